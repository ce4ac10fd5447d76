"""``from adalncache.diffusers import enable_adaln_cache``: the diffusers integration's public names.

A thin re-export so users import from one short path; the implementation lives in
:mod:`adalncache.integrations.diffusers` (a package with one module per job; it needs diffusers
installed). It exports exactly that package's names (a test holds the two lists equal).
"""

from __future__ import annotations

from .integrations.diffusers import (
    AdalnCacheConfig,
    AdalnCacheHandle,
    AdalnCacheOutputHook,
    AdalnCachePrepareStep,
    AdalnCacheTimeEmbedderHook,
    AdalnCacheTransformerHook,
    CacheOptions,
    CheckpointMismatchError,
    PipelineAdalnCacheHandle,
    adaln_cache_handle,
    enable_adaln_cache,
    load_transformer,
    minimax_h3_raw_vision,
    register_minimax_h3_block,
)

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
