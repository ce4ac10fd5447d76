"""Table files in the three formats other engines and this package read, behind one interface.

Each format is one module with its write, read and check (:mod:`.sglang`, which also holds the layout
every format shares, :mod:`.adalncache`, :mod:`.vllm_omni`). Callers never branch on the format: they
look it up by name (:func:`table_format`) or open a file with :class:`TableFile`, which finds its format
and has it check the file, as the tier, ``export``, ``verify`` and ``inspect`` use it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ..errors import ConfigError
from ..options import flag
from .adalncache import AdalncacheFormat
from .sglang import PLAN_TENSORS, Layout, SglangFormat, TableFormat, part_tensors
from .vllm_omni import VllmOmniFormat

#: Every format by its name (``--format``), in the order a file's format is recognised: a bound file is
#: also a file of SGLang's layout, so the bound format looks first.
FORMATS: dict[str, TableFormat] = {f.name: f for f in (AdalncacheFormat(), SglangFormat(), VllmOmniFormat())}


def table_format(name: str) -> TableFormat:
    """The format called ``name`` (ConfigError naming ``--format`` otherwise)."""
    if name not in FORMATS:
        raise ConfigError(f"{flag('format')} must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


class TableFile(Layout):
    """One table file of any of :data:`FORMATS` (see :class:`~.sglang.Layout`); ``format`` is the format's
    name and ``kind`` the format itself."""

    formats = tuple(FORMATS.values())


def is_table_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a safetensors file holding the plans and a family's table tensors (for ``inspect``)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                return False
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error):
        return False
    return (
        isinstance(header, dict) and all(name in header for name in PLAN_TENSORS) and part_tensors(header) is not None
    )


__all__ = ["FORMATS", "TableFile", "TableFormat", "is_table_file", "table_format"]
