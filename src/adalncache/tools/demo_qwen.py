"""``adalncache demo --model qwen-image``: a tiny Qwen-Image pipeline, resident versus cached, with a verdict.

Offline and deterministic: a tiny ``QwenImageTransformer2DModel`` saved in bf16 as a sharded
diffusers checkpoint, a ``QwenImagePipeline`` around it (tiny VAE; ``prompt_embeds`` instead of a
text encoder, which needs tokenizer files), run once with the stock transformer and once with one
:func:`~adalncache.diffusers.load_transformer` loaded without reading its modulation projections or
timestep embedder, served by the cache. The verdict compares the images with ``torch.equal``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..devices import resolve_device
from ..errors import ConfigError

#: Image size of the demo's request: 64 px is a 4 x 4 grid of packed latent tokens.
SIZE = 64


def _served_parameter_bytes(model: Any) -> int:
    names = ("img_mod.1.", "txt_mod.1.", "norm_out.linear.", "time_text_embed.timestep_embedder.")
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if p.device.type != "meta" and any(part in name for part in names)
    )


def run_qwen(args: argparse.Namespace) -> int:
    """The demo on Qwen-Image: returns 0 when the cached images equal the resident ones, else 1."""
    from diffusers import QwenImageTransformer2DModel

    from .demo_files import bf16_files, no_loading_bars, run_cached
    from .tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline, tiny_qwen_transformer

    if not isinstance(args.steps, int) or args.steps < 1:
        raise ConfigError(f"--steps must be a positive integer (num_inference_steps), got {args.steps}")
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix="adalncache-demo-qwen-") as tmp:
        directory = Path(tmp) / "transformer"
        bf16_files(tiny_qwen_transformer("plain", seed=args.seed), Path(tmp) / "fp32", directory)
        with no_loading_bars():
            stock = QwenImageTransformer2DModel.from_pretrained(directory, torch_dtype=torch.bfloat16).to(device).eval()
        pipe = tiny_qwen_pipeline(seed=args.seed, transformer=stock).to(device)
        pipe.set_progress_bar_config(disable=True)  # the demo prints its own lines only
        prompt = {k: v.to(device) for k, v in tiny_prompt_embeds(stock, seed=args.seed).items()}

        def run() -> tuple[torch.Tensor, float]:
            generator = torch.Generator(device).manual_seed(args.seed)
            start = time.perf_counter()
            out = pipe(
                height=SIZE,
                width=SIZE,
                num_inference_steps=args.steps,
                generator=generator,
                output_type="pt",
                true_cfg_scale=1.0,
                **prompt,
            )
            return out.images, time.perf_counter() - start

        resident, resident_s = run()
        bytes_before = _served_parameter_bytes(stock)
        cached = run_cached(pipe, directory, device, run, _served_parameter_bytes)
    identical = torch.equal(cached.output, resident)
    rows = [
        ("request", f"{SIZE}x{SIZE}, {args.steps} steps (QwenImagePipeline, bf16)"),
        *cached.rows("modulation projections and timestep embedder", bytes_before, resident_s),
    ]
    print(f"adalncache demo: tiny Qwen-Image, device {device}, seed {args.seed}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"bit-identical: {'yes' if identical else 'no'}")
    return 0 if identical else 1


__all__ = ["run_qwen"]
