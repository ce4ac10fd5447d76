"""A pipeline's scheduler watched for the schedule of each request (classic ``DiffusionPipeline``s).

A pipeline such as ``QwenImagePipeline`` calls ``scheduler.set_timesteps`` once per request,
before its first denoising step; its timesteps depend on the image size (``mu``), so they are
only known then. :class:`ScheduleWatch` wraps ``set_timesteps`` (an instance attribute, removed
again by :meth:`ScheduleWatch.remove`) and hands the new timesteps to the transformer's handle,
whose next forward prepares the whole schedule in one pass (:meth:`.handle.AdalnCacheHandle.expect_schedule`).

With ``overlap=True`` that first forward starts the pass on a background thread and waits only for
its own step's plans (:mod:`.overlap`). ``QwenImagePipeline`` sets the timesteps after encoding
the prompt; its pass starts earlier still, when the call begins, from the schedule predicted from
the call's arguments (:mod:`.calls`), which that first forward adopts when it is the one set here.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import PlanError
from ...plans import plan_key, slab_rows
from .family import DiffusersFamily
from .modules import forward_argument

logger = logging.getLogger(__name__)

#: Marks our wrapper, so a second enabling does not wrap it again.
WRAPPER_ATTRIBUTE = "_adalncache_schedule_watch"


class ScheduleWatch:
    """``scheduler.set_timesteps`` wrapped to report each request's timesteps to ``expect``."""

    def __init__(
        self, scheduler: Any, expect: Callable[[torch.Tensor], None], *, last_step: Callable[[], None] | None = None
    ) -> None:
        self.scheduler = scheduler
        self.expect = expect
        #: Called after the request's last ``scheduler.step`` (the handle's ``release``: the request ends there).
        self.last_step = last_step
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
        if self.last_step is not None and callable(getattr(scheduler, "step", None)):
            scheduler.step = self._watched_step(scheduler.step)
        self._installed = True

    def _watched_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``scheduler.step`` that calls ``last_step`` once the request's last step is taken.

        Where a mismatch of the request's forwards is reported in a classic pipeline: the step
        index is the scheduler's own host counter, so the check costs no extra sync per step.
        """
        scheduler, last_step = self.scheduler, self.last_step
        assert last_step is not None

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            index, timesteps = getattr(scheduler, "step_index", None), getattr(scheduler, "timesteps", None)
            if isinstance(index, int) and timesteps is not None and index >= len(timesteps):
                last_step()
            return result

        return step

    def remove(self) -> None:
        """Put the scheduler's own ``set_timesteps`` and ``step`` back."""
        if self._installed:
            self.scheduler.__dict__.pop("set_timesteps", None)
            self.scheduler.__dict__.pop("step", None)
            self._installed = False


class PendingSchedule(threading.local):
    """Per thread: the timesteps a scheduler set, prepared by the request's first forward.

    ``hold(plans, attention_kwargs)`` holds the whole schedule for the thread (the request lifecycle's); the
    family turns the scheduler's timesteps into the forward's plans
    (:meth:`~.family.DiffusersFamily.schedule_plans`), seeing the first forward's arguments.
    """

    def __init__(
        self,
        model: Any,
        family: Callable[[], DiffusersFamily],
        cache: Callable[[], Any],
        hold: Callable[[list[Any], Mapping[str, Any] | None], None],
    ) -> None:
        self.model = model
        self.family = family
        self.cache = cache
        self.hold = hold
        self.timesteps: torch.Tensor | None = None

    def expect(self, timesteps: torch.Tensor) -> None:
        self.timesteps = timesteps.detach().clone()

    def before_forward(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """At a forward: prepare the schedule set since the last one, if it fits the cache (else per forward)."""
        timesteps, self.timesteps = self.timesteps, None
        if timesteps is None:
            return
        if timesteps.is_floating_point() and not bool(torch.isfinite(timesteps).all()):
            raise PlanError(
                f"the pipeline's scheduler set non-finite timesteps {timesteps.tolist()} for this request of "
                f"{timesteps.numel()} step(s): the model would compute NaN outputs from them, and no table holds "
                "such a plan. diffusers' flow-match scheduler with shift_terminal (Qwen-Image's config) divides 0 by "
                "0 for a single step: use num_inference_steps >= 2, or a scheduler config without shift_terminal"
            )
        family, model = self.family(), self.model
        plans = family.schedule_plans(model, timesteps, args, kwargs)
        if plans is None:
            logger.info("AdaLN cache: the forward's timestep is not one of the schedule's; plans build per forward")
            return
        plans = [family.request_plan(model, plan) for plan in plans]
        if self.fits(plans):
            self.hold(plans, forward_argument(model, "attention_kwargs", args, kwargs))

    def fits(self, plans: list[Any], *, warn: bool = True) -> bool:
        """Whether the cache can hold every plan of a schedule at once (else its plans build per forward)."""
        cache = self.cache()
        distinct = len({plan_key(plan, cache.spec.plan_columns) for plan in plans})
        width = max(
            slab_rows(plan_key(plan, cache.spec.plan_columns), cache.spec.plan_columns, cache.max_plan_width)
            for plan in plans
        )
        if distinct <= cache.max_plans and width <= cache.max_plan_width:
            return True
        if warn:  # not an error: each forward still builds its own plan; holding the whole schedule needs room for it
            logger.warning(
                "AdaLN cache: this request's schedule has %d distinct plans of up to %d rows, more than max_plans=%d "
                "x max_plan_width=%d hold; its plans build step by step (one pass each): raise max_plans "
                "(--max-plans) or max_plan_width (--plan-width) to build it in one pass",
                distinct,
                width,
                cache.max_plans,
                cache.max_plan_width,
            )
        return False


__all__ = ["PendingSchedule", "ScheduleWatch"]
