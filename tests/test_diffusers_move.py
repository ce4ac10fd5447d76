"""Moving an enabled model: ``.to()``/``.cpu()``/``pipe.to()`` take the cache along; casts are refused.

On a CPU-only machine every move is CPU to CPU, which must be allowed, exact and free (no pass).
What a move across devices does to the tables (park the old device's rows on the host, start
the new device from what was parked for it, rebuild the rest there) runs on a GPU; here it is
driven through the very same code by giving two CPU devices different identities, which is what
a CPU and a GPU are to the cache. The ``cuda`` tests run where CUDA is present.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import adalncache.cache as cache_module  # where a move compares device identities
from adalncache.diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
from adalncache.errors import ConfigError
from adalncache.plans import minimax_h3_plans
from adalncache.tools.tiny import make_request, run_loop
from tiny_helpers import parameter_bytes

STEPS = 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (moves across devices)")


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_moves_on_the_same_device_are_free_and_exact(tiny_saved_root: Path) -> None:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    model = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    handle: Any = adaln_cache_handle(model)
    reference = MiniMaxH3Transformer3DModel.from_pretrained(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    request = make_request(reference, "fl2va", STEPS, seed=3)
    expected = run_loop(reference, request)
    handle.prepare(request.plans)
    slab = handle.cache.block_params
    moves: list[Callable[[], Any]] = [
        lambda: model.to("cpu"),
        lambda: model.cpu(),
        lambda: model.to(torch.device("cpu"), non_blocking=True),
        lambda: model.to(device="cpu"),
    ]
    for move in moves:
        assert move() is model
        assert run_loop(model, request).equal(expected)
    assert handle.stats.passes == 1 and handle.cache.block_params is slab  # nothing rebuilt, nothing moved
    handle.disable()
    assert run_loop(model, request).equal(expected)


@pytest.mark.parametrize(
    "cast",
    [
        "to(torch.float32)",
        "to(torch.bfloat16)",
        "half()",
        "float()",
        "bfloat16()",
        "to('cpu', torch.float16)",
        "to('meta')",
        "type(torch.float16)",
    ],
)
def test_casts_are_refused_and_change_nothing(tiny_saved_root: Path, cast: str) -> None:
    """The released mixed precision holds fp32 and bf16 tensors, so every cast changes some of them."""
    model = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    handle: Any = adaln_cache_handle(model)
    before = _state(model)
    with pytest.raises(ConfigError, match="disable"):
        eval(f"model.{cast}")
    after = _state(model)
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(after[k].dtype == before[k].dtype for k in before)
    assert handle.enabled
    handle.disable()


def test_a_no_op_cast_of_an_fp32_model_is_allowed(tiny_saved_root: Path) -> None:
    model = load_transformer(tiny_saved_root / "fp32")
    assert model.float() is model and model.to(torch.float32) is model
    adaln_cache_handle(model).disable()


def test_disable_after_moves_restores_the_stock_model(load_tiny: Callable[[str], Any]) -> None:
    """enable_adaln_cache (weights served from host memory), moves, disable: exactly the model again."""
    model = load_tiny("fp32-disk")
    before = _state(model)
    request = make_request(model, "t2va", STEPS, seed=1)
    expected = run_loop(model, request)
    handle = enable_adaln_cache(model)
    model.to("cpu").cpu()
    assert run_loop(model, request).equal(expected)
    handle.disable()
    after = _state(model)
    assert list(after) == list(before)
    for name, tensor in before.items():
        assert after[name].device.type == "cpu" and torch.equal(after[name], tensor), name
    assert parameter_bytes(model) == sum(t.numel() * t.element_size() for t in before.values())


def _two_kinds_of_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``cpu`` and ``cpu:0`` two device identities, as a CPU and a GPU are to the cache."""
    real = cache_module.device_identity
    monkeypatch.setattr(cache_module, "device_identity", lambda device: (*real(device), device.index))


def test_cache_move_across_identities_parks_and_restores_tables(
    load_tiny: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moving away parks the tables on the host; the other device starts empty; coming back restores
    them bit for bit, in LRU order, with no pass; a plan built meanwhile elsewhere is not brought."""
    _two_kinds_of_cpu(monkeypatch)
    model = load_tiny("bf16-disk")
    handle: Any = enable_adaln_cache(model, max_plans=8)
    cache = handle.cache
    plans = minimax_h3_plans("t2va", STEPS)
    handle.prepare(plans)
    resident, rows = cache.resident_plans, {k: cache.rows_of(k) for k in cache.resident_plans}
    # prepare() holds the plans for this thread: their slot tensors belong to the slab as it is.
    with pytest.raises(ConfigError, match="held by requests in flight"):
        cache.move_to("cpu:0")
    assert cache.device == torch.device("cpu") and cache.resident_plans == resident  # nothing changed
    handle.release()
    cache.move_to("cpu:0")
    assert cache.device == torch.device("cpu", 0) and len(cache) == 0
    cache.move_to("cpu")
    assert cache.resident_plans == resident
    for key, want in rows.items():
        got = cache.rows_of(key)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    cache.check_invariants()
    assert handle.stats.passes == 1
    # Through the handle, as a forward on "another device" and back would run it: exact, one pass.
    request = make_request(model, "t2va", STEPS, seed=2)
    handle.follow(torch.device("cpu", 0))
    assert len(handle.cache) == 0 and handle.device == torch.device("cpu", 0)
    handle.follow(torch.device("cpu"))
    out = run_loop(model, request)
    handle.disable()
    assert out.equal(run_loop(model, request))
    assert handle.stats.passes == 1


def test_cache_move_within_an_identity_copies_the_slab(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    handle: Any = enable_adaln_cache(model)
    handle.prepare(minimax_h3_plans("fl2va", STEPS))
    handle.release()  # a cache whose plans are held does not move
    cache = handle.cache
    before = {k: cache.rows_of(k) for k in cache.resident_plans}
    old = cache.block_params
    cache.move_to("cpu:0")  # another device object of the same kind: rows are valid there
    assert cache.block_params is not old and cache.resident_plans == list(before)
    for key, want in before.items():
        assert all(torch.equal(a, b) for a, b in zip(cache.rows_of(key), want))
    handle.disable()


@CUDA
def test_cuda_round_trip_is_exact_and_restores_without_a_pass(tiny_saved_root: Path) -> None:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    stock = MiniMaxH3Transformer3DModel.from_pretrained(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16).to("cuda")
    model = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    handle: Any = adaln_cache_handle(model)
    model.to("cuda")
    assert handle.cache.block_params.device.type == "cuda"
    request = make_request(stock, "t2va", STEPS, seed=3, device="cuda")
    handle.prepare(request.plans)
    assert run_loop(model, request).equal(run_loop(stock, request))
    model.to("cpu")
    assert handle.cache.block_params.device.type == "cpu"
    model.to("cuda")
    assert run_loop(model, request).equal(run_loop(stock, request))
    assert handle.stats.passes == 1  # the CUDA tables came back from the host, no pass
    handle.disable()
    assert model.norm_out.linear.weight.device.type == "cuda"
    assert run_loop(model, request).equal(run_loop(stock, request))


@CUDA
def test_cuda_device_map_load_is_exact(tiny_saved_root: Path) -> None:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    stock = MiniMaxH3Transformer3DModel.from_pretrained(
        tiny_saved_root / "bf16", torch_dtype=torch.bfloat16, device_map="cuda"
    )
    model = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16, device_map="cuda")
    assert model.hf_device_map == stock.hf_device_map
    request = make_request(stock, "ref2va", STEPS, seed=3, device="cuda")
    adaln_cache_handle(model).prepare(request.plans)
    assert run_loop(model, request).equal(run_loop(stock, request))
