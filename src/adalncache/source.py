"""Weight sources: where the projection bytes of a rebuild pass come from.

Two kinds share one small protocol (:class:`WeightSource`) so the cache never cares where bytes
come from:

* :class:`CheckpointSource` reads safetensors files (native or diffusers layout, one file, a
  directory, a sharded checkpoint with its index, or a list of files). It parses the headers
  itself, validates every projection tensor at construction, and streams one layer at a time
  with ``pread`` on a background thread, so layer k+1 is read while layer k is projected and at
  most ``read_ahead + 1`` layers are in memory. Files are opened per pass, so a file replaced by
  ``rename`` is seen by the next pass and nothing relies on a mapping staying valid.
* :class:`TensorSource` serves tensors already in memory (a model's own weights), as they are.

Alignment matters for exactness (DESIGN.md): an fp32 GEMV on CPU gives different bits for the
same weight at different addresses modulo 16 bytes. A model loaded from a safetensors file holds
memory-mapped views whose address is congruent to the tensor's file offset modulo the page size,
so every buffer this module reads into is offset to keep that congruence modulo 64.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from .errors import CheckpointError, ConfigError
from .spec import FINAL, LAYOUTS, KeyLayout, Layer, ModulationSpec, get_layout

log = logging.getLogger(__name__)

#: safetensors dtype names -> torch dtypes (only what a header may legitimately carry).
_ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

#: Buffers keep the file offset of their data modulo this many bytes (see the module docstring).
ALIGNMENT = 64
#: pread chunk: large enough to stream at disk speed, small enough to notice a truncation early.
_CHUNK = 64 << 20
#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


class Columns(NamedTuple):
    """A slice ``[start, stop)`` of output features, as a fraction of each layer's width.

    Column-parallel ranks read ``part`` of ``parts`` equal slices of every projection.
    """

    part: int
    parts: int

    def bounds(self, width: int) -> tuple[int, int]:
        size = width // self.parts
        return self.part * size, (self.part + 1) * size


class LayerWeights(NamedTuple):
    """One projection as a pass sees it: the layer, its weight ``(out, in)`` and bias ``(out,)``."""

    layer: Layer
    weight: torch.Tensor
    bias: torch.Tensor


@runtime_checkable
class WeightSource(Protocol):
    """What the cache needs from a source of projection weights."""

    spec: ModulationSpec
    layout: KeyLayout
    bytes_read: int

    @property
    def fingerprint(self) -> str:
        """Identity of the bytes served; stores bind entries to it."""
        ...

    def refresh(self) -> bool:
        """Re-check the identity cheaply (``stat``, never re-hashing data); True when it changed.

        Raises CheckpointError when the changed source no longer validates.
        """
        ...

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str,
        columns: Columns | None = None,
        read_ahead: int = 1,
    ) -> Iterator[LayerWeights]:
        """Yield ``layers`` in order, reading ahead; the consumer must finish one before asking the next."""
        ...

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for ``inspect`` and logs."""
        ...


# ---------------------------------------------------------------------------------------------
# safetensors files


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives inside a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first data byte
    end: int  # absolute file offset one past the last data byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return _ST_DTYPES.get(self.dtype)


@dataclass(frozen=True)
class FileIdentity:
    """``stat`` identity of a file: any rewrite, rename-replace or touch changes it."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: tensor entries plus the identity the fingerprint is built from."""

    path: Path
    identity: FileIdentity
    digest: str
    entries: dict[str, TensorEntry]

    @classmethod
    def read(cls, path: Path) -> SafetensorsHeader:
        """Parse ``path``'s header, rejecting anything that is not a complete safetensors file."""
        try:
            identity = FileIdentity.of(path)
            with open(path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(
                        f"{path} is not a safetensors file ({identity.size} bytes, shorter than the 8-byte "
                        f"header length): pass a .safetensors checkpoint"
                    )
                (length,) = struct.unpack("<Q", prefix)
                if length <= 0 or length > _MAX_HEADER or 8 + length > identity.size:
                    raise CheckpointError(
                        f"{path} is not a safetensors file (header length {length} does not fit the "
                        f"{identity.size}-byte file): pass a .safetensors checkpoint, or re-save it if it "
                        f"was truncated"
                    )
                raw = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(
                f"{path} is not a safetensors file (its header is not valid JSON: {exc}): pass a "
                f".safetensors checkpoint"
            ) from None
        data_start = 8 + length
        entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = (int(v) for v in info["data_offsets"])
                entry = TensorEntry(
                    name,
                    str(info["dtype"]),
                    tuple(int(s) for s in info["shape"]),
                    data_start + begin,
                    data_start + end,
                )
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
            if entry.end > identity.size or entry.begin > entry.end:
                raise CheckpointError(
                    f"{path} is truncated: tensor {name!r} ends at byte {entry.end} but the file has "
                    f"{identity.size} bytes; re-save or re-download the checkpoint"
                )
            entries[name] = entry
        digest = hashlib.sha256(prefix + raw).hexdigest()
        return cls(path, identity, digest, entries)


def _files_of(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> tuple[list[Path], Path | None]:
    """Resolve ``path`` into checkpoint files, plus the index json that named them (if any)."""
    if isinstance(path, (list, tuple)):
        files = [Path(p) for p in path]
        if not files:
            raise CheckpointError("the list of checkpoint files is empty: pass at least one .safetensors file")
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {file} does not exist")
        return files, None
    root = Path(path)  # type: ignore[arg-type]
    if root.is_file():
        return [root], None
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint path {root} does not exist: pass a .safetensors file, a directory of them, or a list of files"
        )
    indexes = sorted(root.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(
            f"{root} holds several index files ({', '.join(p.name for p in indexes)}): pass the files of one "
            f"checkpoint as a list, or the directory of one checkpoint"
        )
    if indexes:
        index = indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a weight_map): {exc}") from None
        base = root.resolve()
        files = []
        for name in names:
            file = (root / name).resolve()
            if base not in file.parents:
                raise CheckpointError(
                    f"{index} points at {name!r}, outside the checkpoint directory {root}: an index may only "
                    f"name files inside its own directory"
                )
            if not file.is_file():
                raise CheckpointError(f"{index} names {name!r}, which does not exist in {root}")
            files.append(file)
        return files, index
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}: pass a directory that holds the checkpoint")
    return files, None


def _tensor_problem(
    spec: ModulationSpec,
    name: str,
    shape: tuple[int, ...] | None,
    dtype: torch.dtype | str | None,
    want: tuple[int, ...],
) -> str | None:
    """Why a projection tensor cannot be used, or None."""
    if shape is None:
        return f"{name}: missing"
    if tuple(shape) != want:
        return f"{name}: shape {list(shape)}, expected {list(want)}"
    if dtype != spec.dtype:
        shown = str(dtype).removeprefix("torch.")
        return f"{name}: dtype {shown}, expected {str(spec.dtype).removeprefix('torch.')} (ModulationSpec.dtype)"
    return None


def _expected(spec: ModulationSpec, layout: KeyLayout) -> list[tuple[Layer, str, tuple[int, ...]]]:
    out: list[tuple[Layer, str, tuple[int, ...]]] = []
    for layer in spec.layers():
        width = spec.out_features(layer)
        out.append((layer, layout.weight(layer), (width, spec.time_embed_dim)))
        out.append((layer, layout.bias(layer), (width,)))
    return out


def _detect_layout(names: set[str] | Mapping[str, Any], spec: ModulationSpec, layout: str, where: str) -> KeyLayout:
    if layout != "auto":
        return get_layout(layout)
    scores = {name: sum(key in names for _, key, _ in _expected(spec, lay)) for name, lay in LAYOUTS.items()}
    best = max(scores, key=lambda n: scores[n])
    if scores[best] == 0:
        raise CheckpointError(
            f"{where} holds no AdaLN projection in a known layout (looked for "
            f"{LAYOUTS['native'].weight(0)!r} and {LAYOUTS['diffusers'].weight(0)!r}): pass a MiniMax-H3 "
            f"transformer checkpoint, or set layout= (CLI --layout)"
        )
    return LAYOUTS[best]


def _raise_problems(problems: list[str], where: str, layout: KeyLayout) -> None:
    if not problems:
        return
    shown = problems[:20]
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise CheckpointError(
        f"{len(problems)} AdaLN projection tensor(s) unusable in {layout.name} layout ({where}):\n  "
        + "\n  ".join(shown)
        + more
    )


# ---------------------------------------------------------------------------------------------
# reading


#: O_DIRECT needs the buffer address, the file offset and the length aligned to the device's
#: logical block size; 4096 covers every common device. Buffers are placed so that their data
#: address is congruent to the file offset modulo this (which implies ALIGNMENT), with a block of
#: slack before and two after, so a direct read can round its range out to whole blocks.
_DIRECT_BLOCK = 4096
_SLACK = 3 * _DIRECT_BLOCK


def _place(storage: torch.Tensor, nbytes: int, file_offset: int) -> torch.Tensor:
    """The ``nbytes`` view of ``storage`` whose address is congruent to ``file_offset`` mod 4096."""
    pad = _DIRECT_BLOCK + (file_offset - storage.data_ptr()) % _DIRECT_BLOCK
    return storage[pad : pad + nbytes]


def _aligned_empty(nbytes: int, file_offset: int, *, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 buffer whose data address is congruent to ``file_offset`` modulo 4096 (so modulo ALIGNMENT).

    Returns (storage, view): keep ``storage`` alive for as long as ``view`` is used.
    """
    storage = torch.empty(nbytes + _SLACK, dtype=torch.uint8, pin_memory=pin)
    return storage, _place(storage, nbytes, file_offset)


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


def _resident_fraction(fd: int, offset: int, nbytes: int) -> float | None:
    """The fraction of ``[offset, offset + nbytes)`` of ``fd`` held in the page cache (mincore).

    Maps the range without touching it (no page is read or faulted in), asks ``mincore``, unmaps.
    None where that is not possible.
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


class _DirectReads:
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
            resident = _resident_fraction(fd, offset, nbytes)
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
        chunk that this also writes are the same file bytes (or buffer slack, see ``_place``).
        """
        fd = self._fd(path, pass_fd)
        if fd is None:
            return None
        lead = offset % _DIRECT_BLOCK
        length = -(-(lead + nbytes) // _DIRECT_BLOCK) * _DIRECT_BLOCK
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


def _pread_into(
    fd: int, view: torch.Tensor, offset: int, path: Path, what: str, direct: _DirectReads | None = None
) -> int:
    """Fill ``view`` (contiguous uint8, CPU, placed by ``_place``) from ``fd`` at ``offset``.

    Every byte is really read. With ``direct``, cached bytes come from the page cache and the
    rest with O_DIRECT (see :class:`_DirectReads`).
    """
    total = view.numel()
    base = view.data_ptr()
    done = 0
    while done < total:
        n = min(_CHUNK, total - done)
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


def _use_count(storage: torch.Tensor) -> int:
    """References to ``storage``'s memory: every live view of it holds one."""
    return int(torch._C._storage_Use_Count(storage.untyped_storage()._cdata))


class _Staging:
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

    def __init__(self, slots: int, pin: bool) -> None:
        self.slots = max(1, slots)
        self.pin = pin
        self._lock = threading.Lock()  # the reader thread and a prefaulting consumer share the pool
        self._buffers: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}
        self.fresh = 0  # buffers allocated (first use of a slot, or a slot still held by a consumer)
        # A consumer that kept one layer past its turn keeps them all (a list, a dict of layers):
        # after the first timeout the pool stops waiting and allocates straight away.
        self._wait = self.WAIT_S

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
                return None
            time.sleep(0.0002)
        return held

    def take(self, index: int, part: str, nbytes: int, file_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``(storage, view)`` like :func:`_aligned_empty`, from the pool when its slot is free."""
        key = (index % self.slots, part)
        held = self._free(key)
        if held is None or held[0].numel() < nbytes + _SLACK:
            held = self._add(key, torch.empty(nbytes + _SLACK, dtype=torch.uint8, pin_memory=self.pin))
        storage = held[0]
        return storage, _place(storage, nbytes, file_offset)

    def _add(
        self, key: tuple[int, str], storage: torch.Tensor, *, only_if_absent: bool = False
    ) -> tuple[torch.Tensor, int]:
        """Register ``storage`` as the buffer of ``key`` (unless ``only_if_absent`` and one is there)."""
        with self._lock:
            if only_if_absent and key in self._buffers:
                return self._buffers[key]
            held = (storage, _use_count(storage))
            self._buffers[key] = held
            self.fresh += 1
            return held

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
            if held is not None and held[0].numel() >= nbytes + _SLACK:
                return False
        storage = torch.empty(nbytes + _SLACK, dtype=torch.uint8, pin_memory=self.pin)
        storage.fill_(0)
        # The reader may have got there first; then its buffer stays and this one is dropped.
        return self._add(key, storage, only_if_absent=True)[0] is storage

    def resized(self, slots: int) -> _Staging:
        """This pool for a new pass with ``slots`` slots: the buffers of the slots it keeps, reused."""
        if max(1, slots) == self.slots:
            self._wait = self.WAIT_S  # a new pass, perhaps a different consumer
            return self
        pool = _Staging(slots, self.pin)
        pool._buffers = {key: held for key, held in self._buffers.items() if key[0] < pool.slots}
        pool.fresh = self.fresh
        return pool

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool's buffers."""
        return sum(storage.numel() for storage, _ in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


class CheckpointSource:
    """Projection weights streamed from safetensors files (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        spec: ModulationSpec,
        *,
        layout: str = "auto",
        keep_buffers: bool = True,
        direct_io: bool = True,
    ) -> None:
        if not isinstance(spec, ModulationSpec):
            raise ConfigError(f"CheckpointSource needs a ModulationSpec as spec, got {type(spec).__name__}")
        self.spec = spec
        self.path = path
        self._layout_arg = layout
        if layout != "auto":
            get_layout(layout)
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
        #: Read the bytes the page cache does not hold with O_DIRECT (see :class:`_DirectReads`):
        #: no CPU copy, no page cache filled or evicted. Cached bytes are read from the cache.
        self.direct_io = bool(direct_io)
        #: Of ``bytes_read``, those read with O_DIRECT.
        self.bytes_direct = 0
        self._kept: _Staging | None = None
        self._load()

    # -- identity ---------------------------------------------------------------------------

    def _load(self) -> None:
        """(Re)resolve files, parse headers and validate; only commits state when all is well."""
        files, index = _files_of(self.path)
        headers = [SafetensorsHeader.read(f) for f in files]
        where: dict[str, SafetensorsHeader] = {}
        for header in headers:
            for name in header.entries:
                where.setdefault(name, header)
        searched = ", ".join(str(f) for f in files)
        layout = _detect_layout(where, self.spec, self._layout_arg, f"checkpoint ({searched})")
        problems = []
        for _, key, shape in _expected(self.spec, layout):
            holder = where.get(key)
            entry = holder.entries[key] if holder else None
            problem = _tensor_problem(
                self.spec,
                key,
                entry.shape if entry else None,
                (entry.torch_dtype or entry.dtype) if entry else None,
                shape,
            )
            if problem:
                problems.append(problem)
        _raise_problems(problems, f"files searched: {searched}", layout)
        self.files = files
        self.index = index
        self.layout = layout
        self._headers = headers
        self._where = where
        self._index_identity = FileIdentity.of(index) if index else None
        digest = hashlib.sha256()
        for header in headers:
            ident = header.identity
            digest.update(
                f"{header.path.resolve()}|{ident.device}|{ident.inode}|{ident.size}|{ident.mtime_ns}|"
                f"{header.digest}\n".encode()
            )
        self._fingerprint = digest.hexdigest()

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def _identities_changed(self) -> bool:
        try:
            if any(FileIdentity.of(h.path) != h.identity for h in self._headers):
                return True
            if self.index is not None and FileIdentity.of(self.index) != self._index_identity:
                return True
        except OSError:
            return True
        return False

    def refresh(self) -> bool:
        """``stat`` every file; on any change re-parse headers and re-validate (CheckpointError if bad)."""
        if not self._identities_changed():
            return False
        old = self._fingerprint
        self._load()
        log.info(
            "checkpoint %s changed on disk (fingerprint %s -> %s)",
            self.path,
            old[:12],
            self._fingerprint[:12],
        )
        return self._fingerprint != old

    # -- streaming --------------------------------------------------------------------------

    def entry(self, name: str) -> tuple[SafetensorsHeader, TensorEntry]:
        header = self._where[name]
        return header, header.entries[name]

    def _read_tensor(
        self,
        fds: dict[Path, int],
        name: str,
        rows: tuple[int, int] | None,
        pin: bool,
        staging: tuple[_Staging, int, str] | None = None,
        direct: _DirectReads | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        header, entry = self.entry(name)
        dtype = entry.torch_dtype
        assert dtype is not None  # validated
        offset, nbytes, shape = self._span(name, rows)
        if staging is None:
            storage, view = _aligned_empty(nbytes, offset, pin=pin)
        else:
            pool, index, part = staging
            storage, view = pool.take(index, part, nbytes, offset)
        self._count(_pread_into(fds[header.path], view, offset, header.path, name, direct))
        return storage, view.view(dtype).view(shape)

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

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def read_layer(
        self,
        fds: dict[Path, int],
        layer: Layer,
        *,
        columns: Columns | None = None,
        pin: bool = False,
        staging: tuple[_Staging, int] | None = None,
        direct: _DirectReads | None = None,
    ) -> tuple[LayerWeights, list[torch.Tensor]]:
        """Read one layer's weight and bias (really reading every byte); returns keep-alive storages.

        ``staging`` (pool, position in the pass) reads into a reused buffer instead of a fresh one.
        """
        rows = columns.bounds(self.spec.out_features(layer)) if columns else None
        w_stage = (staging[0], staging[1], "weight") if staging else None
        b_stage = (staging[0], staging[1], "bias") if staging else None
        w_store, weight = self._read_tensor(fds, self.layout.weight(layer), rows, pin, w_stage, direct)
        b_store, bias = self._read_tensor(fds, self.layout.bias(layer), rows, pin, b_stage, direct)
        return LayerWeights(layer, weight, bias), [w_store, b_store]

    @contextlib.contextmanager
    def open_files(self) -> Iterator[dict[Path, int]]:
        """Open every file for one pass (files are never kept open between passes)."""
        fds: dict[Path, int] = {}
        try:
            for header in self._headers:
                try:
                    fds[header.path] = os.open(header.path, os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(f"cannot open checkpoint file {header.path}: {exc}") from exc
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
    ) -> Iterator[LayerWeights]:
        """Yield each layer, reading up to ``read_ahead`` layers ahead on a background thread.

        At most ``read_ahead + 1`` layers are held in host memory at once: the one the consumer
        projects and those being read. On CUDA the host buffers are pinned and copied to the device
        on a side stream, so the copy of layer k+1 overlaps the projection of layer k.
        """
        device = torch.device(device)
        if read_ahead < 0:
            raise ConfigError(f"read_ahead must be >= 0, got {read_ahead}")
        cuda = device.type == "cuda"
        copy_stream = torch.cuda.Stream(device) if cuda else None
        todo = list(layers)
        # On CUDA each pinned buffer is free again once its copy finished (load waits for it), and
        # loads run one at a time, so one buffer serves the whole pass; pinning is slow and rounds
        # up, so it happens once per pass, not per layer. On CPU the consumer projects from the
        # buffer itself: the one it holds plus the read_ahead being read. With read_ahead=0 the read
        # runs inside next(), while the consumer still holds the previous layer, so a single
        # buffer could never be reused: that mode keeps a fresh buffer per layer.
        staging: _Staging | None = None
        if cuda or read_ahead:
            slots = 1 if cuda else read_ahead + 1
            # A kept pool is taken out while in use, so two concurrent passes never share buffers.
            with self._lock:
                kept, self._kept = self._kept, None
            # Another read_ahead keeps the buffers it can use; a pool of the other kind is dropped.
            reuse = kept is not None and kept.pin == cuda
            staging = kept.resized(slots) if reuse and kept is not None else _Staging(slots, pin=cuda)

        def load(fds: dict[Path, int], index: int) -> LayerWeights:
            layer = todo[index]
            stage = (staging, index) if staging is not None else None
            lw, keep = self.read_layer(fds, layer, columns=columns, pin=cuda, staging=stage, direct=direct)
            if copy_stream is None:
                return lw  # the views keep their buffers alive; nothing else holds them
            # Runs on the reader thread: the pinned buffer is copied on a side stream, and the
            # thread waits for the copy so the buffer can be freed (pinned memory is not reused
            # while a DMA may still read it).
            with torch.cuda.stream(copy_stream):
                weight = lw.weight.to(device, non_blocking=True)
                bias = lw.bias.to(device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(copy_stream)
            done.synchronize()
            del keep, lw  # the staging buffer is free for the next layer
            return LayerWeights(layer, weight, bias)

        direct = _DirectReads() if self.direct_io else None
        with (
            self.open_files() as fds,
            contextlib.closing(direct) if direct is not None else contextlib.nullcontext(),
            ThreadPoolExecutor(1, thread_name_prefix="adalncache-read") as pool,
        ):
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
                    # While layer 0 is read, first-touch the buffer layer 1 will be read into.
                    rows = columns.bounds(self.spec.out_features(todo[1])) if columns else None
                    staging.prefault(1, "weight", self._span(self.layout.weight(todo[1]), rows)[1])
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
                if direct is not None:
                    with self._lock:
                        self.bytes_direct += direct.bytes
                if staging is not None:
                    if self.keep_buffers:
                        with self._lock:
                            self._kept = staging
                    else:
                        staging.clear()

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
        for _, key, _ in _expected(self.spec, self.layout):
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


class TensorSource:
    """Projection weights already in memory, used exactly as they are (never copied).

    ``tensors`` maps native or diffusers names to tensors. The fingerprint covers each tensor's
    address, shape, dtype, device and in-place version counter, so replacing or editing a weight
    in place (a fused LoRA, say) is noticed by the next build.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], spec: ModulationSpec, *, layout: str = "auto") -> None:
        if not isinstance(spec, ModulationSpec):
            raise ConfigError(f"TensorSource needs a ModulationSpec as spec, got {type(spec).__name__}")
        if not isinstance(tensors, Mapping):
            raise ConfigError(f"TensorSource needs a mapping of tensor names to tensors, got {type(tensors).__name__}")
        self.spec = spec
        self.layout = _detect_layout(tensors, spec, layout, "the tensors given to TensorSource")
        problems = []
        for _, key, shape in _expected(spec, self.layout):
            t = tensors.get(key)
            if t is not None and not isinstance(t, torch.Tensor):
                problems.append(f"{key}: not a tensor ({type(t).__name__})")
                continue
            if t is not None and t.device.type == "meta":
                problems.append(f"{key}: a meta tensor holds no data")
                continue
            problem = _tensor_problem(
                spec,
                key,
                tuple(t.shape) if t is not None else None,
                t.dtype if t is not None else None,
                shape,
            )
            if problem:
                problems.append(problem)
        _raise_problems(problems, "tensors given to TensorSource", self.layout)
        self.tensors = {key: tensors[key] for _, key, _ in _expected(spec, self.layout)}
        self.bytes_read = 0
        #: The fingerprint names addresses in this process, so store entries could never hit again.
        self.persistent = False
        self._fingerprint = self._compute_fingerprint()

    def _compute_fingerprint(self) -> str:
        digest = hashlib.sha256()
        for key, t in self.tensors.items():
            digest.update(f"{key}|{t.data_ptr()}|{tuple(t.shape)}|{t.dtype}|{t.device}|{t._version}\n".encode())
        return digest.hexdigest()

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def refresh(self) -> bool:
        new = self._compute_fingerprint()
        changed = new != self._fingerprint
        self._fingerprint = new
        return changed

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
    ) -> Iterator[LayerWeights]:
        device = torch.device(device)
        for layer in layers:
            weight = self.tensors[self.layout.weight(layer)]
            bias = self.tensors[self.layout.bias(layer)]
            if columns is not None:
                start, stop = columns.bounds(self.spec.out_features(layer))
                weight, bias = weight[start:stop], bias[start:stop]
            self.bytes_read += weight.numel() * weight.element_size() + bias.numel() * bias.element_size()
            if weight.device != device:
                weight, bias = weight.to(device), bias.to(device)
            yield LayerWeights(layer, weight, bias)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "tensors",
            "layout": self.layout.name,
            "projection_tensors": len(self.tensors),
            "projection_bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
            "fingerprint": self.fingerprint,
            "spec": self.spec.describe(),
        }

    def __repr__(self) -> str:
        return f"TensorSource({len(self.tensors)} tensors, layout={self.layout.name!r})"


__all__ = [
    "FINAL",
    "CheckpointSource",
    "Columns",
    "LayerWeights",
    "TensorSource",
    "WeightSource",
]
