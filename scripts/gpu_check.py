"""One short, prepared check of the GPU-only claims, for a session that is lent a CUDA device.

Run from the repository root (about two minutes on an H200, most of it writing a 1 GiB checkpoint):

    .venv/bin/python scripts/gpu_check.py --device cuda --out "$OUT"

It also runs on CPU (``--device cpu``), which is how the script itself is tested. Every
exactness check is ``torch.equal``; the script prints one line per check and exits 1 if any
fails. Checks:

1. ``adalncache demo --device DEV``: the diffusers integration, resident vs cached, all tasks.
2. A pass at the released projection widths (2 blocks + output layer) on DEV through
   ``CheckpointSource`` (pinned staging buffer, copy stream, ``record_stream``), against
   ``F.linear`` on DEV with the weights loaded by safetensors (cuBLAS on CUDA): page cache warm,
   cold (O_DIRECT into the pinned buffer) and with ``direct_io=False``.
3. Host tier (pinned arena on CUDA): a plan evicted from the slab comes back from RAM, no pass.
4. Batched mode: what the probe decides on DEV, and the slab equals the per-plan one.
5. Timing, side by side: pass vs read-only vs project-only (weights resident on DEV), 1 and 16 plans.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from adalncache import AdalnCache, CheckpointSource, ModulationSpec
from adalncache.batching import clear_verdicts, verdicts
from adalncache.cli import main as cli_main
from adalncache.plans import plan_key
from adalncache.spec import FINAL, get_layout
from adalncache.tools.bench import drop_page_cache, generate_checkpoint, read_only, request_plans
from adalncache.tools.bench import sync_device as sync

RESULTS: list[dict[str, Any]] = []


def record(name: str, ok: bool, **details: Any) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), **details})
    extra = " ".join(f"{k}={v}" for k, v in details.items())
    print(f"{'PASS' if ok else 'FAIL'} {name} {extra}", flush=True)


def reference(weights: dict[str, torch.Tensor], spec: ModulationSpec, x: torch.Tensor, layer: Any) -> torch.Tensor:
    layout = get_layout("native")
    return F.linear(x, weights[layout.weight(layer)], weights[layout.bias(layer)])


def _o_direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


def _cache_emptied(files: list[Path]) -> bool:
    from adalncache.source import resident_fraction

    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            resident = resident_fraction(fd, 0, path.stat().st_size)
        finally:
            os.close(fd)
        if resident is None or resident >= 0.1:
            return False
    return True


def check_pass(
    name: str,
    source: CheckpointSource,
    weights: dict[str, torch.Tensor],
    xs: dict,
    plans: list,
    device: torch.device,
    expect_direct: bool = False,
    **cache_kw: Any,
) -> AdalnCache:
    cache = AdalnCache(
        source.spec, source, max_plans=len(plans), max_plan_width=4, device=device, progress=False, **cache_kw
    )
    before = source.bytes_direct
    cache.build(plans, embed=lambda p: xs[plan_key(p)])
    bad = []
    for p in plans:
        slot, n = cache.lookup(p), p.numel()
        for layer in source.spec.layers():
            want = reference(weights, source.spec, xs[plan_key(p)], layer)
            got = cache.final_rows(slot, n) if layer == FINAL else cache.block_rows(int(layer), slot, n)
            if not torch.equal(got, want):
                bad.append(f"{p.tolist()}@{layer}")
    direct = source.bytes_direct - before
    supported = _o_direct_supported(source.files[0])
    ok = not bad and (direct > 0 if expect_direct and supported else True)
    record(
        name, ok, mismatches=len(bad), direct_mib=round(direct / 2**20, 1), o_direct_supported=supported,
        direct_expected=expect_direct,
    )  # fmt: skip
    return cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="", help="directory for gpu_check.json")
    parser.add_argument("--dir", default="", help="where the checkpoint is written (default: a temp dir)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=5376, help="hidden size (default: the released 5376)")
    parser.add_argument("--in-features", type=int, default=2688, help="projection input (default: 2688)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"device {device}: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"torch {torch.__version__}",
        flush=True,
    )

    # 1. the diffusers integration end to end
    code = cli_main(["demo", "--device", str(device)])
    record("demo bit-identical (all tasks)", code == 0, exit_code=code)

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="adalncache-gpu-check-"))
    spec = ModulationSpec(num_layers=args.layers, hidden_size=args.hidden, time_embed_dim=args.in_features)
    ckpt = generate_checkpoint(spec, work / f"ckpt-{args.layers}x{args.hidden}x{args.in_features}")
    weights = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        # Copies (clone), so no mapping of the file stays alive: mapped pages cannot be dropped.
        weights.update({k: v.clone().to(device) for k, v in load_file(str(f)).items()})
    plans = request_plans(50)[:16]
    gen = torch.Generator().manual_seed(0)
    xs = {
        plan_key(p): F.silu(torch.randn(p.numel(), spec.time_embed_dim, generator=gen)).to(spec.dtype).to(device)
        for p in plans
    }
    files = [Path(f) for f in sorted(ckpt.glob("*.safetensors"))]

    # 2. passes on the device, warm / cold (O_DIRECT) / plain reads
    source = CheckpointSource(ckpt, spec)
    read_only(source)
    check_pass("pass warm == F.linear on device", source, weights, xs, plans, device)
    drop_page_cache(files)
    # Only where the drop really emptied the cache (mincore) must the cold pass have read directly.
    dropped = _cache_emptied(files)
    check_pass("pass cold (O_DIRECT) == F.linear on device", source, weights, xs, plans, device, expect_direct=dropped)
    plain = CheckpointSource(ckpt, spec, direct_io=False)
    drop_page_cache(files)
    check_pass("pass cold, direct_io=False == F.linear on device", plain, weights, xs, plans, device)

    # 3. host tier: evict from the slab, restore from RAM
    cache = AdalnCache(
        spec, source, max_plans=2, max_plan_width=4, device=device, progress=False, host_cache_bytes=1 << 30
    )
    embed = lambda p: xs[plan_key(p)]  # noqa: E731
    first = cache.build(plans[:2], embed=embed)
    cache.build(plans[2:4], embed=embed)  # evicts the first two from the slab
    back = cache.build(plans[:2], embed=embed)
    same = all(
        torch.equal(cache.block_rows(0, cache.lookup(p), p.numel()), reference(weights, spec, xs[plan_key(p)], 0))
        for p in plans[:2]
    )
    record(
        "host tier restore exact, no pass",
        same and back.host_hits == 2 and back.passes == 0,
        first_passes=first.passes,
        host_hits=back.host_hits,
        passes=back.passes,
    )

    # 4. batched mode on this device
    clear_verdicts()
    batched = check_pass("batched pass == F.linear on device", source, weights, xs, plans, device, batched=True)
    del batched
    record(
        "batched probe verdicts (informational)", True, verdicts={str(k[3:5]): v for k, v in verdicts().items()}
    )  # (width, count): stackable

    # 5. timing side by side
    resident = {
        layer: (weights[get_layout("native").weight(layer)], weights[get_layout("native").bias(layer)])
        for layer in spec.layers()
    }

    def project_only(k: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            for layer in spec.layers():
                w, b = resident[layer]
                for p in plans[:k]:
                    F.linear(xs[plan_key(p)], w, b)
        sync(device)
        return time.perf_counter() - start

    def one_pass(k: int) -> float:
        c = AdalnCache(spec, source, max_plans=k, max_plan_width=4, device=device, progress=False)
        sync(device)
        start = time.perf_counter()
        c.build(plans[:k], embed=embed)
        sync(device)
        return time.perf_counter() - start

    timings: dict[str, list[float]] = {"read": [], "project1": [], "pass1": [], "project16": [], "pass16": []}
    one_pass(1)  # the kept pinned buffer
    for _ in range(3):
        timings["read"].append(read_only(source))
        for k in (1, 16):
            timings[f"project{k}"].append(project_only(k))
            timings[f"pass{k}"].append(one_pass(k))
    med = {k: statistics.median(v) for k, v in timings.items()}
    for k in (1, 16):
        bound = max(med["read"], med[f"project{k}"])
        record(
            f"pass / max(read, project), {k} plan(s), warm (informational)",
            True,
            ratio=round(med[f"pass{k}"] / bound, 3),
            pass_s=round(med[f"pass{k}"], 4),
            read_s=round(med["read"], 4),
            project_s=round(med[f"project{k}"], 4),
        )

    ok = all(r["ok"] for r in RESULTS)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(
            json.dumps({"device": str(device), "results": RESULTS}, indent=2, default=str)
        )
    print(f"gpu_check: {'ALL PASSED' if ok else 'FAILURES'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
