"""The ``adalncache`` command line.

Each sub-command lives in the module that owns its work and exposes ``register(subparsers)``;
this file only wires them together and turns library errors into one clear line and exit
code 2, so a user never sees a traceback for a bad argument.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from .errors import AdalnCacheError

# Modules that register sub-commands, in the order ``--help`` lists them.
_COMMAND_MODULES = (
    "adalncache.tools.demo",
    "adalncache.commands",
    "adalncache.fit",
    "adalncache.tools.bench",
)

log = logging.getLogger("adalncache")


class _Parser(argparse.ArgumentParser):
    """argparse exits with 2 on bad arguments already; keep its messages to one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="adalncache",
        description="Serve AdaLN modulation of MiniMax-H3-like transformers from bit-exact tables.",
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


__all__ = ["build_parser", "main"]
