#!/usr/bin/env python3
"""Print the requirements of some of the package's optional extras, one per line, read from pyproject.toml.

``make test`` installs the test-only extras (``compose``, ``bnb``) apart from the package, so that
the extras' requirements keep one home (pyproject.toml) while the venv the commands run in stays
free of them:

    python3 scripts/extras.py compose bnb
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: the TOML reader pip itself uses
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]  # the same name on the older Python

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(names: list[str]) -> list[str]:
    """The requirements of the extras ``names``, in order; an unknown extra is an error."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    unknown = [name for name in names if name not in extras]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(sorted(extras))}")
    return [requirement for name in names for requirement in extras[name]]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
