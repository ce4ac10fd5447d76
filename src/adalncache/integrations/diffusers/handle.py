"""Enabling and disabling: :func:`enable_adaln_cache`, :class:`AdalnCacheHandle` (one transformer) and
:class:`PipelineAdalnCacheHandle` (a pipeline's transformers, its calls and its scheduler).

An enabling puts its pieces together in this order, and ``disable()`` takes them apart in reverse,
restoring the model bit-exactly: the settings; the weight source, chosen before the model changes
(:func:`choose_source`); the :class:`~adalncache.AdalnCache`; the parked weights (:mod:`.parking`);
the hooks (:mod:`.hooks`); the signature and its LoRA guards (:mod:`.signature`); the builder
(:mod:`.request`); and instance overrides of ``_apply`` (every move and cast ends there: moves take
the cache along, casts are refused), ``compile``, ``enable_layerwise_casting`` and the LoRA loaders.
Moves and offloading: docs/diffusers.md ("Moving an enabled model", "Offloading, mode by mode").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import Unpack

from ... import AdalnCache, TensorSource
from ...cache import PlanHold
from ...devices import HostBuffer
from ...errors import CheckpointError, ConfigError, PlanMismatchError
from ...options import AdalnCacheConfig, ConfigKwargs, flag, option_keywords
from ...source.memory import NoWeights
from ...spec import Layer, ModulationSpec
from .compat import (
    apply_group_offloading_config,
    group_offloading_config,
    group_offloading_hook_names,
    reapply_group_offloading,
)
from .family import DiffusersFamily, base_linear, check_materialised, device_of, execution_device, family_of, recognised
from .hooks import ServingHooks, other_hooks_present
from .parking import ParkTarget, WeightParking
from .quantized import (
    ProjectionStorage,
    adapter_guards,
    casting_guard,
    casting_paths,
    check_storage_options,
    full_precision_variant,
    opaque_model_source,
    own_tensors,
    settle_casting,
    storage_of,
    transformer_spec,
)
from .request import Builder, PipelineWatch, Requests, request_plans
from .signature import Signature, Variant, upstream_digest_of
from .sources import (
    NeverLoaded,
    Quantization,
    Source,
    changed_since,
    check_tables_against_model,
    checkpoint_source,
    model_source,
)

if TYPE_CHECKING:
    from ... import BuildReport, CacheStats

logger = logging.getLogger(__name__)

#: Where the handle of an enabled model is kept on the model.
HANDLE_ATTRIBUTE = "_adalncache_handle"

#: The pipeline components that are transformers the cache can serve.
PIPELINE_TRANSFORMERS = ("transformer", "transformer_ref")

CheckpointArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


# -- settings -------------------------------------------------------------------------------------


def cache_device(device: torch.device | str | None, model_device: torch.device) -> torch.device:
    """The cache's device: the model's, which ``device=`` may name but not change."""
    if device is None:
        return model_device
    try:
        named = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device: set device= (CLI {flag('device')})") from exc
    if named.type != model_device.type or named.index not in (None, model_device.index):
        raise ConfigError(
            f"device={named} (CLI {flag('device')}) differs from the model's device {model_device}: the cache "
            "serves the forward, so it must live where the model runs; move the model first"
        )
    return model_device


# -- where an enabling serves from ----------------------------------------------------------------


@dataclass
class SourceChoice:
    """What one enabling serves from (``source``: ``None`` for table files alone), and what parking needs:
    ``host_tensors`` to restore from (``None``: re-read from the source, checked against its ``digest``).
    ``plain_variant``: set for full-precision tables of quantized projections from the checkpoint;
    ``casting_at_enable``: the served modules with a layerwise-casting hook.
    """

    source: Source | None
    modules: list[tuple[Layer, Any]]
    free_time_embedder: bool
    host_tensors: Any = None
    host_buffers: list[HostBuffer] = field(default_factory=list)
    storage: ProjectionStorage = field(default_factory=ProjectionStorage)
    plain_variant: Variant = None
    casting_at_enable: frozenset[str] = frozenset()
    digest: str | None = None

    def park_targets(self, family: DiffusersFamily, model: Any) -> list[ParkTarget]:
        """Every served projection, and the time embedder's linears when nothing else reads them."""
        targets = [
            ParkTarget(base_linear(module), layer, family.projection_path(layer)) for layer, module in self.modules
        ]
        if self.free_time_embedder:
            targets += [
                ParkTarget(base_linear(linear), None, path) for path, linear in family.time_embedder_linears(model)
            ]
        return targets


def choose_source(
    model: Any,
    spec: ModulationSpec,
    family: DiffusersFamily,
    config: AdalnCacheConfig,
    checkpoint: CheckpointArg | None,
    device: torch.device,
    never_loaded: NeverLoaded | None,
) -> SourceChoice:
    """Check the model and the options and choose the source, the model unchanged: a ``checkpoint=``
    verified against the model's projections (for quantized ones, with nothing equal to compare,
    full-precision tables asked for on purpose); else ``tables=`` alone, checked against the model's
    projections, which are then freed; else the model's own, to host memory (quantized ones as they are).
    A model ``load_transformer`` built never held its projections: its source comes with it.
    """
    if never_loaded is None:
        check_materialised(family, model, spec)
    free_time_embedder = config.free_time_embedder
    if free_time_embedder is None:
        free_time_embedder = not other_hooks_present(model)
    modules = family.projection_modules(model, spec)
    if never_loaded is not None:  # the loader checked it serves this model's projections
        return SourceChoice(never_loaded.source, modules, free_time_embedder)
    storage = storage_of(modules, family.projection_path)
    check_storage_options(
        storage,
        checkpoint=checkpoint,
        quantized_projections=config.quantized_projections,
        precision=config.precision,
        shard=config.shard,
        process_group=config.process_group,
        device=device,
        tables=config.tables,
    )
    choice = SourceChoice(
        None,
        modules,
        free_time_embedder,
        storage=storage,
        casting_at_enable=casting_paths(family.served_modules(model, spec)),
    )
    # The rows come from the model's own upstream modules, whichever source the projections are read from.
    upstream = upstream_digest_of(model, spec, family)
    if checkpoint is not None:
        verify = config.verify_checkpoint and not storage.opaque
        choice.source, choice.digest = checkpoint_source(checkpoint, spec, modules, layout=config.layout, verify=verify)
        if storage.opaque:  # disable() gives back the quantized weights
            choice.host_tensors = own_tensors(modules, device, family.projection_path)
            choice.plain_variant = full_precision_variant(model)
    elif config.tables is not None:
        check_tables_against_model(
            spec, modules, config.tables, device=device, precision=config.precision, upstream=upstream
        )
    elif storage.opaque:
        choice.source, choice.host_tensors = opaque_model_source(spec, modules, device)
    else:
        choice.source, choice.host_tensors, choice.host_buffers = model_source(spec, modules, device)
    if choice.source is not None:
        choice.source.upstream = upstream  # read by the binding (identity.binding.upstream_of)
    return choice


# -- moving an enabled model ----------------------------------------------------------------------


def guarded_apply(
    model: nn.Module, *, moved: Callable[[torch.device], None], back: Callable[[torch.device], None]
) -> Callable[..., Any]:
    """The ``_apply`` override. ``fn`` is probed first on an empty tensor of every device and dtype the model
    holds, so nothing changes until every check passed; ``moved(target)`` runs before the weights move,
    ``back(previous)`` when they then fail to. The parked placeholders are no parameters: it never sees them."""

    def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        held = {(t.device, t.dtype) for t in (*model.parameters(), *model.buffers())}
        targets: set[torch.device] = set()
        for device, dtype in sorted(held, key=str):
            probe = fn(torch.empty(0, dtype=dtype, device=device))
            if probe.dtype != dtype:
                raise ConfigError(
                    f"the model cannot be cast ({dtype} -> {probe.dtype}) while the AdaLN cache is enabled: its "
                    "tables hold the projections' outputs at the loaded precision; call handle.disable(), cast, "
                    "then enable again (or load the model with the torch_dtype you want)"
                )
            if probe.device != device:
                targets.add(probe.device)
        if any(target.type == "meta" for target in targets):
            raise ConfigError(
                "moving the model to the meta device would drop the weights its forward needs while the AdaLN "
                "cache is enabled; call handle.disable() first"
            )
        if len(targets) > 1:
            raise ConfigError(
                f"internal: one move sends the model's tensors to several devices ({sorted(map(str, targets))})"
            )
        if not targets:
            return type(model)._apply(model, fn, recurse)
        target = targets.pop()
        previous = next((d for d, _ in held if d != target), target)
        moved(target)
        try:
            return type(model)._apply(model, fn, recurse)
        except BaseException:
            back(previous)
            raise

    return _apply


class LiftedGroupOffloading:
    """diffusers' group offloading taken off a model now, and applied again by :meth:`restore`, so that it
    comes back *outside* our hooks (it captured the weights now parked): diffusers re-applies it by removing
    and adding it (after a LoRA load, say), and removing a hook beneath one that replaces the forward (ours
    do) would unhook that one.
    """

    def __init__(self, model: nn.Module) -> None:
        from diffusers.hooks.hooks import HookRegistry

        self.model = model
        self.config: Any = group_offloading_config(model)
        if self.config is not None:
            registry = HookRegistry.check_if_exists_or_initialize(model)
            for name in group_offloading_hook_names():
                registry.remove_hook(name, recurse=True)

    def restore(self) -> None:
        """Apply the group offloading taken off again, to the model as it is now (once)."""
        if self.config is not None:
            config, self.config = self.config, None
            apply_group_offloading_config(self.model, config)


# -- one transformer ------------------------------------------------------------------------------


class AdalnCacheHandle:
    """The AdaLN cache enabled on one transformer of a supported family (docs/api.md lists its verbs);
    :func:`~adalncache.diffusers.enable_adaln_cache` makes one. A build runs under the handle's lock; a
    forward whose plan is resident takes no lock but the cache's short one.
    """

    def __init__(
        self,
        model: nn.Module,
        config: AdalnCacheConfig,
        checkpoint: CheckpointArg | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        # Any: a diffusers model whose submodules are reached by attribute, which mypy cannot follow.
        self.model: Any = model
        #: ``checkpoint``: None serves the model's own tensors, or table files alone.
        self.config, self.checkpoint = config, checkpoint
        self.enabled = False
        #: Where the forward runs and the cache lives (offloading keeps the weights elsewhere).
        self.device = cache_device(device, execution_device(model) or device_of(model))
        self.source: Source | None = None
        self.cache: AdalnCache  # set by _enable(), which enable_transformer() calls right away
        self._overrides: tuple[str, ...] = ()
        self._enabled_fingerprint: str | None = None
        #: Builds, LoRA scaling and hook moves (they change module state other threads read).
        self._lock = threading.RLock()
        self.requests = Requests(self, self.device)
        self._fresh_state()

    def _fresh_state(self) -> None:
        """What one enabling builds up: read (again) from the model as it is now."""
        self.family = family_of(self.model)
        self.spec = transformer_spec(self.model)
        self._parking = WeightParking()
        self._hooks: ServingHooks | None = None
        self.builder: Builder | None = None
        self._signature: Signature | None = None
        #: What the enabling serves from (its host copies are released on disable()).
        self._choice = SourceChoice(None, [], free_time_embedder=False)
        #: The quantizer the model was loaded through (``load_transformer(quantization_config=...)``).
        self._quantization: Quantization | None = None

    # ------------------------------------------------------------------ public

    @property
    def stats(self) -> CacheStats:
        """The cache's counters (:class:`~adalncache.CacheStats`)."""
        return self.cache.stats

    # The request verbs (docs/api.md says each one's contract) are those of :class:`~.request.Requests`.

    def prepare(self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None) -> BuildReport:
        """Make ``plans`` resident (one pass at most; call it under the loop's autocast) and hold them for the
        calling thread until its next ``prepare`` or :meth:`release`; its forwards find their slots on the device."""
        return self.requests.prepare(plans, attention_kwargs)

    def release(self, *, check: bool = True) -> None:
        """Release the thread's request (a no-op without one), then raise PlanMismatchError for its forwards that
        matched no plan."""
        self.requests.release(check=check)

    def start_prepare(self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None) -> None:
        """:meth:`prepare` by a background pass: each forward waits for its own plan; :meth:`finish` ends it."""
        self.requests.start_prepare(plans, attention_kwargs)

    def predicted_request(
        self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """A pipeline call's request around a ``with`` block, whose pass of the predicted ``plans`` starts now."""
        return self.requests.call(request_plans(plans), attention_kwargs)

    def finish(self) -> None:
        """End the thread's request: wait for its pass, raise its error if no forward did, then :meth:`release`."""
        self.requests.finish()

    def join_background(self) -> None:
        """Wait until every background pass started on this handle (by any thread) has ended."""
        self.requests.join()

    def check_request(self) -> None:
        """Raise PlanMismatchError for the thread's forwards that matched no plan since the last check (a host
        read: call it off the critical path; the request stays prepared)."""
        self.requests.check()

    def request(
        self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[PlanHold]:
        """``with handle.request(plans):`` holds ``plans`` for the block (released on an error too; a mismatch
        raises at its end), yielding the :class:`~adalncache.cache.PlanHold`."""
        return self.requests.request(plans, attention_kwargs)

    def disable(self, *, allow_changed_checkpoint: bool = False) -> None:
        """Remove every hook and override and put the original weights back, bit-exactly.

        Weights read back from a checkpoint that changed since enabling (its stat identity, or bytes that
        hash to another digest) need not be the originals: CheckpointError before anything changes, the
        cache still serving, unless ``allow_changed_checkpoint=True`` restores from the file as it is.
        """
        if not self.enabled:
            return
        self.requests.close()  # a pass uses the parked weights and the hooks: none from now on
        try:
            self._check_disable(allow_changed_checkpoint)
            held = None if allow_changed_checkpoint else self._choice.digest or self.cache.content_digest
            restored = self._parking.read_back(held)  # every byte in hand before anything changes
        except BaseException:
            self.requests.reopen()
            raise
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self.builder = None
        for name in self._overrides:
            self.model.__dict__.pop(name, None)
        self._overrides = ()
        freed = self._parking.freed
        self._parking.put_back(restored)
        if self._quantization is not None:  # the model loaded quantized: its projections are quantized again
            self._quantization.restore([self.family.projection_path(layer) for layer in self.spec.layers()])
        settle_casting(self.family.served_modules(self.model, self.spec), self._choice.casting_at_enable)
        self.family.release_blocks(self.model)
        reapply_group_offloading(self.model)
        self.enabled = False
        setattr(self.model, HANDLE_ATTRIBUTE, None)
        self._give_back_memory()
        if freed:
            logger.warning(
                "AdaLN cache disabled; the projection weights were freed when it was enabled with tables= and no "
                "checkpoint=, so they stay empty (meta) placeholders and the model cannot run without the cache: "
                "reload it, or enable with checkpoint= to be able to restore them"
            )
        else:
            logger.info("AdaLN cache disabled; projection weights restored")
        self.requests.check()  # a forward of the last request matched none of its plans

    def _check_disable(self, allow_changed_checkpoint: bool) -> None:
        """Refuse a disable that would drop another library's wrapper or restore from a changed file."""
        if self._hooks is not None and self._hooks.forward_wrapped_by_others():
            raise ConfigError(
                "another library wrapped the transformer's forward after enable_adaln_cache() (cache-dit does); "
                "removing the AdaLN cache now would silently drop that wrapper. Remove that wrapper first (cache-dit "
                "1.5.3 cannot remove its own here: reload the model), and enable such a library before "
                "enable_adaln_cache() when the cache must be disabled on its own"
            )
        self.requests.release(check=False)  # a mismatch it reports is raised once disabled
        if self._parking.restores_from_source and not allow_changed_checkpoint:
            assert self.source is not None
            if changed_since(self.source, self._enabled_fingerprint):
                where = self.checkpoint
                if isinstance(where, (list, tuple)):  # load_transformer's model files
                    where = ", ".join(map(str, where))
                raise CheckpointError(
                    f"checkpoint {where} changed on disk since the AdaLN cache was enabled and verified "
                    "it, so restoring the projection weights from it may not give back the original model; "
                    "reload the model, or call disable(allow_changed_checkpoint=True) to restore from the "
                    "file as it is"
                )

    def _give_back_memory(self) -> None:
        """After restoring: the cache's host tier and read buffers, and the model's host copies (CUDA)."""
        cache = getattr(self, "cache", None)
        released = cache.close() if cache is not None else 0
        for buffer in self._choice.host_buffers:
            released += buffer.release()
        self._choice.host_buffers, self._choice.host_tensors = [], None
        if isinstance(self.source, TensorSource):
            self.source.tensors.clear()
        logger.debug("AdaLN cache: %.1f MiB of host memory given back", released / 2**20)

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        source = type(self.source).__name__ if self.source is not None else None
        return f"AdalnCacheHandle({state}, layers={self.spec.num_layers}, source={source}, device={self.device})"

    # ------------------------------------------------------------------ enabling

    def _enable(self, *, never_loaded: NeverLoaded | None = None) -> None:
        """Enable on the model; ``never_loaded``: its served weights were never loaded (``load_transformer``)."""
        model = self.model
        if getattr(model, HANDLE_ATTRIBUTE, None) is not None:
            raise ConfigError(
                "the AdaLN cache is already enabled on this model; call handle.disable() before enabling again"
            )
        # The real block list, for builds inside a forward that swaps model.transformer_blocks (cache-dit).
        self.family.capture_blocks(model)
        try:
            choice = choose_source(
                model, self.spec, self.family, self.config, self.checkpoint, self.device, never_loaded
            )
            if never_loaded is not None:
                self._quantization = never_loaded.quantization
            self._choice, self.source = choice, choice.source
            self.cache = (
                never_loaded.cache
                if never_loaded is not None
                else AdalnCache(self.spec, choice.source, device=self.device, config=self.config)
            )
        except BaseException:
            self.family.release_blocks(model)
            raise
        if choice.source is None:
            assert isinstance(self.cache.source, NoWeights)
            self.source = self.cache.source
        self._enabled_fingerprint = self.cache.source.fingerprint
        # From here on the model is modified; undo everything if a step fails.
        lifted = LiftedGroupOffloading(model)
        try:
            self._parking.park(
                choice.park_targets(self.family, model),
                source=self.cache.source,
                host_tensors=choice.host_tensors,
                never_loaded=never_loaded.residues if never_loaded is not None else None,
                device=never_loaded.device if never_loaded is not None else None,
            )
            self._serve()
            lifted.restore()
            self._install_overrides()
        except BaseException:
            lifted.restore()
            self.enabled = True
            self.disable(allow_changed_checkpoint=True)
            raise
        setattr(model, HANDLE_ATTRIBUTE, self)
        self.enabled = True
        logger.info(
            "AdaLN cache enabled on %s: %d projections (%.1f MB, %s) served from the cache, source %s",
            type(model).__name__,
            self.spec.num_layers + 1,
            self.spec.projection_bytes / 1e6,
            choice.storage.describe(),
            type(self.source).__name__,
        )

    def _serve(self) -> None:
        """Register the hooks, the signature and the builder that holds a request's or a forward's plans."""
        model, choice = self.model, self._choice
        self._hooks = hooks = ServingHooks(model, self.spec, self.cache, self.family, self.requests.state)
        hooks.register(self.requests.serve, time_embedder=choice.free_time_embedder)
        self._signature = signature = Signature(
            model,
            self.spec,
            self.family,
            self._parking,
            self._lock,
            casting_at_enable=choice.casting_at_enable,
            plain_variant=choice.plain_variant if self._quantization is None else self._quantization.variant,
            rebuildable=getattr(self.cache.source, "serves_weights", True),
        )
        signature.hooks = hooks
        self.builder = Builder(
            model,
            self.spec,
            self.family,
            self.cache,
            self._parking,
            signature,
            self._lock,
            lambda: self.device,
            plain_tables=choice.plain_variant is not None,
            on_miss=self.config.on_miss,
            quantization=self._quantization,
        )

    def _install_overrides(self) -> None:
        """Instance overrides (the class's methods stay untouched) of moves, casts, compiles, adapter loads."""
        assert self._hooks is not None and self._signature is not None
        hooks = self._hooks
        overrides = self._signature.guards(standing_in=self._parking.standing_in, after_load=hooks.follow_output)
        overrides["_apply"] = guarded_apply(self.model, moved=self._moved_to, back=self._moved_to)
        overrides.update(hooks.compile_guard())
        overrides.update(casting_guard(self.model, disable=self.disable, enable_again=self._enable_again))
        overrides.update(adapter_guards(self._choice.storage))
        self.model.__dict__.update(overrides)
        self._overrides = tuple(overrides)

    def _enable_again(self) -> None:
        """Enable over the model as it is now (after a cast), with the same settings."""
        self._fresh_state()
        self.requests.reopen()
        self._enable()

    def _moved_to(self, device: torch.device) -> None:
        """The model's weights go to ``device``: the parked weights' home and the cache follow."""
        self._parking.moved_to(device)
        self.follow(device)

    def follow(self, device: torch.device | None) -> None:
        """Serve forwards that run on ``device``: the cache moves its tables there (or rebuilds them). The
        thread's request is over (its slots name the old slab); other threads' holds refuse the move."""
        if device is None or device == self.device:
            return
        before = self.cache.device
        self.requests.release(check=False)  # a mismatch it reports waits for the next check
        self.cache.move_to(device)  # a no-op when both name one device ("cuda" and "cuda:0")
        if self.cache.device != before:
            if self._hooks is not None:
                self._hooks.rebind()  # the slab tensors are new ones on the new device
            logger.info("AdaLN cache: the model runs on %s now (was %s); the tables followed", device, before)
        self.device = device


def enable_transformer(
    model: nn.Module,
    config: AdalnCacheConfig,
    checkpoint: CheckpointArg | None = None,
    *,
    device: torch.device | str | None = None,
    never_loaded: NeverLoaded | None = None,
) -> AdalnCacheHandle:
    """Enable the cache on one transformer; on failure the model is left as it was."""
    handle = AdalnCacheHandle(model, config, checkpoint, device)
    handle._enable(never_loaded=never_loaded)
    return handle


def adaln_cache_handle(model: Any) -> AdalnCacheHandle | None:
    """The enabled handle of ``model``, or ``None``."""
    handle = getattr(model, HANDLE_ATTRIBUTE, None)
    return handle if isinstance(handle, AdalnCacheHandle) and handle.enabled else None


# -- a pipeline -----------------------------------------------------------------------------------


class PipelineAdalnCacheHandle:
    """The AdaLN cache enabled on a pipeline: one :class:`AdalnCacheHandle` per transformer in ``handles``
    (also ``handle["transformer"]``); ``cache`` and ``stats`` are the only one's, else dicts by name. Every
    call is each transformer's request (:class:`~.request.PipelineWatch`); a family may add blocks.
    """

    def __init__(self, pipeline: Any, handles: dict[str, AdalnCacheHandle]) -> None:
        self.pipeline = pipeline
        self.handles = handles
        self._undo: list[Callable[[], None]] = []

    def __getitem__(self, name: str) -> AdalnCacheHandle:
        return self.handles[name]

    @property
    def enabled(self) -> bool:
        return any(handle.enabled for handle in self.handles.values())

    def _each(self, read: Callable[[AdalnCacheHandle], Any]) -> Any:
        """``read`` of the only transformer's handle, else a dict of it by component name."""
        found = {name: read(handle) for name, handle in self.handles.items()}
        return next(iter(found.values())) if len(found) == 1 else found

    @property
    def cache(self) -> Any:
        return self._each(lambda handle: handle.cache)

    @property
    def stats(self) -> Any:
        return self._each(lambda handle: handle.stats)

    def prepare(
        self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None, component: str | None = None
    ) -> Any:
        """Prepare ``plans`` on one component's cache (``component``) or on every one."""
        if component is not None:
            if component not in self.handles:
                raise ConfigError(
                    f"component={component!r} has no AdaLN cache on this pipeline; choose one of {sorted(self.handles)}"
                )
            return self.handles[component].prepare(plans, attention_kwargs=attention_kwargs)
        return self._each(lambda handle: handle.prepare(plans, attention_kwargs=attention_kwargs))

    def release(self) -> None:
        """:meth:`AdalnCacheHandle.release` on every transformer, each mismatch checked before one raises."""
        for handle in self.handles.values():
            handle.release(check=False)
        self.check_request()

    def check_request(self) -> None:
        """``check_request()`` of every transformer's handle (PlanMismatchError after checking them all)."""
        errors: list[PlanMismatchError] = []
        for handle in self.handles.values():
            try:
                handle.check_request()
            except PlanMismatchError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def finish(self) -> None:
        """End the calling thread's request on every transformer (:meth:`AdalnCacheHandle.finish`)."""
        for handle in self.handles.values():
            handle.finish()

    def join_background(self) -> None:
        for handle in self.handles.values():
            handle.join_background()

    def disable(self, *, allow_changed_checkpoint: bool = False) -> None:
        """Disable every transformer's cache, then remove the watches and the family's blocks: in that order,
        a refused disable (another library's wrapper, a changed checkpoint) leaves the pipeline as it was."""
        mismatches: list[PlanMismatchError] = []
        for handle in self.handles.values():
            try:
                handle.disable(allow_changed_checkpoint=allow_changed_checkpoint)
            except PlanMismatchError as exc:  # raised once that handle is disabled: disable the others too
                mismatches.append(exc)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if mismatches:
            raise mismatches[0]

    def attach(self) -> None:
        """Bracket every call, watch a classic pipeline's scheduler, add the families' own blocks."""
        pipeline = self.pipeline
        classic = getattr(pipeline, "_blocks", None) is None and "transformer" in self.handles
        watch = PipelineWatch(pipeline, self._call, self.handles["transformer"].requests.expect if classic else None)
        self._undo.append(watch.remove)  # first: a failure inside install() still undoes what it did
        watch.install()
        for family in {id(h.family): h.family for h in self.handles.values()}.values():
            undo = family.attach_pipeline(pipeline)
            if undo is not None:
                self._undo.append(undo)

    @contextlib.contextmanager
    def _call(self, pipeline: Any, call: Mapping[str, Any]) -> Iterator[None]:
        """One call: each transformer's request, with its family's predicted schedule where ``overlap`` is on."""
        with contextlib.ExitStack() as stack:
            for name, handle in self.handles.items():
                plans = None
                if handle.enabled and handle.config.overlap and call:
                    try:
                        plans = handle.family.predict_schedule(handle.model, pipeline, call, name) or None
                    except Exception as exc:  # a prediction is an optimisation: the schedule is built when known
                        logger.debug("AdaLN cache: no schedule predicted for this call: %s", exc)
                if handle.enabled:
                    stack.enter_context(handle.requests.call(plans, call.get("attention_kwargs")))
            yield

    def __repr__(self) -> str:
        return f"PipelineAdalnCacheHandle({', '.join(f'{n}={h!r}' for n, h in self.handles.items())})"


def enable_pipeline(
    pipeline: Any,
    checkpoint: CheckpointArg | Mapping[str, CheckpointArg] | None,
    config: AdalnCacheConfig,
    device: torch.device | str | None,
) -> PipelineAdalnCacheHandle:
    """Enable the cache on every served transformer of ``pipeline``, all or none (one already enabled keeps its
    cache); ``checkpoint``: one path for one transformer, else a mapping by component name."""
    components: dict[str, Any] = {
        name: getattr(pipeline, name, None)
        for name in PIPELINE_TRANSFORMERS
        if recognised(getattr(pipeline, name, None)) is not None
    }
    if not components:
        transformer = getattr(pipeline, "transformer", None)
        if isinstance(transformer, torch.nn.Module):
            family_of(transformer)  # a refused or unknown class: the ConfigError says why
        raise ConfigError(
            "enable_adaln_cache needs a transformer of a supported family, or a pipeline holding one as "
            f"`transformer` (or `transformer_ref`), got {type(pipeline).__name__}"
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
    # A transformer that already serves from its own cache (load_transformer) is adopted as it is.
    adopted = {name: handle for name, model in components.items() if (handle := adaln_cache_handle(model))}
    for name, handle in adopted.items():
        if checkpoints[name] is not None:
            raise ConfigError(
                f"{name} already serves its AdaLN projections from its own cache (load_transformer enabled it): "
                f"drop checkpoint= for {name}"
            )
        if config.overlap and not handle.config.overlap:
            raise ConfigError(
                f"overlap=True cannot be turned on for {name}, whose cache load_transformer enabled without it: "
                "pass overlap=True to load_transformer instead"
            )
    handles: dict[str, AdalnCacheHandle] = {}
    try:
        for name, model in components.items():
            handles[name] = adopted.get(name) or enable_transformer(
                model, component_config(config, name), checkpoints[name], device=device
            )
    except BaseException:
        for name, handle in handles.items():
            if name not in adopted:
                handle.disable()
        raise
    pipeline_handle = PipelineAdalnCacheHandle(pipeline, handles)
    pipeline_handle.attach()
    return pipeline_handle


def component_config(config: AdalnCacheConfig, component: str | None) -> AdalnCacheConfig:
    """The options of one transformer: ``tables=`` given as a mapping by component name is that
    component's files (a mapping only a pipeline takes)."""
    if not isinstance(config.tables, Mapping):
        return config
    if component is None:  # the cache's own refusal of a mapping, before the model is looked at
        AdalnCacheConfig.of({}, where="enable_adaln_cache()", config=config, cache=True)
    return replace(config, tables=config.tables.get(component))


@option_keywords()
def enable_adaln_cache(
    model_or_pipeline: Any,
    checkpoint: CheckpointArg | Mapping[str, CheckpointArg] | None = None,
    *,
    config: AdalnCacheConfig | None = None,
    device: torch.device | str | None = None,
    **options: Unpack[ConfigKwargs],
) -> AdalnCacheHandle | PipelineAdalnCacheHandle:
    """Serve the AdaLN modulation of a supported transformer (or pipeline) from bit-exact tables.

    The served projections' weights (per family: docs/families.md) and, unless another hook might read
    ``temb``, the time embedder's leave the device; meta placeholders of the right shape keep module
    names, ``repr`` and the LoRA loaders working. A transformer whose modulation depends on the prompt,
    or of an unknown class, is refused with ``ConfigError`` saying why; nothing changes.

    Args:
        model_or_pipeline: a transformer of a supported family, or a pipeline holding one as
            ``transformer`` (a MiniMax-H3 modular pipeline's ``transformer_ref`` gets its own cache too):
            every call of a pipeline is a request. A transformer whose cache is already enabled
            (``load_transformer``) keeps it.
        checkpoint: safetensors file, directory or list of files holding the projections (native or
            diffusers layout), verified against the model's; for a pipeline with both transformers, a
            mapping by component name. ``None`` serves the model's own tensors from host memory.
        config: the options as one :class:`~adalncache.options.AdalnCacheConfig`; each keyword option
            given beside it replaces that field (``config=base, store=...``).
        device: where the cache lives; it must be the model's (``None``: the model's, or the device an
            offloading hook runs it on); when the model moves (``.to()``), the cache follows.
        {cache options}

    ``tables`` with ``checkpoint=None`` frees the projections for good (docs/tables.md). An unknown keyword
    is a ``TypeError`` naming it and the closest option; a bad value a ``ConfigError`` naming the argument
    and its CLI flag, before the model is modified. Returns an :class:`AdalnCacheHandle`, or for a
    pipeline a :class:`PipelineAdalnCacheHandle` of one per transformer.
    """
    given = AdalnCacheConfig.of(options, where="enable_adaln_cache()", config=config)
    if isinstance(model_or_pipeline, torch.nn.Module):
        family_of(model_or_pipeline)  # a refused or unknown class: ConfigError naming why, nothing changed
        if isinstance(checkpoint, Mapping):
            raise ConfigError(
                "checkpoint= is a mapping by component name, which only a pipeline takes; pass one path for a "
                "single transformer"
            )
        return enable_transformer(model_or_pipeline, component_config(given, None), checkpoint, device=device)
    return enable_pipeline(model_or_pipeline, checkpoint, given, device)


__all__ = ["AdalnCacheHandle", "PipelineAdalnCacheHandle", "enable_adaln_cache"]
