"""The one canonical JSON encoding that every hash, binding and bound metadata is computed over.

Why one function: a store entry's binding hash, a table file's bound metadata, the content
digest's leaves and the build-lock namespace must each encode equal values to equal bytes, in
every process and every release, or an entry written by one would be a miss (or a second build)
for the other. Keys sorted, no whitespace, and anything JSON cannot express (a ``torch.dtype``, a
path) as its ``str``, so a value never makes the encoder raise halfway through a build.

``strict=True`` is the same encoding for a format another program reads back and re-checks
(vLLM-Omni's manifest): there a value JSON cannot express must fail loudly at export, never be
written as a ``str`` the reader's own encoder would not produce, and NaN or infinity (not JSON)
are refused instead of written as ``NaN``.
"""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any, *, strict: bool = False) -> bytes:
    """``value`` as canonical JSON bytes (sorted keys, compact separators, ``str`` for the rest).

    With ``strict``, anything JSON cannot express, NaN and infinity included, raises instead.
    """
    if strict:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def plain_json(value: Any) -> Any:
    """``value`` as JSON reads it back (a tuple becomes a list), so two bindings compare as stored."""
    return json.loads(canonical_json(value))


__all__ = ["canonical_json", "plain_json"]
