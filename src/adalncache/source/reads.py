"""Bytes from a file into host memory: aligned buffers, the one ``pread`` loop, O_DIRECT, and mapped views.

A read buffer keeps its tensor's file offset modulo 4096 (:data:`DIRECT_BLOCK`, what O_DIRECT needs; so
modulo 64, where a model mapping the file holds the tensor, which decides a CPU GEMV's bits:
docs/exactness.md), with a block of slack each side for a direct read to round out into; page-locked
ones are :class:`~adalncache.devices.HostBuffer`. Every read of tensor bytes goes through
:func:`pread_into`. :class:`MappedFile` reads only the pages a caller touches (why not safetensors'
``get_tensor``: docs/diffusers.md); :class:`PassMappings` maps the files a pass projecting in place holds open.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..devices import HostBuffer, Registrar
from ..errors import CheckpointError
from .files import SafetensorsHeader

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
    """The ``nbytes`` view of uint8 ``storage`` (of :func:`_storage_bytes`) at an address congruent to
    ``residue`` mod ``modulus``, with at least ``margin`` bytes of ``storage`` before and after it."""
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
    """An uninitialised tensor whose data address is congruent to ``residue`` modulo ``modulus``, ``margin``
    bytes of its allocation free on each side (``pin``: page-locked). Off the CPU a plain allocation: that
    device's allocator decides addresses, and the address effect on the bits is a CPU one."""
    shape = tuple(int(s) for s in shape)
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    itemsize = dtype.itemsize
    if residue % itemsize or modulus % itemsize:
        raise ValueError(
            f"a {dtype} tensor cannot start at an address {residue} modulo {modulus}: not a multiple of its "
            f"{itemsize}-byte elements"
        )
    nbytes = itemsize * math.prod(shape)
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
    """Read buffers reused round-robin across the layers of one pass (``slots`` per part), since a fresh
    496 MiB buffer costs 0.3-0.6 s of first-touch page faults against 55 ms for a cached ``pread`` (2-core
    dev box). A buffer is refilled only once nothing but the pool references it (storage use count),
    after a short wait for the consumer to rebind its loop variables; a consumer that keeps a layer
    longer gets a fresh buffer instead, so none is overwritten under a live tensor.
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
                with self._lock:
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
        self, key: tuple[int, str], storage: torch.Tensor, owner: HostBuffer | None, *, only_if_absent: bool = False
    ) -> tuple[torch.Tensor, int]:
        """Register ``storage`` as the buffer of ``key`` (unless ``only_if_absent`` and one is there)."""
        with self._lock:
            if only_if_absent and key in self._buffers:
                if owner is not None:
                    owner.release()
                return self._buffers[key]
            self._release_owner(key)
            held = (storage, _use_count(storage))
            self._buffers[key] = held
            if owner is not None:
                self._owners[key] = owner
            self.fresh += 1
            return held

    def _release_owner(self, key: tuple[int, str]) -> None:
        """Unlock the pages of ``key``'s old buffer (under the lock); its memory goes with its last view."""
        owner = self._owners.pop(key, None)
        if owner is not None:
            owner.release()

    def prefault(self, index: int, part: str, nbytes: int) -> bool:
        """Allocate and first-touch the buffer of ``index``'s slot now, if it has none yet (returns whether
        one was added): the consumer idles while the first layer is read, so this takes the faults (0.2 s
        per 496 MiB layer) off the critical path. Touched before the pool sees it, so never found referenced.
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
        self.clear()  # unlocks the pages of the slots dropped
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


#: pread chunk: large enough to stream at disk speed, small enough to notice a truncation early.
CHUNK = 64 << 20


def _memory(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _load_libc() -> Any:
    """glibc's mmap, mincore and munmap through ctypes, or None where they are not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
#: The page size of mappings (prefetch ranges start on a page boundary; mincore counts pages).
PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(fd: int, offset: int, nbytes: int) -> float | None:
    """The fraction of ``[offset, offset + nbytes)`` of ``fd`` the page cache holds (``mincore`` on an
    untouched mapping: nothing is read), or None where that cannot be told."""
    if _LIBC is None or nbytes <= 0:
        return None
    lead = offset % PAGE
    length = lead + nbytes
    address = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset - lead)
    if address is None or address == _MAP_FAILED:
        return None
    try:
        pages = -(-length // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if _LIBC.mincore(address, length, vec) != 0:
            return None
        return 1.0 - bytes(vec).count(0) / pages
    finally:
        _LIBC.munmap(address, length)


class DirectReads:
    """O_DIRECT reads for the bytes the page cache does not hold, for one pass.

    Why: a buffered read of cold data costs the CPU the GEMMs need (2-core dev box: 0.3-1.9 s of CPU for
    2 GiB, against 0.09 s with O_DIRECT at the same wall time), and does not evict anything else. A
    64 MiB chunk ``mincore`` finds mostly cached is read with a plain ``pread``; where mincore cannot
    see the cache, ``preadv2(RWF_NOWAIT)`` returns what is cached and only the rest goes direct.
    Anything unsupported (tmpfs, no RWF_NOWAIT, larger blocks) falls back to plain reads, per file.
    """

    def __init__(self) -> None:
        self._fds: dict[Path, int | None] = {}
        self._trusted: dict[Path, bool] = {}
        self.nowait = hasattr(os, "RWF_NOWAIT") and hasattr(os, "O_DIRECT")
        self.bytes = 0

    def _fd(self, path: Path, pass_fd: int) -> int | None:
        """An O_DIRECT descriptor of the very file ``pass_fd`` holds open, never a replacement by ``rename``
        (``/proc/self/fd/N`` reopens the open file; the (device, inode) check refuses anything else)."""
        if path not in self._fds:
            fd: int | None = None
            try:
                fd = os.open(f"/proc/self/fd/{pass_fd}", os.O_RDONLY | os.O_DIRECT)
                held, opened = os.fstat(pass_fd), os.fstat(fd)
                if (held.st_dev, held.st_ino) != (opened.st_dev, opened.st_ino):
                    raise OSError("its reopen reached another file")
            except OSError as exc:
                if fd is not None:
                    os.close(fd)
                    fd = None
                log.debug("O_DIRECT unavailable for %s (%s); reading it through the page cache", path, exc)
            self._fds[path] = fd
        return self._fds[path]

    def chunk(self, fd: int, path: Path, address: int, nbytes: int, offset: int) -> int | None:
        """Read up to ``nbytes`` at ``offset``, directly if the page cache holds less than half of them;
        None where the caller reads the chunk with a plain ``pread``."""
        if not self.nowait:
            return None
        if self._mincore_trusted(path, fd):
            resident = resident_fraction(fd, offset, nbytes)
            if resident is not None:
                return None if resident >= 0.5 else self.read(fd, path, address, nbytes, offset)
        # mincore cannot see the cache of a file we neither own nor may write (Linux >= 5.2 hides
        # it): ask the cache itself. A miss starts the kernel's readahead of a window of this
        # chunk, so some bytes are read twice; that costs throughput, never correctness.
        try:
            got = os.preadv(fd, [_memory(address, nbytes)], offset, os.RWF_NOWAIT)
        except BlockingIOError:
            return self.read(fd, path, address, nbytes, offset)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise  # a real I/O error: the pass fails with it
            log.debug("RWF_NOWAIT unsupported (%s); plain reads from here on", exc)
            self.nowait = False
            return None
        return got if got > 0 else None  # 0: let the plain read decide (end of file or not)

    def _mincore_trusted(self, path: Path, fd: int) -> bool:
        trusted = self._trusted.get(path)
        if trusted is None:
            try:
                euid = os.geteuid()
                trusted = euid == 0 or os.fstat(fd).st_uid == euid
            except OSError:
                trusted = False
            self._trusted[path] = trusted
        return trusted

    def read(self, pass_fd: int, path: Path, address: int, nbytes: int, offset: int) -> int | None:
        """Up to ``nbytes`` read directly into ``address`` (None where O_DIRECT cannot be used), the range
        rounded out to whole blocks: what this writes around it is the same file bytes or a buffer's slack."""
        fd = self._fd(path, pass_fd)
        if fd is None:
            return None
        lead = offset % DIRECT_BLOCK
        length = -(-(lead + nbytes) // DIRECT_BLOCK) * DIRECT_BLOCK
        try:
            got = os.preadv(fd, [_memory(address - lead, length)], offset - lead)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise  # a real I/O error: the pass fails with it
            # EINVAL: blocks larger than 4096, or a filesystem that refuses direct reads
            log.debug("O_DIRECT read of %s failed (%s); reading it through the page cache", path, exc)
            os.close(fd)
            self._fds[path] = None
            return None
        useful = max(0, min(got - lead, nbytes))
        self.bytes += useful
        return useful

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()


def pread_into(
    fd: int, view: torch.Tensor, offset: int, path: Path, what: str, direct: DirectReads | None = None
) -> int:
    """Fill ``view`` (contiguous uint8 on the CPU) from ``fd`` at ``offset``, every byte really read;
    returns the bytes read. A file that ends early raises CheckpointError naming ``path`` and ``what``.
    With ``direct`` (and ``view`` from :func:`read_buffer`), cold bytes are read with O_DIRECT."""
    total = view.numel()
    base = view.data_ptr()
    done = 0
    while done < total:
        n = min(CHUNK, total - done)
        got = None
        if direct is not None:
            got = direct.chunk(fd, path, base + done, n, offset + done)
        if got is None:
            got = os.preadv(fd, [_memory(base + done, n)], offset + done)  # releases the GIL
        if got <= 0:
            raise CheckpointError(
                f"{path} ended at byte {offset + done} while reading {what}: the file was truncated or "
                f"rewritten during the pass; restore it and retry"
            )
        done += got
    return total


class MappedFile:
    """One safetensors file mapped copy-on-write (as torch maps it: each tensor at its file offset's address
    modulo the page size), read-around off unless asked; ``fd``: the file a caller holds open, instead of
    ``header.path``. Its tensors are views that keep the mapping alive; a write to one never reaches the file.
    """

    def __init__(self, header: SafetensorsHeader, *, fd: int | None = None, read_around: bool = False) -> None:
        self.header = header
        self.path: Path = header.path
        try:
            if fd is None:
                with open(self.path, "rb") as f:
                    self._map = self._open(f.fileno())
            else:
                self._map = self._open(fd)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot map checkpoint file {self.path}: {exc}") from exc
        #: Bytes mapped: the file's size when it was mapped.
        self.size = len(self._map) if self._map is not None else 0
        if not read_around and self._map is not None and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            self._map.madvise(mmap.MADV_RANDOM)

    @staticmethod
    def _open(fd: int) -> mmap.mmap | None:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size else None

    def span(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of the mapped bytes ``[offset, offset + nbytes)`` (the caller checked the range)."""
        if self._map is None or nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "a shared buffer": a copy-on-write mapping is that
            return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def tensor(self, name: str, *, prefetch: bool) -> torch.Tensor:
        """A view of tensor ``name`` in the mapping; ``prefetch`` asks the kernel to read its pages now, else
        only the pages touched are read, when they are."""
        entry = self.header.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        dtype = entry.view_dtype(self.path, "mapped")
        if entry.nbytes == 0 or self._map is None:
            return torch.empty(entry.shape, dtype=dtype)
        if prefetch and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            start = entry.begin - entry.begin % PAGE
            self._map.madvise(mmap.MADV_WILLNEED, start, entry.end - start)
        return self.span(entry.begin, entry.nbytes).view(dtype).view(entry.shape)


class PassMappings:
    """The mappings a pass projects from in place: the files it holds open (a replacement by ``rename``
    mid-pass is never read at the old offsets), each mapped on first use, dropped with the pass."""

    def __init__(self, fds: dict[Path, int]) -> None:
        self._fds = fds
        self._maps: dict[Path, MappedFile] = {}

    def resident(self, path: Path, offset: int, nbytes: int) -> bool:
        """Whether the page cache holds every page of ``[offset, offset + nbytes)`` of ``path``; False where
        that cannot be told (no ``mincore``; a file whose cache Linux hides from this process): staged."""
        return nbytes > 0 and resident_fraction(self._fds[path], offset, nbytes) == 1.0

    def view(self, header: SafetensorsHeader, offset: int, nbytes: int, what: str) -> torch.Tensor | None:
        """A uint8 view of those bytes in the mapping, or None where they are to be staged (not all cached).
        The file must still reach their end (CheckpointError otherwise): a page past it raises SIGBUS."""
        path = header.path
        if not self.resident(path, offset, nbytes):
            return None
        try:
            size = os.fstat(self._fds[path]).st_size
        except OSError as exc:
            raise CheckpointError(f"cannot stat checkpoint file {path}: {exc}") from exc
        if size < offset + nbytes:
            raise CheckpointError(
                f"{path} ends at byte {size}, before the end of {what} (byte {offset + nbytes}): the file was "
                f"truncated or rewritten during the pass; restore it and retry"
            )
        mapped = self._maps.get(path)
        if mapped is None:
            mapped = self._maps[path] = MappedFile(header, fd=self._fds[path], read_around=True)
        if mapped.size < offset + nbytes:
            return None  # shorter when it was mapped: the staged read says why
        return mapped.span(offset, nbytes)

    def close(self) -> None:
        self._maps.clear()
