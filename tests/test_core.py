"""The core state machine on real safetensors files: three historical scenarios, LRU, errors, exactness.

The three ``test_seed_*`` scenarios are the bookkeeping bugs an early version had: (a) a plan of
the request evicted by its own build under capacity pressure, (b) a failed rebuild left a
half-built plan visible to a retry, (c) a rejected over-wide request disturbed resident plans.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from adalncache import (
    AdalnCache,
    BuildError,
    CheckpointError,
    CheckpointSource,
    ConfigError,
    ModulationSpec,
    PlanError,
    PlanNotCachedError,
    TensorSource,
    plan_key,
)
from adalncache.testing import FaultInjectingSource, inject_faults
from core_helpers import (
    SPEC,
    RewriteBetweenLayers,
    assert_plan_exact,
    assert_same_state,
    embed_for,
    load_reference,
    make_weights,
    rewrite_in_place,
    snapshot,
    write_checkpoint,
)

A = torch.tensor([0.5])
B = torch.tensor([0.25, 0.75])
C = torch.tensor([0.125])
D = torch.tensor([0.9, 0.3, 0.999])


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt", make_weights(SPEC))


def make_cache(path: Path, **kwargs: object) -> AdalnCache:
    kwargs.setdefault("max_plans", 2)
    kwargs.setdefault("max_plan_width", 4)
    return AdalnCache(SPEC, CheckpointSource(path, SPEC), **kwargs)


EMBED = embed_for(SPEC)


# -- the three historical scenarios (a, b, c) ---------------------------------------------------


def test_seed_a_reuse_survives_capacity_pressure(ckpt: Path) -> None:
    cache = make_cache(ckpt)
    cache.build([A, B], embed=EMBED)
    cache.check_invariants()
    report = cache.build([A, C], embed=EMBED)
    cache.check_invariants()
    assert report.device_hits == 1 and report.built == 1 and report.evicted == 1
    weights = load_reference(ckpt)
    assert_plan_exact(cache, weights, "native", EMBED, A)
    assert_plan_exact(cache, weights, "native", EMBED, C)
    with pytest.raises(PlanNotCachedError, match="does not cover"):
        cache.lookup(B)


@pytest.mark.parametrize("damage", ["drop-tensor", "truncate"])
def test_seed_b_failed_rebuild_hides_request_and_retry_succeeds(ckpt: Path, damage: str) -> None:
    cache = make_cache(ckpt)
    cache.build([A], embed=EMBED)
    original = ckpt.read_bytes()
    weights = make_weights(SPEC)
    if damage == "drop-tensor":
        del weights["blocks.1.adaln_proj.linear.weight"]
        save_file(weights, str(ckpt))
    else:
        ckpt.write_bytes(original[: len(original) - 100])
    with pytest.raises(BuildError) as info:
        cache.build([B, C], embed=EMBED)
    assert isinstance(info.value.__cause__, CheckpointError)
    cache.check_invariants()
    for plan in (A, B, C):  # A was built from the old file: it cannot be trusted either
        with pytest.raises(PlanNotCachedError):
            cache.lookup(plan)
    ckpt.write_bytes(original)
    report = cache.build([B, C], embed=EMBED)
    assert report.built == 2 and report.passes == 1
    cache.check_invariants()
    assert cache.free_slots == []  # both slots in use: nothing leaked
    ref = load_reference(ckpt)
    assert_plan_exact(cache, ref, "native", EMBED, B)
    assert_plan_exact(cache, ref, "native", EMBED, C)


def test_seed_b_file_truncated_during_the_pass(ckpt: Path) -> None:
    """The file shrinks after the pass started: the read of a later layer fails, nothing is published."""
    cache = make_cache(ckpt)
    original = ckpt.read_bytes()

    def embed_then_truncate(plan: torch.Tensor) -> torch.Tensor:
        with open(ckpt, "r+b") as f:  # same inode: the pass's open descriptor sees the truncation
            f.truncate(len(original) // 2)
        return EMBED(plan)

    with pytest.raises(BuildError, match=r"truncated|ended"):
        cache.build([A], embed=embed_then_truncate)
    cache.check_invariants()
    with pytest.raises(PlanNotCachedError):
        cache.lookup(A)
    ckpt.write_bytes(original)
    cache.build([A, B], embed=EMBED)
    assert cache.free_slots == []
    assert_plan_exact(cache, load_reference(ckpt), "native", EMBED, A)


def test_seed_c_over_width_request_keeps_resident_plans(ckpt: Path) -> None:
    cache = make_cache(ckpt, max_plan_width=2)
    cache.build([A, B], embed=EMBED)
    before = snapshot(cache)
    with pytest.raises(PlanError, match="--plan-width"):
        cache.build([A, D], embed=EMBED)
    assert_same_state(before, cache)
    cache.check_invariants()
    ref = load_reference(ckpt)
    assert_plan_exact(cache, ref, "native", EMBED, A)
    assert_plan_exact(cache, ref, "native", EMBED, B)


# -- construction and request errors ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"max_plans": 0}, "--max-plans"),
        ({"max_plans": -3}, "--max-plans"),
        ({"max_plan_width": 0}, "--plan-width"),
        ({"precision": "bf16"}, "--precision"),
        ({"host_cache_bytes": -1}, "--host-cache-gb"),
        ({"shard": "rows"}, "--shard"),
    ],
)
def test_bad_construction_names_the_flag(ckpt: Path, kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        make_cache(ckpt, **kwargs)


@pytest.mark.parametrize(
    "plan",
    [
        torch.tensor([float("nan")]),
        torch.tensor([0.5, float("inf")]),
        torch.tensor([], dtype=torch.float32),
        torch.tensor([[0.5]]),
        torch.tensor([0.5], dtype=torch.float64),
        torch.tensor([0.5], dtype=torch.float16),
        torch.tensor([1], dtype=torch.int64),
    ],
    ids=["nan", "inf", "empty", "2d", "float64", "float16", "int"],
)
def test_bad_plans_raise_plan_error_and_change_nothing(ckpt: Path, plan: torch.Tensor) -> None:
    cache = make_cache(ckpt)
    cache.build([A], embed=EMBED)
    before = snapshot(cache)
    with pytest.raises(PlanError):
        cache.build([A, plan], embed=EMBED)
    assert_same_state(before, cache)
    cache.check_invariants()


def test_too_many_plans_names_max_plans(ckpt: Path) -> None:
    cache = make_cache(ckpt)
    cache.build([A, B], embed=EMBED)
    before = snapshot(cache)
    with pytest.raises(PlanError, match="--max-plans"):
        cache.build([A, B, C], embed=EMBED)
    assert_same_state(before, cache)


def test_embed_of_wrong_shape_is_a_build_error(ckpt: Path) -> None:
    cache = make_cache(ckpt)
    with pytest.raises(BuildError, match=r"embed\(plan\) must return"):
        cache.build([A], embed=lambda p: torch.zeros(len(p), 3, dtype=SPEC.dtype))
    cache.check_invariants()
    assert cache.resident_plans == []


# -- LRU ----------------------------------------------------------------------------------------


def test_touched_plan_outlives_untouched(ckpt: Path) -> None:
    cache = make_cache(ckpt)
    cache.build([A], embed=EMBED)
    cache.build([B], embed=EMBED)
    cache.build([A], embed=EMBED)  # touch A: B is now the least recently used
    cache.build([C], embed=EMBED)
    cache.check_invariants()
    assert A in cache and C in cache and B not in cache


def test_alternating_schedules_that_fit_do_no_more_passes(ckpt: Path) -> None:
    cache = make_cache(ckpt, max_plans=4)
    first, second = [A, B], [C, D]
    cache.build(first, embed=EMBED)
    cache.build(second, embed=EMBED)
    passes = cache.stats.passes
    for _ in range(3):
        assert cache.build(first, embed=EMBED).passes == 0
        assert cache.build(second, embed=EMBED).passes == 0
    assert cache.stats.passes == passes
    cache.check_invariants()


def test_repeated_plan_gets_one_slot(ckpt: Path) -> None:
    cache = make_cache(ckpt)
    report = cache.build([A, A.clone(), A], embed=EMBED)
    assert report.plans == 1 and report.built == 1
    assert len(cache) == 1 and len(cache.free_slots) == 1
    slots = cache.resolve_slots([A, A])
    assert slots.tolist() == [int(cache.lookup(A))] * 2


def test_slab_pointers_never_move_and_stay_out_of_state_dict(ckpt: Path) -> None:
    cache = make_cache(ckpt, max_plans=3)
    pointers = [t.data_ptr() for t in cache.slab_tensors()]
    for request in ([A, B], [C], [D, A], [B, C, D]):
        cache.build(request, embed=EMBED)
    cache.invalidate()
    cache.build([A], embed=EMBED)
    assert [t.data_ptr() for t in cache.slab_tensors()] == pointers
    holder = torch.nn.Linear(2, 2)
    holder.adaln_cache = cache  # a plain attribute, as the integration keeps it
    slab = {t.data_ptr() for t in cache.slab_tensors()}
    assert not any(t.data_ptr() in slab for t in holder.state_dict().values())


def test_plan_key_is_exact_bits_in_order() -> None:
    a = torch.tensor([0.1, 0.2])
    assert plan_key(a) == plan_key(a.clone())
    assert plan_key(a) != plan_key(a.flip(0))
    assert plan_key(torch.tensor([0.0])) != plan_key(torch.tensor([-0.0]))
    nudged = torch.nextafter(a, torch.tensor(1.0))
    assert plan_key(a) != plan_key(nudged)


# -- exactness across dtypes, layouts and checkpoint shapes --------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["native", "diffusers"])
@pytest.mark.parametrize("shards", [1, 3])
def test_every_row_equals_independent_projection(tmp_path: Path, dtype: torch.dtype, layout: str, shards: int) -> None:
    spec = SPEC.with_dtype(dtype)
    path = write_checkpoint(tmp_path / "c", make_weights(spec, layout), shards=shards)
    source = CheckpointSource(path, spec)
    assert source.layout.name == layout
    embed = embed_for(spec)
    cache = AdalnCache(spec, source, max_plans=4, max_plan_width=4)
    plans = [A, B, D, torch.tensor([0.7, 0.1, 0.999, 1.0])]
    cache.build(plans, embed=embed)
    cache.check_invariants()
    ref = load_reference(path)
    for plan in plans:
        assert_plan_exact(cache, ref, layout, embed, plan)
        # block()/final() are the view/chunk of the same rows, as the model's forward makes them.
        slot = cache.lookup(plan)
        n = plan.numel()
        lay_w = ref[source.layout.weight(0)]
        y = torch.nn.functional.linear(embed(plan), lay_w, ref[source.layout.bias(0)])
        for got, want in zip(cache.block(0, slot, n), y.view(-1, 6 * spec.hidden_size).chunk(6, -1)):
            assert torch.equal(got, want)
        for got_l, layer in zip(cache.block_all(slot, n), range(spec.num_layers)):
            for got, want in zip(got_l, cache.block(layer, int(slot), n)):
                assert torch.equal(got, want)


def test_fp32_precision_mode_projects_in_fp32(ckpt: Path) -> None:
    cache = make_cache(ckpt, precision="fp32")
    cache.build([B], embed=lambda p: EMBED(p).float())
    ref = load_reference(ckpt)
    x = EMBED(B).float()
    for layer in range(SPEC.num_layers):
        w = ref[f"blocks.{layer}.adaln_proj.linear.weight"].float()
        b = ref[f"blocks.{layer}.adaln_proj.linear.bias"].float()
        want = torch.nn.functional.linear(x, w, b).to(SPEC.dtype)
        assert torch.equal(cache.block_rows(layer, cache.lookup(B), 2), want)


def test_tensor_source_uses_tensors_as_they_are(tmp_path: Path) -> None:
    weights = make_weights(SPEC, "diffusers")
    source = TensorSource(weights, SPEC)
    assert source.tensors["norm_out.linear.weight"].data_ptr() == weights["norm_out.linear.weight"].data_ptr()
    cache = AdalnCache(SPEC, source, max_plans=2)
    cache.build([B], embed=EMBED)
    assert_plan_exact(cache, weights, "diffusers", EMBED, B)
    weights["transformer_blocks.0.adaln_proj.linear.weight"].mul_(2)  # an in-place edit is noticed
    # ... by the next build that reads the source: a request whose plans are all resident does not
    # re-check the source (the hit path), one with something to build does, first.
    assert cache.build([B], embed=EMBED).device_hits == 1 and cache.stats.fingerprint_changes == 0
    report = cache.build([B, C], embed=EMBED)
    assert report.built == 2 and cache.stats.fingerprint_changes == 1
    assert_plan_exact(cache, weights, "diffusers", EMBED, B)
    assert_plan_exact(cache, weights, "diffusers", EMBED, C)


# -- faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fail_at", [0, 1, 2, "final"])
def test_fault_during_pass(ckpt: Path, fail_at: object) -> None:
    inner = CheckpointSource(ckpt, SPEC)
    source = FaultInjectingSource(inner, None)
    cache = AdalnCache(SPEC, source, max_plans=3)
    cache.build([A, B], embed=EMBED)
    cache.build([A], embed=EMBED)  # touch A: B is the least recently used
    before_a = cache.rows_of(plan_key(A))
    source.arm(fail_at, OSError("disk on fire"))
    with pytest.raises(BuildError, match=f"layer {fail_at}") as info:
        cache.build([C, D], embed=EMBED)  # needs one eviction (3 slots): B goes, A stays
    assert isinstance(info.value.__cause__, OSError)
    cache.check_invariants()
    for plan in (C, D, B):
        with pytest.raises(PlanNotCachedError):
            cache.lookup(plan)
    assert torch.equal(cache.rows_of(plan_key(A)).block, before_a.block)
    assert len(cache.free_slots) == 2  # C's and D's reserved slots came back
    cache.build([C, D], embed=EMBED)
    cache.check_invariants()
    ref = load_reference(ckpt)
    for plan in (A, C, D):
        assert_plan_exact(cache, ref, "native", EMBED, plan)


def test_memory_error_from_embed_is_a_clean_build_error(ckpt: Path) -> None:
    cache = make_cache(ckpt, max_plans=3)
    cache.build([A], embed=EMBED)
    with inject_faults(cache, "embed", MemoryError), pytest.raises(BuildError) as info:
        cache.build([B, C], embed=EMBED)
    assert isinstance(info.value.__cause__, MemoryError)
    cache.check_invariants()
    assert cache.resident_plans == [plan_key(A)] and len(cache.free_slots) == 2


@pytest.mark.parametrize("site", ["embed", "project", "publish", "host_read", 1])
def test_interrupt_during_a_build_is_rolled_back_and_propagates_as_itself(ckpt: Path, site: object) -> None:
    """Ctrl-C is the user's: the same rollback as any failure, then the KeyboardInterrupt itself."""
    source = FaultInjectingSource(CheckpointSource(ckpt, SPEC), None)
    cache = AdalnCache(SPEC, source, max_plans=3, host_cache_bytes=1 << 20, progress=False)
    cache.build([A], embed=EMBED)
    failed = cache.stats.failed_builds
    if isinstance(site, int):
        source.arm(site, KeyboardInterrupt)
        context: Any = contextlib.nullcontext()
    else:
        context = inject_faults(cache, site, KeyboardInterrupt)
    with context, pytest.raises(KeyboardInterrupt) as info:
        cache.build([B, C], embed=EMBED)
    assert type(info.value) is KeyboardInterrupt  # not wrapped
    cache.check_invariants()
    assert cache.resident_plans == [plan_key(A)] and len(cache.free_slots) == 2
    assert cache.stats.failed_builds == failed + 1
    for plan in (B, C):
        assert plan not in cache
    source.disarm()
    cache.build([B, C], embed=EMBED)  # a retry rebuilds
    ref = load_reference(ckpt)
    for plan in (A, B, C):
        assert_plan_exact(cache, ref, "native", EMBED, plan)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("site", ["embed", "project", "publish", "host_read", "host_write", 1])
def test_a_cache_is_freed_by_reference_counting_alone(
    ckpt: Path, site: object, exc: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    """No part of a cache, and no failed or interrupted build, keeps it in a reference cycle: it goes with its
    last reference, garbage collector off (a cache of a process group kept alive keeps the group's threads).
    Warnings are not captured here: a handler that keeps log records keeps the exceptions they name."""
    gc.collect()
    gc.disable()
    try:
        caplog.set_level(logging.CRITICAL, logger="adalncache")
        source = FaultInjectingSource(CheckpointSource(ckpt, SPEC))
        cache = AdalnCache(SPEC, source, max_plans=3, host_cache_bytes=1 << 20, progress=False)
        with cache.acquire([A], embed=EMBED) as slots:
            cache.block_all(slots[0], 1)
        cache.invalidate()
        source.arm(site if isinstance(site, int) else None, exc)
        context = contextlib.nullcontext() if isinstance(site, int) else inject_faults(cache, str(site), exc)
        with context, contextlib.suppress(BaseException):
            cache.build([A, B], embed=EMBED)
        freed = weakref.ref(cache)
        del cache
        assert freed() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("point", ["project", "publish"])
def test_fault_in_projection_or_publish(ckpt: Path, point: str) -> None:
    cache = make_cache(ckpt, max_plans=3)
    cache.build([A], embed=EMBED)
    with inject_faults(cache, point), pytest.raises(BuildError):
        cache.build([B], embed=EMBED)
    cache.check_invariants()
    assert B not in cache and A in cache
    cache.build([B], embed=EMBED)
    assert_plan_exact(cache, load_reference(ckpt), "native", EMBED, B)


# -- rows served are the projection of the bytes on disk ------------------------------------------


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["plain", "mtime-put-back"])
def test_a_checkpoint_rewritten_during_a_pass_publishes_nothing(ckpt: Path, keep_mtime: bool) -> None:
    """A trainer saves over the checkpoint while a pass is between layers: the early layers came
    from the old bytes, the later ones from the new. Nothing of that is published: a BuildError
    names the file, and a retry projects the new bytes."""
    source = RewriteBetweenLayers(CheckpointSource(ckpt, SPEC))
    cache = AdalnCache(SPEC, source, max_plans=3, max_plan_width=2, progress=False)
    cache.build([A], embed=EMBED)
    new = make_weights(SPEC, seed=7)
    source.arm(1, lambda: rewrite_in_place(ckpt, new, keep_mtime=keep_mtime))
    with pytest.raises(BuildError, match=re.escape(str(ckpt))) as info:
        cache.build([B, C], embed=EMBED)
    assert source.fired == 1 and isinstance(info.value.__cause__, CheckpointError)
    assert info.value.failed_at == "checkpoint"
    for plan in (B, C):
        with pytest.raises(PlanNotCachedError):
            cache.lookup(plan)
    cache.check_invariants()
    report = cache.build([B, C], embed=EMBED)  # a retry reads the new bytes (and drops A, read from the old)
    assert report.built == 2 and cache.stats.fingerprint_changes == 1 and A not in cache
    cache.build([A, B, C], embed=EMBED)
    for plan in (A, B, C):
        assert_plan_exact(cache, load_reference(ckpt), "native", EMBED, plan)
    cache.check_invariants()


def test_a_build_from_inside_embed_is_refused_and_leaks_no_slot(ckpt: Path) -> None:
    """``build`` of the same plan from inside ``embed`` (the build lock is re-entrant on the calling
    thread): refused with PlanError, so the outer build fails cleanly and no slot leaks."""
    cache = make_cache(ckpt, max_plans=3)
    inner: list[BaseException] = []

    def reentrant(plan: torch.Tensor) -> torch.Tensor:
        try:
            cache.build([B], embed=EMBED)
        except PlanError as exc:
            inner.append(exc)
            raise
        return EMBED(plan)

    with pytest.raises(BuildError) as info:
        cache.build([B], embed=reentrant)
    assert isinstance(info.value.__cause__, PlanError) and "inside" in str(info.value.__cause__)
    assert len(inner) == 1
    cache.check_invariants()
    assert cache.free_slots == [0, 1, 2] and B not in cache
    cache.invalidate()
    cache.check_invariants()
    report = cache.build([A, B, C], embed=EMBED)  # every slot is usable: nothing leaked
    assert report.built == 3
    for plan in (A, B, C):
        assert_plan_exact(cache, load_reference(ckpt), "native", EMBED, plan)


def test_an_embed_that_changes_its_plan_in_place_is_refused(ckpt: Path) -> None:
    """``embed`` gets a copy of the plan; one that changes that copy in place would file rows of other
    timesteps under the plan's key (and, before, desynchronised plan_timesteps from the slot map)."""
    cache = make_cache(ckpt, max_plans=3)
    cache.build([A], embed=EMBED)
    plan = B.clone()

    def mutating(given: torch.Tensor) -> torch.Tensor:
        given.mul_(0.5)
        return EMBED(given)

    with pytest.raises(BuildError) as info:
        cache.build([plan], embed=mutating)
    assert isinstance(info.value.__cause__, PlanError) and "in place" in str(info.value.__cause__)
    assert torch.equal(plan, B), "the caller's plan tensor was changed"
    cache.check_invariants()
    assert plan not in cache and cache.resident_plans == [plan_key(A)]
    cache.build([plan], embed=EMBED)
    cache.check_invariants()
    assert_plan_exact(cache, load_reference(ckpt), "native", EMBED, B)


# -- the checkpoint source ----------------------------------------------------------------------


def test_a_directory_reads_what_diffusers_would_load(tmp_path: Path) -> None:
    """One file set per directory: the index, else diffusers' single weights file, else every
    ``*.safetensors``; an unrelated file beside diffusers' weights (other tensor names) is not read,
    and an index may be passed by its own path."""
    directory = tmp_path / "transformer"
    weights = make_weights(SPEC, layout="diffusers")
    write_checkpoint(directory, weights, name="diffusion_pytorch_model")
    save_file({"lora.down.weight": torch.zeros(4, 4)}, str(directory / "pytorch_lora_weights.safetensors"))
    source = CheckpointSource(directory, SPEC)
    assert source.files == [directory / "diffusion_pytorch_model.safetensors"]
    sharded = write_checkpoint(tmp_path / "sharded", weights, shards=2, name="diffusion_pytorch_model")
    index = sharded / "diffusion_pytorch_model.safetensors.index.json"
    by_index = CheckpointSource(index, SPEC)
    assert by_index.index == index and by_index.files == CheckpointSource(sharded, SPEC).files
    assert len(by_index.files) == 2


def test_source_names_every_missing_and_misshapen_tensor(tmp_path: Path) -> None:
    weights = make_weights(SPEC)
    del weights["blocks.0.adaln_proj.linear.bias"]
    weights["blocks.2.adaln_proj.linear.weight"] = weights["blocks.2.adaln_proj.linear.weight"][:, :5].contiguous()
    weights["final_layer.adaln_proj.linear.bias"] = weights["final_layer.adaln_proj.linear.bias"].float()
    path = write_checkpoint(tmp_path, weights)
    with pytest.raises(CheckpointError) as info:
        CheckpointSource(path, SPEC)
    msg = str(info.value)
    assert "blocks.0.adaln_proj.linear.bias: missing" in msg
    assert "blocks.2.adaln_proj.linear.weight: shape" in msg
    assert "final_layer.adaln_proj.linear.bias: dtype float32" in msg
    assert str(path) in msg


def test_source_rejects_non_safetensors_and_outside_index(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"definitely not a safetensors file at all")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        CheckpointSource(bad, SPEC)
    d = tmp_path / "sharded"
    write_checkpoint(d, make_weights(SPEC), shards=2)
    index = d / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("model-00001", "../model-00001"))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        CheckpointSource(d, SPEC)


def test_source_list_of_files_and_fingerprint_restat(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "s", make_weights(SPEC), shards=2)
    files = sorted(d.glob("*.safetensors"))
    source = CheckpointSource(files, SPEC)
    fp = source.fingerprint
    assert not source.refresh() and source.fingerprint == fp
    os.utime(files[0], ns=(1, 1))
    assert source.refresh() and source.fingerprint != fp
    before = source.bytes_read
    list(source.stream(SPEC.layers()))
    assert source.bytes_read - before == SPEC.projection_bytes


def test_stream_keeps_file_alignment_and_bounded_read_ahead(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, make_weights(SPEC.with_dtype(torch.float32)))
    spec = SPEC.with_dtype(torch.float32)
    source = CheckpointSource(path, spec)
    for lw in source.stream(spec.layers(), read_ahead=1):
        _, entry = source.entry(source.layout.weight(lw.layer))
        assert lw.weight.data_ptr() % 64 == entry.begin % 64


def test_spec_geometry() -> None:
    spec = ModulationSpec.minimax_h3()
    assert (spec.block_width, spec.final_width) == (96768, 10752)
    assert spec.row_bytes == (50 * 96768 + 10752) * 2
    assert 24.2 <= spec.projection_bytes / 2**30 < 24.3  # 13.0B parameters in bf16
    with pytest.raises(ConfigError, match="num_layers"):
        ModulationSpec(num_layers=0, hidden_size=8, time_embed_dim=8)


def test_store_with_an_in_memory_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--store"):
        AdalnCache(SPEC, TensorSource(make_weights(SPEC), SPEC), store=tmp_path / "store")


def test_row_accessors_reject_out_of_range_widths_and_layers(ckpt: Path) -> None:
    cache = make_cache(ckpt, max_plan_width=2)
    cache.build([B], embed=EMBED)
    slot = cache.lookup(B)
    with pytest.raises(PlanError, match="--plan-width"):
        cache.block(0, slot, 3)
    with pytest.raises(PlanError, match="--plan-width"):
        cache.final(slot, 0)
    with pytest.raises(PlanError, match=r"layer must be in 0\.\.2"):
        cache.block(SPEC.num_layers, slot, 2)
