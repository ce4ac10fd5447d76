"""What the integration takes from diffusers beyond its public API, and what it gives under a short name.

* Every private diffusers name the integration uses is listed in
  :mod:`adalncache.integrations.diffusers.compat` with the release it was checked against; these
  tests import each one from the installed diffusers and check the parameters the integration
  passes, so an upgrade that moves or renames one fails here, by name.
* ``adalncache.diffusers`` exports exactly the names of ``adalncache.integrations.diffusers``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from torch import nn

pytest.importorskip("diffusers")

import adalncache.diffusers as alias
import adalncache.integrations.diffusers as integration
from adalncache.errors import ConfigError
from adalncache.integrations.diffusers import compat


@pytest.mark.parametrize("key", sorted(compat.PRIVATE_NAMES))
def test_every_private_name_is_where_it_was_checked(key: str) -> None:
    entry = compat.PRIVATE_NAMES[key]
    module = importlib.import_module(entry.module)
    assert hasattr(module, entry.name), (
        f"diffusers moved {entry.where} (checked against diffusers {entry.checked}): the AdaLN cache uses it to "
        f"{entry.why}; update adalncache.integrations.diffusers.compat"
    )
    found = getattr(module, entry.name)
    assert compat.private(key) is found
    if entry.parameters is not None:
        names = list(inspect.signature(found).parameters)
        assert names[: len(entry.parameters)] == list(entry.parameters), (
            f"{entry.where} takes {names} now, the integration passes {list(entry.parameters)}"
        )


def test_the_checked_release_is_the_pinned_one() -> None:
    """The release the names were read in is the one pyproject.toml pins for the diffusers extra."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert f"diffusers=={compat.CHECKED_DIFFUSERS}" in pyproject["project"]["optional-dependencies"]["diffusers"]


def test_the_hook_registry_attributes_are_where_diffusers_puts_them() -> None:
    from diffusers.hooks.hooks import HookRegistry, ModelHook

    module = nn.Linear(2, 2)
    assert compat.hook_registry(module) is None and compat.hook_names(module) == []
    registry = HookRegistry.check_if_exists_or_initialize(module)
    assert compat.hook_registry(module) is registry
    registry.register_hook(ModelHook(), "first")
    registry.register_hook(ModelHook(), "second")
    assert compat.hook_names(module) == ["first", "second"]
    assert compat.get_hook(module, "second") is registry.get_hook("second")
    assert compat.get_hook(module, "absent") is None


def test_group_offloading_helpers_read_an_applied_offloading() -> None:
    """The helpers see the offloading diffusers applies, lift it by its hook names and apply it again."""
    import torch
    from diffusers.hooks import apply_group_offloading
    from diffusers.hooks.hooks import HookRegistry

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert not compat.group_offload_enabled(model) and compat.group_offloading_config(model) is None
    cpu = torch.device("cpu")
    apply_group_offloading(
        model, onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1
    )
    assert compat.group_offload_enabled(model) and compat.group_onload_device(model) == cpu
    config = compat.group_offloading_config(model)
    assert config is not None
    registry = HookRegistry.check_if_exists_or_initialize(model)
    for name in compat.group_offloading_hook_names():
        registry.remove_hook(name, recurse=True)
    assert not compat.group_offload_enabled(model)
    compat.apply_group_offloading_config(model, config)
    assert compat.group_offload_enabled(model)
    compat.reapply_group_offloading(model)
    assert compat.group_offload_enabled(model)
    out = model(torch.ones(1, 2))
    assert out.shape == (1, 2)


def test_a_name_that_moved_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = compat.PrivateName("diffusers.hooks.group_offloading", "_no_such_helper", "test a moved name")
    monkeypatch.setitem(compat.PRIVATE_NAMES, "moved", moved)
    with pytest.raises(ConfigError, match=r"has no diffusers\.hooks\.group_offloading\._no_such_helper") as info:
        compat.private("moved")
    assert f"diffusers=={compat.CHECKED_DIFFUSERS}" in str(info.value)


def test_no_module_but_compat_imports_a_private_diffusers_name() -> None:
    """Every ``from diffusers... import _name`` (or import from a private diffusers module) is in compat."""
    root = Path(integration.__file__).resolve().parents[2]
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "compat.py" and path.parent.name == "diffusers":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "diffusers":
                private_module = any(part.startswith("_") for part in node.module.split("."))
                for name in node.names:
                    if private_module or name.name.startswith("_"):
                        offenders.append(f"{path.relative_to(root)}:{node.lineno} {node.module}.{name.name}")
    assert not offenders, "private diffusers names imported outside compat.py:\n" + "\n".join(offenders)


def test_the_short_alias_exports_the_integrations_names() -> None:
    assert sorted(alias.__all__) == sorted(integration.__all__)
    for name in integration.__all__:
        assert getattr(alias, name) is getattr(integration, name), name
