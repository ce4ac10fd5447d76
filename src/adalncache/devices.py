"""The device layer: which device, what memory it can still give, host memory for DMA to it, and
the order of work across its CUDA streams.

* **Which device**: every entry point refuses a device that is not one, or that this machine cannot
  use, before any work, and says it the same way (:func:`resolve_device`); an allocation the device
  cannot hold is refused before it is made (:func:`check_available`).
* **Host memory for DMA** (:class:`HostBuffer`): exactly the size asked for and given back when
  released, unlike torch's pinned allocator. Nothing records which stream still reads a buffer:
  every user synchronises before it reuses or releases one (:func:`copy_to_device`).
* **Stream order** (:class:`StreamSync`): the events that order publish -> read, read -> rewrite and
  build -> build on CUDA (docs/state-machine.md); a no-op on a CPU. The CUDA calls go through seams
  (:class:`Registrar`, :class:`EventBackend`), so the bookkeeping is tested on a CPU with recording ones.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import torch

from .errors import ConfigError
from .options import flag, knob

log = logging.getLogger(__name__)

# -- which device ------------------------------------------------------------------------------


def resolve_device(value: torch.device | str, *, argument: str | None = None) -> torch.device:
    """``value`` as a ``torch.device``, or ConfigError if it is not one or this machine lacks it. The message
    names ``argument=`` (the keyword it was passed as) and its CLI flag, or without it ``--device`` only."""
    if argument is None:
        device_flag = flag("device")
        given, fix = f"{device_flag} {value}", f"use {device_flag} cpu or {device_flag} cuda:0"
        cpu = f"{device_flag} cpu"
    else:
        given = f"{argument}={value!r}"
        fix = f"set {argument}= to a device such as 'cpu' or 'cuda:0' (CLI {flag('device')})"
        cpu = f"{argument}='cpu' (CLI {flag('device')} cpu)"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{given} is not a torch device ({exc}): {fix}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{given}: CUDA is not available on this machine; use {cpu}")
    if device.type == "meta":
        raise ConfigError(f"{given}: the meta device holds no data, so no table can live or be computed there; {fix}")
    return device


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` means the current CUDA device): a build or a reader thread
    must not land on whatever CUDA device is current in its own thread."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def available_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (CPU: ``MemAvailable``, what the kernel gives without
    swapping; CUDA: ``mem_get_info``'s free memory), or None where that cannot be told."""
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", "rb") as handle:
                for line in handle:
                    if line.startswith(b"MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError, ValueError):
            return None
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"


def check_available(nbytes: int, device: torch.device, what: str, lower: str) -> None:
    """ConfigError before allocating ``nbytes`` that ``device`` cannot give (when it can tell). ``what``: the
    allocation and what sizes it; ``lower``: the arguments (and CLI flags) to lower."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ConfigError(
            f"{what} needs {_gib(nbytes)} on {device}, but only {_gib(free)} are available there: lower {lower}"
        )


def allocation_error(exc: BaseException, nbytes: int, device: torch.device, what: str, lower: str) -> ConfigError:
    """The ConfigError for an allocator's own failure (the check before it could not tell)."""
    return ConfigError(
        f"{what} needs {_gib(nbytes)} on {device} and the allocation failed ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else 'out of memory'}): lower {lower}"
    )


# -- host memory for DMA -----------------------------------------------------------------------


class Registrar(Protocol):
    """Page-locks host ranges for the device (``cudaHostRegister``) and unlocks them."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock ``[address, address + nbytes)``; raise on failure."""

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` of the range starting at ``address``."""


class CudaRegistrar:
    """``cudaHostRegister`` (portable: pinned for every device context) and ``cudaHostUnregister``."""

    PORTABLE = 1  # cudaHostRegisterPortable

    def register(self, address: int, nbytes: int) -> None:
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, self.PORTABLE))
        if code != 0:
            raise MemoryError(
                f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}: not enough memory can be "
                f"page-locked (a locked-memory limit, or host memory); lower {knob('host_cache_bytes')} or "
                f"{knob('read_ahead')}"
            )

    def unregister(self, address: int) -> None:
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
        if code != 0:
            log.warning("cudaHostUnregister failed with CUDA error %d; the pages stay locked until exit", code)


#: The registrar used when none is given (CUDA). Tests pass a recording one to each buffer.
CUDA = CudaRegistrar()

#: Bytes page-locked by live :class:`HostBuffer` objects now (through any registrar).
_pinned = 0
_pinned_lock = threading.Lock()


def _count_pinned(delta: int) -> None:
    global _pinned
    with _pinned_lock:
        _pinned += delta


def pinned_bytes() -> int:
    """The bytes this package holds page-locked right now (host tier arenas, staging buffers, host
    copies of a model's projections): what a deployment check compares before and after
    ``disable()`` or ``close()``, which must give them all back."""
    with _pinned_lock:
        return _pinned


def _on_device(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """``device`` current for a CUDA runtime call: a call on a thread whose current device is
    another GPU would create a context there (about 0.5 GiB of that GPU's memory)."""
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _unregister(
    registrar: Registrar, address: int, nbytes: int, device: torch.device | None, keep_alive: object
) -> None:
    """Finalizer: unlock the pages; ``keep_alive`` (the mapping) is dropped only after, so the range
    is still mapped when it is unregistered."""
    with _on_device(device):
        registrar.unregister(address)
    _count_pinned(-nbytes)
    del keep_alive


class HostBuffer:
    """``nbytes`` of host memory as a uint8 tensor (``.tensor``), page-locked for DMA when ``pin``.

    Not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every request up to
    a power of two and keeps freed blocks (a 20 GB host tier would pin 32 GiB, and ``disable()`` give
    nothing back). An anonymous ``mmap`` of exactly ``nbytes``, registered with the CUDA runtime when
    pinned; :meth:`release` unlocks the pages at once (views that outlive it stay valid, as pageable
    memory). ``device``: the GPU the buffer serves, made current for the CUDA calls.
    """

    def __init__(
        self, nbytes: int, *, pin: bool = False, registrar: Registrar | None = None, device: torch.device | None = None
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"a host buffer needs nbytes >= 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.pinned = False
        self._finalizer: weakref.finalize | None = None
        if self.nbytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        if pin:
            registrar = registrar if registrar is not None else CUDA
            address = self.tensor.data_ptr()
            with _on_device(device):
                registrar.register(address, self.nbytes)  # raises: nothing registered, the mapping just goes
            self.pinned = True
            _count_pinned(self.nbytes)
            self._finalizer = weakref.finalize(self, _unregister, registrar, address, self.nbytes, device, mapping)

    def release(self) -> int:
        """Unlock the pages now (idempotent); returns the bytes that were page-locked."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is None or not finalizer.alive:
            return 0
        finalizer()
        self.pinned = False
        return self.nbytes

    def __repr__(self) -> str:
        return f"HostBuffer({self.nbytes} bytes{', pinned' if self.pinned else ''})"


def host_tensor_like(
    tensor: torch.Tensor, *, pin: bool, registrar: Registrar | None = None
) -> tuple[torch.Tensor, HostBuffer]:
    """A host copy of ``tensor`` in a :class:`HostBuffer` of exactly its size (page-locked when ``pin``),
    and the buffer that owns its memory (keep it to release the pages early)."""
    nbytes = tensor.numel() * tensor.element_size()
    buffer = HostBuffer(nbytes, pin=pin, registrar=registrar, device=tensor.device)
    copy = buffer.tensor.view(tensor.dtype).view(tensor.shape) if nbytes else torch.empty_like(tensor, device="cpu")
    copy.copy_(tensor)
    return copy, buffer


# -- stream order ------------------------------------------------------------------------------


class EventBackend(Protocol):
    """How events are made and waited on for one device (:class:`DeviceEvents`, or a recording fake)."""

    #: False when every operation is a no-op (the cache then skips the bookkeeping entirely).
    active: bool

    def stream(self) -> Hashable:
        """The calling thread's current stream on this device (a hashable identity)."""

    def record(self) -> Any:
        """Record an event on the current stream after everything enqueued so far; return it."""

    def wait(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (the host does not block)."""


class DeviceEvents:
    """CUDA events on the calling thread's current stream of ``device``; inactive on any other device type,
    where work runs in program order and there is nothing to record or wait for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = device.type == "cuda"

    def stream(self) -> Hashable:
        stream = torch.cuda.current_stream(self.device)
        return (stream.device_index, stream.cuda_stream)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class StreamSync:
    """Per-slot events of one slab: the last write of each slot and the reads still pending on it. Thread-safe:
    readers record and wait from any thread while a build runs. Inactive backend (a CPU): every method returns."""

    def __init__(self, num_slots: int, backend: EventBackend) -> None:
        self._lock = threading.Lock()
        self._slots = num_slots
        self.reset(backend)

    def reset(self, backend: EventBackend) -> None:
        """Start over with ``backend`` (also when the slab moved to another device: the old events order
        nothing there; the cache moves under both locks, with no reader or build in flight)."""
        with self._lock:
            self.backend = backend
            #: The event after the last write of each slot (``None``: never written, or already
            #: waited for by everyone who needed it).
            self.written: list[Any] = [None] * self._slots
            #: Per slot, per stream: the newest event after a read of that slot (events on one stream
            #: complete in order, so the newest stands for all).
            self.read: list[dict[Hashable, Any]] = [{} for _ in range(self._slots)]
            #: Per stream: the newest event after a read whose slot the host does not know (a gather
            #: with a device slot tensor); every rewrite of any slot waits on these.
            self.read_any: dict[Hashable, Any] = {}
            #: The event after the last build's last write (the next build's stream waits on it).
            self.last_build: Any = None
            #: The event of the newest publish. Builds are chained (each waits for the previous one),
            #: so it follows every earlier publish too: a reader of slots the host does not know
            #: waits on it alone.
            self.last_publish: Any = None

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
    """One side stream per device, made on first use and reused by every later pass: the caching allocator
    keeps blocks freed on a stream for that stream, so a fresh stream per pass would grow the reserved
    device memory pass after pass."""

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
    """Copy host ``tensors`` to ``device`` on ``stream`` and wait until the copies are done, also when one
    fails after others were queued, so the host buffers may be reused as soon as this returns or raises.
    The calling thread makes ``device`` current (a reader thread never creates a context on another GPU).
    ``copy`` and ``context`` are seams for tests on a CPU.
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
