"""A synthetic model family for the seam tests: what the core must serve for a family that is not MiniMax-H3.

Its geometry has what the next families need and MiniMax-H3 does not: layers of different widths
named by module path, two projection inputs (``a`` for some layers, ``b`` for others) where ``b``
has fewer rows than the plan (as Qwen-Image's ``txt_mod`` takes the first half of ``[t; 0*t]``),
and plans of two columns (a timestep and a guidance value per row). The reference
(:func:`reference_rows`) reads the weights with safetensors' own loader and projects each layer
with ``F.linear`` at its input's own M, independently of the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from adalncache import AdalnCache, ModulationSpec
from adalncache.geometry import Family, KeyLayout, ModelGeometry, ServedLayer

FAMILY = Family("synthetic", "Synthetic", (KeyLayout("diffusers"),))
IN_FEATURES = 16
LAYERS = (
    ServedLayer("blocks.0.mod_a", 24, "a"),
    ServedLayer("blocks.0.mod_b", 40, "b"),
    ServedLayer("blocks.1.mod_a", 24, "a"),
    ServedLayer("blocks.1.mod_b", 8, "b"),
    ServedLayer("norm_out.linear", 16, "b"),
)
GEOMETRY = ModelGeometry(FAMILY, LAYERS, IN_FEATURES, ("timestep", "guidance"))
SPEC = ModulationSpec.for_geometry(GEOMETRY, dtype=torch.bfloat16, num_layers=2, hidden_size=8)


def plan(*rows: tuple[float, float]) -> torch.Tensor:
    """A two-column plan: one (timestep, guidance) pair per row."""
    return torch.tensor(rows, dtype=torch.float32)


#: A request with a repeated plan and 1 to 3 rows (input ``b`` then has 1, 1 and 2 rows).
PLANS = [
    plan((0.9, 3.5)),
    plan((0.7, 3.5), (0.7, 0.0)),
    plan((0.5, 4.0), (0.45, 4.0), (0.2, 1.0)),
    plan((0.7, 3.5), (0.7, 0.0)),
]


def b_rows(n: int) -> int:
    """Rows input ``b`` takes for a plan of ``n`` rows: the first half, rounded up."""
    return (n + 1) // 2


def make_weights(spec: ModulationSpec = SPEC, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic weights under the diffusers names (the layer ids), plus an unrelated tensor."""
    layout = spec.layout("diffusers")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {"unrelated.weight": torch.randn(5, 7, generator=g)}
    for layer in spec.layers():
        out[layout.weight(layer)] = (torch.randn(*spec.weight_shape(layer), generator=g) / 4).to(spec.dtype)
        out[layout.bias(layer)] = torch.randn(spec.out_features(layer), generator=g).to(spec.dtype)
    return out


def write_checkpoint(directory: Path, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    save_file({k: v.contiguous() for k, v in make_weights(seed=seed).items()}, str(path))
    return path


def embed(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two inputs from one plan: ``a`` for every row, ``b`` for the first half (its own function)."""
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(32, 2, generator=g)
    wa = torch.randn(IN_FEATURES, 32, generator=g) / 4
    wb = torch.randn(IN_FEATURES, 32, generator=g) / 4
    hidden = F.silu(F.linear(p, w1))
    a = F.silu(F.linear(hidden, wa)).to(SPEC.dtype)
    b = F.silu(F.linear(hidden[: b_rows(p.shape[0])], wb)).to(SPEC.dtype)
    return {"a": a, "b": b}


def load_reference(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def reference_rows(weights: Mapping[str, torch.Tensor], p: torch.Tensor, layer: str) -> torch.Tensor:
    """``layer``'s table rows of plan ``p``: ``F.linear`` at its input's M, zero rows past it."""
    layout = SPEC.layout("diffusers")
    x = embed(p)[SPEC.input_of(layer)]
    y = F.linear(x, weights[layout.weight(layer)], weights[layout.bias(layer)])
    out = torch.zeros(p.shape[0], SPEC.out_features(layer), dtype=SPEC.dtype)
    out[: y.shape[0]] = y
    return out


def assert_exact(cache: AdalnCache, weights: Mapping[str, torch.Tensor], plans: list[torch.Tensor]) -> None:
    """Every layer's rows of every plan equal the independent projection bit for bit."""
    for p in plans:
        slot = cache.lookup(p)
        for layer in cache.spec.layers():
            got = cache.layer_rows(layer, slot, p.shape[0])
            assert torch.equal(got, reference_rows(weights, p, str(layer))), f"layer {layer} of plan {p.tolist()}"
