"""enable_adaln_cache on a MiniMaxH3Transformer3DModel: bit-identical outputs, freed weights, removal."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import CheckpointError, ConfigError, PlanError, PlanNotCachedError
from adalncache.plans import minimax_h3_plans
from adalncache.tools.tiny import make_request, run_loop
from tiny_helpers import adaln_parameter_bytes, parameter_bytes, write_native_checkpoint

TASKS = ("t2va", "fl2va", "ref2va")
PRECISIONS = ("fp32-memory", "fp32-disk", "bf16-disk")  # as the load_tiny fixture takes them
STEPS = 6  # grid points: 5 forwards, the first at M=1 for t2va (the GEMV path)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _assert_state_equal(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    for name, tensor in state.items():
        assert tensor.device.type != "meta", name
        assert tensor.dtype == snapshot[name].dtype, name
        assert torch.equal(tensor, snapshot[name]), name


@pytest.mark.parametrize("checkpoint", ["none", "native", "diffusers"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("task", TASKS)
def test_cached_loop_is_bit_identical(
    load_tiny: Callable[[str], Any],
    tiny_saved_root: Path,
    tmp_path: Path,
    task: str,
    precision: str,
    checkpoint: str,
) -> None:
    """Every forward output torch.equal to the resident model's, with the projections gone.

    ``native``: a sharded native-layout checkpoint written from the model; ``diffusers``: the
    ``save_pretrained`` file the models are loaded from (for the in-memory fp32 model its
    tensors sit at other addresses modulo 64 than the model's, the case the M=1 GEMV is
    sensitive to).
    """
    model = load_tiny(precision)
    path: Path | None = None
    if checkpoint == "native":
        path = write_native_checkpoint(model, tmp_path / "native", shards=2)
    elif checkpoint == "diffusers":
        path = tiny_saved_root / ("bf16" if precision.startswith("bf16") else "fp32")
    snapshot = _snapshot(model)
    request = make_request(model, task, STEPS, seed=3)
    resident = run_loop(model, request)
    bytes_before = parameter_bytes(model)
    adaln_before = adaln_parameter_bytes(model)

    handle = enable_adaln_cache(model, path)
    assert adaln_parameter_bytes(model) == 0
    assert parameter_bytes(model) == bytes_before - adaln_before
    report = handle.prepare(minimax_h3_plans(task, STEPS))
    assert report.passes == 1
    cached = run_loop(model, request)
    for step, ((video_r, audio_r), (video_c, audio_c)) in enumerate(zip(resident.outputs, cached.outputs)):
        assert torch.equal(video_r, video_c), f"video output differs at step {step}"
        assert torch.equal(audio_r, audio_c), f"audio output differs at step {step}"
    assert torch.equal(resident.latents, cached.latents)
    assert torch.equal(resident.audio_latents, cached.audio_latents)
    assert handle.stats.passes == 1  # the loop itself never rebuilt

    handle.disable()
    assert parameter_bytes(model) == bytes_before
    _assert_state_equal(model, snapshot)
    assert run_loop(model, request).equal(resident)


def test_cache_really_serves_the_source(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    """A checkpoint with other projections, unverified, changes the outputs: the tables are what runs."""
    model = load_tiny("bf16-disk")
    other = load_tiny("bf16-disk")
    with torch.no_grad():
        other.transformer_blocks[1].adaln_proj.linear.bias.add_(0.25)
    path = write_native_checkpoint(other, tmp_path / "other")
    request = make_request(model, "t2va", 4)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, path, verify_checkpoint=False)
    handle.prepare(request.plans)
    assert not run_loop(model, request).equal(resident)
    handle.disable()


def test_mismatched_checkpoint_is_refused(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    model = load_tiny("bf16-disk")
    other = load_tiny("bf16-disk")
    with torch.no_grad():
        other.norm_out.linear.weight[0, 0] += 1.0
    path = write_native_checkpoint(other, tmp_path / "finetune")
    snapshot = _snapshot(model)
    with pytest.raises(ConfigError, match=r"norm_out\.linear\.weight differs"):
        enable_adaln_cache(model, path)
    # Refusing left the model untouched and enabling still works afterwards.
    _assert_state_equal(model, snapshot)
    enable_adaln_cache(model).disable()


def test_checkpoint_of_another_dtype_is_refused(load_tiny: Callable[[str], Any], tiny_saved_root: Path) -> None:
    """The fp32 file holds the same values but is not what a bf16 model projects with."""
    model = load_tiny("bf16-disk")
    with pytest.raises(ConfigError, match="does not match the model"):
        enable_adaln_cache(model, tiny_saved_root / "fp32")


def test_placeholders_keep_names_shapes_and_repr(load_tiny: Callable[[str], Any]) -> None:
    """Parked weights stay reachable by name with their shape and dtype, but are no parameters.

    Unregistered, so ``.to()``, group offloading and accelerate's hooks never see them; every
    other parameter keeps its name and order, and disabling gives back the exact original list.
    """
    model = load_tiny("bf16-disk")
    names = [name for name, _ in model.named_parameters()]
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    handle = enable_adaln_cache(model)
    weight = model.transformer_blocks[0].adaln_proj.linear.weight
    assert weight.device.type == "meta" and weight.dtype == torch.bfloat16
    assert model.norm_out.linear.bias.device.type == "meta"
    assert model.time_embedder.linear_1.weight.device.type == "meta"
    parked = {
        name
        for name in names
        if ".adaln_proj.linear." in name or name.startswith(("norm_out.linear.", "time_embedder."))
    }
    assert [name for name, _ in model.named_parameters()] == [name for name in names if name not in parked]
    for name in parked:
        module_path, _, attr = name.rpartition(".")
        placeholder = getattr(model.get_submodule(module_path), attr)
        assert placeholder.device.type == "meta" and tuple(placeholder.shape) == shapes[name], name
    assert "adaln_proj" in repr(model)
    assert "enabled" in repr(handle)
    handle.disable()
    assert "disabled" in repr(handle)
    assert [name for name, _ in model.named_parameters()] == names
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == shapes
    assert model.transformer_blocks[0].adaln_proj.linear.weight.device.type == "cpu"


def test_time_embedder_can_stay(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "fl2va", 4)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, free_time_embedder=False)
    assert model.time_embedder.linear_1.weight.device.type == "cpu"
    assert model.transformer_blocks[0].adaln_proj.linear.weight.device.type == "meta"
    handle.prepare(request.plans)
    assert run_loop(model, request).equal(resident)
    handle.disable()


def test_unprepared_plan_builds_with_one_warning(
    load_tiny: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 5)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model)
    with caplog.at_level(logging.WARNING, logger="adalncache"):
        cached = run_loop(model, request)
    assert cached.equal(resident)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "not prepared" in r.getMessage()]
    assert len(warnings) == 1
    assert handle.stats.passes == len(request.plan)  # one pass per unprepared step
    handle.disable()


def test_on_miss_raise(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "ref2va", 4)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, on_miss="raise")
    with pytest.raises(PlanNotCachedError, match="does not cover"):
        run_loop(model, request)
    handle.prepare(request.plan)  # the row_timestep_plan pairs are accepted as they are
    assert run_loop(model, request).equal(resident)
    handle.disable()


def test_repeated_prepare_does_no_pass(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    handle = enable_adaln_cache(model)
    plans = minimax_h3_plans("fl2va", 8)
    assert handle.prepare(plans).passes == 1
    assert handle.prepare(plans).passes == 0
    assert handle.prepare(plans[:3]).passes == 0
    assert handle.stats.passes == 1
    handle.disable()


def test_state_dict_and_save_pretrained_keep_the_projections(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    model = load_tiny("bf16-disk")
    snapshot = _snapshot(model)
    handle = enable_adaln_cache(model)
    _assert_state_equal(model, snapshot)  # state_dict while enabled carries the real weights
    model.save_pretrained(tmp_path / "saved")
    handle.disable()
    reloaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "saved", torch_dtype=torch.bfloat16)
    _assert_state_equal(reloaded, snapshot)


def test_state_dict_with_checkpoint_source(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    model = load_tiny("fp32-disk")
    path = write_native_checkpoint(model, tmp_path / "native")
    snapshot = _snapshot(model)
    handle = enable_adaln_cache(model, path)
    _assert_state_equal(model, snapshot)
    handle.disable()
    _assert_state_equal(model, snapshot)


def test_load_state_dict_into_served_weights_is_refused(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    state = _snapshot(model)
    handle = enable_adaln_cache(model)
    with pytest.raises(ConfigError, match="disable"):
        model.load_state_dict(state)
    handle.disable()
    model.load_state_dict(state)


def test_enable_twice_and_bad_arguments(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    with pytest.raises(ConfigError, match="on_miss"):
        enable_adaln_cache(model, on_miss="ignore")  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    handle = enable_adaln_cache(model)
    with pytest.raises(ConfigError, match="already enabled"):
        enable_adaln_cache(model)
    handle.disable()
    handle.disable()  # idempotent
    with pytest.raises(ConfigError, match="disabled"):
        handle.prepare(minimax_h3_plans("t2va", 3))
    with pytest.raises(ConfigError, match="MiniMaxH3Transformer3DModel"):
        enable_adaln_cache(torch.nn.Linear(2, 2))


def test_non_float32_timestep_is_a_plan_error(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 3)
    handle = enable_adaln_cache(model)
    kwargs = request.forward_kwargs(0, request.latents, request.audio_latents)
    kwargs["timestep"] = "0.5"
    with pytest.raises(PlanError):
        model(**kwargs)
    handle.disable()


def test_moving_or_casting_while_enabled_is_refused(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    handle = enable_adaln_cache(model)
    assert model.to("cpu") is model  # a no-op move is fine (pipelines call pipe.to(device) freely)
    with pytest.raises(ConfigError, match="disable"):
        model.to(torch.float32)
    with pytest.raises(ConfigError, match="disable"):
        model.half()
    handle.disable()
    model.to(torch.float32)
    assert model.transformer_blocks[0].adaln_proj.linear.weight.dtype == torch.float32


def test_disable_refuses_a_checkpoint_changed_since_enable(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    """Weights served from a checkpoint come back from it; a rewritten file cannot give them back."""
    import shutil

    model = load_tiny("bf16-disk")
    snapshot = _snapshot(model)
    path = write_native_checkpoint(model, tmp_path / "native", shards=1)
    keep = tmp_path / "kept"
    shutil.copytree(path, keep)
    handle = enable_adaln_cache(model, path)
    other = load_tiny("bf16-disk")
    with torch.no_grad():
        other.norm_out.linear.bias.add_(1.0)
    write_native_checkpoint(other, path, shards=1)  # rewritten in place (new inode, new header)
    with pytest.raises(CheckpointError, match="changed on disk"):
        handle.disable()
    assert handle.enabled
    for item in keep.iterdir():  # the original bytes back (a new file identity all the same)
        shutil.copy2(item, path / item.name)
    with pytest.raises(CheckpointError, match="allow_changed_checkpoint"):
        handle.disable()
    handle.disable(allow_changed_checkpoint=True)
    _assert_state_equal(model, snapshot)


def test_disable_refuses_bytes_rewritten_where_no_stat_sees_it(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    """Written through a shared mapping whose pages are already dirty, the checkpoint's bytes change and its
    stat identity does not (ext4): ``disable()`` re-reads the projections to restore them, hashes them, finds
    another digest than the one enabling's verification learnt, and raises CheckpointError before anything
    changes; the model stays enabled and serving, exactly. The original bytes back, it restores them."""
    from core_helpers import DirtyMapping

    model = load_tiny("bf16-disk")
    snapshot = _snapshot(model)
    request = make_request(model, "t2va", 3, seed=2)
    resident = run_loop(model, request)
    path = write_native_checkpoint(model, tmp_path / "native", shards=1, match_alignment=False)
    other = load_tiny("bf16-disk")
    with torch.no_grad():
        other.norm_out.linear.bias.add_(1.0)
    (file,) = path.glob("*.safetensors")
    (rewritten,) = write_native_checkpoint(other, tmp_path / "other", shards=1, match_alignment=False).glob(
        "*.safetensors"
    )
    old, new = file.read_bytes(), rewritten.read_bytes()
    assert len(old) == len(new) and old != new
    mapping = DirtyMapping(file)  # its first write of each page moves the file's times once, as any write does
    try:
        handle = enable_adaln_cache(model, path)
        assert run_loop(model, request).equal(resident)  # built from the bytes enabling verified
        assert mapping.write(new), "writeback cleaned the pages in between (a sync elsewhere): rerun"
        with pytest.raises(CheckpointError, match="rewritten without its stat identity changing"):
            handle.disable()
        assert handle.enabled
        assert run_loop(model, request).equal(resident)  # served from the resident tables, as before
        assert mapping.write(old)
        handle.disable()
    finally:
        mapping.close()
    _assert_state_equal(model, snapshot)


def test_host_tier_brings_evicted_plans_back_without_a_pass(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "fl2va", 6)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, max_plans=5, host_cache_bytes=1 << 22)
    assert handle.prepare(request.plans).passes == 1
    assert handle.prepare(minimax_h3_plans("fl2va", 5)).evicted > 0  # another schedule pushes some out
    report = handle.prepare(request.plans)
    assert report.passes == 0 and report.host_hits > 0
    assert run_loop(model, request).equal(resident)
    handle.disable()


def test_non_float32_timestep_tensor_is_refused_not_converted(load_tiny: Callable[[str], Any]) -> None:
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 3)
    handle = enable_adaln_cache(model)
    kwargs = request.forward_kwargs(1, request.latents, request.audio_latents)
    kwargs["timestep"] = kwargs["timestep"].to(torch.float64)
    with pytest.raises(PlanError, match="float32"):
        model(**kwargs)
    handle.disable()


def test_store_serves_a_new_handle_without_a_pass(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    """Entries written under a checkpoint fingerprint come back bit-exactly in a later enable."""
    model = load_tiny("fp32-disk")
    path = write_native_checkpoint(model, tmp_path / "native")
    request = make_request(model, "ref2va", 5)
    resident = run_loop(model, request)
    first = enable_adaln_cache(model, path, store=tmp_path / "store")
    assert first.prepare(request.plans).passes == 1
    first.disable()
    second = enable_adaln_cache(model, path, store=tmp_path / "store")
    report = second.prepare(request.plans)
    assert report.passes == 0 and report.store_hits == len(request.plans)
    assert run_loop(model, request).equal(resident)
    second.disable()
