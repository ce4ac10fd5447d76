"""The ``forward`` section: a forward step of a tiny MiniMax-H3, resident, served from the cache, and offloaded.

Three instances of the same seeded model run the same request: with its projections resident,
with the cache enabled, and with diffusers' group offloading moving the projections (to disk on
a CPU, where offloading to the CPU would be a no-op; to host memory on a GPU). Exactness comes
from the real denoising loop; timing is per step, the three variants taking turns.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch

from .primitives import sync_device
from .results import Comparison, Results


def bench_forward(res: Results, size: str, steps: int, runs: int, device: torch.device) -> None:
    """Per-step forward of a tiny MiniMax-H3: resident vs cached vs group offloading.

    On a CPU, offloading to the CPU would be a no-op, so the projections go to disk
    (``offload_to_disk_path``); on a GPU they are offloaded to host memory.
    """
    try:
        from diffusers.hooks import apply_group_offloading

        from ...diffusers import enable_adaln_cache
        from ...plans import plan_key
        from ..tiny import make_request, run_loop, tiny_transformer
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
        "size": size,
        "steps": steps,
        "cached_bit_identical": exact,
        "device": str(device),
        "offload_to": offload_to,
        "offload_bit_identical": bool(resident_out.equal(offload_out)),
    }
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


__all__ = ["bench_forward"]
