"""Serving that ``torch.compile`` traces like the resident model: no extra frames, graphs or recompiles.

Two things would otherwise make a compiled, cached model compile more than the same model without
the cache:

- **A hook per block.** diffusers' ``HookRegistry`` gives each hooked module its own
  ``functools.partial`` as ``forward``. Dynamo guards on that object's identity, so a hook on every
  block's ``adaln_proj`` makes each block of a regional compile (``compile_repeated_blocks``)
  recompile, and with 50 blocks the later ones pass the recompile limit and run uncompiled.
  Instead every served block's owner module (MiniMax-H3's ``adaln_proj``, Qwen-Image's ``img_mod``)
  gets one shared class (:func:`served_class`) swapped in place:
  the object, its name, its parameters and peft wrappers stay; ``repr`` shows the original class
  name. Its forward gathers the block's rows from the slab through tensors only (a per-block view
  of the block's column and the thread's slot buffer, updated in place once per forward), never a
  Python number that dynamo would specialise on, so every block reuses one graph. The addresses
  do not move while the model stays on one device, which is what CUDA-graph replay needs.
- **Host work inside the compiled frame.** The transformer hook reads the step's timesteps on the
  host, looks the plan up and may build it; traced by dynamo that is a row of data-dependent graph
  breaks. ``model.compile()`` stores the compiled callable as ``_compiled_call_impl``;
  :class:`EagerPrepare` stands in for it, does the host work eagerly, then calls the compiled
  callable, inside which the hook only runs the original forward.

``torch.compile(model)`` (a wrapper module) cannot be reached from here: the hook's host work runs
under ``torch.compiler.disable`` there, so it adds frames but no graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ...errors import ConfigError
from ...slab import gather_rows

#: Per-block attributes the served class reads; set on install, removed on uninstall.
ROWS_ATTRIBUTE = "_adalncache_rows"
STATE_ATTRIBUTE = "_adalncache_state"
_ATTRIBUTES = (ROWS_ATTRIBUTE, STATE_ATTRIBUTE)

#: The served subclass of each (owner class, served forward), made once so every block shares it.
_SERVED: dict[tuple[type, Callable[..., Any]], type] = {}


class Releasable(Protocol):
    """A request's hold on its plans (:class:`~adalncache.PlanHold`): released when the forward ends."""

    def release(self) -> None: ...


#: ``prepare(args, kwargs)``: the transformer hook's host work for one forward; returns its hold.
Prepare = Callable[[tuple[Any, ...], Mapping[str, Any]], Releasable]


class ForwardState(Protocol):
    """What the transformer hook keeps for the forward in progress (``hooks.ServeState``).

    Per thread. ``slot`` is the device tensor of the forward's plan (``None`` outside a forward,
    so a stray call fails with advice instead of reading the rows of another step);
    ``slot_buffer`` is the one-element tensor the served modules gather with, written in place so
    its address does not change; ``dtype`` is the dtype the rows are served in (``None``: the
    slab's); ``prepared_outside`` tells the hook that :class:`EagerPrepare` already did the host
    work of this forward.
    """

    slot: torch.Tensor | None
    slot_buffer: torch.Tensor
    row_buffer: torch.Tensor
    dtype: torch.dtype | None
    prepared_outside: bool

    def require(self, what: str) -> tuple[torch.Tensor, int, torch.dtype | None]: ...

    def clear(self) -> None: ...


def _served_forward(self: Any, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``adaln_proj(temb)`` served from the slab: ``Y.view(-1, 6H).chunk(6, -1)`` of the resident ``Y``.

    ``temb`` only gives the number of timesteps: it has one row per timestep of the plan.
    """
    state: ForwardState = getattr(self, STATE_ATTRIBUTE)
    if state.slot is None:
        state.require("adaln_proj")
    rows = gather_rows(getattr(self, ROWS_ATTRIBUTE), state.row_buffer[: temb.shape[0]])
    dtype = state.dtype
    if dtype is not None and rows.dtype != dtype:  # built under autocast: served in its dtype
        rows = rows.to(dtype)
    chunks: tuple[torch.Tensor, ...] = rows.reshape(-1, 6 * self.hidden_size).chunk(6, dim=-1)
    return chunks


def served_class(cls: type, forward: Callable[..., Any] = _served_forward) -> type:
    """The shared served subclass of ``cls`` answering with ``forward`` (same name, so ``repr`` and
    class-name lookups are unchanged)."""
    served = _SERVED.get((cls, forward))
    if served is None:
        served = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        served.__qualname__ = cls.__qualname__
        served._adalncache_original = cls  # type: ignore[attr-defined]  # a marker on a class made at runtime
        _SERVED[(cls, forward)] = served
    return served


class ServedBlocks:
    """The served owners (every block's module that calls a served projection) switched to the
    served class, and switched back.

    ``modules``: ``(layer, path, owner module)`` in layer order; ``forward(layer)``: the served
    class's forward for that layer's owner (the family's; owners of one class and one forward share
    one served class); ``rows(layer)``: the ``[P, W, width]`` view of the cache's table the owner
    of ``layer`` gathers from, read again at every :meth:`rebind` (the slab moved).
    """

    def __init__(
        self,
        modules: list[tuple[Any, str, nn.Module]],
        state: ForwardState,
        forward: Callable[[Any], Callable[..., Any]] = lambda layer: _served_forward,
    ) -> None:
        self.modules = modules
        self.state = state
        self.forward = forward
        self._installed = False

    def install(self, rows: Callable[[Any], torch.Tensor]) -> None:
        for _, path, module in self.modules:
            if "forward" in module.__dict__:
                # Another hook replaced this module's forward per instance; a class swap would not reach it.
                raise ConfigError(
                    f"{path} has a forward of its own (a hook of another library "
                    "wraps it), so the AdaLN cache cannot serve it; remove that hook before enabling the cache"
                )
        for layer, _, module in self.modules:
            module.__class__ = served_class(type(module), self.forward(layer))
        self._installed = True
        self.rebind(rows)

    def rebind(self, rows: Callable[[Any], torch.Tensor]) -> None:
        """Point every served module at its rows (again, after the cache's slab moved)."""
        for layer, _, module in self.modules:
            # A per-layer view of the layer's rows, the same strides for every block.
            module.__dict__[ROWS_ATTRIBUTE] = rows(layer)
            module.__dict__[STATE_ATTRIBUTE] = self.state

    def uninstall(self) -> None:
        if not self._installed:
            return
        for _, _, module in self.modules:
            original = getattr(type(module), "_adalncache_original", None)
            if original is not None:
                module.__class__ = original
            for name in _ATTRIBUTES:
                module.__dict__.pop(name, None)
        self._installed = False


class EagerPrepare:
    """Stands in for ``model._compiled_call_impl``: the host work eagerly, then the compiled call.

    ``nn.Module.compile`` stores the compiled callable there and every call of the model goes
    through it, so this is the one place a compiled model's forward can be entered outside the
    compiled region.
    """

    def __init__(self, compiled: Callable[..., Any], prepare: Prepare, state: ForwardState) -> None:
        self.compiled = compiled
        self.prepare = prepare
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        held = self.prepare(args, kwargs)
        self.state.prepared_outside = True
        try:
            return self.compiled(*args, **kwargs)
        finally:
            self.state.prepared_outside = False
            self.state.clear()
            held.release()


class CompiledCall:
    """Keeps a compiled model's ``_compiled_call_impl`` wrapped in :class:`EagerPrepare` while enabled."""

    def __init__(self, model: nn.Module, prepare: Prepare, state: ForwardState) -> None:
        self.model = model
        self.prepare = prepare
        self.state = state

    def wrap(self) -> None:
        """Wrap the model's compiled callable, if it has one (idempotent)."""
        compiled = self.model.__dict__.get("_compiled_call_impl")
        if compiled is not None and not isinstance(compiled, EagerPrepare):
            self.model._compiled_call_impl = EagerPrepare(compiled, self.prepare, self.state)

    def unwrap(self) -> None:
        """Put the compiled callable back as ``nn.Module.compile`` left it."""
        current = self.model.__dict__.get("_compiled_call_impl")
        if isinstance(current, EagerPrepare):
            self.model._compiled_call_impl = current.compiled

    def guard(self) -> dict[str, Callable[..., Any]]:
        """An instance override of ``compile``: compile as asked, then wrap the result."""
        model = self.model
        cls: Any = type(model)

        def compile(*args: Any, **kwargs: Any) -> Any:
            self.unwrap()
            result = cls.compile(model, *args, **kwargs)
            self.wrap()
            return result

        return {"compile": compile}
