"""``adalncache build | export | inspect | verify | store prune``: the command-line shells.

Each ``run_*`` checks its arguments, calls the library (:mod:`adalncache.offline`, :mod:`adalncache.formats`,
the checkpoint's family through :mod:`adalncache.families`) and prints what it returns. No family is named
here: the checkpoint's family turns the schedule flags it takes into plans and refuses the others. Under
torchrun, each rank builds its share of every pass (``--shard``), as ``AdalnCache(process_group=...)`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from . import families
from .cache import AdalnCache
from .cli import add_flag, add_options, add_schedule_flags, gib_to_bytes
from .devices import resolve_device
from .errors import ConfigError
from .formats import FORMATS, TableFile, TableFormat, is_table_file, table_format, vllm_omni
from .geometry import Schedule
from .identity.binding import BINDING_FORMAT
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
from .options import Argument, Cli, flag
from .plans import distinct_plans
from .spec import ModulationSpec
from .tiers.store import Store


@contextlib.contextmanager
def _torchrun_group(device: torch.device, timeout: float) -> Iterator[tuple[Any, torch.device, int]]:
    """(process group, this rank's device, rank) under torchrun (gloo on CPU, NCCL with one GPU per rank), else
    ``(None, device, 0)``. ``timeout`` is the only bound on how long ranks wait for a dead one: the user's."""
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


def _schedule(args: argparse.Namespace, given: dict[str, Any], spec: ModulationSpec, source: Any) -> Schedule:
    """The family's schedule of the flags ``given``, its plans distinct (first-seen order); computed before
    anything is created, so every bad schedule flag is one line and leaves nothing on disk."""
    schedule = families.schedule(spec, given, source=source, checkpoint=args.checkpoint)
    order, tensors = distinct_plans(schedule.plans, columns=spec.plan_columns)
    return Schedule([tensors[k] for k in order], schedule.described, schedule.records)


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The flags of ``names`` given on the command line (every schedule flag parses to None when absent)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _passes(
    args: argparse.Namespace,
    device: torch.device,
    source: Any,
    plans: list[torch.Tensor],
    options: Sequence[str],
    work: Callable[[AdalnCache, Any, bool], Any],
    *,
    embed: bool = True,
) -> tuple[Any, str, bool]:
    """``work(cache, embed, progress)`` on a cache of the command's ``options`` for ``plans``: the result, the
    ranks in words, whether this is rank 0. The slab holds no more plans than one pass needs; the store is
    opened after the checkpoint's embed, so a checkpoint without its time embedder leaves no store behind."""
    with _torchrun_group(device, args.timeout) as (group, device, rank):
        progress = rank == 0 and not args.quiet
        inputs = source.spec.family.checkpoint_embed(source, source.spec, device) if embed else None
        given = {name: getattr(args, name) for name in options}
        given.update(max_plans=max(1, min(args.max_plans, len(plans))), max_plan_width=max(p.shape[0] for p in plans))
        given.update(store=Store(args.store, lock_wait_s=args.lock_wait) if args.store else None, progress=progress)
        # Closed before the group is destroyed: a cache that outlived it would keep gloo's threads alive.
        with AdalnCache(source.spec, source, device=device, process_group=group, **given) as cache:
            result = work(cache, inputs, progress)
            ranks = f", {cache.world_size} ranks (--shard {args.shard})" if group is not None else ""
    return result, ranks, rank == 0


def run_build(args: argparse.Namespace) -> int:
    if not (args.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    schedule = _schedule(args, _given(args, list(families.ARGUMENTS)), spec, source)
    width = max(p.shape[0] for p in schedule.plans)
    if width > args.max_plan_width:
        raise ConfigError(
            f"these schedules have plans of {width} {spec.family.plan_rows}: raise "
            f"{flag('max_plan_width')} to at least {width}"
        )

    def fill(cache: AdalnCache, embed: Any, progress: bool) -> Any:
        return fill_store(cache, schedule.plans, embed=embed, progress=progress)

    report, ranks, rank0 = _passes(args, device, source, schedule.plans, BUILD_OPTIONS, fill)
    if rank0:
        print(
            f"adalncache build: {report.plans} distinct plan(s) for {schedule.described}: {report.already_stored} "
            f"already stored, {report.built} built in "
            f"{report.passes} pass(es) into {args.store} (binding {report.binding[:12]}, {args.precision}{ranks})"
        )
    return 0


def run_export(args: argparse.Namespace) -> int:
    if not (args.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    kind = table_format(args.format)
    given = _format_inputs(args, kind)
    own = kind.schedule(args.checkpoint, given)  # None: the checkpoint family's schedule flags
    output = Path(args.output)
    check_output(output)  # before anything is read, then again against the checkpoint's files
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    check_output(output, source_files(source))
    tasks = given.get("task") or []
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
        schedule = _schedule(args, given, spec, source)
        plans, schedules = schedule.plans, schedule.records
    else:
        plans, schedules = own

    def export(cache: AdalnCache, embed: Any, progress: bool) -> Any:
        given = {"model_variant": args.model_variant, "tasks": tasks, "schedules": schedules, "progress": progress}
        return export_tables(cache, plans, output, embed=embed, format=args.format, **given)

    report, _, rank0 = _passes(args, device, source, plans, EXPORT_OPTIONS, export, embed=not kind.own_input)
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
    elif rank0:
        print(
            f"adalncache export: wrote {report.path} ({report.format}, {report.plans} plans of up to {report.width} "
            f"{spec.family.plan_rows}, {report.bytes / 2**20:.2f} MiB): {report.store_hits} from the store, "
            f"{report.built} built in {report.passes} pass(es); content {report.content or 'not bound (sglang format)'}"
        )
        if "sglang" in spec.family.table_formats:  # how this file's step counts map to SGLang's
            sglang = ", ".join(f"--steps {n} -> --num-inference-steps {n - 1}" for n in given["steps"])
            variant = f", --model-variant {args.model_variant}" if args.model_variant else ""
            print(f"  serves SGLang ({sglang}){variant}")
    return 0


def _format_inputs(args: argparse.Namespace, kind: TableFormat) -> dict[str, Any]:
    """The schedule flags given to ``export`` (at their default value too), once those the format does not take
    (its own ``takes``, else the families') are refused."""
    names = [*families.ARGUMENTS, *(argument.name for argument in SIDECAR)]
    given = _given(args, names)
    takes = kind.takes if kind.takes is not None else families.ARGUMENTS
    refused = ", ".join("--" + name.replace("_", "-") for name in given if name not in takes)
    if refused:
        said = "its own schedule flags" if kind.takes is not None else "the checkpoint family's schedule flags"
        taken = ", ".join("--" + name.replace("_", "-") for name in names if name in takes)
        raise ConfigError(f"--format {kind.name} does not take {refused} (it takes {said}: {taken}): drop {refused}")
    return given


#: The schedule of a ``--format vllm-omni`` file, named as vLLM-Omni's schedule contract names it.
SIDECAR = (
    Argument("mode", "vLLM-Omni's task mode", Cli("choice", choices=tuple(vllm_omni.MODES))),
    Argument(
        "num_steps",
        f"forwards (vLLM-Omni's num_inference_steps) (default: {vllm_omni.DEFAULT_NUM_STEPS}, or the intervals of "
        "--base-schedule)",
        Cli("int", 1),
    ),
    Argument(
        "base_schedule", "explicit rectified-flow positions, comma-separated (a distilled release's)", Cli("text")
    ),
    Argument(
        "flow_shift",
        "video flow shift (default: the release's, as vLLM-Omni reads it from model_index.json next to the "
        f"transformer, else {vllm_omni.DEFAULT_FLOW_SHIFT:g})",
        Cli("float"),
    ),
    Argument(
        "audio_flow_shift",
        f"audio flow shift (default: the release's, else {vllm_omni.DEFAULT_AUDIO_FLOW_SHIFT:g})",
        Cli("float"),
    ),
)


def _geometry(spec: dict[str, Any], blocks: str) -> str:
    """A described spec in words: its layers, else (a spec listing none: the default family's) ``blocks``."""
    if "family" not in spec:
        return f"{spec['num_layers']} blocks, hidden {spec['hidden_size']}, {blocks}{spec['dtype']}"
    # An entry is [id, width, input] plus ``false`` for a layer without a bias (AuraFlow's).
    widths = sorted({int(entry[1]) for entry in spec["layers"]})
    return (
        f"{spec['family']}: {len(spec['layers'])} layers of widths {', '.join(map(str, widths))}, input "
        f"{spec['in_features']}, plans keyed by {', '.join(spec['plan_inputs'])}, {spec['dtype']}"
    )


def _print_tables(info: dict[str, Any]) -> None:
    spec, width = info["spec"], info["width"]
    columns = spec.get("plan_inputs") or ["timestep"]  # a plan's rows: timesteps, or rows of several keys
    rows = f"{width} timesteps" if len(columns) == 1 else f"{width} rows of ({', '.join(columns)})"
    print(
        f"table file {info['path']}: {info['format']} format, {info['plans']} plans of up to {rows} (per width: "
        f"{info['plans_per_width']}), {info['bytes'] / 2**20:.2f} MiB"
    )
    print(f"  {_geometry(spec, '')}; model_variant {info['model_variant'] or '(none)'}")
    binding = info["binding"]
    found = info.get("manifest")
    if found is not None:
        schedule, arch, math_block = found["schedule"], found["architecture"], found["math"]
        print(
            f"  vLLM-Omni sidecar (format 4): mode {schedule['mode']}, {schedule['num_steps']} steps, flow_shift "
            f"{schedule['flow_shift']:g}, audio_flow_shift {schedule['audio_flow_shift']:g}, base_schedule "
            f"{schedule['base_schedule']}; adapter {found['adapter_sha256'] or 'none'}"
        )
        cuda = math_block.get("device_type") == "cuda"
        on = f" (capability {math_block.get('capability')}, CUDA {math_block.get('cuda')})" if cuda else ""
        print(
            f"  time embedder {arch['timestep_input_dim']} -> {arch['time_embed_hidden_size']} -> "
            f"{arch['time_embed_dim']}; {len(found['weights'])} weight digests; built under torch "
            f"{math_block.get('torch')} on {math_block.get('device_type')}{on}"
        )
    elif binding is None:
        print("  binding: none (an sglang file: only its geometry can be checked)")
    else:
        env = binding.get("environment", {})
        print(f"  content {binding.get('content')}")
        print(f"  upstream {binding.get('upstream')} (the modules before the projections: time embedders, ...)")
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
            if b["format"] < BINDING_FORMAT:
                bound = "a file's stat identity" if b["format"] == 1 else "the content without the upstream modules"
                print(
                    f"  binding {bhash[:12]}: {b['entries']} entries, {b['bytes'] / 2**20:.2f} MiB: format "
                    f"{b['format']} (bound to {bound}), never looked up by this version; store prune --max-gb removes "
                    "entries"
                )
                continue
            print(
                f"  binding {bhash[:12]}: {b['entries']} entries, {b['bytes'] / 2**20:.2f} MiB, content "
                f"{str(b['content'])[:23]}, upstream {str(b['upstream'])[:23]}, precision {b['precision']}, spec "
                f"{b['spec']}, torch {b['torch']} on {b['device']}"
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
    geometry = _geometry(spec, f"time embedding {spec.get('time_embed_dim')}, ")
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


def run_verify(args: argparse.Namespace) -> int:
    if args.sample is not None and args.sample < 1:
        raise ConfigError(f"--sample must be a positive number of entries, got {args.sample}")
    path = Path(args.store or "")
    if args.tables is None and not is_store(path):
        raise ConfigError(f"{path} is not an adalncache store (no STORE marker): set --store")
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    table = TableFile(args.tables, spec, argument="--tables") if args.tables is not None else None
    given = {"read_ahead": args.read_ahead, "sample": args.sample, "seed": args.seed, "progress": not args.quiet}
    given.update(embed=spec.family.checkpoint_embed(source, spec, device), device=device, max_plans=args.max_plans)
    # A store's report names no content, weights or foreign environment: those lines are a table file's.
    if table is None:
        report = verify_store(Store(path), spec, source, **given)
        checked = f"{report.checked} entr{'y' if report.checked == 1 else 'ies'} recomputed"
        said = f"; {report.other_bindings} under other bindings not checked"
    else:
        report = verify_tables(table, source, **given)
        checked, said = f"{report.checked} plan(s) of {table.path} recomputed", ""
        if report.content_matches is not None:
            said += f", content {'matches' if report.content_matches else 'DIFFERS'}"
        if report.weights_mismatched is not None:
            said += f", {len(report.weights_mismatched)} weight digest(s) differ"
    for line in report.corrupt:
        print(f"CORRUPT {line}")
    for line in report.mismatched:
        print(f"MISMATCH {line}")
    if report.content_matches is False and table is not None:
        print(f"CONTENT the file names {table.content}, --checkpoint is {report.content}")
    for name in report.weights_mismatched or []:
        print(f"WEIGHTS {name}: its digest in the file's manifest is not --checkpoint's")
    if report.foreign:
        print(
            f"NOTE built under another {', '.join(report.foreign)} than this machine's: a bit-for-bit match here is "
            f"not expected (verify on the machine class it was exported for)"
        )
    print(
        f"adalncache verify: {'OK' if report.ok else 'FAILED'}: {checked}, {len(report.mismatched)} mismatched, "
        f"{len(report.corrupt)} corrupt{said}"
    )
    return 0 if report.ok else 1


def run_prune(args: argparse.Namespace) -> int:
    path = Path(args.store)
    if not is_store(path):
        raise ConfigError(f"{path} is not an adalncache store (no STORE marker): set --store")
    limit = gib_to_bytes(args.max_gb, "--max-gb")
    store = Store(path)
    before = store.total_bytes
    removed = store.prune(limit)
    print(
        f"adalncache store prune: removed {removed} entr{'y' if removed == 1 else 'ies'}, "
        f"{before / 2**30:.3f} -> {store.total_bytes / 2**30:.3f} GiB (limit {args.max_gb} GiB)"
    )
    return 0


#: The cache options each command takes, as generated flags (in this order on its --help).
EXPORT_OPTIONS = ("store", "precision", "batched", "tiled", "shard", "max_plans", "read_ahead")
BUILD_OPTIONS = ("store", "max_plan_width", *EXPORT_OPTIONS[1:4], "host_cache_bytes", *EXPORT_OPTIONS[4:])
VERIFY_OPTIONS = ("max_plans", "read_ahead")
#: ``--layout``: auto, or any family's checkpoint layout.
LAYOUTS = ["auto", *dict.fromkeys(layout.name for family in families.FAMILIES.values() for layout in family.layouts)]


def _common(parser: argparse.ArgumentParser, *, passes: bool = False) -> None:
    """The flags every command that reads a checkpoint takes; ``passes``: those of one that fills a store."""
    parser.add_argument("--layout", default="auto", choices=LAYOUTS, help="checkpoint layout")
    parser.add_argument("--device", default="cpu", help="device the tables are for (default: cpu)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    if not passes:
        return
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="under torchrun, the process group's timeout in seconds: how long ranks wait for a dead peer "
        "(default: 600)",
    )
    parser.add_argument(
        "--lock-wait",
        type=float,
        default=600.0,
        help="seconds to wait for another process building the same store entries before building them here "
        "(0: never wait) (default: 600)",
    )


def _register_build(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "build",
        help="fill a store with the tables of one or more schedules",
        description=(
            "Compute the AdaLN tables of every plan the given schedules use, from CHECKPOINT (which must include "
            "the time embedder), and write them to --store in as few passes as --max-plans allows."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=".safetensors file, or a (sharded) checkpoint directory")
    add_options(p, BUILD_OPTIONS, required=("store",))
    _common(p, passes=True)
    add_schedule_flags(p)
    p.set_defaults(func=run_build)


def _register_export(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the tables of one or more schedules to one file (sglang, vllm-omni or adalncache format)",
        description=(
            "Compute the AdaLN tables of every plan the given schedules use, from CHECKPOINT (which must include "
            "the time embedder), and write them to one safetensors file: --format sglang is exactly SGLang's "
            "sidecar (serve it with SGLang's AdaLN cache path and the same --model-variant); --format adalncache "
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
        choices=list(dict.fromkeys(v for f in families.FAMILIES.values() for v in f.model_variants)),
        default=None,
        help="the released transformer the tables belong to, where the checkpoint's family names one (the one its "
        "tasks run on); SGLang compares it with its own --model-variant",
    )
    add_options(p, EXPORT_OPTIONS)
    _common(p, passes=True)
    add_schedule_flags(p)
    group = p.add_argument_group(
        "vllm-omni schedule (--format vllm-omni: one schedule per file, as its requests name it)"
    )
    for argument in SIDECAR:
        add_flag(group, argument.flag, argument.cli, dest=argument.name, help=argument.help, default=None)
    p.set_defaults(func=run_export)


def _register_inspect(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="what a checkpoint or a store holds",
        description=(
            "Checkpoint: layout, tensors, bytes, file identity and content digest. Store: entries, sizes, bindings, "
            "health. Table file: format, plans, binding, slot digests."
        ),
    )
    p.add_argument("path", metavar="PATH", help="a checkpoint (file or directory), a store directory or a table file")
    p.add_argument("--layout", default="auto", choices=LAYOUTS, help="checkpoint layout (default: auto)")
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
    add_options(p, VERIFY_OPTIONS)
    _common(p)
    p.set_defaults(func=run_verify)


def _register_store(subparsers: Any) -> None:
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
