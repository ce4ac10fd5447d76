"""safetensors headers: the dtype table, one file's tensor entries, and the checks they must pass.

A checkpoint is validated when a source is constructed (and again when it changes on disk), the
way safetensors itself validates a file, so a corrupt header is reported as a malformed file
naming the tensor, instead of surfacing later as an internal error of the read or the GEMM.
The rules (those of the safetensors format):

* 8 bytes of little-endian header length, then that many bytes of UTF-8 JSON holding one object,
  at most 100 MB;
* ``__metadata__``, if present, maps strings to strings;
* every other key is a tensor: ``dtype`` a known name, ``shape`` a list of non-negative integers,
  ``data_offsets`` two integers ``[begin, end]`` with ``0 <= begin <= end`` (JSON integers: not
  floats, not booleans), and ``end - begin`` equal to the product of the shape times the
  dtype's size;
* sorted by offset, the spans tile the data section exactly: the first starts at 0, each starts
  where the previous one ends (no gap, no overlap), and the last ends at the end of the file.

After these checks pass, safetensors' own parser (``safe_open``, which reads the header and maps
the file without reading tensor data) must accept the file too, so this reader never accepts a
file the format's reference implementation refuses.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..identity.files import FileIdentity


class DType(NamedTuple):
    """One safetensors dtype: its name in headers, its width in bits, the torch dtype (if any)."""

    name: str
    bits: int
    torch: torch.dtype | None


def _optional(name: str) -> torch.dtype | None:
    """A torch dtype that older torch builds lack."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


#: Every dtype a safetensors header may carry. A tensor of a dtype without a torch counterpart
#: (the sub-byte float formats) is validated like any other; it only cannot be read as a tensor.
DTYPES: tuple[DType, ...] = (
    DType("BOOL", 8, torch.bool),
    DType("U8", 8, torch.uint8),
    DType("I8", 8, torch.int8),
    DType("U16", 16, _optional("uint16")),
    DType("I16", 16, torch.int16),
    DType("U32", 32, _optional("uint32")),
    DType("I32", 32, torch.int32),
    DType("U64", 64, _optional("uint64")),
    DType("I64", 64, torch.int64),
    DType("F16", 16, torch.float16),
    DType("BF16", 16, torch.bfloat16),
    DType("F32", 32, torch.float32),
    DType("F64", 64, torch.float64),
    DType("C64", 64, torch.complex64),
    DType("F8_E4M3", 8, torch.float8_e4m3fn),
    DType("F8_E5M2", 8, torch.float8_e5m2),
    DType("F8_E4M3FNUZ", 8, _optional("float8_e4m3fnuz")),
    DType("F8_E5M2FNUZ", 8, _optional("float8_e5m2fnuz")),
    DType("F8_E8M0", 8, _optional("float8_e8m0fnu")),
    DType("F4", 4, None),
    DType("F6_E2M3", 6, None),
    DType("F6_E3M2", 6, None),
)
_BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
#: safetensors dtype names -> torch dtypes (those torch can hold).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {d.name: d.torch for d in DTYPES if d.torch is not None}
_NAME_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_BY_TORCH_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES.values()}


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The name a safetensors header gives ``dtype`` (``torch.bfloat16`` -> ``"BF16"``), or None."""
    return _NAME_OF.get(dtype)


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype spelled ``name`` the way torch prints it without its prefix (``"bfloat16"``)."""
    return _BY_TORCH_NAME.get(name)


#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER = 100_000_000


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
        return SAFETENSORS_DTYPES.get(self.dtype)


class NotARegularFile(OSError):
    """A path names a FIFO, a device, a socket or a directory where a regular file must be."""


def is_regular(path: Path) -> bool:
    """Whether ``path`` (following symlinks) is a regular file; False if it cannot be stat'ed."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, refused (:class:`NotARegularFile`) unless it is a regular file.

    The one way the package opens a file to read it. ``O_NONBLOCK`` because opening a FIFO for
    reading otherwise waits for a writer, forever if none comes (a named pipe called
    ``x.safetensors`` in a checkpoint directory must not hang a scan); on a regular file the flag
    changes nothing. The type is checked on the open descriptor, so a file swapped for a FIFO
    after a ``stat`` is still refused.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
            raise NotARegularFile(errno.EINVAL, f"{path} is not a regular file ({kind})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """The whole content of the regular file ``path`` (:func:`open_regular`, then read)."""
    fd = open_regular(path)
    try:
        parts = []
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


class _Object(dict[str, Any]):
    """A JSON object that remembers the keys it was given more than once (JSON allows it; we do not)."""

    repeated: list[str]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    out = _Object()
    out.repeated = []
    for key, value in pairs:
        if key in out:
            out.repeated.append(key)
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _integer(text: str) -> int | float:
    """A JSON integer; ``-0`` stays a float, as safetensors' parser reads it (and refuses it as an offset)."""
    return -0.0 if text == "-0" else int(text)


def _is_count(value: Any) -> bool:
    """A JSON integer >= 0 (Python's json reads ``true`` as a bool, which is an int: refuse it)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated safetensors header: tensor entries plus the identity the fingerprint is built from."""

    path: Path
    identity: FileIdentity
    digest: str
    entries: dict[str, TensorEntry]

    @classmethod
    def read(cls, path: Path) -> SafetensorsHeader:
        """Parse and validate ``path``'s header (see the module docstring); CheckpointError if it is malformed."""
        try:
            fd = open_regular(path)
            try:
                return cls._read(path, fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc

    @classmethod
    def _read(cls, path: Path, fd: int) -> SafetensorsHeader:
        identity = FileIdentity.from_stat(os.fstat(fd))
        # No read-ahead: a buffered read of the header would pull the first tensors' pages into
        # the page cache too, and a load that must not read the projections would read some.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise CheckpointError(
                f"{path} is not a safetensors file ({identity.size} bytes, shorter than the 8-byte "
                f"header length): pass a .safetensors checkpoint"
            )
        (length,) = struct.unpack("<Q", prefix)
        if length <= 0 or length > MAX_HEADER or 8 + length > identity.size:
            raise CheckpointError(
                f"{path} is not a safetensors file (header length {length} does not fit the "
                f"{identity.size}-byte file): pass a .safetensors checkpoint, or re-save it if it "
                f"was truncated"
            )
        raw = _pread_exact(fd, length, 8)
        try:
            header = json.loads(
                raw.decode("utf-8"), object_pairs_hook=_object, parse_constant=_no_constant, parse_int=_integer
            )
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CheckpointError(
                f"{path} is not a safetensors file (its header is not valid JSON: {exc}): pass a "
                f".safetensors checkpoint"
            ) from None
        entries = _entries(path, header, 8 + length, identity.size)
        # Through the descriptor just checked: a path swapped for a FIFO meanwhile never blocks.
        _safetensors_accepts(path, fd)
        digest = hashlib.sha256(prefix + raw).hexdigest()
        return cls(path, identity, digest, entries)


def _pread_exact(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer only at the end of the file), however the reads split."""
    parts = []
    while length > 0:
        part = os.pread(fd, length, offset)
        if not part:
            break
        parts.append(part)
        length -= len(part)
        offset += len(part)
    return b"".join(parts)


def _malformed(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is a malformed safetensors file: {what}; re-save or re-download the checkpoint")


def _repeated(obj: Any) -> list[str]:
    """The keys a parsed JSON object was given more than once."""
    return obj.repeated if isinstance(obj, _Object) else []


def _entries(path: Path, header: dict[str, Any], data_start: int, size: int) -> dict[str, TensorEntry]:
    """The tensor entries of ``header``, each checked alone, then their spans checked together."""
    if _repeated(header):
        raise _malformed(path, f"its header names {_repeated(header)[0]!r} twice")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _malformed(path, f"its __metadata__ is {json.dumps(meta)[:80]}, not a map of strings to strings")
    if _repeated(meta):
        raise _malformed(path, f"its __metadata__ repeats the key {_repeated(meta)[0]!r}")
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name != "__metadata__":
            entries[name] = _entry(path, name, info, data_start, size)
    _check_tiling(path, entries, data_start, size)
    return entries


def _entry(path: Path, name: str, info: Any, data_start: int, size: int) -> TensorEntry:
    """One tensor's entry, checked on its own: field types, known dtype, span length, inside the file."""

    def bad(what: str) -> CheckpointError:
        return _malformed(path, f"tensor {name!r} {what}")

    if not isinstance(info, dict):
        raise bad(f"has the entry {json.dumps(info)[:80]}, not a JSON object")
    if _repeated(info):
        raise bad(f"repeats the key {_repeated(info)[0]!r} in its entry")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in info]
    if missing:
        raise bad(f"has no {missing[0]!r} in its entry")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    known = _BY_NAME.get(dtype) if isinstance(dtype, str) else None
    if known is None:
        raise bad(f"has the unknown dtype {json.dumps(dtype)[:40]} (known: {', '.join(_BY_NAME)})")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise bad(f"has the shape {json.dumps(shape)[:80]}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(v) for v in offsets)):
        raise bad(f"has the data_offsets {json.dumps(offsets)[:80]}, not two non-negative integers [begin, end]")
    begin, end = offsets
    if begin > end:
        raise bad(f"has the data_offsets [{begin}, {end}]: its span ends before it begins")
    elements = 1
    for s in shape:
        elements *= s
    bits = elements * known.bits
    if bits % 8:
        raise bad(f"holds {elements} elements of {known.name}, which do not fill whole bytes")
    if end - begin != bits // 8:
        raise bad(f"spans {end - begin} bytes of data, but its shape {shape} of {known.name} needs {bits // 8} bytes")
    if data_start + end > size:
        raise CheckpointError(
            f"{path} is truncated (or its header corrupt): tensor {name!r} ends at byte {data_start + end} but "
            f"the file has {size} bytes; re-save or re-download the checkpoint"
        )
    return TensorEntry(name, known.name, tuple(shape), data_start + begin, data_start + end)


def _check_tiling(path: Path, entries: dict[str, TensorEntry], data_start: int, size: int) -> None:
    """Sorted by offset, the spans must cover the data section exactly: no gap, no overlap, no tail."""
    expected = data_start
    previous: TensorEntry | None = None
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end, e.name)):
        if entry.begin < expected:
            assert previous is not None  # expected only grows past data_start after a first entry
            raise _malformed(
                path,
                f"tensor {entry.name!r} (data bytes {entry.begin - data_start}..{entry.end - data_start}) "
                f"overlaps tensor {previous.name!r} (bytes {previous.begin - data_start}..{previous.end - data_start})",
            )
        if entry.begin > expected:
            raise _malformed(
                path,
                f"data bytes {expected - data_start}..{entry.begin - data_start} before tensor {entry.name!r} "
                f"belong to no tensor (the spans must tile the data section)",
            )
        expected, previous = entry.end, entry
    if expected < size:  # (every span ends inside the file: checked entry by entry)
        after = f"after tensor {previous.name!r}" if previous is not None else "after the header"
        raise _malformed(path, f"its last {size - expected} bytes ({after}) belong to no tensor")


#: safetensors names the tensor of an error between backticks.
_NAMED = re.compile(r"`([^`]*)`")


def _safetensors_accepts(path: Path, fd: int | None = None) -> None:
    """safetensors' own parser must accept the file too (a backstop for anything the checks above miss).

    ``fd``: an open descriptor of ``path``; safetensors then opens that very file (through
    ``/proc/self/fd``, where the system has it), not whatever the path names by now.
    """
    opened = f"/proc/self/fd/{fd}" if fd is not None and os.path.isdir("/proc/self/fd") else str(path)
    try:
        with safe_open(opened, framework="pt"):
            pass
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc
    except Exception as exc:  # safetensors' error type lives in its compiled module
        named = _NAMED.search(str(exc))
        which = f" (tensor {named.group(1)!r})" if named else ""
        raise _malformed(path, f"safetensors refuses its header{which}: {exc}") from None
