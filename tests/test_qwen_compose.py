"""Qwen-Image with the AdaLN cache, composed with diffusers features: every output ``torch.equal``.

LoRA (peft, before and after enabling), layerwise casting, group offloading, a block-level step
cache (First Block Cache) and regional compilation (no more frames, graphs, breaks or recompiles
than the same model compiled without the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from adalncache.diffusers import enable_adaln_cache
from adalncache.tools.tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer

pytest.importorskip("diffusers")

TIMESTEPS = (0.9, 0.85, 0.5)


def _steps(model: Any, context: bool = False, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Three forwards at TIMESTEPS (the same inputs otherwise), inside a cache context if asked."""
    inputs = tiny_qwen_inputs(model, 1, dtype=dtype)
    outputs = []
    for t in TIMESTEPS:
        inputs["timestep"] = torch.tensor([t]).to(inputs["hidden_states"].dtype)
        with torch.no_grad():
            if context:
                with model.cache_context("cond"):
                    outputs.append(model(**inputs)[0])
            else:
                outputs.append(model(**inputs)[0])
    return outputs


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _lora(model: Any) -> None:
    from peft import LoraConfig

    targets = ["img_mod.1", "txt_mod.1", "norm_out.linear", "timestep_embedder.linear_1"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model.add_adapter(LoraConfig(r=2, target_modules=targets, init_lora_weights=False))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_lora_on_the_served_modules_is_served_exactly(when: str) -> None:
    pytest.importorskip("peft")
    resident = tiny_qwen_transformer("plain")
    _lora(resident)
    expected = _steps(resident)
    model = tiny_qwen_transformer("plain")
    if when == "before":
        _lora(model)
    handle = enable_adaln_cache(model)
    if when == "after":
        _lora(model)  # peft replaces norm_out.linear and wraps img_mod.1: the cache follows both
    assert _equal(_steps(model), expected)
    handle.disable()
    assert _equal(_steps(model), expected)


def test_layerwise_casting_is_served_exactly() -> None:
    def cast(model: Any) -> Any:
        model = model.to(torch.bfloat16)
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        return model

    expected = _steps(cast(tiny_qwen_transformer("plain")), dtype=torch.bfloat16)
    model = cast(tiny_qwen_transformer("plain"))
    handle = enable_adaln_cache(model)
    assert handle.spec.dtype == torch.bfloat16  # the tables hold what the fp8-stored projections return
    assert _equal(_steps(model, dtype=torch.bfloat16), expected)
    handle.disable()


def test_group_offloading_is_served_exactly() -> None:
    expected = _steps(tiny_qwen_transformer("plain"))
    model = tiny_qwen_transformer("plain")
    handle = enable_adaln_cache(model)
    model.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    assert _equal(_steps(model), expected)
    handle.disable()
    assert _equal(_steps(model), expected)


@pytest.mark.parametrize("when", ["before", "after"])
def test_first_block_cache_is_served_exactly(when: str) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    resident = tiny_qwen_transformer("plain")
    resident.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    expected = _steps(resident, context=True)
    model = tiny_qwen_transformer("plain")
    if when == "before":
        model.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    handle = enable_adaln_cache(model)
    if when == "after":
        model.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    assert _equal(_steps(model, context=True), expected)
    handle.disable(allow_changed_checkpoint=False)


def _compiled_counts(compile_model: Callable[[Any], None], cache: bool) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_qwen_transformer("plain")
    handle = enable_adaln_cache(model) if cache else None
    if handle is not None:
        handle.prepare([torch.tensor([t]) for t in TIMESTEPS])
    compile_model(model)
    torch._dynamo.reset()
    counters.clear()
    outputs = _steps(model)
    counts = (
        counters["frames"]["total"],
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        sum(counters["recompiles"].values()),
    )
    if handle is not None:
        handle.disable()
    return outputs, counts


def test_regional_compile_compiles_no_more_than_the_resident_model() -> None:
    """``compile_repeated_blocks``: the served ``img_mod``/``txt_mod`` class is one class for every block."""

    def regional(model: Any) -> None:
        model.compile_repeated_blocks(backend="aot_eager")

    resident, resident_counts = _compiled_counts(regional, cache=False)
    cached, cached_counts = _compiled_counts(regional, cache=True)
    assert _equal(cached, resident)
    assert cached_counts == resident_counts, (cached_counts, resident_counts)


def test_a_family_serving_every_projection_by_hook_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam's other serving path: no class swap, a hook on every projection, followed when peft replaces it.

    A family whose blocks' owner modules do more than call the projection (an AdaLayerNormZero)
    serves its projections this way; here Qwen-Image's family is registered with no swapped layer.
    """
    pytest.importorskip("peft")
    from adalncache.integrations.diffusers import family as registry
    from adalncache.integrations.diffusers.qwen_image import QwenImage
    from adalncache.spec import Layer, ModulationSpec

    class HookedQwenImage(QwenImage):
        def swapped_layers(self, spec: ModulationSpec) -> list[Layer]:
            return []

    monkeypatch.setitem(registry.FAMILIES, "qwen-image", HookedQwenImage())
    resident = tiny_qwen_transformer("zero-cond")
    _lora(resident)
    expected = _steps(resident)
    model = tiny_qwen_transformer("zero-cond")
    handle = enable_adaln_cache(model)
    assert type(model.transformer_blocks[0].img_mod).__name__ == "Sequential"
    assert "forward" not in model.transformer_blocks[0].img_mod.__dict__  # no swap, no hook on the owner
    assert len(handle._hooks.hooked) == len(handle.spec.layers())
    _lora(model)  # peft wraps every projection: each hook moves to the wrapper
    assert _equal(_steps(model), expected)
    handle.disable()
    assert _equal(_steps(model), expected)
