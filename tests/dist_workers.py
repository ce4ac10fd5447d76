"""What each rank of the distributed tests runs (tests/test_distributed.py spawns the groups).

Every rank joins a real gloo process group through a FileStore, runs every scenario of its group
in order (one spawn per group keeps the suite fast) and saves what the parent checks with
``torch.save``: tables, reports, errors. A scenario that raises is recorded, not fatal, so one
broken scenario does not hide the others; the parent asserts on each scenario separately.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adalncache import AdalnCache, BuildError, CheckpointSource, ConfigError, ModulationSpec, PlanError, Store
from adalncache.testing import FaultInjectingSource, inject_faults

#: Geometries: widths divide by 2 and 3 (columns), and layer counts whose L + 1 projections do
#: and do not divide by the world size.
SPEC_A = ModulationSpec(num_layers=3, hidden_size=6, time_embed_dim=32)
SPEC_B = ModulationSpec(num_layers=4, hidden_size=6, time_embed_dim=32)
SPEC_ODD = ModulationSpec(num_layers=2, hidden_size=8, time_embed_dim=32)  # final width 16: not /3
SPEC_ONE = ModulationSpec(num_layers=1, hidden_size=6, time_embed_dim=32)  # 2 projections: a 3rd rank reads none
#: The process group's timeout: a rank that hangs or dies makes its peers raise after this.
PG_TIMEOUT_S = 60

Scenario = Callable[[int, int, Any, Path], dict[str, Any]]


def plans() -> list[torch.Tensor]:
    """A request with a repeated plan and widths 1..3 (M=1 takes the GEMV path)."""
    return [
        torch.tensor([0.9], dtype=torch.float32),
        torch.tensor([0.7, 0.65], dtype=torch.float32),
        torch.tensor([0.5, 0.45, 0.2], dtype=torch.float32),
        torch.tensor([0.7, 0.65], dtype=torch.float32),
    ]


def more_plans(i: int) -> list[torch.Tensor]:
    """Fresh plans for the i-th request of a sequence."""
    return [torch.tensor([0.31 + i / 97, 0.11 + i / 89], dtype=torch.float32), torch.tensor([0.05 + i / 83])]


def embed_fn(spec: ModulationSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    from core_helpers import embed_for

    return embed_for(spec)


def tables(cache: AdalnCache) -> dict[str, Any]:
    return {
        "block": cache.block_params.clone(),
        "final": cache.final_params.clone(),
        "lengths": cache.plan_lengths.clone(),
        "timesteps": cache.plan_timesteps.clone(),
        "slots": {k: cache.slot_of(k) for k in cache.resident_plans},
    }


def _checkpoint(data: Path, spec: ModulationSpec) -> Path:
    return data / f"ckpt-L{spec.num_layers}-H{spec.hidden_size}" / "model.safetensors"


# -- world-size-agnostic scenarios -----------------------------------------------------------


def scenario_layers(rank: int, world: int, pg: Any, data: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in (SPEC_A, SPEC_B, SPEC_ODD, SPEC_ONE):
        source = CheckpointSource(_checkpoint(data, spec), spec)
        cache = AdalnCache(spec, source, max_plans=4, max_plan_width=4, process_group=pg, shard="layers")
        report = cache.build(plans(), embed=embed_fn(spec))
        cache.check_invariants()
        out[spec.num_layers] = {"tables": tables(cache), "report": report.as_dict(), "read": source.bytes_read}
    return out


def scenario_columns(rank: int, world: int, pg: Any, data: Path) -> dict[str, Any]:
    spec = SPEC_A
    source = CheckpointSource(_checkpoint(data, spec), spec)
    cache = AdalnCache(spec, source, max_plans=4, max_plan_width=4, process_group=pg, shard="columns")
    report = cache.build(plans(), embed=embed_fn(spec))
    cache.check_invariants()
    return {"tables": tables(cache), "report": report.as_dict(), "read": source.bytes_read}


def scenario_faults(rank: int, world: int, pg: Any, data: Path) -> dict[str, Any]:
    """Faults on one rank at a random layer of its own share (and other phases), then a retry."""
    from adalncache.distributed import _split

    spec = SPEC_B
    rng = random.Random(1234)  # the same draws on every rank
    cases: list[tuple[str, int, Any]] = []
    shares = _split(spec.layers(), world)
    for failing in range(world):
        for _ in range(2):
            cases.append(("layers", failing, rng.choice(shares[failing])))
    cases.append(("columns", world - 1, rng.choice(spec.layers())))
    cases.append(("layers", 0, "embed"))
    cases.append(("layers", world - 1, "publish"))
    # Ctrl-C on one rank: that rank raises the interrupt itself, its peers a BuildError naming it.
    cases.append(("interrupt", world - 1, rng.choice(shares[world - 1])))  # 2 * world + 4 cases: no eviction
    source = FaultInjectingSource(CheckpointSource(_checkpoint(data, spec), spec), None)
    caches = {
        mode: AdalnCache(spec, source, max_plans=24, max_plan_width=4, process_group=pg, shard=mode)
        for mode in ("layers", "columns")
    }
    for cache in caches.values():
        cache.build(plans()[:1], embed=embed_fn(spec))  # a resident plan the faults must not disturb
    records = []
    for i, (kind, failing, where) in enumerate(cases):
        mode = "layers" if kind == "interrupt" else kind
        cache = caches[mode]
        request = more_plans(i)
        lengths = cache.plan_lengths.clone()
        resident = cache.resident_plans
        record: dict[str, Any] = {"mode": mode, "failing": failing, "where": where, "interrupted": False}
        start = time.monotonic()
        try:
            if rank == failing and where in ("embed", "publish"):
                with inject_faults(cache, where, RuntimeError):
                    cache.build(request, embed=embed_fn(spec))
            else:
                if rank == failing:
                    source.arm(where, KeyboardInterrupt if kind == "interrupt" else OSError)
                cache.build(request, embed=embed_fn(spec))
            record["error"] = None
        except BuildError as exc:
            record.update(error=str(exc), rank=exc.rank, cause=type(exc.__cause__).__name__)
        except KeyboardInterrupt:
            record.update(error=None, interrupted=True)
        finally:
            source.disarm()
        record["seconds"] = time.monotonic() - start
        record["lengths_unchanged"] = torch.equal(lengths, cache.plan_lengths)
        record["resident_unchanged"] = resident == cache.resident_plans
        cache.check_invariants()
        retry = cache.build(request, embed=embed_fn(spec))
        record["retry_built"] = retry.built
        record["retry_tables"] = {k: cache.rows_of(k) for k in cache.resident_plans}
        records.append(record)
    return {"records": records}


def scenario_tiers(rank: int, world: int, pg: Any, data: Path) -> dict[str, Any]:
    """A mixed request sequence through the host tier and per-rank stores, where the ranks' tiers differ.

    Rank 1 alone loses its host copies, then its store entries: every hit must be agreed, so each
    rank's report must still be the same as its peers' at every step.
    """
    spec = SPEC_A
    source = CheckpointSource(_checkpoint(data, spec), spec)
    cache = AdalnCache(
        spec,
        source,
        max_plans=2,
        max_plan_width=4,
        host_cache_bytes=64 * spec.row_bytes,
        store=data / f"store-{rank}",
        process_group=pg,
    )
    embed = embed_fn(spec)
    a, b, c = more_plans(0)[:1], more_plans(1)[:1], more_plans(2)[:1]
    log: list[tuple[str, dict[str, Any]]] = []

    def step(name: str, request: list[torch.Tensor]) -> None:
        report = cache.build(request, embed=embed).as_dict()
        cache.check_invariants()
        log.append((name, {k: report[k] for k in ("device_hits", "host_hits", "store_hits", "built", "passes")}))

    step("a", a)
    step("b", b)
    step("a again", a)
    step("c evicts b", c)
    step("b from host", b)  # evicts a
    if rank == 1 and cache.host_tier is not None:
        cache.host_tier.clear()  # only this rank lost its host copies
    step("a: host disagrees, store agrees", a)
    cache.invalidate()
    if rank == 1 and cache.store is not None:
        cache.store.prune(0)  # only this rank lost its store entries
    step("c: store disagrees", c)
    step("c again", c)
    # One directory shared by every rank: every rank writes (the same bytes), then a fresh cache
    # on every rank restores from it without a pass.
    if rank == 0:
        Store(data / "shared")  # created once: concurrent first creation of one directory races in Store
    dist.barrier()
    shared = [
        AdalnCache(spec, source, max_plans=2, max_plan_width=4, store=data / "shared", process_group=pg)
        for _ in range(2)
    ]
    first = shared[0].build(a, embed=embed).as_dict()
    second = shared[1].build(a, embed=embed).as_dict()
    return {
        "log": log,
        "tables": {k: cache.rows_of(k) for k in cache.resident_plans},
        "shared": (first["built"], second["store_hits"], second["passes"]),
        "shared_rows": shared[1].rows_of(shared[1].resident_plans[0]),
    }


def scenario_config(rank: int, world: int, pg: Any, data: Path) -> dict[str, Any]:
    """Construction-time agreement: capacities min-reduced, settings compared, SPMD requests checked."""
    spec = SPEC_A
    source = CheckpointSource(_checkpoint(data, spec), spec)
    out: dict[str, Any] = {}
    cache = AdalnCache(spec, source, max_plans=3 + rank, max_plan_width=2 + rank, process_group=pg)
    out["capacities"] = (cache.max_plans, cache.max_plan_width, tuple(cache.block_params.shape))
    try:
        AdalnCache(spec, source, precision="fp32" if rank == 0 else "match", process_group=pg)
        out["mismatch"] = None
    except ConfigError as exc:
        out["mismatch"] = str(exc)
    try:
        cache.build([torch.tensor([0.5 + rank / 10])], embed=embed_fn(spec))
        out["spmd"] = None
    except PlanError as exc:
        out["spmd"] = str(exc)
    out["after_spmd"] = cache.build([torch.tensor([0.5])], embed=embed_fn(spec)).built
    if rank == 0:
        cache.invalidate()  # one rank alone: the next build must bring the ranks back into step
    report = cache.build([torch.tensor([0.5]), torch.tensor([0.25])], embed=embed_fn(spec))
    out["after_divergence"] = (report.device_hits, report.built, cache.resident_plans)
    # A store rank 1 alone cannot use (a regular file): every rank's construction fails, none hangs.
    bad = data / "not-a-dir"
    if rank == 0:
        bad.write_text("x")
    dist.barrier()
    start = time.monotonic()
    try:
        AdalnCache(spec, source, store=bad if rank == 1 else data / f"fine-{rank}", process_group=pg)
        out["bad_store"] = None
    except ConfigError as exc:
        out["bad_store"] = (str(exc), time.monotonic() - start)
    out["after_bad_store"] = AdalnCache(spec, source, process_group=pg).build(plans()[:1], embed=embed_fn(spec)).built
    if world == 3:
        odd = CheckpointSource(_checkpoint(data, SPEC_ODD), SPEC_ODD)
        try:
            AdalnCache(SPEC_ODD, odd, process_group=pg, shard="columns")
            out["odd"] = None
        except ConfigError as exc:
            out["odd"] = str(exc)
    return out


def scenario_diffusers(rank: int, world: int, pg: Any, data: Path) -> dict[str, Any]:
    """Each rank's tiny transformer gets its cache from the same process group."""
    from adalncache.diffusers import enable_adaln_cache
    from adalncache.plans import minimax_h3_plans
    from adalncache.tools.tiny import make_request, run_loop, tiny_transformer

    model = tiny_transformer("tiny", seed=0)
    request = make_request(model, "fl2va", 4, seed=3)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, process_group=pg, shard="layers", max_plans=8)
    report = handle.prepare(minimax_h3_plans("fl2va", 4))
    cached = run_loop(model, request)
    equal = all(torch.equal(x, y) for r, c in zip(resident.outputs, cached.outputs) for x, y in zip(r, c))
    out = {
        "equal": equal,
        "steps": len(cached.outputs),
        "built": report.built,
        "read": handle.cache.source.bytes_read,
        "tables": tables(handle.cache),
    }
    handle.disable()
    # shard="columns" with a LoRA on the projections: refused up front, on every rank alike.
    from peft import LoraConfig

    model = tiny_transformer("tiny", seed=0)
    handle = enable_adaln_cache(model, process_group=pg, shard="columns", max_plans=8)
    model.add_adapter(LoraConfig(r=2, target_modules=["adaln_proj.linear"], init_lora_weights=False))
    try:
        handle.prepare(minimax_h3_plans("fl2va", 4))
        out["columns_lora"] = None
    except ConfigError as exc:
        out["columns_lora"] = str(exc)
    return out


def scenario_death(rank: int, world: int, pg: Any, data: Path) -> dict[str, Any]:
    """The last rank dies outright in the middle of its pass; the others must raise, bounded in time."""
    spec = SPEC_B
    source = CheckpointSource(_checkpoint(data, spec), spec)
    cache = AdalnCache(spec, source, max_plans=4, max_plan_width=4, process_group=pg)
    cache.build(plans()[:1], embed=embed_fn(spec))
    lengths = cache.plan_lengths.clone()

    def project(layer: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if rank == world - 1:
            os._exit(0)  # no exception, no cleanup: the process is simply gone
        return torch.nn.functional.linear(x, weight, bias)

    start = time.monotonic()
    try:
        cache.build(more_plans(0), embed=embed_fn(spec), project=project)
        error = None
    except BuildError as exc:
        error = str(exc)
    return {
        "error": error,
        "seconds": time.monotonic() - start,
        "lengths_unchanged": torch.equal(lengths, cache.plan_lengths),
        "resident": len(cache.resident_plans),
    }


SCENARIOS: dict[str, Scenario] = {
    "death": scenario_death,
    "layers": scenario_layers,
    "columns": scenario_columns,
    "faults": scenario_faults,
    "tiers": scenario_tiers,
    "config": scenario_config,
    "diffusers": scenario_diffusers,
}


def entry(
    rank: int, world: int, init_file: str, names: list[str], data: str, out: str, timeout_s: float = PG_TIMEOUT_S
) -> None:
    """The spawned process: join the group, run the scenarios, save each result or traceback."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        pg = dist.group.WORLD
        for name in names:
            try:
                result: dict[str, Any] = {"ok": True, **SCENARIOS[name](rank, world, pg, Path(data))}
            except Exception:
                result = {"ok": False, "traceback": traceback.format_exc()}
            torch.save(result, Path(out) / f"{name}-{rank}.pt")
            if name == "death":
                # The group lost a member: no barrier, no orderly teardown is possible. Tearing the
                # broken gloo group down (or leaving it to interpreter exit) can abort the process
                # ("terminate called without an active exception") after its result is saved, so
                # the survivor leaves at once.
                os._exit(0)
            dist.barrier()  # scenarios start together, so one's collectives never meet another's
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
