"""Table files: ``adalncache export`` in both formats, SGLang's load-time checks, serving with ``tables=``, verify.

Real tiny MiniMax-H3 checkpoints (with the time embedder) written to disk, the real command line,
real safetensors files read back with safetensors itself. The ground truth is the resident model's
own projections.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from adalncache import (
    AdalnCache,
    CheckpointSource,
    ConfigError,
    ModulationSpec,
    PlanError,
    PlanNotCachedError,
    plan_key,
)
from adalncache.cli import main
from adalncache.families import checkpoint_embed as time_embed_fn
from adalncache.formats import TableFile
from adalncache.offline import export_tables
from adalncache.plans import minimax_h3_plans, schedule_plans
from adalncache.spec import FINAL, LAYOUTS
from core_helpers import SPEC as CORE_SPEC
from core_helpers import embed_for, load_reference, make_weights, write_checkpoint
from tiers_support import run_on_private_tmpfs, write_h3_checkpoint

pytest.importorskip("diffusers")

TENSORS = ("plan_timesteps", "plan_lengths", "block_params", "final_params")


# ---------------------------------------------------------------------------------------------
# SGLang's loader, re-implemented as read in SGLang 0.5.23
# (sglang/multimodal_gen/runtime/models/dits/minimax_h3_adaln_cache.py, MiniMaxH3AdalnCache.load)


def sglang_load(path: Path, *, num_layers: int, hidden_size: int, model_variant: str | None) -> dict[str, Any]:
    """Every check SGLang 0.5.23 makes when it loads a sidecar; raises ValueError with its messages."""
    if not os.path.isfile(path):
        raise ValueError(f"MiniMax H3 AdaLN cache does not exist: {path}")
    with safe_open(str(path), framework="pt", device="cpu") as cache_file:
        metadata = cache_file.metadata() or {}
        if metadata.get("format_version") != "2":
            raise ValueError("MiniMax H3 AdaLN cache has an unsupported or missing format_version")
        cache_variant = metadata.get("model_variant")
        if model_variant is not None and cache_variant != model_variant:
            raise ValueError("MiniMax H3 AdaLN cache model_variant does not match the loaded variant")
        ts, lengths, block, final = (cache_file.get_tensor(name) for name in TENSORS)
    if (
        ts.dtype != torch.float32
        or ts.ndim != 2
        or lengths.dtype != torch.int64
        or lengths.shape != (ts.shape[0],)
        or bool((lengths < 1).any())
        or bool((lengths > ts.shape[1]).any())
    ):
        raise ValueError("MiniMax H3 AdaLN cache has invalid timestep plans")
    block_width = 6 * 3 * hidden_size
    if block.dtype != torch.bfloat16 or block.shape != (ts.shape[0], ts.shape[1], num_layers, block_width):
        raise ValueError("MiniMax H3 AdaLN cache has invalid block_params")
    if final.dtype != torch.bfloat16 or final.shape != (ts.shape[0], ts.shape[1], 2 * hidden_size):
        raise ValueError("MiniMax H3 AdaLN cache has invalid final_params")
    slots = {}
    for slot in range(ts.shape[0]):
        n = int(lengths[slot])
        slots[_sglang_key(ts[slot, :n])] = slot  # SGLang: fp32 bit patterns as unsigned ints
    return {"metadata": metadata, "timesteps": ts, "lengths": lengths, "block": block, "final": final, "slots": slots}


def _sglang_key(plan: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) & 0xFFFFFFFF for v in plan.contiguous().view(torch.int32).tolist())


def _resident_rows(model: Any, plan: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The resident model's own projection outputs for ``plan`` (the ground truth)."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    with torch.no_grad():
        temb = model.time_embedder(model.time_proj(plan).to(get_parameter_dtype(model.time_embedder)))
        x = F.silu(temb)
        blocks = [b.adaln_proj.linear(x.to(b.adaln_proj.linear.weight.dtype)) for b in model.transformer_blocks]
        final = model.norm_out.linear(x.to(model.norm_out.linear.weight.dtype))
    return torch.stack(blocks, dim=1), final


@pytest.fixture
def bf16(load_tiny: Callable[[str], Any], tmp_path: Path) -> tuple[Any, Path, ModulationSpec]:
    model = load_tiny("bf16-disk")
    return model, write_h3_checkpoint(model, tmp_path / "ckpt"), ModulationSpec.from_transformer(model)


def _export(ckpt: Path, out: Path, *extra: str) -> int:
    return main(["export", str(ckpt), "-o", str(out), "-q", *extra])


# ---------------------------------------------------------------------------------------------
# export


def test_sglang_export_passes_sglangs_checks_and_holds_the_resident_bits(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, ckpt, spec = bf16
    out = tmp_path / "h3-fl2va.safetensors"
    assert (
        _export(
            ckpt,
            out,
            "--format",
            "sglang",
            "--model-variant",
            "fl2va",
            "--task",
            "t2va",
            "--task",
            "fl2va",
            "--steps",
            "4",
            "--steps",
            "5",
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "--steps 4 -> --num-inference-steps 3" in printed and "--steps 5 -> --num-inference-steps 4" in printed
    loaded = sglang_load(out, num_layers=spec.num_layers, hidden_size=spec.hidden_size, model_variant="fl2va")
    assert loaded["metadata"] == {"format_version": "2", "model_variant": "fl2va"}  # exactly SGLang's keys
    with safe_open(str(out), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(TENSORS)
    plans = schedule_plans(["t2va", "fl2va"], [4, 5])
    assert len(loaded["slots"]) == len(plans) == loaded["timesteps"].shape[0]  # unique plans, one slot each
    assert loaded["timesteps"].shape[1] == max(p.numel() for p in plans)  # W = the widest plan
    for p in plans:
        slot, n = loaded["slots"][_sglang_key(p)], p.numel()
        block, final = _resident_rows(model, p)
        assert torch.equal(loaded["block"][slot, :n], block) and torch.equal(loaded["final"][slot, :n], final)
        # Rows past a plan's length (never read by SGLang) are zeros: the bytes are deterministic.
        assert not loaded["block"][slot, n:].any() and not loaded["timesteps"][slot, n:].any()
    # The re-implemented checks are real: each breakage SGLang refuses is refused.
    tensors = {name: loaded[key] for name, key in zip(TENSORS, ("timesteps", "lengths", "block", "final"))}
    broken = tmp_path / "broken.safetensors"
    for meta, change, says in (
        ({"format_version": "1", "model_variant": "fl2va"}, {}, "format_version"),
        ({"format_version": "2", "model_variant": "ref2va"}, {}, "model_variant"),
        (
            {"format_version": "2", "model_variant": "fl2va"},
            {"block_params": tensors["block_params"].float()},
            "block_params",
        ),
        (
            {"format_version": "2", "model_variant": "fl2va"},
            {"plan_lengths": tensors["plan_lengths"] * 0},
            "timestep plans",
        ),
    ):
        save_file({**tensors, **change}, str(broken), metadata=meta)
        with pytest.raises(ValueError, match=says):
            sglang_load(broken, num_layers=spec.num_layers, hidden_size=spec.hidden_size, model_variant="fl2va")
    with pytest.raises(ValueError, match="block_params"):
        sglang_load(out, num_layers=spec.num_layers, hidden_size=spec.hidden_size + 2, model_variant="fl2va")


def test_bound_export_round_trips_and_serves_with_no_weights(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, ckpt, spec = bf16
    out = tmp_path / "h3.safetensors"
    assert _export(ckpt, out, "--task", "ref2va", "--steps", "4", "--model-variant", "ref2va") == 0
    plans = minimax_h3_plans("ref2va", 4)
    table = TableFile(out, spec)
    assert table.format == "adalncache" and table.model_variant == "ref2va" and table.binding is not None
    assert table.binding["spec"] == spec.describe() and table.binding["precision"] == "match"
    source = CheckpointSource(ckpt, spec)
    assert table.content == AdalnCache(spec, source, max_plans=1).identify()
    # A bound bf16 file with a model_variant is an SGLang file as well.
    sglang_load(out, num_layers=spec.num_layers, hidden_size=spec.hidden_size, model_variant="ref2va")
    # Served with no weights at all: every plan from the file, bit for bit the resident model's. No
    # pass can run there, so build() needs no embed=.
    cache = AdalnCache(spec, None, max_plans=8, max_plan_width=4, tables=out)
    report = cache.build(plans)
    distinct = len({plan_key(p) for p in plans})
    assert (report.table_hits, report.passes, report.bytes_read) == (distinct, 0, 0)
    for p in plans:
        block, final = _resident_rows(model, p)
        slot = cache.lookup(p)
        assert torch.equal(cache.block_rows(0, slot, p.numel()), block[:, 0])
        assert torch.equal(cache.rows_of(plan_key(p)).block, block) and torch.equal(
            cache.final_rows(slot, p.numel()), final
        )
    # A plan the file lacks: PlanNotCachedError naming the plan and the file searched; nothing changes.
    other = minimax_h3_plans("t2va", 6)[1]
    resident = cache.resident_plans
    with pytest.raises(PlanNotCachedError, match="not in the table files") as info:
        cache.build([other])
    assert str(out) in str(info.value) and "checkpoint=" in str(info.value) and "adalncache export" in str(info.value)
    assert cache.resident_plans == resident
    cache.check_invariants()
    # With a weight source a pass may run: embed= stays required, refused before anything changes.
    with pytest.raises(PlanError, match="needs embed="):
        AdalnCache(spec, source, max_plans=8, max_plan_width=4, tables=out).build([other])
    # inspect shows the format, the plans and the binding, and checks every slot digest.
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "adalncache format" in shown and f"{table.plans} plans" in shown and "every digest verified" in shown


def test_tables_tier_sits_below_the_store_and_a_checkpoint_builds_what_it_lacks(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path
) -> None:
    model, ckpt, spec = bf16
    out = tmp_path / "t2va.safetensors"
    assert _export(ckpt, out, "--task", "t2va", "--steps", "4") == 0
    source = CheckpointSource(ckpt, spec)
    embed = time_embed_fn(source, spec)
    store = tmp_path / "store"
    cache = AdalnCache(spec, source, max_plans=8, max_plan_width=4, tables=[out], store=store)
    inside = minimax_h3_plans("t2va", 4)
    outside = minimax_h3_plans("fl2va", 4)[0]
    report = cache.build([*inside, outside], embed=embed)
    assert report.table_hits == len({plan_key(p) for p in inside}) and report.built == 1 and report.passes == 1
    assert len(cache.store.entries()) == 1  # only the plan built was written to the store; table hits were not
    block, final = _resident_rows(model, outside)
    assert torch.equal(cache.rows_of(plan_key(outside)).block, block)
    assert torch.equal(cache.rows_of(plan_key(outside)).final, final)
    # A LoRA-like variant: tables hold the base projection only, so they are not consulted.
    cache.invalidate()
    report = cache.build(inside, embed=embed, variant=("some adapter",))
    assert report.table_hits == 0 and report.built == len({plan_key(p) for p in inside})


def test_mismatched_table_files_are_refused(
    bf16: tuple[Any, Path, ModulationSpec], load_tiny: Callable[[str], Any], tmp_path: Path
) -> None:
    _, ckpt, spec = bf16
    out = tmp_path / "t.safetensors"
    assert _export(ckpt, out, "--task", "t2va", "--steps", "3") == 0
    source = CheckpointSource(ckpt, spec)
    # Another geometry.
    wider = ModulationSpec(spec.num_layers, spec.hidden_size * 2, spec.time_embed_dim, dtype=spec.dtype)
    with pytest.raises(ConfigError, match=r"block_params .* this model needs"):
        AdalnCache(wider, None, tables=out)
    # Another dtype (an fp32 model).
    with pytest.raises(ConfigError, match="float32"):
        AdalnCache(spec.with_dtype(torch.float32), None, tables=out)
    # Other weights with the same geometry: the content digest differs.
    other_model = load_tiny("bf16-disk")
    with torch.no_grad():
        other_model.norm_out.linear.bias.add_(1)
    other = write_h3_checkpoint(other_model, tmp_path / "other")
    with pytest.raises(ConfigError, match="other projection weights"):
        AdalnCache(spec, CheckpointSource(other, spec), tables=out)
    # Another precision, another numeric environment (the CPU thread count decides bits here).
    with pytest.raises(ConfigError, match="precision"):
        AdalnCache(spec, source, precision="fp32", tables=out)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with pytest.raises(ConfigError, match="environment"):
            AdalnCache(spec, source, tables=out)
    finally:
        torch.set_num_threads(threads)
    # Missing, not safetensors, truncated.
    for bad, says in (
        (tmp_path / "absent.safetensors", "does not exist"),
        (tmp_path / "garbage.safetensors", "not a readable safetensors"),
        (tmp_path / "short.safetensors", "not a readable safetensors"),
    ):
        if "garbage" in bad.name:
            bad.write_bytes(b"not a table file at all")
        if "short" in bad.name:
            bad.write_bytes(out.read_bytes()[:-10])
        with pytest.raises(ConfigError, match=says):
            AdalnCache(spec, None, tables=bad)
    with pytest.raises(ConfigError, match="tables="):
        AdalnCache(spec, None)
    AdalnCache(spec, source, tables=out)  # the control: this model's own file opens


def test_a_corrupt_slot_is_a_miss_never_wrong_rows(bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path) -> None:
    model, ckpt, spec = bf16
    out = tmp_path / "t.safetensors"
    assert _export(ckpt, out, "--task", "t2va", "--steps", "3") == 0
    table = TableFile(out, spec)
    victim = table.keys[0]
    entry = table._entries["block_params"]
    data = bytearray(out.read_bytes())
    data[entry.begin + 5] ^= 0x10  # a byte of slot 0's first row
    out.write_bytes(bytes(data))
    source = CheckpointSource(ckpt, spec)
    cache = AdalnCache(spec, source, max_plans=8, max_plan_width=4, tables=out)
    plans = minimax_h3_plans("t2va", 3)
    report = cache.build(plans, embed=time_embed_fn(source, spec))
    assert report.built == 1 and report.table_hits == len({plan_key(p) for p in plans}) - 1
    assert cache.stats.tables_corrupt == 1
    p = next(p for p in plans if plan_key(p) == victim)
    block, _ = _resident_rows(model, p)
    assert torch.equal(cache.rows_of(victim).block, block)  # rebuilt from the checkpoint, exact
    assert main(["inspect", str(out)]) == 0  # inspect names the bad slot
    assert main(["verify", "--tables", str(out), "--checkpoint", str(ckpt), "-q"]) == 1


def test_verify_tables_and_bad_export_inputs(
    bf16: tuple[Any, Path, ModulationSpec],
    load_tiny: Callable[[str], Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, ckpt, spec = bf16
    bound, sglang = tmp_path / "bound.safetensors", tmp_path / "sglang.safetensors"
    assert _export(ckpt, bound, "--task", "fl2va", "--steps", "3") == 0
    assert (
        _export(ckpt, sglang, "--task", "fl2va", "--steps", "3", "--format", "sglang", "--model-variant", "fl2va") == 0
    )
    capsys.readouterr()
    assert main(["verify", "--tables", str(bound), "--checkpoint", str(ckpt), "-q"]) == 0
    assert "content matches" in capsys.readouterr().out
    assert main(["verify", "--tables", str(sglang), "--checkpoint", str(ckpt), "-q", "--sample", "2"]) == 0
    assert "2 plan(s)" in capsys.readouterr().out
    # An sglang file whose bytes were changed (it has no digests): only recomputation tells.
    table = TableFile(sglang, spec)
    data = bytearray(sglang.read_bytes())
    data[table._entries["final_params"].begin + 1] ^= 0x08
    sglang.write_bytes(bytes(data))
    proc = subprocess.run(
        [sys.executable, "-m", "adalncache", "verify", "--tables", str(sglang), "--checkpoint", str(ckpt), "-q"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 1 and "MISMATCH" in proc.stdout, proc.stderr
    # Bad inputs: one line naming the flag, exit 2, nothing written.
    fp32_ckpt = write_h3_checkpoint(load_tiny("fp32-disk"), tmp_path / "fp32")
    target = tmp_path / "never.safetensors"
    for argv, flag in (
        ([str(fp32_ckpt), "--format", "sglang", "--model-variant", "fl2va"], "--format"),
        ([str(ckpt), "--format", "sglang"], "--model-variant"),
        ([str(ckpt), "--format", "sglang", "--model-variant", "fl2va", "--precision", "fp32"], "--precision"),
        ([str(ckpt), "--model-variant", "ref2va"], "--model-variant"),
        (
            [
                str(ckpt),
                "--format",
                "sglang",
                "--model-variant",
                "fl2va",
                "--store",
                str(tmp_path / "st"),
                "-o",
                str(tmp_path / "no-such-dir" / "x.safetensors"),
            ],
            "-o/--output",
        ),
        ([str(ckpt), "--format", "onnx"], "--format"),
    ):
        full = ["export", *argv, "--task", "fl2va", "--steps", "3", "-q"]
        if "-o" not in argv:
            full += ["-o", str(target)]
        try:
            code = main(full)
        except SystemExit as exc:  # argparse's own errors exit
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and flag in err, (argv, err)
    assert not target.exists() and not (tmp_path / "st").exists()
    assert not list(tmp_path.glob(".never*")) and not list(tmp_path.glob(".*.tmp-*"))
    assert main(["verify", "--tables", str(tmp_path / "absent"), "--checkpoint", str(ckpt)]) == 2
    assert "--tables" in capsys.readouterr().err


def test_a_failed_export_leaves_nothing(bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path) -> None:
    _, ckpt, spec = bf16
    source = CheckpointSource(ckpt, spec)
    embed = time_embed_fn(source, spec)
    calls = {"n": 0}

    def failing(plan: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("disk full, say")
        return embed(plan)

    plans = schedule_plans(["t2va"], [5])
    out = tmp_path / "t.safetensors"
    out.write_bytes(b"the previous file")
    cache = AdalnCache(spec, source, max_plans=2, max_plan_width=2)
    with pytest.raises(Exception, match="disk full"):
        export_tables(cache, plans, out, embed=failing, progress=False)
    assert out.read_bytes() == b"the previous file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "t.safetensors"]  # no temporary file left
    report = export_tables(cache, plans, out, embed=embed, progress=False)  # a retry writes it whole
    assert report.plans == len(plans) and TableFile(out, spec).keys == [plan_key(p) for p in plans]
    assert json.loads(TableFile(out, spec).metadata["adalncache.schedules"]) == []


def test_table_files_follow_a_move_only_where_they_fit(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Table files are bound to a numeric environment: a cache that moves to a device of another
    identity serves them there only if the binding fits (here it does not: it builds), and serves
    them again once it is back."""
    import adalncache.cache as cache_module  # where a move compares device identities
    import adalncache.identity.binding as identity_module

    # ``cpu`` and ``cpu:0`` as two device identities with two numeric environments (a CPU and a GPU).
    real_identity, real_environment = cache_module.device_identity, identity_module.numeric_environment
    monkeypatch.setattr(cache_module, "device_identity", lambda device: (*real_identity(device), device.index))
    monkeypatch.setattr(
        identity_module, "numeric_environment", lambda device: {**real_environment(device), "index": device.index}
    )
    model, ckpt, spec = bf16
    out = tmp_path / "h3.safetensors"
    assert _export(ckpt, out, "--task", "t2va", "--steps", "4") == 0  # bound to ``cpu``
    plans = minimax_h3_plans("t2va", 4)
    distinct = len({plan_key(p) for p in plans})
    source = CheckpointSource(ckpt, spec)
    embed = time_embed_fn(source, spec)
    cache = AdalnCache(spec, source, max_plans=8, tables=out)
    report = cache.build(plans, embed=embed)
    assert (report.table_hits, report.passes) == (distinct, 0)
    cache.move_to("cpu:0")
    assert cache.tables is None and len(cache) == 0
    report = cache.build(plans, embed=embed)
    assert (report.table_hits, report.passes) == (0, 1)  # built there: the files do not fit
    cache.move_to("cpu")
    assert cache.tables is not None and len(cache) == distinct  # parked tables came back
    cache.invalidate()
    report = cache.build(plans, embed=embed)
    assert (report.table_hits, report.passes) == (distinct, 0)
    for p in plans:
        block, final = _resident_rows(model, p)
        rows = cache.rows_of(plan_key(p))
        assert torch.equal(rows.block, block) and torch.equal(rows.final, final)
    cache.check_invariants()


# ---------------------------------------------------------------------------------------------
# rows served are the projection of the weights the source reads now


def test_a_table_file_is_checked_again_when_the_checkpoint_changes(
    bf16: tuple[Any, Path, ModulationSpec], load_tiny: Callable[[str], Any], tmp_path: Path
) -> None:
    """The checkpoint is replaced (atomic renames, as a downloader does) by other weights: the bound
    file exported from the old ones is checked again, found to name other content, and never served
    again; every plan is built from the new bytes."""
    _, ckpt, spec = bf16
    out = tmp_path / "t2va.safetensors"
    assert _export(ckpt, out, "--task", "t2va", "--steps", "4") == 0
    source = CheckpointSource(ckpt, spec)
    embed = time_embed_fn(source, spec)
    plans = minimax_h3_plans("t2va", 4)
    distinct = len({plan_key(p) for p in plans})
    cache = AdalnCache(spec, source, max_plans=8, max_plan_width=4, tables=out)
    assert cache.build(plans[:1], embed=embed).table_hits == 1
    fine_tuned = load_tiny("bf16-disk")
    with torch.no_grad():
        for block in fine_tuned.transformer_blocks:
            block.adaln_proj.linear.bias.add_(1)
        fine_tuned.norm_out.linear.bias.add_(1)
    other = write_h3_checkpoint(fine_tuned, tmp_path / "other")
    for path in sorted(other.iterdir()):
        os.replace(path, ckpt / path.name)
    report = cache.build(plans, embed=embed)
    assert (report.table_hits, report.built) == (0, distinct) and cache.stats.fingerprint_changes == 1
    for p in plans:
        block, final = _resident_rows(fine_tuned, p)
        rows = cache.rows_of(plan_key(p))
        assert torch.equal(rows.block, block) and torch.equal(rows.final, final)
    cache.invalidate()
    report = cache.build(plans, embed=embed)  # the file names other weights: not consulted again
    assert report.table_hits == 0 and report.passes == 1


def test_the_table_tier_honours_autocast(tmp_path: Path) -> None:
    """fp32 tables in a bound file are never served under ``torch.autocast`` to bf16 (the resident
    projection then computes and returns bf16): they are built under autocast instead, and the file
    serves again once autocast is off."""
    spec = CORE_SPEC.with_dtype(torch.float32)
    path = write_checkpoint(tmp_path / "fp32", make_weights(spec, seed=2))
    weights = load_reference(path)
    embed = embed_for(spec)
    plan = torch.tensor([0.25, 0.75])
    out = tmp_path / "fp32.safetensors"
    export_tables(AdalnCache(spec, CheckpointSource(path, spec), max_plans=1), [plan], out, embed=embed, progress=False)
    cache = AdalnCache(spec, CheckpointSource(path, spec), max_plans=2, tables=out, progress=False)
    lay = LAYOUTS["native"]
    layer0 = (weights[lay.weight(0)], weights[lay.bias(0)])
    final = (weights[lay.weight(FINAL)], weights[lay.bias(FINAL)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_final = F.linear(embed(plan), *layer0), F.linear(embed(plan), *final)
        report = cache.build([plan], embed=embed)
        assert (report.table_hits, report.built) == (0, 1)
        got = cache.block_rows(0, cache.lookup(plan), 2)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        assert torch.equal(cache.final_rows(cache.lookup(plan), 2), want_final)
    report = cache.build([plan], embed=embed)
    assert report.table_hits == 1  # outside autocast: the file's fp32 tables
    assert torch.equal(cache.block_rows(0, cache.lookup(plan), 2), F.linear(embed(plan), *layer0))


def test_export_never_writes_over_what_it_reads(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-o`` naming a checkpoint file (or its index, or a link to one), a directory, or anything but a
    regular file or a new name: refused before any pass, one line, exit 2; nothing changes."""
    _, ckpt, _ = bf16
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    index = ckpt / "model.safetensors.index.json"
    before = {p: p.read_bytes() for p in (shard, index)}
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    link = tmp_path / "link.safetensors"
    link.symlink_to(shard)
    for target in (shard, index, link, fifo, ckpt):
        code = main(["export", str(ckpt), "--task", "t2va", "--steps", "3", "-q", "-o", str(target)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "-o/--output" in err, (target, err)
    assert all(p.read_bytes() == data for p, data in before.items())
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and os.readlink(link) == str(shard)
    assert not list(tmp_path.rglob(".*tmp*")) and not list(ckpt.glob(".*"))


_FULL_DISK_EXPORT = """
done = subprocess.run(
    [sys.executable, "-m", "adalncache", "export", {ckpt!r}, "--task", "t2va", "--steps", "4", "-q",
     "-o", str(MOUNT / "h3.safetensors")],
    capture_output=True, text=True, timeout=240,
)
print(json.dumps({{"code": done.returncode, "err": done.stderr, "left": sorted(os.listdir(MOUNT))}}))
"""


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path
) -> None:
    """A table file that does not fit on its disk: a typed error naming -o, exit 2, one line, and no
    partial or temporary file left behind (a real tmpfs that is too small: the kernel's ENOSPC)."""
    _, ckpt, _ = bf16
    done = run_on_private_tmpfs(_FULL_DISK_EXPORT.format(ckpt=str(ckpt)), tmp_path / "small", size="16k")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # (A fresh interpreter may print import-time warnings of third-party packages first: not ours.)
    ours = [line for line in out["err"].splitlines() if line.startswith("adalncache")]
    assert out["code"] == 2 and "Traceback" not in out["err"] and len(ours) == 1, out["err"]
    assert "-o/--output" in ours[0] and "space" in ours[0] and out["left"] == [], out


# ---------------------------------------------------------------------------------------------
# every schedule flag a format does not take is refused

#: Every schedule flag of ``export``, with a value (a flag's own default among them: given is given).
SCHEDULE_FLAGS: dict[str, list[str]] = {
    "--task": ["t2va"],
    "--steps": ["3"],
    "--video-shift": ["12"],
    "--audio-shift": ["3"],
    "--no-audio-refs": [],
    "--height": ["8"],
    "--width": ["8"],
    "--timesteps": ["0.5"],
    "--batch": ["1"],
    "--scheduler-config": ["scheduler_config.json"],
    "--guidance": ["3.5"],
    "--timestep-r": ["0.25"],
    "--additional-t-cond": ["1"],
    "--mode": ["t2va"],
    "--num-steps": ["4"],
    "--base-schedule": ["1,0.5,0"],
    "--flow-shift": ["12"],
    "--audio-flow-shift": ["3"],
}
MINIMAX = {"--task", "--steps", "--video-shift", "--audio-shift", "--no-audio-refs"}
SIDECAR = {"--mode", "--num-steps", "--base-schedule", "--flow-shift", "--audio-flow-shift"}
#: What each format takes, and a schedule it exports from a tiny MiniMax-H3 checkpoint.
FORMAT_SCHEDULES = {
    "sglang": (MINIMAX, ["--task", "t2va", "--steps", "3", "--model-variant", "fl2va"]),
    "adalncache": (set(SCHEDULE_FLAGS) - SIDECAR, ["--task", "t2va", "--steps", "3"]),
    "vllm-omni": (SIDECAR, ["--mode", "t2va", "--num-steps", "4"]),
}
REFUSED = [(fmt, flag) for fmt, (takes, _) in FORMAT_SCHEDULES.items() for flag in SCHEDULE_FLAGS if flag not in takes]


@pytest.mark.parametrize(("fmt", "flag"), REFUSED, ids=[f"{fmt} {flag}" for fmt, flag in REFUSED])
def test_export_refuses_every_flag_its_format_does_not_take(
    fmt: str, flag: str, tiny_saved_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag the chosen format does not take (``--format vllm-omni --video-shift 12``, ``--format sglang
    --timesteps 0.5``, ``--format adalncache --mode t2va``) is one line naming it and the format, exit 2,
    before anything is read: no table file, no temporary file, no store directory."""
    _, schedule = FORMAT_SCHEDULES[fmt]
    out, store = tmp_path / "t.safetensors", tmp_path / "store"
    argv = ["export", str(tiny_saved_root / "bf16"), "-o", str(out), "--format", fmt, *schedule, "-q"]
    code = main([*argv, "--store", str(store), flag, *SCHEDULE_FLAGS[flag]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--format {fmt} does not take {flag} " in err and f"drop {flag}" in err, err
    assert list(tmp_path.iterdir()) == [], "a refused export created something"


def test_each_format_takes_its_own_schedule_flags(tiny_saved_root: Path, tmp_path: Path) -> None:
    """The control: the schedule flags a format takes pass the check (here: every one of a format at once)."""
    checkpoint = str(tiny_saved_root / "bf16")
    for fmt, flags in (
        ("sglang", ["--task", "t2va", "--steps", "3", "--video-shift", "12", "--audio-shift", "3"]),
        ("vllm-omni", ["--mode", "t2va", "--num-steps", "3", "--flow-shift", "12", "--audio-flow-shift", "3"]),
    ):
        out = tmp_path / f"{fmt}.safetensors"
        variant = ["--model-variant", "fl2va"] if fmt == "sglang" else []
        assert main(["export", checkpoint, "-o", str(out), "--format", fmt, *variant, *flags, "-q"]) == 0
        assert TableFile(out).format == fmt
