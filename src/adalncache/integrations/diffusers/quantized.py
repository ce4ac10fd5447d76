"""Projections stored in another format than the one they compute in: quantized or layerwise-cast weights.

The cache cannot read such a weight as a matrix, and must not: the resident bits are whatever the module's
own forward computes from its tensors, so the tables are projected through that forward and the slab holds
what it returns (:func:`output_dtype`). Detection looks at the classes of the module and of its weight and
never imports a quantization library. The user's view: docs/diffusers.md (Quantized AdaLN projections,
Layerwise casting).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import nn

from ... import TensorSource
from ...errors import AdalnCacheError, ConfigError
from ...options import flag
from ...spec import Layer, ModulationSpec
from .family import base_linear, casting_hook, diffusers_layout, family_of
from .sources import HostTensors

#: Module prefixes of the classes each library quantizes with, and the name messages use.
_LIBRARIES = (
    ("torchao", "torchao"),
    ("optimum.quanto", "optimum-quanto"),
    ("diffusers.quantizers.gguf", "gguf"),
    ("bitsandbytes", "bitsandbytes"),
)


def is_plain_tensor(tensor: Any) -> TypeGuard[torch.Tensor]:
    """A ``torch.Tensor`` or ``nn.Parameter`` itself, not a subclass holding quantized data."""
    return type(tensor) in (torch.Tensor, nn.Parameter)


def _library(cls: type) -> str | None:
    module = cls.__module__ or ""
    return next((name for prefix, name in _LIBRARIES if module == prefix or module.startswith(prefix + ".")), None)


def quantization_of(module: nn.Module) -> str | None:
    """Which library quantized this projection (``"torchao"``, ``"gguf"``...), or None for a plain one. The module's
    class decides first (optimum-quanto's ``QLinear`` quantizes a plain weight in its forward when not frozen), then the
    weight's; any other tensor subclass counts as quantized too."""
    base = base_linear(module)
    name = _library(type(base))
    if name is not None:
        return name
    weight = base._parameters.get("weight")
    if weight is None or is_plain_tensor(weight):
        return None
    cls = type(weight)
    return _library(cls) or f"tensor subclass {cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class ProjectionStorage:
    """How a model's AdaLN projections store their weights: the libraries that quantized them, and the
    paths of those layerwise casting keeps in a storage dtype."""

    quantized: tuple[str, ...] = ()
    cast: tuple[str, ...] = ()

    @property
    def opaque(self) -> bool:
        """Whether the tables must come from the modules' own forwards (never from raw matrices)."""
        return bool(self.quantized or self.cast)

    def describe(self) -> str:
        parts = [f"quantized ({', '.join(self.quantized)})"] if self.quantized else []
        parts += ["stored in another dtype by layerwise casting"] if self.cast else []
        return " and ".join(parts) or "plain"


def storage_of(modules: Sequence[tuple[Layer, Any]], path: Callable[[Layer], str] = str) -> ProjectionStorage:
    """The storage of the projections ``modules`` (``(layer, module)`` pairs); ``path`` names a layer's module."""
    libraries = sorted({name for _, module in modules if (name := quantization_of(module)) is not None})
    cast = tuple(path(layer) for layer, module in modules if casting_hook(module) is not None)
    return ProjectionStorage(quantized=tuple(libraries), cast=cast)


def output_dtype(module: nn.Module, model: nn.Module) -> torch.dtype:
    """The dtype this projection returns: what the cache's slab must hold to serve it unchanged. Under layerwise
    casting, the compute dtype; for a floating-point weight (torchao and optimum-quanto report the logical one), that
    dtype; for packed bytes (GGUF, bitsandbytes) that of one forward of a zero row in the bias's dtype (the forward
    casts its input to it), or the model's for a projection without a bias (bitsandbytes returns its input's dtype)."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    compute = casting_compute_dtype(module)
    if compute is not None:
        return compute
    base: Any = base_linear(module)
    weight = base._parameters.get("weight")
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    bias = base._parameters.get("bias")
    device = next((t.device for t in (bias, weight) if t is not None and t.device.type != "meta"), None)
    if device is None:
        raise ConfigError("the model's AdaLN projections are not materialised; load the model fully before enabling")
    with torch.no_grad():
        floating = bias is not None and bias.is_floating_point()
        dtype = get_parameter_dtype(module if floating else model)
        probe = torch.zeros(1, int(base.in_features), dtype=dtype, device=device)
        served: torch.dtype = module(probe).dtype
        return served


def transformer_spec(model: nn.Module) -> ModulationSpec:
    """The model's :class:`~adalncache.ModulationSpec`, its dtype what the projections return (one for all:
    one slab serves every projection)."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    family = family_of(model)
    modules = [(layer, family.projection_module(model, layer)) for layer in family.model_layers(model)]
    storage = storage_of(modules)
    if not storage.opaque:
        return family.spec(model)
    if "bitsandbytes" in storage.quantized:
        # A bitsandbytes forward returns its input's dtype, and which dtype a family's forward feeds the
        # projections (the model's, or the projection's own) cannot be told from here: measured, an fp32
        # Qwen-Image with bf16 4-bit projections would be served other bits. Refused, not guessed.
        model_dtype = get_parameter_dtype(model)
        other = {
            str(param.dtype).removeprefix("torch.")
            for _, module in modules
            for param in base_linear(module).parameters()
            if param.is_floating_point() and param.dtype != model_dtype
        }
        if other:
            raise ConfigError(
                f"the bitsandbytes AdaLN projections hold {', '.join(sorted(other))} parameters in a "
                f"{str(model_dtype).removeprefix('torch.')} model; the cache cannot tell which dtype the model feeds "
                "them, so it cannot serve them exactly. Load the model in the projections' dtype (torch_dtype=, as "
                "BitsAndBytesConfig loads it)"
            )
    dtypes = {str(dtype): dtype for dtype in (output_dtype(module, model) for _, module in modules)}
    if len(dtypes) != 1:
        raise ConfigError(
            f"the AdaLN projections return different dtypes ({sorted(dtypes)}); the cache serves them from one "
            "table dtype, so load or quantize the model with one compute dtype for all of them"
        )
    return family.spec(model, dtype=next(iter(dtypes.values())))


#: Where bitsandbytes keeps a weight's quantized data on the module rather than on the parameter:
#: ``(holder on the module, attribute, the parameter's attribute)``. ``Linear8bitLt``'s first forward
#: moves ``weight.CB`` / ``weight.SCB`` to ``module.state``; ``Linear4bit`` may keep ``quant_state``.
_HELD_BY_MODULE = (("state", "CB", "CB"), ("state", "SCB", "SCB"), ("", "quant_state", "quant_state"))


def hand_state_to_weight(base: nn.Module, weight: Any) -> Callable[[], None]:
    """Move what bitsandbytes keeps of ``weight`` on ``base`` itself onto ``weight``; returns the undo. Parking the
    parameter alone would leave the module holding the weight's bytes (an 8-bit module's ``state.CB`` *is* its int8
    weight after one forward); on the parameter, where the library looks first, the parked object carries everything its
    forward needs. The undo puts the same objects back."""
    if _library(type(base)) != "bitsandbytes" or weight is None:
        return lambda: None
    saved: list[tuple[Any, str, Any]] = []
    for holder_name, name, weight_name in _HELD_BY_MODULE:
        holder = getattr(base, holder_name, None) if holder_name else base
        value = getattr(holder, name, None)
        if value is None:
            continue
        on_weight = getattr(weight, weight_name, None)
        saved += [(holder, name, value), (weight, weight_name, on_weight)]
        if on_weight is None:
            setattr(weight, weight_name, value)
        setattr(holder, name, None)

    def undo() -> None:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)

    return undo


@contextlib.contextmanager
def state_kept_by_weight(base: nn.Module) -> Iterator[None]:
    """Around a forward of a parked projection's own tensors: what it leaves on the module goes back to the
    parameter (:func:`hand_state_to_weight`)."""
    weight = base._parameters.get("weight")
    try:
        yield
    finally:
        hand_state_to_weight(base, weight)


def fresh_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object over the same storage (plain tensors), or the tensor itself (subclasses: bitsandbytes
    keeps its state on the very object). Layerwise casting rebinds ``.data`` of what sits in ``_parameters``,
    and must not rebind the source's own tensors (their fingerprint would change at every build)."""
    return tensor.detach() if is_plain_tensor(tensor) else tensor


def own_tensors(
    modules: Sequence[tuple[Layer, Any]], device: torch.device, path: Callable[[Layer], str] = str
) -> HostTensors:
    """The projections' own tensors by ``(layer, name)``, on the host: on CPU the very objects, elsewhere
    ``.to("cpu")`` copies (torchao refuses ``copy=``); quantized ones never detached (bitsandbytes' state)."""
    host: HostTensors = {}
    for layer, module in modules:
        base = base_linear(module)
        for name in ("weight", "bias"):
            tensor: torch.Tensor | None = base._parameters.get(name)
            if tensor is None and name == "bias":
                continue  # built without one (nn.Linear(..., bias=False)): nothing to park or give back
            if tensor is None:
                raise ConfigError(f"{path(layer)}.{name} is missing; the AdaLN projections need a weight")
            tensor = fresh_alias(tensor)
            if tensor.device.type != "cpu":
                tensor = tensor.to("cpu")
                if device.type == "cuda" and is_plain_tensor(tensor):
                    tensor = tensor.pin_memory()
            host[(layer, name)] = tensor
    return host


def opaque_model_source(
    spec: ModulationSpec, modules: Sequence[tuple[Layer, Any]], device: torch.device
) -> tuple[TensorSource, HostTensors]:
    """The model's own quantized or cast projections as a source (told each tensor's logical shape: it never
    reads them as matrices, and fingerprints them by identity), and the host tensors it holds."""
    layout = diffusers_layout(spec)
    host = own_tensors(modules, device, layout.prefix)
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for layer, module in modules:
        base: Any = base_linear(module)
        shapes_of = {"weight": (int(base.out_features), int(base.in_features)), "bias": (int(base.out_features),)}
        for name in spec.tensors_of(layer):
            key = f"{layout.prefix(layer)}.{name}"
            if (layer, name) not in host:
                raise ConfigError(f"{key} is missing; the model config declares it")
            tensors[key], shapes[key] = host[(layer, name)], shapes_of[name]
    return TensorSource(tensors, spec, layout=layout.name, logical_shapes=shapes), host


def full_precision_variant(model: Any) -> tuple[Any, ...]:
    """What full-precision tables of quantized projections are built under, besides the checkpoint: their
    input comes from this model's time embedder, which may be quantized or cast too."""
    embedder = tuple(
        (path, quantization_of(linear), casting_hook(linear) is not None)
        for path, linear in family_of(model).time_embedder_linears(model)
    )
    return ("full-precision tables of quantized projections", embedder)


def adapter_guards(storage: ProjectionStorage) -> dict[str, Callable[..., Any]]:
    """Refuse loading a LoRA into quantized or cast projections while served (disable, load, enable)."""
    if not storage.opaque:
        return {}

    def refuse_adapter(*args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"loading a LoRA into AdaLN projections that are {storage.describe()} is not supported while the AdaLN "
            "cache is enabled; call handle.disable(), load the LoRA, then enable again (the cache then serves it "
            "exactly)"
        )

    return {"load_lora_adapter": refuse_adapter, "add_adapter": refuse_adapter}


def check_storage_options(
    storage: ProjectionStorage,
    *,
    checkpoint: Any,
    quantized_projections: str,
    precision: str,
    shard: str,
    process_group: Any,
    device: torch.device,
    tables: Any = None,
) -> None:
    """Refuse, before the model is touched, the settings that cannot be exact with this storage."""
    if quantized_projections == "checkpoint" and checkpoint is None:
        raise ConfigError(
            "quantized_projections='checkpoint' serves full-precision tables from an unquantized checkpoint, so it "
            f"needs checkpoint= (CLI {flag('checkpoint')}): pass the file the model was quantized from"
        )
    if not storage.opaque:
        return
    what = storage.describe()
    if tables is not None and quantized_projections != "checkpoint":
        # Exported tables are full-precision projections: this model's own (quantized) forward
        # computes other bits, and its content cannot be compared with a file's binding.
        raise ConfigError(
            f"tables= holds full-precision tables but the model's AdaLN projections are {what}; they would not "
            "equal this model. Drop tables=, or serve full-precision tables on purpose with "
            "quantized_projections='checkpoint' and checkpoint= the file the model was quantized from"
        )
    if checkpoint is not None and quantized_projections != "checkpoint":
        raise ConfigError(
            f"checkpoint= (CLI {flag('checkpoint')}) holds full-precision projections but the model's AdaLN "
            f"projections are {what}; tables from the checkpoint would not equal this model. Pass checkpoint=None to "
            "serve the model's own projections, or quantized_projections='checkpoint' to serve full-precision "
            "tables from the checkpoint on purpose (the AdaLN projections then compute unquantized, the rest of the "
            "model stays as loaded)"
        )
    if quantized_projections == "model" and precision != "match":
        raise ConfigError(
            f"precision={precision!r} (CLI {flag('precision')}) recomputes the projections in fp32 from their "
            f"weights, but the model's AdaLN projections are {what} and only their own forward computes what the "
            "model does; use precision='match'"
        )
    if shard == "columns" and process_group is not None:
        raise ConfigError(
            f"shard='columns' (CLI {flag('shard')}) slices each projection's weight across ranks, but the AdaLN "
            f"projections are {what}; use shard='layers'"
        )
    if "bitsandbytes" in storage.quantized and device.type != "cpu":
        raise ConfigError(
            f"bitsandbytes-quantized AdaLN projections on {device} are untested with the AdaLN cache (moving "
            "bitsandbytes parameters to the host and back re-quantizes them); keep the AdaLN projections out of "
            "quantization (BitsAndBytesConfig(llm_int8_skip_modules=['adaln_proj', 'norm_out'])) or run on CPU"
        )


def casting_compute_dtype(module: Any) -> torch.dtype | None:
    """The compute dtype of the casting hook on ``module``'s linear, or None (a pass beneath the hooks casts
    each parameter itself, as the hook's ``module.to(dtype=compute_dtype)`` would)."""
    hook = casting_hook(module)
    compute: torch.dtype | None = hook.compute_dtype if hook is not None else None
    return compute


def casting_paths(named: Sequence[tuple[str, Any]]) -> frozenset[str]:
    """The paths among ``named`` (``(path, module)`` pairs) whose linear carries a casting hook."""
    return frozenset(path for path, module in named if casting_hook(module) is not None)


def new_casting(named: Sequence[tuple[str, Any]], at_enable: frozenset[str]) -> None:
    """Refuse a casting hook added to a served module since enabling (the tables would not be cast)."""
    added = sorted(casting_paths(named) - at_enable)
    if added:
        raise ConfigError(
            f"layerwise casting was applied to {', '.join(added[:3])}{' ...' if len(added) > 3 else ''} while the "
            "AdaLN cache serves them, so the tables no longer match the cast model; call handle.disable() (the "
            "casting then applies to the restored weights) and enable the cache again, or cast with "
            "model.enable_layerwise_casting(...), which re-enables the cache for you"
        )


def settle_casting(named: Sequence[tuple[str, Any]], at_enable: frozenset[str]) -> None:
    """Cast restored weights the way a casting hook added while enabled would have cast them at registration
    (registered on a placeholder, that cast reached nothing real)."""
    for path, module in named:
        if path in at_enable:
            continue
        hook = casting_hook(module)
        if hook is not None:
            base_linear(module).to(dtype=hook.storage_dtype, non_blocking=hook.non_blocking)


def casting_guard(
    model: Any, *, disable: Callable[[], None], enable_again: Callable[[], None]
) -> dict[str, Callable[..., Any]]:
    """An instance override of ``enable_layerwise_casting``: disable, cast the real weights, enable again
    (cast while served, only the placeholders would change)."""
    cls: Any = type(model)

    def enable_layerwise_casting(*args: Any, **kwargs: Any) -> Any:
        disable()
        result = cls.enable_layerwise_casting(model, *args, **kwargs)
        try:
            enable_again()
        except AdalnCacheError as exc:
            raise ConfigError(
                f"layerwise casting was applied, but the AdaLN cache could not be enabled again: {exc}; the cache "
                "is now disabled"
            ) from exc
        return result

    return {"enable_layerwise_casting": enable_layerwise_casting}
