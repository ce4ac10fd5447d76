"""vLLM-Omni's format-4 sidecar: ``adalncache export --format vllm-omni``, and reading such files back.

Real tiny MiniMax-H3 checkpoints (bf16 projections, fp32 time embedder, as released) written to disk,
the real command line, real safetensors files. The plans are checked against vLLM-Omni's own
``timestep_plans`` twice: against a recorded fixture (always) and against the installed package
(where it is installed); the exported file is loaded by vLLM-Omni's own loader where it is installed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adalncache import AdalnCache, CheckpointSource, ConfigError, ModulationSpec, PlanError, plan_key
from adalncache.cli import main
from adalncache.families import checkpoint_embed as time_embed_fn
from adalncache.formats import TableFile
from adalncache.formats import vllm_omni as vo
from adalncache.offline import export_tables, verify_tables
from tiers_support import write_h3_checkpoint
from vllm_omni_support import FIXTURE, SCHEDULES, load, their_plans

pytest.importorskip("diffusers")

T2VA6 = ["--format", "vllm-omni", "--mode", "t2va", "--num-steps", "6"]


@pytest.fixture
def bf16(load_tiny: Callable[[str], Any], tmp_path: Path) -> tuple[Any, Path, ModulationSpec]:
    model = load_tiny("bf16-disk")
    return model, write_h3_checkpoint(model, tmp_path / "ckpt"), ModulationSpec.from_transformer(model)


def _export(ckpt: Path, out: Path, *extra: str) -> int:
    return main(["export", str(ckpt), "-o", str(out), "-q", *extra])


def _checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _sha256(tensor: torch.Tensor) -> str:
    """The digest as vLLM-Omni's ``tensor_digest`` defines it, written out independently."""
    t = tensor.contiguous()
    h = hashlib.sha256(json.dumps([str(t.dtype), list(t.shape)], separators=(",", ":")).encode())
    h.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def _rewrite(
    src: Path,
    dst: Path,
    *,
    manifest: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of a sidecar with its manifest or tensors changed (digests left as they were)."""
    with safe_open(str(src), framework="pt") as handle:
        meta = dict(handle.metadata())
        found = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open has no iter)
    doc = json.loads(meta["manifest"])
    if manifest is not None:
        manifest(doc)
    if tensors is not None:
        tensors(found)
    save_file(found, str(dst), metadata={**meta, "manifest": vo.canonical_json(doc)})
    return dst


# ---------------------------------------------------------------------------------------------
# plans: vLLM-Omni's own, recorded and live


def test_plans_equal_the_recorded_vllm_omni_plans() -> None:
    records = json.loads(FIXTURE.read_text())
    assert records["vllm_omni"] == "0.30.0" and len(records["records"]) == len(SCHEDULES)
    for record in records["records"]:
        ours = vo.timestep_plans(vo.schedule_contract(**record["schedule"]))
        theirs = [torch.tensor(plan, dtype=torch.float32) for plan in record["plans"]]
        assert len(ours) == len(theirs), record["schedule"]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), record["schedule"]
    # Schedules of other row kinds, steps or shifts give other plans (fl2va and ref2va-image share their row
    # kinds): the fixture exercises each, so the check above cannot pass by comparing one list to itself.
    kinds = {json.dumps({**r["schedule"], "mode": vo.MODES[r["schedule"]["mode"]]}) for r in records["records"]}
    assert len({json.dumps(r["plans"]) for r in records["records"]}) == len(kinds) == 20


def test_plans_and_contract_equal_the_installed_vllm_omni() -> None:
    module = load()
    if module is None:
        pytest.skip("vllm-omni is not installed")
    extra = [
        {"mode": m, "num_steps": n, "base_schedule": None, "flow_shift": f, "audio_flow_shift": a}
        for m in vo.MODES
        for n, f, a in ((3, 2.5, 9.0), (51, 12.0, 3.0), (13, 0.5, 0.75))
    ]
    for schedule in [*SCHEDULES, *extra]:
        assert vo.schedule_contract(**schedule) == module.schedule_contract(**schedule)
        ours = [p.tolist() for p in vo.timestep_plans(vo.schedule_contract(**schedule))]
        assert ours == their_plans(module, schedule), schedule
    assert vo.math_of_device("cpu") == module.math_identity(torch.device("cpu"))
    for t in (torch.zeros(0), torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(3, dtype=torch.bfloat16)):
        assert vo.tensor_sha256(t) == module.tensor_digest(t) == _sha256(t)


def test_schedule_defaults_and_refusals() -> None:
    contract = vo.schedule_contract("ref2va-audio")
    assert contract == {
        "mode": "ref2va-audio",
        "num_steps": 50,
        "base_schedule": None,
        "flow_shift": 12.0,
        "audio_flow_shift": 3.0,
    }
    assert vo.schedule_contract("fl2va", base_schedule=[1.0, 0.5, 0.0])["num_steps"] == 2
    for kwargs, says in (
        ({"mode": "i2v"}, "--mode"),
        ({"mode": ["t2va"]}, "--mode"),
        ({"mode": "t2va", "num_steps": 1}, "--num-steps"),
        ({"mode": "t2va", "flow_shift": 0.0}, "--flow-shift"),
        ({"mode": "t2va", "audio_flow_shift": float("nan")}, "--audio-flow-shift"),
        ({"mode": "t2va", "base_schedule": [1.0, 0.5]}, "--base-schedule"),
        ({"mode": "t2va", "base_schedule": [1.0, 0.5, 0.0], "num_steps": 3}, "--num-steps"),
    ):
        with pytest.raises(PlanError, match=says):
            vo.schedule_contract(**kwargs)


# ---------------------------------------------------------------------------------------------
# export, and reading the file back


def test_export_writes_the_sidecar_and_tables_serves_it_exactly(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, ckpt, spec = bf16
    out = tmp_path / "h3.safetensors"
    assert _export(ckpt, out, *T2VA6) == 0
    assert "enforce_eager" in capsys.readouterr().out
    contract = vo.schedule_contract("t2va", 6)
    plans = vo.timestep_plans(contract)
    with safe_open(str(out), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    assert set(meta) == {"format_version", "manifest"} and meta["format_version"] == "4"
    assert meta["manifest"] == vo.canonical_json(json.loads(meta["manifest"]))  # canonical JSON
    found = json.loads(meta["manifest"])
    assert set(found) == set(vo.MANIFEST_KEYS) and set(tensors) == set(vo.PAYLOAD)
    assert found["schedule"] == contract and found["model_variant"] == "fl2va" and found["adapter_sha256"] is None
    assert found["architecture"] == {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "timestep_input_dim": 32,
        "time_embed_hidden_size": 64,
        "time_embed_dim": spec.time_embed_dim,
    }
    assert found["math"] == {
        "torch": torch.__version__,
        "device_type": "cpu",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    # Digests: every weight by its native name over the checkpoint's bytes, every payload tensor.
    stored = _checkpoint_tensors(ckpt)
    assert found["weights"] == {name: _sha256(stored[name]) for name in vo.weight_names(spec)}
    assert found["payload"] == {name: _sha256(tensors[name]) for name in vo.PAYLOAD}
    # The time embeddings are vLLM-Omni's fp32 temb: the resident model's time embedder computes the same
    # bits once its weights sit in fresh storage as vLLM-Omni's parameters do (a one-row fp32 GEMV on a CPU
    # can change with the weights' address, and this model's weights are views into its file); the rows
    # are the resident projections of that temb.
    aligned = copy.deepcopy(model.time_embedder)
    for parameter in aligned.parameters():
        parameter.data = parameter.data.clone()
    timesteps, lengths = vo.padded_plans(plans)
    assert torch.equal(tensors["plan_timesteps"], timesteps) and torch.equal(tensors["plan_lengths"], lengths)
    for slot, plan in enumerate(plans):
        n = len(plan)
        with torch.no_grad():
            temb = aligned(model.time_proj(plan))
            x = torch.nn.functional.silu(temb).to(torch.bfloat16)
            blocks = torch.stack([b.adaln_proj.linear(x) for b in model.transformer_blocks], dim=1)
            final = model.norm_out.linear(x)
            if n > 1:  # several rows: the address does not matter, the model as loaded gives these bits too
                assert torch.equal(model.time_embedder(model.time_proj(plan)), temb)
        assert temb.dtype == torch.float32 and torch.equal(tensors["time_embeddings"][slot, :n], temb)
        assert torch.equal(tensors["block_params"][slot, :n], blocks)
        assert torch.equal(tensors["final_params"][slot, :n], final)
        assert not tensors["time_embeddings"][slot, n:].any() and not tensors["block_params"][slot, n:].any()
    # tables= with no weights at all serves every plan, exactly the rows a build from vLLM-Omni's input gives.
    source = CheckpointSource(ckpt, spec)
    embedding = vo.TimeEmbedding(source, spec)
    theirs = AdalnCache(spec, source, max_plans=len(plans), max_plan_width=2)
    theirs.build(plans, embed=embedding.embed)
    alone = AdalnCache(spec, None, max_plans=len(plans), max_plan_width=2, tables=out)
    report = alone.build(plans)
    assert report.table_hits == len(plans) and alone.stats.passes == 0
    for plan in plans:
        a, b = alone.rows_of(plan_key(plan)), theirs.rows_of(plan_key(plan))
        assert all(torch.equal(x, y) for x, y in zip(a.parts, b.parts))
    # Beside the checkpoint, a build with this model's own input serves a plan from the file only where that
    # input is the file's, and builds the others: every row equals a fresh build's, never the file's other bits.
    embed = time_embed_fn(source, spec)
    fresh = AdalnCache(spec, source, max_plans=len(plans), max_plan_width=2)
    fresh.build(plans, embed=embed)
    same = [p for p in plans if torch.equal(embed(p), embedding.embed(p))]
    assert len(same) >= len(plans) - 1  # every plan of two rows, at least
    beside = AdalnCache(spec, CheckpointSource(ckpt, spec), max_plans=len(plans), max_plan_width=2, tables=out)
    report = beside.build(plans, embed=embed)
    assert report.table_hits == len(same) and report.built == len(plans) - len(same)
    for plan in plans:
        a, b = beside.rows_of(plan_key(plan)), fresh.rows_of(plan_key(plan))
        assert all(torch.equal(x, y) for x, y in zip(a.parts, b.parts))


def test_inspect_and_verify_tables_understand_the_sidecar(
    bf16: tuple[Any, Path, ModulationSpec], tiny_saved_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, ckpt, spec = bf16
    out = tmp_path / "ref.safetensors"
    schedule = [
        "--format",
        "vllm-omni",
        "--mode",
        "ref2va-mixed",
        "--num-steps",
        "4",
        "--flow-shift",
        "6",
        "--audio-flow-shift",
        "2.5",
    ]
    assert _export(ckpt, out, *schedule) == 0
    # The same weights in diffusers' layout (the whole saved transformer) give the same manifest and payload:
    # digests name the native tensors and hash the bytes, whatever the file calls them.
    assert _export(tiny_saved_root / "bf16", tmp_path / "diffusers.safetensors", *schedule) == 0
    ours, theirs = (json.loads(TableFile(p).metadata["manifest"]) for p in (out, tmp_path / "diffusers.safetensors"))
    assert ours == theirs
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "vllm-omni format" in shown and "mode ref2va-mixed, 4 steps, flow_shift 6, audio_flow_shift 2.5" in shown
    assert "model_variant ref2va" in shown and "every payload digest verified" in shown
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["manifest"]["schedule"]["mode"] == "ref2va-mixed"
    assert main(["verify", "--tables", str(out), "--checkpoint", str(ckpt), "-q"]) == 0
    assert "OK" in capsys.readouterr().out
    # Another checkpoint of the same geometry: rows and weight digests differ, and verify says so (exit 1).
    other = dict(_checkpoint_tensors(ckpt))
    other["blocks.1.adaln_proj.linear.bias"] = other["blocks.1.adaln_proj.linear.bias"] + 1
    (tmp_path / "other").mkdir()
    save_file(other, str(tmp_path / "other" / "model.safetensors"))
    assert main(["verify", "--tables", str(out), "--checkpoint", str(tmp_path / "other"), "-q"]) == 1
    said = capsys.readouterr().out
    assert "WEIGHTS blocks.1.adaln_proj.linear.bias" in said and "MISMATCH" in said and "FAILED" in said
    report = verify_tables(TableFile(out, spec), CheckpointSource(ckpt, spec), embed=lambda p: p, progress=False)
    assert report.ok and report.checked == len(vo.timestep_plans(vo.schedule_contract("ref2va-mixed", 4, None, 6, 2.5)))


# ---------------------------------------------------------------------------------------------
# refusals before any pass


def test_export_refuses_what_the_sidecar_cannot_hold(
    bf16: tuple[Any, Path, ModulationSpec],
    load_tiny: Callable[[str], Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, ckpt, spec = bf16
    out = tmp_path / "x.safetensors"
    fp32 = write_h3_checkpoint(load_tiny("fp32-memory"), tmp_path / "fp32")
    fp16 = tmp_path / "fp16"
    fp16.mkdir()
    save_file({k: v.half() for k, v in _checkpoint_tensors(ckpt).items()}, str(fp16 / "model.safetensors"))
    for checkpoint, extra, says in (
        (fp32, T2VA6, "bfloat16 tables only"),
        (fp16, T2VA6, "bfloat16 tables only"),
        (ckpt, [*T2VA6, "--precision", "fp32"], "--precision fp32"),
        (ckpt, [*T2VA6, "--model-variant", "ref2va"], "--model-variant ref2va does not serve --mode t2va"),
        (ckpt, ["--format", "vllm-omni", "--mode", "ref2va-image", "--model-variant", "fl2va"], "--model-variant"),
        (ckpt, [*T2VA6, "--shard", "columns"], "--shard layers"),
        (ckpt, [*T2VA6, "--store", str(tmp_path / "store")], "drop --store"),
        (ckpt, [*T2VA6, "--task", "t2va"], "drop --task"),
        (ckpt, ["--format", "vllm-omni"], "needs --mode"),
        (ckpt, ["--format", "vllm-omni", "--mode", "t2va", "--base-schedule", "1,0.5"], "--base-schedule"),
        (ckpt, ["--format", "sglang", "--model-variant", "fl2va", "--mode", "t2va"], "--mode"),
        (ckpt, ["--format", "adalncache"], "needs --task and --steps"),
    ):
        assert _export(checkpoint, out, *extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, (extra, err)
        assert not out.exists() and not list(tmp_path.glob(".x.safetensors.tmp-*"))
    # The Python API refuses the same, and more, before any pass.
    source = CheckpointSource(ckpt, spec)
    contract = vo.schedule_contract("t2va", 4)
    plans = vo.timestep_plans(contract)

    def refused(cache: AdalnCache, says: str, given: list[torch.Tensor] = plans, **kwargs: Any) -> None:
        with pytest.raises(ConfigError, match=says):
            export_tables(
                cache, given, out, **{"format": "vllm-omni", "schedules": [contract], "progress": False, **kwargs}
            )
        assert cache.stats.passes == 0 and not out.exists()

    cache = AdalnCache(spec, source, max_plans=8, max_plan_width=2)
    refused(cache, "drop embed=", embed=time_embed_fn(source, spec))
    refused(cache, "exactly one schedule", schedules=[contract, contract])
    refused(cache, "exactly the schedule's plans", plans[::-1])
    refused(cache, "does not serve", model_variant="ref2va")
    refused(AdalnCache(spec, source, max_plans=8, max_plan_width=2, store=tmp_path / "s"), "drop --store")
    lora = AdalnCache(spec, source, max_plans=8, max_plan_width=2)
    lora.build(plans[:1], embed=time_embed_fn(source, spec), variant="lora:adapter-1")
    passes = lora.stats.passes
    with pytest.raises(ConfigError, match="LoRA variant is active"):
        export_tables(lora, plans, out, format="vllm-omni", schedules=[contract], progress=False)
    assert lora.stats.passes == passes and not out.exists()


# ---------------------------------------------------------------------------------------------
# reading refuses a file that is not what this cache computes


def test_tables_refuses_a_tampered_or_foreign_sidecar(bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path) -> None:
    _, ckpt, spec = bf16
    out = tmp_path / "h3.safetensors"
    assert _export(ckpt, out, *T2VA6) == 0
    TableFile(out, spec)  # the untouched file opens

    def opened(path: Path, says: str, source: Any = None) -> None:
        with pytest.raises(ConfigError, match=says):
            AdalnCache(spec, source, max_plans=8, max_plan_width=2, tables=path)

    def bump(tensors: dict[str, torch.Tensor]) -> None:
        tensors["block_params"][0, 0, 0, 0] += 1

    opened(_rewrite(out, tmp_path / "a.safetensors", tensors=bump), "does not match its payload digest")
    opened(
        _rewrite(out, tmp_path / "b.safetensors", manifest=lambda m: m["math"].update(torch="1.0")),
        "another numeric environment",
    )
    opened(
        _rewrite(out, tmp_path / "c.safetensors", manifest=lambda m: m["schedule"].update(num_steps=7)),
        "another model's|plans|needs",
    )
    opened(
        _rewrite(out, tmp_path / "d.safetensors", manifest=lambda m: m.update(model_variant="ref2va")),
        "does not run mode",
    )
    opened(_rewrite(out, tmp_path / "e.safetensors", manifest=lambda m: m.pop("math")), "exactly the keys")
    first = "blocks.0.adaln_proj.linear.weight"
    tampered = _rewrite(out, tmp_path / "f.safetensors", manifest=lambda m: m["weights"].update({first: "0" * 64}))
    AdalnCache(spec, None, max_plans=8, max_plan_width=2, tables=tampered).close()  # no weights: nothing to compare
    opened(tampered, "other weights", CheckpointSource(ckpt, spec))
    # The other checkpoint of this geometry: its weight digests differ from the file's.
    other = dict(_checkpoint_tensors(ckpt))
    other["time_embedder.proj_in.bias"] = other["time_embedder.proj_in.bias"] * 2
    (tmp_path / "other").mkdir()
    save_file(other, str(tmp_path / "other" / "model.safetensors"))
    opened(out, "time_embedder.proj_in.bias", CheckpointSource(tmp_path / "other", spec))
    # A cache of another precision, or of other geometry.
    with pytest.raises(ConfigError, match="precision='match'"):
        AdalnCache(spec, None, max_plans=8, max_plan_width=2, precision="fp32", tables=out)
    with pytest.raises(ConfigError):
        AdalnCache(
            ModulationSpec(
                num_layers=spec.num_layers + 1, hidden_size=spec.hidden_size, time_embed_dim=spec.time_embed_dim
            ),
            None,
            tables=out,
        )


# ---------------------------------------------------------------------------------------------
# vLLM-Omni's own loader


def test_vllm_omnis_loader_accepts_the_export_and_serves_our_rows(
    bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path
) -> None:
    module = load()
    if module is None:
        pytest.skip("vllm-omni is not installed")
    _, ckpt, spec = bf16
    out = tmp_path / "h3.safetensors"
    assert _export(ckpt, out, "--format", "vllm-omni", "--mode", "fl2va", "--num-steps", "5") == 0
    arch = types.SimpleNamespace(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        timestep_input_dim=32,
        time_embed_hidden_size=64,
        time_embed_dim=spec.time_embed_dim,
    )
    sidecar = module.MiniMaxH3AdalnCache(arch, path=str(out), model_variant="fl2va")
    sidecar.bind_adapter(None)
    for name, tensor in _checkpoint_tensors(ckpt).items():  # the stream the server loads the checkpoint from
        sidecar.verify_weight(name, tensor)
    sidecar.finish_loading(torch.device("cpu"))
    sidecar.check_request(mode="fl2va", num_steps=5, base_schedule=None, flow_shift=12.0, audio_flow_shift=3.0)
    table = TableFile(out, spec)
    embedding = vo.TimeEmbedding(CheckpointSource(ckpt, spec), spec)
    for plan in vo.timestep_plans(vo.schedule_contract("fl2va", 5)):
        blocks, final = sidecar.lookup(plan)
        rows = table.read(plan_key(plan))
        assert rows is not None
        n = len(plan)
        theirs = torch.stack([torch.stack(layer, dim=1).reshape(n, -1) for layer in blocks], dim=1)
        assert torch.equal(theirs, rows.parts[0]) and torch.equal(torch.stack(final, 1).reshape(n, -1), rows.parts[1])
        # Serving keys rows by the digest of the time embedding its forward computes.
        assert module.tensor_digest(embedding.temb(plan)) in sidecar._embedding_plans
    # The loader's checks are real: a file for the other variant, another weight, or another machine is refused.
    with pytest.raises(ValueError, match="model variant"):
        module.MiniMaxH3AdalnCache(arch, path=str(out), model_variant="ref2va")
    other = module.MiniMaxH3AdalnCache(arch, path=str(out), model_variant="fl2va")
    with pytest.raises(ValueError, match="weight mismatch"):
        other.verify_weight("blocks.0.adaln_proj.linear.bias", torch.zeros(18 * spec.hidden_size, dtype=torch.bfloat16))
    foreign = _rewrite(out, tmp_path / "m.safetensors", manifest=lambda m: m["math"].update(torch="1.0"))
    third = module.MiniMaxH3AdalnCache(arch, path=str(foreign), model_variant="fl2va")
    third.bind_adapter(None)
    for name, tensor in _checkpoint_tensors(ckpt).items():
        third.verify_weight(name, tensor)
    with pytest.raises(ValueError, match="numerical environment"):
        third.finish_loading(torch.device("cpu"))


def test_a_sidecar_is_checked_again_when_the_checkpoint_changes(
    bf16: tuple[Any, Path, ModulationSpec], load_tiny: Callable[[str], Any], tmp_path: Path
) -> None:
    """The checkpoint is replaced by other weights (atomic renames): the sidecar's weight digests are checked
    again, found to differ, and it is never served again; every plan is built from the new bytes."""
    _, ckpt, spec = bf16
    out = tmp_path / "h3.safetensors"
    assert _export(ckpt, out, *T2VA6) == 0
    plans = vo.timestep_plans(vo.schedule_contract("t2va", 6))
    source = CheckpointSource(ckpt, spec)
    embed = vo.TimeEmbedding(source, spec).embed
    cache = AdalnCache(spec, source, max_plans=8, max_plan_width=2, tables=out)
    assert cache.build(plans[1:2], embed=embed).table_hits == 1
    fine_tuned = load_tiny("bf16-disk")
    with torch.no_grad():
        fine_tuned.transformer_blocks[0].adaln_proj.linear.bias.add_(1)
    other = write_h3_checkpoint(fine_tuned, tmp_path / "other")
    for path in sorted(other.iterdir()):
        os.replace(path, ckpt / path.name)
    report = cache.build(plans, embed=embed)
    assert (report.table_hits, report.built) == (0, len(plans)) and cache.stats.fingerprint_changes == 1
    fresh = AdalnCache(spec, CheckpointSource(ckpt, spec), max_plans=8, max_plan_width=2)  # the new bytes
    fresh.build(plans, embed=embed)
    for plan in plans:
        a, b = cache.rows_of(plan_key(plan)), fresh.rows_of(plan_key(plan))
        assert all(torch.equal(x, y) for x, y in zip(a.parts, b.parts))
    cache.invalidate()
    report = cache.build(plans, embed=embed)  # the file names other weights: not consulted again
    assert report.table_hits == 0 and report.passes == 1


def test_enable_adaln_cache_serves_a_sidecar_without_weights(
    bf16: tuple[Any, Path, ModulationSpec], load_tiny: Callable[[str], Any], tmp_path: Path
) -> None:
    """A model enabled with a sidecar and no checkpoint: its projections are hashed against the manifest, then
    freed; a plan whose input is the file's is served with the resident model's bits, one whose input differs
    (the model's own time embedding of it has other bits) raises PlanNotCachedError, never wrong rows."""
    from adalncache.diffusers import enable_adaln_cache
    from adalncache.errors import PlanNotCachedError

    model, ckpt, spec = bf16
    out = tmp_path / "h3.safetensors"
    assert _export(ckpt, out, *T2VA6) == 0
    plans = vo.timestep_plans(vo.schedule_contract("t2va", 6))
    resident = {}
    with torch.no_grad():
        for plan in plans:
            x = torch.nn.functional.silu(model.time_embedder(model.time_proj(plan))).to(torch.bfloat16)
            blocks = torch.stack([b.adaln_proj.linear(x) for b in model.transformer_blocks], dim=1)
            resident[plan_key(plan)] = (x, blocks, model.norm_out.linear(x))
    handle = enable_adaln_cache(model, tables=out)
    embedding = vo.TimeEmbedding(CheckpointSource(ckpt, spec), spec)
    same = [p for p in plans if torch.equal(resident[plan_key(p)][0], embedding.embed(p))]
    assert len(same) >= len(plans) - 1
    report = handle.prepare(same)
    assert report.table_hits == len(same) and report.passes == 0
    for plan in same:
        rows = handle.cache.rows_of(plan_key(plan))
        _, blocks, final = resident[plan_key(plan)]
        assert torch.equal(rows.parts[0], blocks) and torch.equal(rows.parts[1], final)
    for plan in [p for p in plans if not any(p is q for q in same)]:
        with pytest.raises(PlanNotCachedError):
            handle.prepare([plan])
    # Another model's weights: refused when enabling, before anything is freed.
    other = load_tiny("bf16-disk")
    with torch.no_grad():
        other.transformer_blocks[0].adaln_proj.linear.bias.add_(1)
    with pytest.raises(ConfigError, match="other weights"):
        enable_adaln_cache(other, tables=out)
    assert other.transformer_blocks[0].adaln_proj.linear.weight.numel() > 0


def test_export_takes_the_releases_schedule_defaults(bf16: tuple[Any, Path, ModulationSpec], tmp_path: Path) -> None:
    """Unset flags take what the release's model_index.json gives vLLM-Omni (its flow shifts, a distilled
    release's positions), then vLLM-Omni's own defaults; a flag given wins."""
    _, ckpt, _ = bf16
    partition = tmp_path / "release" / "FL2VA"
    (partition / "transformer").mkdir(parents=True)
    for path in ckpt.iterdir():
        (partition / "transformer" / path.name).write_bytes(path.read_bytes())
    release = {
        "partition": "fl2va",
        "sigma_shift_scales": {"video": 5.0, "audio": 2.0},
        "base_schedule": [1.0, 0.75, 0.5, 0.0],
    }
    (partition / "model_index.json").write_text(json.dumps({"_minimax_h3": release}))

    def schedule(*extra: str) -> dict[str, Any]:
        out = tmp_path / "x.safetensors"
        assert _export(partition / "transformer", out, "--format", "vllm-omni", "--mode", "fl2va", *extra) == 0
        return json.loads(TableFile(out).metadata["manifest"])["schedule"]

    assert schedule() == vo.schedule_contract("fl2va", 3, [1.0, 0.75, 0.5, 0.0], 5.0, 2.0)
    assert schedule("--flow-shift", "7", "--base-schedule", "1,0.5,0") == vo.schedule_contract(
        "fl2va", 2, [1.0, 0.5, 0.0], 7.0, 2.0
    )
    assert vo.release_defaults(ckpt) == {}  # a checkpoint outside a release: vLLM-Omni's defaults
