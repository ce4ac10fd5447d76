"""The cache options are declared once (adalncache.options) and every door reads that one definition.

The doors are ``AdalnCache(...)``, ``enable_adaln_cache(...)``, ``load_transformer(...)`` and the
``build``/``export`` commands; the tests here check the definition itself (its typed keyword
form agrees with its fields, each check refuses with the option's flag, an unknown keyword is a
TypeError) and that the cache's public signature is generated from it.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from adalncache import AdalnCache
from adalncache.errors import ConfigError
from adalncache.options import OPTIONS, CacheKwargs, CacheOptions, flag, knob, option


def test_the_keyword_form_lists_exactly_the_fields() -> None:
    """CacheKwargs (for ``**options: Unpack[...]``) and CacheOptions name the same options."""
    assert list(typing.get_type_hints(CacheKwargs)) == [f.name for f in dataclasses.fields(CacheOptions)]
    assert [o.name for o in OPTIONS] == [f.name for f in dataclasses.fields(CacheOptions)]
    assert all(o.doc for o in OPTIONS)


def test_the_cache_signature_is_generated_from_the_definition() -> None:
    parameters = inspect.signature(AdalnCache).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for o in OPTIONS:
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
        CacheOptions(**given)  # type: ignore[arg-type]  # the wrong types are the point


def test_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="max_plan_widht"):
        CacheOptions.of({"max_plan_widht": 2}, where="AdalnCache()")
    assert CacheOptions.of({"max_plans": 3}, where="x").kwargs()["max_plans"] == 3


def test_flags_come_from_the_definition() -> None:
    assert flag("max_plan_width") == option("max_plan_width").flag == "--plan-width"
    assert knob("host_cache_bytes") == "host_cache_bytes (CLI --host-cache-gb)"
    assert flag("device") == "--device"
    with pytest.raises(KeyError):
        flag("process_group")  # no flag: under torchrun the group is the world
