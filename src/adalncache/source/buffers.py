"""Host buffers placed at a chosen address modulo N, and the pool that reuses them across a pass.

Why placement matters for exactness: on CPU an fp32 GEMV (M=1) gives different bits for the same
weight at different addresses modulo 16 bytes. A model loaded from a safetensors file holds
memory-mapped views whose address is congruent to the tensor's file offset modulo the page size,
so a copy that must project like the model keeps that address modulo 64 (:data:`ALIGNMENT`).
Reads go further and keep it modulo 4096 (:data:`DIRECT_BLOCK`), which is what O_DIRECT needs
from the buffer, the file offset and the length; the buffers they use carry a block of slack on
each side, so a direct read can round its range out to whole blocks.

Page-locked buffers (for CUDA) come from :class:`~adalncache.devices.HostBuffer`: exactly the
size asked for, unlike torch's pinned allocator (which rounds each request up to a power of two,
pinning a 496 MiB layer as 512 MiB, and keeps freed blocks), and given back when released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from ..devices import HostBuffer, Registrar

log = logging.getLogger(__name__)

#: A copy of a weight keeps its address modulo this many bytes (see the module docstring).
ALIGNMENT = 64
#: O_DIRECT's unit: buffer address, file offset and length aligned to the device's logical block
#: size; 4096 covers every common device. Read buffers are placed modulo this (so modulo ALIGNMENT).
DIRECT_BLOCK = 4096


def _storage_bytes(nbytes: int, modulus: int, margin: int) -> int:
    """Bytes of storage that hold ``nbytes`` at any residue, with ``margin`` free on each side."""
    return nbytes + modulus + 2 * margin


def place(storage: torch.Tensor, nbytes: int, residue: int, *, modulus: int, margin: int) -> torch.Tensor:
    """The ``nbytes`` view of uint8 ``storage`` whose address is congruent to ``residue`` mod ``modulus``.

    At least ``margin`` bytes of ``storage`` lie before the view and after it (``storage`` must
    hold ``nbytes + modulus + 2 * margin`` bytes).
    """
    pad = margin + (residue - storage.data_ptr() - margin) % modulus
    return storage[pad : pad + nbytes]


def aligned_empty(
    shape: Sequence[int],
    dtype: torch.dtype,
    residue: int,
    *,
    modulus: int = ALIGNMENT,
    margin: int = 0,
    pin: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An uninitialised tensor whose data address is congruent to ``residue`` modulo ``modulus``.

    ``margin`` bytes of the same allocation stay free before and after the data (a direct read
    rounds its range out into them). ``pin`` allocates page-locked memory. The tensor is a view of
    a larger allocation and keeps it alive. On a device other than the CPU the tensor is a plain
    allocation: that device's allocator decides addresses, and the address effect on the bits is
    a CPU one.
    """
    shape = tuple(int(s) for s in shape)
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    itemsize = dtype.itemsize
    if residue % itemsize or modulus % itemsize:
        raise ValueError(
            f"a {dtype} tensor cannot start at an address {residue} modulo {modulus}: not a multiple of its "
            f"{itemsize}-byte elements"
        )
    nbytes = itemsize
    for size in shape:
        nbytes *= size
    size = _storage_bytes(nbytes, modulus, margin)
    # Page-locked: the view keeps the mapping alive, and the buffer object (kept on the tensor)
    # keeps the pages locked for as long as the tensor lives.
    owner = HostBuffer(size, pin=True) if pin else None
    storage = owner.tensor if owner is not None else torch.empty(size, dtype=torch.uint8)
    view = place(storage, nbytes, residue, modulus=modulus, margin=margin).view(dtype).view(shape)
    if owner is not None:
        vars(view)["adalncache_host_buffer"] = owner  # the pinned buffer lives as long as the view
    return view


def read_buffer(nbytes: int, file_offset: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 buffer for ``nbytes`` read from ``file_offset``: placed and padded for O_DIRECT."""
    return aligned_empty((nbytes,), torch.uint8, file_offset, modulus=DIRECT_BLOCK, margin=DIRECT_BLOCK, pin=pin)


def _use_count(storage: torch.Tensor) -> int:
    """References to ``storage``'s memory: every live view of it holds one."""
    return int(torch._C._storage_Use_Count(storage.untyped_storage()._cdata))


class StagingPool:
    """Read buffers reused across the layers of one pass, instead of one fresh buffer per layer.

    Why: a fresh 496 MiB buffer is a fresh ``mmap`` whose pages the kernel faults in and zeroes
    on first touch; measured on the 2-core dev box that costs 0.3-0.6 s per layer against 55 ms for
    the ``pread`` itself from the page cache. ``slots`` buffers per part (weight, bias) are used
    round-robin, so at most ``slots`` layers are alive. A buffer is only refilled once nothing but
    this pool references it (storage use count); a consumer that keeps a layer past the next one
    (say, into a list) makes the pool allocate a fresh buffer instead, so it is never overwritten
    under a live tensor. The wait covers the moment between ``next()`` and the consumer rebinding
    its loop variables; it is short because the consumer drops the previous layer within
    microseconds of receiving the next.
    """

    #: How long to wait for a consumer to drop a buffer before giving up and allocating a new one.
    WAIT_S = 0.05

    def __init__(
        self, slots: int, pin: bool, registrar: Registrar | None = None, device: torch.device | None = None
    ) -> None:
        self.slots = max(1, slots)
        self.pin = pin
        self.registrar = registrar
        #: The GPU the page-locked buffers serve (current for the CUDA calls, on any thread).
        self.device = device
        self._lock = threading.Lock()  # the reader thread and a prefaulting consumer share the pool
        self._buffers: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}
        #: The page-locked host buffers behind the pool's storages (pinned pools only), by slot.
        self._owners: dict[tuple[int, str], HostBuffer] = {}
        #: Bytes asked of the allocator for each fresh storage, in order (tests check the sizes).
        self.requested: list[int] = []
        self.fresh = 0  # buffers allocated (first use of a slot, or a slot still held by a consumer)
        # A consumer that kept one layer past its turn keeps them all (a list, a dict of layers):
        # after the first timeout the pool stops waiting and allocates straight away.
        self._wait = self.WAIT_S

    def _storage(self, nbytes: int) -> tuple[torch.Tensor, HostBuffer | None]:
        size = _storage_bytes(nbytes, DIRECT_BLOCK, DIRECT_BLOCK)
        self.requested.append(size)
        if not self.pin:
            return torch.empty(size, dtype=torch.uint8), None
        owner = HostBuffer(size, pin=True, registrar=self.registrar, device=self.device)
        return owner.tensor, owner

    def _free(self, key: tuple[int, str]) -> tuple[torch.Tensor, int] | None:
        held = self._buffers.get(key)
        if held is None:
            return None
        storage, idle = held
        deadline = time.monotonic() + self._wait
        while _use_count(storage) > idle:
            if time.monotonic() >= deadline:
                log.debug("staging buffer %s still referenced by the consumer; allocating a new one", key)
                self._wait = 0.0
                del self._buffers[key]
                # The consumer's view keeps the memory alive (as pageable memory once unlocked).
                self._release_owner(key)
                return None
            time.sleep(0.0002)
        return held

    def take(self, index: int, part: str, nbytes: int, file_offset: int) -> torch.Tensor:
        """A buffer like :func:`read_buffer`, from the pool when the slot of ``index`` is free."""
        key = (index % self.slots, part)
        held = self._free(key)
        if held is None or held[0].numel() < _storage_bytes(nbytes, DIRECT_BLOCK, DIRECT_BLOCK):
            held = self._add(key, *self._storage(nbytes))
        return place(held[0], nbytes, file_offset, modulus=DIRECT_BLOCK, margin=DIRECT_BLOCK)

    def _add(
        self,
        key: tuple[int, str],
        storage: torch.Tensor,
        owner: HostBuffer | None,
        *,
        only_if_absent: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """Register ``storage`` as the buffer of ``key`` (unless ``only_if_absent`` and one is there)."""
        with self._lock:
            if only_if_absent and key in self._buffers:
                if owner is not None:
                    owner.release()
                return self._buffers[key]
            self._release_owner(key, locked=True)
            held = (storage, _use_count(storage))
            self._buffers[key] = held
            if owner is not None:
                self._owners[key] = owner
            self.fresh += 1
            return held

    def _release_owner(self, key: tuple[int, str], *, locked: bool = False) -> None:
        """Unlock the pages of ``key``'s old buffer (pinned pools); its memory goes with its last view."""
        if not locked:
            with self._lock:
                owner = self._owners.pop(key, None)
        else:
            owner = self._owners.pop(key, None)
        if owner is not None:
            owner.release()

    def prefault(self, index: int, part: str, nbytes: int) -> bool:
        """Allocate and first-touch the buffer of ``index``'s slot now, if it has none yet.

        Why: the consumer of a pass idles while the first layer is read; faulting in the next
        slot's fresh buffer meanwhile takes that cost (0.2 s per 496 MiB layer on the dev box) off
        the pass's critical path. The buffer is touched before the pool sees it, so the reader
        never finds it referenced. Returns whether a buffer was added.
        """
        key = (index % self.slots, part)
        with self._lock:
            held = self._buffers.get(key)
            if held is not None and held[0].numel() >= _storage_bytes(nbytes, DIRECT_BLOCK, DIRECT_BLOCK):
                return False
        storage, owner = self._storage(nbytes)
        storage.fill_(0)
        # The reader may have got there first; then its buffer stays and this one is dropped.
        return self._add(key, storage, owner, only_if_absent=True)[0] is storage

    def resized(self, slots: int) -> StagingPool:
        """This pool for a new pass with ``slots`` slots: the buffers of the slots it keeps, reused."""
        if max(1, slots) == self.slots:
            self._wait = self.WAIT_S  # a new pass, perhaps a different consumer
            return self
        pool = StagingPool(slots, self.pin, self.registrar, self.device)
        with self._lock:
            for key, held in self._buffers.items():
                if key[0] < pool.slots:
                    pool._buffers[key] = held
                    if key in self._owners:
                        pool._owners[key] = self._owners.pop(key)
            dropped = list(self._owners.values())
            self._owners.clear()
        for owner in dropped:
            owner.release()
        pool.fresh = self.fresh
        pool.requested = list(self.requested)
        return pool

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool's buffers."""
        return sum(storage.numel() for storage, _ in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer: page-locked ones are unlocked now, and all go back to the system
        once no tensor views them (the pool is only cleared between passes, when none does)."""
        with self._lock:
            self._buffers.clear()
            owners = list(self._owners.values())
            self._owners.clear()
        for owner in owners:
            owner.release()
