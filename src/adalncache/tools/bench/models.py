"""The sections on tiny real models: ``forward``, ``qwen``, ``first-request``, ``deploy``.

Each runs a tiny diffusers model or pipeline (:mod:`adalncache.tools.tiny`,
:mod:`adalncache.tools.tiny_qwen`) resident and served by the cache, checks the outputs with
``torch.equal``, and measures the two side by side.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...plans import minimax_h3_plans, plan_key
from ...source.files import checkpoint_files
from ..measure import (
    OnloadMeter,
    drop_page_cache,
    io_read_bytes,
    proc_status,
    resident_served_bytes,
    served_bytes,
    timed,
)
from .primitives import in_fresh_process
from .workload import Comparison, Results

# ---------------------------------------------------------------------------------------------------- forward


def forward_rounds(
    models: Mapping[str, Any], calls: Sequence[Mapping[str, Any]], runs: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds of each model's forward on each of ``calls``, ``2 * runs`` rounds, the models taking turns
    call by call (drifting load on a shared machine hits them alike)."""
    samples: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for _ in range(max(runs, 1) * 2):
            for call in calls:
                for name, model in models.items():
                    samples[name].append(timed(partial(model, **call), device))
    return samples


def bench_forward(res: Results, size: str, steps: int, runs: int, device: torch.device) -> None:
    """The ``forward`` section: a forward step of a tiny MiniMax-H3, resident, served from the cache, and offloaded.

    Three instances of the same seeded model run the same request: projections resident, the cache
    enabled, and diffusers' group offloading moving the projections (to disk on a CPU, where
    offloading to the CPU would be a no-op; to host memory on a GPU). Exactness comes from the real
    denoising loop; timing is per step, the three taking turns.
    """
    if res.lacks("forward comparison", "diffusers"):
        return
    from diffusers.hooks import apply_group_offloading

    from ...diffusers import enable_adaln_cache
    from ..tiny import make_request, run_loop, tiny_transformer

    model: Any = tiny_transformer(size).to(device)
    request = make_request(model, "t2va", steps, device=device)
    cached_model: Any = tiny_transformer(size).to(device)
    distinct = len({plan_key(p) for p in request.plans})
    handle: Any = enable_adaln_cache(cached_model, max_plans=distinct, max_plan_width=4)
    off_model: Any = tiny_transformer(size).to(device)
    on_gpu = device.type == "cuda"
    offload_to = "host" if on_gpu else "disk"
    with tempfile.TemporaryDirectory(prefix="adalncache-offload-") as tmp:
        modules = [(f"block{n}", b.adaln_proj) for n, b in enumerate(off_model.transformer_blocks)]
        for name, module in [*modules, ("norm_out", off_model.norm_out)]:
            where: dict[str, Any] = (
                {"offload_device": torch.device("cpu")} if on_gpu else {"offload_to_disk_path": os.path.join(tmp, name)}
            )
            apply_group_offloading(module, onload_device=device, offload_type="leaf_level", **where)
        try:
            handle.prepare(request.plans)
            variants = {"resident": model, "cached": cached_model, "offload": off_model}
            outs = {name: run_loop(which, request) for name, which in variants.items()}  # also the warm-up
            calls = [
                request.forward_kwargs(step, request.latents, request.audio_latents)
                for step in range(len(request.plan))
            ]
            samples = forward_rounds(variants, calls, runs, device)
        finally:
            handle.disable()
    exact = bool(outs["resident"].equal(outs["cached"]))
    res.values["forward"] = {
        "size": size,
        "steps": steps,
        "cached_bit_identical": exact,
        "device": str(device),
        "offload_to": offload_to,
        "offload_bit_identical": bool(outs["resident"].equal(outs["offload"])),
    }
    name = f"forward step, tiny '{size}'"
    note = f"torch.equal outputs: {exact}"
    res.add(Comparison(name, "cached", "resident", samples["cached"], samples["resident"], 1.0, note=note))
    res.add(Comparison(name, "cached", f"group offload ({offload_to})", samples["cached"], samples["offload"]))


# ---------------------------------------------------------------------------------------------------- qwen

#: The ``qwen`` section's forward timesteps (the pipeline's ``t / 1000``).
QWEN_TIMESTEPS = (0.999, 0.75, 0.5)


def bench_qwen(res: Results, runs: int, device: torch.device) -> None:
    """The ``qwen`` section: a forward step of a tiny Qwen-Image (bf16, the released dtype), resident and
    served from the cache (every plan prepared in one pass first); ``torch.equal`` on every step's
    output, timing per step, the two taking turns."""
    if res.lacks("qwen forward comparison", "diffusers"):
        return
    from ...diffusers import enable_adaln_cache
    from ..tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer

    models: dict[str, Any] = {
        name: tiny_qwen_transformer("plain").to(device=device, dtype=torch.bfloat16) for name in ("resident", "cached")
    }
    inputs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tiny_qwen_inputs(models["resident"]).items()
    }
    steps = [torch.tensor([t], dtype=torch.bfloat16, device=device) for t in QWEN_TIMESTEPS]
    handle: Any = enable_adaln_cache(models["cached"], max_plans=len(steps))
    calls = [{**inputs, "timestep": t} for t in steps]
    exact = True
    try:
        handle.prepare(steps)
        with torch.no_grad():
            for call in calls:
                out = {name: model(**call)[0] for name, model in models.items()}
                exact = exact and torch.equal(out["resident"], out["cached"])
        samples = forward_rounds(models, calls, runs, device)
        passes = int(handle.stats.passes)
    finally:
        handle.disable()
    res.values["qwen_forward"] = {"steps": len(steps), "cached_bit_identical": exact, "passes": passes}
    note = f"torch.equal outputs: {exact}; {passes} pass for the request"
    name = "forward step, tiny Qwen-Image (bf16)"
    res.add(Comparison(name, "cached", "resident", samples["cached"], samples["resident"], 1.0, note=note))


# ---------------------------------------------------------------------------------------------------- first-request

#: Denoising steps of the first-request section's request (its schedule's plans are what the pass builds).
FIRST_REQUEST_STEPS = 8

#: The MiniMax-H3 request (its pipeline's own latents returned).
MINIMAX_CALL: dict[str, Any] = {
    "prompt": "a cat playing a piano in the rain",
    "height": 64,
    "width": 64,
    "num_frames": 124,
    "num_inference_steps": FIRST_REQUEST_STEPS,
    "output": ["latents"],
    "output_type": "pt",
}
#: The Qwen-Image request: a prompt the tiny tokenizer knows, with true CFG (two encodings).
QWEN_CALL: dict[str, Any] = {
    "prompt": "a cat playing a piano in the rain",
    "negative_prompt": "waves crash on a rocky shore",
    "true_cfg_scale": 2.0,
    "height": 64,
    "width": 64,
    "num_inference_steps": FIRST_REQUEST_STEPS,
    "output_type": "latent",
}

#: The Qwen-Image pipeline by ``--size``: its transformer's tiny size and its text encoder's layers
#: (the encoding is what a pass started before it overlaps; at "medium" the two encodings take about
#: as long as the cold pass on a 2-core CPU).
QWEN_SIZES = {"tiny": ("tiny", 2), "small": ("medium", 160), "medium": ("medium", 160)}

#: diffusers' modular pipelines log the traceback of an exception raised in a block: the stop is ours.
_BLOCK_LOGGER = "diffusers.modular_pipelines.modular_pipeline"


class _FirstStepDone(Exception):
    """Raised by the wrapped ``scheduler.step`` to stop a timed request after its first step."""


def _call(pipe: Any, request: Mapping[str, Any], *, stop_after_first: bool) -> Any:
    scheduler = pipe.scheduler
    own = scheduler.__dict__.get("step")  # the cache's own watch of a classic pipeline's steps, if any
    original = scheduler.step

    def step(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if stop_after_first:
            raise _FirstStepDone
        return out

    scheduler.step = step
    try:
        return pipe(generator=torch.Generator().manual_seed(0), **request)
    except _FirstStepDone:
        return None
    finally:
        if own is None:
            del scheduler.step  # the instance attribute: the class's step shows through again
        else:
            scheduler.step = own


def _first_step_seconds(pipe: Any, handle: Any, request: Mapping[str, Any], cold: Callable[[], object]) -> float:
    handle.cache.invalidate()  # cold: the request's pass runs (the caller joined every pass still running)
    cold()
    logger = logging.getLogger(_BLOCK_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        started = time.perf_counter()
        _call(pipe, request, stop_after_first=True)
        return time.perf_counter() - started
    finally:
        logger.setLevel(level)
        for transformer in handle.handles.values():  # the stopped request's holds (a classic pipeline keeps them)
            transformer.release(check=False)


def _compare(
    pipes: dict[str, Any],
    handles: dict[str, Any],
    request: Mapping[str, Any],
    runs: int,
    cold: Callable[[], object] = lambda: None,
) -> tuple[dict[str, Any], bool]:
    """Time each pipeline's first request, taking turns (``cold()`` before each); then whether every
    pipeline's whole request equals the ``"sequential"`` one's."""
    outputs = {name: _latents(_call(pipe, request, stop_after_first=False)) for name, pipe in pipes.items()}
    exact = all(torch.equal(outputs["sequential"], latents) for latents in outputs.values())
    samples: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(max(runs, 1)):
        for name in samples:  # taking turns, so drifting load hits both alike
            for handle in handles.values():  # untimed: no stopped request's pass runs beside it
                handle.join_background()
            samples[name].append(_first_step_seconds(pipes[name], handles[name], request, cold))
    for handle in handles.values():
        handle.join_background()  # the last stopped request's pass, still running
    passes = {name: int(handle.stats.passes) for name, handle in handles.items()}
    return {"samples": samples, "passes": passes}, exact


def _latents(output: Any) -> torch.Tensor:
    """The final latents of a MiniMax-H3 (``output=["latents"]``) or Qwen-Image (``output_type="latent"``) call
    (the latter's output is itself a dict: ``images`` tells it apart)."""
    latents: torch.Tensor = output.images if hasattr(output, "images") else output["latents"]
    return latents


def bench_first_request(res: Results, size: str, runs: int, work: Path, device: torch.device | None = None) -> None:
    """The ``first-request`` section: a first request's wall time to the end of its first ``scheduler.step``
    (prompt encoding + pass + first step), from a cold cache.

    Pipelines of the same seeded components, one with the request's pass before step 0, one with
    ``overlap=True`` (step 0 waits only for its own plans): a MiniMax-H3 modular pipeline (its pass
    starts at the denoise loop) and a Qwen-Image pipeline with a real text encoder (its pass starts
    when the call begins, so it overlaps the prompt encoding too). The request is then stopped (the
    rest is the same in both) and every background pass joined outside the timing: ``invalidate()``
    does not wait for one, which would build into the next run's cold cache. Exactness: each
    pipeline's whole request once, ``torch.equal`` on the latents.
    """
    if res.lacks("first-request comparison", "diffusers", "transformers"):
        return
    from ...diffusers import enable_adaln_cache
    from ..tiny import tiny_pipeline

    device = device or torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipes = {name: tiny_pipeline(size=size, seed=0).to(device) for name in ("sequential", "overlapped")}
        for pipe in pipes.values():
            pipe.set_progress_bar_config(disable=True)
        handles = {name: enable_adaln_cache(pipe, overlap=name == "overlapped") for name, pipe in pipes.items()}
        try:
            measured, exact = _compare(pipes, handles, MINIMAX_CALL, runs)
        finally:
            for handle in handles.values():
                handle.disable()
    res.values["first_request"] = {
        "steps": FIRST_REQUEST_STEPS,
        "size": size,
        "latents_bit_identical": exact,
        **measured,
    }
    samples = measured["samples"]
    name = f"first request, encode + pass + first step (tiny MiniMax-H3 pipeline, {size}, {FIRST_REQUEST_STEPS} steps)"
    note = f"torch.equal latents: {exact}; overlapped runs two transactions (step 0's plans, then the rest)"
    res.add(Comparison(name, "overlapped", "sequential", samples["overlapped"], samples["sequential"], 1.0, note))
    _bench_qwen_first_request(res, runs, work, size, device)


def _qwen_parts(pipe: Any, handle: Any, runs: int, cold: Callable[[], object]) -> dict[str, float]:
    """Medians of what the first step waits for, alone: the two prompt encodings, and a cold pass of the schedule."""
    import inspect

    from ...integrations.diffusers.qwen_image import predicted_timesteps, schedule_timesteps

    bound = inspect.signature(type(pipe).__call__).bind(pipe, **QWEN_CALL)
    bound.apply_defaults()
    call = {name: value for name, value in bound.arguments.items() if name != "self"}
    plans = schedule_timesteps(predicted_timesteps(pipe, call), batch=1, dtype=torch.float32)
    transformer = handle.handles["transformer"]
    encode, passes = [], []
    for _ in range(max(runs, 1)):
        started = time.perf_counter()
        for prompt in (QWEN_CALL["prompt"], QWEN_CALL["negative_prompt"]):
            pipe.encode_prompt(prompt=prompt, device=pipe._execution_device)
        encode.append(time.perf_counter() - started)
        handle.cache.invalidate()
        cold()
        started = time.perf_counter()
        transformer.prepare(plans)
        passes.append(time.perf_counter() - started)
        transformer.release()
    return {"encode": statistics.median(encode), "pass": statistics.median(passes)}


def _bench_qwen_first_request(res: Results, runs: int, work: Path, size: str, device: torch.device) -> None:
    """The Qwen-Image rows: ``load_transformer``, the checkpoint's pages dropped before each run (a first
    request after start-up); the pass started before the prompt is encoded ("early"), at the first
    forward ("late": a subclass with its own ``__call__`` gets no prediction), before step 0 ("sequential")."""
    from diffusers import QwenImagePipeline

    from ...diffusers import enable_adaln_cache, load_transformer
    from ..tiny import save_tiny
    from ..tiny_qwen import tiny_qwen_pipeline, tiny_qwen_transformer

    class LateStart(QwenImagePipeline):
        """``QwenImagePipeline`` with a ``__call__`` of its own: no schedule is predicted for it."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]  # diffusers' __call__ is untyped to mypy

    qwen_size, text_layers = QWEN_SIZES[size]
    directory = work / f"qwen-first-request-{qwen_size}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_tiny(tiny_qwen_transformer("plain", size=qwen_size), directory, dtype=torch.float32)
        files = sorted(directory.glob("*.safetensors"))
        pipes: dict[str, Any] = {}
        for name in ("sequential", "late", "early"):
            transformer = load_transformer(
                directory, torch_dtype=torch.float32, device_map=device, overlap=name != "sequential"
            )
            pipe = tiny_qwen_pipeline(transformer=transformer.eval(), text_encoder_layers=text_layers)
            chosen: Any = LateStart(**pipe.components) if name == "late" else pipe
            pipes[name] = chosen.to(device)
            pipes[name].set_progress_bar_config(disable=True)
        handles = {name: enable_adaln_cache(pipe) for name, pipe in pipes.items()}
        cached: list[float | None] = []

        source: Any = handles["sequential"].cache.source  # a CheckpointSource: load_transformer's files

        def cold() -> None:
            drop_page_cache(files)
            cached.append(source.cached_fraction())

        try:
            measured, exact = _compare(pipes, handles, QWEN_CALL, runs, cold=cold)
            measured["parts_s"] = _qwen_parts(pipes["sequential"], handles["sequential"], runs, cold)
        finally:
            for handle in handles.values():
                handle.disable()
    measured["served_bytes_cached_at_start"] = max((c for c in cached if c is not None), default=None)
    res.values["first_request_qwen"] = {
        "steps": FIRST_REQUEST_STEPS,
        "size": qwen_size,
        "text_encoder_layers": text_layers,
        "latents_bit_identical": exact,
        **measured,
    }
    samples, parts = measured["samples"], measured["parts_s"]
    what = (
        f"tiny Qwen-Image pipeline, {qwen_size}, {FIRST_REQUEST_STEPS} steps, true CFG, load_transformer, "
        "checkpoint pages dropped"
    )
    note = (
        f"torch.equal latents: {exact}; the pass of the schedule predicted from the call's arguments; "
        f"alone: prompt encodings {parts['encode'] * 1e3:.0f} ms, cold pass {parts['pass'] * 1e3:.0f} ms"
    )
    name = f"first request, encode + pass + first step ({what}): pass started before the prompt is encoded"
    res.add(Comparison(name, "early", "sequential", samples["early"], samples["sequential"], 1.0, note))
    note = "both overlapped; what starting before the prompt encoding adds"
    name = f"first request, encode + pass + first step ({what}): started before the encoding / at the first forward"
    res.add(Comparison(name, "early", "late", samples["early"], samples["late"], 1.0, note))


# ---------------------------------------------------------------------------------------------------- deploy

#: The modes of :func:`memory_probe`: a stock load then ``enable_adaln_cache`` (serving the model's
#: own weights, or the checkpoint), and ``load_transformer``.
MODES = ("stock", "stock-checkpoint", "load_transformer")


def memory_probe(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: load (``args["mode"]``, one of :data:`MODES`), enable, prepare and run one request.

    Returns the bytes the load read, the served bytes it left in the page cache, and the peak
    resident memory above the level after the imports (``peak``; ``VmHWM`` is reset through
    ``/proc/self/clear_refs`` once they are done), with its anonymous and file-backed parts.
    """
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from ...diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
    from ..tiny import make_request, run_loop

    mode, checkpoint = args["mode"], Path(args["checkpoint"])
    task, steps = args.get("task", "t2va"), int(args.get("steps", 4))
    torch.set_num_threads(1)
    files = checkpoint_files(checkpoint)[0]
    plans = minimax_h3_plans(task, steps)
    distinct = len({plan_key(p) for p in plans})
    dropped = drop_page_cache(files)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of what follows
        resettable = True
    except OSError:
        resettable = False
    base = proc_status()
    read0 = io_read_bytes()
    started = time.perf_counter()
    if mode == "load_transformer":
        model: Any = load_transformer(checkpoint, torch_dtype=torch.bfloat16, max_plans=distinct)
    elif mode in ("stock", "stock-checkpoint"):
        model = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint, torch_dtype=torch.bfloat16)
    else:
        raise ValueError(f"unknown mode {mode!r}: one of {MODES}")
    load_seconds = time.perf_counter() - started
    read1 = io_read_bytes()
    served_resident = resident_served_bytes(files)
    if mode != "load_transformer":
        enable_adaln_cache(model, checkpoint if mode == "stock-checkpoint" else None, max_plans=distinct)
    handle: Any = adaln_cache_handle(model)
    request = make_request(model, task, steps, seed=0)
    report = handle.prepare(plans)
    run_loop(model, request)
    end = proc_status()
    return {
        "mode": mode,
        "dropped": dropped,
        "peak_resettable": resettable,
        "load_read_bytes": None if read0 is None or read1 is None else read1 - read0,
        "load_seconds": load_seconds,
        "served_resident_after_load": served_resident,
        "peak": end["VmHWM"] - base["VmRSS"],
        "anon": end["RssAnon"] - base["RssAnon"],
        "file": end["RssFile"] - base["RssFile"],
        "passes": report.passes,
        "source_bytes_read": int(getattr(handle.source, "bytes_read", 0)),
    }


def bench_deploy(res: Results, size: str, steps: int, *, quick: bool = False) -> None:
    """The ``deploy`` section: deploying without the projections, on a tiny MiniMax-H3 in the released precision.

    Measured, ``from_pretrained`` + ``enable_adaln_cache`` against ``load_transformer``, each in a
    fresh process (:func:`memory_probe`): the peak resident memory of load + enable + one request,
    the bytes the load reads (page cache dropped first) and leaves cached; then the bytes
    block-level group offloading onloads per forward with and without the cache; then the released
    model as ``adalncache fit`` arithmetic. ``quick`` leaves out the stock load served from its checkpoint.
    """
    if res.lacks("deploy section", "diffusers"):
        return
    from ..tiny import save_released, tiny_transformer

    values: dict[str, Any] = {"size": size}
    with tempfile.TemporaryDirectory(prefix="adalncache-deploy-") as tmp:
        checkpoint = Path(tmp) / "transformer"
        # The released mixed precision in the file: bf16 blocks and projections, fp32 time embedder and heads.
        save_released(tiny_transformer(size), checkpoint)
        served, total = served_bytes(checkpoint_files(checkpoint)[0])
        modes = [mode for mode in MODES if not (quick and mode == "stock-checkpoint")]
        args = {"checkpoint": str(checkpoint), "steps": steps}
        probes = {
            mode: in_fresh_process(f"{__name__}:memory_probe", {**args, "mode": mode}, timeout=600) for mode in modes
        }
        values.update({"served_bytes": served, "checkpoint_bytes": total, "probes": probes})
        _compare_probes(res, size, probes, served, total)
        values["onloaded_per_forward"] = onloads = onloaded_per_forward(checkpoint, steps)
        name = f"bytes onloaded per forward by group offloading (block level, 1 block per group), '{size}'"
        note = "the projections and the time embedder are never onloaded"
        with_, without = [onloads["with"]], [onloads["without"]]
        res.add(Comparison(name, "with the cache", "without", with_, without, None, note=note, unit="bytes"))
    values.update(_released(res))
    res.values["deploy"] = values


def _compare_probes(res: Results, size: str, probes: dict[str, Any], served: int, total: int) -> None:
    """The fresh processes side by side: peak resident memory, and the bytes their load read."""
    new, mib = probes["load_transformer"], 2**20
    for stock_mode, label in (("stock", "its own weights"), ("stock-checkpoint", "checkpoint=")):
        if stock_mode not in probes:
            continue
        stock = probes[stock_mode]
        note = (
            f"anonymous {new['anon'] / mib:.0f} vs {stock['anon'] / mib:.0f} MiB, file-backed "
            f"{new['file'] / mib:.0f} vs {stock['file'] / mib:.0f} MiB; served tensors "
            f"{served / mib:.0f} MiB of {total / mib:.0f} MiB"
        )
        name = f"peak resident memory of load + enable + one t2va request, '{size}' (fresh processes)"
        baseline = f"from_pretrained + enable_adaln_cache({label})"
        peaks = [float(new["peak"])], [float(stock["peak"])]
        res.add(Comparison(name, "load_transformer", baseline, *peaks, None, note=note, unit="bytes"))
    stock = probes["stock"]
    if new["load_read_bytes"] is not None and stock["load_read_bytes"]:
        note = (
            f"served tensors' pages cached by the load: {new['served_resident_after_load']} B vs "
            f"{stock['served_resident_after_load'] / mib:.1f} MiB"
        )
        name = f"checkpoint bytes read by the load, '{size}' (page cache dropped)"
        reads = [float(new["load_read_bytes"])], [float(stock["load_read_bytes"])]
        res.add(Comparison(name, "load_transformer", "from_pretrained", *reads, None, note=note, unit="bytes"))


def onloaded_per_forward(checkpoint: Path, steps: int) -> dict[str, float]:
    """Bytes block-level group offloading (1 block per group, CPU to CPU) onloads per forward, without and
    with the cache."""
    from diffusers.hooks import apply_group_offloading
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from ...diffusers import adaln_cache_handle, load_transformer
    from ..tiny import make_request, run_loop

    cpu = torch.device("cpu")
    onloads: dict[str, float] = {}
    for name, load in (("without", MiniMaxH3Transformer3DModel.from_pretrained), ("with", load_transformer)):
        model: Any = load(checkpoint, torch_dtype=torch.bfloat16)
        apply_group_offloading(
            model, onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1
        )
        request = make_request(model, "t2va", steps)
        if name == "with":
            handle: Any = adaln_cache_handle(model)
            handle.prepare(request.plans)
        meter = OnloadMeter(model)
        run_loop(model, request)
        onloads[name] = meter.bytes / len(request.plan)
        del model
    return onloads


def _released(res: Results) -> dict[str, Any]:
    """The released model's arithmetic, as notes: ``adalncache fit --released minimax-h3 --recipe bf16``."""
    from ...fit import default_tables, fit, recipes, released_model

    model = released_model("minimax-h3")
    found = fit(model, default_tables(model), recipe_names=("bf16",))
    bf16 = model.footprint(recipes()["bf16"])
    moved = [sum(b for b, _ in bf16.blocks), sum(b - s for b, s in bf16.blocks)]  # what block offload moves per step
    gib, table = 2**30, found["rows"][0]["table_bytes"]
    res.note(
        f"released MiniMax-H3 (arithmetic, not measurement, adalncache fit): weights {bf16.total / gib:.1f} GiB, "
        f"projections {bf16.served / gib:.1f} GiB; block-level group offloading moves {moved[0] / gib:.1f} GiB per "
        f"step without the cache, {moved[1] / gib:.1f} GiB with it; the slab for a 50-step t2va request holds "
        f"{table / gib:.2f} GiB"
    )
    for row in found["rows"]:
        fits = ", ".join(
            f"{card} GB: {'yes' if row['fits_without'][card] else 'no'}/{'yes' if row['fits_with'][card] else 'no'}"
            for card in row["fits_without"]
        )
        res.note(
            f"released, {row['placement']} (arithmetic): {row['without_cache_bytes'] / gib:.1f} GiB without the cache, "
            f"{row['with_cache_bytes'] / gib:.1f} GiB with it; fits without/with: {fits}"
        )
    return {"card_table": found["rows"], "released_onloaded_per_step": moved}
