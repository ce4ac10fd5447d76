"""The hit path of a fully resident request, timed call by call, with SGLang's cache side by side when installed.

Every request of a serving process calls ``build()`` (or its holding variant) and resolves its
slots, even when every plan is already resident; that is the path this module times. Both
caches are timed in the same process, on the same plans and the same slab contents, in
interleaved rounds (a neighbour's load hits both alike), one call per sample.

The baseline is SGLang's own ``MiniMaxH3AdalnCache`` imported from an installed ``sglang``
package: never a dependency of this project and never a copy of its code. Its module imports a
few functions of SGLang's serving runtime (tensor-parallel rank, host memory budget, logging),
which do not import outside a full SGLang deployment; those are stubbed while the module is
loaded (world size 1, no host tier) and removed again, so nothing of the stubs outlives the load.
Where no usable SGLang is installed, the baseline is reported as not available and only this
package's numbers are printed.

Keys: each cache keys plans with its own key function (this package's :func:`~adalncache.plans.plan_key`,
SGLang's ``_plan_key``) on the fp32 plans. Variants with ``keys=`` pass keys computed once per
request outside the timed call, where the cache's ``build`` or ``resolve_slots`` accepts them
(found with :func:`inspect.signature`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import inspect
import logging
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The cache module inside an installed ``sglang`` package (0.5.23).
SGLANG_CACHE_FILE = Path("multimodal_gen/runtime/models/dits/minimax_h3_adaln_cache.py")


class _SglangArch:
    """The two fields of SGLang's ``MiniMaxH3DiTArchConfig`` that its cache reads."""

    def __init__(self, num_layers: int, hidden_size: int) -> None:
        self.num_layers = num_layers
        self.hidden_size = hidden_size


def _runtime_stubs() -> dict[str, dict[str, Any]]:
    """What SGLang 0.5.23's cache module imports from SGLang's runtime, as a single process serves it."""
    return {
        "sglang.multimodal_gen.configs.models.dits.minimax_h3": {
            "MINIMAX_H3_ADALN_MODALITY_NUM": 3,
            "MiniMaxH3DiTArchConfig": _SglangArch,
        },
        "sglang.multimodal_gen.runtime.distributed": {
            "get_tp_world_size": lambda: 1,
            "tensor_model_parallel_all_gather": lambda tensor: tensor,
        },
        "sglang.multimodal_gen.runtime.distributed.parallel_state": {
            "get_tp_rank": lambda: 0,
            "get_world_group": lambda: None,
            "world_group_is_initialized": lambda: False,
        },
        "sglang.multimodal_gen.runtime.managers.memory_managers.host_memory_budget": {
            "HOST_RESERVE_FRACTION": 0.1,
            "MIN_HOST_RESERVE_BYTES": 0,
            "host_memory_available_bytes": lambda: 0,
        },
        "sglang.multimodal_gen.runtime.utils.logging_utils": {"init_logger": logging.getLogger},
    }


@contextlib.contextmanager
def _stubbed(modules: dict[str, dict[str, Any]]) -> Iterator[None]:
    """``modules`` (and their parent packages) in ``sys.modules`` for the duration; the old entries after."""
    names = set(modules)
    for name in modules:
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name in sorted(names):
            module = types.ModuleType(name)
            if name not in modules:
                module.__path__ = []  # a package, so its children can be imported from it
            module.__dict__.update(modules.get(name, {}))
            sys.modules[name] = module
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def load_sglang_cache() -> tuple[types.ModuleType, str] | str:
    """SGLang's cache module (``MiniMaxH3AdalnCache``, ``_plan_key``) and SGLang's version, or why not available."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError) as exc:
        return f"sglang cannot be found ({exc})"
    if spec is None or not spec.submodule_search_locations:
        return "sglang is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / SGLANG_CACHE_FILE
    if not path.is_file():
        return f"this sglang has no {SGLANG_CACHE_FILE}"
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    name = "_adalncache_bench_sglang_adaln_cache"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        return f"cannot load {path}"
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # under a private name: its classes resolve their annotations through it
    try:
        with _stubbed(_runtime_stubs()):
            loader_spec.loader.exec_module(module)
    except Exception as exc:  # another SGLang version, or a missing dependency of the module (msgspec)
        sys.modules.pop(name, None)
        return f"SGLang {version}'s cache module did not load: {type(exc).__name__}: {exc}"
    for needed in ("MiniMaxH3AdalnCache", "_plan_key"):
        if not hasattr(module, needed):
            return f"SGLang {version}'s cache module has no {needed}"
    return module, version


@dataclass
class SglangBaseline:
    """SGLang's cache over the same checkpoint files, its slab built by its own rebuild pass."""

    cache: Any
    version: str
    key: Callable[[torch.Tensor], tuple[int, ...]]

    @classmethod
    def open(
        cls,
        files: Sequence[Path],
        *,
        num_layers: int,
        hidden_size: int,
        max_plans: int,
        device: torch.device,
    ) -> SglangBaseline | str:
        """The baseline, or why it is not available (never raises for a missing or foreign SGLang)."""
        loaded = load_sglang_cache()
        if isinstance(loaded, str):
            return loaded
        module, version = loaded
        try:
            cache = module.MiniMaxH3AdalnCache(
                _SglangArch(num_layers, hidden_size), weight_files=[str(f) for f in files], max_plans=max_plans,
                max_plan_width=4,
            )  # fmt: skip
            cache.load(device)
        except Exception as exc:
            return f"SGLang {version}'s cache could not be constructed: {type(exc).__name__}: {exc}"
        return cls(cache, version, module._plan_key)


@dataclass
class HitTiming:
    """One call of the hit path for one request size: seconds per call, ours and the baseline's."""

    call: str
    plans: int
    ours: list[float]
    theirs: list[float] | None

    def row(self) -> dict[str, Any]:
        ours = statistics.median(self.ours)
        out: dict[str, Any] = {"call": self.call, "plans": self.plans, "adalncache_s": ours,
                               "adalncache_per_plan_s": ours / self.plans}  # fmt: skip
        if self.theirs is not None:
            theirs = statistics.median(self.theirs)
            out.update(sglang_s=theirs, sglang_per_plan_s=theirs / self.plans, ratio=ours / theirs)
        return out


def _accepts_keys(fn: Callable[..., Any]) -> bool:
    try:
        return "keys" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def hit_variants(
    ours: Any, theirs: SglangBaseline | None, steps: Sequence[torch.Tensor], embed: Callable[[torch.Tensor], Any]
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]:
    """``call label -> (our call, the baseline's call or None)`` for one request's per-step plans."""
    from ..plans import plan_key

    plans = list(steps)
    keys = [plan_key(p) for p in plans]
    variants: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {}
    sg = theirs.cache if theirs is not None else None
    sg_keys = [theirs.key(p) for p in plans] if theirs is not None else []
    variants["build()"] = (
        lambda: ours.build(plans, embed=embed),
        (lambda: sg.build(plans, embed=embed)) if sg is not None else None,
    )
    if _accepts_keys(ours.build):
        variants["build(keys=)"] = (
            lambda: ours.build(plans, embed=embed, keys=keys),
            (lambda: sg.build(plans, embed=embed, keys=sg_keys)) if sg is not None else None,
        )
    variants["resolve_slots()"] = (
        lambda: ours.resolve_slots(plans),
        (lambda: sg.resolve_slots(plans)) if sg is not None else None,
    )
    if _accepts_keys(ours.resolve_slots):
        variants["resolve_slots(keys=)"] = (
            lambda: ours.resolve_slots(plans, keys=keys),
            (lambda: sg.resolve_slots(plans, keys=sg_keys)) if sg is not None else None,
        )
    return variants


def time_interleaved(
    calls: dict[str, Callable[[], Any]], samples: int, device: torch.device, warmup: int = 20
) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``, one call per sample, the calls taking turns.

    The hit path is host work (a ``resolve_slots`` also queues a small copy); the device is
    synchronised once per round, outside the timed calls, so queued copies never pile up.
    """
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in calls}
    enabled = gc.isenabled()
    gc.disable()  # a collection inside one sample would land on whichever call happened to run
    try:
        for _ in range(samples):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - start)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        if enabled:
            gc.enable()
    return out


def measure(
    ours: Any,
    theirs: SglangBaseline | None,
    requests: Mapping[int, Sequence[torch.Tensor]],
    embed: Callable[[torch.Tensor], Any],
    samples: int,
    device: torch.device,
) -> list[HitTiming]:
    """Every hit-path call for every request size, ours and the baseline's interleaved in one loop."""
    calls: dict[str, Callable[[], Any]] = {}
    labels: list[tuple[str, int]] = []
    for size, steps in requests.items():
        for call, (mine, base) in hit_variants(ours, theirs, steps, embed).items():
            labels.append((call, size))
            calls[f"ours {call} {size}"] = mine
            if base is not None:
                calls[f"theirs {call} {size}"] = base
    got = time_interleaved(calls, samples, device)
    return [
        HitTiming(call, size, got[f"ours {call} {size}"], got.get(f"theirs {call} {size}")) for call, size in labels
    ]


def tables_identical(ours: Any, theirs: SglangBaseline, plans: Sequence[torch.Tensor]) -> bool:
    """Whether both caches hold the same bits for every plan (so both were timed on the same tables)."""
    from ..plans import plan_key

    for plan in plans:
        n = plan.numel()
        rows = ours.rows_of(plan_key(plan))
        slot = theirs.cache.resolve_slots([plan])[0]
        their_block = theirs.cache.block_params[slot, :n].to(rows.block.device)
        their_final = theirs.cache.final_params[slot, :n].to(rows.final.device)
        if not (torch.equal(rows.block, their_block) and torch.equal(rows.final, their_final)):
            return False
    return True


def format_table(timings: Sequence[HitTiming], baseline: str) -> str:
    """The side-by-side table the bench prints (microseconds; per plan; ratio ours / baseline)."""
    head = f"  {'call':<22}{'plans':>6}{'adalncache':>13}{'per plan':>11}"
    with_baseline = any(t.theirs is not None for t in timings)
    if with_baseline:
        head += f"{baseline:>16}{'per plan':>11}{'ratio':>8}"
    lines = [head]
    for t in timings:
        row = t.row()
        us, per_plan = row["adalncache_s"] * 1e6, row["adalncache_per_plan_s"] * 1e6
        line = f"  {t.call:<22}{t.plans:>6}{us:>10.1f} us{per_plan:>8.2f} us"
        if "sglang_s" in row:
            us, per_plan = row["sglang_s"] * 1e6, row["sglang_per_plan_s"] * 1e6
            line += f"{us:>13.1f} us{per_plan:>8.2f} us{row['ratio']:>8.2f}"
        lines.append(line)
    return "\n".join(lines)


__all__ = ["HitTiming", "SglangBaseline", "format_table", "load_sglang_cache", "measure", "tables_identical"]
