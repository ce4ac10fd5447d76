"""The cache's options, declared once in :class:`AdalnCacheConfig`: type, default, validation, documentation
and CLI flag of each; and the flags of the other arguments messages advise on (:data:`ARGUMENT_FLAGS`, the
families' schedule :class:`Argument`). Every door builds one config from it, the command line generates its
flags from it, and every message takes its flag from here (:func:`flag`, :func:`knob`), so the runtime
below the command line spells no flag. How to add an option: docs/api.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypedDict, TypeVar

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
}


@dataclass(frozen=True)
class Cli:
    """How the command line parses one option or argument.

    ``kind``: ``"int"`` (an integer >= ``minimum`` and, with ``below``, < ``below``), ``"float"``,
    ``"text"``, ``"choice"`` (one of ``choices``), ``"switch"`` (present or not), ``"auto-switch"``
    (``auto``, ``on`` or ``off``: ``"auto"``, True or False), ``"gib"`` (a number of GiB, turned into
    bytes), ``"path"``.
    """

    kind: Literal["int", "float", "text", "choice", "switch", "auto-switch", "gib", "path"]
    minimum: int = 0
    choices: tuple[str, ...] = ()
    below: int | None = None


@dataclass(frozen=True)
class Argument:
    """A flag that names a schedule (``--steps``), declared by the families that take it: its flag is its name
    with dashes, so no family spells one. ``default``: an absent flag's value (the flag itself parses as None
    when absent, so one given at its default is seen); ``repeat``: given several times, a list."""

    name: str
    help: str
    cli: Cli
    default: Any = None
    repeat: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


#: Every declared schedule argument by name (:func:`declare`).
_ARGUMENTS: dict[str, Argument] = {}


def declare(arguments: Iterable[Argument]) -> None:
    """Make ``arguments`` known to :func:`flag`; a name several families declare must be one argument."""
    for argument in arguments:
        known = _ARGUMENTS.setdefault(argument.name, argument)
        if known != argument:
            raise ValueError(
                f"the schedule argument {argument.name} is declared twice, differently: {known}, {argument}"
            )


#: An option's check: ``check(name, value, flag)`` raises a ConfigError naming the option and its flag.
Check = Callable[[str, Any, str | None], None]


@dataclass(frozen=True)
class Option:
    """One option of :class:`AdalnCacheConfig`, as the doors, the messages and the command line read it."""

    name: str
    default: Any
    doc: str
    flag: str | None
    check: Check | None
    cli: Cli | None
    #: An option of the diffusers doors only (the cache itself does not take it).
    integration: bool = False


def _fix(name: str, flag: str | None) -> str:
    return f"set {name}=" + (f" (CLI {flag})" if flag else "")


def _integer(minimum: int) -> Check:
    def check(name: str, value: Any, flag: str | None) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}: {_fix(name, flag)}")

    return check


def _one_of(choices: tuple[str, ...]) -> Check:
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
    check: Check | None = None,
    cli: Cli | None = None,
    integration: bool = False,
) -> Any:
    """A field of :class:`AdalnCacheConfig` with its documentation, flag, check and command-line parsing; the
    check defaults to the bounds ``cli`` parses with, so they are stated once."""
    if check is None and cli is not None:
        kinds = {"switch": _boolean, "auto-switch": _auto_or_boolean, "choice": _one_of(cli.choices)}
        check = _integer(cli.minimum) if cli.kind in ("int", "gib") else kinds.get(cli.kind)
    return field(default=default, metadata={_OPTION: (doc, flag, check, cli, integration)})


#: ``on_miss=``: what a forward outside a prepared request does with a plan that is not resident.
ON_MISS = ("build", "raise")
#: ``quantized_projections=``: where the tables of quantized or layerwise-cast projections come from.
QUANTIZED_PROJECTIONS = ("model", "checkpoint")


@dataclass(frozen=True)
class AdalnCacheConfig:
    """Every option of the AdaLN cache, checked when constructed (ConfigError naming the option and its flag).

    Every door reads it (docs/api.md): ``AdalnCache`` takes the first group of fields, the diffusers doors
    all of them (the ``integration`` ones too); keywords beside ``config=`` replace its fields (:meth:`of`).
    """

    max_plans: int = _option(
        64, "distinct plans (timestep sets) resident at once", flag="--max-plans", cli=Cli("int", 1)
    )
    max_plan_width: int = _option(4, "timesteps (rows) of the widest plan", flag="--plan-width", cli=Cli("int", 1))
    precision: str = _option(
        "match",
        "match: bit-identical to the resident projection; fp32: project in fp32, store in the weight dtype",
        flag="--precision",
        cli=Cli("choice", choices=PRECISIONS),
    )
    host_cache_bytes: int = _option(
        0,
        "host memory keeping copies of built plans, so an evicted plan returns without a pass (0: none)",
        flag="--host-cache-gb",
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
        cli=Cli("choice", choices=SHARD_MODES),
    )
    read_ahead: int = _option(
        1, "layers read ahead of the one being projected during a pass", flag="--read-ahead", cli=Cli("int", 0)
    )
    progress: bool | None = _option(
        None, "a progress bar for passes (None: when stderr is a terminal)", check=_optional_boolean
    )
    batched: bool = _option(
        False,
        "stack the plans of one width into one GEMM where a probe proves it bit-identical",
        flag="--batched",
        cli=Cli("switch"),
    )
    tiled: bool | str = _option(
        "auto",
        "project every plan tile by tile over the output columns where a probe proves it bit-identical: auto "
        "(where the probe also found it faster, with the default projection), on, off",
        flag="--tiled",
        cli=Cli("auto-switch"),
    )
    # A mapping by component is for the pipeline doors only, which split it before any cache sees it.
    tables: TablesArg | None = _option(
        None,
        "table files (adalncache export) served as a read-only tier below the store; for a pipeline with both "
        "transformers, a mapping by component name",
        flag="--tables",
    )
    on_miss: str = _option(
        "build",
        "what a forward outside a prepared request does with a plan that is not resident: build builds it (one "
        "warning per handle), raise raises PlanNotCachedError",
        check=_one_of(ON_MISS),
        integration=True,
    )
    free_time_embedder: bool | None = _option(
        None,
        "also move the time embedder off the device (None: unless another diffusers hook, which might read temb, "
        "is attached; the AdaLN projections are its only consumers in the stock forward)",
        check=_optional_boolean,
        integration=True,
    )
    layout: str = _option("auto", "the checkpoint's key layout: auto, native or diffusers", integration=True)
    verify_checkpoint: bool = _option(
        True,
        "stream the checkpoint once when enabling and refuse it unless its projections equal the model's (keep "
        "it on: a fine-tune or a fused LoRA must not be served from the base file)",
        check=_boolean,
        integration=True,
    )
    quantized_projections: str = _option(
        "model",
        "tables of quantized or layerwise-cast projections: model (through their own forward, equal to the "
        "quantized model's; a checkpoint is refused) or checkpoint (full-precision tables from the unquantized "
        "checkpoint, on purpose)",
        check=_one_of(QUANTIZED_PROJECTIONS),
        integration=True,
    )
    overlap: bool = _option(
        False,
        "run a pipeline request's pass on a background thread from the call's start, so its first step waits "
        "only for its own plans",
        check=_boolean,
        integration=True,
    )

    def __post_init__(self) -> None:
        for o in OPTIONS:
            if o.check is not None:  # ConfigError naming the option and its flag
                o.check(o.name, getattr(self, o.name), o.flag)

    @classmethod
    def of(
        cls,
        kwargs: Mapping[str, Any],
        *,
        where: str,
        config: AdalnCacheConfig | None = None,
        cache: bool = False,
        exclude: Sequence[str] = (),
    ) -> AdalnCacheConfig:
        """``config`` (default: the defaults) with the keywords given to ``where`` replacing its fields, checked;
        an unknown keyword is a TypeError naming the closest option. ``cache``: ``where`` is the cache itself
        (its options only, one set of table files); ``exclude``: options ``where`` has no use for."""
        if config is not None and not isinstance(config, AdalnCacheConfig):
            raise ConfigError(f"config= must be an AdalnCacheConfig, got {type(config).__name__}")
        names = [name for name in (CACHE_OPTION_NAMES if cache else OPTION_NAMES) if name not in exclude]
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                if name in OPTION_NAMES and cache:
                    hint = f" ({name} is an option of enable_adaln_cache and load_transformer, not of the cache)"
                raise TypeError(f"{where} got an unexpected keyword argument {name!r}{hint}")
        result = dataclasses.replace(config, **kwargs) if config is not None else cls(**kwargs)
        if cache and isinstance(result.tables, Mapping):
            raise ConfigError(
                "tables= is a mapping by component name, which only a pipeline takes; pass one path (or a list of "
                "paths) for a single transformer"
            )
        return result


#: One class: the cache's options are the first fields of the config (``AdalnCache.options`` is one).
CacheOptions = AdalnCacheConfig


class CacheKwargs(TypedDict, total=False):
    """The cache's options as keyword arguments (``**options: Unpack[CacheKwargs]``); defaults in
    :class:`AdalnCacheConfig`."""

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
    tables: TablesArg | Mapping[str, TablesArg] | None


class ConfigKwargs(CacheKwargs, total=False):
    """Every option as keyword arguments, for the diffusers doors (a test keeps both in step with the fields)."""

    on_miss: str
    free_time_embedder: bool | None
    layout: str
    verify_checkpoint: bool
    quantized_projections: str
    overlap: bool


#: Every option, in declaration order.
OPTIONS: tuple[Option, ...] = tuple(Option(f.name, f.default, *f.metadata[_OPTION]) for f in fields(AdalnCacheConfig))
OPTION_NAMES: tuple[str, ...] = tuple(option.name for option in OPTIONS)
#: The options of the cache itself (``AdalnCache(...)``'s keywords).
CACHE_OPTION_NAMES: tuple[str, ...] = tuple(option.name for option in OPTIONS if not option.integration)
_BY_NAME = {option.name: option for option in OPTIONS}


def option(name: str) -> Option:
    """The option called ``name``."""
    return _BY_NAME[name]


def flag(name: str) -> str:
    """The command-line flag of the option or argument ``name`` (``"max_plans"`` -> ``"--max-plans"``)."""
    found = _BY_NAME[name].flag if name in _BY_NAME else None
    found = found or ARGUMENT_FLAGS.get(name)
    if found is None and name in _ARGUMENTS:
        found = _ARGUMENTS[name].flag
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


def option_keywords(*, exclude: Sequence[str] = (), cache: bool = False) -> Callable[[F], F]:
    """Give a function that takes ``**options: Unpack[ConfigKwargs]`` the signature its users read: each option
    a keyword with its default and type (and documented at :data:`DOC_MARKER`), while the source names none.
    ``exclude``: options the function does not take (or takes as its own parameters); ``cache``: the cache's only.
    """

    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own} | set(exclude) | ({o.name for o in OPTIONS if o.integration} if cache else set())
        if function.__doc__ and DOC_MARKER in function.__doc__:
            function.__doc__ = _document(function.__doc__, taken)
        types = {f.name: f.type for f in fields(AdalnCacheConfig)}
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
