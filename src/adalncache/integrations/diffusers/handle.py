"""The AdaLN cache enabled on one ``MiniMaxH3Transformer3DModel``: :class:`AdalnCacheHandle`.

The handle owns the pieces and the order they are put together and taken apart in: the weight
source, the :class:`~adalncache.AdalnCache`, the parked weights, the hooks, the LoRA tracking and
the method overrides. It also gives the cache the two callbacks of a build, ``embed`` (the
projections' exact input for a plan) and ``project`` (one layer's output through the module's own,
possibly LoRA-wrapped, quantized or layerwise-cast forward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CheckpointError, ConfigError, PlanNotCachedError
from ...plans import PlanKey
from ...spec import FINAL, Layer
from .casting import casting_guard, casting_paths, new_casting, settle_casting
from .config import AdalnCacheConfig
from .hooks import OUTPUT_HOOK, TIME_EMBEDDER_HOOK, ServingHooks, other_hooks_present, unhooked
from .lora import LoraTracker, Tuners, Variant, applied_lora_scale, lora_scale_of
from .modules import (
    TIME_EMBEDDER,
    base_linear,
    capture_blocks,
    check_materialised,
    device_of,
    install_overrides,
    projection_dtype,
    projection_module,
    projection_modules,
    release_blocks,
    remove_overrides,
    served_modules,
    swapped_parameters,
    time_embedder_linears,
)
from .parking import TimeEmbedderLoan, WeightParking
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
from .sources import Source, changed_since, checkpoint_source, model_source

if TYPE_CHECKING:
    from ... import AdalnCache, BuildReport, CacheStats

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
        self.device = device_of(model)
        self.source: Source | None = None
        self.cache: AdalnCache  # set by _enable(), which enable_transformer() calls right away
        self._overrides: tuple[str, ...] = ()
        self._loan: TimeEmbedderLoan | None = None
        self._enabled_fingerprint: str | None = None
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
        """Make every plan resident for the model's current LoRA state, in at most one pass.

        ``plans``: the per-step ``timestep`` tensors (``minimax_h3_plans`` gives them ahead of
        time) or the pipeline's ``row_timestep_plan`` (``(timestep, timestep_indices)`` pairs).
        ``attention_kwargs``: what the loop will pass the transformer; its ``"scale"`` changes the
        effective LoRA projection, so the tables are built under it.
        """
        if not self.enabled:
            raise ConfigError("prepare() needs the AdaLN cache enabled; this handle was disabled")
        tensors = [plan[0] if isinstance(plan, (tuple, list)) else plan for plan in plans]
        scale = lora_scale_of(attention_kwargs)
        tuners, variant, refs = self._signature(scale)
        return self._build(tensors, scale, tuners, variant, refs)

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
        self._parking.restore()
        settle_casting(served_modules(self.model, self.spec), self._casting_at_enable)
        release_blocks(self.model)
        self.enabled = False
        setattr(self.model, HANDLE_ATTRIBUTE, None)
        logger.info("AdaLN cache disabled; projection weights restored")

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        source = type(self.source).__name__ if self.source is not None else None
        return f"AdalnCacheHandle({state}, layers={self.spec.num_layers}, source={source}, device={self.device})"

    # ------------------------------------------------------------------ enabling

    def _enable(self) -> None:
        model = self.model
        if getattr(model, HANDLE_ATTRIBUTE, None) is not None:
            raise ConfigError(
                "the AdaLN cache is already enabled on this model; call handle.disable() before enabling again"
            )
        # The real block list, for builds inside a forward that swaps model.transformer_blocks (cache-dit).
        capture_blocks(model)
        try:
            free_time_embedder, device, modules, host_tensors = self._choose_source()
            assert self.source is not None
            self.cache = self.config.cache_options.build(self.spec, self.source, device)
        except BaseException:
            release_blocks(model)
            raise
        # From here on the model is modified; undo everything if a step fails.
        try:
            targets: list[tuple[nn.Module, Layer | None]] = [(base_linear(module), layer) for layer, module in modules]
            if free_time_embedder:
                targets += [(base_linear(linear), None) for _, linear in time_embedder_linears(model)]
            self._parking.park(targets, source=self.cache.source, host_tensors=host_tensors)
            self._hooks = ServingHooks(model, self.spec, self.cache, self._make_resident)
            self._hooks.register(time_embedder=free_time_embedder)
            overrides = self._lora.guards(standing_in=self._parking.standing_in, after_load=self._hooks.follow_output)
            overrides.update(self._device_guards())
            overrides.update(self._composition_guards())
            install_overrides(model, overrides)
            self._overrides = tuple(overrides)
        except BaseException:
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

    def _choose_source(self) -> tuple[bool, torch.device, list[tuple[Layer, Any]], Any]:
        """Check the model and the options, and set up the weight source; nothing on the model changes yet.

        Returns whether to park the time embedder, the cache's device, the projection modules and
        the host tensors parking restores from (``None``: re-read them from the checkpoint).
        """
        model = self.model
        config = self.config
        check_materialised(model, self.spec)
        self._lora.start()
        options = config.cache_options
        device = options.device_for(self.device)
        free_time_embedder = config.free_time_embedder
        if free_time_embedder is None:
            free_time_embedder = not other_hooks_present(model)
        modules = projection_modules(model, self.spec)
        self._storage = storage = storage_of(modules)
        check_storage_options(
            storage,
            checkpoint=config.checkpoint,
            quantized_projections=config.quantized_projections,
            precision=options.precision,
            shard=options.shard,
            process_group=options.process_group,
            device=device,
        )
        self._casting_at_enable = casting_paths(served_modules(model, self.spec))
        host_tensors = None
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
        elif storage.opaque:
            self.source, host_tensors = opaque_model_source(self.spec, modules, self.device)
        else:
            self.source, host_tensors = model_source(self.spec, modules, self.device)
        self._enabled_fingerprint = self.source.fingerprint
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
        """Overrides that refuse to move or cast the model while its tables live on one device.

        Without them the meta placeholders would fail deep inside torch ("Cannot copy out of meta
        tensor"), or a dtype cast would silently leave the tables at the old dtype. A no-op
        ``.to()`` is let through: pipelines call ``pipe.to(device)`` freely.
        """

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConfigError(
                "the model cannot be moved or cast while the AdaLN cache is enabled (its tables live on "
                f"{self.device} in {self.spec.dtype}); call handle.disable(), move or cast the model, then "
                "enable again"
            )

        def to(*args: Any, **kwargs: Any) -> Any:
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            moves = device is not None and not (
                torch.device(device).type == self.device.type
                and torch.device(device).index in (None, self.device.index)
            )
            if moves or dtype is not None:
                refuse()
            return self.model

        return {"_apply": refuse, "to": to}

    # ------------------------------------------------------------------ per forward

    def _make_resident(self, plan: torch.Tensor, key: PlanKey, attention_kwargs: Mapping[str, Any] | None) -> None:
        """Before a forward: make ``plan`` resident under the forward's LoRA signature (or refuse).

        Called by the transformer hook with the host copy of the forward's timestep and its key.
        """
        scale = lora_scale_of(attention_kwargs)
        tuners, variant, refs = self._signature(scale)
        if self.config.on_miss == "raise":
            if variant != self._lora.variant:
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
        report = self._build([plan], scale, tuners, variant, refs)
        if report.passes and self.config.on_miss == "build":
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

    # ------------------------------------------------------------------ building

    def _signature(self, scale: float) -> tuple[list[tuple[str, Any]], Variant, list[torch.Tensor]]:
        """Follow a swapped output module, refuse a fuse or a new cast, and read the LoRA signature under ``scale``."""
        assert self._hooks is not None
        self._hooks.follow_output()
        new_casting(served_modules(self.model, self.spec), self._casting_at_enable)
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

    def _build(
        self, plans: Sequence[torch.Tensor], scale: float, tuners: Tuners, variant: Variant, refs: list[torch.Tensor]
    ) -> BuildReport:
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
        # The parked time embedder is lent back by the first embed of a pass and parked again when
        # the build returns, so a build that hits costs no copy.
        with self._parking.time_embedder_loan(self.device) as loan, torch.no_grad(), applied_lora_scale(tuners, scale):
            self._loan = loan
            try:
                report = self.cache.build(plans, embed=self._embed, project=self._project, variant=variant)
            finally:
                self._loan = None
        if self._lora.built_under(variant, refs):
            logger.info("AdaLN cache: tables rebuilt for a new LoRA signature")
        return report

    def _embed(self, plan: torch.Tensor) -> torch.Tensor:
        """The projections' exact input for ``plan``, computed as the stock forward computes it.

        ``time_proj``, then the (fp32) time embedder at its own dtype, then SiLU at ``temb``'s
        precision and only then the cast to the projection dtype (the other order changes about
        half the outputs). Runs the time embedder's own (possibly LoRA-wrapped) forward.
        """
        from diffusers.models.modeling_utils import get_parameter_dtype

        if self._loan is not None:
            self._loan.take()
        model = self.model
        temb = model.time_proj(plan.to(self.device))
        time_embedder = model.get_submodule(TIME_EMBEDDER)
        temb = unhooked(time_embedder, TIME_EMBEDDER_HOOK)(temb.to(get_parameter_dtype(time_embedder)))
        return F.silu(temb).to(projection_dtype(model, self.spec))

    def _project(self, layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``layer``'s output for ``x``, through the module's own (LoRA-wrapped, quantized, cast) forward.

        Full-precision tables of quantized projections (``quantized_projections="checkpoint"``) are a
        plain linear of the checkpoint's weights: decided by that setting, never by the weight's
        type, since a module like optimum-quanto's unfrozen ``QLinear`` quantizes a plain weight in
        its forward.
        """
        if self._plain_tables:
            return F.linear(x, weight, bias)
        module = projection_module(self.model, layer)
        call = unhooked(module, OUTPUT_HOOK) if layer == FINAL else module
        weight = fresh_alias(self._parking.at_model_residue(layer, "weight", weight))
        bias = fresh_alias(self._parking.at_model_residue(layer, "bias", bias))
        with swapped_parameters(base_linear(module), {"weight": weight, "bias": bias}):
            return call(x)  # type: ignore[no-any-return]


def enable_transformer(model: nn.Module, config: AdalnCacheConfig) -> AdalnCacheHandle:
    """Enable the cache on one transformer; on failure the model is left as it was."""
    handle = AdalnCacheHandle(model, config)
    handle._enable()
    return handle


def adaln_cache_handle(model: Any) -> AdalnCacheHandle | None:
    """The enabled handle of ``model``, or ``None``."""
    handle = getattr(model, HANDLE_ATTRIBUTE, None)
    return handle if isinstance(handle, AdalnCacheHandle) and handle.enabled else None
