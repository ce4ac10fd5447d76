"""``scripts/gpu_check.py`` (the prepared device check) runs and passes on CPU at small widths.

A device session runs it on CUDA; this keeps the script itself from rotting between such sessions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_passes_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    cmd = [
        sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--layers", "2",
        "--hidden", "64", "--in-features", "512", "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["results"]
    names = {r["check"]: r for r in results}
    assert all(r["ok"] for r in results)
    cold = names["pass cold (O_DIRECT) == F.linear on device"]
    # Where this filesystem serves O_DIRECT and the drop emptied the cache, the cold pass went direct.
    expected = cold["o_direct_supported"] and cold["direct_expected"]
    assert cold["mismatches"] == 0 and (cold["direct_mib"] > 0 or not expected)
    assert names["host tier restore exact, no pass"]["host_hits"] == 2
