"""Persistent store: cross-process hits, binding misses, corruption, SIGKILLed writers, concurrent fillers."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adalncache import AdalnCache, CheckpointSource, ConfigError, Store, plan_key
from adalncache.cli import main
from adalncache.offline import verify_store
from adalncache.slab import PlanRows
from adalncache.source.files import write_safetensors
from adalncache.testing import inject_faults
from adalncache.tiers.store import binding_hash
from tiers_support import plan, projection_dict, run_on_private_tmpfs, simple_embed, small_spec

TESTS = Path(__file__).resolve().parent
PLANS = [plan(0.9, 0.8), plan(0.5), plan(0.3, 0.2, 0.1)]


def _checkpoint(tmp_path: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    spec = small_spec(dtype)
    return write_safetensors(projection_dict(spec, seed), tmp_path / f"ckpt-{seed}-{dtype}.safetensors")


def _cache(ckpt: Path, store: Path | Store, *, dtype: torch.dtype = torch.bfloat16, **kw) -> AdalnCache:
    spec = small_spec(dtype)
    return AdalnCache(spec, CheckpointSource(ckpt, spec), max_plans=4, max_plan_width=4, store=store, **kw)


def _equal(a: PlanRows, b: PlanRows) -> bool:
    return torch.equal(a.block.cpu(), b.block.cpu()) and torch.equal(a.final.cpu(), b.final.cpu())


_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    from safetensors.torch import save_file
    from tiers_support import plan, simple_embed, small_spec
    from adalncache import AdalnCache, CheckpointSource, plan_key
    spec = small_spec()
    cache = AdalnCache(spec, CheckpointSource({ckpt!r}, spec), max_plans=8, max_plan_width=4, store={store!r})
    plans = [plan(*p) for p in {plans!r}]
    report = cache.build(plans, embed=simple_embed(spec))
    out = {{}}
    for i, p in enumerate(plans):
        rows = cache.rows_of(plan_key(p))
        out[f"block{{i}}"] = rows.block.contiguous()
        out[f"final{{i}}"] = rows.final.contiguous()
    save_file(out, {rows_out!r})
    print(json.dumps(report.as_dict()))
    """
)


def _child(tmp_path: Path, ckpt: Path, store: Path, plans: list[list[float]], name: str) -> subprocess.Popen:
    rows_out = str(tmp_path / f"{name}.safetensors")
    code = _CHILD.format(tests=str(TESTS), ckpt=str(ckpt), store=str(store), plans=plans, rows_out=rows_out)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_second_process_gets_store_hits_and_no_pass(tmp_path: Path) -> None:
    ckpt, store = _checkpoint(tmp_path), tmp_path / "store"
    first = _cache(ckpt, store)
    report = first.build(PLANS, embed=simple_embed(first.spec))
    assert report.built == 3 and report.passes == 1
    assert len(first.store.entries()) == 3
    proc = _child(tmp_path, ckpt, store, [p.tolist() for p in PLANS], "second")
    child = _finish(proc)
    assert child["store_hits"] == 3 and child["passes"] == 0 and child["built"] == 0 and child["bytes_read"] == 0
    rows = load_file(str(tmp_path / "second.safetensors"))
    for i, p in enumerate(PLANS):
        mine = first.rows_of(plan_key(p))
        assert torch.equal(rows[f"block{i}"], mine.block) and torch.equal(rows[f"final{i}"], mine.final)


def test_changed_binding_is_a_miss(tmp_path: Path) -> None:
    ckpt, store = _checkpoint(tmp_path), tmp_path / "store"
    base = _cache(ckpt, store)
    embed = simple_embed(base.spec)
    base.build(PLANS, embed=embed)
    assert _cache(ckpt, store).build(PLANS, embed=embed).store_hits == 3  # control: same binding hits

    # precision
    report = _cache(ckpt, store, precision="fp32").build(PLANS, embed=embed)
    assert report.store_hits == 0 and report.passes == 1

    # numeric environment: a TF32 / matmul-precision switch changes the binding even on CPU
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        report = _cache(ckpt, store).build(PLANS, embed=embed)
        assert report.store_hits == 0 and report.passes == 1
    finally:
        torch.set_float32_matmul_precision(previous)

    # dtype: same everything else, spec dtype changed in the binding -> nothing found
    binding = dict(base.binding())
    assert Store(store).get_many(binding, [plan_key(p) for p in PLANS], base.spec).keys() == {
        plan_key(p) for p in PLANS
    }
    other = small_spec(torch.float16)
    binding_fp16 = {**binding, "spec": other.describe()}
    assert Store(store).get_many(binding_fp16, [plan_key(p) for p in PLANS], other) == {}
    ckpt16 = _checkpoint(tmp_path, dtype=torch.float16)
    report = _cache(ckpt16, store, dtype=torch.float16).build(PLANS, embed=simple_embed(small_spec(torch.float16)))
    assert report.store_hits == 0 and report.passes == 1

    # fingerprint: the checkpoint is rewritten with other weights (same path)
    write_safetensors(projection_dict(small_spec(), seed=7), ckpt)
    changed = _cache(ckpt, store)
    report = changed.build(PLANS, embed=embed)
    assert report.store_hits == 0 and report.passes == 1
    assert not _equal(changed.rows_of(plan_key(PLANS[0])), base.rows_of(plan_key(PLANS[0])))
    # ... and a cache that was running when the file changed misses too (re-stat before lookup)
    base.invalidate()
    report = base.build(PLANS, embed=embed)
    assert report.store_hits == 3  # entries written under the new fingerprint by `changed`
    assert _equal(base.rows_of(plan_key(PLANS[0])), changed.rows_of(plan_key(PLANS[0])))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_corrupt_entry_is_detected_moved_aside_and_rebuilt(tmp_path: Path, damage: str) -> None:
    ckpt, store = _checkpoint(tmp_path), tmp_path / "store"
    writer = _cache(ckpt, store)
    embed = simple_embed(writer.spec)
    writer.build(PLANS, embed=embed)
    victim = next(e for e in writer.store.entries() if e.size > 0)
    data = bytearray(victim.path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 7]
    else:
        data[20] ^= 0x20  # inside the JSON header
    victim.path.write_bytes(bytes(data))

    reader = _cache(ckpt, store)
    report = reader.build(PLANS, embed=embed)
    assert report.store_hits == 2 and report.built == 1 and report.passes == 1
    assert reader.stats.store_corrupt == 1 and reader.store.corrupt_moved == 1
    assert len(list((store / "corrupt").iterdir())) == 1
    for p in PLANS:
        assert _equal(reader.rows_of(plan_key(p)), writer.rows_of(plan_key(p)))
    # rebuilt and rewritten: a third process-like cache hits all three
    assert _cache(ckpt, store).build(PLANS, embed=embed).store_hits == 3
    assert Store(store).health()["corrupt"] == []


def test_store_write_failure_is_counted_and_leaves_nothing(tmp_path: Path) -> None:
    ckpt, store = _checkpoint(tmp_path), tmp_path / "store"
    cache = _cache(ckpt, store)
    with inject_faults(cache, "store_write"):
        report = cache.build(PLANS, embed=simple_embed(cache.spec))
    assert report.tier_write_failures == 1 and report.built == 3
    assert cache.store.entries() == [] and cache.store.health()["temp_files"] == 0
    cache.check_invariants()


def test_one_failing_store_entry_does_not_keep_the_others_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, store = _checkpoint(tmp_path), tmp_path / "store"
    cache = _cache(ckpt, store)
    victim = plan_key(PLANS[1])
    put = Store.put

    def flaky_put(self: Store, binding: object, key: tuple[int, ...], rows: PlanRows) -> object:
        if key == victim:
            raise OSError(28, "No space left on device")
        return put(self, binding, key, rows)

    monkeypatch.setattr(Store, "put", flaky_put)
    report = cache.build(PLANS, embed=simple_embed(cache.spec))
    assert report.tier_write_failures == 1 and cache.stats.tier_write_failures == 1 and report.built == 3
    stored = {item.key for item in Store(store).iter_entries() if not isinstance(item, tuple)}
    assert stored == {plan_key(p) for p in PLANS} - {victim}
    cache.check_invariants()


def test_prune_is_lru_by_explicit_recency(tmp_path: Path) -> None:
    ckpt, store_dir = _checkpoint(tmp_path), tmp_path / "store"
    cache = _cache(ckpt, store_dir)
    cache.build(PLANS, embed=simple_embed(cache.spec))
    store = Store(store_dir)
    binding = cache.binding()
    bhash = binding_hash(binding)
    paths = {plan_key(p): store._entry_path(bhash, plan_key(p)) for p in PLANS}
    for age, p in enumerate(PLANS):  # oldest first: PLANS[0]
        os.utime(paths[plan_key(p)], (1_000_000 + age, 1_000_000 + age))
    assert store.get_many(binding, [plan_key(PLANS[0])], cache.spec)  # a hit makes PLANS[0] the newest
    sizes = {k: p.stat().st_size for k, p in paths.items()}
    keep = sizes[plan_key(PLANS[0])] + sizes[plan_key(PLANS[2])]
    assert store.prune(keep) == 1
    assert not paths[plan_key(PLANS[1])].exists()
    assert paths[plan_key(PLANS[0])].exists() and paths[plan_key(PLANS[2])].exists()
    assert store.total_bytes <= keep
    assert store.prune(0) == 2 and store.entries() == []


def test_max_bytes_bounds_the_store_on_write(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    probe = _cache(ckpt, tmp_path / "probe")
    probe.build([plan(0.45)], embed=simple_embed(probe.spec))
    one = probe.store.entries()[0].size
    bounded = Store(tmp_path / "store", max_bytes=2 * one + 10)
    cache = _cache(ckpt, bounded)
    cache.build([plan(0.5), plan(0.6), plan(0.7)], embed=simple_embed(cache.spec))
    assert bounded.total_bytes <= 2 * one + 10 and len(bounded.entries()) == 2


def test_orphaned_temp_files_are_swept_live_ones_kept(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    host = store._host
    entries = tmp_path / "store" / "entries" / "abc"
    entries.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = entries / f".tmp-{host}-{dead.pid}-x-y.entry"
    live = entries / f".tmp-{host}-{os.getpid()}-x-y.entry"
    foreign_old = entries / ".tmp-otherhost-1-x-y.entry"
    for path in (orphan, live, foreign_old):
        path.write_bytes(b"partial")
    os.utime(foreign_old, (0, 0))
    Store(tmp_path / "store")
    assert not orphan.exists() and not foreign_old.exists() and live.exists()


# -- SIGKILL at random moments --------------------------------------------------------------------


def _expected_rows(spec, key) -> PlanRows:
    """Deterministic rows for a key, big enough (~1 MiB) that a kill often lands mid-write."""
    g = torch.Generator().manual_seed(sum(key) & 0x7FFFFFFF)
    n = len(key)
    block = torch.randn(n, spec.num_layers, spec.block_width, generator=g).to(spec.dtype)
    final = torch.randn(n, spec.final_width, generator=g).to(spec.dtype)
    return PlanRows(torch.zeros(n), block, final)


def _kill_writer(root: str, binding: dict, keys: list, rows: list) -> None:  # runs in a forked child
    store = Store(root)
    i = 0
    while True:  # killed by the parent
        store.put(binding, keys[i % len(keys)], rows[i % len(keys)])
        i += 1


def test_writer_killed_at_random_moments_never_leaves_a_served_bad_entry(tmp_path: Path) -> None:
    spec = small_spec(layers=16, hidden=512, k=16)  # ~0.3 MiB per timestep row
    root = tmp_path / "store"
    binding = {"fingerprint": "kill-test", "spec": spec.describe()}
    keys = [plan_key(plan(0.1 * i + 0.01, 0.5)) for i in range(8)]
    rows = [_expected_rows(spec, k) for k in keys]
    ctx = multiprocessing.get_context("fork")  # fork: the child needs no import time, only Store.put
    rng = random.Random(1234)
    kills = swept = 0
    deadline = time.monotonic() + 60
    while kills < 24 and time.monotonic() < deadline:
        proc = ctx.Process(target=_kill_writer, args=(str(root), binding, keys, rows), daemon=True)
        proc.start()
        time.sleep(rng.uniform(0.0, 0.06))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        kills += 1
        store = Store(root)  # sweeps the dead writer's temp file
        swept += store.swept_temp
        found = store.get_many(binding, keys, spec)
        assert store.corrupt_moved == 0
        for key, got in found.items():
            want = rows[keys.index(key)]
            assert torch.equal(got.block, want.block) and torch.equal(got.final, want.final)
    assert kills >= 20
    assert swept >= 1, "no kill landed inside a write: the test did not exercise a torn write"
    store = Store(root)
    assert store.health()["temp_files"] == 0
    assert store.health()["corrupt"] == []
    assert len(store.entries()) >= 1  # some writes completed, so the test exercised real entries


# -- two processes filling one store at once ------------------------------------------------------


def test_two_processes_fill_one_store_concurrently(tmp_path: Path) -> None:
    ckpt, store = _checkpoint(tmp_path), tmp_path / "store"
    a = [[0.9, 0.8], [0.5], [0.4, 0.3], [0.25], [0.2, 0.1]]
    b = [[0.5], [0.25], [0.95, 0.85, 0.75], [0.6], [0.2, 0.1]]
    procs = [_child(tmp_path, ckpt, store, a, "a"), _child(tmp_path, ckpt, store, b, "b")]
    reports = [_finish(p) for p in procs]
    assert all(r["built"] + r["store_hits"] == 5 for r in reports)
    reference = AdalnCache(small_spec(), CheckpointSource(ckpt, small_spec()), max_plans=8, max_plan_width=4)
    reference.hash_passes = True  # no store of its own: its pass learns the digest the shared store is keyed by
    everything = [plan(*p) for p in {tuple(x): None for x in a + b}]
    reference.build(everything, embed=simple_embed(reference.spec))
    shared = Store(store)
    found = shared.get_many(reference.binding(), [plan_key(p) for p in everything], reference.spec)
    assert len(found) == len(everything) and shared.corrupt_moved == 0
    for p in everything:
        assert _equal(found[plan_key(p)], reference.rows_of(plan_key(p)))
    for name, plans in (("a", a), ("b", b)):
        rows = load_file(str(tmp_path / f"{name}.safetensors"))
        for i, p in enumerate(plans):
            ref = reference.rows_of(plan_key(plan(*p)))
            assert torch.equal(rows[f"block{i}"], ref.block) and torch.equal(rows[f"final{i}"], ref.final)
    assert shared.health() == {"ok": len(everything), "corrupt": [], "temp_files": 0, "moved_aside": 0}


def test_store_refuses_a_non_empty_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--store"):
        Store(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    Store(tmp_path / "fresh")  # a new directory is created
    Store(tmp_path / "fresh")  # and reopened
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(ConfigError, match="--store"):
        Store(file)


def _open_store_after_barrier(path: str, barrier: object) -> None:
    barrier.wait()
    Store(path)


def test_processes_creating_one_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    """Subdirectories and a temp marker appear before STORE: that is a store being born, not a foreign dir."""
    ctx = multiprocessing.get_context("fork")
    for attempt in range(10):
        path = str(tmp_path / f"s{attempt}")
        barrier = ctx.Barrier(3)
        procs = [ctx.Process(target=_open_store_after_barrier, args=(path, barrier)) for _ in range(3)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=60)
        assert [proc.exitcode for proc in procs] == [0, 0, 0]


# -- temporary files are never entries -------------------------------------------------------------


def test_a_live_writers_temp_file_is_never_an_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A writer halfway through an entry (its temp file, named for this live process): not an entry for
    ``entries()``, ``health()``/``inspect``, ``verify`` or ``prune``, which leaves it to its writer."""
    ckpt, store_dir = _checkpoint(tmp_path), tmp_path / "store"
    cache = _cache(ckpt, store_dir)
    embed = simple_embed(cache.spec)
    cache.build(PLANS, embed=embed)
    store = Store(store_dir)
    entry = store.entries()[0].path
    temp = entry.with_name(f".tmp-{store._host}-{os.getpid()}-{'0' * 32}-{entry.name}")
    temp.write_bytes(entry.read_bytes()[:100])
    assert temp not in [e.path for e in store.entries()] and len(store.entries()) == len(PLANS)
    health = store.health()
    assert health["corrupt"] == [] and health["ok"] == len(PLANS) and health["temp_files"] == 1
    assert main(["inspect", str(store_dir)]) == 0
    assert "healthy" in capsys.readouterr().out
    report = verify_store(store, cache.spec, CheckpointSource(ckpt, cache.spec), embed=embed, progress=False)
    assert report.ok and report.checked == len(PLANS)
    assert main(["store", "prune", "--store", str(store_dir), "--max-gb", "0"]) == 0
    assert Store(store_dir).entries() == [] and temp.exists()  # the live writer's file is its own


def test_pruning_while_another_thread_writes_never_fails_a_write(tmp_path: Path) -> None:
    ckpt, store_dir = _checkpoint(tmp_path), tmp_path / "store"
    cache = _cache(ckpt, store_dir)
    cache.build(PLANS, embed=simple_embed(cache.spec))
    binding, rows = cache.binding(), cache.rows_of(plan_key(PLANS[0]))
    assert binding is not None
    store = Store(store_dir)
    failures: list[BaseException] = []
    done = threading.Event()

    def prune() -> None:
        while not done.is_set():
            store.prune(0)

    pruner = threading.Thread(target=prune)
    pruner.start()
    try:
        for i in range(150):
            try:
                store.put(binding, plan_key(plan(0.001 * (i + 1), 0.5)), rows)
            except Exception as exc:
                failures.append(exc)
    finally:
        done.set()
        pruner.join()
    assert failures == [], failures[:3]


# -- a store that cannot be written ---------------------------------------------------------------

_UNWRITABLE = """
import logging
import torch
import torch.nn.functional as F
from tiers_support import plan, projection_dict, simple_embed, small_spec
from adalncache import AdalnCache, CheckpointSource, Store, plan_key
from adalncache.spec import FINAL, LAYOUTS
from adalncache.identity.binding import forget_process_memo
from adalncache.source.files import write_safetensors

warnings = []
class Count(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("adalncache").addHandler(Count())
spec = small_spec()
weights = projection_dict(spec, 0)
ckpt = write_safetensors(weights, Path({ckpt!r}))
embed = simple_embed(spec)
store = MOUNT / "store"
AdalnCache(spec, CheckpointSource(ckpt, spec), max_plans=4, max_plan_width=4, store=store).build(
    [plan(0.5)], embed=embed)
{damage}()
forget_process_memo()
warnings.clear()
cache = AdalnCache(spec, CheckpointSource(ckpt, spec), max_plans=4, max_plan_width=4, store=store)
reports = [cache.build(p, embed=embed).as_dict() for p in ([plan(0.5)], [plan(0.3, 0.2)], [plan(0.7)], [plan(0.9)])]
lay = LAYOUTS["native"]
exact = True
for p in (plan(0.5), plan(0.3, 0.2), plan(0.7), plan(0.9)):
    x = embed(p)
    rows = cache.rows_of(plan_key(p))
    exact &= torch.equal(rows.final, F.linear(x, weights[lay.weight(FINAL)], weights[lay.bias(FINAL)]))
    for i in range(spec.num_layers):
        exact &= torch.equal(rows.block[:, i], F.linear(x, weights[lay.weight(i)], weights[lay.bias(i)]))
temps = [str(p) for p in store.rglob(".tmp-*")]
print(json.dumps({{"reports": reports, "stats": cache.stats.as_dict(), "warnings": warnings, "exact": exact,
                  "temps": temps}}))
"""


@pytest.mark.parametrize("damage", ["remount_readonly", "fill"], ids=["read-only", "full"])
def test_a_read_only_or_full_store_degrades_to_no_store(tmp_path: Path, damage: str) -> None:
    """A store on a read-only share, or on a full disk: hits are served, every miss is built as without a
    store (never blocked, never failed), the skipped writes and locks are counted and logged once, and
    no temporary file is left. Real kernel errors: a private tmpfs remounted read-only, or filled."""
    code = _UNWRITABLE.format(ckpt=str(tmp_path / "ckpt.safetensors"), damage=damage)
    done = run_on_private_tmpfs(code, tmp_path / "share", size="4m")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, *misses = out["reports"]
    assert first["store_hits"] == 1 and all(r["built"] == 1 and r["passes"] == 1 for r in misses), out["reports"]
    assert out["exact"] and out["temps"] == []
    assert out["stats"]["store_unwritable"] == len(misses), out["stats"]
    store_warnings = [w for w in out["warnings"] if "store" in w]
    assert len(store_warnings) == 1, out["warnings"]


# -- symbolic links -------------------------------------------------------------------------------


def test_symlinked_checkpoints_and_entries_are_followed_safely(tmp_path: Path) -> None:
    """A checkpoint reached through links (the Hugging Face cache's snapshot of links to blobs) is read
    and watched through them: a blob rewritten in place is noticed. A store entry that is a link to
    another plan's entry is never served as this plan: the link is moved aside (its target stays and
    serves its own plan) and the plan rebuilt; a link to a FIFO never blocks a lookup."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "main"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    spec = small_spec()
    blob = write_safetensors(projection_dict(spec, 0), blobs / "3f2a9c")
    (snapshot / "model.safetensors").symlink_to(blob)
    store_dir = tmp_path / "store"
    embed = simple_embed(spec)
    cache = AdalnCache(spec, CheckpointSource(snapshot, spec), max_plans=4, max_plan_width=4, store=store_dir)
    cache.build(PLANS, embed=embed)
    write_safetensors(projection_dict(spec, 1), blobs / "3f2a9c")  # the blob itself changes (renamed over)
    report = cache.build([plan(0.45)], embed=embed)
    assert cache.stats.fingerprint_changes == 1 and report.built == 1
    new = AdalnCache(spec, CheckpointSource(blob, spec), max_plans=4, max_plan_width=4)
    new.build([plan(0.45)], embed=embed)
    assert _equal(cache.rows_of(plan_key(plan(0.45))), new.rows_of(plan_key(plan(0.45))))
    # Entries that are links.
    store = Store(store_dir)
    binding = cache.binding()
    assert binding is not None
    bhash = binding_hash(binding)
    a, b = store._entry_path(bhash, plan_key(plan(0.45))), store._entry_path(bhash, plan_key(PLANS[0]))
    cache.build([PLANS[0]], embed=embed)
    assert a.is_file() and b.is_file()
    kept = a.read_bytes()
    b.unlink()
    b.symlink_to(a)  # PLANS[0]'s entry now names plan 0.45's file
    fresh = AdalnCache(spec, CheckpointSource(snapshot, spec), max_plans=4, max_plan_width=4, store=store_dir)
    report = fresh.build([PLANS[0], plan(0.45)], embed=embed)
    assert report.store_hits == 1 and report.built == 1 and fresh.stats.store_corrupt == 1
    assert a.read_bytes() == kept and not b.is_symlink()  # the target survives; the link went aside
    assert _equal(fresh.rows_of(plan_key(PLANS[0])), cache.rows_of(plan_key(PLANS[0])))
    b.unlink()
    os.mkfifo(tmp_path / "pipe")
    b.symlink_to(tmp_path / "pipe")
    fresh.invalidate()
    assert fresh.build([PLANS[0]], embed=embed).built == 1  # never blocked on the FIFO: moved aside
    assert fresh.stats.store_corrupt == 2 and (tmp_path / "pipe").exists()
