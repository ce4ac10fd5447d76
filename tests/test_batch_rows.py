"""Forwards of any batch width at default options: rows of equal keying inputs share a slab row.

A diffusers pipeline sends one row per image (``num_images_per_prompt`` x prompts, twice with a
concatenated CFG): a plan of 8, 16 or 32 equal timesteps. The slab keeps ``max_plan_width=4`` rows
per plan; the build projects the plan at its own M and stores each distinct row once where the GEMM
gave rows of equal inputs the same bits (checked per build), and the forward reads every row through
the slot's row map. Each test compares with the resident model by ``torch.equal`` and checks the
slab rows the plan occupies (its distinct rows, not its batch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import adaln_zero_helpers as tiny
from adalncache import AdalnCache, BuildError, PlanError
from adalncache.diffusers import enable_adaln_cache
from adalncache.plans import plan_key, slab_rows


def _slab_rows(cache: AdalnCache) -> dict[int, int]:
    """Plan rows -> slab rows of every resident plan (the slab's ``plan_lengths``)."""
    lengths = cache.plan_lengths.tolist()
    columns = cache.spec.plan_columns
    return {len(key) // columns: lengths[cache.slot_of(key)] for key in cache.resident_plans}


def test_qwen_image_eight_images_with_true_cfg() -> None:
    """QwenImagePipeline, num_images_per_prompt=8 with true CFG (cond and uncond run as two forwards of 8
    rows): images torch.equal, one pass, each plan in one slab row."""
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline()
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    negative = tiny_prompt_embeds(pipe.transformer, seed=2)

    def run() -> torch.Tensor:
        return pipe(
            height=32,
            width=32,
            num_inference_steps=3,
            num_images_per_prompt=8,
            true_cfg_scale=4.0,
            negative_prompt_embeds=negative["prompt_embeds"],
            negative_prompt_embeds_mask=negative["prompt_embeds_mask"],
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
            **prompt,
        ).images

    resident = run()
    handle = enable_adaln_cache(pipe)
    assert handle.cache.max_plan_width == 4
    assert torch.equal(run(), resident) and handle.stats.passes == 1
    assert _slab_rows(handle.cache) == {8: 1}
    handle.cache.check_invariants()
    assert torch.equal(run(), resident) and handle.stats.passes == 1  # a repeat builds nothing
    handle.disable()


def test_a_concatenated_cfg_of_sixteen_images_is_thirty_two_rows() -> None:
    """AuraFlow concatenates cond and uncond: 16 images a prompt make forwards of 32 equal rows."""
    pipeline = "AuraFlowPipeline"
    name = next(n for n, p in tiny.PIPELINES.items() if pipeline in p)
    pipe = tiny.tiny_pipeline(tiny.pipeline_transformer(name), pipeline)
    kwargs = tiny.request(pipe, 2) | {"num_images_per_prompt": 16}
    seen: list[int] = []
    pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: seen.append(int(k["timestep"].shape[0])), with_kwargs=True
    )

    def run() -> torch.Tensor:
        return pipe(**kwargs | {"generator": torch.Generator().manual_seed(0)})[0]

    resident = run()
    assert set(seen) == {32}
    handle = enable_adaln_cache(pipe)
    assert torch.equal(run(), resident) and handle.stats.passes == 1
    assert _slab_rows(handle.cache) == {32: 1}
    handle.cache.check_invariants()
    handle.disable()


def test_hunyuan_image_batch() -> None:
    """HunyuanImage-2.1 (keyed by timestep, timestep_r and guidance): 8 images a prompt, each CFG branch its own
    forward of 8 rows."""
    pipeline = "HunyuanImagePipeline"
    name = next(n for n, p in tiny.PIPELINES.items() if pipeline in p)
    pipe = tiny.tiny_pipeline(tiny.pipeline_transformer(name, **tiny.PIPELINE_FLAGS[pipeline]), pipeline)
    kwargs = tiny.request(pipe, 2) | {"num_images_per_prompt": 8}

    def run() -> torch.Tensor:
        return pipe(**kwargs | {"generator": torch.Generator().manual_seed(0)})[0]

    resident = run()
    handle = enable_adaln_cache(pipe)
    assert torch.equal(run(), resident) and handle.stats.passes == 1
    assert set(_slab_rows(handle.cache).items()) == {(8, 1)}
    handle.cache.check_invariants()
    handle.disable()


def test_minimax_h3_batch_leaves_its_plans_alone() -> None:
    """MiniMax-H3's batch axis is pure replication: the plan (a step's distinct timesteps, which
    ``timestep_indices`` points into) is the same at any batch, so a batch of 3 forwards (fl2va: 2 and 3
    distinct timesteps a step) reads each plan's own rows, torch.equal to the resident model."""
    from adalncache.tools.tiny import make_request, tiny_transformer

    model = tiny_transformer()
    request = make_request(model, "fl2va", 3)

    def forwards() -> list[torch.Tensor]:
        out = []
        for step in range(len(request.plan)):
            kwargs = request.forward_kwargs(step, request.latents, request.audio_latents)
            for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
                kwargs[name] = kwargs[name].expand(3, *kwargs[name].shape[1:]).clone()
            with torch.no_grad():
                out.extend(model(**kwargs))
        return out

    resident = forwards()
    assert resident[0].shape[0] == 3
    handle = enable_adaln_cache(model)
    assert all(torch.equal(a, b) for a, b in zip(forwards(), resident, strict=True))
    assert _slab_rows(handle.cache) == {2: 2, 3: 3}
    handle.disable()


def _qwen_cache(**options: Any) -> tuple[AdalnCache, Any]:
    from adalncache.tools.tiny_qwen import tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline()
    handle = enable_adaln_cache(pipe.transformer, **options)
    return handle.cache, handle


def test_the_real_limit_names_rows_distinct_values_and_the_option() -> None:
    """More distinct rows than the width: refused before anything is built, naming both numbers and the flag."""
    cache, handle = _qwen_cache()
    plan = torch.tensor([0.9, 0.5, 0.9, 0.3, 0.2, 0.1, 0.9, 0.5])
    assert slab_rows(plan_key(plan), 1, 4) == 5
    with pytest.raises(PlanError, match=r"5 distinct timesteps in its 8 rows .*max_plan_width \(CLI --plan-width\)"):
        handle.prepare([plan])
    assert len(cache) == 0
    handle.disable()


def test_rows_that_differ_from_one_gemm_are_never_shared() -> None:
    """The probe runs on every build: a projection giving rows of equal inputs different bits makes the build
    fail (nothing published) with the numbers and the option, never a row served in another's place."""
    cache, handle = _qwen_cache()
    plan = torch.full((6,), 0.5)

    def skewed(layer: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.nn.functional.linear(x, weight, bias)
        y[-1] = y[-1] + 1
        return y

    embed = lambda p: torch.zeros(p.shape[0], cache.spec.in_features, dtype=cache.spec.dtype)  # noqa: E731
    with pytest.raises(BuildError, match=r"6 rows holds 1 distinct values.*at least 6") as info:
        cache.build([plan], embed=embed, project=skewed)
    assert isinstance(info.value.__cause__, PlanError)
    assert len(cache) == 0
    cache.check_invariants()
    cache.build([plan], embed=embed)
    assert _slab_rows(cache) == {6: 1}
    rows = cache.layer_rows(cache.spec.layers()[0], cache.lookup(plan), 6)
    assert rows.shape[0] == 6 and all(torch.equal(rows[i], rows[0]) for i in range(6))
    handle.disable()


def test_a_shared_plan_leaves_the_slab_and_comes_back_from_the_host_tier_exactly() -> None:
    """A plan of 8 equal rows goes to the host tier as 8 rows (as a plan whose rows each have a slab row
    would), comes back with no pass into one slab row, checked again, and reads the same rows."""
    from tiers_support import plan, simple_embed, small_spec, tensor_source

    spec = small_spec()
    cache = AdalnCache(spec, tensor_source(spec), max_plans=2, max_plan_width=4, host_cache_bytes=32 * spec.row_bytes)
    embed = simple_embed(spec)
    batch = plan(*[0.5] * 8)
    cache.build([batch], embed=embed)
    key = plan_key(batch)
    before = cache.rows_of(key)
    assert before.timesteps.shape[0] == 8 and _slab_rows(cache) == {8: 1}
    cache.build([plan(0.3, 0.2), plan(0.1)], embed=embed)  # evicts the batch plan
    assert key not in cache.resident_plans
    report = cache.build([batch], embed=embed)
    assert report.passes == 0 and report.host_hits == 1
    assert _slab_rows(cache)[8] == 1
    after = cache.rows_of(key)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    slot = cache.lookup(batch)
    assert torch.equal(cache.block_rows(0, slot, 8), before.block[:, 0])
    cache.check_invariants()
