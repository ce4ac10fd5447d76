"""Where an enabled model's projection weights come from: its own tensors (a :class:`~adalncache.TensorSource`,
on the host), or a checkpoint verified bit for bit against them when enabling (a fine-tune or a fused LoRA
served from the base file would be wrong silently), whose content digest is kept for ``disable()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import AdalnCache, CheckpointSource, TensorSource
from ...devices import HostBuffer, host_tensor_like
from ...errors import CheckpointError, ConfigError
from ...identity import DigestSink
from ...identity.binding import CheckedRead
from ...options import flag
from ...source import Columns, LayerWeights, WeightSource
from ...source.memory import NoWeights
from ...spec import KeyLayout, Layer, ModulationSpec
from ...tiers.tables import TablesArg, TablesTier
from .family import base_linear, diffusers_layout


class CastCheckpointSource:
    """A :class:`~adalncache.CheckpointSource` whose projections are served cast to the model's dtype.
    ``tensor.to(dtype)`` on read is the very cast ``from_pretrained(torch_dtype=...)`` performs (a fresh,
    64-byte-aligned allocation, as the stock load's); everything else is the wrapped source's."""

    #: Declared, not set: unless the integration sets it, it is the wrapped source's (through ``__getattr__``).
    upstream: str | Callable[[], str | None] | None

    def __init__(self, source: CheckpointSource, dtype: torch.dtype) -> None:
        self.source = source
        self.spec = source.spec.with_dtype(dtype)
        self.layout: KeyLayout = source.layout
        self.persistent = True

    @property
    def bytes_read(self) -> int:  # the wrapped source's counter (a setter too, which __getattr__ cannot give)
        return self.source.bytes_read

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        self.source.bytes_read = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["source"], name)

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
        digests: DigestSink | None = None,
    ) -> Iterator[LayerWeights]:
        # The digest is of the file's bytes, as read: the cast is a function of them, and the
        # binding names the served dtype besides.
        dtype = self.spec.dtype
        stream = self.source.stream(layers, device=device, columns=columns, read_ahead=read_ahead, digests=digests)
        for weights in stream:
            bias = weights.bias.to(dtype) if weights.bias is not None else None
            yield LayerWeights(weights.layer, weights.weight.to(dtype), bias)

    def describe(self) -> dict[str, Any]:
        return {**self.source.describe(), "served_as": str(self.spec.dtype), "spec": self.spec.describe()}

    def __repr__(self) -> str:
        return f"CastCheckpointSource({self.source!r}, dtype={self.spec.dtype})"


#: Every kind of weight source the integration uses: a checkpoint (cast on read for a model loaded
#: in another dtype), the model's own tensors, ``NoWeights`` (table files only), or another
#: ``WeightSource`` (the model's own quantized tensors, which only their modules can read).
Source = CheckpointSource | TensorSource | CastCheckpointSource | NoWeights | WeightSource


@dataclass(frozen=True)
class NeverLoaded:
    """What ``load_transformer`` hands the handle of a model whose served weights were never loaded. ``cache`` was built
    before the weights were loaded (its options checked first); ``residues``: each never-loaded parameter's path -> the
    address residue modulo 64 a stock load would have given it."""

    source: Source
    cache: AdalnCache
    residues: Mapping[str, int]
    device: torch.device
    quantization: Quantization | None = None


class Quantization:
    """The diffusers quantizer ``load_transformer`` loads through, applied by the passes to each projection
    weight they read (``create_quantized_param``, as ``from_pretrained`` does, on a fresh ``nn.Linear`` at
    the projection's path so per-module rules apply): the rows are the quantized model's."""

    def __init__(self, quantizer: Any, model: Any) -> None:
        self.quantizer = quantizer
        self.model = model
        config = quantizer.quantization_config.to_dict()
        #: What the tables are built under besides the weights (part of their binding in every tier).
        self.variant = ("quantization", tuple(sorted((str(k), repr(v)) for k, v in config.items())))

    def weight(self, path: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (of the projection at ``path``) as the quantizer would have loaded it."""
        name = f"{path}.weight"
        if not self.quantizer.check_if_quantized_param(self.model, weight, name, {}):
            return weight
        root = holder = torch.nn.Module()
        *parents, last = path.split(".")
        for part in parents:
            child = torch.nn.Module()
            holder.add_module(part, child)
            holder = child
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
        holder.add_module(last, linear)
        self.quantizer.create_quantized_param(root, weight, name, weight.device, {}, [])
        return linear.weight

    def restore(self, paths: Sequence[str]) -> None:
        """Quantize the restored projection weights in the model, as ``from_pretrained`` would have."""
        for path in paths:
            module = self.model.get_submodule(path)
            name = f"{path}.weight"
            if self.quantizer.check_if_quantized_param(self.model, module.weight, name, {}):
                self.quantizer.create_quantized_param(
                    self.model, module.weight.data, name, module.weight.device, {}, []
                )


#: A host copy of one parked projection tensor, by ``(layer, "weight" | "bias")``.
HostTensors = dict[tuple[Layer, str], torch.Tensor]


class CheckpointMismatchError(ConfigError, CheckpointError):
    """The checkpoint given to enable_adaln_cache cannot serve this model (a ConfigError and a
    CheckpointError: the setting is wrong because the file does not fit)."""


def model_source(
    spec: ModulationSpec, modules: Sequence[tuple[Layer, Any]], device: torch.device
) -> tuple[TensorSource, HostTensors, list[HostBuffer]]:
    """The model's own projection tensors as a source, the host tensors it holds, and their host buffers. On CPU the
    very tensor objects (no buffer). Elsewhere host copies, each in a buffer of exactly its size, page-locked on CUDA
    (torch's pinned allocator would round each 496 MiB layer up to 512 MiB and never give it back); release the buffers
    to unlock them."""
    tensors: dict[str, torch.Tensor] = {}
    host: HostTensors = {}
    buffers: list[HostBuffer] = []
    pin = device.type == "cuda"
    layout = diffusers_layout(spec)
    for layer, module in modules:
        base = base_linear(module)
        for name in spec.tensors_of(layer):
            tensor = getattr(base, name).detach()
            if tensor.device.type != "cpu":
                tensor, buffer = host_tensor_like(tensor, pin=pin)
                buffers.append(buffer)
            tensors[f"{layout.prefix(layer)}.{name}"] = tensor
            host[(layer, name)] = tensor
    return TensorSource(tensors, spec, layout=layout.name), host, buffers


def check_tables_against_model(
    spec: ModulationSpec,
    modules: Sequence[tuple[Layer, Any]],
    tables: TablesArg,
    *,
    device: torch.device,
    precision: str,
    upstream: str | None = None,
) -> None:
    """Refuse table files that do not hold this model's projections (their content digests against the model's
    own tensors; ``upstream``: the model's upstream digest), before its weights are freed. An sglang file
    carries nothing to compare; its geometry is checked when the cache opens it."""
    if not any(table.checkable for table in TablesTier(tables, spec).files):
        return
    own, _, buffers = model_source(spec, modules, device)
    own.upstream = upstream
    try:
        cache = AdalnCache(spec, own, max_plans=1, max_plan_width=1, device=device, precision=precision, tables=tables)
        cache.close()
    finally:
        for buffer in buffers:
            buffer.release()


def checkpoint_source(
    checkpoint: Any, spec: ModulationSpec, modules: Sequence[tuple[Layer, Any]], *, layout: str, verify: bool
) -> tuple[CheckpointSource, str | None]:
    """A :class:`~adalncache.CheckpointSource` for ``checkpoint``, refused unless it fits the model, and
    the content digest of its projections when ``verify`` read them (else None)."""
    many = isinstance(checkpoint, Sequence) and not isinstance(checkpoint, (str, bytes))
    paths: Any = [os.fspath(path) for path in checkpoint] if many else os.fspath(checkpoint)
    try:
        source = CheckpointSource(paths, spec, layout=layout)
    except CheckpointError as exc:
        # Missing, misshapen or other-dtype projections: this checkpoint cannot serve this model.
        raise CheckpointMismatchError(
            f"checkpoint= (CLI {flag('checkpoint')}) does not match the model ({spec.dtype} projections of "
            f"{spec.num_layers} blocks): {exc}"
        ) from exc
    return source, verify_against_model(source, spec, modules) if verify else None


def verify_against_model(source: Source, spec: ModulationSpec, modules: Sequence[tuple[Layer, Any]]) -> str | None:
    """Stream the checkpoint one layer at a time and refuse it unless it equals the model, bit for bit;
    returns the content digest of the bytes read (None where the source cannot hash them)."""
    by_layer, layout = dict(modules), diffusers_layout(spec)
    check = CheckedRead(source)
    for weights in check.layers():
        base = base_linear(by_layer[weights.layer])
        layer = weights.layer
        for name, theirs in (("weight", weights.weight), ("bias", weights.bias)):
            if theirs is None:  # a layer without a bias: the source reads none, the model has none
                continue
            ours = getattr(base, name).detach()
            same = theirs.dtype == ours.dtype and theirs.shape == ours.shape
            same = same and torch.equal(theirs.to(ours.device), ours)
            if not same:
                raise ConfigError(
                    f"checkpoint= (CLI {flag('checkpoint')}) does not match the model: "
                    f"{layout.prefix(layer)}.{name} differs (checkpoint {theirs.dtype} {tuple(theirs.shape)}, "
                    f"model {ours.dtype} {tuple(ours.shape)}). A fine-tuned model or one with a fused LoRA must not be "
                    "served from the base file; pass checkpoint=None to serve the model's own weights, "
                    "or the checkpoint it was loaded from"
                )
    return check.digest


def changed_since(source: Source, fingerprint: str | None) -> bool:
    """Whether ``source`` no longer holds what it held when its fingerprint was ``fingerprint``."""
    before = source.fingerprint
    try:
        source.refresh()
    except CheckpointError:
        return True
    return source.fingerprint != before or before != fingerprint


def source_key(source: Source, path: str, layer: Layer | None, name: str) -> str:
    """The source's name of parameter ``name`` of the served module at ``path`` (diffusers layout): a
    projection's by its layer, a time-embedder linear's by its position in the layouts."""
    layout = source.layout
    if layer is not None:
        return layout.weight(layer) if name == "weight" else layout.bias(layer)
    ours = diffusers_layout(source.spec).time_embedder
    if path not in ours:
        raise ConfigError(f"internal: {path} is neither an AdaLN projection nor a time-embedder linear")
    return f"{layout.time_embedder[ours.index(path)]}.{name}"
