"""Model-based test of pipeline calls as requests: how a call ends, what it leaves, what upstream changes do.

Why a machine: a call is a request from its start to a ``finally`` (returned, raised in a step
callback or in the transformer, interrupted with ``pipe._interrupt``); a forward of it whose keying
inputs match none of its plans is served NaN and reported at its end; a change to the time
embedder between calls or during one must rebuild; two pipelines sharing one transformer run their
calls on two threads. Bugs of that kind (a request left on the thread, a mismatch lost or raised
over the call's own error, a stale row after a change) show only after particular sequences.

The models: two tiny ``QwenImagePipeline``s sharing one cached transformer (its time embedder kept
on the model, so it can change while enabled), and a resident pipeline whose transformer is changed
the same way. Steps: a call (of 2 to 4 steps, ending any of the ways above, maybe with one forward
nudged off its schedule, maybe changing the time embedder from a step callback), a bare forward with
a timestep of its own, a change to the time embedder between calls, and both pipelines called at
once on two threads. The contract checked after every step:

* a call that returned or was interrupted gives the resident pipeline's latents, bit for bit, unless
  one of its forwards was nudged: it then raises ``PlanMismatchError`` at its end; a call that raised
  raises its own error, a nudge's mismatch noted on it; a bare forward equals the resident one;
* after every call nothing is held and no request is live on the thread; ``check_request()`` has
  nothing to report; the cache's invariants hold.

Profiles: ``make test`` runs a few derandomized sequences; ``ADALNCACHE_SOAK=1`` (``make soak``) runs
many random ones.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from adalncache import PlanMismatchError
from adalncache.diffusers import enable_adaln_cache
from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_inputs, tiny_qwen_pipeline, tiny_qwen_transformer
from tiny_helpers import register_state_machine_profiles

register_state_machine_profiles("requests", ci=(4, 5), soak=(300, 15))

ENDINGS = ("returned", "interrupted", "callback raises", "transformer raises")
#: The time embedder tensor a change scales in place (kept on the model: free_time_embedder=False).
CHANGED = "time_text_embed.timestep_embedder.linear_1.weight"


class Failed(RuntimeError):
    """The error a step callback or the transformer raises on purpose."""


def _change(model: Any) -> None:
    with torch.no_grad():
        model.get_parameter(CHANGED).mul_(1.25)


class Call:
    """One call's plan: its steps, how it ends and at which step, a nudged forward, a change mid-call."""

    def __init__(self, steps: int, ending: str, at: int, nudge: int | None, change_at: int | None) -> None:
        self.steps, self.ending, self.at, self.nudge, self.change_at = (
            steps,
            ending,
            min(at, steps - 1),
            nudge,
            change_at,
        )

    def run(self, pipe: Any, prompt: dict[str, Any], *, cached: bool) -> torch.Tensor:
        forwards = [0]

        def pre_forward(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            forwards[0] += 1
            if self.ending == "transformer raises" and forwards[0] == self.at + 1:
                raise Failed("the transformer failed")
            if cached and self.nudge is not None and forwards[0] == self.nudge + 1:
                kwargs = {**kwargs, "timestep": kwargs["timestep"] * 0.999}
            return args, kwargs

        def on_step_end(p: Any, step: int, t: Any, outputs: dict[str, Any]) -> dict[str, Any]:
            if self.change_at == step:
                _change(p.transformer)
            if step == self.at and self.ending == "callback raises":
                raise Failed("a callback failed")
            p._interrupt = self.ending == "interrupted" and step >= self.at
            return {}

        hook = pipe.transformer.register_forward_pre_hook(pre_forward, with_kwargs=True)
        try:
            generator = torch.Generator().manual_seed(0)
            out = pipe(
                height=32,
                width=32,
                num_inference_steps=self.steps,
                generator=generator,
                output_type="latent",
                callback_on_step_end=on_step_end,
                **prompt,
            )
            return out.images
        finally:
            hook.remove()

    @property
    def raises(self) -> bool:
        return self.ending in ("callback raises", "transformer raises")

    @property
    def nudged(self) -> bool:
        """Whether the nudged forward runs (one of step 1 on: the first forward prepares the schedule)."""
        last = self.at if self.ending != "returned" else self.steps - 1
        return (
            self.nudge is not None
            and self.nudge <= last
            and not (self.ending == "transformer raises" and self.nudge >= self.at)
        )


class RequestsMachine(RuleBasedStateMachine):
    """The changes applied so far (to both transformers) and what the cached pipelines are."""

    def __init__(self) -> None:
        super().__init__()
        self.resident = tiny_qwen_pipeline(transformer=tiny_qwen_transformer("plain", seed=0))
        self.model = tiny_qwen_transformer("plain", seed=0)
        self.pipes = [tiny_qwen_pipeline(transformer=self.model), tiny_qwen_pipeline(transformer=self.model)]
        self.prompt = tiny_prompt_embeds(self.model, seed=1)
        self.handles: list[Any] = []

    @initialize()
    def enable(self) -> None:
        self.handles = [enable_adaln_cache(pipe, free_time_embedder=False) for pipe in self.pipes]
        assert self.handles[1]["transformer"] is self.handles[0]["transformer"]  # one transformer, one cache

    def teardown(self) -> None:
        for handle in reversed(self.handles):
            handle.disable()

    # -- helpers ----------------------------------------------------------------------------------

    def _resident(self, call: Call) -> torch.Tensor | None:
        """The resident pipeline's latents for ``call`` (None when it raises), changed the same way."""
        try:
            return call.run(self.resident, self.prompt, cached=False)
        except Failed:
            return None

    def _served(self, pipe: Any, call: Call) -> None:
        expected = self._resident(call)
        if call.raises:
            with pytest.raises(Failed) as caught:
                call.run(pipe, self.prompt, cached=True)
            notes = getattr(caught.value, "__notes__", [])
            assert bool(notes) == call.nudged, notes  # the mismatch is noted on the call's error, never raised over it
        elif call.nudged:
            with pytest.raises(PlanMismatchError, match=r"^1 forward\(s\)"):
                call.run(pipe, self.prompt, cached=True)
        else:
            assert expected is not None
            assert torch.equal(call.run(pipe, self.prompt, cached=True), expected), "not the resident latents"

    # -- rules ------------------------------------------------------------------------------------

    @rule(
        steps=st.integers(min_value=2, max_value=4),
        ending=st.sampled_from(ENDINGS),
        at=st.integers(min_value=0, max_value=3),
        nudge=st.sampled_from([None, None, 1, 2]),
        change_at=st.sampled_from([None, None, None, 0]),
        which=st.sampled_from([0, 1]),
    )
    def call(self, steps: int, ending: str, at: int, nudge: int | None, change_at: int | None, which: int) -> None:
        # A forward after a change mid-call is keyed on the host (the request's rows are of the old time
        # embedder): a nudge there is no mismatch, so the two are not combined.
        self._served(self.pipes[which], Call(steps, ending, at, nudge if change_at is None else None, change_at))

    @rule()
    def bare_forward(self) -> None:
        """A forward of no call, with a timestep of its own: the host path, exact."""
        inputs = tiny_qwen_inputs(self.model, 1, seed=5)
        inputs["timestep"] = torch.tensor([0.4375])
        with torch.no_grad():
            assert torch.equal(self.model(**inputs)[0], self.resident.transformer(**inputs)[0])

    @rule()
    def change_between_calls(self) -> None:
        _change(self.resident.transformer)
        _change(self.model)

    @rule(steps=st.sampled_from([(2, 3), (3, 3), (4, 2)]))
    def two_pipelines_on_two_threads(self, steps: tuple[int, int]) -> None:
        calls = [Call(n, "returned", n - 1, None, None) for n in steps]
        expected = [self._resident(call) for call in calls]
        served: list[Any] = [None, None]
        errors: list[BaseException] = []

        def run(index: int) -> None:
            try:
                served[index] = calls[index].run(self.pipes[index], self.prompt, cached=True)
            except BaseException as exc:  # re-raised on the test's thread below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        for got, want in zip(served, expected):
            assert want is not None and torch.equal(got, want)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def nothing_outlives_a_call(self) -> None:
        if not self.handles:
            return
        handle = self.handles[0]["transformer"]
        assert handle.cache.held_slots == {}, "a call's holds outlived it"
        assert handle.requests.current() is None
        handle.check_request()  # nothing left to report
        handle.cache.check_invariants()


def _run(profile: str) -> None:
    run_state_machine_as_test(RequestsMachine, settings=settings.get_profile(profile))


def test_requests_state_machine() -> None:
    """A few derandomized sequences (``make test``)."""
    _run("adalncache-requests-soak" if os.environ.get("ADALNCACHE_SOAK") else "adalncache-requests-ci")


@pytest.mark.soak
@pytest.mark.timeout(4 * 3600)
def test_requests_state_machine_soak() -> None:
    """Many random sequences (``make soak``: ADALNCACHE_SOAK=1 pytest -m soak)."""
    _run("adalncache-requests-soak" if os.environ.get("ADALNCACHE_SOAK") else "adalncache-requests-ci")


def test_every_way_a_call_ends_in_one_sequence() -> None:
    """The sequences the generated ones reach rarely, made deterministic: each way a call ends followed by
    a bare forward and a call, changes between and during calls, a mismatch alone and under a failure,
    and both pipelines on two threads. Each step checks the machine's contract."""
    machine = RequestsMachine()
    try:
        machine.enable()
        for ending in ENDINGS:
            machine.call(3, ending, 1, None, None, 0)
            machine.nothing_outlives_a_call()
            machine.bare_forward()
        machine.call(3, "returned", 2, 2, None, 1)  # a forward off its schedule: PlanMismatchError at the end
        machine.call(4, "transformer raises", 3, 1, None, 0)  # the call's own error, the mismatch noted on it
        machine.change_between_calls()
        machine.call(3, "returned", 2, None, None, 1)
        machine.call(3, "interrupted", 2, None, 0, 0)  # the time embedder changed after step 0
        machine.nothing_outlives_a_call()
        machine.two_pipelines_on_two_threads((3, 4))
        machine.nothing_outlives_a_call()
    finally:
        machine.teardown()
