"""Weight parking: the served projections' (and the time embedder's) weights leave the device.

Each becomes a meta placeholder kept as a plain attribute, plus a 0-element dtype buffer (why: docs/diffusers.md);
the real tensor stays on the host (on CPU the very object) or is re-read from the checkpoint, checked
against its content digest. Restoring is bit-exact, the address modulo 64 included (docs/exactness.md).
``state_dict()`` carries the real weights; ``load_state_dict()`` into them is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...identity.binding import CheckedRead
from ...source.reads import ALIGNMENT, MappedFile, aligned_empty
from ...spec import Layer
from .family import swapped_parameters
from .quantized import hand_state_to_weight, is_plain_tensor, state_kept_by_weight
from .sources import HostTensors, Source, source_key

#: Alignment window the restored weights keep: 64 bytes covers the 16 that change GEMV bits on CPU.
RESIDUE_BYTES = ALIGNMENT

#: The 0-element buffer that gives a parked module a dtype (diffusers' get_parameter_dtype raises on
#: a module without any parameter or buffer).
DTYPE_MARKER = "_adalncache_dtype"


@dataclass(frozen=True)
class ParkTarget:
    """A base ``nn.Linear`` to park, its projection layer (``None``: a time-embedder linear) and its path."""

    module: nn.Module
    layer: Layer | None
    path: str


@dataclass
class ParkedParam:
    """One parameter moved off the model: where it lived and how to bring it back bit-exactly."""

    module: nn.Module
    name: str
    placeholder: nn.Parameter
    original: torch.Tensor | None  # the model's own tensor (CPU) or a host copy; None: re-read from the source
    device: torch.device  # where the model keeps its weights: where restore puts this one back
    residue: int  # data_ptr % 64 of the original: fp32 GEMV bits depend on it on CPU
    requires_grad: bool
    layer: Layer | None  # projection layer, or None for the time embedder
    key: str | None  # the source's name of the tensor, when it is read back from the source


def _as_function(method: Callable[..., Any]) -> Callable[..., Any]:
    """torch tags hook callables with attributes, which bound methods do not take: wrap them."""

    def function(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return function


class WeightParking:
    """The parameters parked off one model, and everything needed to bring them back: ``park``, then
    ``read_back`` (nothing changes yet) and ``put_back``."""

    def __init__(self) -> None:
        self.parked: list[ParkedParam] = []
        self.time_embedder_parked = False
        self._source: Source | None = None
        self._residues: dict[tuple[Layer, str], int] = {}
        self._hook_handles: list[Any] = []
        self._keys_only = False
        #: Each parked module's parameter order, so restoring gives state_dict() its original key order.
        self._orders: list[tuple[nn.Module, list[str]]] = []
        self._maps: dict[tuple[Any, ...], MappedFile] = {}
        #: Puts back what a quantization library kept on each parked module (:func:`hand_state_to_weight`).
        self._library_undos: list[Callable[[], None]] = []

    def park(
        self,
        targets: Sequence[ParkTarget],
        *,
        source: Source,
        host_tensors: HostTensors | None,
        never_loaded: Mapping[str, int] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Replace the weight and bias of every target by meta placeholders. ``host_tensors``: host copies of the
        model's own projections to restore from (without them, ``source``, verified equal when enabling).
        ``never_loaded``: for a model whose served tensors are meta already, each one's path -> the residue a stock load
        would have given it; ``device``: where the model keeps its weights."""
        self._source = source
        for target in targets:
            base, layer = target.module, target.layer
            self._orders.append((base, list(base._parameters)))
            self._library_undos.append(hand_state_to_weight(base, base._parameters.get("weight")))
            for name in ("weight", "bias"):
                param = base._parameters.get(name)
                if param is None:
                    continue
                original: torch.Tensor | None
                where = param.device
                if param.device.type == "meta":
                    if never_loaded is None or device is None:
                        raise ConfigError(
                            f"{target.path}.{name} holds no data (meta): load the model fully before enabling the "
                            "AdaLN cache, or load it with adalncache.diffusers.load_transformer"
                        )
                    original, where = None, device
                    residue = never_loaded.get(f"{target.path}.{name}", 0)
                elif layer is not None and host_tensors is None:
                    original, residue = None, param.data_ptr() % RESIDUE_BYTES
                elif param.device.type == "cpu":
                    original, residue = param, param.data_ptr() % RESIDUE_BYTES  # the very object
                elif layer is not None:
                    assert host_tensors is not None
                    original, residue = host_tensors[(layer, name)], 0
                elif is_plain_tensor(param):
                    original, residue = param.detach().to("cpu", copy=True), 0
                else:
                    # A quantized tensor: the object as it is (torchao refuses copy=); it has no
                    # address to reproduce.
                    original, residue = param.to("cpu"), 0
                key = source_key(source, target.path, layer, name) if original is None else None
                if layer is not None:
                    self._residues[(layer, name)] = residue
                # Built from shape and dtype: empty_like of a quantized tensor subclass is not implemented.
                meta = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
                placeholder = nn.Parameter(meta, requires_grad=param.requires_grad)
                self.parked.append(
                    ParkedParam(base, name, placeholder, original, where, residue, param.requires_grad, layer, key)
                )
                if layer is None:
                    self.time_embedder_parked = True
                del base._parameters[name]
                base.__dict__[name] = placeholder  # an attribute, not a parameter (module docstring)
                marker = base._buffers.get(DTYPE_MARKER)
                if marker is None or (not marker.is_floating_point() and placeholder.is_floating_point()):
                    # The first floating-point placeholder's dtype, as get_parameter_dtype picks it
                    # from the stock parameters (the bias when the weight is quantized).
                    marker = torch.empty(0, dtype=placeholder.dtype, device=where)
                    base.register_buffer(DTYPE_MARKER, marker, persistent=False)
            self._hook_handles.append(base.register_state_dict_post_hook(_as_function(self._state_dict_hook)))
            self._hook_handles.append(base.register_load_state_dict_pre_hook(_as_function(self._load_state_dict_hook)))

    def read_back(self, held: str | None = None) -> list[tuple[ParkedParam, nn.Parameter]]:
        """Every parked parameter's real tensor, on its device at its residue, without touching the model. Source-backed
        projections are read in one pass checked against ``held`` (the content digest; ``None``: not checked): a
        mismatch raises ``CheckpointError`` before anything is put back. Freed ones (table files only) keep their meta
        placeholders."""
        freed = self.freed
        reread: dict[tuple[Layer, str], torch.Tensor] = {}
        # In the order they were parked: the spec's pass order (layers may be module paths).
        layers = list(dict.fromkeys(p.layer for p in self.parked if p.original is None and p.layer is not None))
        if layers and not freed:
            assert self._source is not None
            every = set(layers) == set(self._source.spec.layers())
            for weights in CheckedRead(self._source, held if every else None).layers(layers):
                reread[(weights.layer, "weight")] = weights.weight
                if weights.bias is not None:  # a layer without a bias parked none
                    reread[(weights.layer, "bias")] = weights.bias
        restored: list[tuple[ParkedParam, nn.Parameter]] = []
        for parked in self.parked:
            if parked.original is None and freed:
                continue
            if parked.original is not None and parked.original.device == parked.device:
                tensor = parked.original
            else:
                if parked.original is not None:
                    source_tensor = parked.original
                elif parked.layer is not None:
                    source_tensor = reread[(parked.layer, parked.name)]
                else:
                    source_tensor = self._read_by_key(parked)
                if is_plain_tensor(source_tensor):
                    dtype = parked.placeholder.dtype
                    tensor = aligned_empty(source_tensor.shape, dtype, parked.residue, device=parked.device)
                    tensor.copy_(source_tensor)
                else:
                    tensor = source_tensor.to(parked.device)  # a quantized tensor has no address to reproduce
            param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, parked.requires_grad)
            restored.append((parked, param))
        return restored

    def put_back(self, restored: list[tuple[ParkedParam, nn.Parameter]]) -> None:
        """Remove the state_dict hooks and put what :meth:`read_back` returned in place, bit-exactly."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for parked, param in restored:
            parked.module.__dict__.pop(parked.name, None)
            parked.module._parameters[parked.name] = param
        for undo in reversed(self._library_undos):
            undo()
        for module, order in self._orders:
            module._buffers.pop(DTYPE_MARKER, None)
            params = dict(module._parameters)
            module._parameters.clear()
            module._parameters.update({k: params[k] for k in order if k in params})
            module._parameters.update({k: v for k, v in params.items() if k not in order})
        self.parked.clear()
        self._orders.clear()
        self._library_undos.clear()
        self._residues.clear()
        self._maps.clear()
        self.time_embedder_parked = False

    def placeholders(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The placeholders parked on ``module``, by name (these records stay while a loan moves them aside)."""
        return {p.name: p.placeholder for p in self.parked if p.module is module}

    @property
    def freed(self) -> bool:
        """Whether projections were parked with no way back: no host copy and a source without weights."""
        serves = getattr(self._source, "serves_weights", True)
        return not serves and any(parked.original is None for parked in self.parked)

    @property
    def restores_from_source(self) -> bool:
        """Whether ``restore`` reads weights back from the source (and so needs it unchanged)."""
        return any(parked.original is None for parked in self.parked)

    def moved_to(self, device: torch.device) -> None:
        """The model now keeps its weights on ``device``: restore puts the parked ones there too."""
        for parked in self.parked:
            parked.device = device

    def at_model_residue(self, layer: Layer, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor``, or an aligned copy of it when the model holds it elsewhere modulo 64 bytes on ``device``. A
        checkpoint's tensors sit at the file's offsets, not necessarily the resident model's, so an fp32 or fp16 CPU
        weight is copied to the model's residue (bf16 showed no such effect and is used as it is). ``device`` is where
        the forward runs: on an indexed CPU device (``"cpu:0"``) the model was moved there with ``.to()``, which copies
        to fresh 64-byte-aligned allocations."""
        if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.float16):
            return tensor
        if not is_plain_tensor(tensor):
            return tensor  # quantized: projected by the module's own kernels, used as the model holds it
        residue = self._residues.get((layer, name))
        if residue is not None and device.type == "cpu" and device != tensor.device:
            residue = 0
        if residue is None or tensor.data_ptr() % RESIDUE_BYTES == residue:
            return tensor
        copy = aligned_empty(tensor.shape, tensor.dtype, residue, device=tensor.device)
        copy.copy_(tensor)
        return copy

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """Zero-stride stand-ins on each parked parameter's device, and a state_dict of keys only: a LoRA
        loader puts a new adapter on its base layer's device (meta would lose it) and reads only keys."""
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

    def _read_by_key(self, parked: ParkedParam) -> torch.Tensor:
        """A never-loaded time-embedder tensor, read from the source now at the model's dtype and residue."""
        assert parked.key is not None and self._source is not None
        reader: Any = self._source  # a checkpoint source (the only kind that parks by key)
        tensor = reader.read_tensor(parked.key)
        if tensor.dtype != parked.placeholder.dtype:
            tensor = tensor.to(parked.placeholder.dtype)  # a fresh copy, as a stock load's cast is
        if tensor.device.type == "cpu" and tensor.data_ptr() % RESIDUE_BYTES != parked.residue:
            copy = aligned_empty(tensor.shape, tensor.dtype, parked.residue)
            copy.copy_(tensor)
            tensor = copy
        return tensor

    def _lazy_view(self, parked: ParkedParam) -> torch.Tensor:
        """The checkpoint's tensor as a mapped view: nothing is read until someone touches it."""
        assert parked.key is not None and self._source is not None
        reader: Any = self._source  # a checkpoint source (the only kind that parks by key)
        header, _ = reader.entry(parked.key)
        mapped = self._maps.get((header.path, header.identity))
        if mapped is None:
            mapped = self._maps[(header.path, header.identity)] = MappedFile(header)
        view = mapped.tensor(parked.key, prefetch=False)
        return view if view.dtype == parked.placeholder.dtype else view.to(parked.placeholder.dtype)

    def _entry(self, module: nn.Module, name: str) -> ParkedParam | None:
        for parked in self.parked:
            if parked.module is module and parked.name == name:
                return parked
        return None

    def _real_tensor(self, parked: ParkedParam) -> torch.Tensor:
        if parked.original is not None:
            return parked.original.detach()
        if self.freed:
            raise ConfigError(
                f"state_dict() needs {parked.name} of a projection the AdaLN cache freed (enabled with tables= and no "
                "checkpoint=): save from the original checkpoint, or enable with checkpoint= to keep a way back"
            )
        return self._lazy_view(parked)

    def _state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Put the real weights into ``state_dict`` (weight before bias, a stock state dict's order) so
        save_pretrained never writes a model without them."""
        if self._keys_only:
            return  # a LoRA loader only reads the keys
        for name in ("weight", "bias"):
            parked = self._entry(module, name)
            if parked is not None:
                state_dict[prefix + name] = self._real_tensor(parked)

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


class TimeEmbedderLoan(contextlib.ExitStack):
    """The time embedder's real weights, lent to one build on first use (a build that hits every plan
    copies nothing) and taken back after. ``linears``: the time embedder's base linears, whose weights
    are lent as copies when kept on another device than the build's (group offloading)."""

    def __init__(self, parking: WeightParking, device: torch.device, linears: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        self._parking = parking
        self._device = device
        self._linears = list(linears)
        self._taken = False

    def take(self) -> None:
        """Put real weights on the build's device (once per loan)."""
        if self._taken:
            return
        swaps: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for parked in self._parking.parked:
            if parked.layer is None:
                tensor = parked.original if parked.original is not None else self._parking._read_by_key(parked)
                if tensor.device != self._device:
                    tensor = tensor.to(self._device, non_blocking=True)
                swaps.setdefault(parked.module, {})[parked.name] = tensor
        if not self._parking.time_embedder_parked:
            for module in self._linears:
                for name, param in module.named_parameters(recurse=False):
                    if param.device != self._device:
                        swaps.setdefault(module, {})[name] = param.detach().to(self._device)
        for module, tensors in swaps.items():
            self.enter_context(swapped_parameters(module, tensors))
            self.enter_context(state_kept_by_weight(module))
        self._taken = True
