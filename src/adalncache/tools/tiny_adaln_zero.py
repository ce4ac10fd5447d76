"""Deterministic tiny models of the AdaLayerNormZero family's eight diffusers classes, built offline.

Tests need each real class (``HunyuanImageTransformer2DModel``, ``MotifVideoTransformer3DModel``,
``BriaTransformer2DModel``, ``LongCatImageTransformer2DModel``, ``HunyuanVideo15Transformer3DModel``,
``AuraFlowTransformer2DModel``, ``BriaFiboTransformer2DModel``, ``OvisImageTransformer2DModel``)
small enough for a 2-core CPU, with every part its forward runs (double and single blocks, the
token refiner of the two Hunyuan classes, the optional embedders of ``timestep_r`` and
``guidance``), and the arguments its forward takes. Weights are filled from a seeded generator
(not the classes' own init, some of which zeroes projections), so two builds with the same seed
are the same model, and a bf16 copy round-trips through ``save_pretrained``/``from_pretrained``.

Their diffusers pipelines are built in :mod:`.tiny_adaln_zero_pipelines`.

Everything imports diffusers lazily: ``import adalncache.tools.tiny_adaln_zero`` works without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..families import adaln_zero

if TYPE_CHECKING:
    from torch import nn

_HEADS = {"num_attention_heads": 2, "attention_head_dim": 16}  # hidden 32
_FLUX = {**_HEADS, "num_layers": 2, "num_single_layers": 2, "in_channels": 8, "axes_dims_rope": [4, 6, 6]}

#: The tiny config of each class: hidden 32, two blocks of each kind, one refiner block.
CONFIGS: dict[str, dict[str, Any]] = {
    "HunyuanImageTransformer2DModel": {
        **_HEADS,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "num_single_layers": 2,
        "num_refiner_layers": 1,
        "patch_size": (1, 1),
        "text_embed_dim": 24,
        "rope_axes_dim": (8, 8),
    },
    "MotifVideoTransformer3DModel": {
        **_HEADS,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "num_single_layers": 2,
        "text_embed_dim": 24,
        "rope_axes_dim": (4, 6, 6),
    },
    "BriaTransformer2DModel": {**_FLUX, "joint_attention_dim": 24},
    "LongCatImageTransformer2DModel": {**_FLUX, "joint_attention_dim": 24, "pooled_projection_dim": 24},
    "HunyuanVideo15Transformer3DModel": {
        **_HEADS,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "num_refiner_layers": 1,
        "text_embed_dim": 24,
        "text_embed_2_dim": 12,
        "image_embed_dim": 12,
        "rope_axes_dim": (4, 6, 6),
    },
    "AuraFlowTransformer2DModel": {
        **_HEADS,
        "sample_size": 8,
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "num_mmdit_layers": 2,
        "num_single_dit_layers": 2,
        "joint_attention_dim": 24,
        "caption_projection_dim": 32,
        "pos_embed_max_size": 8,
    },
    "BriaFiboTransformer2DModel": {**_FLUX, "joint_attention_dim": 24, "text_encoder_dim": 12},
    "OvisImageTransformer2DModel": {**_FLUX, "out_channels": 8, "joint_attention_dim": 24},
}

#: Each class's config flags that enable an optional per-step input.
OPTIONAL_FLAGS: dict[str, dict[str, str]] = {
    name: {flag: input_name for input_name, flag in layout.optional} for name, layout in adaln_zero.CLASSES.items()
}

#: Image side of the latent grid (tokens = side * side; frames 2 for the video classes).
SIDE = 4
FRAMES = 2
TEXT_TOKENS = 5


def model_class(class_name: str) -> type[nn.Module]:
    """The diffusers class called ``class_name`` (one of :data:`CONFIGS`)."""
    if class_name not in CONFIGS:
        raise ConfigError(f"no tiny model of {class_name!r}: the tiny classes are {', '.join(CONFIGS)}")
    import diffusers

    return getattr(diffusers, class_name)


def config(class_name: str, **flags: Any) -> dict[str, Any]:
    """The tiny config of ``class_name`` with ``flags`` (``use_meanflow=True``, ``guidance_embeds=True``)."""
    model_class(class_name)
    return {**CONFIGS[class_name], **flags}


def build(class_name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **flags: Any) -> nn.Module:
    """A tiny ``class_name`` with seeded weights (the same for the same seed and flags), in ``dtype``, eval mode."""
    cls = model_class(class_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**config(class_name, **flags))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def save_and_load(model: Any, directory: Path, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``model`` (a diffusers model) saved in ``dtype`` with ``save_pretrained`` into ``directory`` and loaded back."""
    model.to(dtype).save_pretrained(str(directory))
    loaded = type(model).from_pretrained(str(directory), torch_dtype=dtype)
    return loaded.eval()


def forward_kwargs(
    model: nn.Module, inputs: Mapping[str, torch.Tensor], *, batch: int, seed: int = 1
) -> dict[str, Any]:
    """The arguments of one forward of ``model``: seeded latents and text, plus ``inputs`` (the per-step ones).

    ``inputs``: ``timestep`` and the optional per-step inputs by their argument names, each with
    ``batch`` entries, passed as given (their dtype is the caller's, as a pipeline's would be).
    """
    name = type(model).__name__
    cfg = CONFIGS[name]
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    tokens = SIDE * SIDE
    mask = torch.ones(batch, TEXT_TOKENS, dtype=torch.bool)
    mask[-1, -1] = False  # one padded text token: the masks reach the attention
    kw: dict[str, Any] = {"return_dict": False, **inputs}
    if name in (
        "BriaTransformer2DModel",
        "LongCatImageTransformer2DModel",
        "OvisImageTransformer2DModel",
        "BriaFiboTransformer2DModel",
    ):
        ids = torch.zeros(tokens, 3)
        ids[:, 1], ids[:, 2] = torch.arange(tokens) // SIDE, torch.arange(tokens) % SIDE
        kw |= {
            "hidden_states": rand(batch, tokens, cfg["in_channels"]),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["joint_attention_dim"]),
            "img_ids": ids,
            "txt_ids": torch.zeros(TEXT_TOKENS, 3),
        }
        if name == "BriaFiboTransformer2DModel":
            layers = cfg["num_layers"] + cfg["num_single_layers"]
            kw["text_encoder_layers"] = [rand(batch, TEXT_TOKENS, cfg["text_encoder_dim"]) for _ in range(layers)]
    elif name == "AuraFlowTransformer2DModel":
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], cfg["sample_size"], cfg["sample_size"]),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["joint_attention_dim"]),
        }
    elif name == "HunyuanImageTransformer2DModel":
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], SIDE, SIDE),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["text_embed_dim"]),
            "encoder_attention_mask": mask,
        }
    elif name == "MotifVideoTransformer3DModel":
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], FRAMES, SIDE, SIDE),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["text_embed_dim"]),
            "encoder_attention_mask": mask,
        }
    else:  # HunyuanVideo15Transformer3DModel
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], FRAMES, SIDE, SIDE),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["text_embed_dim"]),
            "encoder_attention_mask": mask,
            "encoder_hidden_states_2": rand(batch, 3, cfg["text_embed_2_dim"]),
            "encoder_attention_mask_2": torch.ones(batch, 3, dtype=torch.bool),
            "image_embeds": rand(batch, 2, cfg["image_embed_dim"]),
        }
    return kw


__all__ = [
    "CONFIGS",
    "OPTIONAL_FLAGS",
    "build",
    "config",
    "forward_kwargs",
    "model_class",
    "save_and_load",
]
