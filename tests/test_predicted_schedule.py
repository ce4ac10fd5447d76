"""A ``QwenImagePipeline`` call's pass started before its prompt is encoded (``overlap=True``).

The schedule is predicted from the call's arguments; the request's first forward adopts the pass
only when the scheduler set the same plans, bit for bit. Checked here: the prediction equals the
pipeline's own timesteps over sizes, step counts, ``sigmas``, given latents and batches; the pass
is running before ``encode_prompt`` is called; an adopted prediction costs no extra pass; a wrong,
failing or unreadable prediction never serves a row, never fails the request, and leaves no hold;
``disable()`` gives the pipeline its own class back. Tiny real pipelines; nothing is downloaded.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import pytest
import torch

from adalncache.diffusers import enable_adaln_cache
from adalncache.reports import FaultPoints

pytest.importorskip("diffusers")

from diffusers import QwenImagePipeline

from adalncache.integrations.diffusers.qwen_image import QwenImage, predicted_timesteps
from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline, tiny_qwen_transformer


class _Stop(Exception):
    """Stops a pipeline call once its scheduler's timesteps are set."""


def _pipe() -> Any:
    return tiny_qwen_pipeline(transformer=tiny_qwen_transformer("plain"))


def _call_arguments(pipe: Any, **call: Any) -> dict[str, Any]:
    """``call`` bound to ``QwenImagePipeline.__call__``'s parameters, defaults applied (as the watch sees it)."""
    import inspect

    bound = inspect.signature(QwenImagePipeline.__call__).bind(pipe, **call)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["self"]
    return arguments


def _timesteps_the_pipeline_sets(pipe: Any, **call: Any) -> torch.Tensor:
    """Run the pipeline up to its ``set_timesteps`` (the resident pipeline, no cache) and return them."""
    scheduler = pipe.scheduler
    original = scheduler.set_timesteps

    @functools.wraps(original)  # the pipeline inspects its signature for `sigmas`
    def set_timesteps(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        raise _Stop

    scheduler.set_timesteps = set_timesteps
    try:
        with pytest.raises(_Stop):
            pipe(output_type="latent", **call)
    finally:
        del scheduler.set_timesteps
    return scheduler.timesteps.clone()


CASES = {
    "32x32-4-steps": {"height": 32, "width": 32, "num_inference_steps": 4},
    "48x80-7-steps": {"height": 48, "width": 80, "num_inference_steps": 7},
    "odd-size": {"height": 40, "width": 72, "num_inference_steps": 3},
    "default-size": {"num_inference_steps": 2},
    "own-sigmas": {"height": 32, "width": 32, "num_inference_steps": 3, "sigmas": [1.0, 0.6, 0.25]},
}


@pytest.mark.parametrize("call", list(CASES.values()), ids=list(CASES))
def test_the_predicted_timesteps_are_the_pipelines_own(call: dict[str, Any]) -> None:
    pipe = _pipe()
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    expected = _timesteps_the_pipeline_sets(pipe, **call, **prompt)
    predicted = predicted_timesteps(pipe, _call_arguments(pipe, **call, **prompt))
    assert torch.equal(predicted, expected)


def test_given_latents_set_the_predicted_shift() -> None:
    """Latents passed in are used as they are: their length, not the call's size, sets ``mu``."""
    pipe = _pipe()
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    latents = torch.randn(1, 24, pipe.transformer.config.in_channels, generator=torch.Generator().manual_seed(2))
    call = {"height": 32, "width": 32, "num_inference_steps": 5, "latents": latents}
    expected = _timesteps_the_pipeline_sets(pipe, **call, **prompt)
    assert torch.equal(predicted_timesteps(pipe, _call_arguments(pipe, **call, **prompt)), expected)
    without = predicted_timesteps(pipe, _call_arguments(pipe, **{**call, "latents": None}, **prompt))
    assert not torch.equal(without, expected)  # the check above can fail: the latents' length matters


def _run(pipe: Any, embeds: dict[str, Any], **call: Any) -> torch.Tensor:
    arguments = {"height": 32, "width": 32, "num_inference_steps": 4, **call}
    return pipe(generator=torch.Generator().manual_seed(0), output_type="pt", **arguments, **embeds).images


BATCHES = {
    "one": {},
    "two-images-per-prompt": {"num_images_per_prompt": 2},
    "two-prompts": {"batch": 2},
}


@pytest.mark.parametrize("batch", list(BATCHES.values()), ids=list(BATCHES))
def test_an_adopted_prediction_costs_no_extra_pass_and_is_exact(
    batch: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    pipe = _pipe()
    prompt = tiny_prompt_embeds(pipe.transformer, batch=batch.pop("batch", 1), seed=1)
    resident = _run(pipe, prompt, **batch)
    handle = enable_adaln_cache(pipe, overlap=True)
    assert isinstance(pipe, QwenImagePipeline) and type(pipe).__name__ == "QwenImagePipeline"
    with caplog.at_level(logging.DEBUG, logger="adalncache"):
        assert torch.equal(_run(pipe, prompt, **batch), resident)
    assert [r for r in caplog.records if "predicted schedule is the request's" in r.getMessage()]
    # Adopted: the overlapped request's two transactions (first step, then all), no pass of its own after it.
    assert handle.stats.passes == 2 and handle.stats.built_plans == 4
    assert torch.equal(_run(pipe, prompt, **batch), resident) and handle.stats.passes == 2
    handle.join_background()
    assert not handle.cache._pool.held_slots
    handle.disable()
    assert type(pipe) is QwenImagePipeline and '"_class_name": "QwenImagePipeline"' in pipe.to_json_string()


class BlockUntil(FaultPoints):
    """The first publish waits for ``go`` (at most ``timeout`` seconds); ``reached`` says it got there."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.reached = threading.Event()
        self.go = threading.Event()

    def check(self, point: str) -> None:
        if point == "publish" and not self.reached.is_set():
            self.reached.set()
            self.go.wait(timeout=self.timeout)


def test_the_pass_runs_before_the_prompt_is_encoded() -> None:
    """``encode_prompt`` is entered only once the pass is about to publish its first step's plans."""
    pipe = _pipe()
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    resident = _run(pipe, prompt)
    handle = enable_adaln_cache(pipe, overlap=True)
    faults = BlockUntil(timeout=60)
    handle.cache.fault_points = faults
    seen: list[bool] = []
    encode = pipe.encode_prompt

    def encode_prompt(*args: Any, **kwargs: Any) -> Any:
        seen.append(faults.reached.wait(timeout=60))  # False: no pass reached its publish while encoding waited
        faults.go.set()
        return encode(*args, **kwargs)

    pipe.encode_prompt = encode_prompt
    assert torch.equal(_run(pipe, prompt), resident)
    assert seen == [True] and handle.stats.passes == 2
    del pipe.encode_prompt
    handle.disable()


def _shifted(self: QwenImage, model: Any, pipeline: Any, call: Any, component: str) -> Any:
    """A wrong prediction: every timestep a little off the pipeline's."""
    plans = ORIGINAL_PREDICT(self, model, pipeline, call, component)
    return [plan * 0.99 for plan in plans]


ORIGINAL_PREDICT = QwenImage.predict_schedule


def _overlapped(monkeypatch: pytest.MonkeyPatch, predict: Any) -> tuple[Any, dict[str, Any], torch.Tensor, Any]:
    """A tiny pipeline, its prompt, its resident images, and its overlapped handle predicting with ``predict``."""
    pipe = _pipe()
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    resident = _run(pipe, prompt)
    handle = enable_adaln_cache(pipe, overlap=True)
    monkeypatch.setattr(QwenImage, "predict_schedule", predict)
    return pipe, prompt, resident, handle


def test_a_wrong_prediction_is_dropped_and_the_real_schedule_built(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pipe, prompt, resident, handle = _overlapped(monkeypatch, _shifted)
    with caplog.at_level(logging.INFO, logger="adalncache"):
        assert torch.equal(_run(pipe, prompt), resident)
    assert any("was not the request's; dropped" in record.getMessage() for record in caplog.records)
    # The prediction's two transactions, then the request's own two (from its first forward).
    assert handle.stats.passes == 4 and handle.stats.built_plans == 8
    handle.join_background()
    assert not handle.cache._pool.held_slots
    handle.cache.check_invariants()
    handle.disable()


class FailFirstPublish(FaultPoints):
    def __init__(self) -> None:
        self.failed = False

    def check(self, point: str) -> None:
        if point == "publish" and not self.failed:
            self.failed = True
            raise OSError("injected publish failure")


def test_a_failing_wrong_prediction_is_no_error_of_the_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pipe, prompt, resident, handle = _overlapped(monkeypatch, _shifted)
    handle.cache.fault_points = faults = FailFirstPublish()
    with caplog.at_level(logging.WARNING, logger="adalncache"):
        assert torch.equal(_run(pipe, prompt), resident)
        handle.join_background()
    assert faults.failed and handle.stats.failed_builds == 1
    ours = [r for r in caplog.records if r.name.startswith("adalncache") and r.levelno >= logging.WARNING]
    assert not ours  # the failure was no request's
    assert not handle.cache._pool.held_slots
    handle.cache.check_invariants()
    handle.disable()


def test_a_prediction_that_raises_starts_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: QwenImage, model: Any, pipeline: Any, call: Any, component: str) -> Any:
        raise KeyError("num_inference_steps")

    pipe, prompt, resident, handle = _overlapped(monkeypatch, broken)
    with caplog.at_level(logging.DEBUG, logger="adalncache"):
        assert torch.equal(_run(pipe, prompt), resident)
    messages = [r.getMessage() for r in caplog.records]
    assert any("no schedule predicted for this call" in m for m in messages)
    assert not any("predicted schedule is the request's" in m for m in messages)  # nothing to adopt
    assert handle.stats.passes == 2  # the first forward started the request's pass, as without a prediction
    handle.disable()


def test_a_call_that_fails_before_its_first_forward_gives_the_prediction_back() -> None:
    pipe = _pipe()
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    handle = enable_adaln_cache(pipe, overlap=True)
    with pytest.raises(ValueError):
        _run(pipe, prompt, height=32, width=32, callback_on_step_end_tensor_inputs=["not_a_tensor"])
    handle.join_background()
    assert handle.stats.passes >= 1 and len(handle.cache) == 4  # the prediction's pass did run ...
    assert not handle.cache._pool.held_slots  # ... and gave its holds back when the call failed
    resident_after = _run(pipe, prompt)  # the cache is as usable as before
    handle.disable()
    assert torch.equal(resident_after, _run(pipe, prompt))


def test_a_call_patched_onto_the_class_later_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The swapped class finds its parent's ``__call__`` at each call: a wrapper another library puts on
    the pipeline class after an enable/disable cycle runs when the cache is enabled again."""
    pipe = _pipe()
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    enable_adaln_cache(pipe, overlap=True).disable()
    calls: list[int] = []
    stock = QwenImagePipeline.__call__

    @functools.wraps(stock)
    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return stock(self, *args, **kwargs)

    monkeypatch.setattr(QwenImagePipeline, "__call__", patched)
    resident = _run(pipe, prompt)
    handle = enable_adaln_cache(pipe, overlap=True)
    assert torch.equal(_run(pipe, prompt), resident)
    assert calls == [1, 1]
    handle.disable()


def test_the_pipeline_class_is_swapped_while_enabled_and_given_back() -> None:
    """Every call is bracketed (with or without ``overlap``): the instance's class is a same-named subclass
    of its own while enabled, and its own class again after ``disable()``."""
    pipe = _pipe()
    handle = enable_adaln_cache(pipe)
    assert type(pipe) is not QwenImagePipeline and isinstance(pipe, QwenImagePipeline)
    assert type(pipe).__name__ == "QwenImagePipeline" and type(pipe).__module__ == QwenImagePipeline.__module__
    handle.disable()
    assert type(pipe) is QwenImagePipeline


def test_a_pipeline_encoding_its_own_prompts_adopts_the_prediction(caplog: pytest.LogCaptureFixture) -> None:
    """A real tokenizer and text encoder: two prompts, two images each, true CFG (two encodings)."""
    pipe = tiny_qwen_pipeline(text_encoder_layers=2)
    call = {
        "prompt": ["a cat playing a piano in the rain", "waves crash on a rocky shore"],
        "negative_prompt": ["the quick brown fox", "a drone shot"],
        "true_cfg_scale": 2.0,
        "num_images_per_prompt": 2,
    }
    resident = _run(pipe, {}, **call)
    handle = enable_adaln_cache(pipe, overlap=True)
    with caplog.at_level(logging.DEBUG, logger="adalncache"):
        assert torch.equal(_run(pipe, {}, **call), resident)
    assert [r for r in caplog.records if "predicted schedule is the request's" in r.getMessage()]
    assert handle.stats.passes == 2 and resident.shape[0] == 4
    handle.disable()


# -- load_transformer, and a cold checkpoint ---------------------------------------------------------


def _saved(tmp_path: Any) -> Any:
    from adalncache.tools.tiny import save_tiny

    directory = tmp_path / "transformer"
    save_tiny(tiny_qwen_transformer("plain"), directory, dtype=torch.float32)
    return directory


def test_load_transformer_takes_overlap_and_the_pipeline_keeps_it(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from adalncache.diffusers import load_transformer

    directory = _saved(tmp_path)
    stock = tiny_qwen_pipeline(transformer=type(tiny_qwen_transformer()).from_pretrained(directory).eval())
    prompt = tiny_prompt_embeds(stock.transformer, seed=1)
    resident = _run(stock, prompt)
    pipe = tiny_qwen_pipeline(transformer=load_transformer(directory, torch_dtype=torch.float32, overlap=True))
    handle = enable_adaln_cache(pipe)
    assert handle["transformer"].config.overlap
    with caplog.at_level(logging.DEBUG, logger="adalncache"):
        assert torch.equal(_run(pipe, prompt), resident)
    assert [r for r in caplog.records if "predicted schedule is the request's" in r.getMessage()]
    handle.disable()


def test_overlap_cannot_be_turned_on_for_a_transformer_load_transformer_enabled(tmp_path: Any) -> None:
    from adalncache import ConfigError
    from adalncache.diffusers import adaln_cache_handle, load_transformer

    pipe = tiny_qwen_pipeline(transformer=load_transformer(_saved(tmp_path), torch_dtype=torch.float32))
    with pytest.raises(ConfigError, match="pass overlap=True to load_transformer"):
        enable_adaln_cache(pipe, overlap=True)
    assert type(pipe) is QwenImagePipeline  # nothing changed: no watch, no class swap
    assert "set_timesteps" not in pipe.scheduler.__dict__
    handle = adaln_cache_handle(pipe.transformer)
    assert handle is not None and handle.enabled and not handle.config.overlap
    handle.disable()


def test_a_cold_checkpoint_is_read_once_a_warm_one_first_step_first(tmp_path: Any) -> None:
    """From a checkpoint the page cache does not hold, the first step's own transaction would read every
    layer twice (O_DIRECT keeps nothing cached): the overlapped pass is one transaction there."""
    from adalncache.diffusers import load_transformer
    from adalncache.integrations.diffusers.request import split_pays
    from adalncache.tools.measure import drop_page_cache

    directory = _saved(tmp_path)
    files = sorted(directory.glob("*.safetensors"))
    pipe = tiny_qwen_pipeline(transformer=load_transformer(directory, torch_dtype=torch.float32, overlap=True))
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    handle = enable_adaln_cache(pipe)
    source = handle.cache.source
    drop_page_cache(files)
    if source.cached_fraction() != 0.0:
        pytest.skip("this filesystem keeps the files cached: nothing to measure")
    assert not split_pays(source)
    cold = _run(pipe, prompt)
    handle.join_background()
    assert handle.stats.passes == 1 and handle.stats.built_plans == 4
    for path in files:  # warm: every byte read through the page cache
        path.read_bytes()
    assert source.cached_fraction() == 1.0 and split_pays(source)
    handle.cache.invalidate()
    assert torch.equal(_run(pipe, prompt), cold)
    handle.join_background()
    assert handle.stats.passes == 3  # the first step's plans, then all of them
    handle.disable()


@pytest.mark.parametrize("plans", [None, torch.tensor([0.5]), "0.5"], ids=["None", "one tensor", "a string"])
def test_predicted_request_refuses_what_is_not_a_list_of_plans(plans: Any) -> None:
    from adalncache import PlanError

    pipe = _pipe()
    handle = enable_adaln_cache(pipe, overlap=True)
    with (
        pytest.raises(PlanError, match="plans must be a list of plans"),
        handle["transformer"].predicted_request(plans),
    ):
        pass
    assert not handle.cache._pool.held_slots and handle.stats.passes == 0
    handle.disable()
