"""torch.compile with the AdaLN cache: no more frames, graphs, breaks or recompiles than without it.

Counted with ``torch._dynamo.utils.counters`` over a whole request (the step's plan goes from one
timestep to two, so both models recompile once for the new shape), after ``torch._dynamo.reset()``;
a second identical request must compile nothing more. ``make test`` uses ``backend="aot_eager"``
(the graphs dynamo captures are the same for every backend, and it compiles in seconds); there the
compiled outputs are also bit-identical to eager. Inductor is measured in the soak test at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.tools.tiny import LoopResult, TinyRequest, make_request, run_loop, tiny_transformer
from compose_helpers import assert_equal, maxdiff

pytestmark = pytest.mark.slow


@dataclass
class Compiled:
    """One compiled run: what dynamo compiled for the first request, and what the second one added."""

    result: LoopResult
    frames: int
    graphs: int
    breaks: int
    recompiles: int
    second_request_added: dict[str, dict[str, int]]


def _counts() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {name: dict(values) for name, values in counters.items()}


def _run_compiled(
    compile_model: Callable[[Any], Any], request: TinyRequest, *, cache: str, resident: LoopResult | None = None
) -> Compiled:
    """``cache``: "none", "first" (enable, then compile) or "last" (compile, then enable).

    With the cache, ``disable()`` then gives back the compiled model: the compiled callable as
    ``compile()`` left it, and outputs equal to ``resident`` (the compiled model without the cache).
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_transformer("tiny")
    runner: Any = model
    handle = None
    if cache == "last":
        runner = compile_model(model)
    if cache != "none":
        handle = enable_adaln_cache(model)
        handle.prepare(request.plans)
    if cache in ("none", "first"):
        runner = compile_model(model)
    torch._dynamo.reset()
    counters.clear()
    result = run_loop(runner, request)
    first = _counts()
    assert_equal(run_loop(runner, request), result)
    second = _counts()
    added = {
        name: {key: value - first.get(name, {}).get(key, 0) for key, value in values.items()}
        for name, values in second.items()
    }
    if handle is not None:
        compiled = model.__dict__.get("_compiled_call_impl")
        handle.disable()
        if compiled is not None:
            assert type(compiled).__name__ == "EagerPrepare"
            assert model.__dict__["_compiled_call_impl"] is compiled.compiled
        assert_equal(run_loop(runner, request), resident if resident is not None else result)
    return Compiled(
        result=result,
        frames=first.get("frames", {}).get("total", 0),
        graphs=first.get("stats", {}).get("unique_graphs", 0),
        breaks=sum(first.get("graph_break", {}).values()),
        recompiles=sum(first.get("recompiles", {}).values()),
        second_request_added={
            name: {k: v for k, v in values.items() if v} for name, values in added.items() if any(values.values())
        },
    )


def _regional(model: Any) -> Any:
    model.compile_repeated_blocks(backend="aot_eager")
    return model


def _full(model: Any) -> Any:
    model.compile(backend="aot_eager")
    return model


def _wrapper(model: Any) -> Any:
    return torch.compile(model, backend="aot_eager")


@pytest.fixture(scope="module")
def request_and_eager() -> tuple[TinyRequest, LoopResult]:
    model = tiny_transformer("tiny")
    request = make_request(model, "t2va", 4)
    return request, run_loop(model, request)


@pytest.mark.parametrize("compile_model", [_regional, _full], ids=["compile_repeated_blocks", "model.compile"])
def test_compiled_cache_compiles_no_more_than_the_resident_model(
    request_and_eager: tuple[TinyRequest, LoopResult], compile_model: Callable[[Any], Any]
) -> None:
    request, eager = request_and_eager
    resident = _run_compiled(compile_model, request, cache="none")
    assert resident.graphs >= 1 and resident.second_request_added == {}
    assert_equal(resident.result, eager)
    for order in ("first", "last"):
        cached = _run_compiled(compile_model, request, cache=order, resident=resident.result)
        counts = (cached.frames, cached.graphs, cached.breaks, cached.recompiles)
        resident_counts = (resident.frames, resident.graphs, resident.breaks, resident.recompiles)
        assert all(c <= r for c, r in zip(counts, resident_counts)), (order, counts, resident_counts)
        assert cached.second_request_added == {}, (order, cached.second_request_added)
        assert_equal(cached.result, resident.result)


def test_torch_compile_wrapper_adds_frames_but_no_graphs(request_and_eager: tuple[TinyRequest, LoopResult]) -> None:
    """``torch.compile(model)`` reaches the hook itself: its host work runs eagerly (more frames, same graphs)."""
    request, eager = request_and_eager
    resident = _run_compiled(_wrapper, request, cache="none")
    cached = _run_compiled(_wrapper, request, cache="first", resident=resident.result)
    assert cached.graphs <= resident.graphs, (cached.graphs, resident.graphs)
    assert cached.second_request_added == {}
    assert_equal(cached.result, resident.result)
    assert_equal(cached.result, eager)


@pytest.mark.soak
@pytest.mark.parametrize("compile_model", ["regional", "full"])
def test_inductor(request_and_eager: tuple[TinyRequest, LoopResult], compile_model: str) -> None:
    """Inductor on CPU: regional compilation is bit-identical to the compiled resident model.

    A whole-model ``compile()`` also compiles ``time_proj`` and the time embedder, which inductor
    fuses differently from eager (the tables are built eagerly), so those outputs are compared
    with the compiled resident model and the difference is only reported, never hidden: eager
    stays exact (every other test).
    """

    def inductor(model: Any) -> Any:
        (model.compile_repeated_blocks if compile_model == "regional" else model.compile)(backend="inductor")
        return model

    request, eager = request_and_eager
    resident = _run_compiled(inductor, request, cache="none")
    cached = _run_compiled(inductor, request, cache="first", resident=resident.result)
    assert cached.graphs <= resident.graphs and cached.frames <= resident.frames
    print(
        f"inductor {compile_model}: cached vs compiled resident max {maxdiff(cached.result, resident.result):.3g}, "
        f"compiled resident vs eager max {maxdiff(resident.result, eager):.3g}"
    )
    if compile_model == "regional":
        assert_equal(cached.result, resident.result)
