"""A pipeline call is one request, ended however the call ends.

The request a pipeline call prepares (its whole schedule, its forwards served on the device) ends in
a ``finally`` when the call returns, raises (in a step callback, in the transformer) or is
interrupted (``pipe._interrupt``): nothing of it stays on the thread. A bare forward afterwards,
with a timestep of its own, takes the host path and is exact (it used to get the poison slot's
NaN), and the next call is served exactly (it used to fail with ``PlanMismatchError`` blaming
itself). Checked on ``QwenImagePipeline`` and HunyuanImage-2.1's pipeline (the AdaLayerNormZero
family), both classic pipelines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import adaln_zero_helpers as tiny
from adalncache import PlanMismatchError
from adalncache.diffusers import enable_adaln_cache
from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline, tiny_qwen_transformer

STEPS = 3


def _qwen() -> tuple[Any, Callable[..., Any]]:
    pipe = tiny_qwen_pipeline(transformer=tiny_qwen_transformer("plain"))
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)

    def run(**extra: Any) -> Any:
        generator = torch.Generator().manual_seed(0)
        kwargs = {"height": 32, "width": 32, "num_inference_steps": STEPS, "output_type": "latent"}
        return pipe(generator=generator, **kwargs, **prompt, **extra).images

    return pipe, run


def _hunyuan_image() -> tuple[Any, Callable[..., Any]]:
    name, pipeline = "HunyuanImageTransformer2DModel", "HunyuanImagePipeline"
    pipe = tiny.tiny_pipeline(tiny.pipeline_transformer(name, **tiny.PIPELINE_FLAGS[pipeline]), pipeline)
    return pipe, lambda **extra: pipe(**tiny.request(pipe, STEPS), **extra)[0]


PIPELINES = {"QwenImagePipeline": _qwen, "HunyuanImagePipeline": _hunyuan_image}


def _first_forward(pipe: Any, run: Callable[..., Any]) -> dict[str, Any]:
    """The keyword arguments of the call's first transformer forward, its timestep halved: a bare forward
    of the request's plan shape with a timestep of its own."""
    seen: list[dict[str, Any]] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(dict(kwargs)) if not seen else None, with_kwargs=True
    )
    try:
        run()
    finally:
        hook.remove()
    kwargs = seen[0]
    kwargs["timestep"] = kwargs["timestep"] * 0.5
    return kwargs


def _bare(pipe: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        out = pipe.transformer(**kwargs)
    return out[0] if isinstance(out, tuple) else out.sample


def _interrupt_at_step_one(pipe: Any, step: int, t: Any, outputs: dict[str, Any]) -> dict[str, Any]:
    pipe._interrupt = step >= 1
    return {}


def _raise_at_step_one(pipe: Any, step: int, t: Any, outputs: dict[str, Any]) -> dict[str, Any]:
    if step == 1:
        raise RuntimeError("a callback failed")
    return {}


@pytest.mark.parametrize("ending", ["interrupted", "callback raises", "transformer raises"])
@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_a_call_that_ends_early_leaves_nothing_on_its_thread(pipeline: str, ending: str) -> None:
    pipe, run = PIPELINES[pipeline]()
    bare = _first_forward(pipe, run)
    resident, resident_bare = run(), _bare(pipe, bare)
    handle = enable_adaln_cache(pipe)
    cache = handle.cache
    if ending == "interrupted":
        run(callback_on_step_end=_interrupt_at_step_one)
    elif ending == "callback raises":
        with pytest.raises(RuntimeError, match="a callback failed"):
            run(callback_on_step_end=_raise_at_step_one)
    else:
        forwards = [0]

        def fail_second(*_: Any) -> None:
            forwards[0] += 1
            if forwards[0] == 2:
                raise RuntimeError("the transformer failed")

        hook = pipe.transformer.register_forward_pre_hook(fail_second)
        try:
            with pytest.raises(RuntimeError, match="the transformer failed"):
                run()
        finally:
            hook.remove()
    assert cache.held_slots == {}, "the call's request outlived it"
    assert handle["transformer"].requests.current() is None
    served = _bare(pipe, bare)
    assert not torch.isnan(served).any() and torch.equal(served, resident_bare)  # the host path, exact
    handle.check_request()  # nothing was served the poison slot
    assert torch.equal(run(), resident)  # the next call: exact, no PlanMismatchError
    assert cache.held_slots == {}
    handle.disable()


def test_a_failing_call_raises_its_own_error_and_notes_its_mismatch() -> None:
    """A forward of the call matched none of its plans (NaN), then the call failed: its own error
    propagates, the mismatch noted on it and never raised over it; nothing is left to report later."""
    pipe, run = _qwen()
    handle = enable_adaln_cache(pipe)
    forwards = [0]

    def nudge_then_fail(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        forwards[0] += 1  # the first forward prepares the schedule; the second matches none of it
        if forwards[0] == 2:
            kwargs["timestep"] = kwargs["timestep"] * 0.999
        if forwards[0] == 3:
            raise RuntimeError("the transformer failed")
        return args, kwargs

    hook = pipe.transformer.register_forward_pre_hook(nudge_then_fail, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="the transformer failed") as caught:
            run()
    finally:
        hook.remove()
    assert any("1 forward(s) of this request" in note for note in getattr(caught.value, "__notes__", []))
    handle.check_request()  # reported with the call's error, not again
    handle.disable()


def test_a_mismatch_of_a_call_that_returned_raises_at_its_end() -> None:
    pipe, run = _qwen()
    resident = run()
    handle = enable_adaln_cache(pipe)
    forwards = [0]

    def nudge_the_second(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        forwards[0] += 1
        return args, {**kwargs, "timestep": kwargs["timestep"] * 0.999} if forwards[0] == 2 else kwargs

    hook = pipe.transformer.register_forward_pre_hook(nudge_the_second, with_kwargs=True)
    try:
        with pytest.raises(PlanMismatchError, match=r"^1 forward\(s\) of this request"):
            run()
    finally:
        hook.remove()
    assert torch.equal(run(), resident)
    handle.disable()
