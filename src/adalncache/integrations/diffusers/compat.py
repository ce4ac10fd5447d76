"""diffusers' private names, each listed once in :data:`PRIVATE_NAMES` with the release it was checked against.

Lookups are lazy, so a diffusers that moved one name still serves everything else, and the moved one raises
:class:`ConfigError` naming it; a test imports every name and checks the parameters passed.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError

#: The diffusers release every name below was read in (the one pyproject.toml pins).
CHECKED_DIFFUSERS = "0.42.1"


@dataclass(frozen=True)
class PrivateName:
    """One private diffusers name: where it is defined, what it is used for, for a function the leading
    ``parameters`` the integration passes (``None``: a constant or a class), the release it was read in."""

    module: str
    name: str
    why: str
    parameters: tuple[str, ...] | None = None
    checked: str = CHECKED_DIFFUSERS

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


_GROUP, _HELPERS = "diffusers.hooks.group_offloading", "diffusers.hooks._helpers"

#: Every private diffusers name the package uses, by the key the functions below look it up by.
PRIVATE_NAMES: dict[str, PrivateName] = {
    entry.name: entry
    for entry in (
        PrivateName(_GROUP, "_is_group_offload_enabled", "whether group offloading is applied", ("module",)),
        PrivateName(_GROUP, "_get_group_onload_device", "where a group-offloaded forward runs", ("module",)),
        PrivateName(_GROUP, "_get_top_level_group_offload_hook", "the config of applied group offloading", ("module",)),
        PrivateName(_GROUP, "_apply_group_offloading", "apply lifted group offloading again", ("module", "config")),
        PrivateName(
            _GROUP,
            "_maybe_remove_and_reapply_group_offloading",
            "rebuild the groups after weights were parked or restored (diffusers' LoRA code does the same)",
            ("module",),
        ),
        PrivateName(_GROUP, "_GROUP_OFFLOADING", "hook name: a module's group-offloading hook"),
        PrivateName(_GROUP, "_LAYER_EXECUTION_TRACKER", "hook name: group offloading's execution tracker"),
        PrivateName(_GROUP, "_LAZY_PREFETCH_GROUP_OFFLOADING", "hook name: group offloading's lazy prefetch"),
        PrivateName(_HELPERS, "TransformerBlockRegistry", "teach the block-level step caches a block"),
        PrivateName(_HELPERS, "TransformerBlockMetadata", "what a registered block returns"),
    )
}

#: Private attributes of diffusers objects (not importable names): where a module's hook registry
#: sits (``HookRegistry.check_if_exists_or_initialize`` sets it), and the registry's hook names in
#: registration order. Checked against :data:`CHECKED_DIFFUSERS` by the same test.
HOOK_REGISTRY_ATTRIBUTE = "_diffusers_hook"
HOOK_ORDER_ATTRIBUTE = "_hook_order"


@functools.cache
def private(key: str) -> Any:
    """The diffusers object listed as ``key`` in :data:`PRIVATE_NAMES`, imported on first use (ConfigError
    naming it and the release it was checked against where it moved)."""
    entry = PRIVATE_NAMES[key]
    try:
        return getattr(importlib.import_module(entry.module), entry.name)
    except (ImportError, AttributeError) as exc:
        import diffusers

        raise ConfigError(
            f"diffusers {diffusers.__version__} has no {entry.where}, which the AdaLN cache uses to {entry.why} "
            f"(checked against diffusers {entry.checked}); install diffusers=={entry.checked}"
        ) from exc


def hook_registry(module: nn.Module) -> Any:
    """The diffusers ``HookRegistry`` on ``module``, or ``None`` when no diffusers hook was ever added."""
    return getattr(module, HOOK_REGISTRY_ATTRIBUTE, None)


def hook_names(module: nn.Module) -> list[str]:
    """The names of the diffusers hooks on ``module``, in registration order (innermost first)."""
    return list(getattr(hook_registry(module), HOOK_ORDER_ATTRIBUTE, []))


def get_hook(module: nn.Module, name: str) -> Any:
    """The diffusers hook registered on ``module`` under ``name``, or ``None``."""
    registry = hook_registry(module)
    return registry.get_hook(name) if registry is not None else None


def group_offload_enabled(module: nn.Module) -> bool:
    """Whether diffusers' group offloading is applied to ``module``."""
    return bool(private("_is_group_offload_enabled")(module))


def group_onload_device(module: nn.Module) -> torch.device:
    """The device a group-offloaded ``module`` runs its forward on."""
    return torch.device(private("_get_group_onload_device")(module))


def group_offloading_config(module: nn.Module) -> Any:
    """The config group offloading was applied to ``module`` with, or ``None`` when it is not applied."""
    top = private("_get_top_level_group_offload_hook")(module)
    return None if top is None else top.config


def group_offloading_hook_names() -> Sequence[str]:
    """The names of every hook group offloading registers (removing them all takes it off)."""
    return tuple(
        private(key) for key in ("_GROUP_OFFLOADING", "_LAYER_EXECUTION_TRACKER", "_LAZY_PREFETCH_GROUP_OFFLOADING")
    )


def group_offloading_hook(module: nn.Module) -> Any:
    """The group-offloading hook on ``module`` (its ``.group`` is what one onload moves), or ``None``."""
    return get_hook(module, private("_GROUP_OFFLOADING"))


def apply_group_offloading_config(module: nn.Module, config: Any) -> None:
    """Apply group offloading to ``module`` with ``config`` (as :func:`group_offloading_config` read it)."""
    private("_apply_group_offloading")(module, config)


def reapply_group_offloading(module: nn.Module) -> None:
    """Rebuild ``module``'s offloading groups from its parameters as they are now (if it is applied)."""
    if group_offload_enabled(module):
        private("_maybe_remove_and_reapply_group_offloading")(module)


def block_registry() -> tuple[Any, Any]:
    """``(TransformerBlockRegistry, TransformerBlockMetadata)``: the registry the block-level step caches read."""
    return private("TransformerBlockRegistry"), private("TransformerBlockMetadata")


__all__ = ["CHECKED_DIFFUSERS", "PRIVATE_NAMES", "PrivateName", "private"]
