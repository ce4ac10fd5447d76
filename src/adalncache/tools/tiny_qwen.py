"""Tiny deterministic Qwen-Image transformers (a real ``QwenImageTransformer2DModel``, no download).

Variants: ``"plain"`` (Qwen-Image), ``"zero-cond"`` (``zero_cond_t``, as Qwen-Image-Edit-2511) and
``"layered"`` (``use_additional_t_cond``, as Qwen-Image-Layered). The sizes keep a forward on two
CPU cores in milliseconds while every code path of the released model runs: two blocks, two heads.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .tiny import seeded, widen

#: The constructor arguments shared by every variant.
BASE: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 24,
    "axes_dims_rope": (4, 6, 6),
}

#: Sizes over :data:`BASE`: "tiny" for tests; "medium" (8 blocks of width 768, each block's two
#: modulation projections 768 x 4,608) makes a pass take long enough to measure beside a forward.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "medium": {
        "num_layers": 8,
        "attention_head_dim": 64,
        "num_attention_heads": 12,
        "joint_attention_dim": 64,
        "axes_dims_rope": (16, 24, 24),
    },
}

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "zero-cond": {"zero_cond_t": True},
    "layered": {"use_additional_t_cond": True},
}


def tiny_qwen_transformer(variant: str = "plain", seed: int = 0, size: str = "tiny") -> nn.Module:
    """A deterministic (:func:`~adalncache.tools.tiny.seeded`) fp32 ``QwenImageTransformer2DModel`` of
    ``variant``, its modulation projections widened, in eval mode."""
    from diffusers import QwenImageTransformer2DModel

    if variant not in VARIANTS:
        raise ConfigError(f"unknown tiny Qwen-Image variant {variant!r}: use one of {sorted(VARIANTS)}")
    if size not in SIZES:
        raise ConfigError(f"unknown tiny Qwen-Image size {size!r}: use one of {sorted(SIZES)}")
    config = {**BASE, **SIZES[size], **VARIANTS[variant]}

    def build() -> Any:
        model: Any = QwenImageTransformer2DModel(**config)
        widen(modulation_linears(model))
        if config.get("use_additional_t_cond"):
            with torch.no_grad():
                model.time_text_embed.addition_t_embedding.weight.normal_(0.0, 0.5)
        return model

    return seeded(build, seed).eval()


def modulation_linears(model: Any) -> list[Any]:
    """Every block's ``img_mod.1`` and ``txt_mod.1`` and ``norm_out.linear``, in the geometry's order."""
    linears = [linear for block in model.transformer_blocks for linear in (block.img_mod[1], block.txt_mod[1])]
    return [getattr(linear, "base_layer", linear) for linear in [*linears, model.norm_out.linear]]


def tiny_qwen_inputs(
    model: Any, batch: int = 1, *, seed: int = 0, dtype: torch.dtype | None = None, frames: int = 1
) -> dict[str, Any]:
    """Deterministic forward arguments for a tiny model: a 4x4 latent grid (x ``frames``), 5 text tokens.

    ``frames`` > 1 gives ``zero_cond_t`` models a condition image per sample (``img_shapes`` of
    several entries) as the Edit pipelines pass it. The timestep is the pipeline's ``t / 1000``.
    """
    config = model.config
    dtype = dtype or model.img_in.weight.dtype
    generator = torch.Generator().manual_seed(seed)
    tokens = 16 * frames
    hidden = torch.randn(batch, tokens, config.in_channels, generator=generator).to(dtype)
    text = torch.randn(batch, 5, config.joint_attention_dim, generator=generator).to(dtype)
    timestep = (torch.tensor([937.5, 250.0])[:batch] if batch <= 2 else torch.linspace(999, 1, batch)) / 1000
    inputs: dict[str, Any] = {
        "hidden_states": hidden,
        "encoder_hidden_states": text,
        "encoder_hidden_states_mask": torch.ones(batch, 5, dtype=torch.long),
        "timestep": timestep.to(dtype),
        "img_shapes": [[(1, 4, 4)] * frames for _ in range(batch)],
        "return_dict": False,
    }
    if config.use_additional_t_cond:
        inputs["additional_t_cond"] = torch.tensor([1] * batch, dtype=torch.long)
    return inputs


def tiny_qwen_vae(seed: int = 0) -> Any:
    """A deterministic tiny ``AutoencoderKLQwenImage`` (8x spatial, 4 latent channels), in eval mode."""
    from diffusers import AutoencoderKLQwenImage

    mean, std = [0.1, -0.2, 0.3, 0.0], [1.5, 2.0, 1.0, 2.5]
    args = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}
    vae: Any = seeded(lambda: AutoencoderKLQwenImage(**args, latents_mean=mean, latents_std=std), seed)
    return vae.eval()


def tiny_qwen_pipeline(
    variant: str = "plain",
    seed: int = 0,
    transformer: Any = None,
    pipeline: str = "QwenImagePipeline",
    *,
    text_encoder_layers: int = 0,
) -> Any:
    """A Qwen-Image pipeline of a tiny transformer and VAE, by default without text encoder, tokenizer or processor.

    ``pipeline``: ``QwenImagePipeline`` or another diffusers pipeline of the transformer (Edit,
    EditPlus, Layered: the latter with a ``"layered"`` transformer). The Edit pipelines' processor
    needs files that cannot be made offline: requests pass ``prompt_embeds`` and
    ``prompt_embeds_mask`` (:func:`tiny_prompt_embeds`) instead. ``text_encoder_layers`` > 0
    (``QwenImagePipeline`` only): the pipeline encodes its prompts itself, with
    :func:`~adalncache.tools.tiny.tiny_tokenizer` and a text encoder of that many layers.
    """
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipeline_class = getattr(diffusers, pipeline, None)
    if pipeline_class is None or not pipeline.startswith("QwenImage"):
        raise ConfigError(f"pipeline must name a diffusers Qwen-Image pipeline class, got {pipeline!r}")
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, shift_terminal=0.02, time_shift_type="exponential"
    )
    model: Any = transformer if transformer is not None else tiny_qwen_transformer(variant, seed)
    parts: dict[str, Any] = {
        "scheduler": scheduler,
        "vae": tiny_qwen_vae(seed),
        # The Layered pipeline casts its input image to the text encoder's dtype even when prompt
        # embeddings are passed: it gets a tiny real one (never called on a prompt).
        "text_encoder": tiny_qwen_text_encoder(seed) if pipeline == "QwenImageLayeredPipeline" else None,
        "tokenizer": None,
        "transformer": model,
    }
    if text_encoder_layers > 0:
        if pipeline != "QwenImagePipeline":
            raise ConfigError(f"text_encoder_layers needs pipeline='QwenImagePipeline', got {pipeline!r}")
        from .tiny import tiny_tokenizer

        parts["tokenizer"] = tokenizer = tiny_tokenizer()
        width = int(model.config.joint_attention_dim)
        parts["text_encoder"] = tiny_qwen_text_encoder(
            seed, width=width, layers=text_encoder_layers, vocab_size=len(tokenizer)
        )
    if "processor" in inspect.signature(pipeline_class.__init__).parameters:  # the Edit pipelines'
        parts["processor"] = None
    return pipeline_class(**parts)


def tiny_qwen_text_encoder(seed: int = 0, *, width: int = 16, layers: int = 1, vocab_size: int = 64) -> Any:
    """A deterministic tiny ``Qwen2_5_VLForConditionalGeneration`` (``layers`` text layers of ``width``,
    the transformer's ``joint_attention_dim``; one vision layer of width 16), in eval mode."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    quarter = width // 16  # the rotary sections split half of each head's width (width / 2 heads)
    text = {
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": vocab_size,
        "rope_scaling": {"type": "mrope", "mrope_section": [quarter, quarter, width // 4 - 2 * quarter]},
        "bos_token_id": None,
        "eos_token_id": None,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 16,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return seeded(lambda: Qwen2_5_VLForConditionalGeneration(config), seed).eval()


def tiny_prompt_embeds(model: Any, batch: int = 1, seed: int = 0, tokens: int = 5) -> dict[str, torch.Tensor]:
    """Deterministic ``prompt_embeds`` and ``prompt_embeds_mask`` for a tiny pipeline's transformer."""
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, tokens, model.config.joint_attention_dim, generator=generator)
    return {
        "prompt_embeds": embeds.to(model.img_in.weight.dtype),
        "prompt_embeds_mask": torch.ones(batch, tokens, dtype=torch.long),
    }
