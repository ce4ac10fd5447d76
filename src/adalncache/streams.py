"""Stream ordering for the slab: who must wait for whom before reading or rewriting a slot.

On a CPU every operation runs in program order, so nothing here does anything. On CUDA the host
returns from a kernel launch long before the kernel ran, and each thread may launch on its own
stream, so three orderings must be made explicit:

* **publish -> read.** A build enqueues the projections and copies that fill its slots on the
  building thread's current stream, then flips the host-side slot map. A forward on another
  stream that resolves the new slot could read the rows before those kernels ran. So a build
  records an event after its last write (:meth:`StreamSync.after_write`), and every reader makes
  its own current stream wait on the event of each slot it reads (:meth:`StreamSync.before_read`)
  before enqueueing the read.
* **read -> rewrite.** Eviction, a rebuild into a freed slot, and the clearing of a slot's length
  all write into memory that a reader on another stream may still have queued reads of. So a
  request that held slots records an event when it releases them, a gather records one after
  reading (:meth:`StreamSync.after_read`), and a writer's stream waits on every such event of a
  slot, and on the slot's last write, before its first write to it
  (:meth:`StreamSync.before_write`). Per slot, only the newest event of each stream is kept:
  events on one stream complete in order. A clearing outside a build (the last release of a slot
  retired by ``invalidate()``, ``invalidate()`` itself) records its own write event.
* **build -> build.** Builds are serialised on the host by the cache's lock, but two threads
  build on two streams. Each build's stream waits on the previous build's last event
  (:meth:`StreamSync.begin_build`), so host-tier copies and slot writes of consecutive builds
  never overlap on the device either.

The CUDA calls live in :class:`CudaEvents`; :class:`NoEvents` (CPU) makes every method a no-op,
and :class:`RecordedEvents` replays the bookkeeping on a CPU for tests (which events are
recorded, and which each stream waits on, per slot). The source's copy streams
(:class:`CopyStreams`) and the copy that must finish before its host buffer is reused
(:func:`copy_to_device`) are here too, so all stream code sits in one module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import torch


class EventBackend(Protocol):
    """How events are made and waited on for one device (CUDA, a CPU no-op, or a recording fake)."""

    #: False when every operation is a no-op (the cache then skips the bookkeeping entirely).
    active: bool

    def stream(self) -> Hashable:
        """The calling thread's current stream on this device (a hashable identity)."""
        ...

    def record(self) -> Any:
        """Record an event on the current stream after everything enqueued so far; return it."""
        ...

    def wait(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (the host does not block)."""
        ...


class NoEvents:
    """A CPU: work runs in program order, so there is nothing to record or wait for."""

    active = False

    def stream(self) -> Hashable:
        return None

    def record(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        return None


class CudaEvents:
    """CUDA events on the calling thread's current stream of ``device``."""

    active = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self) -> Hashable:
        stream = torch.cuda.current_stream(self.device)
        return (stream.device_index, stream.cuda_stream)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class RecordedEvents:
    """A CPU stand-in that logs what a CUDA backend would do, for tests of the bookkeeping.

    ``current`` names the stream the calling code is "on"; events are numbered in record order;
    ``log`` holds ``("record", stream, event)`` and ``("wait", stream, event)`` tuples.
    """

    active = True

    def __init__(self) -> None:
        self.current: Hashable = "default"
        self.log: list[tuple[str, Hashable, int]] = []
        self._count = 0

    def stream(self) -> Hashable:
        return self.current

    def record(self) -> Any:
        self._count += 1
        self.log.append(("record", self.current, self._count))
        return self._count

    def wait(self, event: Any) -> None:
        self.log.append(("wait", self.current, int(event)))

    def waits(self) -> list[tuple[Hashable, int]]:
        """``(stream, event)`` of every wait so far, in order."""
        return [(stream, event) for kind, stream, event in self.log if kind == "wait"]


def events_for(device: torch.device) -> EventBackend:
    """The event backend of ``device``: CUDA events on a GPU, nothing on a CPU."""
    return CudaEvents(device) if device.type == "cuda" else NoEvents()


class StreamSync:
    """Per-slot events of one slab: the last write of each slot and the reads still pending on it.

    Thread-safe (a small lock of its own): readers record and wait from any thread while a build
    runs. With an inactive backend (a CPU) every method returns at once.
    """

    def __init__(self, num_slots: int, backend: EventBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        #: The event after the last write of each slot (``None``: never written, or already waited
        #: for by everyone who needed it).
        self.written: list[Any] = [None] * num_slots
        #: Per slot, per stream: the newest event after a read of that slot.
        self.read: list[dict[Hashable, Any]] = [{} for _ in range(num_slots)]
        #: Per stream: the newest event after a read whose slot the host does not know (a gather
        #: with a device slot tensor); every rewrite of any slot waits on these.
        self.read_any: dict[Hashable, Any] = {}
        #: The event after the last build's last write (the next build's stream waits on it).
        self.last_build: Any = None
        #: The event of the newest publish. Builds are chained (each waits for the previous one),
        #: so it follows every earlier publish too: a reader of slots the host does not know
        #: waits on it alone.
        self.last_publish: Any = None

    @property
    def active(self) -> bool:
        return bool(self.backend.active)

    def reset(self, backend: EventBackend) -> None:
        """Start over with ``backend`` (the slab moved to another device: the old events order
        nothing there). The caller has no reader or build in flight (the cache moves under both
        locks, with no plan held)."""
        with self._lock:
            self.backend = backend
            self.written = [None] * len(self.written)
            self.read = [{} for _ in self.read]
            self.read_any = {}
            self.last_build = None
            self.last_publish = None

    def begin_build(self) -> None:
        """Before a build writes anything: order its stream after the previous build."""
        if not self.backend.active:
            return
        with self._lock:
            event = self.last_build
        if event is not None:
            self.backend.wait(event)

    def end_build(self) -> None:
        """After a build's last device work (publish, or a rollback's clearing)."""
        if not self.backend.active:
            return
        event = self.backend.record()
        with self._lock:
            self.last_build = event

    def before_write(self, slots: Iterable[int]) -> None:
        """Before the first write to ``slots``: wait until every pending read of them is done, and
        the last write of each (a clearing on another stream, say)."""
        if not self.backend.active:
            return
        pending: list[Any] = []
        with self._lock:
            for slot in slots:
                pending.extend(self.read[slot].values())
                self.read[slot].clear()  # waited for by this stream, which writes everything after
                pending.append(self.written[slot])
            # Reads of unknown slots stay: a writer on another stream must wait for them too.
            pending.extend(self.read_any.values())
        for event in _distinct(pending):
            self.backend.wait(event)

    def after_write(self, slots: Sequence[int], *, publish: bool = False) -> None:
        """After the last write of ``slots``: one event every later reader (``publish``) or writer waits on."""
        if not self.backend.active or not slots:
            return
        event = self.backend.record()
        with self._lock:
            for slot in slots:
                self.written[slot] = event
            if publish:
                self.last_publish = event

    def before_read(self, slots: Iterable[int] | None) -> None:
        """Before reading ``slots`` (``None``: slots the host does not know: after every publish)."""
        if not self.backend.active:
            return
        with self._lock:
            events = [self.last_publish] if slots is None else [self.written[slot] for slot in slots]
        for event in _distinct(events):
            self.backend.wait(event)

    def after_read(self, slots: Iterable[int] | None) -> None:
        """After enqueueing reads of ``slots`` (``None``: unknown slots): no rewrite may overtake them."""
        if not self.backend.active:
            return
        stream = self.backend.stream()
        event = self.backend.record()
        with self._lock:
            if slots is None:
                self.read_any[stream] = event
            else:
                for slot in slots:
                    self.read[slot][stream] = event


def _distinct(events: Iterable[Any]) -> list[Any]:
    """The events, without ``None`` and without waiting twice on one event object."""
    seen: set[int] = set()
    out = []
    for event in events:
        if event is not None and id(event) not in seen:
            seen.add(id(event))
            out.append(event)
    return out


class CopyStreams:
    """One side stream per device, made on first use and reused by every later pass.

    Why not a new stream per pass: torch hands out streams round-robin from a pool, and the
    caching allocator keeps blocks freed on a stream for that stream, so a fresh stream per pass
    leaves each pass's freed weight blocks cached where the next pass cannot reuse them, and the
    reserved device memory grows pass after pass.
    """

    def __init__(self, factory: Callable[[torch.device], Any] | None = None) -> None:
        self._factory = factory or (lambda device: torch.cuda.Stream(device))
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        #: How many streams were made (tests check that passes reuse them).
        self.made = 0

    def get(self, device: torch.device) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._factory(device)
                self._streams[device] = stream
                self.made += 1
            return stream


def _cuda_context(device: torch.device, stream: Any) -> contextlib.AbstractContextManager[Any]:
    """``device`` current and ``stream`` current on it, for the calling thread."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def copy_to_device(
    tensors: Sequence[torch.Tensor],
    device: torch.device,
    stream: Any,
    *,
    copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
    context: Callable[[torch.device, Any], contextlib.AbstractContextManager[Any]] = _cuda_context,
) -> list[torch.Tensor]:
    """Copy host ``tensors`` to ``device`` on ``stream`` and wait until the copies are done.

    The host buffers may be reused as soon as this returns, whether it returns or raises: a
    failure after some copies were queued (out of device memory on the second tensor, say) still
    synchronises ``stream`` before propagating, so no DMA can read a buffer the caller hands back
    to its pool. The calling thread makes ``device`` current, so a reader thread never creates a
    context on another GPU. ``copy`` (the per-tensor copy) and ``context`` (making the device and
    stream current) are seams for tests on a CPU.
    """
    do_copy = copy or (lambda t: t.to(device, non_blocking=True))
    try:
        with context(device, stream):
            out = [do_copy(t) for t in tensors]
        stream.synchronize()
    except BaseException:
        stream.synchronize()  # whatever was queued reads the host buffers: let it finish first
        raise
    return out


__all__ = [
    "CopyStreams",
    "CudaEvents",
    "EventBackend",
    "NoEvents",
    "RecordedEvents",
    "StreamSync",
    "copy_to_device",
    "events_for",
]
