"""Recomputing stored tables and comparing them bit for bit: what ``verify`` does for a store and for a table file.

Why one module: a store's entries (:func:`adalncache.offline.verify_store`) and a table file's plans
(:func:`adalncache.export.verify_tables`) are checked the same way: a sample of them, chunks of at
most one slab, a cache that always projects per plan (so it confirms tables built stacked too),
and ``torch.equal`` of every table part. Only where the stored rows come from differs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

import torch

from .cache import AdalnCache
from .errors import ConfigError
from .options import flag
from .plans import PlanKey
from .slab import PlanRows
from .source import WeightSource
from .spec import ModulationSpec

T = TypeVar("T")


def check_sample(sample: int | None, unit: str) -> None:
    """Refuse a sample size below one (ConfigError naming ``--sample``)."""
    if sample is not None and sample < 1:
        raise ConfigError(f"sample must be a positive number of {unit}, got {sample}: set {flag('sample')}")


def sampled(items: Sequence[T], sample: int | None, seed: int) -> list[T]:
    """``sample`` of ``items`` chosen with ``seed`` (all of them when ``sample`` is None or not smaller)."""
    if sample is not None and sample < len(items):
        return random.Random(seed).sample(list(items), sample)
    return list(items)


def chunked(items: Sequence[T], per_pass: int) -> list[list[T]]:
    """``items`` in chunks of ``per_pass`` (at least one): one pass, one slab's worth, each."""
    step = max(1, per_pass)
    return [list(items[i : i + step]) for i in range(0, len(items), step)]


def verifying_cache(
    spec: ModulationSpec,
    source: WeightSource,
    *,
    plans: int,
    width: int,
    device: str | torch.device,
    precision: str,
    read_ahead: int,
    progress: bool,
) -> AdalnCache:
    """A cache that recomputes ``plans`` plans of up to ``width`` rows, always per plan (never stacked:
    this is what confirms tables that were built stacked)."""
    return AdalnCache(
        spec,
        source,
        device=device,
        max_plans=max(1, plans),
        max_plan_width=width,
        precision=precision,
        read_ahead=read_ahead,
        progress=progress,
        batched=False,
        tiled=False,  # always whole, per plan: this confirms tables built batched or tiled
    )


def same_rows(cache: AdalnCache, key: PlanKey, stored: PlanRows) -> bool:
    """Whether the cache's recomputed rows of ``key`` equal ``stored``, part for part (``torch.equal``)."""
    fresh = cache.rows_of(key)
    return len(fresh.parts) == len(stored.parts) and all(
        torch.equal(a.cpu(), b) for a, b in zip(fresh.parts, stored.parts)
    )


__all__ = ["check_sample", "chunked", "same_rows", "sampled", "verifying_cache"]
