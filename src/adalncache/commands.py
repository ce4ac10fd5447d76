"""``adalncache build | inspect | verify | store prune``: fill, look into and check a store offline.

Why these exist: a serving process should start with its tables already on disk. ``build`` runs
the same transactional build the cache runs at serving time (same source, same embed, same
binding), so the entries it writes are exactly those a serving cache on this machine looks up.
``verify`` recomputes entries from the checkpoint and compares them bit for bit, so a store can be
trusted after a copy or a disk scare; ``inspect`` says what a checkpoint or a store holds.

The embed is MiniMax-H3's own: diffusers' ``Timesteps`` (``flip_sin_to_cos=True``,
``downscale_freq_shift=0``) and ``TimestepEmbedding`` loaded with the checkpoint's time-embedder
weights (native ``time_embedder.proj_in/proj_out`` or diffusers ``time_embedder.linear_1/linear_2``),
then SiLU in the embedder's dtype and only then the cast to the projection dtype. The weights are
read with ``CheckpointSource.read_tensor``, into buffers that keep their file offset modulo 64 like
the projections, because an fp32 GEMV's bits depend on the weight's address.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .cache import AdalnCache
from .errors import CheckpointError, ConfigError
from .plans import PlanKey, distinct_plans, format_plan, key_to_plan, minimax_h3_plans
from .source import CheckpointSource, SafetensorsHeader, checkpoint_files
from .spec import LAYOUTS, ModulationSpec
from .tiers.store import Store, StoredEntry, binding_hash

log = logging.getLogger(__name__)

TASKS = ("t2va", "fl2va", "ref2va")

#: Time-embedder tensor names per layout: (first linear, second linear).
TIME_EMBEDDER_NAMES: dict[str, tuple[str, str]] = {
    "native": ("time_embedder.proj_in", "time_embedder.proj_out"),
    "diffusers": ("time_embedder.linear_1", "time_embedder.linear_2"),
}

_BLOCK_RE = {
    "native": re.compile(r"^blocks\.(\d+)\.adaln_proj\.linear\.weight$"),
    "diffusers": re.compile(r"^transformer_blocks\.(\d+)\.adaln_proj\.linear\.weight$"),
}


# ---------------------------------------------------------------------------------------------
# checkpoint geometry and embed


def infer_spec(checkpoint: str | Path, *, layout: str = "auto", modalities: int = 3) -> ModulationSpec:
    """Read the projection geometry from a checkpoint's headers alone (no tensor data is read).

    Blocks are counted from ``0`` up to the first missing index; the width of block 0 gives the
    hidden size (``6 * modalities * hidden``), its input width the time-embedding size, its dtype
    the spec's dtype. ``CheckpointSource`` then validates every tensor against the result.
    """
    if layout not in ("auto", *LAYOUTS):
        raise ConfigError(f"layout must be auto, native or diffusers, got {layout!r}: set --layout")
    files, _ = checkpoint_files(checkpoint)
    entries: dict[str, Any] = {}
    for file in files:
        entries.update(SafetensorsHeader.read(file).entries)
    candidates = [layout] if layout != "auto" else list(LAYOUTS)
    for name in candidates:
        pattern = _BLOCK_RE[name]
        indices = {int(m.group(1)) for key in entries if (m := pattern.match(key))}
        if not indices:
            continue
        count = 0
        while count in indices:
            count += 1
        first = entries[LAYOUTS[name].weight(0)] if 0 in indices else None
        if first is None or len(first.shape) != 2 or first.torch_dtype is None:
            raise CheckpointError(f"{checkpoint}: block 0's AdaLN projection weight is missing or malformed")
        out, k = first.shape
        if out % (6 * modalities):
            raise CheckpointError(
                f"{checkpoint}: block 0's AdaLN projection has {out} outputs, not a multiple of 6 x {modalities} "
                f"modalities; this is not a MiniMax-H3 checkpoint"
            )
        try:
            return ModulationSpec(
                num_layers=count, hidden_size=out // (6 * modalities), time_embed_dim=k,
                modalities=modalities, dtype=first.torch_dtype,
            )  # fmt: skip
        except ConfigError as exc:
            raise CheckpointError(f"{checkpoint}: unusable projection geometry: {exc}") from None
    raise CheckpointError(
        f"{checkpoint} holds no AdaLN projection in a known layout (looked for {LAYOUTS['native'].weight(0)!r} "
        f"and {LAYOUTS['diffusers'].weight(0)!r}): pass a MiniMax-H3 transformer checkpoint, or set --layout"
    )


def _read_float(source: CheckpointSource, name: str) -> torch.Tensor:
    header, entry = source.entry(name)
    dtype = entry.torch_dtype
    if dtype is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"{header.path}: tensor {name} has dtype {entry.dtype}, expected F32, BF16 or F16")
    return source.read_tensor(name)


def time_embed_fn(
    source: CheckpointSource, spec: ModulationSpec, device: torch.device | str = "cpu"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``embed(plan)`` of MiniMax-H3 from the checkpoint's time-embedder weights (see the module docstring)."""
    try:
        from diffusers.models.embeddings import TimestepEmbedding, Timesteps
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("build and verify need diffusers (pip install 'adalncache[diffusers]')") from exc
    first, second = TIME_EMBEDDER_NAMES[source.layout.name]
    names = [first + ".weight", first + ".bias", second + ".weight", second + ".bias"]
    missing = []
    for name in names:
        try:
            source.entry(name)
        except KeyError:
            missing.append(name)
    if missing:
        raise CheckpointError(
            f"the checkpoint has no time-embedder weights ({', '.join(missing)} missing from "
            f"{', '.join(str(f) for f in source.files)}): build and verify compute the projections' input "
            f"from them; pass the whole transformer checkpoint, not only its AdaLN projections"
        )
    w1, b1, w2, b2 = (_read_float(source, name) for name in names)
    if w1.dim() != 2 or w2.dim() != 2 or w2.shape[1] != w1.shape[0] or w2.shape[0] != spec.time_embed_dim:
        raise CheckpointError(
            f"time-embedder shapes {list(w1.shape)} and {list(w2.shape)} do not produce the projections' "
            f"{spec.time_embed_dim} input features"
        )
    freq_dim, hidden = w1.shape[1], w1.shape[0]
    device = torch.device(device)
    time_proj = Timesteps(num_channels=freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
    embedder = TimestepEmbedding(in_channels=freq_dim, time_embed_dim=hidden, out_dim=spec.time_embed_dim)
    for linear, (w, b) in ((embedder.linear_1, (w1, b1)), (embedder.linear_2, (w2, b2))):
        linear.weight = torch.nn.Parameter(w if device.type == "cpu" else w.to(device), requires_grad=False)
        linear.bias = torch.nn.Parameter(b if device.type == "cpu" else b.to(device), requires_grad=False)
    embedder.eval()
    embed_dtype = w1.dtype

    def embed(plan: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            temb = time_proj(plan.to(device))
            temb = embedder(temb.to(embed_dtype))
            return F.silu(temb).to(spec.dtype)

    return embed


def _open(checkpoint: str, layout: str) -> tuple[ModulationSpec, CheckpointSource]:
    spec = infer_spec(checkpoint, layout=layout)
    return spec, CheckpointSource(checkpoint, spec, layout=layout)


def _gb_to_bytes(value: float, flag: str) -> int:
    if not (value >= 0) or value == float("inf"):
        raise ConfigError(f"{flag} must be a non-negative number of GiB, got {value!r}")
    return int(value * (1 << 30))


# ---------------------------------------------------------------------------------------------
# build


def schedule_plans(
    tasks: Sequence[str], steps: Sequence[int], *, video_shift: float, audio_shift: float, audio_refs: bool
) -> list[torch.Tensor]:
    """Every distinct plan of every (task, step count) pair, in first-seen order."""
    plans: list[torch.Tensor] = []
    for task in tasks:
        for count in steps:
            plans.extend(
                minimax_h3_plans(task, count, video_shift=video_shift, audio_shift=audio_shift, audio_refs=audio_refs)
            )
    order, tensors = distinct_plans(plans)
    return [tensors[k] for k in order]


def run_build(args: argparse.Namespace) -> int:
    spec, source = _open(args.checkpoint, args.layout)
    embed = time_embed_fn(source, spec, args.device)
    plans = schedule_plans(
        args.task, args.steps, video_shift=args.video_shift, audio_shift=args.audio_shift,
        audio_refs=not args.no_audio_refs,
    )  # fmt: skip
    width = max(p.numel() for p in plans)
    if width > args.plan_width:
        raise ConfigError(f"these schedules have plans of {width} timesteps: raise --plan-width to at least {width}")
    store = Store(args.store)
    # The working slab: no more plans than one pass needs, so a small build allocates little.
    slab_plans = max(1, min(args.max_plans, len(plans)))
    cache = AdalnCache(
        spec, source, max_plans=slab_plans, max_plan_width=width, device=args.device,
        precision=args.precision, store=store, progress=not args.quiet, batched=args.batched,
    )  # fmt: skip
    # Existence by name only: reading every entry to verify it would cost as much as a pass on a
    # large store. A corrupt entry is caught (and rebuilt) by the serving cache's read, or by verify.
    stored = store.contains(cache.binding(), [_key(p) for p in plans])
    todo = [p for p in plans if _key(p) not in stored]
    chunks = [todo[i : i + slab_plans] for i in range(0, len(todo), slab_plans)]
    built = passes = failures = 0
    for chunk in tqdm(chunks, desc="adalncache build", unit="pass", disable=args.quiet or len(chunks) < 2):
        report = cache.build(chunk, embed=embed)
        built += report.built
        passes += report.passes
        failures += report.tier_write_failures
        cache.invalidate()  # the slab is scratch here; the store is the product
    if failures:
        raise ConfigError(
            f"{failures} store write(s) failed under {args.store} (see the log, -v): check the directory's "
            f"free space and permissions (--store)"
        )
    print(
        f"adalncache build: {len(plans)} distinct plan(s) for {', '.join(args.task)} x steps "
        f"{', '.join(map(str, args.steps))}: {len(stored)} already stored, {built} built in {passes} pass(es) "
        f"into {args.store} (binding {binding_hash(cache.binding())[:12]}, {args.precision})"
    )
    return 0


def _key(plan: torch.Tensor) -> PlanKey:
    from .plans import plan_key

    return plan_key(plan)


# ---------------------------------------------------------------------------------------------
# inspect


def _is_store(path: Path) -> bool:
    return path.is_dir() and (path / "STORE").exists()


def inspect_store(path: Path, *, verify: bool = True) -> dict[str, Any]:
    store = Store(path)
    entries = store.entries()
    bindings = store.bindings()
    per: dict[str, dict[str, Any]] = {}
    for entry in entries:
        info = per.setdefault(entry.binding, {"entries": 0, "bytes": 0})
        info["entries"] += 1
        info["bytes"] += entry.size
    for bhash, info in per.items():
        binding = bindings.get(bhash, {})
        env = binding.get("environment", {}) if isinstance(binding, dict) else {}
        info.update(
            fingerprint=str(binding.get("fingerprint", "?"))[:16],
            spec=binding.get("spec"),
            precision=binding.get("precision"),
            variant=binding.get("variant"),
            torch=env.get("torch"),
            device=env.get("device_name") or env.get("cpu_capability") or env.get("device_type"),
        )
    return {
        "kind": "store",
        "path": str(path),
        "entries": len(entries),
        "bytes": sum(e.size for e in entries),
        "bindings": per,
        "health": store.health(verify=verify),
    }


def inspect_checkpoint(path: str, layout: str) -> dict[str, Any]:
    spec, source = _open(path, layout)
    info = source.describe()
    first, second = TIME_EMBEDDER_NAMES[source.layout.name]
    present = []
    for name in (first + ".weight", second + ".weight"):
        try:
            source.entry(name)
            present.append(name)
        except KeyError:
            pass
    info["time_embedder"] = len(present) == 2
    info["row_bytes"] = spec.row_bytes
    return info


def run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    is_store = _is_store(path)
    info = inspect_store(path, verify=not args.quick) if is_store else inspect_checkpoint(args.path, args.layout)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    if info["kind"] == "store":
        health = info["health"]
        print(f"store {info['path']}: {info['entries']} entries, {info['bytes'] / 2**20:.2f} MiB")
        for bhash, b in info["bindings"].items():
            print(
                f"  binding {bhash[:12]}: {b['entries']} entries, {b['bytes'] / 2**20:.2f} MiB, checkpoint "
                f"{b['fingerprint'][:12]}, precision {b['precision']}, spec {b['spec']}, torch {b['torch']} on "
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
    print(
        f"  {spec['num_layers']} blocks, hidden {spec['hidden_size']}, time embedding {spec['time_embed_dim']}, "
        f"{spec['dtype']}; {info['projection_tensors']} projection tensors, "
        f"{info['projection_bytes'] / 2**20:.2f} MiB; one table row {info['row_bytes'] / 2**20:.3f} MiB"
    )
    print(f"  time embedder: {'present' if info['time_embedder'] else 'MISSING (build/verify need it)'}")
    print(f"  fingerprint {info['fingerprint']}")
    if args.tensors:
        for t in info["tensors"]:
            print(f"    {t['name']} {t['dtype']} {t['shape']} ({t['file']})")
    return 0


# ---------------------------------------------------------------------------------------------
# verify


def run_verify(args: argparse.Namespace) -> int:
    if args.sample is not None and args.sample < 1:
        raise ConfigError(f"--sample must be a positive number of entries, got {args.sample}")
    path = Path(args.store)
    if not _is_store(path):
        raise ConfigError(f"{path} is not an adalncache store (no STORE marker): set --store")
    spec, source = _open(args.checkpoint, args.layout)
    store = Store(path)
    embed = time_embed_fn(source, spec, args.device)
    entries = store.entries()
    by_binding: dict[str, list[Any]] = {}
    for entry in entries:
        by_binding.setdefault(entry.binding, []).append(entry)
    checked = mismatched = corrupt = 0
    hashes = _local_hashes(spec, source, args.device)
    matched_any = False
    for precision, bhash in hashes.items():
        infos = by_binding.get(bhash, [])
        if not infos:
            continue
        matched_any = True
        if args.sample is not None and args.sample < len(infos):
            infos = random.Random(args.seed).sample(infos, args.sample)
        # Entries are read chunk by chunk, one pass each, so memory stays at one slab's worth.
        per_pass = max(1, min(args.max_plans, len(infos)))
        chunks = [infos[i : i + per_pass] for i in range(0, len(infos), per_pass)]
        for chunk in tqdm(chunks, desc=f"adalncache verify ({precision})", unit="pass", disable=args.quiet):
            stored: list[StoredEntry] = []
            for item in store.iter_entries(chunk):
                if isinstance(item, StoredEntry):
                    stored.append(item)
                else:
                    corrupt += 1
                    print(f"CORRUPT {item[0].path}: {item[1]}")
            if not stored:
                continue
            cache = AdalnCache(
                spec, source, max_plans=len(stored), max_plan_width=max(len(e.key) for e in stored),
                device=args.device, precision=precision, progress=not args.quiet,
                batched=False,  # always per plan: this is what confirms entries built with --batched
            )  # fmt: skip
            cache.build([key_to_plan(e.key) for e in stored], embed=embed)
            for item in stored:
                fresh = cache.rows_of(item.key)
                same = torch.equal(fresh.block.cpu(), item.rows.block) and torch.equal(
                    fresh.final.cpu(), item.rows.final
                )
                checked += 1
                if not same:
                    mismatched += 1
                    print(f"MISMATCH {item.info.path}: plan {format_plan(item.key)} differs from a recomputation")
            del cache, stored
    others = len(entries) - sum(len(by_binding.get(h, [])) for h in hashes.values())
    if not matched_any:
        raise ConfigError(
            f"{path} holds no entries for this checkpoint on this machine ({len(entries)} entries under other "
            f"bindings): check --checkpoint and --device, or run adalncache build first"
        )
    verdict = "OK" if not (mismatched or corrupt) else "FAILED"
    print(
        f"adalncache verify: {verdict}: {checked} entr{'y' if checked == 1 else 'ies'} recomputed, {mismatched} "
        f"mismatched, {corrupt} corrupt; {others} under other bindings not checked"
    )
    return 1 if (mismatched or corrupt) else 0


def _local_hashes(spec: ModulationSpec, source: CheckpointSource, device: str) -> dict[str, str]:
    """The binding hash a cache on this machine would use, per precision (what verify can check)."""
    out = {}
    for precision in ("match", "fp32"):
        probe = AdalnCache(spec, source, max_plans=1, max_plan_width=1, device=device, precision=precision)
        out[precision] = binding_hash(probe.binding())
    return out


# ---------------------------------------------------------------------------------------------
# store prune


def run_prune(args: argparse.Namespace) -> int:
    path = Path(args.store)
    if not _is_store(path):
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


def _positive_int(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {value}")
        return value

    return parse


def _common(parser: argparse.ArgumentParser, *, slab: bool = True) -> None:
    parser.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS], help="checkpoint layout")
    parser.add_argument("--device", default="cpu", help="device the tables are for (default: cpu)")
    if slab:
        parser.add_argument(
            "--max-plans", type=_positive_int("--max-plans"), default=64,
            help="plans per pass: the working slab (default: 64)",
        )  # fmt: skip
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def register(subparsers: Any) -> None:
    """Add ``build``, ``inspect``, ``verify`` and ``store prune`` to the ``adalncache`` command line."""
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
    p.add_argument("--task", action="append", required=True, choices=TASKS, help="request kind (repeatable)")
    p.add_argument(
        "--steps", action="append", required=True, type=_positive_int("--steps"),
        help="num_inference_steps of a schedule (repeatable)",
    )  # fmt: skip
    p.add_argument("--video-shift", type=float, default=12.0, help="video schedule shift (default: 12)")
    p.add_argument("--audio-shift", type=float, default=3.0, help="audio schedule shift (default: 3)")
    p.add_argument("--no-audio-refs", action="store_true", help="ref2va without a reference audio")
    p.add_argument(
        "--plan-width", type=_positive_int("--plan-width"), default=4,
        help="most timesteps per plan (default: 4)",
    )  # fmt: skip
    p.add_argument("--precision", default="match", choices=["match", "fp32"], help="projection precision")
    p.add_argument(
        "--batched", action="store_true",
        help="stack plans of one width into one GEMM where a probe shows the bits unchanged (verify re-checks)",
    )  # fmt: skip
    _common(p)
    p.set_defaults(func=run_build)

    p = subparsers.add_parser(
        "inspect",
        help="what a checkpoint or a store holds",
        description="Checkpoint: layout, tensors, bytes, fingerprint. Store: entries, sizes, bindings, health.",
    )
    p.add_argument("path", metavar="PATH", help="a checkpoint (file or directory) or a store directory")
    p.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS], help="checkpoint layout (default: auto)")
    p.add_argument("--tensors", action="store_true", help="list every projection tensor")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quick", action="store_true", help="store: list entries without checking their digests")
    p.set_defaults(func=run_inspect)

    p = subparsers.add_parser(
        "verify",
        help="recompute store entries and compare bit for bit (exit 1 on any difference)",
        description=(
            "Recompute the store's entries for --checkpoint on this machine and compare them with torch.equal. "
            "Exit status 1 when any entry differs or is corrupt."
        ),
    )
    p.add_argument("--store", required=True, help="store directory")
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


__all__ = ["TASKS", "TIME_EMBEDDER_NAMES", "infer_spec", "register", "schedule_plans", "time_embed_fn"]
