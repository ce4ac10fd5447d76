"""Helpers shared by the tier tests: tiny specs, in-memory sources, checkpoints with a time embedder.

Why a native checkpoint *with* the time embedder: ``adalncache build``/``verify`` compute the
projections' input from it, and ``tiny_helpers.write_native_checkpoint`` writes only the projections.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from adalncache import ModulationSpec, TensorSource
from adalncache.spec import LAYOUTS


def small_spec(dtype: torch.dtype = torch.bfloat16, layers: int = 2, hidden: int = 8, k: int = 16) -> ModulationSpec:
    return ModulationSpec(num_layers=layers, hidden_size=hidden, time_embed_dim=k, dtype=dtype)


def projection_dict(spec: ModulationSpec, seed: int = 0, layout: str = "native") -> dict[str, torch.Tensor]:
    """Random projection weights and biases of ``spec`` under ``layout``'s names."""
    g = torch.Generator().manual_seed(seed)
    lay = LAYOUTS[layout]
    out: dict[str, torch.Tensor] = {}
    for layer in spec.layers():
        out[lay.weight(layer)] = torch.randn(spec.out_features(layer), spec.time_embed_dim, generator=g).to(spec.dtype)
        out[lay.bias(layer)] = torch.randn(spec.out_features(layer), generator=g).to(spec.dtype)
    return out


def tensor_source(spec: ModulationSpec, seed: int = 0) -> TensorSource:
    return TensorSource(projection_dict(spec, seed), spec)


def simple_embed(spec: ModulationSpec, seed: int = 1) -> Any:
    """A deterministic embed: silu of a fixed outer product, cast to the weights' dtype."""
    w = torch.randn(spec.time_embed_dim, generator=torch.Generator().manual_seed(seed))

    def embed(plan: torch.Tensor) -> torch.Tensor:
        return F.silu(plan[:, None] * w[None]).to(spec.dtype)

    return embed


def plan(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def write_h3_checkpoint(model: Any, directory: Path, *, shards: int = 2) -> Path:
    """A sharded native-layout checkpoint of ``model``'s projections *and* time embedder.

    Tensors keep the model's own address modulo 64 (as ``tiny_helpers.write_native_checkpoint`` does), so
    projecting and embedding from the file is bit-identical to the resident model.
    """
    from adalncache.source.files import write_safetensors
    from tiny_helpers import projection_tensors

    directory.mkdir(parents=True, exist_ok=True)
    tensors = dict(projection_tensors(model, "native"))
    te = model.time_embedder
    for native, module in (("proj_in", te.linear_1), ("proj_out", te.linear_2)):
        tensors[f"time_embedder.{native}.weight"] = module.weight.detach()
        tensors[f"time_embedder.{native}.bias"] = module.bias.detach()
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        chunk = names[index * per : (index + 1) * per]
        file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in chunk}
        write_safetensors(part, directory / file_name, residues={n: t.data_ptr() % 64 for n, t in part.items()})
        weight_map.update(dict.fromkeys(chunk, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def mount_namespaces_work() -> bool:
    """Whether this machine lets a process mount a private tmpfs (a user and mount namespace)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    try:
        done = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "--", "true"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


_MOUNT_PRELUDE = '''
import json, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
MOUNT = Path({mount!r})
MOUNT.mkdir(parents=True, exist_ok=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size={size}", "tmpfs", str(MOUNT)], check=True)


def remount_readonly():
    """Make MOUNT read-only (EROFS for everyone, root included): a read-only share."""
    subprocess.run(["mount", "-o", "remount,ro", str(MOUNT)], check=True)


def fill():
    """Fill MOUNT until the kernel says ENOSPC: a full disk."""
    fd = os.open(MOUNT / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        pass
    finally:
        os.close(fd)
'''


def run_on_private_tmpfs(code: str, mount: Path, *, size: str = "1m", timeout: float = 300) -> Any:
    """Run ``code`` (Python) in a child process with a tmpfs of ``size`` mounted at ``mount``, seen by it alone.

    Real kernel errors, no mocks: a full tmpfs answers ENOSPC and a read-only one EROFS, to root too
    (the tests run as root on some machines, where permission bits would not stop a write). The
    child has ``MOUNT``, ``remount_readonly()`` and ``fill()``; the mount goes away with it. Skips
    the calling test where namespaces are not available.
    """
    if not mount_namespaces_work():
        pytest.skip("this machine does not allow a private mount namespace (unshare --user --mount)")
    tests = str(Path(__file__).resolve().parent)
    script = _MOUNT_PRELUDE.format(tests=tests, mount=str(mount), size=size) + textwrap.dedent(code)
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "--", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
