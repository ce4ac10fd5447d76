"""Qwen-Image LoRA through diffusers' own loader: every change rebuilds the tables, images ``torch.equal``.

A real LoRA file in diffusers' Qwen-Image format (``transformer.<module>.lora_A/B.weight``, written
with safetensors) is loaded by ``QwenImageLoraLoaderMixin.load_lora_weights`` into two identical
tiny pipelines: one resident, one served by the cache. After each change (load before or after
enabling, set_adapters, ``attention_kwargs`` scale, a hotswap in place, unload, fuse) the cached
pipeline's images must be ``torch.equal`` to the resident one's.

The tiny pipelines have no text encoder (a Qwen2.5-VL tokenizer cannot be made offline), so the
requests pass ``prompt_embeds``; the denoising loop is the stock one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline
from compose_helpers import write_lora


def _lora_file(model: Any, path: Path, seed: int, rank: int = 4) -> Path:
    """A LoRA in diffusers' Qwen-Image format on every served module, the time embedder and one attention."""
    names = []
    for i in range(len(model.transformer_blocks)):
        names += [f"transformer_blocks.{i}.img_mod.1", f"transformer_blocks.{i}.txt_mod.1"]
    names += ["norm_out.linear", "time_text_embed.timestep_embedder.linear_1", "transformer_blocks.0.attn.to_q"]
    return write_lora(model, names, path, seed, rank)


def _run(pipe: Any, **kwargs: Any) -> torch.Tensor:
    """A three-step 32x32 request of fixed prompt embeddings and seed."""
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    generator = torch.Generator().manual_seed(0)
    out = pipe(
        height=32,
        width=32,
        num_inference_steps=3,
        true_cfg_scale=1.0,
        generator=generator,
        output_type="pt",
        **prompt,
        **kwargs,
    )
    return out.images


@pytest.fixture
def pair() -> tuple[Any, Any]:
    """Two identical tiny fp32 Qwen-Image pipelines: the first stays resident, the second gets the cache."""
    return tiny_qwen_pipeline(), tiny_qwen_pipeline()


def test_load_switch_scale_unload(pair: tuple[Any, Any], tmp_path: Path) -> None:
    resident, cached = pair
    base = _run(resident)
    handle = enable_adaln_cache(cached)

    def check(**kwargs: Any) -> torch.Tensor:
        expected = _run(resident, **kwargs)
        assert torch.equal(_run(cached, **kwargs), expected)
        return expected

    one = _lora_file(resident.transformer, tmp_path / "one.safetensors", seed=1)
    two = _lora_file(resident.transformer, tmp_path / "two.safetensors", seed=2)
    for pipe in pair:
        pipe.load_lora_weights(str(one), adapter_name="one")
    # peft put the adapter where the model runs, not on the meta placeholder's device.
    assert cached.transformer.transformer_blocks[0].img_mod[1].lora_A["one"].weight.device.type == "cpu"
    passes = handle.stats.passes
    with_one = check()
    assert handle.stats.passes == passes + 1  # the new LoRA signature: the request's schedule, one pass
    assert not torch.equal(with_one, base)  # the LoRA does change the images

    for pipe in pair:
        pipe.load_lora_weights(str(two), adapter_name="two")
        pipe.set_adapters(["one", "two"], [0.7, 0.3])
    switched = check()
    assert not torch.equal(switched, with_one)
    scaled = check(attention_kwargs={"scale": 0.5})
    assert not torch.equal(scaled, switched)
    assert torch.equal(check(), switched)

    for pipe in pair:
        pipe.set_adapters("two")
    check()
    for pipe in pair:
        pipe.unload_lora_weights()
    assert torch.equal(check(), base)
    handle.disable()
    assert torch.equal(_run(cached), base)


def test_lora_loaded_before_enabling(pair: tuple[Any, Any], tmp_path: Path) -> None:
    resident, cached = pair
    path = _lora_file(resident.transformer, tmp_path / "lora.safetensors", seed=3)
    for pipe in pair:
        pipe.load_lora_weights(str(path), adapter_name="style")
    expected = _run(resident)
    handle = enable_adaln_cache(cached)
    assert cached.transformer.norm_out.linear.base_layer.weight.device.type == "meta"
    assert torch.equal(_run(cached), expected) and handle.stats.passes == 1
    for pipe in pair:
        pipe.unload_lora_weights()
    assert torch.equal(_run(cached), _run(resident))
    handle.disable()


def test_a_hotswap_in_place_rebuilds_the_tables(pair: tuple[Any, Any], tmp_path: Path) -> None:
    """``load_lora_weights(..., hotswap=True)`` copies the new adapter into the old one's tensors.

    peft writes through ``.data`` (same tensor objects, same addresses, same version counters, same
    scaling at equal rank and alpha): without the hotswap counter in the LoRA signature, the tables of
    the first adapter were served under the second.
    """
    resident, cached = pair
    one = _lora_file(resident.transformer, tmp_path / "one.safetensors", seed=4)
    two = _lora_file(resident.transformer, tmp_path / "two.safetensors", seed=5)
    handle = enable_adaln_cache(cached)
    for pipe in pair:
        pipe.load_lora_weights(str(one), adapter_name="style")
    with_one = _run(resident)
    assert torch.equal(_run(cached), with_one)
    passes = handle.stats.passes
    for pipe in pair:
        pipe.load_lora_weights(str(two), adapter_name="style", hotswap=True)
    with_two = _run(resident)
    assert not torch.equal(with_two, with_one)
    assert torch.equal(_run(cached), with_two)
    assert handle.stats.passes == passes + 1
    assert torch.equal(_run(cached), with_two) and handle.stats.passes == passes + 1  # then served, not rebuilt
    handle.disable()


def test_fuse_is_refused_while_enabled_and_served_after_re_enabling(pair: tuple[Any, Any], tmp_path: Path) -> None:
    resident, cached = pair
    path = _lora_file(resident.transformer, tmp_path / "lora.safetensors", seed=6)
    handle = enable_adaln_cache(cached)
    for pipe in pair:
        pipe.load_lora_weights(str(path), adapter_name="turbo")
    with pytest.raises(ConfigError, match=r"disable\(\)"):
        cached.fuse_lora()
    with pytest.raises(ConfigError, match=r"disable\(\)"):
        cached.transformer.unfuse_lora()
    # Nothing was fused: still the resident model with the LoRA unfused.
    assert torch.equal(_run(cached), _run(resident))
    # The advised sequence: disable, fuse, enable again (the fused weights are the source).
    handle.disable()
    for pipe in pair:
        pipe.fuse_lora()
    fused = _run(resident)
    handle = enable_adaln_cache(cached)
    assert torch.equal(_run(cached), fused)
    handle.disable()
    for pipe in pair:
        pipe.unfuse_lora()
    handle = enable_adaln_cache(cached)
    assert torch.equal(_run(cached), _run(resident))
    handle.disable()
