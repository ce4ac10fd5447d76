"""What the benchmark measures on: a generated checkpoint at the real widths, a request's plans, their inputs.

The checkpoint holds ``spec``'s projections in the native layout, sharded with an index, filled
with seeded random bf16 (so every run, on every machine, reads the same bytes); it is written
once per geometry and reused. The request is a 50-step t2va request (diffusers' own schedule when
diffusers is installed); its projection inputs are deterministic ``silu(temb)`` stand-ins.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ...plans import distinct_plans, plan_key
from ...source import LazyTensor, write_safetensors
from ...spec import FINAL, ModulationSpec, get_layout

log = logging.getLogger(__name__)

#: The released geometry: time embedding (projection input) and hidden size (output = 18 x hidden).
REAL_IN = 2688
REAL_HIDDEN = 5376
#: Request of the big comparisons: a 50-step t2va request has 49 distinct plans.
STEPS = 50


def _random_bf16(shape: tuple[int, ...], seed: int, scale: float) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        out = torch.empty(shape, dtype=torch.bfloat16)
        rows = shape[0]
        step = max(1, (64 << 20) // (4 * max(1, out[0].numel()))) if len(shape) > 1 else rows
        flat = out if len(shape) > 1 else out.view(1, -1)
        for lo in range(0, flat.shape[0], step):
            chunk = flat[lo : lo + step]
            chunk.copy_(torch.randn(chunk.shape, generator=gen) * scale)
        return out

    return make


def generate_checkpoint(spec: ModulationSpec, directory: Path, *, layers_per_shard: int = 10) -> Path:
    """A native-layout sharded checkpoint of ``spec``'s projections; reused when already complete."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / "COMPLETE.json"
    want = {"spec": spec.describe(), "layers_per_shard": layers_per_shard, "version": 1}
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == want:
                return directory
        except (OSError, ValueError):
            pass
    for old in directory.glob("*.safetensors*"):
        old.unlink()
    layout = get_layout("native")
    layers = spec.layers()
    groups = [layers[i : i + layers_per_shard] for i in range(0, len(layers), layers_per_shard)]
    weight_map: dict[str, str] = {}
    scale = 1.0 / spec.time_embed_dim**0.5
    for n, group in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]] = []
        for layer in group:
            seed = 1000 + (spec.num_layers if layer == FINAL else int(layer))
            shape = spec.weight_shape(layer)
            tensors.append((layout.weight(layer), shape, _random_bf16(shape, seed, scale)))
            out = (spec.out_features(layer),)
            tensors.append((layout.bias(layer), out, _random_bf16(out, seed + 7919, 0.1)))
        lazy = {n: LazyTensor(shape, torch.bfloat16, make) for n, shape, make in tensors}
        write_safetensors(lazy, directory / name, metadata={"format": "pt", "generator": "adalncache bench"})
        weight_map.update({t[0]: name for t in tensors})
        log.info("wrote %s", name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    marker.write_text(json.dumps(want))
    return directory


def make_inputs(
    spec: ModulationSpec, plans: Sequence[torch.Tensor], device: torch.device | str = "cpu"
) -> dict[tuple[int, ...], torch.Tensor]:
    """A deterministic projection input per plan, on ``device``: ``silu(temb).to(bf16)`` stand-ins."""
    out = {}
    for n, plan in enumerate(plans):
        key = plan_key(plan)
        if key not in out:
            gen = torch.Generator().manual_seed(n)
            x = F.silu(torch.randn(plan.numel(), spec.time_embed_dim, generator=gen)).to(spec.dtype)
            out[key] = x.to(device)
    return out


def request_plans(steps: int = STEPS) -> list[torch.Tensor]:
    """The distinct plans of a ``steps``-step t2va request (diffusers' own schedule when available)."""
    try:
        from ...plans import minimax_h3_plans

        plans = minimax_h3_plans("t2va", steps)
    except Exception as exc:  # diffusers absent: the same shape of request, synthetic values
        log.warning("minimax_h3_plans unavailable (%s); using synthetic width-2 plans", exc)
        plans = [torch.tensor([1.0 - i / steps, 1.0 - i / (2 * steps)]) for i in range(steps - 1)]
    order, tensors = distinct_plans(plans)
    return [tensors[k] for k in order]


def plan_keys(plans: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """The key of each plan, in order."""
    return [plan_key(p) for p in plans]


__all__ = ["REAL_HIDDEN", "REAL_IN", "STEPS", "generate_checkpoint", "make_inputs", "plan_keys", "request_plans"]
