"""The primitives the benchmark times side by side: raw reads, projections alone, a naive loop, the real pass.

Each returns seconds (``None`` where the machine cannot do it) and synchronises the device around
what it times, so a timer measures the work and not its queueing. The baselines read the same
bytes from the same files as the pass (:func:`tensor_ranges`), so a ratio compares like with like.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...batching import clear_verdicts
from ...cache import AdalnCache
from ...plans import PlanKey, plan_key
from ...source.reads import aligned_empty, pread_into
from ...spec import Layer


def tensor_ranges(source: Any) -> list[tuple[Path, int, int]]:
    """(file, offset, nbytes) of every projection tensor, in pass order."""
    out = []
    for layer in source.spec.layers():
        for name in (source.layout.weight(layer), source.layout.bias(layer)):
            header, entry = source.entry(name)
            out.append((header.path, entry.begin, entry.nbytes))
    return out


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


class PinnedCopy:
    """The pinned host-to-device copy of the bytes a pass moves: the physical limit of a CUDA pass.

    One page-locked host buffer and one device buffer, as large as the largest projection tensor,
    allocated once (outside every timing); each sample copies every projection tensor's byte count
    from one to the other with ``non_blocking=True``, in pass order, between two synchronisations.
    The bytes copied are whatever the buffers hold: a copy's speed does not depend on them.
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
        sync_device(self.device)
        start = time.perf_counter()
        for nbytes in self.sizes:
            self.target[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        sync_device(self.device)
        return time.perf_counter() - start


def read_buffer(source: Any) -> torch.Tensor:
    """A buffer for :func:`read_only`, its pages faulted in: the cost floor of reading is the copy."""
    buf = torch.empty(max(n for _, _, n in tensor_ranges(source)), dtype=torch.uint8)
    buf.fill_(0)
    return buf


def read_and_project_concurrently(source: Any, resident: Any, xs: Sequence[torch.Tensor]) -> float:
    """Read-only on a thread while project-only runs, with no dependency between them.

    Why: on a machine with few cores the two compete for the same cores and memory bandwidth, so
    even a perfect pipeline cannot reach max(read, project). This is what overlapping them costs
    here, which tells a pipeline's own overhead apart from the machine's limit.
    """
    buf = read_buffer(source)
    reader = threading.Thread(target=read_only, args=(source, buf))
    start = time.perf_counter()
    reader.start()
    resident.project_only(xs)
    reader.join()
    return time.perf_counter() - start


def read_only_direct(source: Any) -> float | None:
    """The same sequential read with O_DIRECT (no page cache copy): the faster raw read when cold.

    Ranges are rounded out to 4096-byte blocks into one page-aligned buffer; None where the
    filesystem refuses O_DIRECT.
    """
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


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer around it measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_of(inputs: dict[tuple[int, ...], torch.Tensor] | Sequence[torch.Tensor]) -> torch.device:
    """The device the projection inputs sit on (the cache is built there)."""
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    return values[0].device if values else torch.device("cpu")


class ResidentLayer:
    """Projection weights held in memory, for the project-only baseline.

    By default one layer of each width (MiniMax-H3: block 0 and the output layer): every layer of
    a width has the same shape, so projecting that one weight once per layer costs what projecting
    each layer's own weight costs (496 MiB never fits a cache), without holding 24 GiB.
    ``every_layer``: each layer's own weight (a checkpoint small enough to hold, whose tables are
    then checked against these very GEMMs, :func:`tables_equal_linear`).
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
        sync_device(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            for layer in self.spec.layers():
                weight, bias = self.weights(layer)
                for x in xs:
                    F.linear(x, weight, bias)
        sync_device(self.device)
        return time.perf_counter() - start


def tables_equal_linear(
    cache: AdalnCache, resident: ResidentLayer, plans: Sequence[torch.Tensor], inputs: dict[PlanKey, torch.Tensor]
) -> bool:
    """Whether every layer's rows of every plan are ``torch.equal`` to ``F.linear`` of its held weights.

    ``resident`` must hold every layer (``every_layer=True``): these are the file's own weights,
    so a match says the table is what the resident model's projection returns for that input.
    """
    with torch.no_grad():
        for plan in plans:
            key = plan_key(plan, cache.spec.plan_columns)
            x = inputs[key]
            slot = int(cache.lookup(plan))
            for layer in cache.spec.layers():
                weight, bias = resident.tensors[layer]
                if not torch.equal(cache.layer_rows(layer, slot, x.shape[0]), F.linear(x, weight, bias)):
                    return False
    return True


def naive(source: Any, xs: Sequence[torch.Tensor]) -> float:
    """Read each layer whole into a fresh buffer, then project every plan: no overlap, no reuse.

    On a GPU each layer is copied to the device (pageable, blocking) before it is projected.
    """
    spec, layout = source.spec, source.layout
    device = device_of(xs)
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


def request_cache(
    source: Any, plans: int, device: torch.device, *, batched: bool = False, tiled: bool | str = "auto"
) -> AdalnCache:
    """A fresh cache with room for ``plans`` plans of up to 4 timesteps, no progress bar."""
    return AdalnCache(
        source.spec,
        source,
        max_plans=plans,
        max_plan_width=4,
        progress=False,
        batched=batched,
        device=device,
        tiled=tiled,
    )


def one_pass(
    source: Any,
    plans: Sequence[torch.Tensor],
    inputs: dict[tuple[int, ...], torch.Tensor],
    *,
    fresh: bool = False,
    batched: bool = False,
    settle: Callable[[], None] | None = None,
    in_place: bool = True,
    tiled: bool | str = "auto",
) -> float:
    """The real thing: a fresh cache's ``build`` of ``plans`` (one rebuild pass), timed.

    By default the source keeps its read buffers between passes (``keep_buffers``, the library's
    default), so this is a serving process's steady state: if the source holds no pool yet, an
    untimed pass fills it first, then ``settle`` runs (the cold runs drop the page cache again
    there, so the priming pass cannot warm it). ``fresh``: the source allocates new buffers for
    this pass and frees them after (``keep_buffers=False``), which is what the first pass of a
    process costs. ``in_place`` and ``tiled``: the source's and the cache's options of those names
    (the library's defaults: in place, ``"auto"``).
    """
    device = device_of(inputs)  # the cache lives where the inputs do

    def build(todo: Sequence[torch.Tensor]) -> float:
        cache = request_cache(source, len(todo), device, batched=batched, tiled=tiled)
        sync_device(device)
        start = time.perf_counter()
        report = cache.build(list(todo), embed=lambda p: inputs[plan_key(p)])
        sync_device(device)
        seconds = time.perf_counter() - start
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


def batched_exactness(
    source: Any, plans: Sequence[torch.Tensor], inputs: dict[tuple[int, ...], torch.Tensor]
) -> dict[str, Any]:
    """Build ``plans`` per plan and batched, from scratch (probe included), and compare the slabs bitwise."""
    clear_verdicts()  # a new process's view: the batched build probes every shape class again
    built = {}
    reports = {}
    for batched in (False, True):
        cache = request_cache(source, len(plans), device_of(inputs), batched=batched)
        reports[batched] = cache.build(list(plans), embed=lambda p: inputs[plan_key(p)])
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


__all__ = [
    "ResidentLayer",
    "batched_exactness",
    "device_of",
    "naive",
    "one_pass",
    "read_and_project_concurrently",
    "read_buffer",
    "read_only",
    "read_only_direct",
    "request_cache",
    "sync_device",
    "tables_equal_linear",
    "tensor_ranges",
]
