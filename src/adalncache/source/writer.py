"""The one safetensors writer: real files whose tensors sit at chosen offsets modulo ``align``.

Why not ``safetensors.torch.save_file``: on a CPU an fp32 GEMV's bits depend on the weight's
address modulo 16, and a memory-mapped file puts a tensor at (page-aligned base + file offset).
Choosing the offsets lets a checkpoint reproduce a model's own alignment, so projecting from the
mapped file is bit-identical to the resident model. Tensors can also be generated one at a time
as they are written (:class:`LazyTensor`), so a multi-GiB benchmark checkpoint needs one tensor
of memory. The files follow the format exactly (the tensors tile the data section; gaps are
``uint8`` padding tensors named ``PAD_PREFIX.<n>``), so safetensors itself loads them.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import ConfigError
from .header import safetensors_name

#: Padding tensors carry this prefix; readers look tensors up by name, so padding is invisible to them.
PAD_PREFIX = "__adalncache_padding__"


class LazyTensor(NamedTuple):
    """A tensor of ``shape`` and ``dtype`` that ``make()`` produces only when it is written."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


def _declared(name: str, tensor: torch.Tensor | LazyTensor) -> tuple[list[int], str, int]:
    """(shape, safetensors dtype name, bytes) of ``tensor``, without producing a lazy one."""
    shape = [int(s) for s in tensor.shape]
    dtype_name = safetensors_name(tensor.dtype)
    if dtype_name is None:
        raise ConfigError(f"write_safetensors cannot store dtype {tensor.dtype} (tensor {name!r})")
    nbytes = tensor.dtype.itemsize
    for s in shape:
        nbytes *= s
    return shape, dtype_name, nbytes


def _data(name: str, tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    """The bytes of ``tensor`` as a flat uint8 CPU tensor (producing a lazy one now)."""
    if isinstance(tensor, LazyTensor):
        made = tensor.make()
        if tuple(made.shape) != tuple(tensor.shape) or made.dtype != tensor.dtype:
            raise ConfigError(
                f"write_safetensors: tensor {name!r} was declared {tensor.dtype} {list(tensor.shape)} but made "
                f"{made.dtype} {list(made.shape)}"
            )
        data = made
    else:
        data = tensor.detach()
    return data.to("cpu").contiguous().reshape(-1).view(torch.uint8)


def write_safetensors(
    tensors: Mapping[str, torch.Tensor | LazyTensor],
    path: str | os.PathLike[str],
    *,
    residues: Mapping[str, int] | None = None,
    align: int = 64,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` to ``path`` as a safetensors file, each at a chosen file offset modulo ``align``.

    ``residues`` gives the wanted ``file offset % align`` per tensor (default 0). The header is
    padded with spaces (which the format allows) so the data section starts at a multiple of
    ``align``. The file is written to a temporary name, synced and renamed into place, so a
    reader never sees half of it. Returns ``path``.
    """
    residues = dict(residues or {})
    path = Path(path)
    order: list[tuple[str, torch.Tensor | LazyTensor | int]] = []  # an int is that many padding bytes
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, tensor in tensors.items():
        shape, dtype_name, nbytes = _declared(name, tensor)
        gap = (residues.get(name, 0) - offset) % align
        if gap:
            pad_name = f"{PAD_PREFIX}.{sum(isinstance(t, int) for _, t in order)}"
            header[pad_name] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            order.append((pad_name, gap))
            offset += gap
        header[name] = {"dtype": dtype_name, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        order.append((name, tensor))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * ((-(8 + len(blob))) % align)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for name, item in order:
            if isinstance(item, int):
                handle.write(b"\0" * item)
                continue
            data = _data(name, item)
            if data.numel():
                handle.write(data.numpy().data)
            del data
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path
