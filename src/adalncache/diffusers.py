"""``from adalncache.diffusers import enable_adaln_cache``: the diffusers integration's public names.

A thin re-export so users import from one short path; the implementation lives in
:mod:`adalncache.integrations.diffusers` (a package with one module per job; it needs diffusers
installed). It exports exactly that package's names (a test holds the two lists equal).
"""

from __future__ import annotations

from .integrations.diffusers import *  # noqa: F403  # the package's public names, listed there once
from .integrations.diffusers import __all__ as __all__
