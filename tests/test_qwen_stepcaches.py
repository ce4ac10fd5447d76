"""Step caches on Qwen-Image with the AdaLN cache: diffusers' ``enable_cache`` configs and cache-dit.

The stock ``QwenImagePipeline`` (tiny, real classes; prompt embeddings passed since no Qwen2.5-VL
text encoder can be made offline) runs each step inside ``cache_context("cond")``. The rule, as for
MiniMax-H3: over a whole request, images ``torch.equal`` to the same step cache without the AdaLN
cache, in both orders of enabling, the request's schedule built in one pass before its first step
and no plan built or missed inside the loop (``on_miss="raise"`` would fail the forward). Where a
step cache skips work, the test checks it really skipped some, or the comparison proves nothing.

Qwen-Image's block is in diffusers' own block registry, so the block-level caches (first-block
cache, MagCache, SeaCache) need no registration.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

STEPS = 8  # enough for the caches to skip after their warm-up steps

pytestmark = pytest.mark.slow


def _run(pipe: Any) -> torch.Tensor:
    """An eight-step 32x32 request of fixed prompt embeddings and seed, without true CFG."""
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    generator = torch.Generator().manual_seed(0)
    out = pipe(
        height=32,
        width=32,
        num_inference_steps=STEPS,
        true_cfg_scale=1.0,
        generator=generator,
        output_type="pt",
        **prompt,
    )
    return out.images


def _pipeline() -> tuple[Any, dict[str, int]]:
    """A tiny pipeline, and a count of the attention calls its blocks really ran.

    The hook sits on a leaf inside the attention: one on the attention module itself would also
    count the calls a step cache answers from its cache.
    """
    pipe = tiny_qwen_pipeline()
    pipe.set_progress_bar_config(disable=True)
    calls = {"attention": 0}

    def count(*_: Any) -> None:
        calls["attention"] += 1

    for block in pipe.transformer.transformer_blocks:
        block.attn.to_q.register_forward_pre_hook(count)
    return pipe, calls


def _compare(
    enable_step_cache: Callable[[Any], Any],
    *,
    wraps_forward: bool = False,
    overlap: bool = False,
    disable_step_cache: Callable[[Any], Any] | None = None,
) -> int:
    """Step cache alone vs with the AdaLN cache in both orders; returns the attention calls it skipped.

    A second request runs after ``disable()``: the step cache must be left working (compared with
    the second request of the step cache alone, since its state may carry over between requests).
    ``wraps_forward``: the step cache wraps the forward outside diffusers' hook registry, so
    ``disable()`` under it is refused instead, and must leave the pipeline as it was (the second
    request equal too). ``overlap``: the AdaLN cache runs the pass on a background thread (a new
    schedule: two passes). ``disable_step_cache``: called last, where the step cache went first.
    """
    reference, calls = _pipeline()
    enable_step_cache(reference)
    expected = _run(reference)
    skipped = STEPS * len(reference.transformer.transformer_blocks) - calls["attention"]
    expected_after = _run(reference)
    for order in ("adalncache first", "step cache first"):
        pipe, _ = _pipeline()
        if order == "step cache first":
            enable_step_cache(pipe)
        handle = enable_adaln_cache(pipe, on_miss="raise", overlap=overlap)
        if order == "adalncache first":
            enable_step_cache(pipe)
        assert torch.equal(_run(pipe), expected), order
        handle.join_background()
        stats = handle.stats
        assert (stats.built_plans, stats.passes) == (STEPS, 2 if overlap else 1), (order, stats)
        if wraps_forward and order == "adalncache first":
            with pytest.raises(ConfigError, match=r"wrapped the transformer's forward"):
                handle.disable()
            assert torch.equal(_run(pipe), expected_after), order  # refused: the pipeline left as it was
            continue
        handle.disable()
        assert torch.equal(_run(pipe), expected_after), order
        if disable_step_cache is not None:
            disable_step_cache(pipe)  # its own removal still works after the AdaLN cache's
    return skipped


@pytest.fixture(autouse=True, scope="module")
def _quiet() -> None:
    logging.getLogger("diffusers").setLevel(logging.ERROR)


def test_taylorseer() -> None:
    from diffusers.hooks import TaylorSeerCacheConfig

    def enable(pipe: Any) -> None:
        pipe.transformer.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))

    assert _compare(enable) > 0


def test_pyramid_attention_broadcast() -> None:
    """PAB asks for the current timestep: the pipeline's own ``current_timestep`` (0..1000)."""
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    def enable(pipe: Any) -> None:
        config = PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
        )
        pipe.transformer.enable_cache(config)

    assert _compare(enable) > 0


def test_text_kv_cache() -> None:
    """Accepted and exact; it caches the text keys and values inside the attention (no call skipped)."""
    from diffusers.hooks import TextKVCacheConfig

    _compare(lambda pipe: pipe.transformer.enable_cache(TextKVCacheConfig()))


def test_first_block_cache() -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    assert _compare(lambda pipe: pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))) > 0


def test_mag_cache_calibrated_on_the_model() -> None:
    from diffusers.hooks import MagCacheConfig

    calibrating, _ = _pipeline()
    calibrating.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _run(calibrating)
    ratios = [float(x) for x in re.findall(r"\[([-0-9.e, ]+)\]", printed.getvalue())[-1].split(",")]
    mag = {"mag_ratios": ratios, "num_inference_steps": STEPS, "threshold": 0.5, "retention_ratio": 0.1}
    assert _compare(lambda pipe: pipe.transformer.enable_cache(MagCacheConfig(**mag))) > 0


def _raw_vision(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """SeaCache's ``raw_vision_callback``: each sample's packed image rows as a ``(C, 1, H, W)`` latent."""
    hidden = kwargs["hidden_states"]
    latents = []
    for sample, shapes in enumerate(kwargs["img_shapes"]):
        frames, height, width = shapes[0]
        rows = hidden[sample, : frames * height * width]
        latents.append(rows.T.reshape(hidden.shape[-1], frames, height, width))
    return latents


def test_sea_cache_runs_exactly_but_the_stock_pipeline_lets_it_skip_nothing() -> None:
    """SeaCache needs the step index, sigma and step count in ``cache_context``, which QwenImagePipeline
    (diffusers 0.42.1) does not pass: it runs "fail-open" (every block computed), exact with the AdaLN cache."""
    from diffusers.hooks import SeaCacheConfig

    def enable(pipe: Any) -> None:
        pipe.transformer.enable_cache(SeaCacheConfig(threshold=1.0, raw_vision_callback=_raw_vision))

    assert _compare(enable) == 0


def _step_in_cache_context(pipe: Any) -> None:
    """Make the pipeline's ``cache_context("cond")`` carry the step index, sigma and step count SeaCache needs.

    Read from the pipeline's own scheduler at each forward (``step_index`` is None before the first
    step); an instance attribute, so the stock denoising loop itself is unchanged.
    """
    model = pipe.transformer
    stock = type(model).cache_context

    def cache_context(name: str) -> Any:
        scheduler = pipe.scheduler
        step = scheduler.step_index or 0
        sigma = float(scheduler.sigmas[step])
        return stock(model, name, step_index=step, sigma=sigma, num_inference_steps=len(scheduler.timesteps))

    model.cache_context = cache_context


def test_sea_cache_given_the_step_skips_and_is_exact() -> None:
    from diffusers.hooks import SeaCacheConfig

    def enable(pipe: Any) -> None:
        _step_in_cache_context(pipe)
        pipe.transformer.enable_cache(SeaCacheConfig(threshold=1.0, raw_vision_callback=_raw_vision))

    assert _compare(enable) > 0


def test_faster_cache_fails_in_diffusers_itself() -> None:
    """Not a row the AdaLN cache can support: the pipeline without it fails (diffusers 0.42.1)."""
    from diffusers.hooks import FasterCacheConfig

    pipe, _ = _pipeline()
    pipe.transformer.enable_cache(
        FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
            is_guidance_distilled=True,
        )
    )
    with pytest.raises(TypeError):
        _run(pipe)


def _cache_dit(pipe: Any) -> Any:
    cache_dit = pytest.importorskip("cache_dit", reason="cache-dit is installed by the compose extra")
    from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern

    adapter = BlockAdapter(
        pipe=pipe,
        transformer=pipe.transformer,
        blocks=pipe.transformer.transformer_blocks,
        forward_pattern=ForwardPattern.Pattern_1,
        check_forward_pattern=True,
    )
    config = DBCacheConfig(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        residual_diff_threshold=0.5,
        max_warmup_steps=2,
        num_inference_steps=STEPS,
    )
    return cache_dit.enable_cache(adapter, cache_config=config)


def test_cache_dit_dbcache_in_both_orders() -> None:
    assert _compare(_cache_dit, wraps_forward=True) > 0


def test_cache_dit_dbcache_in_both_orders_overlapped() -> None:
    """cache-dit wraps the pipeline class's ``__call__``: over it the AdaLN cache swaps no class (its
    pass starts at the first forward), and under it a refused ``disable()`` keeps cache-dit's wrapper."""
    import cache_dit

    assert _compare(_cache_dit, wraps_forward=True, overlap=True, disable_step_cache=cache_dit.disable_cache) > 0
