"""Sources that read nothing from disk: projection tensors already in memory, or no weights at all.

:class:`NoWeights` stands where a weight source would be for a cache that serves table files only (a
model loaded without its projections, or whose projections were freed), so the cache's bookkeeping
needs no special case; the cache checks ``serves_weights`` before a pass, so :meth:`NoWeights.stream`
raising :class:`~adalncache.PlanNotCachedError` is only a last line of defence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError, PlanNotCachedError
from ..identity import DigestSink, role_of
from ..options import flag
from ..spec import Layer, ModulationSpec
from . import Columns, LayerWeights, check_tensors, detect_layout, expected, tensor_problem
from .files import safetensors_name


class TensorSource:
    """Projection weights already in memory, used exactly as they are, never copied (docs/api.md). Its
    fingerprint names addresses, shapes, dtypes, devices and in-place versions, so an in-place edit (a fused
    LoRA) is noticed by the next build; tensors of ``logical_shapes`` (quantized, packed, fp8 by layerwise
    casting) are validated by that shape alone, fingerprinted also by identity and inner tensors (a subclass
    may report no address of its own), and never column-sliced: only their module's forward can read them.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: ModulationSpec,
        *,
        layout: str = "auto",
        logical_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        if not isinstance(spec, ModulationSpec):
            raise ConfigError(f"TensorSource needs a ModulationSpec as spec, got {type(spec).__name__}")
        if not isinstance(tensors, Mapping):
            raise ConfigError(f"TensorSource needs a mapping of tensor names to tensors, got {type(tensors).__name__}")
        self.spec = spec
        self.layout = detect_layout(tensors, spec, layout, "the tensors given to TensorSource")
        self.logical_shapes = {key: tuple(shape) for key, shape in (logical_shapes or {}).items()}

        def problem(key: str, shape: tuple[int, ...]) -> str | None:
            t = tensors.get(key)
            if t is None:
                return tensor_problem(spec, key, None, None, shape)
            if not isinstance(t, torch.Tensor):
                return f"{key}: not a tensor ({type(t).__name__})"
            if t.device.type == "meta":
                return f"{key}: a meta tensor holds no data"
            if key in self.logical_shapes:
                return tensor_problem(spec, key, self.logical_shapes[key], spec.dtype, shape)
            return tensor_problem(spec, key, tuple(t.shape), t.dtype, shape)

        check_tensors(spec, self.layout, problem, "tensors given to TensorSource")
        self.tensors = {key: tensors[key] for _, key, _ in expected(spec, self.layout)}
        self.bytes_read = 0
        self.upstream: str | Callable[[], str | None] | None = None
        #: The fingerprint names addresses in this process, so store entries could never hit again.
        self.persistent = False
        self._fingerprint = self._compute_fingerprint()

    @property
    def opaque(self) -> bool:
        """Whether some tensors can only be read by their module's own forward (``logical_shapes``)."""
        return bool(self.logical_shapes)

    def _compute_fingerprint(self) -> str:
        digest = hashlib.sha256()
        for key, t in self.tensors.items():
            digest.update(f"{key}|{t.data_ptr()}|{tuple(t.shape)}|{t.dtype}|{t.device}|{t._version}\n".encode())
            if key in self.logical_shapes:
                digest.update(f"{id(t)}|{type(t).__qualname__}|{_inner_tensors(t)}\n".encode())
        return digest.hexdigest()

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def refresh(self) -> bool:
        old, self._fingerprint = self._fingerprint, self._compute_fingerprint()
        return old != self._fingerprint

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
        digests: DigestSink | None = None,
    ) -> Iterator[LayerWeights]:
        """Yield the tensors (or their ``columns``); ``digests`` hashes host tensors, never device ones."""
        device = torch.device(device)
        if columns is not None and self.opaque:
            raise ConfigError(
                f"shard='columns' (CLI {flag('shard')}) slices each projection's weight, which quantized or "
                "layerwise-cast weights do not allow; use shard='layers'"
            )
        for layer in layers:
            weight = self.tensors[self.layout.weight(layer)]
            bias = self.tensors[self.layout.bias(layer)] if self.spec.has_bias(layer) else None
            rows = None
            if columns is not None:
                rows = start, stop = columns.bounds(self.spec.out_features(layer))
                weight = weight[start:stop]
                bias = bias[start:stop] if bias is not None else None
            if digests is not None:
                for part, tensor in (("weight", weight), ("bias", bias)):
                    if tensor is not None and tensor.device.type == "cpu" and tensor.is_contiguous():
                        full = self.tensors[self.layout.tensor(layer, part)]
                        dtype = safetensors_name(full.dtype) or str(full.dtype)  # as a file names it: hashes alike
                        digests.feed(role_of(layer, part), dtype, tuple(full.shape), rows, tensor)
            self.bytes_read += sum(t.numel() * t.element_size() for t in (weight, bias) if t is not None)
            if weight.device != device:
                weight = weight.to(device)
                bias = bias.to(device) if bias is not None else None
            yield LayerWeights(layer, weight, bias)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "tensors (opaque: read by their modules only)" if self.opaque else "tensors",
            "layout": self.layout.name,
            "projection_tensors": len(self.tensors),
            "projection_bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
            "fingerprint": self.fingerprint,
            "spec": self.spec.describe(),
        }

    def __repr__(self) -> str:
        return f"TensorSource({len(self.tensors)} tensors, layout={self.layout.name!r})"


def _inner_tensors(t: torch.Tensor) -> list[tuple[str, int, int]]:
    """Address and in-place version of each tensor inside a tensor subclass (``__tensor_flatten__``)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return []
    names, _ = flatten()
    inner = [(name, getattr(t, name, None)) for name in names]
    return [(name, x.data_ptr(), x._version) for name, x in inner if isinstance(x, torch.Tensor)]


class NoWeights:
    """No projection weights: every plan must come from a table file (see the module docstring)."""

    #: Nothing to read, nothing to hash, nothing a store could be bound to.
    serves_weights = False
    persistent = False
    upstream: str | Callable[[], str | None] | None = None

    def __init__(self, spec: ModulationSpec) -> None:
        self.spec = spec
        self.layout = spec.default_layout
        self.bytes_read = 0

    @property
    def fingerprint(self) -> str:
        return "no-weights"

    def refresh(self) -> bool:
        return False

    def stream(self, layers: Sequence[Layer], **_: Any) -> Iterator[LayerWeights]:
        raise PlanNotCachedError(
            "this cache has no projection weights (source=None): it serves table files only; pass a checkpoint "
            "to build plans they lack"
        )

    def describe(self) -> dict[str, Any]:
        return {"kind": "none", "spec": self.spec.describe(), "fingerprint": self.fingerprint}

    def __repr__(self) -> str:
        return "NoWeights()"
