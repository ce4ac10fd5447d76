"""Plan keys and plan validation, and the distinct plans of a set of schedules (docs/api.md, "Plans").

A plan's key is its exact fp32 bit patterns, row-major: two plans that differ in one bit (or only in
order) give different AdaLN outputs. ``minimax_h3_plans`` is importable from here, where users have
always found it; :func:`schedule_plans` sits here because it keys plans (families must not import this).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence

import torch

from .errors import PlanError
from .families.minimax_h3 import minimax_h3_plans
from .options import knob

PlanKey = tuple[int, ...]


def _describe(plan: object) -> str:
    if isinstance(plan, torch.Tensor):
        return f"tensor of shape {tuple(plan.shape)} and dtype {plan.dtype}"
    return type(plan).__name__


_TENSOR = torch.Tensor
_FLOAT32 = torch.float32
#: ``(pack n floats as fp32, unpack n int32)`` by n: the bit patterns of n fp32 values.
_CODECS: dict[int, tuple[Callable[..., bytes], Callable[[bytes], tuple[int, ...]]]] = {}


def _codec(n: int) -> tuple[Callable[..., bytes], Callable[[bytes], tuple[int, ...]]]:
    codec = _CODECS.get(n)
    if codec is None:
        codec = _CODECS[n] = (struct.Struct(f"={n}f").pack, struct.Struct(f"={n}i").unpack)
    return codec


def _bits(values: list[float]) -> tuple[int, ...] | None:
    """The fp32 bit patterns of ``values`` (fp32 values held as Python floats), or None for a NaN: the round
    trip through a double keeps every finite value, the infinities and -0.0, but could change a NaN's
    payload, so a NaN (or inf - inf) in the sum sends the caller the exact way."""
    total = sum(values)
    if total != total:
        return None
    pack, unpack = _codec(len(values))
    return unpack(pack(*values))


def _shaped(plan: object, columns: int) -> bool:
    """Whether ``plan`` is a float32 tensor of a cache with ``columns`` plan columns."""
    if not isinstance(plan, _TENSOR) or plan.dtype is not _FLOAT32:
        return False
    if columns == 1:
        return plan.dim() == 1
    return plan.dim() == 2 and plan.shape[1] == columns


def _wrong_shape(plan: object, columns: int) -> PlanError:
    if columns == 1:
        return PlanError(
            f"a plan must be a 1-D float32 tensor of timesteps (the model's `timestep` argument), got "
            f"{_describe(plan)}; pass timestep.to(torch.float32).flatten()"
        )
    return PlanError(
        f"a plan of this cache must be a float32 tensor of shape (rows, {columns}): one row per input row, one "
        f"column per keying input (spec.plan_inputs), got {_describe(plan)}"
    )


def plan_key(plan: torch.Tensor, columns: int = 1) -> PlanKey:
    """The exact identity of a plan: its fp32 bit patterns, row-major. ``columns``: 1 takes a 1-D plan, more an
    ``(rows, columns)`` one; PlanError for anything else (no fp32 bit pattern to key on: a float64 or float16
    timestep would be rounded by the model). On the hit path:
    ``tolist`` and a ``struct`` round trip cost about half of viewing the tensor as int32."""
    if not _shaped(plan, columns):
        raise _wrong_shape(plan, columns)
    if not plan.is_cpu:
        if plan.is_meta:
            # A meta tensor has no bits to key on (it would fail later with a bare NotImplementedError).
            raise PlanError("a plan must hold data, got a meta tensor: pass the timestep tensor the forward receives")
        plan = plan.detach().cpu()
    if columns != 1:
        plan = plan.reshape(-1)
    key = _bits(plan.tolist())
    if key is None:
        return tuple(plan.detach().contiguous().view(torch.int32).tolist())
    return key


def plan_keys(plans: Sequence[torch.Tensor], columns: int = 1) -> list[PlanKey]:
    """``[plan_key(p, columns) for p in plans]`` with one ``cat`` and one ``tolist`` (about half the cost for a
    49-plan request); anything unusual goes the per-plan way, which raises the precise PlanError."""
    try:
        flat = torch.cat(list(plans)).reshape(-1) if all(_shaped(plan, columns) for plan in plans) else None
        bits = _bits(flat.tolist()) if flat is not None and flat.is_cpu else None
    except Exception:  # mixed devices, nothing to concatenate...
        bits = None
    if bits is None:  # the exact, slower way
        return [plan_key(plan, columns) for plan in plans]
    keys: list[PlanKey] = []
    start = 0
    for plan in plans:
        stop = start + plan.numel()
        keys.append(bits[start:stop])
        start = stop
    return keys


def key_to_plan(key: PlanKey, columns: int = 1) -> torch.Tensor:
    """The float32 tensor whose bit patterns are ``key`` (inverse of :func:`plan_key`)."""
    plan = torch.tensor(list(key), dtype=torch.int32).view(torch.float32)
    return plan if columns == 1 else plan.view(-1, columns)


def plan_rows(key: PlanKey, columns: int = 1) -> int:
    """Rows of the plan whose key is ``key``."""
    return len(key) // columns


def shared_rows(key: PlanKey, columns: int = 1) -> tuple[list[int], list[int]]:
    """``(stored, row_of)`` of a plan whose rows of equal keying inputs share one slab row: the first plan row
    of each distinct row, in order, and the index into ``stored`` each plan row reads."""
    first: dict[PlanKey, int] = {}
    row_of = [first.setdefault(key[i : i + columns], len(first)) for i in range(0, len(key), columns)]
    return [row_of.index(r) for r in range(len(first))], row_of


def slab_rows(key: PlanKey, columns: int = 1, width: int | None = None) -> int:
    """The slab rows the plan ``key`` needs: its rows while they fit ``width``, else its distinct rows (rows of
    equal keying inputs, a batch's images, may share one where the build finds them bitwise equal)."""
    rows = plan_rows(key, columns)
    return rows if width is not None and rows <= width else len(shared_rows(key, columns)[0])


def validate_plan(plan: torch.Tensor, *, max_plan_width: int | None = None, columns: int = 1) -> None:
    """Reject plans that cannot be served: not float32 of the cache's shape, empty, non-finite, or with more
    distinct rows than the slab holds per plan."""
    key = plan_key(plan, columns)  # dtype and rank
    rows = plan.shape[0]
    if plan.numel() == 0:
        raise PlanError(
            "a plan must hold at least one timestep, got an empty tensor"
            if columns == 1
            else f"a plan must hold at least one row, got a tensor of shape {tuple(plan.shape)}"
        )
    if not bool(torch.isfinite(plan).all()):
        raise PlanError(f"a plan's {'timesteps' if columns == 1 else 'values'} must be finite, got {plan.tolist()}")
    if max_plan_width is None or rows <= max_plan_width:
        return
    distinct = slab_rows(key, columns)
    if distinct > max_plan_width:
        values = "timesteps" if columns == 1 else "rows of keying inputs"
        raise PlanError(
            f"a plan holds {distinct} distinct {values} in its {rows} rows but the slab holds at most "
            f"{max_plan_width} per plan (rows of equal inputs share one): raise {knob('max_plan_width')} to at "
            f"least {distinct}"
        )


def keyed_plans(
    plans: Sequence[torch.Tensor], keys: Sequence[PlanKey] | None = None, columns: int = 1
) -> tuple[list[torch.Tensor], list[PlanKey]]:
    """``plans`` as a list, with one key per plan: computed here, or the caller's ``keys`` (computed once per
    request; trusted here, while the cache re-checks the key of every plan it is about to build)."""
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
    plans = list(plans)  # any iterable; callers walk it more than once
    if keys is None:
        return plans, plan_keys(plans, columns)
    keys = list(keys)
    if len(keys) != len(plans):
        raise PlanError(
            f"keys= must hold one key per plan (plan_key of each, in order), got {len(keys)} keys for "
            f"{len(plans)} plans"
        )
    for key in keys:
        if type(key) is not tuple:
            raise PlanError(
                f"keys= must hold plan_key(plan) of each plan (a tuple of fp32 bit patterns), got a "
                f"{type(key).__name__}: pass keys=plan_keys(plans)"
            )
    return plans, keys


def distinct_plans(
    plans: Sequence[torch.Tensor], keys: Sequence[PlanKey] | None = None, columns: int = 1
) -> tuple[list[PlanKey], dict[PlanKey, torch.Tensor]]:
    """Keys of ``plans`` in first-seen order, deduplicated, with one tensor per key (see :func:`keyed_plans`)."""
    plans, keys = keyed_plans(plans, keys, columns)
    tensors: dict[PlanKey, torch.Tensor] = {}
    for key, plan in zip(keys, plans):
        if key not in tensors:
            tensors[key] = plan
    return list(tensors), tensors


def _number(v: float) -> str:
    return f"{v:.6g}" if math.isfinite(v) else str(v)


def format_plan(key: PlanKey, limit: int = 4, columns: int = 1) -> str:
    """Short human-readable form of a plan key for messages and logs (rows in parentheses when ``columns > 1``)."""
    values = key_to_plan(key).tolist()
    rows = [values[i : i + columns] for i in range(0, len(values), columns)]
    shown = [_number(r[0]) if columns == 1 else "(" + ", ".join(map(_number, r)) + ")" for r in rows[:limit]]
    return f"[{', '.join(shown)}{', ...' if len(rows) > limit else ''}]"


def schedule_plans(
    tasks: Sequence[str],
    steps: Sequence[int],
    *,
    video_shift: float = 12.0,
    audio_shift: float = 3.0,
    audio_refs: bool = True,
) -> list[torch.Tensor]:
    """Every distinct plan of every (task, step count) pair, in first-seen order: one ``build`` of these fills a
    store for every request of those kinds and step counts."""
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
    "keyed_plans",
    "minimax_h3_plans",
    "plan_key",
    "plan_keys",
    "plan_rows",
    "schedule_plans",
    "shared_rows",
    "slab_rows",
    "validate_plan",
]
