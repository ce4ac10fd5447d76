"""The family-neutral description of what a cache serves: projections, their table columns, plans, layouts.

The slab, pass, tiers, store, table files and rank agreement serve any model whose AdaLN modulation
depends on per-step scalars only, knowing of it only a :class:`ModelGeometry`. :class:`Family` is the
one seam through which the core asks a family anything; :class:`ImageFamily` is what the families of
diffusers' flow-matching image pipelines share (docs/api.md, docs/adding-a-family.md). No model is named.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import torch

from .errors import CheckpointError, ConfigError
from .options import Argument, Cli, flag

#: A served layer: a block index, ``"final"`` (the output layer of a family that numbers its
#: blocks), or the projection's module path (``"transformer_blocks.3.norm1.linear"``).
Layer = int | str

FINAL: Literal["final"] = "final"

SUPPORTED_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The name of the one table part of a geometry that declares none (the whole row).
TABLE_PART = "table"
#: Its tensor in a table file: ``table_rows [P, W, table_width]``.
TABLE_ROWS = "table_rows"
#: The plan input of a family keyed by the timestep alone.
TIMESTEP = "timestep"


@dataclass(frozen=True)
class KeyLayout:
    """Tensor names of one checkpoint layout: a layer's tensors are ``<prefix>.weight`` and ``<prefix>.bias``
    (:meth:`prefix`). ``time_embedder``: the module paths of the time embedder's linears."""

    name: str
    block_prefix: str = ""
    final_prefix: str = ""
    time_embedder: tuple[str, ...] = ()

    def prefix(self, layer: Layer) -> str:
        """``block_prefix`` formatted with a block index, ``final_prefix`` for :data:`FINAL`, else the layer id
        itself (a module path: how diffusers names it)."""
        if layer == FINAL and self.final_prefix:
            return self.final_prefix
        if isinstance(layer, int) and self.block_prefix:
            return self.block_prefix.format(i=layer)
        return str(layer)

    def tensor(self, layer: Layer, part: str) -> str:
        """The checkpoint name of ``layer``'s ``part`` (``"weight"`` or ``"bias"``)."""
        return f"{self.prefix(layer)}.{part}"

    def weight(self, layer: Layer) -> str:
        return self.tensor(layer, "weight")

    def bias(self, layer: Layer) -> str:
        return self.tensor(layer, "bias")

    def block_index(self, name: str) -> int | None:
        """The block index ``i`` if ``name`` is block ``i``'s projection weight in this layout, else None."""
        if not self.block_prefix:
            return None
        before, after = self.block_prefix.split("{i}")  # the names are written once; re caches the pattern
        match = re.fullmatch(re.escape(before) + r"(\d+)" + re.escape(after) + r"\.weight", name)
        return int(match.group(1)) if match else None

    def time_embedder_tensors(self) -> list[str]:
        """Weight and bias names of the time embedder's linears: first weight, first bias, second..."""
        return [f"{prefix}.{part}" for prefix in self.time_embedder for part in ("weight", "bias")]


@dataclass(frozen=True)
class ServedLayer:
    """One served projection. ``bias=False``: an ``nn.Linear(..., bias=False)``, with no bias tensor anywhere
    (checkpoint, model, digest, parking), projected as ``F.linear(x, w, None)`` as the resident module is."""

    id: Layer
    out_features: int
    input: str = "x"
    bias: bool = True

    @property
    def tensors(self) -> tuple[str, ...]:
        """The projection's tensor names, in ``nn.Linear``'s parameter order (``"weight"``, then ``"bias"`` if any)."""
        return ("weight", "bias") if self.bias else ("weight",)


@dataclass(frozen=True)
class TablePart:
    """A named run of columns ``[start, stop)`` of the table row, stored as ``(rows, *shape)``: ``tensor`` in a
    table file, ``name`` in a store entry's header (a family splits its row where other engines expect it)."""

    name: str
    tensor: str
    start: int
    stop: int
    shape: tuple[int, ...]


#: ``gather(part, select=None)``: a table part's rows of the slot being read (``select`` narrows the
#: part's ``[P + 1, W, *shape]`` view before the gather), as the cache reads rows.
Gather = Callable[..., "torch.Tensor"]


class RowSplit(Protocol):
    """How a family's table rows split into what its modules take (the cache's ``block*`` and ``final*``
    reads): which parts hold the blocks' and the output layer's rows; the cache only gathers a part's rows."""

    block_part: str
    final_part: str

    def block_rows(self, gather: Gather, layer: object) -> torch.Tensor: ...
    def block(self, rows: torch.Tensor, spec: Any) -> tuple[torch.Tensor, ...]: ...
    def block_all(self, gather: Gather, spec: Any) -> list[tuple[torch.Tensor, ...]]: ...
    def final_rows(self, gather: Gather) -> torch.Tensor: ...
    def final(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Schedule:
    """What a command's schedule flags name for one checkpoint: every forward's plan in step order
    (repeats kept), the schedule in words (``build``'s report), and what a table file records of it."""

    plans: list[torch.Tensor]
    described: str
    records: list[dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """One model family: what all its models share, and everything the core asks of a family (through the
    registry, or as ``spec.family``) instead of naming a model. Fields and methods: docs/api.md; how a
    family module fills them in: docs/adding-a-family.md. ``layouts`` are tried in order by detection (the
    first is what a cache without weights reports); ``model_embed`` (``"module:function"``) is loaded by name
    (:meth:`checkpoint_embed`), so the core imports nothing above it.
    """

    name: str
    title: str
    layouts: tuple[KeyLayout, ...]
    class_names: tuple[str, ...] = ()
    table_formats: tuple[str, ...] = ("adalncache",)
    table_tensors: tuple[str, ...] = (TABLE_ROWS,)
    model_variants: tuple[str, ...] = ()
    task_variants: tuple[tuple[str, str], ...] = ()
    rows: RowSplit | None = None
    arguments: tuple[Argument, ...] = ()
    plan_rows: str = "rows"
    demos: tuple[tuple[str, str], ...] = ()
    model_embed: str = ""

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ConfigError(f"family {self.name!r} declares no key layout")
        names = [layout.name for layout in self.layouts]
        if len(set(names)) != len(names):
            raise ConfigError(f"family {self.name!r} declares the key layout names {names} more than once")

    def layout(self, name: str) -> KeyLayout:
        """The layout called ``name``, or a ConfigError listing this family's layouts."""
        for layout in self.layouts:
            if layout.name == name:
                return layout
        raise ConfigError(
            f"unknown checkpoint layout {name!r}: set layout= (CLI {flag('layout')}) to one of "
            f"{sorted(layout.name for layout in self.layouts)} or 'auto'"
        )

    def variant_of(self, task: str) -> str | None:
        """The model variant serving ``task`` (None when the family names none)."""
        return dict(self.task_variants).get(task)

    # -- a model's geometry ------------------------------------------------------------------------

    def spec_fields(self, model: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The spec keywords of a transformer of this family (``ModulationSpec``'s, or ``for_geometry``'s for a
        family whose spec carries its geometry): its config, and the projections' dtype (``dtype`` when
        their weights are stored in another one). ConfigError for another model."""
        raise ConfigError(f"the {self.name} family reads no transformer")

    def projection_dtype(self, model: Any, first: Layer) -> torch.dtype:
        """The dtype of the model's projection of layer ``first`` (inside a peft LoRA wrapper, if any), where
        diffusers puts it; bfloat16 for a model without it (no blocks)."""
        try:
            linear = model.get_submodule(self.layout("diffusers").prefix(first))
        except AttributeError:
            return torch.bfloat16
        return getattr(linear, "base_layer", linear).weight.dtype

    def header_fields(
        self, path: object, entries: Mapping[str, Any], config: Mapping[str, Any], layout: str, modalities: int
    ) -> dict[str, Any]:
        """The spec keywords (as :meth:`spec_fields`) of a checkpoint from its safetensors header entries and
        its ``config.json`` (no tensor data); CheckpointError when its projections are missing or unusable."""
        raise ConfigError(f"the {self.name} family reads no checkpoint")

    # -- schedules -----------------------------------------------------------------------------------

    def schedule_name(self, spec: Any) -> str:
        """What messages call a checkpoint of ``spec`` (``a ... schedule``): the family's title by default."""
        return self.title

    def schedule_hint(self, spec: Any) -> str:
        """How the flags name a schedule of this family, for messages (``--task and --steps``)."""
        return ", ".join(argument.flag for argument in self.arguments)

    def schedule(self, values: Mapping[str, Any], *, spec: Any, source: Any, checkpoint: Any) -> Schedule:
        """The plans the schedule ``values`` (every argument of :attr:`arguments`, defaults applied) name for a
        checkpoint of ``spec`` opened as ``source``. A bad value is a ConfigError or PlanError naming its flag,
        raised here, before commands create a store or a file."""
        raise ConfigError(f"the {self.title} family names no schedule on the command line")

    # -- the projections' input without the model -----------------------------------------------------

    def upstream(self, spec: Any, layout: KeyLayout) -> tuple[str, ...]:
        """Checkpoint keys (as ``layout`` names them) of the tensors a table row depends on besides the
        projections (by default the layout's time embedder): their one declaration (docs/adding-a-family.md).
        Every layout lists them in the same order, so position names a tensor across layouts."""
        return tuple(layout.time_embedder_tensors())

    def upstream_names(self, spec: Any, layout: KeyLayout) -> dict[str, str]:
        """:meth:`upstream` keys of ``layout`` -> their diffusers parameter names, which the upstream digest
        hashes them under, so a native checkpoint and a model loaded from its conversion give one digest."""
        keys = self.upstream(spec, layout)
        diffusers = next((found for found in self.layouts if found.name == "diffusers"), layout)
        names = self.upstream(spec, diffusers)
        assert len(names) == len(keys), f"family {self.name!r}: layouts declare different upstream tensors"
        return dict(zip(keys, names))

    def missing_upstream(self, source: Any) -> list[str]:
        """The :meth:`upstream` tensors ``source``'s checkpoint lacks."""
        missing = []
        for name in self.upstream(source.spec, source.layout):
            try:
                source.entry(name)
            except KeyError:
                missing.append(name)
        return missing

    def checkpoint_embed(self, source: Any, spec: Any, device: Any = "cpu") -> Callable[[torch.Tensor], Any]:
        """``embed(plan)`` without the model in memory (``build``, ``export``, ``verify``): the projections' exact
        input from the checkpoint's :meth:`upstream` tensors; CheckpointError naming those it lacks."""
        missing = self.missing_upstream(source)
        if missing:
            raise CheckpointError(
                f"the checkpoint has no time-embedder weights ({', '.join(missing)} missing from "
                f"{', '.join(str(f) for f in source.files)}): build, export and verify compute the projections' "
                "input from them; pass the whole transformer checkpoint, not only its AdaLN projections"
            )
        if self.model_embed:
            module, _, function = self.model_embed.partition(":")
            embed: Callable[..., Callable[[torch.Tensor], Any]] = getattr(import_module(module), function)
            return embed(source, spec, device)
        return self.embed_from_checkpoint(source, spec, torch.device(device))

    def embed_from_checkpoint(self, source: Any, spec: Any, device: torch.device) -> Callable[[torch.Tensor], Any]:
        """:meth:`checkpoint_embed` of a family whose input the core computes itself."""
        raise ConfigError(f"the {self.title} family computes no projection input from a checkpoint")


def read_upstream(source: Any, name: str) -> torch.Tensor:
    """One upstream tensor as the file holds it: its address keeps the file offset's alignment, as
    the source keeps the projections', because an fp32 GEMV's bits depend on the weight's address."""
    header, entry = source.entry(name)
    if entry.torch_dtype not in SUPPORTED_WEIGHT_DTYPES:
        raise CheckpointError(f"{header.path}: tensor {name} has dtype {entry.dtype}, expected F32, BF16 or F16")
    return source.read_tensor(name)


# ---------------------------------------------------------------------------------------------
# the schedules of the flow-matching image pipelines (several families share them)

STEPS = Argument("steps", "the pipeline's num_inference_steps (repeatable)", Cli("int", 1), repeat=True)
HEIGHT = Argument(
    "height",
    "image height (repeatable; default 1024): the schedule is shifted by the image size",
    Cli("int", 1),
    None,
    True,
)
WIDTH = Argument("width", "image width (repeatable, one per height; default: the height)", Cli("int", 1), repeat=True)
TIMESTEPS = Argument(
    "timesteps", "explicit forward timesteps, comma-separated (the forward's timestep values)", Cli("text")
)
BATCH = Argument(
    "batch",
    "the forward's rows: images per forward (batch x num_images_per_prompt; 2 x images where the pipeline "
    "concatenates cond and uncond)",
    Cli("int", 1),
    default=1,
)
SCHEDULER_CONFIG = Argument(
    "scheduler_config",
    "the pipeline's scheduler_config.json (default: scheduler/ beside the transformer's directory, else the "
    "family's released scheduler config where it has one)",
    Cli("text"),
)

#: The default image size of a step count's schedule.
DEFAULT_SIZE = 1024


def numbers(argument: Argument, text: str) -> list[float]:
    """The comma-separated numbers of ``argument``, finite as the float32 a plan holds; ConfigError naming it,
    raised before the command creates a store's directory (the plan's own check would come after)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{argument.flag} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{argument.flag} is empty: pass the forward's values, e.g. {argument.flag} 0.999,0.5")
    return finite(argument, values)


def finite(argument: Argument, values: list[float]) -> list[float]:
    """``values`` if every one is finite as the float32 a plan holds, else ConfigError naming ``argument``."""
    if not bool(torch.tensor(values, dtype=torch.float32).isfinite().all()):
        raise ConfigError(f"{argument.flag} must be finite float32 values (|v| < 3.4e38), got {values}")
    return values


class ImageFamily(Family):
    """A family served through flow-matching image pipelines (docs/adding-a-family.md): a schedule is a step
    count at an image size, or the forward's timesteps. ``released_scheduler``: the config used when neither
    the flag nor ``scheduler/`` beside the checkpoint gives one (None: one must)."""

    released_scheduler: ClassVar[Mapping[str, Any] | None] = None

    def schedule_hint(self, spec: Any) -> str:
        return f"{STEPS.flag} N (with {HEIGHT.flag}/{WIDTH.flag}), or {TIMESTEPS.flag} t1,t2,..."

    def check_values(self, values: Mapping[str, Any], spec: Any) -> None:
        """Refuse the family's own flags that do not fit this checkpoint, before any schedule is computed."""

    def step_inputs(
        self, spec: Any, values: Mapping[str, Any], steps: int, size: tuple[int, int], config: Mapping[str, Any]
    ) -> list[dict[str, torch.Tensor]]:
        """The per-step inputs (by the forward's argument names) of each forward of ``steps`` at ``size``."""
        raise NotImplementedError

    def plans_of(
        self, forwards: list[dict[str, torch.Tensor]], values: Mapping[str, Any], spec: Any, source: Any
    ) -> list[torch.Tensor]:
        """The plans of these forwards (``timestep`` each, and what a step count computed besides)."""
        raise NotImplementedError

    def schedule(self, values: Mapping[str, Any], *, spec: Any, source: Any, checkpoint: Any) -> Schedule:
        steps, timesteps, batch = values["steps"], values["timesteps"], values["batch"]
        if timesteps is not None and steps:  # every family's plans take one or the other: never ignore one
            raise ConfigError(
                f"{TIMESTEPS.flag} and {STEPS.flag} both name the schedule (explicit timesteps, or the pipeline's "
                "schedule of N steps): pass one of them"
            )
        self.check_values(values, spec)
        extra = {name: values[name] for name in ("guidance", "timestep_r") if values.get(name) is not None}
        if timesteps is not None:
            forwards = [{TIMESTEP: torch.tensor([v] * batch)} for v in numbers(TIMESTEPS, timesteps)]
            records = [{"timesteps": timesteps, "batch": batch, **extra}]
            described = f"{len(forwards)} explicit timestep(s)"
        elif steps:
            config, released = self._scheduler_config(values, checkpoint)
            sizes = _sizes(values)
            forwards = [
                f for n in steps for z in sizes for f in self._step_inputs(spec, values, n, z, config, released)
            ]
            records = [{"steps": n, "height": h, "width": w, "batch": batch, **extra} for n in steps for h, w in sizes]
            described = f"steps {', '.join(map(str, steps))} at {', '.join(f'{h}x{w}' for h, w in sizes)}"
            if released:
                flag = SCHEDULER_CONFIG.flag
                described += f" (the released {self.title} scheduler config: no {flag}, no scheduler/ beside)"
        else:
            raise ConfigError(f"name a {self.schedule_name(spec)} schedule: {self.schedule_hint(spec)}")
        return Schedule(self.plans_of(forwards, values, spec, source), described, records)

    def _step_inputs(
        self,
        spec: Any,
        values: Mapping[str, Any],
        steps: int,
        size: tuple[int, int],
        config: Mapping[str, Any],
        released: bool,
    ) -> list[dict[str, torch.Tensor]]:
        """:meth:`step_inputs`, a bad config value or size (the formulas take them as they are: a string ``shift``
        raised a bare TypeError) or non-finite timesteps (a ``shift_terminal`` config divides 0 by 0 at one step)
        being one ConfigError naming the flags, before any store exists."""
        where = "the released scheduler config" if released else SCHEDULER_CONFIG.flag
        said = f"{STEPS.flag} {steps} at {HEIGHT.flag} {size[0]} {WIDTH.flag} {size[1]}"

        def compute(count: int) -> list[dict[str, torch.Tensor]]:
            try:
                return self.step_inputs(spec, values, count, size, config)
            except (TypeError, ValueError, OverflowError, KeyError, ZeroDivisionError) as exc:
                raise ConfigError(
                    f"the schedule for {said} cannot be computed from {where} ({type(exc).__name__}: {exc}): pass the "
                    f"pipeline's scheduler/scheduler_config.json and a size it runs, or {TIMESTEPS.flag}"
                ) from None

        def is_finite(forwards: list[dict[str, torch.Tensor]]) -> bool:
            return all(bool(t.float().isfinite().all()) for step in forwards for t in step.values())

        forwards = compute(steps)
        if is_finite(forwards):
            return forwards
        working = next((n for n in range(steps + 1, steps + 65) if is_finite(compute(n))), None)
        advice = "use another scheduler config"
        if working is not None:
            advice = f"use {STEPS.flag} {working} (the smallest step count above {steps} whose timesteps are finite)"
        raise ConfigError(
            f"the schedule for {said} has non-finite timesteps under {where} (its formula divides by zero at this "
            f"step count; the model would compute NaN from them): {advice}, or pass {TIMESTEPS.flag}"
        )

    def _scheduler_config(self, values: Mapping[str, Any], checkpoint: Any) -> tuple[dict[str, Any], bool]:
        """The pipeline's scheduler config, and whether it is :attr:`released_scheduler` (a copy of which is
        used when neither the flag nor ``scheduler/`` beside the transformer's directory gives one)."""
        if values["scheduler_config"] is not None:
            where = Path(values["scheduler_config"])
        else:
            path = Path(checkpoint[0] if isinstance(checkpoint, (list, tuple)) else checkpoint)
            where = (path if path.is_dir() else path.parent).parent / "scheduler"
            if self.released_scheduler is not None and not where.exists():
                return dict(self.released_scheduler), True
        if where.is_dir():
            where = where / "scheduler_config.json"
        try:
            config = json.loads(where.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{STEPS.flag} needs the pipeline's scheduler config to compute the schedule: {where} cannot be read "
                f"({type(exc).__name__}); pass {SCHEDULER_CONFIG.flag} PATH (the pipeline's "
                f"scheduler/scheduler_config.json), or {TIMESTEPS.flag}"
            ) from None
        if not isinstance(config, dict):
            raise ConfigError(f"{SCHEDULER_CONFIG.flag} {where} is not a JSON object")
        return config, False


def _sizes(values: Mapping[str, Any]) -> list[tuple[int, int]]:
    heights = values["height"] or [DEFAULT_SIZE]
    widths = values["width"] or heights
    if len(widths) != len(heights):
        raise ConfigError(f"{WIDTH.flag} is given {len(widths)} time(s) for {len(heights)} {HEIGHT.flag}: pair them")
    return list(zip(heights, widths))


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ModelGeometry:
    """The served layers of one model in pass order (the table row puts their outputs side by side in that
    order), the projections' input width, the plan's keying inputs (one column each) and the table row's
    named parts (none: one part, :data:`TABLE_PART`, the whole row)."""

    family: Family
    layers: tuple[ServedLayer, ...]
    in_features: int
    plan_inputs: tuple[str, ...] = (TIMESTEP,)
    parts: tuple[TablePart, ...] = ()
    _offsets: dict[Layer, int] = field(init=False, repr=False, compare=False, hash=False)
    _by_id: dict[Layer, ServedLayer] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.family, Family):
            raise ConfigError(f"ModelGeometry.family must be a Family, got {type(self.family).__name__}")
        if not self.layers:
            raise ConfigError("a geometry needs at least one served layer")
        if not _positive(self.in_features):
            raise ConfigError(f"ModelGeometry.in_features must be a positive integer, got {self.in_features!r}")
        offsets: dict[Layer, int] = {}
        by_id: dict[Layer, ServedLayer] = {}
        offset = 0
        for layer in self.layers:
            if not isinstance(layer, ServedLayer):
                raise ConfigError(f"ModelGeometry.layers must hold ServedLayer entries, got {type(layer).__name__}")
            if isinstance(layer.id, bool) or not isinstance(layer.id, (int, str)) or layer.id == "":
                raise ConfigError(f"a layer id must be a block index or a module path, got {layer.id!r}")
            if layer.id in by_id:
                raise ConfigError(f"layer {layer.id!r} appears twice in the geometry")
            if not _positive(layer.out_features):
                raise ConfigError(
                    f"layer {layer.id!r}: out_features must be a positive integer, got {layer.out_features!r}"
                )
            if not isinstance(layer.input, str) or not layer.input:
                raise ConfigError(f"layer {layer.id!r}: input must name the projection input, got {layer.input!r}")
            if not isinstance(layer.bias, bool):
                raise ConfigError(f"layer {layer.id!r}: bias must be True or False, got {layer.bias!r}")
            by_id[layer.id] = layer
            offsets[layer.id] = offset
            offset += layer.out_features
        if not self.plan_inputs or len(set(self.plan_inputs)) != len(self.plan_inputs):
            raise ConfigError(f"plan_inputs must be distinct names of the plan's inputs, got {self.plan_inputs!r}")
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_by_id", by_id)
        self._check_parts(offset)

    def _check_parts(self, width: int) -> None:
        parts = self.table_parts()
        start = 0
        for part in parts:
            if part.start != start or part.stop <= part.start or math.prod(part.shape) != part.stop - part.start:
                raise ConfigError(
                    f"table part {part.name!r} covers columns [{part.start}, {part.stop}) as {part.shape}: the parts "
                    f"must cover the row's {width} columns in order, each shape holding its columns exactly"
                )
            start = part.stop
        if start != width:
            raise ConfigError(f"the table parts cover {start} columns but must cover the layers' {width}")
        if len({p.name for p in parts}) != len(parts) or len({p.tensor for p in parts}) != len(parts):
            raise ConfigError(f"table part names must be distinct, got {[p.name for p in parts]}")
        if tuple(p.tensor for p in parts) != self.family.table_tensors:
            raise ConfigError(
                f"the table parts' tensors {[p.tensor for p in parts]} are not the {self.family.name} family's "
                f"{list(self.family.table_tensors)}"
            )

    @property
    def table_width(self) -> int:
        """Columns of one table row: every layer's output side by side."""
        last = self.layers[-1]
        return self._offsets[last.id] + last.out_features

    def table_parts(self) -> tuple[TablePart, ...]:
        """The row's parts in order; one whole-row part when the geometry declares none."""
        if self.parts:
            return self.parts
        width = sum(layer.out_features for layer in self.layers)
        return (TablePart(TABLE_PART, TABLE_ROWS, 0, width, (width,)),)

    def layer(self, layer: Layer) -> ServedLayer:
        """The served layer ``layer``, or a ConfigError naming the geometry's first and last layers."""
        try:
            return self._by_id[layer]
        except (KeyError, TypeError):
            first, last = self.layers[0].id, self.layers[-1].id
            raise ConfigError(
                f"{layer!r} is not a served layer of this {self.family.name} geometry ({len(self.layers)} layers, "
                f"{first!r} to {last!r})"
            ) from None

    def offset(self, layer: Layer) -> int:
        """The first column of ``layer``'s output in the table row."""
        self.layer(layer)
        return self._offsets[layer]

    def __contains__(self, layer: object) -> bool:
        try:
            return layer in self._by_id
        except TypeError:
            return False

    def inputs(self) -> tuple[str, ...]:
        """The names of the projection inputs, in the order the layers first take them."""
        return tuple(dict.fromkeys(layer.input for layer in self.layers))

    def describe(self) -> dict[str, object]:
        """A JSON-friendly identity. A layer without a bias adds ``false`` to its entry, one with a bias nothing,
        so a geometry whose layers all have one keeps the identity (and bindings) it had before."""
        return {
            "family": self.family.name,
            "layers": [
                [layer.id, layer.out_features, layer.input, *([] if layer.bias else [False])] for layer in self.layers
            ],
            "in_features": self.in_features,
            "plan_inputs": list(self.plan_inputs),
        }


__all__ = [
    "BATCH",
    "FINAL",
    "HEIGHT",
    "SCHEDULER_CONFIG",
    "STEPS",
    "SUPPORTED_WEIGHT_DTYPES",
    "TABLE_PART",
    "TABLE_ROWS",
    "TIMESTEP",
    "TIMESTEPS",
    "WIDTH",
    "Family",
    "Gather",
    "ImageFamily",
    "KeyLayout",
    "Layer",
    "ModelGeometry",
    "RowSplit",
    "Schedule",
    "ServedLayer",
    "TablePart",
    "finite",
    "numbers",
    "read_upstream",
]
