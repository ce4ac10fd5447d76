"""Model geometry and checkpoint key layouts, as one :class:`ModulationSpec` per cache.

A spec is a :class:`~adalncache.geometry.ModelGeometry` and a dtype; the core reads only its
family-neutral members (docs/api.md, "ModulationSpec"). The fields ``num_layers``, ``hidden_size``,
``time_embed_dim`` and ``modalities`` describe the default family's geometry; a spec of another
family carries its ``geometry`` (built by :mod:`adalncache.families`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import families
from .errors import CheckpointError, ConfigError
from .families import minimax_h3 as _default
from .geometry import FINAL, SUPPORTED_WEIGHT_DTYPES, Family, KeyLayout, Layer, ModelGeometry, ServedLayer, TablePart

if TYPE_CHECKING:
    from torch import nn

#: The default family's two checkpoint layouts (native and diffusers names), by name.
LAYOUTS: dict[str, KeyLayout] = _default.LAYOUTS


def get_layout(name: str) -> KeyLayout:
    """The default family's layout called ``name``, or a ConfigError listing the valid ones."""
    return _default.FAMILY.layout(name)


@dataclass(frozen=True)
class ModulationSpec:
    """Geometry and dtype of the AdaLN projections a cache serves. The slab stores outputs in ``dtype`` (the
    weights') because the resident ``linear`` returns it, so serving needs no cast. ``geometry``: ``None``
    for the default family's, derived from the fields."""

    num_layers: int
    hidden_size: int
    time_embed_dim: int
    modalities: int = 3
    dtype: torch.dtype = torch.bfloat16
    geometry: ModelGeometry | None = None
    _geometry: ModelGeometry = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "time_embed_dim", "modalities"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModulationSpec.{name} must be a positive integer, got {value!r}")
        if self.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise ConfigError(
                f"ModulationSpec.dtype must be one of bfloat16, float16, float32 (the projection weights' "
                f"dtype), got {self.dtype}"
            )
        geometry = self.geometry
        if geometry is None:
            geometry = _default.geometry(self.num_layers, self.hidden_size, self.time_embed_dim, self.modalities)
        elif not isinstance(geometry, ModelGeometry):
            raise ConfigError(f"ModulationSpec.geometry must be a ModelGeometry or None, got {type(geometry).__name__}")
        elif geometry.in_features != self.time_embed_dim:
            raise ConfigError(
                f"ModulationSpec.time_embed_dim ({self.time_embed_dim}) must equal the geometry's in_features "
                f"({geometry.in_features}): both are the projections' input width"
            )
        object.__setattr__(self, "_geometry", geometry)

    def __repr__(self) -> str:
        fields = (
            f"num_layers={self.num_layers}, hidden_size={self.hidden_size}, time_embed_dim={self.time_embed_dim}, "
            f"modalities={self.modalities}, dtype={self.dtype}"
        )
        if self.geometry is None:
            return f"ModulationSpec({fields})"
        g = self.geometry
        return f"ModulationSpec({fields}, geometry={g.family.name}: {len(g.layers)} layers, {g.table_width} columns)"

    @classmethod
    def for_geometry(
        cls,
        geometry: ModelGeometry,
        *,
        dtype: torch.dtype = torch.bfloat16,
        num_layers: int | None = None,
        hidden_size: int | None = None,
    ) -> ModulationSpec:
        """The spec of ``geometry`` in ``dtype``; ``num_layers`` (default: the served layers) and ``hidden_size``
        (default: the input width) only describe the model."""
        return cls(
            num_layers=num_layers if num_layers is not None else len(geometry.layers),
            hidden_size=hidden_size if hidden_size is not None else geometry.in_features,
            time_embed_dim=geometry.in_features,
            dtype=dtype,
            geometry=geometry,
        )

    @classmethod
    def _of(cls, fields: dict[str, Any]) -> ModulationSpec:
        """The spec of a family's keywords: :meth:`for_geometry`'s where its spec carries its geometry."""
        return cls.for_geometry(**fields) if "geometry" in fields else cls(**fields)

    # -- the family-neutral members the core reads (the geometry's, documented there) ----------

    @property
    def family(self) -> Family:
        """The model family: its name, key layouts and table formats."""
        return self._geometry.family

    @property
    def model_geometry(self) -> ModelGeometry:
        """The served layers, table parts and plan inputs (derived for the default family)."""
        return self._geometry

    def layers(self) -> list[Layer]:
        """Every served projection, in the order a pass reads them and a table row holds them."""
        return [layer.id for layer in self._geometry.layers]

    def served_layer(self, layer: Layer) -> ServedLayer:
        """``layer``'s width and input (ConfigError for a layer this spec does not serve)."""
        return self._geometry.layer(layer)

    def tensors_of(self, layer: Layer) -> tuple[str, ...]:
        """The projection tensors ``layer`` has: ``("weight", "bias")``, or ``("weight",)`` without a bias."""
        return self._geometry.layer(layer).tensors

    def has_bias(self, layer: Layer) -> bool:
        return self._geometry.layer(layer).bias

    def has_layer(self, layer: object) -> bool:
        return layer in self._geometry

    def out_features(self, layer: Layer) -> int:
        return self._geometry.layer(layer).out_features

    def input_of(self, layer: Layer) -> str:
        """The name of the projection input ``layer`` takes (a key of a mapping ``embed`` returns)."""
        return self._geometry.layer(layer).input

    @property
    def inputs(self) -> tuple[str, ...]:
        return self._geometry.inputs()

    @property
    def in_features(self) -> int:
        return self.time_embed_dim

    def offset(self, layer: Layer) -> int:
        return self._geometry.offset(layer)

    @property
    def table_width(self) -> int:
        return self._geometry.table_width

    def table_parts(self) -> tuple[TablePart, ...]:
        return self._geometry.table_parts()

    @property
    def plan_inputs(self) -> tuple[str, ...]:
        """The per-step inputs that key a plan, one plan column each, in order."""
        return self._geometry.plan_inputs

    @property
    def plan_columns(self) -> int:
        """Columns of a plan: 1 (a 1-D plan of timesteps) or the number of keying inputs (an ``(n, C)`` plan)."""
        return len(self._geometry.plan_inputs)

    def plan_rows(self, key: Sequence[int]) -> int:
        """Rows of the plan whose key is ``key`` (a key holds ``rows * plan_columns`` bit patterns)."""
        return len(key) // self.plan_columns

    def layouts(self) -> dict[str, KeyLayout]:
        """The family's checkpoint layouts by name, in detection order."""
        return {layout.name: layout for layout in self.family.layouts}

    def layout(self, name: str) -> KeyLayout:
        """The family's layout called ``name``, or a ConfigError listing the valid ones."""
        return self.family.layout(name)

    @property
    def default_layout(self) -> KeyLayout:
        """The layout a cache without weights reports (the family's first)."""
        return self.family.layouts[0]

    # -- the default family's members --------------------------------------------------------

    def _default_only(self, name: str) -> None:
        if self.geometry is not None:
            raise ConfigError(
                f"ModulationSpec.{name} describes the {_default.FAMILY.title} geometry; this spec is a "
                f"{self.family.title} one: use spec.out_features(layer) and spec.layers()"
            )

    @property
    def block_width(self) -> int:
        """Output features of one block projection: 6 parameters x modalities x hidden."""
        self._default_only("block_width")
        return _default.block_width(self.hidden_size, self.modalities)

    @property
    def final_width(self) -> int:
        """Output features of the output-layer projection: shift and scale."""
        self._default_only("final_width")
        return _default.final_width(self.hidden_size)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one plan row's table: every served layer's output."""
        return self.table_width * self.itemsize

    def weight_shape(self, layer: Layer) -> tuple[int, int]:
        return (self.out_features(layer), self.in_features)

    def layer_bytes(self, layer: Layer) -> int:
        """Bytes of one projection's weight and bias (if it has one) in ``dtype``."""
        out = self.out_features(layer)
        return (out * self.in_features + (out if self.has_bias(layer) else 0)) * self.itemsize

    @property
    def projection_bytes(self) -> int:
        """Bytes of every projection weight and bias: what the cache keeps off the device."""
        return sum(self.layer_bytes(layer) for layer in self.layers())

    def slab_bytes(self, max_plans: int, max_plan_width: int) -> int:
        """Device bytes of a slab of ``max_plans`` x ``max_plan_width`` plan rows (all buffers, and the
        poison slot's table rows: one slot more than ``max_plans``)."""
        rows = max_plans * max_plan_width
        return (rows + max_plan_width) * self.row_bytes + rows * 4 * self.plan_columns + max_plans * 8

    def with_dtype(self, dtype: torch.dtype) -> ModulationSpec:
        return replace(self, dtype=dtype)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly identity of the geometry (stores and table files bind entries to it)."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.geometry is None:
            fields = _default.describe(self.num_layers, self.hidden_size, self.time_embed_dim, self.modalities)
            return {**fields, "dtype": dtype}
        return {**self.geometry.describe(), "dtype": dtype}

    # -- presets and readers -------------------------------------------------------------------

    @classmethod
    def minimax_h3(cls, **overrides: Any) -> ModulationSpec:
        """The released geometry of the family this preset is named for; ``overrides`` replace any field."""
        return cls(**{**_default.RELEASED, **overrides})

    @classmethod
    def from_transformer(cls, model: nn.Module, *, dtype: torch.dtype | None = None) -> ModulationSpec:
        """Read the geometry of a diffusers transformer of a supported family; ``dtype``: the projections' output
        dtype when their weights are stored in another one. A prompt-dependent class is refused (ConfigError)."""
        name = type(model).__name__
        if name in families.REFUSED:
            families.for_class(name)  # raises the ConfigError naming the reason
        family = families.of_class(name) or families.DEFAULT
        return cls._of(family.spec_fields(model, dtype))

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        layout: str = "auto",
        modalities: int = 3,
    ) -> ModulationSpec:
        """Read the projection geometry from a checkpoint's safetensors headers alone; the family from the
        ``_class_name`` of a ``config.json`` beside the weights, else the default. CheckpointError when no
        layout's projections are there or the first is unusable, ConfigError for a refused or unknown class."""
        # Deferred, and from the source module that imports no spec: the rest of the source package is
        # built on this module (it validates checkpoints against a spec).
        from .source.files import SafetensorsHeader, checkpoint_files

        config = _config(path)
        class_name = config.get("_class_name")
        # Refused and unknown classes raise; a checkpoint without config.json is the default family's.
        family = families.for_class(class_name) if isinstance(class_name, str) else families.DEFAULT
        if layout != "auto":
            family.layout(layout)  # raises the ConfigError that lists the family's layouts
        files, _ = checkpoint_files(path)
        entries: dict[str, Any] = {}
        for file in files:
            entries.update(SafetensorsHeader.read(file).entries)
        try:
            return cls._of(family.header_fields(path, entries, config, layout, modalities))
        except ConfigError as exc:
            raise CheckpointError(f"{path}: unusable projection geometry: {exc}") from None


def _config(path: object) -> dict[str, Any]:
    """The ``config.json`` in ``path`` (a directory) or beside it (a file, or the first of a list); ``{}`` if none."""
    if isinstance(path, (list, tuple)) and path:
        path = path[0]
    if not isinstance(path, (str, os.PathLike)):
        return {}
    where = Path(path)
    config = (where if where.is_dir() else where.parent) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


__all__ = [
    "FINAL",
    "LAYOUTS",
    "SUPPORTED_WEIGHT_DTYPES",
    "KeyLayout",
    "Layer",
    "ModelGeometry",
    "ModulationSpec",
    "ServedLayer",
    "TablePart",
    "get_layout",
]
