"""The one canonical JSON encoding that every hash, binding and bound metadata is computed over.

Why one function: a store entry's binding hash, a table file's bound metadata, the content
digest's leaves and the build-lock namespace must each encode equal values to equal bytes, in
every process and every release, or an entry written by one would be a miss (or a second build)
for the other. Keys sorted, no whitespace, and anything JSON cannot express (a ``torch.dtype``, a
path) as its ``str``, so a value never makes the encoder raise halfway through a build.
"""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON bytes (sorted keys, compact separators, ``str`` for the rest)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def plain_json(value: Any) -> Any:
    """``value`` as JSON reads it back (a tuple becomes a list), so two bindings compare as stored."""
    return json.loads(canonical_json(value))


__all__ = ["canonical_json", "plain_json"]
