"""minimax_h3_plans: the pipeline's own plans, ahead of time."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from adalncache.errors import PlanError
from adalncache.families.minimax_h3 import TASKS
from adalncache.plans import minimax_h3_plans, plan_key

pytest.importorskip("diffusers")


def _keys(plans: list[torch.Tensor]) -> list[tuple[int, ...]]:
    return [plan_key(plan) for plan in plans]


def _pipeline_row_plan(layout: dict[str, Any], n_video: int, n_audio: int, steps: int) -> list[torch.Tensor]:
    """Run the pipeline's own MiniMaxH3SetTimestepsStep block and return its row_timestep_plan."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    pipe = MiniMaxH3SetTimestepsStep().init_pipeline()
    pipe.update_components(scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    plan = pipe(
        num_inference_steps=steps,
        video_indices=layout["video_indices"],
        audio_indices=layout["audio_indices"],
        text_indices=layout["text_indices"],
        num_condition_video_rows=n_video,
        num_condition_audio_rows=n_audio,
        output="row_timestep_plan",
    )
    return [timestep for timestep, _ in plan]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("steps", [2, 5, 9, 50])
def test_plans_equal_the_set_timesteps_block(task: str, steps: int) -> None:
    """Bit for bit what the pipeline's SetTimesteps block stages for a real (larger) layout."""
    from adalncache.families.minimax_h3 import LatentShape, build_layout

    layout, n_video, n_audio, _, _ = build_layout(
        task,
        patch_size=(1, 2, 2),
        video_channels=4,
        audio_channels=8,
        geometry=LatentShape(num_text_tokens=9, num_latent_frames=3, latent_height=4, latent_width=6),
    )
    expected = _pipeline_row_plan(layout, n_video, n_audio, steps)
    plans = minimax_h3_plans(task, steps)
    assert _keys(plans) == _keys(expected)
    assert all(plan.dtype == torch.float32 and plan.dim() == 1 and plan.device.type == "cpu" for plan in plans)


@pytest.mark.parametrize(
    ("task", "audio_refs", "first", "later"),
    [
        ("t2va", True, 1, 2),
        ("fl2va", True, 2, 3),
        ("ref2va", True, 3, 4),
        ("ref2va", False, 2, 3),
    ],
)
def test_plan_widths_per_task(task: str, audio_refs: bool, first: int, later: int) -> None:
    """Distinct timesteps at step 0 and at later steps, per task (the table in docs/api.md)."""
    plans = minimax_h3_plans(task, 8, audio_refs=audio_refs)
    assert len(plans) == 7
    assert plans[0].numel() == first
    assert {plan.numel() for plan in plans[1:]} == {later}
    # Distinct timesteps are sorted, as torch.unique returns them for timestep_indices.
    assert all(bool((plan[1:] > plan[:-1]).all()) for plan in plans)


def test_conditioning_values() -> None:
    """Keyframe rows sit at 0.999 (max with t), reference audio at exactly 1.0."""
    fl2va = minimax_h3_plans("fl2va", 6)
    ref2va = minimax_h3_plans("ref2va", 6)
    assert all(float(plan[-1]) == pytest.approx(0.999) for plan in fl2va)
    assert all(float(plan[-1]) == 1.0 for plan in ref2va)
    # The generated rows' values are the same in all three tasks.
    t2va = minimax_h3_plans("t2va", 6)
    assert _keys([plan[:-1] for plan in fl2va]) == _keys(t2va)


def test_shifts_shape_the_schedule() -> None:
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    default = minimax_h3_plans("t2va", 6)
    assert _keys(minimax_h3_plans("t2va", 6, video_shift=12.0, audio_shift=3.0)) == _keys(default)
    assert _keys(minimax_h3_plans("t2va", 6, video_shift=5.0)) != _keys(default)
    assert _keys(minimax_h3_plans("t2va", 6, audio_shift=1.0)) != _keys(default)
    video = MiniMaxH3Scheduler(shift=12.0)
    video.set_timesteps(6)
    assert [float(plan[0]) for plan in default] == [float(t) for t in video.timesteps]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"task": "i2v", "steps": 4}, "--task"),
        ({"task": "t2va", "steps": 1}, "--steps"),
        ({"task": "t2va", "steps": 4.0}, "--steps"),
        ({"task": "t2va", "steps": True}, "--steps"),
    ],
)
def test_errors_name_argument_and_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(PlanError, match=flag):
        minimax_h3_plans(**kwargs)


def test_bad_shift() -> None:
    with pytest.raises(PlanError, match="video_shift"):
        minimax_h3_plans("t2va", 4, video_shift=0.0)
    with pytest.raises(PlanError, match="audio_shift"):
        minimax_h3_plans("t2va", 4, audio_shift=float("nan"))


def test_plans_module_imports_without_diffusers() -> None:
    """plans.py imports diffusers only inside minimax_h3_plans."""
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "import torch\n"
        "from adalncache.plans import plan_key, minimax_h3_plans\n"
        "assert plan_key(torch.tensor([0.5])) == (1056964608,)\n"
        "try:\n"
        "    minimax_h3_plans('t2va', 4)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "PlanError"
