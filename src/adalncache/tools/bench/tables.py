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
from ...identity.binding import forget_process_memo
from ...plans import plan_key
from .primitives import sync_device
from .results import Comparison, Results
from .workload import make_inputs


def bench_tables(res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
    """Hashing on top of a pass; hashing read, store hit and table hit against a pass (module docstring)."""
    section = TablesSection(res, source, plans, runs, device)
    source.keep_buffers = True
    section.timed_build(section.cache(), plans[:1])  # fills the read buffers and the page cache
    plain = section.hashing()
    section.hash_read(plain)
    section.hits(plain)


class TablesSection:
    """One run of the section: the request, its inputs, and a cache of the request's size on demand."""

    def __init__(self, res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
        self.res = res
        self.source = source
        self.spec = source.spec
        self.plans = plans
        self.runs = runs
        self.device = device
        self.inputs = make_inputs(self.spec, plans, device)

    def embed(self, plan: torch.Tensor) -> torch.Tensor:
        return self.inputs[plan_key(plan)]

    def cache(self, **kwargs: Any) -> AdalnCache:
        """A fresh cache for the whole request (``source=``, ``store=``, ``tables=`` as given)."""
        source = kwargs.pop("source", self.source)
        return AdalnCache(
            self.spec, source, max_plans=len(self.plans), max_plan_width=4, progress=False, device=self.device, **kwargs
        )

    def timed_build(self, cache: AdalnCache, todo: list[torch.Tensor]) -> tuple[float, Any]:
        sync_device(self.device)
        start = time.perf_counter()
        report = cache.build(todo, embed=self.embed)
        sync_device(self.device)
        return time.perf_counter() - start, report

    def hashing(self) -> list[float]:
        """A pass that hashes against one that does not, alternating; returns the plain passes' seconds."""
        res, plans = self.res, self.plans
        hashed: list[float] = []
        plain: list[float] = []
        for run in range(self.runs):
            for kind in ("hashed", "plain") if run % 2 == 0 else ("plain", "hashed"):
                cache = self.cache()
                cache.hash_passes = kind == "hashed"  # on with a store or table files; off here by default
                seconds, report = self.timed_build(cache, plans)
                assert report.passes == 1
                want = self.spec.projection_bytes if kind == "hashed" else 0
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
                note="alternating runs; a cache hashes its passes where a store or table files bind to the digest",
            )
        )
        return plain

    def hash_read(self, plain: list[float]) -> None:
        """The one read a copied checkpoint costs (hashing only) against a pass."""
        reads = []
        for _ in range(self.runs):
            forget_process_memo()
            probe = AdalnCache(
                self.spec, self.source, max_plans=1, max_plan_width=1, progress=False, device=self.device
            )
            start = time.perf_counter()
            probe.identify()
            reads.append(time.perf_counter() - start)
        self.res.add(
            Comparison("hashing-only read (a copied checkpoint's one read)", "hash read", "pass", reads, plain)
        )

    def hits(self, plain: list[float]) -> None:
        """A store hit and a table-file hit (no weight source) against a pass."""
        res, plans, n = self.res, self.plans, len(self.plans)
        with tempfile.TemporaryDirectory(prefix="adalncache-bench-tables-") as tmp:
            store, table = Path(tmp) / "store", Path(tmp) / "tables.safetensors"
            self.timed_build(self.cache(store=store), plans)
            hits = []
            for _ in range(self.runs):
                seconds, report = self.timed_build(self.cache(store=store), plans)
                if report.store_hits != n:
                    res.note(f"tables: a store run hit {report.store_hits} of {n} plans")
                hits.append(seconds)
            res.add(Comparison(f"store hit vs pass, {n} plans (content-bound)", "store hit", "pass", hits, plain))
            export_tables(self.cache(), plans, table, embed=self.embed, progress=False)
            res.values["tables_file_bytes"] = table.stat().st_size
            served = []
            for _ in range(self.runs):
                seconds, report = self.timed_build(self.cache(source=None, tables=table), plans)
                if report.table_hits != n:
                    res.note(f"tables: a table-file run hit {report.table_hits} of {n} plans")
                served.append(seconds)
            res.add(
                Comparison(
                    f"table-file hit vs pass, {n} plans",
                    "table hit",
                    "pass",
                    served,
                    plain,
                    note=f"bound file of {table.stat().st_size / 2**20:.0f} MiB, no weight source",
                )
            )


__all__ = ["TablesSection", "bench_tables"]
