#!/usr/bin/env python3
"""The device check: the claims only a CUDA device can test, in one short run that always reports.

On any machine with a CUDA GPU and a CUDA build of torch, from the repository root (no install
needed: the script puts this tree's ``src`` first on the path; torch is the only hard
requirement, diffusers only for the demo, which runs last):

    python3 scripts/gpu_check.py

The results go to ``gpu_check_results/gpu_check.json`` (``--out DIR`` for another directory).
``--device cpu`` runs every check a CPU can run, at the widths given; the test suite runs it at
small widths, so the script keeps working on machines without a GPU.

Why it is built this way: a run that dies half way must still say what it found. Every check
runs in its own ``try``; its result is appended to ``gpu_check.json`` (rewritten atomically, so a
kill leaves the previous version) the moment it ends; a watchdog ends a check that hangs and
records which one; checks still to run after ``--deadline`` seconds are reported as skipped, so a
run always finishes with a report. A check that cannot run on this machine (no NCCL, an older
torch) reports ``"skipped"`` with the reason instead of failing. Exactness is ``torch.equal``, and
every timed region is bracketed by ``torch.cuda.synchronize``. The exit status is 0 when no
check failed (skipped ones do not fail), 1 when one did, 2 when the watchdog stopped the run.

The checks, in order (``--only`` takes their names):

* ``environment``: versions, what is importable, the work directory's filesystem and whether it
  takes O_DIRECT (informational);
* ``checkpoint``: a checkpoint at the released widths (``--layers`` blocks of 2688 -> 96768, and
  the output layer) written on this machine, and its tensors loaded onto the device by an
  independent reader, as the reference;
* ``exact-match``, ``exact-fp32``: plans of 1 to 4 timesteps, both precisions, every layer
  ``torch.equal`` to ``F.linear`` on the device;
* ``batched``: the batched mode's slab equals ``F.linear``; the probe's verdicts on this device;
* ``in-place``: a warm pass with ``CheckpointSource(in_place=True)`` and one with ``in_place=False``,
  both exact, timed side by side (on CUDA both stage through the pinned buffer: in place is a CPU
  path, so the check confirms that no byte was taken in place there and the bits are unchanged);
* ``tiled``: ``tiled=True`` and ``tiled=False`` over plans of 1 to 4 timesteps, bf16 and fp32: both
  exact against ``F.linear``, the probe's verdicts (exact, faster) per plan width on this device,
  and the two passes timed side by side (2,048-row tiles; smaller when the layers are narrower);
* ``o-direct``: a cold pass (page cache dropped; where it cannot be dropped, every chunk routed to
  O_DIRECT) into the pinned staging buffer, and one with ``direct_io=False``, both exact;
* ``lagging-consumer``: a projection that sleeps while the reader runs ahead, with the device
  filled so that only a few layers fit: exact, and the peak memory of the pass within budget;
* ``memory``, in a fresh process: reserved device memory and host memory (RSS, torch's pinned
  cache, the package's page-locked bytes where it counts them) over six passes, after
  ``release_buffers()`` and after closing the cache: no growth from pass to pass, memory given back;
* ``stream-publish``: a build on one stream whose last write lands late, read at once on another
  stream with no manual synchronisation: the rows read are the built ones;
* ``stream-evict``: a read queued late on one stream, then a build on another stream that evicts
  the slot read: the read sees the evicted plan's rows;
* ``acquire``: a held plan is neither evicted nor rewritten by a build on another stream, and
  after release an eviction waits for the holder's stream;
* ``threads``: four threads with a CUDA stream each serving random requests through ``acquire``;
  every row exact, invariants hold, no raw exception;
* ``tf32``: the new precision API (``torch.backends.cuda.matmul.fp32_precision = "tf32"``) with a
  store (write, then hit, exact) and the batched mode; after restoring, the store misses;
* ``nccl``, in a fresh process: a one-rank process group (NCCL on CUDA, gloo on CPU),
  ``shard="layers"`` and ``"columns"``, exact;
* ``host-tier``: a plan evicted from the slab comes back from the (pinned) host tier, no pass;
* ``timing``: pass vs read-only vs project-only, 1 and 16 plans, and on CUDA the pass as a ratio of
  the pinned host-to-device copy of the same bytes, the physical limit (informational);
* ``graph-capture``: a prepared request's forward of a tiny MiniMax-H3 captured in one CUDA graph
  (the forward finds its slot on the device, no host read) and replayed: ``torch.equal`` to the
  resident forward; a stray timestep copied into the captured input gives NaN and a
  ``PlanMismatchError`` at ``check_request()``; the right one is exact again (on a CPU: the same
  forwards run eagerly);
* ``first-request``: a first request's prompt encoding + pass + first step, its pass started on a
  background thread before the prompt is encoded (``overlap=True``) against before step 0, for a
  MiniMax-H3 and a Qwen-Image pipeline (the bench's ``first-request`` section, "medium" on CUDA):
  latents ``torch.equal``, and the ratios this device shows;
* ``demo``: ``adalncache demo`` on the device (diffusers' tiny MiniMax-H3, resident vs cached).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import gc
import importlib.util
import io
import json
import logging
import mmap
import os
import platform
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "src" / "adalncache").is_dir():
    sys.path.insert(0, str(ROOT / "src"))  # this tree's package, whatever else is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from adalncache import AdalnCache, CheckpointSource, ModulationSpec, PlanError, plan_key  # noqa: E402
from adalncache.devices import pinned_bytes  # noqa: E402
from adalncache.source.reads import aligned_empty  # noqa: E402
from adalncache.spec import FINAL, Layer  # noqa: E402
from adalncache.tools.bench.primitives import PinnedCopy, read_only  # noqa: E402
from adalncache.tools.bench.workload import generate_checkpoint  # noqa: E402
from adalncache.tools.measure import cached_fraction, drop_page_cache, proc_status  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
log = logging.getLogger("gpu_check")


class Skipped(Exception):
    """A check that cannot run in this tree or on this machine; the reason goes into the JSON."""


# ---------------------------------------------------------------------------------------------
# the report: one JSON file, rewritten after every check


class Report:
    """Results in check order, written to ``DIR/gpu_check.json`` after each one (atomically)."""

    def __init__(self, out: Path | None, header: dict[str, Any]) -> None:
        self.out = out
        self.header = header
        self.results: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        self.write(finished=False)

    def add(self, result: dict[str, Any]) -> None:
        with self._lock:
            self.results.append(result)
            self._write(finished=False)
        if result.get("skipped"):
            verdict = "SKIP"
        elif result.get("informational") and result.get("ok"):
            verdict = "INFO"
        else:
            verdict = "PASS" if result.get("ok") else "FAIL"
        shown = {k: v for k, v in result.items() if k not in ("check", "ok", "traceback", "output")}
        print(f"{verdict} {result['check']} {json.dumps(shown, default=str)[:1500]}", flush=True)

    def write(self, *, finished: bool, aborted: str | None = None) -> None:
        with self._lock:
            self._write(finished=finished, aborted=aborted)

    def _write(self, *, finished: bool, aborted: str | None = None) -> None:
        if self.out is None:
            return
        body = {
            **self.header,
            "elapsed_s": round(time.perf_counter() - self.started, 2),
            "finished": finished,
            "aborted": aborted,
            "results": self.results,
        }
        tmp = self.out / ".gpu_check.json.tmp"
        tmp.write_text(json.dumps(body, indent=2, default=str))
        os.replace(tmp, self.out / "gpu_check.json")

    def failed(self) -> list[str]:
        return [r["check"] for r in self.results if not r.get("skipped") and not r.get("ok")]


# ---------------------------------------------------------------------------------------------
# devices, timing, memory probes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds of ``fn`` including the device work it queued."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


#: The memory counters a snapshot reads from /proc/self/status.
STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin", "VmHWM")


def memory_snapshot(device: torch.device) -> dict[str, Any]:
    snap: dict[str, Any] = dict(proc_status(STATUS_KEYS))
    if device.type == "cuda":
        sync(device)
        snap["reserved"] = torch.cuda.memory_reserved(device)
        snap["allocated"] = torch.cuda.memory_allocated(device)
        stats = getattr(torch.cuda.memory, "host_memory_stats", None)
        if callable(stats):
            with contextlib.suppress(Exception):
                host = stats()
                snap["torch_pinned_owned"] = host.get("allocated_bytes.current")  # in use + cached
                snap["torch_pinned_active"] = host.get("active_bytes.current")
    snap["package_pinned"] = pinned_bytes()
    return snap


def importable(name: str) -> bool:
    """Whether ``import name`` would find the module (without importing it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def filesystem_of(path: Path) -> str:
    """The filesystem type holding ``path`` (longest mount prefix in /proc/mounts), or 'unknown'."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def o_direct_works(path: Path) -> bool:
    """Whether an aligned O_DIRECT read of ``path`` succeeds on this filesystem."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    buf = mmap.mmap(-1, 4096)
    try:
        return os.preadv(fd, [buf], 0) >= 0
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


def cold(files: list[Path]) -> bool:
    """Whether the page cache holds under 10% of every file (mincore), so a pass must read the disk."""
    for path in files:
        resident = cached_fraction(path, 0, path.stat().st_size)
        if resident is None or resident >= 0.1:
            return False
    return True


@contextlib.contextmanager
def forced_cold(files: list[Path], *, whole_machine: bool, drop: bool = True) -> Iterator[str]:
    """Make the next pass read ``files`` with O_DIRECT; yields how.

    Drops the files from the page cache (fadvise; with ``whole_machine``, as root, then the whole
    page cache with ``drop_caches``, on a machine whose whole page cache this run may drop). Where
    the files stay cached anyway (a container may keep them), routes every chunk of the pass to
    O_DIRECT for the duration, since what is checked is the direct read into the pinned staging
    buffer, not the cache policy. ``drop`` False goes straight to that (how the tests take this
    path on a machine where dropping works).
    """
    if drop:
        drop_page_cache(files)
        if cold(files):
            yield "page cache dropped (fadvise)"
            return
    if whole_machine and drop:
        with contextlib.suppress(OSError):
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
    if drop and cold(files):
        yield "page cache dropped (drop_caches)"
        return
    from adalncache.source import reads

    original = reads.DirectReads.chunk

    def direct_chunk(self: Any, fd: int, path: Path, address: int, nbytes: int, offset: int) -> int | None:
        return self.read(fd, path, address, nbytes, offset)

    reads.DirectReads.chunk = direct_chunk  # type: ignore[method-assign]  # patched for this check only, restored below
    try:
        yield "page cache could not be dropped: every chunk routed to O_DIRECT"
    finally:
        reads.DirectReads.chunk = original  # type: ignore[method-assign]  # the restore of the patch above


class GpuSleep:
    """Queue a kernel that keeps the current stream busy for a while (CUDA); nothing on CPU.

    Calibrated once with CUDA events, so a check can say "this read runs 0.3 s from now".
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cycles_per_ms = 0.0
        if device.type == "cuda":
            if not hasattr(torch.cuda, "_sleep"):
                raise Skipped("torch.cuda._sleep not available in this torch")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sync(device)
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_ms = 20_000_000 / max(start.elapsed_time(end), 1e-3)

    def __call__(self, ms: float) -> None:
        if self.device.type == "cuda":
            torch.cuda._sleep(int(self.cycles_per_ms * ms))


def streams(device: torch.device, count: int) -> list[Any]:
    """``count`` new CUDA streams, or Nones on CPU (``on(None)`` is a no-op there)."""
    return [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in range(count)]


def on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# checkpoints, plans, the reference


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def load_reference(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` on ``device``, read by this script's own safetensors reader.

    Independent of the package's reader on purpose (the reference must not share its code). On
    CPU each tensor sits at its file offset modulo 4096, where a model mapping the file holds it.
    """
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            base = 8 + size
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                lo, hi = meta["data_offsets"]
                dtype = _DTYPES[meta["dtype"]]
                host = aligned_empty((hi - lo,), torch.uint8, base + lo, modulus=4096)
                f.seek(base + lo)
                if f.readinto((ctypes.c_char * (hi - lo)).from_address(host.data_ptr())) != hi - lo:
                    raise OSError(f"{path} ended inside tensor {name}")
                tensor = host.view(dtype).view(meta["shape"])
                out[name] = tensor if device.type == "cpu" else tensor.to(device)
    return out


@dataclass
class Checkpoint:
    """A generated checkpoint, its reference tensors on the device, and the reference projection."""

    spec: ModulationSpec
    path: Path
    files: list[Path]
    weights: dict[str, torch.Tensor]
    device: torch.device

    def source(self, **kwargs: Any) -> CheckpointSource:
        return CheckpointSource(self.path, self.spec, **kwargs)

    def wb(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = "final_layer" if layer == FINAL else f"blocks.{int(layer)}"
        return self.weights[f"{prefix}.adaln_proj.linear.weight"], self.weights[f"{prefix}.adaln_proj.linear.bias"]

    def reference(self, layer: Layer, x: torch.Tensor, precision: str = "match") -> torch.Tensor:
        """What the resident projection computes for input ``x``, in the slab's dtype."""
        weight, bias = self.wb(layer)
        with torch.no_grad():
            if precision == "fp32":
                return F.linear(x.float(), weight.float(), bias.float()).to(self.spec.dtype)
            return F.linear(x, weight, bias)

    def mismatches(
        self, cache: Any, plans: list[torch.Tensor], xs: dict[Any, torch.Tensor], precision: str = "match"
    ) -> list[str]:
        """``plan@layer`` of every row set that is not ``torch.equal`` to the reference."""
        bad = []
        for plan in plans:
            key, n = plan_key(plan), plan.numel()
            slot = cache.lookup(plan)
            for layer in self.spec.layers():
                got = cache.final_rows(slot, n) if layer == FINAL else cache.block_rows(int(layer), slot, n)
                if not torch.equal(got, self.reference(layer, xs[key], precision)):
                    bad.append(f"{[round(v, 4) for v in plan.tolist()]}@{layer}")
        return bad


def make_plans(widths: tuple[int, ...], per_width: int, seed: int) -> list[torch.Tensor]:
    """Distinct plans of the given widths: sorted fp32 timesteps in (0, 1), as a request's are."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(w, generator=gen).sort().values for w in widths for _ in range(per_width)]


def make_inputs(
    spec: ModulationSpec, plans: list[torch.Tensor], device: torch.device, *, fp32: bool = False, seed: int = 0
) -> dict[Any, torch.Tensor]:
    """One projection input per plan (``silu`` of random rows; bf16 unless ``fp32``), on the device."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for plan in plans:
        x = F.silu(torch.randn(plan.numel(), spec.time_embed_dim, generator=gen))
        out[plan_key(plan)] = (x if fp32 else x.to(spec.dtype)).to(device)
    return out


def embed_of(xs: dict[Any, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda plan: xs[plan_key(plan)]


# ---------------------------------------------------------------------------------------------
# the checks


class Context:
    """What the checks share: the device, the arguments, the work directory and the checkpoints."""

    def __init__(self, args: argparse.Namespace, device: torch.device, work: Path) -> None:
        self.args = args
        self.device = device
        self.work = work
        self._ckpts: dict[str, Checkpoint | BaseException] = {}
        self._sleep: GpuSleep | None = None
        #: The running check's time limit (its watchdog), for the checks that start a child process.
        self.limit_s = args.check_timeout

    def cache(self, ckpt: Checkpoint, source: Any = None, **kwargs: Any) -> AdalnCache:
        kwargs.setdefault("max_plan_width", 4)
        kwargs.setdefault("progress", False)
        return AdalnCache(ckpt.spec, source if source is not None else ckpt.source(), device=self.device, **kwargs)

    def _checkpoint(self, name: str, spec: ModulationSpec, per_shard: int) -> Checkpoint:
        got = self._ckpts.get(name)
        if isinstance(got, Checkpoint):
            return got
        if got is not None:
            raise Skipped(f"needs the {name} checkpoint, which failed: {type(got).__name__}: {got}")
        try:
            path = generate_checkpoint(spec, self.work / f"ckpt-{name}", layers_per_shard=per_shard)
            files = sorted(path.glob("*.safetensors"))
            ckpt = Checkpoint(spec, path, files, load_reference(files, self.device), self.device)
        except BaseException as exc:
            self._ckpts[name] = exc
            raise
        self._ckpts[name] = ckpt
        return ckpt

    def real(self) -> Checkpoint:
        """``--layers`` blocks at the released widths (by default), sharded two layers per file."""
        args = self.args
        spec = ModulationSpec(num_layers=args.layers, hidden_size=args.hidden, time_embed_dim=args.in_features)
        return self._checkpoint("real", spec, 2)

    def small(self) -> Checkpoint:
        """A small checkpoint for the checks about ordering (streams, threads, switches), where passes must be quick."""
        return self._checkpoint("small", ModulationSpec(num_layers=3, hidden_size=128, time_embed_dim=256), 2)

    def sleep(self) -> GpuSleep:
        if self._sleep is None:
            self._sleep = GpuSleep(self.device)
        return self._sleep


def check_environment(ctx: Context) -> dict[str, Any]:
    device = ctx.device
    probe = ctx.work / "o_direct_probe.bin"
    probe.write_bytes(os.urandom(8192))
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "cpus": os.cpu_count(),
        "importable": {name: importable(name) for name in ("diffusers", "safetensors", "tqdm", "transformers", "peft")},
        "work_dir": str(ctx.work),
        "work_filesystem": filesystem_of(ctx.work),
        "o_direct_on_work_dir": o_direct_works(probe),
        "fp32_precision_api": hasattr(torch.backends.cuda.matmul, "fp32_precision"),
        "nccl_available": bool(torch.distributed.is_available() and torch.distributed.is_nccl_available()),
    }
    probe.unlink()
    return {"ok": True, "informational": True, **info}


def check_checkpoint(ctx: Context) -> dict[str, Any]:
    start = time.perf_counter()
    ckpt = ctx.real()
    return {
        "ok": True,
        "spec": ckpt.spec.describe(),
        "files": len(ckpt.files),
        "projection_gib": round(ckpt.spec.projection_bytes / GiB, 3),
        "seconds": round(time.perf_counter() - start, 2),
    }


def _exactness(ctx: Context, precision: str) -> dict[str, Any]:
    ckpt = ctx.real()
    plans = make_plans((1, 2, 3, 4), 2, seed=1)
    xs = make_inputs(ckpt.spec, plans, ctx.device, fp32=precision == "fp32", seed=1)
    cache = ctx.cache(ckpt, max_plans=len(plans), precision=precision)
    report = cache.build(plans, embed=embed_of(xs))
    by_width = {w: ckpt.mismatches(cache, [p for p in plans if p.numel() == w], xs, precision) for w in (1, 2, 3, 4)}
    bad = [b for w in by_width.values() for b in w]
    return {
        "ok": not bad and report.passes == 1,
        "plans": len(plans),
        "passes": report.passes,
        "mismatches": len(bad),
        "mismatches_by_width": {w: len(b) for w, b in by_width.items()},
        "first_mismatches": bad[:5],
        "pass_s": round(report.seconds, 3),
    }


def check_exact_match(ctx: Context) -> dict[str, Any]:
    return _exactness(ctx, "match")


def check_exact_fp32(ctx: Context) -> dict[str, Any]:
    return _exactness(ctx, "fp32")


def check_batched(ctx: Context) -> dict[str, Any]:
    from adalncache.rebuild import clear_verdicts, verdicts

    ckpt = ctx.real()
    plans = make_plans((2,), 16, seed=2)  # a 16-step t2va request's shape: plans of two timesteps
    xs = make_inputs(ckpt.spec, plans, ctx.device, seed=2)
    clear_verdicts()
    cache = ctx.cache(ckpt, max_plans=len(plans), batched=True)
    report = cache.build(plans, embed=embed_of(xs))
    bad = ckpt.mismatches(cache, plans, xs)
    return {
        "ok": not bad,
        "mismatches": len(bad),
        "stacked_layers": report.stacked_layers,
        "per_plan_layers": report.per_plan_layers,
        "verdicts": {str(k[3:5]): v for k, v in verdicts().items()},  # (width, count): stackable
    }


def check_in_place(ctx: Context) -> dict[str, Any]:
    ckpt = ctx.real()
    plans = make_plans((1, 2, 3, 4), 2, seed=15)
    xs = make_inputs(ckpt.spec, plans, ctx.device, seed=15)
    sources = {"in_place": ckpt.source(), "staged": ckpt.source(in_place=False)}
    for source in sources.values():
        read_only(source)  # warm: the page cache holds every byte
    seconds: dict[str, list[float]] = {name: [] for name in sources}
    bad: dict[str, int] = {}
    for _ in range(3):
        for name, source in sources.items():
            cache = ctx.cache(ckpt, source, max_plans=len(plans), tiled=False)
            seconds[name].append(timed(ctx.device, lambda c=cache: c.build(plans, embed=embed_of(xs))))
            bad[name] = len(ckpt.mismatches(cache, plans, xs))
    med = {name: statistics.median(v) for name, v in seconds.items()}
    taken = sources["in_place"].bytes_in_place
    cuda = ctx.device.type == "cuda"
    return {
        "ok": not any(bad.values()) and (taken == 0 if cuda else taken > 0),
        "mismatches": bad,
        "bytes_in_place": taken,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "in_place_over_staged": round(med["in_place"] / med["staged"], 3),
    }


def check_tiled(ctx: Context) -> dict[str, Any]:
    from adalncache import rebuild as tiling
    from adalncache.rebuild import clear_verdicts, verdicts

    ckpt = ctx.real()
    width = ckpt.spec.out_features(0)
    tile = tiling.TILE_ROWS if width >= 4 * tiling.TILE_ROWS else max(128, width // 4)
    old_tile, tiling.TILE_ROWS = tiling.TILE_ROWS, tile
    plans = make_plans((2,), 12, seed=16) + make_plans((1, 3, 4), 1, seed=17)
    out: dict[str, Any] = {"tile_rows": tile, "informational_timing": True}
    try:
        for precision in ("match", "fp32"):
            xs = make_inputs(ckpt.spec, plans, ctx.device, fp32=precision == "fp32", seed=16)
            embed = embed_of(xs)
            clear_verdicts()
            seconds: dict[str, list[float]] = {"tiled": [], "whole": []}
            bad: dict[str, int] = {}
            for _ in range(3):
                for name, mode in (("tiled", True), ("whole", False)):
                    cache = ctx.cache(ckpt, max_plans=len(plans), precision=precision, tiled=mode)
                    seconds[name].append(timed(ctx.device, lambda c=cache, e=embed: c.build(plans, embed=e)))
                    bad[name] = len(ckpt.mismatches(cache, plans, xs, precision))
            med = {name: statistics.median(v) for name, v in seconds.items()}
            speed = verdicts("tiled speed")
            out[precision] = {
                "mismatches": bad,
                "median_s": {k: round(v, 4) for k, v in med.items()},
                "tiled_over_whole": round(med["tiled"] / med["whole"], 3),
                # plan width -> [exact, faster], per shape class the probe saw
                "verdicts": [[k[3], v, speed.get(k)] for k, v in verdicts("tiled").items()],
            }
    finally:
        tiling.TILE_ROWS = old_tile
        clear_verdicts()
    out["ok"] = all(not any(out[p]["mismatches"].values()) for p in ("match", "fp32"))
    return out


def check_o_direct(ctx: Context) -> dict[str, Any]:
    ckpt = ctx.real()
    plans = make_plans((1, 2), 2, seed=3)
    xs = make_inputs(ckpt.spec, plans, ctx.device, seed=3)
    supported = o_direct_works(ckpt.files[0])
    # Staged, as on CUDA always: on a CPU a page cache that could not be dropped would otherwise be
    # projected in place, and this check is about the O_DIRECT staging path.
    source = ckpt.source(in_place=False)
    keep = "keep-cache:o-direct" in ctx.args.simulate.split(",")
    with forced_cold(ckpt.files, whole_machine=ctx.device.type == "cuda", drop=not keep) as how:
        before = source.bytes_direct
        cache = ctx.cache(ckpt, source, max_plans=len(plans))
        cache.build(plans, embed=embed_of(xs))
        direct = source.bytes_direct - before
    bad = ckpt.mismatches(cache, plans, xs)
    del cache
    plain = ckpt.source(direct_io=False)
    drop_page_cache(ckpt.files)
    cache = ctx.cache(ckpt, plain, max_plans=len(plans))
    cache.build(plans, embed=embed_of(xs))
    bad_plain = ckpt.mismatches(cache, plans, xs)
    return {
        "ok": not bad and not bad_plain and (direct > 0 or not supported),
        "how": how,
        "o_direct_supported": supported,
        "direct_mib": round(direct / MiB, 1),
        "read_mib": round(source.bytes_read / MiB, 1),
        "mismatches": len(bad),
        "mismatches_direct_io_false": len(bad_plain),
        "staging": "pinned host memory" if ctx.device.type == "cuda" else "pageable host memory",
    }


def check_lagging_consumer(ctx: Context) -> dict[str, Any]:
    """A projection that sleeps, so the reader runs ``read_ahead`` layers ahead of it, under memory pressure."""
    ckpt = ctx.real()
    spec, device = ckpt.spec, ctx.device
    layer = spec.layer_bytes(0)
    read_ahead = 2
    plans = make_plans((2, 3), 1, seed=4)
    xs = make_inputs(spec, plans, device, seed=4)
    delay = 0.15 if device.type == "cuda" else 0.01
    calls: list[Layer] = []

    def lagging(which: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        time.sleep(delay)
        calls.append(which)
        return F.linear(x, weight, bias)

    source = ckpt.source(keep_buffers=False)
    cache = ctx.cache(ckpt, source, max_plans=len(plans), read_ahead=read_ahead)
    # The pass may hold the layer being projected, read_ahead layers read ahead, and one in flight.
    budget = (read_ahead + 2) * layer
    details: dict[str, Any] = {"read_ahead": read_ahead, "sleep_per_projection_s": delay}
    filler = None
    stop = threading.Event()
    peak = [0]
    sampler = None
    try:
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(device)
            headroom = budget + GiB  # the pass's layers, plus cuBLAS workspace and small outputs
            if free > headroom:
                filler = torch.empty(free - headroom, dtype=torch.uint8, device=device)
            details["device_free_during_pass_gib"] = round(torch.cuda.mem_get_info(device)[0] / GiB, 2)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        else:
            base = proc_status().get("RssAnon", 0)
            peak[0] = base

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], proc_status().get("RssAnon", 0))
                    time.sleep(0.002)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        start = time.perf_counter()
        report = cache.build(plans, embed=embed_of(xs), project=lagging)
        sync(device)
        seconds = time.perf_counter() - start
        if device.type == "cuda":
            used = torch.cuda.max_memory_allocated(device) - base
        else:
            stop.set()
            assert sampler is not None
            sampler.join()
            used = peak[0] - base
            budget += 64 * MiB  # the sampler sees the allocator's own slack too
    finally:
        stop.set()
        del filler
    bad = ckpt.mismatches(cache, plans, xs)
    return {
        "ok": not bad and report.passes == 1 and used <= budget,
        **details,
        "mismatches": len(bad),
        "projections": len(calls),
        "pass_s": round(seconds, 2),
        "peak_over_baseline_mib": round(used / MiB, 1),
        "budget_mib": round(budget / MiB, 1),
        "layers_at_peak": round(used / layer, 2),
    }


def in_fresh_process(ctx: Context, name: str) -> dict[str, Any]:
    """Run check ``name`` in a new process of this script and return its result.

    Why: what a check about memory measures must not depend on what earlier checks left behind
    (torch's pinned cache would hand a freed pinned block to the next pass, and blocks cached on
    many streams would hide a pass that allocates on a new one). The child reuses the checkpoint
    in the work directory.
    """
    args = ctx.args
    out = ctx.work / f"child-{name}"
    limit = max(15.0, ctx.limit_s - 10)  # the child ends (or is killed) before this check's watchdog fires
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--only",
        name,
        "--device",
        str(ctx.device),
        "--dir",
        str(ctx.work),
        "--out",
        str(out),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--in-features",
        str(args.in_features),
        "--check-timeout",
        str(max(10.0, limit - 10)),
        "--simulate",
        args.simulate,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"") + (exc.stderr or b"")
        text = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
        why = f"the child process ran past {limit:.0f} s and was killed"
        return {"ok": False, "error": why, "output": text[-4000:]}
    report = out / "gpu_check.json"
    found = [r for r in json.loads(report.read_text())["results"] if r["check"] == name] if report.exists() else []
    if not found:
        return {
            "ok": False,
            "error": f"the child process left no result (exit {proc.returncode})",
            "output": (proc.stdout + proc.stderr)[-4000:],
        }
    result = {k: v for k, v in found[0].items() if k not in ("check", "seconds")}
    if result.get("skipped"):
        raise Skipped(result["skipped"])
    return {**result, "process": "a fresh process"}


def check_memory(ctx: Context) -> dict[str, Any]:
    """Reserved device memory and host memory over six passes, after ``release_buffers()`` and after closing."""
    if not ctx.args.child:
        return in_fresh_process(ctx, "memory")
    ckpt = ctx.real()
    spec, device = ckpt.spec, ctx.device
    layer = spec.layer_bytes(0)
    sets = [make_plans((2,), 2, seed=5), make_plans((2,), 2, seed=6)]
    xs = {**make_inputs(spec, sets[0], device, seed=5), **make_inputs(spec, sets[1], device, seed=6)}
    source = ckpt.source()
    cache = ctx.cache(ckpt, source, max_plans=2)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = memory_snapshot(device)
    passes = []
    for n in range(6):
        report = cache.build(sets[n % 2], embed=embed_of(xs))  # alternating sets: a pass every time
        sync(device)
        passes.append({**memory_snapshot(device), "passes": report.passes, "kept_bytes": source.kept_bytes})
    bad = ckpt.mismatches(cache, sets[1], xs)
    released = source.release_buffers()
    gc.collect()
    after_release = memory_snapshot(device)
    cache.close()
    gc.collect()
    after_close = memory_snapshot(device)
    del cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    after_empty = memory_snapshot(device)

    def growth(key: str) -> int:
        return int(passes[5].get(key, 0) - passes[1].get(key, 0))

    host_kept = after_release.get("VmRSS", 0) - base.get("VmRSS", 0)
    verdicts = {
        "one_pass_each": all(p["passes"] == 1 for p in passes),
        "device_reserved_steady": growth("reserved") <= layer // 2,
        "host_rss_steady": growth("VmRSS") <= layer // 2,
        "host_given_back_after_release": host_kept <= max(64 * MiB, layer // 4),
    }
    if after_release.get("torch_pinned_owned") is not None:
        # What torch's pinned allocator keeps cached is not given back to the system either.
        verdicts["torch_pinned_cache_not_holding_buffers"] = (
            after_release["torch_pinned_owned"] - (base.get("torch_pinned_owned") or 0) <= layer // 4
        )
    if "package_pinned" in after_release:
        verdicts["package_pinned_zero_after_release"] = after_release["package_pinned"] == 0
    return {
        "ok": not bad and all(verdicts.values()),
        "verdicts": verdicts,
        "mismatches": len(bad),
        "layer_mib": round(layer / MiB, 1),
        "device_reserved_growth_mib_pass2_to_6": round(growth("reserved") / MiB, 1),
        "host_rss_growth_mib_pass2_to_6": round(growth("VmRSS") / MiB, 1),
        "host_rss_over_baseline_after_release_mib": round(host_kept / MiB, 1),
        "released_bytes": released,
        "baseline": base,
        "per_pass": passes,
        "after_release_buffers": after_release,
        "after_close": after_close,
        "after_empty_cache": after_empty,
    }


def check_stream_publish(ctx: Context) -> dict[str, Any]:
    """Build on one stream with its last write landing late; read at once on another, no manual sync."""
    ckpt = ctx.small()
    device = ctx.device
    sleep = ctx.sleep()
    plans = make_plans((1, 2, 3, 4), 1, seed=7)
    xs = make_inputs(ckpt.spec, plans, device, seed=7)
    cache = ctx.cache(ckpt, max_plans=len(plans))
    build_stream, read_stream = streams(device, 2)
    late_ms = 300.0

    def late(which: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if which == FINAL:
            sleep(late_ms)  # the output layer's rows are written this long after the build's host side ends
        return F.linear(x, weight, bias)

    sync(device)
    start = time.perf_counter()
    with on(build_stream):
        cache.build(plans, embed=embed_of(xs), project=late)
    returned = time.perf_counter() - start
    got: dict[Any, list[torch.Tensor]] = {}
    with on(read_stream):
        for plan in plans:
            slot, n = cache.lookup(plan), plan.numel()  # a device tensor: the reads below are gathers
            got[plan_key(plan)] = [
                cache.final_rows(slot, n) if layer == FINAL else cache.block_rows(int(layer), slot, n)
                for layer in ckpt.spec.layers()
            ]
    sync(device)
    bad = [
        f"{plan_key(p)}@{layer}"
        for p in plans
        for layer, rows in zip(ckpt.spec.layers(), got[plan_key(p)])
        if not torch.equal(rows, ckpt.reference(layer, xs[plan_key(p)]))
    ]
    return {
        "ok": not bad,
        "streams": device.type == "cuda",
        "mismatches": len(bad),
        "first_mismatches": bad[:5],
        "late_write_ms": late_ms if device.type == "cuda" else 0,
        "build_returned_after_s": round(returned, 3),
    }


def check_stream_evict(ctx: Context) -> dict[str, Any]:
    """A read queued late on one stream, then a build on another that evicts the slot it reads."""
    ckpt = ctx.small()
    device = ctx.device
    sleep = ctx.sleep()
    first, second = make_plans((2,), 2, seed=8)
    xs = make_inputs(ckpt.spec, [first, second], device, seed=8)
    cache = ctx.cache(ckpt, max_plans=1)
    cache.build([first], embed=embed_of(xs))
    sync(device)
    read_stream, build_stream = streams(device, 2)
    n = first.numel()
    with on(read_stream):
        sleep(500.0)
        slot = cache.lookup(first)
        rows = [
            cache.final_rows(slot, n) if layer == FINAL else cache.block_rows(int(layer), slot, n)
            for layer in ckpt.spec.layers()
        ]
    with on(build_stream):
        report = cache.build([second], embed=embed_of(xs))  # evicts `first`: the only slot
    sync(device)
    bad = [
        str(layer)
        for layer, got in zip(ckpt.spec.layers(), rows)
        if not torch.equal(got, ckpt.reference(layer, xs[plan_key(first)]))
    ]
    bad_second = ckpt.mismatches(cache, [second], xs)
    return {
        "ok": not bad and not bad_second and report.evicted == 1,
        "streams": device.type == "cuda",
        "evicted": report.evicted,
        "stale_reads": len(bad),
        "mismatches_after": len(bad_second),
    }


def check_acquire(ctx: Context) -> dict[str, Any]:
    ckpt = ctx.small()
    device = ctx.device
    sleep = ctx.sleep()
    first, second = make_plans((2,), 2, seed=9)
    xs = make_inputs(ckpt.spec, [first, second], device, seed=9)
    cache: Any = ctx.cache(ckpt, max_plans=1)
    read_stream, build_stream = streams(device, 2)
    n = first.numel()
    refused = ""
    with on(read_stream), cache.acquire([first], embed=embed_of(xs)) as slots:
        sleep(300.0)
        rows = [
            cache.final_rows(slots[0], n) if layer == FINAL else cache.block_rows(int(layer), slots[0], n)
            for layer in ckpt.spec.layers()
        ]
        with on(build_stream):
            try:
                cache.build([second], embed=embed_of(xs))
            except PlanError as exc:
                refused = str(exc)
        still_resident = cache.slot_of(plan_key(first)) is not None
    # Released on the reading stream: an eviction from now on must wait for what it queued.
    with on(read_stream):
        sleep(300.0)
        late_rows = cache.final_rows(cache.lookup(first), n)
    with on(build_stream):
        cache.build([second], embed=embed_of(xs))
    sync(device)
    want = [ckpt.reference(layer, xs[plan_key(first)]) for layer in ckpt.spec.layers()]
    held_ok = all(torch.equal(a, b) for a, b in zip(rows, want))
    cache.check_invariants()
    return {
        "ok": bool(refused)
        and "max_plans" in refused
        and still_resident
        and held_ok
        and torch.equal(late_rows, want[-1])
        and not ckpt.mismatches(cache, [second], xs),
        "refused": refused[:300],
        "held_plan_still_resident": still_resident,
        "held_rows_exact": held_ok,
        "read_before_eviction_exact": bool(torch.equal(late_rows, want[-1])),
    }


def check_threads(ctx: Context) -> dict[str, Any]:
    ckpt = ctx.small()
    device = ctx.device
    plans = make_plans((1, 2, 3), 3, seed=10)
    xs = make_inputs(ckpt.spec, plans, device, seed=10)
    want = {plan_key(p): [ckpt.reference(layer, xs[plan_key(p)]) for layer in ckpt.spec.layers()] for p in plans}
    cache: Any = ctx.cache(ckpt, max_plans=6)
    errors: list[str] = []
    refused = [0]
    mismatches = [0]
    served = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        (stream,) = streams(device, 1)
        try:
            with on(stream):
                for _ in range(25):
                    request = rng.sample(plans, rng.randint(1, 4))
                    try:
                        with cache.acquire(request, embed=embed_of(xs)) as slots:
                            got = [
                                [
                                    cache.final_rows(slots[i], p.numel())
                                    if layer == FINAL
                                    else cache.block_rows(int(layer), slots[i], p.numel())
                                    for layer in ckpt.spec.layers()
                                ]
                                for i, p in enumerate(request)
                            ]
                        if stream is not None:
                            stream.synchronize()
                        bad = sum(
                            not torch.equal(g, w)
                            for i, p in enumerate(request)
                            for g, w in zip(got[i], want[plan_key(p)])
                        )
                        with lock:
                            mismatches[0] += bad
                            served[0] += 1
                    except PlanError:
                        with lock:  # every slot held by other threads: a clear refusal, allowed
                            refused[0] += 1
        except BaseException as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sync(device)
    invariants = "ok"
    try:
        cache.check_invariants()
    except BaseException as exc:
        invariants = f"{type(exc).__name__}: {exc}"
    resident_bad = ckpt.mismatches(cache, [p for p in plans if cache.slot_of(plan_key(p)) is not None], xs)
    return {
        "ok": not errors and not mismatches[0] and invariants == "ok" and not resident_bad and served[0] > 0,
        "requests_served": served[0],
        "refused": refused[0],
        "mismatches": mismatches[0],
        "errors": errors[:5],
        "invariants": invariants,
        "resident_mismatches": len(resident_bad),
    }


def check_tf32(ctx: Context) -> dict[str, Any]:
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        raise Skipped("torch.backends.cuda.matmul.fp32_precision not available in this torch")
    from adalncache.rebuild import clear_verdicts

    ckpt = ctx.small()
    device = ctx.device
    plans = make_plans((1, 2, 3), 2, seed=11)
    xs = make_inputs(ckpt.spec, plans, device, fp32=True, seed=11)
    store = ctx.work / "store-tf32"
    ieee_ref = {plan_key(p): ckpt.reference(0, xs[plan_key(p)], "fp32") for p in plans}
    old = matmul.fp32_precision
    details: dict[str, Any] = {"previous_fp32_precision": old}
    matmul.fp32_precision = "tf32"
    try:
        tf32_ref = {plan_key(p): ckpt.reference(0, xs[plan_key(p)], "fp32") for p in plans}
        details["tf32_changed_bits"] = sum(int((tf32_ref[k] != ieee_ref[k]).sum()) for k in tf32_ref)
        writer = ctx.cache(ckpt, max_plans=len(plans), precision="fp32", store=str(store))
        writer.build(plans, embed=embed_of(xs))
        details["store_write_failures"] = writer.stats.tier_write_failures
        details["mismatches_built"] = len(ckpt.mismatches(writer, plans, xs, "fp32"))
        reader = ctx.cache(ckpt, max_plans=len(plans), precision="fp32", store=str(store))
        hit = reader.build(plans, embed=embed_of(xs))
        details["store_hits"] = hit.store_hits
        details["mismatches_from_store"] = len(ckpt.mismatches(reader, plans, xs, "fp32"))
        clear_verdicts()
        batched = ctx.cache(ckpt, max_plans=len(plans), precision="fp32", batched=True)
        report = batched.build(plans, embed=embed_of(xs))
        details["batched_stacked_layers"] = report.stacked_layers
        details["mismatches_batched"] = len(ckpt.mismatches(batched, plans, xs, "fp32"))
    finally:
        matmul.fp32_precision = old
    after = ctx.cache(ckpt, max_plans=len(plans), precision="fp32", store=str(store)).build(plans, embed=embed_of(xs))
    details["store_hits_after_restoring"] = after.store_hits
    # On CUDA the switch is part of the binding: a table built under TF32 must not serve IEEE. On a
    # CPU the CUDA switch changes no bits, so it is not in the binding and the store may hit.
    binding_ok = after.store_hits == 0 if device.type == "cuda" else True
    details["ok"] = (
        details["store_write_failures"] == 0
        and details["store_hits"] == len(plans)
        and details["mismatches_built"] == 0
        and details["mismatches_from_store"] == 0
        and details["mismatches_batched"] == 0
        and binding_ok
    )
    return details


def check_nccl(ctx: Context) -> dict[str, Any]:
    """A one-rank process group; in a fresh process, so a hang or a broken NCCL cannot stop the other checks."""
    import torch.distributed as dist

    if not ctx.args.child:
        return in_fresh_process(ctx, "nccl")
    device = ctx.device
    if not dist.is_available():
        raise Skipped("torch.distributed not available in this torch")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        raise Skipped("NCCL not available in this torch")
    if dist.is_initialized():
        raise Skipped("a process group is already initialised in this process")
    ckpt = ctx.small()
    plans = make_plans((1, 2, 3, 4), 1, seed=12)
    xs = make_inputs(ckpt.spec, plans, device, seed=12)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rendezvous = ctx.work / f"pg-{os.getpid()}-{time.monotonic_ns()}"
    dist.init_process_group(
        backend, init_method=f"file://{rendezvous}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    out: dict[str, Any] = {"backend": backend}
    try:
        for shard in ("layers", "columns"):
            cache = ctx.cache(ckpt, max_plans=len(plans), process_group=dist.group.WORLD, shard=shard)
            report = cache.build(plans, embed=embed_of(xs))
            out[shard] = {"passes": report.passes, "mismatches": len(ckpt.mismatches(cache, plans, xs))}
            del cache
    finally:
        dist.destroy_process_group()
    out["ok"] = all(out[s]["passes"] == 1 and out[s]["mismatches"] == 0 for s in ("layers", "columns"))
    return out


def check_host_tier(ctx: Context) -> dict[str, Any]:
    ckpt = ctx.real()
    plans = make_plans((2,), 4, seed=13)
    xs = make_inputs(ckpt.spec, plans, ctx.device, seed=13)
    cache = ctx.cache(ckpt, max_plans=2, host_cache_bytes=ckpt.spec.slab_bytes(4, 4) + MiB)
    first = cache.build(plans[:2], embed=embed_of(xs))
    cache.build(plans[2:4], embed=embed_of(xs))  # evicts the first two from the slab
    back = cache.build(plans[:2], embed=embed_of(xs))
    bad = ckpt.mismatches(cache, plans[:2], xs)
    tier = cache.host_tier
    return {
        "ok": not bad and back.host_hits == 2 and back.passes == 0,
        "first_passes": first.passes,
        "host_hits": back.host_hits,
        "passes": back.passes,
        "mismatches": len(bad),
        "host_tier": repr(tier),
    }


def check_timing(ctx: Context) -> dict[str, Any]:
    ckpt = ctx.real()
    device = ctx.device
    spec = ckpt.spec
    plans = make_plans((2,), 16, seed=14)
    xs = make_inputs(spec, plans, device, seed=14)
    source = ckpt.source()
    resident = {layer: ckpt.wb(layer) for layer in spec.layers()}

    def project_only(k: int) -> float:
        def work() -> None:
            with torch.no_grad():
                for layer in spec.layers():
                    weight, bias = resident[layer]
                    for plan in plans[:k]:
                        F.linear(xs[plan_key(plan)], weight, bias)

        return timed(device, work)

    def one_pass(k: int) -> float:
        cache = ctx.cache(ckpt, source, max_plans=k)
        return timed(device, lambda: cache.build(plans[:k], embed=embed_of(xs)))

    samples: dict[str, list[float]] = {"read": [], "project1": [], "pass1": [], "project16": [], "pass16": []}
    h2d = PinnedCopy(source, device) if device.type == "cuda" else None  # the physical limit of a CUDA pass
    if h2d is not None:
        samples["h2d"] = []
    one_pass(1)  # the kept staging buffer, the copy stream, cuBLAS handles
    for _ in range(3):
        if h2d is not None:
            samples["h2d"].append(h2d())
        samples["read"].append(read_only(source))  # host only: no device work to wait for
        for k in (1, 16):
            samples[f"project{k}"].append(project_only(k))
            samples[f"pass{k}"].append(one_pass(k))
    med = {k: statistics.median(v) for k, v in samples.items()}
    out: dict[str, Any] = {"ok": True, "informational": True, "median_s": {k: round(v, 4) for k, v in med.items()}}
    for k in (1, 16):
        out[f"pass_over_max_read_project_{k}"] = round(med[f"pass{k}"] / max(med["read"], med[f"project{k}"]), 3)
        if h2d is not None:
            out[f"pass_over_pinned_h2d_{k}"] = round(med[f"pass{k}"] / med["h2d"], 3)
    return out


def check_demo(ctx: Context) -> dict[str, Any]:
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        raise Skipped(f"diffusers not importable ({exc}); pip install diffusers==0.42.1 for the demo") from exc
    # What diffusers' MiniMax-H3 pipeline and its fp32-module loading need besides diffusers itself.
    missing = [name for name in ("transformers", "accelerate") if not importable(name)]
    if missing:
        raise Skipped(f"the demo needs {' and '.join(missing)} besides diffusers, not importable here")
    from adalncache.cli import main as cli_main

    argv = ["demo", "--device", str(ctx.device), "--size", ctx.args.demo_size, "--steps", str(ctx.args.demo_steps)]
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = cli_main(argv)
    text = captured.getvalue()
    print(text, flush=True)
    return {"ok": code == 0, "exit_code": code, "argv": argv, "output": text[-4000:]}


def check_first_request(ctx: Context) -> dict[str, Any]:
    """A first request's prompt encoding + pass + first step on this device, its pass on a background
    thread started before the prompt is encoded (``overlap=True``) against before step 0: the bench's
    ``first-request`` section (a MiniMax-H3 and a Qwen-Image pipeline; the latter loaded by
    ``load_transformer`` from a checkpoint whose pages are dropped). Exactness (latents
    ``torch.equal``) decides the verdict; the ratios are what the device shows.
    """
    missing = [name for name in ("diffusers", "transformers") if not importable(name)]
    if missing:
        raise Skipped(f"the first-request check runs tiny pipelines and needs {' and '.join(missing)}")
    from adalncache.tools.bench.models import bench_first_request
    from adalncache.tools.bench.workload import Results

    size = "medium" if ctx.device.type == "cuda" else "tiny"
    res = Results(config={"device": str(ctx.device), "size": size})
    bench_first_request(res, size, 3 if ctx.device.type == "cuda" else 1, ctx.work / "first-request", ctx.device)
    exact = {name: res.values[name]["latents_bit_identical"] for name in ("first_request", "first_request_qwen")}
    return {
        "ok": all(exact.values()),
        "latents_bit_identical": exact,
        "size": size,
        "ratios": {f"{c.name}: {c.subject} / {c.baseline}": round(c.ratio, 3) for c in res.comparisons},
        "qwen_parts_s": res.values["first_request_qwen"].get("parts_s"),
    }


def _stray(timestep: torch.Tensor) -> torch.Tensor:
    """``timestep`` one fp32 ulp up: the same shape as a prepared plan, and none of them."""
    return torch.nextafter(timestep, torch.full_like(timestep, 2000.0))


def check_graph_capture(ctx: Context) -> dict[str, Any]:
    """A prepared request's forward captured in a CUDA graph and replayed: exact, and a stray timestep
    written into the captured input gives NaN and a PlanMismatchError at ``check_request()``.

    On a CPU the same forwards run eagerly (no graph to capture): the code path and the verdicts
    are the same, which is what the test suite runs.
    """
    missing = [name for name in ("diffusers", "transformers") if not importable(name)]
    if missing:
        raise Skipped(f"the graph-capture check runs a tiny MiniMax-H3 and needs {' and '.join(missing)}")
    from adalncache import PlanMismatchError
    from adalncache.diffusers import enable_adaln_cache
    from adalncache.tools.tiny import make_request, tiny_transformer

    device = ctx.device
    model = tiny_transformer("tiny", seed=0).to(device)
    request = make_request(model, "t2va", 4, seed=3, device=device)
    kwargs = request.forward_kwargs(1, request.latents.clone(), request.audio_latents.clone())
    with torch.no_grad():
        resident = model(**kwargs)[0].clone()
    handle = enable_adaln_cache(model)
    try:
        handle.prepare(request.plans)
        static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        run, how = _captured(model, static, device)
        exact = bool(torch.equal(run(), resident))
        static["timestep"].copy_(_stray(kwargs["timestep"]))
        stray_nan = bool(torch.isnan(run()).all())
        try:
            handle.check_request()
            reported = ""
        except PlanMismatchError as exc:
            reported = str(exc)
        static["timestep"].copy_(kwargs["timestep"])
        exact_again = bool(torch.equal(run(), resident))
        handle.check_request()
        handle.cache.check_invariants()
    finally:
        handle.disable()
    return {
        "ok": exact and stray_nan and bool(reported) and exact_again,
        "how": how,
        "exact": exact,
        "stray_forward_all_nan": stray_nan,
        "mismatch_reported": reported[:300],
        "exact_after_mismatch": exact_again,
    }


def _captured(model: Any, static: dict[str, Any], device: torch.device) -> tuple[Callable[[], torch.Tensor], str]:
    """``run()`` replaying ``model(**static)`` from a CUDA graph (CUDA), or calling it (elsewhere)."""
    if device.type != "cuda":

        def eager() -> torch.Tensor:
            with torch.no_grad():
                out: torch.Tensor = model(**static)[0]
            return out.clone()

        return eager, "eager forwards (no CUDA device: nothing to capture)"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():  # warm-up off the capture, as torch.cuda.graph asks
        for _ in range(2):
            model(**static)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        captured = model(**static)[0]

    def replay() -> torch.Tensor:
        graph.replay()
        return captured.clone()

    return replay, "one CUDA graph captured, replayed with new inputs copied into its static tensors"


#: name, function; the order is the run order (the demo last; it, graph-capture and first-request need diffusers).
CHECKS: list[tuple[str, Callable[[Context], dict[str, Any]]]] = [
    ("environment", check_environment),
    ("checkpoint", check_checkpoint),
    ("exact-match", check_exact_match),
    ("exact-fp32", check_exact_fp32),
    ("batched", check_batched),
    ("in-place", check_in_place),
    ("tiled", check_tiled),
    ("o-direct", check_o_direct),
    ("lagging-consumer", check_lagging_consumer),
    ("memory", check_memory),
    ("stream-publish", check_stream_publish),
    ("stream-evict", check_stream_evict),
    ("acquire", check_acquire),
    ("threads", check_threads),
    ("tf32", check_tf32),
    ("nccl", check_nccl),
    ("host-tier", check_host_tier),
    ("timing", check_timing),
    ("graph-capture", check_graph_capture),
    ("first-request", check_first_request),
    ("demo", check_demo),
]
NAMES = [name for name, _ in CHECKS]
#: Tighter watchdogs where a hang is likelier than slowness (a collective that never completes).
LIMITS = {"nccl": 120.0}
#: Checks that run in a fresh process of this script (see :func:`in_fresh_process`).
IN_CHILD = {"memory", "nccl"}


# ---------------------------------------------------------------------------------------------
# running


def run_check(name: str, fn: Callable[[Context], dict[str, Any]], ctx: Context, report: Report, limit_s: float) -> None:
    """One check in its own try, under a watchdog; its result goes into the report either way."""
    simulate = ctx.args.simulate.split(",")
    start = time.perf_counter()
    ctx.limit_s = limit_s

    def hung() -> None:
        report.add({"check": name, "ok": False, "error": f"timed out after {limit_s:.0f} s (watchdog)"})
        report.write(finished=False, aborted=f"check {name} timed out")
        print(f"gpu_check: {name} exceeded {limit_s:.0f} s; stacks follow, then exit", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(2)

    watchdog = threading.Timer(limit_s, hung)
    watchdog.daemon = True
    watchdog.start()
    result: dict[str, Any]
    try:
        if ctx.args.child or name not in IN_CHILD:  # a check run in a child is simulated there
            if f"fail:{name}" in simulate:
                raise RuntimeError(f"simulated failure of {name} (--simulate)")
            if f"hang:{name}" in simulate:
                time.sleep(3600)
        result = {"check": name, **fn(ctx)}
    except Skipped as exc:
        result = {"check": name, "ok": None, "skipped": str(exc)}
    except BaseException as exc:  # a check must never take the others down with it
        if isinstance(exc, KeyboardInterrupt):
            watchdog.cancel()
            raise
        result = {
            "check": name,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    finally:
        watchdog.cancel()
    result["seconds"] = round(time.perf_counter() - start, 2)
    report.add(result)
    gc.collect()
    if ctx.device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(ctx.device)
            torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--out",
        default="gpu_check_results",
        help="directory for gpu_check.json, written after every check (default: gpu_check_results)",
    )
    parser.add_argument("--dir", default="", help="work directory for the checkpoints (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=4, help="blocks of the real-width checkpoint (default 4)")
    parser.add_argument("--hidden", type=int, default=5376, help="hidden size (default: the released 5376)")
    parser.add_argument("--in-features", type=int, default=2688, help="projection input (default: 2688)")
    parser.add_argument("--only", default="", help=f"comma-separated checks to run, in their order: {','.join(NAMES)}")
    parser.add_argument("--check-timeout", type=float, default=240.0, help="watchdog per check, seconds")
    parser.add_argument("--deadline", type=float, default=420.0, help="skip the remaining checks after this many s")
    parser.add_argument("--demo-size", default="small", choices=["tiny", "small"])
    parser.add_argument("--demo-steps", type=int, default=8)
    parser.add_argument("--simulate", default="", help=argparse.SUPPRESS)  # fail:NAME,hang:NAME,... (tests)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run by in_fresh_process
    args = parser.parse_args(argv)
    unknown = [n for n in args.only.split(",") if n and n not in NAMES]
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; choose from {NAMES}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out) if args.out else None
    header = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:] if argv is None else argv,
        "checks": NAMES,
    }
    report = Report(out, header)
    print(f"gpu_check: device {device}, torch {torch.__version__}, python {platform.python_version()}", flush=True)
    chosen = [n for n in args.only.split(",") if n] or NAMES
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="adalncache-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, device, work)
    started = time.perf_counter()
    try:
        for name, fn in CHECKS:
            if name not in chosen:
                continue
            left = args.deadline - (time.perf_counter() - started)
            if left < 5:
                report.add({"check": name, "ok": None, "skipped": f"out of time (--deadline {args.deadline:.0f} s)"})
                continue
            run_check(name, fn, ctx, report, min(LIMITS.get(name, args.check_timeout), args.check_timeout, left))
    finally:
        if not args.dir:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    report.write(finished=True)
    failed = report.failed()
    skipped = [r["check"] for r in report.results if r.get("skipped")]
    print(
        f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'no failures'}"
        + (f"; skipped: {', '.join(skipped)}" if skipped else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
