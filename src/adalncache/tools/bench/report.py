"""Writing a run's results: ``bench.json`` (everything), ``bench.md`` (the table and notes), ``bench.png`` (a chart)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from .results import Results


def write_outputs(res: Results, out_dir: Path) -> list[Path]:
    """Write ``res`` into ``out_dir`` (created); the paths written (no chart without matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(res.as_dict(), indent=2, default=str))
    md = [
        "# adalncache bench",
        "",
        f"Command: `{res.config['command']}`",
        "",
        f"Machine: {res.config['machine']}",
        "",
        "| comparison | subject | baseline | subject median | baseline median | ratio | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in res.comparisons:
        md.append(
            f"| {c.name} | {c.subject} | {c.baseline} | {c.fmt(c.subject_s)} | "
            f"{c.fmt(c.baseline_s)} | {c.ratio:.3f} | "
            f"{'' if c.target is None else f'<= {c.target:g}'} | "
            f"{'' if c.met is None else ('yes' if c.met else 'NO')} |"
        )
    md.append("")
    for c in res.comparisons:
        if c.note:
            md.append(f"- {c.name}: {c.note}")
    for text in res.notes:
        md.append(f"- note: {text}")
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


__all__ = ["write_outputs"]
