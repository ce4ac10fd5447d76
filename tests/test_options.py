"""The cache options are declared once (adalncache.options.AdalnCacheConfig) and every door reads it.

The doors are ``AdalnCache(...)``, ``enable_adaln_cache(...)``, ``load_transformer(...)`` and the
``build``/``export`` commands; the tests here check the definition itself (its typed keyword
form agrees with its fields, each check refuses with the option's flag, an unknown keyword is a
TypeError naming the close match, a keyword beside ``config=`` replaces its field) and that the
cache's public signature is generated from it.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from adalncache import AdalnCache
from adalncache.errors import ConfigError
from adalncache.options import (
    CACHE_OPTION_NAMES,
    OPTIONS,
    AdalnCacheConfig,
    CacheKwargs,
    CacheOptions,
    ConfigKwargs,
    flag,
    knob,
    option,
)


def test_the_keyword_form_lists_exactly_the_fields() -> None:
    """ConfigKwargs (for ``**options: Unpack[...]``) and AdalnCacheConfig name the same options, CacheKwargs
    the cache's; CacheOptions is the one class, not a second."""
    assert CacheOptions is AdalnCacheConfig
    assert list(typing.get_type_hints(ConfigKwargs)) == [f.name for f in dataclasses.fields(AdalnCacheConfig)]
    assert list(typing.get_type_hints(CacheKwargs)) == list(CACHE_OPTION_NAMES)
    assert [o.name for o in OPTIONS] == [f.name for f in dataclasses.fields(AdalnCacheConfig)]
    assert all(o.doc for o in OPTIONS)


def test_the_cache_signature_is_generated_from_the_definition() -> None:
    parameters = inspect.signature(AdalnCache).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert set(parameters) == {"spec", "source", "device", "config", *CACHE_OPTION_NAMES}
    for o in (option(name) for name in CACHE_OPTION_NAMES):
        assert parameters[o.name].kind is inspect.Parameter.KEYWORD_ONLY, o.name
        assert parameters[o.name].default == o.default, o.name
    assert parameters["device"].default == "cpu"


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"max_plans": 0}, r"max_plans must be an integer >= 1.*--max-plans"),
        ({"max_plan_width": True}, r"max_plan_width.*--plan-width"),
        ({"host_cache_bytes": -1}, r"host_cache_bytes.*--host-cache-gb"),
        ({"read_ahead": 1.5}, r"read_ahead.*--read-ahead"),
        ({"precision": "fp16"}, r"precision must be one of.*--precision"),
        ({"shard": "rows"}, r"shard must be one of.*--shard"),
        ({"batched": 1}, r"batched must be True or False.*--batched"),
        ({"progress": "yes"}, r"progress must be None, True or False"),
        ({"store": 3}, r"store= must be a directory path or a Store.*--store"),
    ],
)
def test_each_check_names_the_option_and_its_flag(given: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        AdalnCacheConfig(**given)  # type: ignore[arg-type]  # the wrong types are the point


def test_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="'max_plan_widht'; did you mean 'max_plan_width'"):
        AdalnCacheConfig.of({"max_plan_widht": 2}, where="AdalnCache()")
    assert AdalnCacheConfig.of({"max_plans": 3}, where="x").max_plans == 3
    with pytest.raises(TypeError, match="on_miss is an option of enable_adaln_cache"):
        AdalnCacheConfig.of({"on_miss": "raise"}, where="AdalnCache()", cache=True)


def test_a_keyword_beside_config_replaces_its_field() -> None:
    """``config=`` plus keywords: the keywords win, and the result is checked again."""
    base = AdalnCacheConfig(max_plans=3, precision="fp32")
    merged = AdalnCacheConfig.of({"max_plans": 5}, where="x", config=base)
    assert (merged.max_plans, merged.precision, base.max_plans) == (5, "fp32", 3)
    with pytest.raises(ConfigError, match=r"max_plans.*--max-plans"):
        AdalnCacheConfig.of({"max_plans": 0}, where="x", config=base)
    with pytest.raises(ConfigError, match="config= must be an AdalnCacheConfig"):
        AdalnCacheConfig.of({}, where="x", config={"max_plans": 3})  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(ConfigError, match="mapping by component name"):
        AdalnCacheConfig.of({"tables": {"transformer": "t.safetensors"}}, where="AdalnCache()", cache=True)


def test_flags_come_from_the_definition() -> None:
    assert flag("max_plan_width") == option("max_plan_width").flag == "--plan-width"
    assert knob("host_cache_bytes") == "host_cache_bytes (CLI --host-cache-gb)"
    assert flag("device") == "--device"
    with pytest.raises(KeyError):
        flag("process_group")  # no flag: under torchrun the group is the world


def test_the_cache_takes_config_and_keywords_replace_its_fields() -> None:
    """``AdalnCache(..., config=AdalnCacheConfig(...))``: the cache's options from the config, a keyword
    beside it wins, and an integration option is refused as a keyword of the cache."""
    from adalncache import TensorSource
    from core_helpers import SPEC, make_weights

    source = TensorSource(make_weights(SPEC), SPEC)
    config = AdalnCacheConfig(max_plans=3, max_plan_width=2, read_ahead=0, on_miss="raise")
    cache = AdalnCache(SPEC, source, config=config, max_plan_width=3)
    assert (cache.max_plans, cache.max_plan_width, cache.read_ahead) == (3, 3, 0)
    # The option attributes are the options in force: read-only, so no caller sizes work by a value the slab lacks.
    for name in ("max_plans", "max_plan_width", "precision", "host_cache_bytes"):
        with pytest.raises(AttributeError, match=f"{name} is read-only"):
            setattr(cache, name, 1)
    assert (cache.max_plans, cache.options.max_plans) == (3, 3)
    cache.close()
    with pytest.raises(TypeError, match="overlap is an option of enable_adaln_cache"):
        AdalnCache(SPEC, source, overlap=True)  # type: ignore[call-arg]  # wrong on purpose: the refusal is tested


def test_the_docs_list_every_option_with_its_default_and_flag() -> None:
    """The documentation is checked against the definition: api.md's table has a row per cache option
    naming its CLI flag, and diffusers.md's options block lists every option with its default."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    api = (docs / "api.md").read_text()
    rows = {}  # option name -> its row, by the names in the row's first cell
    for row in re.findall(r"^\| `\w+`.*$", api, re.M):
        rows.update((name, row) for name in re.findall(r"`(\w+)`", row.split("|")[1]))
    block = (docs / "diffusers.md").read_text().split("## Options", 1)[1].split("```", 2)[1]
    for o in OPTIONS:
        if not o.integration:
            row = rows.get(o.name, "")
            assert row, f"api.md's options table lacks {o.name}"
            assert o.flag is None or o.flag in row, (o.name, o.flag)
        assert f"{o.name}={o.default!r}".replace("'", '"') in block, f"diffusers.md's options block: {o.name}"
