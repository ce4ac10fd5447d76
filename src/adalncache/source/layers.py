"""The reads of one layer in a pass: its weight and bias, staged or in place, counted and hashed.

Why apart from the pass: how one tensor's bytes reach a buffer (a fresh buffer, a reused staging
slot, O_DIRECT, or a view of the pass's mapping) is the same whether a pass streams the layers on
a reader thread or a caller reads one layer itself, and every byte read is counted and hashed
exactly once, here, on the thread that read it, while it is still hot in the CPU's caches.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..identity.digest import DigestSink, role_of
from ..spec import Layer
from .buffers import StagingPool, read_buffer
from .header import open_regular
from .mapped import PassMappings
from .protocol import Columns, LayerWeights
from .reads import DirectReads, pread_into
from .validated import ValidatedCheckpoint


class ReadCounters:
    """The byte counters of a source, shared by its passes' reader threads (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Projection bytes read by passes (staged or in place).
        self.read = 0
        #: Of ``read``, those read with O_DIRECT.
        self.direct = 0
        #: Of ``read``, those projected in place from the mapping (hashed, never copied).
        self.in_place = 0

    def add(self, nbytes: int, *, in_place: bool = False) -> None:
        with self.lock:
            self.read += nbytes
            if in_place:
                self.in_place += nbytes

    def add_direct(self, nbytes: int) -> None:
        with self.lock:
            self.direct += nbytes


@contextlib.contextmanager
def open_files(checkpoint: ValidatedCheckpoint) -> Iterator[dict[Path, int]]:
    """Open every file of ``checkpoint`` for one pass (files are never kept open between passes)."""
    fds: dict[Path, int] = {}
    try:
        for header in checkpoint.headers:
            try:
                fds[header.path] = open_regular(header.path)
            except OSError as exc:
                raise CheckpointError(f"cannot open checkpoint file {header.path}: {exc}") from exc
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


class LayerReads:
    """Reads layers of one validated checkpoint into buffers or mapped views, counting every byte."""

    def __init__(self, checkpoint: ValidatedCheckpoint, counters: ReadCounters) -> None:
        self.checkpoint = checkpoint
        self.counters = counters

    def staged(
        self,
        fds: dict[Path, int],
        name: str,
        rows: tuple[int, int] | None,
        pin: bool,
        staging: tuple[StagingPool, int, str] | None = None,
        direct: DirectReads | None = None,
        digests: tuple[DigestSink, str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw buffer, tensor view of it) of a projection tensor or its ``rows``, read with ``pread``.

        ``digests`` (sink, role): hash the bytes just read, on this (the reader) thread.
        """
        header, entry = self.checkpoint.entry(name)
        dtype = entry.torch_dtype
        assert dtype is not None  # validated
        offset, nbytes, shape = self.checkpoint.span(name, rows)
        if staging is None:
            raw = read_buffer(nbytes, offset, pin=pin)
        else:
            pool, index, part = staging
            raw = pool.take(index, part, nbytes, offset)
        self.counters.add(pread_into(fds[header.path], raw, offset, header.path, name, direct))
        if digests is not None:
            digests[0].feed(digests[1], entry.dtype, entry.shape, rows, raw)
        return raw, raw.view(dtype).view(shape)

    def mapped(
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
        header, entry = self.checkpoint.entry(name)
        dtype = entry.torch_dtype
        assert dtype is not None  # validated
        offset, nbytes, shape = self.checkpoint.span(name, rows)
        raw = maps.view(header, offset, nbytes, name)
        if raw is None:
            return None
        self.counters.add(nbytes, in_place=True)
        if digests is not None:
            digests[0].feed(digests[1], entry.dtype, entry.shape, rows, raw)
        return raw, raw.view(dtype).view(shape)

    def layer(
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
        spec, layout = self.checkpoint.spec, self.checkpoint.layout
        rows = columns.bounds(spec.out_features(layer)) if columns else None
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for part in spec.tensors_of(layer):
            name = layout.weight(layer) if part == "weight" else layout.bias(layer)
            sink = (digests, role_of(layer, part)) if digests is not None else None
            got = self.mapped(maps, name, rows, sink) if maps is not None else None
            if got is None:
                stage = (staging[0], staging[1], part) if staging else None
                got = self.staged(fds, name, rows, pin, stage, direct, sink)
            out.append(got)
        (w_raw, weight), *rest = out
        bias = rest[0][1] if rest else None
        return LayerWeights(layer, weight, bias), [w_raw, *(raw for raw, _ in rest)]


__all__ = ["LayerReads", "ReadCounters", "open_files"]
