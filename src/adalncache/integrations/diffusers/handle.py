"""The AdaLN cache enabled on one ``MiniMaxH3Transformer3DModel``: :class:`AdalnCacheHandle`.

The handle owns the pieces and the order they are put together and taken apart in: the weight
source, the :class:`~adalncache.AdalnCache`, the parked weights, the hooks, the LoRA tracking and
the method overrides. It also gives the cache the two callbacks of a build, ``embed`` (the
projections' exact input for a plan) and ``project`` (one layer's output through the module's own,
possibly LoRA-wrapped, quantized or layerwise-cast forward).

Requests hold their plans (:class:`~adalncache.holds.PlanHold`): ``prepare`` holds a request's
plans for the calling thread until that thread's next ``prepare`` or ``release()``; ``request``
holds them for a ``with`` block; and every forward holds its own plan until it returns. So a
build for another request (another thread, or a forward whose plan was not prepared) never
evicts or rewrites what a running request reads.

Threads: a build (with its LoRA scale and its loan of the time embedder's weights) runs under the
handle's lock; a forward whose plan is resident takes no lock but the cache's short one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import TensorSource
from ...errors import CheckpointError, ConfigError, PlanNotCachedError
from ...holds import PlanHold
from ...hostmem import HostBuffer
from ...plans import PlanKey
from ...source.absent import NoWeights
from ...spec import Layer
from .casting import casting_compute_dtype, casting_guard, casting_paths, new_casting, settle_casting
from .config import AdalnCacheConfig
from .hooks import ServingHooks, other_hooks_present
from .lora import LoraTracker, Tuners, Variant, applied_lora_scale, lora_scale_of
from .modules import (
    TIME_EMBEDDER,
    base_linear,
    bypassing_hooks,
    capture_blocks,
    check_materialised,
    device_of,
    execution_device,
    install_overrides,
    projection_dtype,
    projection_module,
    projection_modules,
    projection_path,
    release_blocks,
    remove_overrides,
    served_modules,
    swapped_parameters,
    time_embedder_linears,
)
from .moving import LiftedGroupOffloading, guarded_apply, refresh_group_offloading
from .parking import ParkTarget, TimeEmbedderLoan, WeightParking
from .quantized import (
    ProjectionStorage,
    adapter_guards,
    check_storage_options,
    fresh_alias,
    full_precision_variant,
    opaque_model_source,
    own_tensors,
    storage_of,
    transformer_spec,
)
from .sources import (
    NeverLoaded,
    Source,
    changed_since,
    check_tables_against_model,
    checkpoint_source,
    model_source,
)

if TYPE_CHECKING:
    from ... import AdalnCache, BuildReport, CacheStats
    from ...rebuild import EmbedFn

logger = logging.getLogger(__name__)

#: Where the handle of an enabled model is kept on the model.
HANDLE_ATTRIBUTE = "_adalncache_handle"


class AdalnCacheHandle:
    """The AdaLN cache enabled on one ``MiniMaxH3Transformer3DModel``.

    ``cache`` is the :class:`~adalncache.AdalnCache`; ``prepare(plans)`` builds plans ahead of
    the loop; ``stats`` are the cache's counters; ``disable()`` restores the original modules and
    weights bit-exactly. :func:`~adalncache.diffusers.enable_adaln_cache` makes one.
    """

    def __init__(self, model: nn.Module, config: AdalnCacheConfig) -> None:
        # Any: a diffusers model whose submodules are reached by attribute, which mypy cannot follow.
        self.model: Any = model
        self.config = config
        self.enabled = False
        #: Where the forward runs and the cache lives (offloading keeps the weights elsewhere).
        self.device = execution_device(model) or device_of(model)
        self.source: Source | None = None
        self.cache: AdalnCache  # set by _enable(), which enable_transformer() calls right away
        self._overrides: tuple[str, ...] = ()
        self._loan: TimeEmbedderLoan | None = None
        self._enabled_fingerprint: str | None = None
        #: Builds, LoRA scaling and hook moves (they change module state other threads read).
        self._lock = threading.RLock()
        #: Per thread: the hold of its last prepare() (``.hold``).
        self._prepared = threading.local()
        #: Host copies of the model's own projections (CUDA), released on disable().
        self._host_buffers: list[HostBuffer] = []
        self._fresh_state()

    def _fresh_state(self) -> None:
        """What one enabling builds up: read (again) from the model as it is now."""
        self.spec = transformer_spec(self.model)
        self._parking = WeightParking()
        self._lora = LoraTracker(self.model, self.spec)
        self._hooks: ServingHooks | None = None
        self._warned_miss = False
        self._storage = ProjectionStorage()
        #: Full-precision tables of quantized projections from the checkpoint (quantized_projections="checkpoint"),
        #: and the variant they are built under (see ``_choose_source``).
        self._plain_tables = False
        self._plain_variant: Variant = None
        #: Served modules that had a layerwise-casting hook when the cache was enabled.
        self._casting_at_enable: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ public

    @property
    def stats(self) -> CacheStats:
        """The cache's counters (:class:`~adalncache.CacheStats`)."""
        return self.cache.stats

    def prepare(self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None) -> BuildReport:
        """Make every plan resident for the model's current LoRA and autocast state, in at most one
        pass, and hold them for the calling thread until its next ``prepare`` or :meth:`release`.

        ``plans``: the per-step ``timestep`` tensors (``minimax_h3_plans`` gives them ahead of
        time) or the pipeline's ``row_timestep_plan`` (``(timestep, timestep_indices)`` pairs).
        ``attention_kwargs``: what the loop will pass the transformer; its ``"scale"`` changes the
        effective LoRA projection, so the tables are built under it. Call it under the autocast
        state the loop runs under (tables built outside autocast are rebuilt inside it).
        """
        self.release()  # the thread's previous request is over: its plans may make room for this one
        held = self._request_hold(plans, attention_kwargs)
        self._prepared.hold = held
        return held.report

    def release(self) -> None:
        """Release the plans the calling thread's last :meth:`prepare` holds (no-op when none)."""
        held: PlanHold | None = getattr(self._prepared, "hold", None)
        self._prepared.hold = None
        if held is not None:
            held.release()

    @contextlib.contextmanager
    def request(self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None) -> Iterator[PlanHold]:
        """``with handle.request(plans):`` prepares ``plans`` and holds them until the block ends.

        For a bare transformer loop: no build for another request evicts or rewrites these plans
        while the loop runs, and they are released on an exception too. Yields the
        :class:`~adalncache.holds.PlanHold` (``.report`` says what the build did).
        """
        held = self._request_hold(plans, attention_kwargs)
        try:
            yield held
        finally:
            held.release()

    def _request_hold(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> PlanHold:
        if not self.enabled:
            raise ConfigError("prepare() needs the AdaLN cache enabled; this handle was disabled")
        self._follow(execution_device(self.model))
        tensors = [plan[0] if isinstance(plan, (tuple, list)) else plan for plan in plans]
        scale = lora_scale_of(attention_kwargs)
        tuners, variant, refs = self._signature(scale)
        return self._hold(tensors, None, scale, tuners, variant, refs)

    def disable(self, *, allow_changed_checkpoint: bool = False) -> None:
        """Remove every hook and override and put the original weights back, bit-exactly.

        Weights served from a checkpoint are read back from it. If the file changed since enabling
        verified it (its stat identity: a rewrite, a rename over it), what it holds now need not be
        the original weights, so this raises CheckpointError before touching anything and the cache
        stays enabled; ``allow_changed_checkpoint=True`` restores from the file as it is now.
        """
        if not self.enabled:
            return
        if self._hooks is not None and self._hooks.forward_wrapped_by_others():
            raise ConfigError(
                "another library wrapped the transformer's forward after enable_adaln_cache() (cache-dit does); "
                "removing the AdaLN cache now would silently drop that wrapper. Remove that wrapper first (cache-dit "
                "1.5.3 cannot remove its own here: reload the model), and enable such a library before "
                "enable_adaln_cache() when the cache must be disabled on its own"
            )
        self.release()
        if self._parking.restores_from_source and not allow_changed_checkpoint:
            assert self.source is not None
            if changed_since(self.source, self._enabled_fingerprint):
                raise CheckpointError(
                    f"checkpoint {self.config.checkpoint} changed on disk since enable_adaln_cache() verified "
                    "it, so restoring the projection weights from it may not give back the original model; "
                    "reload the model, or call disable(allow_changed_checkpoint=True) to restore from the "
                    "file as it is"
                )
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        remove_overrides(self.model, self._overrides)
        self._overrides = ()
        freed = self._parking.freed
        self._parking.restore()
        settle_casting(served_modules(self.model, self.spec), self._casting_at_enable)
        release_blocks(self.model)
        refresh_group_offloading(self.model)
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

    def _give_back_memory(self) -> None:
        """After restoring: the cache's host tier and read buffers, and the model's host copies.

        The copies of the model's own projections (CUDA) are unlocked now, and freed with the
        in-memory source, which a closed cache never reads again.
        """
        cache = getattr(self, "cache", None)
        released = cache.close() if cache is not None else 0
        for buffer in self._host_buffers:
            released += buffer.release()
        self._host_buffers = []
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
        capture_blocks(model)
        try:
            free_time_embedder, device, modules, host_tensors = self._choose_source(never_loaded)
            source = self.source
            if never_loaded is not None:
                self.cache = never_loaded.cache
            else:
                self.cache = self.config.cache_options.build(self.spec, source, device)
        except BaseException:
            release_blocks(model)
            raise
        if source is None:
            assert isinstance(self.cache.source, NoWeights)
            self.source = self.cache.source
        self._enabled_fingerprint = self.cache.source.fingerprint
        # From here on the model is modified; undo everything if a step fails. Group offloading (if
        # applied first) captured the weights parked here: it is lifted, and comes back rebuilt,
        # outside our hooks (see moving.LiftedGroupOffloading).
        lifted = LiftedGroupOffloading(model)
        try:
            targets = [ParkTarget(base_linear(module), layer, projection_path(layer)) for layer, module in modules]
            if free_time_embedder:
                linears = time_embedder_linears(model)
                targets += [ParkTarget(base_linear(linear), None, path) for path, linear in linears]
            self._parking.park(
                targets,
                source=self.cache.source,
                host_tensors=host_tensors,
                never_loaded=never_loaded.residues if never_loaded is not None else None,
                device=never_loaded.device if never_loaded is not None else None,
            )
            self._hooks = ServingHooks(model, self.spec, self.cache, self._make_resident)
            self._hooks.register(time_embedder=free_time_embedder)
            lifted.restore()
            overrides = self._lora.guards(standing_in=self._parking.standing_in, after_load=self._hooks.follow_output)
            overrides.update(self._device_guards())
            overrides.update(self._composition_guards())
            install_overrides(model, overrides)
            self._overrides = tuple(overrides)
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
            self._storage.describe(),
            type(self.source).__name__,
        )

    def _choose_source(
        self, never_loaded: NeverLoaded | None
    ) -> tuple[bool, torch.device, list[tuple[Layer, Any]], Any]:
        """Check the model and the options, and set ``self.source``; nothing on the model changes yet.

        Returns whether to park the time embedder, the cache's device, the projection modules and
        the host tensors parking restores from (``None``: re-read them from the source). The source
        is ``None`` for table files alone (``tables=`` and no checkpoint): the cache serves them
        with no weights.
        """
        model = self.model
        config = self.config
        if never_loaded is None:
            check_materialised(model, self.spec)
        self._lora.start()
        options = config.cache_options
        device = options.device_for(self.device)
        free_time_embedder = config.free_time_embedder
        if free_time_embedder is None:
            free_time_embedder = not other_hooks_present(model)
        modules = projection_modules(model, self.spec)
        host_tensors = None
        if never_loaded is not None:
            self.source = never_loaded.source  # the loader checked it serves this model's projections
            return free_time_embedder, device, modules, host_tensors
        self._storage = storage = storage_of(modules)
        check_storage_options(
            storage,
            checkpoint=config.checkpoint,
            quantized_projections=config.quantized_projections,
            precision=options.precision,
            shard=options.shard,
            process_group=options.process_group,
            device=device,
            tables=options.tables,
        )
        self._casting_at_enable = casting_paths(served_modules(model, self.spec))
        if config.checkpoint is not None:
            # Quantized projections are never compared with a checkpoint (there is nothing equal to
            # compare): reaching here means full-precision tables from it were asked for on purpose.
            self.source = checkpoint_source(
                config.checkpoint,
                self.spec,
                modules,
                layout=config.layout,
                verify=config.verify_checkpoint and not storage.opaque,
            )
            if storage.opaque:
                self._plain_tables = True
                host_tensors = own_tensors(modules, self.device)  # disable() gives back the quantized weights
                self._plain_variant = self._lora.variant = full_precision_variant(model)
        elif options.tables is not None:
            # Table files and no checkpoint: the projections are needed by no plan the files hold,
            # so after a check against bound files they are freed, not parked (no source).
            check_tables_against_model(self.spec, modules, options.tables, device=device, precision=options.precision)
            self.source = None
        elif storage.opaque:
            self.source, host_tensors = opaque_model_source(self.spec, modules, self.device)
        else:
            self.source, host_tensors, self._host_buffers = model_source(self.spec, modules, self.device)
        return free_time_embedder, device, modules, host_tensors

    def _composition_guards(self) -> dict[str, Callable[..., Any]]:
        """Overrides for what other diffusers features do to a served model: compile, cast, load adapters."""
        assert self._hooks is not None
        guards = self._hooks.compiled.guard()
        guards.update(casting_guard(self.model, disable=self.disable, enable_again=self._enable_again))
        guards.update(adapter_guards(self._storage))
        return guards

    def _enable_again(self) -> None:
        """Enable over the model as it is now (after a cast), with the same settings."""
        self._fresh_state()
        self._enable()

    def _device_guards(self) -> dict[str, Callable[..., Any]]:
        """The ``_apply`` override: moves take the cache along, casts are refused (see ``moving``)."""
        return {"_apply": guarded_apply(self.model, moved=self._moved_to, back=self._moved_to)}

    def _moved_to(self, device: torch.device) -> None:
        """The model's weights go to ``device``: the parked weights' home and the cache follow."""
        self._parking.moved_to(device)
        self._follow(device)

    def _follow(self, device: torch.device | None) -> None:
        """Serve forwards that run on ``device``: the cache moves its tables there (or rebuilds them)."""
        if device is None or device == self.device:
            return
        before = self.cache.device
        # The calling thread's prepared request holds slots of the old device: it is over. Holds of
        # other threads' requests in flight make the move fail (ConfigError, nothing moved).
        self.release()
        self.cache.move_to(device)  # a no-op when both name one device ("cuda" and "cuda:0")
        if self.cache.device != before:
            if self._hooks is not None:
                self._hooks.rebind()  # the slab tensors are new ones on the new device
            logger.info("AdaLN cache: the model runs on %s now (was %s); the tables followed", device, before)
        self.device = device

    # ------------------------------------------------------------------ per forward

    def _make_resident(
        self, plan: torch.Tensor, key: PlanKey, attention_kwargs: Mapping[str, Any] | None, device: torch.device
    ) -> PlanHold:
        """Before a forward: hold ``plan`` resident under the forward's LoRA signature (or refuse).

        Called by the transformer hook with the host copy of the forward's timestep, its key, and
        the device the forward runs on (its timestep's), which the cache follows; the hook
        releases the hold when the forward returns.
        """
        self._follow(device)
        scale = lora_scale_of(attention_kwargs)
        tuners, variant, refs = self._signature(scale)
        if self.config.on_miss == "raise":
            held = self.cache.hold_resident([plan], keys=[key], variant=variant)
            if held is not None:
                return held
            if variant != self._lora.variant:
                raise PlanNotCachedError(
                    "the AdaLN cache does not cover this forward: the LoRA state of the AdaLN projections "
                    "changed since the tables were built; call handle.prepare(plans) (on_miss='raise')"
                )
            raise PlanNotCachedError(
                f"the AdaLN cache does not cover this forward's plan {plan.tolist()} under the current LoRA and "
                "autocast state; call handle.prepare(plans) before the loop (under the loop's autocast), or "
                "enable with on_miss='build'"
            )
        held = self._hold([plan], [key], scale, tuners, variant, refs)
        if held.report.passes and self.config.on_miss == "build":
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
        return held

    # ------------------------------------------------------------------ building

    def _signature(self, scale: float) -> tuple[list[tuple[str, Any]], Variant, list[torch.Tensor]]:
        """Follow a swapped output module, refuse a fuse or a new cast, and read the LoRA signature under ``scale``.

        Reading it under a scale other than 1 scales the adapters for a moment, which a build on
        another thread must not see: that case (and a hook move) takes the handle's lock.
        """
        assert self._hooks is not None
        new_casting(served_modules(self.model, self.spec), self._casting_at_enable)
        if scale == 1.0 and not self._hooks.output_moved():
            tuners, variant, refs = self._lora.current(scale)
        else:
            with self._lock:
                self._hooks.follow_output()
                tuners, variant, refs = self._lora.current(scale)
        if self._plain_tables:
            if variant is not None:
                # The adapter wraps the quantized module, which would requantize the checkpoint's weight.
                raise ConfigError(
                    "LoRA adapters on the AdaLN projections cannot be combined with "
                    "quantized_projections='checkpoint'; unload the adapter, or serve the model's own projections "
                    "(quantized_projections='model' without checkpoint=)"
                )
            variant = self._plain_variant
        return tuners, variant, refs

    def _hold(
        self,
        plans: Sequence[torch.Tensor],
        keys: Sequence[PlanKey] | None,
        scale: float,
        tuners: Tuners,
        variant: Variant,
        refs: list[torch.Tensor],
    ) -> PlanHold:
        """Hold ``plans`` resident under ``variant``: the cache's hit path, else a build under the lock."""
        held = self.cache.hold_resident(plans, keys=keys, variant=variant)
        if held is not None:
            return held
        if (
            variant is not None
            and not self._plain_tables
            and self.cache.shard == "columns"
            and self.cache.world_size > 1
        ):
            # The adapter's forward runs on the whole projection; a rank's column slice of the base
            # weight cannot go through it (it would fail later with an unhelpful shape error).
            raise ConfigError(
                "LoRA adapters on the AdaLN projections need shard='layers' (CLI --shard layers): with "
                "shard='columns' each rank holds a column slice of the base weight, which the adapter's "
                "full-width forward cannot run on; unload the adapter or build with shard='layers'"
            )
        with self._lock:
            # The parked time embedder is lent back by the first embed of a pass and parked again
            # when the build returns, so a build that hits costs no copy.
            linears = [base_linear(linear) for _, linear in time_embedder_linears(self.model)]
            loan = self._parking.time_embedder_loan(self.device, linears)
            with loan, torch.no_grad(), applied_lora_scale(tuners, scale):
                self._loan = loan
                try:
                    embed: EmbedFn = self._embed
                    held = self.cache.hold(plans, embed=embed, project=self._project, variant=variant, keys=keys)
                finally:
                    self._loan = None
            if self._lora.built_under(variant, refs):
                logger.info("AdaLN cache: tables rebuilt for a new LoRA signature")
        return held

    def _embed(self, plan: torch.Tensor) -> torch.Tensor:
        """The projections' exact input for ``plan``, computed as the stock forward computes it.

        ``time_proj``, then the (fp32) time embedder at its own dtype, then SiLU at ``temb``'s
        precision and only then the cast to the projection dtype (the other order changes about
        half the outputs). Runs the time embedder's own (possibly LoRA-wrapped) forward, beneath
        every hook on it (ours stands in for it; an offloading hook must not move the lent weights).
        """
        from diffusers.models.modeling_utils import get_parameter_dtype

        if self._loan is not None:
            self._loan.take()
        model = self.model
        temb = model.time_proj(plan.to(self.device))
        time_embedder = model.get_submodule(TIME_EMBEDDER)
        with bypassing_hooks(time_embedder.modules()):
            temb = time_embedder(temb.to(get_parameter_dtype(time_embedder)))
        return F.silu(temb).to(projection_dtype(model, self.spec))

    def _project(self, layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``layer``'s output for ``x``, through the module's own (LoRA-wrapped, quantized, cast) forward.

        The served module and its base linear run their class's forward beneath every hook: ours
        would serve the table, and an offloading hook would move the source's weights.
        Full-precision tables of quantized projections (``quantized_projections="checkpoint"``) are a
        plain linear of the checkpoint's weights: decided by that setting, never by the weight's
        type, since a module like optimum-quanto's unfrozen ``QLinear`` quantizes a plain weight in
        its forward.
        """
        if self._plain_tables:
            return F.linear(x, weight, bias)
        module = projection_module(self.model, layer)
        base = base_linear(module)
        weight = self._parking.at_model_residue(layer, "weight", weight)
        bias = self._parking.at_model_residue(layer, "bias", bias)
        compute = casting_compute_dtype(module)
        if compute is not None:  # the layerwise-casting hook, bypassed below, would cast them so
            weight, bias = weight.to(compute), bias.to(compute)
        weight, bias = fresh_alias(weight), fresh_alias(bias)
        # The module's class forward is called directly, not through a bypass of its instance forward:
        # the output layer's module carries the output hook, and another thread's forward calling it
        # while a bypass stood in its place would run the plain linear on its own input.
        with bypassing_hooks({base} - {module}), swapped_parameters(base, {"weight": weight, "bias": bias}):
            return type(module).forward(module, x)  # type: ignore[no-any-return]


def enable_transformer(
    model: nn.Module, config: AdalnCacheConfig, *, never_loaded: NeverLoaded | None = None
) -> AdalnCacheHandle:
    """Enable the cache on one transformer; on failure the model is left as it was.

    ``never_loaded``: the model's served weights were never loaded (``load_transformer`` built it
    with meta placeholders in their place); they are parked straight from that source.
    """
    handle = AdalnCacheHandle(model, config)
    handle._enable(never_loaded=never_loaded)
    return handle


def adaln_cache_handle(model: Any) -> AdalnCacheHandle | None:
    """The enabled handle of ``model``, or ``None``."""
    handle = getattr(model, HANDLE_ATTRIBUTE, None)
    return handle if isinstance(handle, AdalnCacheHandle) and handle.enabled else None
