"""Build once, serve everywhere: export the tables of some schedules as one file, and verify such a file.

:func:`export_tables` computes the tables of a set of plans with an :class:`~adalncache.AdalnCache`
(so store entries are reused, and a ``torchrun`` group shares the passes exactly as ``build``
does) and streams them into a table file (:mod:`adalncache.tablefile`) in one of three formats:
``sglang`` (exactly SGLang's sidecar, for a family whose ``table_formats`` include it),
``adalncache`` (the same tensors plus the binding that lets a reader verify it; every family) or
``vllm-omni`` (vLLM-Omni's weight-bound sidecar of one schedule, :mod:`adalncache.vllm_omni`).
:func:`verify_tables` recomputes a file's plans from a checkpoint on this machine and compares
them bit for bit. ``adalncache export`` and ``adalncache verify --tables`` are shells over these.

Step counts: ``--steps N`` is the pipeline's ``num_inference_steps`` (grid points including the
terminal 0), so it gives ``N - 1`` forwards; SGLang's ``--num-inference-steps M`` counts forwards.
A file exported with ``--steps N`` therefore serves SGLang at ``--num-inference-steps N - 1``.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import vllm_omni
from .cache import AdalnCache
from .errors import ConfigError
from .identity import plain_json
from .options import flag
from .plans import format_plan, key_to_plan, plan_key
from .source.checkpoint import CheckpointSource
from .spec import ModulationSpec
from .tablefile import FORMATS, TableFile, TableWriter, bound_metadata, sglang_metadata
from .verify import check_sample, chunked, same_rows, sampled, verifying_cache

log = logging.getLogger(__name__)

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
    fmt, variant, prec = flag("format"), flag("model_variant"), flag("precision")
    if format not in FORMATS:
        raise ConfigError(f"{fmt} must be one of {', '.join(FORMATS)}, got {format!r}")
    if format not in family.table_formats:
        raise ConfigError(
            f"{fmt} {format} cannot hold {family.title} tables (that format serves only the families whose tables "
            f"its engine loads); use {fmt} {' or '.join(family.table_formats)}"
        )
    variants = family.model_variants
    if model_variant is not None and not variants:
        raise ConfigError(f"{variant} does not apply to {family.title} tables: drop it")
    if model_variant is not None and model_variant not in variants:
        raise ConfigError(f"{variant} must be one of {', '.join(variants)}, got {model_variant!r}")
    if format == "sglang":
        if spec.dtype != torch.bfloat16:
            raise ConfigError(
                f"{fmt} sglang holds bfloat16 tables only (SGLang checks the dtype), but this checkpoint's "
                f"projections are {str(spec.dtype).removeprefix('torch.')}: use {fmt} adalncache"
            )
        if precision != "match":
            raise ConfigError(
                f"{fmt} sglang cannot hold {prec} {precision} tables: SGLang serves the file as the "
                f"resident projection's output (precision match); use {prec} match or {fmt} adalncache"
            )
        if model_variant is None and variants:
            raise ConfigError(
                f"{fmt} sglang needs {variant} {' or '.join(variants)}: SGLang compares it with its own "
                f"{variant} ({_runs_on(family)})"
            )
    if model_variant is not None:
        wrong = sorted({t for t in tasks if family.variant_of(t) != model_variant})
        if wrong:
            raise ConfigError(
                f"{variant} {model_variant} does not serve {flag('task')} {', '.join(wrong)} "
                f"({_runs_on(family, 'the ')}): export one file per transformer"
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
        raise ConfigError(f"{flag('output')} {path} cannot be used: {exc}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{flag('output')} {path} is a directory: name the table file to write")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"{flag('output')} {path} is not a regular file (a FIFO, a device or a socket), which the table file "
                f"would replace: name a new file, or a table file to replace"
            )
        for source in inputs:
            try:
                other = os.stat(source)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                raise ConfigError(
                    f"{flag('output')} {path} is {source}, which this export reads (the checkpoint): writing the "
                    f"tables there would destroy it; name another file"
                )
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag('output')} {path}: its directory {parent} does not exist or is not writable")
    if needs is not None:
        try:
            vfs = os.statvfs(parent)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            return
        if needs > free:
            raise ConfigError(
                f"{flag('output')} {path}: the table file needs {needs} bytes ({needs / 2**20:.1f} MiB) but its disk "
                f"has {free} bytes free: free some space, or name a file on another disk"
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
    embed: Embed | None = None,
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
    if format == vllm_omni.FORMAT:
        if embed is not None:
            raise ConfigError(
                f"{flag('format')} {format} computes the projections' input itself (vLLM-Omni's fp32 time "
                "embedding, from the "
                f"checkpoint's time embedder): drop embed="
            )
        return _export_sidecar(cache, plans, path, model_variant=model_variant, schedules=schedules, progress=progress)
    if embed is None:
        raise ConfigError(f"export_tables(format={format!r}) needs embed= (the projections' input for a plan)")
    if format == "adalncache":
        cache.hash_passes = True  # the file is bound to the content digest its passes learn (no second read)
    writer = _opened_writer(cache, plans, path, format=format, model_variant=model_variant, schedules=schedules)
    keys = [plan_key(p, spec.plan_columns) for p in plans]
    try:
        passes, store_hits, built = _write_passes(
            cache, plans, keys, writer, lambda batch: cache.build(batch, embed=embed), progress=progress
        )
        binding = cache.binding() if format == "adalncache" else None  # (a collective in a group)
        if format == "adalncache" and binding is None:
            raise ConfigError(
                "the content digest of the checkpoint could not be composed (a column split whose world size does "
                f"not divide 64 cuts the hashed row blocks): export the bound format with {flag('shard')} layers or "
                f"2, 4, 8 ranks, or use {flag('format')} sglang"
            )
        if writer is None:
            return ExportReport(
                path,
                format,
                len(plans),
                max(spec.plan_rows(k) for k in keys),
                0,
                passes,
                store_hits,
                built,
                None if binding is None else binding["content"],
            )
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
        path,
        format,
        len(plans),
        writer.width,
        path.stat().st_size,
        passes,
        store_hits,
        built,
        None if binding is None else binding["content"],
    )


def _opened_writer(
    cache: AdalnCache,
    plans: Sequence[torch.Tensor],
    path: Path,
    *,
    format: str,
    model_variant: str | None,
    schedules: Sequence[Mapping[str, Any]],
) -> TableWriter | None:
    """Rank 0's writer of a bound or SGLang file, its header written; ``None`` on the other ranks.

    Created before the passes, so an unwritable output fails before them rather than after. The
    header is sized for the final metadata: a binding is well under the 2 KiB placeholder.
    """
    spec = cache.spec
    inputs = [*source_files(cache.source), *([t.path for t in cache.tables.files] if cache.tables else [])]
    writer = TableWriter(path, spec, plans, bound=format == "adalncache") if cache.rank == 0 else None
    check_output(path, inputs, needs=writer.nbytes if writer is not None else None)
    if writer is not None:
        if format == "sglang":
            assert model_variant is not None
            writer.open(sglang_metadata(model_variant))
        else:
            writer.open(
                bound_metadata(binding={"~": "~" * 2048}, schedules=schedules, model_variant=model_variant, spec=spec)
            )
    return writer


def _write_passes(
    cache: AdalnCache,
    plans: Sequence[torch.Tensor],
    keys: Sequence[Any],
    writer: TableWriter | None,
    build: Callable[[list[torch.Tensor]], Any],
    *,
    progress: bool,
    extra: Callable[[TableWriter, int], None] | None = None,
) -> tuple[int, int, int]:
    """Builds ``plans`` in passes of at most ``cache.max_plans`` plans and writes each pass's rows (and
    ``extra``) to ``writer`` before the next pass reuses the slab; returns (passes, store hits, built)."""
    passes = store_hits = built = 0
    chunks = [list(range(i, min(i + cache.max_plans, len(plans)))) for i in range(0, len(plans), cache.max_plans)]
    for chunk in tqdm(chunks, desc="adalncache export", unit="pass", disable=not progress or len(chunks) < 2):
        report = build([plans[i] for i in chunk])
        passes, store_hits, built = passes + report.passes, store_hits + report.store_hits, built + report.built
        if writer is not None:
            for index in chunk:
                writer.write_slot(index, cache.rows_of(keys[index]))
                if extra is not None:
                    extra(writer, index)
        cache.invalidate()
    return passes, store_hits, built


def _sidecar_schedule(plans: Sequence[torch.Tensor], schedules: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The one schedule of a vLLM-Omni sidecar, its plans checked against ``plans`` (ConfigError otherwise)."""
    if len(schedules) != 1:
        raise ConfigError(
            f"{flag('format')} {vllm_omni.FORMAT} holds exactly one schedule (vLLM-Omni binds the file to it), got "
            f"{len(schedules)}: pass schedules=[schedule_contract(...)] and export one file per schedule"
        )
    try:
        contract = vllm_omni.schedule_contract(**dict(schedules[0]))
    except TypeError as exc:
        keys = ", ".join(vllm_omni.SCHEDULE_KEYS)
        raise ConfigError(f"the schedule of a {vllm_omni.FORMAT} file takes {keys}: {exc}") from None
    derived = vllm_omni.timestep_plans(contract)
    if len(plans) != len(derived) or not all(torch.equal(a.float(), b) for a, b in zip(plans, derived)):
        raise ConfigError(
            "plans must be exactly the schedule's plans in vLLM-Omni's order (vllm_omni.timestep_plans(contract)): "
            "its loader refuses a file with any other plans"
        )
    return contract


def _check_sidecar(
    cache: AdalnCache,
    plans: Sequence[torch.Tensor],
    model_variant: str | None,
    schedules: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, Any], str]:
    """The schedule and model variant of a vLLM-Omni sidecar of ``plans``, or a ConfigError saying what to change."""
    spec = cache.spec
    contract = _sidecar_schedule(plans, schedules)
    variant = vllm_omni.check_export(
        spec,
        precision=cache.precision,
        model_variant=model_variant,
        contract=contract,
        variant=cache.variant,
        shard=cache.shard,
        world_size=cache.world_size,
    )
    if cache.store is not None or cache.tables is not None:
        raise ConfigError(
            f"{flag('format')} {vllm_omni.FORMAT} projects every plan from vLLM-Omni's own time embedding, "
            "which store entries "
            f"and table files do not record (they may hold rows of another input): drop {flag('store')} "
            "(store=, tables=)"
        )
    return contract, variant


def _export_sidecar(
    cache: AdalnCache,
    plans: Sequence[torch.Tensor],
    path: Path,
    *,
    model_variant: str | None,
    schedules: Sequence[Mapping[str, Any]],
    progress: bool,
) -> ExportReport:
    """Write vLLM-Omni's weight-bound sidecar (:mod:`adalncache.vllm_omni`); see :func:`export_tables`.

    The projections' weight digests are taken from the bytes the passes project with (a layer no
    pass of this process read, another rank's in a layer split, is hashed by one read at the end);
    the payload digests by reading the finished tensors back from the temporary file before it is
    renamed into place. No store or table file is used: their rows record no projection input.
    """
    spec = cache.spec
    contract, variant = _check_sidecar(cache, plans, model_variant, schedules)
    embedding = vllm_omni.TimeEmbedding(cache.source, spec, cache.device)
    # Resident plans were built from whatever embed= their build had: projected again here.
    cache.invalidate()
    inputs = source_files(cache.source)
    extras = {vllm_omni.EMBEDDINGS: ((spec.time_embed_dim,), torch.float32)}
    writer = TableWriter(path, spec, plans, bound=False, extras=extras) if cache.rank == 0 else None
    check_output(path, inputs, needs=writer.nbytes if writer is not None else None)
    digests = vllm_omni.WeightDigests(spec)
    manifest = functools.partial(
        vllm_omni.manifest,
        spec=spec,
        embedding=embedding,
        contract=contract,
        model_variant=variant,
        math_block=vllm_omni.math_of_device(cache.device),
    )
    placeholder = {name: "0" * 64 for name in [*vllm_omni.weight_names(spec), *vllm_omni.PAYLOAD]}
    if writer is not None:
        writer.open(vllm_omni.metadata(manifest(weights=placeholder, payload=placeholder)))
    keys = [plan_key(p, spec.plan_columns) for p in plans]
    try:
        passes, store_hits, built = _write_passes(
            cache,
            plans,
            keys,
            writer,
            lambda batch: cache.build(batch, embed=embedding.embed, project=digests.project),
            progress=progress,
            extra=lambda out, index: out.write_extra(vllm_omni.EMBEDDINGS, index, embedding.temb(plans[index])),
        )
        if writer is None:
            return ExportReport(
                path, vllm_omni.FORMAT, len(plans), _width(spec, keys), 0, passes, store_hits, built, None
            )
        digests.complete(cache.source, read_ahead=cache.read_ahead)
        found = manifest(weights={**embedding.digests, **digests.digests}, payload=_payload_digests(writer))
        writer.finish(vllm_omni.metadata(found))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    log.info(
        "%s: weight digests of %d layer(s) taken during the passes, %d by a hashing read",
        path,
        digests.from_passes,
        digests.from_read,
    )
    return ExportReport(
        path, vllm_omni.FORMAT, len(plans), writer.width, path.stat().st_size, passes, store_hits, built, None
    )


def _width(spec: ModulationSpec, keys: Sequence[Any]) -> int:
    """The widest plan of ``keys``: a file's ``W``."""
    return max(spec.plan_rows(k) for k in keys)


def _payload_digests(writer: TableWriter) -> dict[str, str]:
    """The sidecar's payload digests, of its tensors as written (read back); non-finite values are refused."""
    payload = {}
    for name in vllm_omni.PAYLOAD:
        value = writer.read_back(name)
        if not bool(torch.isfinite(value).all()):
            raise ConfigError(f"the {name} of this export hold non-finite values: vLLM-Omni refuses such a file")
        payload[name] = vllm_omni.tensor_sha256(value)
    return payload


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
    #: Binding fields (environment, shard; a vLLM-Omni sidecar's math) that differ from this machine: bits are
    #: then not expected to match.
    foreign: list[str] = field(default_factory=list)
    #: A vLLM-Omni sidecar: the weights whose digest in its manifest differs from the checkpoint's.
    weights_mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.corrupt or self.weights_mismatched) and self.content_matches is not False


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
    check_sample(sample, "plans")
    spec = source.spec
    if table.spec != spec:
        raise ConfigError(f"{table.path} holds tables of another geometry than {flag('checkpoint')}")
    binding = table.binding or {}
    precision = str(binding.get("precision", "match"))
    report = TablesVerifyReport()
    keys = sampled(list(dict.fromkeys(table.keys)), sample, seed)
    cache = verifying_cache(
        spec,
        source,
        plans=min(max_plans, len(keys)),
        width=table.width,
        device=device,
        precision=precision,
        read_ahead=read_ahead,
        progress=progress,
    )
    cache.hash_passes = table.binding is not None  # a bound file's content is checked against what the passes read
    columns = spec.plan_columns
    # A vLLM-Omni sidecar holds rows of vLLM-Omni's own time embedding, and binds its weights by digest:
    # both are recomputed here, the projections' digests from the bytes the passes project with.
    embedding = vllm_omni.TimeEmbedding(source, spec, device) if table.manifest is not None else None
    digests = vllm_omni.WeightDigests(spec) if embedding is not None else None
    for chunk in tqdm(
        chunked(keys, max_plans), desc=f"adalncache verify {flag('tables')}", unit="pass", disable=not progress
    ):
        plans = [key_to_plan(k, columns) for k in chunk]
        if embedding is not None and digests is not None:
            cache.build(plans, embed=embedding.embed, project=digests.project)
        else:
            cache.build(plans, embed=embed)
        for key, plan in zip(chunk, plans):
            shown = format_plan(key, columns=columns)
            stored = table.read(key)
            if stored is None:
                report.corrupt.append(f"slot {table.slot_of(key)} (plan {shown}) fails its digest")
                continue
            report.checked += 1
            same = same_rows(cache, key, stored)
            if embedding is not None:
                temb = table.read_rows(vllm_omni.EMBEDDINGS, key)
                same = same and temb is not None and torch.equal(embedding.temb(plan).cpu(), temb)
            if not same:
                report.mismatched.append(f"plan {shown} (slot {table.slot_of(key)}) differs")
        cache.invalidate()
    if table.manifest is not None and embedding is not None and digests is not None:
        digests.complete(source, read_ahead=read_ahead)
        here = {**embedding.digests, **digests.digests}
        report.weights_mismatched = vllm_omni.weight_mismatches(table.manifest, here)
        if vllm_omni.math_of_device(device) != table.manifest["math"]:
            report.foreign.append("math")
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
