"""What a cache tells about itself: its slab tensors, its options, its placement, what is resident.

Why a base class of its own: :class:`~adalncache.AdalnCache` decides when work runs (builds,
holds, moves); these members only read its state, each under the state lock where the state can
change, and none of them starts work. Kept apart, the class that does the work stays readable.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from .assembly import Parts
from .distributed import Collective
from .options import CacheOptions
from .placement import Site
from .plans import PlanKey, plan_key
from .reports import CacheStats
from .serving import SlabReads
from .tiers.chain import TierChain

if TYPE_CHECKING:
    from .tiers.host import HostTier
    from .tiers.store import Store
    from .tiers.tables import TablesTier


class CacheIntrospection(SlabReads):
    """The read-only members of :class:`~adalncache.AdalnCache` (which sets the attributes below)."""

    #: The options in force: as given, with the capacities every rank of a group agreed on.
    options: CacheOptions
    stats: CacheStats
    _parts: Parts
    _site: Site
    _dist: Collective
    _closed: bool

    # -- the slab tensors ---------------------------------------------------------------------

    @property
    def plan_timesteps(self) -> torch.Tensor:
        """``[P, W]`` f32 (``[P, W, C]`` for plans of ``C`` columns): each slot's plan, zero past its length."""
        return self._slab.plan_timesteps

    @property
    def plan_lengths(self) -> torch.Tensor:
        """``[P]`` i64: each slot's plan rows, 0 for a free slot."""
        return self._slab.plan_lengths

    @property
    def table(self) -> torch.Tensor:
        """``[P, W, spec.table_width]``: every served layer's output per plan row, side by side."""
        return self._slab.table

    @property
    def block_params(self) -> torch.Tensor:
        """``[P, W, L, block_width]``: the table's ``block`` part, a view of :attr:`table` (two-part tables)."""
        return self._slab.part_params("block")

    @property
    def final_params(self) -> torch.Tensor:
        """``[P, W, final_width]``: the table's ``final`` part, a view of :attr:`table` (two-part tables)."""
        return self._slab.part_params("final")

    # -- the options and the placement ------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the slab lives and passes project (changed only by :meth:`move_to`)."""
        return self._site.device

    @property
    def _tiers(self) -> TierChain:
        return self._site.tiers

    @property
    def max_plans(self) -> int:
        return self.options.max_plans

    @property
    def max_plan_width(self) -> int:
        return self.options.max_plan_width

    @property
    def host_cache_bytes(self) -> int:
        return self.options.host_cache_bytes

    @property
    def precision(self) -> str:
        return self.options.precision

    @property
    def shard(self) -> str:
        return self.options.shard

    @property
    def read_ahead(self) -> int:
        return self.options.read_ahead

    @property
    def progress(self) -> bool | None:
        return self.options.progress

    @property
    def batched(self) -> bool:
        """Whether plans of one width are stacked into one GEMM where a probe proved it bit-identical
        to the per-plan GEMM on this device (:mod:`adalncache.batching`); off by default."""
        return self.options.batched

    @property
    def tiled(self) -> bool | str:
        """Whether each layer is projected tile by tile over its output columns, every plan per tile, where a
        probe proved it bit-identical (:mod:`adalncache.tiling`): ``"auto"`` only where it was also faster."""
        return self.options.tiled

    # -- introspection ----------------------------------------------------------------------

    @property
    def slab_bytes(self) -> int:
        return self._slab.nbytes

    def slab_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._slab.tensors()

    @property
    def resident_plans(self) -> list[PlanKey]:
        """Published plan keys, least recently used first."""
        with self._lock:
            return self._pool.keys()

    def slot_of(self, key: PlanKey) -> int | None:
        with self._lock:
            return self._pool.slot_of(key)

    @property
    def free_slots(self) -> list[int]:
        with self._lock:
            return self._pool.free_slots

    @property
    def held_slots(self) -> dict[int, int]:
        """How many requests hold each held slot (resident, or retired by an identity change)."""
        with self._lock:
            return self._pool.held_slots

    @property
    def variant(self) -> Hashable:
        return self._identity.variant

    @property
    def serve_dtype(self) -> torch.dtype:
        """The dtype rows are served in: the autocast dtype the tables were built under, else ``spec.dtype``."""
        return self._identity.serve_dtype

    @property
    def host_tier(self) -> HostTier | None:
        return self._tiers.host

    @property
    def store(self) -> Store | None:
        return self._tiers.store

    @property
    def tables(self) -> TablesTier | None:
        """The read-only table files (``tables=``), or None."""
        return self._tiers.tables

    @property
    def content_digest(self) -> str | None:
        """The content digest of the source's projection tensors, if known yet (no I/O; see :meth:`identify`)."""
        return self._identity.content.digest

    @property
    def world_size(self) -> int:
        """Ranks that build this cache together (1 without a process group)."""
        return self._dist.world

    @property
    def rank(self) -> int:
        """This process's rank in the cache's process group (0 without one)."""
        return self._dist.rank

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` gave the cache's host memory back (it can no longer build)."""
        return self._closed

    def __contains__(self, plan: torch.Tensor) -> bool:
        key = plan_key(plan, self.spec.plan_columns)
        with self._lock:
            return key in self._pool

    def __len__(self) -> int:
        with self._lock:
            return len(self._pool)

    def __repr__(self) -> str:
        return (
            f"AdalnCache({len(self)}/{self.max_plans} plans resident, width {self.max_plan_width}, "
            f"{self.spec.num_layers} layers, {self.precision}, {self.device})"
        )

    def binding(self) -> dict[str, Any] | None:
        """Everything a stored table depends on besides its plan (stores key entries by it).

        ``None`` while the source's content digest is not known (the store is then not used).
        """
        return self._identity.binding()


__all__ = ["CacheIntrospection"]
