"""The AdaLayerNormZero family: Flux-shaped diffusers transformers whose ``temb`` is timestep-only.

Eight diffusers 0.42.1 classes (:data:`CLASSES`) modulate with ``AdaLayerNormZero`` /
``AdaLayerNormZeroSingle`` blocks and an output ``norm_out``, all taking one input ``silu(temb)``
computed from per-step scalars alone; what each serves, what stays resident and how its ``temb`` is
computed is tabulated in docs/families.md. A model is checked against exactly that list
(:func:`check_structure`) and refused, never half served, when it differs. The checkpoint-only
``embed`` needs each class's own embedding modules, so it lives in the integration
(:attr:`~adalncache.geometry.Family.model_embed`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

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
    finite,
    numbers,
)
from ..options import Argument, Cli
from .qwen_image import pipeline_timesteps

#: The second timestep of the mean-flow variants (the next step's timestep).
TIMESTEP_R = "timestep_r"
#: The distilled guidance scale of guidance-embedded variants.
GUIDANCE = "guidance"

#: The one projection input: ``silu(temb)`` in the projections' dtype.
INPUT = "temb"


def input_name(class_name: str) -> str:
    """The projections' input as a geometry names it (``temb:BriaTransformer2DModel``): classes with the same
    modules compute ``temb`` differently (a ``* 1000``, a cast), so the class is in the geometry's identity."""
    return f"{INPUT}:{class_name}"


def class_of(geometry: ModelGeometry) -> str:
    """The diffusers class a geometry of this family was made for (from its projections' input name)."""
    prefix, _, class_name = geometry.layers[0].input.partition(":")
    if prefix != INPUT or class_name not in CLASSES:
        raise ConfigError(f"{geometry.layers[0].input!r} is not an input of the {FAMILY.name} family")
    return class_name


#: The output layer every class of the family has.
FINAL_PATH = "norm_out.linear"

#: Module classes that compute an AdaLN modulation: every module of these classes in a model is
#: either served or listed as staying resident, else the model is refused.
ADALN_CLASS = re.compile(r"AdaLayerNorm|AdaNorm|PreFinalBlock")


@dataclass(frozen=True)
class ClassLayout:
    """Where one diffusers class keeps its modulation, and what computes its ``temb``.

    ``double``/``single``: the block lists' attributes and the config keys counting them (``single``
    empty: no single-stream blocks); ``single_norm``/``single_ways``: the single block's AdaLN attribute
    and its outputs per dim (3, or 6 for an ``AdaLayerNormZero``); ``final_class``: the output layer's
    class; ``stays``: AdaLN modules taking more than ``temb``, resident (``{k}`` counts the config's
    ``refiners``); ``temb_module``: the module whose output is ``temb``; ``time_embedders``: the
    ``TimestepEmbedding`` modules inside it whose weights shape ``temb``; ``optional``: plan inputs after
    ``timestep`` with the config flag enabling each (served by the time embedders after the first, in
    order); ``guidance_embedder``: ``guidance``'s embedder where it sits outside ``temb_module``.
    """

    class_name: str
    title: str
    double: tuple[str, str] = ("transformer_blocks", "num_layers")
    single: tuple[str, str] | tuple[()] = ("single_transformer_blocks", "num_single_layers")
    single_norm: str = "norm"
    single_ways: int = 3
    final_class: str = "AdaLayerNormContinuous"
    bias: bool = True
    stays: tuple[str, ...] = ()
    refiners: str = "num_refiner_layers"
    temb_module: str = "time_embed"
    time_embedders: tuple[str, ...] = ("time_embed.timestep_embedder",)
    optional: tuple[tuple[str, str], ...] = ()
    guidance_embedder: str = ""
    #: A config flag the class cannot be served with, and why.
    unservable: tuple[tuple[str, str], ...] = ()


_REFINER = "context_embedder.token_refiner.refiner_blocks.{k}.norm_out"

CLASSES: dict[str, ClassLayout] = {
    c.class_name: c
    for c in (
        ClassLayout(
            "HunyuanImageTransformer2DModel",
            "HunyuanImage-2.1",
            stays=(_REFINER,),
            temb_module="time_guidance_embed",
            time_embedders=(
                "time_guidance_embed.timestep_embedder",
                "time_guidance_embed.timestep_embedder_r",
                "time_guidance_embed.guidance_embedder",
            ),
            optional=((TIMESTEP_R, "use_meanflow"), (GUIDANCE, "guidance_embeds")),
        ),
        ClassLayout(
            "MotifVideoTransformer3DModel",
            "Motif-Video",
            temb_module="time_text_embed",
            time_embedders=("time_text_embed.timestep_embedder",),
        ),
        ClassLayout(
            "BriaTransformer2DModel",
            "Bria",
            unservable=(
                (
                    "guidance_embeds",
                    "the model class (as of its 0.42.1 release) cannot be built with guidance_embeds=True (its "
                    "guidance embedder misses time_theta) and its forward skips the guidance embedding when "
                    "guidance is 0",
                ),
            ),
        ),
        ClassLayout("LongCatImageTransformer2DModel", "LongCat-Image"),
        ClassLayout(
            "HunyuanVideo15Transformer3DModel",
            "HunyuanVideo-1.5",
            single=(),
            stays=(_REFINER,),
            time_embedders=("time_embed.timestep_embedder", "time_embed.timestep_embedder_r"),
            optional=((TIMESTEP_R, "use_meanflow"),),
        ),
        ClassLayout(
            "AuraFlowTransformer2DModel",
            "AuraFlow",
            double=("joint_transformer_blocks", "num_mmdit_layers"),
            single=("single_transformer_blocks", "num_single_dit_layers"),
            single_norm="norm1",
            single_ways=6,
            final_class="AuraFlowPreFinalBlock",
            bias=False,
            temb_module="time_step_proj",
            time_embedders=("time_step_proj",),
        ),
        ClassLayout(
            "BriaFiboTransformer2DModel",
            "Bria-FIBO",
            optional=((GUIDANCE, "guidance_embeds"),),
            guidance_embedder="guidance_embed.timestep_embedder",
        ),
        ClassLayout(
            "OvisImageTransformer2DModel",
            "Ovis-Image",
            temb_module="timestep_embedder",
            time_embedders=("timestep_embedder",),
        ),
    )
}

#: The linears of every class's time embedders (a model has those of its class; the others are absent).
TIME_EMBEDDER_LINEARS = tuple(
    dict.fromkeys(
        f"{path}.{linear}" for c in CLASSES.values() for path in c.time_embedders for linear in ("linear_1", "linear_2")
    )
)


def layout_of(class_name: str) -> ClassLayout:
    """The layout of a class of this family, or a ConfigError naming the family's classes."""
    try:
        return CLASSES[class_name]
    except (KeyError, TypeError):
        raise ConfigError(f"{class_name} is not a class of the {FAMILY.name} family ({', '.join(CLASSES)})") from None


def _count(config: Mapping[str, Any], key: str, class_name: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{class_name}: config {key} must be a non-negative integer, got {value!r}")
    return value


def fields_from_config(class_name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The block counts (double, single, token refiner), ``hidden_size`` (heads x head dim) and plan inputs of a
    model of ``class_name`` with this config; ConfigError for a configuration the class cannot be served with."""
    layout = layout_of(class_name)
    for flag, reason in layout.unservable:
        if config.get(flag):
            raise ConfigError(f"{class_name} with {flag}={config.get(flag)!r} cannot be served: {reason}")
    heads = _count(config, "num_attention_heads", class_name)
    head_dim = _count(config, "attention_head_dim", class_name)
    if heads * head_dim == 0:
        raise ConfigError(f"{class_name}: num_attention_heads x attention_head_dim must be positive")
    return {
        "double_layers": _count(config, layout.double[1], class_name),
        "single_layers": _count(config, layout.single[1], class_name) if layout.single else 0,
        "refiner_layers": _count(config, layout.refiners, class_name) if layout.stays else 0,
        "hidden_size": heads * head_dim,
        "plan_inputs": (TIMESTEP, *(name for name, flag in layout.optional if config.get(flag))),
    }


def served_paths(class_name: str, double_layers: int, single_layers: int) -> list[tuple[str, int, str]]:
    """``(module path, outputs per dim, AdaLN module class)`` of every served linear, in the forward's order."""
    layout = layout_of(class_name)
    zero, blocks = "AdaLayerNormZero", layout.double[0]
    paths: list[tuple[str, int, str]] = []
    for i in range(double_layers):
        paths += [(f"{blocks}.{i}.norm1.linear", 6, zero), (f"{blocks}.{i}.norm1_context.linear", 6, zero)]
    if layout.single:
        kind = zero if layout.single_ways == 6 else "AdaLayerNormZeroSingle"
        paths += [
            (f"{layout.single[0]}.{j}.{layout.single_norm}.linear", layout.single_ways, kind)
            for j in range(single_layers)
        ]
    return [*paths, (FINAL_PATH, 2, layout.final_class)]


def resident_paths(class_name: str, refiner_layers: int) -> list[str]:
    """Module paths of the AdaLN modules that stay resident (their input includes the prompt)."""
    layout = layout_of(class_name)
    return [pattern.format(k=k) for pattern in layout.stays for k in range(refiner_layers)]


@lru_cache(maxsize=64)
def geometry(
    class_name: str, double_layers: int, single_layers: int, hidden_size: int, plan_inputs: tuple[str, ...]
) -> ModelGeometry:
    """The geometry of one model: its served projections by module path, widths, plan inputs."""
    paths = served_paths(class_name, double_layers, single_layers)
    bias = layout_of(class_name).bias  # AuraFlow's projections have none: served as F.linear(x, w, None)
    layers = tuple(ServedLayer(path, ways * hidden_size, input_name(class_name), bias) for path, ways, _ in paths)
    return ModelGeometry(FAMILY, layers, hidden_size, plan_inputs)


def geometry_from_config(class_name: str, config: Mapping[str, Any]) -> ModelGeometry:
    """:func:`geometry` of the model ``config`` describes."""
    f = fields_from_config(class_name, config)
    return geometry(class_name, f["double_layers"], f["single_layers"], f["hidden_size"], f["plan_inputs"])


def spec_args(geometry: ModelGeometry, fields: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
    """``ModulationSpec.for_geometry`` keywords of a model (blocks counted double plus single)."""
    return {
        "geometry": geometry,
        "dtype": dtype,
        "num_layers": fields["double_layers"] + fields["single_layers"],
        "hidden_size": fields["hidden_size"],
    }


def walk(model: Any) -> ModelGeometry:
    """The geometry of a transformer of this family, after its modules passed :func:`check_structure`."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if not isinstance(config, Mapping):
        raise ConfigError(f"{name} has no model config (config.json) to read its geometry from")
    fields = fields_from_config(name, config)
    modules = {path: type(module).__name__ for path, module in model.named_modules()}
    linears: dict[str, tuple[int, int, bool]] = {}
    for path, _, _ in served_paths(name, fields["double_layers"], fields["single_layers"]):
        try:
            linear = model.get_submodule(path)
        except AttributeError:
            continue  # reported by the check as a missing module
        linear = getattr(linear, "base_layer", linear)  # inside a peft LoRA wrapper
        weight = getattr(linear, "weight", None)
        if weight is not None and getattr(weight, "dim", lambda: 0)() == 2:
            # The logical shape: a packed quantized weight (GGUF blocks, bitsandbytes 4-bit) is stored in another.
            out, k = getattr(linear, "out_features", weight.shape[0]), getattr(linear, "in_features", weight.shape[1])
            linears[path] = (int(out), int(k), getattr(linear, "bias", None) is not None)
    return check_structure(name, config, modules, linears)


def from_transformer(model: Any, dtype: Any = None) -> dict[str, Any]:
    """The spec keywords of a transformer of this family (:func:`walk`); ``dtype`` as :meth:`Family.spec_fields`."""
    geo = walk(model)
    dtype = dtype or FAMILY.projection_dtype(model, geo.layers[0].id)
    return spec_args(geo, fields_from_config(type(model).__name__, model.config), dtype)


def check_structure(
    class_name: str, config: Mapping[str, Any], modules: Mapping[str, str], linears: Mapping[str, tuple[int, int, bool]]
) -> ModelGeometry:
    """The model's geometry once its modules (path -> class name) and served ``linears`` (out, in, has bias)
    match the class's list (docs/families.md: how a model is checked); ConfigError naming what differs."""
    layout = layout_of(class_name)
    fields, geo = fields_from_config(class_name, config), geometry_from_config(class_name, config)
    served = {
        path.rpartition(".")[0]: (path, kind)
        for path, _, kind in served_paths(class_name, fields["double_layers"], fields["single_layers"])
    }
    resident = set(resident_paths(class_name, fields["refiner_layers"]))
    found = {path for path, kind in modules.items() if ADALN_CLASS.search(kind)}
    problems: list[str] = []
    missing = sorted(set(served) - found)
    unexpected = sorted(found - set(served) - resident)
    if missing:
        problems.append(f"no AdaLN module at {_few(missing)}")
    if unexpected:
        problems.append(f"AdaLN modules not in its list at {_few(unexpected)}")
    if resident - found:
        problems.append(f"no resident token-refiner AdaLN at {_few(sorted(resident - found))}")
    for owner, (path, kind) in served.items():
        if owner not in modules:
            continue
        if modules[owner] != kind:
            problems.append(f"{owner} is a {modules[owner]}, not an {kind}")
        if f"{owner}.emb" in modules:
            problems.append(f"{owner} embeds its own timestep (an AdaLayerNormZero with num_embeddings)")
        want = (geo.layer(path).out_features, geo.in_features, layout.bias)
        if linears.get(path) != want:
            problems.append(f"{path} is {_linear(linears.get(path))}, not {_linear(want)}")
    if problems:
        raise ConfigError(
            f"{class_name} cannot be served: its modules differ from the {FAMILY.name} family's list for this "
            f"class ({'; '.join(problems[:4])}); nothing was changed"
        )
    return geo


def _linear(shape: tuple[int, int, bool] | None) -> str:
    if shape is None:
        return "missing"
    out, k, bias = shape
    return f"Linear({k} -> {out}, bias={bias})"


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


#: dtypes whose values an fp32 plan holds exactly (so the forward's tensor is the plan cast back).
_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)


def plan_of(inputs: Mapping[str, Any], plan_inputs: tuple[str, ...]) -> torch.Tensor:
    """The plan of one forward: its per-step inputs (by argument name), one fp32 column each; PlanError for a
    missing input, one not 1-D with ``timestep``'s rows, or a dtype an fp32 plan cannot hold exactly."""
    columns: list[torch.Tensor] = []
    for name in plan_inputs:
        value = inputs.get(name)
        if not isinstance(value, torch.Tensor):
            raise PlanError(
                f"the AdaLN cache needs the forward's {name} tensor (this model's config makes {name} one of the "
                f"inputs of its modulation), got {type(value).__name__}"
            )
        if value.dim() != 1 or value.dtype not in _EXACT_IN_FP32:
            raise PlanError(
                f"the AdaLN cache serves a 1-D float32, bfloat16 or float16 {name} (one entry per batch row), got "
                f"shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        if columns and value.shape[0] != columns[0].shape[0]:
            raise PlanError(f"{name} has {value.shape[0]} rows but timestep has {columns[0].shape[0]}")
        columns.append(value.detach().to(torch.float32))
    if len(columns) == 1:
        return columns[0]
    return torch.stack(columns, dim=1)


#: How the family's pipelines turn a scheduler timestep (fp32) into the forward's ``timestep`` of
#: dtype ``d``: as it is (Motif-Video, Bria), cast (HunyuanImage, HunyuanVideo-1.5, Bria-FIBO), cast
#: then divided by 1000 (LongCat-Image, Ovis-Image), divided by 1000 then cast (AuraFlow).
PIPELINE_TIMESTEPS: tuple[Callable[[torch.Tensor, torch.dtype], torch.Tensor], ...] = (
    lambda t, d: t,
    lambda t, d: t.to(d),
    lambda t, d: t.to(d) / 1000,
    lambda t, d: (t / 1000).to(d),
)


#: How each class's pipeline sets its scheduler for a step count: ``shifted`` (``sigmas = linspace(1,
#: 1 / steps, steps)`` and ``mu`` from the packed latent length ``(height // k) * (width // k)``, ``k``
#: given), ``unshifted`` (``sigmas = linspace(1, 0, steps + 1)[:-1]``, no ``mu``: the Hunyuan
#: pipelines), ``plain`` (``set_timesteps(steps)``: AuraFlow), ``bria`` (Bria's own rule); and how it
#: turns a scheduler timestep into the forward's (an index of :data:`PIPELINE_TIMESTEPS`). Not here:
#: Motif-Video, whose shift depends on the frame count, which a checkpoint does not give.
STEP_SCHEDULES: dict[str, tuple[str, int, int]] = {
    "BriaTransformer2DModel": ("bria", 16, 0),
    "OvisImageTransformer2DModel": ("shifted", 16, 2),
    "LongCatImageTransformer2DModel": ("shifted", 16, 2),
    "BriaFiboTransformer2DModel": ("shifted", 16, 1),  # vae_scale_factor 16, unpatched latents
    "AuraFlowTransformer2DModel": ("plain", 0, 3),
    "HunyuanImageTransformer2DModel": ("unshifted", 0, 1),
    "HunyuanVideo15Transformer3DModel": ("unshifted", 0, 1),
}


def _scheduler_timesteps(
    class_name: str, steps: int, height: int, width: int, scheduler_config: Mapping[str, Any]
) -> torch.Tensor:
    """The scheduler timesteps (fp32) the class's pipeline sets; the shifted rule is Qwen-Image's, which they copy."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    rule, packing, _ = STEP_SCHEDULES[class_name]
    scheduler: Any = FlowMatchEulerDiscreteScheduler.from_config(dict(scheduler_config))
    config = scheduler.config
    dynamic = config.get("use_dynamic_shifting")
    if rule in ("unshifted", "plain") and dynamic:
        raise ConfigError(
            f"the scheduler config shifts by the image size (use_dynamic_shifting), which {class_name}'s pipeline "
            f"does not pass (it would fail): pass the scheduler config of the pipeline, or {TIMESTEPS.flag}"
        )
    if rule == "shifted" or (rule == "bria" and dynamic):
        sequence = (height // packing) * (width // packing)
        return pipeline_timesteps(steps, height, width, scheduler_config, sequence=sequence).to(torch.float32)
    if rule == "bria":
        from diffusers.pipelines.bria.pipeline_bria import get_original_sigmas

        scheduler.set_timesteps(sigmas=get_original_sigmas(config.num_train_timesteps, steps))
    elif rule == "unshifted":
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    else:
        scheduler.set_timesteps(steps)
    return scheduler.timesteps.to(torch.float32)


def pipeline_forward_inputs(
    class_name: str,
    steps: int,
    height: int,
    width: int,
    scheduler_config: Mapping[str, Any],
    *,
    rows: int,
    dtype: torch.dtype,
    timestep_r: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """The per-step inputs each forward of the class's pipeline receives for ``steps`` at ``height`` x ``width``:
    the scheduler timesteps as the pipeline sets them (:data:`STEP_SCHEDULES`), then its conversion; ``rows``:
    2 x images where it concatenates cond and uncond; ``timestep_r``: the next step's timestep (0 after the
    last), as the Hunyuan pipelines pass it. ConfigError naming ``--timesteps`` where a step count does not
    determine the schedule."""
    if class_name not in STEP_SCHEDULES:
        raise ConfigError(
            f"the schedule of {class_name}'s pipeline is not computed from a step count here (it depends on more "
            f"than the checkpoint and the image size): pass the forward's timesteps ({TIMESTEPS.flag})"
        )
    if scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler") != "FlowMatchEulerDiscreteScheduler":
        raise ConfigError(
            f"the scheduler config names a {scheduler_config.get('_class_name')}; a step count is turned into "
            f"timesteps for a FlowMatchEulerDiscreteScheduler only: pass the forward's timesteps ({TIMESTEPS.flag})"
        )
    schedule = _scheduler_timesteps(class_name, steps, height, width, scheduler_config)
    convert = PIPELINE_TIMESTEPS[STEP_SCHEDULES[class_name][2]]
    forwards = []
    for k in range(schedule.shape[0]):
        step = {TIMESTEP: convert(schedule[k], dtype).expand(rows)}
        if timestep_r:
            following = schedule[k + 1] if k + 1 < schedule.shape[0] else torch.tensor(0.0)
            step[TIMESTEP_R] = following.expand(rows).to(dtype)
        forwards.append(step)
    return forwards


GUIDANCE_VALUE = Argument(
    GUIDANCE, "the guidance value every forward receives, where the config enables guidance_embeds", Cli("float")
)
TIMESTEP_R_VALUES = Argument(
    TIMESTEP_R, "the forwards' timestep_r (mean-flow variants), comma-separated, one per explicit timestep", Cli("text")
)


class AdalnZero(ImageFamily):
    """The AdaLayerNormZero family (module docstring)."""

    def spec_fields(self, model: Any, dtype: Any = None) -> dict[str, Any]:
        return from_transformer(model, dtype)

    def header_fields(
        self, path: object, entries: Mapping[str, Any], config: Mapping[str, Any], layout: str, modalities: int
    ) -> dict[str, Any]:
        """Every served projection's weight and bias (where the class has one) must be there with the
        geometry's shapes and one dtype; CheckpointError names the first that is not."""
        name = str(config.get("_class_name"))
        geo = geometry_from_config(name, config)
        dtypes = set()
        for layer in geo.layers:
            shapes = {"weight": [layer.out_features, geo.in_features], "bias": [layer.out_features]}
            for tensor, shape in ((f"{layer.id}.{part}", shapes[part]) for part in layer.tensors):
                entry = entries.get(tensor)
                if entry is None or list(entry.shape) != shape or entry.torch_dtype is None:
                    found = "missing" if entry is None else f"{list(entry.shape)} {entry.dtype}"
                    raise CheckpointError(
                        f"{path}: {tensor} is {found}, not {shape}: this is not the {name} of its config"
                    )
                dtypes.add(entry.torch_dtype)
        if len(dtypes) != 1:
            raise CheckpointError(f"{path}: the AdaLN projections have several dtypes ({sorted(map(str, dtypes))})")
        return spec_args(geo, fields_from_config(name, config), dtypes.pop())

    def schedule_name(self, spec: Any) -> str:
        return class_of(spec.model_geometry)

    def schedule_hint(self, spec: Any) -> str:
        return (
            f"{super().schedule_hint(spec)}, plus {GUIDANCE_VALUE.flag} / {TIMESTEP_R_VALUES.flag} where its config "
            "takes them"
        )

    def check_values(self, values: Mapping[str, Any], spec: Any) -> None:
        """``guidance`` and ``timestep_r`` exactly where the config makes them inputs of ``temb`` (with a step
        count, ``timestep_r`` is the schedule's next timestep, as the mean-flow pipelines pass it)."""
        class_name, inputs = class_of(spec.model_geometry), spec.plan_inputs
        if values[GUIDANCE] is not None:
            finite(GUIDANCE_VALUE, [values[GUIDANCE]])
        for argument in (GUIDANCE_VALUE, TIMESTEP_R_VALUES):
            value = values[argument.name]
            if argument is TIMESTEP_R_VALUES and values["timesteps"] is None and values["steps"]:
                if value is not None:
                    raise ConfigError(
                        f"{argument.flag} pairs with {TIMESTEPS.flag} (one value per timestep); with {STEPS.flag} it "
                        f"is the schedule's next timestep: drop {argument.flag}"
                    )
                continue
            said = f"this {class_name} checkpoint's config"
            if argument.name in inputs and value is None:
                raise ConfigError(f"{said} makes {argument.name} an input of temb: pass {argument.flag}")
            if argument.name not in inputs and value is not None:
                raise ConfigError(f"{said} does not take {argument.name}: drop {argument.flag}")

    def step_inputs(
        self, spec: Any, values: Mapping[str, Any], steps: int, size: tuple[int, int], config: Mapping[str, Any]
    ) -> list[dict[str, torch.Tensor]]:
        return pipeline_forward_inputs(
            class_of(spec.model_geometry),
            steps,
            *size,
            config,
            rows=values["batch"],
            dtype=spec.dtype,
            timestep_r=TIMESTEP_R in spec.plan_inputs,
        )

    def plans_of(
        self, forwards: list[dict[str, torch.Tensor]], values: Mapping[str, Any], spec: Any, source: Any
    ) -> list[torch.Tensor]:
        """Each forward's columns: ``timestep``, ``timestep_r`` (the flag's values with explicit timesteps,
        the schedule's next timestep with a step count) and ``guidance`` (the same at every step)."""
        seconds = numbers(TIMESTEP_R_VALUES, values[TIMESTEP_R]) if values[TIMESTEP_R] is not None else []
        if seconds and len(seconds) != len(forwards):
            raise ConfigError(
                f"{TIMESTEP_R_VALUES.flag} has {len(seconds)} value(s) for {len(forwards)} {TIMESTEPS.flag}: pair them"
            )
        plans = []
        for k, forward in enumerate(forwards):
            step, shape = dict(forward), forward[TIMESTEP].shape
            if seconds:
                step[TIMESTEP_R] = torch.full(shape, seconds[k], dtype=torch.float32)
            if values[GUIDANCE] is not None:
                step[GUIDANCE] = torch.full(shape, values[GUIDANCE], dtype=torch.float32)
            plans.append(plan_of(step, spec.plan_inputs))
        return plans

    def upstream(self, spec: Any, layout: KeyLayout) -> tuple[str, ...]:
        """The class's time embedders that its config builds (the first, and one per optional input it
        enables), and Bria-FIBO's guidance embedder where guidance is an input."""
        inputs = spec.plan_inputs
        layout_ = CLASSES[class_of(spec.model_geometry)]
        embedders = [layout_.time_embedders[0]]
        embedders += [path for (name, _), path in zip(layout_.optional, layout_.time_embedders[1:]) if name in inputs]
        if layout_.guidance_embedder and GUIDANCE in inputs:
            embedders.append(layout_.guidance_embedder)
        linears = [f"{e}.linear_{i}" for e in embedders for i in (1, 2)]
        return tuple(f"{linear}.{part}" for linear in linears for part in ("weight", "bias"))


FAMILY = AdalnZero(
    name="adaln-zero",
    title="AdaLayerNormZero (timestep-only temb)",
    layouts=(KeyLayout("diffusers", time_embedder=TIME_EMBEDDER_LINEARS),),
    class_names=tuple(CLASSES),
    arguments=(STEPS, HEIGHT, WIDTH, TIMESTEPS, BATCH, SCHEDULER_CONFIG, GUIDANCE_VALUE, TIMESTEP_R_VALUES),
    demos=(("bria", "BriaTransformer2DModel"), ("ovis-image", "OvisImageTransformer2DModel")),
    model_embed="adalncache.integrations.diffusers.adaln_zero:adaln_zero_embed_fn",
)
