"""Tiny seeded AdaLayerNormZero-family models, and the pipelines of the two the demo runs (Bria, Ovis-Image).

A tiny model is a real diffusers class (``BriaTransformer2DModel``, ``OvisImageTransformer2DModel``,
or any class of the family given its config) small enough for a 2-core CPU, its weights filled from
a seeded generator (not the class's own init, some of which zeroes projections), so two builds with
the same seed are the same model, and a bf16 copy round-trips through
``save_pretrained``/``from_pretrained``.

Its pipeline gets a tiny one-level VAE (only sized: the demo's requests return latents) and no text
encoder: the encoders need tokenizer files that cannot be made offline, so a request passes seeded
prompt embeddings (:func:`prompt_embeds`). The VAE is built at the dtype it runs in (fp32,
diffusers' default), so building it logs nothing.

Everything imports diffusers lazily: ``import adalncache.tools.tiny_adaln_zero`` works without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

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

    cls = getattr(diffusers, class_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**config)
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

    Some pipeline modules import ``CLIPImageProcessor`` or ``SiglipImageProcessor`` at module level;
    without torchvision, transformers binds each to its PIL twin and logs a notice once. The tiny
    pipelines use no image processor but the PIL one they are given, so the notice says nothing
    about them: transformers' log level is raised for the import only, then restored.
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
