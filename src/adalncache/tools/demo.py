"""``adalncache demo``: a deterministic tiny model, resident versus cached, with a verdict.

MiniMax-H3 (the default), end to end and offline: a seeded transformer in the released mixed
precision, written as a sharded native-layout checkpoint, runs one request's denoising loop twice,
stock (projections resident) and loaded by :func:`~adalncache.diffusers.load_transformer` without
ever reading its AdaLN projections or time embedder, served by the cache. ``--model qwen-image |
bria | ovis-image``: the family's tiny diffusers pipeline (prompt embeddings instead of a text
encoder, which needs tokenizer files), its transformer saved in bf16 as a sharded diffusers
checkpoint, run the same two ways. The verdict compares every output with ``torch.equal``; the
table reports plans, passes, the bytes the load read and never read, and the time both ways.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cli import int_parser
from ..devices import resolve_device
from ..errors import ConfigError
from ..families import DEMOS
from ..families.minimax_h3 import TASKS
from ..spec import ModulationSpec

#: Small shards, so a family demo's checkpoint is sharded with its index like a released one.
SHARD_SIZE = "40KB"


@dataclass
class DemoResult:
    """One MiniMax-H3 task's outcome: what the table prints and whether the cached run was bit-identical."""

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


def _format_bytes(count: int, smallest: str = "B") -> str:
    """``count`` in MiB, else KiB, else (``smallest="B"``, the MiniMax-H3 table's) bytes."""
    if count >= 1 << 20:
        return f"{count / (1 << 20):.2f} MiB"
    if count >= 1 << 10 or smallest == "KiB":
        return f"{count / (1 << 10):.1f} KiB"
    return f"{count} B"


@dataclass
class _Load:
    """What ``load_transformer`` read of a checkpoint whose page cache was dropped first."""

    #: Bytes the load read (None where /proc cannot tell, or the page cache could not be dropped).
    read: int | None
    total: int
    #: Bytes of the served tensors in the files, and of their pages in the page cache after the load.
    never_read: int
    in_page_cache: int


def _measured_load(directory: Path, load: Callable[[], Any]) -> tuple[Any, _Load]:
    """``load()`` of the checkpoint in ``directory`` with its page cache dropped, and what it read."""
    from ..source.files import checkpoint_files
    from .measure import drop_page_cache, io_read_bytes, resident_served_bytes, served_bytes

    files = checkpoint_files(directory)[0]
    never_read, total = served_bytes(files)
    dropped = drop_page_cache(files)
    before = io_read_bytes()
    model = load()
    after = io_read_bytes()
    read = None if before is None or after is None or not dropped else after - before
    return model, _Load(read, total, never_read, resident_served_bytes(files))


def _load_line(load: _Load, served: str, smallest: str) -> str:
    """The table's ``load`` row: what the load read, and the ``served`` bytes it never read."""
    read = "?" if load.read is None else _format_bytes(load.read, smallest)
    cached = "none of them" if load.in_page_cache == 0 else _format_bytes(load.in_page_cache, smallest)
    return (
        f"load_transformer read {read} of the {_format_bytes(load.total, smallest)} checkpoint; "
        f"{_format_bytes(load.never_read, smallest)} of {served} never read ({cached} in the page cache)"
    )


def _print_rows(rows: Sequence[tuple[str, str]], identical: bool) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"bit-identical: {'yes' if identical else 'no'}")


def _served_bytes(model: Any, time_embedder: bool) -> int:
    """Bytes on the model's device of the projections the cache serves (and of the time embedder's linears,
    where the load leaves them out too): the modules the family's diffusers layout names."""
    spec = ModulationSpec.from_transformer(model)
    layout = spec.layout("diffusers")
    owners = {layout.prefix(layer) for layer in spec.layers()} | set(layout.time_embedder if time_embedder else ())
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if p.device.type != "meta" and name.rpartition(".")[0] in owners
    )


# ---------------------------------------------------------------------------------------------------- MiniMax-H3


def _table_bytes(cache: Any) -> int:
    """Device bytes of the cache's slab buffers (what replaces the weights on the device)."""
    names = ("plan_timesteps", "plan_lengths", "block_params", "final_params")
    return sum(t.numel() * t.element_size() for t in (getattr(cache, n, None) for n in names) if t is not None)


def run_task(
    model: Any, checkpoint: Path, task: str, steps: int, *, seed: int, device: torch.device, config: Path | None = None
) -> DemoResult:
    """Run one task on the stock ``model``, then on ``load_transformer(checkpoint)`` (its page cache dropped
    first, :func:`_measured_load`), and compare bit for bit. ``config``: the diffusers config directory
    of a native ``checkpoint``."""
    from ..diffusers import adaln_cache_handle, load_transformer
    from ..plans import minimax_h3_plans, plan_key
    from .tiny import make_request, run_loop

    request = make_request(model, task, steps, seed=seed, device=device)
    resident = run_loop(model, request)
    bytes_before = _served_bytes(model, time_embedder=True)

    # The plans known ahead of time, from the schedule alone, must be the loop's own plans.
    ahead = minimax_h3_plans(task, steps)
    distinct = len({plan_key(plan) for plan in ahead})
    # A slab sized to the request, so the table bytes reported are what this request needs.
    cached_model, load = _measured_load(
        checkpoint,
        lambda: load_transformer(
            checkpoint,
            config=config,
            torch_dtype=torch.bfloat16,
            device_map=device,
            max_plans=distinct,
            max_plan_width=4,
        ),
    )
    handle: Any = adaln_cache_handle(cached_model)
    try:
        bytes_after = _served_bytes(cached_model, time_embedder=True)
        table_bytes = _table_bytes(handle.cache)
        aot_match = [plan_key(p) for p in ahead] == [plan_key(p) for p in request.plans]
        report = handle.prepare(ahead)
        cached = run_loop(cached_model, request)
        stats = dict(handle.stats.as_dict())
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
        load_read_bytes=load.read,
        checkpoint_bytes=load.total,
        never_read_bytes=load.never_read,
        served_cached_after_load=load.in_page_cache,
    )


def _print_result(result: DemoResult) -> None:
    aot = "yes" if result.aot_plans_match else "NO"
    load = _Load(
        result.load_read_bytes, result.checkpoint_bytes, result.never_read_bytes, result.served_cached_after_load
    )
    before = _format_bytes(result.bytes_before)
    after = f"{_format_bytes(result.bytes_after)} weights + {_format_bytes(result.table_bytes)} table"
    rows = [
        ("task", result.task),
        ("steps", f"{result.steps} (grid points; {result.forwards} forwards)"),
        ("plans", f"{result.plans} distinct (ahead-of-time plans match the loop: {aot})"),
        ("passes", f"{result.passes} rebuild pass{'es' if result.passes != 1 else ''} for the whole request"),
        ("load", _load_line(load, "AdaLN projections and time embedder", "B")),
        ("AdaLN bytes on device", f"{before} resident -> {after} cached"),
        ("per-step time", f"{result.resident_ms:.2f} ms resident, {result.cached_ms:.2f} ms cached (median)"),
        ("cache stats", ", ".join(f"{k}={v}" for k, v in result.stats.items() if v or k == "passes")),
    ]
    print()
    _print_rows(rows, result.identical)


def run_minimax_h3(args: argparse.Namespace) -> int:
    """The MiniMax-H3 demo: 0 when every task is bit-identical, else 1."""
    from .tiny import SIZES, save_tiny, tiny_transformer, write_native_model

    if args.size not in SIZES:
        raise ConfigError(f"unknown size {args.size!r}: set --size to one of {', '.join(SIZES)}")
    if not isinstance(args.steps, int) or args.steps < 2:
        raise ConfigError(f"--steps must be an integer >= 2 (grid points, terminal 0 included), got {args.steps}")
    device = resolve_device(args.device)
    tasks = list(TASKS) if args.task == "all" else [args.task]

    with tempfile.TemporaryDirectory(prefix="adalncache-demo-") as tmp:
        root = Path(tmp)
        built = tiny_transformer(args.size, seed=args.seed)
        model: Any = save_tiny(built, root / "diffusers", dtype=torch.bfloat16)
        del built
        # The whole model under the MiniMax release's names, sharded like the release.
        checkpoint = write_native_model(model, root / "native", shards=2, qkv_layout="interleaved")
        model = model.to(device)
        config = model.config
        dtype = model.transformer_blocks[0].adaln_proj.linear.weight.dtype
        geometry = f"{config.num_layers} blocks, hidden {config.hidden_size}, time embedding {config.time_embed_dim}"
        precision = f"{str(dtype).removeprefix('torch.')} AdaLN projections, fp32 time embedder"
        print(
            f"adalncache demo: tiny MiniMax-H3 '{args.size}' ({geometry}), released mixed precision ({precision}), "
            f"device {device}, seed {args.seed}"
        )
        print(f"native checkpoint: {checkpoint} ({len(list(checkpoint.glob('*.safetensors')))} shards + index)")
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


# ---------------------------------------------------------------------------------------------------- pipelines


@dataclass(frozen=True)
class _PipelineDemo:
    """What differs between the pipeline demos (Qwen-Image and the AdaLayerNormZero family's).

    ``request``: the request row (``{steps}`` filled in); ``never_read``: what the cached load never
    reads; ``inputs``: the request's arguments besides the steps and the generator;
    ``time_embedder``: whether the cached load leaves the time embedder out too.
    """

    title: str
    request: str
    never_read: str
    build: Callable[[int], Any]
    pipeline: Callable[[Any, int], Any]
    inputs: Callable[[Any, int, torch.device], dict[str, Any]]
    time_embedder: bool


#: Image size of the Qwen-Image request: 64 px is a 4 x 4 grid of packed latent tokens.
QWEN_SIZE = 64
#: Image size of the AdaLayerNormZero requests (the tiny VAE does not downsample: a 4 x 4 grid of packed
#: tokens), and their guidance scale.
ADALN_ZERO_SIZE = 8
GUIDANCE = 4.0


def _qwen_demo() -> _PipelineDemo:
    from .tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline, tiny_qwen_transformer

    def inputs(stock: Any, seed: int, device: torch.device) -> dict[str, Any]:
        prompt = {k: v.to(device) for k, v in tiny_prompt_embeds(stock, seed=seed).items()}
        return {"height": QWEN_SIZE, "width": QWEN_SIZE, "output_type": "pt", "true_cfg_scale": 1.0, **prompt}

    return _PipelineDemo(
        title="tiny Qwen-Image",
        request=f"{QWEN_SIZE}x{QWEN_SIZE}, {{steps}} steps (QwenImagePipeline, bf16)",
        never_read="modulation projections and timestep embedder",
        build=lambda seed: tiny_qwen_transformer("plain", seed=seed),
        pipeline=lambda stock, seed: tiny_qwen_pipeline(seed=seed, transformer=stock),
        inputs=inputs,
        time_embedder=True,
    )


def _adaln_zero_demo(name: str) -> _PipelineDemo:
    from ..families import adaln_zero
    from .tiny_adaln_zero import CONFIGS, PIPELINES, prompt_embeds, seeded_model, tiny_pipeline

    _, class_name = DEMOS[name]

    def inputs(stock: Any, seed: int, device: torch.device) -> dict[str, Any]:
        return {
            "prompt_embeds": prompt_embeds(stock, seed=seed + 1).to(device),
            "negative_prompt_embeds": prompt_embeds(stock, seed=seed + 2).to(device),
            "guidance_scale": GUIDANCE,
            "height": ADALN_ZERO_SIZE,
            "width": ADALN_ZERO_SIZE,
            "output_type": "latent",
            **({"negative_prompt": None} if name == "ovis-image" else {}),
        }

    size = f"{ADALN_ZERO_SIZE}x{ADALN_ZERO_SIZE}"
    return _PipelineDemo(
        title=f"tiny {adaln_zero.layout_of(class_name).title} ({class_name})",
        request=f"{size}, {{steps}} steps, guidance {GUIDANCE:g} ({PIPELINES[class_name]}, bf16)",
        never_read="modulation projections",
        build=lambda seed: seeded_model(class_name, CONFIGS[class_name], seed=seed),
        pipeline=lambda stock, seed: tiny_pipeline(stock),
        inputs=inputs,
        time_embedder=False,
    )


@contextlib.contextmanager
def _no_loading_bars() -> Iterator[None]:
    """diffusers' shard-loading progress bars off for the block (the demo prints its own lines only)."""
    from diffusers.utils import logging as diffusers_logging

    enabled = diffusers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            diffusers_logging.enable_progress_bar()


def run_pipeline(args: argparse.Namespace, demo: _PipelineDemo) -> int:
    """A pipeline demo: 0 when the cached request's output equals the resident one, else 1.

    The cached half puts a ``load_transformer`` model in the pipeline and enables the cache on the
    pipeline, which adopts the loaded cache and watches the scheduler.
    """
    from ..diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
    from .tiny import save_released

    if not isinstance(args.steps, int) or args.steps < 1:
        raise ConfigError(f"--steps must be a positive integer (num_inference_steps), got {args.steps}")
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix=f"adalncache-demo-{args.model}-") as tmp:
        directory = Path(tmp) / "transformer"
        built = demo.build(args.seed)
        save_released(built, directory, max_shard_size=SHARD_SIZE)
        with _no_loading_bars():
            stock = type(built).from_pretrained(directory, torch_dtype=torch.bfloat16).to(device).eval()
        pipe = demo.pipeline(stock, args.seed).to(device)
        pipe.set_progress_bar_config(disable=True)  # the demo prints its own lines only
        inputs = demo.inputs(stock, args.seed, device)

        def run() -> tuple[torch.Tensor, float]:
            generator = torch.Generator(device).manual_seed(args.seed)
            start = time.perf_counter()
            out = pipe(num_inference_steps=args.steps, generator=generator, **inputs)
            return out.images, time.perf_counter() - start

        resident, resident_s = run()
        bytes_before = _served_bytes(stock, demo.time_embedder)
        model, load = _measured_load(
            directory, lambda: load_transformer(directory, torch_dtype=torch.bfloat16, device_map=device)
        )
        pipe.transformer = model
        handle: Any = enable_adaln_cache(pipe)
        try:
            cached, seconds = run()
            served = adaln_cache_handle(model)
            assert served is not None, "enable_adaln_cache(pipe) enables the pipeline's transformer"
            table_bytes, plans, passes = served.cache.slab_bytes, len(handle.cache), handle.stats.passes
            bytes_after = _served_bytes(model, demo.time_embedder)
        finally:
            handle.disable()
    identical = torch.equal(cached, resident)
    rows = [
        ("request", demo.request.format(steps=args.steps)),
        ("plans", f"{plans} distinct, built in {passes} pass(es) before the first step"),
        ("load", _load_line(load, demo.never_read, "KiB")),
        (
            "modulation bytes on device",
            f"{_format_bytes(bytes_before, 'KiB')} resident -> {_format_bytes(bytes_after, 'KiB')} "
            f"weights + {_format_bytes(table_bytes, 'KiB')} table cached",
        ),
        ("request time", f"{resident_s * 1000:.1f} ms resident, {seconds * 1000:.1f} ms cached"),
    ]
    print(f"adalncache demo: {demo.title}, device {device}, seed {args.seed}")
    _print_rows(rows, identical)
    return 0 if identical else 1


# ---------------------------------------------------------------------------------------------------- command


def run(args: argparse.Namespace) -> int:
    """The ``demo`` sub-command: returns 0 when every output is bit-identical, else 1."""
    model = getattr(args, "model", "minimax-h3")
    family, _ = DEMOS[model]  # each demo model's family runs it its own way
    if family.name == "qwen-image":
        return run_pipeline(args, _qwen_demo())
    if family.name == "adaln-zero":
        return run_pipeline(args, _adaln_zero_demo(model))
    return run_minimax_h3(args)


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
        choices=list(DEMOS),
        help="the model (default: minimax-h3; qwen-image runs a tiny QwenImagePipeline, bria and ovis-image a tiny "
        "BriaPipeline and OvisImagePipeline)",
    )
    parser.add_argument("--task", default="all", choices=[*TASKS, "all"], help="request kind (default: all three)")
    parser.add_argument(
        "--steps", type=int, default=8, help="scheduler grid points, terminal 0 included (default: 8 = 7 forwards)"
    )
    parser.add_argument(
        "--size", default="small", choices=["tiny", "small"], help="model size (default: small, savings in MB)"
    )
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    # An integer torch's generators take (0 to 2**63 - 1), else argparse's one-line error.
    seed = int_parser("--seed", 0, 2**63)
    parser.add_argument("--seed", type=seed, default=0, help="seed of the weights and the noise (default: 0)")
    parser.set_defaults(func=run)
