"""A checkpoint's safetensors files: their headers, which files make the checkpoint, their fingerprint, the writer.

Headers are validated as safetensors validates a file (:meth:`SafetensorsHeader.read`), so a corrupt
one is a malformed file naming the tensor, not a failure inside a read or a GEMM. Which files a path
stands for (one set, never a merge; only regular files opened, so nothing blocks) and what the
fingerprint is: docs/api.md, "CheckpointSource". The writer (:func:`write_safetensors`) places each
tensor at a chosen file offset modulo ``align``, reproducing a mapped model's alignment (an fp32 GEMV's
bits depend on the address: docs/exactness.md); its gaps are ``uint8`` padding tensors, so safetensors
itself loads the files, and :class:`LazyTensor` lets a multi-GiB file need one tensor of memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from safetensors import safe_open

from ..errors import CheckpointError, ConfigError
from ..identity import FileIdentity
from ..options import flag

log = logging.getLogger(__name__)


class DType(NamedTuple):
    """One safetensors dtype: its name in headers, its width in bits, the torch dtype (if any)."""

    name: str
    bits: int
    torch: torch.dtype | None


def _dtypes(table: str) -> tuple[DType, ...]:
    """``NAME:bits[:torch name]`` entries; a torch dtype this build lacks is None, as for the sub-byte floats."""
    out = []
    for entry in table.split():
        name, bits, *torch_name = entry.split(":")
        found = getattr(torch, torch_name[0], None) if torch_name else None
        out.append(DType(name, int(bits), found if isinstance(found, torch.dtype) else None))
    return tuple(out)


#: Every dtype a safetensors header may carry. One without a torch counterpart (the sub-byte float
#: formats) is validated like any other; it only cannot be read as a tensor.
DTYPES = _dtypes(
    "BOOL:8:bool U8:8:uint8 I8:8:int8 U16:16:uint16 I16:16:int16 U32:32:uint32 I32:32:int32 U64:64:uint64 "
    "I64:64:int64 F16:16:float16 BF16:16:bfloat16 F32:32:float32 F64:64:float64 C64:64:complex64 "
    "F8_E4M3:8:float8_e4m3fn F8_E5M2:8:float8_e5m2 F8_E4M3FNUZ:8:float8_e4m3fnuz F8_E5M2FNUZ:8:float8_e5m2fnuz "
    "F8_E8M0:8:float8_e8m0fnu F4:4 F6_E2M3:6 F6_E3M2:6"
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

    def misaligned(self) -> str | None:
        """Why this tensor's data cannot be viewed as its dtype in place, or None: it is read (or mapped) at
        its file offset's address modulo 4096, so its elements sit on their natural boundary only if the
        offset is a multiple of the element size, as every writer of the format lays them out."""
        dtype = self.torch_dtype
        if dtype is None:
            return f"dtype {self.dtype} has no torch counterpart"
        if self.begin % dtype.itemsize:
            return (
                f"its data starts at file offset {self.begin}, not a multiple of its {dtype.itemsize}-byte "
                f"elements; re-save the checkpoint with safetensors"
            )
        return None

    def view_dtype(self, path: Path, how: str) -> torch.dtype:
        """The dtype to view this tensor's bytes as; CheckpointError naming ``path`` where it cannot be ``how``."""
        why = self.misaligned()
        if why:
            raise CheckpointError(f"{path}: tensor {self.name!r} cannot be {how}: {why}")
        assert self.torch_dtype is not None  # misaligned said so
        return self.torch_dtype


class NotARegularFile(OSError):
    """A path names a FIFO, a device, a socket or a directory where a regular file must be."""


def is_regular(path: Path) -> bool:
    """Whether ``path`` (following symlinks) is a regular file; False if it cannot be stat'ed."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, refused (:class:`NotARegularFile`) unless it is a regular file: the
    one way the package opens a file to read it. ``O_NONBLOCK`` so that a FIFO named ``x.safetensors`` never
    hangs a scan waiting for a writer; the type is checked on the open descriptor, so a file swapped for a
    FIFO after a ``stat`` is still refused."""
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


def fsync_dir(path: Path) -> None:
    """Make a rename into directory ``path`` durable: the directory entry itself must reach the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


def read_regular(path: Path) -> bytes:
    """The whole content of the regular file ``path`` (:func:`open_regular`, then read)."""
    with open(open_regular(path), "rb") as handle:
        return handle.read()


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
    #: The header's ``__metadata__`` (strings by key; empty when it has none).
    metadata: dict[str, str]

    @classmethod
    def read(cls, path: Path) -> SafetensorsHeader:
        """Parse and validate ``path``'s header; CheckpointError if it is malformed.

        8 bytes of little-endian length, then at most 100 MB of UTF-8 JSON holding one object, whose
        ``__metadata__`` maps strings to strings and whose every other key is a tensor: a known ``dtype``,
        a ``shape`` of non-negative integers, ``data_offsets`` of two JSON integers (not floats, not
        booleans) ``0 <= begin <= end`` spanning the shape times the dtype's size; sorted by offset the
        spans tile the data section exactly; then safetensors' own parser must accept the file too.
        """
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
        _safetensors_accepts(path, fd)
        digest = hashlib.sha256(prefix + raw).hexdigest()
        return cls(path, identity, digest, entries, dict(header.get("__metadata__") or {}))


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
    elements = math.prod(shape)
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


def _safetensors_accepts(path: Path, fd: int) -> None:
    """safetensors' own parser must accept the file too (a backstop for anything the checks above miss),
    opened through ``/proc/self/fd`` where there is one, so a path swapped for a FIFO meanwhile never blocks."""
    opened = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
    try:
        with safe_open(opened, framework="pt"):
            pass
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc
    except Exception as exc:  # safetensors' error type lives in its compiled module
        named = _NAMED.search(str(exc))
        which = f" (tensor {named.group(1)!r})" if named else ""
        raise _malformed(path, f"safetensors refuses its header{which}: {exc}") from None


#: What a checkpoint path may be: a file, an index, a directory, or a list of files.
CheckpointPath = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

#: The single weights file diffusers' ``from_pretrained`` loads from a model directory.
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
#: The writer's padding tensors carry this prefix; readers look tensors up by name, so padding is invisible to them.
PAD_PREFIX = "__adalncache_padding__"

#: How a user picks one file set: the library argument and every command-line way to pass a checkpoint.
PICK = (
    "pass the file (or the index) to serve from: CheckpointSource(path), the checkpoint= of an integration, "
    f"the CHECKPOINT argument of adalncache build, export and inspect, or {flag('checkpoint')} of adalncache verify"
)


def _not_regular(path: Path) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {path} is not a regular file (a FIFO, a device, a socket or a directory): pass a "
        f".safetensors file"
    )


def _existing_file(file: Path, missing: str) -> Path:
    """``file``, refused (CheckpointError) with ``missing`` if it does not exist, or if it is not a regular file."""
    if not file.exists():
        raise CheckpointError(missing)
    if not is_regular(file):
        raise _not_regular(file)
    return file


def _regular_in(root: Path, pattern: str) -> list[Path]:
    """The regular files of ``root`` matching ``pattern``, sorted; anything else is skipped (logged), never opened."""
    out = []
    for path in sorted(root.glob(pattern)):
        if is_regular(path):
            out.append(path)
        elif path.exists() or path.is_symlink():
            log.warning("%s is not a regular file (a FIFO, a device or a socket?): not read", path)
    return out


def checkpoint_files(path: CheckpointPath) -> tuple[list[Path], Path | None]:
    """Resolve ``path`` into checkpoint files, plus the index json that named them (if any).

    CheckpointError when a path does not exist or is not a regular file, a directory holds no checkpoint
    or several index files, or an index is invalid or names a file outside its directory (ambiguity with
    other files of a directory is :class:`CheckpointFiles`'s to check: it reads their headers).
    """
    if isinstance(path, (list, tuple)):
        if not path:
            raise CheckpointError("the list of checkpoint files is empty: pass at least one .safetensors file")
        return [_existing_file(f, f"checkpoint file {f} does not exist") for f in map(Path, path)], None
    root = Path(cast("str | os.PathLike[str]", path))  # a list or tuple returned above
    try:
        mode = os.stat(root).st_mode
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint path {root} does not exist: pass a .safetensors file, a directory of them, or a list of files"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot use checkpoint path {root}: {exc}") from exc
    if stat.S_ISREG(mode):
        if root.name.endswith(INDEX_SUFFIX):
            return _indexed_files(root.parent, root), root
        return [root], None
    if not stat.S_ISDIR(mode):
        raise _not_regular(root)
    indexes = _regular_in(root, "*" + INDEX_SUFFIX)
    if len(indexes) > 1:
        raise CheckpointError(
            f"{root} holds several index files ({', '.join(p.name for p in indexes)}): pass the index to use "
            f"(its path), the files of one checkpoint as a list, or the directory of one checkpoint"
        )
    if indexes:
        return _indexed_files(root, indexes[0]), indexes[0]
    files = _regular_in(root, "*.safetensors")
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}: pass a directory that holds the checkpoint")
    single = root / DIFFUSERS_WEIGHTS
    if single in files:
        return [single], None
    return files, None


def _indexed_files(root: Path, index: Path) -> list[Path]:
    """The files ``index`` names, each required to be a regular file inside ``root``."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index (needs a weight_map): {exc}") from None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items())
    ):
        raise CheckpointError(
            f"{index} is not a valid safetensors index: its weight_map must map tensor names to file names "
            f"(strings), got {json.dumps(weight_map)[:120]}"
        )
    base = root.resolve()
    files = []
    for name in sorted(set(weight_map.values())):
        file = (root / name).resolve()
        if base not in file.parents:
            raise CheckpointError(
                f"{index} points at {name!r}, outside the checkpoint directory {root}: an index may only "
                f"name files inside its own directory"
            )
        files.append(_existing_file(file, f"{index} names {name!r}, which does not exist in {root}"))
    return files


def _clash(root: Path, name: str, first: Path, second: Path, index: Path | None) -> CheckpointError:
    chosen = f"its index {index.name} names {first.name}" if index is not None else f"{first.name} is read"
    return CheckpointError(
        f"{root} is ambiguous: {first.name} and {second.name} both hold tensor {name!r} ({chosen}); a checkpoint "
        f"is one set of files, never a merge: {PICK}, or move the other file out of the directory"
    )


@dataclass(frozen=True)
class CheckpointFiles:
    """One validated reading of a checkpoint: its files, their headers, and their fingerprint."""

    files: list[Path]
    index: Path | None
    index_identity: FileIdentity | None
    headers: list[SafetensorsHeader]
    #: Tensor name -> the header of the file that holds it.
    where: dict[str, SafetensorsHeader]
    fingerprint: str

    @classmethod
    def read(cls, path: CheckpointPath) -> CheckpointFiles:
        """Resolve ``path``, parse and validate every header (CheckpointError on the first problem)."""
        files, index = checkpoint_files(path)
        headers = [SafetensorsHeader.read(f) for f in files]
        where: dict[str, SafetensorsHeader] = {}
        directory = Path(path) if isinstance(path, (str, os.PathLike)) and Path(path).is_dir() else None
        root = directory or (index.parent if index else files[0].parent if len(files) > 1 else Path(str(files[0])))
        for header in headers:
            for name in header.entries:
                held = where.setdefault(name, header)
                if held is not header and not name.startswith(PAD_PREFIX):
                    raise _clash(root, name, held.path, header.path, index)
        # Every other *.safetensors of a directory: one that holds a tensor of the set makes it ambiguous.
        chosen, others = {f.resolve() for f in files}, _regular_in(directory, "*.safetensors") if directory else []
        for other in (f for f in others if f.resolve() not in chosen):
            try:
                names = SafetensorsHeader.read(other).entries
            except CheckpointError as exc:
                log.warning("%s is not part of the checkpoint and cannot be read (%s): ignored", other, exc)
                continue
            shared = sorted(n for n in set(names) & set(where) if not n.startswith(PAD_PREFIX))
            if shared:
                raise _clash(root, shared[0], where[shared[0]].path, other, index)
            log.info("%s holds none of the checkpoint's tensors: not read", other)
        digest = hashlib.sha256()
        for header in headers:
            fields = (header.path.resolve(), *dataclasses.astuple(header.identity), header.digest)
            digest.update(("|".join(map(str, fields)) + "\n").encode())
        index_identity = FileIdentity.of(index) if index else None
        return cls(files, index, index_identity, headers, where, digest.hexdigest())

    def changed_files(self) -> list[Path]:
        """The files (and index) whose ``stat`` identity is no longer the one they had when read."""
        out = []
        watched = [(h.path, h.identity) for h in self.headers]
        if self.index is not None and self.index_identity is not None:
            watched.append((self.index, self.index_identity))
        for path, identity in watched:
            try:
                if FileIdentity.of(path) != identity:
                    out.append(path)
            except OSError:
                out.append(path)
        return out

    def changed(self) -> bool:
        return bool(self.changed_files())


class LazyTensor(NamedTuple):
    """A tensor of ``shape`` and ``dtype`` that ``make()`` produces only when it is written."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


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
    """Write ``tensors`` to ``path`` as a safetensors file, each at its ``residues`` (``file offset % align``,
    default 0), the header padded with spaces so the data starts at a multiple of ``align``. Written to a
    temporary name, synced and renamed into place, so a reader never sees half of it. Returns ``path``."""
    residues = dict(residues or {})
    path = Path(path)
    order: list[tuple[str, torch.Tensor | LazyTensor | int]] = []  # an int is that many padding bytes
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, tensor in tensors.items():
        shape, dtype_name = [int(s) for s in tensor.shape], safetensors_name(tensor.dtype)
        if dtype_name is None:
            raise ConfigError(f"write_safetensors cannot store dtype {tensor.dtype} (tensor {name!r})")
        nbytes = tensor.dtype.itemsize * math.prod(shape)
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
