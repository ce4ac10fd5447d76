"""diffusers' layerwise casting (fp8 storage, bf16 compute) with the AdaLN cache, in either order.

Casting keeps ``adaln_proj.linear`` weights in fp8 and casts them to bf16 around each forward
(``norm_out.linear`` matches diffusers' "norm" skip pattern and stays bf16). The cached model must
equal the same cast model without the cache; casting a model that is already served must never
leave the tables on uncast weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache.diffusers import adaln_cache_handle, enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.tools.tiny import make_request, run_loop
from compose_helpers import assert_equal, assert_exact, assert_full_precision_tables, maxdiff, projections, serve
from tiny_helpers import write_native_checkpoint

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def _cast(model: Any, **kwargs: Any) -> Any:
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16, **kwargs)
    return model


def test_casting_then_cache_is_exact(load_tiny: Callable[[str], Any]) -> None:
    model = _cast(load_tiny("bf16-disk"))
    assert model.transformer_blocks[0].adaln_proj.linear.weight.dtype == FP8
    request = make_request(model, "t2va", 4)
    served = serve(model, request)
    assert_exact(served, request)  # no fingerprint change: the casting hook never rebinds the source's tensors
    assert maxdiff(served.resident, run_loop(load_tiny("bf16-disk"), request)) > 0  # casting does change outputs
    assert model.transformer_blocks[0].adaln_proj.linear.weight.dtype == FP8  # restored as stored


def test_casting_then_checkpoint_needs_the_full_precision_option(
    load_tiny: Callable[[str], Any], tmp_path: Any
) -> None:
    """A checkpoint holds the uncast weights: refused, or served on purpose as the model with uncast projections."""
    checkpoint = write_native_checkpoint(load_tiny("bf16-disk"), tmp_path / "ck")
    model = _cast(load_tiny("bf16-disk"))
    reference = _cast(load_tiny("bf16-disk"), skip_modules_pattern=("norm", "adaln_proj", "time_embedder", "proj_"))
    request = make_request(model, "t2va", 4)
    says = r"layerwise casting.*quantized_projections='checkpoint'"
    assert_full_precision_tables(model, reference, checkpoint, request, says)


def test_cache_then_enable_layerwise_casting_re_enables_over_the_cast_weights(load_tiny: Callable[[str], Any]) -> None:
    reference = _cast(load_tiny("bf16-disk"))
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 4)
    cast_resident = run_loop(reference, request)
    handle = enable_adaln_cache(model)
    handle.prepare(request.plans)
    _cast(model)  # the handle's guard: disable, cast the real weights, enable again
    assert adaln_cache_handle(model) is handle and handle.enabled
    assert all(linear.weight.device.type == "meta" for linear in projections(model))
    handle.prepare(request.plans)
    assert_equal(run_loop(model, request), cast_resident)
    assert handle.stats.passes == 1 and handle.stats.fingerprint_changes == 0
    handle.disable()
    assert_equal(run_loop(model, request), cast_resident)


def test_cache_then_apply_layerwise_casting_function_is_refused_and_settled_by_disable(
    load_tiny: Callable[[str], Any],
) -> None:
    """The free function bypasses any method guard: the next forward refuses, ``disable()`` casts the weights."""
    from diffusers.hooks import apply_layerwise_casting

    patterns = ("norm", "time_embedder", "^proj_in$", "^proj_out$", "audio_proj")
    reference = load_tiny("bf16-disk")
    apply_layerwise_casting(reference, storage_dtype=FP8, compute_dtype=BF16, skip_modules_pattern=patterns)
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 4)
    handle = enable_adaln_cache(model)
    handle.prepare(request.plans)
    apply_layerwise_casting(model, storage_dtype=FP8, compute_dtype=BF16, skip_modules_pattern=patterns)
    with pytest.raises(ConfigError, match=r"layerwise casting was applied to transformer_blocks\.0\.adaln_proj"):
        run_loop(model, request)
    with pytest.raises(ConfigError, match=r"handle\.disable\(\)"):
        handle.prepare(request.plans)
    handle.disable()
    assert model.transformer_blocks[0].adaln_proj.linear.weight.dtype == FP8
    assert_equal(run_loop(model, request), run_loop(reference, request))
