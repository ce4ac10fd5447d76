"""The ``first-request`` section: a first request's wall time to the end of its first denoising step.

Two pipelines of the same seeded components run the same request from a cold cache
(``invalidate()`` before each run): one with the request's pass in the foreground (the whole
schedule before step 0), one with ``overlap=True`` (the pass on a background thread, step 0
waiting only for its own plans). Measured for a MiniMax-H3 modular pipeline (``--size``: its
pass starts at the denoise loop, after the prompt is encoded) and for a Qwen-Image pipeline with
a real tokenizer and text encoder (its pass starts when the call begins, from the schedule
predicted from the call's arguments, so it overlaps the prompt encoding too). The time measured
is from the call to the end of the first ``scheduler.step``: prompt encoding + pass + first step.
The request is then stopped (the rest of the loop is the same in both) and its holds released;
both handles' background passes are joined before each run, outside the timing
(``invalidate()`` does not wait for a pass: a pass still running would build into the next
run's cold cache and overlap its timing). Exactness: the whole request of each pipeline, run
once, ``torch.equal`` on the latents.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .results import Comparison, Results

#: Denoising steps of the measured request (its schedule's plans are what the pass builds).
STEPS = 8

#: The Qwen-Image request: a prompt the tiny tokenizer knows, with true CFG (two encodings).
QWEN_CALL: dict[str, Any] = {
    "prompt": "a cat playing a piano in the rain",
    "negative_prompt": "waves crash on a rocky shore",
    "true_cfg_scale": 2.0,
    "height": 64,
    "width": 64,
    "num_inference_steps": STEPS,
    "output_type": "latent",
}

#: The Qwen-Image pipeline by ``--size``: its transformer's tiny size and its text encoder's layers
#: (the encoding is what a pass started before it overlaps; at "medium" the two encodings take about
#: as long as the cold pass on a 2-core CPU).
QWEN_SIZES = {"tiny": ("tiny", 2), "small": ("medium", 160), "medium": ("medium", 160)}


class _FirstStepDone(Exception):
    """Raised by the wrapped ``scheduler.step`` to stop a timed request after its first step."""


def _minimax_call(pipe: Any) -> Any:
    return pipe(
        prompt="a cat playing a piano in the rain",
        height=64,
        width=64,
        num_frames=124,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output=["latents"],
        output_type="pt",
    )


def _qwen_call(pipe: Any) -> Any:
    return pipe(generator=torch.Generator().manual_seed(0), **QWEN_CALL)


def _call(pipe: Any, request: Callable[[Any], Any], *, stop_after_first: bool) -> Any:
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
        return request(pipe)
    except _FirstStepDone:
        return None
    finally:
        if own is None:
            del scheduler.step  # the instance attribute: the class's step shows through again
        else:
            scheduler.step = own


#: diffusers' modular pipelines log the traceback of an exception raised in a block: the stop is ours.
_BLOCK_LOGGER = "diffusers.modular_pipelines.modular_pipeline"


def _first_step_seconds(pipe: Any, handle: Any, request: Callable[[Any], Any], cold: Callable[[], object]) -> float:
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
    request: Callable[[Any], Any],
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
    """The final latents of a MiniMax-H3 (``output=["latents"]``) or Qwen-Image (``output_type="latent"``) call."""
    if hasattr(output, "images"):  # a pipeline output (itself a dict) of a classic pipeline
        images: torch.Tensor = output.images
        return images
    latents: torch.Tensor = output["latents"]
    return latents


def _disable_all(handles: dict[str, Any]) -> None:
    for handle in handles.values():
        handle.disable()


def bench_first_request(res: Results, size: str, runs: int, work: Path, device: torch.device | None = None) -> None:
    """Encode + pass + first step of a first request: overlapped against sequential, side by side."""
    try:
        from ...diffusers import enable_adaln_cache
        from ..tiny import tiny_pipeline
    except ImportError as exc:
        res.note(f"first-request comparison skipped: diffusers or transformers unavailable ({exc})")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipes = {
            name: tiny_pipeline(size=size, seed=0).to(device or torch.device("cpu"))
            for name in ("sequential", "overlapped")
        }
        for pipe in pipes.values():
            pipe.set_progress_bar_config(disable=True)
        handles = {name: enable_adaln_cache(pipe, overlap=name == "overlapped") for name, pipe in pipes.items()}
        try:
            measured, exact = _compare(pipes, handles, _minimax_call, runs)
        finally:
            _disable_all(handles)
    res.values["first_request"] = {"steps": STEPS, "size": size, "latents_bit_identical": exact, **measured}
    res.add(
        Comparison(
            f"first request, encode + pass + first step (tiny MiniMax-H3 pipeline, {size}, {STEPS} steps)",
            "overlapped",
            "sequential",
            measured["samples"]["overlapped"],
            measured["samples"]["sequential"],
            1.0,
            note=f"torch.equal latents: {exact}; overlapped runs two transactions (step 0's plans, then the rest)",
        )
    )
    _bench_qwen_first_request(res, runs, work, size, device or torch.device("cpu"))


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
    """The Qwen-Image rows: a transformer loaded by ``load_transformer`` (its projections never
    read), its checkpoint's pages dropped before each run (a first request after start-up), the
    pass started before the prompt is encoded ("early"), at the first forward ("late": a
    subclass with its own ``__call__`` gets no prediction), and before step 0 ("sequential")."""
    from diffusers import QwenImagePipeline

    from ...diffusers import enable_adaln_cache, load_transformer
    from ..measure import drop_page_cache
    from ..tiny_qwen import save_tiny_qwen, tiny_qwen_pipeline, tiny_qwen_transformer

    class LateStart(QwenImagePipeline):
        """``QwenImagePipeline`` with a ``__call__`` of its own: no schedule is predicted for it."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]  # diffusers' __call__ is untyped to mypy

    qwen_size, text_layers = QWEN_SIZES[size]
    directory = work / f"qwen-first-request-{qwen_size}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_tiny_qwen(tiny_qwen_transformer("plain", size=qwen_size), directory, dtype=torch.float32)
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
            measured, exact = _compare(pipes, handles, _qwen_call, runs, cold=cold)
            measured["parts_s"] = _qwen_parts(pipes["sequential"], handles["sequential"], runs, cold)
        finally:
            _disable_all(handles)
    measured["served_bytes_cached_at_start"] = max((c for c in cached if c is not None), default=None)
    res.values["first_request_qwen"] = {
        "steps": STEPS,
        "size": qwen_size,
        "text_encoder_layers": text_layers,
        "latents_bit_identical": exact,
        **measured,
    }
    samples, parts = measured["samples"], measured["parts_s"]
    what = f"tiny Qwen-Image pipeline, {qwen_size}, {STEPS} steps, true CFG, load_transformer, checkpoint pages dropped"
    res.add(
        Comparison(
            f"first request, encode + pass + first step ({what}): pass started before the prompt is encoded",
            "early",
            "sequential",
            samples["early"],
            samples["sequential"],
            1.0,
            note=(
                f"torch.equal latents: {exact}; the pass of the schedule predicted from the call's arguments; "
                f"alone: prompt encodings {parts['encode'] * 1e3:.0f} ms, cold pass {parts['pass'] * 1e3:.0f} ms"
            ),
        )
    )
    res.add(
        Comparison(
            f"first request, encode + pass + first step ({what}): started before the encoding / at the first forward",
            "early",
            "late",
            samples["early"],
            samples["late"],
            1.0,
            note="both overlapped; what starting before the prompt encoding adds",
        )
    )


__all__ = ["bench_first_request"]
