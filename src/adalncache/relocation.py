"""Moving a cache between devices: which tables may follow, and where the others wait.

Tables are the bits one kind of device computes, and another kind computes other bits (a CPU and
a GPU, two GPU models), so rows are never served on a device of another identity
(:func:`~adalncache.identity.device_identity`). Within one identity (``cuda:0`` to ``cuda:1`` of
one model) the slab is copied as it is. Across identities the resident tables are *stashed*: host
copies, least recently used first, with the source fingerprint, the variant and the autocast state they
were built under, kept per identity. When the cache comes back to a device of that identity they are
restored bit-exactly with no pass, unless the source changed since (then they are stale and
dropped). Everything else is built on the new device by the next build, the store included (it is
keyed by the numeric environment, device and all).

A model offload that bounces a transformer between a GPU and the host therefore copies the
resident rows once each way and never rebuilds them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from .plans import PlanKey
from .rows import PlanRows
from .slab import Slab
from .slots import SlotPool


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` means the current CUDA device)."""

    def indexed(device: torch.device) -> torch.device:
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    return indexed(a) == indexed(b)


class StashedTables(NamedTuple):
    """One device identity's tables, kept on the host while the cache serves another device."""

    rows: list[tuple[PlanKey, PlanRows]]
    fingerprint: str | None
    variant: Hashable
    autocast: torch.dtype | None


class HostTableStash:
    """Host copies of one cache's computed tables, by device identity, kept while the cache serves a
    device of another identity (a model's weights are nothing of this: only rows the cache computed)."""

    def __init__(self) -> None:
        self._stashed: dict[tuple[Any, ...], StashedTables] = {}

    def stash(
        self,
        identity: tuple[Any, ...],
        pool: SlotPool,
        slab: Slab,
        *,
        fingerprint: str | None,
        variant: Hashable,
        autocast: torch.dtype | None,
    ) -> None:
        """Keep host copies of every table ``pool`` holds resident, least recently used first."""
        rows = []
        for key, slot in pool.items():
            copy = slab.read_rows(slot, slab.spec.plan_rows(key))
            rows.append((key, PlanRows(*(tensor.to("cpu") for tensor in copy))))
        if rows:
            self._stashed[identity] = StashedTables(rows, fingerprint, variant, autocast)
        else:
            self._stashed.pop(identity, None)

    def restore(
        self, identity: tuple[Any, ...], pool: SlotPool, slab: Slab, *, fingerprint: str | None
    ) -> StashedTables | None:
        """Publish the tables stashed for ``identity`` into an empty ``pool``; what came back, or None.

        Only tables built under ``fingerprint`` (the source as the cache holds it now) come back.
        """
        stashed = self._stashed.pop(identity, None)
        if stashed is None or stashed.fingerprint != fingerprint:
            return None
        rows = dict(stashed.rows[-pool.num_slots :])
        keys = list(rows)
        reservation = pool.reserve(keys, set(keys))
        for key, slot in reservation.slots.items():
            slab.write_rows(slot, rows[key])
        # Contents first, then timesteps and lengths, then the host-side map: as a build publishes.
        slab.publish([reservation.slots[k] for k in keys], [rows[k].timesteps for k in keys])
        pool.commit(reservation.slots)
        pool.touch(keys)
        return StashedTables(list(rows.items()), stashed.fingerprint, stashed.variant, stashed.autocast)


__all__ = ["HostTableStash", "StashedTables", "same_device"]
