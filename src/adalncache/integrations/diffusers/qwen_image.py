"""What is Qwen-Image's in the integration: its :class:`~.family.DiffusersFamily` (:data:`FAMILY`).

``QwenImageTransformer2DModel.forward`` (diffusers 0.42.1) casts ``timestep`` to ``img_in``'s output dtype,
doubles it to ``[t; 0]`` with ``zero_cond_t``, and runs ``img_mod`` on every row of ``temb``, ``txt_mod``
and ``norm_out`` on the first half. So a plan is the timestep *as the forward sees it* (with Layered's
``additional_t_cond`` index as a second column), and each input is projected at its own row count.
See docs/diffusers.md (Qwen-Image).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import PlanError
from ...families import qwen_image as core
from ...families.qwen_image import forward_plan_of, pipeline_timesteps, schedule_timesteps
from ...geometry import TIMESTEP
from ...spec import Layer, ModulationSpec
from .family import (
    DiffusersFamily,
    embedding_beneath_hooks,
    forward_argument,
    input_dtype,
    register,
    timestep_argument,
)
from .request import pipeline_class


class QwenImage(DiffusersFamily):
    """Qwen-Image (``QwenImageTransformer2DModel``) as the integration serves it."""

    family = core.FAMILY
    time_embedder = "time_text_embed"

    def swapped_layers(self, spec: ModulationSpec) -> list[Layer]:
        """Every block's ``img_mod.1`` and ``txt_mod.1``: their ``Sequential`` owners are class-swapped."""
        return [layer for layer in spec.layers() if str(layer).startswith(f"{self.blocks}.")]

    def upstream_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``time_text_embed``: its ``time_proj``, timestep embedder and (Layered) ``addition_t_embedding``."""
        return [(self.time_embedder, model.get_submodule(self.time_embedder))]

    def stand_in(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, torch.dtype | None]:
        """``time_text_embed(timestep, hidden_states, ...)`` has one row per timestep, in ``hidden_states``' dtype."""
        timestep = args[0] if args else kwargs["timestep"]
        hidden_states = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        return int(timestep.shape[0]), getattr(hidden_states, "dtype", None)

    def forward_plan(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
        """The forward's timestep as it sees it (cast, doubled with ``zero_cond_t``), with its index column."""
        timestep = timestep_argument(module, args, kwargs)
        additional = forward_argument(module, core.ADDITIONAL, args, kwargs)
        return self.plan(module, timestep, additional, timestep.device)

    def request_plan(self, model: nn.Module, plan: Any) -> Any:
        """A ``prepare()`` plan: the ``timestep`` tensor the forward receives, or a mapping by argument name."""
        if isinstance(plan, Mapping):
            unknown = sorted(set(plan) - {TIMESTEP, core.ADDITIONAL})
            if unknown or TIMESTEP not in plan:
                raise PlanError(
                    f"a Qwen-Image plan is the forward's timestep tensor, or a mapping with 'timestep' (and "
                    f"'additional_t_cond'), got the keys {sorted(plan)}"
                )
            embedding = getattr(getattr(model, "time_text_embed", None), "addition_t_embedding", None)
            if isinstance(embedding, nn.Embedding) and isinstance(plan.get(core.ADDITIONAL), (int, torch.Tensor)):
                core.check_additional_t_cond(plan[core.ADDITIONAL], embedding.num_embeddings)
            return self.plan(model, plan[TIMESTEP], plan.get(core.ADDITIONAL))
        if not isinstance(plan, torch.Tensor):
            raise PlanError(f"a Qwen-Image plan is the forward's timestep tensor, got {type(plan).__name__}")
        return self.plan(model, plan, None)

    def schedule_plans(
        self, model: nn.Module, timesteps: torch.Tensor, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> list[Any] | None:
        """The Qwen-Image pipelines' ``t.expand(batch).to(latents.dtype) / 1000`` for every scheduler timestep,
        computed as the pipeline does (the forward's bits); ``None`` when this forward's timestep is none of them."""
        timestep = timestep_argument(model, args, kwargs)
        if timestep.dim() != 1 or not timestep.is_floating_point():
            return None
        batch, dtype = timestep.shape[0], timestep.dtype
        steps = schedule_timesteps(timesteps.detach().to(timestep.device), batch=batch, dtype=dtype)
        if not any(torch.equal(step, timestep) for step in steps):
            return None
        additional = forward_argument(model, core.ADDITIONAL, args, kwargs)
        if getattr(model.config, "use_additional_t_cond", False):
            return [{TIMESTEP: step, core.ADDITIONAL: additional} for step in steps]
        return steps

    def predict_schedule(
        self, model: nn.Module, pipeline: Any, call: Mapping[str, Any], component: str
    ) -> list[Any] | None:
        """``QwenImagePipeline``'s schedule from its call's arguments: its text-to-image call only (the Edit
        and Layered pipelines size the latents their own way; their passes start at the first forward)."""
        from diffusers import QwenImagePipeline

        config: Any = model.config
        if pipeline_class(pipeline).__call__ is not QwenImagePipeline.__call__ or config.use_additional_t_cond:
            return None
        if component != "transformer":
            return None
        batch, dtype = _call_batch_and_dtype(pipeline, call)
        if batch is None or dtype is None:
            return None
        timesteps = predicted_timesteps(pipeline, call)
        return schedule_timesteps(timesteps, batch=batch, dtype=dtype)

    def plan(
        self, model: Any, timestep: torch.Tensor, additional: Any, device: torch.device | None = None
    ) -> torch.Tensor:
        """The plan of a forward run on ``device`` with ``timestep`` and ``additional_t_cond``: float32, exact."""
        config = model.config
        dtype = input_dtype(model, model.img_in, device)
        return forward_plan_of(
            dtype, bool(config.zero_cond_t), bool(config.use_additional_t_cond), timestep, additional
        )

    def embed(
        self, model: Any, spec: ModulationSpec, plan: torch.Tensor, device: torch.device
    ) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """``silu(temb)`` from the model's own ``time_text_embed``, as the forward computes it (module docstring)."""
        dtype = input_dtype(model, model.img_in, device)
        plan = plan.to(device)
        timestep = (plan[:, 0] if plan.dim() == 2 else plan).to(dtype)
        additional = plan[:, 1].to(torch.long) if plan.dim() == 2 else None
        module = model.get_submodule(self.time_embedder)
        # Only the dtype of hidden_states is read by time_text_embed.
        hidden = torch.empty(0, dtype=dtype, device=device)
        with embedding_beneath_hooks(module.modules()):
            temb = module(timestep, hidden, additional)
        if not model.config.zero_cond_t:
            return F.silu(temb).to(spec.dtype)
        first = temb.chunk(2, dim=0)[0]
        return {core.INPUT: F.silu(temb).to(spec.dtype), core.FIRST: F.silu(first).to(spec.dtype)}


def predicted_timesteps(pipeline: Any, call: Mapping[str, Any]) -> torch.Tensor:
    """The scheduler timesteps ``QwenImagePipeline.__call__`` will set for ``call``: :func:`pipeline_timesteps`
    with the call's values, on a fresh scheduler of the pipeline's class and config (its own is untouched)."""
    scale = pipeline.vae_scale_factor
    height = int(call["height"] or pipeline.default_sample_size * scale)
    width = int(call["width"] or pipeline.default_sample_size * scale)
    latents = call["latents"]
    if isinstance(latents, torch.Tensor):
        sequence = int(latents.shape[1])
    else:  # prepare_latents: 2 * (size // (scale * 2)) latent pixels a side, packed 2 x 2
        sequence = (height // (scale * 2)) * (width // (scale * 2))
    scheduler = pipeline.scheduler
    return pipeline_timesteps(
        call["num_inference_steps"],
        height,
        width,
        scheduler.config,
        sigmas=call["sigmas"],
        sequence=sequence,
        scheduler_class=type(scheduler),
        device=pipeline._execution_device,
    )


def _call_batch_and_dtype(pipeline: Any, call: Mapping[str, Any]) -> tuple[int | None, torch.dtype | None]:
    """The latents' batch and dtype of a ``QwenImagePipeline`` call: the transformer's timestep is
    ``t.expand(batch).to(dtype)`` (None where the call does not tell)."""
    prompt, embeds, latents = call["prompt"], call["prompt_embeds"], call["latents"]
    if isinstance(prompt, str):
        batch: int | None = 1
    elif isinstance(prompt, list):
        batch = len(prompt)
    else:
        batch = int(embeds.shape[0]) if isinstance(embeds, torch.Tensor) else None
    if batch is not None:
        batch *= int(call["num_images_per_prompt"])
    if isinstance(latents, torch.Tensor):  # used as given, cast to the embeddings' dtype
        batch = int(latents.shape[0])
    # encode_prompt returns given embeddings as they are, and casts its own to the text encoder's dtype.
    encoder = getattr(pipeline, "text_encoder", None)
    dtype = embeds.dtype if isinstance(embeds, torch.Tensor) else getattr(encoder, "dtype", None)
    return batch, dtype


#: The one instance the registry serves Qwen-Image models with.
FAMILY = register(QwenImage())

__all__ = ["FAMILY", "QwenImage"]
