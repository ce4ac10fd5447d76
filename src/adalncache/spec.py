"""Model geometry and checkpoint key layouts.

A :class:`ModulationSpec` is everything the cache needs to know about a model: how many AdaLN
projections there are and how wide they are. Key layouts map a layer index to the tensor names
of the native MiniMax release and of diffusers (the two hold the same rows in the same order:
only the names differ), and name the time embedder whose output the projections take.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
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
    """Tensor names of one checkpoint layout.

    ``block_prefix`` is a format string taking the block index ``i``; ``time_embedder`` holds the
    module paths of the time embedder's two linears (first, second), whose weights build the
    projections' input when only a checkpoint is at hand.
    """

    name: str
    block_prefix: str
    final_prefix: str
    time_embedder: tuple[str, str]

    def prefix(self, layer: Layer) -> str:
        """The module path holding ``weight`` and ``bias`` for ``layer``."""
        return self.final_prefix if layer == FINAL else self.block_prefix.format(i=layer)

    def weight(self, layer: Layer) -> str:
        return self.prefix(layer) + ".weight"

    def bias(self, layer: Layer) -> str:
        return self.prefix(layer) + ".bias"

    def block_index(self, name: str) -> int | None:
        """The block index ``i`` if ``name`` is block ``i``'s projection weight in this layout, else None."""
        match = self._block_weight_pattern().fullmatch(name)
        return int(match.group(1)) if match else None

    def _block_weight_pattern(self) -> re.Pattern[str]:
        # Derived from block_prefix so the names are written once; re caches compiled patterns.
        before, after = self.block_prefix.split("{i}")
        return re.compile(re.escape(before) + r"(\d+)" + re.escape(after) + r"\.weight")

    def time_embedder_tensors(self) -> list[str]:
        """Weight and bias names of the time embedder's two linears: first weight, first bias, second..."""
        return [f"{prefix}.{part}" for prefix in self.time_embedder for part in ("weight", "bias")]


LAYOUTS: dict[str, KeyLayout] = {
    "native": KeyLayout(
        "native", "blocks.{i}.adaln_proj.linear", "final_layer.adaln_proj.linear",
        ("time_embedder.proj_in", "time_embedder.proj_out"),
    ),
    "diffusers": KeyLayout(
        "diffusers", "transformer_blocks.{i}.adaln_proj.linear", "norm_out.linear",
        ("time_embedder.linear_1", "time_embedder.linear_2"),
    ),
}  # fmt: skip


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
    def from_transformer(cls, model: nn.Module, *, dtype: torch.dtype | None = None) -> ModulationSpec:
        """Read the geometry of a diffusers ``MiniMaxH3Transformer3DModel`` (config plus weight dtype).

        ``dtype``: the projections' output dtype when their weights are stored in another one
        (quantized, or kept in fp8 by layerwise casting); by default block 0's weight dtype.
        """
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
        if dtype is not None:
            return cls(num_layers=num_layers, hidden_size=hidden_size, time_embed_dim=time_embed_dim, dtype=dtype)
        dtype = torch.bfloat16
        blocks = getattr(model, "transformer_blocks", None)
        if blocks is not None and len(blocks) > 0:
            linear = blocks[0].adaln_proj.linear
            base = getattr(linear, "base_layer", linear)  # a peft LoRA wrapper keeps the Linear inside
            dtype = base.weight.dtype
        return cls(num_layers=num_layers, hidden_size=hidden_size, time_embed_dim=time_embed_dim, dtype=dtype)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        layout: str = "auto",
        modalities: int = 3,
    ) -> ModulationSpec:
        """Read the projection geometry from a checkpoint's safetensors headers alone (no tensor data).

        ``path`` is what ``CheckpointSource`` takes (a file, a directory, a list of files). Blocks
        are counted from ``0`` up to the first missing index; block 0's projection gives the
        hidden size (``6 * modalities * hidden`` outputs), its input width the time-embedding
        size, its dtype the spec's dtype. ``CheckpointSource`` then validates every tensor against
        the result. Raises CheckpointError when no layout's projections are there or block 0's
        is unusable.
        """
        # Deferred, and from the two source modules that import no spec: the rest of the source
        # package is built on this module (it validates checkpoints against a spec).
        from .errors import CheckpointError
        from .source.files import checkpoint_files
        from .source.header import SafetensorsHeader

        if layout not in ("auto", *LAYOUTS):
            get_layout(layout)  # raises the ConfigError that lists the layouts
        files, _ = checkpoint_files(path)
        entries: dict[str, Any] = {}
        for file in files:
            entries.update(SafetensorsHeader.read(file).entries)
        candidates = [LAYOUTS[layout]] if layout != "auto" else list(LAYOUTS.values())
        for key_layout in candidates:
            indices = {index for name in entries if (index := key_layout.block_index(name)) is not None}
            if not indices:
                continue
            count = 0
            while count in indices:
                count += 1
            first = entries.get(key_layout.weight(0))
            if first is None or len(first.shape) != 2 or first.torch_dtype is None:
                raise CheckpointError(f"{path}: block 0's AdaLN projection weight is missing or malformed")
            out, k = first.shape
            if out % (6 * modalities):
                raise CheckpointError(
                    f"{path}: block 0's AdaLN projection has {out} outputs, not a multiple of 6 x {modalities} "
                    f"modalities; this is not a MiniMax-H3 checkpoint"
                )
            try:
                return cls(
                    num_layers=count, hidden_size=out // (6 * modalities), time_embed_dim=k,
                    modalities=modalities, dtype=first.torch_dtype,
                )  # fmt: skip
            except ConfigError as exc:
                raise CheckpointError(f"{path}: unusable projection geometry: {exc}") from None
        raise CheckpointError(
            f"{path} holds no AdaLN projection in a known layout (looked for {LAYOUTS['native'].weight(0)!r} "
            f"and {LAYOUTS['diffusers'].weight(0)!r}): pass a MiniMax-H3 transformer checkpoint, or set --layout"
        )


__all__ = ["FINAL", "LAYOUTS", "KeyLayout", "Layer", "ModulationSpec", "get_layout"]
