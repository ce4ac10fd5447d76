"""Projection weights streamed from safetensors files, one layer at a time, with read-ahead (docs/api.md).

A pass reads on a background thread, so layer k+1 is read while layer k is projected and at most
``read_ahead + 1`` layers are in memory; every byte is counted and hashed once, on the reader thread,
while still hot in the CPU's caches. Files are opened (and, in place, mapped) per pass, so a file
replaced by ``rename`` is seen by the next pass and no mapping outlives its pass. A refresh swaps the
:class:`ValidatedCheckpoint` whole, so a pass never sees half of an old checkpoint and half of a new
one. Buffers keep each tensor's file offset modulo 4096, where a model mapping the file holds it
(docs/exactness.md); what projecting in place cannot catch: docs/tables.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..devices import CopyStreams, copy_to_device, indexed
from ..errors import CheckpointError, ConfigError
from ..identity import DigestSink, checkpoint_upstream, role_of
from ..spec import KeyLayout, Layer, ModulationSpec
from . import Columns, LayerWeights, check_tensors, detect_layout, expected, tensor_problem
from .files import CheckpointFiles, CheckpointPath, SafetensorsHeader, TensorEntry, open_regular
from .reads import DirectReads, PassMappings, StagingPool, pread_into, read_buffer, resident_fraction

log = logging.getLogger(__name__)
_UNSET = object()


def _open(path: Path) -> int:
    try:
        return open_regular(path)
    except OSError as exc:
        raise CheckpointError(f"cannot open checkpoint file {path}: {exc}") from exc


@dataclass(frozen=True)
class ValidatedCheckpoint:
    """The files of a checkpoint and its key layout, every projection tensor checked against ``spec``."""

    files: CheckpointFiles
    layout: KeyLayout
    spec: ModulationSpec

    @classmethod
    def read(cls, path: CheckpointPath, spec: ModulationSpec, layout: str) -> ValidatedCheckpoint:
        """Resolve the files, parse their headers and validate; CheckpointError naming every problem."""
        checkpoint = CheckpointFiles.read(path)
        where = checkpoint.where
        searched = ", ".join(str(f) for f in checkpoint.files)
        found = detect_layout(where, spec, layout, f"checkpoint ({searched})")

        def problem(key: str, shape: tuple[int, ...]) -> str | None:
            entry = where[key].entries[key] if key in where else None
            if entry is None:
                return tensor_problem(spec, key, None, None, shape)
            found = tensor_problem(spec, key, entry.shape, entry.torch_dtype or entry.dtype, shape)
            if found is None and (why := entry.misaligned()):
                found = f"{key}: {why}"
            return found

        check_tensors(spec, found, problem, f"files searched: {searched}")
        return cls(checkpoint, found, spec)

    def entry(self, name: str) -> tuple[SafetensorsHeader, TensorEntry]:
        """The header of the file holding tensor ``name`` and its entry there (KeyError if absent)."""
        header = self.files.where[name]
        return header, header.entries[name]

    def span(self, name: str, rows: tuple[int, int] | None) -> tuple[int, int, list[int]]:
        """(file offset, bytes, shape) of tensor ``name``, or of its rows ``[start, stop)``."""
        entry = self.entry(name)[1]
        shape = list(entry.shape)
        if rows is None:
            return entry.begin, entry.nbytes, shape
        start, stop = rows
        row_bytes = entry.nbytes // shape[0]
        shape[0] = stop - start
        return entry.begin + start * row_bytes, (stop - start) * row_bytes, shape

    @contextlib.contextmanager
    def opened(self) -> Iterator[dict[Path, int]]:
        """Every file open, for one pass (files are never kept open between passes)."""
        fds: dict[Path, int] = {}
        try:
            for header in self.files.headers:
                fds[header.path] = _open(header.path)
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)


class CheckpointSource:
    """Projection weights streamed from safetensors files (the arguments: docs/api.md).

    ``keep_buffers`` because a serving process runs pass after pass, and fresh buffers cost every pass
    the first-touch page faults of two layers (0.23 s per 496 MiB layer on the 2-core dev box, against
    45 ms for the ``pread`` itself) or, on CUDA, a slow pinned allocation.
    """

    def __init__(
        self,
        path: CheckpointPath,
        spec: ModulationSpec,
        *,
        layout: str = "auto",
        keep_buffers: bool = True,
        direct_io: bool = True,
        in_place: bool = True,
        rehash: bool = False,
    ) -> None:
        if not isinstance(spec, ModulationSpec):
            raise ConfigError(f"CheckpointSource needs a ModulationSpec as spec, got {type(spec).__name__}")
        for name, value in (("in_place", in_place), ("rehash", rehash)):
            if not isinstance(value, bool):
                raise ConfigError(f"CheckpointSource's {name} must be True or False, got {value!r}")
        self.spec = spec
        self.path = path
        self._layout_arg = layout
        if layout != "auto":
            spec.layout(layout)
        self.keep_buffers = bool(keep_buffers)
        self.direct_io = bool(direct_io)
        self.in_place = in_place
        self.rehash = rehash
        #: One lock for the byte counters (passes' reader threads add to them) and the kept buffers.
        self._lock = threading.Lock()
        self._read = 0
        #: Of ``bytes_read``, those read with O_DIRECT, and those projected in place from the mapping
        #: (hashed, never copied).
        self.bytes_direct = self.bytes_in_place = 0
        #: The staging buffers kept from the last pass (taken out while a pass uses them).
        self._pool: StagingPool | None = None
        #: The side stream of each device this source copies layers to, reused by every pass.
        self.copy_streams = CopyStreams()
        self._upstream: Any = _UNSET
        self._load()

    # -- identity ---------------------------------------------------------------------------

    def _load(self) -> None:
        """(Re)resolve files, parse headers and validate; only commits state when all is well."""
        self._checkpoint = ValidatedCheckpoint.read(self.path, self.spec, self._layout_arg)
        self.files = self._checkpoint.files.files
        self.index = self._checkpoint.files.index
        self.layout = self._checkpoint.layout

    @property
    def fingerprint(self) -> str:
        return self._checkpoint.files.fingerprint

    @property
    def upstream(self) -> str | Callable[[], str | None] | None:
        """What was set, else the digest of the checkpoint's own upstream tensors
        (:func:`~adalncache.identity.checkpoint_upstream`)."""
        return checkpoint_upstream(self) if self._upstream is _UNSET else self._upstream

    @upstream.setter
    def upstream(self, value: str | Callable[[], str | None] | None) -> None:
        self._upstream = value

    def changed_files(self) -> list[Path]:
        """The files (and index) whose ``stat`` identity moved since they were validated: a build checks
        before and after its pass, and publishes nothing read from them (the bytes may be a mix)."""
        return self._checkpoint.files.changed_files()

    def refresh(self) -> bool:
        """``stat`` every file; on any change re-parse headers and re-validate (CheckpointError if bad)."""
        if not self._checkpoint.files.changed():
            return False
        old = self.fingerprint
        self._load()
        log.info("checkpoint %s changed on disk (fingerprint %s -> %s)", self.path, old[:12], self.fingerprint[:12])
        return self.fingerprint != old

    # -- counters ---------------------------------------------------------------------------

    def _count(self, nbytes: int, *, in_place: bool = False, direct: int = 0) -> None:
        with self._lock:
            self._read += nbytes
            self.bytes_in_place += nbytes if in_place else 0
            self.bytes_direct += direct

    @property
    def bytes_read(self) -> int:
        """Projection bytes read by passes (staged or in place)."""
        return self._read

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        with self._lock:
            self._read = value

    def cached_fraction(self) -> float | None:
        """Of the projection bytes, the fraction the page cache holds now (``mincore``; nothing is read), or
        None where that cannot be told. A cold pass reads with O_DIRECT, so a second read is as cold."""
        total = cached = 0.0
        checkpoint = self._checkpoint
        try:
            with checkpoint.opened() as fds:
                for _, key, _ in expected(self.spec, self.layout):
                    header, entry = checkpoint.entry(key)
                    fraction = resident_fraction(fds[header.path], entry.begin, entry.nbytes)
                    if fraction is None:
                        return None
                    total += entry.nbytes
                    cached += fraction * entry.nbytes
        except CheckpointError:
            return None
        return cached / total if total else None

    # -- reading ----------------------------------------------------------------------------

    def entry(self, name: str) -> tuple[SafetensorsHeader, TensorEntry]:
        """The header of the file holding tensor ``name`` and its entry there (KeyError if absent)."""
        return self._checkpoint.entry(name)

    def read_tensor(self, name: str) -> torch.Tensor:
        """One whole tensor as the file holds it (the time embedder), at the file offset's address modulo
        4096 (an fp32 GEMV's bits depend on it); through the page cache, not counted in ``bytes_read``.
        CheckpointError, naming the files and the tensor, if it is absent or unreadable."""
        try:
            header, entry = self.entry(name)
        except KeyError:
            files = ", ".join(str(f) for f in self.files)
            raise CheckpointError(f"the checkpoint has no tensor {name!r} (files searched: {files})") from None
        dtype = entry.view_dtype(header.path, "read")
        view = read_buffer(entry.nbytes, entry.begin)
        fd = _open(header.path)
        try:
            pread_into(fd, view, entry.begin, header.path, name)
        finally:
            os.close(fd)
        return view.view(dtype).view(entry.shape)

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
        digests: DigestSink | None = None,
    ) -> Iterator[LayerWeights]:
        """Yield each layer, reading up to ``read_ahead`` layers ahead on a background thread. On CUDA the
        host buffers are pinned and copied on a side stream, so the copy of layer k+1 overlaps the
        projection of layer k."""
        device = torch.device(device)
        if read_ahead < 0:
            raise ConfigError(f"read_ahead must be >= 0, got {read_ahead}")
        # With its index: the reader thread must not guess which CUDA device is current.
        yield from LayerPass(self, layers, indexed(device), columns, read_ahead, digests).run()

    # -- buffers and summary ----------------------------------------------------------------

    @property
    def _kept(self) -> StagingPool | None:
        """The staging pool kept from the last pass (None when none is kept, or a pass holds it)."""
        with self._lock:
            return self._pool

    @property
    def kept_bytes(self) -> int:
        """Bytes the read buffers kept from the last pass hold (0 when none are kept)."""
        pool = self._kept
        return pool.nbytes if pool is not None else 0

    def _take_buffers(self, device: torch.device, read_ahead: int) -> StagingPool | None:
        """The staging buffers of one pass: the kept pool where it fits, else a new one (None: fresh per layer).

        On CUDA a pinned buffer is free again once its copy finished and loads run one at a time, so one
        buffer serves the pass. On CPU the consumer projects from the buffer itself: the one it holds plus
        the read_ahead being read. With read_ahead=0 the read runs inside next(), while the consumer
        still holds the previous layer, so no buffer could be reused: a fresh one per layer.
        """
        cuda = device.type == "cuda"
        if not (cuda or read_ahead):
            return None
        with self._lock:  # taken out while in use, so two concurrent passes never share buffers
            kept, self._pool = self._pool, None
        # Another read_ahead keeps the buffers it can use; a pool of the other kind is dropped.
        slots = 1 if cuda else read_ahead + 1
        reuse = kept is not None and kept.pin == cuda
        staging = kept.resized(slots) if reuse and kept is not None else StagingPool(slots, pin=cuda, device=device)
        staging.device = device if cuda else None
        return staging

    def _give_back(self, staging: StagingPool, keep: bool) -> None:
        """After a pass: keep its buffers for the next one, or free them."""
        if keep:
            with self._lock:
                self._pool = staging
        else:
            staging.clear()

    def release_buffers(self) -> int:
        """Free the read buffers kept from the last pass (a pass in progress owns its own); returns the bytes."""
        with self._lock:
            kept, self._pool = self._pool, None
        if kept is None:
            return 0
        released = kept.nbytes
        kept.clear()
        log.debug("released %.1f MiB of kept read buffers", released / 2**20)
        return released

    def describe(self) -> dict[str, Any]:
        tensors: list[dict[str, Any]] = []
        total = 0
        for _, key, _ in expected(self.spec, self.layout):
            header, entry = self.entry(key)
            tensors.append({"name": key, "file": header.path.name, "shape": list(entry.shape), "dtype": entry.dtype})
            total += entry.nbytes
        return {
            "kind": "checkpoint",
            "path": str(self.path),
            "files": [str(f) for f in self.files],
            "index": str(self.index) if self.index else None,
            "layout": self.layout.name,
            "projection_tensors": len(tensors),
            "projection_bytes": total,
            "fingerprint": self.fingerprint,
            "spec": self.spec.describe(),
            "tensors": tensors,
        }

    def __repr__(self) -> str:
        return f"CheckpointSource({str(self.path)!r}, layout={self.layout.name!r}, files={len(self.files)})"


class LayerPass:
    """One pass over ``layers`` of the checkpoint as validated when it starts: a reader thread ``read_ahead``
    layers ahead of the consumer. Its files, mappings and thread end with it (drained whether the consumer
    finishes, fails or stops early); only the staging buffers the source keeps outlive it."""

    def __init__(
        self,
        source: CheckpointSource,
        layers: Sequence[Layer],
        device: torch.device,
        columns: Columns | None,
        read_ahead: int,
        digests: DigestSink | None,
    ) -> None:
        self.source, self.checkpoint = source, source._checkpoint
        self.todo = list(layers)
        self.device, self.columns, self.read_ahead, self.digests = device, columns, read_ahead, digests
        self.cuda = device.type == "cuda"
        self.copy_stream = source.copy_streams.get(device) if self.cuda else None
        self.staging = source._take_buffers(device, read_ahead)
        self.keep = source.keep_buffers
        self.direct = DirectReads() if source.direct_io else None
        self.in_place = source.in_place and not self.cuda
        # In place: the pass's own mappings of the files it holds open (set once they are).
        self.maps: PassMappings | None = None

    def _rows(self, layer: Layer) -> tuple[int, int] | None:
        return self.columns.bounds(self.checkpoint.spec.out_features(layer)) if self.columns else None

    def read(self, fds: dict[Path, int], layer: Layer, index: int) -> tuple[LayerWeights, list[torch.Tensor]]:
        """One layer's weight and bias, really reading every byte (in place, into a staging slot, or a
        fresh buffer), counted and hashed; returns the keep-alive buffers too."""
        checkpoint, rows = self.checkpoint, self._rows(layer)
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for part in checkpoint.spec.tensors_of(layer):
            name = checkpoint.layout.tensor(layer, part)
            header, entry = checkpoint.entry(name)
            dtype = entry.torch_dtype
            assert dtype is not None  # validated
            offset, nbytes, shape = checkpoint.span(name, rows)
            raw = self.maps.view(header, offset, nbytes, name) if self.maps is not None else None
            if raw is not None:
                self.source._count(nbytes, in_place=True)
            else:
                if self.staging is not None:
                    raw = self.staging.take(index, part, nbytes, offset)
                else:
                    raw = read_buffer(nbytes, offset, pin=self.cuda)
                self.source._count(pread_into(fds[header.path], raw, offset, header.path, name, self.direct))
            if self.digests is not None:
                self.digests.feed(role_of(layer, part), entry.dtype, entry.shape, rows, raw)
            out.append((raw, raw.view(dtype).view(shape)))
        (w_raw, weight), *rest = out
        return LayerWeights(layer, weight, rest[0][1] if rest else None), [w_raw, *(raw for raw, _ in rest)]

    def load(self, fds: dict[Path, int], index: int) -> LayerWeights:
        """Read layer ``index`` of the pass (on the reader thread), and copy it to a CUDA device."""
        lw, keep = self.read(fds, self.todo[index], index)
        if self.copy_stream is None:
            return lw  # the views keep their buffers alive; nothing else holds them
        # With the cache's device current (never device 0 by default): the pinned buffer is copied on
        # the source's side stream, and the thread waits for the copy, even when it fails halfway,
        # before the buffer can be reused.
        copied = copy_to_device([t for t in (lw.weight, lw.bias) if t is not None], self.device, self.copy_stream)
        del keep, lw  # the staging buffer is free for the next layer
        return LayerWeights(self.todo[index], copied[0], copied[1] if len(copied) > 1 else None)

    def prefault_second(self) -> None:
        """While layer 0 is read, first-touch the buffer layer 1 will be read into (unless it will be
        projected in place: then no buffer is needed)."""
        staging, todo, checkpoint = self.staging, self.todo, self.checkpoint
        if staging is None or self.cuda or len(todo) < 2 or staging.slots < 2:
            return
        name = checkpoint.layout.weight(todo[1])
        offset, nbytes, _ = checkpoint.span(name, self._rows(todo[1]))
        if self.maps is None or not self.maps.resident(checkpoint.entry(name)[0].path, offset, nbytes):
            staging.prefault(1, "weight", nbytes)

    def handed_over(self, lw: LayerWeights) -> LayerWeights:
        """``lw`` made safe for the consumer's stream: on CUDA the block was allocated on the copy
        stream, so the allocator is told the compute stream uses it (else it could hand the block
        back to the next copy early)."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for tensor in (lw.weight, lw.bias):
                if tensor is not None:
                    tensor.record_stream(current)
        return lw

    def run(self) -> Iterator[LayerWeights]:
        """Yield each layer; at most ``read_ahead + 1`` layers are alive at once (this one and those being read)."""
        direct = self.direct
        with (
            self.checkpoint.opened() as fds,
            contextlib.closing(direct) if direct is not None else contextlib.nullcontext(),
            ThreadPoolExecutor(1, thread_name_prefix="adalncache-read") as pool,
        ):
            self.maps = PassMappings(fds) if self.in_place else None
            pending: list[Future[LayerWeights]] = []
            submitted = 0

            def submit() -> None:
                nonlocal submitted
                if submitted < len(self.todo):
                    pending.append(pool.submit(self.load, fds, submitted))
                    submitted += 1

            try:
                submit()
                self.prefault_second()
                for _ in range(len(self.todo)):
                    lw = pending.pop(0).result()
                    # Read ahead while the consumer projects this layer.
                    while len(pending) < self.read_ahead and submitted < len(self.todo):
                        submit()
                    yield self.handed_over(lw)
                    del lw
                    if not pending:
                        submit()
            finally:
                for fut in pending:
                    fut.cancel()
                for fut in pending:
                    with contextlib.suppress(BaseException):
                        fut.result()
                self.end()

    def end(self) -> None:
        """Count the pass's O_DIRECT bytes, close its mappings, and keep (or free) its staging buffers."""
        if self.direct is not None:
            self.source._count(0, direct=self.direct.bytes)
        if self.maps is not None:
            self.maps.close()
        if self.staging is not None:
            self.source._give_back(self.staging, self.keep)
