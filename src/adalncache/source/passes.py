"""One pass's stream of layers: the reader thread, read-ahead, the copy to a device, and the kept buffers.

Why apart from the source: a pass has a lifetime of its own (files opened and mapped for it,
staging buffers taken for it and handed back after it, a reader thread that must be drained
whether the consumer finishes, fails or stops early), and none of it outlives the pass except the
staging buffers a source keeps for the next one (:class:`KeptBuffers`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..devices import CopyStreams, copy_to_device
from ..identity.digest import DigestSink
from ..spec import Layer
from .buffers import StagingPool
from .layers import LayerReads, open_files
from .mapped import PassMappings
from .protocol import Columns, LayerWeights
from .reads import DirectReads

log = logging.getLogger(__name__)


class KeptBuffers:
    """The staging buffers a source keeps between passes (taken out while a pass uses them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: StagingPool | None = None

    def take(self, device: torch.device, read_ahead: int) -> StagingPool | None:
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
            kept, self._pool = self._pool, None
        # Another read_ahead keeps the buffers it can use; a pool of the other kind is dropped.
        reuse = kept is not None and kept.pin == cuda
        staging = kept.resized(slots) if reuse and kept is not None else StagingPool(slots, pin=cuda, device=device)
        staging.device = device if cuda else None
        return staging

    def give_back(self, staging: StagingPool, keep: bool) -> None:
        """After a pass: keep its buffers for the next one, or free them."""
        if keep:
            with self._lock:
                self._pool = staging
        else:
            staging.clear()

    @property
    def pool(self) -> StagingPool | None:
        """The kept pool (None while none is kept or a pass holds it)."""
        with self._lock:
            return self._pool

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._pool.nbytes if self._pool is not None else 0

    def release(self) -> int:
        """Free the kept buffers; the bytes released."""
        with self._lock:
            kept, self._pool = self._pool, None
        if kept is None:
            return 0
        released = kept.nbytes
        kept.clear()
        log.debug("released %.1f MiB of kept read buffers", released / 2**20)
        return released


@dataclass
class PassSettings:
    """How one pass reads: where the layers go, which columns, how far ahead, what it hashes and keeps."""

    device: torch.device
    columns: Columns | None
    read_ahead: int
    digests: DigestSink | None
    direct_io: bool
    in_place: bool
    keep_buffers: bool


class LayerPass:
    """One pass over ``layers``: a reader thread ``read_ahead`` layers ahead of the consumer."""

    def __init__(
        self,
        reads: LayerReads,
        layers: Sequence[Layer],
        settings: PassSettings,
        kept: KeptBuffers,
        copy_streams: CopyStreams,
    ) -> None:
        self.reads = reads
        self.todo = list(layers)
        self.settings = settings
        self.kept = kept
        device = settings.device
        self.cuda = device.type == "cuda"
        self.copy_stream = copy_streams.get(device) if self.cuda else None
        self.staging = kept.take(device, settings.read_ahead)
        self.direct = DirectReads() if settings.direct_io else None
        # In place (CPU only): the pass's own mappings of the files it holds open (set once they are).
        self.maps: PassMappings | None = None

    def load(self, fds: dict[Path, int], index: int) -> LayerWeights:
        """Read layer ``index`` of the pass (on the reader thread), and copy it to a CUDA device."""
        layer = self.todo[index]
        stage = (self.staging, index) if self.staging is not None else None
        s = self.settings
        lw, keep = self.reads.layer(
            fds,
            layer,
            columns=s.columns,
            pin=self.cuda,
            staging=stage,
            direct=self.direct,
            digests=s.digests,
            maps=self.maps,
        )
        if self.copy_stream is None:
            return lw  # the views keep their buffers alive; nothing else holds them
        # Runs on the reader thread, with the cache's device current (never device 0 by
        # default): the pinned buffer is copied on the source's side stream, and the thread
        # waits for the copy, even when it fails halfway, before the buffer can be reused.
        copied = copy_to_device([t for t in (lw.weight, lw.bias) if t is not None], s.device, self.copy_stream)
        del keep, lw  # the staging buffer is free for the next layer
        return LayerWeights(layer, copied[0], copied[1] if len(copied) > 1 else None)

    def prefault_second(self) -> None:
        """While layer 0 is read, first-touch the buffer layer 1 will be read into (unless it will be
        projected in place: then no buffer is needed)."""
        staging, todo = self.staging, self.todo
        if staging is None or self.cuda or len(todo) < 2 or staging.slots < 2:
            return
        checkpoint, columns = self.reads.checkpoint, self.settings.columns
        rows = columns.bounds(checkpoint.spec.out_features(todo[1])) if columns else None
        name = checkpoint.layout.weight(todo[1])
        offset, nbytes, _ = checkpoint.span(name, rows)
        if self.maps is None or not self.maps.resident(checkpoint.entry(name)[0].path, offset, nbytes):
            staging.prefault(1, "weight", nbytes)

    def handed_over(self, lw: LayerWeights) -> LayerWeights:
        """``lw`` made safe for the consumer's stream: on CUDA the block was allocated on the copy
        stream, so the allocator is told the compute stream uses it (else it could hand the block
        back to the next copy early)."""
        if self.cuda:
            current = torch.cuda.current_stream(self.settings.device)
            lw.weight.record_stream(current)
            if lw.bias is not None:
                lw.bias.record_stream(current)
        return lw

    def run(self) -> Iterator[LayerWeights]:
        """Yield each layer; at most ``read_ahead + 1`` layers are alive at once (this one and those being read)."""
        direct = self.direct
        with (
            open_files(self.reads.checkpoint) as fds,
            contextlib.closing(direct) if direct is not None else contextlib.nullcontext(),
            ThreadPoolExecutor(1, thread_name_prefix="adalncache-read") as pool,
        ):
            self.maps = PassMappings(fds) if self.settings.in_place and not self.cuda else None
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
                    while len(pending) < self.settings.read_ahead and submitted < len(self.todo):
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
            self.reads.counters.add_direct(self.direct.bytes)
        if self.maps is not None:
            self.maps.close()
        if self.staging is not None:
            self.kept.give_back(self.staging, self.settings.keep_buffers)


__all__ = ["KeptBuffers", "LayerPass", "PassSettings"]
