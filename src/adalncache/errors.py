"""Exception types of adalncache: each says what to change (the argument and its CLI flag), derives from
:class:`AdalnCacheError` and from the builtin a caller would expect (``except ValueError`` keeps working).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: The attribute a failure carries to say where it happened ("read of layer 3", "publish").
#: Only :func:`mark_failed_at`, :func:`failure_phase` and :func:`failing_at` touch it.
_FAILED_AT = "adalncache_failed_at"


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


class PlanMismatchError(PlanNotCachedError):
    """A served forward's plan was none of its request's prepared plans: raised after the fact, since the
    forward found its slot on the device and was served the poison slot's NaN rows (docs/diffusers.md)."""


class CheckpointError(AdalnCacheError, ValueError):
    """A checkpoint is missing tensors, has misshapen ones, or is not a readable safetensors file."""


class BuildError(AdalnCacheError, RuntimeError):
    """A build failed before publishing; nothing of the request is visible and a retry rebuilds it.
    ``__cause__`` is the original error; ``rank`` the failing rank (``None`` in one process); ``failed_at``
    the tensor, layer or phase."""

    def __init__(self, message: str, *, rank: int | None = None, failed_at: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.failed_at = failed_at


def mark_failed_at(exc: BaseException, where: str) -> None:
    """Label ``exc`` with the phase it came from unless an inner phase already did (the innermost wins: a read
    failure inside a projection says "read of layer 3"); exceptions that refuse attributes stay unlabelled."""
    if failure_phase(exc) is None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, _FAILED_AT, where)


def failure_phase(exc: BaseException) -> str | None:
    """The phase ``exc`` was labelled with by :func:`mark_failed_at`, or ``None``."""
    where = getattr(exc, _FAILED_AT, None)
    return None if where is None else str(where)


@contextlib.contextmanager
def failing_at(where: str) -> Iterator[None]:
    """Within the block, label any exception (``KeyboardInterrupt`` too) with ``where``; re-raise it."""
    try:
        yield
    except BaseException as exc:
        mark_failed_at(exc, where)
        raise


__all__ = [
    "AdalnCacheError",
    "BuildError",
    "CheckpointError",
    "ConfigError",
    "PlanError",
    "PlanNotCachedError",
    "failing_at",
    "failure_phase",
    "mark_failed_at",
]
