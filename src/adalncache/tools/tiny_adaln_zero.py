"""Tiny seeded AdaLayerNormZero-family models, and the pipelines of the two the demo runs (Bria, Ovis-Image).

A tiny model is a real diffusers class small enough for a 2-core CPU, every weight drawn from a
seeded generator (not the class's own init, some of which zeroes projections). Its pipeline gets a
tiny one-level VAE (fp32, the dtype it runs in: building it logs nothing) and no text encoder (the
encoders need tokenizer files that cannot be made offline): a request passes seeded prompt
embeddings (:func:`prompt_embeds`). diffusers is imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .tiny import seeded

if TYPE_CHECKING:
    from torch import nn

#: Attention of every tiny class: 2 heads of 16 (hidden 32).
HEADS = {"num_attention_heads": 2, "attention_head_dim": 16}
#: The Flux-shaped classes' tiny blocks: two double and two single, 8 latent channels (2 x 2 packed).
FLUX = {**HEADS, "num_layers": 2, "num_single_layers": 2, "in_channels": 8, "axes_dims_rope": [4, 6, 6]}

#: The tiny config of each class the demo runs.
CONFIGS: dict[str, dict[str, Any]] = {
    "BriaTransformer2DModel": {**FLUX, "joint_attention_dim": 24},
    "OvisImageTransformer2DModel": {**FLUX, "out_channels": 8, "joint_attention_dim": 24},
}

#: The demo's pipeline of each of its classes.
PIPELINES = {"BriaTransformer2DModel": "BriaPipeline", "OvisImageTransformer2DModel": "OvisImagePipeline"}

#: Text tokens of a prompt's seeded embeddings.
TEXT_TOKENS = 5


def seeded_model(
    class_name: str, config: Mapping[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The diffusers class ``class_name`` built from ``config``, every parameter drawn from ``seed``, in eval mode."""
    import diffusers

    model = seeded(lambda: getattr(diffusers, class_name)(**config), seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def flux_vae(latent_channels: int) -> Any:
    """A one-level ``AutoencoderKL`` (scale factor 1), fp32."""
    import diffusers

    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        norm_num_groups=8,
        layers_per_block=1,
        # The released VAEs set it; BriaPipeline casts a VAE without one (``vae.to(float32)``, which
        # logs diffusers' direct-cast warning) when it is built.
        shift_factor=0.0,
    )


def pipeline_class(name: str) -> Any:
    """The diffusers pipeline class ``name``, imported without transformers' torchvision-fallback notices.

    Without torchvision, transformers binds an image processor a pipeline module imports to its PIL
    twin and logs a notice, which says nothing about the tiny pipelines (they use the PIL one).
    """
    import diffusers
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        return getattr(diffusers, name)
    finally:
        transformers_logging.set_verbosity(level)


def tiny_pipeline(transformer: Any) -> Any:
    """The demo's pipeline (:data:`PIPELINES`) of a tiny Bria or Ovis-Image ``transformer``, progress bars off."""
    import diffusers

    cls = pipeline_class(PIPELINES[type(transformer).__name__])
    vae = flux_vae(transformer.config.in_channels // 4)  # the pipelines pack 2 x 2 latent patches
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    pipe = cls(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_embeds(
    transformer: Any, seed: int = 0, *, width: int | None = None, tokens: int = TEXT_TOKENS
) -> torch.Tensor:
    """Seeded text embeddings of one prompt, in the transformer's dtype (``width``: its ``joint_attention_dim``)."""
    width = width or transformer.config.joint_attention_dim
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, width, generator=g).to(next(transformer.parameters()).dtype)
