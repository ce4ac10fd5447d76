"""What the benchmark times side by side: raw reads, projections alone, a naive loop, the real pass, SGLang's.

Each timed primitive returns seconds (``None`` where the machine cannot do it), the device
synchronised around what it times (:func:`~adalncache.tools.measure.timed`). The baselines read the
same bytes from the same files as the pass (:func:`tensor_ranges`), and variants run interleaved
(:func:`rounds`), so a neighbour's load on a shared machine hits them alike.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...cache import AdalnCache
from ...plans import PlanKey, plan_key
from ...rebuild import clear_verdicts
from ...source.reads import aligned_empty, pread_into
from ...spec import Layer, ModulationSpec
from ..measure import sync_device, timed
from .workload import PlanInputs


def rounds(
    variants: Mapping[str, Callable[[], float]], runs: int, before: Callable[[], object] | None = None
) -> dict[str, list[float]]:
    """``runs`` samples of every variant, taking turns; ``before`` runs ahead of each sample (a cache drop, say)."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, fn in variants.items():
            if before is not None:
                before()
            out[name].append(fn())
    return out


def in_fresh_process(target: str, args: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
    """The JSON result of ``module:function`` called with ``args`` in a fresh Python process (same
    interpreter and import path), which measures one thing alone: a process's peak memory cannot be
    reset below what it already touched. A failure raises ``RuntimeError`` with its stderr's last lines.
    """
    module, function = target.split(":")
    code = f"import json, sys\nfrom {module} import {function}\nprint(json.dumps({function}(json.loads(sys.argv[1]))))"
    command = [sys.executable, "-c", code, json.dumps(args)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{function}({args}) failed: {tail}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------------------------------- reads


def tensor_ranges(source: Any) -> list[tuple[Path, int, int]]:
    """(file, offset, nbytes) of every projection tensor, in pass order."""
    out = []
    for layer in source.spec.layers():
        for name in (source.layout.weight(layer), source.layout.bias(layer)):
            header, entry = source.entry(name)
            out.append((header.path, entry.begin, entry.nbytes))
    return out


def read_buffer(source: Any) -> torch.Tensor:
    """A buffer for :func:`read_only`, its pages faulted in (zero-filled): the cost floor of reading is the copy."""
    return torch.zeros(max(n for _, _, n in tensor_ranges(source)), dtype=torch.uint8)


def read_only(source: Any, buf: torch.Tensor | None = None) -> float:
    """The raw sequential read of the pass's bytes, from the same files, into one reused buffer."""
    ranges = tensor_ranges(source)
    if buf is None:
        buf = read_buffer(source)
    start = time.perf_counter()
    fds = {p: os.open(p, os.O_RDONLY) for p in {p for p, _, _ in ranges}}
    try:
        for path, offset, nbytes in ranges:
            pread_into(fds[path], buf[:nbytes], offset, path, "a projection tensor")
    finally:
        for fd in fds.values():
            os.close(fd)
    return time.perf_counter() - start


def read_only_direct(source: Any) -> float | None:
    """The same sequential read with O_DIRECT (no page cache copy), ranges rounded out to 4096-byte blocks:
    the faster raw read when cold. None where the filesystem refuses O_DIRECT."""
    import mmap

    block = 4096
    ranges = tensor_ranges(source)
    spans = [(p, o - o % block, -(-(o % block + n) // block) * block) for p, o, n in ranges]
    buf = mmap.mmap(-1, max(length for _, _, length in spans))
    buf.write(b"\0" * len(buf))  # fault the pages in before timing, as read_only does
    try:
        fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in {p for p, _, _ in spans}}
    except (OSError, AttributeError):
        buf.close()
        return None
    view = memoryview(buf)
    start = time.perf_counter()
    try:
        for path, offset, length in spans:
            done = 0
            while done < length:
                n = min(64 << 20, length - done)
                got = os.preadv(fds[path], [view[done : done + n]], offset + done)
                if got <= 0:
                    break  # the file's end, inside the last block
                done += got
    finally:
        for fd in fds.values():
            os.close(fd)
        seconds = time.perf_counter() - start
        view.release()
        buf.close()
    return seconds


def read_and_project_concurrently(source: Any, resident: ResidentLayer, xs: Sequence[torch.Tensor]) -> float:
    """Read-only on a thread while project-only runs, with no dependency between them.

    On few cores the two compete for cores and memory bandwidth, so even a perfect pipeline cannot
    reach max(read, project): this tells a pipeline's own overhead apart from the machine's limit.
    """
    buf = read_buffer(source)
    reader = threading.Thread(target=read_only, args=(source, buf))
    start = time.perf_counter()
    reader.start()
    resident.project_only(xs)
    reader.join()
    return time.perf_counter() - start


class PinnedCopy:
    """The pinned host-to-device copy of the bytes a pass moves: the physical limit of a CUDA pass.

    Each sample copies every projection tensor's byte count, in pass order, ``non_blocking``, from one
    page-locked buffer to one device buffer allocated once (a copy's speed does not depend on the bytes).
    """

    def __init__(self, source: Any, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"a pinned host-to-device copy needs a CUDA device, got {device}")
        self.sizes = [nbytes for _, _, nbytes in tensor_ranges(source)]
        self.device = device
        self.host = torch.empty(max(self.sizes), dtype=torch.uint8, pin_memory=True)
        self.target = torch.empty(max(self.sizes), dtype=torch.uint8, device=device)
        self()  # the first copy of a process sets up the DMA path: untimed

    def __call__(self) -> float:
        def copy() -> None:
            for nbytes in self.sizes:
                self.target[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

        return timed(copy, self.device)


# ---------------------------------------------------------------------------------------------------- projections


class ResidentLayer:
    """Projection weights held in memory, for the project-only baseline.

    By default one layer of each width, projected once per layer: it costs what each layer's own
    weight costs (496 MiB never fits a cache) without holding 24 GiB. ``every_layer``: each layer's
    own weight, for a checkpoint small enough to hold (:func:`tables_equal_linear`).
    """

    def __init__(self, source: Any, device: torch.device | str = "cpu", *, every_layer: bool = False) -> None:
        self.spec = source.spec
        self.device = torch.device(device)
        self.tensors: dict[Layer, tuple[torch.Tensor, torch.Tensor]] = {}
        layers = self.spec.layers()
        if not every_layer:
            first: dict[int, Layer] = {}
            for layer in layers:
                first.setdefault(self.spec.out_features(layer), layer)
            layers = list(first.values())
        self.of_width = {self.spec.out_features(layer): layer for layer in reversed(layers)}
        for lw in source.stream(layers):
            self.tensors[lw.layer] = (lw.weight.clone().to(self.device), lw.bias.clone().to(self.device))

    def weights(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s own weight and bias if held, else those of the held layer of its width."""
        held = self.tensors.get(layer)
        return held if held is not None else self.tensors[self.of_width[self.spec.out_features(layer)]]

    def project_only(self, xs: Sequence[torch.Tensor]) -> float:
        def project() -> None:
            with torch.no_grad():
                for layer in self.spec.layers():
                    weight, bias = self.weights(layer)
                    for x in xs:
                        F.linear(x, weight, bias)

        return timed(project, self.device)


def tables_equal_linear(
    cache: AdalnCache, resident: ResidentLayer, plans: Sequence[torch.Tensor], inputs: dict[PlanKey, torch.Tensor]
) -> bool:
    """Whether every layer's rows of every plan are ``torch.equal`` to ``F.linear`` of the file's own weights
    (``resident`` holds every layer): what the resident model's projection returns for that input."""
    with torch.no_grad():
        for plan in plans:
            x = inputs[plan_key(plan, cache.spec.plan_columns)]
            slot = int(cache.lookup(plan))
            for layer in cache.spec.layers():
                weight, bias = resident.tensors[layer]
                if not torch.equal(cache.layer_rows(layer, slot, x.shape[0]), F.linear(x, weight, bias)):
                    return False
    return True


def naive(source: Any, xs: Sequence[torch.Tensor]) -> float:
    """Read each layer whole into a fresh buffer, then project every plan: no overlap, no reuse (on a GPU
    each layer is copied to the device, pageable and blocking, first)."""
    spec, layout = source.spec, source.layout
    device = xs[0].device if xs else torch.device("cpu")
    start = time.perf_counter()
    fds: dict[Path, int] = {}
    try:
        with torch.no_grad():
            for layer in spec.layers():
                parts = []
                for name in (layout.weight(layer), layout.bias(layer)):
                    header, entry = source.entry(name)
                    fd = fds.get(header.path)
                    if fd is None:
                        fd = fds[header.path] = os.open(header.path, os.O_RDONLY)
                    # Same address modulo 64 as the file offset, as the real pass keeps it.
                    view = aligned_empty((entry.nbytes,), torch.uint8, entry.begin)
                    pread_into(fd, view, entry.begin, header.path, name)
                    parts.append(view.view(torch.bfloat16).view(entry.shape).to(device))
                weight, bias = parts
                for x in xs:
                    F.linear(x, weight, bias)
                del parts, weight, bias
        sync_device(device)
    finally:
        for fd in fds.values():
            os.close(fd)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------- the pass


def inputs_device(inputs: PlanInputs) -> torch.device:
    """The device the projection inputs sit on (the cache is built there)."""
    return next(iter(inputs.values())).device if inputs else torch.device("cpu")


def request_cache(
    source: Any, plans: int, device: torch.device, *, spec: ModulationSpec | None = None, **options: Any
) -> AdalnCache:
    """A fresh cache of ``spec`` (the source's) with room for ``plans`` plans of up to 4 timesteps, no progress."""
    spec = spec or source.spec
    return AdalnCache(spec, source, max_plans=plans, max_plan_width=4, progress=False, device=device, **options)


def timed_build(cache: AdalnCache, plans: Sequence[torch.Tensor], inputs: PlanInputs) -> tuple[float, Any]:
    """Seconds of ``cache.build(plans)`` on the inputs' device, and its report."""
    reports = []
    seconds = timed(lambda: reports.append(cache.build(list(plans), embed=inputs.embed)), inputs_device(inputs))
    return seconds, reports[0]


def one_pass(
    source: Any,
    plans: Sequence[torch.Tensor],
    inputs: PlanInputs,
    *,
    fresh: bool = False,
    batched: bool = False,
    settle: Callable[[], object] | None = None,
    in_place: bool = True,
    tiled: bool | str = "auto",
) -> float:
    """The real thing: a fresh cache's ``build`` of ``plans`` (one rebuild pass), timed.

    By default a serving process's steady state: the source keeps its read buffers (an untimed pass
    fills them first, then ``settle`` runs: a cold run drops the page cache it warmed). ``fresh``:
    new buffers, freed after (``keep_buffers=False``), what a process's first pass costs.
    """

    def build(todo: Sequence[torch.Tensor]) -> float:
        cache = request_cache(source, len(todo), inputs_device(inputs), batched=batched, tiled=tiled)
        seconds, report = timed_build(cache, todo, inputs)
        assert report.passes == 1 and report.built == len(todo)
        return seconds

    source.keep_buffers = not fresh
    source.in_place = in_place
    if fresh:
        source.release_buffers()
    elif source.kept_bytes == 0:
        build(plans[:1])
        if settle is not None:
            settle()
    return build(plans)


def batched_exactness(source: Any, plans: Sequence[torch.Tensor], inputs: PlanInputs) -> dict[str, Any]:
    """Build ``plans`` per plan and batched, from scratch (probe included), and compare the slabs bitwise."""
    clear_verdicts()  # a new process's view: the batched build probes every shape class again
    built = {}
    reports = {}
    for batched in (False, True):
        cache = request_cache(source, len(plans), inputs_device(inputs), batched=batched)
        reports[batched] = cache.build(list(plans), embed=inputs.embed)
        built[batched] = {plan_key(p): cache.rows_of(plan_key(p)) for p in plans}
    per_plan, stacked = built[False], built[True]
    same = all(
        torch.equal(per_plan[k].block, stacked[k].block) and torch.equal(per_plan[k].final, stacked[k].final)
        for k in per_plan
    )
    report = reports[True]
    return {
        "bit_identical": same,
        "stacked_layers": report.stacked_layers,
        "per_plan_layers": report.per_plan_layers,
        "first_batched_pass_s": report.seconds,
        "per_plan_pass_s": reports[False].seconds,
    }


# ---------------------------------------------------------------------------------------------------- SGLang

#: The cache module inside an installed ``sglang`` package (0.5.23).
SGLANG_CACHE_FILE = Path("multimodal_gen/runtime/models/dits/minimax_h3_adaln_cache.py")


@dataclass
class _SglangArch:
    """The two fields of SGLang's ``MiniMaxH3DiTArchConfig`` that its cache reads."""

    num_layers: int
    hidden_size: int


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
    """SGLang's cache module (``MiniMaxH3AdalnCache``, ``_plan_key``) and version, or why not available.

    Imported from an installed ``sglang`` (never a dependency, never a copy of its code). The
    module imports a few functions of SGLang's serving runtime that do not import outside a full
    deployment: they are stubbed (:func:`_runtime_stubs`) while it loads, and removed again.
    """
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
    def open(cls, source: Any, max_plans: int, device: torch.device) -> SglangBaseline | str:
        """The baseline over ``source``'s files, or why it is not available (never raises for a missing or
        foreign SGLang)."""
        loaded = load_sglang_cache()
        if isinstance(loaded, str):
            return loaded
        module, version = loaded
        try:
            cache = module.MiniMaxH3AdalnCache(
                _SglangArch(source.spec.num_layers, source.spec.hidden_size),
                weight_files=[str(f) for f in source.files],
                max_plans=max_plans,
                max_plan_width=4,
            )
            cache.load(device)
        except Exception as exc:
            return f"SGLang {version}'s cache could not be constructed: {type(exc).__name__}: {exc}"
        return cls(cache, version, module._plan_key)

    def tables_identical(self, ours: Any, plans: Sequence[torch.Tensor]) -> bool:
        """Whether both caches hold the same bits for every plan (so both were timed on the same tables)."""
        for plan in plans:
            n = plan.numel()
            rows = ours.rows_of(plan_key(plan))
            slot = self.cache.resolve_slots([plan])[0]
            their_block = self.cache.block_params[slot, :n].to(rows.block.device)
            their_final = self.cache.final_params[slot, :n].to(rows.final.device)
            if not (torch.equal(rows.block, their_block) and torch.equal(rows.final, their_final)):
                return False
        return True
