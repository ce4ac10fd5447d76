"""Turning a device argument into a usable torch device, with the error that says what to change.

Why its own module: the cache (``device=``) and the ``demo`` and ``bench`` commands
(``--device``) must all refuse a device that is not one, or that this machine cannot use, before
doing any work, and say it the same way.
"""

from __future__ import annotations

import torch

from .errors import ConfigError
from .options import flag


def resolve_device(value: torch.device | str, *, argument: str | None = None) -> torch.device:
    """``value`` as a ``torch.device``, or ConfigError if it is not one or this machine lacks it.

    ``argument``: the keyword the caller's user passed it as (``"device"`` for ``AdalnCache``);
    the message then names ``device=`` and its CLI flag. Without it the value came from the
    command line and the message names ``--device`` only.
    """
    if argument is None:
        device_flag = flag("device")
        given, fix = f"{device_flag} {value}", f"use {device_flag} cpu or {device_flag} cuda:0"
        cpu = f"{device_flag} cpu"
    else:
        given = f"{argument}={value!r}"
        fix = f"set {argument}= to a device such as 'cpu' or 'cuda:0' (CLI {flag('device')})"
        cpu = f"{argument}='cpu' (CLI {flag('device')} cpu)"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{given} is not a torch device ({exc}): {fix}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{given}: CUDA is not available on this machine; use {cpu}")
    if device.type == "meta":
        raise ConfigError(f"{given}: the meta device holds no data, so no table can live or be computed there; {fix}")
    return device


def available_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``, where torch or the system can tell; else None.

    CPU: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can give without swapping); CUDA:
    the free memory ``torch.cuda.mem_get_info`` reports.
    """
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", "rb") as handle:
                for line in handle:
                    if line.startswith(b"MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError, ValueError):
            return None
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"


def check_available(nbytes: int, device: torch.device, what: str, lower: str) -> None:
    """ConfigError before allocating ``nbytes`` that ``device`` cannot give (when it can tell).

    ``what``: the allocation and what sizes it; ``lower``: the arguments (and CLI flags) to lower.
    """
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ConfigError(
            f"{what} needs {_gib(nbytes)} on {device}, but only {_gib(free)} are available there: lower {lower}"
        )


def allocation_error(exc: BaseException, nbytes: int, device: torch.device, what: str, lower: str) -> ConfigError:
    """The ConfigError for an allocator's own failure (the check before it could not tell)."""
    return ConfigError(
        f"{what} needs {_gib(nbytes)} on {device} and the allocation failed ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else 'out of memory'}): lower {lower}"
    )


__all__ = ["allocation_error", "available_bytes", "check_available", "resolve_device"]
