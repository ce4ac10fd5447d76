"""adalncache: serve AdaLN modulation from bit-exact precomputed tables.

The public names and what callers may rely on are in docs/api.md; the README has a walk-through.
"""

from __future__ import annotations

from .cache import AdalnCache, BuildReport, CacheStats, PlanHold
from .errors import (
    AdalnCacheError,
    BuildError,
    CheckpointError,
    ConfigError,
    PlanError,
    PlanMismatchError,
    PlanNotCachedError,
)
from .options import AdalnCacheConfig
from .plans import plan_key
from .source.checkpoint import CheckpointSource
from .source.memory import TensorSource
from .spec import ModulationSpec
from .tiers.store import Store

__version__ = "0.1.0"

__all__ = [
    "AdalnCache",
    "AdalnCacheConfig",
    "AdalnCacheError",
    "BuildError",
    "BuildReport",
    "CacheStats",
    "CheckpointError",
    "CheckpointSource",
    "ConfigError",
    "ModulationSpec",
    "PlanError",
    "PlanHold",
    "PlanMismatchError",
    "PlanNotCachedError",
    "Store",
    "TensorSource",
    "__version__",
    "plan_key",
]
