"""Bias-less served projections (``ServedLayer(..., bias=False)``, as AuraFlow's): served exactly from every tier.

The synthetic family of tests/seam_helpers.py, with two of its five layers declared without a bias
and a checkpoint that holds no bias for them. Tables are compared with ``torch.equal`` against an
independent ``F.linear(x, w, None)`` (``F.linear(x, w, b)`` for the others) at each input's own M:
built from a checkpoint and from tensors in memory, restored from the store in another cache, and
served from a bound table file without weights. A geometry whose layers all have a bias describes
itself (and so digests and binds) exactly as before bias-less layers existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import seam_helpers as S
from adalncache import AdalnCache, CheckpointSource, ConfigError, Store, TensorSource
from adalncache.errors import CheckpointError
from adalncache.formats import TableFile
from adalncache.geometry import ModelGeometry, ServedLayer
from adalncache.offline import export_tables
from adalncache.spec import ModulationSpec

BIAS_LESS = {"blocks.0.mod_b", "norm_out.linear"}
LAYERS = tuple(ServedLayer(s.id, s.out_features, s.input, s.id not in BIAS_LESS) for s in S.LAYERS)
GEOMETRY = ModelGeometry(S.FAMILY, LAYERS, S.IN_FEATURES, ("timestep", "guidance"))
SPEC = ModulationSpec.for_geometry(GEOMETRY, dtype=torch.bfloat16, num_layers=2, hidden_size=8)


def _weights() -> dict[str, torch.Tensor]:
    """The seam family's weights without the biases of the bias-less layers."""
    return {k: v for k, v in S.make_weights().items() if k.removesuffix(".bias") not in BIAS_LESS}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in _weights().items()}, str(path))
    return path


def _assert_exact(cache: AdalnCache, weights: Mapping[str, torch.Tensor], plans: list[torch.Tensor]) -> None:
    layout = SPEC.layout("diffusers")
    for p in plans:
        slot = cache.lookup(p)
        for layer in SPEC.layers():
            x = S.embed(p)[SPEC.input_of(layer)]
            bias = weights[layout.bias(layer)] if SPEC.has_bias(layer) else None
            y = F.linear(x, weights[layout.weight(layer)], bias)
            want = torch.zeros(p.shape[0], SPEC.out_features(layer), dtype=SPEC.dtype)
            want[: y.shape[0]] = y
            assert torch.equal(cache.layer_rows(layer, slot, p.shape[0]), want), f"layer {layer}"


def test_the_geometry_declares_which_layers_have_a_bias() -> None:
    assert [SPEC.tensors_of(layer) for layer in SPEC.layers()] == [
        ("weight", "bias") if layer not in BIAS_LESS else ("weight",) for layer in SPEC.layers()
    ]
    assert (
        SPEC.layer_bytes("blocks.0.mod_b") == 40 * 16 * 2 and SPEC.layer_bytes("blocks.0.mod_a") == (24 * 16 + 24) * 2
    )
    # A biased layer's entry is what it always was (three fields); a bias-less one adds False.
    assert S.SPEC.describe()["layers"][1] == ["blocks.0.mod_b", 40, "b"]
    assert SPEC.describe()["layers"][1] == ["blocks.0.mod_b", 40, "b", False]
    with pytest.raises(ConfigError, match="bias must be True or False"):
        ModelGeometry(S.FAMILY, (ServedLayer("x", 4, "a", "no"),), 16)  # type: ignore[arg-type]  # wrong on purpose


def test_a_checkpoint_source_reads_the_weights_alone_and_builds_exactly(ckpt: Path) -> None:
    source = CheckpointSource(ckpt, SPEC)
    by_layer = {lw.layer: lw for lw in source.stream(SPEC.layers(), device="cpu")}
    assert all((by_layer[layer].bias is None) == (layer in BIAS_LESS) for layer in SPEC.layers())
    cache = AdalnCache(SPEC, source, max_plans=4)
    assert cache.build(S.PLANS, embed=S.embed).passes == 1
    _assert_exact(cache, load_file(str(ckpt)), S.PLANS[:3])
    memory = AdalnCache(SPEC, TensorSource(load_file(str(ckpt)), SPEC), max_plans=4)
    memory.build(S.PLANS, embed=S.embed)
    _assert_exact(memory, load_file(str(ckpt)), S.PLANS[:3])


def test_a_checkpoint_missing_a_declared_bias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in _weights().items() if k != "blocks.0.mod_a.bias"}, str(path))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mod_a\.bias: missing"):
        CheckpointSource(path, SPEC)


def test_the_store_and_a_bound_table_file_serve_bias_less_layers_exactly(ckpt: Path, tmp_path: Path) -> None:
    weights = load_file(str(ckpt))
    store = tmp_path / "store"
    AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=4, store=str(store)).build(S.PLANS, embed=S.embed)
    assert [b["spec"]["layers"][1] for b in Store(store).bindings().values()] == [["blocks.0.mod_b", 40, "b", False]]
    second = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=4, store=str(store))
    report = second.build(S.PLANS, embed=S.embed)
    assert report.store_hits == 3 and report.passes == 0
    _assert_exact(second, weights, S.PLANS[:3])

    out = tmp_path / "tables.safetensors"
    export_tables(
        AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=4), S.PLANS[:3], out, embed=S.embed, progress=False
    )
    assert TableFile(out).spec.model_geometry.layers == LAYERS  # the bias flags come back from the binding
    served = AdalnCache(SPEC, None, max_plans=4, tables=str(out))
    built = served.build(S.PLANS, embed=S.embed)
    assert built.table_hits == 3 and built.passes == 0
    _assert_exact(served, weights, S.PLANS[:3])
