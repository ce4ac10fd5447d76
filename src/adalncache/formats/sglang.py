"""The layout every table file has, which is SGLang's sidecar, and the ``sglang`` format: that layout alone.

The layout (``format_version = "2"``, as SGLang checks it) holds the tables of a set of plans in one
safetensors file, one tensor per table part of the family (``spec.table_parts()``) beside the plans:

* ``plan_timesteps [P, W] float32`` (``[P, W, C]`` for plans of ``C`` columns): slot ``s`` holds a
  plan in its first ``plan_lengths[s]`` rows, zeros after;
* ``plan_lengths [P] int64``, each in ``1..W``;
* one ``[P, W, *part.shape]`` tensor per table part: the projections' outputs, rows past a plan's
  length zero (readers never read them; zeros keep the bytes deterministic). A family whose tables
  another engine reads declares that engine's parts (SGLang's sidecar: ``block_params`` and
  ``final_params``); any other family has one, ``table_rows [P, W, table_width]``.

The other formats add to it (:mod:`.adalncache` binds the file in its metadata, :mod:`.vllm_omni` adds a
per-row tensor and a manifest), so what they share lives here: :class:`TableFormat`, the interface each
format implements (its write, read and check; the defaults are the bare layout's), :class:`TableWriter`,
which streams a file slot by slot (never a whole P x W slab in memory) into a temporary file renamed into
place at the end, and :class:`Layout`, which opens a file, asks its format to check it, and reads a plan's
rows with two ``pread`` calls.

:class:`SglangFormat` is SGLang's: exactly the layout, bfloat16, and ``model_variant``, nothing else, so
SGLang loads it unmodified. It carries no binding: a reader can check its geometry and nothing more, so it
is served as ``precision="match"`` tables outside autocast, and never again once the weight source changed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .. import families
from ..errors import CheckpointError, ConfigError
from ..identity.digest import hash_hex
from ..identity.files import FileIdentity
from ..options import flag
from ..plans import PlanKey, format_plan, key_to_plan, plan_key
from ..rows import PlanRows
from ..source.header import SafetensorsHeader, TensorEntry, safetensors_name
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
    raw = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy() for t in (timesteps, *parts)]
    return hash_hex(*(p.data for p in raw))


def table_shapes(plans: int, width: int, spec: ModulationSpec) -> Shapes:
    """Shape and dtype of the plan and table-part tensors of a file of ``plans`` slots ``width`` rows wide."""
    C = spec.plan_columns
    out: Shapes = {
        "plan_timesteps": ((plans, width) if C == 1 else (plans, width, C), torch.float32),
        "plan_lengths": ((plans,), torch.int64),
    }
    for part in spec.table_parts():
        out[part.tensor] = ((plans, width, *part.shape), spec.dtype)
    return out


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for size in shape:
        n *= size
    return n


def _raw(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


# ---------------------------------------------------------------------------------------------
# the interface of a format


class Export:
    """One export in a format: how its passes compute rows, what each slot adds, the metadata it writes.

    The default is the bare layout's: rows of ``cache.build(batch, embed=embed)``, and the format's
    metadata as written before the passes.
    """

    #: The metadata key the writer records a digest per slot under, or None.
    slot_digests: str | None = None
    #: The content digest the file binds (for the report), once written.
    content: str | None = None

    def __init__(self, cache: Any, metadata: Mapping[str, str], embed: Callable[[torch.Tensor], Any]) -> None:
        self.cache, self._metadata, self._embed = cache, dict(metadata), embed
        #: Further per-row tensors the file carries beside the table parts (``[P, W, *shape]``).
        self.extras: Shapes = {}

    def build(self, batch: list[torch.Tensor]) -> Any:
        return self.cache.build(batch, embed=self._embed)

    def slot(self, writer: TableWriter, index: int, rows: PlanRows) -> None:
        writer.write_slot(index, rows)

    def placeholder(self) -> dict[str, str]:
        """The metadata written first: the final one's length at most (the header is sized from it)."""
        return self._metadata

    def finish(self, writer: TableWriter | None) -> dict[str, str]:
        """The final metadata, asked of every rank after the passes (a rank without the writer too)."""
        return self._metadata


class TableFormat:
    """One table format: how a file is written (:meth:`export`), read (:meth:`opened`) and checked.

    Each hook has the bare layout's behaviour here (a file that carries no binding: SGLang's); a format
    overrides what it adds. ``table``
    arguments are the :class:`Layout` being opened or served, ``template`` the binding (content
    left open) the cache would give tables it built now.
    """

    name = ""
    version = FORMAT_VERSION
    #: The schedule inputs (argument names) an export in this format takes; None: the family's own.
    takes: frozenset[str] | None = None
    #: Whether a file binds the projections' content digest (checked against the weight source's).
    binds_content = False
    #: Whether a file names the weights it was built from, so a reader can check it against them.
    checkable = False
    #: Whether its rows are projected from an input the format computes itself (no ``embed=``).
    own_input = False

    # -- writing ----------------------------------------------------------------------------------

    def check_export(
        self,
        spec: ModulationSpec,
        *,
        precision: str,
        model_variant: str | None,
        tasks: Sequence[str] = (),
        schedules: Sequence[Mapping[str, Any]] = (),
        shard: str = "layers",
        world_size: int = 1,
        variant: object = None,
        tiers: bool = False,
    ) -> None:
        """Refuse, before any work, what the format cannot express for this family (ConfigError naming the flag)."""
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
        """Refuse what an engine that serves the file as its resident bf16 projection cannot hold."""
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
        """The plans and schedule records the command line's inputs (``given``, by argument name) name for a format
        that takes its own (``takes``); None: the checkpoint family's schedule."""
        return None

    def export(
        self,
        cache: Any,
        plans: Sequence[torch.Tensor],
        *,
        embed: Callable[[torch.Tensor], Any] | None,
        model_variant: str | None,
        tasks: Sequence[str],
        schedules: Sequence[Mapping[str, Any]],
    ) -> Export:
        """The export of ``plans`` from ``cache``, checked (ConfigError before any pass)."""
        raise NotImplementedError

    def _checked_embed(self, cache: Any, embed: Any, model_variant: str | None, tasks: Sequence[str]) -> Any:
        """The checks of a format whose rows are the projections of the caller's ``embed``."""
        self.check_export(cache.spec, precision=cache.precision, model_variant=model_variant, tasks=tasks)
        if embed is None:
            raise ConfigError(f"export_tables(format={self.name!r}) needs embed= (the projections' input for a plan)")
        return embed

    # -- reading ----------------------------------------------------------------------------------

    def recognizes(self, metadata: Mapping[str, str]) -> bool:
        """Whether a file of this format's version with this metadata is of this format."""
        return True

    def opened(self, table: Layout, spec: ModulationSpec | None) -> ModulationSpec | None:
        """Read the format's metadata into ``table``; returns ``spec``, or the one the file describes."""
        return spec

    def check_file(self, table: Layout) -> None:
        """Refuse (ConfigError) a file, once its shapes are the spec's, that this format's rules refuse."""

    def described(self, table: Layout) -> dict[str, Any]:
        """What ``describe()`` adds for this format (its keys are among the ones it always has)."""
        return {}

    def read(self, table: Layout, slot: int, rows: PlanRows) -> bool:
        """Whether a slot's rows as read may be served (a format with slot digests checks them)."""
        return True

    # -- serving (the tier) -----------------------------------------------------------------------

    def check_cache(self, table: Layout, template: Mapping[str, Any], *, digest: str | None, source: Any) -> None:
        """Refuse (ConfigError) a file this cache cannot serve bit-exactly, at the cache's construction."""
        precision = template.get("precision")
        advice = f" or export a bound file with {flag('precision')} {precision}"
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
                f"{table.path}: an {self.name} table file holds tables computed without autocast: not served under "
                "torch.autocast"
            )
        return None if template.get("precision") == "match" else f"{table.path}: not served at another precision"

    def still_serves(self, table: Layout, source: Any) -> bool | None:
        """After the weight source changed: whether the file still serves (None: ask its content digest)."""
        log.warning(
            "%s: the weight source changed on disk and an %s table file carries no binding to check it against: "
            "no longer served",
            table.path,
            self.name,
        )
        return False

    def same_input(self, table: Layout, key: PlanKey, embed: Callable[[torch.Tensor], Any] | None) -> str | None:
        """Why this build's projection input for ``key`` is not the one the file's rows came from, or None."""
        return None

    # -- verifying and describing -------------------------------------------------------------------

    def verifier(self, table: Layout, source: Any, embed: Any, device: torch.device | str) -> Verifier:
        return Verifier(embed)

    def summary(self, info: Mapping[str, Any]) -> list[str]:
        """``inspect``'s lines about what binds the file (its ``describe()`` is ``info``)."""
        return [f"  binding: none (an {self.name} file: only its geometry can be checked)"]

    def slots_checked(self, table: Layout, quick: bool) -> str | None:
        """What ``inspect`` says of the file's slots (their digests read again unless ``quick``), or None."""
        return None


class Verifier:
    """How ``verify --tables`` recomputes a file's rows, and what it checks besides them (defaults: nothing)."""

    def __init__(self, embed: Any, project: Any = None) -> None:
        self.embed, self.project = embed, project

    def prepare(self, cache: Any) -> None:
        """Set up the recomputing cache before its passes."""

    def same(self, table: Layout, key: PlanKey, plan: torch.Tensor) -> bool:
        """What the file holds of ``key`` besides its table rows matches (checked after the rows)."""
        return True

    def finish(self, cache: Any, report: Any, read_ahead: int) -> None:
        """Fill the report's format-specific findings after the passes."""


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
    """SGLang's sidecar: the layout, bfloat16 resident-projection tables and ``model_variant``; no binding."""

    name = "sglang"
    #: SGLang's sidecar is MiniMax-H3's: its schedule is named by request kinds, steps and shifts.
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

    def export(self, cache: Any, plans: Sequence[torch.Tensor], **given: Any) -> Export:
        embed = self._checked_embed(cache, given["embed"], given["model_variant"], given["tasks"])
        return Export(cache, {"format_version": FORMAT_VERSION, "model_variant": given["model_variant"]}, embed)

    def check_file(self, table: Layout) -> None:
        family = table.spec.family
        if self.name not in family.table_formats:
            raise bad_file(
                table.path,
                f"it carries no binding, and {family.title} tables are only served from bound files "
                f"(export them with adalncache export {flag('format')} adalncache)",
                table.argument,
            )


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
        extras: Shapes | None = None,
        slot_digests: str | None = None,
    ) -> None:
        """``extras``: further per-row tensors a format carries beside the table parts, by name: each is
        ``[P, W, *shape]`` of ``dtype``, written with :meth:`write_extra` (rows past a plan's length zero).
        ``slot_digests``: the metadata key to record each slot's :func:`slot_digest` under (None: none)."""
        self.path = Path(path)
        self.spec = spec
        self.keys: list[PlanKey] = [plan_key(p, spec.plan_columns) for p in plans]
        if not self.keys:
            raise ConfigError(f"a table file needs at least one plan (check {flag('task')} and {flag('steps')})")
        if len(set(self.keys)) != len(self.keys):
            raise ConfigError("a table file holds each plan once: pass distinct plans (SGLang would serve one of them)")
        self.width = max(spec.plan_rows(k) for k in self.keys)
        shapes = table_shapes(len(self.keys), self.width, spec)
        self._extras = dict(extras or {})
        for name, (row_shape, dtype) in self._extras.items():
            if name in shapes:
                raise ConfigError(f"a table file's extra tensor cannot be named {name!r}: the layout has that tensor")
            shapes[name] = ((len(self.keys), self.width, *row_shape), dtype)
        self._shapes = shapes
        self._tensors: dict[str, Any] = {}
        self.begin: dict[str, int] = {}
        offset = 0
        for name, (shape, dtype) in shapes.items():
            nbytes = _nbytes(shape, dtype)
            self._tensors[name] = {"dtype": safetensors_name(dtype), "shape": list(shape)}
            self._tensors[name]["data_offsets"] = [offset, offset + nbytes]
            self.begin[name] = offset
            offset += nbytes
        self._data_bytes = offset
        self._digest_key = slot_digests
        self._digests = ["0" * 64] * len(self.keys)
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
        self._reserved = len(self._header(metadata)) + _SLACK
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

    def write_slot(self, index: int, rows: PlanRows) -> None:
        """Write slot ``index``'s rows (its plan is ``keys[index]``); the padding rows stay zero."""
        key, s = self.keys[index], self.spec
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
        for got, part in zip(parts, table_parts):
            self._pwrite(self.begin[part.tensor] + index * self.width * (part.stop - part.start) * s.itemsize, got)
        if self._digest_key is not None:
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
        self._pwrite(self.begin[name] + index * self.width * _nbytes(row_shape, dtype), rows)

    def read_back(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` as written so far (a format whose metadata digests its tensors reads them here)."""
        assert self._fd is not None
        shape, dtype = self._shapes[name]
        buf = torch.empty(_nbytes(shape, dtype), dtype=torch.uint8)
        if buf.numel():
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


def part_tensors(names: Any) -> tuple[str, ...] | None:
    """The table parts' tensors among ``names`` (a family's whole set), or None when no family's set is there."""
    for tensors in families.table_tensor_sets():
        if all(name in names for name in tensors):
            return tensors
    return None


class Layout:
    """One table file, validated and indexed; :meth:`read` returns a plan's rows.

    ``spec``: the geometry and dtype the file must have (None: taken from the file, for
    ``inspect``). ``argument``: how messages name the file's setting (``tables=``, ``--tables``).
    ``formats``: the formats a file may be of; the first whose version and metadata it has reads and
    checks it. Raises ConfigError when the file is missing, is not safetensors, lacks or misshapes one
    of its tensors, has another ``format_version``, or its plans are malformed, or its format refuses it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        spec: ModulationSpec | None,
        *,
        argument: str,
        formats: Sequence[TableFormat],
    ) -> None:
        self.path = Path(path)
        self.argument = argument
        #: A vLLM-Omni sidecar's manifest; a bound file's binding and slot digests (None for the other formats).
        self.manifest: dict[str, Any] | None = None
        self.binding: dict[str, Any] | None = None
        self.slot_digests: list[str] | None = None
        #: What a format remembers of its checks of this file (its weight digests per source, say).
        self.memo: dict[Any, Any] = {}
        entries = self._open()
        self._entries: dict[str, TensorEntry] = entries
        self._check_present(spec)
        version = self.metadata.get("format_version")
        kind = next((f for f in formats if f.version == version and f.recognizes(self.metadata)), None)
        if kind is None:
            known = {f.version: [g.name for g in formats if g.version == f.version] for f in formats}
            said = " and ".join(f"{v!r} ({' and '.join(names)} files)" for v, names in known.items())
            raise bad_file(self.path, f"its format_version is {version!r}, this reader knows {said}", argument)
        self.kind: TableFormat = kind
        self.format = kind.name
        ts, lengths = entries["plan_timesteps"], entries["plan_lengths"]
        if ts.dtype != "F32" or len(ts.shape) not in (2, 3) or lengths.dtype != "I64" or lengths.shape != ts.shape[:1]:
            raise bad_file(self.path, "plan_timesteps must be [P, W] float32 and plan_lengths [P] int64", argument)
        self.plans, self.width = ts.shape[:2]
        spec = kind.opened(self, spec)
        self.spec: ModulationSpec = spec if spec is not None else self._spec_of()
        for name, (shape, want) in table_shapes(self.plans, self.width, self.spec).items():
            entry = entries[name]
            if tuple(entry.shape) != shape or entry.torch_dtype != want:
                raise ConfigError(
                    f"{self.path} ({argument}): {name} is {list(entry.shape)} {entry.torch_dtype or entry.dtype}, "
                    f"this model needs {list(shape)} {want}: it holds another checkpoint geometry or dtype; export "
                    f"tables from this model's checkpoint (adalncache export)"
                )
        kind.check_file(self)
        self._index_plans(ts, lengths)

    def _open(self) -> dict[str, TensorEntry]:
        """The file's tensor entries; sets its identity and metadata (a ConfigError if it is no safetensors file)."""
        if not self.path.is_file():
            raise ConfigError(f"table file {self.path} does not exist ({self.argument})")
        try:
            header = SafetensorsHeader.read(self.path)
            with safe_open(str(self.path), framework="pt") as handle:
                self.metadata: dict[str, str] = dict(handle.metadata() or {})
        except (CheckpointError, OSError) as exc:
            raise bad_file(self.path, f"not a readable safetensors file: {exc}", self.argument) from None
        self.identity: FileIdentity = header.identity
        return header.entries

    def _check_present(self, spec: ModulationSpec | None) -> None:
        """Refuses a file without the plan tensors and the table parts of ``spec`` (or of its own family)."""
        if spec is not None:
            parts: Sequence[str] = [p.tensor for p in spec.table_parts()]
        else:
            parts = part_tensors(self._entries) or families.table_tensor_sets()[0]
        wanted = [*PLAN_TENSORS, *parts]
        absent = [name for name in wanted if name not in self._entries]
        if absent:
            raise bad_file(
                self.path,
                f"it has no {', '.join(absent)} tensor (a table file holds {', '.join(wanted)})",
                self.argument,
            )

    def part_dtype(self) -> torch.dtype | None:
        """The dtype of the file's first table-part tensor (what ``inspect`` takes the spec's dtype from)."""
        found = part_tensors(self._entries)
        return self._entries[found[0]].torch_dtype if found else None

    def _spec_of(self) -> ModulationSpec:
        """The spec a file of a family whose table parts determine its geometry describes (``inspect``)."""
        dtype = self.part_dtype()
        try:
            fields = families.table_fields({name: tuple(e.shape) for name, e in self._entries.items()}, dtype)
        except ValueError as exc:
            raise bad_file(self.path, str(exc), self.argument) from None
        return ModulationSpec(**fields)

    def _index_plans(self, ts: TensorEntry, lengths: TensorEntry) -> None:
        """Reads the plans into ``keys`` (slot order) and the slot of each plan (the first of a repeated one)."""
        columns = self.spec.plan_columns
        timesteps = self._read(ts.begin, ts.nbytes, ts.name).view(torch.float32).view(tuple(ts.shape))
        counts = self._read(lengths.begin, lengths.nbytes, lengths.name).view(torch.int64)
        if bool(((counts < 1) | (counts > self.width)).any()):
            raise bad_file(self.path, f"a plan length is outside 1..{self.width}", self.argument)
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

    def read_whole(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` of the file, in its dtype and shape (read now)."""
        entry = self._entries[name]
        dtype = entry.torch_dtype
        if dtype is None:
            raise bad_file(self.path, f"{name} has dtype {entry.dtype}, which torch cannot hold", self.argument)
        return self._read(entry.begin, entry.nbytes, name).view(dtype).view(tuple(entry.shape))

    def read_rows(self, name: str, key: PlanKey) -> torch.Tensor | None:
        """A plan's rows of a per-row tensor ``name`` (``[P, W, ...]``: a table part or a format's extra), or None."""
        slot = self._slots.get(key)
        return None if slot is None else self._rows(name, slot, self.spec.plan_rows(key))

    def _rows(self, name: str, slot: int, n: int) -> torch.Tensor:
        entry = self._entries[name]
        dtype = entry.torch_dtype
        assert dtype is not None
        row_shape = tuple(entry.shape[2:])
        row_bytes = _nbytes(row_shape, dtype)
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
        return self.kind.checkable

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
        """The rows of plan ``key`` (None if absent; None, logged, if its format refuses the slot as read)."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        n = self.spec.plan_rows(key)
        parts = [self._rows(part.tensor, slot, n) for part in self.spec.table_parts()]
        rows = PlanRows(key_to_plan(key, self.spec.plan_columns), *parts)
        return rows if self.kind.read(self, slot, rows) else None

    def describe(self) -> dict[str, Any]:
        """What ``inspect`` shows: format, geometry, plans per width, variant, binding."""
        widths: dict[int, int] = {}
        for key in self.keys:
            rows = self.spec.plan_rows(key)
            widths[rows] = widths.get(rows, 0) + 1
        info = {
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
            "tool": None,
            "created": None,
            "schedules": None,
            "manifest": self.manifest,
        }
        return {**info, **self.kind.described(self)}

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
