"""``adalncache demo --model bria | ovis-image``: a tiny AdaLayerNormZero-family pipeline, resident versus cached.

Offline and deterministic, like the Qwen-Image demo: a tiny ``BriaTransformer2DModel`` or
``OvisImageTransformer2DModel`` saved in bf16 as a sharded diffusers checkpoint, its diffusers
pipeline around it (tiny VAE; prompt embeddings instead of a text encoder, which needs tokenizer
files), run once with the stock transformer and once with one
:func:`~adalncache.diffusers.load_transformer` loaded without reading its modulation projections
(this family's time embedder is loaded), served by the cache. Bria's pipeline concatenates the conditional and
unconditional batch (two rows a forward), Ovis-Image's runs them as two forwards. The verdict
compares the latents with ``torch.equal``.
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
from ..families import adaln_zero

#: The demo's models: ``--model`` name -> diffusers class.
MODELS = {"bria": "BriaTransformer2DModel", "ovis-image": "OvisImageTransformer2DModel"}

#: Image size of the request (the tiny VAE does not downsample: a 4 x 4 grid of packed tokens).
SIZE = 8
GUIDANCE = 4.0


def _served_parameter_bytes(model: Any) -> int:
    """Bytes on the model's device of the served projections (the time embedder stays loaded in this family)."""
    name = type(model).__name__
    config = model.config
    fields = adaln_zero.fields_from_config(name, config)
    owners = [path for path, _, _ in adaln_zero.served_paths(name, fields["double_layers"], fields["single_layers"])]
    return sum(
        p.numel() * p.element_size()
        for path, p in model.named_parameters()
        if p.device.type != "meta" and any(path.startswith(f"{owner}.") for owner in owners)
    )


def run_adaln_zero(args: argparse.Namespace) -> int:
    """The demo on ``args.model`` (a key of :data:`MODELS`): 0 when the cached latents equal the resident ones."""
    from . import tiny_adaln_zero as tiny
    from . import tiny_adaln_zero_pipelines as pipelines
    from .demo_files import bf16_files, no_loading_bars, run_cached

    if not isinstance(args.steps, int) or args.steps < 1:
        raise ConfigError(f"--steps must be a positive integer (num_inference_steps), got {args.steps}")
    class_name = MODELS[args.model]
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix=f"adalncache-demo-{args.model}-") as tmp:
        directory = Path(tmp) / "transformer"
        bf16_files(tiny.build(class_name, seed=args.seed), Path(tmp) / "fp32", directory)
        cls: Any = tiny.model_class(class_name)
        with no_loading_bars():
            stock = cls.from_pretrained(directory, torch_dtype=torch.bfloat16).to(device).eval()
        pipe = pipelines.tiny_pipeline(stock).to(device)
        pipe.set_progress_bar_config(disable=True)  # the demo prints its own lines only
        prompt = pipelines.prompt_embeds(stock, seed=args.seed + 1).to(device)
        negative = pipelines.prompt_embeds(stock, seed=args.seed + 2).to(device)
        extra = {"negative_prompt": None} if args.model == "ovis-image" else {}

        def run() -> tuple[torch.Tensor, float]:
            generator = torch.Generator(device).manual_seed(args.seed)
            start = time.perf_counter()
            out = pipe(
                prompt_embeds=prompt,
                negative_prompt_embeds=negative,
                guidance_scale=GUIDANCE,
                height=SIZE,
                width=SIZE,
                num_inference_steps=args.steps,
                generator=generator,
                output_type="latent",
                **extra,
            )
            return out.images, time.perf_counter() - start

        resident, resident_s = run()
        bytes_before = _served_parameter_bytes(stock)
        cached = run_cached(pipe, directory, device, run, _served_parameter_bytes)
    identical = torch.equal(cached.output, resident)
    rows = [
        ("request", f"{SIZE}x{SIZE}, {args.steps} steps, guidance {GUIDANCE:g} ({type(pipe).__name__}, bf16)"),
        *cached.rows("modulation projections", bytes_before, resident_s),
    ]
    title = adaln_zero.layout_of(class_name).title
    print(f"adalncache demo: tiny {title} ({class_name}), device {device}, seed {args.seed}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"bit-identical: {'yes' if identical else 'no'}")
    return 0 if identical else 1


__all__ = ["MODELS", "run_adaln_zero"]
