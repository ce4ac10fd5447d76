"""``adalncache build | inspect | verify | store prune`` on real tiny MiniMax-H3 checkpoints."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from adalncache.cli import main
from adalncache.plans import minimax_h3_plans, plan_key
from adalncache.tiers.store import MAGIC, Store
from adalncache.tools.tiny import make_request, run_loop
from tiers_support import write_h3_checkpoint
from tiny_helpers import write_native_checkpoint

pytest.importorskip("diffusers")


def _resident_rows(model: Any, plan: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the resident model's own projections output for ``plan`` (the ground truth)."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    with torch.no_grad():
        temb = model.time_proj(plan)
        temb = model.time_embedder(temb.to(get_parameter_dtype(model.time_embedder)))
        x = F.silu(temb)
        blocks = [b.adaln_proj.linear(x.to(b.adaln_proj.linear.weight.dtype)) for b in model.transformer_blocks]
        final = model.norm_out.linear(x.to(model.norm_out.linear.weight.dtype))
    return torch.stack(blocks, dim=1), final


def _stored(store: Path) -> dict[tuple[int, ...], Any]:
    out = {}
    for item in Store(store).iter_entries():
        assert not isinstance(item, tuple), item
        out[item.key] = item
    return out


@pytest.mark.parametrize("precision", ["bf16-disk", "fp32-disk"])
def test_build_then_verify_on_sharded_checkpoint(
    precision: str, load_tiny: Callable[[str], Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = load_tiny(precision)
    ckpt = write_h3_checkpoint(model, tmp_path / "ckpt", shards=3)
    assert len(list(ckpt.glob("*.safetensors"))) == 3
    store = tmp_path / "store"
    code = main(
        [
            "build",
            str(ckpt),
            "--store",
            str(store),
            "--task",
            "t2va",
            "--task",
            "ref2va",
            "--steps",
            "4",
            "--steps",
            "6",
            "--max-plans",
            "8",
            "--read-ahead",
            "0",
            "--host-cache-gb",
            "0.001",
            "-q",
        ]
    )
    assert code == 0
    plans = {plan_key(p): p for t in ("t2va", "ref2va") for s in (4, 6) for p in minimax_h3_plans(t, s)}
    out = capsys.readouterr().out
    passes = -(-len(plans) // 8)
    assert f"{len(plans)} distinct plan(s)" in out and f"in {passes} pass(es)" in out
    entries = _stored(store)
    assert set(entries) == set(plans)
    # The entries are exactly the resident model's projection outputs: the embed is MiniMax-H3's.
    for key, p in plans.items():
        block, final = _resident_rows(model, p)
        assert torch.equal(entries[key].rows.block, block), f"block rows differ for plan {p.tolist()}"
        assert torch.equal(entries[key].rows.final, final)

    assert (
        main(
            ["verify", "--store", str(store), "--checkpoint", str(ckpt), "--max-plans", "3", "--read-ahead", "2", "-q"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "OK" in out and f"{len(plans)} entries recomputed" in out
    assert main(["verify", "--store", str(store), "--checkpoint", str(ckpt), "--sample", "2", "-q"]) == 0
    assert "2 entries recomputed" in capsys.readouterr().out
    # Building again finds everything stored and runs no pass.
    assert main(["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "6", "-q"]) == 0
    assert "0 built in 0 pass(es)" in capsys.readouterr().out


def test_cli_built_store_serves_the_diffusers_integration(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    """A serving process finds what ``build`` wrote: no pass, and the denoising loop stays bit-exact."""
    from adalncache.diffusers import enable_adaln_cache

    model = load_tiny("bf16-disk")
    ckpt = write_h3_checkpoint(model, tmp_path / "ckpt")
    store = tmp_path / "store"
    assert main(["build", str(ckpt), "--store", str(store), "--task", "fl2va", "--steps", "4", "-q"]) == 0
    request = make_request(model, "fl2va", 4, seed=1)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, str(ckpt), store=str(store))
    report = handle.prepare(minimax_h3_plans("fl2va", 4))
    assert report.store_hits == report.plans > 0 and report.passes == 0
    cached = run_loop(model, request)
    assert cached.equal(resident)
    handle.disable()


def _tamper(path: Path) -> None:
    """Rewrite payload bytes and recompute the digest so the entry still reads as healthy."""
    data = bytearray(path.read_bytes())
    (head_len,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    payload = len(MAGIC) + 4 + head_len
    data[payload + 3] ^= 0x40
    body = bytes(data[:-32])
    path.write_bytes(body + hashlib.sha256(body).digest())


def test_verify_exits_1_on_a_tampered_entry(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    model = load_tiny("bf16-disk")
    ckpt = write_h3_checkpoint(model, tmp_path / "ckpt")
    store = tmp_path / "store"
    assert main(["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "4", "-q"]) == 0
    victim = Store(store).entries()[0]
    _tamper(victim.path)
    assert Store(store).health()["corrupt"] == []  # the digest matches: only recomputation can tell
    # The real entry point, in its own process: exit status 1 and the entry named.
    proc = subprocess.run(
        [sys.executable, "-m", "adalncache", "verify", "--store", str(store), "--checkpoint", str(ckpt), "-q"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr
    assert "MISMATCH" in proc.stdout and victim.path.name in proc.stdout and "FAILED" in proc.stdout


def test_verify_exits_1_on_a_corrupt_entry(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    model = load_tiny("bf16-disk")
    ckpt = write_h3_checkpoint(model, tmp_path / "ckpt")
    store = tmp_path / "store"
    assert main(["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "3", "-q"]) == 0
    victim = Store(store).entries()[0]
    data = bytearray(victim.path.read_bytes())
    data[-40] ^= 1
    victim.path.write_bytes(bytes(data))
    assert main(["verify", "--store", str(store), "--checkpoint", str(ckpt), "-q"]) == 1


def test_build_without_time_embedder_is_a_clear_error(
    load_tiny: Callable[[str], Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_native_checkpoint(load_tiny("bf16-disk"), tmp_path / "projections-only")
    code = main(["build", str(ckpt), "--store", str(tmp_path / "s"), "--task", "t2va", "--steps", "4", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "time-embedder" in err and "time_embedder.proj_in.weight" in err


def test_inspect_checkpoint_and_store(
    load_tiny: Callable[[str], Any], tiny_saved_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = load_tiny("bf16-disk")
    ckpt = write_h3_checkpoint(model, tmp_path / "ckpt")
    assert main(["inspect", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "native" and len(info["files"]) == 2 and info["time_embedder"] is True
    assert info["spec"]["num_layers"] == len(model.transformer_blocks) and info["spec"]["dtype"] == "bfloat16"
    assert info["projection_bytes"] == sum(
        t.numel() * t.element_size()
        for b in [*(blk.adaln_proj.linear for blk in model.transformer_blocks), model.norm_out.linear]
        for t in (b.weight, b.bias)
    )
    store = tmp_path / "store"
    assert main(["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "4", "-q"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(store), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "store" and info["entries"] == len(set(map(plan_key, minimax_h3_plans("t2va", 4))))
    (binding,) = info["bindings"].values()
    assert binding["precision"] == "match" and binding["entries"] == info["entries"]
    assert info["health"]["ok"] == info["entries"] and info["health"]["corrupt"] == []
    assert main(["inspect", str(store)]) == 0
    assert "healthy" in capsys.readouterr().out
    victim = Store(store).entries()[0].path
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated: health must say so
    assert main(["inspect", str(store), "--json"]) == 0
    health = json.loads(capsys.readouterr().out)["health"]
    assert len(health["corrupt"]) == 1 and victim.name in health["corrupt"][0]
    assert main(["inspect", str(store), "--quick"]) == 0
    assert "not checked" in capsys.readouterr().out
    # A diffusers-layout directory (save_pretrained) holds the time embedder under its diffusers names.
    assert main(["inspect", str(tiny_saved_root / "bf16"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "diffusers" and info["time_embedder"] is True


def test_store_prune_and_bad_flags(
    load_tiny: Callable[[str], Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = load_tiny("bf16-disk")
    ckpt = write_h3_checkpoint(model, tmp_path / "ckpt")
    store = tmp_path / "store"
    assert main(["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "4", "-q"]) == 0
    assert len(Store(store).entries()) > 0
    assert main(["store", "prune", "--store", str(store), "--max-gb", "1"]) == 0
    assert len(Store(store).entries()) > 0
    assert main(["store", "prune", "--store", str(store), "--max-gb", "0"]) == 0
    assert Store(store).entries() == []
    capsys.readouterr()
    for argv, flag in (
        (["store", "prune", "--store", str(store), "--max-gb", "-1"], "--max-gb"),
        (["store", "prune", "--store", str(tmp_path / "nope"), "--max-gb", "1"], "--store"),
        (["verify", "--store", str(tmp_path / "nope"), "--checkpoint", str(ckpt)], "--store"),
        (["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "1"], "--steps"),
        (
            ["build", str(ckpt), "--store", str(store), "--task", "ref2va", "--steps", "4", "--plan-width", "2"],
            "--plan-width",
        ),
        (["build", str(tmp_path / "missing"), "--store", str(store), "--task", "t2va", "--steps", "4"], "missing"),
        (["verify", "--store", str(store), "--checkpoint", str(ckpt), "--sample", "0"], "--sample"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err, (argv, err)


def test_build_from_a_diffusers_layout_directory(
    load_tiny: Callable[[str], Any], tiny_saved_root: Path, tmp_path: Path
) -> None:
    """``save_pretrained`` output (diffusers names, time_embedder.linear_1/2) is a build source too."""
    model = load_tiny("bf16-disk")
    source_dir = tiny_saved_root / "bf16"
    store = tmp_path / "store"
    assert (
        main(
            [
                "build",
                str(source_dir),
                "--store",
                str(store),
                "--task",
                "ref2va",
                "--steps",
                "3",
                "--no-audio-refs",
                "-q",
            ]
        )
        == 0
    )
    plans = {plan_key(p): p for p in minimax_h3_plans("ref2va", 3, audio_refs=False)}
    entries = _stored(store)
    assert set(entries) == set(plans)
    for key, p in plans.items():
        block, final = _resident_rows(model, p)
        assert torch.equal(entries[key].rows.block, block) and torch.equal(entries[key].rows.final, final)
    assert main(["verify", "--store", str(store), "--checkpoint", str(source_dir), "-q"]) == 0
