"""What the AdaLN cache takes off the device for each supported class: served bytes and share, on meta.

The README's table of supported models is computed here, not typed in: each class is instantiated
on the meta device (no memory, no download) with its class-default config (the released sizes) or
the overrides given, its served projections are read by the cache's own geometry
(``ModulationSpec.from_transformer``), and their bytes are counted against the whole model's, in
bf16 (two bytes a parameter).

Run ``python tests/family_sizes.py`` for the markdown table.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from adalncache import ModulationSpec
from adalncache.families import adaln_zero

#: The classes of the other families, whose class defaults are the released sizes.
OTHER_FAMILIES = ("MiniMaxH3Transformer3DModel", "QwenImageTransformer2DModel")

#: Configs other than the class defaults, where a released model differs from them (sizes only).
RELEASED: dict[str, tuple[str, dict[str, Any]]] = {
    "BriaFiboTransformer2DModel": ("released Bria-FIBO: 8 double blocks", {"num_layers": 8}),
}


@dataclass(frozen=True)
class Sizes:
    """Served and total parameter bytes of one model (bf16), and which config they were counted with."""

    class_name: str
    config: str
    served_layers: int
    served_bytes: int
    total_bytes: int

    @property
    def share(self) -> float:
        return self.served_bytes / self.total_bytes


def measure(class_name: str, overrides: Mapping[str, Any] | None = None, label: str = "class defaults") -> Sizes:
    """The served and total bf16 bytes of ``class_name`` built on the meta device with ``overrides``."""
    import diffusers

    cls = getattr(diffusers, class_name)
    with torch.device("meta"):
        model = cls(**dict(overrides or {}))
    spec = ModulationSpec.from_transformer(model, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    return Sizes(class_name, label, len(spec.layers()), spec.projection_bytes, 2 * total)


def table() -> list[Sizes]:
    """Every supported class at its class defaults, plus the released configs of :data:`RELEASED`."""
    rows = []
    for name in (*OTHER_FAMILIES, *adaln_zero.CLASSES):
        rows.append(measure(name))
        if name in RELEASED:
            label, overrides = RELEASED[name]
            rows.append(measure(name, overrides, label))
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the table as markdown."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print("| class | config | served layers | served (bf16) | share of the model |")
    print("|---|---|---|---|---|")
    for row in table():
        gib = row.served_bytes / 2**30
        print(f"| `{row.class_name}` | {row.config} | {row.served_layers} | {gib:.2f} GiB | {row.share:.1%} |")


if __name__ == "__main__":
    main()
