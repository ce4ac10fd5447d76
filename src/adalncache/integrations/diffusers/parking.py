"""Weight parking: the served projections' (and the time embedder's) weights leave the device.

While the cache serves them, each parked parameter is replaced by a meta placeholder of the same
shape, dtype and ``requires_grad``, so module names, ``repr``, parameter counts and the LoRA
loaders keep working while the bytes are gone. The real tensor is kept on the host (on CPU the
model's own tensor object; elsewhere a host copy) or, when a verified checkpoint holds it, not kept
at all and read back on restore.

Restoring is bit-exact, alignment included: on CPU an fp32 GEMV with a single row (M=1) gives
different bits for the same weight at a different address modulo 16 bytes, so a weight that comes
back from a copy or a file is placed at the address the original had, modulo 64.

``state_dict()`` on a parked module carries the real weights (``save_pretrained`` must never write
a model without its projections); ``load_state_dict()`` into a parked weight is refused.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...source import ALIGNMENT, aligned_empty
from ...spec import FINAL, Layer
from .modules import swapped_parameters
from .quantized import is_plain_tensor
from .sources import HostTensors, Source, read_layer, read_layers

#: Alignment window the restored weights keep: 64 bytes covers the 16 that change GEMV bits on CPU.
RESIDUE_BYTES = ALIGNMENT


@dataclass
class ParkedParam:
    """One parameter moved off the model: where it lived and how to bring it back bit-exactly."""

    module: nn.Module
    name: str
    placeholder: nn.Parameter
    original: torch.Tensor | None  # the model's own tensor (CPU) or a host copy; None: re-read from the source
    device: torch.device
    residue: int  # data_ptr % 64 of the original: fp32 GEMV bits depend on it on CPU
    requires_grad: bool
    layer: Layer | None  # projection layer, or None for the time embedder


def _pass_order(layer: Layer) -> float:
    """Sort key giving the order a pass reads layers in (blocks by index, then the output layer)."""
    return math.inf if layer == FINAL else float(layer)


def _as_function(method: Callable[..., Any]) -> Callable[..., Any]:
    """torch tags hook callables with attributes, which bound methods do not take: wrap them."""

    def function(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return function


class WeightParking:
    """The parameters parked off one model, and everything needed to bring them back.

    ``park`` replaces them with meta placeholders and installs the state_dict hooks; ``restore``
    puts the originals back bit-exactly and removes the hooks. In between, ``time_embedder_loan``
    lends the time embedder's real weights to a build, ``standing_in`` lends zero-stride stand-ins
    on the model's device to a LoRA load, and ``at_model_residue`` aligns a weight from the source
    like the model's own.
    """

    def __init__(self) -> None:
        self.parked: list[ParkedParam] = []
        self.time_embedder_parked = False
        self._source: Source | None = None
        self._residues: dict[tuple[Layer, str], int] = {}
        self._hook_handles: list[Any] = []
        self._keys_only = False

    # ------------------------------------------------------------------ park and restore

    def park(
        self,
        targets: Sequence[tuple[nn.Module, Layer | None]],
        *,
        source: Source,
        host_tensors: HostTensors | None,
    ) -> None:
        """Replace the weight and bias of every ``(linear, layer)`` target by meta placeholders.

        ``layer`` is None for the time embedder's linears. ``host_tensors`` (the source's host copies
        of the model's own projections) are kept to restore from; without them the projections are
        read back from ``source``, whose contents enabling verified equal to the model's.
        """
        self._source = source
        for base, layer in targets:
            for name in ("weight", "bias"):
                param = base._parameters.get(name)
                if param is None:
                    continue
                original: torch.Tensor | None
                if layer is not None and host_tensors is None:
                    original = None
                elif param.device.type == "cpu":
                    original = param  # the very object: same storage, same alignment
                elif layer is not None:
                    assert host_tensors is not None
                    original = host_tensors[(layer, name)]
                elif is_plain_tensor(param):
                    original = param.detach().to("cpu", copy=True)
                else:
                    original = param.to("cpu")  # a quantized tensor: the object as it is (torchao refuses copy=)
                residue = param.data_ptr() % RESIDUE_BYTES
                if layer is not None:
                    self._residues[(layer, name)] = residue
                # Built from shape and dtype: empty_like of a quantized tensor subclass is not implemented.
                meta = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
                placeholder = nn.Parameter(meta, requires_grad=param.requires_grad)
                self.parked.append(
                    ParkedParam(
                        module=base,
                        name=name,
                        placeholder=placeholder,
                        original=original,
                        device=param.device,
                        residue=residue,
                        requires_grad=param.requires_grad,
                        layer=layer,
                    )
                )
                if layer is None:
                    self.time_embedder_parked = True
                base._parameters[name] = placeholder
            self._hook_handles.append(base.register_state_dict_post_hook(_as_function(self._state_dict_hook)))
            self._hook_handles.append(base.register_load_state_dict_pre_hook(_as_function(self._load_state_dict_hook)))

    def restore(self) -> None:
        """Remove the state_dict hooks and put every parked parameter back, bit-exactly."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        # Source-backed weights are read back in one streaming pass (verified equal at enable).
        reread: dict[tuple[Layer, str], torch.Tensor] = {}
        layers = sorted({p.layer for p in self.parked if p.original is None and p.layer is not None}, key=_pass_order)
        if layers:
            assert self._source is not None
            for layer, weight, bias in read_layers(self._source, layers):
                reread[(layer, "weight")], reread[(layer, "bias")] = weight, bias
        for parked in reversed(self.parked):
            if parked.original is not None and parked.original.device == parked.device:
                tensor = parked.original
            else:
                source_tensor = parked.original
                if source_tensor is None:
                    assert parked.layer is not None  # only projections are source-backed
                    source_tensor = reread[(parked.layer, parked.name)]
                if is_plain_tensor(source_tensor):
                    shape, dtype = source_tensor.shape, source_tensor.dtype
                    tensor = aligned_empty(shape, dtype, parked.residue, device=parked.device)
                    tensor.copy_(source_tensor)
                else:
                    tensor = source_tensor.to(parked.device)  # a quantized tensor has no address to reproduce
            param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, parked.requires_grad)
            parked.module._parameters[parked.name] = param
        self.parked.clear()
        self._residues.clear()
        self.time_embedder_parked = False

    @property
    def restores_from_source(self) -> bool:
        """Whether ``restore`` reads weights back from the source (and so needs it unchanged)."""
        return any(parked.original is None for parked in self.parked)

    # ------------------------------------------------------------------ lending

    def at_model_residue(self, layer: Layer, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or an aligned copy of it when the model held it elsewhere modulo 64 bytes.

        A checkpoint maps its tensors at the file's offsets, which need not be where the resident
        model kept them (say a model built in memory and served from its ``save_pretrained`` file),
        so an fp32 or fp16 weight on CPU is copied to the model's residue. bf16 showed no such effect
        at any M and is used as it is (no copy of the whole projection stack per pass).
        """
        if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.float16):
            return tensor
        if not is_plain_tensor(tensor):
            return tensor  # quantized: projected by the module's own kernels, used as the model holds it
        residue = self._residues.get((layer, name))
        if residue is None or tensor.data_ptr() % RESIDUE_BYTES == residue:
            return tensor
        copy = aligned_empty(tensor.shape, tensor.dtype, residue, device=tensor.device)
        copy.copy_(tensor)
        return copy

    def time_embedder_loan(self, device: torch.device) -> TimeEmbedderLoan:
        """A context in which ``take()`` puts the time embedder's real weights back until exit."""
        return TimeEmbedderLoan(self, device)

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """Zero-stride stand-ins on each parked parameter's device, and a state_dict of keys only.

        A LoRA loader moves a new adapter to its base layer's device and only reads the
        state_dict's keys: with meta bases the adapter would land on meta, weights lost, and
        materialising the real weights for it would cost a read of every projection.
        """
        swaps: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for parked in self.parked:
            stand_in = torch.zeros((), dtype=parked.placeholder.dtype, device=parked.device).expand(
                parked.placeholder.shape
            )
            swaps.setdefault(parked.module, {})[parked.name] = stand_in
        self._keys_only = True
        try:
            with contextlib.ExitStack() as stack:
                for module, tensors in swaps.items():
                    stack.enter_context(swapped_parameters(module, tensors))
                yield
        finally:
            self._keys_only = False

    # ------------------------------------------------------------------ state_dict hooks

    def _entry(self, module: nn.Module, name: str) -> ParkedParam | None:
        for parked in self.parked:
            if parked.module is module and parked.name == name:
                return parked
        return None

    def _real_tensor(self, parked: ParkedParam) -> torch.Tensor:
        if parked.original is not None:
            return parked.original.detach()
        assert parked.layer is not None and self._source is not None  # only projections are source-backed
        weight, bias = read_layer(self._source, parked.layer)
        return weight if parked.name == "weight" else bias

    def _state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Put the real weights into ``state_dict`` so save_pretrained never writes a model without them."""
        if self._keys_only:
            return  # a LoRA loader only reads the keys
        for name in ("weight", "bias"):
            key = prefix + name
            parked = self._entry(module, name)
            if parked is not None and key in state_dict:
                state_dict[key] = self._real_tensor(parked)

    def _load_state_dict_hook(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for name in ("weight", "bias"):
            if prefix + name in state_dict and self._entry(module, name) is not None:
                raise ConfigError(
                    f"load_state_dict() would overwrite {prefix}{name}, which the AdaLN cache serves from "
                    "tables; call handle.disable() first, load, then enable again"
                )


class TimeEmbedderLoan:
    """The parked time embedder's real weights, lent to one build on first use and parked again after.

    The build's ``embed`` runs the time embedder's own forward; taking the weights lazily means a
    build that hits every plan costs no copy.
    """

    def __init__(self, parking: WeightParking, device: torch.device) -> None:
        self._parking = parking
        self._device = device
        self._stack = contextlib.ExitStack()
        self._taken = False

    def take(self) -> None:
        """Put the real weights back (once per loan); a no-op when the time embedder is not parked."""
        if self._taken or not self._parking.time_embedder_parked:
            return
        swaps: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for parked in self._parking.parked:
            if parked.layer is None and parked.original is not None:
                tensor = parked.original
                if tensor.device != self._device:
                    tensor = tensor.to(self._device, non_blocking=True)
                swaps.setdefault(parked.module, {})[parked.name] = tensor
        for module, tensors in swaps.items():
            self._stack.enter_context(swapped_parameters(module, tensors))
        self._taken = True

    def __enter__(self) -> TimeEmbedderLoan:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stack.close()
