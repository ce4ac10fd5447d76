"""Plan keys and plan validation, and the distinct plans of a set of schedules.

A plan is one forward's ``timestep`` tensor: the distinct timesteps of that step, in the order
``timestep_indices`` points at. Its key is the tuple of exact fp32 bit patterns, in order, because
two plans that differ in one bit (or only in order) give different AdaLN outputs.

The schedules themselves (tasks, the pipeline's recipe, :func:`minimax_h3_plans`) live in
:mod:`adalncache.schedules`; ``minimax_h3_plans`` is importable from here too, where users have
always found it. :func:`schedule_plans` sits here rather than there because it keys plans, and the
schedules module must not import this one (this one re-exports from it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .errors import PlanError
from .schedules import minimax_h3_plans

PlanKey = tuple[int, ...]


def _describe(plan: object) -> str:
    if isinstance(plan, torch.Tensor):
        return f"tensor of shape {tuple(plan.shape)} and dtype {plan.dtype}"
    return type(plan).__name__


def plan_key(plan: torch.Tensor) -> PlanKey:
    """The exact identity of a plan: its fp32 bit patterns, in order.

    Raises PlanError for anything that is not a 1-D float32 tensor, since such a thing has no
    fp32 bit pattern to key on (a float64 or float16 timestep would be rounded by the model).
    """
    if not isinstance(plan, torch.Tensor) or plan.dtype != torch.float32 or plan.dim() != 1:
        raise PlanError(
            f"a plan must be a 1-D float32 tensor of timesteps (the model's `timestep` argument), got "
            f"{_describe(plan)}; pass timestep.to(torch.float32).flatten()"
        )
    if plan.device.type == "meta":
        # A meta tensor has no bits to key on (it would fail later with a bare NotImplementedError).
        raise PlanError("a plan must hold data, got a meta tensor: pass the timestep tensor the forward receives")
    host = plan.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    return tuple(host.contiguous().view(torch.int32).tolist())


def key_to_plan(key: PlanKey) -> torch.Tensor:
    """The float32 tensor whose bit patterns are ``key`` (inverse of :func:`plan_key`)."""
    return torch.tensor(list(key), dtype=torch.int32).view(torch.float32)


def validate_plan(plan: torch.Tensor, *, max_plan_width: int | None = None) -> None:
    """Reject plans that cannot be served: not 1-D float32, empty, non-finite, or too wide."""
    plan_key(plan)  # dtype and rank
    if plan.numel() == 0:
        raise PlanError("a plan must hold at least one timestep, got an empty tensor")
    if not bool(torch.isfinite(plan).all()):
        raise PlanError(f"a plan's timesteps must be finite, got {plan.tolist()}")
    if max_plan_width is not None and plan.numel() > max_plan_width:
        raise PlanError(
            f"a plan has {plan.numel()} distinct timesteps but the slab holds at most {max_plan_width} per "
            f"plan: raise max_plan_width (CLI --plan-width) to at least {plan.numel()}"
        )


def distinct_plans(plans: Sequence[torch.Tensor]) -> tuple[list[PlanKey], dict[PlanKey, torch.Tensor]]:
    """Keys of ``plans`` in first-seen order, deduplicated, with one tensor per key."""
    if plans is None or isinstance(plans, (str, bytes)) or not hasattr(plans, "__iter__"):
        raise PlanError(
            f"build() takes a sequence of plans (one 1-D timestep tensor per step), got {type(plans).__name__}: "
            f"pass a list such as minimax_h3_plans(task, steps)"
        )
    if isinstance(plans, torch.Tensor):
        raise PlanError(
            "build() takes a sequence of plans (one 1-D timestep tensor per step), got a single tensor: "
            "wrap it in a list"
        )
    order: list[PlanKey] = []
    tensors: dict[PlanKey, torch.Tensor] = {}
    for plan in plans:
        key = plan_key(plan)
        if key not in tensors:
            tensors[key] = plan
            order.append(key)
    return order, tensors


def format_plan(key: PlanKey, limit: int = 4) -> str:
    """Short human-readable form of a plan key for messages and logs."""
    values = key_to_plan(key).tolist()
    shown = ", ".join(f"{v:.6g}" if math.isfinite(v) else str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def schedule_plans(
    tasks: Sequence[str],
    steps: Sequence[int],
    *,
    video_shift: float = 12.0,
    audio_shift: float = 3.0,
    audio_refs: bool = True,
) -> list[torch.Tensor]:
    """Every distinct plan of every (task, step count) pair, in first-seen order.

    What a store is filled for: one ``build`` of these covers every request of those kinds and
    step counts (``minimax_h3_plans`` gives each schedule's plans; repeats across steps, tasks and
    step counts are kept once).
    """
    plans: list[torch.Tensor] = []
    for task in tasks:
        for count in steps:
            plans.extend(
                minimax_h3_plans(task, count, video_shift=video_shift, audio_shift=audio_shift, audio_refs=audio_refs)
            )
    order, tensors = distinct_plans(plans)
    return [tensors[k] for k in order]


__all__ = [
    "PlanKey",
    "distinct_plans",
    "format_plan",
    "key_to_plan",
    "minimax_h3_plans",
    "plan_key",
    "schedule_plans",
    "validate_plan",
]
