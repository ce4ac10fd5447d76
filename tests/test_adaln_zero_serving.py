"""enable_adaln_cache on the AdaLayerNormZero family's classes: freed, exact, one pass, restorable, refusals.

Each class is built tiny (seeded, no download) in fp32, and as a bf16 copy saved and loaded with
diffusers' own ``save_pretrained``/``from_pretrained``. A few denoising steps at batch 1 and 2 (the
batch-2 rows identical as a cond/uncond concatenation makes them, or distinct) run resident first;
with the cache enabled and the steps prepared in one pass, every output is ``torch.equal`` to the
resident one, the served projections hold no bytes, and ``disable()`` gives the weights back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

import adaln_zero_helpers as tiny
from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError, PlanError
from adalncache.families import adaln_zero
from adalncache.integrations.diffusers.handle import HANDLE_ATTRIBUTE
from tiny_helpers import parameter_bytes

#: (class, flags) of every served class, with each optional input's variant (AuraFlow's projections have no bias).
SERVED = [
    (name, flags)
    for name, layout in adaln_zero.CLASSES.items()
    for flags in ([{}] + ([{flag: True for _, flag in layout.optional}] if layout.optional else []))
]
TIMESTEP_IN_MODEL_DTYPE = {"HunyuanImageTransformer2DModel", "HunyuanVideo15Transformer3DModel"}
UNIT_TIMESTEPS = {"LongCatImageTransformer2DModel", "OvisImageTransformer2DModel"}
STEPS = (0.9137, 0.6021, 0.3347)


def _id(variant: tuple[str, dict[str, bool]]) -> str:
    name, flags = variant
    return name.removesuffix("Model") + "".join(f"+{flag}" for flag in flags)


def step_inputs(model: nn.Module, step: int, batch: int, same_rows: bool) -> dict[str, torch.Tensor]:
    """The per-step inputs of one forward, as a pipeline passes them (dtypes included)."""
    name = type(model).__name__
    dtype = next(model.parameters()).dtype
    scale = 1.0 if name in UNIT_TIMESTEPS else 1000.0
    rows = [STEPS[step]] * batch if same_rows else [STEPS[step] * (1 - 0.3 * i) for i in range(batch)]
    t = torch.tensor(rows) * scale
    inputs = {"timestep": t.to(dtype) if name in TIMESTEP_IN_MODEL_DTYPE else t}
    config: Any = model.config
    if config.get("use_meanflow"):
        following = STEPS[step + 1] if step + 1 < len(STEPS) else 0.0
        inputs[adaln_zero.TIMESTEP_R] = (torch.tensor([following] * batch) * 1000).to(dtype)
    if config.get("guidance_embeds"):
        inputs[adaln_zero.GUIDANCE] = torch.tensor([4.5] * batch) * (1000 if "Hunyuan" in name else 1)
    return inputs


#: The forwards of a request: every step at batch 1, at batch 2 with identical rows, and distinct rows.
FORWARDS = [(step, batch, same) for step in range(len(STEPS)) for batch, same in ((1, True), (2, True), (2, False))]


def run(model: nn.Module) -> list[torch.Tensor]:
    outputs = []
    for step, batch, same in FORWARDS:
        kwargs = tiny.forward_kwargs(model, step_inputs(model, step, batch, same), batch=batch, seed=step)
        with torch.no_grad():
            outputs.append(model(**kwargs)[0])
    return outputs


def request_plans(model: nn.Module) -> list[Any]:
    """What a caller prepares: the timestep tensor, or a mapping of the per-step inputs by argument name."""
    plans = []
    for step, batch, same in FORWARDS:
        inputs = step_inputs(model, step, batch, same)
        plans.append(inputs["timestep"] if len(inputs) == 1 else inputs)
    return plans


def served_bytes(model: nn.Module) -> int:
    geometry_layers = adaln_zero.served_paths(type(model).__name__, *_counts(model))
    return sum(
        p.numel() * p.element_size()
        for path, _, _ in geometry_layers
        for p in model.get_submodule(path).parameters()
        if p.device.type != "meta"
    )


def _counts(model: nn.Module) -> tuple[int, int]:
    fields = adaln_zero.fields_from_config(type(model).__name__, model.config)
    return fields["double_layers"], fields["single_layers"]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _assert_state_equal(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    for name, tensor in state.items():
        assert tensor.device.type != "meta" and tensor.dtype == snapshot[name].dtype, name
        assert torch.equal(tensor, snapshot[name]), name


@pytest.mark.parametrize("precision", ["fp32-memory", "bf16-disk"])
@pytest.mark.parametrize("variant", SERVED, ids=[_id(v) for v in SERVED])
def test_enabled_forwards_equal_the_resident_ones_with_the_projections_freed(
    variant: tuple[str, dict[str, bool]], precision: str, tmp_path: Path
) -> None:
    name, flags = variant
    model = tiny.build(name, **flags)
    if precision == "bf16-disk":
        model = tiny.save_and_load(model, tmp_path / "model", torch.bfloat16)
    resident = run(model)
    snapshot = _snapshot(model)
    before, served = parameter_bytes(model), served_bytes(model)
    assert served > 0

    handle = enable_adaln_cache(model)
    assert served_bytes(model) == 0
    assert parameter_bytes(model) <= before - served  # the served projections (and time embedders) are gone
    assert model.get_submodule("norm_out.linear").weight.device.type == "meta"
    assert handle.prepare(request_plans(model)).passes == 1
    assert handle.prepare(request_plans(model)).passes == 0  # a repeated request builds nothing
    cached = run(model)
    for i, (r, c) in enumerate(zip(resident, cached)):
        assert torch.equal(r, c), f"forward {FORWARDS[i]} differs"
    assert handle.stats.passes == 1

    handle.disable()
    assert parameter_bytes(model) == before
    _assert_state_equal(model, snapshot)
    assert all(torch.equal(r, c) for r, c in zip(resident, run(model)))


def test_the_time_embedder_can_stay() -> None:
    model = tiny.build("OvisImageTransformer2DModel")
    resident = run(model)
    handle = enable_adaln_cache(model, free_time_embedder=False)
    assert model.timestep_embedder.linear_1.weight.device.type == "cpu"
    assert model.single_transformer_blocks[0].norm.linear.weight.device.type == "meta"
    handle.prepare(request_plans(model))
    assert all(torch.equal(r, c) for r, c in zip(resident, run(model)))
    handle.disable()


def test_a_forward_missing_an_input_its_config_enables_is_a_plan_error() -> None:
    model = tiny.build("HunyuanVideo15Transformer3DModel", use_meanflow=True)
    handle = enable_adaln_cache(model)
    inputs = step_inputs(model, 0, 1, True)
    del inputs[adaln_zero.TIMESTEP_R]
    with pytest.raises(PlanError, match="needs the forward's timestep_r tensor"), torch.no_grad():
        model(**tiny.forward_kwargs(model, inputs, batch=1))
    handle.disable()


def _unchanged_refusal(model: nn.Module, match: str) -> None:
    snapshot, text = _snapshot(model), repr(model)
    with pytest.raises(ConfigError, match=match):
        enable_adaln_cache(model)
    assert repr(model) == text and getattr(model, HANDLE_ATTRIBUTE, None) is None
    _assert_state_equal(model, snapshot)


def test_auraflow_is_served_without_a_bias_anywhere(tmp_path: Path) -> None:
    """AuraFlow's projections are ``nn.Linear(..., bias=False)``: the geometry says so, the checkpoint holds no
    bias, enabling parks only the weights (no bias appears), and disable() leaves the biases None."""
    from adalncache import ModulationSpec

    model = tiny.build("AuraFlowTransformer2DModel")
    spec = ModulationSpec.from_transformer(model)
    assert not any(spec.has_bias(layer) for layer in spec.layers())
    assert all(spec.tensors_of(layer) == ("weight",) for layer in spec.layers())
    model.save_pretrained(tmp_path / "aura")
    assert ModulationSpec.from_checkpoint(tmp_path / "aura") == spec
    resident = run(model)
    handle = enable_adaln_cache(model, checkpoint=tmp_path / "aura")
    assert handle.prepare(request_plans(model)).passes == 1
    assert all(torch.equal(r, c) for r, c in zip(resident, run(model)))
    for layer in spec.layers():
        linear = model.get_submodule(str(layer))
        assert linear.weight.device.type == "meta" and linear.bias is None
    handle.disable()
    for layer in spec.layers():
        assert model.get_submodule(str(layer)).bias is None
    assert all(torch.equal(r, c) for r, c in zip(resident, run(model)))


def test_a_model_whose_modules_differ_from_its_classes_list_is_refused_unchanged() -> None:
    from diffusers.models.normalization import AdaLayerNormZero

    model = tiny.build("BriaTransformer2DModel")
    model.transformer_blocks[1].norm1_context = AdaLayerNormZero(32, num_embeddings=4)
    _unchanged_refusal(model, "BriaTransformer2DModel cannot be served: its modules differ .* embeds its own timestep")


def test_flux_and_sd3_are_refused_as_prompt_modulated_unchanged() -> None:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    flux = FluxTransformer2DModel(
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        pooled_projection_dim=8,
        in_channels=8,
        axes_dims_rope=(4, 6, 6),
    )
    _unchanged_refusal(flux, "FluxTransformer2DModel cannot be served from AdaLN tables: .*pooled text")
    sd3 = SD3Transformer2DModel(
        sample_size=8,
        in_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        caption_projection_dim=32,
        pooled_projection_dim=8,
        out_channels=4,
    )
    _unchanged_refusal(sd3, "SD3Transformer2DModel cannot be served from AdaLN tables: .*pooled text")


def test_a_class_of_no_family_is_refused_as_not_supported() -> None:
    from diffusers import SanaTransformer2DModel

    sana = SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=24,
        sample_size=8,
    )
    _unchanged_refusal(sana, "SanaTransformer2DModel is not a supported family")


#: Every class's diffusers pipelines (HunyuanVideo-1.5's text-to-video and image-to-video), each
#: run in fp32 from memory; Bria (cond and uncond concatenated) and Ovis-Image (two forwards a step)
#: also as bf16 files saved and loaded by diffusers.
PIPELINE_RUNS = [(pipeline, "fp32-memory") for pipelines in tiny.PIPELINES.values() for pipeline in pipelines] + [
    ("BriaPipeline", "bf16-disk"),
    ("OvisImagePipeline", "bf16-disk"),
]


@pytest.mark.parametrize(("pipeline", "precision"), PIPELINE_RUNS, ids=lambda v: str(v))
def test_a_pipeline_request_is_built_in_one_pass_and_repeats_build_nothing(
    pipeline: str, precision: str, tmp_path: Path
) -> None:
    """The pipeline's own denoising loop, classifier-free guidance included (AuraFlow, Bria and Bria-FIBO
    concatenate cond and uncond: 2 identical rows a forward; the others run separate forwards), with
    each optional per-step input the pipeline passes (HunyuanImage: timestep_r and guidance;
    HunyuanVideo-1.5 image-to-video: timestep_r).

    The tiny pipelines have no text encoder (T5, Qwen2.5-VL, Qwen3, T5Gemma and SmolLM3 need tokenizer
    files that cannot be made offline): requests pass seeded prompt embeddings, or, for Bria-FIBO and
    LongCat-Image whose pipelines take text only, text whose encoding is seeded; they return latents.
    """
    name = next(n for n, p in tiny.PIPELINES.items() if pipeline in p)
    transformer = tiny.pipeline_transformer(name, **tiny.PIPELINE_FLAGS.get(pipeline, {}))
    if precision == "bf16-disk":
        transformer = tiny.save_and_load(transformer, tmp_path / "model", torch.bfloat16)
    pipe = tiny.tiny_pipeline(transformer, pipeline)

    def run(steps: int) -> torch.Tensor:
        return pipe(**tiny.request(pipe, steps))[0]

    resident = {steps: run(steps) for steps in (3, 4)}
    handle = enable_adaln_cache(pipe)
    assert torch.equal(run(4), resident[4]) and handle.stats.passes == 1
    assert len(handle.cache) == 4  # every step's plan, prepared before the first step ran
    assert served_bytes(transformer) == 0
    assert torch.equal(run(4), resident[4]) and handle.stats.passes == 1  # the same request: no pass
    assert torch.equal(run(3), resident[3]) and handle.stats.passes == 2  # a new schedule: one pass
    handle.disable()
    assert "set_timesteps" not in pipe.scheduler.__dict__
    assert torch.equal(run(4), resident[4])


#: How each class's diffusers pipeline turns a scheduler timestep ``t`` into the forward's per-step
#: inputs (the lines of its denoising loop), for the classes whose pipelines are not built tiny here.
PIPELINE_STEP: dict[str, Any] = {
    # pipeline_hunyuanimage.py: t.expand(B).to(dtype); timestep_r the next timestep (0 at the end),
    # expanded then cast; guidance the distilled scale in the transformer's dtype times 1000.
    "HunyuanImageTransformer2DModel": lambda t, nxt, b, d: {
        "timestep": t.expand(b).to(d),
        "timestep_r": nxt.expand(b).to(d),
        "guidance": torch.tensor([3.5] * b, dtype=d) * 1000.0,
    },
    # pipeline_hunyuan_video1_5_image2video.py: as HunyuanImage's without guidance.
    "HunyuanVideo15Transformer3DModel": lambda t, nxt, b, d: {
        "timestep": t.expand(b).to(d),
        "timestep_r": nxt.expand(b).to(d),
    },
    # pipeline_motif_video.py: t.expand(B).
    "MotifVideoTransformer3DModel": lambda t, nxt, b, d: {"timestep": t.expand(b)},
    # pipeline_longcat_image.py: t.expand(B).to(dtype), passed as timestep / 1000.
    "LongCatImageTransformer2DModel": lambda t, nxt, b, d: {"timestep": t.expand(b).to(d) / 1000},
    # pipeline_aura_flow.py: torch.tensor([t / 1000]).expand(2B) (cond and uncond concatenated), then cast.
    "AuraFlowTransformer2DModel": lambda t, nxt, b, d: {"timestep": torch.tensor([t / 1000]).expand(b).to(d)},
    # pipeline_bria_fibo.py: t.expand(B).to(dtype); guidance as the caller passes it.
    "BriaFiboTransformer2DModel": lambda t, nxt, b, d: {
        "timestep": t.expand(b).to(d),
        "guidance": torch.tensor([5.0] * b),
    },
}


@pytest.mark.parametrize("name", sorted(PIPELINE_STEP))
def test_a_schedule_read_from_the_first_forward_covers_every_step(name: str, tmp_path: Path) -> None:
    """The family's schedule_plans, given a scheduler's timesteps and a request's first forward as the
    class's pipeline builds it, prepares plans that every later forward hits (on_miss="raise")."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    flags = {flag: True for _, flag in adaln_zero.CLASSES[name].optional}
    model = tiny.save_and_load(tiny.build(name, **flags), tmp_path / "model", torch.bfloat16)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    timesteps = scheduler.timesteps
    following = [*timesteps[1:], torch.tensor(0.0)]
    forwards = [PIPELINE_STEP[name](t, n, 2, torch.bfloat16) for t, n in zip(timesteps, following)]
    resident = []
    for inputs in forwards:
        with torch.no_grad():
            resident.append(model(**tiny.forward_kwargs(model, inputs, batch=2))[0])

    handle = enable_adaln_cache(model, on_miss="raise")
    first = tiny.forward_kwargs(model, forwards[0], batch=2)
    plans = handle.family.schedule_plans(model, timesteps, (), first)
    assert plans is not None and len(plans) == len(timesteps)
    assert handle.prepare(plans).passes == 1
    for inputs, expected in zip(forwards, resident):
        with torch.no_grad():
            assert torch.equal(model(**tiny.forward_kwargs(model, inputs, batch=2))[0], expected)
    assert handle.stats.passes == 1
    # A first forward no conversion of the schedule gives: no plans (they would build per forward).
    other = tiny.forward_kwargs(model, {**forwards[0], "timestep": forwards[0]["timestep"] + 7}, batch=2)
    assert handle.family.schedule_plans(model, timesteps, (), other) is None
    handle.disable()


# -- checkpoints and load_transformer ---------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        ("HunyuanImageTransformer2DModel", {"use_meanflow": True, "guidance_embeds": True}),
        ("BriaTransformer2DModel", {}),
        ("AuraFlowTransformer2DModel", {}),
    ],
    ids=_id,
)
def test_load_transformer_never_loads_the_served_tensors(variant: tuple[str, dict[str, bool]], tmp_path: Path) -> None:
    """A sharded bf16 diffusers checkpoint: the spec from its headers is the model's, the served projections stay
    meta placeholders, the forwards equal the stock model's, and disable() reads them back exactly."""
    from adalncache import ModulationSpec
    from adalncache.diffusers import adaln_cache_handle, load_transformer

    name, flags = variant
    directory = tmp_path / "model"
    tiny.build(name, **flags).to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
    assert (directory / "diffusion_pytorch_model.safetensors.index.json").is_file()
    stock = tiny.model_class(name).from_pretrained(directory, torch_dtype=torch.bfloat16).eval()
    resident = run(stock)
    assert ModulationSpec.from_checkpoint(directory) == ModulationSpec.from_transformer(stock)
    model = load_transformer(directory, torch_dtype=torch.bfloat16)
    handle = adaln_cache_handle(model)
    assert handle is not None and handle.spec == ModulationSpec.from_transformer(stock)
    assert served_bytes(model) == 0
    assert parameter_bytes(model) <= parameter_bytes(stock) - served_bytes(stock)
    assert handle.prepare(request_plans(model)).passes == 1
    assert all(torch.equal(r, c) for r, c in zip(resident, run(model)))
    handle.disable()
    _assert_state_equal(model, _snapshot(stock))
    assert all(torch.equal(r, c) for r, c in zip(resident, run(model)))


@pytest.mark.parametrize("variant", SERVED, ids=_id)
def test_load_transformer_reads_neither_projections_nor_the_time_embedder(
    variant: tuple[str, dict[str, bool]], tmp_path: Path
) -> None:
    """Every class and variant: the parameters a stock load has and this load lacks are exactly the served
    projections and the linears of the class's own time embedders (the optional ones its config enables);
    the first request still equals the stock model's."""
    from adalncache.diffusers import adaln_cache_handle, load_transformer

    name, flags = variant
    directory = tmp_path / "model"
    tiny.build(name, **flags).to(torch.bfloat16).save_pretrained(directory)
    stock = tiny.model_class(name).from_pretrained(directory, torch_dtype=torch.bfloat16).eval()
    model = load_transformer(directory, torch_dtype=torch.bfloat16)
    layout = adaln_zero.CLASSES[name]
    never_loaded = set(dict(stock.named_parameters())) - set(dict(model.named_parameters()))
    embedders = {n for n, _ in stock.named_parameters() if n.startswith(tuple(f"{e}." for e in layout.time_embedders))}
    served = set(_served_paths(stock))
    projections = {n for n, _ in stock.named_parameters() if n.rsplit(".", 1)[0] in served}
    assert embedders and never_loaded == projections | embedders
    handle = adaln_cache_handle(model)
    assert handle is not None
    assert handle.prepare(request_plans(model)).passes == 1
    assert all(torch.equal(r, c) for r, c in zip(run(stock), run(model)))


def _served_paths(model: nn.Module) -> list[str]:
    """The module paths of the projections the cache serves on ``model``."""
    from adalncache import ModulationSpec
    from adalncache.integrations.diffusers.adaln_zero import FAMILY

    return [FAMILY.projection_path(layer) for layer in ModulationSpec.from_transformer(model).layers()]


def test_a_checkpoint_of_another_structure_is_refused(tmp_path: Path) -> None:
    import json

    from adalncache import ModulationSpec
    from adalncache.errors import CheckpointError

    directory = tmp_path / "ovis"
    tiny.build("OvisImageTransformer2DModel").save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_single_layers": 3}))
    with pytest.raises(CheckpointError, match=r"single_transformer_blocks\.2\.norm\.linear\.weight is missing"):
        ModulationSpec.from_checkpoint(directory)


def test_the_store_serves_another_handle_without_a_pass(tmp_path: Path) -> None:
    """Served from its diffusers checkpoint (verified against the model at enable), tables stored by one model are
    found by a fresh model of the same weights: no pass, equal outputs."""
    flags = {"use_meanflow": True, "guidance_embeds": True}
    model = tiny.save_and_load(tiny.build("HunyuanImageTransformer2DModel", **flags), tmp_path / "model")
    resident = run(model)
    handle = enable_adaln_cache(model, tmp_path / "model", store=tmp_path / "store")
    assert handle.prepare(request_plans(model)).passes == 1
    assert all(torch.equal(r, c) for r, c in zip(resident, run(model)))
    handle.disable()
    again = tiny.model_class("HunyuanImageTransformer2DModel").from_pretrained(
        tmp_path / "model", torch_dtype=torch.bfloat16
    )
    handle = enable_adaln_cache(again.eval(), tmp_path / "model", store=tmp_path / "store")
    report = handle.prepare(request_plans(again))
    assert report.passes == 0 and report.store_hits > 0
    assert all(torch.equal(r, c) for r, c in zip(resident, run(again)))
    handle.disable()


def test_a_bound_table_file_serves_a_fresh_model_without_weights(tmp_path: Path) -> None:
    """Tables exported from a checkpoint-served model (bound to its weights, the family in the binding) serve a
    fresh model of those weights with its projections freed and no weight source: no pass, outputs equal."""
    from adalncache.offline import export_tables
    from adalncache.plans import distinct_plans
    from adalncache.source.memory import NoWeights

    name, flags = "BriaFiboTransformer2DModel", {"guidance_embeds": True}
    model = tiny.save_and_load(tiny.build(name, **flags), tmp_path / "model")
    resident = run(model)
    handle = enable_adaln_cache(model, tmp_path / "model", free_time_embedder=False)
    plans = [handle.family.request_plan(model, plan) for plan in request_plans(model)]
    keys, tensors = distinct_plans(plans, columns=handle.spec.plan_columns)

    def embed(plan: torch.Tensor) -> Any:
        return handle.family.embed(model, handle.spec, plan, torch.device("cpu"))

    out = tmp_path / "tables.safetensors"
    export_tables(handle.cache, [tensors[k] for k in keys], out, embed=embed, progress=False)
    handle.disable()

    fresh = tiny.model_class(name).from_pretrained(tmp_path / "model", torch_dtype=torch.bfloat16)
    handle = enable_adaln_cache(fresh.eval(), tables=out)
    assert isinstance(handle.cache.source, NoWeights) and served_bytes(fresh) == 0
    assert all(torch.equal(r, c) for r, c in zip(resident, run(fresh)))
    assert handle.stats.passes == 0 and handle.stats.table_hits > 0


def _compiled_counts(name: str, cache: bool) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny.build(name)
    handle = enable_adaln_cache(model) if cache else None
    if handle is not None:
        handle.prepare(request_plans(model))
    model.compile_repeated_blocks(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    outputs = run(model)
    counts = (
        counters["frames"]["total"],
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        sum(counters["recompiles"].values()),
    )
    if handle is not None:
        handle.disable()
    return outputs, counts


@pytest.mark.parametrize("name", ["OvisImageTransformer2DModel", "HunyuanVideo15Transformer3DModel"])
def test_regional_compile_compiles_no_more_than_the_resident_model(name: str) -> None:
    """``compile_repeated_blocks``: the served AdaLN class is one class per kind for every block, so the cached
    model compiles the same frames, graphs, breaks and recompiles as the resident one, with equal outputs."""
    resident, resident_counts = _compiled_counts(name, cache=False)
    cached, cached_counts = _compiled_counts(name, cache=True)
    assert all(torch.equal(r, c) for r, c in zip(resident, cached))
    assert cached_counts == resident_counts, (cached_counts, resident_counts)


def _lora(model: nn.Module) -> None:
    from peft import LoraConfig

    targets = ["norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "timestep_embedder.linear_1"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model.add_adapter(LoraConfig(r=2, target_modules=targets, init_lora_weights=False))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_lora_on_the_served_modules_is_served_exactly(when: str) -> None:
    """A peft LoRA on every served projection and the time embedder, loaded before or after enabling."""
    pytest.importorskip("peft")
    name = "OvisImageTransformer2DModel"
    resident = tiny.build(name)
    _lora(resident)
    expected = run(resident)
    model = tiny.build(name)
    assert not torch.equal(run(model)[0], expected[0])  # the LoRA changes the outputs
    if when == "before":
        _lora(model)
    handle = enable_adaln_cache(model)
    if when == "after":
        _lora(model)
    assert all(torch.equal(r, c) for r, c in zip(expected, run(model)))
    handle.disable()
    assert all(torch.equal(r, c) for r, c in zip(expected, run(model)))


@pytest.mark.parametrize(
    ("pipeline", "flags"),
    [("BriaFiboPipeline", {"guidance_embeds": True}), ("HunyuanVideo15Pipeline", {"use_meanflow": True})],
)
def test_a_pipeline_leaving_out_an_input_the_config_enables_is_a_plan_error(
    pipeline: str, flags: dict[str, bool]
) -> None:
    """Bria-FIBO's pipeline passes no guidance, HunyuanVideo-1.5's text-to-video pipeline no timestep_r: the
    stock forward then skips that embedding, but a plan cannot mark an input absent, so serving refuses."""
    name = next(n for n, p in tiny.PIPELINES.items() if pipeline in p)
    pipe = tiny.tiny_pipeline(tiny.pipeline_transformer(name, **flags), pipeline)
    resident = pipe(**tiny.request(pipe, 2))[0]  # the stock pipeline runs
    assert torch.isfinite(resident).all()
    handle = enable_adaln_cache(pipe)
    missing = adaln_zero.GUIDANCE if "guidance_embeds" in flags else adaln_zero.TIMESTEP_R
    with pytest.raises(PlanError, match=f"needs the forward's {missing} tensor"):
        pipe(**tiny.request(pipe, 2))
    handle.disable()
    assert torch.equal(pipe(**tiny.request(pipe, 2))[0], resident)


@pytest.mark.parametrize("name", ["HunyuanImageTransformer2DModel", "BriaTransformer2DModel"])
def test_load_transformer_leaves_the_served_pages_unread(name: str, tmp_path: Path) -> None:
    """Page cache dropped, then load: no whole page inside a served projection or the class's time-embedder
    linears is cached afterwards (nothing read them). A stock load of the same files caches them, so the
    measurement can see what it looks for."""
    from adalncache.diffusers import load_transformer
    from adalncache.source.files import CheckpointFiles
    from adalncache.tools.measure import PAGE, cached_fraction, drop_page_cache

    flags = {flag: True for _, flag in adaln_zero.CLASSES[name].optional}
    directory = tmp_path / "model"
    tiny.build(name, **flags).to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
    files = sorted(directory.glob("*.safetensors"))
    stock = tiny.model_class(name).from_pretrained(directory, torch_dtype=torch.bfloat16)
    served = {f"{path}.{part}" for path in _served_paths(stock) for part in ("weight", "bias")}
    embedders = tuple(f"{e}." for e in adaln_zero.CLASSES[name].time_embedders)
    served |= {n for n, _ in stock.named_parameters() if n.startswith(embedders)}
    del stock

    def cached() -> int:
        total = 0
        for header in CheckpointFiles.read(files).headers:
            for key, entry in header.entries.items():
                first, last = -(-entry.begin // PAGE) * PAGE, entry.end // PAGE * PAGE
                if key in served and last > first:
                    total += round((cached_fraction(header.path, first, last - first) or 0.0) * (last - first))
        return total

    if not drop_page_cache(files) or cached() != 0:
        pytest.skip("this filesystem keeps the files cached: nothing to measure")
    model = load_transformer(directory, torch_dtype=torch.bfloat16)
    assert cached() == 0
    del model
    assert drop_page_cache(files)
    tiny.model_class(name).from_pretrained(directory, torch_dtype=torch.bfloat16)
    assert cached() > 0  # the stock load reads them
