"""Where the served modules sit in a diffusers ``MiniMaxH3Transformer3DModel``, and how to reach them.

The cache serves every block's ``adaln_proj.linear`` and ``norm_out.linear``: their module paths
are the prefixes of the diffusers key layout, so the layout is the one place that names them. peft
wraps a module it targets (the real ``nn.Linear`` becomes ``base_layer``) and, for
``norm_out.linear``, may replace the object outright, so these helpers look the current module up
each time instead of holding on to one.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...spec import FINAL, LAYOUTS, Layer, ModulationSpec
from .compat import get_hook, group_offload_enabled, group_onload_device

#: The diffusers layout: its prefixes are the projections' module paths inside the transformer.
DIFFUSERS_LAYOUT = LAYOUTS["diffusers"]

#: The attribute holding the transformer's blocks.
BLOCKS = "transformer_blocks"

#: The real block list of each enabled model. Kept off the model itself: a library that looks for
#: a model's blocks among its attributes (cache-dit does) must not find a second list there.
_CAPTURED_BLOCKS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()

#: The time embedder and its two linears, whose LoRA (if any) also shapes what the projections see.
TIME_EMBEDDER = "time_embedder"
TIME_EMBEDDER_LINEARS = ("linear_1", "linear_2")


#: The name diffusers registers its layerwise-casting hook under.
CASTING_HOOK = "layerwise_casting"


def is_minimax_h3_transformer(obj: Any) -> bool:
    """Whether ``obj`` is a diffusers ``MiniMaxH3Transformer3DModel`` (imported lazily)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return isinstance(obj, MiniMaxH3Transformer3DModel)


def projection_path(layer: Layer) -> str:
    """Module path of ``layer``'s projection (``transformer_blocks.3.adaln_proj.linear``)."""
    return DIFFUSERS_LAYOUT.prefix(layer)


def owner_path(layer: Layer) -> str:
    """Module path of the module that calls ``layer``'s projection (``transformer_blocks.3.adaln_proj``)."""
    return projection_path(layer).rpartition(".")[0]


def base_linear(module: nn.Module) -> nn.Module:
    """The ``nn.Linear`` under a peft wrapper (or the module itself)."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else module


def capture_blocks(model: nn.Module) -> None:
    """Remember the model's real block list while the cache is enabled."""
    _CAPTURED_BLOCKS[model] = model.get_submodule(BLOCKS)


def release_blocks(model: nn.Module) -> None:
    """Forget the list :func:`capture_blocks` remembered."""
    _CAPTURED_BLOCKS.pop(model, None)


def transformer_blocks(model: nn.Module) -> nn.Module:
    """The model's real block list: the captured one while enabled, else the model's attribute."""
    captured = _CAPTURED_BLOCKS.get(model)
    return captured if captured is not None else model.get_submodule(BLOCKS)


def _in_block(layer: int, path: str) -> str:
    """``path`` (a path in the model) relative to block ``layer``."""
    head = f"{BLOCKS}.{layer}."
    if not path.startswith(head):
        raise ConfigError(f"internal: {path} is not inside {head.rstrip('.')}")
    return path[len(head) :]


def projection_module(model: nn.Module, layer: Layer) -> Any:
    """The current module of ``layer``'s projection (peft may have wrapped it), through the real blocks."""
    if layer == FINAL:
        return model.get_submodule(projection_path(FINAL))
    block = transformer_blocks(model)[int(layer)]  # type: ignore[index]
    return block.get_submodule(_in_block(int(layer), projection_path(layer)))


def projection_modules(model: nn.Module, spec: ModulationSpec) -> list[tuple[Layer, Any]]:
    """``(layer, current module)`` of every projection, in pass order; peft may have wrapped them."""
    return [(layer, projection_module(model, layer)) for layer in spec.layers()]


def modulation_modules(model: nn.Module, spec: ModulationSpec) -> list[nn.Module]:
    """Every block's ``adaln_proj`` (the module that calls the projection), in layer order."""
    blocks: Any = transformer_blocks(model)
    return [blocks[layer].get_submodule(_in_block(layer, owner_path(layer))) for layer in range(spec.num_layers)]


def time_embedder_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of the time embedder's linears that exist on this model."""
    time_embedder = model.get_submodule(TIME_EMBEDDER)
    named = []
    for name in TIME_EMBEDDER_LINEARS:
        child = getattr(time_embedder, name, None)
        if isinstance(child, nn.Module):
            named.append((f"{TIME_EMBEDDER}.{name}", child))
    return named


def served_modules(model: nn.Module, spec: ModulationSpec) -> list[tuple[str, Any]]:
    """``(path, current module)`` of every module whose weights shape the served outputs."""
    named: list[tuple[str, Any]] = [
        (projection_path(layer), module) for layer, module in projection_modules(model, spec)
    ]
    return named + time_embedder_linears(model)


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


def check_materialised(model: nn.Module, spec: ModulationSpec) -> None:
    """Refuse a model whose projections hold no data: there would be nothing to serve or restore."""
    for _, module in projection_modules(model, spec):
        base = base_linear(module)
        for name in ("weight", "bias"):
            param = getattr(base, name, None)
            if param is None or param.device.type == "meta":
                raise ConfigError(
                    "the model's AdaLN projections are not materialised (meta or missing bias): load "
                    "the model fully before enabling the AdaLN cache, or load it with "
                    "adalncache.diffusers.load_transformer; accelerate's cpu_offload (and "
                    "enable_sequential_cpu_offload) moves every weight to meta, so enable the cache first, "
                    "then offload"
                )


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
        return hook.compute_dtype  # type: ignore[no-any-return]
    base = base_linear(module)
    for name in ("weight", "bias"):  # nn.Linear's parameter order; quantized weights are not floating
        tensor = getattr(base, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return tensor.dtype
    return get_parameter_dtype(module)


def projection_dtype(model: nn.Module, spec: ModulationSpec) -> torch.dtype:
    """The one dtype every projection computes in (the cache serves them one shared embedding)."""
    dtypes = {stock_dtype(module) for _, module in projection_modules(model, spec)}
    if len(dtypes) != 1:
        raise ConfigError(
            f"the AdaLN projections do not share one dtype ({sorted(map(str, dtypes))}); the cache "
            "serves one embedding to all of them, so cast the model consistently before enabling"
        )
    return dtypes.pop()


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
            module._parameters[name] = tensor  # type: ignore[assignment]
        yield
    finally:
        for name, param in saved.items():
            if param is _ABSENT:
                module._parameters.pop(name, None)
            else:
                module._parameters[name] = param
        module.__dict__.update(shadows)


@contextlib.contextmanager
def bypassing_hooks(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run ``modules`` with their class's own ``forward``, beneath every hook wrapped around them.

    diffusers hooks (ours, group offloading) and accelerate hooks all replace ``module.forward``
    with a wrapper. A rebuild pass calls a served module's forward with weights taken from the
    source, and no hook may see that call: an offloading hook would onload the module and then
    move those weights to its offload device, and ours would serve the table instead of
    projecting. The class's forward is bound on the instance for the duration, then the wrappers
    come back.
    """
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for module in modules:
            saved.append((module, module.__dict__.get("forward", _ABSENT)))
            module.__dict__["forward"] = type(module).forward.__get__(module)
        yield
    finally:
        for module, forward in reversed(saved):
            if forward is _ABSENT:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward


def install_overrides(model: nn.Module, overrides: Mapping[str, Callable[..., Any]]) -> None:
    """Shadow methods of ``model`` with instance attributes (the class's methods stay untouched)."""
    for name, function in overrides.items():
        model.__dict__[name] = function


def remove_overrides(model: nn.Module, names: Iterable[str]) -> None:
    """Take instance overrides off ``model`` so its class's methods apply again."""
    for name in names:
        model.__dict__.pop(name, None)
