"""The whole tiny MiniMax-H3 modular pipeline (t2va, and fl2va), resident versus cached.

Tiny Qwen3-VL text encoder (51 layers), locally trained BPE tokenizer, Qwen3VLProcessor without
torchvision, tiny video and audio VAEs: nothing is downloaded. The cached call must give
bit-identical latents, video and audio, building its whole row_timestep_plan in exactly one pass
before the first step; a repeated identical call does no pass.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.plans import minimax_h3_plans, plan_key

OUTPUTS = ["latents", "audio_latents", "videos", "audio"]
STEPS = 4


def _call(pipe: Any, **extra: Any) -> dict[str, torch.Tensor]:
    return pipe(
        **extra,
        prompt="a cat playing a piano in the rain",
        height=64,
        width=64,
        num_frames=124,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output=OUTPUTS,
        output_type="pt",
    )


@pytest.fixture(scope="module")
def pipe() -> Any:
    from adalncache.tools.tiny import tiny_pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_pipeline(size="tiny", seed=0)


@pytest.fixture(scope="module")
def resident(pipe: Any) -> dict[str, torch.Tensor]:
    """The resident t2va outputs, computed once for the module (the pipeline is deterministic)."""
    return _call(pipe)


def _assert_outputs_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    for name in OUTPUTS:
        assert torch.equal(expected[name], got[name]), f"{name} differs"


def test_full_pipeline_t2va_is_bit_identical(pipe: Any, resident: dict[str, torch.Tensor]) -> None:
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True
    )
    try:
        _assert_outputs_equal(resident, _call(pipe))  # deterministic: the fixture's run is this run
    finally:
        hook.remove()
    # The plans known ahead of time are the ones the pipeline fed the transformer.
    assert [plan_key(p) for p in seen] == [plan_key(p) for p in minimax_h3_plans("t2va", STEPS)]

    handle = enable_adaln_cache(pipe)
    try:
        transformer = pipe.transformer
        assert transformer.transformer_blocks[0].adaln_proj.linear.weight.device.type == "meta"
        first = _call(pipe)
        _assert_outputs_equal(resident, first)
        assert handle.stats.passes == 1  # the whole plan, in one pass, before step 0
        assert handle.stats.built_plans == len(seen)
        second = _call(pipe)
        _assert_outputs_equal(resident, second)
        assert handle.stats.passes == 1  # a repeated identical call does no pass
    finally:
        handle.disable()
    assert transformer.transformer_blocks[0].adaln_proj.linear.weight.device.type == "cpu"
    _assert_outputs_equal(resident, _call(pipe))
    # disable() took the prepare block back out of the denoise loop.
    from adalncache.integrations.diffusers.minimax_h3 import PREPARE_BLOCK, denoise_loops

    assert all(PREPARE_BLOCK not in loop.sub_blocks for loop in denoise_loops(pipe._blocks))


def test_pipeline_on_miss_raise_is_satisfied_by_the_prepare_block(pipe: Any, resident: dict[str, torch.Tensor]) -> None:
    """With on_miss='raise' no forward may build: the loop's prepare block must have built everything."""
    handle = enable_adaln_cache(pipe, on_miss="raise")
    try:
        _assert_outputs_equal(resident, _call(pipe))
        assert handle.stats.passes == 1
    finally:
        handle.disable()


def test_pipeline_handle_surface(pipe: Any) -> None:
    from adalncache.errors import ConfigError

    handle = enable_adaln_cache(pipe)
    try:
        assert set(handle.handles) == {"transformer"}
        assert handle["transformer"].cache is handle.cache
        report = handle.prepare(minimax_h3_plans("t2va", STEPS))
        assert report.passes == 1
        with pytest.raises(ConfigError, match="transformer_ref"):
            handle.prepare(minimax_h3_plans("t2va", STEPS), component="transformer_ref")
    finally:
        handle.disable()
    with pytest.raises(ConfigError, match="pipeline"):
        enable_adaln_cache(object())


def test_transformer_and_transformer_ref_get_their_own_caches(
    pipe: Any, resident: dict[str, torch.Tensor], tmp_path: Any
) -> None:
    from adalncache.errors import ConfigError
    from adalncache.integrations.diffusers.minimax_h3 import AdalnCachePrepareStep, denoise_loops
    from adalncache.tools.tiny import tiny_transformer

    pipe.update_components(transformer_ref=tiny_transformer("tiny", seed=1))
    try:
        with pytest.raises(ConfigError, match="transformer_ref"):
            enable_adaln_cache(pipe, tmp_path)  # one path cannot serve two different checkpoints
        handle = enable_adaln_cache(pipe)
        try:
            assert set(handle.handles) == {"transformer", "transformer_ref"}
            assert handle["transformer"].cache is not handle["transformer_ref"].cache
            # Each denoise loop got a prepare block for the transformer its denoiser drives.
            targets = {
                block.transformer_name
                for loop in denoise_loops(pipe._blocks)
                for block in loop.sub_blocks.values()
                if isinstance(block, AdalnCachePrepareStep)
            }
            assert targets == {"transformer", "transformer_ref"}
            _assert_outputs_equal(resident, _call(pipe))  # t2va runs on `transformer` only
            assert handle.stats["transformer"].passes == 1
            assert handle.stats["transformer_ref"].passes == 0
        finally:
            handle.disable()
    finally:
        pipe.update_components(transformer_ref=None)


def test_full_pipeline_fl2va_with_a_keyframe(pipe: Any) -> None:
    """The keyframe path too: the PIL image processor, the tiny vision tower and the video VAE encoder."""
    import numpy as np
    from PIL import Image

    keyframe = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True
    )
    try:
        resident = _call(pipe, image=keyframe)
    finally:
        hook.remove()
    assert [plan_key(p) for p in seen] == [plan_key(p) for p in minimax_h3_plans("fl2va", STEPS)]
    handle = enable_adaln_cache(pipe, on_miss="raise")
    try:
        _assert_outputs_equal(resident, _call(pipe, image=keyframe))
        assert handle.stats.passes == 1
    finally:
        handle.disable()


def test_pipeline_holds_a_request_from_its_first_step_to_its_end(pipe: Any, resident: dict[str, torch.Tensor]) -> None:
    """The prepare block holds the request's plans for the whole loop; the call's end releases them,
    whether it returned or a step raised; disable() leaves the loop as it was."""
    from adalncache.integrations.diffusers.minimax_h3 import denoise_loops

    handle = enable_adaln_cache(pipe)
    cache = handle.cache
    distinct = len({plan_key(p) for p in minimax_h3_plans("t2va", STEPS)})
    during: list[int] = []
    calls = [0]

    def observe(*args: Any) -> None:
        calls[0] += 1
        during.append(sum(cache.held_slots.values()))
        if fail_at[0] == calls[0]:
            raise RuntimeError("injected failure in the middle of the loop")

    fail_at = [0]
    hook = pipe.transformer.register_forward_pre_hook(observe)
    try:
        _assert_outputs_equal(resident, _call(pipe))
        assert during and all(held == distinct for held in during)  # held at every step
        assert cache.held_slots == {}  # and released after the last one
        calls[0], fail_at[0] = 0, 2
        with pytest.raises(RuntimeError, match="injected"):
            _call(pipe)
        assert cache.held_slots == {}  # released by the exception
        fail_at[0] = 0
        _assert_outputs_equal(resident, _call(pipe))
        assert handle.stats.passes == 1
    finally:
        hook.remove()
        handle.disable()
    assert all("loop_step" not in vars(loop) for loop in denoise_loops(pipe._blocks))


def test_pipeline_with_transformers_loaded_without_projections(pipe: Any, tmp_path: Any) -> None:
    """The documented way: put load_transformer's model in the pipeline, then enable_adaln_cache(pipe)
    adopts its cache (and only adds the prepare block). Outputs equal the same pipeline holding the
    stock from_pretrained model; pipe.to() moves it freely."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from adalncache.diffusers import adaln_cache_handle, load_transformer

    original = pipe.transformer
    original.save_pretrained(tmp_path / "transformer")
    stock = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "transformer")
    try:
        pipe.update_components(transformer=stock)
        expected = _call(pipe)
        loaded = load_transformer(tmp_path / "transformer")
        pipe.update_components(transformer=loaded)
        handle = enable_adaln_cache(pipe)
        assert handle["transformer"] is adaln_cache_handle(loaded)
        with pytest.raises(Exception, match="drop checkpoint="):
            enable_adaln_cache(pipe, tmp_path / "transformer")
        _assert_outputs_equal(expected, _call(pipe))
        assert handle.stats.passes == 1
        pipe.to("cpu")
        _assert_outputs_equal(expected, _call(pipe))
        assert handle.stats.passes == 1
        handle.disable()
        assert loaded.norm_out.linear.weight.device.type == "cpu"
    finally:
        pipe.update_components(transformer=original)
