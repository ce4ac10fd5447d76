"""Model geometry and checkpoint key layouts.

A :class:`ModulationSpec` is everything the cache needs to know about a model: how many AdaLN
projections there are and how wide they are. Key layouts map a layer index to the tensor names
of the native MiniMax release and of diffusers (REFERENCE.md section 5: no row permutation
between them, only the names differ).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

#: A layer of the projection stack: a block index, or ``"final"`` for the output layer.
Layer = int | Literal["final"]

FINAL: Literal["final"] = "final"

SUPPORTED_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class KeyLayout:
    """Tensor names of one checkpoint layout (format strings taking the block index ``i``)."""

    name: str
    block_prefix: str
    final_prefix: str

    def prefix(self, layer: Layer) -> str:
        """The module path holding ``weight`` and ``bias`` for ``layer``."""
        return self.final_prefix if layer == FINAL else self.block_prefix.format(i=layer)

    def weight(self, layer: Layer) -> str:
        return self.prefix(layer) + ".weight"

    def bias(self, layer: Layer) -> str:
        return self.prefix(layer) + ".bias"


LAYOUTS: dict[str, KeyLayout] = {
    "native": KeyLayout("native", "blocks.{i}.adaln_proj.linear", "final_layer.adaln_proj.linear"),
    "diffusers": KeyLayout("diffusers", "transformer_blocks.{i}.adaln_proj.linear", "norm_out.linear"),
}


def get_layout(name: str) -> KeyLayout:
    """Return the layout called ``name`` or raise a ConfigError listing the valid ones."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ConfigError(
            f"unknown checkpoint layout {name!r}: set layout= (CLI --layout) to one of {sorted(LAYOUTS)} or 'auto'"
        ) from None


@dataclass(frozen=True)
class ModulationSpec:
    """Geometry of the AdaLN projections of a MiniMax-H3-like transformer.

    ``dtype`` is the projection weights' dtype; the slab stores outputs in it because that is the
    dtype the resident ``linear`` returns, so serving from the slab needs no cast.
    """

    num_layers: int
    hidden_size: int
    time_embed_dim: int
    modalities: int = 3
    dtype: torch.dtype = torch.bfloat16

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

    @property
    def block_width(self) -> int:
        """Output features of one block projection: 6 parameters x modalities x hidden."""
        return 6 * self.modalities * self.hidden_size

    @property
    def final_width(self) -> int:
        """Output features of the output-layer projection: shift and scale."""
        return 2 * self.hidden_size

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one timestep's table row: every block plus the output layer."""
        return (self.num_layers * self.block_width + self.final_width) * self.itemsize

    def layers(self) -> list[Layer]:
        """Every projection, in the order a pass reads them (blocks first, then the output layer)."""
        return [*range(self.num_layers), FINAL]

    def out_features(self, layer: Layer) -> int:
        return self.final_width if layer == FINAL else self.block_width

    def weight_shape(self, layer: Layer) -> tuple[int, int]:
        return (self.out_features(layer), self.time_embed_dim)

    def layer_bytes(self, layer: Layer) -> int:
        """Bytes of one projection's weight and bias in ``dtype``."""
        out = self.out_features(layer)
        return (out * self.time_embed_dim + out) * self.itemsize

    @property
    def projection_bytes(self) -> int:
        """Bytes of every projection weight and bias: what the cache keeps off the device."""
        return sum(self.layer_bytes(layer) for layer in self.layers())

    def slab_bytes(self, max_plans: int, max_plan_width: int) -> int:
        """Device bytes of a slab of ``max_plans`` x ``max_plan_width`` timestep rows (all buffers)."""
        rows = max_plans * max_plan_width
        return rows * self.row_bytes + rows * 4 + max_plans * 8

    def with_dtype(self, dtype: torch.dtype) -> ModulationSpec:
        return replace(self, dtype=dtype)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly identity of the geometry (stores bind entries to it)."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "time_embed_dim": self.time_embed_dim,
            "modalities": self.modalities,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def minimax_h3(cls, **overrides: Any) -> ModulationSpec:
        """The released MiniMax-H3 geometry: 50 blocks, hidden 5376, time embedding 2688, bf16."""
        fields: dict[str, Any] = {"num_layers": 50, "hidden_size": 5376, "time_embed_dim": 2688}
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_transformer(cls, model: nn.Module) -> ModulationSpec:
        """Read the geometry of a diffusers ``MiniMaxH3Transformer3DModel`` (config plus weight dtype)."""
        config = getattr(model, "config", None)
        try:
            num_layers = int(config.num_layers)  # type: ignore[union-attr]
            hidden_size = int(config.hidden_size)  # type: ignore[union-attr]
            time_embed_dim = int(config.time_embed_dim)  # type: ignore[union-attr]
        except AttributeError:
            raise ConfigError(
                f"ModulationSpec.from_transformer needs a MiniMaxH3Transformer3DModel (a config with "
                f"num_layers, hidden_size and time_embed_dim), got {type(model).__name__}"
            ) from None
        dtype = torch.bfloat16
        blocks = getattr(model, "transformer_blocks", None)
        if blocks is not None and len(blocks) > 0:
            linear = blocks[0].adaln_proj.linear
            base = getattr(linear, "base_layer", linear)  # a peft LoRA wrapper keeps the Linear inside
            dtype = base.weight.dtype
        return cls(num_layers=num_layers, hidden_size=hidden_size, time_embed_dim=time_embed_dim, dtype=dtype)


__all__ = ["FINAL", "LAYOUTS", "KeyLayout", "Layer", "ModulationSpec", "get_layout"]
