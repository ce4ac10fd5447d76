"""Every command-line flag the library's messages name exists on the ``adalncache`` command line.

A message such as "set --host-cache-gb" is advice; a user who follows it must find the flag. The
flags are collected from the string literals of ``src/adalncache`` with ``ast`` (f-strings
included), and the defined flags by walking ``build_parser()`` and all its sub-commands.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adalncache.cli import build_parser

SRC = Path(__file__).resolve().parents[1] / "src" / "adalncache"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
#: Flags of another program that the library names as such: SGLang's, where a table file is served
#: (``adalncache export --help`` tells how its step count maps to SGLang's).
FOREIGN = {"--minimax-h3-adaln-cache-path", "--num-inference-steps"}


def named_flags(root: Path = SRC) -> dict[str, list[str]]:
    """Each ``--flag`` written in a string literal under ``root``, with where it is written."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for flag in FLAG.findall(node.value):
                    found.setdefault(flag, []).append(f"{path.relative_to(root.parent.parent)}:{node.lineno}")
    return found


def defined_flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Each option string of ``parser`` and its sub-commands, with the commands that define it."""
    out: dict[str, set[str]] = {}
    for action in parser._actions:
        for option in action.option_strings:
            out.setdefault(option, set()).add(parser.prog)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for option, progs in defined_flags(sub).items():
                    out.setdefault(option, set()).update(progs)
    return out


def test_every_flag_a_message_names_is_defined() -> None:
    defined = defined_flags(build_parser())
    missing = {flag: where for flag, where in named_flags().items() if flag not in defined and flag not in FOREIGN}
    assert not missing, "flags named in the library but defined by no command:\n" + "\n".join(
        f"  {flag}: {', '.join(where)}" for flag, where in sorted(missing.items())
    )


def test_the_collection_sees_messages_and_parsers() -> None:
    """The two sides are read for real: known library messages and known commands are found."""
    named = named_flags()
    assert any("options.py" in where for where in named["--host-cache-gb"])  # where messages take flags from
    assert any("commands.py" in where for where in named["--timeout"])  # an f-string
    defined = defined_flags(build_parser())
    assert "adalncache store prune" in defined["--max-gb"]  # a nested sub-command
    assert {"adalncache build", "adalncache verify"} <= defined["--read-ahead"]
    assert "adalncache build" in defined["--shard"] and "adalncache build" in defined["--host-cache-gb"]
    assert {"adalncache demo", "adalncache bench", "adalncache build"} <= defined["--device"]


def test_every_flag_of_the_options_definition_is_defined() -> None:
    """Messages take their flags from adalncache.options (not from literals): each one it holds or the families
    declare exists on ``build`` and ``export``, and each cache option with a flag parses to the option's own
    default on ``build``."""
    from adalncache import families
    from adalncache.options import ARGUMENT_FLAGS, OPTIONS, flag

    defined = defined_flags(build_parser())
    flags = {o.flag for o in OPTIONS if o.flag} | {f for text in ARGUMENT_FLAGS.values() for f in text.split("/")}
    for argument in families.ARGUMENTS.values():
        assert flag(argument.name) == argument.flag
        assert {"adalncache build", "adalncache export"} <= defined[argument.flag], argument.flag
        flags.add(argument.flag)
    assert not {f for f in flags if f not in defined}, sorted(f for f in flags if f not in defined)
    args = build_parser().parse_args(["build", "ckpt", "--store", "s", "--task", "t2va", "--steps", "4"])
    for o in OPTIONS:
        if hasattr(args, o.name) and o.name != "store":
            assert getattr(args, o.name) == o.default, o.name


def test_the_collection_finds_a_flag_no_command_defines(tmp_path: Path) -> None:
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "m.py").write_text('x = 3\nmsg = f"value {x}: set --no-such-flag or --max-plans"\n')
    named = named_flags(package)
    assert named == {"--no-such-flag": ["src/pkg/m.py:2"], "--max-plans": ["src/pkg/m.py:2"]}
    assert "--no-such-flag" not in defined_flags(build_parser())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--read-ahead", "-1"], "--read-ahead must be >= 0"),
        (["--read-ahead", "two"], "--read-ahead takes an integer"),
        (["--host-cache-gb", "-1"], "--host-cache-gb must be a non-negative number"),
        (["--shard", "rows"], "--shard.*invalid choice"),
        (["--timeout", "0"], "--timeout must be a positive number"),
        (["--device", "abacus"], "--device abacus is not a torch device"),
    ],
)
def test_build_flags_refuse_bad_values(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from adalncache.cli import main

    base = ["build", str(tmp_path / "missing"), "--store", str(tmp_path / "s"), "--task", "t2va", "--steps", "4"]
    try:
        code = main([*base, *argv])
    except SystemExit as exc:  # argparse's own errors exit; library errors return 2
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and re.search(says, err.splitlines()[-1]), err
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------
# a clean first screen: each command's stderr is its own

ROOT = Path(__file__).resolve().parents[1]
#: Terminal control sequences a progress bar writes (cursor up, erase line).
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def foreign_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are not adalncache's own (its progress bars and messages start so)."""
    lines = re.split(r"[\r\n]", ANSI.sub("", stderr))
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("adalncache")]


def run_as_installed(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m adalncache ARGV`` with only the package's source on the path, as a user's install sees
    it: none of the test-only extras (quantization libraries, a step cache, bitsandbytes) that the test
    run itself has on ``PYTHONPATH`` and that diffusers would import and let speak."""
    env = {key: value for key, value in os.environ.items() if key not in {"PYTHONPATH", "PYTHONWARNINGS"}}
    env["PYTHONPATH"] = str(ROOT / "src")
    return subprocess.run(
        [sys.executable, "-m", "adalncache", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_filter_of_foreign_lines_sees_other_libraries_and_passes_progress_bars() -> None:
    ours = "adalncache pass:   0%|          | 0/3\radalncache pass: 100%|#| 3/3\x1b[A\n"
    theirs = (
        "Failed to load torchao/_C_mxfp8.so: Could not load this library\n"
        "W1205 07:14:01 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass\n"
    )
    assert foreign_lines(ours) == []
    assert foreign_lines(ours + theirs) == [line for line in theirs.splitlines()]


def test_every_command_prints_only_its_own_output(tiny_saved_root: Path, tmp_path: Path) -> None:
    """``--help``, ``inspect``, ``build``, ``verify``, ``export`` on a tiny checkpoint, and ``demo`` (which
    imports diffusers): each succeeds, prints its output on stdout, and writes nothing on stderr but its
    own progress bars, in the environment a ``pip install`` gives (no other library's warnings)."""
    checkpoint, store = str(tiny_saved_root / "bf16"), str(tmp_path / "store")
    schedule = ["--task", "t2va", "--steps", "3"]
    commands = [
        ["--help"],
        ["inspect", checkpoint],
        ["build", checkpoint, *schedule, "--store", store],
        ["verify", "--store", store, "--checkpoint", checkpoint],
        ["export", checkpoint, *schedule, "-o", str(tmp_path / "tables.safetensors")],
        ["demo", "--size", "tiny", *schedule],
    ]
    for argv in commands:
        proc = run_as_installed(argv, tmp_path)
        assert proc.returncode == 0, (argv, proc.stderr[-2000:])
        assert proc.stdout.strip(), argv
        assert foreign_lines(proc.stderr) == [], (argv, foreign_lines(proc.stderr))
