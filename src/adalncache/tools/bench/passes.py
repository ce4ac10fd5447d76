"""The sections on a generated checkpoint: ``pass``, ``qwen-pass``, ``build``, ``store``, ``memory``, ``tables``.

Each measures the rebuild pass or what stands in for it (a hit of the resident slab, of the store,
of a table file) at the real projection widths, on the checkpoint and request of :mod:`.workload`,
timed with :mod:`.primitives`.
"""

from __future__ import annotations

import gc
import logging
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...cache import AdalnCache
from ...identity.binding import forget_process_memo
from ...offline import export_tables
from ...plans import plan_key
from ...rebuild import TILE_ROWS, verdicts
from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from ..measure import drop_page_cache, meminfo, proc_status, sync_device, timed
from .primitives import (
    PinnedCopy,
    ResidentLayer,
    SglangBaseline,
    batched_exactness,
    in_fresh_process,
    inputs_device,
    naive,
    one_pass,
    read_and_project_concurrently,
    read_only,
    read_only_direct,
    request_cache,
    rounds,
    tables_equal_linear,
    timed_build,
)
from .workload import (
    QWEN_BLOCKS,
    QWEN_SIZE,
    STEPS,
    Comparison,
    PlanInputs,
    Results,
    fmt_s,
    generate_checkpoint,
    make_inputs,
    qwen_config,
    qwen_request_plans,
    qwen_spec,
    request_plans,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------- pass

#: The pass may cost this much more than the larger of its two bounds.
PASS_TARGET = 1.15
#: The pass against the naive loop at the crossover.
NAIVE_TARGET = 0.75

Timings = dict[str, list[float]]
Before = Callable[[], object] | None


def bench_pass(
    res: Results, source: Any, plans: list[torch.Tensor], runs: int, cold: bool, device: torch.device
) -> None:
    """The ``pass`` section: the rebuild pass against what bounds it, warm and cold, variants interleaved.

    At 1 plan and the whole request: the pass against max(read-only, project-only) (an overlapping
    pass costs about the larger), a process's first pass (fresh staging buffers), reading and
    projecting merely run at once (the overlap this machine allows), the batched pass against the
    per-plan one (slabs compared bitwise). Warm, the whole request: in place against staged, tiled
    against per plan, the default against the old default, SGLang's own pass where installed, and on
    CUDA the pinned host-to-device copy of the pass's bytes. Then, where reading and projecting cost
    about the same (where overlap matters most), the pass against a naive read-then-project loop.
    """
    section = PassSection(res, source, plans, runs, device)
    section.state("warm", None)
    if cold:
        section.state("cold", partial(drop_page_cache, list(source.files)))


class PassSection:
    """One run of the ``pass`` section: the request's inputs, the resident weights, the two request sizes."""

    def __init__(self, res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
        self.res = res
        self.source = source
        self.plans = plans
        self.runs = runs
        self.inputs = make_inputs(source.spec, plans, device)
        self.resident = ResidentLayer(source, device)
        self.sizes = sorted({1, len(plans)})
        self.xs_of = {k: self.inputs.of(plans[:k]) for k in self.sizes}
        #: SGLang's cache over the same files, or why it is not available (opened by the warm state).
        self.sglang: SglangBaseline | str = "not opened"

    def state(self, state: str, before: Before) -> None:
        """Every comparison of one page-cache state (``before``: how a sample starts cold; None: warm)."""
        source = self.source
        if before is None:
            read_only(source)  # warm: the page cache holds every byte from here on (if memory allows)
        direct_ok = state == "cold" and read_only_direct(source) is not None
        variants = self.variants(before, direct_ok)
        if before is None:
            exact = batched_exactness(source, self.plans, self.inputs)
            self.res.values["batched"] = exact
            log.info("batched vs per-plan build: %s", exact)
        got = rounds(variants, self.runs, before)
        reads, read_kind = self.record(state, got, direct_ok)
        self.compare(state, got, reads, read_kind)
        self.crossover(state, reads, before)

    def variants(self, before: Before, direct_ok: bool) -> dict[str, Callable[[], float]]:
        """What one round times, by name."""
        source, plans, inputs = self.source, self.plans, self.inputs
        variants: dict[str, Callable[[], float]] = {"read": partial(read_only, source)}
        if direct_ok:
            # Cold, the pass reads with O_DIRECT, so the raw-read bound is the faster of the two.
            variants["readdirect"] = lambda: read_only_direct(source) or 0.0
        for k in self.sizes:
            variants[f"project{k}"] = partial(self.resident.project_only, self.xs_of[k])
            variants[f"pass{k}"] = partial(one_pass, source, plans[:k], inputs, settle=before)
        # A process's first pass (every pass with keep_buffers=False) also faults its staging buffers
        # in: with few layers that fixed cost dominates, so it is measured on its own.
        variants["pass1fresh"] = partial(one_pass, source, plans[:1], inputs, fresh=True)
        variants["concurrent1"] = partial(read_and_project_concurrently, source, self.resident, self.xs_of[1])
        variants[f"batched{self.sizes[-1]}"] = partial(one_pass, source, plans, inputs, batched=True, settle=before)
        if before is None:  # warm: the options of the pass at GEMM speed, side by side
            variants.update(self.fast_variants())
            if self.resident.device.type == "cuda":  # the physical limit of a CUDA pass, beside it
                variants["h2d"] = PinnedCopy(source, self.resident.device)
        return variants

    def fast_variants(self) -> dict[str, Callable[[], float]]:
        """In place vs staged, tiled vs per plan (each alone), and SGLang's pass where available (warm only)."""
        source, plans, inputs = self.source, self.plans, self.inputs
        variants: dict[str, Callable[[], float]] = {
            "staged": partial(one_pass, source, plans, inputs, in_place=False, tiled=False),
            "inplace": partial(one_pass, source, plans, inputs, in_place=True, tiled=False),
            "tiled": partial(one_pass, source, plans, inputs, in_place=True, tiled=True),
        }
        self.sglang = SglangBaseline.open(source, len(plans), inputs_device(inputs))
        if isinstance(self.sglang, SglangBaseline):
            variants["sglang"] = partial(self.sglang_pass, self.sglang)
        return variants

    def sglang_pass(self, baseline: SglangBaseline) -> float:
        """SGLang's own rebuild pass of the whole request over the same files (its tables dropped first)."""
        baseline.cache.invalidate()
        return timed(lambda: baseline.cache.build(list(self.plans), embed=self.inputs.embed), self.resident.device)

    def record(self, state: str, got: Timings, direct_ok: bool) -> tuple[list[float], str]:
        """Keep the raw samples; returns the raw-read bound (the faster read) and its name."""
        values, sizes, top = self.res.values, self.sizes, self.sizes[-1]
        values[f"pass_{state}_s"] = {str(k): got[f"pass{k}"] for k in sizes}
        values[f"pass_fresh_buffers_{state}_s"] = {"1": got["pass1fresh"]}
        values[f"pass_batched_{state}_s"] = {str(top): got[f"batched{top}"]}
        reads = got["read"]
        values[f"read_only_{state}_s"] = reads
        read_kind = "read-only"
        if direct_ok:
            values[f"read_only_direct_{state}_s"] = got["readdirect"]
            if statistics.median(got["readdirect"]) < statistics.median(reads):
                reads, read_kind = got["readdirect"], "read-only (O_DIRECT)"
        values[f"project_only_{state}_s"] = {str(k): got[f"project{k}"] for k in sizes}
        return reads, read_kind

    def compare(self, state: str, got: Timings, reads: list[float], read_kind: str) -> None:
        """The pass against its bounds at each size, and the batched pass against the per-plan one."""
        res = self.res
        for k in self.sizes:
            project = got[f"project{k}"]
            read_bound = statistics.median(reads) >= statistics.median(project)
            base, base_kind = (reads, read_kind) if read_bound else (project, "project-only")
            note = f"read {fmt_s(statistics.median(reads))}, project {fmt_s(statistics.median(project))}"
            name = f"pass vs max(read, project), {k} plan(s), {state}"
            res.add(Comparison(name, "pass", base_kind, got[f"pass{k}"], base, PASS_TARGET, note=note))
            if k == 1:
                self.compare_first_pass(state, got, base, base_kind)
        top = self.sizes[-1]
        if "staged" in got:
            self.compare_fast(got, top)
        if "h2d" in got:
            res.values["pinned_h2d_s"] = got["h2d"]
            note = "the copy alone, from page-locked memory: the limit a CUDA pass cannot beat"
            for k in self.sizes:
                name = f"pass vs the pinned host-to-device copy of its bytes, {k} plan(s), {state}"
                res.add(Comparison(name, "pass", "pinned H2D copy", got[f"pass{k}"], got["h2d"], None, note=note))
        elif state == "warm":
            res.note("pass vs pinned host-to-device copy: measured on a CUDA device only (--device cuda)")
        batched = res.values["batched"]
        note = (
            "plans of one width stacked into one GEMM where the probe proved the bits equal; slabs "
            f"torch.equal to per-plan: {batched['bit_identical']} ({batched['stacked_layers']} stacked, "
            f"{batched['per_plan_layers']} per-plan layer groups in a new process's first pass)"
        )
        name = f"batched pass vs per-plan pass, {top} plan(s), {state}"
        res.add(Comparison(name, "pass, batched=True", "pass", got[f"batched{top}"], got[f"pass{top}"], None, note))

    def compare_fast(self, got: Timings, top: int) -> None:
        """Warm, the whole request: in place vs staged, tiled vs per plan, the default vs the old default and SGLang."""
        res, source = self.res, self.source
        res.values["pass_fast_warm_s"] = {
            name: got[name] for name in ("staged", "inplace", "tiled", "sglang") if name in got
        }
        res.values["tiled_verdicts"] = {str(k): v for k, v in verdicts("tiled").items()}
        rows = [
            (
                "in-place pass vs staged pass",
                "pass, in place",
                "pass, staged",
                "inplace",
                "staged",
                "both per plan (tiled=False); in place: no copy of the page cache into staging buffers",
            ),
            (
                "tiled pass vs per-plan pass",
                "pass, tiled",
                "pass, per plan",
                "tiled",
                "inplace",
                f"both in place; tiles of {TILE_ROWS} rows, every plan per tile, each at its own M",
            ),
            (
                "default pass vs staged per-plan pass",
                "pass (defaults)",
                "pass, staged, per plan",
                f"pass{top}",
                "staged",
                "defaults: in place, tiled='auto' (where the probe found tiling exact and faster)",
            ),
        ]
        for name, subject, baseline, mine, theirs, note in rows:
            res.add(
                Comparison(f"{name}, {top} plan(s), warm", subject, baseline, got[mine], got[theirs], None, note=note)
            )
        if "sglang" in got and isinstance(self.sglang, SglangBaseline):
            probe = request_cache(source, top, self.resident.device)
            probe.build(list(self.plans), embed=self.inputs.embed)
            same = self.sglang.tables_identical(probe, self.plans)
            version = self.sglang.version
            note = f"same files, plans and inputs; tables bit-identical: {same}"
            name = f"pass vs SGLang {version}'s pass, {top} plan(s), warm"
            res.add(
                Comparison(name, "pass (defaults)", f"SGLang {version}", got[f"pass{top}"], got["sglang"], 1.0, note)
            )
        elif isinstance(self.sglang, str):
            res.note(f"SGLang pass baseline not available: {self.sglang}")

    def compare_first_pass(self, state: str, got: Timings, base: list[float], base_kind: str) -> None:
        """At 1 plan: the first pass of a process against the bound, and the pass against mere concurrency."""
        note = "keep_buffers=False, or a process's first pass: staging buffers faulted in"
        name = f"first pass (fresh buffers) vs max(read, project), 1 plan(s), {state}"
        self.res.add(Comparison(name, "pass, fresh buffers", base_kind, got["pass1fresh"], base, PASS_TARGET, note))
        note = "the overlap this machine allows: read-only on a thread while project-only runs"
        name = f"pass vs read and project run concurrently (no pipeline), 1 plan(s), {state}"
        self.res.add(Comparison(name, "pass", "read || project", got["pass1"], got["concurrent1"], None, note))

    def crossover(self, state: str, reads: Sequence[float], before: Before) -> None:
        """The pass against the naive loop where reading and projecting cost about the same.

        Project-only grows linearly in the plans (one GEMM per plan and layer), so the request size
        where it meets read-only is interpolated from the two measured sizes, then measured for real.
        """
        values = self.res.values
        project = values[f"project_only_{state}_s"]
        first = statistics.median(project[str(self.sizes[0])])
        per_plan = (statistics.median(project[str(self.sizes[-1])]) - first) / max(1, self.sizes[-1] - 1)
        read_s = statistics.median(reads)
        best = min(range(1, len(self.plans) + 1), key=lambda k: abs((first + (k - 1) * per_plan) - read_s))
        xs = self.inputs.of(self.plans[:best])
        cross = rounds(
            {
                "read": partial(read_only, self.source),
                "project": partial(self.resident.project_only, xs),
                "naive": partial(naive, self.source, xs),
                "pass": partial(one_pass, self.source, self.plans[:best], self.inputs, settle=before),
            },
            self.runs,
            before,
        )
        read, proj = statistics.median(cross["read"]), statistics.median(cross["project"])
        values[f"crossover_{state}"] = {"plans": best, "read_only_s": read, "project_only_s": proj}
        note = f"read {fmt_s(read)}, project {fmt_s(proj)}"
        name = f"pass vs naive, {best} plan(s) (read ~ project here), {state}"
        self.res.add(Comparison(name, "pass", "naive", cross["pass"], cross["naive"], NAIVE_TARGET, note=note))


# ---------------------------------------------------------------------------------------------------- qwen-pass


def bench_qwen_pass(res: Results, runs: int, device: torch.device, work: Path, *, dim: int, max_plans: int) -> None:
    """The ``qwen-pass`` section: one pass of Qwen-Image's projections at the released widths against its GEMMs.

    A generated Qwen-Image checkpoint (diffusers layout, its family read back from ``config.json``)
    holds the served projections of a few blocks; a 50-step 1024 x 1024 request is built in one
    pass, timed against ``F.linear`` of every plan's input with every layer's weight held in memory
    (nothing read), the two taking turns; every table row is checked ``torch.equal`` to those GEMMs.
    """
    if res.lacks("qwen-pass", "diffusers"):  # the schedule is the pipeline's, computed by diffusers' scheduler
        return
    spec = qwen_spec(QWEN_BLOCKS, dim)
    directory = work / f"qwen-{QWEN_BLOCKS}x{dim}"
    print(f"qwen-image checkpoint: {directory} ({spec.projection_bytes / 2**30:.2f} GiB of projections)", flush=True)
    generate_checkpoint(spec, directory, layout="diffusers", config=qwen_config(QWEN_BLOCKS, dim))
    read_back = ModulationSpec.from_checkpoint(directory)
    if read_back != spec:
        raise AssertionError(f"the generated checkpoint reads back as {read_back!r}, not {spec!r}")
    source = CheckpointSource(directory, spec)
    res.config["qwen_pass"] = {"spec": spec.describe(), "checkpoint": str(directory)}
    plans = qwen_request_plans(spec, STEPS, QWEN_SIZE)[: max_plans or None]
    inputs = make_inputs(spec, plans, device)
    resident = ResidentLayer(source, device, every_layer=True)
    read_only(source)  # warm: the page cache holds every byte, as for the resident weights
    probe = request_cache(source, len(plans), device)
    report = probe.build(list(plans), embed=inputs.embed)
    exact = tables_equal_linear(probe, resident, plans, inputs)
    del probe
    variants = {
        "pass": partial(one_pass, source, plans, inputs),
        "gemm": partial(resident.project_only, inputs.of(plans)),
    }
    samples = rounds(variants, max(runs, 1))
    layers = len(spec.layers())
    res.values["qwen_pass"] = {
        "blocks": QWEN_BLOCKS,
        "dim": dim,
        "layers": layers,
        "plans": len(plans),
        "projection_bytes": spec.projection_bytes,
        "passes": report.passes,
        "tables_equal_linear": exact,
        "pass_s": samples["pass"],
        "gemm_s": samples["gemm"],
    }
    log.info("qwen-pass: %d plans, tables torch.equal to F.linear: %s", len(plans), exact)
    note = (
        f"{layers} projections ({spec.projection_bytes / 2**20:.0f} MiB bf16) of a generated checkpoint; a "
        f"{STEPS}-step {QWEN_SIZE}x{QWEN_SIZE} request, batch 1; tables torch.equal to F.linear of the file's "
        f"weights: {exact}"
    )
    name = f"Qwen-Image pass vs plain GEMMs, {QWEN_BLOCKS} blocks at dim {dim}, {len(plans)} plan(s), warm"
    res.add(Comparison(name, "pass", "F.linear, weights in memory", samples["pass"], samples["gemm"], None, note))


# ---------------------------------------------------------------------------------------------------- build


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


#: The hit-path calls timed, by label: ``call(cache, plans, keys, embed)``.
HIT_CALLS: dict[str, Callable[[Any, list[torch.Tensor], list[Any], Callable[[torch.Tensor], Any]], Any]] = {
    "build()": lambda cache, plans, keys, embed: cache.build(plans, embed=embed),
    "build(keys=)": lambda cache, plans, keys, embed: cache.build(plans, embed=embed, keys=keys),
    "resolve_slots()": lambda cache, plans, keys, embed: cache.resolve_slots(plans),
    "resolve_slots(keys=)": lambda cache, plans, keys, embed: cache.resolve_slots(plans, keys=keys),
}


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
            sync_device(device)
    finally:
        if enabled:
            gc.enable()
    return out


def hit_timings(
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
        plans = list(steps)
        keys = [plan_key(p) for p in plans]  # each cache keys plans with its own key function
        their_keys = [theirs.key(p) for p in plans] if theirs is not None else []
        for call, fn in HIT_CALLS.items():
            labels.append((call, size))
            calls[f"ours {call} {size}"] = partial(fn, ours, plans, keys, embed)
            if theirs is not None:
                calls[f"theirs {call} {size}"] = partial(fn, theirs.cache, plans, their_keys, embed)
    got = time_interleaved(calls, samples, device)
    return [
        HitTiming(call, size, got[f"ours {call} {size}"], got.get(f"theirs {call} {size}")) for call, size in labels
    ]


def format_table(timings: Sequence[HitTiming], baseline: str) -> str:
    """The side-by-side table the bench prints (microseconds; per plan; ratio ours / baseline)."""
    head = f"  {'call':<22}{'plans':>6}{'adalncache':>13}{'per plan':>11}"
    if any(t.theirs is not None for t in timings):
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
    """The ``build`` section: the hit path of a fully resident request, timed call by call, SGLang's cache beside it.

    Every request calls ``build()`` and resolves its slots even when every plan is resident: that
    path, for 49 and 10 plans, with and without keys computed once per request (``keys=``), and
    SGLang's cache (where installed) over the same files, plans and inputs in interleaved rounds,
    each keying plans its own way. The checkpoint has 50 layers in 7-layer shards at tiny widths:
    keying, the identity check and the LRU do not depend on the projection widths.
    """
    spec = ModulationSpec(num_layers=50, hidden_size=8, time_embed_dim=16)
    ckpt = generate_checkpoint(spec, directory, layers_per_shard=7)
    source = CheckpointSource(ckpt, spec)
    plans = request_plans(STEPS)  # one plan tensor per step, as a pipeline passes them
    inputs = make_inputs(spec, plans, device)
    cache = request_cache(source, 64, device)
    cache.build(plans, embed=inputs.embed)
    baseline = SglangBaseline.open(source, 64, device)
    theirs: SglangBaseline | None = None
    if isinstance(baseline, str):
        res.note(f"SGLang baseline not available: {baseline}")
    else:
        baseline.cache.build(plans, embed=inputs.embed)  # its own rebuild pass, from the same files
        same = baseline.tables_identical(cache, plans)
        res.note(f"SGLang {baseline.version} baseline: same checkpoint, plans and inputs; tables bit-identical: {same}")
        theirs = baseline
    requests = {len(plans): plans, 10: plans[:10]}
    timings = hit_timings(cache, theirs, requests, inputs.embed, max(runs, 1) * 100, device)
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
            note = f"{per_plan} vs {statistics.median(t.theirs) / t.plans * 1e6:.2f} us per plan"
            res.add(
                Comparison(f"hit path, {t.plans} plans: {t.call}", "adalncache", label, t.ours, t.theirs, 1.0, note)
            )
        if t.call == "build()" and t.plans == len(plans):
            note = f"{per_plan}; the hit path stats none of the {len(source.files)} checkpoint files"
            name = f"build() of a fully resident {t.plans}-plan request"
            res.add(Comparison(name, "build()", "1 ms", t.ours, [1e-3], 1.0, note=note))


# ---------------------------------------------------------------------------------------------------- store


def bench_store(res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
    """The ``store`` section: a store hit against a pass of the same request."""
    section = TablesSection(res, source, plans, runs, device)
    with tempfile.TemporaryDirectory(prefix="adalncache-bench-store-") as tmp:
        hits = section.store_hits(tmp, "store run")
    # The pass of the same request was measured (warm) in the pass section of this run.
    measured = res.values.get("pass_warm_s", {}).get(str(len(plans)))
    passes = measured or [one_pass(source, plans, section.inputs) for _ in range(runs)]
    res.add(Comparison(f"store hit vs pass, {len(plans)} plans", "store hit", "pass", hits, passes))


# ---------------------------------------------------------------------------------------------------- memory


def probe_pass(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process (the parent's buffers do not count): one pass, sampling ``RssAnon`` every
    millisecond (the kernel keeps no peak of anonymous memory)."""
    spec = ModulationSpec(**args["spec"])
    source = CheckpointSource(args["checkpoint"], spec)
    plans = request_plans(STEPS)[: args["plans"]]
    device = torch.device(args.get("device", "cpu"))
    inputs = make_inputs(spec, plans, device)
    baseline = proc_status()
    cache = request_cache(source, len(plans), device)
    cache.block_params.fill_(0)  # touch the slab so it is counted before the pass
    with_slab = proc_status()
    peak = [with_slab["RssAnon"]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc_status()["RssAnon"])
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        cache.build(plans, embed=inputs.embed)
    finally:
        stop.set()
        sampler.join()
    after = proc_status()
    peak[0] = max(peak[0], after["RssAnon"])
    kept = source.release_buffers()  # what keep_buffers (the default) holds between passes
    return {
        "baseline": baseline,
        "with_slab": with_slab,
        "after": after,
        "peak_rss_anon": peak[0],
        "slab_bytes": cache.slab_bytes,
        "kept_between_passes_bytes": kept,
        "after_release": proc_status(),
    }


def bench_memory(res: Results, source: Any, plans: list[torch.Tensor], checkpoint: Path, device: torch.device) -> None:
    """The ``memory`` section: projection bytes against slab bytes, and the peak anonymous memory of a pass
    (:func:`probe_pass`); the page cache is file-backed and reported apart."""
    spec = source.spec
    full = ModulationSpec.minimax_h3()
    n = len(plans)
    res.values["memory"] = {
        "projection_bytes": spec.projection_bytes,
        "slab_bytes_request": spec.slab_bytes(n, 4),
        "full_model_projection_bytes": full.projection_bytes,
        "full_model_slab_bytes_request": full.slab_bytes(n, 4),
        "full_model_slab_bytes_default_64x4": full.slab_bytes(64, 4),
    }
    probe_args = {
        "spec": {k: getattr(spec, k) for k in ("num_layers", "hidden_size", "time_embed_dim")},
        "checkpoint": str(checkpoint),
        "plans": n,
        "device": str(device),
    }
    meminfo_before = meminfo()
    try:
        probe = in_fresh_process(f"{__name__}:probe_pass", probe_args)
    except RuntimeError as exc:
        res.note(f"memory probe failed: {exc}")
        return
    layer = spec.layer_bytes(0)
    pass_anon = probe["peak_rss_anon"] - probe["baseline"]["RssAnon"]
    budget = probe["slab_bytes"] + 3 * layer
    res.values["memory"].update(
        {
            "probe": probe,
            "pass_peak_anon_over_baseline": pass_anon,
            "budget_slab_plus_3_layers": budget,
            "layer_bytes": layer,
            "page_cache_delta_bytes": meminfo()["Cached"] - meminfo_before["Cached"],
            "kept_between_passes_bytes": probe["kept_between_passes_bytes"],
        }
    )
    mib = 2**20
    note = (
        f"slab {probe['slab_bytes'] / mib:.0f} MiB, layer {layer / mib:.0f} MiB, peak over baseline "
        f"{pass_anon / mib:.0f} MiB = slab + {(pass_anon - probe['slab_bytes']) / layer:.2f} layers; "
        f"VmHWM {probe['after']['VmHWM'] / mib:.0f} MiB, RssFile {probe['after']['RssFile'] / mib:.0f} MiB; "
        f"kept between passes (keep_buffers): {probe['kept_between_passes_bytes'] / mib:.0f} MiB"
    )
    name, subject = f"peak anonymous memory of a {n}-plan pass", "peak RssAnon - baseline"
    res.add(Comparison(name, subject, "slab + 3 layers", [float(pass_anon)], [float(budget)], 1.0, note, "bytes"))


# ---------------------------------------------------------------------------------------------------- tables


def bench_tables(res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
    """The ``tables`` section: what content identity and table files cost and save, for one request.

    Against a plain pass: the pass hashing what it streams (alternating runs), a hashing-only read
    (a copied checkpoint's one read), a store hit (entries bound to the content digest) and a
    table-file hit (``export_tables``' bound file, served with no weight source).
    """
    section = TablesSection(res, source, plans, runs, device)
    source.keep_buffers = True
    timed_build(section.cache(), plans[:1], section.inputs)  # fills the read buffers and the page cache
    plain = section.hashing()
    section.hash_read(plain)
    section.hits(plain)


class TablesSection:
    """One run of the ``tables`` section: the request, its inputs, and a cache of the request's size on demand."""

    def __init__(self, res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
        self.res = res
        self.source = source
        self.spec = source.spec
        self.plans = plans
        self.runs = runs
        self.device = device
        self.inputs: PlanInputs = make_inputs(self.spec, plans, device)

    def cache(self, **kwargs: Any) -> AdalnCache:
        """A fresh cache for the whole request (``source=``, ``store=``, ``tables=`` as given)."""
        source = kwargs.pop("source", self.source)
        return request_cache(source, len(self.plans), self.device, spec=self.spec, **kwargs)

    def hashing(self) -> list[float]:
        """A pass that hashes against one that does not, alternating; returns the plain passes' seconds."""
        res, plans = self.res, self.plans
        hashed: list[float] = []
        plain: list[float] = []
        for run in range(self.runs):
            for kind in ("hashed", "plain") if run % 2 == 0 else ("plain", "hashed"):
                cache = self.cache()
                cache.hash_passes = kind == "hashed"  # on with a store or table files; off here by default
                seconds, report = timed_build(cache, plans, self.inputs)
                assert report.passes == 1
                want = self.spec.projection_bytes if kind == "hashed" else 0
                if report.hashed_bytes != want:
                    res.note(f"tables: a {kind} pass hashed {report.hashed_bytes} bytes, expected {want}")
                (hashed if kind == "hashed" else plain).append(seconds)
        res.values["tables_pass_hashed_s"] = hashed
        res.values["tables_pass_plain_s"] = plain
        note = "alternating runs; a cache hashes its passes where a store or table files bind to the digest"
        name = f"hashing during a pass, {len(plans)} plans"
        res.add(Comparison(name, "pass + BLAKE3", "pass", hashed, plain, 1.05, note=note))
        return plain

    def hash_read(self, plain: list[float]) -> None:
        """The one read a copied checkpoint costs (hashing only) against a pass."""
        reads = []
        for _ in range(self.runs):
            forget_process_memo()
            probe = AdalnCache(
                self.spec, self.source, max_plans=1, max_plan_width=1, progress=False, device=self.device
            )
            start = time.perf_counter()
            probe.identify()
            reads.append(time.perf_counter() - start)
        name = "hashing-only read (a copied checkpoint's one read)"
        self.res.add(Comparison(name, "hash read", "pass", reads, plain))

    def store_hits(self, store: str | Path, what: str) -> list[float]:
        """Seconds of builds of the request that hit ``store``, which an untimed build fills first."""
        timed_build(self.cache(store=store), self.plans, self.inputs)
        return self.timed_hits(what, "store_hits", store=store)

    def timed_hits(self, what: str, counter: str, **options: Any) -> list[float]:
        """Seconds of builds of the request by fresh caches of ``options``, each expected to hit every plan
        (its report's ``counter``; a run that does not is noted)."""
        seconds = []
        for _ in range(self.runs):
            took, report = timed_build(self.cache(**options), self.plans, self.inputs)
            if getattr(report, counter) != len(self.plans):
                self.res.note(f"{what} hit {getattr(report, counter)} of {len(self.plans)} plans")
            seconds.append(took)
        return seconds

    def hits(self, plain: list[float]) -> None:
        """A store hit and a table-file hit (no weight source) against a pass."""
        res, plans, n = self.res, self.plans, len(self.plans)
        with tempfile.TemporaryDirectory(prefix="adalncache-bench-tables-") as tmp:
            store, table = Path(tmp) / "store", Path(tmp) / "tables.safetensors"
            hits = self.store_hits(store, "tables: a store run")
            res.add(Comparison(f"store hit vs pass, {n} plans (content-bound)", "store hit", "pass", hits, plain))
            export_tables(self.cache(), plans, table, embed=self.inputs.embed, progress=False)
            res.values["tables_file_bytes"] = table.stat().st_size
            served = self.timed_hits("tables: a table-file run", "table_hits", source=None, tables=table)
            note = f"bound file of {table.stat().st_size / 2**20:.0f} MiB, no weight source"
            res.add(Comparison(f"table-file hit vs pass, {n} plans", "table hit", "pass", served, plain, note=note))
