"""The MiniMax-H3 request kinds and their denoising schedules: which timesteps each step feeds the model.

One home for the task list and for the recipe that turns a task, a step count and the two shifts
into the pipeline's ``row_timestep_plan``: the packed layout comes from the pipeline's own static
builders and the timesteps from its own ``MiniMaxH3SetTimestepsStep.build_row_timesteps`` and
``MiniMaxH3Scheduler``, so what is computed here is bit for bit what a request stages. The plans
(one ``timestep`` tensor per forward) depend only on which kinds of rows the layout has (generated
video and audio, keyframe or reference video, reference audio), never on prompt, resolution or
seed: :func:`minimax_h3_plans` uses the smallest layout with the task's row kinds, the tiny request
builders a larger one, and both get the same plans.

diffusers is imported inside the functions that need it, so importing this module never does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from .errors import PlanError
from .options import flag

#: The request kinds of the MiniMax-H3 pipeline: text to video+audio, first/last keyframes to
#: video+audio, and references (image, optionally audio) to video+audio.
TASKS = ("t2va", "fl2va", "ref2va")


def check_task(task: object) -> str:
    """``task`` if it is one of :data:`TASKS`, else a PlanError naming ``task=`` and ``--task``."""
    if task not in TASKS:
        raise PlanError(f"unknown task {task!r}: set task= (CLI {flag('task')}) to one of {', '.join(TASKS)}")
    return str(task)


def check_steps(steps: object) -> int:
    """``steps`` if it is an integer >= 2, else a PlanError naming ``steps=`` and ``--steps``."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise PlanError(
            f"steps must be an integer >= 2 (the pipeline's num_inference_steps: grid points with the "
            f"terminal 0, so n points give n - 1 forwards), got {steps!r}: set steps= (CLI {flag('steps')})"
        )
    return steps


def check_shift(name: str, shift: object) -> float:
    """A schedule shift as a float if it is a positive finite number, else a PlanError naming it."""
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
        raise PlanError(f"{name} must be a positive finite number, got {shift!r}")
    return float(shift)


@dataclass
class LatentShape:
    """Latent geometry of a request's packed layout (the defaults keep a tiny forward at a few ms)."""

    num_text_tokens: int = 6
    num_latent_frames: int = 2
    latent_height: int = 4
    latent_width: int = 4
    num_audio_latents: int = 3
    num_keyframes: int = 1


#: The smallest layout that has every kind of row a task has: all the plans look at.
_PLAN_SHAPE = LatentShape(
    num_text_tokens=1, num_latent_frames=1, latent_height=1, latent_width=1, num_audio_latents=1, num_keyframes=1
)


def build_layout(
    task: str,
    *,
    patch_size: tuple[int, int, int],
    video_channels: int,
    audio_channels: int,
    geometry: LatentShape | None = None,
    audio_refs: bool = True,
) -> tuple[dict[str, torch.Tensor], int, int, list[torch.Tensor], list[torch.Tensor]]:
    """The packed layout of a ``task`` request, from the pipeline's own static builders.

    Returns the layout tensors (``position_ids``, ``token_tags`` and the three index tensors), the
    numbers of conditioning video and audio rows, and the ``ref2va`` reference latents that
    define them (empty otherwise). ``t2va`` has no anchors, ``fl2va`` anchors ``num_keyframes``
    keyframes (first, then last), ``ref2va`` packs an image reference and, with ``audio_refs``, an
    audio reference (which pins reference audio rows at ``t = 1``).
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3Ref2VAPrepareLayoutStep,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_TEXT_TAG,
        MINIMAX_H3_VIDEO_TAG,
    )
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
    )

    task = check_task(task)
    geo = geometry or LatentShape()
    text_token_tags = torch.full((geo.num_text_tokens,), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    condition_latents: list[torch.Tensor] = []
    audio_condition_latents: list[torch.Tensor] = []
    if task in ("t2va", "fl2va"):
        anchors: tuple[str, ...] = ()
        if task == "fl2va":
            anchors = tuple("first" if i % 2 == 0 else "last" for i in range(max(1, geo.num_keyframes)))
        out = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            text_token_tags,
            geo.num_latent_frames,
            geo.latent_height,
            geo.latent_width,
            geo.num_audio_latents,
            patch_size,
            MINIMAX_H3_AUDIO_CHANNELS,
            MINIMAX_H3_AUDIO_TAG,
            MINIMAX_H3_VIDEO_TAG,
            anchors,
        )
    else:
        references: list[Any] = [MiniMaxH3ImageReference(image=torch.zeros(3, 8, 8))]
        condition_latents.append(torch.zeros(1, video_channels, 1, geo.latent_height, geo.latent_width))
        if audio_refs:
            references.append(MiniMaxH3AudioReference(audio=torch.zeros(1, 800)))
            audio_condition_latents.append(torch.zeros(2 * MINIMAX_H3_AUDIO_CHANNELS, audio_channels))
        out = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
            text_token_tags,
            references,
            condition_latents,
            audio_condition_latents,
            geo.num_latent_frames,
            geo.latent_height,
            geo.latent_width,
            geo.num_audio_latents,
            patch_size,
            MINIMAX_H3_AUDIO_CHANNELS,
            MINIMAX_H3_AUDIO_TAG,
            MINIMAX_H3_VIDEO_TAG,
        )
    position_ids, token_tags, video_indices, audio_indices, text_indices, n_cond_video, n_cond_audio = out
    layout = {
        "position_ids": position_ids,
        "token_tags": token_tags,
        "video_indices": video_indices,
        "audio_indices": audio_indices,
        "text_indices": text_indices,
    }
    return layout, int(n_cond_video), int(n_cond_audio), condition_latents, audio_condition_latents


def build_row_timestep_plan(
    layout: Mapping[str, torch.Tensor],
    num_condition_video_rows: int,
    num_condition_audio_rows: int,
    steps: int,
    *,
    video_shift: float = 12.0,
    audio_shift: float = 3.0,
    device: str | torch.device = "cpu",
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """The pipeline's ``row_timestep_plan`` for a layout, with ``MiniMaxH3SetTimestepsStep``'s own code.

    Mirrors ``MiniMaxH3SetTimestepsStep.__call__``: two ``MiniMaxH3Scheduler`` instances (video and
    audio shift), conditioning video rows held at ``max(t, keyframe_noise_aug)``, reference audio
    rows at ``1.0``. Returns the plan and the two schedules' timesteps.
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    steps = check_steps(steps)
    noise_aug: Any = MiniMaxH3ModularPipeline.keyframe_noise_aug  # a property, read off the class
    keyframe_noise_aug = float(noise_aug.fget(None))
    scheduler: Any = MiniMaxH3Scheduler(shift=video_shift)
    audio_scheduler: Any = MiniMaxH3Scheduler(shift=audio_shift)
    scheduler.set_timesteps(steps, device=device)
    audio_scheduler.set_timesteps(steps, device=device)
    timesteps = scheduler.timesteps
    audio_timesteps = audio_scheduler.timesteps
    plan = [
        tuple(
            tensor.to(device)
            for tensor in MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout["video_indices"],
                layout["audio_indices"],
                num_condition_video_rows,
                num_condition_audio_rows,
                layout["text_indices"].numel(),
                float(timestep),
                float(audio_timestep),
                max(float(timestep), keyframe_noise_aug),
                1.0,
            )
        )
        for timestep, audio_timestep in zip(timesteps, audio_timesteps)
    ]
    return cast(list[tuple[torch.Tensor, torch.Tensor]], plan), timesteps, audio_timesteps


def minimax_h3_plans(
    task: str,
    steps: int,
    *,
    video_shift: float = 12.0,
    audio_shift: float = 3.0,
    audio_refs: bool = True,
) -> list[torch.Tensor]:
    """The per-step plans (``timestep`` tensors) the MiniMax-H3 modular pipeline will feed the transformer.

    Built with diffusers' own code, so they are bit-identical to what a request produces: the two
    ``MiniMaxH3Scheduler`` schedules (``video_shift``, ``audio_shift``), the packed layout of
    ``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` (``t2va``; ``fl2va`` with a keyframe anchor)
    or ``MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence`` (``ref2va``: an image
    reference, plus an audio reference when ``audio_refs``), and
    ``MiniMaxH3SetTimestepsStep.build_row_timesteps`` per step. Plans depend only on the task kind,
    ``steps`` and the shifts, never on prompt, resolution or seed, which is why a tiny layout gives
    the same tensors as the real one.

    ``steps`` is the pipeline's ``num_inference_steps``: scheduler grid points with the terminal 0,
    so ``steps`` points give ``steps - 1`` forwards (fewer if the shift collapses grid points).
    Returns one float32 CPU tensor per forward, in step order (repeats are kept: step ``i`` is
    ``result[i]``), ready for ``AdalnCache.build`` or ``handle.prepare``.
    """
    task = check_task(task)
    steps = check_steps(steps)
    video_shift = check_shift("video_shift", video_shift)
    audio_shift = check_shift("audio_shift", audio_shift)
    try:
        import diffusers.modular_pipelines.minimax_h3
        import diffusers.schedulers.scheduling_minimax_h3  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PlanError(
            "minimax_h3_plans needs diffusers with MiniMax-H3 support (pip install 'adalncache[diffusers]')"
        ) from exc
    layout, n_cond_video, n_cond_audio, _, _ = build_layout(
        task,
        patch_size=(1, 1, 1),
        video_channels=1,
        audio_channels=1,
        geometry=_PLAN_SHAPE,
        audio_refs=audio_refs,
    )
    plan, _, _ = build_row_timestep_plan(
        layout, n_cond_video, n_cond_audio, steps, video_shift=video_shift, audio_shift=audio_shift
    )
    return [timestep for timestep, _ in plan]


__all__ = [
    "TASKS",
    "LatentShape",
    "build_layout",
    "build_row_timestep_plan",
    "check_shift",
    "check_steps",
    "check_task",
    "minimax_h3_plans",
]
