"""``adalncache build | export | inspect | verify | store prune``: the command-line shells.

Each ``run_*`` checks its arguments, turns them into library calls (:mod:`adalncache.offline`,
:mod:`adalncache.formats`, :mod:`adalncache.plans`, :mod:`adalncache.embedding`) and prints what they
return; the work itself lives in the library, where the examples and the tests call it too.
``build`` and ``export`` may run under torchrun: each rank then builds its share of every pass
(``--shard``) and the ranks exchange rows, as ``AdalnCache(process_group=...)`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from .cache import AdalnCache
from .devices import resolve_device
from .embedding import time_embed_fn
from .errors import ConfigError
from .families import adaln_zero, qwen_image
from .families.minimax_h3 import MODEL_VARIANTS
from .formats import FORMATS, TableFile, TableFormat, is_table_file, table_format, vllm_omni
from .geometry import TIMESTEP
from .offline import (
    check_output,
    describe_checkpoint,
    describe_store,
    export_tables,
    fill_store,
    is_store,
    open_checkpoint,
    source_files,
    verify_store,
    verify_tables,
)
from .options import flag, option
from .plans import schedule_plans
from .schedules import TASKS
from .spec import LAYOUTS
from .tiers.store import Store


def _embed_fn(source: Any, spec: Any, device: torch.device) -> Callable[[torch.Tensor], Any]:
    """``embed(plan)`` of the checkpoint's family, from the checkpoint alone.

    The AdaLayerNormZero family's comes from the integration: each class computes ``temb`` with
    its own modules, which it builds from the checkpoint's config (only their weights loaded).
    """
    if spec.family.name == adaln_zero.FAMILY.name:
        from .integrations.diffusers.adaln_zero import adaln_zero_embed_fn

        return adaln_zero_embed_fn(source, spec, device)
    return time_embed_fn(source, spec, device)


def _gb_to_bytes(value: float, flag: str) -> int:
    if not (value >= 0) or value == float("inf"):
        raise ConfigError(f"{flag} must be a non-negative number of GiB, got {value!r}")
    return int(value * (1 << 30))


# ---------------------------------------------------------------------------------------------
# build


@contextlib.contextmanager
def _torchrun_group(device: torch.device, timeout: float) -> Iterator[tuple[Any, torch.device, int]]:
    """(process group, this rank's device, rank) when torchrun started this command (``WORLD_SIZE`` > 1).

    A plain run gets ``(None, device, 0)``.
    gloo on CPU, NCCL on CUDA with one GPU per rank (``LOCAL_RANK``). ``timeout`` is the only bound
    on how long the other ranks wait when one dies outright, so it is the user's to set.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield None, device, 0
        return
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout))
    try:
        yield dist.group.WORLD, device, dist.get_rank()
        # The ranks leave together: a rank that exits while rank 0 still writes (and hashes) closes its
        # connections under rank 0's process group, which can abort rank 0. Skipped on a failure.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_build(args: argparse.Namespace) -> int:
    if not (args.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    plans, described = _request_plans(args, spec)
    width = max(p.shape[0] for p in plans)
    if width > args.max_plan_width:
        raise ConfigError(
            f"these schedules have plans of {width} timesteps: raise {flag('max_plan_width')} to at least {width}"
        )
    with _torchrun_group(device, args.timeout) as (group, device, rank):
        rank0 = rank == 0
        embed = _embed_fn(source, spec, device)
        # The working slab: no more plans than one pass needs, so a small build allocates little.
        options = _options_of(args, BUILD_OPTIONS)
        options.update(max_plans=max(1, min(args.max_plans, len(plans))), max_plan_width=width)
        options.update(store=Store(args.store, lock_wait_s=args.lock_wait), progress=rank0 and not args.quiet)
        # Closed before the group is destroyed: a cache that outlived it would keep gloo's threads alive.
        with AdalnCache(spec, source, device=device, process_group=group, **options) as cache:
            report = fill_store(cache, plans, embed=embed, progress=rank0 and not args.quiet)
            ranks = f", {cache.world_size} ranks (--shard {args.shard})" if group is not None else ""
    if rank0:
        print(
            f"adalncache build: {report.plans} distinct plan(s) for {described}: {report.already_stored} already "
            f"stored, {report.built} built in "
            f"{report.passes} pass(es) into {args.store} (binding {report.binding[:12]}, {args.precision}{ranks})"
        )
    return 0


# ---------------------------------------------------------------------------------------------
# export


def run_export(args: argparse.Namespace) -> int:
    if not (args.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    kind = table_format(args.format)
    own = kind.schedule(args.checkpoint, _format_inputs(args, kind))  # None: the family's schedule flags
    output = Path(args.output)
    check_output(output)  # before anything is read, then again against the checkpoint's files
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    check_output(output, source_files(source))
    tasks = args.task or []
    world = max(int(os.environ.get("WORLD_SIZE", "1")), 2 if args.shard == "columns" else 1)
    kind.check_export(
        spec,
        precision=args.precision,
        model_variant=args.model_variant,
        tasks=tasks,
        schedules=own[1] if own is not None else (),
        shard=args.shard,
        world_size=world,
        tiers=bool(args.store),
    )
    if own is None:
        plans, _ = _request_plans(args, spec)
        schedules = _schedule_records(args, spec)
    else:
        plans, schedules = own
    width = max(p.shape[0] for p in plans)
    store = Store(args.store, lock_wait_s=args.lock_wait) if args.store else None
    with _torchrun_group(device, args.timeout) as (group, device, rank):
        rank0 = rank == 0
        embed = None if kind.own_input else _embed_fn(source, spec, device)
        options = _options_of(args, EXPORT_OPTIONS)
        options.update(max_plans=max(1, min(args.max_plans, len(plans))), max_plan_width=width, store=store)
        with AdalnCache(
            spec, source, device=device, process_group=group, progress=rank0 and not args.quiet, **options
        ) as cache:
            report = export_tables(
                cache,
                plans,
                output,
                embed=embed,
                format=args.format,
                model_variant=args.model_variant,
                tasks=tasks,
                schedules=schedules,
                progress=rank0 and not args.quiet,
            )
    if rank0 and own is not None:
        sidecar = schedules[0]
        print(
            f"adalncache export: wrote {report.path} (vllm-omni format 4, {report.plans} plans of up to "
            f"{report.width} timesteps, {report.bytes / 2**20:.2f} MiB): {report.built} built in {report.passes} "
            f"pass(es)"
        )
        print(
            f"  serves vLLM-Omni {vllm_omni.variant_of(sidecar['mode'])} requests of mode {sidecar['mode']}, "
            f"{sidecar['num_steps']} steps, flow_shift {sidecar['flow_shift']:g}, audio_flow_shift "
            f"{sidecar['audio_flow_shift']:g}, in eager mode (enforce_eager), tensor parallel 1, on this machine class"
        )
    elif rank0 and spec.family.name != "minimax-h3":
        print(
            f"adalncache export: wrote {report.path} ({report.format}, {report.plans} plans of up to {report.width} "
            f"rows, {report.bytes / 2**20:.2f} MiB): {report.store_hits} from the store, {report.built} built in "
            f"{report.passes} pass(es); content {report.content}"
        )
    elif rank0:
        sglang = ", ".join(f"--steps {n} -> --num-inference-steps {n - 1}" for n in args.steps)
        print(
            f"adalncache export: wrote {report.path} ({report.format}, {report.plans} plans of up to {report.width} "
            f"timesteps, {report.bytes / 2**20:.2f} MiB): {report.store_hits} from the store, {report.built} built "
            f"in {report.passes} pass(es); content {report.content or 'not bound (sglang format)'}"
        )
        print(f"  serves SGLang ({sglang}){f', --model-variant {args.model_variant}' if args.model_variant else ''}")
    return 0


def _schedule_inputs() -> tuple[dict[str, Any], frozenset[str]]:
    """``export``'s schedule inputs (argument names), each with the default it stands for when not given, and
    which of them are the checkpoint family's (the others name a format's own schedule)."""
    family, own = argparse.ArgumentParser(add_help=False), argparse.ArgumentParser(add_help=False)
    _schedules(family, "")
    _sidecar_arguments(own)
    names = vars(family.parse_args([]))
    return {**names, **vars(own.parse_args([]))}, frozenset(names)


def _format_inputs(args: argparse.Namespace, kind: TableFormat) -> dict[str, Any]:
    """The schedule inputs given to ``export``, once every one the format does not take is refused.

    ``export`` parses every schedule flag with the default None, so a flag given is seen even at its
    default value (``--video-shift 12``); the defaults are put back here once it is checked. A
    format takes its own inputs (``takes``) or, without any, the checkpoint family's schedule flags.
    """
    defaults, family = _schedule_inputs()
    given = {name: getattr(args, name) for name in defaults if getattr(args, name) is not None}
    takes = kind.takes if kind.takes is not None else family
    refused = ", ".join("--" + name.replace("_", "-") for name in given if name not in takes)
    if refused:
        said = "its own schedule flags" if kind.takes is not None else "the checkpoint family's schedule flags"
        taken = ", ".join("--" + name.replace("_", "-") for name in defaults if name in takes)
        raise ConfigError(f"--format {kind.name} does not take {refused} (it takes {said}: {taken}): drop {refused}")
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return given


def _sidecar_arguments(parser: argparse.ArgumentParser) -> None:
    """The schedule of a ``--format vllm-omni`` file, named as vLLM-Omni's schedule contract names it."""
    group = parser.add_argument_group(
        "vllm-omni schedule (--format vllm-omni: one schedule per file, as vLLM-Omni requests name it)"
    )
    group.add_argument("--mode", choices=list(vllm_omni.MODES), default=None, help="vLLM-Omni's task mode")
    group.add_argument(
        "--num-steps",
        type=_positive_int("--num-steps"),
        default=None,
        help=f"forwards (vLLM-Omni's num_inference_steps) (default: {vllm_omni.DEFAULT_NUM_STEPS}, or the "
        f"intervals of --base-schedule)",
    )
    group.add_argument(
        "--base-schedule",
        default=None,
        help="explicit rectified-flow positions, comma-separated (a distilled release's base_schedule)",
    )
    group.add_argument(
        "--flow-shift",
        type=float,
        default=None,
        help=f"video flow shift (default: the release's, as vLLM-Omni reads it from model_index.json next to the "
        f"transformer, else {vllm_omni.DEFAULT_FLOW_SHIFT:g})",
    )
    group.add_argument(
        "--audio-flow-shift",
        type=float,
        default=None,
        help=f"audio flow shift (default: the release's, else {vllm_omni.DEFAULT_AUDIO_FLOW_SHIFT:g})",
    )


# ---------------------------------------------------------------------------------------------
# inspect


def _family_geometry(spec: dict[str, Any]) -> str | None:
    """A described spec of a family that lists its layers, in words (None for the default family's)."""
    if "family" not in spec:
        return None
    # An entry is [id, width, input] plus ``false`` for a layer without a bias (AuraFlow's).
    widths = sorted({int(entry[1]) for entry in spec["layers"]})
    return (
        f"{spec['family']}: {len(spec['layers'])} layers of widths {', '.join(map(str, widths))}, input "
        f"{spec['in_features']}, plans keyed by {', '.join(spec['plan_inputs'])}, {spec['dtype']}"
    )


def _plan_rows_in_words(spec: dict[str, Any], width: int) -> str:
    """What a plan of ``width`` rows is: timesteps, or rows of the plan's columns where several key it."""
    columns = spec.get("plan_inputs") or ["timestep"]
    if len(columns) == 1:
        return f"{width} timesteps"
    return f"{width} rows of ({', '.join(columns)})"


def _print_tables(info: dict[str, Any]) -> None:
    spec = info["spec"]
    print(
        f"table file {info['path']}: {info['format']} format, {info['plans']} plans of up to "
        f"{_plan_rows_in_words(spec, info['width'])} (per width: {info['plans_per_width']}), "
        f"{info['bytes'] / 2**20:.2f} MiB"
    )
    geometry = _family_geometry(spec) or f"{spec['num_layers']} blocks, hidden {spec['hidden_size']}, {spec['dtype']}"
    print(f"  {geometry}; model_variant {info['model_variant'] or '(none)'}")
    binding = info["binding"]
    found = info.get("manifest")
    if found is not None:
        schedule, arch, math_block = found["schedule"], found["architecture"], found["math"]
        print(
            f"  vLLM-Omni sidecar (format 4): mode {schedule['mode']}, {schedule['num_steps']} steps, flow_shift "
            f"{schedule['flow_shift']:g}, audio_flow_shift {schedule['audio_flow_shift']:g}, base_schedule "
            f"{schedule['base_schedule']}; adapter {found['adapter_sha256'] or 'none'}"
        )
        print(
            f"  time embedder {arch['timestep_input_dim']} -> {arch['time_embed_hidden_size']} -> "
            f"{arch['time_embed_dim']}; {len(found['weights'])} weight digests; built under torch "
            f"{math_block.get('torch')} on {math_block.get('device_type')}"
            + (
                f" (capability {math_block.get('capability')}, CUDA {math_block.get('cuda')})"
                if math_block.get("device_type") == "cuda"
                else ""
            )
        )
    elif binding is None:
        print("  binding: none (an sglang file: only its geometry can be checked)")
    else:
        env = binding.get("environment", {})
        print(f"  content {binding.get('content')}")
        print(
            f"  precision {binding.get('precision')}, shard {binding.get('shard')}, torch {env.get('torch')} on "
            f"{env.get('device_name') or env.get('cpu_capability') or env.get('device_type')}; {info['tool']}, "
            f"{info['created']}"
        )
        print(f"  schedules: {info['schedules']}")
    if "slots" in info:
        print(f"  slots: {info['slots']}")


def run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if is_store(path):
        info = describe_store(path, verify=not args.quick)
    elif is_table_file(path):
        table = TableFile(path, argument="PATH")
        info = table.describe()
        slots = table.kind.slots_checked(table, args.quick)
        if slots is not None:
            info["slots"] = slots
    else:
        store = Store(args.store) if args.store else None
        info = describe_checkpoint(args.path, layout=args.layout, store=store, hash=args.hash)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    if info["kind"] == "tables":
        _print_tables(info)
        return 0
    if info["kind"] == "store":
        health = info["health"]
        print(f"store {info['path']}: {info['entries']} entries, {info['bytes'] / 2**20:.2f} MiB")
        for bhash, b in info["bindings"].items():
            if b["format"] == 1:
                print(
                    f"  binding {bhash[:12]}: {b['entries']} entries, {b['bytes'] / 2**20:.2f} MiB: format 1 (bound to "
                    f"a file's stat identity), never looked up by this version; store prune --max-gb removes entries"
                )
                continue
            print(
                f"  binding {bhash[:12]}: {b['entries']} entries, {b['bytes'] / 2**20:.2f} MiB, content "
                f"{str(b['content'])[:23]}, precision {b['precision']}, spec {b['spec']}, torch {b['torch']} on "
                f"{b['device']}"
            )
        if args.quick:
            state = "digests not checked (--quick)"
        else:
            state = "healthy" if not health["corrupt"] else f"{len(health['corrupt'])} CORRUPT"
            state = f"{health['ok']} verified, {state}"
        print(f"  health: {state}, {health['temp_files']} temp file(s), {health['moved_aside']} moved aside")
        for line in health["corrupt"]:
            print(f"    corrupt: {line}")
        return 0
    spec = info["spec"]
    print(f"checkpoint {info['path']}: {info['layout']} layout, {len(info['files'])} file(s)")
    geometry = _family_geometry(spec) or (
        f"{spec['num_layers']} blocks, hidden {spec['hidden_size']}, time embedding {spec['time_embed_dim']}, "
        f"{spec['dtype']}"
    )
    print(
        f"  {geometry}; {info['projection_tensors']} projection tensors, "
        f"{info['projection_bytes'] / 2**20:.2f} MiB; one table row {info['row_bytes'] / 2**20:.3f} MiB"
    )
    print(f"  time embedder: {'present' if info['time_embedder'] else 'MISSING (build/verify need it)'}")
    print(f"  file identity   {info['fingerprint'][:16]}  (stat and header of every file: any rewrite, copy or touch)")
    content = info["content"]
    if content is not None:
        print(f"  content digest  {content}  ({info['content_from']})")
    else:
        memo = "" if args.store else "; give --store to consult its memo"
        print(
            f"  content digest  not known yet: the next rebuild pass learns it, or --hash now (reads "
            f"{info['projection_bytes'] / 2**30:.2f} GiB{memo})"
        )
    if args.tensors:
        for t in info["tensors"]:
            print(f"    {t['name']} {t['dtype']} {t['shape']} ({t['file']})")
    return 0


# ---------------------------------------------------------------------------------------------
# verify


def run_verify_tables(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    table = TableFile(args.tables, spec, argument="--tables")
    embed = _embed_fn(source, spec, device)
    report = verify_tables(
        table,
        source,
        embed=embed,
        device=device,
        max_plans=args.max_plans,
        read_ahead=args.read_ahead,
        sample=args.sample,
        seed=args.seed,
        progress=not args.quiet,
    )
    for line in report.corrupt:
        print(f"CORRUPT {line}")
    for line in report.mismatched:
        print(f"MISMATCH {line}")
    if report.content_matches is False:
        print(f"CONTENT the file names {table.content}, --checkpoint is {report.content}")
    for name in report.weights_mismatched or []:
        print(f"WEIGHTS {name}: its digest in the file's manifest is not --checkpoint's")
    if report.foreign:
        print(
            f"NOTE built under another {', '.join(report.foreign)} than this machine's: a bit-for-bit match here is "
            f"not expected (verify on the machine class it was exported for)"
        )
    print(
        f"adalncache verify: {'OK' if report.ok else 'FAILED'}: {report.checked} plan(s) of {table.path} recomputed, "
        f"{len(report.mismatched)} mismatched, {len(report.corrupt)} corrupt"
        + ("" if report.content_matches is None else f", content {'matches' if report.content_matches else 'DIFFERS'}")
        + ("" if report.weights_mismatched is None else f", {len(report.weights_mismatched)} weight digest(s) differ")
    )
    return 0 if report.ok else 1


def run_verify(args: argparse.Namespace) -> int:
    if args.sample is not None and args.sample < 1:
        raise ConfigError(f"--sample must be a positive number of entries, got {args.sample}")
    if args.tables is not None:
        return run_verify_tables(args)
    path = Path(args.store)
    if not is_store(path):
        raise ConfigError(f"{path} is not an adalncache store (no STORE marker): set --store")
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    embed = _embed_fn(source, spec, device)
    report = verify_store(
        Store(path),
        spec,
        source,
        embed=embed,
        device=device,
        max_plans=args.max_plans,
        read_ahead=args.read_ahead,
        sample=args.sample,
        seed=args.seed,
        progress=not args.quiet,
    )
    for line in report.corrupt:
        print(f"CORRUPT {line}")
    for line in report.mismatched:
        print(f"MISMATCH {line}")
    checked = report.checked
    print(
        f"adalncache verify: {'OK' if report.ok else 'FAILED'}: {checked} entr{'y' if checked == 1 else 'ies'} "
        f"recomputed, {len(report.mismatched)} mismatched, {len(report.corrupt)} corrupt; {report.other_bindings} "
        f"under other bindings not checked"
    )
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------------
# store prune


def run_prune(args: argparse.Namespace) -> int:
    path = Path(args.store)
    if not is_store(path):
        raise ConfigError(f"{path} is not an adalncache store (no STORE marker): set --store")
    limit = _gb_to_bytes(args.max_gb, "--max-gb")
    store = Store(path)
    before = store.total_bytes
    removed = store.prune(limit)
    print(
        f"adalncache store prune: removed {removed} entr{'y' if removed == 1 else 'ies'}, "
        f"{before / 2**30:.3f} -> {store.total_bytes / 2**30:.3f} GiB (limit {args.max_gb} GiB)"
    )
    return 0


# ---------------------------------------------------------------------------------------------
# argparse wiring


def _int_at_least(flag: str, minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_int(flag: str) -> Callable[[str], int]:
    return _int_at_least(flag, 1)


_T = TypeVar("_T")

#: Plans are float32: an index column is exact only below 2**24 (and an embedding index is never negative).
MAX_INDEX = 2**24


def _index(flag: str) -> Callable[[str], int]:
    """An embedding index: 0 <= value < 2**24, so the plan's float32 column holds it exactly."""
    at_least_zero = _int_at_least(flag, 0)

    def parse(text: str) -> int:
        value = at_least_zero(text)
        if value >= MAX_INDEX:
            raise argparse.ArgumentTypeError(f"{flag} must be < {MAX_INDEX} (an embedding index), got {value}")
        return value

    return parse


def _scheduled(compute: Callable[[], _T], released: bool, steps: int, height: int, width: int) -> _T:
    """``compute()``, the schedule a pipeline runs, with a bad config value or size as one ConfigError.

    Why: the schedule formulas take the config's values as they are; a string ``shift`` or a
    size whose sequence length overflows a float raised a bare TypeError or OverflowError.
    """
    try:
        return compute()
    except (TypeError, ValueError, OverflowError, KeyError, ZeroDivisionError) as exc:
        source = "the released scheduler config" if released else "--scheduler-config"
        raise ConfigError(
            f"the schedule for --steps {steps} at --height {height} --width {width} cannot be computed from {source} "
            f"({type(exc).__name__}: {exc}): pass the pipeline's scheduler/scheduler_config.json and a size it runs, "
            "or --timesteps"
        ) from None


#: The cache options each command takes, as generated flags (in this order on its --help).
BUILD_OPTIONS = (
    "store",
    "max_plan_width",
    "precision",
    "batched",
    "tiled",
    "host_cache_bytes",
    "shard",
    "max_plans",
    "read_ahead",
)
EXPORT_OPTIONS = ("store", "precision", "batched", "tiled", "shard", "max_plans", "read_ahead")
VERIFY_OPTIONS = ("max_plans", "read_ahead")


def _gib_bytes(text: str) -> int:
    try:
        return _gb_to_bytes(float(text), option("host_cache_bytes").flag or "")
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_options(parser: argparse.ArgumentParser, names: Sequence[str], *, required: Sequence[str] = ()) -> None:
    """One flag per cache option of ``names``, generated from :mod:`adalncache.options`.

    The flag, its help, its default and how it parses come from the option's definition; the
    value lands in ``args.<option name>`` in the option's own unit (bytes for ``--host-cache-gb``).
    ``required``: options this command cannot run without.
    """
    for name in names:
        o = option(name)
        cli = o.cli
        if o.flag is None or cli is None:
            raise ValueError(f"the option {name} has no command-line flag")
        kwargs: dict[str, Any] = {"dest": name, "default": o.default, "help": o.doc}
        if cli.kind == "int":
            kwargs["type"] = _int_at_least(o.flag, cli.minimum)
            kwargs["metavar"] = "N"
        elif cli.kind == "path":
            kwargs["metavar"] = "DIR"
        elif cli.kind == "choice":
            kwargs["choices"] = list(cli.choices)
        elif cli.kind == "switch":
            kwargs["action"] = "store_true"
        elif cli.kind == "auto-switch":
            kwargs["type"] = _auto_switch
            kwargs["metavar"] = "{auto,on,off}"
        elif cli.kind == "gib":
            kwargs["type"] = _gib_bytes
            kwargs["metavar"] = "GIB"
        if name in required:
            kwargs["required"] = True
            del kwargs["default"]
        elif cli.kind != "switch":
            shown = o.default / 2**30 if cli.kind == "gib" else o.default
            kwargs["help"] += f" (default: {shown})"
        parser.add_argument(o.flag, **kwargs)


def _auto_switch(text: str) -> bool | str:
    """``auto``, ``on`` or ``off`` as an option takes it: ``"auto"``, True, False."""
    values: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}
    if text not in values:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from auto, on, off)")
    return values[text]


def _options_of(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The cache options ``names`` as the command line gave them, as keyword arguments of AdalnCache."""
    return {name: getattr(args, name) for name in names}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS], help="checkpoint layout")
    parser.add_argument("--device", default="cpu", help="device the tables are for (default: cpu)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _schedules(parser: argparse.ArgumentParser, steps_help: str) -> None:
    """The flags that name schedules: --task and --steps (repeatable), the shifts, --no-audio-refs; and
    Qwen-Image's --height/--width (repeatable), --timesteps, --batch, --scheduler-config, --additional-t-cond,
    which the AdaLayerNormZero family shares (but --additional-t-cond), with its --guidance and --timestep-r.
    Which of them a command needs depends on the checkpoint's family (and, for ``export``, on
    ``--format``), so none is required here: it is checked once the checkpoint is open."""
    parser.add_argument("--task", action="append", choices=TASKS, help="MiniMax-H3: request kind (repeatable)")
    parser.add_argument("--steps", action="append", type=_positive_int("--steps"), help=steps_help)
    parser.add_argument("--video-shift", type=float, default=12.0, help="video schedule shift (default: 12)")
    parser.add_argument("--audio-shift", type=float, default=3.0, help="audio schedule shift (default: 3)")
    parser.add_argument("--no-audio-refs", action="store_true", help="ref2va without a reference audio")
    qwen = "Qwen-Image, Bria, Ovis-Image: "
    parser.add_argument(
        "--height",
        action="append",
        type=_positive_int("--height"),
        help=qwen + "image height (repeatable; default 1024): the schedule is shifted by the image size",
    )
    parser.add_argument(
        "--width",
        action="append",
        type=_positive_int("--width"),
        help=qwen + "image width (repeatable, paired with --height; default: the height)",
    )
    parser.add_argument(
        "--timesteps",
        default=None,
        help="Qwen-Image and the AdaLayerNormZero family: explicit forward timesteps, comma-separated "
        "(the values of the transformer's timestep argument), instead of --steps",
    )
    parser.add_argument(
        "--batch",
        type=_positive_int("--batch"),
        default=1,
        help="Qwen-Image: images per forward (batch x num_images_per_prompt); the AdaLayerNormZero family: the "
        "forward's rows (2 x images where the pipeline concatenates cond and uncond) (default: 1)",
    )
    parser.add_argument(
        "--scheduler-config",
        default=None,
        help=qwen + "the pipeline's scheduler_config.json (default: scheduler/ beside the transformer's directory; "
        "for Qwen-Image without one, the released Qwen-Image scheduler config)",
    )
    adaln = "AdaLayerNormZero family: "
    parser.add_argument(
        "--guidance",
        type=float,
        default=None,
        help=adaln + "the guidance value every forward receives, where the config enables guidance_embeds",
    )
    parser.add_argument(
        "--timestep-r",
        default=None,
        help=adaln + "the forwards' timestep_r (mean-flow variants), comma-separated, one per --timesteps value",
    )
    parser.add_argument(
        "--additional-t-cond",
        type=_index("--additional-t-cond"),
        default=None,
        help=qwen + "Layered checkpoints: the additional_t_cond index the pipeline passes",
    )


def _request_plans(args: argparse.Namespace, spec: Any) -> tuple[list[torch.Tensor], str]:
    """The distinct plans the schedule flags name for this checkpoint's family, and how to say what they are."""
    if args.timesteps is not None and args.steps:  # every family's plans take one or the other: never ignore one
        raise ConfigError(
            "--timesteps and --steps both name the schedule (explicit timesteps, or the pipeline's schedule of N "
            "steps): pass one of them"
        )
    if spec.family.name == adaln_zero.FAMILY.name:
        return _adaln_zero_plans(args, spec)
    if args.guidance is not None or args.timestep_r is not None:
        raise ConfigError(
            f"--guidance and --timestep-r are per-step inputs of AdaLayerNormZero-family models, not of a "
            f"{spec.family.title} checkpoint: drop them"
        )
    if spec.family.name == qwen_image.FAMILY.name:
        return _qwen_image_plans(args, spec)
    if not args.task or not args.steps:
        raise ConfigError(
            f"a {spec.family.title} checkpoint needs --task and --steps (the schedules): pass e.g. --task t2va "
            "--steps 50"
        )
    plans = schedule_plans(
        args.task,
        args.steps,
        video_shift=args.video_shift,
        audio_shift=args.audio_shift,
        audio_refs=not args.no_audio_refs,
    )
    return plans, f"{', '.join(args.task)} x steps {', '.join(map(str, args.steps))}"


def _sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    heights = args.height or [1024]
    widths = args.width or heights
    if len(widths) != len(heights):
        raise ConfigError(f"--width is given {len(widths)} time(s) for {len(heights)} --height: pair them")
    return list(zip(heights, widths))


def _explicit_timesteps(flag: str, text: str) -> list[float]:
    """The comma-separated numbers of ``flag`` (the forward's values); ConfigError naming it otherwise."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{flag} is empty: pass the forward's values, e.g. {flag} 0.999,0.5")
    return _finite(flag, values)


def _finite(flag: str, values: list[float]) -> list[float]:
    """``values`` if every one is finite as the float32 a plan holds; else ConfigError naming ``flag``.

    Checked before the store is opened: the plan's own check would refuse them too, but only
    after the command had created the store's directory.
    """
    if not bool(torch.tensor(values, dtype=torch.float32).isfinite().all()):
        raise ConfigError(f"{flag} must be finite float32 values (|v| < 3.4e38), got {values}")
    return values


def _adaln_zero_plans(args: argparse.Namespace, spec: Any) -> tuple[list[torch.Tensor], str]:
    """An AdaLayerNormZero-family checkpoint's plans: its pipeline's forward timesteps (--steps), or --timesteps.

    Each plan has ``--batch`` rows (the forward's rows) and a column per per-step input the
    config enables: ``timestep``, ``timestep_r`` (``--timestep-r``, one per timestep; with
    ``--steps`` the schedule's next timestep, as the mean-flow pipelines pass it) and
    ``guidance`` (``--guidance``, the same at every step), the values the forward receives.
    """
    from .integrations.diffusers import adaln_zero as served
    from .plans import distinct_plans

    class_name = adaln_zero.class_of(spec.model_geometry)
    inputs = tuple(spec.plan_inputs)
    if args.task or args.additional_t_cond is not None:
        raise ConfigError(
            f"--task and --additional-t-cond name MiniMax-H3 and Qwen-Image schedules; a {class_name} schedule is "
            "--steps (with --height/--width) or --timesteps, plus --guidance / --timestep-r where its config takes them"
        )
    if args.guidance is not None:
        _finite("--guidance", [args.guidance])
    for name, flag_name, value in (
        (adaln_zero.GUIDANCE, "--guidance", args.guidance),
        (adaln_zero.TIMESTEP_R, "--timestep-r", args.timestep_r),
    ):
        if name == adaln_zero.TIMESTEP_R and args.timesteps is None and args.steps:
            continue  # --steps computes timestep_r from the schedule (the next step's timestep)
        if name in inputs and value is None:
            raise ConfigError(f"this {class_name} checkpoint's config makes {name} an input of temb: pass {flag_name}")
        if name not in inputs and value is not None:
            raise ConfigError(f"this {class_name} checkpoint's config does not take {name}: drop {flag_name}")
    if args.timesteps is not None:
        forwards = [torch.tensor([v] * args.batch) for v in _explicit_timesteps("--timesteps", args.timesteps)]
        described = f"{len(forwards)} explicit timestep(s)"
    elif args.steps:
        if args.timestep_r is not None:
            raise ConfigError(
                "--timestep-r pairs with --timesteps (one value per timestep); with --steps it is the schedule's next "
                "timestep: drop --timestep-r"
            )
        config, released = _scheduler_config(args)
        forwards, following = [], []
        for steps in args.steps:
            for height, width in _sizes(args):
                scheduled = _scheduled(
                    functools.partial(
                        served.pipeline_forward_inputs,
                        class_name,
                        steps,
                        height,
                        width,
                        config,
                        rows=args.batch,
                        dtype=spec.dtype,
                        timestep_r=adaln_zero.TIMESTEP_R in inputs,
                    ),
                    released,
                    steps,
                    height,
                    width,
                )
                for step in scheduled:
                    forwards.append(step[TIMESTEP])
                    following += [step[adaln_zero.TIMESTEP_R]] if adaln_zero.TIMESTEP_R in step else []
        sizes = ", ".join(f"{h}x{w}" for h, w in _sizes(args))
        described = f"steps {', '.join(map(str, args.steps))} at {sizes}"
    else:
        raise ConfigError(f"name a {class_name} schedule: --steps N (with --height/--width), or --timesteps t1,t2,...")
    seconds: list[float] = []
    if args.timestep_r is not None:
        seconds = _explicit_timesteps("--timestep-r", args.timestep_r)
        if len(seconds) != len(forwards):
            raise ConfigError(f"--timestep-r has {len(seconds)} value(s) for {len(forwards)} --timesteps: pair them")
    plans = []
    for k, timestep in enumerate(forwards):
        step = {TIMESTEP: timestep}
        if seconds:
            step[adaln_zero.TIMESTEP_R] = torch.full(timestep.shape, seconds[k], dtype=torch.float32)
        elif args.timesteps is None and adaln_zero.TIMESTEP_R in inputs:
            step[adaln_zero.TIMESTEP_R] = following[k]
        if args.guidance is not None:
            step[adaln_zero.GUIDANCE] = torch.full(timestep.shape, args.guidance, dtype=torch.float32)
        plans.append(served.plan_of(step, inputs))
    order, tensors = distinct_plans(plans, columns=spec.plan_columns)
    return [tensors[k] for k in order], described


def _qwen_image_plans(args: argparse.Namespace, spec: Any) -> tuple[list[torch.Tensor], str]:
    """Qwen-Image's plans: the pipeline's forward timesteps for each (steps, size), or --timesteps."""
    from .integrations.diffusers import qwen_image as served
    from .plans import distinct_plans

    if args.task:
        raise ConfigError(
            "--task names MiniMax-H3 request kinds; a Qwen-Image schedule is --steps with --height/--width"
        )
    if args.timesteps is not None:
        values = _explicit_timesteps("--timesteps", args.timesteps)
        forwards = [torch.tensor([v] * args.batch) for v in values]
        described = f"{len(values)} explicit timestep(s)"
    elif args.steps:
        config, released = _scheduler_config(args, qwen_image.RELEASED_SCHEDULER)
        forwards = []
        for steps in args.steps:
            for height, width in _sizes(args):
                timesteps = _scheduled(
                    functools.partial(served.pipeline_timesteps, steps, height, width, config),
                    released,
                    steps,
                    height,
                    width,
                )
                forwards += served.schedule_timesteps(timesteps, batch=args.batch, dtype=spec.dtype)
        sizes = ", ".join(f"{h}x{w}" for h, w in _sizes(args))
        described = f"steps {', '.join(map(str, args.steps))} at {sizes}"
        if released:
            described += " (the released Qwen-Image scheduler config: no --scheduler-config, no scheduler/ beside)"
    else:
        raise ConfigError("name a Qwen-Image schedule: --steps N (with --height/--width), or --timesteps t1,t2,...")
    if args.additional_t_cond is not None and spec.plan_columns != 2:
        raise ConfigError(
            "this Qwen-Image checkpoint has no use_additional_t_cond (its forwards ignore additional_t_cond): drop "
            "--additional-t-cond"
        )
    plans = served.spec_plans(spec, forwards, args.additional_t_cond)
    order, tensors = distinct_plans(plans, columns=spec.plan_columns)
    return [tensors[k] for k in order], described


def _scheduler_config(
    args: argparse.Namespace, released: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], bool]:
    """The pipeline's scheduler config: --scheduler-config, else ``scheduler/`` beside the transformer's
    directory; and whether it is ``released``.

    ``released``: the family's released scheduler config, a copy of which is returned (with True, so
    the caller can say it was used) when neither is there, as for a transformer directory copied on
    its own; a family without one needs the flag.
    """
    if args.scheduler_config is not None:
        where = Path(args.scheduler_config)
    else:
        checkpoint = Path(args.checkpoint)
        directory = checkpoint if checkpoint.is_dir() else checkpoint.parent
        where = directory.parent / "scheduler"
        if released is not None and not where.exists():
            return dict(released), True
    if where.is_dir():
        where = where / "scheduler_config.json"
    try:
        config = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--steps needs the pipeline's scheduler config to compute the schedule: {where} cannot be read "
            f"({type(exc).__name__}); pass --scheduler-config PATH (the pipeline's scheduler/scheduler_config.json), "
            "or --timesteps"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"--scheduler-config {where} is not a JSON object")
    return config, False


def _schedule_records(args: argparse.Namespace, spec: Any) -> list[dict[str, Any]]:
    """What a table file records about the schedules it was exported for."""
    if spec.family.name in (qwen_image.FAMILY.name, adaln_zero.FAMILY.name):
        inputs = {"guidance": args.guidance, "timestep_r": args.timestep_r}
        extra = {k: v for k, v in inputs.items() if v is not None}
        if args.timesteps is not None:
            return [{"timesteps": args.timesteps, "batch": args.batch, **extra}]
        return [
            {"steps": n, "height": h, "width": w, "batch": args.batch, **extra}
            for n in args.steps or []
            for h, w in _sizes(args)
        ]
    shifts = {"video_shift": args.video_shift, "audio_shift": args.audio_shift, "audio_refs": not args.no_audio_refs}
    return [{"task": t, "steps": n, **shifts} for t in args.task or [] for n in args.steps or []]


def _lock_wait(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock-wait",
        type=float,
        default=600.0,
        help="seconds to wait for another process building the same store entries before building them here "
        "(0: never wait) (default: 600)",
    )


def _register_build(subparsers: Any) -> None:
    """``adalncache build``: fill a store with the tables of some schedules."""
    p = subparsers.add_parser(
        "build",
        help="fill a store with the tables of one or more schedules",
        description=(
            "Compute the AdaLN tables of every plan the given tasks and step counts use, from CHECKPOINT (which "
            "must include the time embedder), and write them to --store in as few passes as --max-plans allows."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=".safetensors file, or a (sharded) checkpoint directory")
    _schedules(p, "num_inference_steps of a schedule (repeatable)")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="under torchrun, the process group's timeout in seconds: how long ranks wait for a dead peer "
        "(default: 600)",
    )
    _lock_wait(p)
    _add_options(p, BUILD_OPTIONS, required=("store",))
    _common(p)
    p.set_defaults(func=run_build)


def _register_export(subparsers: Any) -> None:
    """``adalncache export``: write the tables of some schedules to one table file."""
    p = subparsers.add_parser(
        "export",
        help="write the tables of one or more schedules to one file (sglang, vllm-omni or adalncache format)",
        description=(
            "Compute the AdaLN tables of every plan the given tasks and step counts use, from CHECKPOINT (which must "
            "include the time embedder), and write them to one safetensors file: --format sglang is exactly SGLang's "
            "sidecar (serve it with --minimax-h3-adaln-cache-path and the same --model-variant); --format adalncache "
            "adds the binding (content digest, spec, precision, numeric environment) that lets enable_adaln_cache("
            "tables=) and adalncache verify --tables check it. Step counts: --steps N is the pipeline's "
            "num_inference_steps (N grid points, N - 1 forwards); SGLang's --num-inference-steps counts forwards, so "
            "a file exported with --steps N serves SGLang's --num-inference-steps N-1. Entries already in --store "
            "are reused; under torchrun the ranks share the passes (--shard) and rank 0 writes the file. --format "
            "vllm-omni writes vLLM-Omni's weight-bound sidecar of one schedule, named by --mode, --num-steps "
            "(forwards), --base-schedule, --flow-shift and --audio-flow-shift instead of --task and --steps."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=".safetensors file, or a (sharded) checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="the table file to write (replaced atomically when done)")
    p.add_argument(
        "--format",
        default="adalncache",
        choices=list(FORMATS),
        help="adalncache: bound, verifiable, any dtype (default); sglang: exactly SGLang's sidecar (bfloat16, "
        "--precision match, needs --model-variant); vllm-omni: vLLM-Omni's weight-bound sidecar of one schedule "
        "(bfloat16, --precision match, no --store)",
    )
    p.add_argument(
        "--model-variant",
        choices=list(MODEL_VARIANTS),
        default=None,
        help="the released transformer the tables belong to (t2va and fl2va run on fl2va, ref2va on ref2va); "
        "SGLang compares it with its own --model-variant",
    )
    _schedules(
        p,
        "num_inference_steps (grid points; N - 1 forwards, SGLang's --num-inference-steps N-1) (repeatable)",
    )
    _sidecar_arguments(p)
    p.add_argument("--timeout", type=float, default=600.0, help="under torchrun, the process group's timeout (s)")
    _lock_wait(p)
    _add_options(p, EXPORT_OPTIONS)
    _common(p)
    p.set_defaults(func=run_export, **dict.fromkeys(_schedule_inputs()[0]))  # None: see _format_inputs


def _register_inspect(subparsers: Any) -> None:
    """``adalncache inspect``: what a checkpoint, a store or a table file holds."""
    p = subparsers.add_parser(
        "inspect",
        help="what a checkpoint or a store holds",
        description=(
            "Checkpoint: layout, tensors, bytes, file identity and content digest. Store: entries, sizes, bindings, "
            "health. Table file: format, plans, binding, slot digests."
        ),
    )
    p.add_argument("path", metavar="PATH", help="a checkpoint (file or directory), a store directory or a table file")
    p.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS], help="checkpoint layout (default: auto)")
    p.add_argument("--tensors", action="store_true", help="list every projection tensor")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quick", action="store_true", help="store or table file: skip checking their digests")
    p.add_argument("--store", default=None, help="checkpoint: consult (and with --hash, fill) this store's digest memo")
    p.add_argument(
        "--hash",
        action="store_true",
        help="checkpoint: compute its content digest now if no memo has it (reads every projection byte once)",
    )
    p.set_defaults(func=run_inspect)


def _register_verify(subparsers: Any) -> None:
    """``adalncache verify``: recompute store entries or a table file and compare them bit for bit."""
    p = subparsers.add_parser(
        "verify",
        help="recompute store entries or a table file and compare bit for bit (exit 1 on any difference)",
        description=(
            "Recompute the store's entries (--store) or a table file's plans (--tables) for --checkpoint on this "
            "machine and compare them with torch.equal. Exit status 1 when anything differs or is corrupt (or a "
            "bound table file names another content digest)."
        ),
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--store", default=None, help="store directory")
    what.add_argument("--tables", default=None, help="a table file written by adalncache export (either format)")
    p.add_argument("--checkpoint", required=True, help="the checkpoint the entries were built from")
    p.add_argument("--sample", type=int, default=None, help="check only N entries, chosen at random")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample (default: 0)")
    _add_options(p, VERIFY_OPTIONS)
    _common(p)
    p.set_defaults(func=run_verify)


def _register_store(subparsers: Any) -> None:
    """``adalncache store prune``: store maintenance."""
    p = subparsers.add_parser("store", help="store maintenance", description="Store maintenance commands.")
    store_sub = p.add_subparsers(dest="store_command", metavar="ACTION", parser_class=type(p))
    store_sub.required = True
    q = store_sub.add_parser(
        "prune",
        help="delete least-recently-used entries down to a size",
        description="Delete least-recently-used entries until the store holds at most --max-gb GiB.",
    )
    q.add_argument("--store", required=True, help="store directory")
    q.add_argument("--max-gb", type=float, required=True, help="size to prune down to, in GiB (0 empties it)")
    q.set_defaults(func=run_prune)


def register(subparsers: Any) -> None:
    """Add ``build``, ``export``, ``inspect``, ``verify`` and ``store prune`` to the ``adalncache`` command line."""
    for add in (_register_build, _register_export, _register_inspect, _register_verify, _register_store):
        add(subparsers)


__all__ = ["register", "run_build", "run_export", "run_inspect", "run_prune", "run_verify"]
