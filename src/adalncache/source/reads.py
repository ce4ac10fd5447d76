"""Reading file ranges into host buffers: the one ``pread`` loop, and O_DIRECT for what is not cached.

Every read of tensor bytes in the package goes through :func:`pread_into`. With a
:class:`DirectReads` it reads the bytes the page cache does not hold with O_DIRECT, and those it
holds with a plain ``pread``; without one, every byte comes through the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .buffers import DIRECT_BLOCK

log = logging.getLogger(__name__)

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
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(fd: int, offset: int, nbytes: int) -> float | None:
    """The fraction of ``[offset, offset + nbytes)`` of ``fd`` held in the page cache (mincore).

    Maps the range without touching it (no page is read or faulted in), asks ``mincore``, unmaps.
    None where that is not possible. Also what tests and the GPU check use to tell a cold file
    from a warm one.
    """
    if _LIBC is None or nbytes <= 0:
        return None
    lead = offset % _PAGE
    length = lead + nbytes
    address = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset - lead)
    if address is None or address == _MAP_FAILED:
        return None
    try:
        pages = -(-length // _PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if _LIBC.mincore(address, length, vec) != 0:
            return None
        return 1.0 - bytes(vec).count(0) / pages
    finally:
        _LIBC.munmap(address, length)


class DirectReads:
    """O_DIRECT reads for the bytes the page cache does not hold, for one pass.

    Why: a buffered read of cold data costs the CPU a copy out of the page cache plus the cache's
    own bookkeeping (measured on the 2-core dev box: 0.3-1.9 s of CPU for 2 GiB, against 0.09 s
    with O_DIRECT at the same wall time), and that CPU is what the GEMMs of a compute-bound pass
    need. Bytes already cached are still read from the cache: for every 64 MiB chunk ``mincore``
    says how much of it is cached (a mostly cached chunk is read with a plain ``pread``); where
    mincore cannot see the cache, a ``preadv2(RWF_NOWAIT)`` returns what is cached and only the
    rest goes direct.
    Direct reads do not fill the page cache, so a cold checkpoint stays cold between passes (and
    does not evict anything else); ``CheckpointSource(direct_io=False)`` restores plain reads.
    Anything unsupported (a filesystem without O_DIRECT such as tmpfs, a kernel without
    RWF_NOWAIT, a device with larger blocks) falls back to plain reads, per file.
    """

    def __init__(self) -> None:
        self._fds: dict[Path, int | None] = {}
        self._trusted: dict[Path, bool] = {}
        self.nowait = hasattr(os, "RWF_NOWAIT") and hasattr(os, "O_DIRECT")
        self.bytes = 0

    def _fd(self, path: Path, pass_fd: int) -> int | None:
        """An O_DIRECT descriptor of the very file ``pass_fd`` holds open (never a replacement).

        Why: the pass opened its files at its start; a checkpoint replaced by ``rename`` since then
        must not be read at the old offsets. ``/proc/self/fd/N`` reopens the open file itself,
        and the (device, inode) check refuses anything else.
        """
        if path not in self._fds:
            fd: int | None = None
            try:
                fd = os.open(f"/proc/self/fd/{pass_fd}", os.O_RDONLY | os.O_DIRECT)
                held, opened = os.fstat(pass_fd), os.fstat(fd)
                if (held.st_dev, held.st_ino) != (opened.st_dev, opened.st_ino):
                    os.close(fd)
                    fd = None
                    log.debug("O_DIRECT reopen of %s reached another file; plain reads for it", path)
            except OSError as exc:
                if fd is not None:
                    os.close(fd)
                    fd = None
                log.debug("O_DIRECT unavailable for %s (%s); reading it through the page cache", path, exc)
            self._fds[path] = fd
        return self._fds[path]

    def chunk(self, fd: int, path: Path, address: int, nbytes: int, offset: int) -> int | None:
        """Read up to ``nbytes`` at ``offset``, directly if the page cache holds less than half of them.

        None: the caller reads this chunk with a plain ``pread`` (mostly cached, or no O_DIRECT
        for this file, or no way to tell cached bytes from cold ones, or the end of the file).
        """
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
        """Up to ``nbytes`` read directly into ``address``; None where O_DIRECT cannot be used.

        The range is rounded out to whole blocks: the bytes before ``address`` and after the
        chunk that this also writes are the same file bytes (or the slack of a buffer from
        :func:`~adalncache.source.buffers.read_buffer`).
        """
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
    """Fill ``view`` (contiguous uint8 on the CPU) from ``fd`` at ``offset``; returns the bytes read.

    Every byte is really read; a file that ends early raises CheckpointError naming ``path`` and
    ``what``. With ``direct`` (and ``view`` from :func:`~adalncache.source.buffers.read_buffer`),
    cached bytes come from the page cache and the rest with O_DIRECT (see :class:`DirectReads`).
    """
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
