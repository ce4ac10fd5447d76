"""Projection weights streamed from safetensors files, one layer at a time, with read-ahead.

A :class:`CheckpointSource` parses and validates the headers itself (native or diffusers layout;
one file, a directory, a sharded checkpoint with its index, or a list of files), checks every
projection tensor at construction, and streams one layer at a time with ``pread`` on a
background thread, so layer k+1 is read while layer k is projected and at most
``read_ahead + 1`` layers are in memory. Files are opened (and, in place, mapped) per pass, so a
file replaced by ``rename`` is seen by the next pass and no mapping outlives its pass.

**In place** (``in_place=True``, the default): on a CPU, a tensor whose every page the page cache
holds is projected straight from a mapping of the file the pass holds open, at the file's own
offsets (where ``from_pretrained`` places the resident weights): no staging copy competes with
the GEMMs for the cores. The reader thread still hashes those bytes (from the mapping) and checks,
per tensor, that the file still reaches its end. Staging stays for CUDA (page-locked buffers, the
copy stream), for bytes the cache does not hold (O_DIRECT), and for ``in_place=False``. What in
place cannot catch is a file truncated *while* a mapped layer is hashed or projected: touching a
page past the new end raises SIGBUS (as it does for a model loaded with ``from_pretrained``, which
maps the same files); see docs/tables.md.

Every buffer it reads into keeps the tensor's file offset modulo 4096 (so modulo 64), which is
where a model that memory-maps the same file holds that tensor, as the mapping does: projecting
from either gives the model's bits (see :mod:`adalncache.source.buffers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from ..identity.digest import DigestSink, role_of
from ..spec import Layer, ModulationSpec
from ..streams import CopyStreams, copy_to_device
from .buffers import StagingPool, read_buffer
from .files import CheckpointFiles, CheckpointPath
from .header import SafetensorsHeader, TensorEntry, open_regular
from .mapped import PassMappings
from .projections import detect_layout, expected, raise_problems, tensor_problem
from .protocol import Columns, LayerWeights
from .reads import DirectReads, pread_into

log = logging.getLogger(__name__)


def _misaligned(entry: TensorEntry) -> str | None:
    """Why ``entry``'s data cannot be viewed as its dtype in place, or None.

    A tensor is read into a buffer at its file offset's address modulo 4096, so its elements sit
    on their natural boundary only if the file offset is a multiple of the element size; every
    writer of the format (safetensors' own included) lays tensors out that way.
    """
    dtype = entry.torch_dtype
    if dtype is None:
        return f"dtype {entry.dtype} has no torch counterpart"
    if entry.begin % dtype.itemsize:
        return (
            f"its data starts at file offset {entry.begin}, not a multiple of its {dtype.itemsize}-byte "
            f"elements; re-save the checkpoint with safetensors"
        )
    return None


class CheckpointSource:
    """Projection weights streamed from safetensors files (see the module docstring)."""

    def __init__(
        self,
        path: CheckpointPath,
        spec: ModulationSpec,
        *,
        layout: str = "auto",
        keep_buffers: bool = True,
        direct_io: bool = True,
        in_place: bool = True,
    ) -> None:
        if not isinstance(spec, ModulationSpec):
            raise ConfigError(f"CheckpointSource needs a ModulationSpec as spec, got {type(spec).__name__}")
        if not isinstance(in_place, bool):
            raise ConfigError(f"CheckpointSource's in_place must be True or False, got {in_place!r}")
        self.spec = spec
        self.path = path
        self._layout_arg = layout
        if layout != "auto":
            spec.layout(layout)
        self.bytes_read = 0
        self._lock = threading.Lock()
        #: Keep the read buffers between passes: ``read_ahead + 1`` layers of host memory (about
        #: 1 GiB at the released widths), or one pinned layer on CUDA. On by default because a
        #: serving process runs pass after pass, and fresh buffers cost every pass the first-touch
        #: page faults of two layers (measured 0.23 s per 496 MiB layer on the 2-core dev box,
        #: against 45 ms for the ``pread`` itself from the page cache) or, on CUDA, a slow pinned
        #: allocation. Set it False (or call :meth:`release_buffers`) to give the memory back to the
        #: OS after every pass instead.
        self.keep_buffers = bool(keep_buffers)
        #: Read the bytes the page cache does not hold with O_DIRECT (see
        #: :class:`~adalncache.source.reads.DirectReads`): no CPU copy, no page cache filled or
        #: evicted. Cached bytes are read from the cache.
        self.direct_io = bool(direct_io)
        #: Of ``bytes_read``, those read with O_DIRECT.
        self.bytes_direct = 0
        #: Project from a mapping of the files, with no staging copy, on a CPU where the page cache
        #: holds a tensor (see the module docstring). False: every byte is copied into staging buffers.
        self.in_place = in_place
        #: Of ``bytes_read``, those projected in place from the mapping (hashed, never copied).
        self.bytes_in_place = 0
        self._kept: StagingPool | None = None
        #: The side stream of each device this source copies layers to, reused by every pass.
        self.copy_streams = CopyStreams()
        self._load()

    # -- identity ---------------------------------------------------------------------------

    def _load(self) -> None:
        """(Re)resolve files, parse headers and validate; only commits state when all is well."""
        checkpoint = CheckpointFiles.read(self.path)
        where = checkpoint.where
        searched = ", ".join(str(f) for f in checkpoint.files)
        layout = detect_layout(where, self.spec, self._layout_arg, f"checkpoint ({searched})")
        problems = []
        for _, key, shape in expected(self.spec, layout):
            holder = where.get(key)
            entry = holder.entries[key] if holder else None
            problem = tensor_problem(
                self.spec,
                key,
                entry.shape if entry else None,
                (entry.torch_dtype or entry.dtype) if entry else None,
                shape,
            )
            if problem is None and entry is not None and (why := _misaligned(entry)):
                problem = f"{key}: {why}"
            if problem:
                problems.append(problem)
        raise_problems(problems, f"files searched: {searched}", layout)
        self._checkpoint = checkpoint
        self.files = checkpoint.files
        self.index = checkpoint.index
        self.layout = layout

    @property
    def fingerprint(self) -> str:
        return self._checkpoint.fingerprint

    def changed_files(self) -> list[Path]:
        """The files (and index) whose ``stat`` identity (ctime included) moved since they were validated.

        What a build checks before and after its pass: a file rewritten or replaced meanwhile means
        the bytes read may be a mix of old and new, so nothing read from it may be published.
        """
        return self._checkpoint.changed_files()

    def refresh(self) -> bool:
        """``stat`` every file; on any change re-parse headers and re-validate (CheckpointError if bad)."""
        if not self._checkpoint.changed():
            return False
        old = self.fingerprint
        self._load()
        log.info("checkpoint %s changed on disk (fingerprint %s -> %s)", self.path, old[:12], self.fingerprint[:12])
        return self.fingerprint != old

    # -- reading ----------------------------------------------------------------------------

    def entry(self, name: str) -> tuple[SafetensorsHeader, TensorEntry]:
        """The header of the file holding tensor ``name`` and its entry there (KeyError if absent)."""
        header = self._checkpoint.where[name]
        return header, header.entries[name]

    def read_tensor(self, name: str) -> torch.Tensor:
        """One whole tensor of the checkpoint (any dtype torch can hold), read from disk now.

        For the tensors besides the projections that a caller needs exactly as the file holds
        them (the time embedder, say): the buffer keeps the file offset's address modulo 4096,
        like the projections, because an fp32 GEMV's bits depend on the weight's address. Read
        through the page cache and not counted in ``bytes_read`` (which counts the projection
        bytes of passes). CheckpointError, naming the files and the tensor, if it is absent or
        cannot be read.
        """
        try:
            header, entry = self.entry(name)
        except KeyError:
            files = ", ".join(str(f) for f in self.files)
            raise CheckpointError(f"the checkpoint has no tensor {name!r} (files searched: {files})") from None
        why = _misaligned(entry)
        if why:
            raise CheckpointError(f"{header.path}: tensor {name!r} cannot be read: {why}")
        dtype = entry.torch_dtype
        assert dtype is not None  # _misaligned said so
        view = read_buffer(entry.nbytes, entry.begin)
        try:
            fd = open_regular(header.path)
        except OSError as exc:
            raise CheckpointError(f"cannot open checkpoint file {header.path}: {exc}") from exc
        try:
            pread_into(fd, view, entry.begin, header.path, name)
        finally:
            os.close(fd)
        return view.view(dtype).view(entry.shape)

    def _span(self, name: str, rows: tuple[int, int] | None) -> tuple[int, int, list[int]]:
        """(file offset, bytes, shape) of tensor ``name``, or of its rows ``[start, stop)``."""
        entry = self.entry(name)[1]
        shape = list(entry.shape)
        if rows is None:
            return entry.begin, entry.nbytes, shape
        start, stop = rows
        row_bytes = entry.nbytes // shape[0]
        shape[0] = stop - start
        return entry.begin + start * row_bytes, (stop - start) * row_bytes, shape

    def _read_part(
        self,
        fds: dict[Path, int],
        name: str,
        rows: tuple[int, int] | None,
        pin: bool,
        staging: tuple[StagingPool, int, str] | None = None,
        direct: DirectReads | None = None,
        digests: tuple[DigestSink, str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw buffer, tensor view of it) of a projection tensor or its ``rows``.

        ``digests`` (sink, role): hash the bytes just read, on this (the reader) thread, while
        they are still hot in the CPU's caches.
        """
        header, entry = self.entry(name)
        dtype = entry.torch_dtype
        assert dtype is not None  # validated
        offset, nbytes, shape = self._span(name, rows)
        if staging is None:
            raw = read_buffer(nbytes, offset, pin=pin)
        else:
            pool, index, part = staging
            raw = pool.take(index, part, nbytes, offset)
        got = pread_into(fds[header.path], raw, offset, header.path, name, direct)
        with self._lock:
            self.bytes_read += got
        if digests is not None:
            digests[0].feed(digests[1], entry.dtype, entry.shape, rows, raw)
        return raw, raw.view(dtype).view(shape)

    def _mapped_part(
        self,
        maps: PassMappings,
        name: str,
        rows: tuple[int, int] | None,
        digests: tuple[DigestSink, str] | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(raw view, tensor view) of a projection tensor (or its ``rows``) in the pass's mapping, or None to stage it.

        The bytes are hashed here, on the reader thread, which also maps their pages before the
        consumer's GEMM touches them.
        """
        header, entry = self.entry(name)
        dtype = entry.torch_dtype
        assert dtype is not None  # validated
        offset, nbytes, shape = self._span(name, rows)
        raw = maps.view(header, offset, nbytes, name)
        if raw is None:
            return None
        with self._lock:
            self.bytes_read += nbytes
            self.bytes_in_place += nbytes
        if digests is not None:
            digests[0].feed(digests[1], entry.dtype, entry.shape, rows, raw)
        return raw, raw.view(dtype).view(shape)

    def read_layer(
        self,
        fds: dict[Path, int],
        layer: Layer,
        *,
        columns: Columns | None = None,
        pin: bool = False,
        staging: tuple[StagingPool, int] | None = None,
        direct: DirectReads | None = None,
        digests: DigestSink | None = None,
        maps: PassMappings | None = None,
    ) -> tuple[LayerWeights, list[torch.Tensor]]:
        """Read one layer's weight and bias (really reading every byte); returns keep-alive buffers.

        ``staging`` (pool, position in the pass) reads into a reused buffer instead of a fresh one.
        ``maps`` (the pass's mappings, by file): take each tensor the page cache holds in place.
        """
        rows = columns.bounds(self.spec.out_features(layer)) if columns else None
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for part in self.spec.tensors_of(layer):
            name = self.layout.weight(layer) if part == "weight" else self.layout.bias(layer)
            sink = (digests, role_of(layer, part)) if digests is not None else None
            got = self._mapped_part(maps, name, rows, sink) if maps is not None else None
            if got is None:
                stage = (staging[0], staging[1], part) if staging else None
                got = self._read_part(fds, name, rows, pin, stage, direct, sink)
            out.append(got)
        (w_raw, weight), *rest = out
        bias = rest[0][1] if rest else None
        return LayerWeights(layer, weight, bias), [w_raw, *(raw for raw, _ in rest)]

    @contextlib.contextmanager
    def open_files(self) -> Iterator[dict[Path, int]]:
        """Open every file for one pass (files are never kept open between passes)."""
        fds: dict[Path, int] = {}
        try:
            for header in self._checkpoint.headers:
                try:
                    fds[header.path] = open_regular(header.path)
                except OSError as exc:
                    raise CheckpointError(f"cannot open checkpoint file {header.path}: {exc}") from exc
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)

    def _take_staging(self, device: torch.device, read_ahead: int) -> StagingPool | None:
        """The staging buffers of one pass: the kept pool where it fits, else a new one (None: fresh per layer).

        On CUDA each pinned buffer is free again once its copy finished (a load waits for it), and
        loads run one at a time, so one buffer serves the whole pass; pinning is slow and rounds
        up, so it happens once per pass, not per layer. On CPU the consumer projects from the
        buffer itself: the one it holds plus the read_ahead being read. With read_ahead=0 the read
        runs inside next(), while the consumer still holds the previous layer, so a single
        buffer could never be reused: that mode keeps a fresh buffer per layer.
        """
        cuda = device.type == "cuda"
        if not (cuda or read_ahead):
            return None
        slots = 1 if cuda else read_ahead + 1
        # A kept pool is taken out while in use, so two concurrent passes never share buffers.
        with self._lock:
            kept, self._kept = self._kept, None
        # Another read_ahead keeps the buffers it can use; a pool of the other kind is dropped.
        reuse = kept is not None and kept.pin == cuda
        staging = kept.resized(slots) if reuse and kept is not None else StagingPool(slots, pin=cuda, device=device)
        staging.device = device if cuda else None
        return staging

    def _end_pass(self, staging: StagingPool | None, direct: DirectReads | None, maps: PassMappings | None) -> None:
        """Count the pass's O_DIRECT bytes, close its mappings, and keep (or free) its staging buffers."""
        if direct is not None:
            with self._lock:
                self.bytes_direct += direct.bytes
        if maps is not None:
            maps.close()
        if staging is not None:
            if self.keep_buffers:
                with self._lock:
                    self._kept = staging
            else:
                staging.clear()

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
        digests: DigestSink | None = None,
    ) -> Iterator[LayerWeights]:
        """Yield each layer, reading up to ``read_ahead`` layers ahead on a background thread.

        At most ``read_ahead + 1`` layers are held in host memory at once: the one the consumer
        projects and those being read. On CUDA the host buffers are pinned and copied to the device
        on a side stream, so the copy of layer k+1 overlaps the projection of layer k. ``digests``
        hashes every byte read, on the reader thread, before the buffer goes to the consumer.
        """
        device = torch.device(device)
        if read_ahead < 0:
            raise ConfigError(f"read_ahead must be >= 0, got {read_ahead}")
        cuda = device.type == "cuda"
        if cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # the reader thread must not guess
        copy_stream = self.copy_streams.get(device) if cuda else None
        todo = list(layers)
        staging = self._take_staging(device, read_ahead)

        # In place (CPU only): the pass's own mappings of the files it holds open (set once they are).
        maps: PassMappings | None = None

        def load(fds: dict[Path, int], index: int) -> LayerWeights:
            layer = todo[index]
            stage = (staging, index) if staging is not None else None
            lw, keep = self.read_layer(
                fds, layer, columns=columns, pin=cuda, staging=stage, direct=direct, digests=digests, maps=maps
            )
            if copy_stream is None:
                return lw  # the views keep their buffers alive; nothing else holds them
            # Runs on the reader thread, with the cache's device current (never device 0 by
            # default): the pinned buffer is copied on the source's side stream, and the thread
            # waits for the copy, even when it fails halfway, before the buffer can be reused.
            copied = copy_to_device([t for t in (lw.weight, lw.bias) if t is not None], device, copy_stream)
            del keep, lw  # the staging buffer is free for the next layer
            return LayerWeights(layer, copied[0], copied[1] if len(copied) > 1 else None)

        direct = DirectReads() if self.direct_io else None
        with (
            self.open_files() as fds,
            contextlib.closing(direct) if direct is not None else contextlib.nullcontext(),
            ThreadPoolExecutor(1, thread_name_prefix="adalncache-read") as pool,
        ):
            maps = PassMappings(fds) if self.in_place and not cuda else None
            pending: list[Future[LayerWeights]] = []
            submitted = 0

            def submit() -> None:
                nonlocal submitted
                if submitted < len(todo):
                    pending.append(pool.submit(load, fds, submitted))
                    submitted += 1

            try:
                submit()
                if staging is not None and not cuda and len(todo) > 1 and staging.slots > 1:
                    # While layer 0 is read, first-touch the buffer layer 1 will be read into (unless
                    # it will be projected in place: then no buffer is needed).
                    rows = columns.bounds(self.spec.out_features(todo[1])) if columns else None
                    name = self.layout.weight(todo[1])
                    offset, nbytes, _ = self._span(name, rows)
                    if maps is None or not maps.resident(self.entry(name)[0].path, offset, nbytes):
                        staging.prefault(1, "weight", nbytes)
                for _ in range(len(todo)):
                    lw = pending.pop(0).result()
                    # Read ahead while the consumer projects this layer: at most read_ahead + 1
                    # layers are alive at once (this one and those being read).
                    while len(pending) < read_ahead and submitted < len(todo):
                        submit()
                    if cuda:
                        # The block was allocated on the copy stream; tell the allocator the
                        # compute stream uses it, so it is not handed back to the next copy early.
                        current = torch.cuda.current_stream(device)
                        lw.weight.record_stream(current)
                        if lw.bias is not None:
                            lw.bias.record_stream(current)
                    yield lw
                    del lw
                    if not pending:
                        submit()
            finally:
                for fut in pending:
                    fut.cancel()
                for fut in pending:
                    with contextlib.suppress(BaseException):
                        fut.result()
                self._end_pass(staging, direct, maps)

    # -- buffers and summary ----------------------------------------------------------------

    @property
    def kept_bytes(self) -> int:
        """Bytes the read buffers kept from the last pass hold (0 when none are kept)."""
        with self._lock:
            return self._kept.nbytes if self._kept is not None else 0

    def release_buffers(self) -> int:
        """Free the read buffers kept from the last pass; returns the bytes released.

        Why: with ``keep_buffers`` on (the default) the source holds ``read_ahead + 1`` layers of
        host memory between passes; a process that is done building (or about to need that memory)
        gives it back here. The next pass allocates fresh buffers. Safe at any time: a pass in
        progress owns its buffers and is not affected.
        """
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is None:
            return 0
        released = kept.nbytes
        kept.clear()
        log.debug("released %.1f MiB of kept read buffers", released / 2**20)
        return released

    def describe(self) -> dict[str, Any]:
        tensors = []
        total = 0
        for _, key, _ in expected(self.spec, self.layout):
            header, entry = self.entry(key)
            total += entry.nbytes
            tensors.append({"name": key, "file": header.path.name, "shape": list(entry.shape), "dtype": entry.dtype})
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
