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


__all__ = ["guarded_apply"]
