"""What a build records (:class:`CacheStats`, :class:`BuildReport`: docs/api.md), and where a test may make
it fail (:class:`FaultPoints`, which :func:`adalncache.testing.inject_faults` replaces so tests reach every
failure path without monkeypatching). Below the cache because the tiers and the identity fill them in too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CacheStats:
    """Counters over the cache's life (each described in docs/api.md). Hits and builds count distinct plans per
    ``build`` call."""

    device_hits: int = 0
    host_hits: int = 0
    store_hits: int = 0
    built_plans: int = 0
    passes: int = 0
    evicted_plans: int = 0
    host_evicted: int = 0
    host_pressure_skips: int = 0
    tier_write_failures: int = 0
    fingerprint_changes: int = 0
    variant_changes: int = 0
    failed_builds: int = 0
    store_corrupt: int = 0
    table_hits: int = 0
    tables_corrupt: int = 0
    hash_reads: int = 0
    hashed_bytes: int = 0
    store_unbound: int = 0
    lock_waits: int = 0
    store_unwritable: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def record(self, report: BuildReport) -> None:
        """Count a successful build's hits, builds and pass (evictions and failures count as they happen)."""
        self.device_hits += report.device_hits
        self.host_hits += report.host_hits
        self.store_hits += report.store_hits
        self.table_hits += report.table_hits
        self.built_plans += report.built
        self.passes += report.passes


@dataclass
class BuildReport:
    """What one ``build`` call did (each field described in docs/api.md)."""

    plans: int = 0
    device_hits: int = 0
    host_hits: int = 0
    store_hits: int = 0
    table_hits: int = 0
    built: int = 0
    evicted: int = 0
    passes: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    hashed_bytes: int = 0
    waited_s: float = 0.0
    tier_write_failures: int = 0
    stacked_layers: int = 0
    per_plan_layers: int = 0
    tiled_layers: int = 0
    layers_read: list[str] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("layers_read")
        return out


#: The named moments of a build where :class:`FaultPoints` is checked.
POINTS = ("embed", "project", "publish", "host_write", "host_read", "store_write", "store_read")


class FaultPoints:
    """No faults: every check passes. Subclasses raise at chosen points."""

    def check(self, point: str) -> None:
        """Called by the cache at ``point``; raise to simulate a failure there."""


NO_FAULTS = FaultPoints()
