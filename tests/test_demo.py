"""``adalncache demo``: the main job's verdict, through the real command line."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from adalncache.cli import main
from adalncache.tools.demo import DemoResult, _print_result


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_demo_verdict_is_yes(task: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--task", task, "--steps", "5", "--size", "tiny", "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("\nbit-identical: yes") == 1
    assert "bit-identical: no" not in out
    assert f"task                   {task}" in out
    assert "1 rebuild pass for the whole request" in out
    assert "ahead-of-time plans match the loop: yes" in out
    assert "0 B weights" in out  # the projections left the device
    # The cached model was loaded with load_transformer, which never read the projections.
    assert out.count("of AdaLN projections and time embedder never read") == 1
    assert "load_transformer read " in out


def test_demo_all_tasks_small(capsys: pytest.CaptureFixture[str]) -> None:
    """The default job (every task, the 'small' size whose saving reads in MB)."""
    code = main(["demo", "--steps", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("\nbit-identical: yes") == 3  # one verdict line per task
    assert "all tasks bit-identical: yes" in out
    assert "MiB resident" in out


def test_demo_prints_no_for_a_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    result = DemoResult(
        task="t2va",
        steps=4,
        forwards=3,
        plans=3,
        passes=1,
        bytes_before=1 << 21,
        bytes_after=0,
        table_bytes=4096,
        resident_ms=1.0,
        cached_ms=1.0,
        stats={"passes": 1},
        identical=False,
        aot_plans_match=True,
        load_read_bytes=3 << 20,
        checkpoint_bytes=5 << 20,
        never_read_bytes=2 << 20,
    )
    _print_result(result)
    out = capsys.readouterr().out
    assert "bit-identical: no" in out
    assert "read 3.00 MiB of the 5.00 MiB checkpoint; 2.00 MiB of AdaLN projections" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--task", "i2v"], "--task"),
        (["demo", "--size", "huge"], "--size"),
        (["demo", "--steps", "1"], "--steps"),
        (["demo", "--device", "nonsense"], "--device"),
    ],
)
def test_demo_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_qwen_image_verdict_is_yes(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--model", "qwen-image", "--steps", "3", "--seed", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("\nbit-identical: yes") == 1
    assert "3 distinct, built in 1 pass(es) before the first step" in out
    assert "resident -> 0.0 KiB weights" in out  # the served weights left the device
    assert "of modulation projections and timestep embedder never read" in out


@pytest.mark.parametrize("model", ["bria", "ovis-image", "qwen-image"])
def test_a_family_demo_prints_only_its_own_lines(model: str) -> None:
    """A fresh process, as ``make demo ARGS="--model NAME"`` runs it: nothing on stderr (no other library's
    warning: transformers' torchvision fallback when a pipeline module imports an image processor,
    diffusers' direct-cast warning of a VAE cast at construction), and every stdout line is the demo's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import adalncache

    # The package under test and the interpreter's own site-packages (as the project's venv has them).
    env = {**os.environ, "PYTHONPATH": str(Path(adalncache.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "adalncache", "demo", "--model", model, "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0].startswith("adalncache demo: tiny ") and lines[-1] == "bit-identical: yes"
    assert all(line.startswith("  ") for line in lines[1:-1]), lines
