"""The AdaLN cache enabled on one transformer of a supported family: :class:`AdalnCacheHandle`.

The handle owns the pieces of one enabling and the order they are put together and taken apart
in: the weight source (:mod:`.choice`), the :class:`~adalncache.AdalnCache`, the parked weights
(:mod:`.parking`), the hooks (:mod:`.hooks`), the LoRA tracking and the method overrides. Each
thread's request, from ``prepare`` to its end, is :mod:`.lifecycle`'s (the handle's request methods
delegate to it); a request's or a forward's holds are :mod:`.requests` (the hit path, else one build)
with the LoRA signature of :mod:`.signature` and the build callbacks of :mod:`.callbacks`.

Threads: a build (with its LoRA scale and its loan of the time embedder's weights) runs under the
handle's lock; a forward whose plan is resident takes no lock but the cache's short one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ... import TensorSource
from ...cache import PlanHold
from ...devices import HostBuffer
from ...errors import CheckpointError, ConfigError
from ...source.memory import NoWeights
from .callbacks import BuildCallbacks
from .casting import casting_guard, settle_casting
from .choice import SourceChoice, choose_source
from .config import AdalnCacheConfig
from .hooks import ServingHooks
from .lifecycle import RequestLifecycle
from .lora import LoraTracker
from .modules import device_of, execution_device, install_overrides, remove_overrides
from .moving import LiftedGroupOffloading, guarded_apply, refresh_group_offloading
from .parking import WeightParking
from .quantized import ProjectionStorage, adapter_guards, transformer_spec
from .registry import family_of
from .requests import RequestHolds
from .signature import ServedSignature
from .sources import NeverLoaded, Source, changed_since

if TYPE_CHECKING:
    from ... import AdalnCache, BuildReport, CacheStats

logger = logging.getLogger(__name__)

#: Where the handle of an enabled model is kept on the model.
HANDLE_ATTRIBUTE = "_adalncache_handle"


class AdalnCacheHandle:
    """The AdaLN cache enabled on one transformer of a supported family.

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
        self._enabled_fingerprint: str | None = None
        #: Builds, LoRA scaling and hook moves (they change module state other threads read).
        self._lock = threading.RLock()
        #: Each thread's request: held, served on the device or the host path, checked, released.
        self._requests = RequestLifecycle(
            model,
            holds=lambda: self._holds,
            enabled=lambda: self.enabled,
            cache=lambda: self.cache,
            family=lambda: self.family,
            follow=self._follow,
            overlap=config.overlap,
        )
        #: Host copies of the model's own projections (CUDA), released on disable().
        self._host_buffers: list[HostBuffer] = []
        self._fresh_state()

    def _fresh_state(self) -> None:
        """What one enabling builds up: read (again) from the model as it is now."""
        #: What is particular to the model's family (:class:`~.family.DiffusersFamily`).
        self.family = family_of(self.model)
        self.spec = transformer_spec(self.model)
        self._parking = WeightParking()
        self._lora = LoraTracker(self.model, self.spec, self.family)
        self._hooks: ServingHooks | None = None
        self._holds: RequestHolds | None = None
        self._storage = ProjectionStorage()
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
        return self._requests.prepare(plans, attention_kwargs)

    def release(self, *, check: bool = True) -> None:
        """Release the plans the calling thread's last :meth:`prepare` holds (no-op when none).

        Raises :class:`~adalncache.PlanMismatchError` (after releasing) when a forward of that
        request matched none of its prepared plans (it was served NaN rows; see :meth:`check_request`);
        ``check=False`` (on the way out of another error) keeps that report for the next check.
        """
        self._requests.release(check=check)

    def start_prepare(self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None) -> None:
        """:meth:`prepare` on a background thread: returns at once, and each forward of the calling
        thread waits only for its own plan (the first step's are built first, :mod:`.overlap`).

        A failure of the pass is raised by the next forward that needs a plan of it, or by
        :meth:`finish`. The request's forwards key their plans on the host (no device-side lookup).
        """
        self._requests.start_prepare(plans, attention_kwargs)

    def predicted_request(
        self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """With ``overlap=True``: start the pass of a pipeline call's schedule predicted from its
        arguments, for the ``with`` block (the call); its first forward adopts the pass when the
        scheduler set the same plans, and drops it otherwise (a wrong prediction costs time, never a row)."""
        return self._requests.predicted(plans, attention_kwargs)

    def finish(self) -> None:
        """End the calling thread's request: wait for its background pass, if any, raise its error if
        no forward raised it yet, then :meth:`release` (and its PlanMismatchError check)."""
        self._requests.finish()

    def join_background(self) -> None:
        """Wait until every background pass started on this handle (by any thread) has ended."""
        self._requests.join_background()

    def check_request(self) -> None:
        """Raise :class:`~adalncache.PlanMismatchError` if a forward of the calling thread's prepared
        request matched none of its plans since the last check (a host read: call it off the critical path).

        Such a forward finds its slot on the device without a host read, and gets the poison
        slot's NaN rows instead of any plan's; this is where the miss is reported. The request
        stays prepared and the cache stays usable.
        """
        self._requests.check()

    def request(
        self, plans: Sequence[Any], *, attention_kwargs: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[PlanHold]:
        """``with handle.request(plans):`` prepares ``plans`` and holds them until the block ends.

        For a bare transformer loop: no build for another request evicts or rewrites these plans
        while the loop runs, and they are released on an exception too. Yields the
        :class:`~adalncache.cache.PlanHold` (``.report`` says what the build did).
        """
        return self._requests.request(plans, attention_kwargs)

    def disable(self, *, allow_changed_checkpoint: bool = False) -> None:
        """Remove every hook and override and put the original weights back, bit-exactly.

        Weights served from a checkpoint are read back from it. If the file changed since enabling
        verified it (its stat identity: a rewrite, a rename over it), what it holds now need not be
        the original weights, so this raises CheckpointError before touching anything and the cache
        stays enabled; ``allow_changed_checkpoint=True`` restores from the file as it is now.
        """
        if not self.enabled:
            return
        self._requests.stop_background()  # a pass uses the parked weights and the hooks: none from now on
        self._check_disable(allow_changed_checkpoint)
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self._holds = None
        remove_overrides(self.model, self._overrides)
        self._overrides = ()
        freed = self._parking.freed
        self._parking.restore()
        settle_casting(self.family.served_modules(self.model, self.spec), self._casting_at_enable)
        self.family.release_blocks(self.model)
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
        self._requests.check()  # a forward of the last request matched none of its plans

    def _check_disable(self, allow_changed_checkpoint: bool) -> None:
        """Refuse a disable that would drop another library's wrapper or restore from a changed file."""
        if self._hooks is not None and self._hooks.forward_wrapped_by_others():
            raise ConfigError(
                "another library wrapped the transformer's forward after enable_adaln_cache() (cache-dit does); "
                "removing the AdaLN cache now would silently drop that wrapper. Remove that wrapper first (cache-dit "
                "1.5.3 cannot remove its own here: reload the model), and enable such a library before "
                "enable_adaln_cache() when the cache must be disabled on its own"
            )
        self._requests.abandon()  # a mismatch it reports is raised once disabled
        if self._parking.restores_from_source and not allow_changed_checkpoint:
            assert self.source is not None
            if changed_since(self.source, self._enabled_fingerprint):
                raise CheckpointError(
                    f"checkpoint {self.config.checkpoint} changed on disk since enable_adaln_cache() verified "
                    "it, so restoring the projection weights from it may not give back the original model; "
                    "reload the model, or call disable(allow_changed_checkpoint=True) to restore from the "
                    "file as it is"
                )

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
        self.family.capture_blocks(model)
        try:
            choice = choose_source(model, self.spec, self.config, self._lora, self.device, never_loaded)
            self._adopt(choice)
            if never_loaded is not None:
                self.cache = never_loaded.cache
            else:
                self.cache = self.config.cache_options.build(self.spec, choice.source, choice.device)
        except BaseException:
            self.family.release_blocks(model)
            raise
        if choice.source is None:
            assert isinstance(self.cache.source, NoWeights)
            self.source = self.cache.source
        self._enabled_fingerprint = self.cache.source.fingerprint
        # From here on the model is modified; undo everything if a step fails. Group offloading (if
        # applied first) captured the weights parked here: it is lifted, and comes back rebuilt,
        # outside our hooks (see moving.LiftedGroupOffloading).
        lifted = LiftedGroupOffloading(model)
        try:
            self._park(choice, never_loaded)
            self._serve(choice)
            lifted.restore()
            overrides = self._lora.guards(standing_in=self._parking.standing_in, after_load=self._follow_output)
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

    def _adopt(self, choice: SourceChoice) -> None:
        """Keep what the rest of the enabling and the disabling need from the chosen source."""
        self.source = choice.source
        self._storage = choice.storage
        self._casting_at_enable = choice.casting_at_enable
        self._host_buffers = choice.host_buffers

    def _park(self, choice: SourceChoice, never_loaded: NeverLoaded | None) -> None:
        """Free the served weights from the device (the time embedder's too when nothing else reads it)."""
        self._parking.park(
            choice.park_targets(self.family, self.model),
            source=self.cache.source,
            host_tensors=choice.host_tensors,
            never_loaded=never_loaded.residues if never_loaded is not None else None,
            device=never_loaded.device if never_loaded is not None else None,
        )

    def _serve(self, choice: SourceChoice) -> None:
        """Register the hooks, and what a request or a forward holds its plans with."""
        model = self.model
        self._hooks = hooks = ServingHooks(
            model,
            self.spec,
            self.cache,
            self._requests.hold_forward,
            self.family,
            before=self._requests.schedule.before_forward,
            prepared=self._requests.serve_prepared,
        )
        hooks.register(time_embedder=choice.free_time_embedder)
        signature = ServedSignature(
            model,
            self.spec,
            self._lora,
            hooks,
            self._lock,
            casting_at_enable=choice.casting_at_enable,
            plain_tables=choice.plain_tables,
            plain_variant=choice.plain_variant,
        )
        callbacks = BuildCallbacks(
            model, self.spec, self._parking, lambda: self.device, plain_tables=choice.plain_tables, family=self.family
        )
        self._holds = RequestHolds(
            self.cache, signature, callbacks, self._lora, self._lock, on_miss=self.config.on_miss
        )

    def _follow_output(self) -> None:
        """Move the output hook onto whatever module sits at ``norm_out.linear`` now (a LoRA load replaced it)."""
        if self._hooks is not None:
            self._hooks.follow_output()

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
        self._requests.reopen_background()
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
        self._requests.abandon()  # a mismatch it reports waits for the next check
        self.cache.move_to(device)  # a no-op when both name one device ("cuda" and "cuda:0")
        if self.cache.device != before:
            if self._hooks is not None:
                self._hooks.rebind()  # the slab tensors are new ones on the new device
            logger.info("AdaLN cache: the model runs on %s now (was %s); the tables followed", device, before)
        self.device = device

    def expect_schedule(self, timesteps: torch.Tensor) -> None:
        """A pipeline's scheduler set ``timesteps`` on this thread: its next forward prepares them all."""
        self._requests.schedule.expect(timesteps)


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
