"""Serve MiniMax-H3's AdaLN modulation from an :class:`~adalncache.AdalnCache` inside diffusers.

Built the way diffusers builds its own caches (``hooks/text_kv_cache.py``,
``hooks/group_offloading.py``): a config dataclass, one ``enable_*`` entry point, small
``ModelHook`` classes registered under constant names, and a removal path that leaves the model as
it was. One module per job, each importing only those listed before it:

- ``compat``: diffusers' private names, each with the release it was checked against;
- ``modules``: family-neutral helpers to reach, run and patch served modules;
- ``minimax_h3``: what is MiniMax-H3's: the served modules and their paths, their input, a forward's plan;
- ``sources``: the weight source (the model's own tensors, or a checkpoint verified against them);
- ``quantized``: quantized or layerwise-cast projections: detection, their source, what is refused;
- ``casting``: layerwise casting applied while enabled: refused or settled;
- ``config``: :class:`AdalnCacheConfig` and the cache's typed :class:`CacheOptions`;
- ``parking``: weights off the device as meta placeholders, restored bit-exactly; state_dict hooks;
- ``lora``: the LoRA signature the tables are keyed by, and the fuse/unfuse/load guards;
- ``compile``: serving that torch.compile traces like the resident model (served blocks, eager prepare);
- ``hooks``: the diffusers hooks that serve a forward;
- ``moving``: ``.to()``/``.cuda()``/``pipe.to()`` while enabled: moves take the cache along, casts are refused;
- ``choice``: which weight source an enabling serves from, decided before the model changes;
- ``callbacks``: a build's ``embed`` and ``project``, and the time embedder's loan;
- ``signature``: the LoRA signature of a request or a forward, read as the served modules are now;
- ``requests``: holds of a request's or a forward's plans: the hit path, else one build;
- ``handle``: :class:`AdalnCacheHandle`, which puts the pieces together and takes them apart;
- ``pipeline``: the modular pipeline's handle and the block that prepares a request's plans;
- ``stepcaches``: what diffusers' block-level step caches need to know about MiniMax-H3;
- ``enable``: :func:`enable_adaln_cache`;
- ``loading``: :func:`load_transformer`, a transformer loaded without its projections, cache enabled.
"""

from __future__ import annotations

from .config import AdalnCacheConfig, CacheOptions
from .enable import enable_adaln_cache
from .handle import AdalnCacheHandle, adaln_cache_handle
from .hooks import (
    AdalnCacheOutputHook,
    AdalnCacheTimeEmbedderHook,
    AdalnCacheTransformerHook,
)
from .loading import load_transformer
from .pipeline import AdalnCachePrepareStep, PipelineAdalnCacheHandle
from .sources import CheckpointMismatchError
from .stepcaches import minimax_h3_raw_vision, register_minimax_h3_block

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
