"""Family-neutral helpers for the modules the cache serves: reach, run and patch them without caring whose model it is.

peft wraps a module it targets (the real ``nn.Linear`` becomes ``base_layer``, :func:`base_linear`);
a rebuild pass runs a served module's own forward beneath every hook on it
(:func:`bypassing_hooks`) with the source's tensors standing in for its parameters
(:func:`swapped_parameters`); the handle shadows a few of the model's methods
(:func:`install_overrides`). Where the model's forward runs (:func:`execution_device`) and what
dtype a stock forward casts a projection's input to (:func:`stock_dtype`) are read the same way
for any diffusers model. What is particular to MiniMax-H3 (which modules are served, where they
sit) is in :mod:`.minimax_h3`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from .compat import get_hook, group_offload_enabled, group_onload_device

#: The name diffusers registers its layerwise-casting hook under.
CASTING_HOOK = "layerwise_casting"


def base_linear(module: nn.Module) -> nn.Module:
    """The ``nn.Linear`` under a peft wrapper (or the module itself)."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else module


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first materialised parameter (where its weights are kept)."""
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    raise ConfigError(
        "the model holds no materialised parameter; load it before enabling the AdaLN cache (or load it with "
        "adalncache.diffusers.load_transformer, which enables the cache itself); an accelerate offload applied "
        "before enabling moves every weight to meta: enable first, then offload"
    )


def execution_device(model: nn.Module) -> torch.device | None:
    """Where the model's forward runs, which offloading makes differ from where its weights are kept.

    diffusers' group offloading keeps the weights on its offload device and runs on its onload
    device; an accelerate hook (``cpu_offload``, ``cpu_offload_with_hook``) names its execution
    device. Without either, the forward runs where the weights are. ``None`` when nothing tells
    (every weight on meta and no hook naming a device).
    """
    if group_offload_enabled(model):
        return group_onload_device(model)
    device = _hook_device(model)
    if device is not None:
        return device
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    for module in model.modules():  # accelerate's sequential offload: a hook on each module with weights
        device = _hook_device(module)
        if device is not None:
            return device
    return None


def _hook_device(module: nn.Module) -> torch.device | None:
    """The execution device an accelerate hook on ``module`` names, if any."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is None:
        return None
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def casting_hook(module: nn.Module) -> Any:
    """diffusers' layerwise-casting hook on this projection's (base) linear, or None."""
    return get_hook(base_linear(module), CASTING_HOOK)


def stock_dtype(module: nn.Module) -> torch.dtype:
    """The dtype diffusers' ``get_parameter_dtype`` gives ``module`` in the stock (unparked) model.

    The stock forward casts the projection's input to it: a layerwise-casting hook's compute dtype
    where one sits on it, else its first floating-point parameter's dtype. That is the base
    linear's weight, or its bias when the weight is quantized (peft registers ``base_layer``
    before the adapters), which a parked module keeps as placeholder attributes, so the dtype is
    read there; the adapters' own dtype (peft may keep them in fp32) must not decide it.
    """
    from diffusers.models.modeling_utils import get_parameter_dtype

    hook = casting_hook(module)  # as get_parameter_dtype: a casting hook's compute dtype first
    if hook is not None:
        compute: torch.dtype = hook.compute_dtype
        return compute
    base = base_linear(module)
    for name in ("weight", "bias"):  # nn.Linear's parameter order; quantized weights are not floating
        tensor = getattr(base, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return tensor.dtype
    return get_parameter_dtype(module)


_FORWARD_PARAMETERS: dict[type, list[str]] = {}


def forward_argument(model: nn.Module, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Read a forward argument by name whether it was passed by keyword or by position."""
    if name in kwargs:
        return kwargs[name]
    names = _FORWARD_PARAMETERS.get(type(model))
    if names is None:
        signature = inspect.signature(type(model).forward)
        names = [p for p in signature.parameters if p != "self"]
        _FORWARD_PARAMETERS[type(model)] = names
    index = names.index(name) if name in names else -1
    if 0 <= index < len(args):
        return args[index]
    return None


_ABSENT: Any = object()


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily give ``module`` other tensors as parameters, without copying them.

    Set through ``_parameters`` so the tensors are used as they are (same storage, same address:
    the alignment the exactness depends on), and put back even if the forward raises. A parked
    placeholder (an instance attribute of the same name) would shadow them, so it steps aside for
    the duration.
    """
    saved = {name: module._parameters.get(name, _ABSENT) for name in tensors}
    shadows = {name: module.__dict__.pop(name) for name in tensors if name in module.__dict__}
    try:
        for name, tensor in tensors.items():
            module._parameters[name] = tensor  # type: ignore[assignment]  # a plain tensor stands in for the Parameter
        yield
    finally:
        for name, param in saved.items():
            if param is _ABSENT:
                module._parameters.pop(name, None)
            else:
                module._parameters[name] = param
        module.__dict__.update(shadows)


class _ThreadBypass:
    """A module's instance ``forward`` during :func:`bypassing_hooks`: the class's own forward on the
    bypassing thread, the wrapper it stands in for (if any) on every other thread."""

    def __init__(self, module: nn.Module, wrapped: Callable[..., Any] | None, thread: int) -> None:
        self.own = type(module).forward.__get__(module)
        self.wrapped = wrapped
        self.thread = thread

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.wrapped is None or threading.get_ident() == self.thread:
            return self.own(*args, **kwargs)
        return self.wrapped(*args, **kwargs)


@contextlib.contextmanager
def bypassing_hooks(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run ``modules`` with their class's own ``forward``, beneath every hook wrapped around them.

    diffusers hooks (ours, group offloading) and accelerate hooks all replace ``module.forward``
    with a wrapper. A rebuild pass calls a served module's forward with weights taken from the
    source, and no hook may see that call: an offloading hook would onload the module and then
    move those weights to its offload device, and ours would serve the table instead of
    projecting. For the duration, the instance's ``forward`` runs the class's forward on the calling
    thread only: a forward of the model running meanwhile on another thread (a request served
    beside a build) still goes through the wrappers, so it never runs a module whose parameters a
    build has parked or lent. Then the wrappers come back.
    """
    saved: list[tuple[nn.Module, Any]] = []
    thread = threading.get_ident()
    try:
        for module in modules:
            wrapped = module.__dict__.get("forward", _ABSENT)
            saved.append((module, wrapped))
            module.__dict__["forward"] = _ThreadBypass(module, None if wrapped is _ABSENT else wrapped, thread)
        yield
    finally:
        for module, forward in reversed(saved):
            if forward is _ABSENT:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward


@contextlib.contextmanager
def cast_as_layerwise(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Give each module that carries a layerwise-casting hook its parameters in the hook's compute dtype.

    For a forward run beneath every hook (:func:`bypassing_hooks`): the hook's pre-forward is
    ``module.to(dtype=compute_dtype)``, the same ``Tensor.to`` of each of its own parameters,
    which is applied here to fresh tensors instead (the stored ones stay as they are).
    """
    with contextlib.ExitStack() as stack:
        for module in modules:
            hook = get_hook(module, CASTING_HOOK)
            if hook is None:
                continue
            own = {name: p for name, p in module._parameters.items() if p is not None}
            cast = {name: p.detach().to(hook.compute_dtype) for name, p in own.items()}
            stack.enter_context(swapped_parameters(module, cast))
        yield


def install_overrides(model: nn.Module, overrides: Mapping[str, Callable[..., Any]]) -> None:
    """Shadow methods of ``model`` with instance attributes (the class's methods stay untouched)."""
    for name, function in overrides.items():
        model.__dict__[name] = function


def remove_overrides(model: nn.Module, names: Iterable[str]) -> None:
    """Take instance overrides off ``model`` so its class's methods apply again."""
    for name in names:
        model.__dict__.pop(name, None)
