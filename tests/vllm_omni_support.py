"""vLLM-Omni's own MiniMax-H3 sidecar code, loaded where the package is installed (never a dependency).

The package imports vLLM when imported as a whole, but the modules that define its AdaLN sidecar
(the loader, the schedule contract and plans, the digests) need only torch and safetensors. They are
loaded here from their files, under their own module names, with their parent packages as bare
namespaces so that no package ``__init__`` runs. ``timestep_plans`` imports two constants from the
denoising loop, whose module needs vLLM: they are read from that module's source (its assignments,
parsed with ``ast``) rather than restated here. :func:`load` returns None where vllm_omni is absent.

Also the recipe of ``tests/fixtures/vllm_omni_plans.json``: :func:`record_plans` writes vLLM-Omni's
own ``timestep_plans`` for the schedules of :data:`SCHEDULES` (run it with vLLM-Omni installed).
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

PACKAGE = "vllm_omni"
H3 = "vllm_omni.diffusion.models.minimax_h3"
LEAVES = (
    "vllm_omni.diffusion.sched.sigma_schedule",
    "vllm_omni.diffusion.cache.exact_projection_cache",
    f"{H3}.time_request",
    f"{H3}.adaln_cache",
)
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_omni_plans.json"

#: Schedules whose plans the fixture records: every mode, a few step counts, other shifts, an explicit schedule.
SCHEDULES: list[dict[str, Any]] = [
    *(
        {"mode": mode, "num_steps": n, "base_schedule": None, "flow_shift": 12.0, "audio_flow_shift": 3.0}
        for mode in ("t2va", "fl2va", "ref2va-image", "ref2va-audio", "ref2va-mixed")
        for n in (2, 8, 30, 50)
    ),
    {"mode": "t2va", "num_steps": 17, "base_schedule": None, "flow_shift": 5.0, "audio_flow_shift": 1.5},
    {"mode": "ref2va-mixed", "num_steps": 9, "base_schedule": None, "flow_shift": 1.0, "audio_flow_shift": 7.25},
    {
        "mode": "fl2va",
        "num_steps": 4,
        "base_schedule": [1.0, 0.9375, 0.8333, 0.625, 0.0],
        "flow_shift": 12.0,
        "audio_flow_shift": 3.0,
    },
    {
        "mode": "ref2va-audio",
        "num_steps": 3,
        "base_schedule": [0.95, 0.5, 0.25, 0.0],
        "flow_shift": 6.0,
        "audio_flow_shift": 2.0,
    },
]


def _root() -> Path | None:
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _namespace(name: str, root: Path) -> None:
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = module


def _leaf(name: str, root: Path) -> types.ModuleType:
    if name in sys.modules and getattr(sys.modules[name], "__file__", None):
        return sys.modules[name]
    parts = name.split(".")
    for i in range(1, len(parts)):
        _namespace(".".join(parts[:i]), root)
    spec = importlib.util.spec_from_file_location(name, root / (name.replace(".", "/") + ".py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _constants(path: Path, names: set[str]) -> types.ModuleType:
    """A module holding the named module-level constants of ``path``, read from its source."""
    module = types.ModuleType(path.stem)
    for node in ast.parse(path.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.Assign) and isinstance(target, ast.Name) and target.id in names:
            setattr(module, target.id, ast.literal_eval(node.value))
    return module


def load() -> types.ModuleType | None:
    """vLLM-Omni's ``adaln_cache`` module (its loader, contract, plans, digests), or None if not installed."""
    root = _root()
    if root is None:
        return None
    loop = f"{H3}.denoise_loop"
    if loop not in sys.modules:
        _namespace(H3, root)
        sys.modules[loop] = _constants(
            root / (loop.replace(".", "/") + ".py"),
            {"MINIMAX_H3_IMGVID_COND_TIMESTEP", "MINIMAX_H3_AUDIO_REF_COND_TIMESTEP"},
        )
    for name in LEAVES:
        _leaf(name, root)
    return sys.modules[f"{H3}.adaln_cache"]


def their_plans(module: types.ModuleType, schedule: dict[str, Any]) -> list[list[float]]:
    """vLLM-Omni's plans of one schedule, as lists of floats (fp32 values, exact in JSON)."""
    return [plan.tolist() for plan in module.timestep_plans(module.schedule_contract(**schedule))]


def record_plans(path: Path = FIXTURE) -> None:
    """Write the fixture from the installed vLLM-Omni."""
    from importlib.metadata import version

    module = load()
    if module is None:
        raise SystemExit("vllm-omni is not installed")
    records = [json.dumps({"schedule": s, "plans": their_plans(module, s)}) for s in SCHEDULES]
    head = json.dumps(version("vllm-omni"))
    path.write_text(f'{{"vllm_omni": {head}, "records": [\n' + ",\n".join(records) + "\n]}\n")


if __name__ == "__main__":
    record_plans()
