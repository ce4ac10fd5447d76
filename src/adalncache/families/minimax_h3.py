"""MiniMax-H3: its geometry, key layouts and table layout, as the family-neutral core reads them.

MiniMax-H3 (diffusers ``MiniMaxH3Transformer3DModel``) has one AdaLN projection per transformer
block, ``adaln_proj.linear: Linear(time_embed_dim -> 6 * modalities * hidden)``, and one in the
output layer, ``norm_out.linear: Linear(time_embed_dim -> 2 * hidden)``, all taking the same input
``silu(temb)`` cast to the weights' dtype; a plan is the 1-D fp32 tensor of a step's distinct
timesteps. Layers are ``0 .. num_layers - 1`` and ``"final"``.

Its tables keep the layout SGLang's MiniMax-H3 sidecar uses: two parts, ``block`` (every block's
row, ``[num_layers, block_width]``) and ``final``, as ``block_params`` and ``final_params``; the
file's ``model_variant`` names the released transformer (``fl2va`` or ``ref2va``).

The request kinds and their schedules are in :mod:`adalncache.schedules`, the checkpoint-only
embedding (the time embedder read from a checkpoint) in :mod:`adalncache.embedding`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError, PlanError
from ..geometry import FINAL, TIMESTEP, Family, Gather, KeyLayout, ModelGeometry, ServedLayer, TablePart
from ..options import flag

#: The two checkpoint layouts: the native release's names and diffusers'.
LAYOUTS: dict[str, KeyLayout] = {
    "native": KeyLayout(
        "native",
        "blocks.{i}.adaln_proj.linear",
        "final_layer.adaln_proj.linear",
        ("time_embedder.proj_in", "time_embedder.proj_out"),
    ),
    "diffusers": KeyLayout(
        "diffusers",
        "transformer_blocks.{i}.adaln_proj.linear",
        "norm_out.linear",
        ("time_embedder.linear_1", "time_embedder.linear_2"),
    ),
}

#: The released transformers a table file names in ``model_variant`` (SGLang compares it).
MODEL_VARIANTS = ("fl2va", "ref2va")
#: Which released transformer serves each task (t2va runs on the fl2va transformer).
TASK_VARIANTS = {"t2va": "fl2va", "fl2va": "fl2va", "ref2va": "ref2va"}


class ModulationRows:
    """How MiniMax-H3's table rows split into what its modules take (the cache's ``block``,
    ``block_all`` and ``final`` read through this): the ``block`` part stacks every block's row,
    ``[num_layers, block_width]``, and a block's row ``Y`` splits as its forward splits it,
    ``Y.view(-1, 6H).chunk(6, -1)``; the ``final`` part is the output layer's ``(shift, scale)``."""

    block_part = "block"
    final_part = "final"

    def block_rows(self, gather: Gather, layer: object) -> torch.Tensor:
        def one_block(blocks: torch.Tensor) -> torch.Tensor:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < blocks.shape[2]:
                raise PlanError(
                    f"layer must be in 0..{blocks.shape[2] - 1} (a block index), got {layer!r}: the output layer's "
                    f"rows are final_rows() and final()"
                )
            return blocks.select(2, layer)

        return gather(self.block_part, one_block)

    def block(self, rows: torch.Tensor, spec: Any) -> tuple[torch.Tensor, ...]:
        return rows.reshape(-1, 6 * spec.hidden_size).chunk(6, dim=-1)

    def block_all(self, gather: Gather, spec: Any) -> list[tuple[torch.Tensor, ...]]:
        rows = gather(self.block_part)  # (n, num_layers, block_width), one gather
        return [self.block(rows[:, layer], spec) for layer in range(rows.shape[1])]

    def final_rows(self, gather: Gather) -> torch.Tensor:
        return gather(self.final_part)

    def final(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale = rows.chunk(2, dim=-1)
        return shift, scale


FAMILY = Family(
    name="minimax-h3",
    title="MiniMax-H3",
    layouts=tuple(LAYOUTS.values()),
    class_names=("MiniMaxH3Transformer3DModel",),
    table_formats=("adalncache", "sglang", "vllm-omni"),
    table_tensors=("block_params", "final_params"),
    model_variants=MODEL_VARIANTS,
    task_variants=tuple(TASK_VARIANTS.items()),
    rows=ModulationRows(),
)

#: The released geometry: 50 blocks, hidden 5376, time embedding 2688.
RELEASED: dict[str, int] = {"num_layers": 50, "hidden_size": 5376, "time_embed_dim": 2688}

#: The name of the one projection input (``silu(temb)`` in the weights' dtype).
INPUT = "temb"


def block_width(hidden_size: int, modalities: int) -> int:
    """Output features of one block projection: 6 parameters x modalities x hidden."""
    return 6 * modalities * hidden_size


def final_width(hidden_size: int) -> int:
    """Output features of the output-layer projection: shift and scale."""
    return 2 * hidden_size


@lru_cache(maxsize=64)
def geometry(num_layers: int, hidden_size: int, time_embed_dim: int, modalities: int) -> ModelGeometry:
    """The geometry of a MiniMax-H3 of these sizes (the family-neutral view of its projections)."""
    bw, fw = block_width(hidden_size, modalities), final_width(hidden_size)
    layers = (*(ServedLayer(i, bw, INPUT) for i in range(num_layers)), ServedLayer(FINAL, fw, INPUT))
    blocks = num_layers * bw
    parts = (
        TablePart("block", "block_params", 0, blocks, (num_layers, bw)),
        TablePart("final", "final_params", blocks, blocks + fw, (fw,)),
    )
    return ModelGeometry(FAMILY, layers, time_embed_dim, (TIMESTEP,), parts)


def describe(num_layers: int, hidden_size: int, time_embed_dim: int, modalities: int) -> dict[str, Any]:
    """The spec identity stores and table files of this family are bound to (without the dtype)."""
    return {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "time_embed_dim": time_embed_dim,
        "modalities": modalities,
    }


def fields_from_transformer(model: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``num_layers``, ``hidden_size``, ``time_embed_dim`` and the projections' dtype of a transformer.

    The dtype is ``dtype`` when given, else block 0's projection weight's (inside a peft LoRA
    wrapper when there is one), bfloat16 for a model without blocks.
    """
    config: Any = getattr(model, "config", None)
    try:
        num_layers = int(config.num_layers)
        hidden_size = int(config.hidden_size)
        time_embed_dim = int(config.time_embed_dim)
    except AttributeError:
        raise ConfigError(
            f"ModulationSpec.from_transformer needs a MiniMaxH3Transformer3DModel (a config with "
            f"num_layers, hidden_size and time_embed_dim), got {type(model).__name__}"
        ) from None
    fields: dict[str, Any] = {"num_layers": num_layers, "hidden_size": hidden_size, "time_embed_dim": time_embed_dim}
    if dtype is not None:
        return {**fields, "dtype": dtype}
    dtype = torch.bfloat16
    blocks = getattr(model, "transformer_blocks", None)
    if blocks is not None and len(blocks) > 0:
        linear = blocks[0].adaln_proj.linear
        base = getattr(linear, "base_layer", linear)  # a peft LoRA wrapper keeps the Linear inside
        dtype = base.weight.dtype
    return {**fields, "dtype": dtype}


def fields_from_headers(path: object, entries: Mapping[str, Any], layout: str, modalities: int) -> dict[str, Any]:
    """The spec fields of a checkpoint from its safetensors header entries alone (no tensor data).

    Blocks are counted from ``0`` up to the first missing index; block 0's projection gives the
    hidden size (``6 * modalities * hidden`` outputs), its input width the time-embedding size,
    its dtype the spec's dtype. Raises CheckpointError when no layout's projections are there or
    block 0's is unusable.
    """
    candidates = [LAYOUTS[layout]] if layout != "auto" else list(LAYOUTS.values())
    for key_layout in candidates:
        indices = {index for name in entries if (index := key_layout.block_index(name)) is not None}
        if not indices:
            continue
        count = 0
        while count in indices:
            count += 1
        first = entries.get(key_layout.weight(0))
        if first is None or len(first.shape) != 2 or first.torch_dtype is None:
            raise CheckpointError(f"{path}: block 0's AdaLN projection weight is missing or malformed")
        out, k = first.shape
        if out % (6 * modalities):
            raise CheckpointError(
                f"{path}: block 0's AdaLN projection has {out} outputs, not a multiple of 6 x {modalities} "
                f"modalities; this is not a MiniMax-H3 checkpoint"
            )
        return {
            "num_layers": count,
            "hidden_size": out // (6 * modalities),
            "time_embed_dim": k,
            "modalities": modalities,
            "dtype": first.torch_dtype,
        }
    raise CheckpointError(
        f"{path} holds no AdaLN projection in a known layout (looked for {LAYOUTS['native'].weight(0)!r} "
        f"and {LAYOUTS['diffusers'].weight(0)!r}): pass a MiniMax-H3 transformer checkpoint, or set {flag('layout')}"
    )


def fields_from_table(block_shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any] | None:
    """The spec fields a table file's ``block_params [P, W, L, 18 * hidden]`` implies, or None if it cannot."""
    if len(block_shape) != 4:
        return None
    return {"num_layers": block_shape[2], "hidden_size": block_shape[3] // 18, "time_embed_dim": 1, "dtype": dtype}


__all__ = [
    "FAMILY",
    "INPUT",
    "LAYOUTS",
    "MODEL_VARIANTS",
    "RELEASED",
    "TASK_VARIANTS",
    "ModulationRows",
    "block_width",
    "describe",
    "fields_from_headers",
    "fields_from_table",
    "fields_from_transformer",
    "geometry",
]
