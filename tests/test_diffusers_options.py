"""enable_adaln_cache's typed options: each reaches the cache, unknown or bad ones fail clearly.

The keyword arguments are spelled out (not an untyped ``**kwargs``), generated from the one
:class:`~adalncache.options.AdalnCacheConfig`, so a test also keeps them in step with
:class:`~adalncache.AdalnCache`: an option added to the cache but not to the integration, or given
another default, fails here. ``config=`` carries them as one object; a keyword beside it wins.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache import AdalnCache
from adalncache.diffusers import AdalnCacheConfig, CacheOptions, enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.options import CACHE_OPTION_NAMES
from adalncache.plans import minimax_h3_plans
from adalncache.tools.tiny import make_request, run_loop

#: Options of enable_adaln_cache that belong to the integration, not to the cache.
INTEGRATION_OPTIONS = {
    "on_miss",
    "free_time_embedder",
    "layout",
    "verify_checkpoint",
    "quantized_projections",
    "overlap",
}


def _keyword_defaults(function: Callable[..., Any]) -> dict[str, Any]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_cache_options_match_the_cache_constructor() -> None:
    """Every AdalnCache option is a field of the one config class with the same default (device and
    config= aside: the device is where the cache is assembled, not an option)."""
    assert CacheOptions is AdalnCacheConfig
    cache_options = _keyword_defaults(AdalnCache.__init__)
    fields = {f.name: f.default for f in dataclasses.fields(AdalnCacheConfig) if f.name in CACHE_OPTION_NAMES}
    assert set(fields) == set(cache_options) - {"device", "config"}
    for name, default in fields.items():
        assert default == cache_options[name], name


def test_enable_signature_is_the_config_and_the_cache_options() -> None:
    """enable_adaln_cache takes each option by name, typed, with no catch-all ``**kwargs``."""
    parameters = inspect.signature(enable_adaln_cache).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    keywords = _keyword_defaults(enable_adaln_cache)
    config_fields = {f.name for f in dataclasses.fields(AdalnCacheConfig)} - set(CACHE_OPTION_NAMES)
    assert config_fields == INTEGRATION_OPTIONS
    assert set(keywords) == {"config", "device"} | {f.name for f in dataclasses.fields(AdalnCacheConfig)}
    assert keywords["device"] is None and keywords["config"] is None
    for field in dataclasses.fields(AdalnCacheConfig):
        assert keywords[field.name] == field.default, field.name
    assert all(parameters[name].annotation is not inspect.Parameter.empty for name in keywords)


def test_unknown_keyword_is_a_type_error_and_leaves_the_model(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    with pytest.raises(TypeError, match="max_plan_widht'; did you mean 'max_plan_width'"):
        enable_adaln_cache(model, max_plan_widht=2)  # type: ignore[call-arg]  # wrong on purpose: the refusal is what is tested
    assert all(p.device.type != "meta" for p in model.parameters())
    assert getattr(model, "_diffusers_hook", None) is None


def test_typed_options_reach_the_cache(load_tiny: Callable[[str], Any]) -> None:
    """Each option lands on the cache as given, and the served loop is still bit-identical."""
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 4, seed=1)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(
        model,
        max_plans=7,
        max_plan_width=3,
        host_cache_bytes=1 << 20,
        read_ahead=0,
        progress=False,
        batched=True,
        device="cpu",
    )
    try:
        cache = handle.cache
        assert (cache.max_plans, cache.max_plan_width, cache.host_cache_bytes) == (7, 3, 1 << 20)
        assert (cache.read_ahead, cache.progress, cache.batched) == (0, False, True)
        assert (cache.precision, cache.shard, cache.device) == ("match", "layers", torch.device("cpu"))
        assert handle.prepare(request.plans).passes == 1
        assert run_loop(model, request).equal(resident)
    finally:
        handle.disable()


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"device": "meta"}, r"device=meta \(CLI --device\) differs from the model's device cpu"),
        ({"device": "no-such-device"}, r"device 'no-such-device' is not a torch device.*--device"),
        ({"max_plan_width": 0}, r"--plan-width"),
        ({"precision": "fp8"}, r"--precision"),
        ({"shard": "rows"}, r"--shard"),
    ],
    ids=["other device", "bad device", "zero width", "bad precision", "bad shard"],
)
def test_bad_cache_options_fail_before_the_model_changes(
    load_tiny: Callable[[str], Any], options: dict[str, Any], says: str
) -> None:
    model = load_tiny("bf16-disk")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=says):
        enable_adaln_cache(model, **options)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type != "meta" for p in model.parameters())
    # Nothing half-enabled is left behind: enabling with good options works at once.
    handle = enable_adaln_cache(model)
    assert handle.prepare(minimax_h3_plans("t2va", 3)).passes == 1
    handle.disable()


def test_config_is_typed_and_frozen() -> None:
    config = AdalnCacheConfig(max_plans=3)
    assert config.max_plans == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.on_miss = "raise"  # type: ignore[misc]  # wrong on purpose: the refusal is what is tested
    with pytest.raises(ConfigError, match="config= must be an AdalnCacheConfig"):
        enable_adaln_cache(torch.nn.Linear(1, 1), config={"max_plans": 3})  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    with pytest.raises(ConfigError, match="on_miss"):
        AdalnCacheConfig(on_miss="ignore")
    for name, bad in [("overlap", 1), ("quantized_projections", "x"), ("verify_checkpoint", None)]:
        with pytest.raises(ConfigError, match=name):
            AdalnCacheConfig(**{name: bad})


def test_config_reaches_the_cache_and_a_keyword_beside_it_wins(load_tiny: Callable[[str], Any]) -> None:
    """``enable_adaln_cache(model, config=AdalnCacheConfig(...))`` is the keywords' long form; a keyword
    given beside ``config=`` replaces that field; the served loop stays bit-identical."""
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 4, seed=1)
    resident = run_loop(model, request)
    config = AdalnCacheConfig(max_plans=5, max_plan_width=3, on_miss="raise", progress=False)
    handle = enable_adaln_cache(model, config=config, max_plans=6)
    try:
        assert (handle.cache.max_plans, handle.cache.max_plan_width) == (6, 3)
        assert handle.config.on_miss == "raise" and handle.config.max_plans == 6
        handle.prepare(request.plans)
        assert run_loop(model, request).equal(resident)
    finally:
        handle.disable()
