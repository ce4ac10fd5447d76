"""What each rank of the context-parallel test runs (tests/test_compose_parallel.py spawns them).

diffusers' ``enable_parallelism`` with a ``ContextParallelConfig`` on a real gloo group of CPU
processes, with and without the AdaLN cache. Each rank saves what the parent checks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _cpu_context_parallel_shim() -> None:
    """Let diffusers' context parallel start on a CPU-only build (a diffusers limitation, not ours).

    ``ModelMixin._resolve_parallel_config`` picks the rank's device as
    ``rank % torch.accelerator.device_count()``, which divides by zero when no accelerator
    exists (``ZeroDivisionError``), before any mesh or backend is looked at. Reporting one device
    makes it pick ``cpu:0`` for every rank, which is where these ranks run anyway. diffusers
    itself does not support context parallel on CPU; this shim lives only in this test.
    """
    torch.accelerator.device_count = lambda: 1


def _loop(model: Any, request: Any) -> Any:
    from adalncache.tools.tiny import run_loop

    return run_loop(model, request)


def _maxdiff(a: Any, b: Any) -> float:
    return max(
        max((va - vb).abs().max().item(), (aa - ab).abs().max().item())
        for (va, aa), (vb, ab) in zip(a.outputs, b.outputs)
    )


def scenario(rank: int, world: int) -> dict[str, Any]:
    from diffusers import ContextParallelConfig

    from adalncache.diffusers import enable_adaln_cache
    from adalncache.tools.tiny import make_request, tiny_transformer

    out: dict[str, Any] = {}
    with contextlib.suppress(ZeroDivisionError):
        probe = tiny_transformer("tiny")
        probe.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        out["cpu_without_shim"] = "started"
    out.setdefault("cpu_without_shim", "ZeroDivisionError")
    _cpu_context_parallel_shim()

    def ulysses() -> Any:
        return ContextParallelConfig(ulysses_degree=world)

    single = tiny_transformer("tiny")
    request = make_request(single, "t2va", 4)
    resident_single = _loop(single, request)
    parallel = tiny_transformer("tiny")
    parallel.enable_parallelism(config=ulysses())
    resident = _loop(parallel, request)
    out["parallel_vs_single_maxdiff"] = _maxdiff(resident, resident_single)

    def cached(order: str, **options: Any) -> dict[str, Any]:
        model = tiny_transformer("tiny")
        if order == "parallel first":
            model.enable_parallelism(config=ulysses())
        handle = enable_adaln_cache(model, on_miss="raise", **options)
        if order == "cache first":
            model.enable_parallelism(config=ulysses())
        handle.prepare(request.plans)
        result = _loop(model, request)
        return {"equal": result.equal(resident), "maxdiff": _maxdiff(result, resident), **handle.stats.as_dict()}

    out["cache first"] = cached("cache first")
    out["parallel first"] = cached("parallel first")
    out["shared build"] = cached("cache first", process_group=dist.group.WORLD)

    ring = tiny_transformer("tiny")
    try:
        ring.enable_parallelism(config=ContextParallelConfig(ring_degree=world))
        _loop(ring, request)
        out["ring"] = "ran"
    except Exception as exc:
        out["ring"] = f"{type(exc).__name__}: {exc}"
    return out


def entry(rank: int, world: int, init_file: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        try:
            result: dict[str, Any] = {"ok": True, **scenario(rank, world)}
        except Exception:
            result = {"ok": False, "traceback": traceback.format_exc()}
        torch.save(result, Path(out) / f"cp-{rank}.pt")
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
