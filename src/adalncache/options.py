"""The cache's options, declared once: type, default, validation, documentation and CLI flag of each.

Why one module: the options reach the cache from four doors (``AdalnCache(...)``,
``enable_adaln_cache(...)``, ``load_transformer(...)`` and the ``build``/``export`` commands).
Each door used to restate the list, its defaults and its checks; now each forwards keyword
arguments typed by :class:`CacheKwargs` and builds one :class:`CacheOptions`, whose construction
checks every value. The command line generates its flags from :data:`OPTIONS`, and every message
that names a flag takes it from here (:func:`flag`, :func:`knob`), so the runtime below the
command line carries no flag of its own.

Adding an option is one edit here: a field of :class:`CacheOptions` (default, check, one line of
documentation, CLI flag and how the command line parses it) and its key in :class:`CacheKwargs`
(a test keeps the two in step). Every door then accepts it, validates it and documents it.

Besides the options, :data:`ARGUMENT_FLAGS` holds the flags of the other arguments the library's
messages advise on (a device, a checkpoint layout, a schedule, an export), for the same reason.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypedDict, TypeVar, cast

from typing_extensions import Self

from .errors import ConfigError

#: ``tables=``: one table file (``adalncache export``) or several, searched in order.
TablesArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

PRECISIONS = ("match", "fp32")
SHARD_MODES = ("layers", "columns")

#: The flags of arguments that are not cache options, by the keyword that names them in the library.
ARGUMENT_FLAGS = {
    "checkpoint": "--checkpoint",
    "device": "--device",
    "layout": "--layout",
    "task": "--task",
    "steps": "--steps",
    "format": "--format",
    "model_variant": "--model-variant",
    "output": "-o/--output",
    "sample": "--sample",
    "max_bytes": "--max-gb",
    "lock_wait_s": "--lock-wait",
    "mode": "--mode",
    "num_steps": "--num-steps",
    "base_schedule": "--base-schedule",
    "flow_shift": "--flow-shift",
    "audio_flow_shift": "--audio-flow-shift",
    "timesteps": "--timesteps",
    "additional_t_cond": "--additional-t-cond",
}


@dataclass(frozen=True)
class Cli:
    """How the command line parses one option.

    ``kind``: ``"int"`` (an integer >= ``minimum``), ``"choice"`` (one of ``choices``),
    ``"switch"`` (present or not), ``"auto-switch"`` (``auto``, ``on`` or ``off``: ``"auto"``, True or
    False), ``"gib"`` (a number of GiB, turned into bytes), ``"path"``.
    """

    kind: Literal["int", "choice", "switch", "auto-switch", "gib", "path"]
    minimum: int = 0
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Option:
    """One option of :class:`CacheOptions`, as the doors, the messages and the command line read it."""

    name: str
    default: Any
    doc: str
    flag: str | None
    check: Callable[[str, Any, str | None], None] | None
    cli: Cli | None

    def validate(self, value: Any) -> None:
        """ConfigError (naming the option and its flag) unless ``value`` is valid for it."""
        if self.check is not None:
            self.check(self.name, value, self.flag)


def _fix(name: str, flag: str | None) -> str:
    return f"set {name}=" + (f" (CLI {flag})" if flag else "")


def _integer(minimum: int) -> Callable[[str, Any, str | None], None]:
    def check(name: str, value: Any, flag: str | None) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}: {_fix(name, flag)}")

    return check


def _one_of(choices: tuple[str, ...]) -> Callable[[str, Any, str | None], None]:
    def check(name: str, value: Any, flag: str | None) -> None:
        if value not in choices:
            raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}: {_fix(name, flag)}")

    return check


def _boolean(name: str, value: Any, flag: str | None) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}: {_fix(name, flag)}")


def _auto_or_boolean(name: str, value: Any, flag: str | None) -> None:
    if not (value is True or value is False or value == "auto"):
        raise ConfigError(f"{name} must be 'auto', True or False, got {value!r}: {_fix(name, flag)} auto, on or off")


def _optional_boolean(name: str, value: Any, flag: str | None) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{name} must be None, True or False, got {value!r}: {_fix(name, flag)}")


def _store(name: str, value: Any, flag: str | None) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)) and not hasattr(value, "get_many"):
        raise ConfigError(
            f"{name}= must be a directory path or a Store, got {type(value).__name__} {value!r}: set {name}= "
            f"(CLI {flag} DIR), or None for no store"
        )


_OPTION = "adalncache.option"


def _option(
    default: Any,
    doc: str,
    *,
    flag: str | None = None,
    check: Callable[[str, Any, str | None], None] | None = None,
    cli: Cli | None = None,
) -> Any:
    """A field of :class:`CacheOptions` with its documentation, flag, check and command-line parsing."""
    return field(default=default, metadata={_OPTION: (doc, flag, check, cli)})


@dataclass(frozen=True)
class CacheOptions:
    """The options of an :class:`~adalncache.AdalnCache`, checked when constructed (ConfigError).

    The device is not among them: it is where the cache is assembled (the model's device for an
    enabled model), not a setting of the tables.
    """

    max_plans: int = _option(
        64, "distinct plans (timestep sets) resident at once", flag="--max-plans", check=_integer(1), cli=Cli("int", 1)
    )
    max_plan_width: int = _option(
        4, "timesteps (rows) of the widest plan", flag="--plan-width", check=_integer(1), cli=Cli("int", 1)
    )
    precision: str = _option(
        "match",
        "match: bit-identical to the resident projection; fp32: project in fp32, store in the weight dtype",
        flag="--precision",
        check=_one_of(PRECISIONS),
        cli=Cli("choice", choices=PRECISIONS),
    )
    host_cache_bytes: int = _option(
        0,
        "host memory keeping copies of built plans, so an evicted plan returns without a pass (0: none)",
        flag="--host-cache-gb",
        check=_integer(0),
        cli=Cli("gib"),
    )
    store: Any = _option(
        None,
        "a directory (or Store) whose entries survive restarts, keyed by the checkpoint's content",
        flag="--store",
        check=_store,
        cli=Cli("path"),
    )
    process_group: Any = _option(None, "a torch.distributed group whose ranks share each pass (torchrun: the world)")
    shard: str = _option(
        "layers",
        "how ranks split a pass: layers (the one-process tables) or columns (a column-parallel runtime's tables)",
        flag="--shard",
        check=_one_of(SHARD_MODES),
        cli=Cli("choice", choices=SHARD_MODES),
    )
    read_ahead: int = _option(
        1,
        "layers read ahead of the one being projected during a pass",
        flag="--read-ahead",
        check=_integer(0),
        cli=Cli("int", 0),
    )
    progress: bool | None = _option(
        None, "a progress bar for passes (None: when stderr is a terminal)", check=_optional_boolean
    )
    batched: bool = _option(
        False,
        "stack the plans of one width into one GEMM where a probe proves it bit-identical",
        flag="--batched",
        check=_boolean,
        cli=Cli("switch"),
    )
    tiled: bool | str = _option(
        "auto",
        "project every plan tile by tile over the output columns where a probe proves it bit-identical: auto "
        "(where the probe also found it faster, with the default projection), on, off",
        flag="--tiled",
        check=_auto_or_boolean,
        cli=Cli("auto-switch"),
    )
    tables: TablesArg | None = _option(
        None, "table files (adalncache export) served as a read-only tier below the store", flag="--tables"
    )

    def __post_init__(self) -> None:
        for option in OPTIONS:
            option.validate(getattr(self, option.name))

    @classmethod
    def of(cls, kwargs: CacheKwargs | dict[str, Any], *, where: str) -> Self:
        """The options given as keyword arguments to ``where``; TypeError names an unknown one."""
        unknown = [name for name in kwargs if name not in OPTION_NAMES]
        if unknown:
            raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}")
        return cls(**kwargs)

    def kwargs(self) -> CacheKwargs:
        """The options as keyword arguments of ``AdalnCache`` (those of this class, not a subclass's)."""
        return cast(CacheKwargs, {name: getattr(self, name) for name in OPTION_NAMES})


class ServingKwargs(TypedDict, total=False):
    """Every option but ``tables`` as keyword arguments, for a door that types ``tables=`` its own way."""

    max_plans: int
    max_plan_width: int
    precision: str
    host_cache_bytes: int
    store: Any
    process_group: Any
    shard: str
    read_ahead: int
    progress: bool | None
    batched: bool
    tiled: bool | str


class CacheKwargs(ServingKwargs, total=False):
    """The options as keyword arguments (``**options: Unpack[CacheKwargs]``); defaults in :class:`CacheOptions`."""

    tables: TablesArg | None


def _options() -> tuple[Option, ...]:
    found = []
    for f in fields(CacheOptions):
        doc, flag_, check, cli = f.metadata[_OPTION]
        found.append(Option(f.name, f.default, doc, flag_, check, cli))
    return tuple(found)


#: Every option, in declaration order.
OPTIONS: tuple[Option, ...] = _options()
OPTION_NAMES: tuple[str, ...] = tuple(option.name for option in OPTIONS)
_BY_NAME = {option.name: option for option in OPTIONS}


def option(name: str) -> Option:
    """The option called ``name``."""
    return _BY_NAME[name]


def flag(name: str) -> str:
    """The command-line flag of the option or argument ``name`` (``"max_plans"`` -> ``"--max-plans"``)."""
    found = _BY_NAME[name].flag if name in _BY_NAME else ARGUMENT_FLAGS.get(name)
    if found is None:
        raise KeyError(f"{name} has no command-line flag")
    return found


F = TypeVar("F", bound=Callable[..., Any])

#: The line of a docstring that :func:`option_keywords` replaces with the options' documentation.
DOC_MARKER = "{cache options}"


def _document(doc: str, exclude: set[str]) -> str:
    """``doc`` with its :data:`DOC_MARKER` line replaced by one entry per option (default, CLI flag)."""
    lines = []
    for line in doc.splitlines():
        if line.strip() != DOC_MARKER:
            lines.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        for o in OPTIONS:
            if o.name not in exclude:
                cli = f", CLI ``{o.flag}``" if o.flag else ""
                lines.append(f"{indent}{o.name}: {o.doc} (default ``{o.default!r}``{cli}).")
    return "\n".join(lines)


def option_keywords(*, exclude: Sequence[str] = ()) -> Callable[[F], F]:
    """Give a function that takes ``**options: Unpack[CacheKwargs]`` the signature its users read.

    ``inspect.signature``, ``help()`` and the documentation then list each option as a keyword
    argument with its default and type, as if it were written out, while the function's source
    names none of them: the list lives in :class:`CacheOptions` alone. ``exclude``: options the
    function does not take (or takes as its own parameters).
    """

    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own} | set(exclude)
        if function.__doc__ and DOC_MARKER in function.__doc__:
            function.__doc__ = _document(function.__doc__, taken)
        types = {f.name: f.type for f in fields(CacheOptions)}
        added = [
            inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=types[o.name])
            for o in OPTIONS
            if o.name not in taken
        ]
        vars(function)["__signature__"] = signature.replace(parameters=[*own, *added])
        return function

    return decorate


def knob(name: str) -> str:
    """How a message names a setting to change: ``"max_plans (CLI --max-plans)"``."""
    return f"{name} (CLI {flag(name)})"


__all__ = [
    "ARGUMENT_FLAGS",
    "DOC_MARKER",
    "OPTIONS",
    "OPTION_NAMES",
    "PRECISIONS",
    "SHARD_MODES",
    "CacheKwargs",
    "CacheOptions",
    "Cli",
    "Option",
    "ServingKwargs",
    "TablesArg",
    "flag",
    "knob",
    "option",
    "option_keywords",
]
