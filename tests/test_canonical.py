"""The one canonical JSON: its lenient form for the package's own hashes, its strict form for vLLM-Omni."""

from __future__ import annotations

import json
import math

import pytest
import torch

from adalncache.formats import vllm_omni
from adalncache.identity import canonical_json


def test_strict_and_lenient_encode_plain_values_to_the_same_bytes() -> None:
    value = {"b": [1, 2.5, "x"], "a": {"z": None, "y": True}, "é": "ü"}
    assert canonical_json(value) == canonical_json(value, strict=True)
    assert canonical_json(value) == b'{"a":{"y":true,"z":null},"b":[1,2.5,"x"],"\\u00e9":"\\u00fc"}'


def test_strict_refuses_what_the_lenient_form_writes_as_text() -> None:
    assert canonical_json([torch.bfloat16]) == b'["torch.bfloat16"]'
    with pytest.raises(TypeError):
        canonical_json([torch.bfloat16], strict=True)
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan}, strict=True)


def test_vllm_omni_manifest_encoding_is_the_strict_canonical_json() -> None:
    """vLLM-Omni re-encodes the manifest with ``json.dumps(sort_keys, compact, allow_nan=False)``
    and compares: the package's strict form must give exactly those bytes."""
    doc = {"weights": {"sha256": "ab"}, "schedule": [0.5, 1e-3], "architecture": "x"}
    expected = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    assert vllm_omni.canonical_json(doc) == expected
    assert canonical_json(doc, strict=True) == expected.encode()
