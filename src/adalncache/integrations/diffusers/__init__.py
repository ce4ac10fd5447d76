"""Serve the AdaLN modulation of a diffusers transformer from an :class:`~adalncache.AdalnCache`.

Built the way diffusers builds its own caches (``hooks/text_kv_cache.py``): a config dataclass, one
``enable_*`` entry point, small ``ModelHook`` classes under constant names, and a removal path that
leaves the model as it was. One module per job, each importing only those before it in the table of
docs/diffusers.md (Where the code is); each family module registers itself.
"""

from __future__ import annotations

from ...options import AdalnCacheConfig, CacheOptions
from . import adaln_zero, minimax_h3, qwen_image  # noqa: F401  # each registers its family
from .handle import AdalnCacheHandle, PipelineAdalnCacheHandle, adaln_cache_handle, enable_adaln_cache
from .hooks import AdalnCacheOutputHook, AdalnCacheTimeEmbedderHook, AdalnCacheTransformerHook
from .loading import load_transformer
from .minimax_h3 import AdalnCachePrepareStep, minimax_h3_raw_vision, register_minimax_h3_block
from .sources import CheckpointMismatchError

__all__ = [
    "AdalnCacheConfig",
    "AdalnCacheHandle",
    "AdalnCacheOutputHook",
    "AdalnCachePrepareStep",
    "AdalnCacheTimeEmbedderHook",
    "AdalnCacheTransformerHook",
    "CacheOptions",
    "CheckpointMismatchError",
    "PipelineAdalnCacheHandle",
    "adaln_cache_handle",
    "enable_adaln_cache",
    "load_transformer",
    "minimax_h3_raw_vision",
    "register_minimax_h3_block",
]
