"""What the family demos share: the sharded bf16 files they load, and the cached half of their request.

Why not ``model.to(torch.bfloat16)`` and save: diffusers warns about a direct cast of a model that
names modules to keep in fp32, and that warning would open the demo's output. Saving the fp32
model and loading it with ``torch_dtype=torch.bfloat16`` is the released precision rule, applied by
diffusers itself, and gives files like a released checkpoint's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


def format_bytes(count: int) -> str:
    """``count`` bytes in MiB, or KiB below one MiB (the family demos' models are small)."""
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


@dataclass
class CachedRequest:
    """What the cached half of a family demo measured: the load, the request and the cache after it."""

    output: torch.Tensor
    seconds: float
    never_read: int
    total: int
    read: int | None
    in_page_cache: int
    table_bytes: int
    bytes_after: int
    plans: int
    passes: int

    def rows(self, never_read: str, bytes_before: int, resident_seconds: float) -> list[tuple[str, str]]:
        """The report lines after the request line; ``never_read`` names what the load skipped."""
        read = "?" if self.read is None else format_bytes(self.read)
        in_cache = "none of them" if self.in_page_cache == 0 else format_bytes(self.in_page_cache)
        return [
            ("plans", f"{self.plans} distinct, built in {self.passes} pass(es) before the first step"),
            (
                "load",
                f"load_transformer read {read} of the {format_bytes(self.total)} checkpoint; "
                f"{format_bytes(self.never_read)} of {never_read} never read ({in_cache} in the page cache)",
            ),
            (
                "modulation bytes on device",
                f"{format_bytes(bytes_before)} resident -> {format_bytes(self.bytes_after)} "
                f"weights + {format_bytes(self.table_bytes)} table cached",
            ),
            ("request time", f"{resident_seconds * 1000:.1f} ms resident, {self.seconds * 1000:.1f} ms cached"),
        ]


def run_cached(
    pipe: Any,
    directory: Path,
    device: torch.device,
    run: Callable[[], tuple[torch.Tensor, float]],
    served_parameter_bytes: Callable[[Any], int],
) -> CachedRequest:
    """Load ``directory`` with ``load_transformer`` (page cache dropped first, bytes read counted), put it in
    ``pipe``, enable the cache on the pipeline, ``run()`` the request, and disable the cache again."""
    from ..diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
    from .measure import drop_page_cache, io_read_bytes, resident_served_bytes, served_bytes, weight_files

    files = weight_files(directory)
    never_read, total = served_bytes(files)
    dropped = drop_page_cache(files)
    before = io_read_bytes()
    model = load_transformer(directory, torch_dtype=torch.bfloat16, device_map=device)
    after = io_read_bytes()
    read = None if before is None or after is None or not dropped else after - before
    in_page_cache = resident_served_bytes(files)
    pipe.transformer = model
    handle: Any = enable_adaln_cache(pipe)  # adopts the loaded cache, watches the scheduler
    try:
        output, seconds = run()
        served = adaln_cache_handle(model)
        assert served is not None, "enable_adaln_cache(pipe) enables the pipeline's transformer"
        table_bytes, plans, passes = served.cache.slab_bytes, len(handle.cache), handle.stats.passes
        bytes_after = served_parameter_bytes(model)
    finally:
        handle.disable()
    return CachedRequest(
        output, seconds, never_read, total, read, in_page_cache, table_bytes, bytes_after, plans, passes
    )


__all__ = ["SHARD_SIZE", "CachedRequest", "bf16_files", "format_bytes", "no_loading_bars", "run_cached"]
