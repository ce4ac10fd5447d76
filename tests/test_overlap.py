"""A request's pass on a background thread (``overlap=True``): outputs torch.equal, the first step's
plans built first in a transaction of their own, a failure of the pass raised in the request with
the cache as usable as before, and no deadlock between concurrent requests.

Tiny real ``QwenImagePipeline`` / ``QwenImageTransformer2DModel`` and the tiny MiniMax-H3 modular
pipeline; nothing is downloaded.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from typing import Any

import pytest
import torch

from adalncache import BuildError, ConfigError
from adalncache.diffusers import enable_adaln_cache
from adalncache.integrations.diffusers.request import BackgroundPass
from adalncache.reports import FaultPoints

pytest.importorskip("diffusers")

from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_inputs, tiny_qwen_pipeline, tiny_qwen_transformer


class FailAtPublish(FaultPoints):
    """Fails the ``n``-th publish (1-based): the n-th transaction of the cache that reaches it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0

    def check(self, point: str) -> None:
        if point == "publish":
            self.seen += 1
            if self.seen == self.n:
                raise OSError("injected publish failure")


def _qwen_pipe() -> tuple[Any, Any]:
    pipe = tiny_qwen_pipeline(transformer=tiny_qwen_transformer("plain"))
    return pipe, tiny_prompt_embeds(pipe.transformer, seed=1)


def _run(pipe: Any, prompt: dict[str, Any], steps: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe(height=32, width=32, num_inference_steps=steps, generator=generator, output_type="pt", **prompt).images


def test_overlapped_pipeline_requests_are_exact_and_build_the_first_step_first() -> None:
    pipe, prompt = _qwen_pipe()
    resident = {steps: _run(pipe, prompt, steps) for steps in (3, 4)}
    handle = enable_adaln_cache(pipe, overlap=True)
    assert handle["transformer"].config.overlap
    built: list[int] = []
    cache = handle.cache
    original = cache._builder.run

    def spy(order: Any, *args: Any) -> Any:
        built.append(len(order))
        return original(order, *args)

    cache._builder.run = spy
    assert torch.equal(_run(pipe, prompt, 4), resident[4])
    # Two transactions: the first step's plan alone, then the whole schedule (the first one a hit there).
    assert built == [1, 4] and handle.stats.passes == 2 and handle.stats.built_plans == 4
    assert len(cache) == 4
    assert torch.equal(_run(pipe, prompt, 4), resident[4]) and handle.stats.passes == 2  # resident: no pass
    # The 3-step schedule starts at the 4-step one's first timestep: its first transaction is a hit.
    assert torch.equal(_run(pipe, prompt, 3), resident[3]) and handle.stats.passes == 3
    assert built == [1, 4, 3]  # resident plans take the hit path, not a transaction
    cache.check_invariants()
    handle.disable()
    assert torch.equal(_run(pipe, prompt, 4), resident[4])


@pytest.mark.parametrize("failing", [1, 2], ids=["first-transaction", "second-transaction"])
def test_a_failure_in_the_background_pass_raises_in_the_request_and_rolls_back(failing: int) -> None:
    pipe, prompt = _qwen_pipe()
    resident = _run(pipe, prompt)
    handle = enable_adaln_cache(pipe, overlap=True)
    cache = handle.cache
    cache.fault_points = FailAtPublish(failing)
    with pytest.raises(BuildError, match="injected publish failure") as raised:
        _run(pipe, prompt)
    assert raised.value.failed_at == "publish"
    assert cache.stats.failed_builds == 1
    # The failed transaction published nothing; the first one (when it succeeded) stays, whole.
    assert len(cache) == failing - 1
    cache.check_invariants()
    assert not cache._pool.held_slots  # the failed request gave its holds back
    cache.fault_points = FaultPoints()
    assert torch.equal(_run(pipe, prompt), resident)  # as usable as before: the retry builds and is exact
    assert len(cache) == 4
    handle.disable()


class BlockSecondPublish(FaultPoints):
    """Holds the second transaction just before its publish until ``go`` is set."""

    def __init__(self) -> None:
        self.seen = 0
        self.reached = threading.Event()
        self.go = threading.Event()

    def check(self, point: str) -> None:
        if point == "publish":
            self.seen += 1
            if self.seen == 2:
                self.reached.set()
                assert self.go.wait(timeout=120), "the test never let the second transaction publish"


def test_the_first_step_waits_only_for_its_own_plans() -> None:
    """Step 0's forward runs while the rest of the pass is still unpublished; step 1's waits for it."""
    model = tiny_qwen_transformer("plain")
    schedule = [torch.tensor([0.9 - 0.1 * k]) for k in range(3)]
    inputs = tiny_qwen_inputs(model, 1, seed=4)

    def forward(timestep: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(**{**inputs, "timestep": timestep})[0]

    resident = [forward(t) for t in schedule]
    handle = enable_adaln_cache(model)
    faults = BlockSecondPublish()
    handle.cache.fault_points = faults
    outputs: list[torch.Tensor] = []
    step_done = [threading.Event() for _ in schedule]
    errors: list[BaseException] = []

    def request() -> None:  # one request on one thread: its forwards wait on its own background pass
        try:
            handle.start_prepare(schedule)
            for k, timestep in enumerate(schedule):
                outputs.append(forward(timestep))
                step_done[k].set()
            handle.finish()
        except BaseException as exc:
            errors.append(exc)
            faults.go.set()

    thread = threading.Thread(target=request)
    thread.start()
    assert faults.reached.wait(timeout=120)  # the second transaction has projected, not published
    assert step_done[0].wait(timeout=120), errors  # step 0 ran, served from the first transaction alone
    assert len(handle.cache) == 1 and handle.stats.passes == 1
    assert not step_done[1].wait(timeout=0.5)  # step 1 waits: its plan is not published yet
    faults.go.set()
    thread.join(timeout=120)
    assert not thread.is_alive() and errors == []
    assert all(torch.equal(got, ref) for got, ref in zip(outputs, resident)) and len(outputs) == 3
    assert handle.stats.passes == 2 and not handle.cache._pool.held_slots
    handle.disable()


class InterruptAtPublish(FaultPoints):
    def check(self, point: str) -> None:
        if point == "publish":
            raise KeyboardInterrupt


def test_an_interrupt_in_the_background_pass_propagates_as_itself() -> None:
    """Ctrl-C semantics of the pass: rolled back, then raised in the request as itself, not wrapped."""
    pipe, prompt = _qwen_pipe()
    handle = enable_adaln_cache(pipe, overlap=True)
    handle.cache.fault_points = InterruptAtPublish()
    with pytest.raises(KeyboardInterrupt):
        _run(pipe, prompt)
    assert len(handle.cache) == 0 and handle.stats.failed_builds == 1
    assert not handle.cache._pool.held_slots
    handle.cache.check_invariants()
    handle.disable()


def test_concurrent_overlapped_requests_do_not_deadlock() -> None:
    """Two threads, each a request of its own schedule on one transformer, passes in the background."""
    model = tiny_qwen_transformer("plain")
    schedules = [[torch.tensor([1.0 - 0.1 * k - 0.05 * t]) for k in range(4)] for t in range(2)]
    inputs = tiny_qwen_inputs(model, 1, seed=3)

    def forward(timestep: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(**{**inputs, "timestep": timestep})[0]

    resident = [[forward(t) for t in schedule] for schedule in schedules]
    handle = enable_adaln_cache(model, max_plans=8)
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def request(index: int) -> None:
        try:
            handle.start_prepare(schedules[index])
            results[index] = [forward(t) for t in schedules[index]]
            handle.finish()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=request, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "deadlock: a request never finished"
    assert errors == [], "".join(traceback.format_exception(errors[0]))
    for index in range(2):
        assert all(torch.equal(got, ref) for got, ref in zip(results[index], resident[index]))
    assert handle.stats.built_plans == 8
    handle.cache.check_invariants()
    handle.disable()


def test_finish_raises_an_error_no_forward_raised() -> None:
    """A request whose forwards never needed the failed plans still gets the error at its end."""
    model = tiny_qwen_transformer("plain")
    handle = enable_adaln_cache(model)
    handle.cache.fault_points = FailAtPublish(2)
    handle.start_prepare([torch.tensor([0.9]), torch.tensor([0.8])])
    with pytest.raises(BuildError):
        handle.finish()
    handle.finish()  # nothing left to end: a no-op
    handle.cache.check_invariants()
    handle.disable()


def test_a_disabled_handle_refuses_a_new_request_by_its_method_name() -> None:
    """The request methods the handle delegates keep their messages: each names the method refused,
    nothing is held, and ending a request (``release``, ``finish``, ``join_background``) stays a no-op."""
    model = tiny_qwen_transformer("plain")
    handle = enable_adaln_cache(model)
    handle.disable()
    plans = [torch.tensor([0.9])]
    with pytest.raises(ConfigError, match=r"^start_prepare\(\) needs the AdaLN cache enabled"):
        handle.start_prepare(plans)
    with pytest.raises(ConfigError, match=r"^prepare\(\) needs the AdaLN cache enabled"):
        handle.prepare(plans)
    with pytest.raises(ConfigError, match=r"^prepare\(\) needs the AdaLN cache enabled"), handle.request(plans):
        pass
    handle.release()
    handle.finish()
    handle.join_background()
    handle.check_request()


def test_a_background_pass_needs_one_key_per_plan() -> None:
    with pytest.raises(ValueError, match="one key per plan"):
        BackgroundPass(lambda plans: None, [torch.tensor([1.0])], [])  # type: ignore[arg-type, return-value]  # never called


def test_overlap_must_be_a_bool() -> None:
    model = tiny_qwen_transformer("plain")
    with pytest.raises(ConfigError, match="overlap must be True or False"):
        enable_adaln_cache(model, overlap="yes")  # type: ignore[arg-type]  # the wrong type is the point


@pytest.mark.slow
def test_the_minimax_pipeline_overlapped_is_exact() -> None:
    from adalncache.tools.tiny import tiny_pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = tiny_pipeline(size="tiny", seed=0)

    def call() -> dict[str, torch.Tensor]:
        return pipe(
            prompt="a cat playing a piano in the rain",
            height=64,
            width=64,
            num_frames=124,
            num_inference_steps=4,
            generator=torch.Generator().manual_seed(0),
            output=["latents", "audio_latents"],
            output_type="pt",
        )

    resident = call()
    handle = enable_adaln_cache(pipe, overlap=True)
    got = call()
    for name in ("latents", "audio_latents"):
        assert torch.equal(got[name], resident[name]), name
    assert handle.stats.passes == 2  # step 0's plans, then the rest
    assert not handle.cache._pool.held_slots  # the loop's end gave the request's holds back
    handle.disable()


def test_a_hook_bypass_applies_to_the_bypassing_thread_only() -> None:
    """A build runs a module beneath its hooks; a forward on another thread meanwhile still gets the hook."""
    from adalncache.integrations.diffusers.family import bypassing_hooks

    module = torch.nn.Linear(2, 2)
    module.forward = lambda x: torch.full((1,), 7.0)  # type: ignore[method-assign]  # a wrapper, as a hook installs
    x = torch.ones(1, 2)
    seen: list[torch.Tensor] = []
    with bypassing_hooks([module]):
        assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
        other = threading.Thread(target=lambda: seen.append(module(x)))
        other.start()
        other.join()
    assert torch.equal(seen[0], torch.full((1,), 7.0))
    assert torch.equal(module(x), torch.full((1,), 7.0))  # the wrapper is back


def test_a_pass_failing_after_its_request_was_released_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """No thread of the request will raise the error then: it must not vanish at debug level."""
    import logging

    from adalncache.integrations.diffusers.request import BackgroundPass

    go = threading.Event()

    def hold(plans: Any) -> Any:
        go.wait(timeout=30)
        raise OSError("disk gone")

    background = BackgroundPass(hold, [torch.tensor([0.5])], [(1,)]).start()
    background.release()  # the request ends while its pass still runs
    with caplog.at_level(logging.WARNING, logger="adalncache"):
        go.set()
        background.join()
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "disk gone" in r.getMessage()]


def test_no_background_pass_starts_once_disabling_began() -> None:
    """``disable()`` closes the passes before it joins them: a request started on another thread
    afterwards holds in the foreground, never on a pass that would outlive the join."""
    model = tiny_qwen_transformer("plain")
    handle = enable_adaln_cache(model, overlap=True)
    handle.requests.close()
    handle.start_prepare([torch.tensor([0.5])])
    request = handle.requests.current()
    assert request is not None and request.background is None and request.hold is not None
    handle.join_background()
    handle.requests.reopen()
    handle.release()
    handle.disable()
