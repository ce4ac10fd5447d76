"""The ``tables`` section: what content identity and table files cost and save.

For one request (the 49 distinct plans of a 50-step t2va request by default), at the real widths:

* a pass that hashes the projections as it streams them (the content digest is unknown: a cold
  process) against the same pass when the digest is known (the memo has it), in alternating runs
  so that drift in the machine's load hits both alike;
* a hashing-only read (the one read a copied checkpoint costs) against the pass;
* a store hit (entries bound to the content digest) against the pass;
* a table-file hit (a bound file from ``export_tables``, served with no weight source) against the pass.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ...cache import AdalnCache
from ...export import export_tables
from ...plans import plan_key
from ...tiers.digests import forget_process_memo
from .primitives import sync_device
from .results import Comparison, Results
from .workload import make_inputs


def bench_tables(res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
    """Hashing on top of a pass; hashing read, store hit and table hit against a pass (module docstring)."""
    spec = source.spec
    inputs = make_inputs(spec, plans, device)

    def timed_build(cache: AdalnCache, todo: list[torch.Tensor]) -> tuple[float, Any]:
        sync_device(device)
        start = time.perf_counter()
        report = cache.build(todo, embed=embed)
        sync_device(device)
        return time.perf_counter() - start, report

    def embed(plan: torch.Tensor) -> torch.Tensor:
        return inputs[plan_key(plan)]

    def cache(**kwargs: Any) -> AdalnCache:
        return AdalnCache(
            spec,
            kwargs.pop("source", source),
            max_plans=len(plans),
            max_plan_width=4,
            progress=False,
            device=device,
            **kwargs,
        )

    source.keep_buffers = True
    timed_build(cache(), plans[:1])  # fills the read buffers and the page cache
    hashed: list[float] = []
    plain: list[float] = []
    for run in range(runs):
        for kind in ("hashed", "plain") if run % 2 == 0 else ("plain", "hashed"):
            if kind == "hashed":
                forget_process_memo()  # a cold process: the digest is learnt by this pass
            seconds, report = timed_build(cache(), plans)
            assert report.passes == 1
            want = spec.projection_bytes if kind == "hashed" else 0
            if report.hashed_bytes != want:
                res.note(f"tables: a {kind} pass hashed {report.hashed_bytes} bytes, expected {want}")
            (hashed if kind == "hashed" else plain).append(seconds)
    res.values["tables_pass_hashed_s"] = hashed
    res.values["tables_pass_plain_s"] = plain
    res.add(
        Comparison(
            f"hashing during a pass, {len(plans)} plans",
            "pass + BLAKE3",
            "pass",
            hashed,
            plain,
            1.05,
            note="alternating runs; the digest is learnt once per file identity, later passes hash nothing",
        )
    )
    reads = []
    for _ in range(runs):
        forget_process_memo()
        probe = AdalnCache(spec, source, max_plans=1, max_plan_width=1, progress=False, device=device)
        start = time.perf_counter()
        probe.identify()
        reads.append(time.perf_counter() - start)
    res.add(Comparison("hashing-only read (a copied checkpoint's one read)", "hash read", "pass", reads, plain))
    with tempfile.TemporaryDirectory(prefix="adalncache-bench-tables-") as tmp:
        store, table = Path(tmp) / "store", Path(tmp) / "tables.safetensors"
        timed_build(cache(store=store), plans)
        hits = []
        for _ in range(runs):
            seconds, report = timed_build(cache(store=store), plans)
            if report.store_hits != len(plans):
                res.note(f"tables: a store run hit {report.store_hits} of {len(plans)} plans")
            hits.append(seconds)
        res.add(Comparison(f"store hit vs pass, {len(plans)} plans (content-bound)", "store hit", "pass", hits, plain))
        export_tables(cache(), plans, table, embed=embed, progress=False)
        res.values["tables_file_bytes"] = table.stat().st_size
        served = []
        for _ in range(runs):
            seconds, report = timed_build(cache(source=None, tables=table), plans)
            if report.table_hits != len(plans):
                res.note(f"tables: a table-file run hit {report.table_hits} of {len(plans)} plans")
            served.append(seconds)
        res.add(
            Comparison(
                f"table-file hit vs pass, {len(plans)} plans",
                "table hit",
                "pass",
                served,
                plain,
                note=f"bound file of {table.stat().st_size / 2**20:.0f} MiB, no weight source",
            )
        )


__all__ = ["bench_tables"]
