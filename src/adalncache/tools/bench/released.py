"""The released MiniMax-H3 as arithmetic: its byte counts, and what a card must hold with and without the cache.

No weights are read: the model is built on meta with the default config (the released geometry)
and its parameters counted. The benchmark's ``deploy`` section prints these as notes, beside its
measurements on a tiny model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ...plans import minimax_h3_plans, plan_key
from ...spec import ModulationSpec


def released_sizes() -> dict[str, int]:
    """Byte counts of the released MiniMax-H3 in its released mixed precision (arithmetic, no weights).

    The model is built on meta with the default config (the released geometry) and each
    parameter counted at bf16, or fp32 for the modules the model keeps in fp32.
    """
    import accelerate
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    with accelerate.init_empty_weights():
        model = MiniMaxH3Transformer3DModel()
    keep = list(MiniMaxH3Transformer3DModel._keep_in_fp32_modules or [])
    sizes = {"projections": 0, "time_embedder": 0, "blocks_rest": 0, "other": 0, "block_rest": 0, "block_projection": 0}
    for name, param in model.named_parameters():
        nbytes = param.numel() * (4 if any(k in name.split(".") for k in keep) else 2)
        if re.match(r"(transformer_blocks\.\d+\.adaln_proj\.linear|norm_out\.linear)\.", name):
            sizes["projections"] += nbytes
        elif name.startswith("time_embedder."):
            sizes["time_embedder"] += nbytes
        elif name.startswith("transformer_blocks."):
            sizes["blocks_rest"] += nbytes
        else:
            sizes["other"] += nbytes
        if name.startswith("transformer_blocks.0."):
            sizes["block_projection" if ".adaln_proj." in name else "block_rest"] += nbytes
    sizes["num_layers"] = int(model.config.num_layers)
    return sizes


def request_slab_bytes(steps: int = 50, task: str = "t2va") -> int:
    """The slab of the released geometry sized to one request: its distinct plans, its widest plan."""
    plans = minimax_h3_plans(task, steps)
    distinct = len({plan_key(plan) for plan in plans})
    return ModulationSpec.minimax_h3().slab_bytes(distinct, max(int(plan.numel()) for plan in plans))


def card_table(sizes: dict[str, int], slab: int, *, cards_gb: Sequence[int] = (24, 48, 80)) -> list[dict[str, Any]]:
    """What a card must hold, with and without the cache, per way of running (weights and tables only).

    ``resident``: every weight on the card (also what model CPU offload needs while the transformer
    runs); ``group offload``: block-level group offloading, one block per group: the weights outside
    the blocks stay for the forward, one block is onloaded at a time (two with a prefetching
    stream). With the cache the projections and the time embedder are gone and the slab
    (``slab`` bytes) is added. Activations are not counted.
    """
    stock_block = sizes["block_rest"] + sizes["block_projection"]
    cached_block = sizes["block_rest"]
    rows = {
        "resident": (
            sizes["projections"] + sizes["time_embedder"] + sizes["blocks_rest"] + sizes["other"],
            sizes["blocks_rest"] + sizes["other"] + slab,
        ),
        "group offload, 1 block in flight": (
            sizes["other"] + sizes["time_embedder"] + stock_block,
            sizes["other"] + cached_block + slab,
        ),
        "group offload with stream, 2 blocks in flight": (
            sizes["other"] + sizes["time_embedder"] + 2 * stock_block,
            sizes["other"] + 2 * cached_block + slab,
        ),
    }
    table = []
    for mode, (without, with_cache) in rows.items():
        row: dict[str, Any] = {"mode": mode, "without_cache_bytes": without, "with_cache_bytes": with_cache}
        for gb in cards_gb:
            row[f"{gb} GB"] = (without <= gb * 10**9, with_cache <= gb * 10**9)
        table.append(row)
    return table


def onloaded_per_step(sizes: dict[str, int]) -> tuple[int, int]:
    """Bytes block-level group offloading moves per step for the blocks, without and with the cache."""
    layers = sizes["num_layers"]
    return layers * (sizes["block_rest"] + sizes["block_projection"]), layers * sizes["block_rest"]


__all__ = ["card_table", "onloaded_per_step", "released_sizes", "request_slab_bytes"]
