"""Rank agreement for distributed builds (``process_group=``).

The cache talks to its peers only through a :class:`Collective`. In a single process every
method is trivial (:class:`LocalCollective`); with a ``torch.distributed`` process group the
decisions that must be identical on every rank (capacities, tier hits, failures) are reduced
across ranks before anyone acts on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError
from .source import Columns
from .spec import Layer, ModulationSpec

if TYPE_CHECKING:
    from .cache import AdalnCache


@dataclass(frozen=True)
class LocalWork:
    """What this rank reads in a pass: which layers, and which slice of their output features."""

    layers: list[Layer]
    columns: Columns | None = None


class Collective:
    """The agreement protocol the cache relies on; see :class:`LocalCollective` for the trivial one."""

    rank: int = 0
    world: int = 1

    def min_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def any_true(self, flag: bool) -> bool:
        return bool(flag)

    def agree_on(self, mask: Sequence[bool]) -> list[bool]:
        """Element-wise AND over ranks: which plans every rank can serve from a tier."""
        return list(mask)

    def raise_if_any_failed(self, failure: BaseException | None, phase: str) -> None:
        """Raise BuildError on every rank if any rank failed (no-op alone: the caller re-raises)."""

    def local_work(self, layers: Sequence[Layer]) -> LocalWork:
        return LocalWork(list(layers))

    def share_results(self, cache: AdalnCache, slots: list[int], lengths: list[int], work: LocalWork) -> None:
        """Give every rank the rows the others projected (nothing to share alone)."""

    def column_staging(self, cache: AdalnCache, slot: int, layer: Layer, n: int) -> torch.Tensor:
        raise NotImplementedError("column staging needs a process group")

    def writes_store(self) -> bool:
        """Whether this rank writes store entries (one writer per group avoids duplicate work)."""
        return True

    def describe_shard(self) -> str:
        return "single"


class LocalCollective(Collective):
    """A single process: every decision is already agreed."""


def make_collective(process_group: Any, shard: str, spec: ModulationSpec) -> Collective:
    """The collective for ``process_group`` (``None``: a single process)."""
    if process_group is None:
        return LocalCollective()
    raise ConfigError("process_group= is not supported yet in this build: pass process_group=None")


__all__ = ["Collective", "LocalCollective", "LocalWork", "make_collective"]
