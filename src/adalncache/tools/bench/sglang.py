"""SGLang's own AdaLN cache, as the baseline of the hit-path comparison, when an installed SGLang provides it.

The baseline is SGLang's ``MiniMaxH3AdalnCache`` imported from an installed ``sglang`` package:
never a dependency of this project and never a copy of its code. Its module imports a few
functions of SGLang's serving runtime (tensor-parallel rank, host memory budget, logging), which
do not import outside a full SGLang deployment; those are stubbed while the module is loaded
(world size 1, no host tier) and removed again, so nothing of the stubs outlives the load. Where
no usable SGLang is installed, the baseline is reported as not available (a string saying why).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...plans import plan_key

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
                _SglangArch(num_layers, hidden_size),
                weight_files=[str(f) for f in files],
                max_plans=max_plans,
                max_plan_width=4,
            )
            cache.load(device)
        except Exception as exc:
            return f"SGLang {version}'s cache could not be constructed: {type(exc).__name__}: {exc}"
        return cls(cache, version, module._plan_key)


def tables_identical(ours: Any, theirs: SglangBaseline, plans: Sequence[torch.Tensor]) -> bool:
    """Whether both caches hold the same bits for every plan (so both were timed on the same tables)."""
    for plan in plans:
        n = plan.numel()
        rows = ours.rows_of(plan_key(plan))
        slot = theirs.cache.resolve_slots([plan])[0]
        their_block = theirs.cache.block_params[slot, :n].to(rows.block.device)
        their_final = theirs.cache.final_params[slot, :n].to(rows.final.device)
        if not (torch.equal(rows.block, their_block) and torch.equal(rows.final, their_final)):
            return False
    return True


__all__ = ["SglangBaseline", "load_sglang_cache", "tables_identical"]
