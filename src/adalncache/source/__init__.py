"""Weight sources: where the projection bytes of a rebuild pass come from (docs/api.md, "Weight sources").

The protocol every source speaks (:class:`WeightSource`), and the checks each runs on its tensors at
construction (:func:`expected`, :func:`tensor_problem`, :func:`check_tensors`), so a wrong checkpoint or
mapping fails with one message listing every unusable tensor before any build. :mod:`.files` holds the
safetensors files, :mod:`.reads` the bytes into buffers, :mod:`.checkpoint` and :mod:`.memory` the sources.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ..errors import CheckpointError
from ..identity import DigestSink
from ..options import flag
from ..spec import KeyLayout, Layer, ModulationSpec


class Columns(NamedTuple):
    """A slice ``[start, stop)`` of output features: column-parallel ranks read ``part`` of ``parts``
    equal slices of every projection."""

    part: int
    parts: int

    def bounds(self, width: int) -> tuple[int, int]:
        size = width // self.parts
        return self.part * size, (self.part + 1) * size


class LayerWeights(NamedTuple):
    """One projection as a pass sees it: the layer, its weight ``(out, in)`` and bias ``(out,)``
    (None for a layer declared without one, ``ServedLayer(..., bias=False)``)."""

    layer: Layer
    weight: torch.Tensor
    bias: torch.Tensor | None


@runtime_checkable
class WeightSource(Protocol):
    """What the cache needs from a source of projection weights."""

    spec: ModulationSpec
    layout: KeyLayout
    bytes_read: int
    #: The upstream digest (:func:`~adalncache.identity.upstream_digest`) of the modules the rows are computed
    #: from, or a callable giving it when a tier first needs the binding (so nothing is read before); None
    #: names none (the caller's ``embed`` is the caller's to vouch for). A checkpoint names its own tensors
    #: unless told otherwise; the diffusers integration sets the model's, whose own modules compute the rows.
    upstream: str | Callable[[], str | None] | None

    @property
    def fingerprint(self) -> str:
        """Identity of the bytes served (``stat`` identities for files; addresses for tensors)."""

    def refresh(self) -> bool:
        """Re-check the identity cheaply (``stat``, never re-hashing data); True when it changed.
        CheckpointError when the changed source no longer validates."""

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
        ``digests`` hashes the bytes as read; a source that cannot hash them (a device tensor) feeds it nothing."""

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for ``inspect`` and logs."""


def expected(spec: ModulationSpec, layout: KeyLayout) -> list[tuple[Layer, str, tuple[int, ...]]]:
    """(layer, tensor name, shape) of every projection weight and bias, in pass order (a layer declared
    without a bias contributes its weight only: no such tensor is looked for)."""
    out: list[tuple[Layer, str, tuple[int, ...]]] = []
    for layer in spec.layers():
        width = spec.out_features(layer)
        out.append((layer, layout.weight(layer), (width, spec.in_features)))
        if spec.has_bias(layer):
            out.append((layer, layout.bias(layer), (width,)))
    return out


def tensor_problem(
    spec: ModulationSpec,
    name: str,
    shape: tuple[int, ...] | None,
    dtype: torch.dtype | str | None,
    want: tuple[int, ...],
) -> str | None:
    """Why a projection tensor cannot be used, or None."""
    if shape is None:
        return f"{name}: missing"
    if tuple(shape) != want:
        return f"{name}: shape {list(shape)}, expected {list(want)}"
    if dtype != spec.dtype:
        shown = str(dtype).removeprefix("torch.")
        return f"{name}: dtype {shown}, expected {str(spec.dtype).removeprefix('torch.')} (ModulationSpec.dtype)"
    return None


def detect_layout(names: set[str] | Mapping[str, Any], spec: ModulationSpec, layout: str, where: str) -> KeyLayout:
    """``layout`` itself, or for ``"auto"`` the layout whose projection names ``names`` holds most of."""
    if layout != "auto":
        return spec.layout(layout)
    layouts = spec.layouts()
    scores = {name: sum(key in names for _, key, _ in expected(spec, lay)) for name, lay in layouts.items()}
    best = max(scores, key=lambda n: scores[n])
    if scores[best] == 0:
        first = spec.layers()[0]
        looked = " and ".join(repr(lay.weight(first)) for lay in layouts.values())
        raise CheckpointError(
            f"{where} holds no AdaLN projection in a known layout (looked for {looked}): pass a "
            f"{spec.family.title} transformer checkpoint, or set layout= (CLI {flag('layout')})"
        )
    return layouts[best]


def check_tensors(
    spec: ModulationSpec, layout: KeyLayout, problem: Callable[[str, tuple[int, ...]], str | None], where: str
) -> None:
    """CheckpointError listing (the first 20) projection tensors that ``problem(name, shape)`` finds unusable."""
    problems = [p for _, key, shape in expected(spec, layout) if (p := problem(key, shape)) is not None]
    if not problems:
        return
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise CheckpointError(
        f"{len(problems)} AdaLN projection tensor(s) unusable in {layout.name} layout ({where}):\n  "
        + "\n  ".join(problems[:20])
        + more
    )
