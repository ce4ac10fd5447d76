"""Fill an adalncache store with several ranks at once, under torchrun.

    torchrun --nproc-per-node 8 examples/torchrun_build.py /models/MiniMax-H3 \\
        --store /cache/adaln --task t2va --steps 50 --device cuda --timeout 900

Every rank runs this same script (SPMD). With ``--shard layers`` (the default) each rank reads and
projects 1/world of the layers, then the ranks exchange rows, so each rank holds the full tables,
bit-identical to a one-process build, and writes them to the store. ``--shard columns`` mirrors a
column-parallel runtime (its tables are keyed apart in the store). CPU runs use gloo, GPU runs
NCCL, one GPU per rank (``LOCAL_RANK``). This is the library's side of what
``torchrun --nproc-per-node 8 -m adalncache build CHECKPOINT --store DIR --shard layers ...`` does.

``--timeout`` is the process group's timeout. It is the only bound on how long the other ranks
wait when one rank dies outright (killed, out of memory, lost node): any Python exception on a
rank is agreed on and raised everywhere at once, but a dead process cannot take part, so its peers
block in the next collective until this timeout and then fail. Keep it above the longest expected
pass (a cold read of the checkpoint) and well below "forever".
"""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from adalncache import AdalnCache, CheckpointSource, ModulationSpec, Store
from adalncache.families import checkpoint_embed
from adalncache.families.minimax_h3 import TASKS
from adalncache.offline import fill_store
from adalncache.plans import schedule_plans


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="safetensors file or directory (native or diffusers layout)")
    parser.add_argument("--store", required=True, help="store directory (shared or per node)")
    parser.add_argument("--task", action="append", choices=TASKS, help="repeatable")
    parser.add_argument("--steps", action="append", type=int, help="num_inference_steps (repeatable)")
    parser.add_argument("--shard", default="layers", choices=["layers", "columns"])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank: LOCAL_RANK)")
    parser.add_argument("--max-plans", type=int, default=64, help="plans per pass (the working slab)")
    parser.add_argument("--timeout", type=float, default=600.0, help="process group timeout in seconds")
    return parser.parse_args()


def main() -> None:
    args = parse()
    tasks, steps = args.task or ["t2va"], args.steps or [50]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # The explicit timeout bounds the wait for a peer that died; torchrun supplies rank and address.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        spec = ModulationSpec.from_checkpoint(args.checkpoint)
        source = CheckpointSource(args.checkpoint, spec)
        embed = checkpoint_embed(source, spec, device)
        plans = schedule_plans(tasks, steps, video_shift=12.0, audio_shift=3.0, audio_refs=True)
        slab_plans = max(1, min(args.max_plans, len(plans)))
        # The cache is closed (``with``) before the group is destroyed, so it does not keep the group alive.
        with AdalnCache(
            spec,
            source,
            max_plans=slab_plans,
            max_plan_width=max(p.numel() for p in plans),
            device=device,
            store=Store(args.store),
            process_group=dist.group.WORLD,
            shard=args.shard,
            progress=rank == 0,
        ) as cache:
            # Every rank passes the same plans: store hits are agreed across ranks inside build().
            report = fill_store(cache, plans, embed=embed, progress=rank == 0)
        built, stored, passes = report.built, report.already_stored, report.passes
        if rank == 0:
            print(
                f"{world} rank(s), shard={args.shard}: {len(plans)} plan(s), {stored} already stored, {built} "
                f"built in {passes} pass(es); this rank read {source.bytes_read / 2**20:.2f} MiB of "
                f"{spec.projection_bytes / 2**20:.2f} MiB of projections"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
