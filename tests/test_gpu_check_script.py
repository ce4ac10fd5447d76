"""``scripts/gpu_check.py`` (the device check) runs every check a CPU can run, and always reports.

The script's purpose is a CUDA machine, which the test suite does not have; these tests keep it
working without one: the full run at small widths on CPU (every check's code path that needs no GPU), a
simulated failing check (the JSON still holds the others, and the demo still runs last), and a
simulated hang (the watchdog stops the run and the results before it are on disk).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--device",
    "cpu",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--in-features",
    "512",
    "--demo-size",
    "tiny",
    "--demo-steps",
    "3",
]


def run_script(tmp_path: Path, *extra: str, env_dir: Path | None = None, timeout: int = 300) -> tuple[Any, dict]:
    """Run the script in a fresh process; returns the process and the JSON it left."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "gpu_check.py"),
        *SMALL,
        "--dir",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
        *extra,
    ]
    env = None
    if env_dir is not None:
        import os

        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(env_dir), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    out = tmp_path / "out" / "gpu_check.json"
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def by_name(body: dict) -> dict[str, dict]:
    return {r["check"]: r for r in body["results"]}


def without_diffusers(tmp_path: Path) -> Path:
    """A directory whose ``sitecustomize`` hides diffusers, as on a machine without it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['diffusers'] = None\n")
    return site


@pytest.mark.slow
def test_every_check_runs_on_cpu(tmp_path: Path) -> None:
    proc, body = run_script(tmp_path)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert body["finished"] and body["aborted"] is None
    assert [r["check"] for r in body["results"]] == body["checks"], "every check ran, in order, the demo last"
    assert body["checks"][-1] == "demo"
    results = by_name(body)
    assert not [r for r in results.values() if not r.get("skipped") and not r["ok"]], tail
    for name, result in results.items():
        if name not in ("demo", "graph-capture", "first-request"):
            assert not result.get("skipped"), (name, result)
    for precision in ("match", "fp32"):
        exact = results[f"exact-{precision}"]
        assert exact["mismatches"] == 0 and exact["passes"] == 1
        assert set(exact["mismatches_by_width"]) == {"1", "2", "3", "4"}
    in_place = results["in-place"]
    assert in_place["mismatches"] == {"in_place": 0, "staged": 0} and in_place["bytes_in_place"] > 0
    tiled = results["tiled"]
    for precision in ("match", "fp32"):
        assert tiled[precision]["mismatches"] == {"tiled": 0, "whole": 0}
        assert {v[0] for v in tiled[precision]["verdicts"]} == {1, 2, 3, 4}
    direct = results["o-direct"]
    assert direct["mismatches"] == 0 and direct["mismatches_direct_io_false"] == 0
    # Where this filesystem takes O_DIRECT, the cold pass read directly (forced if need be).
    assert direct["direct_mib"] > 0 or not direct["o_direct_supported"]
    lag = results["lagging-consumer"]
    assert lag["mismatches"] == 0 and lag["projections"] == 2 * 3 and lag["peak_over_baseline_mib"] <= lag["budget_mib"]
    memory = results["memory"]
    assert len(memory["per_pass"]) == 6 and all(memory["verdicts"].values())
    assert results["stream-publish"]["mismatches"] == 0 and results["stream-evict"]["stale_reads"] == 0
    tf32 = results["tf32"]
    assert tf32["store_hits"] == 6 and tf32["store_write_failures"] == 0 and tf32["mismatches_batched"] == 0
    nccl = results["nccl"]
    assert nccl["backend"] == "gloo" and nccl["layers"]["mismatches"] == nccl["columns"]["mismatches"] == 0
    assert results["host-tier"]["host_hits"] == 2 and results["host-tier"]["passes"] == 0
    assert set(results["timing"]["median_s"]) == {"read", "project1", "pass1", "project16", "pass16"}
    capture = results["graph-capture"]
    if not capture.get("skipped"):
        assert capture["exact"] and capture["stray_forward_all_nan"] and capture["exact_after_mismatch"]
        assert "matched none" in capture["mismatch_reported"] or "match none" in capture["mismatch_reported"]
    first = results["first-request"]
    if not first.get("skipped"):
        assert first["latents_bit_identical"] == {"first_request": True, "first_request_qwen": True}
        assert len(first["ratios"]) == 3 and first["qwen_parts_s"]["pass"] > 0
    demo = results["demo"]
    if results["environment"]["importable"]["diffusers"]:
        assert demo["ok"] and "all tasks bit-identical: yes" in demo["output"]
    else:
        assert demo["skipped"].startswith("diffusers not importable")


def test_a_failing_check_leaves_the_others_and_the_demo_runs_last(tmp_path: Path) -> None:
    """One check raises, another hangs in its child process: both are recorded, the rest still run."""
    proc, body = run_script(
        tmp_path,
        "--only",
        "environment,exact-match,o-direct,nccl,host-tier,demo",
        "--simulate",
        "fail:exact-match,hang:nccl,keep-cache:o-direct",
        "--check-timeout",
        "30",
        env_dir=without_diffusers(tmp_path),
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = ["environment", "exact-match", "o-direct", "nccl", "host-tier", "demo"]
    assert [r["check"] for r in body["results"]] == checks
    results = by_name(body)
    direct = results["o-direct"]  # the path of a sandbox that keeps the page cache: every chunk O_DIRECT
    assert direct["ok"] and direct["how"].startswith("page cache could not be dropped")
    assert direct["direct_mib"] > 0 or not direct["o_direct_supported"]
    failed = results["exact-match"]
    assert failed["ok"] is False and "simulated failure of exact-match" in failed["error"]
    assert "Traceback" in failed["traceback"]
    hung = results["nccl"]  # the child's watchdog stopped it; this process went on
    assert hung["ok"] is False and "timed out" in hung["error"] and hung["process"] == "a fresh process"
    assert results["environment"]["ok"] and results["host-tier"]["ok"] and results["host-tier"]["host_hits"] == 2
    assert results["environment"]["importable"]["diffusers"] is False
    assert results["demo"]["ok"] is None and results["demo"]["skipped"].startswith("diffusers not importable")
    assert body["finished"] and "FAILED: exact-match, nccl" in proc.stdout


def test_a_hung_check_is_stopped_and_what_ran_before_it_is_kept(tmp_path: Path) -> None:
    proc, body = run_script(
        tmp_path,
        "--only",
        "environment,host-tier,demo",
        "--simulate",
        "hang:host-tier",
        "--check-timeout",
        "4",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["check"] for r in body["results"]] == ["environment", "host-tier"]
    results = by_name(body)
    assert results["environment"]["ok"]
    assert results["host-tier"]["ok"] is False and "timed out after 4 s" in results["host-tier"]["error"]
    assert body["finished"] is False and "host-tier" in body["aborted"]
    assert "run_check" in proc.stderr  # the stacks of the hung run, for whoever reads the log
