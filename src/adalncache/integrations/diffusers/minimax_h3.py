"""What is MiniMax-H3's in the integration: the served modules, where they sit, their input, a forward's plan.

Everything else in the integration (parking, holds, the LoRA signature, moves, hooks) works on
what this module names and is the same for any transformer whose modulation depends on the
timestep alone:

* **the served modules**: every block's ``adaln_proj.linear`` and ``norm_out.linear``; their
  module paths are the prefixes of the diffusers key layout (:data:`DIFFUSERS_LAYOUT`), so the
  layout is the one place that names them. peft may wrap them and, for ``norm_out.linear``,
  replace the object outright, so these helpers look the current module up each time instead of
  holding on to one; the blocks are reached through the list captured at enable time (cache-dit
  swaps ``transformer_blocks`` during its forward);
* **their input** (:func:`embed_input`): ``silu(time_embedder(time_proj(timestep)))`` cast to the
  projections' dtype, computed as the stock forward computes it;
* **a forward's plan** (:func:`forward_plan`): the ``timestep`` tensor the forward receives, 1-D
  float32, one entry per distinct timestep of the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError, PlanError
from ...spec import FINAL, LAYOUTS, Layer, ModulationSpec
from .modules import base_linear, bypassing_hooks, forward_argument, stock_dtype

#: The diffusers layout: its prefixes are the projections' module paths inside the transformer.
DIFFUSERS_LAYOUT = LAYOUTS["diffusers"]

#: The attribute holding the transformer's blocks.
BLOCKS = "transformer_blocks"

#: The real block list of each enabled model. Kept off the model itself: a library that looks for
#: a model's blocks among its attributes (cache-dit does) must not find a second list there.
_CAPTURED_BLOCKS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()

#: The time embedder and its two linears, whose LoRA (if any) also shapes what the projections see.
TIME_EMBEDDER = "time_embedder"
TIME_EMBEDDER_LINEARS = ("linear_1", "linear_2")


def is_minimax_h3_transformer(obj: Any) -> bool:
    """Whether ``obj`` is a diffusers ``MiniMaxH3Transformer3DModel`` (imported lazily)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return isinstance(obj, MiniMaxH3Transformer3DModel)


def projection_path(layer: Layer) -> str:
    """Module path of ``layer``'s projection (``transformer_blocks.3.adaln_proj.linear``)."""
    return DIFFUSERS_LAYOUT.prefix(layer)


def owner_path(layer: Layer) -> str:
    """Module path of the module that calls ``layer``'s projection (``transformer_blocks.3.adaln_proj``)."""
    return projection_path(layer).rpartition(".")[0]


def capture_blocks(model: nn.Module) -> None:
    """Remember the model's real block list while the cache is enabled."""
    _CAPTURED_BLOCKS[model] = model.get_submodule(BLOCKS)


def release_blocks(model: nn.Module) -> None:
    """Forget the list :func:`capture_blocks` remembered."""
    _CAPTURED_BLOCKS.pop(model, None)


def transformer_blocks(model: nn.Module) -> nn.Module:
    """The model's real block list: the captured one while enabled, else the model's attribute."""
    captured = _CAPTURED_BLOCKS.get(model)
    return captured if captured is not None else model.get_submodule(BLOCKS)


def _in_block(layer: int, path: str) -> str:
    """``path`` (a path in the model) relative to block ``layer``."""
    head = f"{BLOCKS}.{layer}."
    if not path.startswith(head):
        raise ConfigError(f"internal: {path} is not inside {head.rstrip('.')}")
    return path[len(head) :]


def projection_module(model: nn.Module, layer: Layer) -> Any:
    """The current module of ``layer``'s projection (peft may have wrapped it), through the real blocks."""
    if layer == FINAL:
        return model.get_submodule(projection_path(FINAL))
    blocks: Any = transformer_blocks(model)
    block = blocks[int(layer)]
    return block.get_submodule(_in_block(int(layer), projection_path(layer)))


def projection_modules(model: nn.Module, spec: ModulationSpec) -> list[tuple[Layer, Any]]:
    """``(layer, current module)`` of every projection, in pass order; peft may have wrapped them."""
    return [(layer, projection_module(model, layer)) for layer in spec.layers()]


def modulation_modules(model: nn.Module, spec: ModulationSpec) -> list[nn.Module]:
    """Every block's ``adaln_proj`` (the module that calls the projection), in layer order."""
    blocks: Any = transformer_blocks(model)
    return [blocks[layer].get_submodule(_in_block(layer, owner_path(layer))) for layer in range(spec.num_layers)]


def time_embedder_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of the time embedder's linears that exist on this model."""
    time_embedder = model.get_submodule(TIME_EMBEDDER)
    named = []
    for name in TIME_EMBEDDER_LINEARS:
        child = getattr(time_embedder, name, None)
        if isinstance(child, nn.Module):
            named.append((f"{TIME_EMBEDDER}.{name}", child))
    return named


def served_modules(model: nn.Module, spec: ModulationSpec) -> list[tuple[str, Any]]:
    """``(path, current module)`` of every module whose weights shape the served outputs."""
    named: list[tuple[str, Any]] = [
        (projection_path(layer), module) for layer, module in projection_modules(model, spec)
    ]
    return named + time_embedder_linears(model)


def check_materialised(model: nn.Module, spec: ModulationSpec) -> None:
    """Refuse a model whose projections hold no data: there would be nothing to serve or restore."""
    for _, module in projection_modules(model, spec):
        base = base_linear(module)
        for name in ("weight", "bias"):
            param = getattr(base, name, None)
            if param is None or param.device.type == "meta":
                raise ConfigError(
                    "the model's AdaLN projections are not materialised (meta or missing bias): load "
                    "the model fully before enabling the AdaLN cache, or load it with "
                    "adalncache.diffusers.load_transformer; accelerate's cpu_offload (and "
                    "enable_sequential_cpu_offload) moves every weight to meta, so enable the cache first, "
                    "then offload"
                )


def projection_dtype(model: nn.Module, spec: ModulationSpec) -> torch.dtype:
    """The one dtype every projection computes in (the cache serves them one shared embedding)."""
    dtypes = {stock_dtype(module) for _, module in projection_modules(model, spec)}
    if len(dtypes) != 1:
        raise ConfigError(
            f"the AdaLN projections do not share one dtype ({sorted(map(str, dtypes))}); the cache "
            "serves one embedding to all of them, so cast the model consistently before enabling"
        )
    return dtypes.pop()


def embed_input(model: Any, spec: ModulationSpec, plan: torch.Tensor, device: torch.device) -> torch.Tensor:
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


def forward_plan(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
    """The plan of one transformer forward: its ``timestep`` argument, refused unless 1-D float32.

    Converting it here would build tables for other timestep values than ``time_proj`` will see.
    """
    timestep = forward_argument(module, "timestep", args, kwargs)
    if not isinstance(timestep, torch.Tensor):
        raise PlanError(f"the AdaLN cache needs the forward's timestep tensor, got {type(timestep).__name__}")
    if timestep.dtype != torch.float32 or timestep.dim() != 1:
        raise PlanError(
            f"the AdaLN cache serves 1-D float32 timesteps (MiniMax-H3's distinct timesteps of the step), got "
            f"shape {tuple(timestep.shape)} and dtype {timestep.dtype}; pass timestep as a 1-D float32 tensor"
        )
    return timestep
