#!/usr/bin/env python3
"""Mutation check: put back one of two historical bookkeeping bugs in a scratch copy of src/ and
show that the state machine (tests/test_state_machine.py, CI profile) catches it.

Why: a model-based test that passes is only evidence if it fails on the bugs it exists for. Both
bugs live in the slot pool (``src/adalncache/slab.py``, class ``SlotPool``). A mutation is a
transformation of that module's syntax tree (``ast.NodeTransformer``), not a text substitution,
so it keeps applying after any reformatting of the code (line length, indentation, quotes,
comments); only a change of the code's structure or names can stop it, and then this script says
so and exits with an error instead of running an unmutated copy. The transformed module is written
back with ``ast.unparse`` into a copy of ``src/`` in a temporary directory (the repository is
never touched), and pytest runs the state machine with ``PYTHONPATH`` pointing at the copy, so the
mutated package shadows the installed one.

Mutations:

* ``publish-early``: the slot map is written when a slot is reserved, before any layer is
  projected (in ``SlotPool.reserve``), and a failed build does not take it back (the map
  deletion in ``SlotPool.release`` never runs): a retry then sees a half-built plan as a hit.
* ``evict-wanted``: eviction may pick a least-recently-used plan of the current request (the
  ``not in wanted`` filter of ``SlotPool._eviction_candidates`` is dropped): a reused plan
  disappears from the slab.

Usage: ``python scripts/mutate.py [--shrink] [publish-early|evict-wanted ...]`` (default: both).
Exit code 0 when every mutation was caught, 1 otherwise. Each run prints the command and the
failing example hypothesis reported. Without ``--shrink`` the run stops at the first failing
sequence (``ADALNCACHE_SM_NO_SHRINK=1``: detection, seconds); with it hypothesis also shrinks the
example to a minimal one, which can take up to its five-minute shrink limit.
"""

from __future__ import annotations

import ast
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_state_machine.py::test_state_machine"

#: The module (under src/adalncache) and class both mutations edit, and the pool's attribute names.
TARGET = "slab.py"
POOL_CLASS = "SlotPool"
MAP = "_map"
FREE = "_free"


class MutationError(RuntimeError):
    """The code no longer has the structure a mutation edits (say which, so it can be updated)."""


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and (node.value.id == "self")
    )


def _method(tree: ast.Module, name: str) -> ast.FunctionDef:
    """The method ``name`` of the pool class (exactly one)."""
    found = [
        item
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == POOL_CLASS
        for item in cls.body
        if isinstance(item, ast.FunctionDef) and item.name == name
    ]
    if len(found) != 1:
        raise MutationError(f"{TARGET}: expected one method {POOL_CLASS}.{name}, found {len(found)}")
    return found[0]


def _once(count: int, what: str) -> None:
    if count != 1:
        raise MutationError(f"{TARGET}: expected exactly one {what}, found {count}")


class _PublishAtReserve(ast.NodeTransformer):
    """After ``<slots>[key] = self._free.pop()``, also write ``self._map[key] = <slots>[key]``."""

    def __init__(self) -> None:
        self.count = 0

    def visit_Assign(self, node: ast.Assign) -> ast.AST | list[ast.stmt]:
        value = node.value
        pops_free = (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "pop"
            and _is_self_attr(value.func.value, FREE)
        )
        if not (pops_free and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)):
            return node
        self.count += 1
        target = node.targets[0]
        early = ast.Assign(
            targets=[
                ast.Subscript(
                    value=ast.Attribute(value=ast.Name("self", ast.Load()), attr=MAP, ctx=ast.Load()),
                    slice=copy.deepcopy(target.slice),
                    ctx=ast.Store(),
                )
            ],
            value=ast.Subscript(value=copy.deepcopy(target.value), slice=copy.deepcopy(target.slice), ctx=ast.Load()),
        )
        return [node, early]


class _KeepMapOnRelease(ast.NodeTransformer):
    """The ``if`` whose body deletes ``self._map[...]`` never runs: ``if <test>:`` -> ``if False:``."""

    def __init__(self) -> None:
        self.count = 0

    def visit_If(self, node: ast.If) -> ast.AST:
        self.generic_visit(node)
        deletes_map = any(
            isinstance(stmt, ast.Delete)
            and any(isinstance(t, ast.Subscript) and _is_self_attr(t.value, MAP) for t in stmt.targets)
            for stmt in node.body
        )
        if deletes_map:
            self.count += 1
            node.test = ast.Constant(False)
        return node


class _EvictAnything(ast.NodeTransformer):
    """Drop the ``<k> not in wanted`` filter of the comprehension over ``self._map``."""

    def __init__(self) -> None:
        self.count = 0

    def visit_comprehension(self, node: ast.comprehension) -> ast.AST:
        if not _is_self_attr(node.iter, MAP):
            return node
        kept = [
            cond
            for cond in node.ifs
            if not (
                isinstance(cond, ast.Compare)
                and len(cond.ops) == 1
                and isinstance(cond.ops[0], ast.NotIn)
                and isinstance(cond.comparators[0], ast.Name)
                and cond.comparators[0].id == "wanted"
            )
        ]
        self.count += len(node.ifs) - len(kept)
        node.ifs = kept
        return node


def _publish_early(tree: ast.Module) -> None:
    reserve = _PublishAtReserve()
    reserve.visit(_method(tree, "reserve"))
    _once(reserve.count, f"assignment of self.{FREE}.pop() to a slot in {POOL_CLASS}.reserve")
    release = _KeepMapOnRelease()
    release.visit(_method(tree, "release"))
    _once(release.count, f"'if' deleting from self.{MAP} in {POOL_CLASS}.release")


def _evict_wanted(tree: ast.Module) -> None:
    evict = _EvictAnything()
    evict.visit(_method(tree, "_eviction_candidates"))
    _once(evict.count, f"'not in wanted' filter over self.{MAP} in {POOL_CLASS}._eviction_candidates")


#: name -> transformation of the target module's tree (in place); raises MutationError.
MUTATIONS: dict[str, Callable[[ast.Module], None]] = {
    "publish-early": _publish_early,
    "evict-wanted": _evict_wanted,
}


def mutate_source(name: str, source: str) -> str:
    """``source`` (the text of the target module, formatted any way) with mutation ``name`` applied."""
    tree = ast.parse(source)
    MUTATIONS[name](tree)
    return ast.unparse(ast.fix_missing_locations(tree))


def mutated_copy(name: str, dest: Path) -> Path:
    """Copy src/ into ``dest`` and apply mutation ``name``; returns the directory for PYTHONPATH."""
    src = dest / "src"
    shutil.copytree(ROOT / "src" / "adalncache", src / "adalncache", ignore=shutil.ignore_patterns("__pycache__"))
    path = src / "adalncache" / TARGET
    path.write_text(mutate_source(name, path.read_text()))
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
        try:
            src = mutated_copy(name, Path(tmp))
        except MutationError as exc:
            raise SystemExit(f"mutation {name} cannot be applied: {exc}") from None
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
