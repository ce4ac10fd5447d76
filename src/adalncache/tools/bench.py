"""``adalncache bench``: side-by-side measurements of the rebuild pass, serving and memory.

Every comparison is measured in one run on one machine and printed as a ratio of medians, because
absolute times on a shared CPU say little while ratios of neighbouring runs stay meaningful. What
it measures:

* the pass against the raw sequential read of the same bytes from the same files and against the
  projections alone (weights already in memory), page cache warm and cold, at 1 plan and at a full
  50-step request: a pass that overlaps reading with projecting costs about the larger of the two;
* the pass against a naive loop that reads each layer whole into a fresh buffer, then projects,
  at the request size where reading and projecting cost about the same (where overlap matters most);
* a forward step of a tiny MiniMax-H3 with its projections resident, served from the cache, and
  offloaded to disk with diffusers' group offloading;
* ``build()`` latency when every plan of a 50-step request is already resident (the per-request
  hot path), and a store hit against a pass when the store is available;
* memory: projection bytes against slab bytes, and the peak anonymous memory of a pass, measured in
  a child process so the parent's buffers do not count (page cache is file-backed, reported apart).

The checkpoint is generated at the real projection widths (in 2688, out 96768 per block) with
``--layers`` blocks (``--full``: all 50, 24.2 GiB), in the native layout, sharded with an index.
Results go to ``bench/results/`` as JSON, Markdown and a PNG chart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..devices import resolve_device
from ..source import LazyTensor, aligned_empty, pread_into, write_safetensors
from ..spec import FINAL, Layer, ModulationSpec, get_layout
from .bench_tables import bench_tables
from .deploy import proc_status

log = logging.getLogger(__name__)

#: The released geometry: time embedding (projection input) and hidden size (output = 18 x hidden).
REAL_IN = 2688
REAL_HIDDEN = 5376
#: Request of the big comparisons: a 50-step t2va request has 49 distinct plans.
STEPS = 50


# ---------------------------------------------------------------------------------------------
# checkpoint generation


def _random_bf16(shape: tuple[int, ...], seed: int, scale: float) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        out = torch.empty(shape, dtype=torch.bfloat16)
        rows = shape[0]
        step = max(1, (64 << 20) // (4 * max(1, out[0].numel()))) if len(shape) > 1 else rows
        flat = out if len(shape) > 1 else out.view(1, -1)
        for lo in range(0, flat.shape[0], step):
            chunk = flat[lo : lo + step]
            chunk.copy_(torch.randn(chunk.shape, generator=gen) * scale)
        return out

    return make


def generate_checkpoint(spec: ModulationSpec, directory: Path, *, layers_per_shard: int = 10) -> Path:
    """A native-layout sharded checkpoint of ``spec``'s projections; reused when already complete."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / "COMPLETE.json"
    want = {"spec": spec.describe(), "layers_per_shard": layers_per_shard, "version": 1}
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == want:
                return directory
        except (OSError, ValueError):
            pass
    for old in directory.glob("*.safetensors*"):
        old.unlink()
    layout = get_layout("native")
    layers = spec.layers()
    groups = [layers[i : i + layers_per_shard] for i in range(0, len(layers), layers_per_shard)]
    weight_map: dict[str, str] = {}
    scale = 1.0 / spec.time_embed_dim**0.5
    for n, group in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]] = []
        for layer in group:
            seed = 1000 + (spec.num_layers if layer == FINAL else int(layer))
            shape = spec.weight_shape(layer)
            tensors.append((layout.weight(layer), shape, _random_bf16(shape, seed, scale)))
            out = (spec.out_features(layer),)
            tensors.append((layout.bias(layer), out, _random_bf16(out, seed + 7919, 0.1)))
        lazy = {n: LazyTensor(shape, torch.bfloat16, make) for n, shape, make in tensors}
        write_safetensors(lazy, directory / name, metadata={"format": "pt", "generator": "adalncache bench"})
        weight_map.update({t[0]: name for t in tensors})
        log.info("wrote %s", name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    marker.write_text(json.dumps(want))
    return directory


# ---------------------------------------------------------------------------------------------
# primitives measured side by side


def drop_page_cache(files: Sequence[Path]) -> None:
    """Evict ``files`` from the page cache (written back first: only clean pages can be dropped)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tensor_ranges(source: Any) -> list[tuple[Path, int, int]]:
    """(file, offset, nbytes) of every projection tensor, in pass order."""
    out = []
    for layer in source.spec.layers():
        for name in (source.layout.weight(layer), source.layout.bias(layer)):
            header, entry = source.entry(name)
            out.append((header.path, entry.begin, entry.nbytes))
    return out


def read_only(source: Any, buf: torch.Tensor | None = None) -> float:
    """The raw sequential read of the pass's bytes, from the same files, into one reused buffer."""
    ranges = tensor_ranges(source)
    if buf is None:
        buf = read_buffer(source)
    start = time.perf_counter()
    fds = {p: os.open(p, os.O_RDONLY) for p in {p for p, _, _ in ranges}}
    try:
        for path, offset, nbytes in ranges:
            pread_into(fds[path], buf[:nbytes], offset, path, "a projection tensor")
    finally:
        for fd in fds.values():
            os.close(fd)
    return time.perf_counter() - start


def read_buffer(source: Any) -> torch.Tensor:
    """A buffer for :func:`read_only`, its pages faulted in: the cost floor of reading is the copy."""
    buf = torch.empty(max(n for _, _, n in tensor_ranges(source)), dtype=torch.uint8)
    buf.fill_(0)
    return buf


def read_and_project_concurrently(source: Any, resident: Any, xs: Sequence[torch.Tensor]) -> float:
    """Read-only on a thread while project-only runs, with no dependency between them.

    Why: on a machine with few cores the two compete for the same cores and memory bandwidth, so
    even a perfect pipeline cannot reach max(read, project). This is what overlapping them costs
    here, which tells a pipeline's own overhead apart from the machine's limit.
    """
    buf = read_buffer(source)
    reader = threading.Thread(target=read_only, args=(source, buf))
    start = time.perf_counter()
    reader.start()
    resident.project_only(xs)
    reader.join()
    return time.perf_counter() - start


def read_only_direct(source: Any) -> float | None:
    """The same sequential read with O_DIRECT (no page cache copy): the faster raw read when cold.

    Ranges are rounded out to 4096-byte blocks into one page-aligned buffer; None where the
    filesystem refuses O_DIRECT.
    """
    import mmap

    block = 4096
    ranges = tensor_ranges(source)
    spans = [(p, o - o % block, -(-(o % block + n) // block) * block) for p, o, n in ranges]
    buf = mmap.mmap(-1, max(length for _, _, length in spans))
    buf.write(b"\0" * len(buf))  # fault the pages in before timing, as read_only does
    try:
        fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in {p for p, _, _ in spans}}
    except (OSError, AttributeError):
        buf.close()
        return None
    view = memoryview(buf)
    start = time.perf_counter()
    try:
        for path, offset, length in spans:
            done = 0
            while done < length:
                n = min(64 << 20, length - done)
                got = os.preadv(fds[path], [view[done : done + n]], offset + done)
                if got <= 0:
                    break  # the file's end, inside the last block
                done += got
    finally:
        for fd in fds.values():
            os.close(fd)
        seconds = time.perf_counter() - start
        view.release()
        buf.close()
    return seconds


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer around it measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(inputs: dict[tuple[int, ...], torch.Tensor] | Sequence[torch.Tensor]) -> torch.device:
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    return values[0].device if values else torch.device("cpu")


class ResidentLayer:
    """One block's and the output layer's weights held in memory, for the project-only baseline.

    Every block has the same shape, so projecting block 0's weight once per block costs what
    projecting each block's own weight costs (496 MiB never fits a cache), without holding 24 GiB.
    """

    def __init__(self, source: Any, device: torch.device | str = "cpu") -> None:
        self.spec = source.spec
        self.device = torch.device(device)
        self.tensors: dict[Layer, tuple[torch.Tensor, torch.Tensor]] = {}
        for lw in source.stream([0, FINAL]):
            self.tensors[lw.layer] = (lw.weight.clone().to(self.device), lw.bias.clone().to(self.device))

    def project_only(self, xs: Sequence[torch.Tensor]) -> float:
        sync_device(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            for layer in self.spec.layers():
                weight, bias = self.tensors[FINAL if layer == FINAL else 0]
                for x in xs:
                    F.linear(x, weight, bias)
        sync_device(self.device)
        return time.perf_counter() - start


def naive(source: Any, xs: Sequence[torch.Tensor]) -> float:
    """Read each layer whole into a fresh buffer, then project every plan: no overlap, no reuse.

    On a GPU each layer is copied to the device (pageable, blocking) before it is projected.
    """
    spec, layout = source.spec, source.layout
    device = _device_of(xs)
    start = time.perf_counter()
    fds: dict[Path, int] = {}
    try:
        with torch.no_grad():
            for layer in spec.layers():
                parts = []
                for name in (layout.weight(layer), layout.bias(layer)):
                    header, entry = source.entry(name)
                    fd = fds.get(header.path)
                    if fd is None:
                        fd = fds[header.path] = os.open(header.path, os.O_RDONLY)
                    # Same address modulo 64 as the file offset, as the real pass keeps it.
                    view = aligned_empty((entry.nbytes,), torch.uint8, entry.begin)
                    pread_into(fd, view, entry.begin, header.path, name)
                    parts.append(view.view(torch.bfloat16).view(entry.shape).to(device))
                weight, bias = parts
                for x in xs:
                    F.linear(x, weight, bias)
                del parts, weight, bias
        sync_device(device)
    finally:
        for fd in fds.values():
            os.close(fd)
    return time.perf_counter() - start


def make_inputs(
    spec: ModulationSpec, plans: Sequence[torch.Tensor], device: torch.device | str = "cpu"
) -> dict[tuple[int, ...], torch.Tensor]:
    """A deterministic projection input per plan, on ``device``: ``silu(temb).to(bf16)`` stand-ins."""
    from ..plans import plan_key

    out = {}
    for n, plan in enumerate(plans):
        key = plan_key(plan)
        if key not in out:
            gen = torch.Generator().manual_seed(n)
            x = F.silu(torch.randn(plan.numel(), spec.time_embed_dim, generator=gen)).to(spec.dtype)
            out[key] = x.to(device)
    return out


def request_plans(steps: int = STEPS) -> list[torch.Tensor]:
    """The distinct plans of a ``steps``-step t2va request (diffusers' own schedule when available)."""
    from ..plans import distinct_plans

    try:
        from ..plans import minimax_h3_plans

        plans = minimax_h3_plans("t2va", steps)
    except Exception as exc:  # diffusers absent: the same shape of request, synthetic values
        log.warning("minimax_h3_plans unavailable (%s); using synthetic width-2 plans", exc)
        plans = [torch.tensor([1.0 - i / steps, 1.0 - i / (2 * steps)]) for i in range(steps - 1)]
    order, tensors = distinct_plans(plans)
    return [tensors[k] for k in order]


def one_pass(
    source: Any,
    plans: Sequence[torch.Tensor],
    inputs: dict[tuple[int, ...], torch.Tensor],
    *,
    fresh: bool = False,
    batched: bool = False,
    settle: Callable[[], None] | None = None,
) -> float:
    """The real thing: a fresh cache's ``build`` of ``plans`` (one rebuild pass), timed.

    By default the source keeps its read buffers between passes (``keep_buffers``, the library's
    default), so this is a serving process's steady state: if the source holds no pool yet, an
    untimed pass fills it first, then ``settle`` runs (the cold runs drop the page cache again
    there, so the priming pass cannot warm it). ``fresh``: the source allocates new buffers for
    this pass and frees them after (``keep_buffers=False``), which is what the first pass of a
    process costs.
    """
    from ..cache import AdalnCache
    from ..plans import plan_key

    device = _device_of(inputs)  # the cache lives where the inputs do

    def build(todo: Sequence[torch.Tensor]) -> float:
        cache = AdalnCache(
            source.spec, source, max_plans=len(todo), max_plan_width=4, progress=False, batched=batched,
            device=device,
        )  # fmt: skip
        sync_device(device)
        start = time.perf_counter()
        report = cache.build(list(todo), embed=lambda p: inputs[plan_key(p)])
        sync_device(device)
        seconds = time.perf_counter() - start
        assert report.passes == 1 and report.built == len(todo)
        return seconds

    source.keep_buffers = not fresh
    if fresh:
        source.release_buffers()
    elif source.kept_bytes == 0:
        build(plans[:1])
        if settle is not None:
            settle()
    return build(plans)


def batched_exactness(
    source: Any, plans: Sequence[torch.Tensor], inputs: dict[tuple[int, ...], torch.Tensor]
) -> dict[str, Any]:
    """Build ``plans`` per plan and batched, from scratch (probe included), and compare the slabs bitwise."""
    from ..batching import clear_verdicts
    from ..cache import AdalnCache
    from ..plans import plan_key

    clear_verdicts()  # a new process's view: the batched build probes every shape class again
    built = {}
    reports = {}
    for batched in (False, True):
        cache = AdalnCache(
            source.spec, source, max_plans=len(plans), max_plan_width=4, progress=False, batched=batched,
            device=_device_of(inputs),
        )  # fmt: skip
        reports[batched] = cache.build(list(plans), embed=lambda p: inputs[plan_key(p)])
        built[batched] = {plan_key(p): cache.rows_of(plan_key(p)) for p in plans}
    per_plan, stacked = built[False], built[True]
    same = all(
        torch.equal(per_plan[k].block, stacked[k].block) and torch.equal(per_plan[k].final, stacked[k].final)
        for k in per_plan
    )
    report = reports[True]
    return {
        "bit_identical": same, "stacked_layers": report.stacked_layers, "per_plan_layers": report.per_plan_layers,
        "first_batched_pass_s": report.seconds, "per_plan_pass_s": reports[False].seconds,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class Comparison:
    """``name``: ``subject`` against ``baseline`` (medians of ``runs`` samples each), with a target."""

    name: str
    subject: str
    baseline: str
    subject_s: list[float]
    baseline_s: list[float]
    target: float | None = None
    note: str = ""
    unit: str = "s"

    @property
    def ratio(self) -> float:
        return statistics.median(self.subject_s) / statistics.median(self.baseline_s)

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "subject": self.subject,
            "baseline": self.baseline,
            "subject_median_s": statistics.median(self.subject_s),
            "baseline_median_s": statistics.median(self.baseline_s),
            "subject_s": self.subject_s,
            "baseline_s": self.baseline_s,
            "ratio": self.ratio,
            "target": self.target,
            "met": self.met,
            "note": self.note,
            "unit": self.unit,
        }

    def fmt(self, samples: list[float]) -> str:
        value = statistics.median(samples)
        return f"{value / 2**20:.0f} MiB" if self.unit == "bytes" else _fmt_s(value)

    def line(self) -> str:
        target = "" if self.target is None else f"  (target <= {self.target:g}: {'met' if self.met else 'MISSED'})"
        return (
            f"{self.name}: {self.subject} {self.fmt(self.subject_s)} / {self.baseline} "
            f"{self.fmt(self.baseline_s)} = {self.ratio:.3f}x{target}" + (f"  [{self.note}]" if self.note else "")
        )


def _fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


@dataclass
class Results:
    config: dict[str, Any]
    comparisons: list[Comparison] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, comparison: Comparison) -> Comparison:
        self.comparisons.append(comparison)
        print(comparison.line(), flush=True)
        return comparison

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", flush=True)

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "comparisons": [c.as_dict() for c in self.comparisons],
            "values": self.values,
            "notes": self.notes,
        }


def _median_runs(fn: Callable[[], float], runs: int, before: Callable[[], None] | None = None) -> list[float]:
    out = []
    for _ in range(runs):
        if before is not None:
            before()
        out.append(fn())
    return out


# ---------------------------------------------------------------------------------------------
# sections


def bench_pass(
    res: Results, source: Any, plans: list[torch.Tensor], runs: int, cold: bool, device: torch.device
) -> None:
    """Pass vs read-only vs project-only (warm, cold) at 1 and all plans; pass vs naive at the crossover.

    The variants run interleaved, round by round, so a neighbour's load on a shared machine hits
    them alike instead of skewing whichever block happened to run during it.
    """
    inputs = make_inputs(source.spec, plans, device)
    resident = ResidentLayer(source, device)
    files = list(source.files)
    states: list[tuple[str, Callable[[], None] | None]] = [("warm", None)]
    if cold:
        states.append(("cold", lambda: drop_page_cache(files)))
    sizes = sorted({1, len(plans)})
    xs_of = {k: [inputs[key] for key in _keys(plans[:k])] for k in sizes}

    def rounds(variants: dict[str, Callable[[], float]], before: Callable[[], None] | None) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(runs):
            for name, fn in variants.items():
                if before is not None:
                    before()
                out[name].append(fn())
        return out

    for state, before in states:
        if before is None:
            read_only(source)  # warm: the page cache holds every byte from here on (if memory allows)
        variants: dict[str, Callable[[], float]] = {"read": lambda: read_only(source)}
        direct_ok = state == "cold" and read_only_direct(source) is not None
        if direct_ok:
            # Cold, the pass reads with O_DIRECT, so the raw-read bound is the faster of the two.
            variants["readdirect"] = lambda: read_only_direct(source) or 0.0
        for k in sizes:
            variants[f"project{k}"] = lambda k=k: resident.project_only(xs_of[k])  # type: ignore[misc]
            variants[f"pass{k}"] = lambda k=k, b=before: one_pass(source, plans[:k], inputs, settle=b)  # type: ignore[misc]
        # The first pass of a process (or every pass with keep_buffers=False) also pays the first
        # touch of its staging buffers: with few layers that fixed cost dominates, so it is
        # measured on its own.
        variants["pass1fresh"] = lambda: one_pass(source, plans[:1], inputs, fresh=True)
        variants["concurrent1"] = lambda: read_and_project_concurrently(source, resident, xs_of[1])
        top = sizes[-1]
        variants[f"batched{top}"] = lambda b=before: one_pass(source, plans, inputs, batched=True, settle=b)  # type: ignore[misc]
        if before is None:
            exact = batched_exactness(source, plans, inputs)
            res.values["batched"] = exact
            log.info("batched vs per-plan build: %s", exact)
        got = rounds(variants, before)
        res.values[f"pass_{state}_s"] = {str(k): got[f"pass{k}"] for k in sizes}
        res.values[f"pass_fresh_buffers_{state}_s"] = {"1": got["pass1fresh"]}
        res.values[f"pass_batched_{state}_s"] = {str(top): got[f"batched{top}"]}
        reads = got["read"]
        res.values[f"read_only_{state}_s"] = reads
        read_kind = "read-only"
        if direct_ok:
            res.values[f"read_only_direct_{state}_s"] = got["readdirect"]
            if statistics.median(got["readdirect"]) < statistics.median(reads):
                reads, read_kind = got["readdirect"], "read-only (O_DIRECT)"
        res.values[f"project_only_{state}_s"] = {str(k): got[f"project{k}"] for k in sizes}
        for k in sizes:
            project = got[f"project{k}"]
            read_bound = statistics.median(reads) >= statistics.median(project)
            base = reads if read_bound else project
            res.add(
                Comparison(
                    f"pass vs max(read, project), {k} plan(s), {state}",
                    "pass",
                    read_kind if read_bound else "project-only",
                    got[f"pass{k}"],
                    base,
                    1.15,
                    note=f"read {_fmt_s(statistics.median(reads))}, project {_fmt_s(statistics.median(project))}",
                )
            )
            if k == 1:
                res.add(
                    Comparison(
                        f"first pass (fresh buffers) vs max(read, project), 1 plan(s), {state}",
                        "pass, fresh buffers",
                        read_kind if read_bound else "project-only",
                        got["pass1fresh"],
                        base,
                        1.15,
                        note="keep_buffers=False, or a process's first pass: staging buffers faulted in",
                    )
                )
                res.add(
                    Comparison(
                        f"pass vs read and project run concurrently (no pipeline), 1 plan(s), {state}",
                        "pass",
                        "read || project",
                        got[f"pass{k}"],
                        got["concurrent1"],
                        None,
                        note="the overlap this machine allows: read-only on a thread while project-only runs",
                    )
                )
        res.add(
            Comparison(
                f"batched pass vs per-plan pass, {top} plan(s), {state}",
                "pass, batched=True",
                "pass",
                got[f"batched{top}"],
                got[f"pass{top}"],
                None,
                note="plans of one width stacked into one GEMM where the probe proved the bits equal; slabs "
                f"torch.equal to per-plan: {res.values['batched']['bit_identical']} "
                f"({res.values['batched']['stacked_layers']} stacked, {res.values['batched']['per_plan_layers']} "
                f"per-plan layer groups in a new process's first pass)",
            )
        )
        # Crossover: project-only grows linearly in the plans (one GEMM per plan and layer), so the
        # request size where it meets read-only is interpolated from the two measured sizes, then
        # measured for real.
        first = statistics.median(got[f"project{sizes[0]}"])
        per_plan = (statistics.median(got[f"project{sizes[-1]}"]) - first) / max(1, sizes[-1] - 1)
        read_s = statistics.median(reads)
        best = min(range(1, len(plans) + 1), key=lambda k: abs((first + (k - 1) * per_plan) - read_s))
        xs = [inputs[key] for key in _keys(plans[:best])]
        cross = rounds(
            {
                "read": lambda: read_only(source),
                "project": lambda xs=xs: resident.project_only(xs),  # type: ignore[misc]
                "naive": lambda xs=xs: naive(source, xs),  # type: ignore[misc]
                "pass": lambda best=best, b=before: one_pass(  # type: ignore[misc]
                    source, plans[:best], inputs, settle=b
                ),
            },
            before,
        )
        res.values[f"crossover_{state}"] = {
            "plans": best, "read_only_s": statistics.median(cross["read"]),
            "project_only_s": statistics.median(cross["project"]),
        }  # fmt: skip
        res.add(
            Comparison(
                f"pass vs naive, {best} plan(s) (read ~ project here), {state}",
                "pass",
                "naive",
                cross["pass"],
                cross["naive"],
                0.75,
                note=f"read {_fmt_s(statistics.median(cross['read']))}, "
                f"project {_fmt_s(statistics.median(cross['project']))}",
            )
        )


def _keys(plans: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    from ..plans import plan_key

    return [plan_key(p) for p in plans]


def bench_forward(res: Results, size: str, steps: int, runs: int, device: torch.device) -> None:
    """Per-step forward of a tiny MiniMax-H3: resident vs cached vs group offloading.

    On a CPU, offloading to the CPU would be a no-op, so the projections go to disk
    (``offload_to_disk_path``); on a GPU they are offloaded to host memory.
    """
    try:
        from diffusers.hooks import apply_group_offloading

        from ..diffusers import enable_adaln_cache
        from ..plans import plan_key
        from .tiny import make_request, run_loop, tiny_transformer
    except ImportError as exc:
        res.note(f"forward comparison skipped: diffusers unavailable ({exc})")
        return

    # Three instances of the same seeded model, run round-robin (noise hits all three alike).
    model: Any = tiny_transformer(size).to(device)
    request = make_request(model, "t2va", steps, device=device)
    cached_model: Any = tiny_transformer(size).to(device)
    distinct = len({plan_key(p) for p in request.plans})
    handle: Any = enable_adaln_cache(cached_model, max_plans=distinct, max_plan_width=4)
    off_model: Any = tiny_transformer(size).to(device)
    on_gpu = device.type == "cuda"
    offload_to = "host" if on_gpu else "disk"
    samples: dict[str, list[float]] = {"resident": [], "cached": [], "offload": []}
    outs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="adalncache-offload-") as tmp:
        modules = [(f"block{n}", b.adaln_proj) for n, b in enumerate(off_model.transformer_blocks)]
        for name, module in [*modules, ("norm_out", off_model.norm_out)]:
            where: dict[str, Any] = (
                {"offload_device": torch.device("cpu")} if on_gpu else {"offload_to_disk_path": os.path.join(tmp, name)}
            )
            apply_group_offloading(module, onload_device=device, offload_type="leaf_level", **where)
        try:
            handle.prepare(request.plans)
            variants = (("resident", model), ("cached", cached_model), ("offload", off_model))
            # Exactness from the real denoising loop, once per variant (this also warms them up).
            for name, which in variants:
                outs[name] = run_loop(which, request)
            # Timing interleaved step by step (the three variants within milliseconds of each other),
            # on the request's own per-step inputs.
            with torch.no_grad():
                for _ in range(max(runs, 1) * 2):
                    for step in range(len(request.plan)):
                        kwargs = request.forward_kwargs(step, request.latents, request.audio_latents)
                        for name, which in variants:
                            sync_device(device)
                            started = time.perf_counter()
                            which(**kwargs)
                            sync_device(device)
                            samples[name].append(time.perf_counter() - started)
        finally:
            handle.disable()
    resident_s, cached_s, offload_s = samples["resident"], samples["cached"], samples["offload"]
    resident_out, cached_out, offload_out = outs["resident"], outs["cached"], outs["offload"]
    exact = bool(resident_out.equal(cached_out))
    res.values["forward"] = {
        "size": size, "steps": steps, "cached_bit_identical": exact, "device": str(device),
        "offload_to": offload_to, "offload_bit_identical": bool(resident_out.equal(offload_out)),
    }  # fmt: skip
    res.add(
        Comparison(
            f"forward step, tiny '{size}'",
            "cached",
            "resident",
            cached_s,
            resident_s,
            1.0,
            note=f"torch.equal outputs: {exact}",
        )
    )
    res.add(Comparison(f"forward step, tiny '{size}'", "cached", f"group offload ({offload_to})", cached_s, offload_s))


def bench_build_latency(res: Results, runs: int, directory: Path, device: torch.device) -> None:
    """The hit path: ``build()`` and ``resolve_slots()`` of a fully resident request, 49 and 10 plans.

    Uses a 50-layer, 8-shard checkpoint at tiny widths: the hit path's cost is keying the plans,
    checking the source's identity and touching the LRU, none of which depends on the projection
    widths. Where an installed SGLang provides its ``MiniMaxH3AdalnCache``, that cache is built over
    the same files with the same plans and inputs and timed in the same loop
    (:mod:`adalncache.tools.hitpath`).
    """
    from ..cache import AdalnCache
    from ..plans import plan_key
    from ..source import CheckpointSource
    from . import hitpath

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
    baseline = hitpath.SglangBaseline.open(
        files, num_layers=spec.num_layers, hidden_size=spec.hidden_size, max_plans=64, device=device
    )
    theirs: hitpath.SglangBaseline | None = None
    if isinstance(baseline, str):
        res.note(f"SGLang baseline not available: {baseline}")
    else:
        baseline.cache.build(plans, embed=embed)  # its own rebuild pass, from the same files
        same = hitpath.tables_identical(cache, baseline, plans)
        res.note(f"SGLang {baseline.version} baseline: same checkpoint, plans and inputs; tables bit-identical: {same}")
        theirs = baseline
    requests = {len(plans): plans, 10: plans[:10]}
    timings = hitpath.measure(cache, theirs, requests, embed, max(runs, 1) * 100, device)
    label = f"SGLang {theirs.version}" if theirs is not None else "SGLang"
    table = hitpath.format_table(timings, label)
    print(f"hit path of a fully resident request (median of {len(timings[0].ours)} calls each):\n{table}", flush=True)
    res.values["hit_path"] = {
        "baseline": theirs.version if theirs is not None else baseline, "rows": [t.row() for t in timings],
        "table": table, "files": len(source.files),
    }  # fmt: skip
    for t in timings:
        per_plan = f"{statistics.median(t.ours) / t.plans * 1e6:.2f} us per plan"
        if t.theirs is not None:
            res.add(
                Comparison(
                    f"hit path, {t.plans} plans: {t.call}", "adalncache", label, t.ours, t.theirs, 1.0,
                    note=f"{per_plan} vs {statistics.median(t.theirs) / t.plans * 1e6:.2f} us per plan",
                )
            )  # fmt: skip
        if t.call == "build()" and t.plans == len(plans):
            res.add(
                Comparison(
                    f"build() of a fully resident {t.plans}-plan request", "build()", "1 ms", t.ours, [1e-3], 1.0,
                    note=f"{per_plan}; the hit path stats none of the {len(source.files)} checkpoint files",
                )
            )  # fmt: skip


def bench_store(res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
    """A store hit against a pass, when the real store is there."""
    from ..tiers import store as store_mod

    if not hasattr(store_mod.Store, "get_many") or not hasattr(store_mod.Store, "put"):
        res.note("store hit vs pass skipped: adalncache.tiers.store.Store is still a placeholder")
        return
    from ..cache import AdalnCache
    from ..plans import plan_key

    inputs = make_inputs(source.spec, plans, device)
    with tempfile.TemporaryDirectory(prefix="adalncache-bench-store-") as tmp:
        try:
            first = AdalnCache(
                source.spec, source, max_plans=len(plans), max_plan_width=4, store=tmp, progress=False, device=device
            )
            first.build(plans, embed=lambda p: inputs[plan_key(p)])
            hits = []
            for _ in range(runs):
                cache = AdalnCache(
                    source.spec, source, max_plans=len(plans), max_plan_width=4, store=tmp, progress=False,
                    device=device,
                )  # fmt: skip
                start = time.perf_counter()
                report = cache.build(plans, embed=lambda p: inputs[plan_key(p)])
                sync_device(device)
                hits.append(time.perf_counter() - start)
                if report.store_hits != len(plans):
                    res.note(f"store run hit {report.store_hits} of {len(plans)} plans")
        except Exception as exc:  # the store is another issue's work: report, do not fail the bench
            res.note(f"store hit vs pass skipped: {type(exc).__name__}: {exc}")
            return
    # The pass of the same request was measured (warm) in the pass section of this run.
    measured = res.values.get("pass_warm_s", {}).get(str(len(plans)))
    passes = measured or _median_runs(lambda: one_pass(source, plans, inputs), runs)
    res.add(Comparison(f"store hit vs pass, {len(plans)} plans", "store hit", "pass", hits, passes))


_PROBE = r"""
import json, sys, threading, time
args = json.loads(sys.argv[1])
from adalncache.tools.bench import _probe_pass
print(json.dumps(_probe_pass(args)))
"""


_status = proc_status  # the resident-memory reading the deploy section's probes share


def _probe_pass(args: dict[str, Any]) -> dict[str, Any]:
    """Child process: one pass, sampling RssAnon every millisecond (the kernel keeps no anon peak)."""
    from ..cache import AdalnCache
    from ..plans import plan_key
    from ..source import CheckpointSource

    spec = ModulationSpec(**args["spec"])
    source = CheckpointSource(args["checkpoint"], spec)
    plans = request_plans(STEPS)[: args["plans"]]
    device = torch.device(args.get("device", "cpu"))
    inputs = make_inputs(spec, plans, device)
    baseline = _status()
    cache = AdalnCache(spec, source, max_plans=len(plans), max_plan_width=4, progress=False, device=device)
    cache.block_params.fill_(0)  # touch the slab so it is counted before the pass
    with_slab = _status()
    peak = [with_slab["RssAnon"]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status()["RssAnon"])
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        cache.build(plans, embed=lambda p: inputs[plan_key(p)])
    finally:
        stop.set()
        sampler.join()
    after = _status()
    peak[0] = max(peak[0], after["RssAnon"])
    kept = source.release_buffers()  # what keep_buffers (the default) holds between passes
    return {
        "baseline": baseline, "with_slab": with_slab, "after": after, "peak_rss_anon": peak[0],
        "slab_bytes": cache.slab_bytes, "kept_between_passes_bytes": kept, "after_release": _status(),
    }  # fmt: skip


def bench_memory(res: Results, source: Any, plans: list[torch.Tensor], checkpoint: Path, device: torch.device) -> None:
    """Projection bytes vs slab bytes, and the peak anonymous memory of a pass (child process)."""
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
    meminfo_before = _meminfo()
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(probe_args)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        res.note(f"memory probe failed: {proc.stderr.strip().splitlines()[-1:]}")
        return
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    layer = spec.layer_bytes(0)
    pass_anon = probe["peak_rss_anon"] - probe["baseline"]["RssAnon"]
    budget = probe["slab_bytes"] + 3 * layer
    res.values["memory"].update({
        "probe": probe, "pass_peak_anon_over_baseline": pass_anon, "budget_slab_plus_3_layers": budget,
        "layer_bytes": layer, "page_cache_delta_bytes": _meminfo()["Cached"] - meminfo_before["Cached"],
        "kept_between_passes_bytes": probe["kept_between_passes_bytes"],
    })  # fmt: skip
    res.add(
        Comparison(
            f"peak anonymous memory of a {n}-plan pass",
            "peak RssAnon - baseline",
            "slab + 3 layers",
            [float(pass_anon)],
            [float(budget)],
            1.0,
            note=f"slab {probe['slab_bytes'] / 2**20:.0f} MiB, layer {layer / 2**20:.0f} MiB, peak over baseline "
            f"{pass_anon / 2**20:.0f} MiB = slab + {(pass_anon - probe['slab_bytes']) / layer:.2f} layers; "
            f"VmHWM {probe['after']['VmHWM'] / 2**20:.0f} MiB, RssFile {probe['after']['RssFile'] / 2**20:.0f} MiB; "
            f"kept between passes (keep_buffers): {probe['kept_between_passes_bytes'] / 2**20:.0f} MiB",
            unit="bytes",
        )
    )


def bench_deploy(res: Results, size: str, steps: int, *, quick: bool = False) -> None:
    """Deploying without the projections, on a tiny MiniMax-H3 of ``size`` in the released precision.

    Side by side: the peak resident memory of load + enable + one request, ``from_pretrained``
    then ``enable_adaln_cache`` against ``load_transformer``, each in a fresh process; the bytes the
    load reads from the checkpoint (page cache dropped first); the bytes block-level group
    offloading onloads per forward with and without the cache. Then the released geometry as
    arithmetic: what a 24, 48 and 80 GB card must hold either way. ``quick`` leaves out the stock
    load served from its checkpoint (one fresh process less).
    """
    try:
        from diffusers.hooks import apply_group_offloading
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

        from ..diffusers import adaln_cache_handle, load_transformer
        from .deploy import (
            MODES,
            OnloadMeter,
            card_table,
            onloaded_per_step,
            released_sizes,
            request_slab_bytes,
            run_memory_probe,
            served_bytes,
            weight_files,
        )
        from .tiny import make_request, run_loop, tiny_transformer
    except ImportError as exc:
        res.note(f"deploy section skipped: diffusers unavailable ({exc})")
        return
    values: dict[str, Any] = {"size": size}
    with tempfile.TemporaryDirectory(prefix="adalncache-deploy-") as tmp:
        checkpoint = Path(tmp) / "transformer"
        built: Any = tiny_transformer(size)
        built.save_pretrained(Path(tmp) / "fp32")
        # The released mixed precision in the file: bf16 blocks and projections, fp32 time embedder and heads.
        mixed: Any = MiniMaxH3Transformer3DModel.from_pretrained(Path(tmp) / "fp32", torch_dtype=torch.bfloat16)
        mixed.save_pretrained(checkpoint)
        del built, mixed
        served, total = served_bytes(weight_files(checkpoint))
        modes = [mode for mode in MODES if not (quick and mode == "stock-checkpoint")]
        probes = {mode: run_memory_probe(mode, checkpoint, steps=steps) for mode in modes}
        values.update({"served_bytes": served, "checkpoint_bytes": total, "probes": probes})
        new = probes["load_transformer"]
        for stock_mode, label in (("stock", "its own weights"), ("stock-checkpoint", "checkpoint=")):
            if stock_mode not in probes:
                continue
            stock = probes[stock_mode]
            res.add(
                Comparison(
                    f"peak resident memory of load + enable + one t2va request, '{size}' (fresh processes)",
                    "load_transformer", f"from_pretrained + enable_adaln_cache({label})",
                    [float(new["peak"])], [float(stock["peak"])], None,
                    note=f"anonymous {new['anon'] / 2**20:.0f} vs {stock['anon'] / 2**20:.0f} MiB, file-backed "
                    f"{new['file'] / 2**20:.0f} vs {stock['file'] / 2**20:.0f} MiB; served tensors "
                    f"{served / 2**20:.0f} MiB of {total / 2**20:.0f} MiB",
                    unit="bytes",
                )
            )  # fmt: skip
        stock = probes["stock"]
        if new["load_read_bytes"] is not None and stock["load_read_bytes"]:
            res.add(
                Comparison(
                    f"checkpoint bytes read by the load, '{size}' (page cache dropped)",
                    "load_transformer", "from_pretrained", [float(new["load_read_bytes"])],
                    [float(stock["load_read_bytes"])], None,
                    note=f"served tensors' pages cached by the load: {new['served_resident_after_load']} B vs "
                    f"{stock['served_resident_after_load'] / 2**20:.1f} MiB",
                    unit="bytes",
                )
            )  # fmt: skip
        # Bytes onloaded per forward by block-level group offloading (CPU to CPU: the bytes, not the time).
        cpu = torch.device("cpu")
        onloads: dict[str, float] = {}
        for name in ("without", "with"):
            if name == "without":
                model: Any = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint, torch_dtype=torch.bfloat16)
            else:
                model = load_transformer(checkpoint, torch_dtype=torch.bfloat16)
            apply_group_offloading(
                model, onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1
            )
            request = make_request(model, "t2va", steps)
            if name == "with":
                handle: Any = adaln_cache_handle(model)
                handle.prepare(request.plans)
            meter = OnloadMeter(model)
            run_loop(model, request)
            onloads[name] = meter.bytes / len(request.plan)
            del model
        values["onloaded_per_forward"] = onloads
        res.add(
            Comparison(
                f"bytes onloaded per forward by group offloading (block level, 1 block per group), '{size}'",
                "with the cache", "without", [onloads["with"]], [onloads["without"]], None,
                note="the projections and the time embedder are never onloaded",
                unit="bytes",
            )
        )  # fmt: skip
    sizes = released_sizes()
    slab = request_slab_bytes()
    table = card_table(sizes, slab)
    stock_step, cached_step = onloaded_per_step(sizes)
    values.update(
        {"released_sizes": sizes, "card_table": table, "released_onloaded_per_step": [stock_step, cached_step]}
    )
    res.values["deploy"] = values
    weights = sum(sizes[k] for k in ("projections", "time_embedder", "blocks_rest", "other"))
    res.note(
        f"released MiniMax-H3 (arithmetic, not measurement): weights {weights / 2**30:.1f} GiB, projections "
        f"{sizes['projections'] / 2**30:.1f} GiB; per block {sizes['block_rest'] / 2**20:.0f} MiB + "
        f"{sizes['block_projection'] / 2**20:.0f} MiB of projection; block-level group offloading moves "
        f"{stock_step / 2**30:.1f} GiB per step without the cache, {cached_step / 2**30:.1f} GiB with it; the "
        f"slab for a 50-step t2va request holds {slab / 2**30:.2f} GiB"
    )
    for row in table:
        fits = ", ".join(
            f"{card}: {'yes' if row[card][0] else 'no'}/{'yes' if row[card][1] else 'no'}"
            for card in ("24 GB", "48 GB", "80 GB")
        )
        res.note(
            f"released, {row['mode']} (arithmetic): {row['without_cache_bytes'] / 2**30:.1f} GiB without the cache, "
            f"{row['with_cache_bytes'] / 2**30:.1f} GiB with it; fits without/with: {fits}"
        )


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


# ---------------------------------------------------------------------------------------------
# output


def write_outputs(res: Results, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(res.as_dict(), indent=2, default=str))
    md = ["# adalncache bench", "", f"Command: `{res.config['command']}`", "",
          f"Machine: {res.config['machine']}", "",
          "| comparison | subject | baseline | subject median | baseline median | ratio | target | met |",
          "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in res.comparisons:
        md.append(
            f"| {c.name} | {c.subject} | {c.baseline} | {c.fmt(c.subject_s)} | "
            f"{c.fmt(c.baseline_s)} | {c.ratio:.3f} | "
            f"{'' if c.target is None else f'<= {c.target:g}'} | "
            f"{'' if c.met is None else ('yes' if c.met else 'NO')} |"
        )
    md.append("")
    for c in res.comparisons:
        if c.note:
            md.append(f"- {c.name}: {c.note}")
    for text in res.notes:
        md.append(f"- note: {text}")
    hit = res.values.get("hit_path")
    if hit:
        md += ["", "Hit path of a fully resident request (median per call):", "", "```", hit["table"], "```"]
    mem = res.values.get("memory")
    if mem:
        md += ["", "Memory:", "",
               f"- projection bytes (this geometry): {mem['projection_bytes'] / 2**30:.2f} GiB; slab for the request: "
               f"{mem['slab_bytes_request'] / 2**20:.1f} MiB",
               f"- full MiniMax-H3: projections {mem['full_model_projection_bytes'] / 2**30:.2f} GiB; slab for a "
               f"50-step request {mem['full_model_slab_bytes_request'] / 2**30:.2f} GiB; default 64x4 slab "
               f"{mem['full_model_slab_bytes_default_64x4'] / 2**30:.2f} GiB"]  # fmt: skip
        if "page_cache_delta_bytes" in mem:
            md.append(
                f"- page cache (file-backed, not anonymous) grew by {mem['page_cache_delta_bytes'] / 2**20:.0f} "
                "MiB during the memory probe"
            )
    md_path = out_dir / "bench.md"
    md_path.write_text("\n".join(md) + "\n")
    paths = [json_path, md_path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(12, 0.55 * len(res.comparisons) + 1.5))
        names = [textwrap.fill(f"{c.name}: {c.subject} / {c.baseline}", 56) for c in res.comparisons]
        ratios = [c.ratio for c in res.comparisons]
        colors = ["tab:gray" if c.met is None else ("tab:green" if c.met else "tab:red") for c in res.comparisons]
        ax.barh(range(len(names)), ratios, color=colors)
        for i, c in enumerate(res.comparisons):
            ax.annotate(f"{c.ratio:.2f}", (c.ratio, i), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=7)  # fmt: skip
            if c.target is not None:
                ax.plot([c.target, c.target], [i - 0.4, i + 0.4], color="black", linewidth=1)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ratio of medians (lower is better; black tick = target)")
        fig.tight_layout()
        png = out_dir / "bench.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        paths.append(png)
    except ImportError:
        res.note("matplotlib unavailable: no chart")
    return paths


# ---------------------------------------------------------------------------------------------
# command line


def run(args: argparse.Namespace) -> int:
    from ..source import CheckpointSource

    torch.manual_seed(0)
    device = resolve_device(args.device)
    hidden = args.hidden if args.hidden else REAL_HIDDEN
    in_features = args.in_features if args.in_features else REAL_IN
    layers = 50 if args.full else args.layers
    runs = args.runs if args.runs else (1 if args.quick else 3)
    spec = ModulationSpec(num_layers=layers, hidden_size=hidden, time_embed_dim=in_features)
    work = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "adalncache-bench"
    ckpt_dir = work / f"ckpt-{layers}x{hidden}x{in_features}"
    source: Any = None
    if set(args.only) & {"pass", "store", "memory", "tables"}:  # the others bring their own small checkpoints
        print(
            f"checkpoint: {ckpt_dir} ({spec.projection_bytes / 2**30:.2f} GiB of projections, {layers} blocks + final)",
            flush=True,
        )
        generate_checkpoint(spec, ckpt_dir)
        source = CheckpointSource(ckpt_dir, spec)
    plans = request_plans(STEPS)
    if args.plans:
        plans = plans[: args.plans]
    res = Results(config={
        "command": " ".join(["adalncache bench", *args.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "spec": spec.describe(), "runs": runs, "plans": len(plans), "checkpoint": str(ckpt_dir),
        "files": len(source.files) if source is not None else None, "read_ahead": 1, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    })  # fmt: skip
    sections: dict[str, Callable[[], None]] = {
        "pass": lambda: bench_pass(res, source, plans, runs, cold=not args.no_cold, device=device),
        "forward": lambda: bench_forward(res, args.size, 3 if args.quick else 8, runs, device),
        "build": lambda: bench_build_latency(res, runs, work / "ckpt-latency-50x8x16", device),
        "store": lambda: bench_store(res, source, plans, runs, device),
        "memory": lambda: bench_memory(res, source, plans, ckpt_dir, device),
        "deploy": lambda: bench_deploy(res, args.size, 3 if args.quick else 4, quick=args.quick),
        "tables": lambda: _bench_tables(res, source, plans, runs, device),
    }
    for name, section in sections.items():
        if name in args.only:
            started = time.perf_counter()
            section()
            res.values.setdefault("section_seconds", {})[name] = time.perf_counter() - started
            write_outputs(res, Path(args.out))  # after every section: a long run leaves partial results
    paths = write_outputs(res, Path(args.out))
    for path in paths:
        print(f"wrote {path}")
    return 0


SECTIONS = ("pass", "forward", "build", "store", "memory", "deploy", "tables")


def _bench_tables(res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
    """Content hashing, store and table-file hits (their own module, :mod:`adalncache.tools.bench_tables`)."""
    inputs = make_inputs(source.spec, plans, device)
    bench_tables(res, source, plans, runs, device, inputs=inputs, compare=Comparison, sync=sync_device)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure the pass, serving and memory side by side (ratios of medians)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--layers", type=int, default=4, help="blocks in the generated checkpoint (default 4)")
    p.add_argument("--full", action="store_true", help="all 50 blocks (24.2 GiB checkpoint on disk)")
    p.add_argument("--hidden", type=int, default=0, help=f"hidden size (default {REAL_HIDDEN}: out = 18 x hidden)")
    p.add_argument("--in-features", type=int, default=0, help=f"projection input width (default {REAL_IN})")
    p.add_argument("--plans", type=int, default=0, help="cap the 50-step request at this many plans")
    p.add_argument("--runs", type=int, default=0, help="samples per measurement (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="one sample each, shorter forward loop (smoke test)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    p.add_argument(
        "--size", default="medium", help="tiny model size for the forward comparison (default medium: real proportions)"
    )
    p.add_argument("--device", default="cpu", help="where the cache and the projections run (default: cpu)")
    p.add_argument("--only", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="sections to run")
    p.add_argument("--dir", default="", help="where checkpoints are generated (default: a temp dir, reused)")
    p.add_argument("--out", default="bench/results", help="output directory (default bench/results)")

    def func(args: argparse.Namespace) -> int:
        args.argv = [a for a in sys.argv[2:]] if len(sys.argv) > 1 and sys.argv[1] == "bench" else []
        return run(args)

    p.set_defaults(func=func)


__all__ = [
    "drop_page_cache",
    "generate_checkpoint",
    "read_only",
    "register",
    "request_plans",
    "run",
    "sync_device",
]
