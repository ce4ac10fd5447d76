"""What the cache needs from a weight source, and the two small types a pass exchanges with it.

The cache never cares where projection bytes come from: a checkpoint on disk
(:class:`~adalncache.source.CheckpointSource`) and tensors already in memory
(:class:`~adalncache.source.TensorSource`) both satisfy :class:`WeightSource`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ..identity.digest import DigestSink
from ..spec import KeyLayout, Layer, ModulationSpec


class Columns(NamedTuple):
    """A slice ``[start, stop)`` of output features, as a fraction of each layer's width.

    Column-parallel ranks read ``part`` of ``parts`` equal slices of every projection.
    """

    part: int
    parts: int

    def bounds(self, width: int) -> tuple[int, int]:
        size = width // self.parts
        return self.part * size, (self.part + 1) * size


class LayerWeights(NamedTuple):
    """One projection as a pass sees it: the layer, its weight ``(out, in)`` and bias ``(out,)``.

    ``bias`` is None for a layer declared without one (``ServedLayer(..., bias=False)``).
    """

    layer: Layer
    weight: torch.Tensor
    bias: torch.Tensor | None


@runtime_checkable
class WeightSource(Protocol):
    """What the cache needs from a source of projection weights."""

    spec: ModulationSpec
    layout: KeyLayout
    bytes_read: int

    @property
    def fingerprint(self) -> str:
        """Identity of the bytes served; stores bind entries to it."""
        ...

    def refresh(self) -> bool:
        """Re-check the identity cheaply (``stat``, never re-hashing data); True when it changed.

        Raises CheckpointError when the changed source no longer validates.
        """
        ...

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str,
        columns: Columns | None = None,
        read_ahead: int = 1,
        digests: DigestSink | None = None,
    ) -> Iterator[LayerWeights]:
        """Yield ``layers`` in order, reading ahead; the consumer must finish one before asking the next.

        ``digests``: a sink that hashes the bytes as they are read (the content identity); a
        source that cannot hash what it serves (a device tensor) feeds it nothing.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for ``inspect`` and logs."""
        ...
