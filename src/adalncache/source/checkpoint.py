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

The source itself only holds what lasts between passes and decides nothing else: the validated
files and layout (:mod:`~adalncache.source.validated`), the per-layer reads and byte counters
(:mod:`~adalncache.source.layers`), and a pass's stream with the staging buffers kept for the next
one (:mod:`~adalncache.source.passes`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..devices import CopyStreams
from ..errors import CheckpointError, ConfigError
from ..identity.digest import DigestSink
from ..spec import Layer, ModulationSpec
from .buffers import StagingPool
from .files import CheckpointPath
from .header import SafetensorsHeader, TensorEntry
from .layers import LayerReads, ReadCounters, open_files
from .mapped import PassMappings
from .passes import KeptBuffers, LayerPass, PassSettings
from .projections import expected
from .protocol import Columns, LayerWeights
from .reads import DirectReads, resident_fraction
from .validated import ValidatedCheckpoint

log = logging.getLogger(__name__)


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
        self._counters = ReadCounters()
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
        #: Project from a mapping of the files, with no staging copy, on a CPU where the page cache
        #: holds a tensor (see the module docstring). False: every byte is copied into staging buffers.
        self.in_place = in_place
        self._buffers = KeptBuffers()
        #: The side stream of each device this source copies layers to, reused by every pass.
        self.copy_streams = CopyStreams()
        self._load()

    # -- identity ---------------------------------------------------------------------------

    def _load(self) -> None:
        """(Re)resolve files, parse headers and validate; only commits state when all is well."""
        checkpoint = ValidatedCheckpoint.read(self.path, self.spec, self._layout_arg)
        self._checkpoint = checkpoint
        self.files = checkpoint.files
        self.index = checkpoint.index
        self.layout = checkpoint.layout

    @property
    def fingerprint(self) -> str:
        return self._checkpoint.fingerprint

    def changed_files(self) -> list[Path]:
        """The files (and index) whose ``stat`` identity (ctime included) moved since they were validated.

        What a build checks before and after its pass: a file rewritten or replaced meanwhile means
        the bytes read may be a mix of old and new, so nothing read from it may be published.
        """
        return self._checkpoint.files_read.changed_files()

    def refresh(self) -> bool:
        """``stat`` every file; on any change re-parse headers and re-validate (CheckpointError if bad)."""
        if not self._checkpoint.files_read.changed():
            return False
        old = self.fingerprint
        self._load()
        log.info("checkpoint %s changed on disk (fingerprint %s -> %s)", self.path, old[:12], self.fingerprint[:12])
        return self.fingerprint != old

    # -- counters ---------------------------------------------------------------------------

    @property
    def bytes_read(self) -> int:
        """Projection bytes read by passes (staged or in place)."""
        return self._counters.read

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        with self._counters.lock:
            self._counters.read = value

    @property
    def bytes_direct(self) -> int:
        """Of ``bytes_read``, those read with O_DIRECT."""
        return self._counters.direct

    @property
    def bytes_in_place(self) -> int:
        """Of ``bytes_read``, those projected in place from the mapping (hashed, never copied)."""
        return self._counters.in_place

    def cached_fraction(self) -> float | None:
        """Of the projection bytes, the fraction the page cache holds now (``mincore``; nothing is read).

        None where that cannot be told (no ``mincore``, a file that cannot be opened: the pass
        itself then says why). What a caller weighing a second read of the same bytes asks: a
        cold pass reads with O_DIRECT, so reading them again is as cold as the first time.
        """
        total = cached = 0.0
        try:
            with open_files(self._checkpoint) as fds:
                for _, key, _ in expected(self.spec, self.layout):
                    header, entry = self._checkpoint.entry(key)
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
        """One whole tensor of the checkpoint (any dtype torch can hold), read from disk now.

        For the tensors besides the projections that a caller needs exactly as the file holds
        them (the time embedder, say): the buffer keeps the file offset's address modulo 4096,
        like the projections, because an fp32 GEMV's bits depend on the weight's address. Read
        through the page cache and not counted in ``bytes_read`` (which counts the projection
        bytes of passes). CheckpointError, naming the files and the tensor, if it is absent or
        cannot be read.
        """
        return self._checkpoint.read_tensor(name)

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
        """One layer's weight and bias, read and counted by :meth:`.layers.LayerReads.layer` (its arguments)."""
        return LayerReads(self._checkpoint, self._counters).layer(
            fds, layer, columns=columns, pin=pin, staging=staging, direct=direct, digests=digests, maps=maps
        )

    def open_files(self) -> contextlib.AbstractContextManager[dict[Path, int]]:
        """Open every file for one pass (files are never kept open between passes)."""
        return open_files(self._checkpoint)

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
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # the reader thread must not guess
        settings = PassSettings(device, columns, read_ahead, digests, self.direct_io, self.in_place, self.keep_buffers)
        reads = LayerReads(self._checkpoint, self._counters)
        yield from LayerPass(reads, layers, settings, self._buffers, self.copy_streams).run()

    # -- buffers and summary ----------------------------------------------------------------

    @property
    def _kept(self) -> StagingPool | None:
        """The staging pool kept from the last pass (None when none is kept), for the tests that
        check which buffers a pass reused."""
        return self._buffers.pool

    @property
    def kept_bytes(self) -> int:
        """Bytes the read buffers kept from the last pass hold (0 when none are kept)."""
        return self._buffers.nbytes

    def release_buffers(self) -> int:
        """Free the read buffers kept from the last pass; returns the bytes released.

        Why: with ``keep_buffers`` on (the default) the source holds ``read_ahead + 1`` layers of
        host memory between passes; a process that is done building (or about to need that memory)
        gives it back here. The next pass allocates fresh buffers. Safe at any time: a pass in
        progress owns its buffers and is not affected.
        """
        return self._buffers.release()

    def describe(self) -> dict[str, Any]:
        tensors = self._checkpoint.projection_tensors()
        total = sum(tensor.pop("nbytes") for tensor in tensors)
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


__all__ = ["CheckpointSource"]
