"""``adalncache bench``: side-by-side measurements of the rebuild pass, serving and memory.

Every comparison is a ratio of medians measured in one run (see docs/benchmarks.md). The sections
(``--only``) on a checkpoint generated at the real projection widths are :mod:`.passes`'; those on
tiny real models :mod:`.models`'; what they share is :mod:`.workload` and :mod:`.primitives`.
Results go to ``bench/results/`` after every section, so a long run leaves partial results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...devices import resolve_device
from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from .models import bench_deploy, bench_first_request, bench_forward, bench_qwen
from .passes import bench_build_latency, bench_memory, bench_pass, bench_qwen_pass, bench_store, bench_tables
from .workload import QWEN_DIM, REAL_HIDDEN, REAL_IN, STEPS, Results, generate_checkpoint, request_plans

#: The sections, in the order they run (``--only`` takes their names).
SECTIONS = ("pass", "forward", "qwen", "qwen-pass", "first-request", "build", "store", "memory", "deploy", "tables")


def run(args: argparse.Namespace) -> int:
    """Run the sections ``args.only`` asks for; results are written after every section."""
    torch.manual_seed(0)
    device = resolve_device(args.device)
    hidden, in_features = args.hidden or REAL_HIDDEN, args.in_features or REAL_IN
    layers = 50 if args.full else args.layers
    runs = args.runs or (1 if args.quick else 3)
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
    plans = request_plans(STEPS)[: args.plans or None]  # --plans caps the request
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
            res, runs, device, work, dim=args.hidden or QWEN_DIM, max_plans=args.plans
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


def write_outputs(res: Results, out_dir: Path) -> list[Path]:
    """Write ``res`` into ``out_dir`` (created): ``bench.json`` (everything), ``bench.md`` (the table and
    notes) and ``bench.png`` (a chart; none without matplotlib). Returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(res.as_dict(), indent=2, default=str))
    md = ["# adalncache bench", "", f"Command: `{res.config['command']}`", "", f"Machine: {res.config['machine']}", ""]
    md.append("| comparison | subject | baseline | subject median | baseline median | ratio | target | met |")
    md.append("|---|---|---|---|---|---|---|---|")
    for c in res.comparisons:
        target = "" if c.target is None else f"<= {c.target:g}"
        met = "" if c.met is None else ("yes" if c.met else "NO")
        md.append(
            f"| {c.name} | {c.subject} | {c.baseline} | {c.fmt(c.subject_s)} | {c.fmt(c.baseline_s)} | "
            f"{c.ratio:.3f} | {target} | {met} |"
        )
    md.append("")
    md += [f"- {c.name}: {c.note}" for c in res.comparisons if c.note]
    md += [f"- note: {text}" for text in res.notes]
    hit = res.values.get("hit_path")
    if hit:
        md += ["", "Hit path of a fully resident request (median per call):", "", "```", hit["table"], "```"]
    mem = res.values.get("memory")
    if mem:
        md += [
            "",
            "Memory:",
            "",
            f"- projection bytes (this geometry): {mem['projection_bytes'] / 2**30:.2f} GiB; slab for the request: "
            f"{mem['slab_bytes_request'] / 2**20:.1f} MiB",
            f"- full MiniMax-H3: projections {mem['full_model_projection_bytes'] / 2**30:.2f} GiB; slab for a "
            f"50-step request {mem['full_model_slab_bytes_request'] / 2**30:.2f} GiB; default 64x4 slab "
            f"{mem['full_model_slab_bytes_default_64x4'] / 2**30:.2f} GiB",
        ]
        if "page_cache_delta_bytes" in mem:
            md.append(
                f"- page cache (file-backed, not anonymous) grew by {mem['page_cache_delta_bytes'] / 2**20:.0f} "
                "MiB during the memory probe"
            )
    md_path = out_dir / "bench.md"
    md_path.write_text("\n".join(md) + "\n")
    paths = [json_path, md_path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(12, 0.55 * len(res.comparisons) + 1.5))
        names = [textwrap.fill(f"{c.name}: {c.subject} / {c.baseline}", 56) for c in res.comparisons]
        ratios = [c.ratio for c in res.comparisons]
        colors = ["tab:gray" if c.met is None else ("tab:green" if c.met else "tab:red") for c in res.comparisons]
        ax.barh(range(len(names)), ratios, color=colors)
        for i, c in enumerate(res.comparisons):
            ax.annotate(
                f"{c.ratio:.2f}", (c.ratio, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7
            )
            if c.target is not None:
                ax.plot([c.target, c.target], [i - 0.4, i + 0.4], color="black", linewidth=1)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ratio of medians (lower is better; black tick = target)")
        fig.tight_layout()
        png = out_dir / "bench.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        paths.append(png)
    except ImportError:
        res.note("matplotlib unavailable: no chart")
    return paths


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
        args.argv = sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "bench" else []
        return run(args)

    p.set_defaults(func=func)
