"""The state machine must catch the two historical bookkeeping bugs when they are put back.

Why a test: a model-based test that always passes proves nothing; this one fails if the state
machine ever stops noticing either reversal (``scripts/mutate.py`` puts them back into a scratch
copy of src/; the repository is never modified). The slow test runs the mutants in detection mode
(no shrinking), about 40 s for both. The cheap tests check that the mutations target the code's
structure, not its formatting: they still apply, and do exactly the same thing, after the slot
pool's source is re-emitted by ``ast.unparse`` or reformatted by ``ruff format`` with another line
length and indent width.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_mutate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("adalncache_mutate", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mutate = _load_mutate()
SOURCE = (ROOT / "src" / "adalncache" / mutate.TARGET).read_text()


def _code(text: str) -> str:
    """The syntax tree of ``text`` without docstrings (a reformatter may re-indent those)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _ruff() -> str | None:
    beside = Path(sys.executable).with_name("ruff")
    return str(beside) if beside.exists() else shutil.which("ruff")


def _reformatted(tmp_path: Path) -> dict[str, str]:
    """The slot pool's source re-emitted by ``ast.unparse`` and, where ruff exists, by ``ruff format``."""
    out = {"ast.unparse": ast.unparse(ast.parse(SOURCE))}
    ruff = _ruff()
    if ruff is not None:
        path = tmp_path / mutate.TARGET
        path.write_text(SOURCE)
        subprocess.run(
            [ruff, "format", "--isolated", "--line-length", "79", "--config", "indent-width = 2", str(path)],
            check=True,
            capture_output=True,
        )
        out["ruff format (79 columns, 2-space indent)"] = path.read_text()
    return out


@pytest.mark.parametrize("mutation", sorted(mutate.MUTATIONS))
def test_mutations_apply_by_structure_after_reformatting(mutation: str, tmp_path: Path) -> None:
    reference = mutate.mutate_source(mutation, SOURCE)
    assert _code(reference) != _code(SOURCE), f"mutation {mutation} changed nothing"
    copies = _reformatted(tmp_path)
    for how, text in copies.items():
        assert text != SOURCE, f"{how} did not reformat anything: the check would prove nothing"
        assert _code(text) == _code(SOURCE), f"{how} changed the code, not only its format"
        assert _code(mutate.mutate_source(mutation, text)) == _code(reference), f"{mutation} differs after {how}"


def test_a_mutation_whose_target_is_gone_refuses_to_run() -> None:
    """Renaming what a mutation edits must fail loudly, never run the state machine on unmutated code."""
    renamed = SOURCE.replace("def _eviction_candidates(", "def _victims(")
    with pytest.raises(mutate.MutationError, match="_eviction_candidates"):
        mutate.mutate_source("evict-wanted", renamed)
    unfiltered = SOURCE.replace("if k not in wanted]", "]")
    with pytest.raises(mutate.MutationError, match="not in wanted"):
        mutate.mutate_source("evict-wanted", unfiltered)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["publish-early", "evict-wanted"])
def test_state_machine_catches_mutation(mutation: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mutate.py"), mutation],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, f"mutation {mutation} was not caught:\n{proc.stdout}\n{proc.stderr}"
    assert "caught in" in proc.stdout and "state = CacheMachine()" in proc.stdout, proc.stdout
