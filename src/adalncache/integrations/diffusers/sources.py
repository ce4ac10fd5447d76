"""Where an enabled model's projection weights come from: its own tensors, or a verified checkpoint.

Without a checkpoint the model's own projection tensors (moved to host memory when the model runs
elsewhere) become a :class:`~adalncache.TensorSource`. With one, the checkpoint must hold exactly
the model's projections: a fine-tune or a fused LoRA served from the base file would give wrong
outputs silently, so enabling streams it once, layer by layer, and compares bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ... import CheckpointSource, TensorSource
from ...errors import CheckpointError, ConfigError
from ...source import WeightSource
from ...spec import Layer, ModulationSpec
from .modules import DIFFUSERS_LAYOUT, base_linear, projection_path

#: A weight source the integration builds: a checkpoint, the model's own tensors, or another
#: ``WeightSource`` (the model's own quantized tensors, which only their modules can read).
Source = CheckpointSource | TensorSource | WeightSource

#: A host copy of one parked projection tensor, by ``(layer, "weight" | "bias")``.
HostTensors = dict[tuple[Layer, str], torch.Tensor]


class CheckpointMismatchError(ConfigError, CheckpointError):
    """The checkpoint given to enable_adaln_cache cannot serve this model (a ConfigError and a
    CheckpointError: the setting is wrong because the file does not fit)."""


def read_layers(source: Source, layers: Sequence[Layer]) -> Iterator[tuple[Layer, torch.Tensor, torch.Tensor]]:
    """Stream ``layers`` from a weight source into host memory, one at a time (with read-ahead)."""
    for weights in source.stream(list(layers), device=torch.device("cpu")):
        yield weights.layer, weights.weight, weights.bias


def read_layer(source: Source, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one projection's weight and bias from a weight source (host tensors)."""
    for _, weight, bias in read_layers(source, [layer]):
        return weight, bias
    raise ConfigError(f"{type(source).__name__} yielded nothing for layer {layer!r}")


def model_source(
    spec: ModulationSpec, modules: Sequence[tuple[Layer, Any]], device: torch.device
) -> tuple[TensorSource, HostTensors]:
    """The model's own projection tensors as a source, and the host tensors it holds by layer.

    On CPU these are the very tensor objects (same storage, same alignment); elsewhere they are
    host copies, pinned on CUDA so rebuild passes copy them to the device at full speed.
    """
    tensors: dict[str, torch.Tensor] = {}
    host: HostTensors = {}
    pin = device.type == "cuda"
    for layer, module in modules:
        base = base_linear(module)
        for name in ("weight", "bias"):
            tensor = getattr(base, name).detach()
            if tensor.device.type != "cpu":
                tensor = tensor.to("cpu", copy=True)
                if pin:
                    tensor = tensor.pin_memory()
            tensors[f"{DIFFUSERS_LAYOUT.prefix(layer)}.{name}"] = tensor
            host[(layer, name)] = tensor
    return TensorSource(tensors, spec, layout=DIFFUSERS_LAYOUT.name), host


def checkpoint_source(
    checkpoint: Any,
    spec: ModulationSpec,
    modules: Sequence[tuple[Layer, Any]],
    *,
    layout: str,
    verify: bool,
) -> CheckpointSource:
    """A :class:`~adalncache.CheckpointSource` for ``checkpoint``, refused unless it fits the model."""
    paths: Any = checkpoint
    if isinstance(checkpoint, Sequence) and not isinstance(checkpoint, (str, bytes)):
        paths = [os.fspath(path) for path in checkpoint]
    else:
        paths = os.fspath(checkpoint)
    try:
        source = CheckpointSource(paths, spec, layout=layout)
    except CheckpointError as exc:
        # Missing, misshapen or other-dtype projections: this checkpoint cannot serve this model.
        raise CheckpointMismatchError(
            f"checkpoint= (CLI --checkpoint) does not match the model ({spec.dtype} projections of "
            f"{spec.num_layers} blocks): {exc}"
        ) from exc
    if verify:
        verify_against_model(source, spec, modules)
    return source


def verify_against_model(source: Source, spec: ModulationSpec, modules: Sequence[tuple[Layer, Any]]) -> None:
    """Stream the checkpoint one layer at a time and refuse it unless it equals the model, bit for bit."""
    by_layer = dict(modules)
    for layer, weight, bias in read_layers(source, spec.layers()):
        base = base_linear(by_layer[layer])
        for name, theirs in (("weight", weight), ("bias", bias)):
            ours = getattr(base, name).detach()
            same = theirs.dtype == ours.dtype and theirs.shape == ours.shape
            same = same and torch.equal(theirs.to(ours.device), ours)
            if not same:
                raise ConfigError(
                    f"checkpoint= (CLI --checkpoint) does not match the model: {projection_path(layer)}.{name} "
                    f"differs (checkpoint {theirs.dtype} {tuple(theirs.shape)}, model {ours.dtype} "
                    f"{tuple(ours.shape)}). A fine-tuned model or one with a fused LoRA must not be "
                    "served from the base file; pass checkpoint=None to serve the model's own weights, "
                    "or the checkpoint it was loaded from"
                )


def changed_since(source: Source, fingerprint: str | None) -> bool:
    """Whether ``source`` no longer holds what it held when its fingerprint was ``fingerprint``."""
    before = source.fingerprint
    try:
        source.refresh()
    except CheckpointError:
        return True
    return source.fingerprint != before or before != fingerprint
