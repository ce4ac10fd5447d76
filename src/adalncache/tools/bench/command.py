"""``adalncache bench``: side-by-side measurements of the rebuild pass, serving and memory.

Every comparison is measured in one run on one machine and printed as a ratio of medians, because
absolute times on a shared CPU say little while ratios of neighbouring runs stay meaningful. What
it measures:

* the pass against the raw sequential read of the same bytes from the same files and against the
  projections alone (weights already in memory), page cache warm and cold, at 1 plan and at a full
  50-step request: a pass that overlaps reading with projecting costs about the larger of the two;
* on CUDA (``--device cuda``), the pass as a ratio of the pinned host-to-device copy of the same
  bytes, the physical limit of a pass that feeds a GPU from host memory (a CPU run notes it);
* the pass against a naive loop that reads each layer whole into a fresh buffer, then projects,
  at the request size where reading and projecting cost about the same (where overlap matters most);
* a forward step of a tiny MiniMax-H3 with its projections resident, served from the cache, and
  offloaded to disk with diffusers' group offloading;
* a forward step of a tiny Qwen-Image (bf16), resident against served from the cache;
* a first request's prompt encoding + pass + first step in a tiny MiniMax-H3 pipeline, with the
  pass on a background thread (``overlap=True``) against the pass before step 0, and in a
  Qwen-Image pipeline loaded by ``load_transformer`` from a checkpoint whose pages are dropped,
  the pass started before the prompt is encoded against before step 0 and at the first forward;
* a pass of a 50-step Qwen-Image request over a generated checkpoint at the released widths (2
  blocks) against the plain GEMMs over the same weights, tables checked ``torch.equal`` to them;
* ``build()`` latency when every plan of a 50-step request is already resident (the per-request
  hot path), beside SGLang's cache where one is installed, and a store hit against a pass;
* memory: projection bytes against slab bytes, and the peak anonymous memory of a pass, measured in
  a child process so the parent's buffers do not count (page cache is file-backed, reported apart);
* deployment: what ``load_transformer`` reads and holds against a stock load, and what group
  offloading onloads with and without the cache; content hashing, store and table-file hits.

The checkpoint is generated at the real projection widths (in 2688, out 96768 per block) with
``--layers`` blocks (``--full``: all 50, 24.2 GiB), in the native layout, sharded with an index.
Results go to ``bench/results/`` as JSON, Markdown and a PNG chart (:mod:`.report`); each section
is a module of this package, timed with :mod:`.primitives` and recorded in :mod:`.results`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...devices import resolve_device
from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from .deploy import bench_deploy
from .first_request import bench_first_request
from .forward import bench_forward
from .hitpath import bench_build_latency
from .memory import bench_memory
from .passes import bench_pass
from .qwen import bench_qwen
from .qwen_pass import bench_qwen_pass
from .report import write_outputs
from .results import Results
from .store import bench_store
from .tables import bench_tables
from .workload import QWEN_DIM, REAL_HIDDEN, REAL_IN, STEPS, generate_checkpoint, request_plans

#: The sections, in the order they run (``--only`` takes their names).
SECTIONS = (
    "pass",
    "forward",
    "qwen",
    "qwen-pass",
    "first-request",
    "build",
    "store",
    "memory",
    "deploy",
    "tables",
)


def run(args: argparse.Namespace) -> int:
    """Run the sections ``args.only`` asks for; results are written after every section."""
    torch.manual_seed(0)
    device = resolve_device(args.device)
    hidden = args.hidden if args.hidden else REAL_HIDDEN
    in_features = args.in_features if args.in_features else REAL_IN
    layers = 50 if args.full else args.layers
    runs = args.runs if args.runs else (1 if args.quick else 3)
    spec = ModulationSpec(num_layers=layers, hidden_size=hidden, time_embed_dim=in_features)
    work = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "adalncache-bench"
    ckpt_dir = work / f"ckpt-{layers}x{hidden}x{in_features}"
    source: Any = None
    if set(args.only) & {"pass", "store", "memory", "tables"}:  # the others bring their own small checkpoints
        print(
            f"checkpoint: {ckpt_dir} ({spec.projection_bytes / 2**30:.2f} GiB of projections, {layers} blocks + final)",
            flush=True,
        )
        generate_checkpoint(spec, ckpt_dir)
        source = CheckpointSource(ckpt_dir, spec)
    plans = request_plans(STEPS)
    if args.plans:
        plans = plans[: args.plans]
    res = Results(
        config={
            "command": " ".join(["adalncache bench", *args.argv]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads",
            # The generated MiniMax-H3 checkpoint's geometry, only where a section ran on it: the other
            # sections bring their own models and say their geometry in their own config entry.
            "spec": spec.describe() if source is not None else None,
            "runs": runs,
            "plans": len(plans),
            "checkpoint": str(ckpt_dir) if source is not None else None,
            "files": len(source.files) if source is not None else None,
            "read_ahead": 1,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
    )
    sections: dict[str, Callable[[], None]] = {
        "pass": lambda: bench_pass(res, source, plans, runs, cold=not args.no_cold, device=device),
        "forward": lambda: bench_forward(res, args.size, 3 if args.quick else 8, runs, device),
        "qwen": lambda: bench_qwen(res, runs, device),
        "qwen-pass": lambda: bench_qwen_pass(
            res, runs, device, work, dim=args.hidden if args.hidden else QWEN_DIM, max_plans=args.plans
        ),
        "first-request": lambda: bench_first_request(res, args.size, runs, work, device),
        "build": lambda: bench_build_latency(res, runs, work / "ckpt-latency-50x8x16", device),
        "store": lambda: bench_store(res, source, plans, runs, device),
        "memory": lambda: bench_memory(res, source, plans, ckpt_dir, device),
        "deploy": lambda: bench_deploy(res, args.size, 3 if args.quick else 4, quick=args.quick),
        "tables": lambda: bench_tables(res, source, plans, runs, device),
    }
    for name, section in sections.items():
        if name in args.only:
            started = time.perf_counter()
            section()
            res.values.setdefault("section_seconds", {})[name] = time.perf_counter() - started
            write_outputs(res, Path(args.out))  # after every section: a long run leaves partial results
    paths = write_outputs(res, Path(args.out))
    for path in paths:
        print(f"wrote {path}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``adalncache bench`` to the command line."""
    p = subparsers.add_parser(
        "bench",
        help="measure the pass, serving and memory side by side (ratios of medians)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--layers", type=int, default=4, help="blocks in the generated checkpoint (default 4)")
    p.add_argument("--full", action="store_true", help="all 50 blocks (24.2 GiB checkpoint on disk)")
    p.add_argument(
        "--hidden",
        type=int,
        default=0,
        help=f"hidden size (default {REAL_HIDDEN}: out = 18 x hidden; qwen-pass: dim, default {QWEN_DIM})",
    )
    p.add_argument("--in-features", type=int, default=0, help=f"projection input width (default {REAL_IN})")
    p.add_argument("--plans", type=int, default=0, help="cap the 50-step request at this many plans")
    p.add_argument("--runs", type=int, default=0, help="samples per measurement (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="one sample each, shorter forward loop (smoke test)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    p.add_argument(
        "--size", default="medium", help="tiny model size for the forward comparison (default medium: real proportions)"
    )
    p.add_argument("--device", default="cpu", help="where the cache and the projections run (default: cpu)")
    p.add_argument("--only", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="sections to run")
    p.add_argument("--dir", default="", help="where checkpoints are generated (default: a temp dir, reused)")
    p.add_argument("--out", default="bench/results", help="output directory (default bench/results)")

    def func(args: argparse.Namespace) -> int:
        args.argv = [a for a in sys.argv[2:]] if len(sys.argv) > 1 and sys.argv[1] == "bench" else []
        return run(args)

    p.set_defaults(func=func)


__all__ = ["SECTIONS", "register", "run"]
