"""Build once, serve everywhere: export the tables of some schedules as one file, and verify such a file.

:func:`export_tables` computes the tables of a set of plans with an :class:`~adalncache.AdalnCache`
(so store entries are reused, and a ``torchrun`` group shares the passes exactly as ``build``
does) and streams them into a table file (:mod:`adalncache.tablefile`) in one of two formats:
``sglang`` (exactly SGLang's sidecar, for a family whose ``table_formats`` include it) or
``adalncache`` (the same tensors plus the binding that lets a reader verify it; every family).
:func:`verify_tables` recomputes a file's plans from a checkpoint on this machine and compares
them bit for bit. ``adalncache export`` and ``adalncache verify --tables`` are shells over these.

Step counts: ``--steps N`` is the pipeline's ``num_inference_steps`` (grid points including the
terminal 0), so it gives ``N - 1`` forwards; SGLang's ``--num-inference-steps M`` counts forwards.
A file exported with ``--steps N`` therefore serves SGLang at ``--num-inference-steps N - 1``.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .cache import AdalnCache
from .errors import ConfigError
from .plans import format_plan, key_to_plan, plan_key
from .source import CheckpointSource
from .spec import ModulationSpec
from .tablefile import FORMATS, TableFile, TableWriter, bound_metadata, sglang_metadata
from .tiers.tables import plain_json

Embed = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ExportReport:
    """What :func:`export_tables` wrote."""

    path: Path
    format: str
    plans: int
    width: int
    bytes: int
    passes: int
    store_hits: int
    built: int
    content: str | None


def check_export(
    spec: ModulationSpec, *, format: str, precision: str, model_variant: str | None, tasks: Sequence[str]
) -> None:
    """Refuse, before any work, what the target format cannot express (ConfigError naming the flag)."""
    family = spec.family
    if format not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format not in family.table_formats:
        raise ConfigError(
            f"--format {format} cannot hold {family.title} tables (that format serves only the families whose tables "
            f"its engine loads); use --format {' or '.join(family.table_formats)}"
        )
    variants = family.model_variants
    if model_variant is not None and not variants:
        raise ConfigError(f"--model-variant does not apply to {family.title} tables: drop it")
    if model_variant is not None and model_variant not in variants:
        raise ConfigError(f"--model-variant must be one of {', '.join(variants)}, got {model_variant!r}")
    if format == "sglang":
        if spec.dtype != torch.bfloat16:
            raise ConfigError(
                f"--format sglang holds bfloat16 tables only (SGLang checks the dtype), but this checkpoint's "
                f"projections are {str(spec.dtype).removeprefix('torch.')}: use --format adalncache"
            )
        if precision != "match":
            raise ConfigError(
                f"--format sglang cannot hold --precision {precision} tables: SGLang serves the file as the "
                f"resident projection's output (precision match); use --precision match or --format adalncache"
            )
        if model_variant is None and variants:
            raise ConfigError(
                f"--format sglang needs --model-variant {' or '.join(variants)}: SGLang compares it with its own "
                f"--model-variant ({_runs_on(family)})"
            )
    if model_variant is not None:
        wrong = sorted({t for t in tasks if family.variant_of(t) != model_variant})
        if wrong:
            raise ConfigError(
                f"--model-variant {model_variant} does not serve --task {', '.join(wrong)} ({_runs_on(family, 'the ')}"
                f"): export one file per transformer"
            )


def _runs_on(family: Any, article: str = "") -> str:
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


def check_output(path: Path, inputs: Iterable[Path] = (), *, needs: int | None = None) -> None:
    """Refuse, before any pass, an output path the export must not write (ConfigError naming ``-o``).

    ``-o`` must be a new name, or a regular file that is none of ``inputs`` (the checkpoint's files
    and index: same device and inode, so a link to one of them counts as that file); never a
    directory, a FIFO, a device or a socket, whose replacement by a file destroys what was there.
    Its directory must exist and be writable, and, when ``needs`` (bytes) is given and the system
    can tell, have room for the file.
    """
    try:
        st = os.stat(path)  # follows links: writing "through" a link to an input is writing the input
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"-o/--output {path} cannot be used: {exc}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"-o/--output {path} is a directory: name the table file to write")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"-o/--output {path} is not a regular file (a FIFO, a device or a socket), which the table file would "
                f"replace: name a new file, or a table file to replace"
            )
        for source in inputs:
            try:
                other = os.stat(source)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                raise ConfigError(
                    f"-o/--output {path} is {source}, which this export reads (the checkpoint): writing the tables "
                    f"there would destroy it; name another file"
                )
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"-o/--output {path}: its directory {parent} does not exist or is not writable")
    if needs is not None:
        try:
            vfs = os.statvfs(parent)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            return
        if needs > free:
            raise ConfigError(
                f"-o/--output {path}: the table file needs {needs} bytes ({needs / 2**20:.1f} MiB) but its disk has "
                f"{free} bytes free: free some space, or name a file on another disk"
            )


def source_files(source: Any) -> list[Path]:
    """The files a weight source reads (a checkpoint's files and index; none for tensors in memory)."""
    files = [Path(f) for f in getattr(source, "files", None) or []]
    index = getattr(source, "index", None)
    return files + ([Path(index)] if index is not None else [])


def export_tables(
    cache: AdalnCache,
    plans: Sequence[torch.Tensor],
    out: str | os.PathLike[str],
    *,
    embed: Embed,
    format: str = "adalncache",
    model_variant: str | None = None,
    tasks: Sequence[str] = (),
    schedules: Sequence[Mapping[str, Any]] = (),
    progress: bool = True,
) -> ExportReport:
    """Compute the tables of ``plans`` with ``cache`` and write them to ``out`` (rank 0 writes in a group).

    ``plans``: distinct plans in slot order (``schedule_plans`` gives them). Passes of at most
    ``cache.max_plans`` plans each; the cache's slab is scratch, the file is the product. The file
    appears at ``out`` only once complete (a temporary file is renamed into place): an interrupted
    or failed export leaves ``out`` as it was. In a process group every rank calls this.
    """
    spec = cache.spec
    check_export(spec, format=format, precision=cache.precision, model_variant=model_variant, tasks=tasks)
    path = Path(out)
    inputs = [*source_files(cache.source), *([t.path for t in cache.tables.files] if cache.tables else [])]
    writer = TableWriter(path, spec, plans, bound=format == "adalncache") if cache.rank == 0 else None
    check_output(path, inputs, needs=writer.nbytes if writer is not None else None)
    if writer is not None:
        # Created now, so an unwritable -o fails before the passes rather than after them. The
        # header is sized for the final metadata: a binding is well under the 2 KiB placeholder.
        if format == "sglang":
            assert model_variant is not None
            writer.open(sglang_metadata(model_variant))
        else:
            writer.open(
                bound_metadata(binding={"~": "~" * 2048}, schedules=schedules, model_variant=model_variant, spec=spec)
            )
    keys = [plan_key(p, spec.plan_columns) for p in plans]
    passes = store_hits = built = 0
    try:
        chunks = [list(range(i, min(i + cache.max_plans, len(plans)))) for i in range(0, len(plans), cache.max_plans)]
        for chunk in tqdm(chunks, desc="adalncache export", unit="pass", disable=not progress or len(chunks) < 2):
            report = cache.build([plans[i] for i in chunk], embed=embed)
            passes, store_hits, built = passes + report.passes, store_hits + report.store_hits, built + report.built
            if writer is not None:
                for index in chunk:
                    writer.write_slot(index, cache.rows_of(keys[index]))
            cache.invalidate()
        binding = cache.binding() if format == "adalncache" else None  # (a collective in a group)
        if format == "adalncache" and binding is None:
            raise ConfigError(
                "the content digest of the checkpoint could not be composed (a column split whose world size does "
                "not divide 64 cuts the hashed row blocks): export the bound format with --shard layers or 2, 4, 8 "
                "ranks, or use --format sglang"
            )
        if writer is None:
            return ExportReport(path, format, len(plans), max(spec.plan_rows(k) for k in keys), 0, passes, store_hits,
                                built, None if binding is None else binding["content"])  # fmt: skip
        if format == "sglang":
            assert model_variant is not None
            metadata = sglang_metadata(model_variant)
        else:
            assert binding is not None
            metadata = bound_metadata(binding=binding, schedules=schedules, model_variant=model_variant, spec=spec)
        writer.finish(metadata)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return ExportReport(
        path, format, len(plans), writer.width, path.stat().st_size, passes, store_hits, built,
        None if binding is None else binding["content"],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# verify


@dataclass
class TablesVerifyReport:
    """What :func:`verify_tables` found."""

    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    #: Bound files: the content digest of the checkpoint here, and whether the file names it.
    content: str | None = None
    content_matches: bool | None = None
    #: Binding fields (environment, shard) that differ from this machine: bits are then not expected to match.
    foreign: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.corrupt) and self.content_matches is not False


def verify_tables(
    table: TableFile,
    source: CheckpointSource,
    *,
    embed: Embed,
    device: str | torch.device = "cpu",
    max_plans: int = 64,
    read_ahead: int = 1,
    sample: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> TablesVerifyReport:
    """Recompute ``table``'s plans from ``source`` on this machine and compare every row with ``torch.equal``.

    Always per plan (never batched), at the file's precision (a bound file's; an sglang file is
    ``match``). For a bound file the pass hashes the checkpoint as it reads it and the result is
    compared with the file's content digest; binding fields that differ from this machine are
    listed in ``foreign`` (a mismatch is then expected, not a fault of the file).
    """
    if sample is not None and sample < 1:
        raise ConfigError(f"sample must be a positive number of plans, got {sample}: set --sample")
    spec = source.spec
    if table.spec != spec:
        raise ConfigError(f"{table.path} holds tables of another geometry than --checkpoint")
    binding = table.binding or {}
    precision = str(binding.get("precision", "match"))
    report = TablesVerifyReport()
    keys = list(dict.fromkeys(table.keys))
    if sample is not None and sample < len(keys):
        keys = random.Random(seed).sample(keys, sample)
    chunks = [keys[i : i + max_plans] for i in range(0, len(keys), max_plans)]
    cache = AdalnCache(
        spec, source, max_plans=max(1, min(max_plans, len(keys))), max_plan_width=table.width, device=device,
        precision=precision, read_ahead=read_ahead, progress=progress, batched=False, tiled=False,
    )  # fmt: skip
    columns = spec.plan_columns
    for chunk in tqdm(chunks, desc="adalncache verify --tables", unit="pass", disable=not progress):
        cache.build([key_to_plan(k, columns) for k in chunk], embed=embed)
        for key in chunk:
            shown = format_plan(key, columns=columns)
            stored = table.read(key)
            if stored is None:
                report.corrupt.append(f"slot {table.slot_of(key)} (plan {shown}) fails its digest")
                continue
            fresh = cache.rows_of(key)
            report.checked += 1
            if not all(torch.equal(a.cpu(), b) for a, b in zip(fresh.parts, stored.parts, strict=True)):
                report.mismatched.append(f"plan {shown} (slot {table.slot_of(key)}) differs")
        cache.invalidate()
    if table.binding is not None:
        report.content = cache.identify()
        report.content_matches = report.content == table.content
        here = cache.binding() or {}
        report.foreign = [
            key for key in ("environment", "shard") if plain_json(binding.get(key)) != plain_json(here.get(key))
        ]
    return report


__all__ = [
    "ExportReport",
    "TablesVerifyReport",
    "check_export",
    "check_output",
    "export_tables",
    "source_files",
    "verify_tables",
]
