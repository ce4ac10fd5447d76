"""MiniMax-H3: its geometry, key layouts and table layout, its request kinds and schedules, and its
projection input read from a checkpoint: everything the family-neutral core asks of this family.

Every block's ``adaln_proj.linear`` (``6 * modalities * hidden`` outputs) and the output layer's
``norm_out.linear`` (``2 * hidden``) take ``silu(temb)``; a plan is a step's distinct timesteps; layers
are ``0 .. num_layers - 1`` and ``"final"``. Tables keep SGLang's sidecar layout (docs/tables.md).

The plans come from the pipeline's own layout builders and ``MiniMaxH3SetTimestepsStep`` /
``MiniMaxH3Scheduler``, so they are bit for bit what a request stages. They depend only on which kinds
of rows a layout has, never on prompt, resolution or seed, so :func:`minimax_h3_plans` uses the
smallest layout with the task's row kinds. diffusers is imported inside the functions that need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError, PlanError
from ..geometry import (
    FINAL,
    STEPS,
    TIMESTEP,
    Family,
    Gather,
    KeyLayout,
    ModelGeometry,
    Schedule,
    ServedLayer,
    TablePart,
    read_upstream,
)
from ..options import Argument, Cli, flag

#: The two checkpoint layouts: the native release's names and diffusers'.
LAYOUTS: dict[str, KeyLayout] = {
    "native": KeyLayout(
        "native",
        "blocks.{i}.adaln_proj.linear",
        "final_layer.adaln_proj.linear",
        ("time_embedder.proj_in", "time_embedder.proj_out"),
    ),
    "diffusers": KeyLayout(
        "diffusers",
        "transformer_blocks.{i}.adaln_proj.linear",
        "norm_out.linear",
        ("time_embedder.linear_1", "time_embedder.linear_2"),
    ),
}

#: The released transformers a table file names in ``model_variant`` (SGLang compares it).
MODEL_VARIANTS = ("fl2va", "ref2va")
#: Which released transformer serves each task (t2va runs on the fl2va transformer).
TASK_VARIANTS = {"t2va": "fl2va", "fl2va": "fl2va", "ref2va": "ref2va"}
#: The request kinds of the MiniMax-H3 pipeline: text to video+audio, first/last keyframes to
#: video+audio, and references (image, optionally audio) to video+audio.
TASKS = ("t2va", "fl2va", "ref2va")

#: The released geometry: 50 blocks, hidden 5376, time embedding 2688.
RELEASED: dict[str, int] = {"num_layers": 50, "hidden_size": 5376, "time_embed_dim": 2688}

#: The name of the one projection input (``silu(temb)`` in the weights' dtype).
INPUT = "temb"


class ModulationRows:
    """How MiniMax-H3's table rows split into what its modules take (the cache's ``block``, ``block_all`` and
    ``final``): a block's row splits as its forward splits it, ``Y.view(-1, 6H).chunk(6, -1)``; the ``final``
    part is the output layer's ``(shift, scale)``."""

    block_part = "block"
    final_part = "final"

    def block_rows(self, gather: Gather, layer: object) -> torch.Tensor:
        def one_block(blocks: torch.Tensor) -> torch.Tensor:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < blocks.shape[2]:
                raise PlanError(
                    f"layer must be in 0..{blocks.shape[2] - 1} (a block index), got {layer!r}: the output layer's "
                    f"rows are final_rows() and final()"
                )
            return blocks.select(2, layer)

        return gather(self.block_part, one_block)

    def block(self, rows: torch.Tensor, spec: Any) -> tuple[torch.Tensor, ...]:
        return rows.reshape(-1, 6 * spec.hidden_size).chunk(6, dim=-1)

    def block_all(self, gather: Gather, spec: Any) -> list[tuple[torch.Tensor, ...]]:
        rows = gather(self.block_part)  # (n, num_layers, block_width), one gather
        return [self.block(rows[:, layer], spec) for layer in range(rows.shape[1])]

    def final_rows(self, gather: Gather) -> torch.Tensor:
        return gather(self.final_part)

    def final(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale = rows.chunk(2, dim=-1)
        return shift, scale


def block_width(hidden_size: int, modalities: int) -> int:
    """Output features of one block projection: 6 parameters x modalities x hidden."""
    return 6 * modalities * hidden_size


def final_width(hidden_size: int) -> int:
    """Output features of the output-layer projection: shift and scale."""
    return 2 * hidden_size


@lru_cache(maxsize=64)
def geometry(num_layers: int, hidden_size: int, time_embed_dim: int, modalities: int) -> ModelGeometry:
    """The geometry of a MiniMax-H3 of these sizes (the family-neutral view of its projections)."""
    bw, fw = block_width(hidden_size, modalities), final_width(hidden_size)
    layers = (*(ServedLayer(i, bw, INPUT) for i in range(num_layers)), ServedLayer(FINAL, fw, INPUT))
    blocks = num_layers * bw
    parts = (
        TablePart("block", "block_params", 0, blocks, (num_layers, bw)),
        TablePart("final", "final_params", blocks, blocks + fw, (fw,)),
    )
    return ModelGeometry(FAMILY, layers, time_embed_dim, (TIMESTEP,), parts)


def describe(num_layers: int, hidden_size: int, time_embed_dim: int, modalities: int) -> dict[str, Any]:
    """The spec identity stores and table files of this family are bound to (without the dtype)."""
    return dict(num_layers=num_layers, hidden_size=hidden_size, time_embed_dim=time_embed_dim, modalities=modalities)


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
            f"terminal 0, so n points give n - 1 forwards), got {steps!r}: set steps= (CLI {STEPS.flag})"
        )
    return steps


def check_shift(name: str, shift: object) -> float:
    """A schedule shift as a float if it is a positive finite number, else a PlanError naming it and its flag."""
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
        raise PlanError(f"{name} must be a positive finite number, got {shift!r}: set {name}= (CLI {flag(name)})")
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


def build_layout(
    task: str,
    *,
    patch_size: tuple[int, int, int],
    video_channels: int,
    audio_channels: int,
    geometry: LatentShape | None = None,
    audio_refs: bool = True,
) -> tuple[dict[str, torch.Tensor], int, int, list[torch.Tensor], list[torch.Tensor]]:
    """The packed layout of a ``task`` request, from the pipeline's own static builders: the layout tensors,
    the numbers of conditioning video and audio rows, and the ``ref2va`` reference latents (empty otherwise).
    ``fl2va`` anchors ``num_keyframes`` keyframes (first, then last); ``ref2va`` packs an image reference
    and, with ``audio_refs``, an audio one (which pins reference audio rows at ``t = 1``)."""
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
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3AudioReference, MiniMaxH3ImageReference

    task = check_task(task)
    geo = geometry or LatentShape()
    text_token_tags = torch.full((geo.num_text_tokens,), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    # The arguments both builders take, in their order after the references.
    sizes = (geo.num_latent_frames, geo.latent_height, geo.latent_width, geo.num_audio_latents, patch_size)
    tags = (MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG)
    condition_latents: list[torch.Tensor] = []
    audio_condition_latents: list[torch.Tensor] = []
    if task in ("t2va", "fl2va"):
        anchors: tuple[str, ...] = ()
        if task == "fl2va":
            anchors = tuple("first" if i % 2 == 0 else "last" for i in range(max(1, geo.num_keyframes)))
        out = MiniMaxH3PrepareLayoutStep.build_packed_sequence(text_token_tags, *sizes, *tags, anchors)
    else:
        references: list[Any] = [MiniMaxH3ImageReference(image=torch.zeros(3, 8, 8))]
        condition_latents.append(torch.zeros(1, video_channels, 1, geo.latent_height, geo.latent_width))
        if audio_refs:
            references.append(MiniMaxH3AudioReference(audio=torch.zeros(1, 800)))
            audio_condition_latents.append(torch.zeros(2 * MINIMAX_H3_AUDIO_CHANNELS, audio_channels))
        out = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
            text_token_tags, references, condition_latents, audio_condition_latents, *sizes, *tags
        )
    names = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")
    layout, (n_cond_video, n_cond_audio) = dict(zip(names, out[:5])), out[5:]
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
    """The pipeline's ``row_timestep_plan`` for a layout and the two schedules' timesteps, as
    ``MiniMaxH3SetTimestepsStep.__call__`` computes them: conditioning video rows held at
    ``max(t, keyframe_noise_aug)``, reference audio rows at ``1.0``."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    steps = check_steps(steps)
    noise_aug: Any = MiniMaxH3ModularPipeline.keyframe_noise_aug  # a property, read off the class
    keyframe_noise_aug = float(noise_aug.fget(None))
    schedules = []
    for shift in (video_shift, audio_shift):
        scheduler: Any = MiniMaxH3Scheduler(shift=shift)
        scheduler.set_timesteps(steps, device=device)
        schedules.append(scheduler.timesteps)
    timesteps, audio_timesteps = schedules
    rows = (layout["video_indices"], layout["audio_indices"], num_condition_video_rows, num_condition_audio_rows)
    plan = [
        tuple(
            tensor.to(device)
            for tensor in MiniMaxH3SetTimestepsStep.build_row_timesteps(
                *rows, layout["text_indices"].numel(), float(t), float(a), max(float(t), keyframe_noise_aug), 1.0
            )
        )
        for t, a in zip(timesteps, audio_timesteps)
    ]
    return cast(list[tuple[torch.Tensor, torch.Tensor]], plan), timesteps, audio_timesteps


def minimax_h3_plans(
    task: str, steps: int, *, video_shift: float = 12.0, audio_shift: float = 3.0, audio_refs: bool = True
) -> list[torch.Tensor]:
    """The per-step plans (``timestep`` tensors) the MiniMax-H3 modular pipeline will feed the transformer,
    built with diffusers' own code (module docstring), so bit-identical to what a request produces.

    ``steps`` is the pipeline's ``num_inference_steps``: grid points with the terminal 0, so ``steps - 1``
    forwards (fewer if the shift collapses grid points). Returns one float32 CPU tensor per forward, in
    step order (repeats kept: step ``i`` is ``result[i]``), ready for ``AdalnCache.build`` or ``handle.prepare``.
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
    # The smallest layout with every kind of row a task has: all the plans look at.
    shape = LatentShape(num_text_tokens=1, num_latent_frames=1, latent_height=1, latent_width=1, num_audio_latents=1)
    layout, n_cond_video, n_cond_audio, _, _ = build_layout(
        task, patch_size=(1, 1, 1), video_channels=1, audio_channels=1, geometry=shape, audio_refs=audio_refs
    )
    plan, _, _ = build_row_timestep_plan(
        layout, n_cond_video, n_cond_audio, steps, video_shift=video_shift, audio_shift=audio_shift
    )
    return [timestep for timestep, _ in plan]


TASK = Argument("task", "request kind (repeatable)", Cli("choice", choices=TASKS), repeat=True)
VIDEO_SHIFT = Argument("video_shift", "video schedule shift", Cli("float"), default=12.0)
AUDIO_SHIFT = Argument("audio_shift", "audio schedule shift", Cli("float"), default=3.0)
NO_AUDIO_REFS = Argument("no_audio_refs", "ref2va without a reference audio", Cli("switch"), default=False)


class MiniMaxH3(Family):
    """The MiniMax-H3 family (module docstring)."""

    def spec_fields(self, model: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The config's ``num_layers``, ``hidden_size``, ``time_embed_dim``; ``dtype`` or block 0's projection's."""
        config: Any = getattr(model, "config", None)
        try:
            fields: dict[str, Any] = {
                "num_layers": int(config.num_layers),
                "hidden_size": int(config.hidden_size),
                "time_embed_dim": int(config.time_embed_dim),
            }
        except AttributeError:
            raise ConfigError(
                f"ModulationSpec.from_transformer needs a MiniMaxH3Transformer3DModel (a config with "
                f"num_layers, hidden_size and time_embed_dim), got {type(model).__name__}"
            ) from None
        return {**fields, "dtype": dtype or self.projection_dtype(model, 0)}

    def header_fields(
        self, path: object, entries: Mapping[str, Any], config: Mapping[str, Any], layout: str, modalities: int
    ) -> dict[str, Any]:
        """Blocks are counted from ``0`` up to the first missing index; block 0's projection (``6 * modalities *
        hidden`` outputs of ``time_embed_dim`` inputs) gives the sizes and the dtype."""
        candidates = [LAYOUTS[layout]] if layout != "auto" else list(LAYOUTS.values())
        for key_layout in candidates:
            indices = {index for name in entries if (index := key_layout.block_index(name)) is not None}
            if not indices:
                continue
            count = next(i for i in range(len(indices) + 1) if i not in indices)
            first = entries.get(key_layout.weight(0))
            if first is None or len(first.shape) != 2 or first.torch_dtype is None:
                raise CheckpointError(f"{path}: block 0's AdaLN projection weight is missing or malformed")
            out, k = first.shape
            if out % (6 * modalities):
                raise CheckpointError(
                    f"{path}: block 0's AdaLN projection has {out} outputs, not a multiple of 6 x {modalities} "
                    f"modalities; this is not a MiniMax-H3 checkpoint"
                )
            hidden = out // (6 * modalities)
            return {**describe(count, hidden, k, modalities), "dtype": first.torch_dtype}
        raise CheckpointError(
            f"{path} holds no AdaLN projection in a known layout (looked for {LAYOUTS['native'].weight(0)!r} "
            f"and {LAYOUTS['diffusers'].weight(0)!r}): pass a MiniMax-H3 transformer checkpoint, or set "
            f"{flag('layout')}"
        )

    def schedule_hint(self, spec: Any) -> str:
        return f"{TASK.flag} and {STEPS.flag}"

    def schedule(self, values: Mapping[str, Any], *, spec: Any, source: Any, checkpoint: Any) -> Schedule:
        """Every plan of every (task, step count) pair (:func:`minimax_h3_plans`), under the two shifts."""
        tasks, steps = values["task"], values["steps"]
        if not tasks or not steps:
            raise ConfigError(
                f"a {self.title} checkpoint needs {self.schedule_hint(spec)} (the schedules): pass e.g. "
                f"{TASK.flag} t2va {STEPS.flag} 50"
            )
        shifts = {"video_shift": values["video_shift"], "audio_shift": values["audio_shift"]}
        audio_refs = not values["no_audio_refs"]
        plans = [p for t in tasks for n in steps for p in minimax_h3_plans(t, n, **shifts, audio_refs=audio_refs)]
        records = [{"task": t, "steps": n, **shifts, "audio_refs": audio_refs} for t in tasks for n in steps]
        return Schedule(plans, f"{', '.join(tasks)} x steps {', '.join(map(str, steps))}", records)

    def embed_from_checkpoint(self, source: Any, spec: Any, device: torch.device) -> Callable[[torch.Tensor], Any]:
        """diffusers' ``Timesteps`` (``flip_sin_to_cos=True``, ``downscale_freq_shift=0``) and
        ``TimestepEmbedding`` with the checkpoint's time-embedder weights, read at their file alignment;
        then SiLU in the embedder's dtype and only then the cast to the projection dtype, as the model."""
        try:
            from diffusers.models.embeddings import TimestepEmbedding, Timesteps
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("build and verify need diffusers (pip install 'adalncache[diffusers]')") from exc
        w1, b1, w2, b2 = (read_upstream(source, name) for name in self.upstream(spec, source.layout))
        if w1.dim() != 2 or w2.dim() != 2 or w2.shape[1] != w1.shape[0] or w2.shape[0] != spec.time_embed_dim:
            raise CheckpointError(
                f"time-embedder shapes {list(w1.shape)} and {list(w2.shape)} do not produce the projections' "
                f"{spec.time_embed_dim} input features"
            )
        freq_dim, hidden = w1.shape[1], w1.shape[0]
        time_proj = Timesteps(num_channels=freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        embedder = TimestepEmbedding(in_channels=freq_dim, time_embed_dim=hidden, out_dim=spec.time_embed_dim)
        for linear, w, b in ((embedder.linear_1, w1, b1), (embedder.linear_2, w2, b2)):
            # On a CPU (any index: ``.to("cpu:0")`` copies) the parameters stay the file's aligned views.
            linear.weight, linear.bias = (
                torch.nn.Parameter(t if device.type == "cpu" else t.to(device), requires_grad=False) for t in (w, b)
            )
        embedder.eval()

        def embed(plan: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                temb = embedder(time_proj(plan.to(device)).to(w1.dtype))
                return F.silu(temb).to(spec.dtype)

        return embed


FAMILY = MiniMaxH3(
    name="minimax-h3",
    title="MiniMax-H3",
    layouts=tuple(LAYOUTS.values()),
    class_names=("MiniMaxH3Transformer3DModel",),
    table_formats=("adalncache", "sglang", "vllm-omni"),
    table_tensors=("block_params", "final_params"),
    model_variants=MODEL_VARIANTS,
    task_variants=tuple(TASK_VARIANTS.items()),
    rows=ModulationRows(),
    arguments=(TASK, STEPS, VIDEO_SHIFT, AUDIO_SHIFT, NO_AUDIO_REFS),
    plan_rows="timesteps",
    demos=(("minimax-h3", "MiniMaxH3Transformer3DModel"),),
)
