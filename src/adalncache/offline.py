"""Offline work on checkpoints, stores and table files, without the model: fill, export, verify, describe.

A serving process should start with its tables on disk: :func:`fill_store` and :func:`export_tables` run the
build a serving cache runs (same source, embed and binding), so they write exactly what it looks up;
:func:`verify_store` and :func:`verify_tables` recompute a sample per plan, never stacked or tiled, and
compare with ``torch.equal``. The ``adalncache build | export | verify | inspect`` commands are shells over these.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm

from .cache import AdalnCache
from .errors import ConfigError
from .formats import TableFile, table_format
from .formats.sglang import TableWriter
from .options import flag
from .plans import PlanKey, format_plan, key_to_plan, plan_key
from .slab import PlanRows
from .source import WeightSource
from .source.checkpoint import CheckpointSource
from .spec import ModulationSpec
from .tiers.store import Store, StoredEntry, binding_hash

Embed = Callable[[torch.Tensor], torch.Tensor]


def open_checkpoint(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, layout: str = "auto"
) -> tuple[ModulationSpec, CheckpointSource]:
    """The spec read from ``path``'s headers and a validated source over it."""
    spec = ModulationSpec.from_checkpoint(path, layout=layout)
    return spec, CheckpointSource(path, spec, layout=layout)


def is_store(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an adalncache store directory (it has the store's marker file)."""
    root = Path(path)
    return root.is_dir() and (root / "STORE").exists()


T = TypeVar("T")


def check_sample(sample: int | None, unit: str) -> None:
    """Refuse a sample size below one (ConfigError naming ``--sample``)."""
    if sample is not None and sample < 1:
        raise ConfigError(f"sample must be a positive number of {unit}, got {sample}: set {flag('sample')}")


def sampled(items: Sequence[T], sample: int | None, seed: int) -> list[T]:
    """``sample`` of ``items`` chosen with ``seed`` (all of them when ``sample`` is None or not smaller)."""
    if sample is not None and sample < len(items):
        return random.Random(seed).sample(list(items), sample)
    return list(items)


def _in_passes(
    cache: AdalnCache, plans: Sequence[torch.Tensor], build: Callable[[list[torch.Tensor]], Any], desc: str, **bar: Any
) -> Iterator[tuple[range, Any]]:
    """``plans`` built ``cache.max_plans`` at a time: each pass's (indices, report), used before the next pass
    reuses the slab, which is scratch here (the product is a store, a file or a comparison). ``bar``:
    ``progress``, and ``least`` passes that show a bar (default 2)."""
    per = max(1, cache.max_plans)
    chunks = [range(i, min(i + per, len(plans))) for i in range(0, len(plans), per)]
    for chunk in tqdm(chunks, desc=desc, unit="pass", disable=not bar["progress"] or len(chunks) < bar.get("least", 2)):
        yield chunk, build([plans[i] for i in chunk])
        cache.invalidate()


def verifying_cache(
    spec: ModulationSpec, source: WeightSource, *, plans: int, width: int, **options: Any
) -> AdalnCache:
    """A cache that recomputes ``plans`` plans of up to ``width`` rows, always whole and per plan (never
    stacked or tiled: this is what confirms tables that were built so); ``options``: device, precision,
    read_ahead, progress."""
    return AdalnCache(
        spec, source, max_plans=max(1, plans), max_plan_width=width, batched=False, tiled=False, **options
    )


def same_rows(cache: AdalnCache, key: PlanKey, stored: PlanRows) -> bool:
    """Whether the cache's recomputed rows of ``key`` equal ``stored``, part for part (``torch.equal``)."""
    fresh = cache.rows_of(key)
    return len(fresh.parts) == len(stored.parts) and all(_same(a, b) for a, b in zip(fresh.parts, stored.parts))


def _same(fresh: torch.Tensor, stored: torch.Tensor | None) -> bool:
    return stored is not None and torch.equal(fresh.cpu(), stored)


@dataclass
class FillReport:
    """What :func:`fill_store` did: plans asked for, found stored, built, and the passes it took."""

    plans: int
    already_stored: int
    built: int
    passes: int
    binding: str


def fill_store(cache: AdalnCache, plans: Sequence[torch.Tensor], *, embed: Embed, progress: bool = True) -> FillReport:
    """Build every plan ``cache``'s store lacks, in passes of at most ``cache.max_plans`` plans (the slab is
    scratch). A failed store write raises ConfigError naming ``--store``: the build did not do its job. Under a
    process group every rank calls this with the same plans.
    """
    store = cache.store
    if store is None:
        raise ConfigError(
            f"fill_store needs a cache with a store: pass AdalnCache(..., store=DIR) (CLI {flag('store')})"
        )
    keys = [plan_key(p, cache.spec.plan_columns) for p in plans]
    # In a group every rank must pass the same chunks: build() agrees on store hits across ranks itself. Alone,
    # existence by name only: verifying every entry would cost as much as a pass on a large store (a corrupt
    # entry is caught by the serving cache's read, or by verify). No binding while the digest is unknown.
    binding = cache.binding() if cache.world_size == 1 else None
    stored: set[PlanKey] = store.contains(binding, keys) if binding is not None else set()
    todo = [p for p, key in zip(plans, keys) if key not in stored]
    unwritable = cache.stats.store_unwritable
    built = passes = failures = hits = 0
    for _, report in _in_passes(
        cache, todo, lambda chunk: cache.build(chunk, embed=embed), "adalncache build", progress=progress
    ):
        built, passes = built + report.built, passes + report.passes
        hits, failures = hits + report.store_hits, failures + report.tier_write_failures
    skipped = cache.stats.store_unwritable - unwritable
    if failures or skipped:
        raise ConfigError(
            f"{failures} store write(s) failed under {store.path}"
            f"{f' and {skipped} pass(es) could not write it at all' if skipped else ''} (see the log, -v): check the "
            f"directory's free space and permissions ({flag('store')})"
        )
    return FillReport(len(plans), len(stored) + hits, built, passes, _binding_hash(cache))


def _binding_hash(cache: AdalnCache) -> str:
    binding = cache.binding()
    return binding_hash(binding) if binding is not None else "unbound"


@dataclass
class VerifyReport:
    """What :func:`verify_store` or :func:`verify_tables` found: entries recomputed, those that differ, those
    unreadable, and what the entries bind, against this machine."""

    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    #: A store: its entries under bindings this machine would not use (not checked).
    other_bindings: int = 0
    #: A bound file: the content digest of the checkpoint here, and whether the file names it.
    content: str | None = None
    content_matches: bool | None = None
    #: What a file binds (environment, shard; a sidecar's math) that differs from this machine: bits are then
    #: not expected to match.
    foreign: list[str] = field(default_factory=list)
    #: A file that binds its weights by digest (a vLLM-Omni sidecar): those that differ (None for the others).
    weights_mismatched: list[str] | None = None

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.corrupt or self.weights_mismatched) and self.content_matches is not False


def _local_hashes(
    spec: ModulationSpec, source: CheckpointSource, device: str | torch.device, store: Store
) -> dict[str, str]:
    """The binding hash a cache here would use, per precision (the content digest from the memo, or hashed)."""
    out = {}
    for precision in ("match", "fp32"):
        probe = AdalnCache(spec, source, max_plans=1, max_plan_width=1, device=device, precision=precision, store=store)
        probe.identify()
        out[precision] = _binding_hash(probe)
    return out


def verify_store(
    store: Store,
    spec: ModulationSpec,
    source: CheckpointSource,
    *,
    embed: Embed,
    device: str | torch.device = "cpu",
    max_plans: int = 64,
    read_ahead: int = 1,
    sample: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> VerifyReport:
    """Recompute ``store``'s entries for this checkpoint on this machine and compare with ``torch.equal``.

    Only entries under a binding this machine would use (per precision) can be checked; the others are
    counted. ``sample``: that many entries per binding, chosen with ``seed``; ``max_plans`` at a time (one
    slab's worth of memory). ConfigError when the store holds nothing for this checkpoint here.
    """
    check_sample(sample, "entries")
    entries = store.entries()
    by_binding: dict[str, list[Any]] = {}
    for entry in entries:
        by_binding.setdefault(entry.binding, []).append(entry)
    report = VerifyReport()
    hashes = _local_hashes(spec, source, device, store)
    if not any(h in by_binding for h in hashes.values()):
        raise ConfigError(
            f"{store.path} holds no entries for this checkpoint on this machine ({len(entries)} entries under other "
            f"bindings: other projections or other modules upstream of them, such as the time embedder, another "
            f"device or torch): check {flag('checkpoint')} and {flag('device')}, or run adalncache build first"
        )
    per = max(1, max_plans)  # one pass, one slab's worth, each
    for precision, bhash in ((p, h) for p, h in hashes.items() if h in by_binding):
        infos = sampled(by_binding[bhash], sample, seed)
        chunks = [infos[i : i + per] for i in range(0, len(infos), per)]
        for chunk in tqdm(chunks, desc=f"adalncache verify ({precision})", unit="pass", disable=not progress):
            items = list(store.iter_entries(chunk))
            stored = [item for item in items if isinstance(item, StoredEntry)]
            report.corrupt += [f"{item[0].path}: {item[1]}" for item in items if not isinstance(item, StoredEntry)]
            if not stored:
                continue
            width = max(spec.plan_rows(e.key) for e in stored)
            options = {"device": device, "precision": precision, "read_ahead": read_ahead, "progress": progress}
            cache = verifying_cache(spec, source, plans=len(stored), width=width, **options)
            cache.build([key_to_plan(e.key, spec.plan_columns) for e in stored], embed=embed)
            report.checked += len(stored)
            for item in stored:
                if not same_rows(cache, item.key, item.rows):
                    shown = format_plan(item.key, columns=spec.plan_columns)
                    report.mismatched.append(f"{item.info.path}: plan {shown} differs from a recomputation")
            del cache, items, stored
    report.other_bindings = len(entries) - sum(len(by_binding.get(h, [])) for h in hashes.values())
    return report


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


def check_output(path: Path, inputs: Iterable[Path] = (), *, needs: int | None = None) -> None:
    """Refuse, before any pass, an output path the export must not write (ConfigError naming ``-o``): ``-o``
    must be a new name or a regular file that is none of ``inputs`` (by device and inode: a link to an input is
    that input), never a directory, FIFO, device or socket, which a file would replace; its directory must be
    writable, with room for ``needs`` bytes where the system can tell.
    """
    out = flag("output")
    try:
        st = os.stat(path)  # follows links: writing "through" a link to an input is writing the input
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"{out} {path} cannot be used: {exc}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{out} {path} is a directory: name the table file to write")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"{out} {path} is not a regular file (a FIFO, a device or a socket), which the table file "
                f"would replace: name a new file, or a table file to replace"
            )
        for source in inputs:
            try:
                other = os.stat(source)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                raise ConfigError(
                    f"{out} {path} is {source}, which this export reads (the checkpoint): writing the "
                    f"tables there would destroy it; name another file"
                )
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{out} {path}: its directory {parent} does not exist or is not writable")
    if needs is not None:
        try:
            vfs = os.statvfs(parent)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            return
        if needs > free:
            raise ConfigError(
                f"{out} {path}: the table file needs {needs} bytes ({needs / 2**20:.1f} MiB) but its disk "
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

    ``plans``: distinct plans in slot order (a family's ``schedule_plans``; for ``format="vllm-omni"`` exactly
    ``timestep_plans`` of the one schedule, and no ``embed=``), built ``cache.max_plans`` at a time. What the
    format cannot hold, and an unwritable output, are refused before any pass; the file appears at ``out``
    only once complete, so a failed export leaves ``out`` as it was. In a process group every rank calls this.
    """
    spec, path, kind = cache.spec, Path(out), table_format(format)
    given = {"embed": embed, "model_variant": model_variant, "tasks": tasks, "schedules": schedules}
    passes = kind.export(cache, plans, **given)
    writer = None
    if cache.rank == 0:
        writer = TableWriter(path, spec, plans, extras=passes.shapes, slot_digests=kind.slot_digests)
    inputs = [*source_files(cache.source), *([t.path for t in cache.tables.files] if cache.tables else [])]
    check_output(path, inputs, needs=writer.nbytes if writer is not None else None)
    done = hits = built = 0
    try:
        if writer is not None:
            writer.open(kind.metadata(passes, given, None, final=False))
        for chunk, report in _in_passes(cache, plans, passes.build, "adalncache export", progress=progress):
            done, hits, built = done + report.passes, hits + report.store_hits, built + report.built
            for i in chunk:  # each pass's rows, before the next pass reuses the slab
                if writer is not None:
                    writer.write_slot(i, cache.rows_of(plan_key(plans[i], spec.plan_columns)), passes.extras(plans[i]))
        metadata = kind.metadata(passes, given, writer, final=True)  # on every rank: a binding may be a collective
        if writer is not None:
            writer.finish(metadata)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    width = max(spec.plan_rows(plan_key(p, spec.plan_columns)) for p in plans)
    size = path.stat().st_size if writer is not None else 0
    return ExportReport(path, format, len(plans), width, size, done, hits, built, passes.content)


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
) -> VerifyReport:
    """Recompute ``table``'s plans from ``source`` on this machine and compare every row with ``torch.equal``.

    Per plan, at the file's precision (``match`` but for a bound file's), as its format computes rows (a
    sidecar's time embeddings are compared too). What the file binds is checked against what the passes read;
    binding fields that differ from this machine are listed in ``foreign`` (a mismatch is then expected).
    """
    check_sample(sample, "plans")
    spec = source.spec
    if table.spec != spec:
        raise ConfigError(f"{table.path} holds tables of another geometry than {flag('checkpoint')}")
    report = VerifyReport()
    keys = sampled(list(dict.fromkeys(table.keys)), sample, seed)
    precision = str((table.binding or {}).get("precision", "match"))
    options = {"device": device, "precision": precision, "read_ahead": read_ahead, "progress": progress}
    cache = verifying_cache(spec, source, plans=min(max_plans, len(keys)), width=table.width, **options)
    passes = table.kind.passes(cache, embed)
    columns = spec.plan_columns
    plans = [key_to_plan(k, columns) for k in keys]
    for chunk, _ in _in_passes(
        cache, plans, passes.build, f"adalncache verify {flag('tables')}", progress=progress, least=1
    ):
        for key, plan in ((keys[i], plans[i]) for i in chunk):
            shown = format_plan(key, columns=columns)
            stored = table.read(key)
            if stored is None:
                report.corrupt.append(f"slot {table.slot_of(key)} (plan {shown}) fails its digest")
                continue
            report.checked += 1
            extras = passes.extras(plan).items()
            if not (same_rows(cache, key, stored) and all(_same(v, table.read_rows(n, key)) for n, v in extras)):
                report.mismatched.append(f"plan {shown} (slot {table.slot_of(key)}) differs")
    table.kind.verified(table, passes, report)
    return report


def describe_store(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
    """Entries, bytes and health of a store, grouped by binding (checkpoint, spec, precision, machine)."""
    store = Store(path)
    entries = store.entries()
    bindings = store.bindings()
    per: dict[str, dict[str, Any]] = {}
    for entry in entries:
        info = per.setdefault(entry.binding, {"entries": 0, "bytes": 0})
        info["entries"] += 1
        info["bytes"] += entry.size
    for bhash, info in per.items():
        binding = bindings.get(bhash, {})
        env = binding.get("environment", {}) if isinstance(binding, dict) else {}
        info.update(
            format=int(binding.get("binding", 1)),
            content=binding.get("content"),
            upstream=binding.get("upstream"),
            spec=binding.get("spec"),
            precision=binding.get("precision"),
            variant=binding.get("variant"),
            torch=env.get("torch"),
            device=env.get("device_name") or env.get("cpu_capability") or env.get("device_type"),
        )
    return {
        "kind": "store",
        "path": str(path),
        "entries": len(entries),
        "bytes": sum(e.size for e in entries),
        "bindings": per,
        "digest_memo": len(store.memo.records()),
        "health": store.health(verify=verify),
    }


def describe_checkpoint(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    layout: str = "auto",
    store: Store | None = None,
    hash: bool = False,
) -> dict[str, Any]:
    """Layout, files, projection tensors and bytes, both identities (docs/tables.md), and whether the time
    embedder is there. The content digest comes from this process's memo or ``store``'s, or with ``hash=True``
    from one hashing read (recorded in ``store``'s memo when given); else it is reported unknown.
    """
    spec, source = open_checkpoint(path, layout=layout)
    info = {**source.describe(), "time_embedder": not spec.family.missing_upstream(source), "row_bytes": spec.row_bytes}
    probe = AdalnCache(spec, source, max_plans=1, max_plan_width=1, store=store)
    content = probe.identify(read=False)
    info["content_from"] = f"from the digest memo{f' in {store.path}' if store is not None else ''}"
    if content is None and hash:
        content = probe.identify(read=True)
        info["content_from"] = f"hashed now{f', recorded in {store.path}' if store is not None else ''}"
    info["content"] = content
    return info
