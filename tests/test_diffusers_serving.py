"""The diffusers integration under serving conditions: autocast, held requests, several threads.

Exactness is ``torch.equal`` against the resident model run the same way (under the same
autocast, with the same request), never a tolerance.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import PlanError, PlanNotCachedError
from adalncache.tools.tiny import LoopResult, make_request, run_loop

STEPS = 4  # grid points: 3 forwards, the first at M=1 (t2va)


def autocast() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("prepared", ["outside autocast", "on a miss inside"])
def test_cached_forward_under_autocast_equals_the_resident_one(load_tiny: Callable[[str], Any], prepared: str) -> None:
    """Tables built outside autocast are never served inside it; inside, the served rows are the
    autocast projection's, in its dtype, so the whole forward equals the resident autocast forward."""
    model = load_tiny("fp32-memory")
    request = make_request(model, "t2va", STEPS, seed=3)
    plain = run_loop(model, request)
    with autocast():
        resident = run_loop(model, request)
    assert not resident.equal(plain)  # autocast changes the outputs: the comparison below means something

    handle = enable_adaln_cache(model)
    try:
        if prepared == "outside autocast":
            handle.prepare(request.plans)
            assert handle.cache.serve_dtype == torch.float32
        with autocast():
            cached = run_loop(model, request)
        assert cached.equal(resident)
        assert handle.cache.serve_dtype == torch.bfloat16
        if prepared == "outside autocast":
            assert handle.stats.variant_changes == 1  # the autocast forward dropped the fp32 tables
        with autocast():
            assert run_loop(model, request).equal(resident)  # now all hits
        # The prepared request would serve its held fp32 rows (exact) from the device; once it is over,
        # the forward keys on the host and the tables are rebuilt outside autocast.
        handle.release()
        assert run_loop(model, request).equal(plain)  # and back outside autocast: rebuilt, exact
        assert handle.cache.serve_dtype == torch.float32
    finally:
        handle.disable()


def test_on_miss_raise_refuses_tables_prepared_outside_autocast(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("fp32-memory")
    request = make_request(model, "t2va", STEPS, seed=3)
    with autocast():
        resident = run_loop(model, request)
    handle = enable_adaln_cache(model, on_miss="raise")
    try:
        handle.prepare(request.plans)
        with autocast(), pytest.raises(PlanNotCachedError, match="autocast"):
            run_loop(model, request)
        with autocast():
            handle.prepare(request.plans)  # prepared under the loop's autocast: served
            assert run_loop(model, request).equal(resident)
    finally:
        handle.disable()


# -- requests hold their plans ----------------------------------------------------------------------


def test_prepare_holds_for_the_thread_until_release_and_forwards_hold_their_own(
    load_tiny: Callable[[str], Any],
) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", STEPS, seed=1)
    handle = enable_adaln_cache(model, max_plans=3)
    try:
        handle.prepare(request.plans)
        held = dict(handle.cache.held_slots)
        assert len(held) == len({tuple(p.tolist()) for p in request.plans}) and set(held.values()) == {1}
        during: list[dict[int, int]] = []
        hook = model.transformer_blocks[0].register_forward_pre_hook(
            lambda *args: during.append(dict(handle.cache.held_slots))
        )
        try:
            run_loop(model, request)
        finally:
            hook.remove()
        # Inside each forward the step's plan is held by prepare alone: a prepared request's forward
        # finds its slot on the device and needs no hold of its own (the request's covers it).
        assert during and all(counts == held for counts in during)
        assert handle.cache.held_slots == held  # every forward released its own hold
        other = make_request(model, "fl2va", STEPS, seed=1)
        with pytest.raises(Exception, match="held by requests in flight"):
            handle.cache.build(other.plans, embed=lambda plan: None)  # type: ignore[arg-type,return-value]  # wrong on purpose: the refusal is what is tested
        handle.release()
        assert handle.cache.held_slots == {}
        with handle.request(other.plans) as hold:
            assert hold.report.built >= 1 and len(handle.cache.held_slots) == len(hold.held)
        assert handle.cache.held_slots == {}
        during.clear()
        hook = model.transformer_blocks[0].register_forward_pre_hook(
            lambda *args: during.append(dict(handle.cache.held_slots))
        )
        try:
            run_loop(model, request)  # nothing prepared: every forward holds its own plan while it runs
        finally:
            hook.remove()
        assert during and all(sum(counts.values()) == 1 for counts in during)
        assert handle.cache.held_slots == {}
    finally:
        handle.disable()


def test_a_forward_that_raises_releases_its_hold(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", STEPS, seed=1)
    handle = enable_adaln_cache(model)
    try:
        calls = [0]

        def boom(*args: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected failure inside the forward")

        hook = model.transformer_blocks[0].register_forward_pre_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                run_loop(model, request)
        finally:
            hook.remove()
        assert handle.cache.held_slots == {}
    finally:
        handle.disable()


# -- several threads, one model -------------------------------------------------------------------


def test_threads_running_requests_on_one_model_get_the_resident_outputs(load_tiny: Callable[[str], Any]) -> None:
    """Three threads run different requests on one model whose slab holds two requests at a time:
    each request's outputs are the resident model's, bit for bit; a request that finds the slab
    full of held plans is refused clearly (naming --max-plans) and retried once another ends."""
    model = load_tiny("bf16-disk")
    tasks = (("t2va", 1), ("fl2va", 2), ("ref2va", 3))
    requests = [make_request(model, task, STEPS, seed=seed) for task, seed in tasks]
    resident = [run_loop(model, request) for request in requests]
    handle = enable_adaln_cache(model, max_plans=6)
    served: list[tuple[int, LoopResult]] = []
    refused: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(len(requests))

    def serve(index: int) -> None:
        start.wait()
        try:
            done = 0
            while done < 2:
                try:
                    with handle.request(requests[index].plans):
                        served.append((index, run_loop(model, requests[index])))
                    done += 1
                except PlanError as exc:
                    refused.append(str(exc))
                    time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors[0]
        assert all("held by requests in flight" in message and "--max-plans" in message for message in refused)
        assert sorted(index for index, _ in served) == [0, 0, 1, 1, 2, 2]
        for index, result in served:
            assert result.equal(resident[index]), f"request {index} differs from the resident model"
        handle.cache.check_invariants()
        assert handle.cache.held_slots == {}
        assert handle.stats.evicted_plans > 0  # the slab really was shared between the requests
    finally:
        handle.disable()
