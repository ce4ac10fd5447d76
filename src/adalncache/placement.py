"""Where a cache serves: its device and the tier chain bound to it, with one owner.

Why its own module: the device and the tiers used to be copied into the cache, its identity and
its build transaction, and a move patched each copy. Now :class:`Site` holds the one current
:class:`Placement`; the identity and the transaction read it there, and a move replaces it with
one assignment (see :mod:`adalncache.assembly`, which builds placements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .tiers.chain import TierChain
    from .tiers.tables import TablesTier


@dataclass(frozen=True)
class Placement:
    """The device, the tier chain placed for it, and the table files the cache was given.

    ``files`` are the table files of ``tables=``; ``tiers.tables`` is them where their binding
    fits this device, else None (plans are built there instead).
    """

    device: torch.device
    tiers: TierChain
    files: TablesTier | None


class Site:
    """The one owner of a cache's current :class:`Placement`."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def tiers(self) -> TierChain:
        return self.placement.tiers


__all__ = ["Placement", "Site"]
