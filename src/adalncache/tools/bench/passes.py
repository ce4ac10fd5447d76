"""The ``pass`` section: the rebuild pass against what bounds it, warm and cold.

At 1 plan and at the whole request: the pass against max(read-only, project-only) (a pass that
overlaps reading with projecting costs about the larger of the two), the first pass of a process
(fresh staging buffers), the pass against reading and projecting merely run at once (the overlap
this machine allows), and the batched pass against the per-plan one (with a bitwise check of
their slabs). Warm, at the whole request: the pass projecting in place from the page cache against
the staged pass (a copy into staging buffers), the tiled pass against the per-plan one, the
default pass against the previous default (staged, per plan), and, where an installed SGLang
provides its cache (:mod:`.sglang`), the default pass against SGLang's own pass over the same
files, plans and inputs. Then, at the request size where reading and projecting cost about the
same (where overlap matters most), the pass against a naive read-then-project loop.

The variants of one page-cache state run interleaved, round by round, so a neighbour's load on a
shared machine hits them alike instead of skewing whichever block happened to run during it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from ...plans import plan_key
from ...rebuild import TILE_ROWS, verdicts
from ..measure import drop_page_cache
from .primitives import (
    PinnedCopy,
    ResidentLayer,
    batched_exactness,
    naive,
    one_pass,
    read_and_project_concurrently,
    read_only,
    read_only_direct,
    request_cache,
    sync_device,
)
from .results import Comparison, Results, fmt_s
from .sglang import SglangBaseline, tables_identical
from .workload import make_inputs, plan_keys

log = logging.getLogger(__name__)

#: The pass may cost this much more than the larger of its two bounds.
PASS_TARGET = 1.15
#: The pass against the naive loop at the crossover.
NAIVE_TARGET = 0.75

Timings = dict[str, list[float]]
Before = Callable[[], None] | None


def bench_pass(
    res: Results, source: Any, plans: list[torch.Tensor], runs: int, cold: bool, device: torch.device
) -> None:
    """Pass vs read-only vs project-only (warm, cold) at 1 and all plans; pass vs naive at the crossover."""
    section = PassSection(res, source, plans, runs, device)
    files = list(source.files)

    def drop() -> None:
        drop_page_cache(files)

    section.state("warm", None)
    if cold:
        section.state("cold", drop)


class PassSection:
    """One run of the section: the request's inputs, the resident weights, the two request sizes."""

    def __init__(self, res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
        self.res = res
        self.source = source
        self.plans = plans
        self.runs = runs
        self.inputs = make_inputs(source.spec, plans, device)
        self.resident = ResidentLayer(source, device)
        self.sizes = sorted({1, len(plans)})
        self.xs_of = {k: self.xs(k) for k in self.sizes}
        #: SGLang's cache over the same files, or why it is not available (opened by the warm state).
        self.sglang: SglangBaseline | str = "not opened"

    def xs(self, k: int) -> list[torch.Tensor]:
        """The projection inputs of the first ``k`` plans."""
        return [self.inputs[key] for key in plan_keys(self.plans[:k])]

    def rounds(self, variants: dict[str, Callable[[], float]], before: Before) -> Timings:
        """``runs`` samples of every variant, taking turns; ``before`` runs ahead of each sample."""
        out: Timings = {name: [] for name in variants}
        for _ in range(self.runs):
            for name, fn in variants.items():
                if before is not None:
                    before()
                out[name].append(fn())
        return out

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
        got = self.rounds(variants, before)
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
        # The first pass of a process (or every pass with keep_buffers=False) also pays the first
        # touch of its staging buffers: with few layers that fixed cost dominates, so it is
        # measured on its own.
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
        self.sglang = SglangBaseline.open(
            list(source.files),
            num_layers=source.spec.num_layers,
            hidden_size=source.spec.hidden_size,
            max_plans=len(plans),
            device=self.inputs[next(iter(self.inputs))].device,
        )
        if isinstance(self.sglang, SglangBaseline):
            variants["sglang"] = partial(self.sglang_pass, self.sglang)
        return variants

    def sglang_pass(self, baseline: SglangBaseline) -> float:
        """SGLang's own rebuild pass of the whole request over the same files (its tables dropped first)."""
        embed = self.embed
        baseline.cache.invalidate()
        sync_device(self.resident.device)
        start = time.perf_counter()
        baseline.cache.build(list(self.plans), embed=embed)
        sync_device(self.resident.device)
        return time.perf_counter() - start

    def embed(self, plan: torch.Tensor) -> torch.Tensor:
        return self.inputs[plan_key(plan)]

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
            for k in self.sizes:
                res.add(
                    Comparison(
                        f"pass vs the pinned host-to-device copy of its bytes, {k} plan(s), {state}",
                        "pass",
                        "pinned H2D copy",
                        got[f"pass{k}"],
                        got["h2d"],
                        None,
                        note="the copy alone, from page-locked memory: the limit a CUDA pass cannot beat",
                    )
                )
        elif state == "warm":
            res.note("pass vs pinned host-to-device copy: measured on a CUDA device only (--device cuda)")
        batched = res.values["batched"]
        res.add(
            Comparison(
                f"batched pass vs per-plan pass, {top} plan(s), {state}",
                "pass, batched=True",
                "pass",
                got[f"batched{top}"],
                got[f"pass{top}"],
                None,
                note="plans of one width stacked into one GEMM where the probe proved the bits equal; slabs "
                f"torch.equal to per-plan: {batched['bit_identical']} ({batched['stacked_layers']} stacked, "
                f"{batched['per_plan_layers']} per-plan layer groups in a new process's first pass)",
            )
        )

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
            probe.build(list(self.plans), embed=self.embed)
            same = tables_identical(probe, self.sglang, self.plans)
            res.add(
                Comparison(
                    f"pass vs SGLang {self.sglang.version}'s pass, {top} plan(s), warm",
                    "pass (defaults)",
                    f"SGLang {self.sglang.version}",
                    got[f"pass{top}"],
                    got["sglang"],
                    1.0,
                    note=f"same files, plans and inputs; tables bit-identical: {same}",
                )
            )
        elif isinstance(self.sglang, str):
            res.note(f"SGLang pass baseline not available: {self.sglang}")

    def compare_first_pass(self, state: str, got: Timings, base: list[float], base_kind: str) -> None:
        """At 1 plan: the first pass of a process against the bound, and the pass against mere concurrency."""
        self.res.add(
            Comparison(
                f"first pass (fresh buffers) vs max(read, project), 1 plan(s), {state}",
                "pass, fresh buffers",
                base_kind,
                got["pass1fresh"],
                base,
                PASS_TARGET,
                note="keep_buffers=False, or a process's first pass: staging buffers faulted in",
            )
        )
        self.res.add(
            Comparison(
                f"pass vs read and project run concurrently (no pipeline), 1 plan(s), {state}",
                "pass",
                "read || project",
                got["pass1"],
                got["concurrent1"],
                None,
                note="the overlap this machine allows: read-only on a thread while project-only runs",
            )
        )

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
        xs = self.xs(best)
        cross = self.rounds(
            {
                "read": partial(read_only, self.source),
                "project": partial(self.resident.project_only, xs),
                "naive": partial(naive, self.source, xs),
                "pass": partial(one_pass, self.source, self.plans[:best], self.inputs, settle=before),
            },
            before,
        )
        read, proj = statistics.median(cross["read"]), statistics.median(cross["project"])
        values[f"crossover_{state}"] = {"plans": best, "read_only_s": read, "project_only_s": proj}
        res_note = f"read {fmt_s(read)}, project {fmt_s(proj)}"
        name = f"pass vs naive, {best} plan(s) (read ~ project here), {state}"
        self.res.add(Comparison(name, "pass", "naive", cross["pass"], cross["naive"], NAIVE_TARGET, note=res_note))


__all__ = ["PassSection", "bench_pass"]
