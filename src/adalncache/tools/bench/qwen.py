"""The ``qwen`` section: a forward step of a tiny Qwen-Image, resident and served from the cache.

Two instances of the same seeded ``QwenImageTransformer2DModel`` (bf16, the released dtype) run the
same three-step request, one with its modulation projections resident, one with the cache
enabled (every plan prepared in one pass first). Exactness is ``torch.equal`` of every step's
output; timing is per step, the two taking turns.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .primitives import sync_device
from .results import Comparison, Results

#: The request's forward timesteps (the pipeline's ``t / 1000``).
TIMESTEPS = (0.999, 0.75, 0.5)


def bench_qwen(res: Results, runs: int, device: torch.device) -> None:
    """Per-step forward of a tiny Qwen-Image: cached vs resident, with the outputs compared bit for bit."""
    try:
        from ...diffusers import enable_adaln_cache
        from ..tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer
    except ImportError as exc:
        res.note(f"qwen forward comparison skipped: diffusers unavailable ({exc})")
        return
    models: dict[str, Any] = {
        name: tiny_qwen_transformer("plain").to(device=device, dtype=torch.bfloat16) for name in ("resident", "cached")
    }
    inputs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tiny_qwen_inputs(models["resident"]).items()
    }
    steps = [torch.tensor([t], dtype=torch.bfloat16, device=device) for t in TIMESTEPS]
    handle: Any = enable_adaln_cache(models["cached"], max_plans=len(steps))
    samples: dict[str, list[float]] = {"resident": [], "cached": []}
    exact = True
    try:
        handle.prepare(steps)
        with torch.no_grad():
            for t in steps:
                out = {name: model(**{**inputs, "timestep": t})[0] for name, model in models.items()}
                exact = exact and torch.equal(out["resident"], out["cached"])
            for _ in range(max(runs, 1) * 2):
                for t in steps:
                    for name, model in models.items():
                        sync_device(device)
                        started = time.perf_counter()
                        model(**{**inputs, "timestep": t})
                        sync_device(device)
                        samples[name].append(time.perf_counter() - started)
        passes = int(handle.stats.passes)
    finally:
        handle.disable()
    res.values["qwen_forward"] = {"steps": len(steps), "cached_bit_identical": exact, "passes": passes}
    res.add(
        Comparison(
            "forward step, tiny Qwen-Image (bf16)", "cached", "resident", samples["cached"], samples["resident"], 1.0,
            note=f"torch.equal outputs: {exact}; {passes} pass for the request",
        )
    )  # fmt: skip


__all__ = ["bench_qwen"]
