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
import time
import warnings
from collections.abc import Callable
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

#: Text encoder layers of the Qwen-Image pipeline (its encoding is what the early pass overlaps).
QWEN_TEXT_LAYERS = 12


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


def _first_step_seconds(pipe: Any, handle: Any, request: Callable[[Any], Any]) -> float:
    handle.cache.invalidate()  # cold: the request's pass runs (the caller joined every pass still running)
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


def _compare(pipes: dict[str, Any], request: Callable[[Any], Any], runs: int) -> tuple[dict[str, Any], bool]:
    """Time each pipeline's first request, taking turns; then whether their whole requests are equal."""
    from ...diffusers import enable_adaln_cache

    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    handles = {name: enable_adaln_cache(pipe, overlap=name == "overlapped") for name, pipe in pipes.items()}
    try:
        outputs = {name: _call(pipe, request, stop_after_first=False) for name, pipe in pipes.items()}
        exact = torch.equal(_latents(outputs["sequential"]), _latents(outputs["overlapped"]))
        samples: dict[str, list[float]] = {"sequential": [], "overlapped": []}
        for _ in range(max(runs, 1)):
            for name in samples:  # taking turns, so drifting load hits both alike
                for handle in handles.values():  # untimed: no stopped request's pass runs beside it
                    handle.join_background()
                samples[name].append(_first_step_seconds(pipes[name], handles[name], request))
        for handle in handles.values():
            handle.join_background()  # the last stopped request's pass, still running
        passes = {name: int(handle.stats.passes) for name, handle in handles.items()}
    finally:
        for handle in handles.values():
            handle.disable()
    return {"samples": samples, "passes": passes}, exact


def _latents(output: Any) -> torch.Tensor:
    """The final latents of a MiniMax-H3 (``output=["latents"]``) or Qwen-Image (``output_type="latent"``) call."""
    if isinstance(output, dict):
        latents: torch.Tensor = output["latents"]
        return latents
    images: torch.Tensor = output.images
    return images


def bench_first_request(res: Results, size: str, runs: int) -> None:
    """Encode + pass + first step of a first request: overlapped against sequential, side by side.

    Two pipelines: a MiniMax-H3 modular pipeline of ``size`` (the pass starts at the loop, after
    the encoding), and a Qwen-Image pipeline of the "medium" tiny size with a real tokenizer and
    text encoder (the pass starts when the call begins, from the predicted schedule).
    """
    try:
        from ..tiny import tiny_pipeline
        from ..tiny_qwen import tiny_qwen_pipeline, tiny_qwen_transformer
    except ImportError as exc:
        res.note(f"first-request comparison skipped: diffusers or transformers unavailable ({exc})")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        minimax = {name: tiny_pipeline(size=size, seed=0) for name in ("sequential", "overlapped")}
        measured, exact = _compare(minimax, _minimax_call, runs)
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qwen = {
            name: tiny_qwen_pipeline(
                transformer=tiny_qwen_transformer("plain", size="medium"), text_encoder_layers=QWEN_TEXT_LAYERS
            )
            for name in ("sequential", "overlapped")
        }
        measured, exact = _compare(qwen, _qwen_call, runs)
    res.values["first_request_qwen"] = {"steps": STEPS, "size": "medium", "latents_bit_identical": exact, **measured}
    res.add(
        Comparison(
            f"first request, encode + pass + first step (tiny Qwen-Image pipeline, medium, {STEPS} steps, true CFG; "
            "overlapped: the pass starts before the prompt is encoded)",
            "overlapped",
            "sequential",
            measured["samples"]["overlapped"],
            measured["samples"]["sequential"],
            1.0,
            note=f"torch.equal latents: {exact}; the pass of the schedule predicted from the call's arguments",
        )
    )


__all__ = ["bench_first_request"]
