"""Qwen-Image: its geometry and key layout, as the family-neutral core reads them.

Qwen-Image (diffusers ``QwenImageTransformer2DModel``) modulates every block twice, image and
text stream, ``img_mod`` and ``txt_mod``, each ``Sequential(SiLU, Linear(dim -> 6 * dim))``, and
its output layer once, ``norm_out.linear: Linear(dim -> 2 * dim)`` inside ``AdaLayerNormContinuous``.
All three take ``silu(temb)`` in the model's dtype, where ``temb = time_text_embed(timestep)`` is
a function of the timestep alone (plus, for the Layered variant, ``use_additional_t_cond``, an
embedding of a per-sample index, which is then the plan's second column).

Layers are named by module path (``transformer_blocks.3.img_mod.1``), in the order the forward
runs them: block by block, image before text, then ``norm_out.linear``. With ``zero_cond_t`` (the
Edit-2511 variant) the forward doubles the timestep to ``[t; 0 * t]``: ``img_mod`` runs on those
2B rows (input :data:`DOUBLED`), ``txt_mod`` and ``norm_out`` on the first B (input
:data:`FIRST`), so a plan is the doubled timestep and the two inputs have different row counts.
The table is one part (``table_rows``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from ..geometry import TIMESTEP, Family, KeyLayout, ModelGeometry, ServedLayer

#: The diffusers layout: no block prefix, so every layer id is its own module path.
LAYOUT = KeyLayout(
    "diffusers",
    time_embedder=("time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"),
)

FAMILY = Family(
    name="qwen-image",
    title="Qwen-Image",
    layouts=(LAYOUT,),
    class_names=("QwenImageTransformer2DModel",),
)

#: The released geometry (Qwen/Qwen-Image ``transformer/config.json``): 60 blocks, 24 heads of 128.
RELEASED: dict[str, Any] = {"num_layers": 60, "hidden_size": 3072, "zero_cond_t": False, "additional_t_cond": False}

#: The released pipeline's scheduler config (Qwen/Qwen-Image ``scheduler/scheduler_config.json``; the
#: Edit and Layered releases ship the same values; the switches left at diffusers' defaults are
#: omitted). ``--steps`` computes a Qwen-Image schedule with it when no ``--scheduler-config`` is
#: given and no ``scheduler/`` directory sits beside the checkpoint: the shift depends on it, so a
#: schedule of another config would build tables no request of the released pipeline asks for.
#: Read-only: it is shared (the CLI, the bench), so no caller may change it for the others.
RELEASED_SCHEDULER: Mapping[str, Any] = MappingProxyType(
    {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "max_image_seq_len": 8192,
        "max_shift": 0.9,
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
        "use_dynamic_shifting": True,
    }
)

#: The projections' input: ``silu(temb)`` in the model's dtype, one row per plan row.
INPUT = "temb"
#: With ``zero_cond_t``: ``img_mod`` takes all 2B rows of ``[t; 0]`` ...
DOUBLED = "temb"
#: ... and ``txt_mod`` and ``norm_out`` the first B.
FIRST = "temb_first"
#: The plan's second column when ``use_additional_t_cond``: the forward's ``additional_t_cond`` index.
ADDITIONAL = "additional_t_cond"
#: The module computing ``temb``, and the ``additional_t_cond`` embedding's weight inside it.
TIME_TEXT_EMBED = "time_text_embed"
ADDITION_WEIGHT = "time_text_embed.addition_t_embedding.weight"
#: The output layer's projection.
FINAL_PATH = "norm_out.linear"
#: The blocks' attribute.
BLOCKS = "transformer_blocks"


def img_path(block: int) -> str:
    return f"{BLOCKS}.{block}.img_mod.1"


def txt_path(block: int) -> str:
    return f"{BLOCKS}.{block}.txt_mod.1"


@lru_cache(maxsize=64)
def geometry(
    num_layers: int, hidden_size: int, zero_cond_t: bool = False, additional_t_cond: bool = False
) -> ModelGeometry:
    """The geometry of a Qwen-Image transformer of these sizes and variant flags."""
    first = FIRST if zero_cond_t else INPUT
    layers: list[ServedLayer] = []
    for block in range(num_layers):
        layers.append(ServedLayer(img_path(block), 6 * hidden_size, INPUT))
        layers.append(ServedLayer(txt_path(block), 6 * hidden_size, first))
    layers.append(ServedLayer(FINAL_PATH, 2 * hidden_size, first))
    plan_inputs = (TIMESTEP, ADDITIONAL) if additional_t_cond else (TIMESTEP,)
    return ModelGeometry(FAMILY, tuple(layers), hidden_size, plan_inputs)


def spec_args(
    num_layers: int, hidden_size: int, dtype: torch.dtype, *, zero_cond_t: bool = False, additional_t_cond: bool = False
) -> dict[str, Any]:
    """``ModulationSpec.for_geometry`` keywords of a Qwen-Image of these sizes."""
    return {
        "geometry": geometry(num_layers, hidden_size, bool(zero_cond_t), bool(additional_t_cond)),
        "dtype": dtype,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
    }


def config_flags(config: Any) -> dict[str, bool]:
    """The variant flags of a config (an object with attributes, or a mapping)."""
    get = config.get if isinstance(config, Mapping) else lambda name, default: getattr(config, name, default)
    return {
        "zero_cond_t": bool(get("zero_cond_t", False)),
        "additional_t_cond": bool(get("use_additional_t_cond", False)),
    }


def from_transformer(model: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The spec keywords of a ``QwenImageTransformer2DModel`` (its config, block 0's ``img_mod.1`` dtype)."""
    config: Any = getattr(model, "config", None)
    try:
        num_layers = int(config.num_layers)
        hidden_size = int(config.num_attention_heads) * int(config.attention_head_dim)
    except AttributeError:
        raise ConfigError(
            f"ModulationSpec.from_transformer needs a QwenImageTransformer2DModel (a config with num_layers, "
            f"num_attention_heads and attention_head_dim), got {type(model).__name__}"
        ) from None
    if dtype is None:
        dtype = torch.bfloat16
        blocks = getattr(model, BLOCKS, None)
        if blocks is not None and len(blocks) > 0:
            linear = blocks[0].img_mod[1]
            dtype = getattr(linear, "base_layer", linear).weight.dtype  # inside a peft LoRA wrapper, if any
    return spec_args(num_layers, hidden_size, dtype, **config_flags(config))


def from_headers(path: object, entries: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The spec keywords of a checkpoint from its safetensors headers (and its ``config.json``'s flags).

    Blocks are counted from 0 up to the first missing ``img_mod.1``; block 0's gives the width
    (``6 * dim`` outputs of ``dim`` inputs) and the dtype.
    """
    count = 0
    while f"{img_path(count)}.weight" in entries:
        count += 1
    first = entries.get(f"{img_path(0)}.weight")
    if first is None:
        raise CheckpointError(
            f"{path} holds no Qwen-Image AdaLN projection (looked for {img_path(0)}.weight): pass the "
            "transformer's own directory (its config.json and weight files, as the model is saved)"
        )
    if len(first.shape) != 2 or first.torch_dtype is None or first.shape[0] != 6 * first.shape[1]:
        raise CheckpointError(f"{path}: {img_path(0)}.weight is {list(first.shape)}, not [6 * dim, dim]")
    return spec_args(count, int(first.shape[1]), first.torch_dtype, **config_flags(config))


__all__ = [
    "ADDITIONAL",
    "ADDITION_WEIGHT",
    "FAMILY",
    "FINAL_PATH",
    "FIRST",
    "INPUT",
    "LAYOUT",
    "RELEASED",
    "RELEASED_SCHEDULER",
    "TIME_TEXT_EMBED",
    "config_flags",
    "from_headers",
    "from_transformer",
    "geometry",
    "img_path",
    "spec_args",
    "txt_path",
]
