"""The model families the cache serves, and the look-alikes it refuses, by name and by diffusers class.

A family module (one per family, beside this file) declares what the family-neutral core needs:
its :class:`~adalncache.geometry.Family` (key layouts, table formats), how to build a
:class:`~adalncache.geometry.ModelGeometry` from a model's sizes, and how to read those sizes from a
checkpoint or a transformer. This package is at the definitions level: the spec's presets import
it, and it imports nothing above the geometry.

Refused classes: transformers whose modulation input includes the prompt. Their projections have
the same module names as a servable family's, but a table built for one prompt is wrong for the
next, so they get a :class:`~adalncache.errors.ConfigError` naming the reason, never tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError
from ..geometry import TABLE_ROWS, Family
from . import adaln_zero, minimax_h3, qwen_image

#: Every supported family by name.
FAMILIES: dict[str, Family] = {
    family.name: family for family in (minimax_h3.FAMILY, qwen_image.FAMILY, adaln_zero.FAMILY)
}

#: The readers of the families whose spec carries its geometry (every family but the default one):
#: ``from_transformer(model, dtype)`` and ``from_headers(path, entries, config)`` give the keywords
#: of ``ModulationSpec.for_geometry``.
READERS: dict[str, Any] = {qwen_image.FAMILY.name: qwen_image, adaln_zero.FAMILY.name: adaln_zero}

_POOLED = "its AdaLN input depends on the pooled text embedding, so tables cannot be shared across prompts"

#: diffusers classes that look servable but are not, with the reason.
REFUSED: dict[str, str] = {
    "FluxTransformer2DModel": _POOLED,
    "SD3Transformer2DModel": _POOLED,
    "HunyuanVideoTransformer3DModel": _POOLED,
    "MochiTransformer3DModel": (
        "its AdaLN input depends on the text embedding, so tables cannot be shared across prompts"
    ),
    "HiDreamImageTransformer2DModel": _POOLED,
    "Kandinsky5Transformer3DModel": _POOLED,
}


def supported() -> str:
    """The supported families, for messages: ``minimax-h3 (MiniMaxH3Transformer3DModel), ...``."""
    return ", ".join(f"{f.name} ({', '.join(f.class_names)})" for f in FAMILIES.values())


def get(name: str) -> Family:
    """The family called ``name``, or a ConfigError listing the supported ones."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown model family {name!r}: the supported families are {supported()}") from None


def for_class(class_name: str) -> Family:
    """The family of a diffusers transformer class; ConfigError naming why a refused or unknown class is not served."""
    for family in FAMILIES.values():
        if class_name in family.class_names:
            return family
    reason = REFUSED.get(class_name)
    if reason is not None:
        raise ConfigError(f"{class_name} cannot be served from AdaLN tables: {reason}")
    raise ConfigError(f"{class_name} is not a supported family: the supported families are {supported()}")


def table_fields(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype | None) -> dict[str, Any]:
    """The spec fields an unbound table file's tensor shapes imply (``inspect``), or ValueError saying why not.

    Only a family whose table parts determine its geometry can be read this way; bound files
    describe their layers in their binding instead.
    """
    if dtype is not None and all(name in shapes for name in minimax_h3.FAMILY.table_tensors):
        fields = minimax_h3.fields_from_table(shapes["block_params"], dtype)
        if fields is not None:
            return fields
    block = shapes.get("block_params")
    raise ValueError(f"block_params is {list(block) if block else None} {dtype}, not [P, W, L, 18 * hidden]")


def table_tensor_sets() -> list[tuple[str, ...]]:
    """The tensors besides the plans that make a table file, per family (what ``inspect`` recognises)."""
    return list(dict.fromkeys([*(family.table_tensors for family in FAMILIES.values()), (TABLE_ROWS,)]))


def of_class(class_name: str) -> Family | None:
    """The family whose diffusers classes include ``class_name``, or None (no error)."""
    return next((family for family in FAMILIES.values() if class_name in family.class_names), None)


__all__ = [
    "FAMILIES",
    "READERS",
    "REFUSED",
    "adaln_zero",
    "for_class",
    "get",
    "minimax_h3",
    "of_class",
    "qwen_image",
    "supported",
    "table_fields",
    "table_tensor_sets",
]
