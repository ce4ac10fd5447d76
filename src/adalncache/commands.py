"""``adalncache build | export | inspect | verify | store prune``: the command-line shells.

Each ``run_*`` checks its arguments, turns them into library calls (:mod:`adalncache.offline`,
:mod:`adalncache.export`, :mod:`adalncache.plans`, :mod:`adalncache.embedding`) and prints what they
return; the work itself lives in the library, where the examples and the tests call it too.
``build`` and ``export`` may run under torchrun: each rank then builds its share of every pass
(``--shard``) and the ranks exchange rows, as ``AdalnCache(process_group=...)`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .cache import PRECISIONS, SHARD_MODES, AdalnCache
from .devices import resolve_device
from .embedding import time_embed_fn
from .errors import ConfigError
from .export import check_export, check_output, export_tables, source_files, verify_tables
from .families.minimax_h3 import MODEL_VARIANTS
from .offline import describe_checkpoint, describe_store, fill_store, is_store, open_checkpoint, verify_store
from .plans import schedule_plans
from .schedules import TASKS
from .spec import LAYOUTS
from .tablefile import FORMATS, TableFile, is_table_file
from .tiers.store import Store


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
    finally:
        dist.destroy_process_group()


def run_build(args: argparse.Namespace) -> int:
    if not (args.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    host_cache_bytes = _gb_to_bytes(args.host_cache_gb, "--host-cache-gb")
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    plans = schedule_plans(
        args.task, args.steps, video_shift=args.video_shift, audio_shift=args.audio_shift,
        audio_refs=not args.no_audio_refs,
    )  # fmt: skip
    width = max(p.numel() for p in plans)
    if width > args.plan_width:
        raise ConfigError(f"these schedules have plans of {width} timesteps: raise --plan-width to at least {width}")
    with _torchrun_group(device, args.timeout) as (group, device, rank):
        rank0 = rank == 0
        embed = time_embed_fn(source, spec, device)
        # The working slab: no more plans than one pass needs, so a small build allocates little.
        cache = AdalnCache(
            spec, source, max_plans=max(1, min(args.max_plans, len(plans))), max_plan_width=width, device=device,
            precision=args.precision, store=Store(args.store, lock_wait_s=args.lock_wait),
            progress=rank0 and not args.quiet,
            batched=args.batched, tiled=TILED_FLAG[args.tiled], read_ahead=args.read_ahead,
            host_cache_bytes=host_cache_bytes,
            process_group=group, shard=args.shard,
        )  # fmt: skip
        report = fill_store(cache, plans, embed=embed, progress=rank0 and not args.quiet)
        ranks = f", {cache.world_size} ranks (--shard {args.shard})" if group is not None else ""
    if rank0:
        print(
            f"adalncache build: {report.plans} distinct plan(s) for {', '.join(args.task)} x steps "
            f"{', '.join(map(str, args.steps))}: {report.already_stored} already stored, {report.built} built in "
            f"{report.passes} pass(es) into {args.store} (binding {report.binding[:12]}, {args.precision}{ranks})"
        )
    return 0


# ---------------------------------------------------------------------------------------------
# export


def run_export(args: argparse.Namespace) -> int:
    if not (args.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    output = Path(args.output)
    check_output(output)  # before anything is read, then again against the checkpoint's files
    device = resolve_device(args.device)
    spec, source = open_checkpoint(args.checkpoint, layout=args.layout)
    check_output(output, source_files(source))
    check_export(spec, format=args.format, precision=args.precision, model_variant=args.model_variant, tasks=args.task)
    shifts = {"video_shift": args.video_shift, "audio_shift": args.audio_shift, "audio_refs": not args.no_audio_refs}
    plans = schedule_plans(args.task, args.steps, **shifts)
    width = max(p.numel() for p in plans)
    store = Store(args.store, lock_wait_s=args.lock_wait) if args.store else None
    schedules = [{"task": t, "steps": n, **shifts} for t in args.task for n in args.steps]
    with _torchrun_group(device, args.timeout) as (group, device, rank):
        rank0 = rank == 0
        embed = time_embed_fn(source, spec, device)
        cache = AdalnCache(
            spec, source, max_plans=max(1, min(args.max_plans, len(plans))), max_plan_width=width, device=device,
            precision=args.precision, store=store, progress=rank0 and not args.quiet, batched=args.batched,
            tiled=TILED_FLAG[args.tiled], read_ahead=args.read_ahead, process_group=group, shard=args.shard,
        )  # fmt: skip
        report = export_tables(
            cache, plans, output, embed=embed, format=args.format, model_variant=args.model_variant,
            tasks=args.task, schedules=schedules, progress=rank0 and not args.quiet,
        )  # fmt: skip
    if rank0:
        sglang = ", ".join(f"--steps {n} -> --num-inference-steps {n - 1}" for n in args.steps)
        print(
            f"adalncache export: wrote {report.path} ({report.format}, {report.plans} plans of up to {report.width} "
            f"timesteps, {report.bytes / 2**20:.2f} MiB): {report.store_hits} from the store, {report.built} built "
            f"in {report.passes} pass(es); content {report.content or 'not bound (sglang format)'}"
        )
        print(f"  serves SGLang ({sglang}){f', --model-variant {args.model_variant}' if args.model_variant else ''}")
    return 0


# ---------------------------------------------------------------------------------------------
# inspect


def _family_geometry(spec: dict[str, Any]) -> str | None:
    """A described spec of a family that lists its layers, in words (None for the default family's)."""
    if "family" not in spec:
        return None
    widths = sorted({int(width) for _, width, _ in spec["layers"]})
    return (
        f"{spec['family']}: {len(spec['layers'])} layers of widths {', '.join(map(str, widths))}, input "
        f"{spec['in_features']}, plans keyed by {', '.join(spec['plan_inputs'])}, {spec['dtype']}"
    )


def _print_tables(info: dict[str, Any]) -> None:
    print(
        f"table file {info['path']}: {info['format']} format, {info['plans']} plans of up to {info['width']} "
        f"timesteps (per width: {info['plans_per_width']}), {info['bytes'] / 2**20:.2f} MiB"
    )
    spec = info["spec"]
    geometry = _family_geometry(spec) or f"{spec['num_layers']} blocks, hidden {spec['hidden_size']}, {spec['dtype']}"
    print(f"  {geometry}; model_variant {info['model_variant'] or '(none)'}")
    binding = info["binding"]
    if binding is None:
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
        if table.binding is not None and not args.quick:
            bad = table.verify_slots()
            info["slots"] = f"{len(bad)} of {table.plans} fail their digest" if bad else "every digest verified"
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
    embed = time_embed_fn(source, spec, device)
    report = verify_tables(
        table, source, embed=embed, device=device, max_plans=args.max_plans, read_ahead=args.read_ahead,
        sample=args.sample, seed=args.seed, progress=not args.quiet,
    )  # fmt: skip
    for line in report.corrupt:
        print(f"CORRUPT {line}")
    for line in report.mismatched:
        print(f"MISMATCH {line}")
    if report.content_matches is False:
        print(f"CONTENT the file names {table.content}, --checkpoint is {report.content}")
    if report.foreign:
        print(
            f"NOTE built under another {', '.join(report.foreign)} than this machine's: a bit-for-bit match here is "
            f"not expected (verify on the machine class it was exported for)"
        )
    print(
        f"adalncache verify: {'OK' if report.ok else 'FAILED'}: {report.checked} plan(s) of {table.path} recomputed, "
        f"{len(report.mismatched)} mismatched, {len(report.corrupt)} corrupt"
        + ("" if report.content_matches is None else f", content {'matches' if report.content_matches else 'DIFFERS'}")
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
    embed = time_embed_fn(source, spec, device)
    report = verify_store(
        Store(path), spec, source, embed=embed, device=device, max_plans=args.max_plans,
        read_ahead=args.read_ahead, sample=args.sample, seed=args.seed, progress=not args.quiet,
    )  # fmt: skip
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


def _common(parser: argparse.ArgumentParser, *, slab: bool = True) -> None:
    parser.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS], help="checkpoint layout")
    parser.add_argument("--device", default="cpu", help="device the tables are for (default: cpu)")
    if slab:
        parser.add_argument(
            "--max-plans", type=_positive_int("--max-plans"), default=64,
            help="plans per pass: the working slab (default: 64)",
        )  # fmt: skip
    parser.add_argument(
        "--read-ahead", type=_int_at_least("--read-ahead", 0), default=1,
        help="layers read ahead while one is projected, as AdalnCache(read_ahead=) (default: 1)",
    )  # fmt: skip
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _schedules(parser: argparse.ArgumentParser, steps_help: str) -> None:
    """The flags that name schedules: --task and --steps (repeatable), the shifts, --no-audio-refs."""
    parser.add_argument("--task", action="append", required=True, choices=TASKS, help="request kind (repeatable)")
    parser.add_argument("--steps", action="append", required=True, type=_positive_int("--steps"), help=steps_help)
    parser.add_argument("--video-shift", type=float, default=12.0, help="video schedule shift (default: 12)")
    parser.add_argument("--audio-shift", type=float, default=3.0, help="audio schedule shift (default: 3)")
    parser.add_argument("--no-audio-refs", action="store_true", help="ref2va without a reference audio")


def _lock_wait(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock-wait", type=float, default=600.0,
        help="seconds to wait for another process building the same store entries before building them here "
        "(0: never wait) (default: 600)",
    )  # fmt: skip


#: ``--tiled``'s choices, as ``AdalnCache(tiled=)`` takes them.
TILED_FLAG: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}


def _tiled(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tiled", default="auto", choices=list(TILED_FLAG),
        help="project every plan tile by tile over the output columns where a probe shows the bits unchanged: "
        "auto (where also faster; default), on, off, as AdalnCache(tiled=)",
    )  # fmt: skip


def register(subparsers: Any) -> None:
    """Add ``build``, ``export``, ``inspect``, ``verify`` and ``store prune`` to the ``adalncache`` command line."""
    p = subparsers.add_parser(
        "build",
        help="fill a store with the tables of one or more schedules",
        description=(
            "Compute the AdaLN tables of every plan the given tasks and step counts use, from CHECKPOINT (which "
            "must include the time embedder), and write them to --store in as few passes as --max-plans allows."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=".safetensors file, or a (sharded) checkpoint directory")
    p.add_argument("--store", required=True, help="store directory (created if absent)")
    _schedules(p, "num_inference_steps of a schedule (repeatable)")
    p.add_argument(
        "--plan-width", type=_positive_int("--plan-width"), default=4,
        help="most timesteps per plan (default: 4)",
    )  # fmt: skip
    p.add_argument("--precision", default="match", choices=list(PRECISIONS), help="projection precision")
    p.add_argument(
        "--batched", action="store_true",
        help="stack plans of one width into one GEMM where a probe shows the bits unchanged (verify re-checks)",
    )  # fmt: skip
    _tiled(p)
    p.add_argument(
        "--host-cache-gb", type=float, default=0.0,
        help="GiB of host memory for the cache's RAM tier, as AdalnCache(host_cache_bytes=) (default: 0; "
        "a build keeps its tables in the store, so it needs none)",
    )  # fmt: skip
    p.add_argument(
        "--shard", default="layers", choices=list(SHARD_MODES),
        help="under torchrun, how the ranks split each pass: layers (the one-process tables) or columns (a "
        "column-parallel runtime's tables, stored apart) (default: layers; one process: no effect)",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=float, default=600.0,
        help="under torchrun, the process group's timeout in seconds: how long ranks wait for a dead peer "
        "(default: 600)",
    )  # fmt: skip
    _lock_wait(p)
    _common(p)
    p.set_defaults(func=run_build)

    p = subparsers.add_parser(
        "export",
        help="write the tables of one or more schedules to one file (sglang or adalncache format)",
        description=(
            "Compute the AdaLN tables of every plan the given tasks and step counts use, from CHECKPOINT (which must "
            "include the time embedder), and write them to one safetensors file: --format sglang is exactly SGLang's "
            "sidecar (serve it with --minimax-h3-adaln-cache-path and the same --model-variant); --format adalncache "
            "adds the binding (content digest, spec, precision, numeric environment) that lets enable_adaln_cache("
            "tables=) and adalncache verify --tables check it. Step counts: --steps N is the pipeline's "
            "num_inference_steps (N grid points, N - 1 forwards); SGLang's --num-inference-steps counts forwards, so "
            "a file exported with --steps N serves SGLang's --num-inference-steps N-1. Entries already in --store "
            "are reused; under torchrun the ranks share the passes (--shard) and rank 0 writes the file."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=".safetensors file, or a (sharded) checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="the table file to write (replaced atomically when done)")
    p.add_argument(
        "--format", default="adalncache", choices=list(FORMATS),
        help="adalncache: bound, verifiable, any dtype (default); sglang: exactly SGLang's sidecar (bfloat16, "
        "--precision match, needs --model-variant)",
    )  # fmt: skip
    p.add_argument(
        "--model-variant", choices=list(MODEL_VARIANTS), default=None,
        help="the released transformer the tables belong to (t2va and fl2va run on fl2va, ref2va on ref2va); "
        "SGLang compares it with its own --model-variant",
    )  # fmt: skip
    _schedules(p, "num_inference_steps (grid points; N - 1 forwards, SGLang's --num-inference-steps N-1) (repeatable)")
    p.add_argument("--store", default=None, help="a store to take entries from (and fill), optional")
    p.add_argument("--precision", default="match", choices=list(PRECISIONS), help="projection precision")
    p.add_argument("--batched", action="store_true", help="stacked projections where proven bit-identical")
    _tiled(p)
    p.add_argument(
        "--shard", default="layers", choices=list(SHARD_MODES),
        help="under torchrun: layers (the one-process tables) or columns (a tensor-parallel runtime's tables)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="under torchrun, the process group's timeout (s)")
    _lock_wait(p)
    _common(p)
    p.set_defaults(func=run_export)

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
        "--hash", action="store_true",
        help="checkpoint: compute its content digest now if no memo has it (reads every projection byte once)",
    )  # fmt: skip
    p.set_defaults(func=run_inspect)

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
    _common(p)
    p.set_defaults(func=run_verify)

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


__all__ = ["register", "run_build", "run_export", "run_inspect", "run_prune", "run_verify"]
