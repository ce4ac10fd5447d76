"""How a forward reaches the slab: the diffusers hooks on the transformer (one ``serve`` per forward,
released when it ends), on ``norm_out.linear`` and on a parked time embedder, and the served class
swapped into every block's owner module; registered under constant names and removed again.

Owners are swapped to one shared class rather than hooked: diffusers gives each hooked module its own
``functools.partial`` as ``forward`` and dynamo guards on its identity, so a regional compile would
recompile every block, the later ones past the recompile limit. The forward's host work (keying,
holding, maybe a build) would be data-dependent graph breaks if traced: it runs eagerly before
``model.compile()``'s compiled call (:class:`EagerPrepare`), and under ``torch.compiler.disable``
inside ``torch.compile(model)``, which cannot be reached (docs/diffusers.md, "torch.compile").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from diffusers.hooks.hooks import HookRegistry, ModelHook
from torch import nn

from ...errors import ConfigError
from ...spec import ModulationSpec
from .compat import get_hook, hook_names, hook_registry
from .family import ROWS_ATTRIBUTE, STATE_ATTRIBUTE, DiffusersFamily, ForwardState, gather_rows

if TYPE_CHECKING:
    from ... import AdalnCache
    from ...cache import PlanHold

TRANSFORMER_HOOK = "adaln_cache_transformer"
OUTPUT_HOOK = "adaln_cache_output"
TIME_EMBEDDER_HOOK = "adaln_cache_time_embedder"

#: Every hook name above starts with it; a hook without it belongs to someone else.
HOOK_PREFIX = "adaln_cache"

#: The served subclass of each (owner class, served forward), made once so every block shares it.
_SERVED: dict[tuple[type, Callable[..., Any]], type] = {}


class ServingState(ForwardState, Protocol):
    """The thread's forward state as the hooks use it: ``prepared_outside`` is set while
    :class:`EagerPrepare` did the forward's host work before the compiled call."""

    prepared_outside: bool

    def clear(self) -> None: ...


#: ``serve(args, kwargs)``: a forward's host work; points the thread's state at its slot and returns what
#: the forward holds until it ends (``None``: its request holds the plans).
Serve = Callable[[tuple[Any, ...], Mapping[str, Any]], "PlanHold | None"]


class AdalnCacheTransformerHook(ModelHook):
    """Asks for the forward's slot once per forward (``serve``) and releases what it held at the end."""

    def __init__(self, serve: Serve, state: ServingState) -> None:
        super().__init__()
        self.serve, self.state = serve, state

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward: Any = self.fn_ref.original_forward
        if self.state.prepared_outside:
            return forward(*args, **kwargs)  # a compiled call: EagerPrepare did the host work already
        return self.served(forward, args, kwargs)

    def served(self, call: Callable[..., Any], args: tuple[Any, ...], kwargs: Any, *, outside: bool = False) -> Any:
        """``call`` after the forward's host work, releasing its hold at the end (on an exception too);
        ``outside``: ``call`` is the compiled one, whose forward must not do the host work again."""
        held = self.prepare(args, kwargs)
        if outside:  # only then: a traced forward writes no more thread state than it must
            self.state.prepared_outside = True
        try:
            return call(*args, **kwargs)
        finally:
            if outside:
                self.state.prepared_outside = False
            self.state.clear()
            if held is not None:
                held.release()

    @torch.compiler.disable
    def prepare(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> PlanHold | None:
        """The forward's host work, never traced (module docstring)."""
        return self.serve(args, kwargs)


class AdalnCacheOutputHook(ModelHook):
    """Serves a hooked projection's output (``norm_out.linear``): its rows for the rows of its input."""

    def __init__(self, rows: torch.Tensor, state: ForwardState, path: str = "norm_out.linear") -> None:
        super().__init__()
        self.rows, self.state, self.path = rows, state, path

    def new_forward(self, module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return gather_rows(self.rows, self.state, int(x.shape[0]), self.path)


class AdalnCacheTimeEmbedderHook(ModelHook):
    """Stands in for a parked time embedder: a zero-stride tensor of the shape and dtype of ``temb``, whose
    value the served projections, its only consumers, never read."""

    def __init__(self, out_features: int, dtype: torch.dtype, device: torch.device, family: DiffusersFamily) -> None:
        super().__init__()
        self.out_features, self.family = out_features, family
        self.zero = torch.zeros((), dtype=dtype, device=device)

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows, dtype = self.family.stand_in(args, kwargs)
        zero = self.zero if dtype is None or dtype == self.zero.dtype else self.zero.to(dtype)
        stand_in = zero.expand(rows, self.out_features)
        return stand_in.clone() if self.family.writable_stand_in else stand_in


def served_class(cls: type, forward: Callable[..., Any]) -> type:
    """The shared served subclass of ``cls`` answering with ``forward`` (same name, so ``repr`` and
    class-name lookups are unchanged)."""
    served = _SERVED.get((cls, forward))
    if served is None:
        served = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        served.__qualname__ = cls.__qualname__
        served._adalncache_original = cls  # type: ignore[attr-defined]  # a marker on a class made at runtime
        _SERVED[(cls, forward)] = served
    return served


def remove_hook(module: nn.Module, name: str) -> None:
    """Remove hook ``name`` from ``module`` if it is there."""
    if get_hook(module, name) is not None:
        hook_registry(module).remove_hook(name, recurse=False)


def other_hooks_present(model: nn.Module) -> bool:
    """Whether a diffusers hook that is not ours sits on any module (it might read ``temb``)."""
    return any(not name.startswith(HOOK_PREFIX) for _, module in model.named_modules() for name in hook_names(module))


class EagerPrepare:
    """Stands in for ``model._compiled_call_impl``: the host work eagerly, then the compiled call."""

    def __init__(self, compiled: Callable[..., Any], hook: AdalnCacheTransformerHook) -> None:
        self.compiled, self.hook = compiled, hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook.served(self.compiled, args, kwargs, outside=True)


class ServingHooks:
    """The hooks and served owners of one transformer: registered together, removed together, the
    output hook kept on the live module, the rows views re-read after the cache moved."""

    def __init__(
        self, model: Any, spec: ModulationSpec, cache: AdalnCache, family: DiffusersFamily, state: ServingState
    ) -> None:
        self.model, self.cache, self.family, self.state = model, cache, family, state
        swapped = family.swapped_layers(spec)
        self.owners = [
            (layer, path, family.module_at(model, path)) for layer in swapped for path in [family.owner_path(layer)]
        ]
        #: The layers served by a hook on their projection module, by module path.
        self.hooked = {family.projection_path(layer): layer for layer in spec.layers() if layer not in set(swapped)}
        self._hooked_output: dict[str, nn.Module] = {}
        self._forward: Any = None
        self._swapped = False

    def register(self, serve: Serve, *, time_embedder: bool) -> None:
        """Register every hook and swap every owner; ``time_embedder``: also stand in for the parked one."""
        from diffusers.models.modeling_utils import get_parameter_dtype

        model, family = self.model, self.family
        for _, path, module in self.owners:
            if "forward" in module.__dict__:  # another hook replaced its forward per instance: a swap misses it
                raise ConfigError(
                    f"{path} has a forward of its own (a hook of another library wraps it), so the AdaLN cache cannot "
                    "serve it; remove that hook before enabling the cache"
                )
        self._hook = AdalnCacheTransformerHook(serve, self.state)
        registry = HookRegistry.check_if_exists_or_initialize(model)
        registry.register_hook(self._hook, TRANSFORMER_HOOK)
        self._forward = model.__dict__.get("forward")  # ours: anything else there later wraps it
        for layer, _, module in self.owners:
            module.__class__ = served_class(type(module), family.served_forward(layer))
        self._swapped = True
        self.rebind()
        if time_embedder:
            module = family.time_embedder_module(model)
            stand_in = AdalnCacheTimeEmbedderHook(
                family.temb_width(model), get_parameter_dtype(module), self.cache.device, family
            )
            HookRegistry.check_if_exists_or_initialize(module).register_hook(stand_in, TIME_EMBEDDER_HOOK)
        registry.invalidate_child_registries_cache()
        self.wrap_compiled()

    def rebind(self) -> None:
        """Point every served owner and output hook at the cache's slab (again, after it moved: new tensors)."""
        for layer, _, module in self.owners:
            module.__dict__[ROWS_ATTRIBUTE] = self.family.rows_view(self.cache, layer)
            module.__dict__[STATE_ATTRIBUTE] = self.state
        for path in self.hooked:
            hook = get_hook(self._hooked_output[path], OUTPUT_HOOK) if path in self._hooked_output else None
            if hook is not None:
                hook.rows = self.family.rows_view(self.cache, self.hooked[path])
        self.follow_output()

    def forward_wrapped_by_others(self) -> bool:
        """Whether something outside diffusers' hook registry (cache-dit) wrapped the transformer's forward after
        us: removing our hook would put back the forward from before enabling and silently drop that wrapper."""
        order = hook_names(self.model)
        return bool(order) and order[-1] == TRANSFORMER_HOOK and self.model.__dict__.get("forward") is not self._forward

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
            rows = self.family.rows_view(self.cache, layer)
            HookRegistry.check_if_exists_or_initialize(current).register_hook(
                AdalnCacheOutputHook(rows, self.state, path), OUTPUT_HOOK
            )
            self._hooked_output[path] = current
            moved = True
        if moved:
            HookRegistry.check_if_exists_or_initialize(self.model).invalidate_child_registries_cache()

    def wrap_compiled(self) -> None:
        """Wrap the model's compiled callable in :class:`EagerPrepare`, if it has one (idempotent)."""
        compiled = self.model.__dict__.get("_compiled_call_impl")
        if compiled is not None and not isinstance(compiled, EagerPrepare):
            self.model._compiled_call_impl = EagerPrepare(compiled, self._hook)

    def unwrap_compiled(self) -> None:
        """Put the compiled callable back as ``nn.Module.compile`` left it."""
        current = self.model.__dict__.get("_compiled_call_impl")
        if isinstance(current, EagerPrepare):
            self.model._compiled_call_impl = current.compiled

    def compile_guard(self) -> dict[str, Callable[..., Any]]:
        """An instance override of ``compile``: compile as asked, then wrap the result."""
        model, cls = self.model, type(self.model)

        def compile(*args: Any, **kwargs: Any) -> Any:
            self.unwrap_compiled()
            result = cls.compile(model, *args, **kwargs)
            self.wrap_compiled()
            return result

        return {"compile": compile}

    def remove(self) -> None:
        """Remove every hook registered here and swap every owner back (those never installed are skipped)."""
        model = self.model
        self.unwrap_compiled()
        remove_hook(model, TRANSFORMER_HOOK)
        if self._swapped:
            for _, _, module in self.owners:
                original = getattr(type(module), "_adalncache_original", None)
                if original is not None:
                    module.__class__ = original
                for name in (ROWS_ATTRIBUTE, STATE_ATTRIBUTE):
                    module.__dict__.pop(name, None)
            self._swapped = False
        for hooked in self._hooked_output.values():
            remove_hook(hooked, OUTPUT_HOOK)
        self._hooked_output = {}
        remove_hook(self.family.time_embedder_module(model), TIME_EMBEDDER_HOOK)
        HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()
        self.state.clear()


__all__ = ["AdalnCacheOutputHook", "AdalnCacheTimeEmbedderHook", "AdalnCacheTransformerHook", "ServingHooks"]
