"""The store's entry file: one plan's rows under one binding, with a header and a whole-file digest.

``MAGIC | u32 header length | JSON header | part bytes ... | sha256``: the trailing digest covers
everything before it; the header (canonical JSON, padded so the payload starts 64-byte aligned)
names the binding, the plan, the dtype and each part's shape. Why its own module: the format is
what every process sharing a store must agree on, and :class:`~adalncache.tiers.store.Store`
(directories, atomic writes, locks, pruning) only moves these files around.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch

from ..canonical import canonical_json
from ..errors import ConfigError
from ..geometry import TABLE_PART
from ..plans import PlanKey, key_to_plan
from ..slab import PlanRows
from ..source.header import NotARegularFile, dtype_named, open_regular
from ..spec import SUPPORTED_WEIGHT_DTYPES, ModulationSpec

MAGIC = b"ADLNSTO1"
FORMAT_VERSION = 1
DIGEST_BYTES = 32


def part_names(count: int) -> list[str]:
    """The names an entry's header gives its parts (informative: the payload's order is the spec's).

    A two-part table's are ``block`` and ``final`` (the only parts of entries written before the
    header listed them), a one-part table's ``table``.
    """
    return ["block", "final"] if count == 2 else [TABLE_PART] if count == 1 else [f"part{i}" for i in range(count)]


class CorruptEntry(Exception):
    """Internal: an entry failed verification (the message says how); ``inode`` names the file read."""

    def __init__(self, message: str, inode: int | None = None) -> None:
        super().__init__(message)
        self.inode = inode


def encode_entry(bhash: str, key: PlanKey, rows: PlanRows) -> list[bytes | memoryview]:
    """The bytes of one entry file, in order: header, each part's rows, the digest of all before it."""
    parts = [part.detach().to("cpu").contiguous() for part in rows.parts]
    n = rows.timesteps.shape[0]
    names = part_names(len(parts))
    if any(part.dim() < 2 or part.shape[0] != n for part in parts):
        shapes = "/".join(str(tuple(part.shape)) for part in parts)
        raise ConfigError(f"store.put: rows of shape {shapes} do not fit a plan of {n} timesteps")
    payload = [part.view(torch.uint8).numpy().reshape(-1) for part in parts]
    columns = rows.timesteps.shape[1] if rows.timesteps.dim() == 2 else 1
    header: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "binding": bhash,
        "key": list(key),
        "timesteps": key_to_plan(key, columns).tolist(),
        "dtype": str(parts[0].dtype).removeprefix("torch."),
        **{f"{name}_shape": list(part.shape) for name, part in zip(names, parts)},
        "parts": names,
        "created": time.time(),
    }
    head = canonical_json(header)
    # Pad the header (JSON allows trailing spaces) so the payload starts 64-byte aligned: the
    # rows are then read as typed views of one buffer, with no copy.
    head += b" " * ((-(len(MAGIC) + 4 + len(head))) % 64)
    prefix = MAGIC + struct.pack("<I", len(head)) + head
    digest = hashlib.sha256()
    digest.update(prefix)
    for chunk in payload:
        digest.update(chunk.data)
    return [prefix, *(p.data for p in payload), digest.digest()]


def parse_entry(path: Path) -> tuple[dict[str, Any], torch.Tensor, int, int]:
    """Read and verify an entry file; returns (header, raw bytes, payload offset, inode).

    The inode lets a caller move aside exactly the file it read, never a fresh rewrite that
    another process renamed into place meanwhile.
    """
    try:
        fd = open_regular(path)
    except NotARegularFile as exc:  # a FIFO or a device where an entry belongs: never opened for reading
        raise CorruptEntry(str(exc)) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        size, inode = st.st_size, st.st_ino
        if size < len(MAGIC) + 4 + DIGEST_BYTES:
            raise CorruptEntry(f"{size} bytes is too short for an entry", inode)
        raw = torch.empty(size, dtype=torch.uint8)
        buf = raw.numpy()
        got = f.readinto(buf.data)
        if got != size:
            raise CorruptEntry(f"read {got} of {size} bytes", inode)
    data = buf.data
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise CorruptEntry("bad magic", inode)
    if hashlib.sha256(data[: size - DIGEST_BYTES]).digest() != bytes(data[size - DIGEST_BYTES :]):
        raise CorruptEntry("digest mismatch", inode)
    (head_len,) = struct.unpack("<I", bytes(data[len(MAGIC) : len(MAGIC) + 4]))
    start = len(MAGIC) + 4
    if start + head_len > size - DIGEST_BYTES:
        raise CorruptEntry("header length out of range", inode)
    try:
        header = json.loads(bytes(data[start : start + head_len]))
    except ValueError as exc:
        raise CorruptEntry(f"header is not JSON: {exc}", inode) from None
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object", inode)
    return header, raw, start + head_len, inode


def entry_rows(header: dict[str, Any], raw: torch.Tensor, offset: int, spec: ModulationSpec | None) -> PlanRows:
    try:
        dtype = dtype_named(header["dtype"])
        if dtype is None or dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise CorruptEntry(f"unknown dtype {header['dtype']!r}")
        names = [str(name) for name in header.get("parts", part_names(2))]
        shapes = [[int(v) for v in header[f"{name}_shape"]] for name in names]
        key = tuple(int(v) for v in header["key"])
        timesteps = torch.tensor(header["timesteps"], dtype=torch.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptEntry(f"header lacks a field: {exc}") from None
    columns = timesteps.shape[1] if timesteps.dim() == 2 else 1
    n = len(key) // columns
    if spec is not None:
        want = [[n, *part.shape] for part in spec.table_parts()]
        if dtype != spec.dtype or shapes != want or columns != spec.plan_columns:
            shown = "/".join(str(shape) for shape in shapes)
            raise CorruptEntry(f"geometry {shown} {dtype} does not match the spec")
    if not shapes or any(not shape or shape[0] != n for shape in shapes):
        raise CorruptEntry("part shapes disagree with the plan")
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [item * math.prod(shape) for shape in shapes]
    if offset + sum(sizes) != raw.numel() - DIGEST_BYTES:
        raise CorruptEntry("payload size disagrees with the header")
    parts = []
    for size, shape in zip(sizes, shapes):
        parts.append(raw[offset : offset + size].view(dtype).view(shape))
        offset += size
    return PlanRows(key_to_plan(key, columns), *parts)


__all__ = ["FORMAT_VERSION", "MAGIC", "CorruptEntry", "encode_entry", "entry_rows", "parse_entry", "part_names"]
