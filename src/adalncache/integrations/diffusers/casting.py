"""diffusers' layerwise casting applied to a model while the AdaLN cache serves it.

Casting *before* enabling needs nothing here: the projections' storage is detected at enable time
(:mod:`.quantized`) and the tables are projected through the casting hook like the resident
forward. Casting *after* enabling would only reach the meta placeholders while the tables keep the
uncast weights, a silent difference. ``model.enable_layerwise_casting(...)`` is therefore
guarded by the handle (disable, cast the restored weights, enable again); the free function
``diffusers.hooks.apply_layerwise_casting(model, ...)`` cannot be guarded, so a casting hook that
appears on a served module is refused at the next forward or prepare (:func:`new_casting`), and
``disable()`` then casts the restored weights the way the hook would have cast them at
registration (:func:`settle_casting`), so the model is the cast model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...errors import AdalnCacheError, ConfigError
from .modules import base_linear, casting_hook


def casting_compute_dtype(module: Any) -> Any:
    """The compute dtype of the casting hook on ``module``'s linear, or None.

    A rebuild pass runs the projection beneath every hook (:func:`~.modules.bypassing_hooks`), so
    it applies the cast itself: the hook's pre-forward is ``module.to(dtype=compute_dtype)``, the
    same ``Tensor.to`` of each parameter.
    """
    hook = casting_hook(module)
    return hook.compute_dtype if hook is not None else None


def casting_paths(named: Sequence[tuple[str, Any]]) -> frozenset[str]:
    """The paths among ``named`` (``(path, module)`` pairs) whose linear carries a casting hook."""
    return frozenset(path for path, module in named if casting_hook(module) is not None)


def new_casting(named: Sequence[tuple[str, Any]], at_enable: frozenset[str]) -> None:
    """Refuse a casting hook added to a served module since enabling (the tables would not be cast)."""
    added = sorted(casting_paths(named) - at_enable)
    if added:
        raise ConfigError(
            f"layerwise casting was applied to {', '.join(added[:3])}{' ...' if len(added) > 3 else ''} while the "
            "AdaLN cache serves them, so the tables no longer match the cast model; call handle.disable() (the "
            "casting then applies to the restored weights) and enable the cache again, or cast with "
            "model.enable_layerwise_casting(...), which re-enables the cache for you"
        )


def settle_casting(named: Sequence[tuple[str, Any]], at_enable: frozenset[str]) -> None:
    """Cast restored weights the way a casting hook added while enabled would have cast them.

    The hook casts its module to the storage dtype when it is registered; registered on a
    placeholder, that cast reached nothing real.
    """
    for path, module in named:
        if path in at_enable:
            continue
        hook = casting_hook(module)
        if hook is not None:
            base_linear(module).to(dtype=hook.storage_dtype, non_blocking=hook.non_blocking)


def casting_guard(
    model: Any, *, disable: Callable[[], None], enable_again: Callable[[], None]
) -> dict[str, Callable[..., Any]]:
    """An instance override of ``enable_layerwise_casting``: disable, cast the real weights, enable again.

    Cast while served, only the placeholders would change; the tables would keep the uncast weights.
    """
    cls: Any = type(model)

    def enable_layerwise_casting(*args: Any, **kwargs: Any) -> Any:
        disable()
        result = cls.enable_layerwise_casting(model, *args, **kwargs)
        try:
            enable_again()
        except AdalnCacheError as exc:
            raise ConfigError(
                f"layerwise casting was applied, but the AdaLN cache could not be enabled again: {exc}; the cache "
                "is now disabled"
            ) from exc
        return result

    return {"enable_layerwise_casting": enable_layerwise_casting}
