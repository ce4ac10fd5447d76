"""What each rank of tests/test_seam.py's gloo group runs: the synthetic family built by two ranks."""

from __future__ import annotations

import contextlib
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import seam_helpers as S
from adalncache import AdalnCache, CheckpointSource

#: Both shard modes: layers split the layer list, columns every layer's outputs (all widths are even).
SHARDS = ("layers", "columns")


def entry(rank: int, world: int, init_file: str, ckpt: str, out: str) -> None:
    """Join the group, build the synthetic family's request in each shard mode, save the tables."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        for shard in SHARDS:
            try:
                source = CheckpointSource(Path(ckpt), S.SPEC)
                cache = AdalnCache(S.SPEC, source, max_plans=4, process_group=dist.group.WORLD, shard=shard)
                cache.build(S.PLANS, embed=S.embed)
                cache.check_invariants()
                result: dict[str, Any] = {
                    "ok": True,
                    "table": cache.table.clone(),
                    "plans": cache.plan_timesteps.clone(),
                    "slots": {key: cache.slot_of(key) for key in cache.resident_plans},
                }
            except Exception:
                result = {"ok": False, "traceback": traceback.format_exc()}
            torch.save(result, Path(out) / f"{shard}-{rank}.pt")
            dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
