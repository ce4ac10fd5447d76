"""What the resident tables were built from, and when they stop being valid.

A table is exact only for the weights and settings it was projected under. Two of those can
change while a cache lives: the weight source (a checkpoint rewritten on disk, seen through its
fingerprint) and the caller's *variant* (whatever else shapes the projection, such as the active
LoRA adapters). :class:`TableIdentity` remembers both, re-checks them at the start of every build,
and tells the cache to drop tables built under an old identity. It also forms the store binding:
everything a stored table depends on besides its plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import CheckpointError
from .numerics import numeric_environment
from .plans import PlanKey
from .reports import CacheStats
from .source import WeightSource
from .spec import ModulationSpec

if TYPE_CHECKING:
    from .distributed import Collective

log = logging.getLogger(__name__)


class TableIdentity:
    """The source fingerprint and the variant the resident tables were built under."""

    def __init__(
        self,
        source: WeightSource,
        collective: Collective,
        stats: CacheStats,
        *,
        spec: ModulationSpec,
        precision: str,
        device: torch.device,
    ) -> None:
        self.source = source
        self._dist = collective
        self.stats = stats  # the cache's counters (the same object)
        self.spec = spec
        self.precision = precision
        self.device = device
        self.fingerprint: str | None = source.fingerprint
        self.variant: Hashable = None

    def check(
        self,
        variant: Hashable,
        request: Sequence[PlanKey],
        resident: Sequence[tuple[PlanKey, int]],
        *,
        holds_tables: bool,
        drop: Callable[[str], None],
    ) -> None:
        """Re-stat the source and compare the variant; ``drop(why)`` tables built under an old identity.

        ``resident``: the slot map in LRU order; ``holds_tables``: whether the slab or the host
        tier holds anything. In a process group the three flags, a digest of ``request`` and one
        of ``resident`` are reduced in one collective, so every rank drops, or keeps, the same
        tables and the slot maps stay equal. Raises the ``CheckpointError`` (alone) or a
        ``BuildError`` naming the rank (in a group) when the source no longer validates.
        """
        invalid: CheckpointError | None = None
        try:
            self.source.refresh()
        except CheckpointError as exc:
            invalid = exc
        fingerprint = self.source.fingerprint
        (failed, changed, variant_changed), diverged = self._dist.agree_identity(
            [invalid is not None, fingerprint != self.fingerprint, variant != self.variant], request, resident
        )
        if diverged:
            # The ranks' slot maps differ (invalidate() on some ranks only, say): their next
            # decisions would differ too, so every rank starts again from an empty slab.
            log.warning("rank %d: the ranks' slabs diverged; dropping every table on every rank", self._dist.rank)
            drop("the ranks' slabs diverged")
        if failed:
            # The file changed (on some rank) and no longer validates: whatever the slab holds came
            # from the old file, so it can no longer be trusted either.
            self.stats.fingerprint_changes += 1
            self.fingerprint = None
            drop("the checkpoint changed on disk and no longer validates")
            self._dist.raise_if_any_failed(invalid, "checkpoint")
            assert invalid is not None  # alone, only this rank can have failed
            raise invalid
        if changed:
            self.stats.fingerprint_changes += 1
            drop("the weight source's fingerprint changed")
            self.fingerprint = fingerprint
        if variant_changed:
            if holds_tables:
                self.stats.variant_changes += 1
                drop(f"variant changed ({self.variant!r} -> {variant!r})")
            self.variant = variant

    def binding(self) -> dict[str, Any]:
        """Everything a stored table depends on besides its plan (stores key entries by it)."""
        return {
            "fingerprint": self.fingerprint,
            "spec": self.spec.describe(),
            "precision": self.precision,
            "variant": repr(self.variant),
            "shard": self._dist.describe_shard(),
            "environment": numeric_environment(self.device),
        }

    def current_binding(self) -> dict[str, Any] | None:
        """:meth:`binding`, or ``None`` if the source changed since the resident tables were built."""
        self.source.refresh()
        return self.binding() if self.source.fingerprint == self.fingerprint else None


__all__ = ["TableIdentity"]
