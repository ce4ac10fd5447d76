"""``adalncache fit``: the bytes each recipe needs on a card, counted on the meta device, checked here
against independent counts, hand arithmetic and the ``gguf`` package; and the README's tables are
exactly what the command prints for the released configs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from adalncache import ModulationSpec
from adalncache.cli import main
from adalncache.fit import (
    CARDS_GIB,
    GGUF_TYPES,
    PLACEMENTS,
    RELEASED,
    Footprint,
    Parameter,
    count_model,
    open_model,
    recipes,
    released_model,
)

diffusers = pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]


def independent_count(class_name: str, config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(served parameters, all parameters, served bf16 bytes, all bf16 bytes) of the model built on meta here,
    the served projections found by their module paths (fp32 for the modules the class keeps in fp32)."""
    cls = getattr(diffusers, class_name)
    with torch.device("meta"):
        model = cls(**config)
    paths = {
        {"final": "norm_out.linear"}.get(layer, f"transformer_blocks.{layer}.adaln_proj.linear")
        if not isinstance(layer, str) or layer == "final"
        else layer
        for layer in ModulationSpec.from_transformer(model).layers()
    }
    served = {name for path in paths for name, _ in model.get_submodule(path).named_parameters(prefix=path)}
    keep = cls._keep_in_fp32_modules or []
    size = {
        name: p.numel() * (4 if any(k in name.split(".") for k in keep) else 2) for name, p in model.named_parameters()
    }
    numel = {name: p.numel() for name, p in model.named_parameters()}
    return (
        sum(numel[n] for n in served),
        sum(numel.values()),
        sum(size[n] for n in served),
        sum(size.values()),
    )


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["fit", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def tiny_config(class_name: str) -> dict[str, Any]:
    """A small config of each supported class (the test suites' tiny models)."""
    if class_name == "MiniMaxH3Transformer3DModel":
        from adalncache.tools.tiny import SIZES

        return dict(SIZES["tiny"])
    if class_name == "QwenImageTransformer2DModel":
        from adalncache.tools.tiny_qwen import BASE

        return dict(BASE)
    from adaln_zero_helpers import config

    return config(class_name)


def write_pipeline(root: Path, class_name: str, config: dict[str, Any]) -> Path:
    """A pipeline's root with ``model_index.json`` and ``transformer/config.json`` (no weights)."""
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(
        json.dumps({"_class_name": "Pipeline", "transformer": ["diffusers", class_name]})
    )
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": class_name, **config}))
    return root


# ---------------------------------------------------------------------------------------------
# the counts


@pytest.mark.parametrize("name", list(RELEASED))
def test_every_released_model_is_counted_as_the_meta_device_holds_it(name: str) -> None:
    """Served and total parameters and bf16 bytes equal a count made here on the meta device, for every class."""
    class_name, overrides, _, _ = RELEASED[name]
    model = released_model(name)
    served, total, served_bytes, total_bytes = independent_count(class_name, dict(overrides))
    assert (model.count(served=True), model.count()) == (served, total)
    bf16 = model.footprint(recipes()["bf16"])
    assert (bf16.served, bf16.total) == (served_bytes, total_bytes)
    assert len(model.spec.layers()) == len(model.served_paths) > 0


def test_every_supported_class_is_one_released_name() -> None:
    """One released config per supported class: the README's tables list every class the cache serves."""
    from adalncache import families

    classes = {name for family in families.FAMILIES.values() for name in family.class_names}
    assert sorted(class_name for class_name, _, _, _ in RELEASED.values()) == sorted(classes)


@pytest.mark.parametrize("class_name", sorted(class_name for class_name, _, _, _ in RELEASED.values()))
def test_every_class_through_the_command(class_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline's root, the transformer directory and its bare config.json give the same counts, which are the
    meta device's; the released name runs too."""
    config = tiny_config(class_name)
    root = write_pipeline(tmp_path / "pipe", class_name, config)
    served, total, _, _ = independent_count(class_name, config)
    for model in (root, root / "transformer", root / "transformer" / "config.json"):
        code, out, err = run([str(model), "--json"], capsys)
        assert code == 0, err
        found = json.loads(out)["model"]
        assert (found["class"], found["served_parameters"], found["parameters"]) == (class_name, served, total)
        assert found["stored"] is None
    name = next(n for n, released in RELEASED.items() if released[0] == class_name)
    code, out, _ = run(["--released", name], capsys)
    assert code == 0 and class_name in out and "Not counted:" in out


def test_the_stored_recipe_is_the_headers_bytes(tiny_saved_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A saved checkpoint: the stored recipe is the bytes its headers give (nothing else read), by block and
    served tensor; the released precision's projections are bf16, so its served bytes are the bf16 recipe's."""
    from adalncache.source.files import SafetensorsHeader

    directory = tiny_saved_root / "bf16"
    entries = {n: e for f in directory.glob("*.safetensors") for n, e in SafetensorsHeader.read(f).entries.items()}
    code, out, err = run([str(directory), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    stored = data["model"]["stored"]
    assert stored["bytes"] == sum(e.nbytes for e in entries.values())
    assert set(stored["dtypes"]) == {"BF16", "F32"} and stored["quantized"] is None
    rows = {(r["recipe"], r["placement"]): r for r in data["rows"]}
    assert rows["stored", "resident"]["without_cache_bytes"] == stored["bytes"]
    assert rows["stored", "resident"]["served_bytes"] == rows["bf16", "resident"]["served_bytes"]
    assert rows["stored", "resident"]["without_cache_bytes"] == rows["bf16", "resident"]["without_cache_bytes"]
    code, out, _ = run([str(directory)], capsys)
    assert code == 0 and "not quantized" in out and "as stored" in out


def test_a_quantized_checkpoint_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An fp8 weight in the headers, or a quantization_config in config.json, says the checkpoint is quantized."""
    from safetensors.torch import save_file

    config = {"_class_name": "QwenImageTransformer2DModel", **tiny_config("QwenImageTransformer2DModel")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weight = torch.zeros(4, 32).to(torch.float8_e4m3fn)
    save_file({"transformer_blocks.0.attn.to_q.weight": weight}, str(tmp_path / "model.safetensors"))
    code, out, err = run([str(tmp_path), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["model"]["stored"]["quantized"] == "tensors of F8_E4M3"
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    code, out, _ = run([str(tmp_path), "--json"], capsys)
    assert json.loads(out)["model"]["stored"]["quantized"] == "quantization_config gguf"


# ---------------------------------------------------------------------------------------------
# the arithmetic


def test_recipe_arithmetic_on_a_hand_checked_case() -> None:
    """Every recipe and placement on a few parameters, against numbers worked out by hand."""
    params = [
        Parameter("blocks.0.proj.weight", (512, 256), linear=True, fp32=False, block="blocks.0", served=True),
        Parameter("blocks.0.proj.bias", (512,), linear=False, fp32=False, block="blocks.0", served=True),
        Parameter("blocks.0.ff.weight", (256, 300), linear=True, fp32=False, block="blocks.0", served=False),
        Parameter("blocks.1.ff.weight", (256, 256), linear=True, fp32=False, block="blocks.1", served=False),
        Parameter("norm_out.linear.weight", (64, 256), linear=True, fp32=False, block=None, served=True),
        Parameter("time.linear.weight", (256, 256), linear=True, fp32=True, block=None, served=False),
        Parameter("table", (4, 16), linear=False, fp32=False, block=None, served=False),
    ]
    by_hand = {
        # 2 bytes a parameter, 4 in a module kept in fp32
        "bf16": [262144, 1024, 153600, 131072, 32768, 262144, 128],
        # 1 byte a linear weight plus 4 per output row; the fp32 module's linear and the rest as bf16
        "8bit": [133120, 1024, 77824, 66560, 16640, 262144, 128],
        # half a byte a linear weight plus 4 per group of 64
        "4bit": [73728, 1024, 43200, 36864, 9216, 262144, 128],
        # 34 bytes per 32 weights; 1-D and <= 1024 elements F32; rows of 300 F16
        "Q8_0": [139264, 2048, 153600, 69632, 17408, 69632, 256],
        # 144 bytes per 256 weights
        "Q4_K": [73728, 2048, 153600, 36864, 9216, 36864, 256],
    }
    known = recipes()
    for name, expected in by_hand.items():
        assert [known[name].size(p) for p in params] == expected, name
    bf16 = Footprint.of((p.block, p.served, known["bf16"].size(p)) for p in params)
    assert (bf16.outside, bf16.outside_served) == (295040, 32768)
    assert sorted(bf16.blocks) == [(131072, 0), (416768, 263168)]
    assert (bf16.total, bf16.served) == (842880, 295936)
    on_card = {(placement, cached): bf16.on_card(placement, cached) for placement in PLACEMENTS for cached in (0, 1)}
    assert on_card == {
        ("resident", 0): 842880,
        ("resident", 1): 546944,
        ("block offload", 0): 295040 + 416768,
        ("block offload", 1): 262272 + 153600,
        ("block offload + stream", 0): 842880,
        ("block offload + stream", 1): 262272 + 153600 + 131072,
    }


def test_gguf_bits_are_the_gguf_packages() -> None:
    """The table of GGUF types used without the ``gguf`` package holds the package's numbers."""
    gguf = pytest.importorskip("gguf")
    for name, sizes in GGUF_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == sizes, name


def test_cards_compare_with_the_reserve(capsys: pytest.CaptureFixture[str]) -> None:
    """A card fits when the bytes are at most its GiB less ``--reserve-gb``; the JSON says so per card."""
    for reserve in ("0", "2", "7.5"):
        code, out, _ = run(["--released", "qwen-image", "--json", "--reserve-gb", reserve], capsys)
        assert code == 0
        data = json.loads(out)
        assert data["reserve_gib"] == float(reserve)
        for row in data["rows"]:
            for gib in CARDS_GIB:
                room = (gib - float(reserve)) * 2**30
                assert row["fits_without"][str(gib)] == (row["without_cache_bytes"] <= room)
                assert row["fits_with"][str(gib)] == (row["with_cache_bytes"] <= room)


# ---------------------------------------------------------------------------------------------
# the request's tables


def test_the_tables_are_the_slab_of_the_requests_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tables are ``spec.slab_bytes`` of the request's distinct plans as build computes them (the
    scheduler config beside the transformer; Edit-2511's doubled timestep), sized from --steps and --batch
    where the schedule needs a scheduler config that is not there."""
    from adalncache.families.qwen_image import RELEASED_SCHEDULER
    from adalncache.plans import minimax_h3_plans
    from adalncache.tools.tiny_qwen import VARIANTS

    def tables(argv: list[str]) -> dict[str, Any]:
        code, out, err = run([*argv, "--json", "--recipe", "bf16"], capsys)
        assert code == 0, err
        data = json.loads(out)
        found = data["tables"]
        model = open_model(argv[0])[0] if not argv[0].startswith("--") else released_model(argv[1])
        assert data["rows"][0]["table_bytes"] == model.spec.slab_bytes(found["plans"], found["rows_per_plan"])
        assert found["row_bytes"] == model.spec.row_bytes
        return found

    qwen = {**tiny_config("QwenImageTransformer2DModel"), **VARIANTS["zero-cond"]}
    root = write_pipeline(tmp_path / "qwen", "QwenImageTransformer2DModel", qwen)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(RELEASED_SCHEDULER)))
    found = tables([str(root), "--steps", "4", "--batch", "2"])
    assert (found["plans"], found["rows_per_plan"]) == (4, 4)  # [t; 0 * t] of 2 images
    found = tables(["--released", "minimax-h3"])  # the default request: t2va, 50 steps
    plans = {tuple(plan.tolist()) for plan in minimax_h3_plans("t2va", 50)}
    assert (found["plans"], found["rows_per_plan"]) == (len(plans), max(map(len, plans))) == (49, 2)
    found = tables(["--released", "qwen-image", "--steps", "20", "--batch", "3"])
    assert (found["plans"], found["rows_per_plan"]) == (20, 3)
    bria = write_pipeline(tmp_path / "bria", "BriaTransformer2DModel", tiny_config("BriaTransformer2DModel"))
    found = tables([str(bria)])
    assert (found["plans"], found["rows_per_plan"]) == (50, 1)  # the default request, no scheduler config


# ---------------------------------------------------------------------------------------------
# the output


def test_the_json_holds_every_number(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--released", "ovis-image", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert set(data) == {
        "model",
        "tables",
        "cards_gib",
        "reserve_gib",
        "recipes",
        "gguf",
        "placements",
        "not_counted",
        "rows",
    }
    assert set(data["model"]) == {
        "class",
        "family",
        "source",
        "config",
        "parameters",
        "served_layers",
        "served_parameters",
        "stored",
    }
    assert set(data["tables"]) == {"request", "plans", "rows_per_plan", "row_bytes"}
    assert data["cards_gib"] == [16, 24, 48, 80] and data["reserve_gib"] == 2.0
    assert len(data["rows"]) == len(data["recipes"]) * len(data["placements"])
    for row in data["rows"]:
        assert set(row) == {
            "recipe",
            "placement",
            "without_cache_bytes",
            "with_cache_bytes",
            "saved_bytes",
            "weight_bytes",
            "served_bytes",
            "table_bytes",
            "fits_without",
            "fits_with",
        }
        assert row["saved_bytes"] == row["without_cache_bytes"] - row["with_cache_bytes"]
        assert set(row["fits_without"]) == set(row["fits_with"]) == {"16", "24", "48", "80"}
        assert all(isinstance(row[k], int) for k in ("without_cache_bytes", "with_cache_bytes", "table_bytes"))
    code, out, _ = run(["--released", "all", "--json", "--recipe", "bf16", "--steps", "20"], capsys)
    every = json.loads(out)
    assert code == 0 and [m["model"]["class"] for m in every] == [r[0] for r in RELEASED.values()]
    assert all(len(m["rows"]) == len(PLACEMENTS) and m["tables"]["plans"] in (19, 20) for m in every)


def test_the_readme_tables_are_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's supported-models and card tables are ``adalncache fit --released all --markdown``, verbatim."""
    code, out, _ = run(["--released", "all", "--markdown"], capsys)
    assert code == 0
    readme = (ROOT / "README.md").read_text()
    printed = [table for table in out.strip().split("\n\n") if table]
    assert len(printed) == 2
    for table in printed:
        assert table in readme, "regenerate the README's tables with: adalncache fit --released all --markdown"


def test_the_docs_examples_are_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``$ adalncache fit ...`` in docs/fit.md followed by its output shows what the command prints."""
    page = (ROOT / "docs" / "fit.md").read_text()
    shown = re.findall(r"```console\n\$ adalncache (fit [^\n]*)\n(.*?)\n```", page, flags=re.S)
    examples = [(command, output) for command, output in shown if not output.startswith("$ ")]
    assert examples
    for command, output in examples:
        code, out, _ = run(command.split()[1:], capsys)
        assert code == 0 and out.rstrip("\n") == output, f"regenerate the output of {command} in docs/fit.md"


def test_the_planner_counts_in_seconds() -> None:
    """Counting the largest released model on meta stays quick (``make test`` counts every class)."""
    import time

    from adalncache.fit import _counted

    _counted.cache_clear()
    start = time.perf_counter()
    count_model({"_class_name": "MiniMaxH3Transformer3DModel"}, source="released", label="")
    assert time.perf_counter() - start < 30


# ---------------------------------------------------------------------------------------------
# refusals


def _refusal(tmp_path: Path, case: str) -> list[str]:
    if case == "prompt-modulated class":
        (tmp_path / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
        return [str(tmp_path)]
    if case == "unknown class":
        (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
        return [str(tmp_path / "config.json")]
    if case == "no _class_name":
        (tmp_path / "config.json").write_text(json.dumps({"num_layers": 2}))
        return [str(tmp_path)]
    if case == "not JSON":
        (tmp_path / "config.json").write_text("{")
        return [str(tmp_path)]
    if case == "missing MODEL":
        return [str(tmp_path / "absent")]
    if case == "directory without config":
        return [str(tmp_path)]
    if case == "pipeline without transformer":
        (tmp_path / "model_index.json").write_text(json.dumps({"vae": ["diffusers", "AutoencoderKL"]}))
        return [str(tmp_path)]
    if case == "MODEL and --released":
        return [str(tmp_path), "--released", "qwen-image"]
    if case == "neither":
        return []
    if case == "a flag a released model cannot use":
        return ["--released", "qwen-image", "--height", "512"]
    if case == "--recipe stored without weights":
        return ["--released", "qwen-image", "--recipe", "stored"]
    if case == "--steps without the scheduler config":
        write_pipeline(tmp_path / "bria", "BriaTransformer2DModel", tiny_config("BriaTransformer2DModel"))
        return [str(tmp_path / "bria"), "--steps", "4"]
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("prompt-modulated class", "FluxTransformer2DModel cannot be served"),
        ("unknown class", "not a supported family"),
        ("no _class_name", "no _class_name"),
        ("not JSON", "is not JSON"),
        ("missing MODEL", "does not exist"),
        ("directory without config", "has no config.json"),
        ("pipeline without transformer", "names no transformer"),
        ("MODEL and --released", "name one model"),
        ("neither", "name one model"),
        ("a flag a released model cannot use", "--height"),
        ("--recipe stored without weights", "--recipe stored"),
        ("--steps without the scheduler config", "--scheduler-config"),
    ],
)
def test_refusals_are_one_line_and_exit_2(
    case: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(_refusal(tmp_path, case), capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--released", "flux"],
        ["--released", "qwen-image", "--reserve-gb", "-1"],
        ["--released", "qwen-image", "--reserve-gb", "nan"],
        ["--released", "qwen-image", "--steps", "0"],
        ["--released", "qwen-image", "--recipe", "Q4_K_M"],
    ],
)
def test_bad_flag_values_are_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fit", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(r"--released|--reserve-gb|--steps|--recipe", err)


def test_nothing_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command reads the config and the headers and writes nothing beside them."""
    root = write_pipeline(tmp_path / "pipe", "OvisImageTransformer2DModel", tiny_config("OvisImageTransformer2DModel"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert run([str(root)], capsys)[0] == 0
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
