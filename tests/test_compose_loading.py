"""Loading paths and adapters added while enabled.

``from_single_file`` reads MiniMax's native single-file layout (written here whole by
``tiny_helpers.write_native_single_file``); the cache must be exact on the loaded model, from its own tensors and from a
``checkpoint=`` pointing at that same file. peft's ``add_adapter`` on an enabled model must give the
adapter real weights (it once put them on the meta placeholders' device: NaN outputs, no error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.tools.tiny import make_request, native_state_dict, run_loop, tiny_transformer
from compose_helpers import assert_equal, assert_exact, serve
from tiny_helpers import write_native_single_file


def _from_single_file(path: Path, config_dir: Path, dtype: torch.dtype | None) -> Any:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel.from_single_file(
        str(path), config=str(config_dir), torch_dtype=dtype, local_files_only=True
    ).eval()


def test_native_writer_round_trips_through_diffusers_conversion() -> None:
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    model = tiny_transformer("tiny")
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(native_state_dict(model), dict(model.config))
    state = model.state_dict()
    assert sorted(converted) == sorted(state)
    assert all(torch.equal(converted[key], state[key]) for key in state)


@pytest.mark.parametrize(("saved", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_from_single_file_with_the_cache_and_the_file_as_checkpoint(
    tiny_saved_root: Path, tmp_path: Path, saved: str, dtype: torch.dtype
) -> None:
    """The fp32 file and the released mixed precision (bf16 projections, fp32 time embedder)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    source = MiniMaxH3Transformer3DModel.from_pretrained(tiny_saved_root / saved, torch_dtype=dtype)
    path = write_native_single_file(source, tmp_path / "minimax-h3.safetensors")
    model = _from_single_file(path, tiny_saved_root / "fp32", dtype)
    request = make_request(model, "fl2va", 4)
    assert_exact(serve(model, request), request)
    assert_exact(serve(model, request, checkpoint=path), request)


def test_checkpoint_single_file_of_another_dtype_is_refused(tiny_saved_root: Path, tmp_path: Path) -> None:
    path = write_native_single_file(tiny_transformer("tiny"), tmp_path / "fp32.safetensors")
    model = _from_single_file(path, tiny_saved_root / "fp32", torch.bfloat16)
    says = r"(?s)checkpoint= \(CLI --checkpoint\) does not match.*dtype float32, expected bfloat16"
    with pytest.raises(ConfigError, match=says):
        enable_adaln_cache(model, path)
    assert all(p.device.type != "meta" for p in model.parameters())


def test_peft_add_adapter_while_enabled_gets_real_weights(load_tiny: Any) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig

    def add(model: Any) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(1)
            targets = ["adaln_proj.linear", "norm_out.linear", "linear_1", "to_q"]
            model.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False))

    reference = load_tiny("bf16-disk")
    add(reference)
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 4)
    handle = enable_adaln_cache(model)
    add(model)
    adapter = model.transformer_blocks[0].adaln_proj.linear.lora_A["default"].weight
    assert adapter.device.type == "cpu"
    assert torch.equal(adapter, reference.transformer_blocks[0].adaln_proj.linear.lora_A["default"].weight)
    assert_equal(run_loop(model, request), run_loop(reference, request))

    with pytest.raises(ConfigError, match=r"init_lora_weights='pissa'.*handle\.disable\(\)"):
        model.add_adapter(LoraConfig(r=2, target_modules=["norm_out.linear"], init_lora_weights="pissa"), "pissa")
    with pytest.raises(ConfigError, match=r"use_dora=True"):
        model.add_adapter(LoraConfig(r=2, target_modules=["norm_out.linear"], use_dora=True), "dora")
    handle.disable()
    assert_equal(run_loop(model, request), run_loop(reference, request))


def test_an_adapter_injected_past_the_guards_is_refused_not_nan(load_tiny: Any) -> None:
    """peft's ``inject_adapter_in_model`` on the model bypasses every method guard: the next forward refuses."""
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model

    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 4)
    handle = enable_adaln_cache(model)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["adaln_proj.linear"]), model)
    with pytest.raises(ConfigError, match=r"holds no data \(meta\).*inject_adapter_in_model"):
        run_loop(model, request)
    handle.disable()
