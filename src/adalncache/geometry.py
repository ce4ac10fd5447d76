"""The family-neutral description of what a cache serves: projections, their table columns, plans, layouts.

Why this module exists: the slot pool, slab, rebuild pass, tiers, store, table files and rank
agreement must work for any model whose AdaLN modulation depends on per-step scalars only. What
they need to know about a model is small and the same for every family:

* the **served layers**, in pass order: each one projection (one weight ``(out, in)`` and, unless
  the layer declares none, one bias ``(out,)``), with its output width and the name of the input
  it takes (a family may feed two projections differently cast or differently many rows of the
  same embedding);
* the **table**: one row of a plan holds every layer's output side by side, each layer owning the
  columns ``[offset, offset + width)`` in pass order; a family may split that row into named
  *parts* (a table file tensor each), where other engines expect its tables in that shape;
* the **plan**: which per-step inputs key a table (``plan_inputs``; one column per input);
* the **key layouts**: how a checkpoint names each layer's tensors.

:class:`ModelGeometry` holds exactly that; :class:`Family` holds what is shared by every model of
one family (its layouts, the table formats it can be written in). Families are defined in
:mod:`adalncache.families`; :class:`~adalncache.spec.ModulationSpec` wraps a geometry with the
dtype. Nothing here names a model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .errors import ConfigError
from .options import flag

if TYPE_CHECKING:
    import torch

#: A served layer: a block index, ``"final"`` (the output layer of a family that numbers its
#: blocks), or the projection's module path (``"transformer_blocks.3.norm1.linear"``).
Layer = int | str

FINAL: Literal["final"] = "final"

#: The name of the one table part of a geometry that declares none (the whole row).
TABLE_PART = "table"
#: Its tensor in a table file: ``table_rows [P, W, table_width]``.
TABLE_ROWS = "table_rows"
#: The plan input of a family keyed by the timestep alone.
TIMESTEP = "timestep"


@dataclass(frozen=True)
class KeyLayout:
    """Tensor names of one checkpoint layout.

    A layer's tensors are ``<prefix>.weight`` and ``<prefix>.bias``. For a block index ``i`` the
    prefix is ``block_prefix`` formatted with ``i``; for :data:`FINAL` it is ``final_prefix``; for
    any other layer (a module path) it is the layer id itself, which is how diffusers names it.
    ``time_embedder`` holds the module paths of the time embedder's linears, whose weights build
    the projections' input when only a checkpoint is at hand.
    """

    name: str
    block_prefix: str = ""
    final_prefix: str = ""
    time_embedder: tuple[str, ...] = ()

    def prefix(self, layer: Layer) -> str:
        """The module path holding ``weight`` and ``bias`` for ``layer``."""
        if layer == FINAL and self.final_prefix:
            return self.final_prefix
        if isinstance(layer, int) and self.block_prefix:
            return self.block_prefix.format(i=layer)
        return str(layer)

    def weight(self, layer: Layer) -> str:
        return self.prefix(layer) + ".weight"

    def bias(self, layer: Layer) -> str:
        return self.prefix(layer) + ".bias"

    def block_index(self, name: str) -> int | None:
        """The block index ``i`` if ``name`` is block ``i``'s projection weight in this layout, else None."""
        if not self.block_prefix:
            return None
        match = self._block_weight_pattern().fullmatch(name)
        return int(match.group(1)) if match else None

    def _block_weight_pattern(self) -> re.Pattern[str]:
        # Derived from block_prefix so the names are written once; re caches compiled patterns.
        before, after = self.block_prefix.split("{i}")
        return re.compile(re.escape(before) + r"(\d+)" + re.escape(after) + r"\.weight")

    def time_embedder_tensors(self) -> list[str]:
        """Weight and bias names of the time embedder's linears: first weight, first bias, second..."""
        return [f"{prefix}.{part}" for prefix in self.time_embedder for part in ("weight", "bias")]


#: The tensors of a projection with a bias, in ``nn.Linear``'s parameter order.
WITH_BIAS: tuple[str, ...] = ("weight", "bias")
#: The tensors of a projection without one (``nn.Linear(..., bias=False)``).
WITHOUT_BIAS: tuple[str, ...] = ("weight",)


@dataclass(frozen=True)
class ServedLayer:
    """One served projection: its layer id, output width, the name of the input it takes, and whether it has a bias.

    ``bias=False`` is a projection built ``nn.Linear(..., bias=False)``: it has no bias tensor
    anywhere (checkpoint, model, digest, parking), and it is projected as ``F.linear(x, w, None)``,
    which is what the resident module computes.
    """

    id: Layer
    out_features: int
    input: str = "x"
    bias: bool = True

    @property
    def tensors(self) -> tuple[str, ...]:
        """The projection's tensor names (``"weight"``, then ``"bias"`` if it has one)."""
        return WITH_BIAS if self.bias else WITHOUT_BIAS


@dataclass(frozen=True)
class TablePart:
    """A named run of columns ``[start, stop)`` of the table row, stored as ``(rows, *shape)``.

    ``tensor`` is the part's name in a table file (``[P, W, *shape]``); ``name`` its name in a
    store entry's header and in :class:`~adalncache.slab.PlanRows` (whose tensors are the parts in
    order).
    """

    name: str
    tensor: str
    start: int
    stop: int
    shape: tuple[int, ...]


#: ``gather(part, select=None)``: a table part's rows of the slot being read (``select`` narrows the
#: part's ``[P + 1, W, *shape]`` view before the gather), as the cache reads rows.
Gather = Callable[..., "torch.Tensor"]


class RowSplit(Protocol):
    """How a family's table rows split into what its modules take, for the cache's ``block_rows``,
    ``block``, ``block_all``, ``final_rows``, ``final``, ``block_params`` and ``final_params``: which
    table part holds the blocks' rows and which the output layer's, and how a row splits. The cache
    only gathers a part's rows; a family whose table is read by layer declares none."""

    block_part: str
    final_part: str

    def block_rows(self, gather: Gather, layer: object) -> torch.Tensor: ...

    def block(self, rows: torch.Tensor, spec: Any) -> tuple[torch.Tensor, ...]: ...

    def block_all(self, gather: Gather, spec: Any) -> list[tuple[torch.Tensor, ...]]: ...

    def final_rows(self, gather: Gather) -> torch.Tensor: ...

    def final(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Family:
    """What every model of one family shares: its name, key layouts, and the table formats it supports.

    ``layouts`` are tried in order by layout detection (``layout="auto"``); the first is the one a
    cache without weights reports. ``table_formats`` are the table-file formats the family's tables
    can be written in (``"adalncache"``, the bound format, always); ``model_variants`` the values a
    table file's ``model_variant`` may take and ``task_variants`` which of them serves each task,
    where another engine reads that field. ``class_names``: the diffusers transformer classes of
    the family (``_class_name`` in a checkpoint's ``config.json``). ``rows``: its :class:`RowSplit`,
    where its modules take the modulation as parts of a row rather than by layer.
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


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ModelGeometry:
    """The served layers of one model, its table columns, its plan inputs, and its family.

    ``layers`` in pass order; the table row puts their outputs side by side in that order.
    ``in_features``: the projections' input width. ``plan_inputs``: the per-step inputs that key
    a plan, one plan column each, in this order. ``parts``: the table row's named parts (none:
    one part, :data:`TABLE_PART`, the whole row).
    """

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
        """A JSON-friendly identity: family, layers with widths and inputs, input width, plan inputs.

        A layer without a bias adds ``false`` to its entry; a layer with one adds nothing, so the
        identity (and every digest and binding made from it) of a geometry whose layers all have a
        bias is what it was before layers could lack one.
        """
        return {
            "family": self.family.name,
            "layers": [
                [layer.id, layer.out_features, layer.input, *([] if layer.bias else [False])] for layer in self.layers
            ],
            "in_features": self.in_features,
            "plan_inputs": list(self.plan_inputs),
        }


__all__ = [
    "FINAL",
    "TABLE_PART",
    "TABLE_ROWS",
    "TIMESTEP",
    "WITHOUT_BIAS",
    "WITH_BIAS",
    "Family",
    "Gather",
    "KeyLayout",
    "Layer",
    "ModelGeometry",
    "RowSplit",
    "ServedLayer",
    "TablePart",
]
