"""Exception types of adalncache.

Every error says what to change: the argument and, where one exists, its CLI flag. They all
derive from :class:`AdalnCacheError` so callers can catch the library's errors in one place,
and from the builtin type a caller would naturally expect (``ValueError``, ``KeyError``...), so
existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations


class AdalnCacheError(Exception):
    """Base class of every error raised by adalncache."""


class ConfigError(AdalnCacheError, ValueError):
    """A construction argument or an integration setting is invalid (names the argument and flag)."""


class PlanError(AdalnCacheError, ValueError):
    """A build request is malformed or does not fit the slab (names the knob to raise)."""


class PlanNotCachedError(AdalnCacheError, KeyError):
    """A plan was looked up that the slab does not hold ("does not cover")."""

    def __str__(self) -> str:  # KeyError would repr() the message, which reads badly.
        return str(self.args[0]) if self.args else ""


class CheckpointError(AdalnCacheError, ValueError):
    """A checkpoint is missing tensors, has misshapen ones, or is not a readable safetensors file."""


class BuildError(AdalnCacheError, RuntimeError):
    """A build failed before publishing; nothing of the request is visible and a retry rebuilds it.

    ``__cause__`` is the original error. ``rank`` is the failing rank in a distributed build
    (``None`` in a single process) and ``failed_at`` names the tensor, layer or phase.
    """

    def __init__(self, message: str, *, rank: int | None = None, failed_at: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.failed_at = failed_at


__all__ = [
    "AdalnCacheError",
    "BuildError",
    "CheckpointError",
    "ConfigError",
    "PlanError",
    "PlanNotCachedError",
]
