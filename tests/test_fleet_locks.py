"""One build per fleet: processes that miss the same plans in one store build them once.

Real processes (``python -c``), one real store directory, a slow ``project=`` so a pass lasts
long enough to be waited for, or killed in the middle. Processes start together behind a file
barrier, after their imports, so the race is real.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from adalncache import AdalnCache, CheckpointSource, Store, plan_key
from adalncache.source.files import write_safetensors
from adalncache.tiers.store import Staleness
from tiers_support import plan, projection_dict, simple_embed, small_spec

TESTS = Path(__file__).resolve().parent
PLANS = [[0.9, 0.8], [0.5], [0.3, 0.2, 0.1]]
WORKERS = 4

_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from tiers_support import plan, simple_embed, small_spec
    from adalncache import AdalnCache, CheckpointSource, plan_key
    barrier = Path({barrier!r})
    (barrier / "ready-{index}").touch()
    while len(list(barrier.glob("ready-*"))) < {workers}:
        time.sleep(0.01)
    marker = barrier / f"building-{{os.getpid()}}"

    def project(layer, x, weight, bias):
        marker.touch()
        time.sleep({sleep})
        return F.linear(x, weight, bias)

    spec = small_spec()
    cache = AdalnCache(spec, CheckpointSource({ckpt!r}, spec), max_plans=8, max_plan_width=4, store={store!r})
    plans = [plan(*p) for p in {plans!r}]
    report = cache.build(plans, embed=simple_embed(spec), project=project)
    rows = {{}}
    for i, p in enumerate(plans):
        got = cache.rows_of(plan_key(p))
        rows[f"block{{i}}"], rows[f"final{{i}}"] = got.block.contiguous(), got.final.contiguous()
    save_file(rows, {out!r})
    print(json.dumps({{"report": report.as_dict(), "lock_waits": cache.stats.lock_waits}}))
    """
)


def _start(tmp_path: Path, index: int, ckpt: Path, store: Path, sleep: float) -> subprocess.Popen[str]:
    code = _WORKER.format(
        tests=str(TESTS),
        barrier=str(tmp_path / "barrier"),
        index=index,
        workers=WORKERS,
        sleep=sleep,
        ckpt=str(ckpt),
        store=str(store),
        plans=PLANS,
        out=str(tmp_path / f"rows-{index}.safetensors"),
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _setup(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    spec = small_spec()
    ckpt = write_safetensors(projection_dict(spec, 0), tmp_path / "model.safetensors")
    (tmp_path / "barrier").mkdir()
    store = tmp_path / "store"
    Store(store)  # created once (two processes creating one directory at the same instant race in mkdir)
    reference = AdalnCache(spec, CheckpointSource(ckpt, spec), max_plans=8, max_plan_width=4)
    reference.build([plan(*p) for p in PLANS], embed=simple_embed(spec))
    want = {}
    for i, p in enumerate(PLANS):
        rows = reference.rows_of(plan_key(plan(*p)))
        want[f"block{i}"], want[f"final{i}"] = rows.block, rows.final
    return ckpt, store, want


def _assert_store_clean(store: Path) -> None:
    health = Store(store).health()
    assert health["corrupt"] == [] and health["temp_files"] == 0 and health["moved_aside"] == 0, health
    assert health["ok"] == len(PLANS)
    for lock in (store / "locks").rglob("*.lock"):  # whatever is left on disk is held by nobody
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def _finish(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_four_processes_on_a_cold_store_build_once(tmp_path: Path) -> None:
    ckpt, store, want = _setup(tmp_path)
    procs = [_start(tmp_path, i, ckpt, store, sleep=0.1) for i in range(WORKERS)]
    results = [_finish(p) for p in procs]
    reports = [r["report"] for r in results]
    assert sum(r["passes"] for r in reports) == 1, reports
    assert sum(r["built"] for r in reports) == len(PLANS)
    assert sum(r["store_hits"] for r in reports) == (WORKERS - 1) * len(PLANS)
    assert sum(r["lock_waits"] for r in results) == WORKERS - 1
    for i in range(WORKERS):
        got = load_file(str(tmp_path / f"rows-{i}.safetensors"))
        assert all(torch.equal(got[k], want[k]) for k in want), f"worker {i} holds other tables"
    _assert_store_clean(store)


def test_a_builder_killed_mid_pass_is_taken_over(tmp_path: Path) -> None:
    ckpt, store, want = _setup(tmp_path)
    procs = {}
    for i in range(WORKERS):
        proc = _start(tmp_path, i, ckpt, store, sleep=0.15)
        procs[proc.pid] = (i, proc)
    deadline = time.monotonic() + 150
    markers: list[Path] = []
    while not markers:
        assert time.monotonic() < deadline, "no worker started a pass"
        markers = list((tmp_path / "barrier").glob("building-*"))
        time.sleep(0.01)
    victim = int(markers[0].name.split("-")[1])
    os.kill(victim, signal.SIGKILL)  # mid-pass: its first projection has started
    killed_index, killed = procs.pop(victim)
    killed.communicate(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    results = {i: _finish(p) for i, p in procs.values()}
    reports = [r["report"] for r in results.values()]
    assert sum(r["passes"] for r in reports) == 1, reports  # one survivor took over; the others waited
    assert sum(r["store_hits"] for r in reports) == (WORKERS - 2) * len(PLANS)
    for i in results:
        got = load_file(str(tmp_path / f"rows-{i}.safetensors"))
        assert all(torch.equal(got[k], want[k]) for k in want), f"worker {i} holds other tables"
    assert not (tmp_path / f"rows-{killed_index}.safetensors").exists()
    _assert_store_clean(store)


def test_a_waiter_builds_itself_after_lock_wait(tmp_path: Path) -> None:
    """A live but slow holder (here another cache of this process, on a thread) is waited for at most lock_wait_s."""
    ckpt, store_dir, want = _setup(tmp_path)
    spec = small_spec()
    plans = [plan(*p) for p in PLANS]
    started, release = threading.Event(), threading.Event()

    def slow(layer: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        started.set()
        release.wait(30)
        return F.linear(x, weight, bias)

    holder = AdalnCache(spec, CheckpointSource(ckpt, spec), max_plans=8, max_plan_width=4, store=store_dir)
    thread = threading.Thread(target=lambda: holder.build(plans, embed=simple_embed(spec), project=slow))
    thread.start()
    try:
        assert started.wait(30)
        waiter = AdalnCache(
            spec,
            CheckpointSource(ckpt, spec),
            max_plans=8,
            max_plan_width=4,
            store=Store(store_dir, lock_wait_s=0.5),
        )
        report = waiter.build(plans, embed=simple_embed(spec))
        assert report.passes == 1 and report.built == len(PLANS) and 0.5 <= report.waited_s < 10
        assert waiter.stats.lock_waits == 1
    finally:
        release.set()
        thread.join(30)
    for i, p in enumerate(plans):  # both built the same bits; the store holds one verified copy of each
        assert torch.equal(waiter.rows_of(plan_key(p)).block, want[f"block{i}"])
        assert torch.equal(holder.rows_of(plan_key(p)).final, want[f"final{i}"])
    _assert_store_clean(store_dir)


def test_staleness_is_judged_on_the_waiters_clock() -> None:
    watch = Staleness(0.2)
    assert not watch.stale(b'{"beat": 1}')
    time.sleep(0.1)
    assert not watch.stale(b'{"beat": 2}')  # it beat: fresh again
    time.sleep(0.25)
    assert watch.stale(b'{"beat": 2}')  # no beat for longer than stale_s
