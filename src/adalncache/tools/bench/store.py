"""The ``store`` section: a store hit against a pass of the same request."""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

from ...cache import AdalnCache
from ...plans import plan_key
from .primitives import one_pass, sync_device
from .results import Comparison, Results, median_runs
from .workload import make_inputs


def bench_store(res: Results, source: Any, plans: list[torch.Tensor], runs: int, device: torch.device) -> None:
    """A store hit against a pass, when the real store is there."""
    inputs = make_inputs(source.spec, plans, device)

    def embed(plan: torch.Tensor) -> torch.Tensor:
        return inputs[plan_key(plan)]

    with tempfile.TemporaryDirectory(prefix="adalncache-bench-store-") as tmp:

        def cache() -> AdalnCache:
            return AdalnCache(
                source.spec, source, max_plans=len(plans), max_plan_width=4, store=tmp, progress=False, device=device
            )

        cache().build(plans, embed=embed)
        hits = []
        for _ in range(runs):
            fresh = cache()
            start = time.perf_counter()
            report = fresh.build(plans, embed=embed)
            sync_device(device)
            hits.append(time.perf_counter() - start)
            if report.store_hits != len(plans):
                res.note(f"store run hit {report.store_hits} of {len(plans)} plans")
    # The pass of the same request was measured (warm) in the pass section of this run.
    measured = res.values.get("pass_warm_s", {}).get(str(len(plans)))
    passes = measured or median_runs(lambda: one_pass(source, plans, inputs), runs)
    res.add(Comparison(f"store hit vs pass, {len(plans)} plans", "store hit", "pass", hits, passes))


__all__ = ["bench_store"]
