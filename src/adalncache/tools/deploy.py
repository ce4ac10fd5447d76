"""Measuring a deployment: what a load reads, what a process holds, what offloading moves.

Used by the benchmark's ``deploy`` section, by ``make demo`` and by the tests, so all three
measure the same way:

* **bytes read** from the checkpoint files: ``/proc/self/io`` ``read_bytes`` (it counts page
  faults of mapped files as well as ``read``), after the files' page cache was dropped
  (``posix_fadvise(DONTNEED)``, checked with ``mincore``);
* **served bytes resident**: whole pages lying inside the served tensors (the AdaLN projections
  and the time embedder) that the page cache holds, asked with ``mincore`` without touching them;
* **peak resident memory** of a load + enable + one request, in a fresh process (a process's peak
  cannot be reset below what its imports already touched): ``VmHWM`` after resetting it through
  ``/proc/self/clear_refs`` once the imports are done;
* **bytes onloaded** by diffusers' group offloading: every group's ``onload_`` is wrapped and the
  bytes of the tensors it moves are summed;
* the **released geometry** as arithmetic: byte counts of the released MiniMax-H3 built on meta.

Linux only (``/proc``); where a measurement is not available the functions return ``None``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..source import CheckpointFiles, checkpoint_files, resident_fraction
from ..spec import ModulationSpec

#: The tensors the cache serves, in either layout: every block's projection, the output layer's,
#: and the time embedder.
SERVED = re.compile(
    r"^(transformer_blocks\.\d+\.adaln_proj\.linear|norm_out\.linear|blocks\.\d+\.adaln_proj\.linear"
    r"|final_layer\.adaln_proj\.linear|time_embedder)\."
)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
GIB = 2**30

# ---------------------------------------------------------------------------------------------------- files


def weight_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index's, or every one)."""
    return checkpoint_files(directory)[0]


def served_bytes(files: Sequence[Path]) -> tuple[int, int]:
    """``(bytes of the served tensors, bytes of every tensor)`` in ``files``, from their headers."""
    served = total = 0
    for header in CheckpointFiles.read(list(files)).headers:
        for name, entry in header.entries.items():
            total += entry.nbytes
            if SERVED.match(name):
                served += entry.nbytes
    return served, total


def drop_cached(files: Sequence[Path]) -> bool:
    """Evict ``files`` from the page cache; True when ``mincore`` then finds none of them cached.

    Pages a live mapping holds cannot be dropped, so unreachable objects (a model loaded earlier
    whose tensors map the files) are collected first.
    """
    gc.collect()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return all(_cached_fraction(path, 0, path.stat().st_size) == 0.0 for path in files)


def _cached_fraction(path: Path, offset: int, nbytes: int) -> float | None:
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
                fraction = _cached_fraction(header.path, first, last - first) or 0.0
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


def proc_status() -> dict[str, int]:
    """This process's resident memory in bytes: ``VmHWM`` (peak), ``VmRSS``, ``RssAnon``, ``RssFile``."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


# ---------------------------------------------------------------------------------------------------- fresh process

#: The modes of :func:`memory_probe`: a stock load then ``enable_adaln_cache`` (serving the model's
#: own weights, or the checkpoint), and ``load_transformer``.
MODES = ("stock", "stock-checkpoint", "load_transformer")

_CHILD = """
import json, sys
from adalncache.tools.deploy import memory_probe
print(json.dumps(memory_probe(json.loads(sys.argv[1]))))
"""


def memory_probe(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: load, enable, prepare and run one request; what it read and held.

    ``args``: ``mode`` (one of :data:`MODES`), ``checkpoint`` (a diffusers-layout directory saved in
    the released mixed precision), ``task``, ``steps``. Returns the bytes read by the load, the
    served bytes it left in the page cache, and the peak resident memory above the level after the
    imports (``peak``), with its anonymous and file-backed parts at the end.
    """
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from ..diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
    from ..plans import minimax_h3_plans, plan_key
    from .tiny import make_request, run_loop

    mode, checkpoint = args["mode"], Path(args["checkpoint"])
    task, steps = args.get("task", "t2va"), int(args.get("steps", 4))
    torch.set_num_threads(1)
    files = weight_files(checkpoint)
    plans = minimax_h3_plans(task, steps)
    distinct = len({plan_key(p) for p in plans})
    dropped = drop_cached(files)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of what follows
        resettable = True
    except OSError:
        resettable = False
    base = proc_status()
    read0 = io_read_bytes()
    started = time.perf_counter()
    if mode == "load_transformer":
        model: Any = load_transformer(checkpoint, torch_dtype=torch.bfloat16, max_plans=distinct)
    elif mode in ("stock", "stock-checkpoint"):
        model = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint, torch_dtype=torch.bfloat16)
    else:
        raise ValueError(f"unknown mode {mode!r}: one of {MODES}")
    load_seconds = time.perf_counter() - started
    read1 = io_read_bytes()
    served_resident = resident_served_bytes(files)
    if mode != "load_transformer":
        enable_adaln_cache(model, checkpoint if mode == "stock-checkpoint" else None, max_plans=distinct)
    handle: Any = adaln_cache_handle(model)
    request = make_request(model, task, steps, seed=0)
    report = handle.prepare(plans)
    run_loop(model, request)
    end = proc_status()
    return {
        "mode": mode,
        "dropped": dropped,
        "peak_resettable": resettable,
        "load_read_bytes": None if read0 is None or read1 is None else read1 - read0,
        "load_seconds": load_seconds,
        "served_resident_after_load": served_resident,
        "peak": end["VmHWM"] - base["VmRSS"],
        "anon": end["RssAnon"] - base["RssAnon"],
        "file": end["RssFile"] - base["RssFile"],
        "passes": report.passes,
        "source_bytes_read": int(getattr(handle.source, "bytes_read", 0)),
    }


def run_memory_probe(
    mode: str, checkpoint: str | os.PathLike[str], *, task: str = "t2va", steps: int = 4, timeout: float = 600
) -> dict[str, Any]:
    """:func:`memory_probe` in a fresh Python process (the same interpreter and import path)."""
    args = {"mode": mode, "checkpoint": os.fspath(checkpoint), "task": task, "steps": steps}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"memory probe ({mode}) failed: {' | '.join(tail)}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------------------------------- offloading


class OnloadMeter:
    """Counts what diffusers' group offloading onloads: calls and bytes of every group's ``onload_``.

    Wraps ``ModuleGroup.onload_``, the one entry point of an onload (from memory, from disk, or a
    prefetch); the bytes are those of the group's tensors that hold data (a parked placeholder is
    no parameter and so is never among them).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

        self.calls = 0
        self.bytes = 0
        groups: list[Any] = []
        for module in model.modules():
            registry = getattr(module, "_diffusers_hook", None)
            hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
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

    def reset(self) -> None:
        self.calls = self.bytes = 0


def _group_tensors(group: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for module in group.modules:
        for tensor in (*module.parameters(), *module.buffers()):
            seen[id(tensor)] = tensor
    for tensor in (*group.parameters, *group.buffers):
        seen[id(tensor)] = tensor
    return list(seen.values())


# ---------------------------------------------------------------------------------------------------- arithmetic


def released_sizes() -> dict[str, int]:
    """Byte counts of the released MiniMax-H3 in its released mixed precision (arithmetic, no weights).

    The model is built on meta with the default config (the released geometry) and each
    parameter counted at bf16, or fp32 for the modules the model keeps in fp32.
    """
    import accelerate
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    with accelerate.init_empty_weights():
        model = MiniMaxH3Transformer3DModel()
    keep = list(MiniMaxH3Transformer3DModel._keep_in_fp32_modules or [])
    sizes = {"projections": 0, "time_embedder": 0, "blocks_rest": 0, "other": 0, "block_rest": 0, "block_projection": 0}
    for name, param in model.named_parameters():
        nbytes = param.numel() * (4 if any(k in name.split(".") for k in keep) else 2)
        if re.match(r"(transformer_blocks\.\d+\.adaln_proj\.linear|norm_out\.linear)\.", name):
            sizes["projections"] += nbytes
        elif name.startswith("time_embedder."):
            sizes["time_embedder"] += nbytes
        elif name.startswith("transformer_blocks."):
            sizes["blocks_rest"] += nbytes
        else:
            sizes["other"] += nbytes
        if name.startswith("transformer_blocks.0."):
            sizes["block_projection" if ".adaln_proj." in name else "block_rest"] += nbytes
    sizes["num_layers"] = int(model.config.num_layers)
    return sizes


def request_slab_bytes(steps: int = 50, task: str = "t2va") -> int:
    """The slab of the released geometry sized to one request: its distinct plans, its widest plan."""
    from ..plans import minimax_h3_plans, plan_key

    plans = minimax_h3_plans(task, steps)
    distinct = len({plan_key(plan) for plan in plans})
    return ModulationSpec.minimax_h3().slab_bytes(distinct, max(int(plan.numel()) for plan in plans))


def card_table(sizes: dict[str, int], slab: int, *, cards_gb: Sequence[int] = (24, 48, 80)) -> list[dict[str, Any]]:
    """What a card must hold, with and without the cache, per way of running (weights and tables only).

    ``resident``: every weight on the card (also what model CPU offload needs while the transformer
    runs); ``group offload``: block-level group offloading, one block per group: the weights outside
    the blocks stay for the forward, one block is onloaded at a time (two with a prefetching
    stream). With the cache the projections and the time embedder are gone and the slab
    (``slab`` bytes) is added. Activations are not counted.
    """
    stock_block = sizes["block_rest"] + sizes["block_projection"]
    cached_block = sizes["block_rest"]
    rows = {
        "resident": (
            sizes["projections"] + sizes["time_embedder"] + sizes["blocks_rest"] + sizes["other"],
            sizes["blocks_rest"] + sizes["other"] + slab,
        ),
        "group offload, 1 block in flight": (
            sizes["other"] + sizes["time_embedder"] + stock_block,
            sizes["other"] + cached_block + slab,
        ),
        "group offload with stream, 2 blocks in flight": (
            sizes["other"] + sizes["time_embedder"] + 2 * stock_block,
            sizes["other"] + 2 * cached_block + slab,
        ),
    }
    table = []
    for mode, (without, with_cache) in rows.items():
        row: dict[str, Any] = {"mode": mode, "without_cache_bytes": without, "with_cache_bytes": with_cache}
        for gb in cards_gb:
            row[f"{gb} GB"] = (without <= gb * 10**9, with_cache <= gb * 10**9)
        table.append(row)
    return table


def onloaded_per_step(sizes: dict[str, int]) -> tuple[int, int]:
    """Bytes block-level group offloading moves per step for the blocks, without and with the cache."""
    layers = sizes["num_layers"]
    return layers * (sizes["block_rest"] + sizes["block_projection"]), layers * sizes["block_rest"]


__all__ = [
    "MODES",
    "SERVED",
    "OnloadMeter",
    "card_table",
    "drop_cached",
    "io_read_bytes",
    "memory_probe",
    "onloaded_per_step",
    "proc_status",
    "released_sizes",
    "request_slab_bytes",
    "resident_served_bytes",
    "run_memory_probe",
    "served_bytes",
    "weight_files",
]
