"""What is MiniMax-H3's in the integration: its :class:`~.family.DiffusersFamily` (:data:`FAMILY`).

* **the served modules**: every block's ``adaln_proj.linear`` and ``norm_out.linear``; their
  module paths are the prefixes of the diffusers key layout (:data:`DIFFUSERS_LAYOUT`). Every
  block's ``adaln_proj`` is served by a class swap whose forward returns the block's six
  modulation tensors (:func:`.compile._served_forward`), ``norm_out.linear`` by a hook;
* **their input** (:meth:`MiniMaxH3.embed`): ``silu(time_embedder(time_proj(timestep)))`` cast to
  the projections' dtype, computed as the stock forward computes it;
* **a forward's plan** (:meth:`MiniMaxH3.forward_plan`): the ``timestep`` tensor the forward
  receives, 1-D float32, one entry per distinct timestep of the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError, PlanError
from ...families import minimax_h3 as core
from ...spec import LAYOUTS, Layer, ModulationSpec
from .calls import pipeline_class
from .compile import _served_forward
from .family import DiffusersFamily, ServedForward, timestep_argument
from .modules import bypassing_hooks, stock_dtype

#: The diffusers layout: its prefixes are the projections' module paths inside the transformer.
DIFFUSERS_LAYOUT = LAYOUTS["diffusers"]

#: The attribute holding the transformer's blocks.
BLOCKS = "transformer_blocks"

#: The time embedder and its two linears, whose LoRA (if any) also shapes what the projections see.
TIME_EMBEDDER = "time_embedder"
TIME_EMBEDDER_LINEARS = ("linear_1", "linear_2")


class MiniMaxH3(DiffusersFamily):
    """MiniMax-H3 (``MiniMaxH3Transformer3DModel``) as the integration serves it."""

    family = core.FAMILY
    time_embedder = TIME_EMBEDDER

    def served_forward(self, layer: Layer) -> ServedForward:
        return _served_forward

    def recognises(self, model: Any) -> bool:
        return is_minimax_h3_transformer(model)

    def rows_view(self, cache: Any, layer: Layer) -> torch.Tensor:
        # A per-block view of the block's rows: (P, W, block_width), the same strides for every block.
        return cache.served_part("block").select(2, int(layer))

    def embed(self, model: Any, spec: ModulationSpec, plan: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The projections' exact input for ``plan``, computed as the stock forward computes it.

        ``time_proj``, then the (fp32) time embedder at its own dtype, then SiLU at ``temb``'s
        precision and only then the cast to the projection dtype (the other order changes about
        half the outputs). Runs the time embedder's own (possibly LoRA-wrapped) forward, beneath
        every hook on it (ours stands in for it; an offloading hook must not move lent weights).
        """
        from diffusers.models.modeling_utils import get_parameter_dtype

        temb = model.time_proj(plan.to(device))
        time_embedder = model.get_submodule(TIME_EMBEDDER)
        with bypassing_hooks(time_embedder.modules()):
            temb = time_embedder(temb.to(get_parameter_dtype(time_embedder)))
        return F.silu(temb).to(projection_dtype(model, spec))

    def predict_schedule(
        self, model: nn.Module, pipeline: Any, call: Mapping[str, Any], component: str
    ) -> list[Any] | None:
        """The MiniMax-H3 modular pipeline's plans for a call, before its blocks run (:func:`predicted_plans`)."""
        return predicted_plans(pipeline, call, component)

    def forward_plan(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
        """The plan of one transformer forward: its ``timestep`` argument, refused unless 1-D float32.

        Converting it here would build tables for other timestep values than ``time_proj`` will see.
        """
        timestep = timestep_argument(module, args, kwargs)
        if timestep.dtype != torch.float32 or timestep.dim() != 1:
            raise PlanError(
                f"the AdaLN cache serves 1-D float32 timesteps (MiniMax-H3's distinct timesteps of the step), got "
                f"shape {tuple(timestep.shape)} and dtype {timestep.dtype}; pass timestep as a 1-D float32 tensor"
            )
        return timestep


#: The one instance the registry serves MiniMax-H3 models with.
FAMILY = MiniMaxH3()


def predicted_plans(pipeline: Any, call: Mapping[str, Any], component: str) -> list[torch.Tensor] | None:
    """Every step's plan a ``MiniMaxH3ModularPipeline`` call feeds its ``component``, from the call's inputs.

    A step's plan is the sorted distinct timesteps of its rows, which depend on the task and the
    two schedules only, never on the prompt, size or seed (:func:`adalncache.minimax_h3_plans`):
    the task is the one the pipeline's blocks pick (``ref2va`` with ``references``, run by
    ``transformer_ref``; ``fl2va`` with ``image`` or ``last_image``; else ``t2va``, both run by
    ``transformer``), ``num_inference_steps`` (diffusers' default when absent), the shifts of
    the pipeline's two schedulers, and, for ``ref2va``, whether an audio reference holds rows at
    ``t = 1``. None for a call it cannot tell (a ``state`` passed in, references without an image
    or video, a pipeline class of another ``__call__``, a component the call does not run).
    """
    from diffusers.modular_pipelines.modular_pipeline import ModularPipeline
    from diffusers.modular_pipelines.modular_pipeline_utils import InputParam

    from ...families.minimax_h3 import minimax_h3_plans

    if pipeline_class(pipeline).__call__ is not ModularPipeline.__call__ or call.get("state") is not None:
        return None
    references = call.get("references")
    if references is not None:
        task = "ref2va"
    elif call.get("image") is not None or call.get("last_image") is not None:
        task = "fl2va"
    else:
        task = "t2va"
    if component != ("transformer_ref" if task == "ref2va" else "transformer"):
        return None
    kinds = [getattr(reference, "kind", None) for reference in references or ()]
    if task == "ref2va" and not any(kind in ("image", "video") for kind in kinds):
        return None
    steps = call.get("num_inference_steps")
    if steps is None:  # the set-timesteps block's input is diffusers' template, with its default
        steps = InputParam.template("num_inference_steps").default
    if steps is None:
        return None
    return minimax_h3_plans(
        task,
        int(steps),
        video_shift=float(pipeline.scheduler.config["shift"]),
        audio_shift=float(pipeline.audio_scheduler.config["shift"]),
        audio_refs="audio" in kinds,
    )


def is_minimax_h3_transformer(obj: Any) -> bool:
    """Whether ``obj`` is a diffusers ``MiniMaxH3Transformer3DModel`` (imported lazily)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return isinstance(obj, MiniMaxH3Transformer3DModel)


def projection_dtype(model: nn.Module, spec: ModulationSpec) -> torch.dtype:
    """The one dtype every projection computes in (the cache serves them one shared embedding)."""
    dtypes = {stock_dtype(module) for _, module in FAMILY.projection_modules(model, spec)}
    if len(dtypes) != 1:
        raise ConfigError(
            f"the AdaLN projections do not share one dtype ({sorted(map(str, dtypes))}); the cache "
            "serves one embedding to all of them, so cast the model consistently before enabling"
        )
    return dtypes.pop()


__all__ = ["DIFFUSERS_LAYOUT", "FAMILY", "MiniMaxH3", "is_minimax_h3_transformer"]
