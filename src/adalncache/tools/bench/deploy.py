"""The ``deploy`` section: deploying without the projections, on a tiny MiniMax-H3 in the released precision.

Side by side, measured:

* the peak resident memory of load + enable + one request, ``from_pretrained`` then
  ``enable_adaln_cache`` against ``load_transformer``, each in a fresh process
  (:func:`memory_probe`: a process's peak cannot be reset below what its imports already touched,
  so ``VmHWM`` is reset through ``/proc/self/clear_refs`` once the imports are done);
* the bytes the load reads from the checkpoint (page cache dropped first) and the served bytes it
  leaves in the page cache;
* the bytes block-level group offloading onloads per forward, with and without the cache.

Then the released geometry as arithmetic (:mod:`.released`): what a 24, 48 and 80 GB card must
hold either way. The measurements themselves are :mod:`adalncache.tools.measure`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ...plans import minimax_h3_plans, plan_key
from ..measure import (
    OnloadMeter,
    drop_page_cache,
    io_read_bytes,
    proc_status,
    resident_served_bytes,
    served_bytes,
    weight_files,
)
from .released import card_table, onloaded_per_step, released_sizes, request_slab_bytes
from .results import Comparison, Results

#: The modes of :func:`memory_probe`: a stock load then ``enable_adaln_cache`` (serving the model's
#: own weights, or the checkpoint), and ``load_transformer``.
MODES = ("stock", "stock-checkpoint", "load_transformer")

_CHILD = """
import json, sys
from adalncache.tools.bench.deploy import memory_probe
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

    from ...diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
    from ..tiny import make_request, run_loop

    mode, checkpoint = args["mode"], Path(args["checkpoint"])
    task, steps = args.get("task", "t2va"), int(args.get("steps", 4))
    torch.set_num_threads(1)
    files = weight_files(checkpoint)
    plans = minimax_h3_plans(task, steps)
    distinct = len({plan_key(p) for p in plans})
    dropped = drop_page_cache(files)
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


def bench_deploy(res: Results, size: str, steps: int, *, quick: bool = False) -> None:
    """Deploying without the projections (module docstring). ``quick`` leaves out the stock load
    served from its checkpoint (one fresh process less)."""
    try:
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

        from ..tiny import tiny_transformer
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
        _compare_probes(res, size, probes, served, total)
        values["onloaded_per_forward"] = onloads = onloaded_per_forward(checkpoint, steps)
        res.add(
            Comparison(
                f"bytes onloaded per forward by group offloading (block level, 1 block per group), '{size}'",
                "with the cache",
                "without",
                [onloads["with"]],
                [onloads["without"]],
                None,
                note="the projections and the time embedder are never onloaded",
                unit="bytes",
            )
        )
    values.update(_released(res))
    res.values["deploy"] = values


def _compare_probes(res: Results, size: str, probes: dict[str, Any], served: int, total: int) -> None:
    """The fresh processes side by side: peak resident memory, and the bytes their load read."""
    new = probes["load_transformer"]
    for stock_mode, label in (("stock", "its own weights"), ("stock-checkpoint", "checkpoint=")):
        if stock_mode not in probes:
            continue
        stock = probes[stock_mode]
        res.add(
            Comparison(
                f"peak resident memory of load + enable + one t2va request, '{size}' (fresh processes)",
                "load_transformer",
                f"from_pretrained + enable_adaln_cache({label})",
                [float(new["peak"])],
                [float(stock["peak"])],
                None,
                note=f"anonymous {new['anon'] / 2**20:.0f} vs {stock['anon'] / 2**20:.0f} MiB, file-backed "
                f"{new['file'] / 2**20:.0f} vs {stock['file'] / 2**20:.0f} MiB; served tensors "
                f"{served / 2**20:.0f} MiB of {total / 2**20:.0f} MiB",
                unit="bytes",
            )
        )
    stock = probes["stock"]
    if new["load_read_bytes"] is not None and stock["load_read_bytes"]:
        res.add(
            Comparison(
                f"checkpoint bytes read by the load, '{size}' (page cache dropped)",
                "load_transformer",
                "from_pretrained",
                [float(new["load_read_bytes"])],
                [float(stock["load_read_bytes"])],
                None,
                note=f"served tensors' pages cached by the load: {new['served_resident_after_load']} B vs "
                f"{stock['served_resident_after_load'] / 2**20:.1f} MiB",
                unit="bytes",
            )
        )


def onloaded_per_forward(checkpoint: Path, steps: int) -> dict[str, float]:
    """Bytes block-level group offloading (1 block per group) onloads per forward, without and with the cache.

    CPU to CPU: the bytes, not the time.
    """
    from diffusers.hooks import apply_group_offloading
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from ...diffusers import adaln_cache_handle, load_transformer
    from ..tiny import make_request, run_loop

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
    return onloads


def _released(res: Results) -> dict[str, Any]:
    """The released geometry's arithmetic, as notes; the values it adds to the section's."""
    sizes = released_sizes()
    slab = request_slab_bytes()
    table = card_table(sizes, slab)
    stock_step, cached_step = onloaded_per_step(sizes)
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
    return {"released_sizes": sizes, "card_table": table, "released_onloaded_per_step": [stock_step, cached_step]}


__all__ = ["MODES", "bench_deploy", "memory_probe", "onloaded_per_forward", "run_memory_probe"]
