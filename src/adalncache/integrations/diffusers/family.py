"""What the integration knows of a model: its family (:class:`DiffusersFamily`, registered here by one module
per family; the seam: docs/api.md, Adding a family), and how to reach, run and patch its modules whatever the
family. Served modules are looked up each time (peft wraps or replaces them), blocks through the list
captured while enabled (cache-dit swaps it in its forward).
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ... import families, slab
from ...errors import ConfigError, PlanError
from ...geometry import Family, KeyLayout
from ...spec import Layer, ModulationSpec
from .compat import get_hook, group_offload_enabled, group_onload_device

#: The key layout whose prefixes are the projections' module paths inside a diffusers transformer.
DIFFUSERS = "diffusers"

#: The name diffusers registers its layerwise-casting hook under.
CASTING_HOOK = "layerwise_casting"

#: Attributes a served owner module reads its rows from: its ``[P + 1, W, width]`` view of the table
#: and the per-thread state holding the forward's slot (set on install, removed on uninstall).
ROWS_ATTRIBUTE = "_adalncache_rows"
STATE_ATTRIBUTE = "_adalncache_state"

#: ``forward(owner, x, ...)`` of a served owner module: its output with the layer's rows in place of the projection's.
ServedForward = Callable[..., Any]

#: The real block list of each enabled model. Kept off the model itself: a library that looks for a
#: model's blocks among its attributes (cache-dit does) must not find a second list there.
_CAPTURED_BLOCKS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def diffusers_layout(spec: ModulationSpec) -> KeyLayout:
    """The family's diffusers layout: its prefixes are module paths inside the transformer."""
    return spec.layout(DIFFUSERS)


class ForwardState(Protocol):
    """The forward in progress on this thread: ``slot`` (``None`` outside a forward), ``row_buffer`` the
    flat slab rows the served modules gather (written in place: compiled and CUDA graphs hold its
    address), ``dtype`` the dtype the rows are served in (``None``: the slab's)."""

    slot: torch.Tensor | None
    row_buffer: torch.Tensor
    dtype: torch.dtype | None

    def require(self, what: str) -> None: ...


def gather_rows(view: torch.Tensor, state: ForwardState, rows: int, what: str) -> torch.Tensor:
    """The forward's ``rows`` rows of a ``[P + 1, W, width]`` table view (the poison slot last), from tensors
    only (never a number dynamo would specialise on): one compiled graph for every block, CUDA graphs kept."""
    if state.slot is None:
        state.require(what)
    out = slab.gather_rows(view, state.row_buffer[:rows])
    dtype = state.dtype
    return out.to(dtype) if dtype is not None and out.dtype != dtype else out  # built under autocast


def rows_forward(owner: Any, x: torch.Tensor) -> torch.Tensor:
    """A served owner's forward: the layer's rows for the ``x.shape[0]`` rows of its input."""
    return gather_rows(
        owner.__dict__[ROWS_ATTRIBUTE], owner.__dict__[STATE_ATTRIBUTE], x.shape[0], type(owner).__name__
    )


class DiffusersFamily(abc.ABC):
    """One model family as the integration serves it; subclasses set ``family`` and ``time_embedder`` and
    implement the abstract methods (the defaults fit blocks in ``blocks`` and peft-wrappable linears)."""

    #: The core family: name, diffusers class names, key layouts (one named ``"diffusers"``).
    family: ClassVar[Family]
    #: The attribute holding the transformer's blocks.
    blocks: ClassVar[str] = "transformer_blocks"
    #: Module path of the module whose output is ``temb`` (hooked with a placeholder when parked).
    time_embedder: ClassVar[str]
    #: Whether the ``temb`` placeholder must be a tensor of its own (a forward adds to it in place), not a view.
    writable_stand_in: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def layout(self) -> KeyLayout:
        return self.family.layout(DIFFUSERS)

    def recognises(self, model: Any) -> bool:
        """Whether ``model`` is a transformer of this family (by its class name, as diffusers names it)."""
        return isinstance(model, nn.Module) and type(model).__name__ in self.family.class_names

    def spec(self, model: nn.Module, dtype: torch.dtype | None = None) -> ModulationSpec:
        """The model's spec (``dtype``: the projections' output dtype when not their weights')."""
        return ModulationSpec.from_transformer(model, dtype=dtype)

    def model_layers(self, model: nn.Module) -> list[Layer]:
        """The model's served layers, read before its dtype is known (quantized weights have none)."""
        return self.spec(model, torch.float32).layers()

    @abc.abstractmethod
    def upstream_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(path, module)`` of every module between the forward's keying inputs and the projections'
        input (time embedders; addition, guidance and second-timestep embeddings): their weights, buffers
        and adapters shape every row, so the tables' signature covers them. Abstract on purpose: a family
        that forgot one would serve stale rows after a change to it."""

    @abc.abstractmethod
    def embed(
        self, model: Any, spec: ModulationSpec, plan: torch.Tensor, device: torch.device
    ) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The projections' exact input for ``plan``, as the stock forward computes it, on ``device``: one
        tensor, or a mapping input name -> tensor when layers take differently many rows."""

    @abc.abstractmethod
    def forward_plan(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
        """The plan of one transformer forward, from its arguments (a PlanError when it has none)."""

    def request_plan(self, model: nn.Module, plan: Any) -> Any:
        """A plan given to ``prepare`` as the forward will key it."""
        return plan

    def schedule_plans(
        self, model: nn.Module, timesteps: torch.Tensor, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> list[Any] | None:
        """Every step's plan of a pipeline request whose scheduler set ``timesteps``, from its first forward
        (``None``: the pipelines prepare their own, or this forward's timestep is none of the computed ones)."""
        return None

    def predict_schedule(
        self, model: nn.Module, pipeline: Any, call: Mapping[str, Any], component: str
    ) -> list[Any] | None:
        """Every step's plan of a pipeline call, from its arguments, before the pipeline runs (``None``: no
        prediction). The request adopts it only if the schedule set later is the same plans, so a wrong
        prediction costs time, never a row."""
        return None

    def attach_pipeline(self, pipeline: Any) -> Callable[[], None] | None:
        """Install what this family's own pipelines need besides the call and scheduler watches; returns the
        undo, or None when nothing was done."""
        return None

    def projection_path(self, layer: Layer) -> str:
        return self.layout.prefix(layer)

    def owner_path(self, layer: Layer) -> str:
        """Module path of the module that calls ``layer``'s projection."""
        return self.projection_path(layer).rpartition(".")[0]

    def blocks_path(self, model: nn.Module) -> str:
        """The attribute holding ``model``'s blocks: :attr:`blocks`, unless the family's classes differ."""
        return self.blocks

    def capture_blocks(self, model: nn.Module) -> None:
        """Remember the model's real block list while the cache is enabled."""
        _CAPTURED_BLOCKS[model] = model.get_submodule(self.blocks_path(model))

    def release_blocks(self, model: nn.Module) -> None:
        _CAPTURED_BLOCKS.pop(model, None)

    def module_at(self, model: nn.Module, path: str) -> Any:
        """The module at ``path``, reaching blocks through the real block list."""
        head = f"{self.blocks_path(model)}."
        if not path.startswith(head):
            return model.get_submodule(path)
        index, _, rest = path[len(head) :].partition(".")
        captured = _CAPTURED_BLOCKS.get(model)
        blocks = captured if captured is not None else model.get_submodule(self.blocks_path(model))
        block = blocks.get_submodule(str(int(index)))
        return block.get_submodule(rest) if rest else block

    def projection_module(self, model: nn.Module, layer: Layer) -> Any:
        """The current module of ``layer``'s projection (peft may have wrapped or replaced it)."""
        return self.module_at(model, self.projection_path(layer))

    def projection_modules(self, model: nn.Module, spec: ModulationSpec) -> list[tuple[Layer, Any]]:
        """``(layer, current module)`` of every projection, in pass order."""
        return [(layer, self.projection_module(model, layer)) for layer in spec.layers()]

    def time_embedder_module(self, model: nn.Module) -> nn.Module:
        """The module whose output is ``temb`` (a family of several classes may put it elsewhere per class)."""
        return model.get_submodule(self.time_embedder)

    def time_embedder_linears(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(path, module)`` of the time embedder's linears that exist on this model (parking may free them)."""
        named = []
        for path in self.layout.time_embedder:
            with contextlib.suppress(AttributeError):
                named.append((path, model.get_submodule(path)))
        return named

    def served_modules(self, model: nn.Module, spec: ModulationSpec) -> list[tuple[str, Any]]:
        """``(path, current module)`` of every module whose weights the cache serves or parks."""
        named = [(self.projection_path(layer), module) for layer, module in self.projection_modules(model, spec)]
        return [*named, *self.time_embedder_linears(model)]

    def swapped_layers(self, spec: ModulationSpec) -> list[Layer]:
        """Layers served by a class swap of their owner module: the blocks' (the rest get a hook)."""
        return [layer for layer in spec.layers() if isinstance(layer, int)]

    def served_forward(self, layer: Layer) -> ServedForward:
        """The forward of ``layer``'s served owner class (by default the layer's rows); an owner that does
        more than call the projection gets a forward doing the rest with the rows in its place."""
        return rows_forward

    def rows_view(self, cache: Any, layer: Layer) -> torch.Tensor:
        """The ``[P + 1, W, out_features]`` view ``layer``'s rows are gathered from (the poison slot last)."""
        return cache.served_params(layer)

    def stand_in(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, torch.dtype | None]:
        """Rows and dtype (``None``: its parameter dtype) of the ``temb`` the parked time embedder would
        return for this call; by default one row per row of its first argument."""
        sample = args[0] if args else next(iter(kwargs.values()))
        return int(sample.shape[0]), None

    def temb_width(self, model: nn.Module) -> int:
        """Width of ``temb``: the time embedder's last linear's outputs."""
        _, last = self.time_embedder_linears(model)[-1]
        out_features: Any = base_linear(last).out_features
        return int(out_features)


def timestep_argument(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
    """The forward's ``timestep`` tensor, or a PlanError saying the cache needs one."""
    timestep = forward_argument(module, "timestep", args, kwargs)
    if not isinstance(timestep, torch.Tensor):
        raise PlanError(f"the AdaLN cache needs the forward's timestep tensor, got {type(timestep).__name__}")
    return timestep


def check_materialised(family: DiffusersFamily, model: nn.Module, spec: ModulationSpec) -> None:
    """Refuse a model whose projections hold no data: there would be nothing to serve or restore."""
    for layer, module in family.projection_modules(model, spec):
        base = base_linear(module)
        for name in spec.tensors_of(layer):
            param = getattr(base, name, None)
            if param is None or param.device.type == "meta":
                raise ConfigError(
                    "the model's AdaLN projections are not materialised (meta or missing bias): load "
                    "the model fully before enabling the AdaLN cache, or load it with "
                    "adalncache.diffusers.load_transformer; accelerate's cpu_offload (and "
                    "enable_sequential_cpu_offload) moves every weight to meta, so enable the cache first, "
                    "then offload"
                )


#: The integration's families, by core family name (each family module registers its one instance;
#: the package imports every family module).
FAMILIES: dict[str, DiffusersFamily] = {}


def register(family: DiffusersFamily) -> DiffusersFamily:
    """Register ``family`` (an instance: a subclass that left an abstract method out cannot be made)."""
    if not isinstance(family, DiffusersFamily):
        raise ConfigError(f"a diffusers family must be a DiffusersFamily, got {type(family).__name__}")
    FAMILIES[family.name] = family
    return family


def by_name(name: str) -> DiffusersFamily:
    """The integration's family called ``name`` (a ConfigError when the core family has none)."""
    family = FAMILIES.get(name)
    if family is None:
        families.get(name)  # an unknown name: the core's error lists the supported families
        raise ConfigError(f"the {name} family has no diffusers integration; the served ones are {sorted(FAMILIES)}")
    return family


def recognised(obj: Any) -> DiffusersFamily | None:
    """The family of ``obj`` when it is a transformer the integration serves, else None (no error)."""
    return next((family for family in FAMILIES.values() if family.recognises(obj)), None)


def family_of(model: Any) -> DiffusersFamily:
    """The family of a transformer, or the core's ConfigError saying why its class is refused or unknown."""
    family = recognised(model)
    return family if family is not None else by_name(families.for_class(type(model).__name__).name)


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
    """Where the model's forward runs (offloading makes it differ from where its weights are kept): group
    offloading's onload device, an accelerate hook's execution device, else the weights' (``None``: no clue)."""
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
    return None if device is None else torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def casting_hook(module: nn.Module) -> Any:
    """diffusers' layerwise-casting hook on this projection's (base) linear, or None."""
    return get_hook(base_linear(module), CASTING_HOOK)


def stock_dtype(module: nn.Module) -> torch.dtype:
    """The dtype diffusers' ``get_parameter_dtype`` gives ``module`` in the stock (unparked) model, which the
    stock forward casts the projection's input to: a layerwise-casting hook's compute dtype, else the base
    linear's first floating-point parameter's (read from a parked module's placeholders; peft's adapters,
    perhaps fp32, must not decide it)."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    hook = casting_hook(module)
    if hook is not None:
        compute: torch.dtype = hook.compute_dtype
        return compute
    base = base_linear(module)
    for name in ("weight", "bias"):  # nn.Linear's parameter order; quantized weights are not floating
        tensor = getattr(base, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return tensor.dtype
    return get_parameter_dtype(module)


def input_dtype(model: nn.Module, linear: nn.Module, device: torch.device | None = None) -> torch.dtype:
    """The dtype of ``hidden_states`` after the model's input ``linear``, which the forward casts the timestep
    to: the autocast dtype where autocast is on for the device the forward runs on (``device``; by default
    where the model runs), since the linear then returns that; else the linear's stock dtype."""
    if device is None:
        device = execution_device(model) or device_of(model)
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return stock_dtype(linear)


_FORWARD_PARAMETERS: dict[type, list[str]] = {}


def forward_argument(model: nn.Module, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """A forward argument by name, whether it was passed by keyword or by position (None when absent)."""
    if name in kwargs:
        return kwargs[name]
    names = _FORWARD_PARAMETERS.get(type(model))
    if names is None:
        names = [p for p in inspect.signature(type(model).forward).parameters if p != "self"]
        _FORWARD_PARAMETERS[type(model)] = names
    index = names.index(name) if name in names else -1
    return args[index] if 0 <= index < len(args) else None


_ABSENT: Any = object()


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily give ``module`` other tensors as parameters, used as they are (same address: the alignment
    the exactness depends on), put back even if the forward raises; a parked placeholder steps aside meanwhile."""
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
    """Run ``modules`` with their class's own ``forward``, beneath every hook wrapped around them. A rebuild pass calls
    a served module with the source's weights, and no hook may see that call (an offloading hook would move those
    weights away, ours would serve the table). Only on the calling thread: a forward on another thread meanwhile still
    goes through the wrappers."""
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
def embedding_beneath_hooks(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run a family's embedding ``modules`` beneath every hook on them (ours stands in for a parked one; an offloading
    hook must not move the weights a build lends), each one with a layerwise-casting hook given its parameters in the
    hook's compute dtype, as its ``module.to(dtype=compute_dtype)`` would. Under autocast the embedding comes out in the
    autocast dtype; the projection's own autocast casts its input back down, so the caller's cast up to the weights'
    dtype (a no-op otherwise) is exact."""
    modules = list(modules)
    with bypassing_hooks(modules), contextlib.ExitStack() as stack:
        for module in modules:
            hook = get_hook(module, CASTING_HOOK)
            if hook is not None:
                own = {name: p for name, p in module._parameters.items() if p is not None}
                stack.enter_context(
                    swapped_parameters(module, {n: p.detach().to(hook.compute_dtype) for n, p in own.items()})
                )
        yield


__all__ = ["FAMILIES", "DiffusersFamily", "family_of", "gather_rows", "register"]
