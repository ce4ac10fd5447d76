"""What is MiniMax-H3's in the integration: its :class:`~.family.DiffusersFamily` (:data:`FAMILY`), its
modular pipeline's prepare block, and what diffusers' block-level step caches need to know of it
(docs/diffusers.md, Step caches). Every block's ``adaln_proj`` is class-swapped to return the six
modulation tensors, ``norm_out.linear`` hooked; a forward's plan is its 1-D float32 ``timestep``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.modular_pipelines.modular_pipeline import LoopSequentialPipelineBlocks, ModularPipelineBlocks
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam
from torch import nn

from ...errors import ConfigError, PlanError
from ...families import minimax_h3 as core
from ...spec import FINAL, Layer, ModulationSpec
from .compat import CHECKED_DIFFUSERS, block_registry
from .family import (
    ROWS_ATTRIBUTE,
    STATE_ATTRIBUTE,
    DiffusersFamily,
    ServedForward,
    bypassing_hooks,
    forward_argument,
    gather_rows,
    register,
    stock_dtype,
    timestep_argument,
)
from .handle import adaln_cache_handle
from .request import pipeline_class

logger = logging.getLogger(__name__)

#: The time embedder (the module whose output is ``temb``).
TIME_EMBEDDER = "time_embedder"

#: Name of the block inserted in front of each loop denoiser.
PREPARE_BLOCK = "adaln_cache_prepare"


def _served_forward(self: Any, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``adaln_proj(temb)`` served from the slab: ``Y.view(-1, 6H).chunk(6, -1)`` of the resident ``Y``
    (``temb`` gives only the number of rows)."""
    rows = gather_rows(self.__dict__[ROWS_ATTRIBUTE], self.__dict__[STATE_ATTRIBUTE], temb.shape[0], "adaln_proj")
    chunks: tuple[torch.Tensor, ...] = rows.reshape(-1, 6 * self.hidden_size).chunk(6, dim=-1)
    return chunks


class MiniMaxH3(DiffusersFamily):
    """MiniMax-H3 (``MiniMaxH3Transformer3DModel``) as the integration serves it."""

    family = core.FAMILY
    time_embedder = TIME_EMBEDDER

    def served_forward(self, layer: Layer) -> ServedForward:
        return _served_forward

    def recognises(self, model: Any) -> bool:
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

        return isinstance(model, MiniMaxH3Transformer3DModel)

    def rows_view(self, cache: Any, layer: Layer) -> torch.Tensor:
        # A per-block view of the block's rows: (P, W, block_width), the same strides for every block.
        return cache.served_part("final") if layer == FINAL else cache.served_part("block").select(2, int(layer))

    def upstream_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [("time_proj", model.get_submodule("time_proj")), (TIME_EMBEDDER, model.get_submodule(TIME_EMBEDDER))]

    def attach_pipeline(self, pipeline: Any) -> Callable[[], None] | None:
        """The prepare block in front of the denoiser of every denoise loop of a modular pipeline."""
        blocks = getattr(pipeline, "_blocks", None)
        if blocks is None:
            return None
        inserted = []
        for loop in denoise_loops(blocks):
            if PREPARE_BLOCK in loop.sub_blocks:
                continue
            subs = loop.sub_blocks.values()
            index, denoiser = next((i, block) for i, block in enumerate(subs) if hasattr(block, "transformer_name"))
            loop.sub_blocks.insert(
                PREPARE_BLOCK, AdalnCachePrepareStep(transformer_name=denoiser.transformer_name), index
            )
            inserted.append(loop)

        def remove() -> None:
            for loop in inserted:
                if PREPARE_BLOCK in loop.sub_blocks:
                    del loop.sub_blocks[PREPARE_BLOCK]

        return remove

    def embed(self, model: Any, spec: ModulationSpec, plan: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``silu(time_embedder(time_proj(plan)))``, as the stock forward computes it: SiLU at ``temb``'s precision and
        only then the cast to the projection dtype (the other order changes about half the outputs); the time embedder's
        own forward, beneath every hook on it (ours stands in for it; an offloading hook must not move lent weights)."""
        from diffusers.models.modeling_utils import get_parameter_dtype

        temb = model.time_proj(plan.to(device))
        time_embedder = model.get_submodule(TIME_EMBEDDER)
        with bypassing_hooks(time_embedder.modules()):
            temb = time_embedder(temb.to(get_parameter_dtype(time_embedder)))
        return F.silu(temb).to(projection_dtype(model, spec))

    def predict_schedule(
        self, model: nn.Module, pipeline: Any, call: Mapping[str, Any], component: str
    ) -> list[Any] | None:
        return predicted_plans(pipeline, call, component)

    def forward_plan(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
        """The forward's ``timestep``, refused unless 1-D float32 (converting it would build tables for other
        values than ``time_proj`` sees)."""
        timestep = timestep_argument(module, args, kwargs)
        if timestep.dtype != torch.float32 or timestep.dim() != 1:
            raise PlanError(
                f"the AdaLN cache serves 1-D float32 timesteps (MiniMax-H3's distinct timesteps of the step), got "
                f"shape {tuple(timestep.shape)} and dtype {timestep.dtype}; pass timestep as a 1-D float32 tensor"
            )
        return timestep


#: The one instance the registry serves MiniMax-H3 models with.
FAMILY = register(MiniMaxH3())


class AdalnCachePrepareStep(ModularPipelineBlocks):
    """Denoise-loop block that hands a request's whole ``row_timestep_plan`` to its transformer at step 0,
    so no step waits on a build; a no-op for a transformer without an enabled cache."""

    model_name = "minimax-h3"  # type: ignore[assignment]  # diffusers declares it None on the base class

    def __init__(self, transformer_name: str = "transformer") -> None:
        self.transformer_name = transformer_name
        super().__init__()

    @property
    def description(self) -> str:
        return (
            "Builds the AdaLN tables of every step of the request in one pass before the first denoising "
            "step (adalncache)."
        )

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam(
                name="row_timestep_plan",
                type_hint=list,
                required=True,
                description="One `(timestep, timestep_indices)` pair per step.",
            ),
            InputParam.template("attention_kwargs"),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return []

    @torch.no_grad()
    def __call__(self, components: Any, block_state: Any, i: int, t: torch.Tensor) -> tuple[Any, Any]:
        if i == 0:
            handle = adaln_cache_handle(getattr(components, self.transformer_name, None))
            if handle is not None:
                handle.requests.schedule(block_state.row_timestep_plan, block_state.attention_kwargs)
        return components, block_state


def denoise_loops(blocks: Any) -> Iterator[LoopSequentialPipelineBlocks]:
    """Every loop block in a block tree whose sub-blocks include a MiniMax-H3 loop denoiser."""
    if isinstance(blocks, LoopSequentialPipelineBlocks):
        if any(hasattr(block, "transformer_name") for block in blocks.sub_blocks.values()):
            yield blocks
        return
    for block in getattr(blocks, "sub_blocks", {}).values():
        yield from denoise_loops(block)


def predicted_plans(pipeline: Any, call: Mapping[str, Any], component: str) -> list[torch.Tensor] | None:
    """Every step's plan a ``MiniMaxH3ModularPipeline`` call feeds its ``component``, from the call's inputs. Plans
    depend on the task (the one the pipeline's blocks pick), the step count, the two schedulers' shifts and, for
    ``ref2va``, whether an audio reference rides at ``t = 1``: never on the prompt, size or seed
    (:func:`adalncache.minimax_h3_plans`). None for a call it cannot tell (a ``state`` passed in, references without an
    image or video, another ``__call__``, a component the call does not run)."""
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


def projection_dtype(model: nn.Module, spec: ModulationSpec) -> torch.dtype:
    """The one dtype every projection computes in (the cache serves them one shared embedding)."""
    dtypes = {stock_dtype(module) for _, module in FAMILY.projection_modules(model, spec)}
    if len(dtypes) != 1:
        raise ConfigError(
            f"the AdaLN projections do not share one dtype ({sorted(map(str, dtypes))}); the cache "
            "serves one embedding to all of them, so cast the model consistently before enabling"
        )
    return dtypes.pop()


#: The diffusers release series (major.minor) the block registration was tested with.
TESTED_DIFFUSERS = ".".join(CHECKED_DIFFUSERS.split(".")[:2])

#: What the registry's metadata must offer for the registration below to mean what it says.
_METADATA_FIELDS = {"return_hidden_states_index", "return_encoder_hidden_states_index", "hidden_states_argument_name"}


def register_minimax_h3_block() -> bool:
    """Register ``MiniMaxH3TransformerBlock`` with diffusers' (private) block registry; True if it was not yet there.
    The block returns ``hidden_states`` as a plain tensor (text rows are part of the packed sequence); a registry that
    looks different raises ``ConfigError`` instead of registering something wrong."""
    import diffusers
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    version = diffusers.__version__
    TransformerBlockRegistry, TransformerBlockMetadata = block_registry()  # ConfigError where it moved
    fields = {field.name for field in dataclasses.fields(TransformerBlockMetadata)}
    if not fields >= _METADATA_FIELDS or not callable(getattr(TransformerBlockRegistry, "register", None)):
        raise ConfigError(
            f"diffusers {version}'s block registry is not the one register_minimax_h3_block() was written for "
            f"(tested with diffusers {TESTED_DIFFUSERS}); the block-level step caches cannot be taught "
            "the MiniMax-H3 block this way"
        )
    try:
        TransformerBlockRegistry.get(MiniMaxH3TransformerBlock)
        return False  # already registered (by diffusers itself, or an earlier call)
    except ValueError:
        pass
    if ".".join(version.split(".")[:2]) != TESTED_DIFFUSERS:
        logger.warning(
            "register_minimax_h3_block(): diffusers %s is not a version this registration was tested with (%s); "
            "its block registry is private to diffusers",
            version,
            TESTED_DIFFUSERS,
        )
    metadata: Any = TransformerBlockMetadata  # diffusers annotates the index as int, None included
    TransformerBlockRegistry.register(
        MiniMaxH3TransformerBlock, metadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None)
    )
    return True


def minimax_h3_raw_vision(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor] | None:
    """SeaCache's ``raw_vision_callback`` for MiniMax-H3: the generated video rows as one ``(C, T, H, W)`` latent. The
    generated rows are the packed video rows (``hidden_states`` ``(1, rows, C)`` in ``video_indices`` order) at the last
    video row's timestep (keyframes and references ride at their own noise level), frame after frame, ``H * W`` rows
    each, their ``(h, w)`` coordinates giving the grid. None (SeaCache then runs without skipping) when the inputs do
    not look like that."""
    names = ("hidden_states", "position_ids", "video_indices", "timestep_indices")
    hidden, positions, video, timestep_indices = (forward_argument(module, name, args, kwargs) for name in names)
    if not all(isinstance(t, torch.Tensor) for t in (hidden, positions, video, timestep_indices)):
        return None
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] != video.numel() or video.numel() == 0:
        return None
    steps = timestep_indices.index_select(0, video).cpu()
    generated = torch.nonzero(steps == steps[-1]).flatten()
    coords = positions.index_select(0, video).cpu().index_select(0, generated)
    times = coords[:, 0]
    frame_starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), times[1:] != times[:-1]])).flatten()
    counts = torch.diff(torch.cat([frame_starts, torch.tensor([times.numel()])]))
    frames = frame_starts.numel()
    rows_per_frame = int(counts[0])
    if not bool((counts == rows_per_frame).all()) or (frames > 1 and not bool((times[frame_starts].diff() > 0).all())):
        return None
    grid = coords[:rows_per_frame, 1:]
    heights, widths = torch.unique(grid[:, 0]), torch.unique(grid[:, 1])
    if heights.numel() * widths.numel() != rows_per_frame:
        return None
    rows = hidden[0].index_select(0, generated.to(hidden.device))
    # Rows within a frame in (h, w) order, whatever order the layout packed them in.
    cell = torch.searchsorted(heights, grid[:, 0].contiguous()) * widths.numel() + torch.searchsorted(
        widths, grid[:, 1].contiguous()
    )
    ordered = rows.view(frames, rows_per_frame, -1)[:, torch.argsort(cell).to(hidden.device)]
    return [ordered.reshape(frames, heights.numel(), widths.numel(), -1).permute(3, 0, 1, 2)]


__all__ = ["FAMILY", "AdalnCachePrepareStep", "minimax_h3_raw_vision", "register_minimax_h3_block"]
