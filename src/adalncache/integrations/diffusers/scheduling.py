"""A pipeline's scheduler watched for the schedule of each request (classic ``DiffusionPipeline``s).

A pipeline such as ``QwenImagePipeline`` calls ``scheduler.set_timesteps`` once per request,
before its first denoising step; its timesteps depend on the image size (``mu``), so they are
only known then. :class:`ScheduleWatch` wraps ``set_timesteps`` (an instance attribute, removed
again by :meth:`ScheduleWatch.remove`) and hands the new timesteps to the transformer's handle,
whose next forward prepares the whole schedule in one pass (:meth:`.handle.AdalnCacheHandle.expect_schedule`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

#: Marks our wrapper, so a second enabling does not wrap it again.
WRAPPER_ATTRIBUTE = "_adalncache_schedule_watch"


class ScheduleWatch:
    """``scheduler.set_timesteps`` wrapped to report each request's timesteps to ``expect``."""

    def __init__(self, scheduler: Any, expect: Callable[[torch.Tensor], None]) -> None:
        self.scheduler = scheduler
        self.expect = expect
        self._installed = False

    def install(self) -> None:
        scheduler = self.scheduler
        if scheduler is None or not callable(getattr(scheduler, "set_timesteps", None)):
            return
        if getattr(scheduler.__dict__.get("set_timesteps"), WRAPPER_ATTRIBUTE, False):
            return  # already watched (by another handle of the same pipeline)
        original = scheduler.set_timesteps

        # functools.wraps keeps the signature visible: pipelines inspect it for `sigmas`/`timesteps`.
        @functools.wraps(original)
        def set_timesteps(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            timesteps = getattr(scheduler, "timesteps", None)
            if isinstance(timesteps, torch.Tensor):
                self.expect(timesteps)
            return result

        setattr(set_timesteps, WRAPPER_ATTRIBUTE, True)
        scheduler.set_timesteps = set_timesteps
        self._installed = True

    def remove(self) -> None:
        """Put the scheduler's own ``set_timesteps`` back."""
        if self._installed:
            self.scheduler.__dict__.pop("set_timesteps", None)
            self._installed = False


__all__ = ["ScheduleWatch"]
