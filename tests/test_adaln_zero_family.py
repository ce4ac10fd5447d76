"""The AdaLayerNormZero family on tiny real diffusers models: which modules are served, and their exact input.

Every one of the eight classes is built tiny (seeded weights, no download), in fp32 and as a bf16
copy saved and loaded with diffusers' own ``save_pretrained``/``from_pretrained``. A real forward
runs with forward pre-hooks on every served projection capturing what it receives; the family's
input function, given only the plan (the forward's per-step inputs), must compute each of those
tensors bit for bit, at batch 1 and 2 and with each class's optional per-step inputs. The walk of
the model's modules must find exactly the class's list, and a model whose modules differ is refused
with the model untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import adaln_zero_helpers as tiny
from adalncache import families
from adalncache.errors import ConfigError, PlanError
from adalncache.families import adaln_zero
from adalncache.integrations.diffusers import adaln_zero as integration

#: (class, config flags): every class, and each optional input's variant.
VARIANTS = [
    (name, flags)
    for name, layout in adaln_zero.CLASSES.items()
    for flags in ([{}] + ([{flag: True for _, flag in layout.optional}] if layout.optional else []))
]

#: Classes whose forward needs timestep in the time embedder's dtype (they cast time_proj's output to it).
TIMESTEP_IN_MODEL_DTYPE = {"HunyuanImageTransformer2DModel", "HunyuanVideo15Transformer3DModel"}
#: Classes whose forward multiplies a timestep in [0, 1] by 1000.
UNIT_TIMESTEPS = {"LongCatImageTransformer2DModel", "OvisImageTransformer2DModel"}


def _id(variant: tuple[str, dict[str, bool]]) -> str:
    name, flags = variant
    return name.removesuffix("Model") + "".join(f"+{flag}" for flag in flags)


def per_step_inputs(model: nn.Module, batch: int) -> dict[str, torch.Tensor]:
    """The forward's per-step inputs, distinct per row, with values bf16 cannot hold (the casts matter)."""
    name = type(model).__name__
    dtype = next(model.parameters()).dtype
    scale = 1.0 if name in UNIT_TIMESTEPS else 1000.0
    t = torch.tensor([0.7131, 0.2459][:batch]) * scale
    inputs = {"timestep": t.to(dtype) if name in TIMESTEP_IN_MODEL_DTYPE else t}
    config = model.config
    if config.get("use_meanflow"):
        inputs[adaln_zero.TIMESTEP_R] = (torch.tensor([0.5011, 0.0][:batch]) * 1000).to(dtype)
    if config.get("guidance_embeds"):
        inputs[adaln_zero.GUIDANCE] = torch.tensor([3.5, 4.123][:batch]) * (1000 if "Hunyuan" in name else 1)
    return inputs


def capture_served_inputs(model: nn.Module, paths: list[str], kwargs: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """Run one forward with a pre-hook on each served projection; what each one received, in order."""
    seen: dict[str, list[torch.Tensor]] = {path: [] for path in paths}
    handles = []
    for path in paths:

        def hook(_: nn.Module, args: tuple[Any, ...], path: str = path) -> None:
            seen[path].append(args[0].detach().clone())

        handles.append(model.get_submodule(path).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("bf16")


def _models(variant: tuple[str, dict[str, bool]], where: Path) -> Iterator[nn.Module]:
    name, flags = variant
    fp32 = tiny.build(name, **flags)
    yield fp32
    yield tiny.save_and_load(tiny.build(name, **flags), where / _id(variant), torch.bfloat16)


@pytest.mark.parametrize("variant", VARIANTS, ids=[_id(v) for v in VARIANTS])
def test_the_input_from_the_plan_is_what_every_served_projection_receives(
    variant: tuple[str, dict[str, bool]], bf16_dir: Path
) -> None:
    for model in _models(variant, bf16_dir):
        geometry = integration.model_geometry(model)
        paths = [str(layer.id) for layer in geometry.layers]
        for batch in (1, 2):
            inputs = per_step_inputs(model, batch)
            seen = capture_served_inputs(model, paths, tiny.forward_kwargs(model, inputs, batch=batch))
            plan = integration.plan_of(inputs, geometry.plan_inputs)
            assert plan.dtype == torch.float32 and plan.shape[0] == batch
            assert plan.dim() == (1 if len(geometry.plan_inputs) == 1 else 2)
            x = integration.embed_input(model, geometry, plan, torch.device("cpu"))
            assert x.dtype == next(model.parameters()).dtype and x.shape == (batch, geometry.in_features)
            for path in paths:
                assert len(seen[path]) == 1, f"{path} ran {len(seen[path])} times"
                assert torch.equal(seen[path][0], x), f"{path} of {_id(variant)} at batch {batch}, {x.dtype}"


@pytest.mark.parametrize("variant", VARIANTS, ids=[_id(v) for v in VARIANTS])
def test_the_walk_finds_exactly_the_classes_list(variant: tuple[str, dict[str, bool]]) -> None:
    name, flags = variant
    model = tiny.build(name, **flags)
    geometry = integration.model_geometry(model)
    layout = adaln_zero.CLASSES[name]
    config = tiny.config(name, **flags)
    double = config[layout.double[1]]
    single = config[layout.single[1]] if layout.single else 0
    assert len(geometry.layers) == 2 * double + single + 1
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    assert geometry.in_features == hidden and geometry.family is adaln_zero.FAMILY
    assert geometry.layers[0].id == f"{layout.double[0]}.0.norm1.linear"
    assert geometry.layers[1].id == f"{layout.double[0]}.0.norm1_context.linear"
    assert geometry.layers[-1].id == "norm_out.linear" and geometry.layers[-1].out_features == 2 * hidden
    widths = {layer.out_features for layer in geometry.layers[: 2 * double]}
    assert widths == {6 * hidden}
    assert {layer.out_features for layer in geometry.layers[2 * double : -1]} <= {layout.single_ways * hidden}
    # Every module that computes a modulation is served or listed as resident, nothing else.
    adaln = {p for p, m in model.named_modules() if adaln_zero.ADALN_CLASS.search(type(m).__name__)}
    served = {str(layer.id).rpartition(".")[0] for layer in geometry.layers}
    resident = set(adaln_zero.resident_paths(name, config.get("num_refiner_layers", 0)))
    assert adaln == served | resident and not served & resident
    assert bool(resident) == (name in ("HunyuanImageTransformer2DModel", "HunyuanVideo15Transformer3DModel"))
    expected_inputs = ("timestep", *(inp for inp, flag in layout.optional if flags.get(flag)))
    assert geometry.plan_inputs == expected_inputs


def _state(model: nn.Module) -> tuple[str, dict[str, torch.Tensor]]:
    return repr(model), {k: v.clone() for k, v in model.state_dict().items()}


def _extra_norm(model: Any) -> None:
    from diffusers.models.normalization import AdaLayerNormZero

    model.transformer_blocks[0].extra = AdaLayerNormZero(32)


def _own_embedding(model: Any) -> None:
    from diffusers.models.normalization import AdaLayerNormZero

    model.transformer_blocks[0].norm1 = AdaLayerNormZero(32, num_embeddings=10)


def _narrow(model: Any) -> None:
    model.single_transformer_blocks[0].norm.linear = nn.Linear(32, 64)


def _one_block_less(model: Any) -> None:
    del model.single_transformer_blocks[1]


def _no_refiner_norm(model: Any) -> None:
    model.context_embedder.token_refiner.refiner_blocks[0].norm_out = nn.Identity()


@pytest.mark.parametrize(
    ("name", "change", "says"),
    [
        ("BriaTransformer2DModel", _extra_norm, "not in its list at transformer_blocks.0.extra"),
        ("OvisImageTransformer2DModel", _own_embedding, "embeds its own timestep"),
        ("LongCatImageTransformer2DModel", _narrow, "single_transformer_blocks.0.norm.linear is Linear(32 -> 64"),
        ("MotifVideoTransformer3DModel", _one_block_less, "no AdaLN module at single_transformer_blocks.1.norm"),
        ("HunyuanImageTransformer2DModel", _no_refiner_norm, "no resident token-refiner AdaLN"),
    ],
)
def test_a_model_whose_modules_differ_from_the_list_is_refused_unchanged(name: str, change: Any, says: str) -> None:
    model = tiny.build(name)
    change(model)
    before = _state(model)
    with pytest.raises(ConfigError, match=f"{name} cannot be served") as info:
        integration.model_geometry(model)
    assert says in str(info.value)
    after = _state(model)
    assert before[0] == after[0] and before[1].keys() == after[1].keys()
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])


@pytest.mark.parametrize("name", sorted(families.REFUSED))
def test_the_prompt_modulated_look_alikes_are_refused_with_the_reason(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name} cannot be served from AdaLN tables: its AdaLN input depends"):
        families.for_class(name)


def test_a_class_of_no_family_is_refused_as_not_supported() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"Linear is not a supported family: the supported families are .*adaln-zero"):
        integration.model_geometry(model)


def test_bria_with_guidance_embeds_is_refused_by_its_config() -> None:
    config = {**tiny.config("BriaTransformer2DModel"), "guidance_embeds": True}
    with pytest.raises(ConfigError, match="BriaTransformer2DModel with guidance_embeds=True cannot be served"):
        adaln_zero.fields_from_config("BriaTransformer2DModel", config)


def test_a_forward_without_an_input_the_config_enables_has_no_plan() -> None:
    plan_inputs = ("timestep", adaln_zero.TIMESTEP_R)
    with pytest.raises(PlanError, match="needs the forward's timestep_r tensor"):
        integration.plan_of({"timestep": torch.ones(2)}, plan_inputs)
    with pytest.raises(PlanError, match="timestep_r has 1 rows but timestep has 2"):
        integration.plan_of({"timestep": torch.ones(2), "timestep_r": torch.ones(1)}, plan_inputs)
    with pytest.raises(PlanError, match=r"dtype torch\.float64"):
        integration.plan_of({"timestep": torch.ones(2, dtype=torch.float64)}, ("timestep",))


@pytest.mark.parametrize(
    "name", ["HunyuanImageTransformer2DModel", "AuraFlowTransformer2DModel", "OvisImageTransformer2DModel"]
)
def test_the_meta_device_sizes_are_the_real_models_bytes(name: str) -> None:
    """The README's served bytes and shares (counted on meta) are what a real bf16 model of that config holds."""
    from adalncache.fit import count_model, recipes

    counted = count_model({"_class_name": name, **tiny.config(name)}, source=name, label="tiny")
    sizes = counted.footprint(recipes()["bf16"])
    model = tiny.build(name, dtype=torch.bfloat16)
    geometry = integration.model_geometry(model)
    served = {p for layer in geometry.layers for p in model.get_submodule(str(layer.id)).parameters()}
    assert sizes.served == sum(p.numel() * p.element_size() for p in served)
    assert sizes.total == sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(counted.spec.layers()) == len(geometry.layers) and 0 < sizes.served < sizes.total


def test_classes_of_the_same_module_names_have_distinct_table_identities() -> None:
    """Bria, LongCat-Image and Ovis-Image of one size share module paths and widths but not their temb: a table
    bound to one is never another's."""
    names = ("BriaTransformer2DModel", "LongCatImageTransformer2DModel", "OvisImageTransformer2DModel")
    config = {"num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1, "num_single_layers": 1}
    geometries = [adaln_zero.geometry_from_config(name, config) for name in names]
    assert len({tuple(str(layer.id) for layer in g.layers) for g in geometries}) == 1
    assert len({str(g.describe()) for g in geometries}) == len(names)
