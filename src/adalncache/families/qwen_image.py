"""Qwen-Image: its geometry, key layout, plan layout, schedules and projection input, as the core asks them.

Every block's ``img_mod.1`` and ``txt_mod.1`` (``Linear(dim -> 6 * dim)``) and the output layer's
``norm_out.linear`` (``2 * dim``) take ``silu(temb)`` in the model's dtype, ``temb`` a function of the
timestep alone (plus, with the Layered variant's ``use_additional_t_cond``, an embedding of a per-sample
index: the plan's second column). Layers are named by module path, in the forward's order: block by
block, image before text, then ``norm_out.linear``; the table is one part (``table_rows``). With
``zero_cond_t`` (Edit-2511) the forward doubles the timestep to ``[t; 0 * t]``: ``img_mod`` runs on
the 2B rows (:data:`INPUT`), ``txt_mod`` and ``norm_out`` on the first B (:data:`FIRST`).

A forward's plan is its timestep as the forward sees it (:func:`forward_plan_of`): cast to the compute
dtype (exact in fp32), doubled with ``zero_cond_t``, with the ``additional_t_cond`` column. The
pipelines pass ``t.expand(batch).to(latents.dtype) / 1000`` of each scheduler timestep, shifted by the
image size (:func:`pipeline_timesteps`, :func:`schedule_timesteps`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError, PlanError
from ..geometry import (
    BATCH,
    HEIGHT,
    SCHEDULER_CONFIG,
    STEPS,
    TIMESTEP,
    TIMESTEPS,
    WIDTH,
    ImageFamily,
    KeyLayout,
    ModelGeometry,
    ServedLayer,
    read_upstream,
)
from ..options import Argument, Cli

#: The diffusers layout: no block prefix, so every layer id is its own module path.
LAYOUT = KeyLayout(
    "diffusers",
    time_embedder=("time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"),
)

#: The released geometry (Qwen/Qwen-Image ``transformer/config.json``): 60 blocks, 24 heads of 128.
RELEASED: dict[str, Any] = {"num_layers": 60, "hidden_size": 3072, "zero_cond_t": False, "additional_t_cond": False}

#: The released pipeline's scheduler config (Qwen/Qwen-Image ``scheduler/scheduler_config.json``, the Edit and
#: Layered releases' too; diffusers' defaults omitted): a step count's schedule uses it when no scheduler
#: config is given or found beside the checkpoint, since the shift depends on it. Read-only: it is shared.
RELEASED_SCHEDULER: Mapping[str, Any] = MappingProxyType(
    {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "max_image_seq_len": 8192,
        "max_shift": 0.9,
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
        "use_dynamic_shifting": True,
    }
)

#: The projections' inputs: ``silu(temb)``, and with ``zero_cond_t`` its first half (module docstring).
INPUT = "temb"
FIRST = "temb_first"
#: The plan's second column when ``use_additional_t_cond``: the forward's ``additional_t_cond`` index.
ADDITIONAL = "additional_t_cond"
#: The module computing ``temb``, and the ``additional_t_cond`` embedding's weight inside it.
TIME_TEXT_EMBED = "time_text_embed"
ADDITION_WEIGHT = f"{TIME_TEXT_EMBED}.addition_t_embedding.weight"
#: The output layer's projection.
FINAL_PATH = "norm_out.linear"

#: Plans are float32: an index column is exact only below 2**24 (and an embedding index is never negative).
ADDITIONAL_T_COND = Argument(
    ADDITIONAL, "Layered checkpoints: the additional_t_cond index the pipeline passes", Cli("int", 0, below=2**24)
)


def img_path(block: int) -> str:
    return f"transformer_blocks.{block}.img_mod.1"


def txt_path(block: int) -> str:
    return f"transformer_blocks.{block}.txt_mod.1"


@lru_cache(maxsize=64)
def geometry(
    num_layers: int, hidden_size: int, zero_cond_t: bool = False, additional_t_cond: bool = False
) -> ModelGeometry:
    """The geometry of a Qwen-Image transformer of these sizes and variant flags."""
    first = FIRST if zero_cond_t else INPUT
    streams = ((img_path, INPUT), (txt_path, first))
    layers = [ServedLayer(path(block), 6 * hidden_size, name) for block in range(num_layers) for path, name in streams]
    layers.append(ServedLayer(FINAL_PATH, 2 * hidden_size, first))
    plan_inputs = (TIMESTEP, ADDITIONAL) if additional_t_cond else (TIMESTEP,)
    return ModelGeometry(FAMILY, tuple(layers), hidden_size, plan_inputs)


def spec_args(
    num_layers: int, hidden_size: int, dtype: torch.dtype, *, zero_cond_t: bool = False, additional_t_cond: bool = False
) -> dict[str, Any]:
    """``ModulationSpec.for_geometry`` keywords of a Qwen-Image of these sizes."""
    return {
        "geometry": geometry(num_layers, hidden_size, bool(zero_cond_t), bool(additional_t_cond)),
        "dtype": dtype,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
    }


def config_flags(config: Any) -> dict[str, bool]:
    """The variant flags of a config (an object with attributes, or a mapping)."""
    get = config.get if isinstance(config, Mapping) else lambda name, default: getattr(config, name, default)
    return {
        "zero_cond_t": bool(get("zero_cond_t", False)),
        "additional_t_cond": bool(get("use_additional_t_cond", False)),
    }


def forward_plan_of(
    dtype: torch.dtype, zero_cond_t: bool, additional_t_cond: bool, timestep: Any, additional: Any
) -> torch.Tensor:
    """The plan of a forward of a model computing in ``dtype`` with these flags (module docstring)."""
    if not isinstance(timestep, torch.Tensor) or timestep.dim() != 1 or not timestep.is_floating_point():
        raise PlanError(
            f"Qwen-Image's timestep is a 1-D floating-point tensor (one entry per sample), got {_describe(timestep)}"
        )
    seen = timestep.detach().to(dtype)
    if zero_cond_t:
        seen = torch.cat([seen, seen * 0], dim=0)
    plan = seen.to(torch.float32)  # exact: every bf16, fp16 and fp32 value is an fp32 value
    if not additional_t_cond:
        return plan
    if not isinstance(additional, torch.Tensor) or additional.dim() != 1 or additional.is_floating_point():
        # A float index would key a plan no forward has (the forward's embedding takes an integer
        # index), and 0.5 would be embedded as index 0: refused, never a plan of another step.
        raise PlanError(
            f"this Qwen-Image transformer has use_additional_t_cond: its plan needs the forward's additional_t_cond "
            f"(a 1-D integer index tensor; the CLI's {ADDITIONAL_T_COND.flag}), got {_describe(additional)}"
        )
    if additional.shape[0] not in (1, plan.shape[0]):
        raise PlanError(
            f"additional_t_cond has {additional.shape[0]} entries for {plan.shape[0]} timestep rows; the forward "
            "adds its embedding to temb row by row, so pass one entry, or one per row"
        )
    column = additional.detach()
    if column.device != plan.device:  # no copy at all when it is on the device already (the served forward's case)
        column = column.to(device=plan.device)
    column = column.expand(plan.shape[0]).to(torch.float32)
    return torch.stack([plan, column], dim=1)


def check_additional_t_cond(index: Any, rows: int) -> None:
    """PlanError unless every ``additional_t_cond`` index (an int or an integer tensor) is in ``0..rows-1``, the
    rows of ``addition_t_embedding``: every path taking an index checks it here, before anything is built,
    where the embedding would fail with a bare ``IndexError``."""
    values = index.detach().flatten().tolist() if isinstance(index, torch.Tensor) else [index]
    bad = [v for v in values if not 0 <= v < rows]
    if bad:
        raise PlanError(
            f"additional_t_cond must be an index in 0..{rows - 1} (the rows of {ADDITION_WEIGHT}), got {bad[0]}: set "
            f"additional_t_cond (CLI {ADDITIONAL_T_COND.flag}) to one of them"
        )


def pipeline_timesteps(
    steps: int,
    height: int,
    width: int,
    scheduler_config: Mapping[str, Any],
    *,
    sigmas: Any = None,
    sequence: int | None = None,
    scheduler_class: Any = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The scheduler timesteps ``QwenImagePipeline`` runs for ``steps`` at ``height`` x ``width``, as it computes
    them on a fresh scheduler: ``mu`` shifted by the packed latents' length ``sequence`` (default
    ``(height // 16) * (width // 16)``), then ``retrieve_timesteps(..., sigmas=..., mu=...)``."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    scheduler: Any = (scheduler_class or FlowMatchEulerDiscreteScheduler).from_config(dict(scheduler_config))
    if sigmas is None:
        sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = calculate_shift(
        (height // 16) * (width // 16) if sequence is None else sequence,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    return timesteps


def schedule_timesteps(
    timesteps: torch.Tensor, *, batch: int = 1, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    """The forward's ``timestep`` at each scheduler timestep: the pipeline's ``t.expand(batch).to(dtype) / 1000``."""
    return [t.expand(batch).to(dtype) / 1000 for t in timesteps]


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


class QwenImage(ImageFamily):
    """The Qwen-Image family (module docstring)."""

    released_scheduler = RELEASED_SCHEDULER

    def spec_fields(self, model: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The config's sizes and variant flags; the dtype of block 0's ``img_mod.1`` unless ``dtype`` is given."""
        config: Any = getattr(model, "config", None)
        try:
            num_layers = int(config.num_layers)
            hidden_size = int(config.num_attention_heads) * int(config.attention_head_dim)
        except AttributeError:
            raise ConfigError(
                f"ModulationSpec.from_transformer needs a QwenImageTransformer2DModel (a config with num_layers, "
                f"num_attention_heads and attention_head_dim), got {type(model).__name__}"
            ) from None
        dtype = dtype or self.projection_dtype(model, img_path(0))
        return spec_args(num_layers, hidden_size, dtype, **config_flags(config))

    def header_fields(
        self, path: object, entries: Mapping[str, Any], config: Mapping[str, Any], layout: str, modalities: int
    ) -> dict[str, Any]:
        """Blocks are counted from 0 up to the first missing ``img_mod.1``; block 0's gives the width
        (``6 * dim`` outputs of ``dim`` inputs) and the dtype; ``config.json`` the variant flags."""
        count = 0
        while f"{img_path(count)}.weight" in entries:
            count += 1
        first = entries.get(f"{img_path(0)}.weight")
        if first is None:
            raise CheckpointError(
                f"{path} holds no Qwen-Image AdaLN projection (looked for {img_path(0)}.weight): pass the "
                "transformer's own directory (its config.json and weight files, as the model is saved)"
            )
        if len(first.shape) != 2 or first.torch_dtype is None or first.shape[0] != 6 * first.shape[1]:
            raise CheckpointError(f"{path}: {img_path(0)}.weight is {list(first.shape)}, not [6 * dim, dim]")
        return spec_args(count, int(first.shape[1]), first.torch_dtype, **config_flags(config))

    def schedule_hint(self, spec: Any) -> str:
        return super().schedule_hint(spec) + (f", and {ADDITIONAL_T_COND.flag} I" if spec.plan_columns == 2 else "")

    def step_inputs(
        self, spec: Any, values: Mapping[str, Any], steps: int, size: tuple[int, int], config: Mapping[str, Any]
    ) -> list[dict[str, torch.Tensor]]:
        timesteps = pipeline_timesteps(steps, size[0], size[1], config)
        return [{TIMESTEP: t} for t in schedule_timesteps(timesteps, batch=values["batch"], dtype=spec.dtype)]

    def plans_of(
        self, forwards: list[dict[str, torch.Tensor]], values: Mapping[str, Any], spec: Any, source: Any
    ) -> list[torch.Tensor]:
        """Each forward's plan; the ``additional_t_cond`` index checked against the checkpoint's embedding."""
        index, layered = values[ADDITIONAL], spec.plan_columns == 2
        if index is not None and not layered:
            raise ConfigError(
                "this Qwen-Image checkpoint has no use_additional_t_cond (its forwards ignore additional_t_cond): "
                f"drop {ADDITIONAL_T_COND.flag}"
            )
        if layered and index is None:
            raise ConfigError(
                f"this Qwen-Image checkpoint has use_additional_t_cond: pass {ADDITIONAL_T_COND.flag} (the index the "
                "pipeline passes the transformer as additional_t_cond)"
            )
        if layered:
            try:
                _, entry = source.entry(ADDITION_WEIGHT)
            except KeyError:
                pass  # the checkpoint-only embed names the missing tensor
            else:
                check_additional_t_cond(index, int(entry.shape[0]))
        column = torch.tensor([index if index is not None else 0])
        zero_cond = FIRST in spec.inputs
        return [forward_plan_of(spec.dtype, zero_cond, layered, f[TIMESTEP], column) for f in forwards]

    def upstream(self, spec: Any, layout: KeyLayout) -> tuple[str, ...]:
        """The timestep embedder's linears, and the ``additional_t_cond`` embedding of a Layered model."""
        return (*layout.time_embedder_tensors(), *((ADDITION_WEIGHT,) if spec.plan_columns == 2 else ()))

    def embed_from_checkpoint(self, source: Any, spec: Any, device: torch.device) -> Callable[[torch.Tensor], Any]:
        """diffusers' own ``QwenTimestepProjEmbeddings`` with the checkpoint's weights (at their file alignment),
        run in the spec's dtype as a model loaded in that dtype runs it; then SiLU."""
        try:
            from diffusers.models.transformers.transformer_qwenimage import QwenTimestepProjEmbeddings
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("build and verify need diffusers (pip install 'adalncache[diffusers]')") from exc
        layered = spec.plan_columns == 2
        module = QwenTimestepProjEmbeddings(spec.in_features, use_additional_t_cond=layered).eval()
        prefix = TIME_TEXT_EMBED + "."
        for name in self.upstream(spec, source.layout):
            tensor = read_upstream(source, name)
            owner, _, attr = name.removeprefix(prefix).rpartition(".")
            value = tensor if tensor.dtype == spec.dtype else tensor.to(spec.dtype)
            # A CPU tensor of the spec's dtype stays the file's view: .to is a no-op.
            setattr(module.get_submodule(owner), attr, torch.nn.Parameter(value.to(device), requires_grad=False))
        zero_cond = FIRST in spec.inputs
        hidden = torch.empty(0, dtype=spec.dtype, device=device)

        def embed(plan: torch.Tensor) -> Any:
            plan = plan.to(device)
            timestep = (plan[:, 0] if plan.dim() == 2 else plan).to(spec.dtype)
            additional = plan[:, 1].to(torch.long) if plan.dim() == 2 else None
            with torch.no_grad():
                temb = module(timestep, hidden, additional)
                if not zero_cond:
                    return F.silu(temb)
                return {INPUT: F.silu(temb), FIRST: F.silu(temb.chunk(2, dim=0)[0])}

        return embed


FAMILY = QwenImage(
    name="qwen-image",
    title="Qwen-Image",
    layouts=(LAYOUT,),
    class_names=("QwenImageTransformer2DModel",),
    arguments=(STEPS, HEIGHT, WIDTH, TIMESTEPS, BATCH, SCHEDULER_CONFIG, ADDITIONAL_T_COND),
    demos=(("qwen-image", "QwenImageTransformer2DModel"),),
)
