"""Distributed builds over real gloo process groups of 2 and 3 spawned ranks.

Each world size is spawned once (module-scoped fixture) and runs every scenario of
tests/dist_workers.py in one group, which keeps process start-up (importing torch per rank) to
one per world size. The parent then checks each scenario separately against an independent
single-process reference. The group runs under a hard deadline: a rank that hangs is killed and
the test fails instead of blocking CI; inside the group the process group's own timeout
(``dist_workers.PG_TIMEOUT_S``) turns a lost peer into an exception.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import dist_workers as W
from adalncache import AdalnCache, CheckpointSource, ConfigError
from adalncache.distributed import _split
from adalncache.source import Columns
from adalncache.spec import FINAL, LAYOUTS
from core_helpers import load_reference, make_weights, write_checkpoint

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

#: Hard wall-clock limit of one spawned group (all its scenarios); far above a normal run.
GROUP_DEADLINE_S = 240
SCENARIOS = {
    2: ["layers", "columns", "faults", "tiers", "config", "diffusers"],
    3: ["layers", "columns", "faults", "config"],
}


def _write_data(data: Path) -> None:
    for spec in (W.SPEC_A, W.SPEC_B, W.SPEC_ODD, W.SPEC_ONE):
        path = W._checkpoint(data, spec)
        write_checkpoint(path.parent, make_weights(spec, seed=spec.num_layers))


def run_group(
    world: int, names: list[str], root: Path, timeout_s: float = W.PG_TIMEOUT_S
) -> dict[str, list[dict[str, Any] | None]]:
    """Spawn ``world`` ranks running ``names``; each scenario's per-rank results (None: no result file)."""
    data, out = root / "data", root / "out"
    out.mkdir(parents=True)
    _write_data(data)
    ctx = mp.start_processes(
        W.entry,
        args=(world, str(root / "rendezvous"), names, str(data), str(out), timeout_s),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + GROUP_DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world}-rank group did not finish within {GROUP_DEADLINE_S} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    results: dict[str, list[dict[str, Any] | None]] = {}
    for name in names:
        files = [out / f"{name}-{r}.pt" for r in range(world)]
        results[name] = [torch.load(f, weights_only=False) if f.exists() else None for f in files]
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Any, Path]:
    world = request.param
    root = tmp_path_factory.mktemp(f"dist{world}")
    return world, run_group(world, SCENARIOS[world], root), root / "data"


def scenario(group: tuple[int, Any, Path], name: str) -> tuple[int, list[dict[str, Any]], Path]:
    world, results, data = group
    if name not in results:
        pytest.skip(f"{name} runs in the other world size's group")
    ranks = results[name]
    for r, res in enumerate(ranks):
        assert res is not None, f"rank {r} of {world} left no result for {name}"
        assert res["ok"], f"rank {r} of {world} failed in {name}:\n{res['traceback']}"
    return world, ranks, data


def single_process_tables(spec: Any, data: Path, request: list[torch.Tensor], **kwargs: Any) -> dict[str, Any]:
    cache = AdalnCache(spec, CheckpointSource(W._checkpoint(data, spec), spec), **kwargs)
    cache.build(request, embed=W.embed_fn(spec))
    return W.tables(cache)


def assert_tables_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["slots"] == want["slots"], f"{what}: slot maps differ"
    for name in ("block", "final", "lengths", "timesteps"):
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


def share_bytes(spec: Any, layers: list[Any]) -> int:
    return sum(spec.layer_bytes(layer) for layer in layers)


def test_layers_tables_equal_single_process_build(group: tuple[int, Any, Path]) -> None:
    """shard='layers': every rank's slab torch.equal to one process, with L+1 divisible or not by world."""
    world, ranks, data = scenario(group, "layers")
    divisible = []
    for spec in (W.SPEC_A, W.SPEC_B, W.SPEC_ODD, W.SPEC_ONE):
        divisible.append((spec.num_layers + 1) % world == 0)
        want = single_process_tables(spec, data, W.plans(), max_plans=4, max_plan_width=4)
        for r, res in enumerate(ranks):
            assert_tables_equal(res[spec.num_layers]["tables"], want, f"rank {r}/{world}, {spec.num_layers} layers")
    assert True in divisible and False in divisible  # both cases were covered


def test_layers_each_rank_reads_only_its_layers(group: tuple[int, Any, Path]) -> None:
    world, ranks, _ = scenario(group, "layers")
    for spec in (W.SPEC_A, W.SPEC_B, W.SPEC_ODD, W.SPEC_ONE):
        shares = _split(spec.layers(), world)
        # The shares partition the projections.
        assert sorted(str(layer) for share in shares for layer in share) == sorted(map(str, spec.layers()))
        reads = [res[spec.num_layers]["read"] for res in ranks]
        assert reads == [share_bytes(spec, share) for share in shares]
        assert sum(reads) == spec.projection_bytes
        assert all(res[spec.num_layers]["report"]["bytes_read"] == read for res, read in zip(ranks, reads))


def column_parallel_reference(spec: Any, data: Path, plan: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Per layer: F.linear of each rank's weight slice at the plan's own M, concatenated (safetensors load)."""
    weights = load_reference(W._checkpoint(data, spec))
    lay = LAYOUTS["native"]
    x = W.embed_fn(spec)(plan)
    out = []
    for layer in spec.layers():
        w, b = weights[lay.weight(layer)], weights[lay.bias(layer)]
        parts = []
        for part in range(world):
            lo, hi = Columns(part, world).bounds(spec.out_features(layer))
            parts.append(F.linear(x, w[lo:hi], b[lo:hi]))
        out.append(torch.cat(parts, dim=-1))
    return out


def test_columns_tables_equal_column_parallel_projection(group: tuple[int, Any, Path]) -> None:
    world, ranks, data = scenario(group, "columns")
    spec = W.SPEC_A
    first = ranks[0]["tables"]
    for r, res in enumerate(ranks):
        assert_tables_equal(res["tables"], first, f"rank {r} vs rank 0")
    distinct = {tuple(p.view(torch.int32).tolist()): p for p in W.plans()}
    assert set(first["slots"]) == set(distinct)
    for key, plan in distinct.items():
        slot, n = first["slots"][key], plan.numel()
        want = column_parallel_reference(spec, data, plan, world)
        for layer, ref in zip(spec.layers(), want):
            got = first["final"][slot, :n] if layer == FINAL else first["block"][slot, :n, int(layer)]
            assert torch.equal(got, ref), f"layer {layer} of plan {plan.tolist()} differs"


def test_columns_each_rank_reads_its_slice(group: tuple[int, Any, Path]) -> None:
    world, ranks, _ = scenario(group, "columns")
    spec = W.SPEC_A
    for res in ranks:
        assert res["read"] == spec.projection_bytes // world
        assert res["report"]["bytes_read"] == res["read"]


def test_fault_on_one_rank_fails_every_rank_then_retry_succeeds(group: tuple[int, Any, Path]) -> None:
    """A fault on one rank at a random layer (or in embed/publish): BuildError naming it everywhere."""
    world, ranks, data = scenario(group, "faults")
    n_cases = len(ranks[0]["records"])
    assert n_cases == 2 * world + 4
    for i in range(n_cases):
        records = [res["records"][i] for res in ranks]
        failing = records[0]["failing"]
        interrupt = i == n_cases - 1  # the last case: a KeyboardInterrupt on one rank
        for r, rec in enumerate(records):
            what = f"case {i} ({rec['mode']}, rank {failing} at {rec['where']!r}) seen by rank {r}"
            if interrupt and r == failing:
                # Ctrl-C is the user's: rolled back like any failure, then raised as itself.
                assert rec["interrupted"] and rec["error"] is None, f"{what}: the interrupt was wrapped"
                assert rec["lengths_unchanged"] and rec["resident_unchanged"] and rec["retry_built"] == 2, what
                continue
            assert not rec["interrupted"], f"{what}: a peer saw the interrupt itself"
            assert rec["error"] is not None, f"{what}: no BuildError"
            assert rec["rank"] == failing, what
            assert f"rank {failing}" in rec["error"], what
            assert "injected fault" in rec["error"], f"{what}: the cause is not named: {rec['error']}"
            if interrupt:
                assert "KeyboardInterrupt" in rec["error"], what
            assert rec["cause"] == (
                "PeerBuildFailure"
                if r != failing
                else ("OSError" if isinstance(rec["where"], int) or rec["where"] == FINAL else "RuntimeError")
            ), what
            assert rec["seconds"] < W.PG_TIMEOUT_S / 2, f"{what}: took {rec['seconds']:.1f} s"
            assert rec["lengths_unchanged"] and rec["resident_unchanged"], f"{what}: something was published"
            assert rec["retry_built"] == 2, what
        for r, rec in enumerate(records[1:], start=1):
            assert rec["retry_tables"].keys() == records[0]["retry_tables"].keys()
            for key, rows in rec["retry_tables"].items():
                for got, want in zip(rows, records[0]["retry_tables"][key]):
                    assert torch.equal(got, want), f"case {i}: rank {r} retry table differs from rank 0"
        if records[0]["mode"] == "layers":
            request = W.more_plans(i)
            want = single_process_tables(W.SPEC_B, data, request, max_plans=24, max_plan_width=4)
            cache_rows = records[0]["retry_tables"]
            for key in want["slots"]:
                slot, n = want["slots"][key], len(key)
                assert torch.equal(cache_rows[key].block, want["block"][slot, :n]), f"case {i}: retry not exact"
                assert torch.equal(cache_rows[key].final, want["final"][slot, :n]), f"case {i}: retry not exact"


def test_tier_hits_agreed_across_ranks(group: tuple[int, Any, Path]) -> None:
    _, ranks, _ = scenario(group, "tiers")
    logs = [res["log"] for res in ranks]
    for r, other in enumerate(logs[1:], start=1):
        assert other == logs[0], f"rank {r} decided differently from rank 0"
    steps = dict(logs[0])
    assert steps["a"]["built"] == 1 and steps["a again"]["device_hits"] == 1
    assert steps["b from host"]["host_hits"] == 1 and steps["b from host"]["passes"] == 0
    # Rank 1 lost its host copy of a: agreed miss in the host tier, agreed hit in the stores.
    assert steps["a: host disagrees, store agrees"] == {
        "device_hits": 0,
        "host_hits": 0,
        "store_hits": 1,
        "built": 0,
        "passes": 0,
    }
    # Rank 1 lost its store entries: every rank rebuilds instead of splitting.
    assert steps["c: store disagrees"]["built"] == 1 and steps["c: store disagrees"]["store_hits"] == 0
    assert steps["c again"]["device_hits"] == 1
    for r, res in enumerate(ranks):
        assert res["shared"] == (1, 1, 0), f"rank {r}: a store shared by the ranks must serve a fresh cache"
        assert all(torch.equal(g, w) for g, w in zip(res["shared_rows"], ranks[0]["shared_rows"]))
    for r, res in enumerate(ranks[1:], start=1):
        for key, rows in res["tables"].items():
            assert all(torch.equal(g, w) for g, w in zip(rows, ranks[0]["tables"][key])), f"rank {r}: {key}"


def test_construction_agreement(group: tuple[int, Any, Path]) -> None:
    """Capacities min-reduced; mismatched settings and non-SPMD requests refused on every rank."""
    world, ranks, _ = scenario(group, "config")
    L, bw = W.SPEC_A.num_layers, W.SPEC_A.block_width
    for r, res in enumerate(ranks):
        assert res["capacities"] == (3, 2, (3, 2, L, bw)), f"rank {r}"
        assert res["mismatch"] is not None and "different settings" in res["mismatch"], f"rank {r}"
        assert res["spmd"] is not None and "different plans" in res["spmd"], f"rank {r}"
        assert res["after_spmd"] == 1, f"rank {r}: a refused request must leave the cache usable"
        # Rank 0 alone invalidated: every rank dropped its tables and rebuilt both plans.
        assert res["after_divergence"][:2] == (0, 2), f"rank {r}: {res['after_divergence']}"
        assert res["after_divergence"] == ranks[0]["after_divergence"], f"rank {r}"
        assert res["bad_store"] is not None, f"rank {r}: a store failing on rank 1 must fail every rank"
        assert res["bad_store"][1] < W.PG_TIMEOUT_S / 2, f"rank {r} waited {res['bad_store'][1]:.1f} s"
        assert (r == 1) or "rank 1 of" in res["bad_store"][0], f"rank {r}: {res['bad_store'][0]}"
        assert res["after_bad_store"] == 1, f"rank {r}: the group must stay usable"
        if world == 3:
            assert res["odd"] is not None and "--shard" in res["odd"], f"rank {r}"


def test_diffusers_integration_per_rank(group: tuple[int, Any, Path]) -> None:
    """enable_adaln_cache(model, process_group=pg): each rank serves bit-identical forwards."""
    _, ranks, _ = scenario(group, "diffusers")
    pytest.importorskip("diffusers")
    for r, res in enumerate(ranks):
        assert res["equal"], f"rank {r}: cached forwards differ from the resident model"
        assert res["steps"] > 0 and res["built"] > 0
        assert_tables_equal(res["tables"], ranks[0]["tables"], f"rank {r} vs rank 0")
    reads = [res["read"] for res in ranks]
    assert all(0 < read < sum(reads) for read in reads), f"each rank reads only its layers: {reads}"
    for r, res in enumerate(ranks):
        message = res["columns_lora"]
        assert message is not None and "shard='layers'" in message and "--shard" in message, f"rank {r}: {message}"


def test_rank_that_dies_outright_is_bounded_by_the_group_timeout(tmp_path: Path) -> None:
    """A rank exits mid-pass (no exception): its peer raises BuildError, publishes nothing, in bounded time."""
    timeout_s = 20.0
    ranks = run_group(2, ["death"], tmp_path, timeout_s=timeout_s)["death"]
    assert ranks[1] is None  # it died before writing anything
    survivor = ranks[0]
    assert survivor is not None and survivor["ok"], survivor and survivor.get("traceback")
    assert survivor["error"] is not None and "rank 0 of 2" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < timeout_s + 10, f"took {survivor['seconds']:.1f} s"
    assert survivor["lengths_unchanged"] and survivor["resident"] == 1


def test_process_group_without_init_is_a_config_error(tmp_path: Path) -> None:
    """A process group given before torch.distributed is initialised: ConfigError saying what to do."""
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    _write_data(tmp_path)
    spec = W.SPEC_A
    source = CheckpointSource(W._checkpoint(tmp_path, spec), spec)
    with pytest.raises(ConfigError, match="init_process_group"):
        AdalnCache(spec, source, process_group=object())


def test_torchrun_example_fills_a_store_that_serves_one_process(tiny_saved_dir: Path, tmp_path: Path) -> None:
    """examples/torchrun_build.py under torchrun (2 ranks, gloo); its entries then serve a plain cache."""
    import os
    import subprocess
    import sys

    from adalncache import ModulationSpec
    from adalncache.families import checkpoint_embed as time_embed_fn
    from adalncache.plans import schedule_plans

    script = Path(__file__).resolve().parents[1] / "examples" / "torchrun_build.py"
    store = tmp_path / "store"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(tiny_saved_dir),
        "--store",
        str(store),
        "--task",
        "fl2va",
        "--steps",
        "4",
        "--timeout",
        "60",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if "rank(s)" in line)
    plans = schedule_plans(["fl2va"], [4], video_shift=12.0, audio_shift=3.0, audio_refs=True)
    assert f"{len(plans)} plan(s), 0 already stored, {len(plans)} built in 1 pass(es)" in line, line
    # Layer sharding reproduces the one-process bits, so its entries serve a one-process cache
    # under the same numeric settings. The ranks ran with one intra-op thread (OMP_NUM_THREADS=1),
    # and the thread count is part of the binding (it can change a GEMM's bits), so this one does too.
    spec = ModulationSpec.from_checkpoint(tiny_saved_dir)
    source = CheckpointSource(tiny_saved_dir, spec)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = AdalnCache(spec, source, max_plans=len(plans), store=store)
        report = cache.build(plans, embed=time_embed_fn(source, spec))
    finally:
        torch.set_num_threads(previous)
    assert (report.store_hits, report.passes, report.bytes_read) == (len(plans), 0, 0)


#: A one-rank gloo group in a fresh process: build with ``process_group=``, then (``close``) close the
#: cache and destroy the group, or (``drop``) drop the last reference with the garbage collector off.
_RELEASE_SCRIPT = """
import gc, json, os, sys, weakref
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from adalncache import AdalnCache, TensorSource
from core_helpers import SPEC, embed_for, make_weights

def threads():
    return [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
gc.disable()
cache = AdalnCache(SPEC, TensorSource(make_weights(SPEC), SPEC), process_group=dist.group.WORLD)
cache.build([torch.tensor([0.5]), torch.tensor([0.25, 0.75])], embed=embed_for(SPEC))
before = threads()
if sys.argv[1] == "close":
    cache.close()
    freed = None
else:
    ref = weakref.ref(cache)
    del cache
    freed = ref() is None
dist.destroy_process_group()
print(json.dumps({{"before": before, "after": threads(), "freed": freed}}))
"""


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_cache_never_keeps_its_process_group_alive(how: str) -> None:
    """Closing a cache releases its process group, and a cache with a group is freed by reference counting
    alone: after ``destroy_process_group()`` no gloo worker thread runs, so none can abort the process at
    interpreter exit (a group kept alive by a reference cycle ended its threads during finalisation)."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = _RELEASE_SCRIPT.format(tests=str(Path(__file__).resolve().parent))
    done = subprocess.run(
        [sys.executable, "-c", script, how, port], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("gloo" in name for name in report["before"]), report  # the check can see gloo's threads
    assert not any("gloo" in name for name in report["after"]), report
    if how == "drop":
        assert report["freed"] is True
