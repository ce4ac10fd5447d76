"""The families the integration serves: one :class:`~.family.DiffusersFamily` per supported family.

:func:`family_of` picks a transformer's family by its class; a class the core refuses (its
modulation depends on the prompt) or does not know gets the core's ConfigError
(:func:`adalncache.families.for_class`), naming the class and why, or the supported families.
Adding a family is one module beside this one and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from ... import families
from ...errors import ConfigError
from ...spec import ModulationSpec
from .adaln_zero import FAMILY as ADALN_ZERO
from .family import DiffusersFamily
from .minimax_h3 import FAMILY as MINIMAX_H3
from .qwen_image import FAMILY as QWEN_IMAGE

#: The integration's families, by core family name.
FAMILIES: dict[str, DiffusersFamily] = {family.name: family for family in (MINIMAX_H3, QWEN_IMAGE, ADALN_ZERO)}


def by_name(name: str) -> DiffusersFamily:
    """The integration's family called ``name`` (a ConfigError when the core family has none)."""
    family = FAMILIES.get(name)
    if family is None:
        families.get(name)  # an unknown name: the core's error lists the supported families
        raise ConfigError(f"the {name} family has no diffusers integration; the served ones are {sorted(FAMILIES)}")
    return family


def for_spec(spec: ModulationSpec) -> DiffusersFamily:
    """The family a spec describes."""
    return by_name(spec.family.name)


def recognised(obj: Any) -> DiffusersFamily | None:
    """The family of ``obj`` when it is a transformer the integration serves, else None (no error)."""
    for family in FAMILIES.values():
        if family.recognises(obj):
            return family
    return None


def family_of(model: Any) -> DiffusersFamily:
    """The family of a transformer, or the ConfigError saying why its class is refused or unknown."""
    family = recognised(model)
    if family is not None:
        return family
    return by_name(families.for_class(type(model).__name__).name)


__all__ = ["FAMILIES", "by_name", "family_of", "for_spec", "recognised"]
