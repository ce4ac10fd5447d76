"""Step caches on MiniMax-H3: what diffusers' block-level caches need to know about this model.

diffusers' first-block cache, MagCache and SeaCache skip whole transformer blocks, and find out
what a block returns from a registry of block classes. diffusers 0.42 does not register
``MiniMaxH3TransformerBlock`` and has no public way to register a block: the registry is
``diffusers.hooks._helpers.TransformerBlockRegistry``, a private module (reached through
:mod:`.compat`). :func:`register_minimax_h3_block` uses it in the least fragile way it can: it
checks that the registry and its metadata fields are the ones it was written against, does
nothing when the block is already registered (a later diffusers may do it itself), and warns on a
diffusers version it was not tested with.

SeaCache also needs the generated video as ``(C, T, H, W)`` latents for its spectral indicator:
:func:`minimax_h3_raw_vision` reads them off the transformer's own inputs (the packed video rows and
their rotary ``(t, h, w)`` coordinates), so no outside geometry is needed.

None of this touches the AdaLN cache: a block a step cache skips never calls its ``adaln_proj``,
and every forward still runs (``norm_out`` always needs its plan), so the cache builds exactly the
request's plans and counts no miss. What the cache does for step caches is elsewhere: it resolves
blocks from the list captured at enable time (cache-dit swaps ``transformer_blocks`` during its
forward) and refuses a ``disable()`` that would drop a forward wrapper added after it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import ConfigError
from .compat import CHECKED_DIFFUSERS, block_registry
from .modules import forward_argument

logger = logging.getLogger(__name__)

#: The diffusers release series (major.minor) the block registration was tested with.
TESTED_DIFFUSERS = ".".join(CHECKED_DIFFUSERS.split(".")[:2])

#: What the registry's metadata must offer for the registration below to mean what it says.
_METADATA_FIELDS = {"return_hidden_states_index", "return_encoder_hidden_states_index", "hidden_states_argument_name"}


def register_minimax_h3_block() -> bool:
    """Register ``MiniMaxH3TransformerBlock`` with diffusers' block registry; True if it was not yet there.

    After this, ``FirstBlockCacheConfig``, ``MagCacheConfig`` and ``SeaCacheConfig`` accept a
    ``MiniMaxH3Transformer3DModel`` in ``enable_cache``. The block takes ``hidden_states`` first and
    returns them as a plain tensor (no ``encoder_hidden_states``: text rows are part of the packed
    sequence). The registry is private to diffusers; a diffusers whose registry looks different
    raises ``ConfigError`` instead of registering something wrong.
    """
    import diffusers
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    version = diffusers.__version__

    TransformerBlockRegistry, TransformerBlockMetadata = block_registry()  # ConfigError where it moved
    fields = {field.name for field in dataclasses.fields(TransformerBlockMetadata)}
    if not fields >= _METADATA_FIELDS or not callable(getattr(TransformerBlockRegistry, "register", None)):
        raise ConfigError(
            f"diffusers {version}'s block registry is not the one register_minimax_h3_block() was written for "
            f"(tested with diffusers {TESTED_DIFFUSERS}); the block-level step caches cannot be taught "
            "the MiniMax-H3 block this way"
        )
    try:
        TransformerBlockRegistry.get(MiniMaxH3TransformerBlock)
        return False  # already registered (by diffusers itself, or an earlier call)
    except ValueError:
        pass
    if ".".join(version.split(".")[:2]) != TESTED_DIFFUSERS:
        logger.warning(
            "register_minimax_h3_block(): diffusers %s is not a version this registration was tested with (%s); "
            "its block registry is private to diffusers",
            version,
            TESTED_DIFFUSERS,
        )
    metadata: Any = TransformerBlockMetadata  # diffusers annotates the index as int, None included
    TransformerBlockRegistry.register(
        MiniMaxH3TransformerBlock, metadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None)
    )
    return True


def minimax_h3_raw_vision(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor] | None:
    """SeaCache's ``raw_vision_callback`` for MiniMax-H3: the generated video rows as one ``(C, T, H, W)`` latent.

    The packed video rows arrive as ``hidden_states`` ``(1, rows, C)`` in the order of
    ``video_indices``. The generated ones are those at the generated video's timestep (the last
    video row's ``timestep_indices`` entry): keyframes and reference images ride at their own
    noise level and are left out. They come frame after frame, each frame ``H * W`` rows with one
    rotary time coordinate; their ``(h, w)`` coordinates give the grid. Returns None (SeaCache
    then runs without skipping) when the inputs do not look like that.
    """
    names = ("hidden_states", "position_ids", "video_indices", "timestep_indices")
    hidden, positions, video, timestep_indices = (forward_argument(module, name, args, kwargs) for name in names)
    if not all(isinstance(t, torch.Tensor) for t in (hidden, positions, video, timestep_indices)):
        return None
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] != video.numel() or video.numel() == 0:
        return None
    steps = timestep_indices.index_select(0, video).cpu()
    generated = torch.nonzero(steps == steps[-1]).flatten()
    coords = positions.index_select(0, video).cpu().index_select(0, generated)
    times = coords[:, 0]
    frame_starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), times[1:] != times[:-1]])).flatten()
    counts = torch.diff(torch.cat([frame_starts, torch.tensor([times.numel()])]))
    frames = frame_starts.numel()
    rows_per_frame = int(counts[0])
    if not bool((counts == rows_per_frame).all()) or (frames > 1 and not bool((times[frame_starts].diff() > 0).all())):
        return None
    grid = coords[:rows_per_frame, 1:]
    heights, widths = torch.unique(grid[:, 0]), torch.unique(grid[:, 1])
    if heights.numel() * widths.numel() != rows_per_frame:
        return None
    rows = hidden[0].index_select(0, generated.to(hidden.device))
    # Rows within a frame in (h, w) order, whatever order the layout packed them in.
    cell = torch.searchsorted(heights, grid[:, 0].contiguous()) * widths.numel() + torch.searchsorted(
        widths, grid[:, 1].contiguous()
    )
    ordered = rows.view(frames, rows_per_frame, -1)[:, torch.argsort(cell).to(hidden.device)]
    return [ordered.reshape(frames, heights.numel(), widths.numel(), -1).permute(3, 0, 1, 2)]
