"""The diffusers hooks that serve a forward's AdaLN modulation from the cache.

- :class:`AdalnCacheTransformerHook` wraps the transformer's ``forward``. A forward of the
  thread's prepared request finds its slot on the device, with no host read (:mod:`.prepared`:
  what a CUDA graph can capture). Any other forward reads the step's ``timestep`` (the *plan*)
  once on the host, has the plan made resident and *held* for the current LoRA signature and
  autocast state (built, or refused with ``on_miss="raise"``); the hold is released when the
  forward ends (on an exception too), so no build on another thread can rewrite the rows a
  forward is reading. Either way the slot goes into a per-thread :class:`ServeState` for the
  served modules, cleared when the forward ends. That host work runs outside any compiled region
  (see :mod:`.compile`).
- Every block's ``adaln_proj`` is served by a class swapped in place rather than a hook
  (:class:`~.compile.ServedBlocks`): a hook per block would make a regional compile recompile
  every block. It serves the block's six modulation tensors whether or not ``adaln_proj.linear``
  is a peft wrapper.
- :class:`AdalnCacheOutputHook` replaces ``norm_out.linear``'s forward. peft *replaces* that module
  object when a LoRA targets it, so :meth:`ServingHooks.follow_output` moves the hook to whatever
  module sits there now.
- :class:`AdalnCacheTimeEmbedderHook` (when the time embedder is parked) returns a zero-stride
  placeholder of the right shape: every consumer of ``temb`` is served from the cache.

:class:`ServingHooks` registers them on one transformer under the constant names below and removes
them again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks.hooks import HookRegistry, ModelHook
from torch import nn

from ...cache import PlanHold
from ...errors import ConfigError
from ...plans import PlanKey, plan_key
from ...spec import FINAL, ModulationSpec
from .compat import get_hook, hook_names, hook_registry
from .compile import CompiledCall, Releasable, ServedBlocks
from .family import DiffusersFamily
from .modules import forward_argument

if TYPE_CHECKING:
    from ... import AdalnCache

TRANSFORMER_HOOK = "adaln_cache_transformer"
OUTPUT_HOOK = "adaln_cache_output"
TIME_EMBEDDER_HOOK = "adaln_cache_time_embedder"

#: Every hook name above starts with it; a hook without it belongs to someone else.
HOOK_PREFIX = "adaln_cache"

#: ``make_resident(plan, key, attention_kwargs, device)``: hold the forward's plan resident on the
#: device the forward runs on (its timestep's), or raise.
MakeResident = Callable[[torch.Tensor, PlanKey, Mapping[str, Any] | None, torch.device], PlanHold]

#: ``prepared(timestep, attention_kwargs)``: the forward's ``(slot, dtype)`` found on the device from
#: the thread's prepared request (no host read), or ``None`` for the host path (see :mod:`.prepared`).
ServePrepared = Callable[[torch.Tensor, Mapping[str, Any] | None], tuple[torch.Tensor, torch.dtype] | None]


class _Unheld:
    """What a forward served from its prepared request releases: nothing (the request holds its plans)."""

    def release(self) -> None:
        return None


UNHELD = _Unheld()


class ServeState(threading.local):
    """What the transformer hook hands the served modules for the forward in progress.

    Per thread (a ``threading.local``): two threads running forwards of one model each see their
    own slot. ``slot_buffer`` is the one-element device tensor the served blocks gather with:
    written in place at every forward of its thread, so its address (which compiled graphs and
    CUDA graphs hold) does not change while the model stays on one device. ``dtype`` is the dtype
    the rows are served in (the autocast dtype they were built under). ``prepared_outside`` is set
    while a compiled call's host work was done before entering it (:class:`~.compile.EagerPrepare`).
    """

    def __init__(self, device: torch.device) -> None:
        self.slot: torch.Tensor | None = None
        self.num_timesteps = 0
        self.dtype: torch.dtype | None = None
        self.slot_buffer = torch.zeros(1, dtype=torch.int64, device=device)
        #: The forward's flat slab rows (``cache.row_index``), which the served blocks gather with.
        self.row_buffer = torch.zeros(1, dtype=torch.int64, device=device)
        self.prepared_outside = False

    def serve(self, held: PlanHold, num_timesteps: int, rows: torch.Tensor) -> None:
        """Stash the held plan's slot (a device tensor, no host copy) and point the served blocks at it."""
        self.serve_slot(held.slots, num_timesteps, held.dtype, rows)

    def serve_slot(self, slot: torch.Tensor, num_timesteps: int, dtype: torch.dtype | None, rows: torch.Tensor) -> None:
        """Stash ``slot`` and its ``rows`` (device tensors, never read on the host) for the served blocks."""
        if self.slot_buffer.device != slot.device:  # the model (and the cache) moved
            self.slot_buffer = torch.zeros(1, dtype=torch.int64, device=slot.device)
        if self.row_buffer.shape != rows.shape or self.row_buffer.device != rows.device:
            self.row_buffer = torch.zeros_like(rows)
        self.slot = slot
        self.num_timesteps = num_timesteps
        self.dtype = dtype
        self.slot_buffer.copy_(slot.reshape(1))
        self.row_buffer.copy_(rows)

    def clear(self) -> None:
        """Forget the forward's slot, so a stray call outside a forward fails instead of reading stale rows."""
        self.slot = None
        self.num_timesteps = 0
        self.dtype = None

    def require(self, what: str) -> tuple[torch.Tensor, int, torch.dtype | None]:
        """The forward's ``(slot, num_timesteps, dtype)``, or a ConfigError when no forward is in progress."""
        if self.slot is None:
            raise ConfigError(
                f"{what} is served by the AdaLN cache and can only run inside the transformer's forward "
                "while the cache is enabled; call handle.disable() to use the module on its own"
            )
        return self.slot, self.num_timesteps, self.dtype


class AdalnCacheTransformerHook(ModelHook):
    """Holds the step's plan once per forward and stashes its slot for the served modules."""

    def __init__(
        self, cache: AdalnCache, state: ServeState, make_resident: MakeResident, family: DiffusersFamily | None = None
    ) -> None:
        super().__init__()
        self.cache = cache
        self.state = state
        self.make_resident = make_resident
        if family is None:
            from .registry import for_spec

            family = for_spec(cache.spec)
        self.family = family
        #: ``before(args, kwargs)``: runs first in :meth:`prepare` (a pipeline's schedule is prepared there).
        self.before: Callable[[tuple[Any, ...], Mapping[str, Any]], None] | None = None
        #: Serves a forward of the thread's prepared request without a host read (:mod:`.prepared`).
        self.prepared: ServePrepared | None = None

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward: Any = self.fn_ref.original_forward
        if self.state.prepared_outside:
            return forward(*args, **kwargs)  # a compiled call: EagerPrepare did the host work already
        held = self.prepare(module, args, kwargs)
        try:
            return forward(*args, **kwargs)
        finally:
            self.state.clear()
            held.release()

    @torch.compiler.disable
    def prepare(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Releasable:
        """The forward's host work: read the plan, hold it resident, point the served modules at its slot.

        Returns the hold, which the caller releases when the forward ends. Never traced: under
        ``torch.compile(model)`` dynamo would otherwise break the graph at every host read and
        dictionary lookup in here. A forward of the thread's prepared request finds its slot on
        the device instead (:mod:`.prepared`): no host read of a device tensor at all.
        """
        if self.before is not None:
            self.before(args, kwargs)
        timestep = self.family.forward_plan(module, args, kwargs)
        attention_kwargs = forward_argument(module, "attention_kwargs", args, kwargs)
        if self.prepared is not None:
            served = self.prepared(timestep, attention_kwargs)
            if served is not None:
                rows = int(timestep.shape[0])
                self.state.serve_slot(served[0], rows, served[1], self.cache.row_index(served[0], rows))
                return UNHELD  # the request's hold keeps its plans; released when the request ends
        # The one device-to-host read of the plan this forward makes: keys, lookups and the build all
        # use this host copy (embed moves it back to the device; the values are the same bits).
        plan = timestep.detach().to("cpu")
        key = plan_key(plan, self.cache.spec.plan_columns)
        held = self.make_resident(plan, key, attention_kwargs, timestep.device)
        try:
            self.state.serve(held, int(plan.shape[0]), self.cache.row_index(held.slots, int(plan.shape[0])))
        except BaseException:
            held.release()
            raise
        return held


class AdalnCacheOutputHook(ModelHook):
    """Serves a hooked projection's output: ``norm_out.linear``'s (shift then scale, as the module
    returns it) by default, or ``layer``'s rows for the rows of its input.
    """

    def __init__(self, cache: AdalnCache, state: ServeState, layer: Any = FINAL, path: str = "norm_out.linear") -> None:
        super().__init__()
        self.cache = cache
        self.state = state
        self.layer = layer
        self.path = path

    def new_forward(self, module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        slot, num_timesteps, dtype = self.state.require(self.path)
        if self.layer == FINAL and self.cache.spec.geometry is None:  # the default family's two-part table
            shift, scale = self.cache.final(slot, num_timesteps, dtype=dtype)
            return torch.cat((shift, scale), dim=-1)
        return self.cache.layer_rows(self.layer, slot, int(x.shape[0]), dtype=dtype)


class AdalnCacheTimeEmbedderHook(ModelHook):
    """Stands in for a parked time embedder: a zero-stride tensor of the shape and dtype of ``temb``.

    Only the AdaLN projections read ``temb`` in the stock forward and both are served from the
    cache, so its value is never used; a zero-stride view costs no memory.
    """

    def __init__(
        self, out_features: int, dtype: torch.dtype, device: torch.device, family: DiffusersFamily | None = None
    ) -> None:
        super().__init__()
        self.out_features = out_features
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.family = family

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.family is None:
            return self.zero.expand(args[0].shape[0], self.out_features)
        rows, dtype = self.family.stand_in(args, kwargs)
        zero = self.zero if dtype is None or dtype == self.zero.dtype else self.zero.to(dtype)
        stand_in = zero.expand(rows, self.out_features)
        return stand_in.clone() if self.family.writable_stand_in else stand_in


def remove_hook(module: nn.Module, name: str) -> None:
    """Remove hook ``name`` from ``module`` if it is there."""
    if get_hook(module, name) is not None:
        hook_registry(module).remove_hook(name, recurse=False)


def other_hooks_present(model: nn.Module) -> bool:
    """Whether a diffusers hook that is not ours sits on any module (it might read ``temb``)."""
    for _, module in model.named_modules():
        if any(not name.startswith(HOOK_PREFIX) for name in hook_names(module)):
            return True
    return False


class ServingHooks:
    """The hooks of one transformer: registered together, the output hook kept on the live module.

    ``make_resident`` is what the transformer hook calls before each forward (the build-or-refuse
    policy, :meth:`.lifecycle.RequestLifecycle.hold_forward`); the hooks themselves only read the cache.
    """

    def __init__(
        self,
        model: Any,
        spec: ModulationSpec,
        cache: AdalnCache,
        make_resident: MakeResident,
        family: DiffusersFamily | None = None,
        before: Callable[[tuple[Any, ...], Mapping[str, Any]], None] | None = None,
        prepared: ServePrepared | None = None,
    ) -> None:
        if family is None:
            from .registry import for_spec

            family = for_spec(spec)
        self.before = before
        self.prepared = prepared
        self.model = model
        self.spec = spec
        self.cache = cache
        self.family = family
        self.state = ServeState(cache.device)
        self.make_resident = make_resident
        swapped = family.swapped_layers(spec)
        owners = [(layer, family.owner_path(layer)) for layer in swapped]
        self.blocks = ServedBlocks(
            [(layer, path, family.module_at(model, path)) for layer, path in owners],
            self.state,
            family.served_forward,
        )
        #: The layers served by a hook on their projection module, by module path.
        self.hooked = {family.projection_path(layer): layer for layer in spec.layers() if layer not in set(swapped)}
        self.compiled = CompiledCall(model, self.prepare_forward, self.state)
        self._transformer_hook: AdalnCacheTransformerHook | None = None
        self._forward: Any = None
        self._hooked_output: dict[str, nn.Module] = {}

    def register(self, *, time_embedder: bool) -> None:
        """Register every hook; ``time_embedder``: also stand in for the (parked) time embedder."""
        from diffusers.models.modeling_utils import get_parameter_dtype

        model = self.model
        family = self.family
        registry = HookRegistry.check_if_exists_or_initialize(model)
        self._transformer_hook = AdalnCacheTransformerHook(self.cache, self.state, self.make_resident, family)
        self._transformer_hook.before = self.before
        self._transformer_hook.prepared = self.prepared
        registry.register_hook(self._transformer_hook, TRANSFORMER_HOOK)
        # The forward the registry installed for our hook: anything else there later wraps it.
        self._forward = model.__dict__.get("forward")
        self.blocks.install(self._rows)
        self.follow_output()
        if time_embedder:
            module = family.time_embedder_module(model)
            hook = AdalnCacheTimeEmbedderHook(
                family.temb_width(model), get_parameter_dtype(module), self.cache.device, family
            )
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, TIME_EMBEDDER_HOOK)
        registry.invalidate_child_registries_cache()
        self.compiled.wrap()

    def prepare_forward(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Releasable:
        """The transformer hook's host work for a forward called with ``args`` and ``kwargs`` (returns its hold)."""
        assert self._transformer_hook is not None
        return self._transformer_hook.prepare(self.model, args, kwargs)

    def _rows(self, layer: Any) -> torch.Tensor:
        return self.family.rows_view(self.cache, layer)

    def rebind(self) -> None:
        """Point the served blocks at the cache's slab again (after the cache moved: new tensors)."""
        self.blocks.rebind(self._rows)

    def forward_wrapped_by_others(self) -> bool:
        """Whether something outside diffusers' hook registry wrapped the transformer's forward after us.

        Removing our hook then would put back the forward from before enabling and silently drop
        that wrapper (cache-dit replaces ``forward`` this way). Hooks registered after ours through
        the registry are fine: it relinks them.
        """
        order = hook_names(self.model)
        if not order or order[-1] != TRANSFORMER_HOOK:
            return False
        return self.model.__dict__.get("forward") is not self._forward

    def output_moved(self) -> bool:
        """Whether a hooked projection (``norm_out.linear``) is another module than the one its hook sits on."""
        return any(self.family.module_at(self.model, path) is not self._hooked_output.get(path) for path in self.hooked)

    def follow_output(self) -> None:
        """Keep each output hook on whatever module sits at its projection's path now (peft swaps it)."""
        moved = False
        for path, layer in self.hooked.items():
            current = self.family.module_at(self.model, path)
            hooked = self._hooked_output.get(path)
            if current is hooked:
                continue
            if hooked is not None:
                remove_hook(hooked, OUTPUT_HOOK)
            HookRegistry.check_if_exists_or_initialize(current).register_hook(
                AdalnCacheOutputHook(self.cache, self.state, layer, path), OUTPUT_HOOK
            )
            self._hooked_output[path] = current
            moved = True
        if moved:
            HookRegistry.check_if_exists_or_initialize(self.model).invalidate_child_registries_cache()

    def remove(self) -> None:
        """Remove every hook registered here (those never registered are skipped)."""
        model = self.model
        self.compiled.unwrap()
        remove_hook(model, TRANSFORMER_HOOK)
        self._transformer_hook = None
        self.blocks.uninstall()
        for hooked in self._hooked_output.values():
            remove_hook(hooked, OUTPUT_HOOK)
        self._hooked_output = {}
        remove_hook(self.family.time_embedder_module(model), TIME_EMBEDDER_HOOK)
        HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()
        self.state.clear()
