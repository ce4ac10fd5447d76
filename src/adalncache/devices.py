"""Turning a ``--device`` argument into a usable torch device, with the error that says what to change.

Why its own module: the ``demo`` and ``bench`` commands both take ``--device`` and must refuse a
bad one before doing any work, with the same message.
"""

from __future__ import annotations

import torch

from .errors import ConfigError


def resolve_device(value: str) -> torch.device:
    """``value`` as a ``torch.device``; ConfigError naming ``--device`` if it is not one or is not here."""
    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ConfigError(f"--device {value!r} is not a torch device: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {value}: CUDA is not available on this machine; use --device cpu")
    return device


__all__ = ["resolve_device"]
