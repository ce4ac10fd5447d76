"""A MiniMax-H3 modular pipeline call's pass started before its prompt is encoded (``overlap=True``).

The plans are predicted from the call's inputs (task, steps, the schedulers' shifts); the loop's
prepare block adopts the pass only when the schedule the set-timesteps block made has the same
keys. Checked here on the tiny real pipeline (t2va and fl2va end to end), and the predictor's
choices for the calls it must decline or send to ``transformer_ref``. Nothing is downloaded.
"""

from __future__ import annotations

import logging
import threading
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.integrations.diffusers.minimax_h3 import predicted_plans
from adalncache.plans import minimax_h3_plans, plan_key
from adalncache.reports import FaultPoints

STEPS = 4
ADOPTED = "predicted schedule is the request's"


def _pipe() -> Any:
    from adalncache.tools.tiny import tiny_pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_pipeline(size="tiny", seed=0)


def _call(pipe: Any, **extra: Any) -> dict[str, torch.Tensor]:
    return pipe(
        **extra,
        prompt="a cat playing a piano in the rain",
        height=64,
        width=64,
        num_frames=124,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output=["latents", "audio_latents"],
        output_type="pt",
    )


def _keyframe() -> Any:
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))


class BlockUntil(FaultPoints):
    """The first publish waits for ``go`` (at most a minute); ``reached`` says it got there."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def check(self, point: str) -> None:
        if point == "publish" and not self.reached.is_set():
            self.reached.set()
            self.go.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["t2va", "fl2va"])
def test_a_minimax_call_starts_its_pass_before_the_prompt_is_encoded(
    task: str, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = _pipe()
    extra = {"image": _keyframe()} if task == "fl2va" else {}
    resident = _call(pipe, **extra)
    handle = enable_adaln_cache(pipe, overlap=True)
    faults = BlockUntil()
    handle.cache.fault_points = faults
    seen: list[bool] = []
    encoder = pipe.text_encoder.model  # what the encoder blocks run (they read its hidden states)
    forward = encoder.forward

    def encode(*args: Any, **kwargs: Any) -> Any:
        if not seen:  # the first encoder forward waits for the pass to reach its first publish
            seen.append(faults.reached.wait(timeout=60))
            faults.go.set()
        return forward(*args, **kwargs)

    encoder.forward = encode
    try:
        with caplog.at_level(logging.DEBUG, logger="adalncache"):
            got = _call(pipe, **extra)
    finally:
        del encoder.forward
    assert seen == [True]
    assert [r for r in caplog.records if ADOPTED in r.getMessage()]
    for name in ("latents", "audio_latents"):
        assert torch.equal(got[name], resident[name]), name
    assert handle.stats.passes == 2  # adopted: the first step's plans, then the rest; no pass of its own
    assert not handle.cache._pool.held_slots
    handle.disable()
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    assert type(pipe) is MiniMaxH3ModularPipeline  # its own class back


def _tiny_pipeline_like() -> Any:
    """The parts of a MiniMax-H3 modular pipeline the predictor reads, with the real class's ``__call__``."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    pipeline: Any = MiniMaxH3ModularPipeline.__new__(MiniMaxH3ModularPipeline)
    pipeline.__dict__.update(
        scheduler=SimpleNamespace(config={"shift": 12.0}),
        audio_scheduler=SimpleNamespace(config={"shift": 3.0}),
    )
    return pipeline


#: Stand-ins for the pipeline's reference objects: the predictor reads their ``kind`` only.
IMAGE, AUDIO = SimpleNamespace(kind="image"), SimpleNamespace(kind="audio")


def _keys(plans: Any) -> list[Any]:
    return [plan_key(plan) for plan in plans]


@pytest.mark.parametrize(
    ("call", "component", "expected"),
    [
        ({"num_inference_steps": 4}, "transformer", ("t2va", 4, False)),
        ({}, "transformer", ("t2va", 50, False)),  # diffusers' default step count
        ({"num_inference_steps": 4, "image": object()}, "transformer", ("fl2va", 4, False)),
        ({"num_inference_steps": 4, "last_image": object()}, "transformer", ("fl2va", 4, False)),
        (
            {"num_inference_steps": 4, "references": [SimpleNamespace(kind="image")]},
            "transformer_ref",
            ("ref2va", 4, False),
        ),
        (
            {"num_inference_steps": 4, "references": [IMAGE, AUDIO]},
            "transformer_ref",
            ("ref2va", 4, True),
        ),
        ({"num_inference_steps": 4}, "transformer_ref", None),  # t2va does not run transformer_ref
        ({"num_inference_steps": 4, "references": [IMAGE]}, "transformer", None),
        ({"num_inference_steps": 4, "references": [AUDIO]}, "transformer_ref", None),
        ({"num_inference_steps": 4, "state": object()}, "transformer", None),  # a state passed in: not told
    ],
    ids=[
        "t2va",
        "default steps",
        "fl2va first keyframe",
        "fl2va last keyframe",
        "ref2va image",
        "ref2va image and audio",
        "t2va on transformer_ref",
        "ref2va on transformer",
        "ref2va audio only",
        "a state passed in",
    ],
)
def test_the_predictor_picks_the_blocks_task(call: dict[str, Any], component: str, expected: Any) -> None:
    got = predicted_plans(_tiny_pipeline_like(), call, component)
    if expected is None:
        assert got is None
        return
    task, steps, audio_refs = expected
    assert got is not None
    assert _keys(got) == _keys(minimax_h3_plans(task, steps, audio_refs=audio_refs))


def test_a_pipeline_class_with_its_own_call_gets_no_prediction() -> None:
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    class Custom(MiniMaxH3ModularPipeline):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    pipeline = _tiny_pipeline_like()
    pipeline.__class__ = Custom
    assert predicted_plans(pipeline, {"num_inference_steps": 4}, "transformer") is None
