"""``from adalncache.diffusers import enable_adaln_cache``: the public names of
:mod:`adalncache.integrations.diffusers` (which needs diffusers), exactly, on one short path.
"""

from __future__ import annotations

from .integrations.diffusers import *  # noqa: F403  # the package's public names, listed there once
from .integrations.diffusers import __all__ as __all__
