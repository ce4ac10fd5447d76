"""load_transformer: built like from_pretrained, exact like it, and never reading the served tensors.

Real files on disk (diffusers layout single and sharded, native layout single and sharded), real
diffusers loading code on both sides; the stock reference is always
``MiniMaxH3Transformer3DModel.from_pretrained`` of the same weights.
"""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

from adalncache.diffusers import AdalnCacheConfig, CacheOptions, adaln_cache_handle, load_transformer
from adalncache.errors import CheckpointError, ConfigError
from adalncache.integrations.diffusers import CheckpointMismatchError
from adalncache.plans import minimax_h3_plans
from adalncache.source.files import checkpoint_files
from adalncache.tools.measure import drop_page_cache, io_read_bytes, resident_served_bytes, served_bytes
from adalncache.tools.tiny import make_request, run_loop, tiny_transformer, write_native_model
from tiny_helpers import write_native_checkpoint

TASKS = ("t2va", "fl2va", "ref2va")
STEPS = 4
SERVED_PREFIXES = ("time_embedder.", "norm_out.linear.")


def _served(name: str) -> bool:
    return name.startswith(SERVED_PREFIXES) or ".adaln_proj.linear." in name


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model (seed 0) on disk in every layout a test loads."""
    root = tmp_path_factory.mktemp("load-transformer")
    built: Any = tiny_transformer("tiny", seed=0)
    built.save_pretrained(root / "fp32")
    mixed: Any = MiniMaxH3Transformer3DModel.from_pretrained(root / "fp32", torch_dtype=torch.bfloat16)
    mixed.save_pretrained(root / "bf16")
    mixed.save_pretrained(root / "bf16-sharded", max_shard_size="150KB")
    assert len(list((root / "bf16-sharded").glob("*.safetensors"))) > 1
    write_native_model(built, root / "native-fp32", shards=1, qkv_layout="stacked")
    write_native_model(mixed, root / "native-bf16-sharded", shards=3, qkv_layout="interleaved")
    write_native_checkpoint(mixed, root / "projections-bf16", shards=2)  # the projections alone
    return {p.name: p for p in root.iterdir()}


def _stock(files: dict[str, Path], name: str, dtype: torch.dtype | None) -> Any:
    """``from_pretrained`` of the diffusers-layout files holding the same weights as ``name``."""
    source = {"native-fp32": "fp32", "native-bf16-sharded": "bf16"}.get(name, name)
    return MiniMaxH3Transformer3DModel.from_pretrained(files[source], torch_dtype=dtype)


def _load(files: dict[str, Path], name: str, dtype: torch.dtype | None, **kwargs: Any) -> Any:
    config = {"native-fp32": files["fp32"], "native-bf16-sharded": files["bf16"]}.get(name)
    return load_transformer(files[name], config=config, torch_dtype=dtype, **kwargs)


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update((name, t) for name, t in model.named_buffers() if not name.endswith("_adalncache_dtype"))
    return out


@pytest.mark.parametrize(
    ("name", "dtype", "device_map"),
    [
        ("fp32", None, None),
        ("fp32", torch.bfloat16, "cpu"),
        ("bf16", torch.bfloat16, None),
        ("bf16", None, torch.device("cpu")),
        ("bf16", torch.float32, None),
        ("bf16-sharded", torch.bfloat16, {"": "cpu"}),
    ],
)
def test_built_like_from_pretrained(
    files: dict[str, Path], name: str, dtype: torch.dtype | None, device_map: Any
) -> None:
    """Same config, same parameters and buffers (values, dtypes, devices, addresses modulo 64),
    and the served tensors meta placeholders of the stock dtype and shape."""
    stock = MiniMaxH3Transformer3DModel.from_pretrained(files[name], torch_dtype=dtype, device_map=device_map)
    model = load_transformer(files[name], torch_dtype=dtype, device_map=device_map)
    assert dict(model.config) == dict(stock.config)
    assert model.training is False
    assert getattr(model, "hf_device_map", None) == getattr(stock, "hf_device_map", None)
    ours, theirs = _tensors(model), _tensors(stock)
    assert set(ours) == {n for n in theirs if not _served(n)}
    for n, tensor in ours.items():
        ref = theirs[n]
        assert tensor.dtype == ref.dtype and tensor.device == ref.device, n
        assert torch.equal(tensor, ref), n
        assert tensor.data_ptr() % 64 == ref.data_ptr() % 64, n  # an fp32 GEMV's bits depend on it
    for n, ref in theirs.items():
        if _served(n):
            module_path, _, attr = n.rpartition(".")
            placeholder = getattr(model.get_submodule(module_path), attr)
            assert placeholder.device.type == "meta", n
            assert placeholder.dtype == ref.dtype and placeholder.shape == ref.shape, n
    handle = adaln_cache_handle(model)
    assert handle is not None and handle.enabled
    handle.disable()
    restored, stock_state = model.state_dict(), stock.state_dict()
    assert list(restored) == list(stock_state)
    for n, ref in stock_state.items():
        assert restored[n].dtype == ref.dtype and torch.equal(restored[n], ref), n


@pytest.mark.parametrize(
    ("name", "dtype", "tasks"),
    [
        ("fp32", None, TASKS),
        ("bf16", torch.bfloat16, TASKS),  # the released mixed precision
        ("fp32", torch.bfloat16, ("fl2va",)),  # cast on read: an fp32 file served as the bf16 model holds it
        ("bf16", None, ("ref2va",)),  # cast on read the other way: bf16 file, fp32 model
        ("bf16-sharded", torch.bfloat16, ("t2va",)),
        ("native-fp32", None, ("fl2va",)),
        ("native-bf16-sharded", torch.bfloat16, ("ref2va",)),
    ],
)
def test_outputs_equal_the_stock_model(
    files: dict[str, Path], name: str, dtype: torch.dtype | None, tasks: tuple[str, ...]
) -> None:
    """t2va, fl2va and ref2va in fp32 and the released precision; one task for each other layout or cast."""
    stock = _stock(files, name, dtype)
    model = _load(files, name, dtype)
    handle: Any = adaln_cache_handle(model)
    assert handle.source.layout.name == ("native" if name.startswith("native") else "diffusers")
    for task in tasks:
        request = make_request(stock, task, STEPS, seed=3)
        before = handle.stats.passes
        assert handle.prepare(minimax_h3_plans(task, STEPS)).passes == 1
        assert run_loop(model, request).equal(run_loop(stock, request)), task
        assert handle.stats.passes == before + 1  # the loop itself never rebuilt
    handle.disable()
    assert run_loop(model, request).equal(run_loop(stock, request))


def test_projections_served_from_another_checkpoint(files: dict[str, Path]) -> None:
    """checkpoint=: the projections alone in the native layout; the time embedder then loads normally."""
    stock = _stock(files, "bf16", torch.bfloat16)
    model = load_transformer(files["bf16"], torch_dtype=torch.bfloat16, checkpoint=files["projections-bf16"])
    handle: Any = adaln_cache_handle(model)
    assert handle.source.layout.name == "native"
    assert model.time_embedder.linear_1.weight.device.type == "cpu"  # not in that checkpoint: loaded
    request = make_request(stock, "fl2va", STEPS, seed=3)
    handle.prepare(request.plans)
    assert run_loop(model, request).equal(run_loop(stock, request))
    with pytest.raises(ConfigError, match="free_time_embedder"):
        load_transformer(
            files["bf16"], torch_dtype=torch.bfloat16, checkpoint=files["projections-bf16"], free_time_embedder=True
        )


def test_time_embedder_can_be_loaded(files: dict[str, Path]) -> None:
    stock = _stock(files, "bf16", torch.bfloat16)
    model = load_transformer(files["bf16"], torch_dtype=torch.bfloat16, free_time_embedder=False)
    assert model.time_embedder.linear_2.weight.device.type == "cpu"
    assert model.norm_out.linear.weight.device.type == "meta"
    request = make_request(stock, "ref2va", STEPS, seed=3)
    adaln_cache_handle(model).prepare(request.plans)
    assert run_loop(model, request).equal(run_loop(stock, request))


def test_config_carries_the_options_and_model_config_the_diffusers_config(files: dict[str, Path]) -> None:
    """``config=AdalnCacheConfig(...)`` with a keyword beside it (the keyword wins); a native checkpoint's
    diffusers config as ``model_config=`` (or, as before, as ``config=``); both as ``config=`` and
    ``model_config=`` at once is a ConfigError naming both; a typo names the close match."""
    stock = _stock(files, "native-fp32", None)
    config = AdalnCacheConfig(max_plans=5, on_miss="raise", free_time_embedder=False)
    model = load_transformer(files["native-fp32"], model_config=files["fp32"], config=config, max_plans=6)
    handle = adaln_cache_handle(model)
    assert handle is not None and (handle.cache.max_plans, handle.config.on_miss) == (6, "raise")
    assert model.time_embedder.linear_2.weight.device.type == "cpu"  # free_time_embedder=False from config=
    request = make_request(stock, "t2va", STEPS, seed=5)
    handle.prepare(request.plans)
    assert run_loop(model, request).equal(run_loop(stock, request))
    with pytest.raises(ConfigError, match=r"config=.*model_config="):
        load_transformer(files["native-fp32"], model_config=files["fp32"], config=files["fp32"])
    with pytest.raises(TypeError, match="did you mean 'on_miss'"):
        load_transformer(files["fp32"], on_mis="raise")  # type: ignore[call-arg]  # wrong on purpose: the refusal is tested
    with pytest.raises(TypeError, match="verify_checkpoint"):
        load_transformer(files["fp32"], verify_checkpoint=False)  # type: ignore[call-arg]  # wrong on purpose: the refusal is tested


def test_cache_options_are_typed_keywords_like_enable_adaln_cache() -> None:
    """Every cache option is a keyword of load_transformer with enable_adaln_cache's default; the
    cache's device is where device_map puts the model, so ``device`` is not one."""
    params = inspect.signature(load_transformer).parameters
    assert "device" not in params  # not an option: where device_map puts the model
    for field in fields(CacheOptions):
        if field.name in ("verify_checkpoint", "quantized_projections"):
            assert field.name not in params  # enable_adaln_cache's: the projections are never read here
            continue
        assert params[field.name].kind is inspect.Parameter.KEYWORD_ONLY, field.name
        assert params[field.name].default == field.default, field.name
    with pytest.raises(TypeError, match="max_plan"):
        load_transformer("nowhere", max_plan=3)  # type: ignore[call-arg]  # wrong on purpose: the refusal is what is tested


def test_the_load_reads_no_served_byte(tmp_path: Path) -> None:
    """Page cache dropped, then load: not one whole page of a projection or of the time embedder is
    read (or cached), and the bytes read are the other tensors' (plus headers and edge pages).
    A stock load of the same files reads them all, so the measurement can see what it looks for."""
    built: Any = tiny_transformer("small", seed=0)
    built.save_pretrained(tmp_path / "fp32")
    mixed: Any = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "fp32", torch_dtype=torch.bfloat16)
    directory = tmp_path / "sharded"
    mixed.save_pretrained(directory, max_shard_size="8MB")
    del built, mixed
    checkpoint = checkpoint_files(directory)[0]
    assert len(checkpoint) > 1
    served, total = served_bytes(checkpoint)
    if not drop_page_cache(checkpoint) or io_read_bytes() is None:
        pytest.skip("this filesystem keeps the files cached (or /proc/self/io is missing): nothing to measure")
    before = io_read_bytes()
    model = load_transformer(directory, torch_dtype=torch.bfloat16)
    read = (io_read_bytes() or 0) - (before or 0)
    assert resident_served_bytes(checkpoint) == 0
    assert read <= total - served + (1 << 20), (read, total, served)
    for param in model.parameters():  # what a first forward touches
        param.float().sum()
    assert resident_served_bytes(checkpoint) == 0
    del model, param  # a live view keeps its mapping, whose pages cannot be dropped

    assert drop_page_cache(checkpoint)
    MiniMaxH3Transformer3DModel.from_pretrained(directory, torch_dtype=torch.bfloat16)
    assert resident_served_bytes(checkpoint) > served // 2  # the stock load reads them


def _fresh_dir(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    return directory


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("no config", ConfigError, r"path=.*config\.json"),
        ("no directory", ConfigError, r"path=.*not a local directory"),
        ("bad subfolder", ConfigError, r"subfolder="),
        ("bad dtype", ConfigError, r"torch_dtype="),
        ("splitting device map", ConfigError, r"device_map='auto'"),
        ("two devices", ConfigError, r"device_map= places the model on several devices"),
        ("meta device", ConfigError, r"device_map="),
        ("device map naming no device", ConfigError, r"device_map='nonsense' does not name a device"),
        ("device map of a list", ConfigError, r"device_map=\['cpu'\] does not name a device"),
        ("disk device map", ConfigError, r"device_map=\{'': 'disk'\}: the model must be loaded on a real device"),
        ("empty device map", ConfigError, r"device_map=\{\} maps no module"),
        ("bad cache option", ConfigError, r"max_plans.*--max-plans"),
        ("bad qkv layout", ConfigError, r"qkv_layout"),
        ("other geometry", CheckpointMismatchError, r"checkpoint=.*cannot serve"),
        ("other dtype", CheckpointMismatchError, r"checkpoint=.*does not hold this model's projections"),
        ("missing tensors", CheckpointError, r"lack .* tensor"),
    ],
)
def test_bad_inputs_name_the_argument(
    files: dict[str, Path], tmp_path: Path, case: str, error: type[Exception], message: str
) -> None:
    kwargs: dict[str, Any] = {"torch_dtype": torch.bfloat16}
    path: Any = files["bf16"]
    if case == "no config":
        path = _fresh_dir(tmp_path, "empty")
        (path / "model.safetensors").write_bytes((files["native-fp32"] / "model.safetensors").read_bytes())
    elif case == "no directory":
        path = tmp_path / "missing"
    elif case == "bad subfolder":
        kwargs["subfolder"] = "transformer"
    elif case == "bad dtype":
        kwargs["torch_dtype"] = torch.int8
    elif case == "splitting device map":
        kwargs["device_map"] = "auto"
    elif case == "two devices":
        kwargs["device_map"] = {"transformer_blocks": "cpu", "proj_in": "meta"}
    elif case == "meta device":
        kwargs["device_map"] = "meta"
    elif case == "device map naming no device":
        kwargs["device_map"] = "nonsense"
    elif case == "device map of a list":
        kwargs["device_map"] = ["cpu"]
    elif case == "disk device map":
        kwargs["device_map"] = {"": "disk"}
    elif case == "empty device map":
        kwargs["device_map"] = {}
    elif case == "bad cache option":
        kwargs["max_plans"] = 0
    elif case == "bad qkv layout":
        kwargs["qkv_layout"] = "rows"
    elif case == "other geometry":
        other: Any = tiny_transformer("small", seed=0)
        kwargs["checkpoint"] = write_native_checkpoint(other, tmp_path / "small-projections", shards=1)
    elif case == "other dtype":
        kwargs["checkpoint"] = files["fp32"]
    elif case == "missing tensors":
        # The projections of this model but nothing else: a model file that lacks its blocks.
        kwargs["config"] = files["bf16"]
        path = files["projections-bf16"]
    with pytest.raises(error, match=message):
        load_transformer(path, **kwargs)


def test_projections_never_downloaded_served_from_table_files(files: dict[str, Path], tmp_path: Path) -> None:
    """Model files without a single AdaLN projection, plus exported table files: the model runs, bit for
    bit the stock model's, for every plan the files hold; a plan they lack raises PlanNotCachedError;
    disable() leaves the projections empty (there is nothing to restore them from)."""
    from safetensors.torch import load_file, save_file

    from adalncache.cli import main
    from adalncache.errors import PlanNotCachedError

    stock = _stock(files, "bf16", torch.bfloat16)
    table = tmp_path / "tables.safetensors"
    assert main(["export", str(files["bf16"]), "--task", "t2va", "--steps", str(STEPS), "-o", str(table), "-q"]) == 0
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((files["bf16"] / "config.json").read_text())
    state = load_file(files["bf16"] / "diffusion_pytorch_model.safetensors")
    projections = [k for k in state if ".adaln_proj.linear." in k or k.startswith("norm_out.linear.")]
    assert projections
    save_file({k: v for k, v in state.items() if k not in projections}, partial / "diffusion_pytorch_model.safetensors")

    with pytest.raises(CheckpointMismatchError):  # without table files, the missing projections are an error
        load_transformer(partial, torch_dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="free_time_embedder"):
        load_transformer(partial, torch_dtype=torch.bfloat16, tables=table, free_time_embedder=True)
    model = load_transformer(partial, torch_dtype=torch.bfloat16, tables=table)
    handle: Any = adaln_cache_handle(model)
    assert model.norm_out.linear.weight.device.type == "meta" and handle.cache.source.serves_weights is False
    request = make_request(stock, "t2va", STEPS, seed=3)
    report = handle.prepare(request.plans)
    assert (report.passes, report.bytes_read, report.table_hits) == (0, 0, report.plans)
    assert run_loop(model, request).equal(run_loop(stock, request))
    other = minimax_h3_plans("t2va", STEPS + 3)
    with pytest.raises(PlanNotCachedError, match="not in the table files"):
        handle.prepare(other)
    with pytest.raises(ConfigError, match="freed"):
        model.state_dict()
    handle.disable()
    assert model.norm_out.linear.weight.device.type == "meta"


# ----------------------------------------------------------------------------------- quantization_config


def _poisoned_copy(source: Path, target: Path) -> Path:
    """``source``'s files with every served projection's bytes NaN: a load that read them would show it."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    for file in source.glob("*.safetensors"):
        state = load_file(file)
        for name, tensor in state.items():
            if ".adaln_proj.linear." in name or name.startswith("norm_out.linear."):
                state[name] = torch.full_like(tensor, float("nan"))
        save_file(state, target / file.name, metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_torchao_quantization_config_loads_quantized_and_serves_exactly(
    files: dict[str, Path], tmp_path: Path, dtype: torch.dtype | None
) -> None:
    """``load_transformer(..., quantization_config=TorchAoConfig(int8 weight-only))`` equals
    ``from_pretrained(..., quantization_config=...)`` with its resident forward, bit for bit, while the model
    files' projections (poisoned: NaN) are never read nor materialised: the tables come from the passes over
    ``checkpoint=``, each weight quantized as the loader quantizes it. ``disable()`` gives back the quantized
    model."""
    pytest.importorskip("torchao", reason="installed by the compose extra")
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    name = "bf16" if dtype is not None else "fp32"
    stock = MiniMaxH3Transformer3DModel.from_pretrained(
        files[name], torch_dtype=dtype, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    ).eval()
    assert type(stock.norm_out.linear.weight).__module__.startswith("torchao")  # the projections are quantized
    poisoned = _poisoned_copy(files[name], tmp_path / "poisoned")
    projections = tmp_path / "projections"
    write_native_checkpoint(MiniMaxH3Transformer3DModel.from_pretrained(files[name], torch_dtype=dtype), projections)
    model = load_transformer(
        poisoned,
        torch_dtype=dtype,
        checkpoint=projections,
        quantization_config=TorchAoConfig(Int8WeightOnlyConfig()),
    )
    handle: Any = adaln_cache_handle(model)
    assert handle.cache.source.bytes_read == 0  # nothing of the projections read by the load
    assert model.norm_out.linear.weight.device.type == "meta"  # nor materialised
    assert all(p.device.type == "meta" for n, p in model.named_parameters() if ".adaln_proj.linear." in n)
    assert getattr(model, "hf_quantizer", None) is not None
    for n, p in model.named_parameters():  # everything else as from_pretrained loaded it, quantized alike
        if not _served(n):
            reference = stock.get_parameter(n)
            assert type(p) is type(reference) and p.dtype == reference.dtype, n
    request = make_request(stock, "t2va", STEPS, seed=2)
    expected = run_loop(stock, request)
    handle.prepare(request.plans)
    assert run_loop(model, request).equal(expected)
    handle.disable()
    assert type(model.norm_out.linear.weight) is type(stock.norm_out.linear.weight)
    assert run_loop(model, request).equal(expected)  # the resident quantized forward after disable()


def test_quantization_configs_it_cannot_apply_are_refused_clearly(files: dict[str, Path]) -> None:
    """A GGUF config (a single .gguf file, not a safetensors directory), bitsandbytes without a GPU, and any
    config whose loaded weights a pass does not reproduce: a ConfigError naming the config and what to do."""
    from diffusers import GGUFQuantizationConfig

    with pytest.raises(ConfigError, match=r"GGUFQuantizationConfig.*from_single_file"):
        load_transformer(files["bf16"], quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16))
    pytest.importorskip("bitsandbytes", reason="installed by the bnb extra")
    from diffusers import BitsAndBytesConfig

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"quantization_config=BitsAndBytesConfig cannot load on this machine"):
            load_transformer(files["bf16"], quantization_config=BitsAndBytesConfig(load_in_8bit=True))


def test_disable_after_the_model_files_changed_names_the_files(files: dict[str, Path], tmp_path: Path) -> None:
    """``disable()`` restores the never-loaded projections from the model files: rewritten since the load, it
    refuses naming the files as paths (not a list's repr) and the way out; ``allow_changed_checkpoint`` restores."""
    import os
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "model"
    shutil.copytree(files["fp32"], directory)
    model = load_transformer(directory)
    handle = adaln_cache_handle(model)
    assert handle is not None
    weights = checkpoint_files(directory)[0][0]
    save_file(load_file(weights), tmp_path / "rewritten.safetensors", metadata={"format": "pt"})
    os.replace(tmp_path / "rewritten.safetensors", weights)  # the same tensors under a new file identity
    said = rf"checkpoint {re.escape(str(weights))} changed on disk since the AdaLN cache was enabled.*allow_changed"
    with pytest.raises(CheckpointError, match=said):
        handle.disable()
    assert handle.enabled
    handle.disable(allow_changed_checkpoint=True)
    assert not handle.enabled
