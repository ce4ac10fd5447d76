"""The state machine must catch the seed note's two bugs when they are put back (scripts/mutate.py).

Why a test: a model-based test that always passes proves nothing; this one fails if the state
machine ever stops noticing either reversal. It runs the mutants in detection mode (no shrinking),
about 40 s for both, on a scratch copy of src/ (the repository is never modified).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
