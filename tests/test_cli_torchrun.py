"""``adalncache build`` started by a launcher as several ranks: ``--shard`` reaches the cache.

The two ranks are started the way torchrun starts its workers (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), without torchrun's own agent process, which
only costs start-up time here. Column sharding gives a column-parallel runtime's tables, which a
store keys apart from the one-process ones: that is how the test sees the flag took effect.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from adalncache import AdalnCache, CheckpointSource, ModulationSpec
from adalncache.cli import main
from adalncache.families import checkpoint_embed as time_embed_fn
from adalncache.plans import plan_key, schedule_plans
from adalncache.tiers.store import Store

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(argv: list[str], world: int = 2) -> list[str]:
    """Run ``argv`` as ``world`` ranks the way torchrun starts its workers; each rank's stdout (all must succeed)."""
    port = _free_port()
    ranks = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "OMP_NUM_THREADS": "1",
        }
        ranks.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=180)
            outputs.append(out)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
    return outputs


@pytest.mark.slow
def test_build_under_a_launcher_shards_by_columns(tiny_saved_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    argv = [
        sys.executable,
        "-m",
        "adalncache",
        "build",
        str(tiny_saved_dir),
        "--store",
        str(store),
        "--task",
        "fl2va",
        "--steps",
        "3",
        "--shard",
        "columns",
        "--timeout",
        "60",
        "-q",
    ]
    outputs = _launch(argv)
    plans = schedule_plans(["fl2va"], [3])
    assert f"{len(plans)} built in 1 pass(es)" in outputs[0] and "2 ranks (--shard columns)" in outputs[0]
    assert outputs[1] == ""  # only rank 0 reports
    entries = list(Store(store).iter_entries())
    assert {getattr(entry, "key", None) for entry in entries} == {plan_key(p) for p in plans}
    # A one-process cache binds its tables apart from the column-sharded ones: it must not hit them.
    spec = ModulationSpec.from_checkpoint(tiny_saved_dir)
    source = CheckpointSource(tiny_saved_dir, spec)
    cache = AdalnCache(spec, source, max_plans=len(plans), store=store)
    report = cache.build(plans, embed=time_embed_fn(source, spec))
    assert (report.store_hits, report.built) == (0, len(plans))


@pytest.mark.slow
def test_export_under_a_launcher_equals_the_one_process_file(tiny_saved_root: Path, tmp_path: Path) -> None:
    """Two ranks share the passes of ``export`` (layer shards) and rank 0 writes: the same tables, the same binding."""

    checkpoint = tiny_saved_root / "bf16"
    shared = tmp_path / "ranks.safetensors"
    argv = [
        sys.executable,
        "-m",
        "adalncache",
        "export",
        str(checkpoint),
        "-o",
        str(shared),
        "--task",
        "t2va",
        "--steps",
        "4",
        "--timeout",
        "60",
        "-q",
    ]
    _launch(argv)
    alone = tmp_path / "alone.safetensors"
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran with one thread, which is part of the binding
    try:
        assert main(["export", str(checkpoint), "-o", str(alone), "--task", "t2va", "--steps", "4", "-q"]) == 0
    finally:
        torch.set_num_threads(previous)
    with safe_open(str(shared), framework="pt") as a, safe_open(str(alone), framework="pt") as b:
        for name in ("plan_timesteps", "plan_lengths", "block_params", "final_params"):
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
        mine, theirs = json.loads(a.metadata()["adalncache.binding"]), json.loads(b.metadata()["adalncache.binding"])
        assert mine == theirs and mine["content"].startswith("blake3:")


def test_vllm_omni_export_under_a_launcher_equals_the_one_process_file(tiny_saved_root: Path, tmp_path: Path) -> None:
    """Two ranks share the passes of a ``--format vllm-omni`` export (layer shards): rank 0 hashes the layers
    the other rank projected with one read, and writes the same file as one process (manifest and tensors)."""
    checkpoint = tiny_saved_root / "bf16"
    schedule = ["--format", "vllm-omni", "--mode", "fl2va", "--num-steps", "4", "-q"]
    shared = tmp_path / "ranks.safetensors"
    _launch(
        [sys.executable, "-m", "adalncache", "export", str(checkpoint), "-o", str(shared), "--timeout", "60", *schedule]
    )
    alone = tmp_path / "alone.safetensors"
    assert main(["export", str(checkpoint), "-o", str(alone), *schedule]) == 0
    with safe_open(str(shared), framework="pt") as a, safe_open(str(alone), framework="pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():  # noqa: SIM118 (safe_open has no iteration)
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


#: Runs ``adalncache.cli.main`` in a launched rank, then prints which of the process's threads are still alive.
_MAIN_THEN_THREADS = (
    "import json, os, sys\n"
    "from adalncache.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
    "print('THREADS ' + json.dumps({'code': code, 'threads': names}))\n"
)


@pytest.mark.parametrize("command", ["build", "export-adalncache", "export-vllm-omni"])
def test_no_gloo_thread_outlives_main_under_a_launcher(command: str, tiny_saved_root: Path, tmp_path: Path) -> None:
    """When ``main()`` returns in a rank, the process group and its gloo worker threads are gone.

    A group kept alive past ``destroy_process_group()`` (by a cache in a reference cycle) ends its
    worker threads only at interpreter exit, where one of them can abort the rank (SIGABRT,
    "terminate called without an active exception") about one run in fifty.
    """
    checkpoint = str(tiny_saved_root / "bf16")
    out = str(tmp_path / "out.safetensors")
    argv = {
        "build": ["build", checkpoint, "--store", str(tmp_path / "store"), "--task", "t2va", "--steps", "3"],
        "export-adalncache": ["export", checkpoint, "-o", out, "--task", "t2va", "--steps", "3"],
        "export-vllm-omni": [
            *("export", checkpoint, "-o", out),
            *("--format", "vllm-omni", "--mode", "t2va"),
            "--num-steps",
            "3",
        ],
    }[command]
    outputs = _launch([sys.executable, "-c", _MAIN_THEN_THREADS, *argv, "--timeout", "60", "-q"])
    for rank, output in enumerate(outputs):
        line = next(text for text in output.splitlines() if text.startswith("THREADS "))
        report = json.loads(line[len("THREADS ") :])
        assert report["code"] == 0, (rank, output)
        gloo = [name for name in report["threads"] if "gloo" in name]
        assert gloo == [], f"rank {rank} still runs {gloo} after main() returned (all threads: {report['threads']})"
