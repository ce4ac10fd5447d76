"""Zero-copy tensors of one safetensors file that read from disk only the bytes a caller touches.

Why not ``safetensors.safe_open(...).get_tensor``: it maps the file with sequential read-ahead
and touches each tensor's first page, and one page fault then reads megabytes around it (the
block device's read-ahead window, doubled for sequential access). Loading every tensor of a
checkpoint except the AdaLN projections that way still reads nearly all of the projections'
pages. :class:`MappedFile` maps the file the way torch does (``MAP_PRIVATE``, so every tensor
sits at its file offset's address modulo the page size, the alignment a stock load gives), turns
read-around off for the whole mapping (``MADV_RANDOM``: a fault reads its own page only), and,
for tensors that will be used at once, asks the kernel to prefetch exactly their pages
(``MADV_WILLNEED``). A tensor that is never touched is never read.

A rebuild pass that projects in place (:class:`~adalncache.source.CheckpointSource`, ``in_place``)
maps the very file its pass holds open (``fd=``), with the kernel's default read-around: it only
uses the mapping for bytes the page cache already holds, where a fault maps cached pages around it
in one go.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import torch

from ..errors import CheckpointError
from .header import SafetensorsHeader, TensorEntry
from .reads import resident_fraction

#: The page size of mappings: prefetch ranges start on a page boundary.
PAGE = mmap.PAGESIZE


class MappedFile:
    """One safetensors file mapped copy-on-write, with read-around off (see the module docstring).

    ``header`` is the file's validated header (its entries give each tensor's span). Tensors
    returned by :meth:`tensor` are views of the mapping; they keep it alive, so the mapping lives
    as long as any of them does, and writing to one never reaches the file.
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
            warnings.simplefilter("ignore", UserWarning)  # a shared buffer: a copy-on-write mapping is that
            return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def entry(self, name: str) -> TensorEntry:
        """The header entry of tensor ``name`` (CheckpointError naming the file if absent)."""
        try:
            return self.header.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name!r}") from None

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of ``name``'s shape and dtype: what a tensor that is never read stands in as."""
        entry = self.entry(name)
        return torch.empty(entry.shape, dtype=_dtype(entry, self.path), device="meta")

    def tensor(self, name: str, *, prefetch: bool) -> torch.Tensor:
        """A view of tensor ``name`` in the mapping; ``prefetch`` asks the kernel to read its pages now.

        Without ``prefetch`` nothing is read until the tensor's bytes are touched, and then only
        the touched pages.
        """
        entry = self.entry(name)
        dtype = _dtype(entry, self.path)
        if entry.nbytes == 0 or self._map is None:
            return torch.empty(entry.shape, dtype=dtype)
        if entry.begin % dtype.itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} starts at file offset {entry.begin}, not a multiple of its "
                f"{dtype.itemsize}-byte elements; re-save the checkpoint with safetensors"
            )
        if prefetch and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            start = entry.begin - entry.begin % PAGE
            self._map.madvise(mmap.MADV_WILLNEED, start, entry.end - start)
        with warnings.catch_warnings():
            # torch warns that the buffer is shared; a copy-on-write mapping is exactly that.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=entry.nbytes, offset=entry.begin)
        return raw.view(dtype).view(entry.shape)


class PassMappings:
    """The mappings a pass projects from in place: the files it holds open, each mapped on first use.

    Why the pass's own descriptors: a checkpoint replaced by ``rename`` mid-pass must not be read
    at the old offsets, so only the file the pass opened is mapped (as its ``pread`` reads do).
    Dropped with the pass (:meth:`close`); tensors a consumer still holds keep their mapping alive.
    """

    def __init__(self, fds: dict[Path, int]) -> None:
        self._fds = fds
        self._maps: dict[Path, MappedFile] = {}

    def resident(self, path: Path, offset: int, nbytes: int) -> bool:
        """Whether the page cache holds every page of ``[offset, offset + nbytes)`` of ``path`` (``mincore``).

        False where that cannot be told (no ``mincore``; a file this process neither owns nor may
        write, whose cache Linux hides): such bytes are staged instead.
        """
        return nbytes > 0 and resident_fraction(self._fds[path], offset, nbytes) == 1.0

    def view(self, header: SafetensorsHeader, offset: int, nbytes: int, what: str) -> torch.Tensor | None:
        """A uint8 view of those bytes in the mapping, or None where they are to be staged.

        Only for bytes the page cache holds. The file must still reach their end now
        (CheckpointError naming it otherwise, as a short ``pread`` gives): a page past the end
        of a file raises SIGBUS when touched.
        """
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


def _dtype(entry: TensorEntry, path: Path) -> torch.dtype:
    dtype = entry.torch_dtype
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {entry.name!r} has dtype {entry.dtype}, which torch cannot hold")
    return dtype


__all__ = ["PAGE", "MappedFile", "PassMappings"]
