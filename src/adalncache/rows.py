"""The table rows of one plan, as tiers hold them.

Tiers (host arena, store) copy published plans out of the slab and back in. They exchange
:class:`PlanRows`, a plan's timesteps and every layer's projection output, so they never need to
know the slab's layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PlanRows(NamedTuple):
    """One plan's table: ``timesteps (n,) f32``, ``block (n, layers, block_width)``, ``final (n, final_width)``."""

    timesteps: torch.Tensor
    block: torch.Tensor
    final: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


__all__ = ["PlanRows"]
