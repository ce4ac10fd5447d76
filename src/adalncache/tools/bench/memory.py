"""The ``memory`` section: projection bytes against slab bytes, and the peak anonymous memory of a pass.

The pass runs in a child process (:func:`probe_pass`) so the parent's buffers do not count; the
kernel keeps no peak of anonymous memory, so the child samples ``RssAnon`` every millisecond while
the pass runs. The page cache is file-backed and reported apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ...cache import AdalnCache
from ...plans import plan_key
from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from ..measure import meminfo, proc_status
from .results import Comparison, Results
from .workload import STEPS, make_inputs, request_plans

_PROBE = r"""
import json, sys, threading, time
args = json.loads(sys.argv[1])
from adalncache.tools.bench.memory import probe_pass
print(json.dumps(probe_pass(args)))
"""


def probe_pass(args: dict[str, Any]) -> dict[str, Any]:
    """Child process: one pass, sampling RssAnon every millisecond (the kernel keeps no anon peak)."""
    spec = ModulationSpec(**args["spec"])
    source = CheckpointSource(args["checkpoint"], spec)
    plans = request_plans(STEPS)[: args["plans"]]
    device = torch.device(args.get("device", "cpu"))
    inputs = make_inputs(spec, plans, device)
    baseline = proc_status()
    cache = AdalnCache(spec, source, max_plans=len(plans), max_plan_width=4, progress=False, device=device)
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
        cache.build(plans, embed=lambda p: inputs[plan_key(p)])
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
    meminfo_before = meminfo()
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


__all__ = ["bench_memory", "probe_pass"]
