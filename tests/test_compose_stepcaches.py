"""Step caches with the AdaLN cache: diffusers' ``enable_cache`` configs and cache-dit's DBCache.

Each step cache skips work inside the transformer (attention, feed-forward or whole blocks); none
skips a whole forward of this model, so every step's plan is needed. The rule: over a whole
request, outputs ``torch.equal`` to the same step cache without the AdaLN cache, in both orders of
enabling, with every plan built once before the loop and none built (or missed) inside it
(``on_miss="raise"`` would fail the forward). The step cache must really skip something, or the
comparison proves nothing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache, minimax_h3_raw_vision, register_minimax_h3_block
from adalncache.errors import ConfigError
from adalncache.tools.tiny import LoopResult, TinyRequest, make_request, run_loop, tiny_transformer
from compose_helpers import assert_equal

STEPS = 9  # 8 forwards: enough for the caches to skip after their warm-up steps

pytestmark = pytest.mark.slow


def denoise(model: Any, request: TinyRequest) -> LoopResult:
    """``tiny.run_loop`` with each forward inside ``cache_context`` (what diffusers' step caches read).

    The step's ``sigma`` (the MiniMax-H3 timestep is the noise level in [0, 1]) and index are
    passed as SeaCache needs them; the other caches only need the context's name.
    """

    def next_timestep(step: int) -> None:
        current_timestep["t"] = float(request.plans[min(step + 1, len(request.plans) - 1)].max()) * 1000

    def context(step: int, t: float, steps: int) -> Any:
        return model.cache_context("cond", step_index=step, sigma=t, num_inference_steps=steps)

    current_timestep["t"] = float(request.plans[0].max()) * 1000
    return run_loop(model, request, on_step=next_timestep, step_context=context)


#: Pyramid Attention Broadcast asks a callback for the current timestep on diffusers' 0..1000 scale.
current_timestep = {"t": 1000.0}


def _attention_calls(model: Any) -> dict[str, int]:
    calls = {"attention": 0}

    def count(*_: Any) -> None:
        calls["attention"] += 1

    # A leaf inside the attention: a hook on the attention module itself would also count the calls a
    # step cache answers from its cache without running the attention.
    for block in model.transformer_blocks:
        block.attn.to_q.register_forward_pre_hook(count)
    return calls


def _compare(request: TinyRequest, enable_step_cache: Callable[[Any], Any], *, wraps_forward: bool = False) -> int:
    """Step cache alone vs with the AdaLN cache in both orders; returns the attention calls it skipped.

    A second request runs after ``disable()``: the step cache must be left working (compared with
    the second request of the step cache alone, since its state carries over between requests).
    ``wraps_forward``: the step cache replaces the forward outside diffusers' hook registry, so
    ``disable()`` under it is refused instead (its own test).
    """
    reference = tiny_transformer("tiny")
    calls = _attention_calls(reference)
    enable_step_cache(reference)
    expected = denoise(reference, request)
    skipped = (STEPS - 1) * len(reference.transformer_blocks) - calls["attention"]
    expected_after = denoise(reference, request)
    distinct = len({tuple(plan.tolist()) for plan in request.plans})
    for order in ("adalncache first", "step cache first"):
        model = tiny_transformer("tiny")
        if order == "step cache first":
            enable_step_cache(model)
        handle = enable_adaln_cache(model, on_miss="raise")
        if order == "adalncache first":
            enable_step_cache(model)
        handle.prepare(request.plans)
        assert_equal(denoise(model, request), expected)
        stats = handle.stats
        assert (stats.built_plans, stats.passes) == (distinct, 1), (order, stats)
        if wraps_forward and order == "adalncache first":
            continue
        handle.disable()
        assert_equal(denoise(model, request), expected_after)
    return skipped


@pytest.fixture(scope="module")
def request_9() -> TinyRequest:
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    return make_request(tiny_transformer("tiny"), "t2va", STEPS)


def test_taylorseer(request_9: TinyRequest) -> None:
    from diffusers.hooks import TaylorSeerCacheConfig

    skipped = _compare(
        request_9, lambda m: m.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))
    )
    assert skipped > 0


def test_pyramid_attention_broadcast(request_9: TinyRequest) -> None:
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    def config() -> Any:
        return PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: current_timestep["t"],
        )

    assert _compare(request_9, lambda m: m.enable_cache(config())) > 0


def test_text_kv_cache(request_9: TinyRequest) -> None:
    """Accepted for this model; it caches nothing here (text rows are part of the packed sequence)."""
    from diffusers.hooks import TextKVCacheConfig

    _compare(request_9, lambda m: m.enable_cache(TextKVCacheConfig()))


def test_block_caches_need_the_block_registered_then_are_exact(request_9: TinyRequest) -> None:
    """First-block cache, MagCache (calibrated on this model) and SeaCache, after ``register_minimax_h3_block``."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, SeaCacheConfig
    from diffusers.hooks._helpers import TransformerBlockRegistry
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    if MiniMaxH3TransformerBlock not in TransformerBlockRegistry._registry:
        with pytest.raises(ValueError, match="not registered"):
            tiny_transformer("tiny").enable_cache(FirstBlockCacheConfig(threshold=0.5))
    register_minimax_h3_block()
    assert register_minimax_h3_block() is False  # idempotent

    assert _compare(request_9, lambda m: m.enable_cache(FirstBlockCacheConfig(threshold=0.5))) > 0

    calibrating = tiny_transformer("tiny")
    calibrating.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS - 1))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        denoise(calibrating, request_9)
    ratios = [float(x) for x in re.findall(r"\[([-0-9.e, ]+)\]", printed.getvalue())[-1].split(",")]
    mag = {"mag_ratios": ratios, "num_inference_steps": STEPS - 1, "threshold": 0.5, "retention_ratio": 0.1}
    assert _compare(request_9, lambda m: m.enable_cache(MagCacheConfig(**mag))) > 0

    sea = {"threshold": 1.0, "raw_vision_callback": minimax_h3_raw_vision}
    assert _compare(request_9, lambda m: m.enable_cache(SeaCacheConfig(**sea))) > 0


def test_faster_cache_fails_in_diffusers_itself(request_9: TinyRequest) -> None:
    """Not a row the AdaLN cache can support: the model without it fails (diffusers 0.42.1)."""
    from diffusers.hooks import FasterCacheConfig

    model = tiny_transformer("tiny")
    model.enable_cache(
        FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: current_timestep["t"],
            is_guidance_distilled=True,
        )
    )
    with pytest.raises(TypeError):
        denoise(model, request_9)


# -------------------------------------------------------------------------------------------- cache-dit


def _cache_dit(model: Any) -> Any:
    cache_dit = pytest.importorskip("cache_dit", reason="cache-dit is installed by the compose extra")
    from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern

    adapter = BlockAdapter(
        transformer=model,
        blocks=model.transformer_blocks,
        forward_pattern=ForwardPattern.Pattern_3,
        check_forward_pattern=True,
    )
    config = DBCacheConfig(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        residual_diff_threshold=0.5,
        max_warmup_steps=2,
        num_inference_steps=STEPS - 1,
    )
    return cache_dit.enable_cache(adapter, cache_config=config)


def test_cache_dit_dbcache_in_both_orders(request_9: TinyRequest) -> None:
    """cache-dit swaps ``transformer_blocks`` for its own wrapper during its forward; the cache still finds them."""
    assert _compare(request_9, _cache_dit, wraps_forward=True) > 0


def test_disable_under_cache_dit_is_refused_not_silent(request_9: TinyRequest) -> None:
    """``disable()`` would drop cache-dit's forward wrapper if cache-dit came second: refused with advice.

    In the other order (cache-dit first) disabling the AdaLN cache leaves cache-dit working.
    """
    reference = tiny_transformer("tiny")
    _cache_dit(reference)
    expected = denoise(reference, request_9)

    model = tiny_transformer("tiny")
    handle = enable_adaln_cache(model)
    _cache_dit(model)
    handle.prepare(request_9.plans)
    with pytest.raises(ConfigError, match=r"wrapped the transformer's forward"):
        handle.disable()
    assert handle.enabled
    assert_equal(denoise(model, request_9), expected)  # still served, cache-dit still there

    model = tiny_transformer("tiny")
    _cache_dit(model)
    handle = enable_adaln_cache(model)
    handle.prepare(request_9.plans)
    handle.disable()
    assert_equal(denoise(model, request_9), expected)
