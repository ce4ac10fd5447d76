"""The layout every table file has, which is SGLang's sidecar, and the ``sglang`` format: that layout alone.

The other formats add to the layout (docs/tables.md, "Table files"), so what they share lives here: the
interface each format implements (:class:`TableFormat`, whose defaults are the bare layout's), the writer
that streams a file slot by slot into place (:class:`TableWriter`), and the reader (:class:`Layout`).
An ``sglang`` file carries no binding, so it serves only as ``precision="match"`` tables outside autocast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import families
from ..errors import CheckpointError, ConfigError
from ..identity import FileIdentity, hash_hex
from ..options import flag
from ..plans import PlanKey, format_plan, key_to_plan, plan_key
from ..slab import PlanRows
from ..source.files import SafetensorsHeader, TensorEntry, fsync_dir, safetensors_name
from ..source.reads import pread_into
from ..spec import ModulationSpec

log = logging.getLogger(__name__)

#: The layout's version, as SGLang checks it.
FORMAT_VERSION = "2"
#: The plan tensors every table file has; the table parts' tensors follow (per family).
PLAN_TENSORS = ("plan_timesteps", "plan_lengths")
_SLACK = 4096  # header bytes reserved beyond the placeholder header, so the final one always fits

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def bad_file(path: Path, what: str, argument: str) -> ConfigError:
    return ConfigError(f"{path} cannot be used as a table file ({argument}): {what}")


def slot_digest(timesteps: torch.Tensor, *parts: torch.Tensor) -> str:
    """BLAKE3 of one slot's useful bytes: its plan, then each table part's rows (first ``n`` rows each)."""
    return hash_hex(*(_raw(t) for t in (timesteps, *parts)))


def _raw(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def layout_shapes(spec: ModulationSpec, plans: int, width: int, rows: Shapes | None = None) -> Shapes:
    """Every tensor of a file of ``plans`` slots of ``width`` rows, in file order: the plans, then each per-row
    tensor (``rows``: its row shape and dtype by name; the spec's table parts when None)."""
    columns = spec.plan_columns
    rows = {part.tensor: (part.shape, spec.dtype) for part in spec.table_parts()} if rows is None else rows
    return {
        "plan_timesteps": ((plans, width) if columns == 1 else (plans, width, columns), torch.float32),
        "plan_lengths": ((plans,), torch.int64),
        **{name: ((plans, width, *shape), dtype) for name, (shape, dtype) in rows.items()},
    }


def padded_plans(plans: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan_timesteps [P, W]`` (``[P, W, C]`` for plans of ``C`` columns; zeros past each plan: never
    read, and they keep the file's bytes deterministic) and ``plan_lengths [P]``, as a file holds them."""
    timesteps = torch.zeros((len(plans), max(len(p) for p in plans), *plans[0].shape[1:]), dtype=torch.float32)
    for index, plan in enumerate(plans):
        timesteps[index, : len(plan)] = plan
    return timesteps, torch.tensor([len(p) for p in plans], dtype=torch.int64)


def _pread(fd: int, offset: int, nbytes: int, path: Path, what: str) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        pread_into(fd, buf, offset, path, what)
    return buf


class Passes:
    """How a format's rows are computed, for an export or a verification: ``cache.build`` of each batch from
    the caller's ``embed`` by default. A format that records more of each plan than its rows says what in
    :meth:`extras` (written beside the rows, and compared by a verification)."""

    #: The content digest the file binds, once an export learnt it (for its report).
    content: str | None = None

    def __init__(self, cache: Any, embed: Callable[[torch.Tensor], Any]) -> None:
        self.cache, self.embed = cache, embed
        #: The per-row tensors :meth:`extras` gives, by name: ``(row shape, dtype)``.
        self.shapes: Shapes = {}

    def build(self, batch: list[torch.Tensor]) -> Any:
        return self.cache.build(batch, embed=self.embed)

    def extras(self, plan: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}


class TableFormat:
    """One table format: its write (:meth:`export`, :meth:`metadata`), read (:meth:`opened`) and checks.

    The defaults are the bare layout's (SGLang's: no binding); a format overrides what it adds. ``table`` is
    the :class:`Layout` opened or served, ``template`` the binding (content left open) of tables built now.
    """

    name = ""
    version = FORMAT_VERSION
    #: The schedule inputs (argument names) an export in this format takes; None: the checkpoint family's.
    takes: frozenset[str] | None = None
    #: Whether a file binds the projections' content digest (the tier checks it against the source's).
    binds_content = False
    #: Whether a file names the weights it was built from, so a reader can check it against them.
    checkable = False
    #: Whether its rows are projected from an input the format computes itself (no ``embed=``).
    own_input = False
    #: The metadata key the writer records one digest per slot under (checked on every read), or None.
    slot_digests: str | None = None
    #: The metadata key that marks a file of this format among those of its version, or None (any file).
    marker: str | None = None

    def check_export(
        self, spec: ModulationSpec, *, model_variant: str | None, tasks: Sequence[str] = (), **settings: Any
    ) -> None:
        """Refuse, before any work, what the format cannot express for this family (ConfigError naming the flag).

        ``settings``: ``precision``, ``schedules``, ``shard``, ``world_size``, ``variant`` (the LoRA variant
        active) and ``tiers`` (whether a store or table files are given), for the formats that check them.
        """
        family, fmt, mv = spec.family, flag("format"), flag("model_variant")
        if self.name not in family.table_formats:
            raise ConfigError(
                f"{fmt} {self.name} cannot hold {family.title} tables (that format serves only the families whose "
                f"tables its engine loads); use {fmt} {' or '.join(family.table_formats)}"
            )
        variants = family.model_variants
        if model_variant is not None and not variants:
            raise ConfigError(f"{mv} does not apply to {family.title} tables: drop it")
        if model_variant is not None and model_variant not in variants:
            raise ConfigError(f"{mv} must be one of {', '.join(variants)}, got {model_variant!r}")
        wrong = sorted({t for t in tasks if family.variant_of(t) != model_variant}) if model_variant else []
        if wrong:
            raise ConfigError(
                f"{mv} {model_variant} does not serve {flag('task')} {', '.join(wrong)} "
                f"({runs_on(family, 'the ')}): export one file per transformer"
            )

    def _bf16_match(self, spec: ModulationSpec, precision: str, engine: str) -> None:
        """Refuse what an engine that serves the file in place of its resident bf16 projection cannot hold."""
        fmt, prec = flag("format"), flag("precision")
        if spec.dtype != torch.bfloat16:
            raise ConfigError(
                f"{fmt} {self.name} holds bfloat16 tables only ({engine} checks the dtype), but this checkpoint's "
                f"projections are {str(spec.dtype).removeprefix('torch.')}: use {fmt} adalncache"
            )
        if precision != "match":
            raise ConfigError(
                f"{fmt} {self.name} cannot hold {prec} {precision} tables: {engine} serves the file in place of "
                f"the resident projection (precision match); use {prec} match or {fmt} adalncache"
            )

    def schedule(self, checkpoint: Any, given: Mapping[str, Any]) -> tuple[list[torch.Tensor], list[Any]] | None:
        """The plans and schedule records that the command line's inputs (``given``) name for a format that
        takes its own (:attr:`takes`); None: the checkpoint family's schedule."""
        return None

    def export(self, cache: Any, plans: Sequence[torch.Tensor], **given: Any) -> Passes:
        """The passes of an export of ``plans`` from ``cache``, everything checked first (ConfigError);
        ``given``: ``export_tables``' ``embed``, ``model_variant``, ``tasks``, ``schedules``."""
        self.check_cache_export(cache, given)
        if given["embed"] is None:
            raise ConfigError(f"export_tables(format={self.name!r}) needs embed= (the projections' input for a plan)")
        return self.passes(cache, given["embed"])

    def check_cache_export(self, cache: Any, given: Mapping[str, Any]) -> None:
        """:meth:`check_export` of an export from ``cache``: its settings, and the ``export_tables`` arguments."""
        settings = {"precision": cache.precision, "shard": cache.shard, "world_size": cache.world_size}
        tiers = cache.store is not None or cache.tables is not None
        checked = {k: given[k] for k in ("model_variant", "tasks", "schedules")}
        self.check_export(cache.spec, **settings, **checked, variant=cache.variant, tiers=tiers)

    def passes(self, cache: Any, embed: Any) -> Passes:
        """How ``cache`` computes this format's rows (for an export or a verification)."""
        return Passes(cache, embed)

    def metadata(
        self, passes: Passes, given: Mapping[str, Any], writer: TableWriter | None, *, final: bool
    ) -> dict[str, str]:
        """The file's metadata: before the passes a placeholder no shorter than the final one (it sizes the
        header); after them (``final``) the real one, asked of every rank (``writer`` is None but on rank 0)."""
        return {"format_version": FORMAT_VERSION, "model_variant": given["model_variant"]}

    def opened(self, table: Layout, spec: ModulationSpec | None) -> ModulationSpec | None:
        """Read the format's metadata into ``table``; returns ``spec``, or (None given) the one the file describes."""
        return spec

    def check_file(self, table: Layout) -> None:
        """Refuse (ConfigError) a file, its shapes the spec's, that the format refuses (an unbound file for a
        family whose tables only bound files serve)."""
        family = table.spec.family
        if self.name not in family.table_formats:
            raise bad_file(
                table.path,
                f"it carries no binding, and {family.title} tables are only served from bound files "
                f"(export them with adalncache export {flag('format')} adalncache)",
                table.argument,
            )

    def check_cache(self, table: Layout, template: Mapping[str, Any], *, digest: str | None, source: Any) -> None:
        """Refuse (ConfigError) at the cache's construction a file it cannot serve bit-exactly (``digest``: the
        source's content digest, if a file binds one; ``source``: its weight source)."""
        advice = f" or export a bound file with {flag('precision')} {template.get('precision')}"
        self._check_match(table, template, f"an {self.name} table file", advice)
        log.info("%s: an %s table file carries no binding: only its geometry was checked", table.path, self.name)

    def _check_match(self, table: Layout, template: Mapping[str, Any], what: str, advice: str = "") -> None:
        precision = template.get("precision")
        if precision != "match":
            raise ConfigError(
                f"{table.path} (tables=) is {what}, which holds tables of the projection as computed (precision "
                f"'match'); this cache has precision={precision!r}: use precision='match' (CLI {flag('precision')})"
                f"{advice}"
            )

    def unfit(self, table: Layout, template: Mapping[str, Any]) -> str | None:
        """Why the file does not hold what this cache would compute now (logged once), or None when it does."""
        if (template.get("environment") or {}).get("autocast") is not None:
            return (
                f"{table.path}: an {self.name} table file holds tables computed without autocast: not served under it"
            )
        return None if template.get("precision") == "match" else f"{table.path}: not served at another precision"

    def still_serves(self, table: Layout, source: Any) -> bool | None:
        """After the weight source changed: whether the file still serves (None: ask the new content digest)."""
        what = f"an {self.name} table file carries no binding to check it against"
        log.warning("%s: the weight source changed on disk and %s: no longer served", table.path, what)
        return False

    def same_input(self, table: Layout, key: PlanKey, embed: Callable[[torch.Tensor], Any] | None) -> str | None:
        """Why this build's projection input for ``key`` is not the one the file's rows came from, or None."""
        return None

    def verified(self, table: Layout, passes: Passes, report: Any) -> None:
        """Fill ``verify --tables``' report with what the file binds, against what the passes read."""

    def described(self, table: Layout) -> dict[str, Any]:
        """What ``describe()`` says for this format (among the keys it always has)."""
        return {}

    def slots_checked(self, table: Layout, quick: bool) -> str | None:
        """What ``inspect`` says of the file's slots (their digests read again unless ``quick``), or None."""
        return None


def runs_on(family: Any, article: str = "") -> str:
    """Which model variant serves which tasks, in the family's words (``a and b run on x, c on y``)."""
    by_variant: dict[str, list[str]] = {}
    for task, variant in family.task_variants:
        by_variant.setdefault(variant, []).append(task)
    said = []
    for i, (variant, tasks) in enumerate(by_variant.items()):
        runs = " and ".join(tasks)
        target = f"{article}{variant} transformer" if article and i == 0 else variant
        said.append(f"{runs} run on {target}" if i == 0 else f"{runs} on {variant}")
    return ", ".join(said)


class SglangFormat(TableFormat):
    """SGLang's sidecar: bf16 tables and ``model_variant``, nothing else (docs/tables.md, "Table files")."""

    name = "sglang"
    #: Its schedule is MiniMax-H3's: request kinds, steps and shifts.
    takes = frozenset({"task", "steps", "video_shift", "audio_shift", "no_audio_refs"})

    def check_export(self, spec: ModulationSpec, **given: Any) -> None:
        super().check_export(spec, **given)
        self._bf16_match(spec, given["precision"], "SGLang")
        variants, mv = spec.family.model_variants, flag("model_variant")
        if given["model_variant"] is None and variants:
            raise ConfigError(
                f"{flag('format')} sglang needs {mv} {' or '.join(variants)}: SGLang compares it with its own "
                f"{mv} ({runs_on(spec.family)})"
            )


class TableWriter:
    """Writes one table file slot by slot; the file appears at ``path`` only when :meth:`finish` succeeds.

    The header is written first with placeholders of the final lengths (digests are fixed-length hex) plus
    slack, the data section is sized up front (a sparse file: padding rows read back as zeros unwritten),
    each slot when its rows are known, the real header last; a writer that dies leaves only its temporary
    file. ``extras``: a format's per-row tensors beside the table parts; ``slot_digests``: the metadata key
    to record each slot's :func:`slot_digest` under.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        spec: ModulationSpec,
        plans: Sequence[torch.Tensor],
        *,
        extras: Shapes | None = None,
        slot_digests: str | None = None,
    ) -> None:
        self.path, self.spec = Path(path), spec
        self.keys: list[PlanKey] = [plan_key(p, spec.plan_columns) for p in plans]
        if not self.keys:
            raise ConfigError(f"a table file needs at least one plan (check {flag('task')} and {flag('steps')})")
        if len(set(self.keys)) != len(self.keys):
            raise ConfigError("a table file holds each plan once: pass distinct plans (SGLang would serve one of them)")
        P, self.width = len(self.keys), max(spec.plan_rows(k) for k in self.keys)
        self._rows: Shapes = {part.tensor: (part.shape, spec.dtype) for part in spec.table_parts()}
        self._rows.update(extras or {})
        self._shapes = layout_shapes(spec, P, self.width, self._rows)
        self._tensors: dict[str, Any] = {}
        self.begin: dict[str, int] = {}
        offset = 0
        for name, (shape, dtype) in self._shapes.items():
            self.begin[name], end = offset, offset + _nbytes(shape, dtype)
            self._tensors[name] = {"dtype": safetensors_name(dtype), "shape": [*shape], "data_offsets": [offset, end]}
            offset = end
        self._data_bytes = offset
        self._digest_key = slot_digests
        self._digests = ["0" * 64] * P
        self._written = [False] * P
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
        self._reserved = len(self._header(metadata)) + _SLACK
        self._reserved += (-(8 + self._reserved)) % 64  # the data section starts 64-byte aligned
        try:
            self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(self._fd, 8 + self._reserved + self._data_bytes)
        except OSError as exc:
            raise self._failed(exc) from None
        timesteps, lengths = padded_plans([key_to_plan(k, self.spec.plan_columns) for k in self.keys])
        self._pwrite(self.begin["plan_timesteps"], timesteps)
        self._pwrite(self.begin["plan_lengths"], lengths)

    def _header(self, metadata: Mapping[str, str]) -> bytes:
        meta = dict(metadata)
        if self._digest_key is not None:
            meta[self._digest_key] = json.dumps(self._digests, separators=(",", ":"))
        return json.dumps({"__metadata__": meta, **self._tensors}, separators=(",", ":")).encode()

    def _pwrite(self, begin: int, tensor: torch.Tensor) -> None:
        assert self._fd is not None
        data, offset = _raw(tensor), 8 + self._reserved + begin
        try:
            while data:
                written = os.pwrite(self._fd, data, offset)
                data, offset = data[written:], offset + written
        except OSError as exc:  # ENOSPC, EDQUOT, EIO: a typed error, and no partial file left
            raise self._failed(exc) from None

    def write_rows(self, name: str, index: int, rows: torch.Tensor) -> None:
        """Write slot ``index``'s rows of the per-row tensor ``name`` (``[n, *shape]``: its plan's ``n`` rows)."""
        row_shape, dtype = self._rows[name]
        n = self.spec.plan_rows(self.keys[index])
        rows = rows.detach().to("cpu")
        if tuple(rows.shape) != (n, *row_shape) or rows.dtype != dtype:
            shown = format_plan(self.keys[index], columns=self.spec.plan_columns)
            raise ConfigError(
                f"{name} rows {tuple(rows.shape)} {rows.dtype} do not fit plan {shown}: need {(n, *row_shape)} {dtype}"
            )
        self._pwrite(self.begin[name] + index * self.width * _nbytes(row_shape, dtype), rows)

    def write_slot(self, index: int, rows: PlanRows, extras: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write slot ``index``'s rows (its plan is ``keys[index]``) and its ``extras``; the padding rows stay zero."""
        parts = self.spec.table_parts()
        if len(rows.parts) != len(parts):
            raise ConfigError(f"rows of {len(rows.parts)} parts do not fit a table of {len(parts)}")
        for part, got in zip(parts, rows.parts):
            self.write_rows(part.tensor, index, got)
        for name, got in (extras or {}).items():
            self.write_rows(name, index, got)
        if self._digest_key is not None:
            self._digests[index] = slot_digest(key_to_plan(self.keys[index], self.spec.plan_columns), *rows.parts)
        self._written[index] = True

    def read_back(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` as written so far (a format whose metadata digests its tensors reads them here)."""
        assert self._fd is not None
        shape, dtype = self._shapes[name]
        buf = _pread(self._fd, 8 + self._reserved + self.begin[name], _nbytes(shape, dtype), self.tmp, name)
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
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Remove the temporary file (nothing at ``path`` changes)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def part_tensors(names: Any) -> tuple[str, ...] | None:
    """The table parts' tensors among ``names`` (a family's whole set), or None when no family's set is there."""
    return next((t for t in families.table_tensor_sets() if all(name in names for name in t)), None)


class Layout:
    """One table file, validated and indexed; :meth:`read` returns a plan's rows.

    ``spec``: the geometry and dtype the file must have (None: taken from the file, for ``inspect``).
    ``argument``: how messages name the file's setting (``tables=``, ``--tables``). Raises ConfigError when the
    file is missing, is not safetensors, lacks or misshapes a tensor, has another ``format_version``, its
    plans are malformed, or its format refuses it.
    """

    #: The formats a file may be of; the first whose version and metadata it has reads and checks it.
    formats: Sequence[TableFormat] = ()

    def __init__(self, path: str | os.PathLike[str], spec: ModulationSpec | None = None, *, argument: str = "tables="):
        self.path, self.argument = Path(path), argument
        #: A vLLM-Omni sidecar's manifest; a bound file's binding and slot digests (None for the other formats).
        self.manifest: dict[str, Any] | None = None
        self.binding: dict[str, Any] | None = None
        self.slot_digests: list[str] | None = None
        #: What a format remembers of its checks of this file (its weight digests per source, say).
        self.memo: dict[Any, Any] = {}
        if not self.path.is_file():
            raise ConfigError(f"table file {self.path} does not exist ({argument})")
        try:
            header = SafetensorsHeader.read(self.path)
        except CheckpointError as exc:
            raise bad_file(self.path, f"not a readable safetensors file: {exc}", argument) from None
        self.identity: FileIdentity = header.identity
        self.metadata: dict[str, str] = header.metadata
        self._entries: dict[str, TensorEntry] = header.entries
        parts = [p.tensor for p in spec.table_parts()] if spec else part_tensors(header.entries)
        wanted = [*PLAN_TENSORS, *(parts or families.table_tensor_sets()[0])]
        absent = [name for name in wanted if name not in header.entries]
        if absent:
            what = f"it has no {', '.join(absent)} tensor (a table file holds {', '.join(wanted)})"
            raise bad_file(self.path, what, argument)
        version = self.metadata.get("format_version")
        formats = self.formats
        kind = next((f for f in formats if f.version == version and f.marker in (None, *self.metadata)), None)
        if kind is None:
            known = {f.version: " and ".join(g.name for g in formats if g.version == f.version) for f in formats}
            said = " and ".join(f"{v!r} ({names} files)" for v, names in known.items())
            raise bad_file(self.path, f"its format_version is {version!r}, this reader knows {said}", argument)
        #: Its format; whether the file names the weights it was built from (a bound file, a sidecar).
        self.kind, self.format, self.checkable = kind, kind.name, kind.checkable
        ts, lengths = header.entries["plan_timesteps"], header.entries["plan_lengths"]
        if ts.dtype != "F32" or len(ts.shape) not in (2, 3) or lengths.dtype != "I64" or lengths.shape != ts.shape[:1]:
            raise bad_file(self.path, "plan_timesteps must be [P, W] float32 and plan_lengths [P] int64", argument)
        self.plans, self.width = ts.shape[:2]
        self.spec: ModulationSpec = kind.opened(self, spec) or self._spec_of()
        self._check_shapes()
        kind.check_file(self)
        self._index_plans(ts, lengths)

    def part_dtype(self) -> torch.dtype | None:
        """The dtype of the file's first table-part tensor (what a spec read from the file takes)."""
        found = part_tensors(self._entries)
        return self._entries[found[0]].torch_dtype if found else None

    def _spec_of(self) -> ModulationSpec:
        """The spec a file of a family whose table parts determine its geometry describes (``inspect``)."""
        try:
            shapes = {name: tuple(e.shape) for name, e in self._entries.items()}
            return ModulationSpec(**families.table_fields(shapes, self.part_dtype()))
        except ValueError as exc:
            raise bad_file(self.path, str(exc), self.argument) from None

    def _check_shapes(self) -> None:
        """Refuses a plan or table-part tensor whose shape or dtype is not the one the spec needs here."""
        for name, (shape, want) in layout_shapes(self.spec, self.plans, self.width).items():
            entry = self._entries[name]
            if tuple(entry.shape) != shape or entry.torch_dtype != want:
                raise ConfigError(
                    f"{self.path} ({self.argument}): {name} is {list(entry.shape)} {entry.torch_dtype or entry.dtype}, "
                    f"this model needs {list(shape)} {want}: it holds another checkpoint geometry or dtype; export "
                    f"tables from this model's checkpoint (adalncache export)"
                )

    def _index_plans(self, ts: TensorEntry, lengths: TensorEntry) -> None:
        """Reads the plans into ``keys`` (slot order) and the slot of each plan (the first of a repeated one)."""
        columns = self.spec.plan_columns
        timesteps, counts = self.read_whole(ts.name), self.read_whole(lengths.name)
        if bool(((counts < 1) | (counts > self.width)).any()):
            raise bad_file(self.path, f"a plan length is outside 1..{self.width}", self.argument)
        self.keys: list[PlanKey] = []
        self._slots: dict[PlanKey, int] = {}
        for s in range(self.plans):
            key = plan_key(timesteps[s, : int(counts[s])].contiguous(), columns)
            self.keys.append(key)
            if self._slots.setdefault(key, s) != s:
                shown = f"plan {format_plan(key, columns=columns)} appears twice (slots {self._slots[key]} and {s})"
                log.warning("%s: %s; the first is served", self.path, shown)

    def read_whole(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` of the file, in its dtype and shape (read now)."""
        entry = self._entries[name]
        if entry.torch_dtype is None:
            raise bad_file(self.path, f"{name} has dtype {entry.dtype}, which torch cannot hold", self.argument)
        return self._read(entry.begin, entry.nbytes, name).view(entry.torch_dtype).view(tuple(entry.shape))

    def read_rows(self, name: str, key: PlanKey) -> torch.Tensor | None:
        """A plan's rows of a per-row tensor ``name`` (``[P, W, ...]``: a table part or a format's extra), or None."""
        slot = self._slots.get(key)
        return None if slot is None else self._rows(name, slot, self.spec.plan_rows(key))

    def _rows(self, name: str, slot: int, n: int) -> torch.Tensor:
        entry = self._entries[name]
        dtype, row_shape = entry.torch_dtype, tuple(entry.shape[2:])
        assert dtype is not None
        row_bytes = _nbytes(row_shape, dtype)
        raw = self._read(entry.begin + slot * self.width * row_bytes, n * row_bytes, name)
        return raw.view(dtype).view(n, *row_shape)

    def _read(self, offset: int, nbytes: int, what: str) -> torch.Tensor:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return _pread(fd, offset, nbytes, self.path, what)
        finally:
            os.close(fd)

    @property
    def model_variant(self) -> str | None:
        if self.manifest is not None:
            return str(self.manifest["model_variant"])
        return self.metadata.get("model_variant")

    @property
    def content(self) -> str | None:
        """The bound content digest (None for a file that binds none)."""
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
        """The rows of plan ``key`` (None if absent; None, logged, if the slot fails its digest)."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        n = self.spec.plan_rows(key)
        parts = [self._rows(part.tensor, slot, n) for part in self.spec.table_parts()]
        rows = PlanRows(key_to_plan(key, self.spec.plan_columns), *parts)
        if self.slot_digests is None or slot_digest(*rows) == self.slot_digests[slot]:
            return rows
        shown = format_plan(key, columns=self.spec.plan_columns)
        log.warning("%s: slot %d (plan %s) fails its digest: not served", self.path, slot, shown)
        return None

    def describe(self) -> dict[str, Any]:
        """What ``inspect`` shows: format, geometry, plans per width, variant, binding."""
        widths = Counter(self.spec.plan_rows(key) for key in self.keys)
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
            **dict.fromkeys(("tool", "created", "schedules")),
            "manifest": self.manifest,
            **self.kind.described(self),
        }

    def verify_slots(self) -> list[str]:
        """Problems found re-reading every slot of a file with slot digests (empty: every digest matches)."""
        if self.slot_digests is None:
            return []
        columns = self.spec.plan_columns
        return [
            f"slot {slot} (plan {format_plan(key, columns=columns)}) fails its digest"
            for key, slot in self._slots.items()
            if self.read(key) is None
        ]
