"""``ModulationSpec.from_checkpoint`` and the key layouts' derived names (block index, time embedder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from adalncache import CheckpointError, ConfigError, ModulationSpec
from adalncache.spec import LAYOUTS
from core_helpers import make_weights, write_checkpoint


@pytest.mark.parametrize("layout", ["native", "diffusers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_spec_read_back_from_headers(tmp_path: Path, layout: str, dtype: torch.dtype) -> None:
    spec = ModulationSpec(num_layers=4, hidden_size=8, time_embed_dim=24, dtype=dtype)
    ckpt = write_checkpoint(tmp_path / "ckpt", make_weights(spec, layout), shards=2)
    assert ModulationSpec.from_checkpoint(ckpt) == spec
    assert ModulationSpec.from_checkpoint(ckpt, layout=layout) == spec
    files = sorted(ckpt.glob("*.safetensors"))
    assert ModulationSpec.from_checkpoint([str(f) for f in files]) == spec


def test_modalities_set_the_hidden_size(tmp_path: Path) -> None:
    spec = ModulationSpec(num_layers=2, hidden_size=8, time_embed_dim=16, modalities=2)
    ckpt = write_checkpoint(tmp_path / "ckpt", make_weights(spec))
    assert ModulationSpec.from_checkpoint(ckpt, modalities=2) == spec
    # Its 96 outputs (6 x 2 x 8) are no multiple of 18 (6 x 3 modalities): refused, not guessed.
    with pytest.raises(CheckpointError, match="not a multiple of 6 x 3"):
        ModulationSpec.from_checkpoint(ckpt)


def test_blocks_counted_up_to_the_first_gap(tmp_path: Path) -> None:
    spec = ModulationSpec(num_layers=5, hidden_size=8, time_embed_dim=16)
    weights = make_weights(spec)
    for part in ("weight", "bias"):
        del weights[f"blocks.3.adaln_proj.linear.{part}"]
    ckpt = write_checkpoint(tmp_path / "ckpt", weights)
    assert ModulationSpec.from_checkpoint(ckpt).num_layers == 3


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    spec = ModulationSpec(num_layers=2, hidden_size=8, time_embed_dim=16)
    native = write_checkpoint(tmp_path / "native", make_weights(spec, "native"))
    with pytest.raises(CheckpointError, match="no AdaLN projection in a known layout"):
        ModulationSpec.from_checkpoint(native, layout="diffusers")
    with pytest.raises(ConfigError, match="--layout"):
        ModulationSpec.from_checkpoint(native, layout="megatron")
    with pytest.raises(CheckpointError, match="does not exist"):
        ModulationSpec.from_checkpoint(tmp_path / "missing")
    other = write_checkpoint(tmp_path / "other", {"unrelated.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match=re.escape("blocks.0.adaln_proj.linear.weight")):
        ModulationSpec.from_checkpoint(other)


def test_layouts_derive_block_indices_from_their_prefix() -> None:
    for layout in LAYOUTS.values():
        for index in (0, 7, 49):
            assert layout.block_index(layout.weight(index)) == index
        assert layout.block_index(layout.bias(3)) is None
        assert layout.block_index(layout.weight("final")) is None
        assert layout.block_index("x" + layout.weight(1)) is None
    assert LAYOUTS["native"].block_index(LAYOUTS["diffusers"].weight(2)) is None
    assert LAYOUTS["native"].block_index("blocks.2.adaln_proj.linearXweight") is None  # the dot is literal


def test_layouts_name_the_time_embedder() -> None:
    assert LAYOUTS["native"].time_embedder_tensors() == [
        "time_embedder.proj_in.weight",
        "time_embedder.proj_in.bias",
        "time_embedder.proj_out.weight",
        "time_embedder.proj_out.bias",
    ]
    assert LAYOUTS["diffusers"].time_embedder == ("time_embedder.linear_1", "time_embedder.linear_2")


def test_diffusers_model_and_layout_agree(tiny_saved_dir: Path) -> None:
    """The diffusers layout's names are the names ``save_pretrained`` writes (time embedder included)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from adalncache import CheckpointSource

    spec = ModulationSpec.from_checkpoint(tiny_saved_dir)
    model = MiniMaxH3Transformer3DModel.from_pretrained(tiny_saved_dir)
    assert spec == ModulationSpec.from_transformer(model)
    source = CheckpointSource(tiny_saved_dir, spec)
    assert source.layout.name == "diffusers" and not spec.family.missing_upstream(source)
