"""Which projection tensors a spec needs, in which key layout, and why a given one cannot be used.

Both kinds of source validate their tensors here at construction, so a wrong checkpoint or a
wrong mapping fails with one message listing every unusable tensor, before any build starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from ..options import flag
from ..spec import KeyLayout, Layer, ModulationSpec


def expected(spec: ModulationSpec, layout: KeyLayout) -> list[tuple[Layer, str, tuple[int, ...]]]:
    """(layer, tensor name, shape) of every projection weight and bias, in pass order.

    A layer without a bias (:attr:`~adalncache.geometry.ServedLayer.bias`) contributes its weight
    only: a bias-less checkpoint holds no such tensor, so none is looked for.
    """
    out: list[tuple[Layer, str, tuple[int, ...]]] = []
    for layer in spec.layers():
        width = spec.out_features(layer)
        out.append((layer, layout.weight(layer), (width, spec.in_features)))
        if spec.has_bias(layer):
            out.append((layer, layout.bias(layer), (width,)))
    return out


def tensor_problem(
    spec: ModulationSpec,
    name: str,
    shape: tuple[int, ...] | None,
    dtype: torch.dtype | str | None,
    want: tuple[int, ...],
) -> str | None:
    """Why a projection tensor cannot be used, or None."""
    if shape is None:
        return f"{name}: missing"
    if tuple(shape) != want:
        return f"{name}: shape {list(shape)}, expected {list(want)}"
    if dtype != spec.dtype:
        shown = str(dtype).removeprefix("torch.")
        return f"{name}: dtype {shown}, expected {str(spec.dtype).removeprefix('torch.')} (ModulationSpec.dtype)"
    return None


def detect_layout(names: set[str] | Mapping[str, Any], spec: ModulationSpec, layout: str, where: str) -> KeyLayout:
    """``layout`` itself, or for ``"auto"`` the layout whose projection names ``names`` holds most of."""
    if layout != "auto":
        return spec.layout(layout)
    layouts = spec.layouts()
    scores = {name: sum(key in names for _, key, _ in expected(spec, lay)) for name, lay in layouts.items()}
    best = max(scores, key=lambda n: scores[n])
    if scores[best] == 0:
        first = spec.layers()[0]
        looked = " and ".join(repr(lay.weight(first)) for lay in layouts.values())
        raise CheckpointError(
            f"{where} holds no AdaLN projection in a known layout (looked for {looked}): pass a "
            f"{spec.family.title} transformer checkpoint, or set layout= (CLI {flag('layout')})"
        )
    return layouts[best]


def raise_problems(problems: list[str], where: str, layout: KeyLayout) -> None:
    """CheckpointError listing ``problems`` (the first 20), if there are any."""
    if not problems:
        return
    shown = problems[:20]
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise CheckpointError(
        f"{len(problems)} AdaLN projection tensor(s) unusable in {layout.name} layout ({where}):\n  "
        + "\n  ".join(shown)
        + more
    )
