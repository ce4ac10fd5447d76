"""Serving under load: threads, requests that hold their plans, stream bookkeeping, host memory.

Everything here runs on a CPU. The stream ordering is checked as bookkeeping (which events are
recorded and which each stream waits on, per slot) with ``RecordedEvents``; page-locking as the
sizes a ``RecordingRegistrar`` is asked to lock and unlock. The CUDA calls themselves are left to
``scripts/gpu_check.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from adalncache import AdalnCache, BuildError, CheckpointSource, ConfigError, PlanError, PlanNotCachedError, plan_key
from adalncache.devices import (
    CopyStreams,
    HostBuffer,
    StreamSync,
    copy_to_device,
    host_tensor_like,
    pinned_bytes,
)
from adalncache.source.reads import DIRECT_BLOCK, StagingPool
from adalncache.spec import FINAL, LAYOUTS
from adalncache.tiers.host import HostTier
from core_helpers import SPEC, assert_same_state, embed_for, load_reference, make_weights, snapshot, write_checkpoint

# -- CPU stand-ins for the CUDA calls: they record what a GPU would be asked to do --------------


class RecordingRegistrar:
    """A CPU stand-in for the CUDA registrar, recording what would be registered: ``live`` maps address -> bytes."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.live: dict[int, int] = {}
        self.registered: list[int] = []  # sizes, in order
        self.unregistered = 0
        self._lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        if self.fail:
            raise MemoryError(f"cannot page-lock {nbytes} bytes (recording registrar told to fail)")
        with self._lock:
            self.live[address] = nbytes
            self.registered.append(nbytes)

    def unregister(self, address: int) -> None:
        with self._lock:
            del self.live[address]
            self.unregistered += 1


class RecordedEvents:
    """A CPU stand-in that logs what a CUDA backend would do, for tests of the bookkeeping.

    ``current`` names the stream the calling code is "on"; events are numbered in record order;
    ``log`` holds ``("record", stream, event)`` and ``("wait", stream, event)`` tuples.
    """

    active = True

    def __init__(self) -> None:
        self.current: Hashable = "default"
        self.log: list[tuple[str, Hashable, int]] = []
        self._count = 0

    def stream(self) -> Hashable:
        return self.current

    def record(self) -> Any:
        self._count += 1
        self.log.append(("record", self.current, self._count))
        return self._count

    def wait(self, event: Any) -> None:
        self.log.append(("wait", self.current, int(event)))

    def waits(self) -> list[tuple[Hashable, int]]:
        """``(stream, event)`` of every wait so far, in order."""
        return [(stream, event) for kind, stream, event in self.log if kind == "wait"]


EMBED = embed_for(SPEC)
LAYOUT = LAYOUTS["native"]

#: Nine distinct plans of widths 1 to 3 (several share timesteps, in another order or as a prefix).
PLANS = [
    torch.tensor(values, dtype=torch.float32)
    for values in (
        [0.5],
        [0.25, 0.75],
        [0.75, 0.25],
        [0.125],
        [0.9, 0.3, 0.999],
        [1.0],
        [0.25, 0.75, 0.999],
        [0.6, 0.4],
        [0.05],
    )
]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt", make_weights(SPEC, seed=5))


def reference(weights: dict[str, torch.Tensor], plan: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's rows of ``plan``, projected independently (safetensors' loader, F.linear at M)."""
    x = EMBED(plan)
    return [F.linear(x, weights[LAYOUT.weight(layer)], weights[LAYOUT.bias(layer)]) for layer in SPEC.layers()]


def rows_of_slot(cache: AdalnCache, slot: int | torch.Tensor, n: int) -> list[torch.Tensor]:
    return [
        cache.final_rows(slot, n) if layer == FINAL else cache.block_rows(int(layer), slot, n)
        for layer in SPEC.layers()
    ]


def assert_every_resident_row_exact(cache: AdalnCache, weights: dict[str, torch.Tensor]) -> None:
    by_key = {plan_key(p): p for p in PLANS}
    for key in cache.resident_plans:
        plan = by_key[key]
        got = rows_of_slot(cache, cache.lookup(plan), plan.numel())
        for layer, (a, b) in enumerate(zip(got, reference(weights, plan))):
            assert torch.equal(a, b), f"plan {plan.tolist()} layer {layer} differs from F.linear"


# -- threads ----------------------------------------------------------------------------------------


def test_threads_building_looking_up_and_acquiring_keep_the_cache_exact(ckpt: Path) -> None:
    """Four threads, 200 small random requests each, nine plans over six slots: no raw exception,
    the invariants hold, every resident row is exact, and no held slot changes while held."""
    weights = load_reference(ckpt)
    refs = {plan_key(p): reference(weights, p) for p in PLANS}
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=6, host_cache_bytes=1 << 14, progress=False)
    errors: list[BaseException] = []
    refused = [0]
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        try:
            for _ in range(200):
                request = [rng.choice(PLANS) for _ in range(rng.randint(1, 3))]
                kind = rng.choice(("build", "lookup", "acquire", "resolve"))
                try:
                    if kind == "build":
                        cache.build(request, embed=EMBED)
                    elif kind == "lookup":
                        for plan in request:
                            with contextlib.suppress(PlanNotCachedError):
                                cache.lookup(plan)
                    elif kind == "resolve":
                        with contextlib.suppress(PlanNotCachedError):
                            cache.resolve_slots(request)
                    else:
                        with cache.acquire(request, embed=EMBED) as slots:
                            # While held, the slots hold exactly the request's tables, whatever the
                            # other threads build, evict or look up meanwhile.
                            for _ in range(2):
                                for plan, slot in zip(request, slots.tolist()):
                                    got = rows_of_slot(cache, slot, plan.numel())
                                    assert all(torch.equal(a, b) for a, b in zip(got, refs[plan_key(plan)]))
                except PlanError as exc:
                    # The only refusal a valid request can meet: the other threads hold the room.
                    assert "held by requests in flight" in str(exc) and "--max-plans" in str(exc), exc
                    refused[0] += 1
        except BaseException as exc:  # anything else fails the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    cache.check_invariants()
    assert cache.held_slots == {}
    assert_every_resident_row_exact(cache, weights)
    stats = cache.stats
    assert stats.failed_builds == 0 and stats.passes >= 1


# -- requests hold their plans ------------------------------------------------------------------


def test_acquire_yields_one_slot_per_plan_and_no_build_evicts_held_plans(ckpt: Path) -> None:
    weights = load_reference(ckpt)
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=3, progress=False)
    a, b, c, d = PLANS[0], PLANS[1], PLANS[3], PLANS[4]
    with cache.acquire([a, b, a], embed=EMBED) as slots:
        assert slots.device == cache.device and slots.dtype == torch.int64
        assert slots.tolist() == [cache.slot_of(plan_key(a)), cache.slot_of(plan_key(b)), cache.slot_of(plan_key(a))]
        cache.build([c], embed=EMBED)  # the one free slot
        before = snapshot(cache)
        with pytest.raises(PlanError) as info:
            cache.build([d, c], embed=EMBED)  # would have to evict a or b (held): refused
        message = str(info.value)
        assert "2 resident plan(s) are held" in message and "max_plans" in message and "--max-plans" in message
        assert_same_state(before, cache)  # nothing changed, not even the stats
        cache.build([d, a], embed=EMBED)  # c is not held: evicted
        assert plan_key(c) not in cache.resident_plans
        assert cache.held_slots == {slots.tolist()[0]: 1, slots.tolist()[1]: 1}
    assert cache.held_slots == {}
    cache.build([c, d], embed=EMBED)  # b is free to go now
    cache.check_invariants()
    assert_every_resident_row_exact(cache, weights)


def test_hold_counts_add_up_and_release_is_idempotent(ckpt: Path) -> None:
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=2, progress=False)
    first = cache.hold([PLANS[0]], embed=EMBED)
    second = cache.hold([PLANS[0], PLANS[1]], embed=EMBED)
    slot = cache.slot_of(plan_key(PLANS[0]))
    assert cache.held_slots[slot] == 2 and second.report.built == 1 and first.report.built == 1
    first.release()
    first.release()
    assert cache.held_slots[slot] == 1
    with pytest.raises(PlanError, match="held by requests in flight"):
        cache.build([PLANS[3]], embed=EMBED)
    second.release()
    cache.build([PLANS[3]], embed=EMBED)
    cache.check_invariants()


@pytest.mark.parametrize("how", ["invalidate", "checkpoint rewritten"])
def test_a_held_plan_that_leaves_the_map_keeps_its_slot_until_released(ckpt: Path, how: str) -> None:
    """No new lookup finds it, but its slot is neither cleared nor reused while it is held."""
    weights = load_reference(ckpt)
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=2, progress=False)
    plan, other = PLANS[1], PLANS[3]
    held = cache.hold([plan], embed=EMBED)
    slot = held.slot_list[0]
    kept = [t.clone() for t in (cache.plan_lengths[slot], cache.plan_timesteps[slot], cache.block_params[slot])]
    if how == "invalidate":
        cache.invalidate()
    else:
        st = os.stat(ckpt)
        os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        cache.build([other], embed=EMBED)  # re-stats, drops every table: the held one retires
        assert cache.stats.fingerprint_changes == 1
    with pytest.raises(PlanNotCachedError):
        cache.lookup(plan)
    cache.build([plan], embed=EMBED)  # rebuilt into the other slot, beside the retired one
    assert cache.slot_of(plan_key(plan)) != slot
    if how == "checkpoint rewritten":
        with pytest.raises(PlanError, match="old identity"):
            cache.build([PLANS[0], plan], embed=EMBED)  # both slots busy: the retired one is still held
    for now, before in zip((cache.plan_lengths[slot], cache.plan_timesteps[slot], cache.block_params[slot]), kept):
        assert torch.equal(now, before), "a held slot was rewritten"
    assert rows_of_slot(cache, held.slots, plan.numel())[0].equal(reference(weights, plan)[0])
    cache.check_invariants()
    held.release()
    assert cache.held_slots == {} and slot in cache.free_slots
    assert int(cache.plan_lengths[slot]) == 0
    cache.check_invariants()


def test_keys_are_computed_once_and_checked_before_building(ckpt: Path) -> None:
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=4, progress=False)
    plans = PLANS[:3]
    keys = [plan_key(p) for p in plans]
    assert cache.build(plans, embed=EMBED, keys=keys).built == 3
    assert cache.build(plans, embed=EMBED, keys=keys).device_hits == 3
    with pytest.raises(PlanError, match="one key per plan"):
        cache.build(plans, embed=EMBED, keys=keys[:2])
    before = snapshot(cache)
    with pytest.raises(PlanError, match="keys= does not match plans"):
        cache.build([PLANS[3]], embed=EMBED, keys=[(*keys[0][:1], 123)])
    assert_same_state(before, cache)


def test_slot_tensors_are_made_without_a_host_copy_and_kept_per_request(ckpt: Path) -> None:
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=6, progress=False)
    cache.build(PLANS[:5], embed=EMBED)
    index = cache.resolve_slots(PLANS[:1])
    whole = cache.resolve_slots(PLANS[:3])  # slots 0, 1, 2: a view of the preallocated index
    assert whole.untyped_storage().data_ptr() == index.untyped_storage().data_ptr()
    scattered = [PLANS[4], PLANS[0], PLANS[4]]
    first = cache.resolve_slots(scattered)
    assert cache.resolve_slots(scattered) is first  # one tensor per slot list, reused
    assert first.tolist() == [cache.slot_of(plan_key(p)) for p in scattered]
    with cache.acquire(scattered, embed=EMBED) as slots:
        assert slots is first


def test_a_closed_cache_gives_its_host_memory_back_and_refuses_to_build(ckpt: Path) -> None:
    source = CheckpointSource(ckpt, SPEC, in_place=False)  # staging buffers: what close() gives back
    cache = AdalnCache(SPEC, source, max_plans=2, host_cache_bytes=1 << 16, progress=False)
    cache.build([PLANS[0]], embed=EMBED)
    assert source.kept_bytes > 0
    released = cache.close()
    assert released >= source.kept_bytes + (1 << 16) - cache.spec.row_bytes - 64 and source.kept_bytes == 0
    assert cache.host_tier is not None and cache.host_tier.capacity_bytes == 0
    for plans in ([PLANS[0]], [PLANS[1]]):  # a hit or a miss: a closed cache builds nothing
        with pytest.raises(ConfigError, match="closed"):
            cache.build(plans, embed=EMBED)
    cache.lookup(PLANS[0])  # resident plans stay readable
    assert cache.close() == 0
    cache.check_invariants()


# -- stream bookkeeping ---------------------------------------------------------------------------


def test_stream_sync_bookkeeping_per_slot() -> None:
    events = RecordedEvents()
    sync = StreamSync(4, events)
    events.current = "build"
    sync.begin_build()  # nothing to wait for yet
    sync.before_write([0, 1])
    sync.after_write([0, 1], publish=True)  # event 1, after the last write of slots 0 and 1
    sync.end_build()  # event 2
    assert events.waits() == []
    events.current = "reader"
    sync.before_read([1])
    assert events.waits() == [("reader", 1)]
    sync.before_read([2, 3])  # never written: nothing to wait for
    assert events.waits() == [("reader", 1)]
    sync.before_read(None)  # slots the host does not know: after every publish
    assert events.waits() == [("reader", 1)] * 2
    sync.after_read([1])  # event 3: the reader's release of slot 1
    events.current = "other reader"
    sync.after_read(None)  # event 4: a gather whose slot the host does not know
    events.current = "build"
    sync.begin_build()
    assert events.waits()[-1] == ("build", 2)  # after the previous build
    count = len(events.waits())
    sync.before_write([1])  # a rewrite of slot 1 waits for its reads, on every stream, and its last write
    assert set(events.waits()[count:]) == {("build", 1), ("build", 3), ("build", 4)}
    count = len(events.waits())
    sync.before_write([1])  # its own reads were waited for; its last write and unknown reads stay
    assert set(events.waits()[count:]) == {("build", 1), ("build", 4)}


def test_the_cache_records_and_waits_on_the_events_it_should(ckpt: Path) -> None:
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=1, progress=False)
    events = RecordedEvents()
    cache.stream_sync.backend = events
    events.current = "builder"
    cache.build([PLANS[0]], embed=EMBED)
    records = [(stream, event) for kind, stream, event in events.log if kind == "record"]
    assert records == [("builder", 1), ("builder", 2)]  # publish of slot 0, then the build's end
    assert cache.stream_sync.written[0] == 1
    events.current = "forward"
    with cache.acquire([PLANS[0]], embed=EMBED) as slots:
        assert events.waits()[-1] == ("forward", 1)  # the forward's stream waits for the publish
        cache.block_all(slots, 1)  # a gather by slot tensor: recorded as a read of unknown slots
    release_event = events.log[-1][2]
    assert events.log[-1] == ("record", "forward", release_event)
    assert cache.stream_sync.read[0] == {"forward": release_event}
    events.current = "builder"
    cache.build([PLANS[3]], embed=EMBED)  # evicts slot 0: its clearing waits for the forward's reads
    waits = events.waits()
    assert ("builder", release_event) in waits and ("builder", release_event - 1) in waits


def test_copy_streams_are_made_once_per_device_and_reused() -> None:
    made: list[torch.device] = []
    streams = CopyStreams(factory=lambda device: made.append(device) or object())
    one, two = torch.device("cuda", 0), torch.device("cuda", 1)
    first = streams.get(one)
    assert all(streams.get(one) is first for _ in range(5))  # every pass reuses it
    assert streams.get(two) is not first and streams.made == 2 and made == [one, two]


class _Stream:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_copy_that_fails_still_synchronises_before_its_buffer_is_reused() -> None:
    import contextlib

    stream = _Stream()
    tensors = [torch.ones(3), torch.ones(4)]
    calls: list[int] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.numel())
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected: no room for the bias")
        return t.clone()

    no_context: Any = lambda device, s: contextlib.nullcontext()  # noqa: E731
    with pytest.raises(torch.OutOfMemoryError):
        copy_to_device(tensors, torch.device("cuda", 0), stream, copy=copy, context=no_context)
    assert calls == [3, 4] and stream.synchronized == 1  # the weight's queued copy finished first
    out = copy_to_device(tensors, torch.device("cuda", 0), stream, copy=lambda t: t.clone(), context=no_context)
    assert len(out) == 2 and stream.synchronized == 2


# -- host memory -------------------------------------------------------------------------------------


def test_pinned_host_buffers_lock_exactly_their_size_and_give_it_back() -> None:
    registrar = RecordingRegistrar()
    size = 3 * (1 << 20) + 12345  # a power-of-two allocator would lock 4 MiB
    before = pinned_bytes()
    buffer = HostBuffer(size, pin=True, registrar=registrar)
    assert registrar.registered == [size] and list(registrar.live.values()) == [size]
    assert pinned_bytes() == before + size  # the package's own count, which gpu_check reads
    assert buffer.tensor.numel() == size and buffer.tensor.data_ptr() % 4096 == 0
    view = buffer.tensor[10:20]
    assert buffer.release() == size and registrar.live == {} and buffer.release() == 0
    assert pinned_bytes() == before
    view.fill_(1)  # a view outliving the release is still valid (pageable) memory
    collected = HostBuffer(4096, pin=True, registrar=registrar)
    assert pinned_bytes() == before + 4096
    del collected  # collected without release(): unlocked by its finalizer
    assert registrar.live == {} and registrar.unregistered == 2 and pinned_bytes() == before


def test_a_refused_page_lock_raises_and_locks_nothing() -> None:
    registrar = RecordingRegistrar(fail=True)
    with pytest.raises(MemoryError):
        HostBuffer(1 << 20, pin=True, registrar=registrar)
    assert registrar.live == {}


def test_host_tier_arena_is_locked_at_its_exact_capacity_and_released() -> None:
    registrar = RecordingRegistrar()
    spec = SPEC
    capacity = 5 * 1000 * spec.row_bytes // 7
    tier = HostTier(spec, capacity, pin=True, registrar=registrar)
    arena = tier.total_units * tier.unit_bytes
    assert tier.pinned and registrar.registered == [arena] and list(registrar.live.values()) == [arena]
    assert tier.arena.numel() == arena <= capacity
    assert tier.release() == arena
    assert registrar.live == {} and tier.capacity_bytes == 0 and len(tier) == 0 and tier.arena.numel() == 0
    tier.check_invariants()


def test_staging_buffers_request_exact_sizes_and_release_their_locks() -> None:
    registrar = RecordingRegistrar()
    pool = StagingPool(1, pin=True, registrar=registrar)
    nbytes = 496 * (1 << 20) // 1024 + 3  # an odd size: nothing rounds it to a power of two
    view = pool.take(0, "weight", nbytes, 1234)
    want = nbytes + 3 * DIRECT_BLOCK
    assert pool.requested == [want] and registrar.registered == [want]
    assert view.data_ptr() % DIRECT_BLOCK == 1234 % DIRECT_BLOCK
    del view
    again = pool.take(1, "weight", nbytes, 1234)  # the same slot: reused, nothing new locked
    assert pool.requested == [want] and len(registrar.registered) == 1
    del again
    pool.clear()
    assert registrar.live == {} and pool.nbytes == 0


def test_host_copies_of_device_tensors_fit_exactly() -> None:
    registrar = RecordingRegistrar()
    tensor = torch.randn(257, 33)
    copy, buffer = host_tensor_like(tensor, pin=True, registrar=registrar)
    assert torch.equal(copy, tensor) and registrar.registered == [tensor.numel() * 4]
    buffer.release()
    assert registrar.live == {}


# -- interrupts and failures under threads ---------------------------------------------------------


def test_a_failed_build_on_one_thread_leaves_the_others_served(ckpt: Path) -> None:
    """A BuildError on one thread rolls back only its own reservation; a held request keeps reading."""
    from adalncache.testing import FaultInjectingSource

    weights = load_reference(ckpt)
    source = FaultInjectingSource(CheckpointSource(ckpt, SPEC), None)
    cache = AdalnCache(SPEC, source, max_plans=3, progress=False)
    with cache.acquire([PLANS[0]], embed=EMBED) as slots:
        source.arm(1, OSError("disk on fire"))
        failure: list[BaseException] = []

        def build() -> None:
            try:
                cache.build([PLANS[1]], embed=EMBED)
            except BuildError as exc:
                failure.append(exc)

        thread = threading.Thread(target=build)
        thread.start()
        thread.join()
        assert failure and isinstance(failure[0].__cause__, OSError)
        got = rows_of_slot(cache, slots, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, reference(weights, PLANS[0])))
    cache.check_invariants()


# -- autocast -------------------------------------------------------------------------------------------


def test_tables_built_under_autocast_are_the_autocast_projection(tmp_path: Path) -> None:
    """Under CPU autocast to bf16 an fp32 projection computes and returns bf16: the tables hold those
    values (exactly: the fp32 slab holds every bf16 value) and are served back in bf16; tables built
    outside autocast are never served inside it, nor the other way round."""
    spec = SPEC.with_dtype(torch.float32)
    path = write_checkpoint(tmp_path / "fp32", make_weights(spec, seed=2))
    weights = load_reference(path)
    embed = embed_for(spec)
    cache = AdalnCache(spec, CheckpointSource(path, spec), max_plans=4, store=tmp_path / "store", progress=False)
    plan = PLANS[1]
    layer0 = (weights[LAYOUT.weight(0)], weights[LAYOUT.bias(0)])
    cache.build([plan], embed=embed)
    plain = cache.block_rows(0, cache.lookup(plan), 2)
    assert plain.dtype == torch.float32 and torch.equal(plain, F.linear(embed(plan), *layer0))
    plain_binding = cache.binding()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(embed(plan), *layer0)
        assert want.dtype == torch.bfloat16 and not torch.equal(want.float(), plain)
        report = cache.build([plan], embed=embed)
        assert report.built == 1 and cache.stats.variant_changes == 1  # not served the fp32 tables
        got = cache.block_rows(0, cache.lookup(plan), 2)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        assert cache.binding()["environment"]["autocast"] == "bfloat16"
        assert cache.binding() != plain_binding  # store entries of one never hit for the other
        with cache.acquire([plan], embed=embed) as slots:
            shift, scale = cache.final(slots, 2)
            final = F.linear(embed(plan), weights[LAYOUT.weight(FINAL)], weights[LAYOUT.bias(FINAL)])
            assert shift.dtype == torch.bfloat16 and torch.equal(torch.cat([shift, scale], -1), final)
    assert "autocast" not in plain_binding["environment"]
    assert cache.build([plan], embed=embed).store_hits == 1  # outside again: the fp32 entry, not the bf16 one
    assert torch.equal(cache.block_rows(0, cache.lookup(plan), 2), plain)


def test_autocast_the_slab_cannot_hold_exactly_is_refused(ckpt: Path, tmp_path: Path) -> None:
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=2, progress=False)  # a bf16 slab
    before = snapshot(cache)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ConfigError, match="cannot hold exactly"):
        cache.build([PLANS[0]], embed=EMBED)
    assert_same_state(before, cache)
    spec = SPEC.with_dtype(torch.float32)
    path = write_checkpoint(tmp_path / "fp32", make_weights(spec))
    fp32 = AdalnCache(spec, CheckpointSource(path, spec), precision="fp32", progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ConfigError, match="--precision"):
        fp32.build([PLANS[0]], embed=embed_for(spec))


# -- closing under load, and leaks over many cycles ------------------------------------------------


def test_close_while_other_threads_build_and_read(ckpt: Path) -> None:
    """``close()`` in the middle of three threads building, acquiring and reading: every thread sees
    either success or the typed refusal of a closed cache (``ConfigError`` "closed"), never a raw
    exception or wrong rows; the invariants hold, no hold is left, the host memory comes back."""
    weights = load_reference(ckpt)
    refs = {plan_key(p): reference(weights, p) for p in PLANS}
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=6, host_cache_bytes=1 << 14, progress=False)
    errors: list[BaseException] = []
    closed_seen = [0]
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        try:
            for _ in range(150):
                request = [rng.choice(PLANS) for _ in range(rng.randint(1, 3))]
                try:
                    if rng.random() < 0.5:
                        cache.build(request, embed=EMBED)
                    else:
                        with cache.acquire(request, embed=EMBED) as slots:
                            for plan, slot in zip(request, slots.tolist()):
                                got = rows_of_slot(cache, slot, plan.numel())
                                assert all(torch.equal(a, b) for a, b in zip(got, refs[plan_key(plan)]))
                except ConfigError as exc:
                    assert "closed" in str(exc), exc
                    closed_seen[0] += 1
                except PlanError as exc:
                    assert "held by requests in flight" in str(exc), exc
                for plan in request:  # lookups stay typed after the close too
                    with contextlib.suppress(PlanNotCachedError):
                        cache.lookup(plan)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    start.wait()
    while cache.stats.passes < 3 and any(t.is_alive() for t in threads):
        threading.Event().wait(0.005)
    released = cache.close()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert released > 0 and closed_seen[0] > 0
    cache.check_invariants()
    assert cache.held_slots == {}
    assert_every_resident_row_exact(cache, weights)


def _process_counts() -> tuple[int, int, int]:
    """(resident set in bytes, open descriptors, threads) of this process."""
    with open("/proc/self/statm") as handle:
        rss = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd")), threading.active_count()


@pytest.mark.soak
def test_three_hundred_cycles_leak_no_memory_descriptors_or_threads(ckpt: Path, tmp_path: Path) -> None:
    """300 cycles of a whole serving life (a source, a cache with a host tier and a store, builds with
    misses and hits, a held request, a hashing read, close): after a warm-up, the process's resident
    memory stays flat (within 32 MiB), and its open descriptors and threads are exactly as many."""
    store = tmp_path / "store"
    plans = PLANS[:4]
    marks: dict[int, tuple[int, int, int]] = {}
    for cycle in range(300):
        source = CheckpointSource(ckpt, SPEC)
        cache = AdalnCache(SPEC, source, max_plans=3, host_cache_bytes=1 << 15, store=store, progress=False)
        cache.build(plans[:2], embed=EMBED)
        cache.build(plans[2:], embed=EMBED)  # evicts: host tier and store hits on the way back
        with cache.acquire(plans[:2], embed=EMBED) as slots:
            assert slots.numel() == 2
        if cycle % 10 == 0:
            cache.invalidate()
            cache.identify()
        cache.close()
        del cache, source
        if cycle in (49, 299):
            gc.collect()
            marks[cycle] = _process_counts()
    (rss0, fds0, threads0), (rss1, fds1, threads1) = marks[49], marks[299]
    assert fds1 == fds0 and threads1 == threads0, (marks, "descriptors or threads leaked")
    assert rss1 - rss0 < 32 << 20, f"resident memory grew by {(rss1 - rss0) / 2**20:.1f} MiB over 250 cycles"
