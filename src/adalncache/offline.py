"""Offline work on checkpoints and stores, without the model: fill a store, check it, describe either.

Why these exist: a serving process should start with its tables already on disk. :func:`fill_store`
runs the same transactional build the cache runs at serving time (same source, same embed, same
binding), so the entries it writes are exactly those a serving cache on this machine looks up.
:func:`verify_store` recomputes entries from the checkpoint and compares them bit for bit, so a store
can be trusted after a copy or a disk scare; :func:`describe_checkpoint` and :func:`describe_store`
say what a checkpoint or a store holds. The ``adalncache build | verify | inspect`` commands are thin
shells over these.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .cache import AdalnCache
from .embedding import has_time_embedder
from .errors import ConfigError
from .options import flag
from .plans import PlanKey, format_plan, key_to_plan, plan_key
from .source.checkpoint import CheckpointSource
from .spec import ModulationSpec
from .tiers.store import Store, StoredEntry, binding_hash
from .verify import check_sample, chunked, same_rows, sampled, verifying_cache

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


# ---------------------------------------------------------------------------------------------
# fill


@dataclass
class FillReport:
    """What :func:`fill_store` did: plans asked for, found stored, built, and the passes it took."""

    plans: int
    already_stored: int
    built: int
    passes: int
    binding: str


def fill_store(
    cache: AdalnCache,
    plans: Sequence[torch.Tensor],
    *,
    embed: Embed,
    progress: bool = True,
) -> FillReport:
    """Build every plan ``cache``'s store lacks, in passes of at most ``cache.max_plans`` plans.

    The cache's slab is scratch here and is emptied after each pass: the store is the product. A
    store write that fails raises ConfigError naming the directory (``--store``), since the build
    then did not do its job. Under a process group every rank calls this with the same plans.
    """
    store = cache.store
    if store is None:
        raise ConfigError(
            f"fill_store needs a cache with a store: pass AdalnCache(..., store=DIR) (CLI {flag('store')})"
        )
    if cache.world_size > 1:
        # Every rank must pass the same chunks: build() agrees on store hits across ranks itself.
        stored: set[PlanKey] = set()
    else:
        # Existence by name only: reading every entry to verify it would cost as much as a pass on a
        # large store. A corrupt entry is caught (and rebuilt) by the serving cache's read, or by verify.
        binding = cache.binding()  # None while the content digest is unknown: the build learns it
        columns = cache.spec.plan_columns
        stored = store.contains(binding, [plan_key(p, columns) for p in plans]) if binding is not None else set()
    todo = [p for p in plans if plan_key(p, cache.spec.plan_columns) not in stored]
    unwritable = cache.stats.store_unwritable
    per_pass = cache.max_plans
    chunks = [todo[i : i + per_pass] for i in range(0, len(todo), per_pass)]
    built = passes = failures = hits = 0
    for chunk in tqdm(chunks, desc="adalncache build", unit="pass", disable=not progress or len(chunks) < 2):
        report = cache.build(chunk, embed=embed)
        built += report.built
        passes += report.passes
        hits += report.store_hits
        failures += report.tier_write_failures
        cache.invalidate()
    skipped = cache.stats.store_unwritable - unwritable
    if failures or skipped:
        raise ConfigError(
            f"{failures} store write(s) failed under {store.path}"
            f"{f' and {skipped} pass(es) could not write it at all' if skipped else ''} (see the log, -v): check the "
            f"directory's free space and permissions ({flag('store')})"
        )
    return FillReport(
        plans=len(plans),
        already_stored=len(stored) + hits,
        built=built,
        passes=passes,
        binding=_binding_hash(cache),
    )


def _binding_hash(cache: AdalnCache) -> str:
    binding = cache.binding()
    return binding_hash(binding) if binding is not None else "unbound"


# ---------------------------------------------------------------------------------------------
# verify


@dataclass
class VerifyReport:
    """What :func:`verify_store` found: entries recomputed, those that differ, those unreadable."""

    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    other_bindings: int = 0

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.corrupt)


def _local_hashes(
    spec: ModulationSpec, source: CheckpointSource, device: str | torch.device, store: Store
) -> dict[str, str]:
    """The binding hash a cache on this machine would use, per precision (what verify can check).

    Needs the checkpoint's content digest: from the store's memo, or one hashing read.
    """
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

    Only entries under a binding this machine would use (per precision) can be checked; the others
    are counted. ``sample`` checks that many entries per binding, chosen with ``seed``. Entries are
    read and recomputed ``max_plans`` at a time, so memory stays at one slab's worth. Raises
    ConfigError when the store holds nothing for this checkpoint here.
    """
    check_sample(sample, "entries")
    entries = store.entries()
    by_binding: dict[str, list[Any]] = {}
    for entry in entries:
        by_binding.setdefault(entry.binding, []).append(entry)
    report = VerifyReport()
    hashes = _local_hashes(spec, source, device, store)
    matched_any = False
    for precision, bhash in hashes.items():
        infos = by_binding.get(bhash, [])
        if not infos:
            continue
        matched_any = True
        infos = sampled(infos, sample, seed)
        for chunk in tqdm(
            chunked(infos, min(max_plans, len(infos))),
            desc=f"adalncache verify ({precision})",
            unit="pass",
            disable=not progress,
        ):
            stored: list[StoredEntry] = []
            for item in store.iter_entries(chunk):
                if isinstance(item, StoredEntry):
                    stored.append(item)
                else:
                    report.corrupt.append(f"{item[0].path}: {item[1]}")
            if not stored:
                continue
            width = max(spec.plan_rows(e.key) for e in stored)
            cache = verifying_cache(
                spec,
                source,
                plans=len(stored),
                width=width,
                device=device,
                precision=precision,
                read_ahead=read_ahead,
                progress=progress,
            )
            cache.build([key_to_plan(e.key, spec.plan_columns) for e in stored], embed=embed)
            for item in stored:
                report.checked += 1
                if not same_rows(cache, item.key, item.rows):
                    report.mismatched.append(
                        f"{item.info.path}: plan {format_plan(item.key, columns=spec.plan_columns)} differs from a "
                        f"recomputation"
                    )
            del cache, stored
    report.other_bindings = len(entries) - sum(len(by_binding.get(h, [])) for h in hashes.values())
    if not matched_any:
        raise ConfigError(
            f"{store.path} holds no entries for this checkpoint on this machine ({len(entries)} entries under other "
            f"bindings): check {flag('checkpoint')} and {flag('device')}, or run adalncache build first"
        )
    return report


# ---------------------------------------------------------------------------------------------
# describe


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
    """Layout, files, projection tensors and bytes, both identities, and whether the time embedder is there.

    The *file identity* (``fingerprint``: stat and header of every file) changes on any rewrite,
    copy or touch; the *content digest* names the projections' bytes, which is what stores and
    table files bind to. It comes from this process's memo or ``store``'s, or with ``hash=True``
    from one hashing read (recorded in ``store``'s memo when given); else it is reported unknown.
    """
    spec, source = open_checkpoint(path, layout=layout)
    info = source.describe()
    info["time_embedder"] = has_time_embedder(source)
    info["row_bytes"] = spec.row_bytes
    probe = AdalnCache(spec, source, max_plans=1, max_plan_width=1, store=store)
    content = probe.identify(read=False)
    info["content_from"] = f"from the digest memo{f' in {store.path}' if store is not None else ''}"
    if content is None and hash:
        content = probe.identify(read=True)
        info["content_from"] = f"hashed now{f', recorded in {store.path}' if store is not None else ''}"
    info["content"] = content
    return info


__all__ = [
    "FillReport",
    "VerifyReport",
    "describe_checkpoint",
    "describe_store",
    "fill_store",
    "is_store",
    "open_checkpoint",
    "verify_store",
]
