"""Model-based test of prepared requests on a tiny Qwen-Image transformer (two-column plan keys).

Why a second machine: ``test_state_machine`` models the core cache (slots, tiers, holds, checkpoint
changes) with no model at all. Prepared requests (``handle.prepare``) add an ordering contract of
their own on top of the diffusers integration: a forward finds its slot on the device, a forward
whose keying inputs match no prepared plan is served the poison slot (NaN) and reported *later*, at
the next reporting point. Bugs of that kind (a miss lost, reported twice, a stale request serving
after a LoRA change, a slot of a failed build handed out) only show after particular sequences.

The model is ``layered`` Qwen-Image (``use_additional_t_cond``): a plan is ``[timestep,
additional_t_cond]`` per row, so two plans with the same timestep and another index column differ
only in their second column; a LoRA is loaded on both the resident copy and the cached one.

Steps: prepare a subset of plans (under a LoRA scale), forward a plan (prepared, unprepared, or one
ulp off a prepared timestep, under either scale), release (``check`` or not), ``check_request``,
disable then enable again, hot-swap the LoRA's weights, and any of these under an injected build
failure. The contract checked after every step:

* a served output is ``torch.equal`` to the resident model's for the same inputs, except a forward
  that the prepared request *covers* (same plan shape and LoRA signature) but that matches none of
  its plans: its output is all-NaN;
* each such forward is reported by exactly one ``PlanMismatchError``, at the first of
  ``check_request``, ``release()``, the next ``prepare``, ``disable()``; ``release(check=False)``
  keeps it for the next one; nothing else raises it;
* an injected build failure raises a typed error and leaves the cache serving the next request
  exactly; the cache's ``check_invariants()`` holds after every step.

Profiles: ``make test`` runs a few derandomized sequences (under ~20 s on two cores);
``ADALNCACHE_SOAK=1`` (``make soak``) runs many random ones.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from adalncache import PlanMismatchError
from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import AdalnCacheError
from adalncache.testing import inject_faults
from adalncache.tools.tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer
from tiny_helpers import register_state_machine_profiles

register_state_machine_profiles("prepared", ci=(40, 12), soak=(1000, 25))

MAX_PLANS = 4
SCALES = (1.0, 0.5)
ONE_ULP_UP = float(torch.nextafter(torch.tensor(0.9375), torch.tensor(2.0)))

#: ``(timesteps, additional_t_cond)`` of a forward. Pairs differ only in the index column (the
#: second key column), a batch of two has another plan shape (another key group on the device).
POOL: list[tuple[tuple[float, ...], tuple[int, ...]]] = [
    ((0.9375,), (1,)),
    ((0.9375,), (0,)),
    ((0.25,), (1,)),
    ((0.9375, 0.25), (1, 1)),
    ((0.9375, 0.25), (0, 0)),
]
#: What a request prepares (indices into POOL): one plan, plans that differ only in the index
#: column, two plan shapes at once, and as many as the slab holds beside one host-path forward.
SUBSETS: list[tuple[int, ...]] = [(0,), (1,), (0, 2), (0, 3), (1, 4), (0, 1, 3), (2, 4), (3,)]
#: One ulp off a pool timestep: a plan no request ever prepares (a drifted scheduler's timestep).
STRAY: tuple[tuple[float, ...], tuple[int, ...]] = ((ONE_ULP_UP,), (1,))


def _plan(entry: tuple[tuple[float, ...], tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The keying inputs of a forward, as ``prepare`` takes them (a mapping by argument name)."""
    timesteps, columns = entry
    return {"timestep": torch.tensor(timesteps), "additional_t_cond": torch.tensor(columns)}


def _lora_state(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """A rank-4 diffusers-format LoRA on every block's ``img_mod.1`` and ``norm_out.linear``."""
    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    names = [f"transformer_blocks.{i}.img_mod.1" for i in range(len(model.transformer_blocks))]
    state = {}
    for name in [*names, "norm_out.linear"]:
        linear = getattr(modules[name], "base_layer", modules[name])
        state[f"transformer.{name}.lora_A.weight"] = 0.3 * torch.randn(4, linear.in_features, generator=generator)
        state[f"transformer.{name}.lora_B.weight"] = 0.3 * torch.randn(linear.out_features, 4, generator=generator)
    return state


class Models:
    """The resident model and the one the cache serves: identical weights, the same LoRA."""

    def __init__(self) -> None:
        self.resident = tiny_qwen_transformer("layered", seed=0)
        self.cached = tiny_qwen_transformer("layered", seed=0)
        for model in (self.resident, self.cached):
            model.load_lora_adapter(_lora_state(model, seed=5), prefix="transformer", adapter_name="style")
        self.lora_seed = 5
        self.inputs = {batch: tiny_qwen_inputs(self.resident, batch) for batch in (1, 2)}

    def hotswap(self, seed: int) -> None:
        """Replace the adapter's weights in place (diffusers' hotswap) on both models."""
        for model in (self.resident, self.cached):
            model.load_lora_adapter(_lora_state(model, seed), prefix="transformer", adapter_name="style", hotswap=True)
        self.lora_seed = seed

    def forward(self, model: Any, entry: tuple[tuple[float, ...], tuple[int, ...]], scale: float) -> torch.Tensor:
        kwargs = dict(self.inputs[len(entry[0])])
        kwargs.update(_plan(entry), attention_kwargs={"scale": scale})
        with torch.no_grad():
            return model(**kwargs)[0]


_MODELS: list[Models] = []


def _models() -> Models:
    """One pair for every sequence (built once: construction dominates a short sequence's time)."""
    if not _MODELS:
        _MODELS.append(Models())
    return _MODELS[0]


Entry = tuple[tuple[float, ...], tuple[int, ...]]


class PreparedMachine(RuleBasedStateMachine):
    """What the thread has prepared (plans, scale), and the misses not yet reported."""

    def __init__(self) -> None:
        super().__init__()
        self.models = _models()
        self.handle: Any = None
        self.prepared: tuple[set[Entry], float] | None = None
        self.pending = 0

    @initialize(chosen=st.sampled_from(SUBSETS), scale=st.sampled_from(SCALES))
    def enable(self, chosen: tuple[int, ...], scale: float) -> None:
        """Enable and prepare a request: most sequences start in the state the contract is about."""
        if self.models.lora_seed != 5:
            self.models.hotswap(5)
        self.handle = enable_adaln_cache(self.models.cached, max_plans=MAX_PLANS)
        self.prepare(chosen, scale, None)

    def teardown(self) -> None:
        if self.handle is not None and self.handle.enabled:
            with self._reporting_point():  # a pending miss is reported here, once
                self.handle.disable()

    # -- the model ------------------------------------------------------------------------------

    def _expect_nan(self, entry: Entry, scale: float) -> bool:
        """Whether the prepared request covers the forward (same plan shape and LoRA signature) but
        holds none of its plans: then it is served the poison slot."""
        if self.prepared is None:
            return False
        plans, prepared_scale = self.prepared
        same_shape = any(len(plan[0]) == len(entry[0]) for plan in plans)
        return same_shape and scale == prepared_scale and entry not in plans

    def _reporting_point(self) -> Any:
        """``pytest.raises(PlanMismatchError)`` when a miss is pending (it is then reported), else a null context."""
        import contextlib

        pending, self.pending = self.pending, 0
        if pending:
            return pytest.raises(PlanMismatchError, match=f"^{pending} forward")
        return contextlib.nullcontext()

    # -- rules ----------------------------------------------------------------------------------

    @precondition(lambda self: self.handle.enabled)
    @rule(
        chosen=st.sampled_from(SUBSETS),
        scale=st.sampled_from(SCALES),
        fault=st.sampled_from([None] * 5 + ["embed", "project", "publish"]),
    )
    def prepare(self, chosen: tuple[int, ...], scale: float, fault: str | None) -> None:
        entries = {POOL[index] for index in chosen}
        plans = [_plan(entry) for entry in entries]
        self.prepared = None  # whatever happens, the previous request is over
        if self.pending:  # reported by the release prepare starts with, before it builds anything
            with self._reporting_point():
                self.handle.prepare(plans, attention_kwargs={"scale": scale})
            return
        if fault is not None:
            with inject_faults(self.handle.cache, fault, RuntimeError) as injected:
                try:
                    self.handle.prepare(plans, attention_kwargs={"scale": scale})
                except AdalnCacheError:
                    assert injected.fired, "prepare failed without a fault"
                    return
        else:
            self.handle.prepare(plans, attention_kwargs={"scale": scale})
        self.prepared = (entries, scale)

    @precondition(lambda self: self.handle.enabled)
    @rule(
        index=st.sampled_from([0, 1, 3, 5, 2, 4]),
        scale=st.sampled_from(SCALES),
        fault=st.sampled_from([None] * 6 + ["embed", "project"]),
    )
    def forward(self, index: int, scale: float, fault: str | None) -> None:
        entry = STRAY if index == len(POOL) else POOL[index]
        expected = self.models.forward(self.models.resident, entry, scale)
        nan = self._expect_nan(entry, scale)
        if self.prepared is not None and scale != self.prepared[1]:
            # The host path builds under another LoRA signature: the held plans retire, so the
            # prepared request's rows may be stale and no later forward is served from them.
            self.prepared = (self.prepared[0], float("nan"))
        if fault is None:
            served = self.models.forward(self.models.cached, entry, scale)
        else:
            with inject_faults(self.handle.cache, fault, RuntimeError) as injected:
                try:
                    served = self.models.forward(self.models.cached, entry, scale)
                except AdalnCacheError:
                    assert injected.fired, "a forward failed without a fault"
                    return
        if nan:
            self.pending += 1
            assert torch.isnan(served).all(), "a forward matching no prepared plan was served rows"
        else:
            assert torch.equal(served, expected), (entry, scale, self.prepared)

    @precondition(lambda self: self.handle.enabled)
    @rule(check=st.booleans())
    def release(self, check: bool) -> None:
        self.prepared = None
        if not check:
            self.handle.release(check=False)  # the miss waits for the next reporting point
            return
        with self._reporting_point():
            self.handle.release()

    @precondition(lambda self: self.handle.enabled)
    @rule()
    def check_request(self) -> None:
        with self._reporting_point():
            self.handle.check_request()

    @precondition(lambda self: self.handle.enabled)
    @rule()
    def disable_and_enable(self) -> None:
        self.prepared = None
        with self._reporting_point():
            self.handle.disable()
        assert not self.handle.enabled
        parameters = dict(self.models.cached.named_parameters())
        for name, value in self.models.resident.named_parameters():
            assert torch.equal(parameters[name], value), f"{name} not restored"
        self.handle = enable_adaln_cache(self.models.cached, max_plans=MAX_PLANS)

    @precondition(lambda self: self.handle.enabled)
    @rule(seed=st.sampled_from([5, 6]))
    def hotswap_lora(self, seed: int) -> None:
        """New adapter weights in place: a prepared request's rows are of the old LoRA, so its
        forwards must take the host path (exact); none of them is a miss."""
        self.models.hotswap(seed)
        if self.prepared is not None:
            self.prepared = (self.prepared[0], float("nan"))  # no forward's signature matches it now

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def cache_consistent(self) -> None:
        if self.handle is not None and self.handle.enabled:
            self.handle.cache.check_invariants()


def _run(profile: str) -> None:
    run_state_machine_as_test(PreparedMachine, settings=settings.get_profile(profile))


def test_prepared_state_machine() -> None:
    """A few derandomized sequences (``make test``)."""
    _run("adalncache-prepared-soak" if os.environ.get("ADALNCACHE_SOAK") else "adalncache-prepared-ci")


@pytest.mark.soak
@pytest.mark.timeout(4 * 3600)
def test_prepared_state_machine_soak() -> None:
    """Many random sequences (``make soak``: ADALNCACHE_SOAK=1 pytest -m soak)."""
    _run("adalncache-prepared-soak" if os.environ.get("ADALNCACHE_SOAK") else "adalncache-prepared-ci")


def test_a_deferred_report_survives_release_and_is_raised_once() -> None:
    """The sequence the generated ones reach rarely: a miss, ``release(check=False)``, a fresh
    prepare (which reports it), then a miss of the new request reported by ``disable()``. Each
    step checks the machine's contract, so a report lost or raised twice fails here."""
    machine = PreparedMachine()
    try:
        machine.enable((0,), 1.0)
        machine.forward(1, 1.0, None)  # differs in the index column only: NaN, one miss
        machine.forward(len(POOL), 1.0, None)  # a ulp off: NaN, a second miss
        machine.release(False)
        machine.check_request()  # the deferred report: "2 forward(s)"
        machine.prepare((0, 3), 0.5, None)
        machine.forward(4, 0.5, None)  # batch of two, other index column: NaN
        machine.forward(3, 0.5, None)  # prepared: exact
        machine.hotswap_lora(6)  # new adapter weights: host path, exact
        machine.forward(3, 0.5, None)
        machine.disable_and_enable()  # reports the one miss, restores every parameter
        machine.cache_consistent()
    finally:
        machine.teardown()
