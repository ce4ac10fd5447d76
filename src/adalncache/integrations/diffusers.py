"""Serve MiniMax-H3's AdaLN modulation from an :class:`~adalncache.AdalnCache` inside diffusers.

Built the way diffusers builds its own caches (``hooks/text_kv_cache.py``,
``hooks/group_offloading.py``): a config dataclass, one ``enable_*`` entry point, small
``ModelHook`` classes registered under constant names, and a removal path that leaves the model as
it was.

How a forward is served:

- ``AdalnCacheTransformerHook`` wraps the transformer's ``forward``. It reads the step's
  ``timestep`` (the *plan*) once on the host, makes sure the plan is resident for the current LoRA
  signature (building it, or raising with ``on_miss="raise"``), resolves its slot and stashes
  ``(slot, num_timesteps)`` for the per-module hooks; the stash is cleared when the forward ends.
- ``AdalnCacheModulationHook`` replaces the whole ``forward`` of every block's ``adaln_proj``, so it
  serves the block's six modulation tensors whether or not ``adaln_proj.linear`` is a peft wrapper.
- ``AdalnCacheOutputHook`` replaces ``norm_out.linear``'s forward. peft *replaces* that module
  object when a LoRA targets it, so the transformer hook re-checks its identity before each forward
  and moves the hook to whatever module sits there now.
- ``AdalnCacheTimeEmbedderHook`` (when the time embedder is freed) returns a zero-stride
  placeholder of the right shape: every consumer of ``temb`` is served from the cache.

The projection weights (and the time embedder's) become meta tensors on the model, so module
names, ``repr`` and the LoRA loaders keep working while the bytes are gone from the device.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from diffusers.hooks.hooks import HookRegistry, ModelHook
from diffusers.modular_pipelines.modular_pipeline import (
    LoopSequentialPipelineBlocks,
    ModularPipelineBlocks,
)
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam
from torch import nn

from ..errors import CheckpointError, ConfigError, PlanError, PlanNotCachedError
from ..plans import plan_key
from ..spec import FINAL, Layer, ModulationSpec

if TYPE_CHECKING:
    from ..cache import AdalnCache, BuildReport, CacheStats

logger = logging.getLogger(__name__)

_ADALN_CACHE_TRANSFORMER_HOOK = "adaln_cache_transformer"
_ADALN_CACHE_MODULATION_HOOK = "adaln_cache_modulation"
_ADALN_CACHE_OUTPUT_HOOK = "adaln_cache_output"
_ADALN_CACHE_TIME_EMBEDDER_HOOK = "adaln_cache_time_embedder"
_ADALN_CACHE_PREPARE_BLOCK = "adaln_cache_prepare"

#: Instance attributes the handle overrides on the transformer while enabled (removed by disable()).
_GUARDED_METHODS = ("fuse_lora", "unfuse_lora", "load_lora_adapter", "_apply", "to")

_PIPELINE_TRANSFORMERS = ("transformer", "transformer_ref")

OnMiss = Literal["build", "raise"]
CheckpointArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass
class AdalnCacheConfig:
    """Settings of :func:`enable_adaln_cache`.

    Attributes:
        checkpoint: safetensors file, directory or list of files holding the projections (native or
            diffusers layout). ``None`` serves the model's own tensors from host memory.
        on_miss: what a forward does when its plan was not prepared: ``"build"`` builds it (one
            warning per handle), ``"raise"`` raises :class:`~adalncache.PlanNotCachedError`.
        free_time_embedder: also move the time embedder off the device. ``None`` (auto) frees it
            unless another diffusers hook is attached to the model, since such a hook might read
            ``temb``; the AdaLN projections are its only consumers in the stock forward.
        layout: checkpoint layout, ``"auto"``, ``"native"`` or ``"diffusers"``.
        verify_checkpoint: stream the checkpoint once at enable time and refuse it unless its
            projections equal the model's (keep it on: a fine-tune or a fused LoRA must not be
            served from the base file).
        cache_kwargs: forwarded to :class:`~adalncache.AdalnCache` (``max_plans``, ``store``, ...).
    """

    checkpoint: CheckpointArg | None = None
    on_miss: OnMiss = "build"
    free_time_embedder: bool | None = None
    layout: str = "auto"
    verify_checkpoint: bool = True
    cache_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.on_miss not in ("build", "raise"):
            raise ConfigError(f"on_miss must be 'build' or 'raise', got {self.on_miss!r}")
        if self.free_time_embedder not in (None, True, False):
            raise ConfigError(f"free_time_embedder must be None, True or False, got {self.free_time_embedder!r}")


class CheckpointMismatchError(ConfigError, CheckpointError):
    """The checkpoint given to enable_adaln_cache cannot serve this model (a ConfigError and a
    CheckpointError: the setting is wrong because the file does not fit)."""


class _ServeState:
    """What the transformer hook hands the per-module hooks for the forward in progress."""

    def __init__(self) -> None:
        self.slot: torch.Tensor | None = None
        self.num_timesteps = 0
        self.blocks: Sequence[tuple[torch.Tensor, ...]] | None = None

    def clear(self) -> None:
        self.slot = None
        self.num_timesteps = 0
        self.blocks = None

    def require(self, what: str) -> tuple[torch.Tensor, int]:
        if self.slot is None:
            raise ConfigError(
                f"{what} is served by the AdaLN cache and can only run inside the transformer's forward "
                "while the cache is enabled; call handle.disable() to use the module on its own"
            )
        return self.slot, self.num_timesteps


class AdalnCacheTransformerHook(ModelHook):
    """Resolves the step's plan once per forward and stashes its slot for the per-module hooks."""

    def __init__(self, handle: AdalnCacheHandle) -> None:
        super().__init__()
        self.handle = handle

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.handle._begin_forward(args, kwargs)
        try:
            forward: Any = self.fn_ref.original_forward
            return forward(*args, **kwargs)
        finally:
            # Cleared so a stray call outside a forward fails loudly instead of reading stale rows.
            self.handle._state.clear()


class AdalnCacheModulationHook(ModelHook):
    """Serves one block's ``adaln_proj`` output: ``Y.view(-1, 6H).chunk(6, -1)`` from the slab."""

    def __init__(self, handle: AdalnCacheHandle, layer: int) -> None:
        super().__init__()
        self.handle = handle
        self.layer = layer

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        state = self.handle._state
        if state.blocks is not None:
            return tuple(state.blocks[self.layer])
        slot, num_timesteps = state.require(f"transformer_blocks.{self.layer}.adaln_proj")
        return tuple(self.handle.cache.block(self.layer, slot, num_timesteps))


class AdalnCacheOutputHook(ModelHook):
    """Serves ``norm_out.linear``'s output ``Z`` (shift then scale, as the module returns it)."""

    def __init__(self, handle: AdalnCacheHandle) -> None:
        super().__init__()
        self.handle = handle

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        slot, num_timesteps = self.handle._state.require("norm_out.linear")
        shift, scale = self.handle.cache.final(slot, num_timesteps)
        return torch.cat((shift, scale), dim=-1)


class AdalnCacheTimeEmbedderHook(ModelHook):
    """Stands in for a freed time embedder: a zero-stride tensor of the shape and dtype of ``temb``.

    Only the AdaLN projections read ``temb`` in the stock forward and both are served from the
    cache, so its value is never used; a zero-stride view costs no memory.
    """

    def __init__(self, out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_features = out_features
        self.zero = torch.zeros((), dtype=dtype, device=device)

    def new_forward(self, module: nn.Module, sample: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.zero.expand(sample.shape[0], self.out_features)


@dataclass
class _FreedParam:
    """One parameter moved off the model: where it lived and how to bring it back bit-exactly."""

    module: nn.Module
    name: str
    placeholder: nn.Parameter
    original: torch.Tensor | None  # the model's own tensor (CPU) or a host copy; None: re-read from checkpoint
    device: torch.device
    residue: int  # data_ptr % 64 of the original: fp32 GEMV bits depend on it on CPU
    requires_grad: bool
    layer: Layer | None  # projection layer, or None for the time embedder


def _base_linear(module: nn.Module) -> nn.Module:
    """The ``nn.Linear`` under a peft wrapper (or the module itself)."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else module


_TUNER_LAYER: list[type] = []


def _is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft tuner layer (a LoRA wrapper); peft is imported once, lazily."""
    if not _TUNER_LAYER:
        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:  # pragma: no cover - peft is optional
            return False
        _TUNER_LAYER.append(BaseTunerLayer)
    return isinstance(module, _TUNER_LAYER[0])


def _aligned_like(shape: Sequence[int], dtype: torch.dtype, residue: int, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor whose address is ``residue`` modulo 64 (CPU), or a plain one elsewhere.

    Restoring an fp32 weight at a different address modulo 16 changes the bits of an M=1 GEMV on
    CPU (REFERENCE.md section 3), so a weight re-read from a checkpoint goes back where the
    original sat, modulo 64.
    """
    if device.type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    numel = 1
    for size in shape:
        numel *= int(size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    buffer = torch.empty(nbytes + 128, dtype=torch.uint8)
    start = (residue - buffer.data_ptr()) % 64
    return buffer[start : start + nbytes].view(dtype).view(tuple(shape))


def _device_of(model: nn.Module) -> torch.device:
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    raise ConfigError("the model holds no materialised parameter; load it before enabling the AdaLN cache")


def _read_layers(source: Any, layers: Sequence[Layer]) -> Iterator[tuple[Layer, torch.Tensor, torch.Tensor]]:
    """Stream ``layers`` from a weight source into host memory, one at a time (with read-ahead)."""
    for weights in source.stream(list(layers), device=torch.device("cpu")):
        yield weights.layer, weights.weight, weights.bias


def _read_layer(source: Any, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one projection's weight and bias from a weight source (host tensors)."""
    for _, weight, bias in _read_layers(source, [layer]):
        return weight, bias
    raise ConfigError(f"{type(source).__name__} yielded nothing for layer {layer!r}")


class AdalnCacheHandle:
    """The AdaLN cache enabled on one ``MiniMaxH3Transformer3DModel``.

    ``cache`` is the :class:`~adalncache.AdalnCache`; ``prepare(plans)`` builds plans ahead of
    the loop; ``stats`` are the cache's counters; ``disable()`` restores the original modules and
    weights bit-exactly.
    """

    def __init__(self, model: nn.Module, config: AdalnCacheConfig) -> None:
        # Any: a diffusers model whose submodules are reached by attribute, which mypy cannot follow.
        self.model: Any = model
        self.config = config
        self.enabled = False
        self._state = _ServeState()
        self._freed: list[_FreedParam] = []
        self._hooked_output: nn.Module | None = None
        self._hook_handles: list[Any] = []
        self._time_embedder_freed = False
        self._variant: Any = None
        self._variant_refs: list[torch.Tensor] = []
        self._warned_miss = False
        self._merged_at_enable: tuple[Any, ...] = ()
        self._materialize_in_state_dict = True
        self._prepared_plans = 0
        self._host_tensors: dict[tuple[Layer, str], torch.Tensor] = {}
        self._residues: dict[tuple[Layer, str], int] = {}
        self._time_embedder_stack: contextlib.ExitStack | None = None
        self._enabled_fingerprint: str | None = None
        self.spec = ModulationSpec.from_transformer(model)
        self.device = _device_of(model)
        self.source: Any = None
        self.cache: AdalnCache  # set by _enable(), which every constructor of a handle calls

    # ------------------------------------------------------------------ public

    @property
    def stats(self) -> CacheStats:
        """The cache's counters (:class:`~adalncache.CacheStats`)."""
        return self.cache.stats

    def prepare(self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None) -> BuildReport:
        """Make every plan resident for the model's current LoRA state, in at most one pass.

        ``plans``: the per-step ``timestep`` tensors (``minimax_h3_plans`` gives them ahead of
        time) or the pipeline's ``row_timestep_plan`` (``(timestep, timestep_indices)`` pairs).
        ``attention_kwargs``: what the loop will pass the transformer; its ``"scale"`` changes the
        effective LoRA projection, so the tables are built under it.
        """
        self._require_enabled("prepare")
        tensors = [plan[0] if isinstance(plan, (tuple, list)) else plan for plan in plans]
        scale = _lora_scale_of(attention_kwargs)
        report = self._build(tensors, scale)
        self._prepared_plans += len(tensors)
        return report

    def disable(self, *, allow_changed_checkpoint: bool = False) -> None:
        """Remove every hook and override and put the original weights back, bit-exactly.

        Weights served from a checkpoint are read back from it. If the file changed since enabling
        verified it (its stat identity: a rewrite, a rename over it), what it holds now need not be
        the original weights, so this raises CheckpointError before touching anything and the cache
        stays enabled; ``allow_changed_checkpoint=True`` restores from the file as it is now.
        """
        if not self.enabled:
            return
        from_checkpoint = any(freed.original is None for freed in self._freed)
        if from_checkpoint and not allow_changed_checkpoint and self._checkpoint_changed():
            raise CheckpointError(
                f"checkpoint {self.config.checkpoint} changed on disk since enable_adaln_cache() verified it, "
                "so restoring the projection weights from it may not give back the original model; reload "
                "the model, or call disable(allow_changed_checkpoint=True) to restore from the file as it is"
            )
        model = self.model
        registry = HookRegistry.check_if_exists_or_initialize(model)
        registry.remove_hook(_ADALN_CACHE_TRANSFORMER_HOOK, recurse=False)
        for block in model.transformer_blocks:
            _remove_hook(block.adaln_proj, _ADALN_CACHE_MODULATION_HOOK)
        if self._hooked_output is not None:
            _remove_hook(self._hooked_output, _ADALN_CACHE_OUTPUT_HOOK)
            self._hooked_output = None
        _remove_hook(model.time_embedder, _ADALN_CACHE_TIME_EMBEDDER_HOOK)
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for name in _GUARDED_METHODS:
            model.__dict__.pop(name, None)
        self._restore_weights()
        registry.invalidate_child_registries_cache()
        self._state.clear()
        self.enabled = False
        model._adalncache_handle = None
        logger.info("AdaLN cache disabled; projection weights restored")

    def _checkpoint_changed(self) -> bool:
        fingerprint = getattr(self.source, "fingerprint", None)
        try:
            self.source.refresh()
        except CheckpointError:
            return True
        return getattr(self.source, "fingerprint", None) != fingerprint or fingerprint != self._enabled_fingerprint

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        source = type(self.source).__name__ if self.source is not None else None
        return f"AdalnCacheHandle({state}, layers={self.spec.num_layers}, source={source}, device={self.device})"

    # ------------------------------------------------------------------ enabling

    def _enable(self) -> None:
        from ..cache import AdalnCache

        model = self.model
        if getattr(model, "_adalncache_handle", None) is not None:
            raise ConfigError(
                "the AdaLN cache is already enabled on this model; call handle.disable() before enabling again"
            )
        self._check_materialised()
        self._merged_at_enable = self._merged_state()
        cache_kwargs = dict(self.config.cache_kwargs)
        device = torch.device(cache_kwargs.pop("device", self.device))
        same_device = device.type == self.device.type and device.index in (None, self.device.index)
        if not same_device:
            raise ConfigError(
                f"device={device} (CLI --device) differs from the model's device {self.device}: the cache "
                "serves the forward, so it must live where the model runs; move the model first"
            )
        device = self.device
        free_time_embedder = self.config.free_time_embedder
        if free_time_embedder is None:
            free_time_embedder = not self._other_hooks_present()
        if self.config.checkpoint is not None:
            self.source = self._checkpoint_source()
        else:
            self.source = self._tensor_source()
        self._enabled_fingerprint = getattr(self.source, "fingerprint", None)
        self.cache = AdalnCache(self.spec, self.source, device=device, **cache_kwargs)
        # From here on the model is modified; undo everything if a step fails.
        try:
            self._free_weights(free_time_embedder, keep_originals=self.config.checkpoint is None)
            self._register_hooks()
        except BaseException:
            self.enabled = True
            self.disable()
            raise
        model._adalncache_handle = self
        self.enabled = True
        logger.info(
            "AdaLN cache enabled on %s: %d projections (%.1f MB) served from the cache, source %s",
            type(model).__name__,
            self.spec.num_layers + 1,
            self.spec.projection_bytes / 1e6,
            type(self.source).__name__,
        )

    def _check_materialised(self) -> None:
        for _, module in self._projection_modules():
            base = _base_linear(module)
            for name in ("weight", "bias"):
                param = getattr(base, name, None)
                if param is None or param.device.type == "meta":
                    raise ConfigError(
                        "the model's AdaLN projections are not materialised (meta or missing bias): load "
                        "the model fully before enabling the AdaLN cache"
                    )

    def _other_hooks_present(self) -> bool:
        for _, module in self.model.named_modules():
            registry = getattr(module, "_diffusers_hook", None)
            if registry is not None and any(
                not name.startswith("adaln_cache") for name in getattr(registry, "_hook_order", [])
            ):
                return True
        return False

    def _projection_modules(self) -> list[tuple[Layer, Any]]:
        """(layer, current linear module) for every projection; peft may have wrapped them."""
        model = self.model
        modules: list[tuple[Layer, Any]] = [
            (index, block.adaln_proj.linear) for index, block in enumerate(model.transformer_blocks)
        ]
        modules.append((FINAL, model.norm_out.linear))
        return modules

    def _time_embedder_linears(self) -> list[Any]:
        time_embedder = self.model.time_embedder
        return [
            child
            for child in (getattr(time_embedder, "linear_1", None), getattr(time_embedder, "linear_2", None))
            if isinstance(child, nn.Module)
        ]

    def _tensor_source(self) -> Any:
        from ..source import TensorSource

        tensors: dict[str, torch.Tensor] = {}
        self._host_tensors.clear()
        pin = self.device.type == "cuda"
        for layer, module in self._projection_modules():
            base = _base_linear(module)
            prefix = "norm_out.linear" if layer == FINAL else f"transformer_blocks.{layer}.adaln_proj.linear"
            for name in ("weight", "bias"):
                tensor = getattr(base, name).detach()
                if tensor.device.type != "cpu":
                    # Off the device into host memory; pinned so rebuild passes copy at full speed.
                    tensor = tensor.to("cpu", copy=True)
                    if pin:
                        tensor = tensor.pin_memory()
                tensors[f"{prefix}.{name}"] = tensor
                self._host_tensors[(layer, name)] = tensor
        return TensorSource(tensors, self.spec)

    def _checkpoint_source(self) -> Any:
        from ..source import CheckpointSource

        checkpoint = self.config.checkpoint
        paths: Any = checkpoint
        if isinstance(checkpoint, Sequence) and not isinstance(checkpoint, (str, bytes)):
            paths = [os.fspath(path) for path in checkpoint]
        elif checkpoint is not None:
            paths = os.fspath(checkpoint)
        try:
            source = CheckpointSource(paths, self.spec, layout=self.config.layout)
        except CheckpointError as exc:
            # Missing, misshapen or other-dtype projections: this checkpoint cannot serve this model.
            raise CheckpointMismatchError(
                f"checkpoint= (CLI --checkpoint) does not match the model ({self.spec.dtype} projections of "
                f"{self.spec.num_layers} blocks): {exc}"
            ) from exc
        if self.config.verify_checkpoint:
            self._verify_checkpoint(source)
        return source

    def _verify_checkpoint(self, source: Any) -> None:
        """Stream the checkpoint one layer at a time and refuse it unless it equals the model."""
        modules = dict(self._projection_modules())
        for layer, weight, bias in _read_layers(source, self.spec.layers()):
            base = _base_linear(modules[layer])
            where = "norm_out.linear" if layer == FINAL else f"transformer_blocks.{layer}.adaln_proj.linear"
            for name, theirs in (("weight", weight), ("bias", bias)):
                ours = getattr(base, name).detach()
                same = theirs.dtype == ours.dtype and theirs.shape == ours.shape
                same = same and torch.equal(theirs.to(ours.device), ours)
                if not same:
                    raise ConfigError(
                        f"checkpoint= (CLI --checkpoint) does not match the model: {where}.{name} differs "
                        f"(checkpoint {theirs.dtype} {tuple(theirs.shape)}, model {ours.dtype} "
                        f"{tuple(ours.shape)}). A fine-tuned model or one with a fused LoRA must not be "
                        "served from the base file; pass checkpoint=None to serve the model's own weights, "
                        "or the checkpoint it was loaded from"
                    )

    def _free_weights(self, free_time_embedder: bool, *, keep_originals: bool) -> None:
        on_cpu = self.device.type == "cpu"
        targets: list[tuple[nn.Module, Layer | None]] = [
            (_base_linear(module), layer) for layer, module in self._projection_modules()
        ]
        if free_time_embedder:
            targets.extend((_base_linear(linear), None) for linear in self._time_embedder_linears())
        for base, layer in targets:
            for name in ("weight", "bias"):
                param = base._parameters.get(name)
                if param is None:
                    continue
                original: torch.Tensor | None
                if layer is not None and not keep_originals:
                    original = None  # re-read from the (verified) checkpoint on disable
                elif on_cpu:
                    original = param  # the very object: same storage, same alignment
                elif layer is not None:
                    original = self._host_tensors[(layer, name)]  # the TensorSource's host copy
                else:
                    original = param.detach().to("cpu", copy=True)
                if layer is not None:
                    self._residues[(layer, name)] = param.data_ptr() % 64
                placeholder = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                self._freed.append(
                    _FreedParam(
                        module=base,
                        name=name,
                        placeholder=placeholder,
                        original=original,
                        device=param.device,
                        residue=param.data_ptr() % 64,
                        requires_grad=param.requires_grad,
                        layer=layer,
                    )
                )
                base._parameters[name] = placeholder
            # torch tags hook callables with attributes, which bound methods do not take: wrap them.
            self._hook_handles.append(base.register_state_dict_post_hook(_as_function(self._state_dict_hook)))
            self._hook_handles.append(base.register_load_state_dict_pre_hook(_as_function(self._load_state_dict_hook)))
        self._time_embedder_freed = free_time_embedder

    def _register_hooks(self) -> None:
        model = self.model
        registry = HookRegistry.check_if_exists_or_initialize(model)
        registry.register_hook(AdalnCacheTransformerHook(self), _ADALN_CACHE_TRANSFORMER_HOOK)
        for index, block in enumerate(model.transformer_blocks):
            HookRegistry.check_if_exists_or_initialize(block.adaln_proj).register_hook(
                AdalnCacheModulationHook(self, index), _ADALN_CACHE_MODULATION_HOOK
            )
        self._sync_output_hook()
        if self._time_embedder_freed:
            from diffusers.models.modeling_utils import get_parameter_dtype

            time_embedder = model.time_embedder
            linear_2: Any = _base_linear(time_embedder.linear_2)
            out_features = int(linear_2.out_features)
            HookRegistry.check_if_exists_or_initialize(time_embedder).register_hook(
                AdalnCacheTimeEmbedderHook(out_features, get_parameter_dtype(time_embedder), self.device),
                _ADALN_CACHE_TIME_EMBEDDER_HOOK,
            )
        for name in _GUARDED_METHODS:
            model.__dict__[name] = getattr(self, f"_guard_{name}")
        registry.invalidate_child_registries_cache()

    # ------------------------------------------------------------------ per forward

    def _require_enabled(self, what: str) -> None:
        if not self.enabled:
            raise ConfigError(f"{what}() needs the AdaLN cache enabled; this handle was disabled")

    def _sync_output_hook(self) -> None:
        """Keep the output hook on whatever module is ``norm_out.linear`` now (peft swaps it)."""
        current = self.model.norm_out.linear
        if current is self._hooked_output:
            return
        if self._hooked_output is not None:
            _remove_hook(self._hooked_output, _ADALN_CACHE_OUTPUT_HOOK)
        HookRegistry.check_if_exists_or_initialize(current).register_hook(
            AdalnCacheOutputHook(self), _ADALN_CACHE_OUTPUT_HOOK
        )
        self._hooked_output = current
        HookRegistry.check_if_exists_or_initialize(self.model).invalidate_child_registries_cache()

    def _sync(self, tuners: Sequence[tuple[str, Any]]) -> None:
        """Before any build or serve: output hook on the live module, no fuse/unfuse since enabling."""
        self._sync_output_hook()
        merged = self._merged_state(tuners)
        if merged != self._merged_at_enable:
            raise ConfigError(
                "a LoRA was fused into (or unfused from) the AdaLN projections or the time embedder while "
                "the AdaLN cache is enabled; call handle.disable() first, fuse or unfuse, then enable "
                "again"
            )

    def _merged_state(self, tuners: Sequence[tuple[str, Any]] | None = None) -> tuple[Any, ...]:
        """Which served modules have which adapters fused into their (base) weights."""
        if tuners is None:
            tuners = self._tuner_modules()
        return tuple((name, tuple(module.merged_adapters)) for name, module in tuners if module.merged_adapters)

    def _tuner_modules(self) -> list[tuple[str, Any]]:
        """The served modules that are peft LoRA wrappers right now (usually none)."""
        return [(name, module) for name, module in self._lora_modules() if _is_tuner_layer(module)]

    def _lora_modules(self) -> list[tuple[str, Any]]:
        """Every module whose LoRA shapes the served outputs (current objects)."""
        named: list[tuple[str, Any]] = [
            ("norm_out.linear" if layer == FINAL else f"transformer_blocks.{layer}.adaln_proj.linear", module)
            for layer, module in self._projection_modules()
        ]
        for index, linear in enumerate(self._time_embedder_linears()):
            named.append((f"time_embedder.linear_{index + 1}", linear))
        return named

    def _signature(self, tuners: Sequence[tuple[str, Any]]) -> tuple[tuple[Any, ...] | None, list[torch.Tensor]]:
        """The LoRA signature of the served modules, and the adapter tensors it names.

        Everything that shapes the effective projection: the active adapters, whether adapters are
        disabled or merged, each adapter's scaling (which already includes a set_adapters weight and
        the attention_kwargs scale when computed under :func:`_applied_lora_scale`), and the
        identity and in-place version of every adapter tensor. The tensors are returned so the
        handle can keep them alive: an address cannot be reused by a new adapter while the
        signature that names it is held.
        """
        entries: list[tuple[Any, ...]] = []
        refs: list[torch.Tensor] = []
        for name, module in tuners:
            tensors = []
            for param_name, param in module.named_parameters():
                if param_name.startswith("base_layer."):
                    continue
                refs.append(param)
                tensors.append(
                    (
                        param_name,
                        id(param),
                        param.data_ptr(),
                        param._version,
                        tuple(param.shape),
                        str(param.dtype),
                    )
                )
            entries.append(
                (
                    name,
                    tuple(module.active_adapters),
                    bool(module.disable_adapters),
                    tuple(module.merged_adapters),
                    tuple(sorted((k, float(v)) for k, v in getattr(module, "scaling", {}).items())),
                    tuple(tensors),
                )
            )
        return (tuple(entries) if entries else None), refs

    def _begin_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        timestep = _argument(self.model, "timestep", args, kwargs)
        if not isinstance(timestep, torch.Tensor):
            raise PlanError(f"the AdaLN cache needs the forward's timestep tensor, got {type(timestep).__name__}")
        attention_kwargs = _argument(self.model, "attention_kwargs", args, kwargs)
        scale = _lora_scale_of(attention_kwargs)
        if timestep.dtype != torch.float32 or timestep.dim() != 1:
            # Converting here would build tables for other timestep values than time_proj will see.
            raise PlanError(
                f"the AdaLN cache serves 1-D float32 timesteps (MiniMax-H3's distinct timesteps of the step), got "
                f"shape {tuple(timestep.shape)} and dtype {timestep.dtype}; pass timestep as a 1-D float32 tensor"
            )
        # The one device-to-host read of the plan this forward makes: keys, lookups and the build all
        # use this host copy (embed moves it back to the device; the values are the same bits).
        plan = timestep.detach().to("cpu")
        key = plan_key(plan)
        tuners, variant, refs = self._current_signature(scale)
        if self.config.on_miss == "raise":
            if variant != self._variant:
                raise PlanNotCachedError(
                    "the AdaLN cache does not cover this forward: the LoRA state of the AdaLN projections "
                    "changed since the tables were built; call handle.prepare(plans) (on_miss='raise')"
                )
            try:
                self.cache.lookup(plan, key=key)
            except PlanNotCachedError as exc:
                raise PlanNotCachedError(
                    f"{exc}; call handle.prepare(plans) before the loop, or enable with on_miss='build'"
                ) from None
            report = self._run_build([plan], scale, variant, refs, tuners)
        else:
            report = self._run_build([plan], scale, variant, refs, tuners)
            if report.passes:
                message = (
                    "AdaLN cache: a forward's plan was not prepared and was built on the spot (one "
                    "rebuild pass); call handle.prepare(plans) before the loop to build all steps in one "
                    "pass"
                )
                if not self._warned_miss:
                    logger.warning(message)
                    self._warned_miss = True
                else:
                    logger.info(message)
        slots = self.cache.resolve_slots([plan], keys=[key])
        slot = slots[0]
        self._state.slot = slot
        self._state.num_timesteps = int(plan.numel())
        # One gather for every layer when the cache offers it (one kernel instead of L on a GPU).
        block_all = getattr(self.cache, "block_all", None)
        blocks = block_all(slot, int(plan.numel())) if callable(block_all) else None
        usable = isinstance(blocks, (list, tuple)) and len(blocks) == self.spec.num_layers
        self._state.blocks = blocks if usable else None

    # ------------------------------------------------------------------ building

    def _current_signature(
        self, scale: float
    ) -> tuple[list[tuple[str, Any]], tuple[Any, ...] | None, list[torch.Tensor]]:
        """Sync the hooks, check for fuses, and read the LoRA signature the forward will run under."""
        tuners = self._tuner_modules()
        self._sync(tuners)
        with _applied_lora_scale(tuners, scale):
            variant, refs = self._signature(tuners)
        return tuners, variant, refs

    def _build(self, plans: Sequence[torch.Tensor], scale: float) -> BuildReport:
        tuners, variant, refs = self._current_signature(scale)
        return self._run_build(plans, scale, variant, refs, tuners)

    def _run_build(
        self,
        plans: Sequence[torch.Tensor],
        scale: float,
        variant: Any,
        refs: list[torch.Tensor],
        tuners: Sequence[tuple[str, Any]],
    ) -> BuildReport:
        if variant is not None and self.cache.shard == "columns" and self.cache.world_size > 1:
            # The adapter's forward runs on the whole projection; a rank's column slice of the base
            # weight cannot go through it (it would fail later with an unhelpful shape error).
            raise ConfigError(
                "LoRA adapters on the AdaLN projections need shard='layers' (CLI --shard layers): with "
                "shard='columns' each rank holds a column slice of the base weight, which the adapter's "
                "full-width forward cannot run on; unload the adapter or build with shard='layers'"
            )
        # The time embedder (when freed) is put back lazily by the first embed of a pass and taken
        # off again when the build returns, so a build that hits costs no copy.
        with contextlib.ExitStack() as stack, torch.no_grad(), _applied_lora_scale(tuners, scale):
            self._time_embedder_stack = stack
            try:
                report = self.cache.build(plans, embed=self._embed, project=self._project, variant=variant)
            finally:
                self._time_embedder_stack = None
        if variant != self._variant:
            logger.info("AdaLN cache: tables rebuilt for a new LoRA signature")
        self._variant = variant
        self._variant_refs = refs
        return report

    def _embed(self, plan: torch.Tensor) -> torch.Tensor:
        """The projections' exact input for ``plan``, computed as the stock forward computes it.

        ``time_proj``, then the (fp32) time embedder at its own dtype, then SiLU at ``temb``'s
        precision and only then the cast to the projection dtype (the other order changes about
        half the outputs). Runs the time embedder's own (possibly LoRA-wrapped) forward.
        """
        from diffusers.models.modeling_utils import get_parameter_dtype

        model = self.model
        self._materialize_time_embedder()
        timestep = plan.to(self.device)
        temb = model.time_proj(timestep)
        time_embedder = model.time_embedder
        temb = _call_unhooked(time_embedder, _ADALN_CACHE_TIME_EMBEDDER_HOOK)(
            temb.to(get_parameter_dtype(time_embedder))
        )
        return F.silu(temb).to(self._projection_dtype())

    def _projection_dtype(self) -> torch.dtype:
        from diffusers.models.modeling_utils import get_parameter_dtype

        dtypes = {get_parameter_dtype(module) for _, module in self._projection_modules()}
        if len(dtypes) != 1:
            raise ConfigError(
                f"the AdaLN projections do not share one dtype ({sorted(map(str, dtypes))}); the cache "
                "serves one embedding to all of them, so cast the model consistently before enabling"
            )
        return dtypes.pop()

    def _project(self, layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``layer``'s output for ``x``, through the module's own (possibly LoRA-wrapped) forward."""
        if layer == FINAL:
            module = self.model.norm_out.linear
            call = _call_unhooked(module, _ADALN_CACHE_OUTPUT_HOOK)
        else:
            module = self.model.transformer_blocks[int(layer)].adaln_proj.linear
            call = module
        base = _base_linear(module)
        weight = self._aligned_like_model(layer, "weight", weight)
        bias = self._aligned_like_model(layer, "bias", bias)
        with _swapped_parameters(base, {"weight": weight, "bias": bias}):
            return call(x)  # type: ignore[no-any-return]

    def _aligned_like_model(self, layer: Layer, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or an aligned copy of it when the model held it elsewhere modulo 64 bytes.

        On CPU an fp32 GEMV (M=1) gives different bits for the same weight at a different address
        modulo 16 (REFERENCE.md section 3). A checkpoint maps its tensors at the file's offsets,
        which need not be where the resident model kept them (say a model built in memory served
        from its ``save_pretrained`` file), so such a weight is copied to the model's residue. bf16
        showed no such effect at any M and is used as it is (no copy of 24 GiB per pass).
        """
        if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.float16):
            return tensor
        residue = self._residues.get((layer, name))
        if residue is None or tensor.data_ptr() % 64 == residue:
            return tensor
        copy = _aligned_like(tensor.shape, tensor.dtype, residue, tensor.device)
        copy.copy_(tensor)
        return copy

    def _materialize_time_embedder(self) -> None:
        """Put the time embedder's real weights back for the rest of the current build."""
        stack = self._time_embedder_stack
        if not self._time_embedder_freed or stack is None or getattr(stack, "_adalncache_done", False):
            return
        swaps: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for freed in self._freed:
            if freed.layer is None and freed.original is not None:
                tensor = freed.original
                if tensor.device != self.device:
                    tensor = tensor.to(self.device, non_blocking=True)
                swaps.setdefault(freed.module, {})[freed.name] = tensor
        for module, tensors in swaps.items():
            stack.enter_context(_swapped_parameters(module, tensors))
        stack._adalncache_done = True  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ guards and state_dict

    def _guard_fuse_lora(self, *args: Any, **kwargs: Any) -> Any:
        if any(_is_tuner_layer(module) for _, module in self._lora_modules()):
            raise ConfigError(
                "fuse_lora() would fuse a LoRA into the AdaLN projections or the time embedder while the "
                "AdaLN cache serves them from tables; call handle.disable() first, fuse, then enable "
                "again"
            )
        return type(self.model).fuse_lora(self.model, *args, **kwargs)

    def _guard__apply(self, *args: Any, **kwargs: Any) -> Any:
        """``.to()``, ``.cuda()``, ``.half()``... while enabled: refuse, the cache lives on one device.

        Without this the meta placeholders would fail deep inside torch ("Cannot copy out of meta
        tensor"), or a dtype cast would silently leave the tables at the old dtype.
        """
        raise ConfigError(
            "the model cannot be moved or cast while the AdaLN cache is enabled (its tables live on "
            f"{self.device} in {self.spec.dtype}); call handle.disable(), move or cast the model, then "
            "enable again"
        )

    def _guard_to(self, *args: Any, **kwargs: Any) -> Any:
        """Let a no-op ``.to()`` through (pipelines call ``pipe.to(device)`` freely); refuse a real move."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        moves = device is not None and not (
            torch.device(device).type == self.device.type and torch.device(device).index in (None, self.device.index)
        )
        if moves or dtype is not None:
            self._guard__apply()
        return self.model

    def _guard_unfuse_lora(self, *args: Any, **kwargs: Any) -> Any:
        if any(_is_tuner_layer(module) for _, module in self._lora_modules()):
            raise ConfigError(
                "unfuse_lora() would change the AdaLN projections or the time embedder while the AdaLN "
                "cache serves them from tables; call handle.disable() first, unfuse, then enable again"
            )
        return type(self.model).unfuse_lora(self.model, *args, **kwargs)

    def _guard_load_lora_adapter(self, *args: Any, **kwargs: Any) -> Any:
        """Load a LoRA with device-resident placeholders, so peft puts the adapter where the model runs.

        peft moves a new adapter to its base layer's device; a meta base would leave the adapter
        on meta, weights lost. Zero-stride placeholders on the model's device (no memory) stand in
        for the duration of the load; the next forward sees the new signature and rebuilds.
        """
        self._materialize_in_state_dict = False
        swaps: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for freed in self._freed:
            stand_in = torch.zeros((), dtype=freed.placeholder.dtype, device=freed.device).expand(
                freed.placeholder.shape
            )
            swaps.setdefault(freed.module, {})[freed.name] = stand_in
        try:
            with contextlib.ExitStack() as stack:
                for module, tensors in swaps.items():
                    stack.enter_context(_swapped_parameters(module, tensors))
                result = type(self.model).load_lora_adapter(self.model, *args, **kwargs)
        finally:
            self._materialize_in_state_dict = True
        self._sync_output_hook()
        return result

    def _freed_entry(self, module: nn.Module, name: str) -> _FreedParam | None:
        for freed in self._freed:
            if freed.module is module and freed.name == name:
                return freed
        return None

    def _real_tensor(self, freed: _FreedParam) -> torch.Tensor:
        if freed.original is not None:
            return freed.original.detach()
        assert freed.layer is not None  # only projections are checkpoint-backed
        weight, bias = _read_layer(self.source, freed.layer)
        return weight if freed.name == "weight" else bias

    def _state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Put the real weights into ``state_dict`` so save_pretrained never writes a model without them."""
        for name in ("weight", "bias"):
            key = prefix + name
            freed = self._freed_entry(module, name)
            if freed is None or key not in state_dict:
                continue
            if not self._materialize_in_state_dict:
                continue  # a LoRA loader only reads the keys
            state_dict[key] = self._real_tensor(freed)

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
            if prefix + name in state_dict and self._freed_entry(module, name) is not None:
                raise ConfigError(
                    f"load_state_dict() would overwrite {prefix}{name}, which the AdaLN cache serves from "
                    "tables; call handle.disable() first, load, then enable again"
                )
        return None

    def _restore_weights(self) -> None:
        # Checkpoint-backed weights are read back in one streaming pass (verified equal at enable).
        reread: dict[tuple[Layer, str], torch.Tensor] = {}
        layers = sorted(
            {f.layer for f in self._freed if f.original is None and f.layer is not None},
            key=lambda layer: self.spec.layers().index(layer),
        )
        if layers:
            for layer, weight, bias in _read_layers(self.source, layers):
                reread[(layer, "weight")], reread[(layer, "bias")] = weight, bias
        for freed in reversed(self._freed):
            if freed.original is not None and freed.original.device == freed.device:
                tensor = freed.original
            else:
                source_tensor = freed.original
                if source_tensor is None:
                    assert freed.layer is not None  # only projections are checkpoint-backed
                    source_tensor = reread[(freed.layer, freed.name)]
                tensor = _aligned_like(source_tensor.shape, source_tensor.dtype, freed.residue, freed.device)
                tensor.copy_(source_tensor)
            param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, freed.requires_grad)
            freed.module._parameters[freed.name] = param
        self._freed.clear()
        self._time_embedder_freed = False


# ---------------------------------------------------------------------------------------------- helpers


def _as_function(method: Callable[..., Any]) -> Callable[..., Any]:
    def function(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return function


def _remove_hook(module: nn.Module, name: str) -> None:
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(name) is not None:
        registry.remove_hook(name, recurse=False)


def _call_unhooked(module: nn.Module, hook_name: str) -> Callable[..., Any]:
    """``module``'s forward beneath our hook (the module's own, possibly LoRA-wrapped, forward)."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook(hook_name) if registry is not None else None
    if hook is None:
        return module
    return hook.fn_ref.original_forward  # type: ignore[no-any-return]


@contextlib.contextmanager
def _swapped_parameters(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily give ``module`` other tensors as parameters, without copying them.

    Set through ``_parameters`` so the tensors are used as they are (same storage, same address:
    the alignment the exactness depends on), and put back even if the forward raises.
    """
    saved = {name: module._parameters.get(name) for name in tensors}
    try:
        for name, tensor in tensors.items():
            module._parameters[name] = tensor  # type: ignore[assignment]
        yield
    finally:
        for name, param in saved.items():
            module._parameters[name] = param


@contextlib.contextmanager
def _applied_lora_scale(modules: Sequence[tuple[str, Any]], scale: float) -> Iterator[None]:
    """Apply ``attention_kwargs["scale"]`` to the served modules as ``@apply_lora_scale`` would.

    The transformer hook runs outside the decorated forward, so the scaling the forward will use
    is reproduced here with peft's own ``scale_layer`` (the same float operations), and the exact
    previous values are restored afterwards (not divided back, which could drift by an ulp).
    """
    from diffusers.utils import USE_PEFT_BACKEND

    if scale == 1.0 or not USE_PEFT_BACKEND:
        yield
        return
    layers = [module for _, module in modules if _is_tuner_layer(module)]  # callers pass tuners
    saved = [dict(module.scaling) for module in layers]
    try:
        for module in layers:
            module.scale_layer(scale)
        yield
    finally:
        for module, values in zip(layers, saved):
            module.scaling.clear()
            module.scaling.update(values)


def _lora_scale_of(attention_kwargs: Mapping[str, Any] | None) -> float:
    if attention_kwargs is None:
        return 1.0
    return float(attention_kwargs.get("scale", 1.0))


_FORWARD_PARAMETERS: dict[type, list[str]] = {}


def _argument(model: nn.Module, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
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


# ---------------------------------------------------------------------------------------------- pipelines


class AdalnCachePrepareStep(ModularPipelineBlocks):
    """Denoise-loop block that builds a request's whole ``row_timestep_plan`` before step 0.

    Inserted in front of each MiniMax-H3 loop denoiser by :func:`enable_adaln_cache`. At the first
    iteration it hands every step's plan to the denoiser's transformer's cache in one ``prepare``
    call (at most one rebuild pass; none when the plans are resident), so no step waits on a build.
    A transformer without an enabled cache makes it a no-op.
    """

    model_name = "minimax-h3"  # type: ignore[assignment]

    def __init__(self, transformer_name: str = "transformer") -> None:
        self.transformer_name = transformer_name
        super().__init__()

    @property
    def description(self) -> str:
        return (
            "Builds the AdaLN tables of every step of the request in one pass before the first denoising "
            "step (adalncache)."
        )

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam(
                name="row_timestep_plan",
                type_hint=list,
                required=True,
                description="One `(timestep, timestep_indices)` pair per step.",
            ),
            InputParam.template("attention_kwargs"),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return []

    @torch.no_grad()
    def __call__(self, components: Any, block_state: Any, i: int, t: torch.Tensor) -> tuple[Any, Any]:
        if i == 0:
            transformer = getattr(components, self.transformer_name, None)
            handle = getattr(transformer, "_adalncache_handle", None)
            if isinstance(handle, AdalnCacheHandle) and handle.enabled:
                handle.prepare(block_state.row_timestep_plan, attention_kwargs=block_state.attention_kwargs)
        return components, block_state


def _denoise_loops(blocks: Any) -> Iterator[LoopSequentialPipelineBlocks]:
    """Every loop block in a block tree whose sub-blocks include a MiniMax-H3 loop denoiser."""
    if isinstance(blocks, LoopSequentialPipelineBlocks):
        if any(hasattr(block, "transformer_name") for block in blocks.sub_blocks.values()):
            yield blocks
        return
    for block in getattr(blocks, "sub_blocks", {}).values():
        yield from _denoise_loops(block)


class PipelineAdalnCacheHandle:
    """The AdaLN cache enabled on a MiniMax-H3 modular pipeline: one handle per transformer.

    ``handles`` maps component names (``transformer``, ``transformer_ref``) to their
    :class:`AdalnCacheHandle`; indexing works too (``handle["transformer"]``). ``cache`` and
    ``stats`` are those of the only transformer when there is one, else dicts by name.
    """

    def __init__(self, pipeline: Any, handles: dict[str, AdalnCacheHandle]) -> None:
        self.pipeline = pipeline
        self.handles = handles
        self._inserted: list[tuple[LoopSequentialPipelineBlocks, str]] = []

    def __getitem__(self, name: str) -> AdalnCacheHandle:
        return self.handles[name]

    @property
    def enabled(self) -> bool:
        return any(handle.enabled for handle in self.handles.values())

    @property
    def cache(self) -> Any:
        if len(self.handles) == 1:
            return next(iter(self.handles.values())).cache
        return {name: handle.cache for name, handle in self.handles.items()}

    @property
    def stats(self) -> Any:
        if len(self.handles) == 1:
            return next(iter(self.handles.values())).stats
        return {name: handle.stats for name, handle in self.handles.items()}

    def prepare(
        self,
        plans: Sequence[Any],
        *,
        attention_kwargs: Mapping[str, Any] | None = None,
        component: str | None = None,
    ) -> Any:
        """Prepare ``plans`` on one component's cache (``component``) or on every one."""
        if component is not None:
            if component not in self.handles:
                raise ConfigError(
                    f"component={component!r} has no AdaLN cache on this pipeline; choose one of {sorted(self.handles)}"
                )
            return self.handles[component].prepare(plans, attention_kwargs=attention_kwargs)
        reports = {
            name: handle.prepare(plans, attention_kwargs=attention_kwargs) for name, handle in self.handles.items()
        }
        return next(iter(reports.values())) if len(reports) == 1 else reports

    def disable(self, *, allow_changed_checkpoint: bool = False) -> None:
        """Remove the inserted loop blocks and disable every transformer's cache."""
        for loop, key in self._inserted:
            if key in loop.sub_blocks:
                del loop.sub_blocks[key]
        self._inserted.clear()
        for handle in self.handles.values():
            handle.disable(allow_changed_checkpoint=allow_changed_checkpoint)

    def _insert_prepare_blocks(self) -> None:
        blocks = getattr(self.pipeline, "_blocks", None)
        if blocks is None:
            return
        for loop in _denoise_loops(blocks):
            if _ADALN_CACHE_PREPARE_BLOCK in loop.sub_blocks:
                continue
            names = list(loop.sub_blocks)
            index, denoiser = next(
                (i, loop.sub_blocks[name])
                for i, name in enumerate(names)
                if hasattr(loop.sub_blocks[name], "transformer_name")
            )
            step = AdalnCachePrepareStep(transformer_name=denoiser.transformer_name)
            loop.sub_blocks.insert(_ADALN_CACHE_PREPARE_BLOCK, step, index)
            self._inserted.append((loop, _ADALN_CACHE_PREPARE_BLOCK))

    def __repr__(self) -> str:
        return f"PipelineAdalnCacheHandle({', '.join(f'{n}={h!r}' for n, h in self.handles.items())})"


# ---------------------------------------------------------------------------------------------- entry point


def _is_minimax_h3_transformer(module: Any) -> bool:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return isinstance(module, MiniMaxH3Transformer3DModel)


def enable_adaln_cache(
    model_or_pipeline: Any,
    checkpoint: CheckpointArg | Mapping[str, CheckpointArg] | None = None,
    *,
    on_miss: OnMiss = "build",
    free_time_embedder: bool | None = None,
    layout: str = "auto",
    verify_checkpoint: bool = True,
    **cache_kwargs: Any,
) -> AdalnCacheHandle | PipelineAdalnCacheHandle:
    """Serve the AdaLN modulation of a MiniMax-H3 transformer (or pipeline) from bit-exact tables.

    The projection weights of every block's ``adaln_proj.linear`` and of ``norm_out.linear`` (and,
    unless another hook might read ``temb``, the time embedder's) leave the device; meta
    placeholders of the right shape keep module names, ``repr`` and the LoRA loaders working.

    Args:
        model_or_pipeline: a ``MiniMaxH3Transformer3DModel`` or a MiniMax-H3 modular pipeline
            (its ``transformer`` and ``transformer_ref``, each with its own cache).
        checkpoint: the safetensors file(s) or directory holding the projections (native or
            diffusers layout); for a pipeline with both transformers, a mapping by component name.
            Enabling streams it once and refuses it (``ConfigError``) unless its projections equal
            the model's. ``None``: the model's own tensors move to host memory and are the source.
        on_miss: ``"build"`` builds an unprepared plan at its first forward (warning once);
            ``"raise"`` raises ``PlanNotCachedError`` instead.
        **cache_kwargs: forwarded to ``AdalnCache`` (``max_plans``, ``max_plan_width``,
            ``host_cache_bytes``, ``store``, ``precision``...). ``device`` defaults to the model's.

    Returns:
        A handle with ``.cache``, ``.prepare(plans)``, ``.stats`` and ``.disable()``.
    """

    def config_for(path: CheckpointArg | None) -> AdalnCacheConfig:
        # One config per served transformer; only the checkpoint differs between them.
        return AdalnCacheConfig(
            checkpoint=path,
            on_miss=on_miss,
            free_time_embedder=free_time_embedder,
            layout=layout,
            verify_checkpoint=verify_checkpoint,
            cache_kwargs=dict(cache_kwargs),
        )

    if _is_minimax_h3_transformer(model_or_pipeline):
        if isinstance(checkpoint, Mapping):
            raise ConfigError(
                "checkpoint= is a mapping by component name, which only a pipeline takes; pass one path "
                "for a single transformer"
            )
        handle = AdalnCacheHandle(model_or_pipeline, config_for(checkpoint))
        handle._enable()
        return handle

    components: dict[str, Any] = {
        name: getattr(model_or_pipeline, name, None)
        for name in _PIPELINE_TRANSFORMERS
        if _is_minimax_h3_transformer(getattr(model_or_pipeline, name, None))
    }
    if not components:
        raise ConfigError(
            "enable_adaln_cache needs a MiniMaxH3Transformer3DModel or a MiniMax-H3 modular pipeline "
            f"holding `transformer` or `transformer_ref`, got {type(model_or_pipeline).__name__}"
        )
    checkpoints: dict[str, CheckpointArg | None]
    if isinstance(checkpoint, Mapping):
        unknown = sorted(set(checkpoint) - set(components))
        if unknown:
            raise ConfigError(
                f"checkpoint= names {unknown}, which this pipeline does not hold; use {sorted(components)}"
            )
        checkpoints = {name: checkpoint.get(name) for name in components}
    elif checkpoint is not None and len(components) > 1:
        raise ConfigError(
            "checkpoint= is one path but the pipeline holds both transformer and transformer_ref, which "
            "are different checkpoints; pass {'transformer': ..., 'transformer_ref': ...}"
        )
    else:
        checkpoints = {name: checkpoint for name in components}
    handles: dict[str, AdalnCacheHandle] = {}
    try:
        for name, model in components.items():
            handle = AdalnCacheHandle(model, config_for(checkpoints[name]))
            handle._enable()
            handles[name] = handle
    except BaseException:
        for handle in handles.values():
            handle.disable()
        raise
    pipeline_handle = PipelineAdalnCacheHandle(model_or_pipeline, handles)
    pipeline_handle._insert_prepare_blocks()
    return pipeline_handle


def adaln_cache_handle(model: nn.Module) -> AdalnCacheHandle | None:
    """The enabled handle of ``model``, or ``None``."""
    handle = getattr(model, "_adalncache_handle", None)
    return handle if isinstance(handle, AdalnCacheHandle) and handle.enabled else None


__all__ = [
    "AdalnCacheConfig",
    "AdalnCacheHandle",
    "AdalnCacheModulationHook",
    "AdalnCacheOutputHook",
    "AdalnCachePrepareStep",
    "AdalnCacheTimeEmbedderHook",
    "AdalnCacheTransformerHook",
    "CheckpointMismatchError",
    "PipelineAdalnCacheHandle",
    "adaln_cache_handle",
    "enable_adaln_cache",
]
