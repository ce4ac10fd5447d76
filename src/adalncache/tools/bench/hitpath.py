"""The ``build`` section: the hit path of a fully resident request, timed call by call, SGLang's cache beside it.

Every request of a serving process calls ``build()`` (or its holding variant) and resolves its
slots, even when every plan is already resident; that is the path this section times, for a
49-plan request and a 10-plan one, with and without keys computed once per request (``keys=``).
Where an installed SGLang provides its cache (:mod:`.sglang`), it is built over the same files
with the same plans and inputs and timed in the same process, on the same slab contents, in
interleaved rounds (a neighbour's load hits both alike), one call per sample. Each cache keys
plans with its own key function (this package's :func:`~adalncache.plans.plan_key`, SGLang's
``_plan_key``).

The checkpoint has 50 layers in 7-layer shards at tiny widths: the hit path's cost is keying the
plans, checking the source's identity and touching the LRU, none of which depends on the
projection widths.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...cache import AdalnCache
from ...plans import plan_key
from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from .results import Comparison, Results
from .sglang import SglangBaseline, tables_identical
from .workload import STEPS, generate_checkpoint, make_inputs, request_plans


@dataclass
class HitTiming:
    """One call of the hit path for one request size: seconds per call, ours and the baseline's."""

    call: str
    plans: int
    ours: list[float]
    theirs: list[float] | None

    def row(self) -> dict[str, Any]:
        ours = statistics.median(self.ours)
        out: dict[str, Any] = {
            "call": self.call,
            "plans": self.plans,
            "adalncache_s": ours,
            "adalncache_per_plan_s": ours / self.plans,
        }
        if self.theirs is not None:
            theirs = statistics.median(self.theirs)
            out.update(sglang_s=theirs, sglang_per_plan_s=theirs / self.plans, ratio=ours / theirs)
        return out


def hit_variants(
    ours: Any, theirs: SglangBaseline | None, steps: Sequence[torch.Tensor], embed: Callable[[torch.Tensor], Any]
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]:
    """``call label -> (our call, the baseline's call or None)`` for one request's per-step plans."""
    plans = list(steps)
    keys = [plan_key(p) for p in plans]
    variants: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {}
    sg = theirs.cache if theirs is not None else None
    sg_keys = [theirs.key(p) for p in plans] if theirs is not None else []
    variants["build()"] = (
        lambda: ours.build(plans, embed=embed),
        (lambda: sg.build(plans, embed=embed)) if sg is not None else None,
    )
    variants["build(keys=)"] = (
        lambda: ours.build(plans, embed=embed, keys=keys),
        (lambda: sg.build(plans, embed=embed, keys=sg_keys)) if sg is not None else None,
    )
    variants["resolve_slots()"] = (
        lambda: ours.resolve_slots(plans),
        (lambda: sg.resolve_slots(plans)) if sg is not None else None,
    )
    variants["resolve_slots(keys=)"] = (
        lambda: ours.resolve_slots(plans, keys=keys),
        (lambda: sg.resolve_slots(plans, keys=sg_keys)) if sg is not None else None,
    )
    return variants


def time_interleaved(
    calls: dict[str, Callable[[], Any]], samples: int, device: torch.device, warmup: int = 20
) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``, one call per sample, the calls taking turns.

    The hit path is host work (a ``resolve_slots`` also queues a small copy); the device is
    synchronised once per round, outside the timed calls, so queued copies never pile up.
    """
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in calls}
    enabled = gc.isenabled()
    gc.disable()  # a collection inside one sample would land on whichever call happened to run
    try:
        for _ in range(samples):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - start)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        if enabled:
            gc.enable()
    return out


def measure(
    ours: Any,
    theirs: SglangBaseline | None,
    requests: Mapping[int, Sequence[torch.Tensor]],
    embed: Callable[[torch.Tensor], Any],
    samples: int,
    device: torch.device,
) -> list[HitTiming]:
    """Every hit-path call for every request size, ours and the baseline's interleaved in one loop."""
    calls: dict[str, Callable[[], Any]] = {}
    labels: list[tuple[str, int]] = []
    for size, steps in requests.items():
        for call, (mine, base) in hit_variants(ours, theirs, steps, embed).items():
            labels.append((call, size))
            calls[f"ours {call} {size}"] = mine
            if base is not None:
                calls[f"theirs {call} {size}"] = base
    got = time_interleaved(calls, samples, device)
    return [
        HitTiming(call, size, got[f"ours {call} {size}"], got.get(f"theirs {call} {size}")) for call, size in labels
    ]


def format_table(timings: Sequence[HitTiming], baseline: str) -> str:
    """The side-by-side table the bench prints (microseconds; per plan; ratio ours / baseline)."""
    head = f"  {'call':<22}{'plans':>6}{'adalncache':>13}{'per plan':>11}"
    with_baseline = any(t.theirs is not None for t in timings)
    if with_baseline:
        head += f"{baseline:>16}{'per plan':>11}{'ratio':>8}"
    lines = [head]
    for t in timings:
        row = t.row()
        us, per_plan = row["adalncache_s"] * 1e6, row["adalncache_per_plan_s"] * 1e6
        line = f"  {t.call:<22}{t.plans:>6}{us:>10.1f} us{per_plan:>8.2f} us"
        if "sglang_s" in row:
            us, per_plan = row["sglang_s"] * 1e6, row["sglang_per_plan_s"] * 1e6
            line += f"{us:>13.1f} us{per_plan:>8.2f} us{row['ratio']:>8.2f}"
        lines.append(line)
    return "\n".join(lines)


def bench_build_latency(res: Results, runs: int, directory: Path, device: torch.device) -> None:
    """The hit path: ``build()`` and ``resolve_slots()`` of a fully resident request, 49 and 10 plans.

    See the module docstring for the checkpoint, the baseline and how the calls are timed.
    """
    spec = ModulationSpec(num_layers=50, hidden_size=8, time_embed_dim=16)
    ckpt = generate_checkpoint(spec, directory, layers_per_shard=7)
    source = CheckpointSource(ckpt, spec)
    plans = request_plans(STEPS)  # one plan tensor per step, as a pipeline passes them
    inputs = make_inputs(spec, plans, device)

    def embed(plan: torch.Tensor) -> torch.Tensor:
        return inputs[plan_key(plan)]

    cache = AdalnCache(spec, source, max_plans=64, max_plan_width=4, progress=False, device=device)
    cache.build(plans, embed=embed)
    files = sorted(ckpt.glob("*.safetensors"))
    baseline = SglangBaseline.open(
        files, num_layers=spec.num_layers, hidden_size=spec.hidden_size, max_plans=64, device=device
    )
    theirs: SglangBaseline | None = None
    if isinstance(baseline, str):
        res.note(f"SGLang baseline not available: {baseline}")
    else:
        baseline.cache.build(plans, embed=embed)  # its own rebuild pass, from the same files
        same = tables_identical(cache, baseline, plans)
        res.note(f"SGLang {baseline.version} baseline: same checkpoint, plans and inputs; tables bit-identical: {same}")
        theirs = baseline
    requests = {len(plans): plans, 10: plans[:10]}
    timings = measure(cache, theirs, requests, embed, max(runs, 1) * 100, device)
    label = f"SGLang {theirs.version}" if theirs is not None else "SGLang"
    table = format_table(timings, label)
    print(f"hit path of a fully resident request (median of {len(timings[0].ours)} calls each):\n{table}", flush=True)
    res.values["hit_path"] = {
        "baseline": theirs.version if theirs is not None else baseline,
        "rows": [t.row() for t in timings],
        "table": table,
        "files": len(source.files),
    }
    for t in timings:
        per_plan = f"{statistics.median(t.ours) / t.plans * 1e6:.2f} us per plan"
        if t.theirs is not None:
            res.add(
                Comparison(
                    f"hit path, {t.plans} plans: {t.call}",
                    "adalncache",
                    label,
                    t.ours,
                    t.theirs,
                    1.0,
                    note=f"{per_plan} vs {statistics.median(t.theirs) / t.plans * 1e6:.2f} us per plan",
                )
            )
        if t.call == "build()" and t.plans == len(plans):
            res.add(
                Comparison(
                    f"build() of a fully resident {t.plans}-plan request",
                    "build()",
                    "1 ms",
                    t.ours,
                    [1e-3],
                    1.0,
                    note=f"{per_plan}; the hit path stats none of the {len(source.files)} checkpoint files",
                )
            )


__all__ = ["HitTiming", "bench_build_latency", "format_table", "measure"]
