"""The table rows of one plan, as tiers hold them.

Tiers (host arena, store, table files) copy published plans out of the slab and back in. They
exchange :class:`PlanRows`: a plan's tensor, then the rows of each part of the spec's table layout
(``spec.table_parts()``, in order), so they never need to know the slab's layout. A family whose
table is one part has ``PlanRows(plan, rows)`` with ``rows (n, table_width)``; one whose tables
another engine reads in two parts (a stacked part of blocks, then the output layer's) has
``PlanRows(plan, block, final)``.
"""

from __future__ import annotations

import torch


class PlanRows(tuple[torch.Tensor, ...]):
    """One plan's table: ``timesteps`` (the plan, f32), then one tensor ``(n, *part.shape)`` per table part."""

    __slots__ = ()

    def __new__(cls, timesteps: torch.Tensor, *parts: torch.Tensor) -> PlanRows:
        if not parts:
            raise ValueError("PlanRows needs the plan and at least one part of its rows")
        return super().__new__(cls, (timesteps, *parts))

    def __getnewargs__(self) -> tuple[torch.Tensor, ...]:
        # Pickled (torch.save, a process group's objects) as the positional arguments __new__ takes.
        return tuple(self)

    @property
    def timesteps(self) -> torch.Tensor:
        """The plan (the slab's ``plan_timesteps`` row): ``(n,)``, or ``(n, columns)``."""
        return self[0]

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The rows of each table part, in the spec's part order."""
        return tuple(self[1:])

    @property
    def block(self) -> torch.Tensor:
        """The first part of a two-part table (its stacked blocks' rows)."""
        return self[1]

    @property
    def final(self) -> torch.Tensor:
        """The second part of a two-part table (its output layer's rows)."""
        if len(self) < 3:
            raise AttributeError("these rows have one part: read .parts[0]")
        return self[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(t.shape)) for t in self)
        return f"PlanRows({shapes})"


__all__ = ["PlanRows"]
