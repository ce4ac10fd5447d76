"""Measuring a process and its checkpoint files: what a load reads, what a process holds, what offloading moves.

One home for the measurements the benchmark, ``make demo``, the tests and ``scripts/gpu_check.py``
share: the page cache (``posix_fadvise`` and ``mincore``), bytes read (``/proc/self/io``, which
counts page faults of mapped files too), memory (``/proc/self/status``, ``/proc/meminfo``) and the
bytes diffusers' group offloading onloads. Linux only; an unavailable measurement is ``None``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..source.files import CheckpointFiles
from ..source.reads import PAGE, resident_fraction

#: The tensors the cache serves, in either layout: every block's projection, the output layer's,
#: and the time embedder (MiniMax-H3's; Qwen-Image's ``img_mod.1``, ``txt_mod.1`` and timestep embedder;
#: the AdaLayerNormZero family's ``norm1``, ``norm1_context`` and single blocks' ``norm`` linears, whose
#: time embedder ``load_transformer`` loads).
SERVED = re.compile(
    r"^(transformer_blocks\.\d+\.adaln_proj\.linear|norm_out\.linear|blocks\.\d+\.adaln_proj\.linear"
    r"|final_layer\.adaln_proj\.linear|time_embedder"
    r"|transformer_blocks\.\d+\.(img|txt)_mod\.1|time_text_embed\.timestep_embedder"
    r"|transformer_blocks\.\d+\.norm1(_context)?\.linear|single_transformer_blocks\.\d+\.norm\.linear)\."
)

STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def served_bytes(files: Sequence[Path]) -> tuple[int, int]:
    """``(bytes of the served tensors, bytes of every tensor)`` in ``files``, from their headers."""
    served = total = 0
    for header in CheckpointFiles.read(list(files)).headers:
        for name, entry in header.entries.items():
            total += entry.nbytes
            if SERVED.match(name):
                served += entry.nbytes
    return served, total


def drop_page_cache(files: Sequence[Path]) -> bool:
    """Evict ``files`` from the page cache; True when ``mincore`` then finds none of them cached.

    Only clean pages can be dropped, so each file is written back first; pages a live mapping
    holds cannot be dropped either, so unreachable objects (a model loaded earlier whose tensors
    map the files) are collected first.
    """
    gc.collect()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return all(cached_fraction(Path(path), 0, Path(path).stat().st_size) == 0.0 for path in files)


def cached_fraction(path: Path, offset: int, nbytes: int) -> float | None:
    """The fraction of ``nbytes`` at ``offset`` in ``path`` that the page cache holds (``None``: unknown)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_fraction(fd, offset, nbytes)
    finally:
        os.close(fd)


def resident_served_bytes(files: Sequence[Path]) -> int:
    """Bytes of whole pages inside served tensors that the page cache holds (nothing is touched)."""
    total = 0
    for header in CheckpointFiles.read(list(files)).headers:
        for name, entry in header.entries.items():
            if not SERVED.match(name):
                continue
            first = -(-entry.begin // PAGE) * PAGE
            last = entry.end // PAGE * PAGE
            if last > first:
                fraction = cached_fraction(header.path, first, last - first) or 0.0
                total += round(fraction * (last - first))
    return total


def io_read_bytes() -> int | None:
    """Bytes this process made the block layer read so far (``/proc/self/io``), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "read_bytes":
                return int(value)
    except OSError:
        return None
    return None


def proc_status(keys: Sequence[str] = STATUS_KEYS) -> dict[str, int]:
    """This process's memory counters ``keys`` from ``/proc/self/status``, in bytes; empty without ``/proc``."""
    with contextlib.suppress(OSError):
        return _kib_counters("/proc/self/status", keys)
    return {}


def meminfo() -> dict[str, int]:
    """The machine's ``/proc/meminfo`` counters, in bytes (``Cached``: the page cache)."""
    return _kib_counters("/proc/meminfo")


def _kib_counters(path: str, keys: Sequence[str] | None = None) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if keys is None or key in keys:
                out[key] = int(value.split()[0]) * 1024
    return out


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer around it measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of ``fn()``, the device synchronised before and after."""
    sync_device(device)
    start = time.perf_counter()
    fn()
    sync_device(device)
    return time.perf_counter() - start


class OnloadMeter:
    """Counts what diffusers' group offloading onloads: calls and bytes of every group's ``onload_``.

    Wraps ``ModuleGroup.onload_``, the one entry point of an onload (from memory, from disk, or a
    prefetch); the bytes are those of the group's tensors that hold data (a parked placeholder is
    no parameter and so is never among them).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from ..integrations.diffusers.compat import group_offloading_hook

        self.calls = 0
        self.bytes = 0
        groups: list[Any] = []
        for module in model.modules():
            hook = group_offloading_hook(module)
            if hook is not None and all(hook.group is not g for g in groups):
                groups.append(hook.group)
                self._wrap(hook.group)
        if not groups:
            raise ValueError("no group offloading hook on this model: apply group offloading first")

    def _wrap(self, group: Any) -> None:
        original: Callable[[], Any] = group.onload_

        def onload_() -> Any:
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in _group_tensors(group) if t.device.type != "meta")
            return original()

        group.onload_ = onload_


def _group_tensors(group: Any) -> list[torch.Tensor]:
    """Each tensor of ``group`` once: its modules' parameters and buffers, then its own."""
    tensors = [t for module in group.modules for t in (*module.parameters(), *module.buffers())]
    return list({id(t): t for t in (*tensors, *group.parameters, *group.buffers)}.values())
