"""``adalncache demo``: a deterministic tiny MiniMax-H3, resident versus cached, with a verdict.

What it shows, end to end and offline: a transformer built from a seed and round-tripped through
``save_pretrained``/``from_pretrained(torch_dtype=bfloat16)`` (the released mixed precision), the
whole model written as a sharded native-layout checkpoint (the MiniMax release's names), and one
request's denoising loop (the pipeline's own layout and plan builders, ``MiniMaxH3Scheduler``) run
twice: with the stock model, projections resident, then with a model that
:func:`~adalncache.diffusers.load_transformer` loaded from that checkpoint without ever reading its
AdaLN projections (or its time embedder), served by the cache. The verdict compares every forward
output and the final latents with ``torch.equal``; the table reports the plans, rebuild passes,
the checkpoint bytes the load read and never read, AdaLN bytes on the device before and after, and
per-step time both ways.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..devices import resolve_device
from ..errors import ConfigError
from ..schedules import TASKS

log = logging.getLogger(__name__)


@dataclass
class DemoResult:
    """One task's outcome: what the table prints and whether the cached run was bit-identical."""

    task: str
    steps: int
    forwards: int
    plans: int
    passes: int
    bytes_before: int
    bytes_after: int
    table_bytes: int
    resident_ms: float
    cached_ms: float
    stats: dict[str, Any]
    identical: bool
    aot_plans_match: bool
    #: Checkpoint bytes the load read (None where /proc cannot tell), of ``checkpoint_bytes``.
    load_read_bytes: int | None = None
    checkpoint_bytes: int = 0
    #: Bytes of the AdaLN projections and the time embedder, none of which the load read.
    never_read_bytes: int = 0
    #: Their bytes in the page cache right after the load (0: not one page was read).
    served_cached_after_load: int = 0


def _format_bytes(count: int) -> str:
    if count >= 1 << 20:
        return f"{count / (1 << 20):.2f} MiB"
    if count >= 1 << 10:
        return f"{count / (1 << 10):.1f} KiB"
    return f"{count} B"


def _table_bytes(cache: Any) -> int:
    """Device bytes of the cache's slab buffers (what replaces the weights on the device)."""
    total = 0
    for name in ("plan_timesteps", "plan_lengths", "block_params", "final_params"):
        tensor = getattr(cache, name, None)
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


def _stats_dict(stats: Any) -> dict[str, Any]:
    as_dict = getattr(stats, "as_dict", None)
    if callable(as_dict):
        return dict(as_dict())
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return dataclasses.asdict(stats)
    return dict(vars(stats))


def run_task(
    model: Any,
    checkpoint: Path,
    task: str,
    steps: int,
    *,
    seed: int,
    device: torch.device,
    config: Path | None = None,
) -> DemoResult:
    """Run one task on the stock ``model``, then on ``load_transformer(checkpoint)``, and compare bit for bit.

    ``config``: the diffusers config directory for a native ``checkpoint`` without one. The load
    is measured with the checkpoint's page cache dropped first: the bytes it read, and the served
    tensors' bytes it left in the page cache (none).
    """
    from ..diffusers import adaln_cache_handle, load_transformer
    from ..plans import minimax_h3_plans, plan_key
    from .measure import drop_page_cache, io_read_bytes, resident_served_bytes, served_bytes, weight_files
    from .tiny import adaln_parameter_bytes, make_request, run_loop

    request = make_request(model, task, steps, seed=seed, device=device)
    resident = run_loop(model, request)
    bytes_before = adaln_parameter_bytes(model)

    # The plans known ahead of time, from the schedule alone, must be the loop's own plans.
    ahead = minimax_h3_plans(task, steps)
    distinct = len({plan_key(plan) for plan in ahead})
    files = weight_files(checkpoint)
    never_read, total = served_bytes(files)
    dropped = drop_page_cache(files)
    before = io_read_bytes()
    # A slab sized to the request, so the table bytes reported are what this request needs.
    cached_model: Any = load_transformer(
        checkpoint, config=config, torch_dtype=torch.bfloat16, device_map=device, max_plans=distinct, max_plan_width=4
    )
    after = io_read_bytes()
    read = None if before is None or after is None or not dropped else after - before
    served_cached = resident_served_bytes(files)
    handle: Any = adaln_cache_handle(cached_model)
    try:
        bytes_after = adaln_parameter_bytes(cached_model)
        table_bytes = _table_bytes(handle.cache)
        aot_match = [plan_key(p) for p in ahead] == [plan_key(p) for p in request.plans]
        report = handle.prepare(ahead)
        cached = run_loop(cached_model, request)
        stats = _stats_dict(handle.stats)
    finally:
        handle.disable()
    return DemoResult(
        task=task,
        steps=steps,
        forwards=len(request.plan),
        plans=int(report.plans),
        passes=int(report.passes),
        bytes_before=bytes_before,
        bytes_after=bytes_after,
        table_bytes=table_bytes,
        resident_ms=1000 * statistics.median(resident.step_seconds),
        cached_ms=1000 * statistics.median(cached.step_seconds),
        stats=stats,
        identical=cached.equal(resident),
        aot_plans_match=aot_match,
        load_read_bytes=read,
        checkpoint_bytes=total,
        never_read_bytes=never_read,
        served_cached_after_load=served_cached,
    )


def _print_header(size: str, model: Any, device: torch.device, seed: int, checkpoint: Path) -> None:
    config = model.config
    dtype = model.transformer_blocks[0].adaln_proj.linear.weight.dtype
    geometry = f"{config.num_layers} blocks, hidden {config.hidden_size}, time embedding {config.time_embed_dim}"
    precision = f"{str(dtype).removeprefix('torch.')} AdaLN projections, fp32 time embedder"
    print(
        f"adalncache demo: tiny MiniMax-H3 '{size}' ({geometry}), released mixed precision ({precision}), "
        f"device {device}, seed {seed}"
    )
    print(f"native checkpoint: {checkpoint} ({len(list(checkpoint.glob('*.safetensors')))} shards + index)")


def _load_line(result: DemoResult) -> str:
    """What ``load_transformer`` read of the checkpoint, and the AdaLN bytes it never read."""
    read = "?" if result.load_read_bytes is None else _format_bytes(result.load_read_bytes)
    cached = "none of them" if result.served_cached_after_load == 0 else _format_bytes(result.served_cached_after_load)
    return (
        f"load_transformer read {read} of the {_format_bytes(result.checkpoint_bytes)} checkpoint; "
        f"{_format_bytes(result.never_read_bytes)} of AdaLN projections and time embedder never read "
        f"({cached} in the page cache)"
    )


def _print_result(result: DemoResult) -> None:
    aot = "yes" if result.aot_plans_match else "NO"
    before = _format_bytes(result.bytes_before)
    after = f"{_format_bytes(result.bytes_after)} weights + {_format_bytes(result.table_bytes)} table"
    rows = [
        ("task", result.task),
        ("steps", f"{result.steps} (grid points; {result.forwards} forwards)"),
        ("plans", f"{result.plans} distinct (ahead-of-time plans match the loop: {aot})"),
        ("passes", f"{result.passes} rebuild pass{'es' if result.passes != 1 else ''} for the whole request"),
        ("load", _load_line(result)),
        ("AdaLN bytes on device", f"{before} resident -> {after} cached"),
        ("per-step time", f"{result.resident_ms:.2f} ms resident, {result.cached_ms:.2f} ms cached (median)"),
        ("cache stats", ", ".join(f"{k}={v}" for k, v in result.stats.items() if v or k == "passes")),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"bit-identical: {'yes' if result.identical else 'no'}")


#: ``--model`` names of the AdaLayerNormZero family's demos (:mod:`.demo_adaln_zero`).
ADALN_ZERO_DEMOS = ("bria", "ovis-image")


def run(args: argparse.Namespace) -> int:
    """The ``demo`` sub-command: returns 0 when every task is bit-identical, else 1."""
    from .tiny import SIZES, save_tiny, tiny_transformer, write_native_model

    if getattr(args, "model", "minimax-h3") == "qwen-image":
        from .demo_qwen import run_qwen

        return run_qwen(args)
    if getattr(args, "model", "minimax-h3") in ADALN_ZERO_DEMOS:
        from .demo_adaln_zero import run_adaln_zero

        return run_adaln_zero(args)

    if args.size not in SIZES:
        raise ConfigError(f"unknown size {args.size!r}: set --size to one of {', '.join(SIZES)}")
    if not isinstance(args.steps, int) or args.steps < 2:
        raise ConfigError(f"--steps must be an integer >= 2 (grid points, terminal 0 included), got {args.steps}")
    device = resolve_device(args.device)
    tasks = list(TASKS) if args.task == "all" else [args.task]

    with tempfile.TemporaryDirectory(prefix="adalncache-demo-") as tmp:
        root = Path(tmp)
        built = tiny_transformer(args.size, seed=args.seed)
        model = save_tiny(built, root / "diffusers", dtype=torch.bfloat16)
        del built
        # The whole model under the MiniMax release's names, sharded like the release.
        checkpoint = write_native_model(model, root / "native", shards=2, qkv_layout="interleaved")
        model = model.to(device)
        _print_header(args.size, model, device, args.seed, checkpoint)
        results = [
            run_task(model, checkpoint, task, args.steps, seed=args.seed, device=device, config=root / "diffusers")
            for task in tasks
        ]
        for result in results:
            _print_result(result)
    ok = all(result.identical for result in results)
    if len(results) > 1:
        print(f"\nall tasks bit-identical: {'yes' if ok else 'no'}")
    return 0 if ok else 1


def _seed(text: str) -> int:
    """``--seed``: an integer torch's generators take (0 to 2**63 - 1), else argparse's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed takes an integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"--seed must be in 0..{2**63 - 1}, got {value}")
    return value


def register(subparsers: Any) -> None:
    """Add the ``demo`` sub-command to the ``adalncache`` command line."""
    parser = subparsers.add_parser(
        "demo",
        help="tiny MiniMax-H3, resident vs cached: bit-exactness and memory verdict",
        description=(
            "Build a deterministic tiny MiniMax-H3 in the released mixed precision, write its native "
            "checkpoint, run a denoising loop resident and with the AdaLN cache, and print a verdict. "
            "Exit status 1 when any output differs."
        ),
    )
    parser.add_argument(
        "--model",
        default="minimax-h3",
        choices=["minimax-h3", "qwen-image", *ADALN_ZERO_DEMOS],
        help="the model (default: minimax-h3; qwen-image runs a tiny QwenImagePipeline, bria and ovis-image a tiny "
        "BriaPipeline and OvisImagePipeline)",
    )
    parser.add_argument("--task", default="all", choices=[*TASKS, "all"], help="request kind (default: all three)")
    parser.add_argument(
        "--steps",
        type=int,
        default=8,
        help="scheduler grid points, terminal 0 included (default: 8 = 7 forwards)",
    )
    parser.add_argument(
        "--size",
        default="small",
        choices=["tiny", "small"],
        help="model size (default: small, savings in MB)",
    )
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--seed", type=_seed, default=0, help="seed of the weights and the noise (default: 0)")
    parser.set_defaults(func=run)


__all__ = ["DemoResult", "register", "run", "run_task"]
