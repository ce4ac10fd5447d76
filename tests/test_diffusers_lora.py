"""LoRA on the served modules: every change rebuilds the tables through the module's own LoRA forward.

A real peft LoRA is loaded through diffusers' MiniMax-H3 LoRA loader (``MiniMaxH3LoraLoaderMixin``,
the pipeline's ``load_lora_weights``) into two identical models: one resident, one cached. Each
change (load, set_adapters, attention_kwargs scale, unload) must leave the cached model's outputs
``torch.equal`` to the resident one's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.tools.tiny import LoopResult, TinyRequest, make_request, run_loop
from compose_helpers import write_lora


def _lora_file(model: Any, path: Path, seed: int, rank: int = 4) -> Path:
    """A LoRA in the diffusers format on every served module (plus one attention projection)."""
    names = [f"transformer_blocks.{i}.adaln_proj.linear" for i in range(len(model.transformer_blocks))]
    names += [
        "norm_out.linear",
        "time_embedder.linear_1",
        "time_embedder.linear_2",
        "transformer_blocks.0.attn.to_q",
    ]
    return write_lora(model, names, path, seed, rank)


def _pipeline(model: Any) -> Any:
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=model)
    return pipe


def _assert_equal(a: LoopResult, b: LoopResult) -> None:
    for step, ((video_a, audio_a), (video_b, audio_b)) in enumerate(zip(a.outputs, b.outputs)):
        assert torch.equal(video_a, video_b), f"video differs at step {step}"
        assert torch.equal(audio_a, audio_b), f"audio differs at step {step}"
    assert torch.equal(a.latents, b.latents) and torch.equal(a.audio_latents, b.audio_latents)


@pytest.fixture
def pair(load_tiny: Callable[[str], Any]) -> tuple[Any, Any, Any, Any, TinyRequest]:
    resident, cached = load_tiny("bf16-disk"), load_tiny("bf16-disk")
    request = make_request(resident, "fl2va", 5, seed=1)
    return resident, cached, _pipeline(resident), _pipeline(cached), request


def test_load_switch_scale_unload(pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path) -> None:
    resident, cached, pipe_r, pipe_c, request = pair
    base = run_loop(resident, request)
    handle = enable_adaln_cache(pipe_c)
    plans = request.plans

    def check(label: str, **kwargs: Any) -> LoopResult:
        handle.prepare(plans, attention_kwargs=kwargs.get("attention_kwargs"))
        expected = run_loop(resident, request, **kwargs)
        got = run_loop(cached, request, **kwargs)
        _assert_equal(expected, got)
        return expected

    one = _lora_file(resident, tmp_path / "one.safetensors", seed=1)
    two = _lora_file(resident, tmp_path / "two.safetensors", seed=2)
    for pipe in (pipe_r, pipe_c):
        pipe.load_lora_weights(str(one), adapter_name="one")
    # peft put the adapter where the model runs, not on the meta placeholder's device.
    assert cached.transformer_blocks[0].adaln_proj.linear.lora_A["one"].weight.device.type == "cpu"
    passes = handle.stats.passes
    with_one = check("load")
    assert handle.stats.passes == passes + 1  # the new LoRA signature rebuilt, once
    assert not with_one.equal(base)  # the LoRA does change the modulation

    for pipe in (pipe_r, pipe_c):
        pipe.load_lora_weights(str(two), adapter_name="two")
        pipe.set_adapters(["one", "two"], [0.7, 0.3])
    switched = check("set_adapters")
    assert not switched.equal(with_one)

    scaled = check("scale", attention_kwargs={"scale": 0.5})
    assert not scaled.equal(switched)
    check("scale back")
    # 0.3 is not a power of two: the decorator's scale-then-divide can leave the scaling an ulp
    # off afterwards, in both models alike; the signature reads the live value, so this stays exact.
    check("scale 0.3", attention_kwargs={"scale": 0.3})
    check("after 0.3")

    for pipe in (pipe_r, pipe_c):
        pipe.set_adapters("two")
    check("switch to two")

    for pipe in (pipe_r, pipe_c):
        pipe.unload_lora_weights()
    _assert_equal(check("unload"), base)

    handle.disable()
    _assert_equal(run_loop(cached, request), base)


def test_forward_without_prepare_rebuilds_after_a_lora_change(
    pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path
) -> None:
    resident, cached, pipe_r, pipe_c, request = pair
    handle = enable_adaln_cache(pipe_c)
    handle.prepare(request.plans)
    path = _lora_file(resident, tmp_path / "lora.safetensors", seed=5)
    for pipe in (pipe_r, pipe_c):
        pipe.load_lora_weights(str(path))
    _assert_equal(run_loop(resident, request), run_loop(cached, request))
    handle.disable()


def test_fuse_while_enabled_raises(pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path) -> None:
    resident, cached, pipe_r, pipe_c, request = pair
    handle = enable_adaln_cache(pipe_c)
    path = _lora_file(resident, tmp_path / "lora.safetensors", seed=7)
    pipe_c.load_lora_weights(str(path), adapter_name="turbo")
    with pytest.raises(ConfigError, match=r"disable\(\)"):
        pipe_c.fuse_lora()
    with pytest.raises(ConfigError, match=r"disable\(\)"):
        cached.fuse_lora()
    with pytest.raises(ConfigError, match=r"disable\(\)"):
        cached.unfuse_lora()
    # Nothing was fused: the cached model still matches a resident model with the LoRA unfused.
    pipe_r.load_lora_weights(str(path), adapter_name="turbo")
    handle.prepare(request.plans)
    _assert_equal(run_loop(resident, request), run_loop(cached, request))
    # The advised sequence works: disable, fuse, enable again (the fused weights are the source).
    handle.disable()
    for pipe in (pipe_r, pipe_c):
        pipe.fuse_lora()
    handle = enable_adaln_cache(pipe_c)
    handle.prepare(request.plans)
    _assert_equal(run_loop(resident, request), run_loop(cached, request))
    handle.disable()


def test_lora_loaded_before_enabling(pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path) -> None:
    resident, cached, pipe_r, pipe_c, request = pair
    path = _lora_file(resident, tmp_path / "lora.safetensors", seed=9)
    for pipe in (pipe_r, pipe_c):
        pipe.load_lora_weights(str(path), adapter_name="style")
    expected = run_loop(resident, request)
    handle = enable_adaln_cache(pipe_c)
    assert cached.norm_out.linear.base_layer.weight.device.type == "meta"
    handle.prepare(request.plans)
    _assert_equal(expected, run_loop(cached, request))
    for pipe in (pipe_r, pipe_c):
        pipe.unload_lora_weights()
    handle.prepare(request.plans)
    _assert_equal(run_loop(resident, request), run_loop(cached, request))
    handle.disable()


def test_a_hotswap_in_place_rebuilds_the_tables(pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path) -> None:
    """peft's hotswap copies the new adapter into the old tensors through ``.data``: nothing the
    signature reads changes but the loader's hotswap counter, so without it the first adapter's
    tables were served under the second."""
    resident, cached, pipe_r, pipe_c, request = pair
    handle = enable_adaln_cache(pipe_c)
    one = _lora_file(resident, tmp_path / "one.safetensors", seed=11)
    two = _lora_file(resident, tmp_path / "two.safetensors", seed=12)
    for pipe in (pipe_r, pipe_c):
        pipe.load_lora_weights(str(one), adapter_name="style")
    handle.prepare(request.plans)
    with_one = run_loop(resident, request)
    _assert_equal(with_one, run_loop(cached, request))
    for pipe in (pipe_r, pipe_c):
        pipe.load_lora_weights(str(two), adapter_name="style", hotswap=True)
    with_two = run_loop(resident, request)
    assert not with_two.equal(with_one)
    _assert_equal(with_two, run_loop(cached, request))
    handle.disable()


def _swap_in_place(model: Any) -> None:
    """A hotswap done on the model directly: new adapter values copied in through ``.data``."""
    generator = torch.Generator().manual_seed(99)
    for name, parameter in model.named_parameters():
        if "lora_B" in name and ("adaln_proj" in name or "norm_out" in name):
            parameter.data.copy_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def test_a_prepared_request_stops_serving_its_rows_after_invalidate(
    pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path
) -> None:
    """``cache.invalidate()`` retires the prepared request's held plans: its forwards rebuild, never the old rows."""
    resident, cached, pipe_resident, pipe_cached, request = pair
    handle = enable_adaln_cache(pipe_cached)
    one = _lora_file(resident, tmp_path / "one.safetensors", seed=11)
    for pipe in (pipe_resident, pipe_cached):
        pipe.load_lora_weights(str(one), adapter_name="style")
    handle.prepare(request.plans)
    before = run_loop(resident, request)
    _assert_equal(before, run_loop(cached, request))
    _swap_in_place(resident)
    _swap_in_place(cached)
    handle.cache.invalidate()
    after = run_loop(resident, request)
    assert not torch.equal(after.latents, before.latents)  # the swap changed the modulation
    _assert_equal(after, run_loop(cached, request))
    handle.release()


def test_prepare_stamps_the_variant_its_plans_were_held_under(
    pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path
) -> None:
    """A LoRA change between prepare's hold and its request: the request keeps the held variant (host path after)."""
    resident, cached, pipe_resident, pipe_cached, request = pair
    handle = enable_adaln_cache(pipe_cached)
    one = _lora_file(resident, tmp_path / "one.safetensors", seed=11)
    two = _lora_file(resident, tmp_path / "two.safetensors", seed=12)
    for pipe in (pipe_resident, pipe_cached):
        pipe.load_lora_weights(str(one), adapter_name="style")
    holds = handle.handles["transformer"].builder
    original = holds.hold

    def hold(*args: Any, **kwargs: Any) -> Any:
        held = original(*args, **kwargs)
        pipe_cached.load_lora_weights(str(two), adapter_name="style", hotswap=True)  # another thread's swap
        return held

    holds.hold = hold  # type: ignore[method-assign]  # the race, injected between the hold and the request
    try:
        handle.prepare(request.plans)
    finally:
        del holds.hold
    pipe_resident.load_lora_weights(str(two), adapter_name="style", hotswap=True)
    _assert_equal(run_loop(resident, request), run_loop(cached, request))
    handle.release()


def test_a_scale_one_read_never_sees_another_thread_s_scaled_build(
    pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path
) -> None:
    """A build under ``scale=0.5`` scales the adapters in place (under the lock); a concurrent read at 1 waits."""
    import threading

    from adalncache.integrations.diffusers.signature import applied_lora_scale

    resident, _, _, pipe_cached, _ = pair
    handle = enable_adaln_cache(pipe_cached)
    pipe_cached.load_lora_weights(str(_lora_file(resident, tmp_path / "one.safetensors", seed=11)), adapter_name="s")
    holds = handle.handles["transformer"].builder
    own, half = holds.variant_of(None), holds.variant_of({"scale": 0.5})
    assert own != half
    tuners, _, _ = holds.signature.read(0.5)
    read: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: read.setdefault("variant", holds.variant_of(None)))
    with holds.lock, applied_lora_scale(tuners, 0.5):  # what a build does around its projections
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive(), "a scale-1 read went past a build's lock while the adapters were scaled"
    thread.join()
    assert read["variant"] == own


def test_a_hotswap_that_fails_midway_still_rebuilds(
    pair: tuple[Any, Any, Any, Any, TinyRequest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peft raising after copying some tensors through ``.data``: the swap is counted, the next forward rebuilds."""
    resident, cached, pipe_resident, pipe_cached, request = pair
    handle = enable_adaln_cache(pipe_cached)
    one = _lora_file(resident, tmp_path / "one.safetensors", seed=11)
    for pipe in (pipe_resident, pipe_cached):
        pipe.load_lora_weights(str(one), adapter_name="style")
    _assert_equal(run_loop(resident, request), run_loop(cached, request))

    def failing_hotswap(model: Any, *args: Any, **kwargs: Any) -> Any:
        _swap_in_place(model)  # some tensors copied in, then the failure
        raise RuntimeError("hotswap failed midway")

    monkeypatch.setattr(type(cached), "load_lora_adapter", failing_hotswap)
    with pytest.raises(RuntimeError, match="midway"):
        pipe_cached.load_lora_weights(str(one), adapter_name="style", hotswap=True)
    monkeypatch.undo()
    _swap_in_place(resident)
    _assert_equal(run_loop(resident, request), run_loop(cached, request))
    handle.disable()
