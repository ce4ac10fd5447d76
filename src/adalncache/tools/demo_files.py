"""The sharded bf16 files the family demos load their transformer from.

Why not ``model.to(torch.bfloat16)`` and save: diffusers warns about a direct cast of a model that
names modules to keep in fp32, and that warning would open the demo's output. Saving the fp32
model and loading it with ``torch_dtype=torch.bfloat16`` is the released precision rule, applied by
diffusers itself, and gives files like a released checkpoint's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: Small shards, so the demo's checkpoint is sharded with its index like a released one.
SHARD_SIZE = "40KB"


@contextlib.contextmanager
def no_loading_bars() -> Iterator[None]:
    """diffusers' shard-loading progress bars off for the block (the demo prints its own lines only)."""
    from diffusers.utils import logging as diffusers_logging

    enabled = diffusers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            diffusers_logging.enable_progress_bar()


def bf16_files(model: Any, scratch: Path, directory: Path) -> None:
    """Write ``model`` (fp32, in memory) to ``directory`` as the sharded bf16 files of a release."""
    model.save_pretrained(scratch)
    cast: Any = type(model).from_pretrained(scratch, torch_dtype=torch.bfloat16)
    cast.save_pretrained(directory, max_shard_size=SHARD_SIZE)
    with contextlib.suppress(OSError):
        for path in scratch.iterdir():
            path.unlink()


__all__ = ["SHARD_SIZE", "bf16_files", "no_loading_bars"]
