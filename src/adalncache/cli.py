"""The ``adalncache`` command line: its parser, ``main``, and its flags made from the one definition of each
(a cache option or a family's schedule argument, :mod:`adalncache.options`). Each sub-command's module
exposes ``register(subparsers)``; a library error is one line and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import families
from .errors import AdalnCacheError, ConfigError
from .options import Cli, option

# Modules that register sub-commands, in the order ``--help`` lists them.
_COMMAND_MODULES = ("adalncache.tools.demo", "adalncache.commands", "adalncache.fit", "adalncache.tools.bench")


class _Parser(argparse.ArgumentParser):
    """argparse exits with 2 on bad arguments already; keep its messages to one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="adalncache", description="Serve AdaLN modulation of MiniMax-H3-like transformers from bit-exact tables."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command whose optional dependency is absent
            if exc.name and exc.name.startswith("adalncache"):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(int(args.verbose), 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.func(args)
    except AdalnCacheError as exc:
        print(f"adalncache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"adalncache {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


def gib_to_bytes(value: float, flag: str) -> int:
    if not (value >= 0) or value == float("inf"):
        raise ConfigError(f"{flag} must be a non-negative number of GiB, got {value!r}")
    return int(value * (1 << 30))


def int_parser(flag: str, minimum: int, below: int | None = None) -> Callable[[str], int]:
    """argparse's ``type=`` of an integer flag in ``minimum <= value < below``, its errors naming ``flag``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum}, got {value}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"{flag} must be < {below}, got {value}")
        return value

    return parse


def _gib_bytes(text: str) -> int:
    try:
        return gib_to_bytes(float(text), option("host_cache_bytes").flag or "")
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _auto_switch(text: str) -> bool | str:
    """``auto``, ``on`` or ``off`` as an option takes it: ``"auto"``, True, False."""
    values: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}
    if text not in values:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from auto, on, off)")
    return values[text]


def add_flag(
    parser: Any, flag: str, cli: Cli, *, dest: str, help: str, default: Any, repeat: bool = False, shown: Any = None
) -> None:
    """One flag parsed as ``cli`` says; ``repeat``: each use appends; ``shown``: the default its help names."""
    kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": help}
    kinds: dict[str, dict[str, Any]] = {
        "int": {"type": int_parser(flag, cli.minimum, cli.below), "metavar": "N"},
        "float": {"type": float},
        "path": {"metavar": "DIR"},
        "choice": {"choices": list(cli.choices)},
        "switch": {"action": "store_true"},
        "auto-switch": {"type": _auto_switch, "metavar": "{auto,on,off}"},
        "gib": {"type": _gib_bytes, "metavar": "GIB"},
    }
    kwargs.update(kinds.get(cli.kind, {}))
    if repeat:
        kwargs["action"] = "append"
    if shown is not None and cli.kind != "switch":
        kwargs["help"] += f" (default: {shown:g})" if isinstance(shown, float) else f" (default: {shown})"
    parser.add_argument(flag, **kwargs)


def add_options(parser: argparse.ArgumentParser, names: Sequence[str], *, required: Sequence[str] = ()) -> None:
    """One flag per cache option of ``names``, from the option's definition; the value lands in ``args.<name>``
    in the option's own unit (bytes for ``--host-cache-gb``)."""
    for name in names:
        o = option(name)
        if o.flag is None or o.cli is None:
            raise ValueError(f"the option {name} has no command-line flag")
        if name in required:
            parser.add_argument(o.flag, dest=name, required=True, help=o.doc, metavar="DIR")
            continue
        shown = o.default / 2**30 if o.cli.kind == "gib" else o.default
        add_flag(parser, o.flag, o.cli, dest=name, help=o.doc, default=o.default, shown=str(shown))


def add_schedule_flags(parser: argparse.ArgumentParser) -> None:
    """Every family's schedule flags, each once, helped with the families that take them; all parse to None
    when absent (so one given at its default is seen): the checkpoint's family checks them once it is open."""
    group = parser.add_argument_group("schedule (the flags of the checkpoint's family)")
    for argument in families.ARGUMENTS.values():
        takers = families.takers(argument.name)
        said = "" if len(takers) == len(families.FAMILIES) else ", ".join(f.title for f in takers) + ": "
        shown = argument.default if argument.default not in (None, False) else None
        add_flag(
            group,
            argument.flag,
            argument.cli,
            dest=argument.name,
            help=said + argument.help,
            default=None,
            repeat=argument.repeat,
            shown=shown,
        )


__all__ = ["add_flag", "add_options", "add_schedule_flags", "build_parser", "gib_to_bytes", "int_parser", "main"]
