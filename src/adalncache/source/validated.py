"""A checkpoint's files checked against a spec: which file holds each projection tensor, and where.

Why a module of its own: construction (and every re-validation after the files changed on disk)
must either accept the whole checkpoint or refuse it naming every missing, misshapen or misplaced
tensor, and what it accepts is then the one description every read of a pass goes by (the file
of a tensor, its offset, the bytes of some of its rows). Keeping that description in one
immutable value means a refresh swaps it whole: a pass never sees half of an old checkpoint and
half of a new one.

Whole-tensor reads of other tensors (the time embedder, say) are here too, because they answer
the same question (where is this tensor, can it be viewed in place) and keep the same address
rule as the projections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..spec import KeyLayout, ModulationSpec
from .buffers import read_buffer
from .files import CheckpointFiles, CheckpointPath
from .header import SafetensorsHeader, TensorEntry, open_regular
from .projections import detect_layout, expected, raise_problems, tensor_problem
from .reads import pread_into


def misaligned(entry: TensorEntry) -> str | None:
    """Why ``entry``'s data cannot be viewed as its dtype in place, or None.

    A tensor is read into a buffer at its file offset's address modulo 4096, so its elements sit
    on their natural boundary only if the file offset is a multiple of the element size; every
    writer of the format (safetensors' own included) lays tensors out that way.
    """
    dtype = entry.torch_dtype
    if dtype is None:
        return f"dtype {entry.dtype} has no torch counterpart"
    if entry.begin % dtype.itemsize:
        return (
            f"its data starts at file offset {entry.begin}, not a multiple of its {dtype.itemsize}-byte "
            f"elements; re-save the checkpoint with safetensors"
        )
    return None


@dataclass(frozen=True)
class ValidatedCheckpoint:
    """The files of a checkpoint and its key layout, every projection tensor checked against ``spec``."""

    files_read: CheckpointFiles
    layout: KeyLayout
    spec: ModulationSpec

    @classmethod
    def read(cls, path: CheckpointPath, spec: ModulationSpec, layout: str) -> ValidatedCheckpoint:
        """Resolve the files, parse their headers and validate; CheckpointError naming every problem."""
        checkpoint = CheckpointFiles.read(path)
        where = checkpoint.where
        searched = ", ".join(str(f) for f in checkpoint.files)
        found = detect_layout(where, spec, layout, f"checkpoint ({searched})")
        problems = []
        for _, key, shape in expected(spec, found):
            holder = where.get(key)
            entry = holder.entries[key] if holder else None
            problem = tensor_problem(
                spec,
                key,
                entry.shape if entry else None,
                (entry.torch_dtype or entry.dtype) if entry else None,
                shape,
            )
            if problem is None and entry is not None and (why := misaligned(entry)):
                problem = f"{key}: {why}"
            if problem:
                problems.append(problem)
        raise_problems(problems, f"files searched: {searched}", found)
        return cls(checkpoint, found, spec)

    @property
    def files(self) -> list[Path]:
        return self.files_read.files

    @property
    def index(self) -> Path | None:
        return self.files_read.index

    @property
    def headers(self) -> list[SafetensorsHeader]:
        return self.files_read.headers

    @property
    def fingerprint(self) -> str:
        return self.files_read.fingerprint

    def entry(self, name: str) -> tuple[SafetensorsHeader, TensorEntry]:
        """The header of the file holding tensor ``name`` and its entry there (KeyError if absent)."""
        header = self.files_read.where[name]
        return header, header.entries[name]

    def span(self, name: str, rows: tuple[int, int] | None) -> tuple[int, int, list[int]]:
        """(file offset, bytes, shape) of tensor ``name``, or of its rows ``[start, stop)``."""
        entry = self.entry(name)[1]
        shape = list(entry.shape)
        if rows is None:
            return entry.begin, entry.nbytes, shape
        start, stop = rows
        row_bytes = entry.nbytes // shape[0]
        shape[0] = stop - start
        return entry.begin + start * row_bytes, (stop - start) * row_bytes, shape

    def read_tensor(self, name: str) -> torch.Tensor:
        """One whole tensor (any dtype torch can hold), read from disk now, at its offset's address modulo 4096.

        CheckpointError, naming the files and the tensor, if it is absent or cannot be read.
        """
        try:
            header, entry = self.entry(name)
        except KeyError:
            files = ", ".join(str(f) for f in self.files)
            raise CheckpointError(f"the checkpoint has no tensor {name!r} (files searched: {files})") from None
        why = misaligned(entry)
        if why:
            raise CheckpointError(f"{header.path}: tensor {name!r} cannot be read: {why}")
        dtype = entry.torch_dtype
        assert dtype is not None  # misaligned said so
        view = read_buffer(entry.nbytes, entry.begin)
        try:
            fd = open_regular(header.path)
        except OSError as exc:
            raise CheckpointError(f"cannot open checkpoint file {header.path}: {exc}") from exc
        try:
            pread_into(fd, view, entry.begin, header.path, name)
        finally:
            os.close(fd)
        return view.view(dtype).view(entry.shape)

    def projection_tensors(self) -> list[dict[str, Any]]:
        """Every projection tensor's name, file, shape and dtype, in the spec's order (for ``describe``)."""
        tensors = []
        for _, key, _ in expected(self.spec, self.layout):
            header, entry = self.entry(key)
            tensors.append(
                {
                    "name": key,
                    "file": header.path.name,
                    "shape": list(entry.shape),
                    "dtype": entry.dtype,
                    "nbytes": entry.nbytes,
                }
            )
        return tensors


__all__ = ["ValidatedCheckpoint", "misaligned"]
