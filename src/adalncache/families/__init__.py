"""The model families the cache serves, and the look-alikes it refuses: the one registry the core asks.

Each family module beside this file makes one :class:`~adalncache.geometry.Family` holding everything
the family-neutral core needs of it; everything else finds a family here (by name, by diffusers class,
or as ``spec.family``) and never names one. Refused classes (:data:`REFUSED`) have a servable family's
module names but a modulation input that includes the prompt, so a table built for one prompt is wrong
for the next: they get a ConfigError naming the reason, never tables (docs/families.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ConfigError
from ..geometry import TABLE_ROWS, Family, Schedule
from ..options import Argument, declare
from . import adaln_zero, minimax_h3, qwen_image

#: Every supported family by name.
FAMILIES: dict[str, Family] = {f.name: f for f in (minimax_h3.FAMILY, qwen_image.FAMILY, adaln_zero.FAMILY)}

#: The family of a model whose class names none (a checkpoint without ``config.json``).
DEFAULT: Family = minimax_h3.FAMILY

#: Every family's schedule arguments, each once, in the families' order: the flags ``build`` and
#: ``export`` take (declared, so messages get their flags from the one definition).
ARGUMENTS: dict[str, Argument] = {a.name: a for family in FAMILIES.values() for a in family.arguments}
declare(ARGUMENTS.values())

#: The demo models (``adalncache demo --model``) -> (family, diffusers class).
DEMOS: dict[str, tuple[Family, str]] = {demo: (f, name) for f in FAMILIES.values() for demo, name in f.demos}

_SHARED = "so tables cannot be shared across prompts"
_POOLED = f"its AdaLN input depends on the pooled text embedding, {_SHARED}"

#: diffusers classes that look servable but are not, with the reason.
REFUSED: dict[str, str] = {
    "FluxTransformer2DModel": _POOLED,
    "SD3Transformer2DModel": _POOLED,
    "HunyuanVideoTransformer3DModel": _POOLED,
    "MochiTransformer3DModel": f"its AdaLN input depends on the text embedding, {_SHARED}",
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
    family = of_class(class_name)
    if family is not None:
        return family
    reason = REFUSED.get(class_name)
    if reason is not None:
        raise ConfigError(f"{class_name} cannot be served from AdaLN tables: {reason}")
    raise ConfigError(f"{class_name} is not a supported family: the supported families are {supported()}")


def table_fields(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype | None) -> dict[str, Any]:
    """The spec fields an unbound table file's tensor shapes imply (``inspect``), or ValueError saying why not:
    only MiniMax-H3's parts determine its geometry; bound files describe their layers in their binding."""
    block = shapes.get("block_params") or ()
    if dtype is not None and all(name in shapes for name in minimax_h3.FAMILY.table_tensors) and len(block) == 4:
        return {"num_layers": block[2], "hidden_size": block[3] // 18, "time_embed_dim": 1, "dtype": dtype}
    raise ValueError(f"block_params is {list(block) if block else None} {dtype}, not [P, W, L, 18 * hidden]")


def table_tensor_sets() -> list[tuple[str, ...]]:
    """The tensors besides the plans that make a table file, per family (what ``inspect`` recognises)."""
    return list(dict.fromkeys([*(family.table_tensors for family in FAMILIES.values()), (TABLE_ROWS,)]))


def of_class(class_name: str) -> Family | None:
    """The family whose diffusers classes include ``class_name``, or None (no error)."""
    return next((family for family in FAMILIES.values() if class_name in family.class_names), None)


def takers(name: str) -> list[Family]:
    """The families whose schedules take the argument ``name``."""
    return [family for family in FAMILIES.values() if any(a.name == name for a in family.arguments)]


def schedule(spec: Any, given: Mapping[str, Any], *, source: Any, checkpoint: Any) -> Schedule:
    """The plans the schedule flags ``given`` (name -> value) name for a checkpoint of ``spec``, from its family.
    A flag of another family's schedules is refused, naming the families that take it: a table built for
    the wrong schedule serves nothing."""
    family: Family = spec.family
    taken = {a.name: a for a in family.arguments}
    foreign = [ARGUMENTS[name].flag for name in given if name not in taken]
    if foreign:
        owners = {f.title: None for name in given if name not in taken for f in takers(name)}
        raise ConfigError(
            f"{' and '.join(foreign)} name{'s' if len(foreign) == 1 else ''} {' and '.join(owners)} schedules; a "
            f"{family.schedule_name(spec)} schedule is {family.schedule_hint(spec)}: drop {', '.join(foreign)}"
        )
    values = {name: given.get(name, argument.default) for name, argument in taken.items()}
    return family.schedule(values, spec=spec, source=source, checkpoint=checkpoint)


def checkpoint_embed(source: Any, spec: Any, device: Any = "cpu") -> Callable[[torch.Tensor], Any]:
    """``embed(plan)`` of ``spec``'s family from the checkpoint ``source`` reads (no model needed)."""
    return spec.family.checkpoint_embed(source, spec, device)
