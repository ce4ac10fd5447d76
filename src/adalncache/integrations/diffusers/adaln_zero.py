"""What is the AdaLayerNormZero family's in the integration: its :class:`~.family.DiffusersFamily` (:data:`FAMILY`).

:mod:`adalncache.families.adaln_zero` defines the family (per-class module lists, geometry, structure
check); this module applies it to a live model: ``temb`` from the model's own modules as each class's
forward computes it (:data:`_TEMB`), the plans, the served forwards of the AdaLN modules, and the input
from a checkpoint alone for the command line (:func:`adaln_zero_embed_fn`). See docs/families.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.modeling_utils import get_parameter_dtype
from torch import nn

from ... import families
from ...errors import CheckpointError, ConfigError, PlanError
from ...families import adaln_zero
from ...families.adaln_zero import PIPELINE_TIMESTEPS, plan_of
from ...geometry import Layer, ModelGeometry
from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from .family import (
    DiffusersFamily,
    ServedForward,
    embedding_beneath_hooks,
    forward_argument,
    input_dtype,
    register,
    rows_forward,
)
from .loading import _build_on_meta, _load_config, _transformer_class


def model_geometry(model: nn.Module) -> ModelGeometry:
    """The served geometry of ``model`` after checking its modules against its class's list; ConfigError
    naming the class and the reason (refused, unknown, or modules that differ); nothing changes either way."""
    name = type(model).__name__
    family = families.for_class(name)
    if family is not adaln_zero.FAMILY:
        raise ConfigError(f"{name} is a {family.title} model, not one of the {adaln_zero.FAMILY.name} family")
    return adaln_zero.walk(model)


def _hunyuan_image(model: Any, cols: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # The forward receives timestep in the embedder's dtype (any other fails its first linear) and
    # casts time_proj's fp32 output to timestep.dtype; timestep_r and guidance are read by time_proj
    # as fp32 whatever their dtype.
    embed = model.time_guidance_embed
    t = cols["timestep"].to(get_parameter_dtype(embed.timestep_embedder))
    return embed(t, timestep_r=cols.get(adaln_zero.TIMESTEP_R), guidance=cols.get(adaln_zero.GUIDANCE))


def _hunyuan_video15(model: Any, cols: Mapping[str, torch.Tensor]) -> torch.Tensor:
    embed = model.time_embed
    t = cols["timestep"].to(get_parameter_dtype(embed.timestep_embedder))
    return embed(t, timestep_r=cols.get(adaln_zero.TIMESTEP_R))


def _motif(model: Any, cols: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return model.time_text_embed(cols["timestep"])  # time_proj reads the timestep as fp32


def _bria(model: Any, cols: Mapping[str, torch.Tensor]) -> torch.Tensor:
    dtype = input_dtype(model, model.x_embedder)  # the forward: timestep.to(hidden_states.dtype)
    temb = model.time_embed(cols["timestep"].to(dtype), dtype=dtype)
    guidance = cols.get(adaln_zero.GUIDANCE)
    if guidance is not None:  # Bria-FIBO's guidance-embedded variant (Bria's own is refused)
        temb = temb + model.guidance_embed(guidance.to(dtype), dtype=dtype)
    return temb


def _longcat(model: Any, cols: Mapping[str, torch.Tensor]) -> torch.Tensor:
    dtype = input_dtype(model, model.x_embedder)  # the forward: timestep.to(hidden_states.dtype) * 1000
    return model.time_embed(cols["timestep"].to(dtype) * 1000, dtype)


def _ovis(model: Any, cols: Mapping[str, torch.Tensor]) -> torch.Tensor:
    dtype = input_dtype(model, model.x_embedder)  # the forward: timestep.to(hidden_states.dtype) * 1000
    proj = model.time_proj(cols["timestep"].to(dtype) * 1000)
    return model.timestep_embedder(proj.to(dtype))


def _auraflow(model: Any, cols: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # The forward casts time_step_embed's fp32 output to its first parameter's dtype.
    proj = model.time_step_embed(cols["timestep"]).to(dtype=get_parameter_dtype(model))
    return model.time_step_proj(proj)


#: Each class's ``temb`` from its per-step inputs (one fp32 tensor per plan column), as its forward computes it.
_TEMB: dict[str, Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor]] = {
    "HunyuanImageTransformer2DModel": _hunyuan_image,
    "MotifVideoTransformer3DModel": _motif,
    "BriaTransformer2DModel": _bria,
    "LongCatImageTransformer2DModel": _longcat,
    "HunyuanVideo15Transformer3DModel": _hunyuan_video15,
    "AuraFlowTransformer2DModel": _auraflow,
    "BriaFiboTransformer2DModel": _bria,
    "OvisImageTransformer2DModel": _ovis,
}


#: Modules outside a class's ``temb`` module its forward computes ``temb`` with (a timestep projection).
_BESIDE_TEMB = {"OvisImageTransformer2DModel": ("time_proj",), "AuraFlowTransformer2DModel": ("time_step_embed",)}

#: A module outside the time embedding module whose output ``temb`` adds (Bria-FIBO's guidance).
GUIDANCE_MODULE = "guidance_embed"


def temb_modules(model: nn.Module) -> list[str]:
    """Module paths ``temb`` is computed with, for this model's class: everything upstream of the projections."""
    name = type(model).__name__
    paths = [adaln_zero.CLASSES[name].temb_module, *_BESIDE_TEMB.get(name, ())]
    if isinstance(getattr(model, GUIDANCE_MODULE, None), nn.Module):
        paths.append(GUIDANCE_MODULE)
    return paths


def plan_columns(plan: torch.Tensor, plan_inputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The plan's columns by input name (a 1-D plan is the ``timestep`` column)."""
    if plan.dim() == 1:
        return {plan_inputs[0]: plan}
    return {name: plan[:, i].contiguous() for i, name in enumerate(plan_inputs)}


def embed_input(model: Any, geometry: ModelGeometry, plan: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The served projections' exact input for ``plan``: ``silu(temb)``, ``temb`` from the model's own modules
    (the output layer's ``.to(x.dtype)`` is a no-op: ``x`` has ``temb``'s dtype in a model the cache serves)."""
    cols = plan_columns(plan.to(device), geometry.plan_inputs)
    with torch.no_grad():
        temb = _TEMB[type(model).__name__](model, cols)
    return F.silu(temb)


class AdalnZero(DiffusersFamily):
    """The AdaLayerNormZero family's eight classes as the integration serves them."""

    family = adaln_zero.FAMILY
    time_embedder = ""  # per class: see time_embedder_module
    # Bria-FIBO's forward adds its guidance embedding to temb in place.
    writable_stand_in = True

    def spec(self, model: nn.Module, dtype: torch.dtype | None = None) -> ModulationSpec:
        if type(model).__name__ not in adaln_zero.CLASSES:
            model_geometry(model)  # a refused or unknown class: the registry's ConfigError
        return ModulationSpec.for_geometry(**adaln_zero.from_transformer(model, dtype))

    def blocks_path(self, model: nn.Module) -> str:
        """The class's double-stream block list (AuraFlow's is ``joint_transformer_blocks``)."""
        layout = adaln_zero.CLASSES.get(type(model).__name__)
        return layout.double[0] if layout is not None else self.blocks

    def swapped_layers(self, spec: ModulationSpec) -> list[Layer]:
        """Every block's AdaLN module (one served class per kind of module); ``norm_out.linear`` gets a hook."""
        return [layer for layer in spec.layers() if layer != adaln_zero.FINAL_PATH]

    def served_forward(self, layer: Layer) -> ServedForward:
        """The served forward of ``layer``'s AdaLN module: its own forward with the rows in place of
        ``linear(silu(emb))`` (6 chunks for ``AdaLayerNormZero``, 3 for ``AdaLayerNormZeroSingle``)."""
        owner = str(layer).rpartition(".")[0]
        single = owner.startswith("single_transformer_blocks.") and owner.endswith(".norm")
        # The served forwards take the AdaLN modules' keywords (emb=...), more than ServedForward names.
        return _single_forward if single else _zero_forward

    def time_embedder_module(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(adaln_zero.CLASSES[type(model).__name__].temb_module)

    def upstream_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(path, model.get_submodule(path)) for path in temb_modules(model)]

    def time_embedder_linears(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The linears of the model's own class's time embedders that its config builds (the family's layout
        lists every class's: a path of another class could name a module of this one)."""
        layout = adaln_zero.CLASSES.get(type(model).__name__)
        if layout is None:
            return super().time_embedder_linears(model)
        named = []
        for embedder in layout.time_embedders:
            for linear in ("linear_1", "linear_2"):
                path = f"{embedder}.{linear}"
                with contextlib.suppress(AttributeError):  # an optional embedder (timestep_r, guidance) left out
                    named.append((path, model.get_submodule(path)))
        return named

    def embed(self, model: Any, spec: ModulationSpec, plan: torch.Tensor, device: torch.device) -> torch.Tensor:
        modules = [module for _, upstream in self.upstream_modules(model) for module in upstream.modules()]
        with embedding_beneath_hooks(modules):
            x = embed_input(model, spec.model_geometry, plan, device)
        return x.to(spec.dtype)

    def forward_plan(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
        inputs = _plan_inputs(module)
        return plan_of({name: forward_argument(module, name, args, kwargs) for name in inputs}, inputs)

    def request_plan(self, model: nn.Module, plan: Any) -> Any:
        """A plan given to ``prepare``: the forward's ``timestep`` tensor, or a mapping of its per-step inputs."""
        inputs = _plan_inputs(model)
        if isinstance(plan, Mapping):
            unknown = sorted(str(key) for key in set(plan) - set(inputs))
            if unknown:  # a key the modulation does not read (a typo, another family's input): never ignored
                raise PlanError(
                    f"a {type(model).__name__} plan mapping takes the keys {list(inputs)} (the inputs of its "
                    f"modulation under this config), got the unknown key(s) {unknown}"
                )
            return plan_of(plan, inputs)
        if isinstance(plan, torch.Tensor) and plan.dim() == 1 and len(inputs) == 1:
            return plan_of({inputs[0]: plan}, inputs)
        return plan  # a (rows, columns) plan as the cache keys it; the cache validates it

    def schedule_plans(
        self, model: nn.Module, timesteps: torch.Tensor, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> list[Any] | None:
        """Every remaining step's per-step inputs of a pipeline request, from its schedule and first forward. The
        conversion (:data:`PIPELINE_TIMESTEPS`) that gives this forward's timestep at some step is the request's, and
        that step its first. ``timestep_r`` (mean-flow) is the next step's timestep (0 after the last); ``guidance`` is
        the same at every step. ``None`` when no conversion matches."""
        inputs = _plan_inputs(model)
        first = {name: forward_argument(model, name, args, kwargs) for name in inputs}
        timestep = first["timestep"]
        if not isinstance(timestep, torch.Tensor) or timestep.dim() != 1 or timestep.numel() == 0:
            return None
        schedule = timesteps.detach().to("cpu", torch.float32).flatten()
        found = _match(schedule, timestep.detach().cpu(), _OWN_CONVERSION.get(type(model).__name__, 0))
        if found is None:
            return None
        convert, start = found
        rows, dtype = timestep.shape[0], timestep.dtype
        plans: list[Any] = []
        for k in range(start, schedule.shape[0]):
            step = {"timestep": convert(schedule[k], dtype).expand(rows)}
            if adaln_zero.TIMESTEP_R in inputs:
                following = schedule[k + 1] if k + 1 < schedule.shape[0] else torch.tensor(0.0)
                step[adaln_zero.TIMESTEP_R] = following.expand(rows).to(dtype)
            if adaln_zero.GUIDANCE in inputs:
                step[adaln_zero.GUIDANCE] = first[adaln_zero.GUIDANCE]
            plans.append(step if len(step) > 1 else step["timestep"])
        given_r = first.get(adaln_zero.TIMESTEP_R)
        if adaln_zero.TIMESTEP_R in inputs and not (
            isinstance(given_r, torch.Tensor) and torch.equal(given_r.cpu(), plans[0][adaln_zero.TIMESTEP_R])
        ):
            return None  # another pipeline's timestep_r: plans build per forward
        return plans


def _zero_forward(
    owner: Any,
    x: torch.Tensor,
    timestep: Any = None,
    class_labels: Any = None,
    hidden_dtype: Any = None,
    emb: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``AdaLayerNormZero.forward`` (diffusers 0.42.1; the model check refused one with its own ``emb``
    module) with the served rows in place of ``linear(silu(emb))``."""
    assert emb is not None
    rows = rows_forward(owner, emb)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = rows.chunk(6, dim=1)
    x = owner.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _single_forward(owner: Any, x: torch.Tensor, emb: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``AdaLayerNormZeroSingle.forward`` (diffusers 0.42.1) with the served rows in place of ``linear(silu(emb))``."""
    assert emb is not None
    rows = rows_forward(owner, emb)
    shift_msa, scale_msa, gate_msa = rows.chunk(3, dim=1)
    x = owner.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    return x, gate_msa


#: The class whose own pipeline's conversion is not the first of :data:`PIPELINE_TIMESTEPS` that
#: can match: at ``t = 1000`` (a flow-matching schedule's first step) "cast then / 1000" and
#: "/ 1000 then cast" both give 1.0, and only AuraFlow's pipeline divides first, so for it that
#: conversion is tried first (the later steps differ).
_OWN_CONVERSION = {"AuraFlowTransformer2DModel": 3}


def _match(
    schedule: torch.Tensor, timestep: torch.Tensor, own: int = 0
) -> tuple[Callable[[torch.Tensor, torch.dtype], torch.Tensor], int] | None:
    """The conversion and the step at which ``schedule`` gives ``timestep`` (every row equal), or None;
    ``own``: the index of the class's own pipeline's conversion, tried first at every step."""
    if not bool((timestep == timestep[0]).all()):
        return None  # a pipeline's rows share the step's timestep
    converts = [PIPELINE_TIMESTEPS[own], *(c for i, c in enumerate(PIPELINE_TIMESTEPS) if i != own)]
    for k in range(schedule.shape[0]):
        for convert in converts:
            value = convert(schedule[k], timestep.dtype)
            if value.dtype == timestep.dtype and torch.equal(value.expand(timestep.shape[0]), timestep):
                return convert, k
    return None


def adaln_zero_embed_fn(
    source: CheckpointSource, spec: ModulationSpec, device: torch.device | str = "cpu"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``embed(plan)`` of an AdaLayerNormZero-family checkpoint, with the model's own embedding modules;
    CheckpointError when the checkpoint lacks a tensor those modules need (a file of the projections alone)."""
    directory = Path(source.files[0]).parent  # where its config.json is, beside its weight files
    cls, _ = _transformer_class(directory, None)
    config, unused = _load_config(cls, directory, None, directory, None)
    model = _build_on_meta(cls, config, unused, spec.dtype)
    device = torch.device(device)
    for prefix in temb_modules(model):
        module = model.get_submodule(prefix)
        for name, param in list(module.named_parameters()):
            key = f"{prefix}.{name}"
            try:
                source.entry(key)
            except KeyError:
                raise CheckpointError(
                    f"the checkpoint has no {key} ({', '.join(str(f) for f in source.files)}): build, export and "
                    "verify compute the projections' input with the model's time embedding; pass the whole "
                    "transformer checkpoint, not only its AdaLN projections"
                ) from None
            tensor = source.read_tensor(key)
            value = tensor if tensor.dtype == param.dtype else tensor.to(param.dtype)  # the stock dtype rule
            owner, _, attr = name.rpartition(".")
            holder: Any = module.get_submodule(owner) if owner else module
            # A CPU tensor already in the parameter's dtype stays the file's aligned buffer (.to is a no-op).
            setattr(holder, attr, nn.Parameter(value.to(device), requires_grad=False))
    model.eval()
    geometry = spec.model_geometry

    def embed(plan: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embed_input(model, geometry, plan, device).to(spec.dtype)

    return embed


def _plan_inputs(model: nn.Module) -> tuple[str, ...]:
    config: Any = model.config
    fields = adaln_zero.fields_from_config(type(model).__name__, config)
    return tuple(fields["plan_inputs"])


#: The family's instance the registry serves.
FAMILY = register(AdalnZero())


__all__ = ["FAMILY", "AdalnZero", "adaln_zero_embed_fn", "embed_input", "model_geometry", "plan_columns"]
