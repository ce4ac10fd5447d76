"""Host memory for DMA: page-locked regions of exactly the size asked for, given back when released.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every
request up to a power of two and keeps freed blocks for reuse instead of returning them to the
system. A 20 GB host tier would pin 32 GiB, an in-memory source would pin each 496 MiB layer as
512 MiB, and ``release_buffers()`` or ``disable()`` would give nothing back.

So a :class:`HostBuffer` is ordinary pageable memory (an anonymous ``mmap``: page-aligned, and
returned to the system when the last tensor viewing it dies) that, when ``pin`` is set, is
page-locked in place with ``cudaHostRegister`` for exactly its size, and unlocked with
``cudaHostUnregister`` by :meth:`HostBuffer.release` (or when the buffer object is collected).
Registered memory is what ``Tensor.is_pinned()`` reports as pinned, and copies from it with
``non_blocking=True`` are asynchronous DMA. Unlike the caching allocator's blocks, nothing here
records which stream still reads a buffer: every user synchronises before it reuses or releases
one (the source's copies, :func:`~adalncache.streams.copy_to_device`; the host tier's blocking
copies).

The CUDA calls go through a :class:`Registrar`, so the sizes registered and the release paths are
tested on a CPU with :class:`RecordingRegistrar`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import weakref
from typing import Any, Protocol

import torch

from .options import knob

log = logging.getLogger(__name__)


class Registrar(Protocol):
    """Page-locks host ranges for the device (``cudaHostRegister``) and unlocks them."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock ``[address, address + nbytes)``; raise on failure."""
        ...

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` of the range starting at ``address``."""
        ...


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


class RecordingRegistrar:
    """A CPU stand-in that records what would be registered: ``live`` maps address -> bytes."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.live: dict[int, int] = {}
        self.registered: list[int] = []  # sizes, in order
        self.unregistered = 0
        self._lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        if self.fail:
            raise MemoryError(f"cannot page-lock {nbytes} bytes (recording registrar told to fail)")
        with self._lock:
            self.live[address] = nbytes
            self.registered.append(nbytes)

    def unregister(self, address: int) -> None:
        with self._lock:
            del self.live[address]
            self.unregistered += 1


#: The registrar used when none is given (CUDA). Tests may pass their own to each buffer.
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

    The memory is an anonymous mapping of exactly ``nbytes`` (rounded to whole pages by the
    kernel, never to a power of two). It goes back to the system when both this object is
    released (or collected) and no tensor viewing it is alive. :meth:`release` unlocks the pages
    at once; views that outlive it stay valid, as ordinary pageable memory. ``device``: the GPU
    the buffer serves, made current for the CUDA calls (whatever thread makes them).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pin: bool = False,
        registrar: Registrar | None = None,
        device: torch.device | None = None,
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"a host buffer needs nbytes >= 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.pinned = False
        if self.nbytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            self._finalizer: weakref.finalize | None = None
            return
        mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        self._finalizer = None
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
    """A host copy of ``tensor`` in a :class:`HostBuffer` of exactly its size (page-locked when ``pin``).

    Returns the copy and the buffer that owns its memory (keep it to release the pages early).
    """
    nbytes = tensor.numel() * tensor.element_size()
    buffer = HostBuffer(nbytes, pin=pin, registrar=registrar, device=tensor.device)
    copy = buffer.tensor.view(tensor.dtype).view(tensor.shape) if nbytes else torch.empty_like(tensor, device="cpu")
    copy.copy_(tensor)
    return copy, buffer


__all__ = [
    "CUDA",
    "CudaRegistrar",
    "HostBuffer",
    "RecordingRegistrar",
    "Registrar",
    "host_tensor_like",
    "pinned_bytes",
]
