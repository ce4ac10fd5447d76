"""Qwen-Image served from tables: tiny real ``QwenImageTransformer2DModel``s, every output ``torch.equal``.

Variants: plain (Qwen-Image), ``zero_cond_t`` (Edit-2511: ``img_mod`` on ``[t; 0]``, 2B rows, the
rest on B rows) and ``use_additional_t_cond`` (Layered: a second plan column). Precisions: the
in-memory fp32 model and the bf16 model loaded from its saved files.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from adalncache import ConfigError, ModulationSpec, PlanError
from adalncache.diffusers import enable_adaln_cache
from adalncache.families import qwen_image as core
from adalncache.tools.tiny_qwen import (
    modulation_linears,
    tiny_qwen_inputs,
    tiny_qwen_transformer,
)

diffusers = pytest.importorskip("diffusers")

VARIANTS = ("plain", "zero-cond", "layered")
PRECISIONS = ("fp32-memory", "bf16-disk")


@pytest.fixture(scope="module")
def qwen_root() -> Iterator[Path]:
    """Each variant's tiny model saved once (fp32 ``save_pretrained``) under ``<root>/<variant>``."""
    with tempfile.TemporaryDirectory(prefix="adalncache-qwen-") as tmp:
        root = Path(tmp)
        for variant in VARIANTS:
            tiny_qwen_transformer(variant).save_pretrained(root / variant)
        yield root


@pytest.fixture
def load_qwen(qwen_root: Path) -> Callable[[str, str], Any]:
    """``load_qwen(variant, precision)``: a fresh tiny model built in memory or loaded in bf16 from disk."""

    def load(variant: str, precision: str) -> Any:
        if precision == "fp32-memory":
            return tiny_qwen_transformer(variant)
        return diffusers.QwenImageTransformer2DModel.from_pretrained(
            qwen_root / variant, torch_dtype=torch.bfloat16
        ).eval()

    return load


def _inputs(model: Any, variant: str, batch: int, seed: int = 0) -> dict[str, Any]:
    # Edit models get a condition image per sample, so modulate_index picks both rows of [t; 0].
    return tiny_qwen_inputs(model, batch, seed=seed, frames=2 if variant == "zero-cond" else 1)


def _run(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def _served_parameters(model: Any) -> list[tuple[str, torch.Tensor]]:
    names = ("img_mod.1.", "txt_mod.1.", "norm_out.linear.", "time_text_embed.timestep_embedder.")
    return [(name, p) for name, p in model.named_parameters() if any(part in name for part in names)]


def _parameter_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_served_forward_equals_the_resident_one(
    load_qwen: Callable[[str, str], Any], variant: str, precision: str, batch: int
) -> None:
    """The served weights leave the device, the forward is torch.equal, disable() gives them back."""
    model = load_qwen(variant, precision)
    inputs = _inputs(model, variant, batch)
    resident = _run(model, inputs)
    served = _served_parameters(model)
    snapshot = {name: p.detach().clone() for name, p in served}
    objects = {name: p for name, p in served}
    before = _parameter_bytes(model)
    served_bytes = sum(p.numel() * p.element_size() for _, p in served)

    handle = enable_adaln_cache(model)
    spec = handle.spec
    assert spec.family.name == "qwen-image" and spec.projection_bytes == sum(
        p.numel() * p.element_size() for name, p in served if "timestep_embedder" not in name
    )
    for linear in modulation_linears(model):
        assert linear.weight.device.type == "meta" and linear.bias.device.type == "meta"
    assert model.time_text_embed.timestep_embedder.linear_1.weight.device.type == "meta"
    assert _served_parameters(model) == [] and _parameter_bytes(model) == before - served_bytes

    report = handle.prepare([inputs["timestep"]] if variant != "layered" else [_keyed(inputs)])
    assert report.passes == 1
    cached = _run(model, inputs)
    assert torch.equal(cached, resident)
    assert handle.stats.passes == 1  # the forward found its plan prepared

    handle.disable()
    restored = dict(_served_parameters(model))
    assert restored.keys() == snapshot.keys()
    for name, tensor in restored.items():
        assert tensor is objects[name] and tensor.dtype == snapshot[name].dtype, name
        assert torch.equal(tensor, snapshot[name]), name
    assert torch.equal(_run(model, inputs), resident)


def _keyed(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"timestep": inputs["timestep"], "additional_t_cond": inputs["additional_t_cond"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_prepare_builds_a_whole_schedule_in_one_pass(load_qwen: Callable[[str, str], Any], variant: str) -> None:
    """Every step's plan in one pass; the loop then builds nothing; a second prepare is all hits."""
    model = load_qwen(variant, "bf16-disk")
    steps = [_inputs(model, variant, 1, seed=seed) for seed in range(4)]
    for seed, inputs in enumerate(steps):
        inputs["timestep"] = torch.tensor([1.0 - 0.2 * seed]).to(torch.bfloat16)
    resident = [_run(model, inputs) for inputs in steps]
    handle = enable_adaln_cache(model, max_plans=8)
    plans = [inputs["timestep"] if variant != "layered" else _keyed(inputs) for inputs in steps]
    assert handle.prepare(plans).passes == 1 and handle.stats.passes == 1
    assert all(torch.equal(_run(model, inputs), ref) for inputs, ref in zip(steps, resident))
    assert handle.prepare(plans).passes == 0 and handle.stats.passes == 1
    handle.disable()


def test_a_miss_is_built_and_exact(load_qwen: Callable[[str, str], Any]) -> None:
    model = load_qwen("plain", "bf16-disk")
    inputs = _inputs(model, "plain", 2, seed=5)
    resident = _run(model, inputs)
    handle = enable_adaln_cache(model)
    handle.prepare([torch.tensor([0.5], dtype=torch.bfloat16)])
    assert torch.equal(_run(model, inputs), resident)
    assert handle.stats.passes == 2  # the prepared plan, then the forward's own
    handle.disable()


def test_plans_are_keyed_by_the_values_the_forward_sees(load_qwen: Callable[[str, str], Any]) -> None:
    """A bf16 model casts the timestep first: an fp32 plan is keyed by its bf16 value, [t; 0] with zero_cond_t."""
    model = load_qwen("zero-cond", "bf16-disk")
    handle = enable_adaln_cache(model)
    timestep = torch.tensor([0.123456789])
    handle.prepare([timestep])
    seen = timestep.to(torch.bfloat16).to(torch.float32)
    assert torch.tensor([seen.item(), 0.0]) in handle.cache
    assert timestep not in handle.cache  # not the unrounded value
    handle.disable()


def test_bad_plans_are_refused_with_what_to_pass(load_qwen: Callable[[str, str], Any]) -> None:
    model = load_qwen("layered", "fp32-memory")
    handle = enable_adaln_cache(model)
    with pytest.raises(PlanError, match="additional_t_cond"):
        handle.prepare([torch.tensor([0.5])])
    with pytest.raises(PlanError, match="keys"):
        handle.prepare([{"timestep": torch.tensor([0.5]), "guidance": torch.tensor([1.0])}])
    with pytest.raises(PlanError, match="1-D floating-point"):
        handle.prepare([{"timestep": torch.tensor([[0.5]]), "additional_t_cond": torch.tensor([1])}])
    assert handle.stats.passes == 0 and len(handle.cache) == 0
    handle.disable()


def test_the_time_embedder_can_stay(load_qwen: Callable[[str, str], Any]) -> None:
    model = load_qwen("plain", "bf16-disk")
    inputs = _inputs(model, "plain", 1)
    resident = _run(model, inputs)
    handle = enable_adaln_cache(model, free_time_embedder=False)
    assert model.time_text_embed.timestep_embedder.linear_1.weight.device.type == "cpu"
    assert torch.equal(_run(model, inputs), resident)
    handle.disable()


# -- the spec ------------------------------------------------------------------------------------


def test_the_spec_from_a_transformer_and_from_a_checkpoint(qwen_root: Path) -> None:
    model = tiny_qwen_transformer("zero-cond")
    spec = ModulationSpec.from_transformer(model)
    dim = 32
    assert spec.family.name == "qwen-image" and spec.num_layers == 2 and spec.in_features == dim
    assert spec.layers() == [
        "transformer_blocks.0.img_mod.1",
        "transformer_blocks.0.txt_mod.1",
        "transformer_blocks.1.img_mod.1",
        "transformer_blocks.1.txt_mod.1",
        "norm_out.linear",
    ]
    assert [spec.out_features(layer) for layer in spec.layers()] == [6 * dim] * 4 + [2 * dim]
    assert [spec.input_of(layer) for layer in spec.layers()] == ["temb", "temb_first"] * 2 + ["temb_first"]
    assert spec.plan_inputs == ("timestep",) and spec.dtype == torch.float32
    layered = ModulationSpec.from_checkpoint(qwen_root / "layered")
    assert layered.plan_inputs == ("timestep", "additional_t_cond") and set(layered.inputs) == {"temb"}
    assert layered.dtype == torch.float32 and layered.layers() == ModulationSpec.from_transformer(model).layers()


def test_the_released_geometry_serves_a_third_of_the_model() -> None:
    """12.7 GiB of bf16 modulation, counted on the meta device from the released config."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = diffusers.QwenImageTransformer2DModel(num_layers=60)
    spec = ModulationSpec.from_transformer(model, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters()) * 2
    assert spec.projection_bytes == sum(
        p.numel() * 2 for name, p in model.named_parameters() if ("_mod.1." in name or "norm_out.linear" in name)
    )
    assert round(spec.projection_bytes / 2**30, 1) == 12.7
    assert round(100 * spec.projection_bytes / total) == 33
    assert spec.geometry == core.geometry(60, 3072)


# -- refusals --------------------------------------------------------------------------------------


def _flux() -> Any:
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )


def test_a_prompt_dependent_modulation_is_refused_and_nothing_changes() -> None:
    model = _flux()
    before = {name: p for name, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=r"FluxTransformer2DModel cannot be served.*pooled text embedding"):
        enable_adaln_cache(model)
    assert {name: p for name, p in model.named_parameters()} == before
    assert all(p.device.type == "cpu" for p in before.values())
    assert not getattr(model, "_diffusers_hook", None) or not model._diffusers_hook.hooks
    with pytest.raises(ConfigError, match="FluxTransformer2DModel cannot be served"):
        ModulationSpec.from_transformer(model)


def test_an_unknown_class_lists_the_supported_families(tmp_path: Path) -> None:
    model = diffusers.SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=8,
        sample_size=8,
    )
    with pytest.raises(ConfigError, match=r"SanaTransformer2DModel is not a supported family.*qwen-image"):
        enable_adaln_cache(model)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(ConfigError, match="SD3Transformer2DModel cannot be served"):
        ModulationSpec.from_checkpoint(tmp_path)


# -- the pipeline ----------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_pipeline_request_is_built_in_one_pass_and_repeats_build_nothing(
    load_qwen: Callable[[str, str], Any], precision: str
) -> None:
    """QwenImagePipeline, with and without true CFG: images torch.equal, one pass per new schedule.

    The tiny pipeline has no text encoder (a Qwen2.5-VL tokenizer cannot be made offline), so
    requests pass ``prompt_embeds``/``prompt_embeds_mask``; the denoising loop is the stock one.
    """
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline(transformer=load_qwen("plain", precision))
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    negative = tiny_prompt_embeds(pipe.transformer, seed=2)

    def run(steps: int, cfg: bool) -> torch.Tensor:
        kwargs: dict[str, Any] = {"true_cfg_scale": 4.0 if cfg else 1.0}
        if cfg:
            kwargs.update(
                negative_prompt_embeds=negative["prompt_embeds"],
                negative_prompt_embeds_mask=negative["prompt_embeds_mask"],
            )
        generator = torch.Generator().manual_seed(0)
        out = pipe(
            height=32, width=32, num_inference_steps=steps, generator=generator, output_type="pt", **prompt, **kwargs
        )
        return out.images

    resident = {(steps, cfg): run(steps, cfg) for steps in (3, 4) for cfg in (False, True)}
    handle = enable_adaln_cache(pipe)
    assert torch.equal(run(4, False), resident[(4, False)]) and handle.stats.passes == 1
    assert len(handle.cache) == 4  # the whole schedule, prepared before the first step ran
    assert torch.equal(run(4, True), resident[(4, True)]) and handle.stats.passes == 1  # same schedule: no pass
    assert torch.equal(run(3, True), resident[(3, True)]) and handle.stats.passes == 2  # a new schedule: one pass
    assert torch.equal(run(3, False), resident[(3, False)]) and handle.stats.passes == 2
    handle.disable()
    assert "set_timesteps" not in pipe.scheduler.__dict__
    assert torch.equal(run(4, False), resident[(4, False)])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pipeline", "variant"), [("QwenImageEditPipeline", "plain"), ("QwenImageEditPlusPipeline", "zero-cond")]
)
def test_an_edit_pipeline_request_is_built_in_one_pass(pipeline: str, variant: str) -> None:
    """The Edit pipelines share the transformer: one pass before the first step, images torch.equal.

    No text encoder or processor can be built offline (Qwen2.5-VL needs its tokenizer's and
    processor's files), so the request passes ``prompt_embeds``/``prompt_embeds_mask``: the
    pipelines encode the prompt (with the input image) only when ``prompt_embeds`` is None. The
    input image itself is still resized to about one megapixel and VAE-encoded, as the pipelines
    always do, and its latents join the transformer's tokens (``img_shapes`` of two entries).
    Edit-Plus with a ``zero_cond_t`` transformer is Qwen-Image-Edit-2511: plans of ``[t; 0]``.
    """
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline
    from tiny_helpers import tiny_edit_image

    pipe = tiny_qwen_pipeline(variant, pipeline=pipeline)
    assert type(pipe).__name__ == pipeline and pipe.text_encoder is None and pipe.processor is None
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    image = tiny_edit_image(seed=3)

    def run() -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        out = pipe(
            image=image,
            height=32,
            width=32,
            num_inference_steps=2,
            true_cfg_scale=1.0,
            generator=generator,
            output_type="pt",
            **prompt,
        )
        return out.images

    resident = run()
    handle = enable_adaln_cache(pipe)
    assert torch.equal(run(), resident) and handle.stats.passes == 1
    keys = handle.cache.resident_plans
    assert len(keys) == 2  # the whole schedule, prepared before the first step ran
    assert {len(key) for key in keys} == {2 if variant == "zero-cond" else 1}  # [t; 0] with zero_cond_t
    assert torch.equal(run(), resident) and handle.stats.passes == 1  # the same request builds nothing
    handle.disable()


@pytest.mark.slow
def test_the_layered_pipeline_is_served_in_one_pass() -> None:
    """QwenImageLayeredPipeline (``use_additional_t_cond``): images torch.equal, one pass, a repeat builds nothing.

    The request passes ``prompt_embeds`` and a non-empty ``prompt`` (its batch size): with no prompt
    the pipeline would caption the input image with the Qwen2.5-VL model, whose tokenizer and
    processor cannot be made offline; the tiny text encoder is there because the pipeline casts the
    input image to its dtype. The input image is resized to the pipeline's 640 x 640 bucket and
    VAE-encoded as always. Each forward's plan is ``(timestep, additional_t_cond)`` with the
    pipeline's ``is_rgb`` index 0: the whole schedule's plans are built before the first step. The
    images come back as decoded ``pt`` tensors (diffusers 0.42.1's Layered pipeline fails on
    ``output_type="latent"``).
    """
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline
    from tiny_helpers import tiny_edit_image

    pipe = tiny_qwen_pipeline("layered", pipeline="QwenImageLayeredPipeline")
    pipe.set_progress_bar_config(disable=True)
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    image = tiny_edit_image(seed=3)

    def run() -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        out = pipe(
            image=image,
            prompt="layers",
            layers=1,
            num_inference_steps=2,
            true_cfg_scale=1.0,
            generator=generator,
            output_type="pt",
            **prompt,
        )
        return list(out.images)

    resident = run()
    handle = enable_adaln_cache(pipe)
    assert _all_equal(run(), resident) and handle.stats.passes == 1
    keys = handle.cache.resident_plans
    assert len(keys) == 2 and {key[1] for key in keys} == {0}  # two steps, additional_t_cond 0 (is_rgb)
    assert _all_equal(run(), resident) and handle.stats.passes == 1  # the same request builds nothing
    handle.disable()
    assert _all_equal(run(), resident)


def _all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_pipeline_of_a_refused_transformer_says_why() -> None:
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=_flux(),
    )
    with pytest.raises(ConfigError, match="FluxTransformer2DModel cannot be served"):
        enable_adaln_cache(pipe)
    assert "set_timesteps" not in pipe.scheduler.__dict__


# -- load_transformer ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_root() -> Iterator[Path]:
    """Each variant saved sharded with its index (diffusers layout), as the released checkpoint is."""
    with tempfile.TemporaryDirectory(prefix="adalncache-qwen-sharded-") as tmp:
        root = Path(tmp)
        for variant in VARIANTS:
            tiny_qwen_transformer(variant).save_pretrained(root / variant, max_shard_size="40KB")
        yield root


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
@pytest.mark.parametrize("variant", VARIANTS)
def test_load_transformer_never_loads_the_served_tensors(
    sharded_root: Path, variant: str, dtype: torch.dtype | None
) -> None:
    from adalncache.diffusers import adaln_cache_handle, load_transformer

    directory = sharded_root / variant
    assert (directory / "diffusion_pytorch_model.safetensors.index.json").is_file()
    stock = diffusers.QwenImageTransformer2DModel.from_pretrained(directory, torch_dtype=dtype).eval()
    inputs = _inputs(stock, variant, 2)
    resident = _run(stock, inputs)
    model = load_transformer(directory, torch_dtype=dtype)
    handle = adaln_cache_handle(model)
    assert handle is not None and handle.spec == ModulationSpec.from_transformer(stock)
    assert _served_parameters(model) == []
    assert _parameter_bytes(model) == _parameter_bytes(stock) - sum(
        p.numel() * p.element_size() for _, p in _served_parameters(stock)
    )
    for linear in modulation_linears(model):
        assert linear.weight.device.type == "meta"
    assert torch.equal(_run(model, inputs), resident)
    handle.disable()
    for (name, ours), (_, theirs) in zip(_served_parameters(model), _served_parameters(stock)):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    assert torch.equal(_run(model, inputs), resident)


def test_load_transformer_refuses_a_prompt_dependent_class(tmp_path: Path) -> None:
    from adalncache.diffusers import load_transformer

    _flux().save_pretrained(tmp_path / "flux")
    with pytest.raises(ConfigError, match="FluxTransformer2DModel cannot be served"):
        load_transformer(tmp_path / "flux")


# -- the command line ----------------------------------------------------------------------------------


def test_cli_tables_of_a_checkpoint_serve_the_pipeline_without_a_pass(tmp_path: Path) -> None:
    """build/export/verify on a Qwen-Image repository (sharded bf16 transformer, scheduler config beside it).

    The tables are computed from the files alone (no model), for the schedule the flags name; the
    pipeline then serves a request of that schedule from the exported file with no pass at all,
    images torch.equal to the resident pipeline's: the CLI's plans and inputs are the forward's bits.
    """
    from adalncache.cli import main
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline()
    repo = tmp_path / "repo"
    pipe.transformer.to(torch.bfloat16).save_pretrained(repo / "transformer", max_shard_size="40KB")
    pipe.scheduler.save_config(repo / "scheduler")
    pipe.transformer = diffusers.QwenImageTransformer2DModel.from_pretrained(
        repo / "transformer", torch_dtype=torch.bfloat16
    ).eval()
    store, tables = tmp_path / "store", tmp_path / "tables.safetensors"
    schedule = ["--steps", "4", "--height", "32", "--width", "32", "-q"]
    assert main(["build", str(repo / "transformer"), "--store", str(store), *schedule]) == 0
    assert main(["export", str(repo / "transformer"), "-o", str(tables), "--store", str(store), *schedule]) == 0
    assert main(["verify", "--tables", str(tables), "--checkpoint", str(repo / "transformer")]) == 0

    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)

    def run() -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return pipe(
            height=32,
            width=32,
            num_inference_steps=4,
            generator=generator,
            output_type="pt",
            true_cfg_scale=1.0,
            **prompt,
        ).images

    resident = run()
    handle = enable_adaln_cache(pipe, repo / "transformer", tables=tables)
    assert torch.equal(run(), resident) and handle.stats.passes == 0
    handle.disable()


def test_cli_schedule_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from adalncache.cli import main

    directory = tmp_path / "transformer"
    tiny_qwen_transformer("layered").save_pretrained(directory)
    base = ["build", str(directory), "--store", str(tmp_path / "s")]
    cases = [
        (["--steps", "4", "--scheduler-config", str(tmp_path / "none")], "--scheduler-config"),
        (["--timesteps", "0.5"], "--additional-t-cond"),
        (["--task", "t2va", "--steps", "4"], "--task names MiniMax-H3"),
        ([], "--steps N"),
        (["--timesteps", "0.5,x", "--additional-t-cond", "1"], "--timesteps must be"),
    ]
    for flags, says in cases:
        assert main([*base, *flags]) != 0
        assert says in capsys.readouterr().err, (flags, says)
    assert not (tmp_path / "s").exists()
    assert main([*base, "--timesteps", "0.5,0.25", "--additional-t-cond", "1", "-q"]) == 0
    assert "2 distinct plan(s)" in capsys.readouterr().out
    # inspect names a two-column plan's columns (not "timesteps")
    tables = tmp_path / "tables.safetensors"
    export = ["export", str(directory), "-o", str(tables), "--store", str(tmp_path / "s")]
    assert main([*export, "--timesteps", "0.5,0.25", "--additional-t-cond", "1", "-q"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tables)]) == 0
    assert "2 plans of up to 1 rows of (timestep, additional_t_cond)" in capsys.readouterr().out


def test_cli_steps_default_to_the_released_scheduler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A transformer directory alone (no scheduler/ beside, no --scheduler-config): the released config.

    The plans are the pipeline's forward timesteps under that config, and differ from those of
    diffusers' default FlowMatchEulerDiscreteScheduler (so the default is really read).
    """
    from adalncache.cli import main
    from adalncache.integrations.diffusers import qwen_image as served

    directory = tmp_path / "transformer"
    tiny_qwen_transformer("plain").save_pretrained(directory)
    store = tmp_path / "s"
    assert (
        main(["build", str(directory), "--store", str(store), "--steps", "4", "--height", "64", "--width", "64"]) == 0
    )
    assert "released Qwen-Image scheduler config" in capsys.readouterr().out
    released = served.pipeline_timesteps(4, 64, 64, core.RELEASED_SCHEDULER)
    default = served.pipeline_timesteps(4, 64, 64, {"use_dynamic_shifting": True})
    assert not torch.equal(released, default)
    from adalncache.tools.bench.workload import QWEN_SCHEDULER

    assert QWEN_SCHEDULER is core.RELEASED_SCHEDULER  # the bench's schedules are the CLI's
    with pytest.raises(TypeError):  # shared by the CLI and the bench: nobody changes it for the others
        core.RELEASED_SCHEDULER["shift"] = 3.0  # type: ignore[index]  # wrong on purpose: the refusal is what is tested
    model = diffusers.QwenImageTransformer2DModel.from_pretrained(directory).eval()
    handle = enable_adaln_cache(model, directory, store=store, on_miss="raise")
    handle.prepare(served.schedule_timesteps(released, batch=1, dtype=torch.float32))
    assert handle.stats.passes == 0  # every plan of the released schedule came from the store
    handle.disable()


def test_a_schedule_larger_than_the_cache_builds_step_by_step(
    load_qwen: Callable[[str, str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A schedule that cannot be held whole is not an error: each forward builds its plan, images stay equal."""
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline(transformer=load_qwen("zero-cond", "fp32-memory"))
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)

    def run() -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        out = pipe(height=32, width=32, num_inference_steps=4, generator=generator, output_type="pt", **prompt)
        return out.images

    resident = run()
    handle = enable_adaln_cache(pipe, max_plans=2)
    with caplog.at_level("WARNING"):
        assert torch.equal(run(), resident)
    assert "raise max_plans (--max-plans)" in caplog.text
    assert handle.stats.passes == 4  # one per step
    handle.disable()


def test_the_load_reads_no_served_byte(tmp_path: Path) -> None:
    """Page cache dropped, then load_transformer: not one whole page of a served tensor is read or cached.

    The model is wider than the tiny one (dim 256) so that every served tensor spans whole pages;
    a stock load of the same files reads them, so the measurement sees what it looks for.
    """
    from adalncache.diffusers import load_transformer
    from adalncache.source.files import checkpoint_files
    from adalncache.tools.measure import (
        drop_page_cache,
        io_read_bytes,
        resident_served_bytes,
        served_bytes,
    )

    config = {
        "num_layers": 2,
        "attention_head_dim": 64,
        "num_attention_heads": 4,
        "in_channels": 16,
        "out_channels": 4,
        "joint_attention_dim": 24,
        "axes_dims_rope": (16, 24, 24),
    }
    built: Any = diffusers.QwenImageTransformer2DModel(**config).to(torch.bfloat16)
    directory = tmp_path / "sharded"
    built.save_pretrained(directory, max_shard_size="1MB")
    del built
    checkpoint = checkpoint_files(directory)[0]
    assert len(checkpoint) > 1
    served, total = served_bytes(checkpoint)
    assert served > 0
    if not drop_page_cache(checkpoint) or io_read_bytes() is None:
        pytest.skip("this filesystem keeps the files cached (or /proc/self/io is missing): nothing to measure")
    before = io_read_bytes()
    model = load_transformer(directory, torch_dtype=torch.bfloat16)
    read = (io_read_bytes() or 0) - (before or 0)
    assert resident_served_bytes(checkpoint) == 0
    assert read <= total - served + (1 << 20), (read, total, served)
    del model
    assert drop_page_cache(checkpoint)
    diffusers.QwenImageTransformer2DModel.from_pretrained(directory, torch_dtype=torch.bfloat16)
    assert resident_served_bytes(checkpoint) > served // 2  # the stock load reads them


@pytest.mark.parametrize("variant", ["plain", "zero-cond"])
def test_a_forward_under_autocast_equals_the_resident_one(load_qwen: Callable[[str, str], Any], variant: str) -> None:
    """fp32 weights under bf16 autocast: the forward casts the timestep to the autocast dtype (img_in's output)."""
    model = load_qwen(variant, "fp32-memory")
    inputs = _inputs(model, variant, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        resident = _run(model, inputs)
    handle = enable_adaln_cache(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert handle.prepare([inputs["timestep"]]).passes == 1
        assert torch.equal(_run(model, inputs), resident)
    assert handle.stats.passes == 1
    handle.disable()


@pytest.mark.parametrize("overlap", [False, True], ids=["foreground", "overlap"])
def test_a_scheduler_setting_nan_timesteps_is_one_clear_error(overlap: bool) -> None:
    """diffusers' flow-match scheduler with shift_terminal gives a 1-step schedule the timestep NaN
    (0 / 0); the resident pipeline returns NaN images. Served, the request raises a PlanError that
    says so and what to change, and the cache serves the next request exactly."""
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline(transformer=tiny_qwen_transformer("plain"))
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)

    def run(steps: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        images: torch.Tensor = pipe(
            height=32, width=32, num_inference_steps=steps, generator=generator, output_type="pt", **prompt
        ).images
        return images

    assert bool(torch.isnan(run(1)).all())  # the resident pipeline's own result
    resident = run(3)
    handle = enable_adaln_cache(pipe, overlap=overlap)
    with pytest.raises(PlanError, match=r"non-finite timesteps \[nan\].*num_inference_steps >= 2"):
        run(1)
    handle.join_background()
    assert not handle.cache._pool.held_slots
    handle.cache.check_invariants()
    assert torch.equal(run(3), resident)
    handle.disable()
