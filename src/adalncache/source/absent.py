"""The source of a cache that has no projection weights at all: it serves table files only.

A model loaded without its AdaLN projections (or whose projections were freed) can still be
served, for every plan its table files hold. :class:`NoWeights` stands where a weight source would
be, so the cache's bookkeeping needs no special case; a build that would need a pass raises
:class:`~adalncache.PlanNotCachedError` before anything changes (the cache checks
``serves_weights`` first, so :meth:`NoWeights.stream` is only a last line of defence).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import PlanNotCachedError
from ..identity.digest import DigestSink
from ..spec import Layer, ModulationSpec
from .protocol import Columns, LayerWeights


class NoWeights:
    """No projection weights: every plan must come from a tier (see the module docstring)."""

    #: Nothing to read, nothing to hash, nothing a store could be bound to.
    serves_weights = False
    persistent = False

    def __init__(self, spec: ModulationSpec) -> None:
        self.spec = spec
        self.layout = spec.default_layout
        self.bytes_read = 0

    @property
    def fingerprint(self) -> str:
        return "no-weights"

    def refresh(self) -> bool:
        return False

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
        digests: DigestSink | None = None,
    ) -> Iterator[LayerWeights]:
        raise PlanNotCachedError(
            "this cache has no projection weights (source=None): it serves table files only; pass a checkpoint "
            "to build plans they lack"
        )

    def describe(self) -> dict[str, Any]:
        return {"kind": "none", "spec": self.spec.describe(), "fingerprint": self.fingerprint}

    def __repr__(self) -> str:
        return "NoWeights()"


__all__ = ["NoWeights"]
