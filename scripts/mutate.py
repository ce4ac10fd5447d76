#!/usr/bin/env python3
"""Mutation check: undo one of the seed note's fixes in a scratch copy of src/ and show that the
state machine (tests/test_state_machine.py, CI profile) catches it.

Why: a model-based test that passes is only evidence if it fails on the bugs it exists for. The
seed note's two bookkeeping bugs are re-introduced by exact text substitutions into a copy of
``src/`` in a temporary directory (the repository is never touched), and pytest runs the state
machine with ``PYTHONPATH`` pointing at the copy, so the mutated package shadows the editable
install.

Mutations:

* ``publish-early``: the slot map is written when a slot is reserved, before any layer is
  projected, and a failed build does not take it back (the seed note's bug 2: a retry then sees
  a half-built plan as a hit).
* ``evict-wanted``: eviction may pick a least-recently-used plan of the current request (the seed
  note's bug 1: a reused plan disappears from the slab).

Usage: ``python scripts/mutate.py [--shrink] [publish-early|evict-wanted ...]`` (default: both).
Exit code 0 when every mutation was caught, 1 otherwise. Each run prints the command and the
failing example hypothesis reported. Without ``--shrink`` the run stops at the first failing
sequence (``ADALNCACHE_SM_NO_SHRINK=1``: detection, seconds); with it hypothesis also shrinks the
example to a minimal one, which can take up to its five-minute shrink limit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_state_machine.py::test_state_machine"

#: name -> list of (file under src/adalncache, exact text, replacement). Each text must occur once.
MUTATIONS: dict[str, list[tuple[str, str, str]]] = {
    "publish-early": [
        (
            "cache.py",
            "            slots[key] = self._free.pop()\n",
            "            slots[key] = self._free.pop()\n"
            "            self._slots[key] = slots[key]  # MUTATION: map first\n",
        ),
        (
            "cache.py",
            "            if self._slots.get(key) == slot:\n                del self._slots[key]\n",
            "            if False:  # MUTATION: a failed build keeps its map entries\n"
            "                del self._slots[key]\n",
        ),
    ],
    "evict-wanted": [
        (
            "cache.py",
            "(k for k in list(self._slots) if k not in wanted)",
            "(k for k in list(self._slots))  # MUTATION: may evict the request's own plans",
        ),
    ],
}


def mutated_copy(name: str, dest: Path) -> Path:
    """Copy src/ into ``dest`` and apply mutation ``name``; returns the directory for PYTHONPATH."""
    src = dest / "src"
    shutil.copytree(ROOT / "src" / "adalncache", src / "adalncache", ignore=shutil.ignore_patterns("__pycache__"))
    for file, old, new in MUTATIONS[name]:
        path = src / "adalncache" / file
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutation {name}: the text to replace occurs {text.count(old)} times in {file}")
        path.write_text(text.replace(old, new))
    return src


def failing_example(output: str) -> str:
    """The ``state = CacheMachine()`` ... ``state.teardown()`` block hypothesis printed."""
    lines = [re.sub(r"^E?[\s|]*", "", line) for line in output.splitlines()]
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "state = CacheMachine()")
        end = next(i for i in range(start, len(lines)) if lines[i].strip() == "state.teardown()")
    except StopIteration:
        return "(no failing example found in the output)"
    errors = [line for line in lines[:start] if re.match(r"^(\w+Error|Failed): ", line)]
    block = "\n".join(line.strip() for line in lines[start : end + 1])
    return block + ("\n# " + errors[-1].strip() if errors else "")


def run(name: str, *, shrink: bool = False) -> bool:
    with tempfile.TemporaryDirectory(prefix=f"adalncache-mutant-{name}-") as tmp:
        src = mutated_copy(name, Path(tmp))
        env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.pop("ADALNCACHE_SOAK", None)
        env.pop("ADALNCACHE_SM_NO_SHRINK", None)
        if not shrink:
            env["ADALNCACHE_SM_NO_SHRINK"] = "1"
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--show-capture=no", TEST]
        check = [sys.executable, "-c", "import adalncache, sys; sys.stdout.write(adalncache.__file__)"]
        where = subprocess.run(check, env=env, capture_output=True, text=True, cwd=ROOT).stdout
        if not where.startswith(str(src)):
            raise SystemExit(f"the mutated copy does not shadow the package (imported {where})")
        knob = "" if shrink else "ADALNCACHE_SM_NO_SHRINK=1 "
        print(f"== mutation {name}: {knob}PYTHONPATH={src} python {' '.join(cmd[1:])}", flush=True)
        started = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - started
        caught = proc.returncode != 0
        print(f"   {'caught' if caught else 'NOT caught'} in {seconds:.1f} s (pytest exit {proc.returncode})")
        if caught:
            print(failing_example(proc.stdout + proc.stderr))
        return caught


def main(argv: list[str]) -> int:
    shrink = "--shrink" in argv
    names = [a for a in argv if a != "--shrink"] or list(MUTATIONS)
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        print(f"unknown mutation(s) {unknown}: choose from {list(MUTATIONS)}", file=sys.stderr)
        return 2
    results = [run(name, shrink=shrink) for name in names]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
