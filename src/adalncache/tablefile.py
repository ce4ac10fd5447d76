"""Table files: the tables of a set of plans in one safetensors file that other engines load too.

The layout (format version 2) is one tensor per table part of the family (``spec.table_parts()``)
beside the plans:

* ``plan_timesteps [P, W] float32`` (``[P, W, C]`` for plans of ``C`` columns): slot ``s`` holds a
  plan in its first ``plan_lengths[s]`` rows, zeros after;
* ``plan_lengths [P] int64``, each in ``1..W``;
* one ``[P, W, *part.shape]`` tensor per table part: the projections' outputs, rows past a plan's
  length zero (readers never read them; zeros keep the bytes deterministic). A family whose tables
  another engine reads declares that engine's parts (SGLang's sidecar: ``block_params`` and
  ``final_params``); any other family has one, ``table_rows [P, W, table_width]``, whose layers'
  columns the metadata lists;
* metadata ``format_version = "2"`` and, for a family whose table files name the transformer they
  belong to, ``model_variant`` (which that engine compares with its own setting).

Two formats share that layout. ``sglang``: exactly the above, bfloat16, nothing else, so SGLang
loads it unmodified; it carries no binding, so a reader can check the geometry and nothing more,
and only a family whose ``table_formats`` include it can be written so. ``adalncache``: the same
tensors (in the projections' dtype) plus metadata that binds the file to what produced it: the
content digest of the projection tensors, the spec (family and layers included), the precision,
the numeric environment, the tool's version, the schedules, the family and its layers (id, first
column, width), and a BLAKE3 digest per slot, checked on every read. A bound file of bfloat16
tables with a ``model_variant`` is also an SGLang file: SGLang ignores the extra keys.

A third format, ``vllm-omni`` (``format_version = "4"``), adds a per-row tensor (the time
embeddings) and binds the file with a manifest instead; its rules live in :mod:`adalncache.vllm_omni`,
which this module asks to check such a file when it opens one (the whole payload against its
digests). The writer takes a format's extra per-row tensors and reads its tensors back for such
digests; the reader reads any per-row tensor of a plan (:meth:`TableFile.read_rows`).

:class:`TableWriter` streams a file slot by slot (never a whole P x W slab in memory), into a
temporary file renamed into place at the end; :class:`TableFile` opens one, validates it, and
reads a plan's rows with two ``pread`` calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from . import families, vllm_omni
from .errors import CheckpointError, ConfigError
from .geometry import Family, KeyLayout, ModelGeometry, ServedLayer
from .identity import FileIdentity, canonical_json, hash_hex
from .options import flag
from .plans import PlanKey, format_plan, key_to_plan, plan_key
from .rows import PlanRows
from .source.files import SafetensorsHeader, TensorEntry, safetensors_name
from .source.reads import pread_into
from .spec import ModulationSpec

log = logging.getLogger(__name__)

#: The layout's version, as SGLang checks it.
FORMAT_VERSION = "2"
FORMATS = ("adalncache", "sglang", vllm_omni.FORMAT)
#: The plan tensors every table file has; the table parts' tensors follow (per family).
PLAN_TENSORS = ("plan_timesteps", "plan_lengths")

#: Metadata keys of the bound (``adalncache``) format.
BOUND = "adalncache.format"
BOUND_VERSION = "1"
TOOL = "adalncache.tool"
BINDING = "adalncache.binding"
CONTENT = "adalncache.content"
SCHEDULES = "adalncache.schedules"
SLOT_DIGESTS = "adalncache.slot_digests"
CREATED = "adalncache.created"
FAMILY = "adalncache.family"
#: ``[[layer id, first column, width], ...]`` in table order: where each layer sits in a row.
LAYERS = "adalncache.layers"

_HEX = 64
_SLACK = 4096  # header bytes reserved beyond the placeholder header, so the final one always fits


def tool_version() -> str:
    """``adalncache <version>`` of this installation."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"adalncache {version('adalncache')}"
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        return "adalncache (not installed)"


def _canonical(value: Any) -> str:
    """Metadata values are strings: the canonical JSON (:func:`adalncache.identity.canonical_json`) as text."""
    return canonical_json(value).decode()


def slot_digest(timesteps: torch.Tensor, *parts: torch.Tensor) -> str:
    """BLAKE3 of one slot's useful bytes: its plan, then each table part's rows (first ``n`` rows each)."""
    raw = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy() for t in (timesteps, *parts)]
    return hash_hex(*(p.data for p in raw))


def layer_table(spec: ModulationSpec) -> list[list[Any]]:
    """``[[layer id, first column, width], ...]``: where each served layer sits in a table row."""
    return [[layer, spec.offset(layer), spec.out_features(layer)] for layer in spec.layers()]


def _bad(path: Path, what: str, argument: str) -> ConfigError:
    return ConfigError(f"{path} cannot be used as a table file ({argument}): {what}")


@dataclass(frozen=True)
class TableShapes:
    """Shapes of the four tensors of a file of ``plans`` slots ``width`` timesteps wide."""

    plans: int
    width: int
    spec: ModulationSpec

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        P, W, s = self.plans, self.width, self.spec
        C = s.plan_columns
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "plan_timesteps": ((P, W) if C == 1 else (P, W, C), torch.float32),
            "plan_lengths": ((P,), torch.int64),
        }
        for part in s.table_parts():
            out[part.tensor] = ((P, W, *part.shape), s.dtype)
        return out


# ---------------------------------------------------------------------------------------------
# writing


class TableWriter:
    """Writes one table file slot by slot; the file appears at ``path`` only when :meth:`finish` succeeds.

    The header is written first with placeholders of the final lengths (digests are fixed-length
    hex) plus slack, the data section is sized up front (a sparse file: padding rows read back as
    zeros without being written), each slot is written when its rows are known, and the real
    header is written last. A writer that dies leaves only its temporary file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        spec: ModulationSpec,
        plans: Sequence[torch.Tensor],
        *,
        bound: bool,
        extras: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        """``extras``: further per-row tensors a format carries beside the table parts, by name: each is
        ``[P, W, *shape]`` of ``dtype``, written with :meth:`write_extra` (rows past a plan's length zero)."""
        self.path = Path(path)
        self.spec = spec
        self.keys: list[PlanKey] = [plan_key(p, spec.plan_columns) for p in plans]
        if not self.keys:
            raise ConfigError(f"a table file needs at least one plan (check {flag('task')} and {flag('steps')})")
        if len(set(self.keys)) != len(self.keys):
            raise ConfigError("a table file holds each plan once: pass distinct plans (SGLang would serve one of them)")
        self.width = max(spec.plan_rows(k) for k in self.keys)
        self.bound = bound
        shapes = TableShapes(len(self.keys), self.width, spec).shapes()
        self._extras = dict(extras or {})
        for name, (row_shape, dtype) in self._extras.items():
            if name in shapes:
                raise ConfigError(f"a table file's extra tensor cannot be named {name!r}: the layout has that tensor")
            shapes[name] = ((len(self.keys), self.width, *row_shape), dtype)
        self._shapes = shapes
        header: dict[str, Any] = {}
        offset = 0
        self.begin: dict[str, int] = {}
        for name, (shape, dtype) in shapes.items():
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= s
            header[name] = {
                "dtype": safetensors_name(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.begin[name] = offset
            offset += nbytes
        self._tensors = header
        self._data_bytes = offset
        self._digests = ["0" * _HEX] * len(self.keys)
        self._written = [False] * len(self.keys)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._fd: int | None = None
        self._reserved = 0

    @property
    def nbytes(self) -> int:
        """The size the file will have (its header slack included, padding rows too): the room it needs."""
        return 8 + len(self._header({})) + 4 * _SLACK + self._data_bytes

    def _failed(self, exc: OSError) -> ConfigError:
        """A write that failed (a full disk, say): the temporary file goes, the error names -o."""
        self.abort()
        return ConfigError(
            f"cannot write the table file {self.path}: {exc.strerror or exc} (set {flag('output')} to a path on a "
            f"disk with room for its {self.nbytes} bytes); nothing was written there"
        )

    def open(self, metadata: Mapping[str, str]) -> None:
        """Create the temporary file and write the fixed parts (raises ConfigError naming ``-o``)."""
        placeholder = self._header(metadata)
        self._reserved = len(placeholder) + _SLACK
        self._reserved += (-(8 + self._reserved)) % 64  # the data section starts 64-byte aligned
        try:
            self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(self._fd, 8 + self._reserved + self._data_bytes)
        except OSError as exc:
            raise self._failed(exc) from None
        C = self.spec.plan_columns
        timesteps = torch.zeros((len(self.keys), self.width) + (() if C == 1 else (C,)), dtype=torch.float32)
        lengths = torch.tensor([self.spec.plan_rows(k) for k in self.keys], dtype=torch.int64)
        for s, key in enumerate(self.keys):
            timesteps[s, : self.spec.plan_rows(key)] = key_to_plan(key, C)
        self._pwrite(self.begin["plan_timesteps"], timesteps)
        self._pwrite(self.begin["plan_lengths"], lengths)

    def _header(self, metadata: Mapping[str, str]) -> bytes:
        meta = dict(metadata)
        if self.bound:
            meta[SLOT_DIGESTS] = json.dumps(self._digests, separators=(",", ":"))
        return json.dumps({"__metadata__": meta, **self._tensors}, separators=(",", ":")).encode()

    def _pwrite(self, begin: int, tensor: torch.Tensor) -> None:
        assert self._fd is not None
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
        offset = 8 + self._reserved + begin
        try:
            while data:
                written = os.pwrite(self._fd, data, offset)
                data, offset = data[written:], offset + written
        except OSError as exc:  # ENOSPC, EDQUOT, EIO: a typed error, and no partial file left
            raise self._failed(exc) from None

    def write_slot(self, index: int, rows: PlanRows) -> None:
        """Write slot ``index``'s rows (its plan is ``keys[index]``); the padding rows stay zero."""
        key = self.keys[index]
        s = self.spec
        n = s.plan_rows(key)
        parts = [part.detach().to("cpu") for part in rows.parts]
        table_parts = s.table_parts()
        if len(parts) != len(table_parts) or any(
            tuple(got.shape) != (n, *part.shape) for got, part in zip(parts, table_parts)
        ):
            shapes = "/".join(str(tuple(got.shape)) for got in parts)
            raise ConfigError(f"rows of shape {shapes} do not fit plan {format_plan(key, columns=s.plan_columns)}")
        if any(got.dtype != s.dtype for got in parts):
            raise ConfigError(f"rows of dtype {parts[0].dtype} do not fit a table file of {s.dtype}")
        item = s.itemsize
        for got, part in zip(parts, table_parts):
            self._pwrite(self.begin[part.tensor] + index * self.width * (part.stop - part.start) * item, got)
        if self.bound:
            self._digests[index] = slot_digest(key_to_plan(key, s.plan_columns), *parts)
        self._written[index] = True

    def write_extra(self, name: str, index: int, rows: torch.Tensor) -> None:
        """Write slot ``index``'s rows of the extra tensor ``name`` (``[n, *shape]``, its plan's ``n`` rows)."""
        row_shape, dtype = self._extras[name]
        n = self.spec.plan_rows(self.keys[index])
        rows = rows.detach().to("cpu")
        if tuple(rows.shape) != (n, *row_shape) or rows.dtype != dtype:
            raise ConfigError(
                f"{name} rows {tuple(rows.shape)} {rows.dtype} do not fit slot {index}: need {(n, *row_shape)} {dtype}"
            )
        row_bytes = dtype.itemsize
        for size in row_shape:
            row_bytes *= size
        self._pwrite(self.begin[name] + index * self.width * row_bytes, rows)

    def read_back(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` as written so far (a format whose metadata digests its tensors reads them here)."""
        assert self._fd is not None
        shape, dtype = self._shapes[name]
        nbytes = dtype.itemsize
        for size in shape:
            nbytes *= size
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            pread_into(self._fd, buf, 8 + self._reserved + self.begin[name], self.tmp, name)
        return buf.view(dtype).view(shape)

    def finish(self, metadata: Mapping[str, str]) -> Path:
        """Write the real header, sync, and rename the file into place; returns its path."""
        assert self._fd is not None
        columns = self.spec.plan_columns
        missing = [format_plan(k, columns=columns) for k, done in zip(self.keys, self._written) if not done]
        if missing:
            self.abort()
            raise ConfigError(
                f"the table file was not finished: {len(missing)} slot(s) never written ({missing[0]}, ...)"
            )
        head = self._header(metadata)
        if len(head) > self._reserved:  # cannot happen: every late value has its placeholder's length
            self.abort()
            raise ConfigError(f"table file header grew past its reserved {self._reserved} bytes")
        head += b" " * (self._reserved - len(head))
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(head)) + head, 0)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self.tmp, self.path)
        except OSError as exc:
            raise self._failed(exc) from None
        with contextlib.suppress(OSError):
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return self.path

    def abort(self) -> None:
        """Remove the temporary file (nothing at ``path`` changes)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            self.tmp.unlink()


# ---------------------------------------------------------------------------------------------
# reading


def _part_tensors(names: Any) -> tuple[str, ...] | None:
    """The table parts' tensors among ``names`` (a family's whole set), or None when no family's set is there."""
    for tensors in families.table_tensor_sets():
        if all(name in names for name in tensors):
            return tensors
    return None


def is_table_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a safetensors file holding the plans and a family's table tensors (for ``inspect``)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                return False
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error):
        return False
    return (
        isinstance(header, dict) and all(name in header for name in PLAN_TENSORS) and _part_tensors(header) is not None
    )


class TableFile:
    """One table file, validated and indexed; :meth:`read` returns a plan's rows.

    ``spec``: the geometry and dtype the file must have (None: taken from the file, for
    ``inspect``). ``argument``: how messages name the file's setting (``tables=``, ``--tables``).
    Raises ConfigError when the file is missing, is not safetensors, lacks or misshapes one of its
    tensors, has another ``format_version``, or its plans are malformed, and for an unbound file of
    a family whose tables are only served from bound ones.
    """

    def __init__(
        self, path: str | os.PathLike[str], spec: ModulationSpec | None = None, *, argument: str = "tables="
    ) -> None:
        self.path = Path(path)
        self.argument = argument
        entries = self._open()
        self._check_present(entries, spec)
        version = self._check_version()
        #: A vLLM-Omni sidecar's manifest (None for the other formats).
        self.manifest: dict[str, Any] | None = None
        if version == vllm_omni.FORMAT_VERSION:
            self.manifest = vllm_omni.read_manifest(self.path, self.metadata, argument)
        ts, lengths = entries["plan_timesteps"], entries["plan_lengths"]
        if ts.dtype != "F32" or len(ts.shape) not in (2, 3) or lengths.dtype != "I64" or lengths.shape != ts.shape[:1]:
            raise _bad(self.path, "plan_timesteps must be [P, W] float32 and plan_lengths [P] int64", argument)
        self.plans, self.width = ts.shape[:2]
        if spec is None and self.manifest is not None:
            found = _part_tensors(entries)
            dtype = entries[found[0]].torch_dtype if found else None
            spec = ModulationSpec(**vllm_omni.spec_fields(self.manifest, dtype or torch.bfloat16))
        if spec is None:
            spec = self._spec_of(entries, argument)
        self.spec = spec
        self._entries: dict[str, TensorEntry] = entries
        self._check_shapes(entries, spec)
        self._check_format(entries, spec)
        self._index_plans(ts, lengths, spec.plan_columns)
        self.format = (
            vllm_omni.FORMAT
            if self.manifest is not None
            else "adalncache"
            if self.metadata.get(BOUND) is not None
            else "sglang"
        )
        self.binding: dict[str, Any] | None = None
        self.slot_digests: list[str] | None = None
        if self.format == "adalncache":
            self._read_binding()

    def _open(self) -> dict[str, TensorEntry]:
        """The file's tensor entries; sets its identity and metadata (a ConfigError if it is no safetensors file)."""
        if not self.path.is_file():
            raise ConfigError(f"table file {self.path} does not exist ({self.argument})")
        try:
            header = SafetensorsHeader.read(self.path)
            with safe_open(str(self.path), framework="pt") as handle:
                self.metadata: dict[str, str] = dict(handle.metadata() or {})
        except (CheckpointError, OSError) as exc:
            raise _bad(self.path, f"not a readable safetensors file: {exc}", self.argument) from None
        self.identity: FileIdentity = header.identity
        return header.entries

    def _check_present(self, entries: dict[str, TensorEntry], spec: ModulationSpec | None) -> None:
        """Refuses a file without the plan tensors and the table parts of ``spec`` (or of its own family)."""
        wanted = [*PLAN_TENSORS, *(p.tensor for p in spec.table_parts())] if spec is not None else None
        if wanted is None:
            found = _part_tensors(entries)
            wanted = [*PLAN_TENSORS, *(found if found is not None else families.table_tensor_sets()[0])]
        absent = [name for name in wanted if name not in entries]
        if absent:
            raise _bad(
                self.path,
                f"it has no {', '.join(absent)} tensor (a table file holds {', '.join(wanted)})",
                self.argument,
            )

    def _check_version(self) -> str | None:
        """The file's ``format_version``, refused unless this reader knows it."""
        version = self.metadata.get("format_version")
        if version not in (FORMAT_VERSION, vllm_omni.FORMAT_VERSION):
            raise _bad(
                self.path,
                f"its format_version is {version!r}, this reader knows {FORMAT_VERSION!r} (sglang and "
                f"adalncache files) and {vllm_omni.FORMAT_VERSION!r} (vLLM-Omni sidecars)",
                self.argument,
            )
        return version

    def _check_shapes(self, entries: dict[str, TensorEntry], spec: ModulationSpec) -> None:
        """Refuses a tensor whose shape or dtype is not the one ``spec`` needs at this plans x width."""
        for name, (shape, want) in TableShapes(self.plans, self.width, spec).shapes().items():
            entry = entries[name]
            if tuple(entry.shape) != shape or entry.torch_dtype != want:
                raise ConfigError(
                    f"{self.path} ({self.argument}): {name} is {list(entry.shape)} "
                    f"{entry.torch_dtype or entry.dtype}, this model needs {list(shape)} {want}: it holds another "
                    f"checkpoint geometry or dtype; export tables from this model's checkpoint (adalncache export)"
                )

    def _check_format(self, entries: dict[str, TensorEntry], spec: ModulationSpec) -> None:
        """Refuses a format the family is not served from: a sidecar's payload is checked against its manifest,
        an unbound file is refused for a family served only from bound ones."""
        if self.manifest is not None:
            if vllm_omni.FORMAT not in spec.family.table_formats:
                raise _bad(self.path, f"a vLLM-Omni sidecar cannot hold {spec.family.title} tables", self.argument)
            shapes = {name: (tuple(e.shape), e.torch_dtype) for name, e in entries.items()}
            vllm_omni.check_payload(self.path, self.manifest, spec, shapes, self.read_whole, self.argument)
        elif self.metadata.get(BOUND) is None and "sglang" not in spec.family.table_formats:
            raise _bad(
                self.path,
                f"it carries no binding, and {spec.family.title} tables are only served from bound files "
                f"(export them with adalncache export {flag('format')} adalncache)",
                self.argument,
            )

    def _index_plans(self, ts: TensorEntry, lengths: TensorEntry, columns: int) -> None:
        """Reads the plans into ``keys`` (slot order) and the slot of each plan (the first of a repeated one)."""
        timesteps = self._read_tensor(ts).view(torch.float32).view(tuple(ts.shape))
        counts = self._read_tensor(lengths).view(torch.int64)
        if bool(((counts < 1) | (counts > self.width)).any()):
            raise _bad(self.path, f"a plan length is outside 1..{self.width}", self.argument)
        self.keys: list[PlanKey] = []
        self._slots: dict[PlanKey, int] = {}
        for s in range(self.plans):
            key = plan_key(timesteps[s, : int(counts[s])].contiguous(), columns)
            self.keys.append(key)
            if key in self._slots:
                log.warning(
                    "%s: plan %s appears twice (slots %d and %d); the first is served",
                    self.path,
                    format_plan(key, columns=columns),
                    self._slots[key],
                    s,
                )
                continue
            self._slots[key] = s

    def _spec_of(self, entries: dict[str, TensorEntry], argument: str) -> ModulationSpec:
        """The spec a file describes itself (``inspect``): a bound file's layers, else its family's tensors."""
        found = _part_tensors(entries)
        first = entries[found[0]] if found else None
        dtype = first.torch_dtype if first is not None else None
        described = self._described_geometry()
        if described is not None and dtype is not None:
            return ModulationSpec.for_geometry(described, dtype=dtype)
        try:
            fields = families.table_fields({name: tuple(e.shape) for name, e in entries.items()}, dtype)
        except ValueError as exc:
            raise _bad(self.path, str(exc), argument) from None
        return ModulationSpec(**fields)

    def _described_geometry(self) -> ModelGeometry | None:
        """The geometry a bound file's binding describes (a family's layers), if it describes one."""
        try:
            described = json.loads(self.metadata[BINDING])["spec"]
            layers = tuple(
                ServedLayer(entry[0], int(entry[1]), str(entry[2]), bool(entry[3]) if len(entry) > 3 else True)
                for entry in described["layers"]
            )
            family_name = str(described["family"])
            family = families.FAMILIES.get(family_name) or Family(family_name, family_name, (KeyLayout("diffusers"),))
            return ModelGeometry(family, layers, int(described["in_features"]), tuple(described["plan_inputs"]))
        except (KeyError, ValueError, TypeError, ConfigError):
            return None

    def _read_binding(self) -> None:
        if self.metadata.get(BOUND) != BOUND_VERSION:
            raise _bad(
                self.path,
                f"its {BOUND} is {self.metadata.get(BOUND)!r}; this reader knows {BOUND_VERSION!r}",
                self.argument,
            )
        try:
            binding = json.loads(self.metadata[BINDING])
            digests = json.loads(self.metadata[SLOT_DIGESTS])
        except (KeyError, ValueError) as exc:
            raise _bad(self.path, f"its binding metadata is missing or not JSON ({exc})", self.argument) from None
        if not isinstance(binding, dict) or not isinstance(digests, list) or len(digests) != self.plans:
            raise _bad(self.path, f"its binding metadata is malformed (needs {self.plans} slot digests)", self.argument)
        self.binding = binding
        self.slot_digests = [str(d) for d in digests]

    def _read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        return self._read(entry.begin, entry.nbytes, entry.name)

    def read_whole(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` of the file, in its dtype and shape (read now)."""
        entry = self._entries[name]
        dtype = entry.torch_dtype
        if dtype is None:
            raise _bad(self.path, f"{name} has dtype {entry.dtype}, which torch cannot hold", self.argument)
        return self._read_tensor(entry).view(dtype).view(tuple(entry.shape))

    def read_rows(self, name: str, key: PlanKey) -> torch.Tensor | None:
        """A plan's rows of a per-row tensor ``name`` (``[P, W, ...]``: a table part or a format's extra), or None."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        entry = self._entries[name]
        dtype = entry.torch_dtype
        assert dtype is not None
        row_shape = tuple(entry.shape[2:])
        row_bytes = dtype.itemsize
        for size in row_shape:
            row_bytes *= size
        n = self.spec.plan_rows(key)
        raw = self._read(entry.begin + slot * self.width * row_bytes, n * row_bytes, name)
        return raw.view(dtype).view(n, *row_shape)

    def _read(self, offset: int, nbytes: int, what: str) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if nbytes:
                pread_into(fd, buf, offset, self.path, what)
        finally:
            os.close(fd)
        return buf

    # -- queries ----------------------------------------------------------------------------

    @property
    def model_variant(self) -> str | None:
        if self.manifest is not None:
            return str(self.manifest["model_variant"])
        return self.metadata.get("model_variant")

    @property
    def checkable(self) -> bool:
        """Whether the file names the weights it was built from (a bound file or a vLLM-Omni sidecar)."""
        return self.binding is not None or self.manifest is not None

    @property
    def content(self) -> str | None:
        """The bound content digest (None for an sglang file)."""
        return None if self.binding is None else self.binding.get("content")

    def slot_of(self, key: PlanKey) -> int | None:
        return self._slots.get(key)

    def __contains__(self, key: PlanKey) -> bool:
        return key in self._slots

    def changed(self) -> bool:
        """Whether the file on disk is no longer the one opened (rewritten, replaced, removed)."""
        try:
            return FileIdentity.of(self.path) != self.identity
        except OSError:
            return True

    def read(self, key: PlanKey) -> PlanRows | None:
        """The rows of plan ``key`` (None if absent; None, logged, if a bound slot fails its digest)."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        s = self.spec
        n, item, W = s.plan_rows(key), s.itemsize, self.width
        parts = []
        for part in s.table_parts():
            width, entry = part.stop - part.start, self._entries[part.tensor]
            raw = self._read(entry.begin + slot * W * width * item, n * width * item, part.tensor)
            parts.append(raw.view(s.dtype).view(n, *part.shape))
        rows = PlanRows(key_to_plan(key, s.plan_columns), *parts)
        if self.slot_digests is not None and slot_digest(*rows) != self.slot_digests[slot]:
            log.warning(
                "%s: slot %d (plan %s) fails its digest: not served",
                self.path,
                slot,
                format_plan(key, columns=s.plan_columns),
            )
            return None
        return rows

    def describe(self) -> dict[str, Any]:
        """What ``inspect`` shows: format, geometry, plans per width, variant, binding."""
        widths: dict[int, int] = {}
        for key in self.keys:
            rows = self.spec.plan_rows(key)
            widths[rows] = widths.get(rows, 0) + 1
        schedules: Any = None
        with contextlib.suppress(KeyError, ValueError):
            schedules = json.loads(self.metadata[SCHEDULES])
        return {
            "kind": "tables",
            "path": str(self.path),
            "format": self.format,
            "plans": self.plans,
            "width": self.width,
            "plans_per_width": dict(sorted(widths.items())),
            "model_variant": self.model_variant,
            "family": self.spec.family.name,
            "spec": self.spec.describe(),
            "bytes": self.identity.size,
            "binding": self.binding,
            "tool": self.metadata.get(TOOL),
            "created": self.metadata.get(CREATED),
            "schedules": schedules,
            "manifest": self.manifest,
        }

    def verify_slots(self) -> list[str]:
        """Problems found re-reading every slot of a bound file (empty: every digest matches)."""
        if self.slot_digests is None:
            return []
        bad = []
        for key in self._slots:
            if self.read(key) is None:
                bad.append(
                    f"slot {self._slots[key]} (plan {format_plan(key, columns=self.spec.plan_columns)}) fails "
                    "its digest"
                )
        return bad


def bound_metadata(
    *,
    binding: Mapping[str, Any],
    schedules: Sequence[Mapping[str, Any]],
    model_variant: str | None,
    spec: ModulationSpec | None = None,
) -> dict[str, str]:
    """The metadata of a bound file (slot digests are added by the writer); ``spec`` adds its family and layers."""
    meta = {
        "format_version": FORMAT_VERSION,
        BOUND: BOUND_VERSION,
        TOOL: tool_version(),
        BINDING: _canonical(binding),
        CONTENT: str(binding.get("content")),
        SCHEDULES: _canonical(list(schedules)),
        CREATED: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if spec is not None:
        meta[FAMILY] = spec.family.name
        meta[LAYERS] = _canonical(layer_table(spec))
    if model_variant is not None:
        meta["model_variant"] = model_variant
    return meta


def sglang_metadata(model_variant: str) -> dict[str, str]:
    """Exactly the two keys SGLang reads."""
    return {"format_version": FORMAT_VERSION, "model_variant": model_variant}


__all__ = [
    "FORMATS",
    "FORMAT_VERSION",
    "PLAN_TENSORS",
    "TableFile",
    "TableShapes",
    "TableWriter",
    "bound_metadata",
    "is_table_file",
    "layer_table",
    "sglang_metadata",
    "slot_digest",
    "tool_version",
]
