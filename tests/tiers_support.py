"""Helpers shared by the tier tests: tiny specs, in-memory sources, checkpoints with a time embedder.

Why a native checkpoint *with* the time embedder: ``adalncache build``/``verify`` compute the
projections' input from it, and ``tiny.write_native_checkpoint`` writes only the projections.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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

    Tensors keep the model's own address modulo 64 (as ``tiny.write_native_checkpoint`` does), so
    projecting and embedding from the file is bit-identical to the resident model.
    """
    from adalncache.tools.tiny import projection_tensors, write_safetensors

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
