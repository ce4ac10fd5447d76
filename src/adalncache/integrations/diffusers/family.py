"""What the integration needs to know about one model family: :class:`DiffusersFamily`.

The integration (parking, sources, the LoRA signature, hooks, builds, moves) is the same for every
diffusers transformer whose AdaLN modulation depends on per-step inputs only. What differs between
families is small, and a family module (``minimax_h3.py``, ``qwen_image.py``, beside this file)
declares exactly that by subclassing :class:`DiffusersFamily`:

* **which transformers it serves**: ``family`` (the core :class:`~adalncache.geometry.Family`,
  whose ``class_names`` are the diffusers classes) and :meth:`DiffusersFamily.spec` (the
  :class:`~adalncache.ModulationSpec` of a model, ``ModulationSpec.from_transformer`` by default);
* **where the served projections sit**: their module paths are the prefixes of the family's
  ``"diffusers"`` key layout (the one place that names them); the current module is looked up
  each time (:meth:`DiffusersFamily.projection_module`) because peft wraps or replaces it, and
  blocks are reached through the list captured while enabled (cache-dit swaps it in its forward);
* **what else shapes the served outputs**: the time embedder's linears (the layout's
  ``time_embedder`` paths), which the LoRA signature reads and parking may free, and
  ``time_embedder``: the module whose output is the projections' ``temb``, stood in for by a
  zero placeholder while its weights are parked (:meth:`DiffusersFamily.stand_in`);
* **the projections' exact input** for a plan (:meth:`DiffusersFamily.embed`), computed with the
  model's own modules as its stock forward computes it: one tensor, or a mapping input name ->
  tensor when layers take differently many rows (``spec.input_of(layer)``);
* **a forward's plan** (:meth:`DiffusersFamily.forward_plan`), from the forward's arguments, and
  the same normalisation for the plans a request prepares (:meth:`DiffusersFamily.request_plan`);
* **how the served modules answer while enabled**: the layers of :meth:`DiffusersFamily.swapped_layers`
  have the module that calls them (their path's parent) switched in place to a served class
  whose forward is :meth:`DiffusersFamily.served_forward` (one class for every block, so a
  regional compile reuses one graph); every other layer's projection gets a hook that returns
  its rows, kept on whatever module sits at its path (peft replaces modules).

One instance per family is registered in :mod:`.registry`; nothing else in the integration names
a family.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ...errors import ConfigError, PlanError
from ...geometry import Family, KeyLayout
from ...slab import gather_rows
from ...spec import Layer, ModulationSpec
from .modules import base_linear, forward_argument

#: The key layout whose prefixes are the projections' module paths inside a diffusers transformer.
DIFFUSERS = "diffusers"

#: ``forward(owner, x)`` of a served owner module: returns the layer's rows for the input ``x``.
ServedForward = Callable[[Any, torch.Tensor], Any]

#: The real block list of each enabled model. Kept off the model itself: a library that looks for
#: a model's blocks among its attributes (cache-dit does) must not find a second list there.
_CAPTURED_BLOCKS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def diffusers_layout(spec: ModulationSpec) -> KeyLayout:
    """The family's diffusers layout: its prefixes are module paths inside the transformer."""
    return spec.layout(DIFFUSERS)


def projection_path(spec: ModulationSpec, layer: Layer) -> str:
    """Module path of ``layer``'s projection (``transformer_blocks.3.img_mod.1``)."""
    return diffusers_layout(spec).prefix(layer)


def rows_forward(owner: Any, x: torch.Tensor) -> torch.Tensor:
    """A served owner's forward: the layer's rows for the ``x.shape[0]`` rows of its input.

    The rows are gathered through tensors only (the block's column view and the thread's slot
    buffer), so a compiled block makes one graph for every block.
    """
    from .compile import ROWS_ATTRIBUTE, STATE_ATTRIBUTE

    state = getattr(owner, STATE_ATTRIBUTE)
    if state.slot is None:
        state.require(type(owner).__name__)
    rows = gather_rows(getattr(owner, ROWS_ATTRIBUTE), state.row_buffer[: x.shape[0]])
    dtype = state.dtype
    if dtype is not None and rows.dtype != dtype:  # built under autocast: served in its dtype
        rows = rows.to(dtype)
    return rows


class DiffusersFamily:
    """One model family as the integration serves it (module docstring); subclass per family.

    Subclasses set ``family`` and ``time_embedder`` and implement :meth:`embed` and
    :meth:`forward_plan`; the rest has defaults that fit a transformer whose blocks are in
    ``blocks`` and whose projections are plain (possibly peft-wrapped) ``nn.Linear`` modules.
    """

    #: The core family: name, diffusers class names, key layouts (one named ``"diffusers"``).
    family: ClassVar[Family]
    #: The attribute holding the transformer's blocks.
    blocks: ClassVar[str] = "transformer_blocks"
    #: Module path of the module whose output is ``temb`` (hooked with a placeholder when parked).
    time_embedder: ClassVar[str]
    #: Whether the placeholder for ``temb`` must be a tensor of its own (the forward adds to it in
    #: place) rather than a zero-stride view.
    writable_stand_in: ClassVar[bool] = False

    # -- which models --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.family.name

    def recognises(self, model: Any) -> bool:
        """Whether ``model`` is a transformer of this family (by its class name, as diffusers names it)."""
        return isinstance(model, nn.Module) and type(model).__name__ in self.family.class_names

    def spec(self, model: nn.Module, dtype: torch.dtype | None = None) -> ModulationSpec:
        """The model's spec (``dtype``: the projections' output dtype when not their weights')."""
        return ModulationSpec.from_transformer(model, dtype=dtype)

    def model_layers(self, model: nn.Module) -> list[Layer]:
        """The model's served layers, read before its dtype is known (quantized weights have none)."""
        return self.spec(model, torch.float32).layers()

    @property
    def layout(self) -> KeyLayout:
        return self.family.layout(DIFFUSERS)

    # -- where the served modules sit ------------------------------------------------------------

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

    def transformer_blocks(self, model: nn.Module) -> nn.Module:
        """The model's real block list: the captured one while enabled, else the model's attribute."""
        captured = _CAPTURED_BLOCKS.get(model)
        return captured if captured is not None else model.get_submodule(self.blocks_path(model))

    def module_at(self, model: nn.Module, path: str) -> Any:
        """The module at ``path``, reaching blocks through the real block list."""
        head = f"{self.blocks_path(model)}."
        if not path.startswith(head):
            return model.get_submodule(path)
        index, _, rest = path[len(head) :].partition(".")
        block = self.transformer_blocks(model).get_submodule(str(int(index)))
        return block.get_submodule(rest) if rest else block

    def projection_module(self, model: nn.Module, layer: Layer) -> Any:
        """The current module of ``layer``'s projection (peft may have wrapped or replaced it)."""
        return self.module_at(model, self.projection_path(layer))

    def projection_modules(self, model: nn.Module, spec: ModulationSpec) -> list[tuple[Layer, Any]]:
        """``(layer, current module)`` of every projection, in pass order."""
        return [(layer, self.projection_module(model, layer)) for layer in spec.layers()]

    def time_embedder_module(self, model: nn.Module) -> nn.Module:
        """The module whose output is ``temb`` (``time_embedder``'s path by default; a family of
        several classes may put it elsewhere per class)."""
        return model.get_submodule(self.time_embedder)

    def time_embedder_linears(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(path, module)`` of the time embedder's linears that exist on this model."""
        named = []
        for path in self.layout.time_embedder:
            try:
                named.append((path, model.get_submodule(path)))
            except AttributeError:
                continue
        return named

    def served_modules(self, model: nn.Module, spec: ModulationSpec) -> list[tuple[str, Any]]:
        """``(path, current module)`` of every module whose weights shape the served outputs."""
        named: list[tuple[str, Any]] = [
            (self.projection_path(layer), module) for layer, module in self.projection_modules(model, spec)
        ]
        return named + self.time_embedder_linears(model)

    # -- the input and the plan ------------------------------------------------------------------

    def embed(
        self, model: Any, spec: ModulationSpec, plan: torch.Tensor, device: torch.device
    ) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The projections' exact input for ``plan``, as the stock forward computes it, on ``device``."""
        raise NotImplementedError

    def forward_plan(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
        """The plan of one transformer forward, from its arguments (a PlanError when it has none)."""
        raise NotImplementedError

    def request_plan(self, model: nn.Module, plan: Any) -> Any:
        """A plan given to ``prepare`` as the forward will key it (the plan itself by default)."""
        return plan

    def schedule_plans(
        self, model: nn.Module, timesteps: torch.Tensor, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> list[Any] | None:
        """Every step's plan of a pipeline request whose scheduler set ``timesteps``, from its first forward.

        The family's pipelines turn a scheduler timestep into the forward's ``timestep`` their own
        way; ``None`` (the default) when the family's pipelines prepare their plans themselves, or
        when this forward's timestep is none of the computed ones (another pipeline's formula).
        """
        return None

    def predict_schedule(
        self, model: nn.Module, pipeline: Any, call: Mapping[str, Any], component: str
    ) -> list[Any] | None:
        """Every step's plan of a pipeline call, from its arguments, before the pipeline runs.

        ``call``: the call's arguments by name, defaults applied (a ``**kwargs`` parameter's
        entries among them); ``component``: the pipeline's name for ``model`` (``transformer``,
        ``transformer_ref``): ``None`` when this call does not run that one. Lets ``overlap=True`` start the
        pass before the prompt is encoded; the request's first forward compares the prediction with
        the plans of the schedule the scheduler set (:meth:`schedule_plans`), so a wrong one costs
        time, never a row. ``None`` (the default): no prediction for this pipeline.
        """
        return None

    # -- serving -----------------------------------------------------------------------------------

    def swapped_layers(self, spec: ModulationSpec) -> list[Layer]:
        """Layers served by a class swap of their owner module: the blocks' (the rest get a hook)."""
        return [layer for layer in spec.layers() if isinstance(layer, int)]

    def served_forward(self, layer: Layer) -> ServedForward:
        """The forward of ``layer``'s served owner class: by default the layer's rows for its input's rows.

        A family whose owner does more than call the projection (an ``AdaLayerNormZero``: the norm
        and the chunks) returns a forward doing the rest with the rows in place of the projection.
        """
        return rows_forward

    def rows_view(self, cache: Any, layer: Layer) -> torch.Tensor:
        """The ``[P + 1, W, out_features]`` view a served owner of ``layer`` gathers its rows from (the
        poison slot last: what a forward that matched no prepared plan reads)."""
        return cache.served_params(layer)

    def stand_in(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, torch.dtype | None]:
        """Rows and dtype of the ``temb`` the parked time embedder would return for this call.

        ``None`` for the dtype: the time embedder's parameter dtype (read when it was parked).
        By default its first argument has one row per row of ``temb``.
        """
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


__all__ = [
    "DIFFUSERS",
    "DiffusersFamily",
    "ServedForward",
    "check_materialised",
    "diffusers_layout",
    "projection_path",
    "rows_forward",
    "timestep_argument",
]
