"""The ``first-request`` section: a first request's wall time to the end of its first denoising step.

Two tiny MiniMax-H3 modular pipelines of the same seeded components (``--size``) run the same
``t2va`` request from a cold cache (``invalidate()`` before each run): one with the request's pass
in the foreground (the whole schedule before step 0), one with ``overlap=True`` (the pass on a
background thread, step 0 waiting only for its own plans). The time measured is from the call to
the end of the first ``scheduler.step``: prompt encoding + pass + first step. The request is then
stopped (the rest of the loop is the same in both); both handles' background passes are joined
before each run, outside the timing (``invalidate()`` does not wait for a pass: a pass still
running would build into the next run's cold cache and overlap its timing). Exactness: the whole
request of each pipeline, run once, ``torch.equal`` on the latents.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch

from .results import Comparison, Results

#: Denoising steps of the measured request (its schedule's plans are what the pass builds).
STEPS = 8


class _FirstStepDone(Exception):
    """Raised by the wrapped ``scheduler.step`` to stop a timed request after its first step."""


def _call(pipe: Any, *, stop_after_first: bool) -> Any:
    scheduler = pipe.scheduler
    original = scheduler.step

    def step(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if stop_after_first:
            raise _FirstStepDone
        return out

    scheduler.step = step
    try:
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
    except _FirstStepDone:
        return None
    finally:
        del scheduler.step  # the instance attribute: the class's step shows through again


#: diffusers' modular pipelines log the traceback of an exception raised in a block: the stop is ours.
_BLOCK_LOGGER = "diffusers.modular_pipelines.modular_pipeline"


def _first_step_seconds(pipe: Any, handle: Any) -> float:
    handle.cache.invalidate()  # cold: the request's pass runs (the caller joined every pass still running)
    logger = logging.getLogger(_BLOCK_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        started = time.perf_counter()
        _call(pipe, stop_after_first=True)
        return time.perf_counter() - started
    finally:
        logger.setLevel(level)


def bench_first_request(res: Results, size: str, runs: int) -> None:
    """Encode + pass + first step of a first request: overlapped against sequential, side by side."""
    try:
        from ...diffusers import enable_adaln_cache
        from ..tiny import tiny_pipeline
    except ImportError as exc:
        res.note(f"first-request comparison skipped: diffusers or transformers unavailable ({exc})")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipes = {name: tiny_pipeline(size=size, seed=0) for name in ("sequential", "overlapped")}
        for pipe in pipes.values():
            pipe.set_progress_bar_config(disable=True)
        handles = {name: enable_adaln_cache(pipe, overlap=name == "overlapped") for name, pipe in pipes.items()}
        try:
            outputs = {name: _call(pipe, stop_after_first=False) for name, pipe in pipes.items()}
            exact = torch.equal(outputs["sequential"]["latents"], outputs["overlapped"]["latents"])
            samples: dict[str, list[float]] = {"sequential": [], "overlapped": []}
            for _ in range(max(runs, 1)):
                for name in samples:  # taking turns, so drifting load hits both alike
                    for handle in handles.values():  # untimed: no stopped request's pass runs beside it
                        handle.join_background()
                    samples[name].append(_first_step_seconds(pipes[name], handles[name]))
            for handle in handles.values():
                handle.join_background()  # the last stopped request's pass, still running
            passes = {name: int(handle.stats.passes) for name, handle in handles.items()}
        finally:
            for handle in handles.values():
                handle.disable()
    res.values["first_request"] = {"steps": STEPS, "size": size, "latents_bit_identical": exact, "passes": passes}
    res.add(
        Comparison(
            f"first request, encode + pass + first step (tiny MiniMax-H3 pipeline, {size}, {STEPS} steps)",
            "overlapped",
            "sequential",
            samples["overlapped"],
            samples["sequential"],
            1.0,
            note=f"torch.equal latents: {exact}; overlapped runs two transactions (step 0's plans, then the rest)",
        )
    )


__all__ = ["bench_first_request"]
