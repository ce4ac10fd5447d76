"""Moving or casting an enabled model: ``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``pipe.to()``.

Every one of these ends in ``nn.Module._apply(fn)`` on the model (``ModelMixin.to`` calls
``nn.Module.to``, which calls it; a pipeline's ``to`` calls each component's), so one override of
``_apply`` sees them all. The override first *probes* ``fn`` on an empty tensor of every device and
dtype the model holds, so nothing changes until every check has passed:

* a dtype change is refused: the tables hold the projections' outputs at the loaded precision,
  and a cast model would read them at the old one (disable, cast, enable again);
* a move to ``meta`` is refused: it would drop the weights the forward still needs;
* a device move is let through, and the cache follows: it moves (or rebuilds) its tables on the
  new device before the weights move, and goes back if the weights cannot.

The parked placeholders are plain attributes, not parameters, so the model's own ``_apply``
never touches them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from .compat import (
    apply_group_offloading_config,
    group_offloading_config,
    group_offloading_hook_names,
    reapply_group_offloading,
)


def guarded_apply(
    model: nn.Module, *, moved: Callable[[torch.device], None], back: Callable[[torch.device], None]
) -> Callable[..., Any]:
    """The ``_apply`` override of an enabled model (see the module docstring).

    ``moved(target)`` runs before the weights move to ``target`` (the cache and the parked
    weights' bookkeeping follow); ``back(previous)`` undoes it when the weights then fail to move.
    """

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
            where = sorted(map(str, targets))
            raise ConfigError(f"internal: one move sends the model's tensors to several devices ({where})")
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


def refresh_group_offloading(model: nn.Module) -> None:
    """Re-apply diffusers' group offloading after weights were parked or restored, if it is applied.

    Group offloading captures, when applied, the parameters of the modules outside its blocks
    (``norm_out.linear`` and the time embedder among them) and, with streams, pinned host copies
    of every parameter. Applied before the cache, it would keep onloading the parked weights'
    originals (and keep their pinned copies); after ``disable()`` it would not know the restored
    ones. diffusers' own remedy after a change of weights (its LoRA code uses it) rebuilds the
    groups from the model as it is now.
    """
    reapply_group_offloading(model)


class LiftedGroupOffloading:
    """diffusers' group offloading taken off a model now, and applied again by :meth:`restore`.

    Enabling parks weights that group offloading captured when it was applied (see
    :func:`refresh_group_offloading`), so it must be applied again; and our hooks must be
    registered while it is off, so that it comes back *outside* them. Hooks are a chain in which
    removing one beneath a hook that replaces the forward (ours do) would unhook that one, and
    diffusers re-applies group offloading by removing and adding it (after a LoRA load or unload,
    say): with it outside ours, that is always safe. A model without group offloading is left alone.
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


__all__ = ["LiftedGroupOffloading", "guarded_apply", "refresh_group_offloading"]
