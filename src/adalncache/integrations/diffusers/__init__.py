"""Serve the AdaLN modulation of a diffusers transformer from an :class:`~adalncache.AdalnCache`.

Built the way diffusers builds its own caches (``hooks/text_kv_cache.py``,
``hooks/group_offloading.py``): a config dataclass, one ``enable_*`` entry point, small ``ModelHook``
classes registered under constant names, and a removal path that leaves the model as it was. One
module per job, each importing only those listed before it:

- ``compat``: diffusers' private names, each with the release it was checked against;
- ``family``: the family seam and its registry, and family-neutral helpers to reach and run modules;
- ``sources``: the weight source (the model's own tensors, or a checkpoint verified against them);
- ``quantized``: quantized or layerwise-cast projections: detection, their source, what is refused;
- ``parking``: weights off the device as meta placeholders, restored bit-exactly; state_dict hooks;
- ``hooks``: the hooks and the served class that take a forward to the slab, compiling like the model;
- ``signature``: what the tables are keyed by besides the weights (adapters, upstream modules);
- ``request``: a request from its start to its end, each thread's, and how its forwards are served;
- ``handle``: enabling and disabling a transformer or a pipeline (:func:`enable_adaln_cache`);
- ``loading``: :func:`load_transformer`, a transformer loaded without its projections, cache enabled;
- one module per family: ``minimax_h3``, ``qwen_image``, ``adaln_zero`` (each registers itself).
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
