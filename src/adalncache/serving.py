"""The read side of the cache: a forward's slots and rows, ordered after the writes that filled them.

Why a base class of its own: these verbs are what every step of every request calls, from any
thread, while a build may be running on another. They take the cache's state lock only to read the
slot map (never during a pass), make the calling thread's CUDA stream wait for the build that
wrote the slot (:class:`~adalncache.streams.StreamSync`; nothing on a CPU), and serve rows in the
dtype the resident projection returns (the autocast dtype the tables were built under).

Slot tensors are made without a host-to-device copy (:meth:`~adalncache.slab.Slab.indices`), and
a device slot is never read on the host, so a captured CUDA graph sees no sync and no baked-in slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from .errors import PlanError, PlanNotCachedError
from .identity.binding import TableIdentity
from .plans import PlanKey, keyed_plans, plan_key
from .slab import Slab
from .slots import SlotPool
from .spec import Layer, ModulationSpec
from .streams import StreamSync


class SlabReads:
    """Lookups and row reads of a cache; :class:`~adalncache.AdalnCache` sets the attributes below."""

    spec: ModulationSpec
    stream_sync: StreamSync
    _slab: Slab
    _pool: SlotPool
    _identity: TableIdentity
    _lock: threading.RLock

    def resolve_slots(self, plans: Sequence[torch.Tensor], *, keys: Sequence[PlanKey] | None = None) -> torch.Tensor:
        """One slot per plan as a LongTensor on the cache device (pass ``keys`` to skip keying).

        Made without a host-to-device copy (a view, or a tensor kept per slot list); read-only.
        """
        plans, keys = keyed_plans(plans, keys, self.spec.plan_columns)
        with self._lock:
            slots = [self._pool.require(k) for k in keys]
            tensor = self._slab.indices(slots)
        self.stream_sync.before_read(slots)
        return tensor

    def lookup(self, plan: torch.Tensor, *, key: PlanKey | None = None) -> torch.Tensor:
        """The slot of a resident plan as a 0-d LongTensor on the cache device."""
        key = plan_key(plan, self.spec.plan_columns) if key is None else key
        with self._lock:
            slot = self._pool.require(key)
        self.stream_sync.before_read([slot])
        return self._slab.index(slot)

    def _read(
        self, slot: int | torch.Tensor, read: Callable[[], torch.Tensor], dtype: torch.dtype | None
    ) -> torch.Tensor:
        """``read()`` of a slot's rows, ordered after their writes, in the served dtype.

        An integer slot gives views of the slab (valid while the slot holds its plan: hold it);
        a device slot tensor gives a gathered copy, and the gather is recorded as a read that a
        later rewrite of any slot waits for.
        """
        known = [self._check_slot(slot)] if not isinstance(slot, torch.Tensor) else None
        self.stream_sync.before_read(known)
        rows = read()
        if known is None:
            self.stream_sync.after_read(None)
        want = dtype if dtype is not None else self._identity.serve_dtype
        return rows if rows.dtype == want else rows.to(want)

    def _check_slot(self, slot: object) -> int:
        """An integer slot, checked on the host: in range, and holding a plan (resident, or retired but held).

        A device slot tensor is never read on the host (that would sync the device): it is the
        caller's from ``lookup``, ``resolve_slots`` or ``acquire``.
        """
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise PlanError(
                f"slot must be an integer or the slot tensor lookup()/resolve_slots() returned, got "
                f"{type(slot).__name__}"
            )
        if not 0 <= slot < self._slab.max_plans:
            raise PlanError(
                f"slot must be in 0..{self._slab.max_plans - 1} (the slab's max_plans), got {slot}: pass a slot "
                f"lookup() or resolve_slots() returned"
            )
        with self._lock:
            in_use = self._pool.in_use(slot)
        if not in_use:
            raise PlanNotCachedError(
                f"the cache does not cover slot {slot}: slot {slot} holds no plan (it is free, or being built); pass "
                f"the slot lookup() or resolve_slots() returned for a resident plan, and hold it while reading"
            )
        return slot

    @property
    def poison_slot(self) -> int:
        """The poison slot's index (``max_plans``): NaN rows that no plan ever occupies.

        A served forward whose plan matched none of its request's prepared plans (found on the
        device, without a host read) gathers these rows: its output is NaN, never another plan's.
        """
        return self._slab.poison_slot

    def served_params(self, layer: Layer) -> torch.Tensor:
        """:meth:`layer_params` with the poison slot after the last slot: ``[P + 1, W, out_features]``."""
        return self._slab.served_layer(layer)

    def served_part(self, name: str) -> torch.Tensor:
        """Table part ``name`` with the poison slot after the last slot: ``[P + 1, W, *part.shape]``."""
        return self._slab.served_part(name)

    def layer_params(self, layer: Layer) -> torch.Tensor:
        """``layer``'s columns of every slot: a ``[P, W, out_features]`` view of :attr:`table`.

        A static view (made once per slab allocation) that served modules can gather from with a
        device slot tensor (``index_select``), so serving never reads the slot on the host.
        """
        return self._slab.layer_params(layer)

    def layer_rows(
        self, layer: Layer, slot: int | torch.Tensor, n: int, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The ``(n, out_features)`` output of ``layer``'s projection for the slot's first ``n`` plan rows."""
        return self._read(slot, lambda: self._slab.layer_rows(layer, slot, n), dtype)

    def block_rows(
        self, layer: int, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``Y`` of block ``layer``: the ``(num_timesteps, block_width)`` output of its projection."""
        return self._read(slot, lambda: self._slab.block_rows(layer, slot, num_timesteps), dtype)

    def block(
        self, layer: int, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The six ``(num_timesteps * modalities, hidden)`` tensors, as ``Y.view(-1, 6H).chunk(6, -1)``."""
        rows = self.block_rows(layer, slot, num_timesteps, dtype=dtype)
        return rows.reshape(-1, 6 * self.spec.hidden_size).chunk(6, dim=-1)

    def block_all(
        self, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> list[tuple[torch.Tensor, ...]]:
        """:meth:`block` for every layer from one gather of the slot."""
        rows = self._read(slot, lambda: self._slab.block_all_rows(slot, num_timesteps), dtype)
        width = 6 * self.spec.hidden_size
        return [rows[:, layer].reshape(-1, width).chunk(6, dim=-1) for layer in range(self.spec.num_layers)]

    def final_rows(
        self, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``Z``: the ``(num_timesteps, final_width)`` output of the output-layer projection."""
        return self._read(slot, lambda: self._slab.final_rows(slot, num_timesteps), dtype)

    def final(
        self, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shift, scale)`` of the output layer."""
        shift, scale = self.final_rows(slot, num_timesteps, dtype=dtype).chunk(2, dim=-1)
        return shift, scale


__all__ = ["SlabReads"]
