"""Turning a device argument into a usable torch device, with the error that says what to change.

Why its own module: the cache (``device=``) and the ``demo`` and ``bench`` commands
(``--device``) must all refuse a device that is not one, or that this machine cannot use, before
doing any work, and say it the same way.
"""

from __future__ import annotations

import torch

from .errors import ConfigError


def resolve_device(value: torch.device | str, *, argument: str | None = None) -> torch.device:
    """``value`` as a ``torch.device``, or ConfigError if it is not one or this machine lacks it.

    ``argument``: the keyword the caller's user passed it as (``"device"`` for ``AdalnCache``);
    the message then names ``device=`` and its CLI flag. Without it the value came from the
    command line and the message names ``--device`` only.
    """
    if argument is None:
        given, fix, cpu = f"--device {value}", "use --device cpu or --device cuda:0", "--device cpu"
    else:
        given = f"{argument}={value!r}"
        fix = f"set {argument}= to a device such as 'cpu' or 'cuda:0' (CLI --device)"
        cpu = f"{argument}='cpu' (CLI --device cpu)"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{given} is not a torch device ({exc}): {fix}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{given}: CUDA is not available on this machine; use {cpu}")
    return device


__all__ = ["resolve_device"]
