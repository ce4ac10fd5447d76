"""Quantized AdaLN projections with the AdaLN cache: torchao, optimum-quanto, GGUF, bitsandbytes.

The rule: outputs ``torch.equal`` to the same quantized model without the cache (tables projected
through each module's own forward from its own quantized tensors), or a ``ConfigError`` at enable
time naming the conflict. A ``checkpoint=`` holds unquantized projections, so it is refused unless
``quantized_projections="checkpoint"`` asks for full-precision tables on purpose, which then equal
the model quantized the same way except for its AdaLN projections.

Real libraries on real tiny models; each test skips only when its library is not installed (the
``compose`` extra installs them, and ``make test`` installs the extra).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.integrations.diffusers.quantized import (
    ProjectionStorage,
    check_storage_options,
    quantization_of,
    storage_of,
)
from adalncache.spec import FINAL
from adalncache.tools.tiny import make_request, run_loop, tiny_transformer
from compose_helpers import (
    assert_equal,
    assert_exact,
    assert_full_precision_tables,
    hook_names,
    maxdiff,
    projections,
    serve,
)
from tiny_helpers import bnb_linear, write_gguf, write_native_checkpoint

EXTRA = "installed by the compose extra (pip install 'adalncache[compose]'; make test installs it)"


def _is_projection(module: nn.Module, fqn: str) -> bool:
    return fqn.endswith("adaln_proj.linear") or fqn == "norm_out.linear"


def _untouched(model: Any, before: dict[str, Any], hooks: list[tuple[str, str]]) -> None:
    """A refused enable left the model as it was: no placeholder, no hook, the same parameter objects."""
    assert all(p.device.type != "meta" for p in model.parameters())
    assert hook_names(model) == hooks
    assert {name: id(p) for name, p in model.named_parameters()} == before


def _projection_storage(model: Any) -> tuple[str, ...]:
    modules = [(i, block.adaln_proj.linear) for i, block in enumerate(model.transformer_blocks)]
    return storage_of([*modules, (FINAL, model.norm_out.linear)]).quantized


# ---------------------------------------------------------------------------------------- torchao

TORCHAO_CONFIGS = (
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "IntxWeightOnlyConfig",
    "Int8DynamicActivationIntxWeightConfig",
    "Float8WeightOnlyConfig",
)


def _torchao_config(name: str) -> Any:
    quantization = pytest.importorskip("torchao.quantization", reason=f"torchao is {EXTRA}")
    if name == "Int8DynamicActivationIntxWeightConfig":
        from torchao.quantization.granularity import PerAxis

        # Its default groups of 32 do not divide the tiny model's 16-wide inputs: one group per row.
        return quantization.Int8DynamicActivationIntxWeightConfig(weight_granularity=PerAxis(0))
    return getattr(quantization, name)()


@pytest.mark.parametrize("precision", ["fp32-memory", "bf16-disk"])
@pytest.mark.parametrize("config", TORCHAO_CONFIGS)
def test_torchao_quantize_is_exact(load_tiny: Callable[[str], Any], config: str, precision: str) -> None:
    """``torchao.quantize_`` on a loaded model (every Linear, the time embedder too), each CPU config."""
    from torchao.quantization import quantize_

    model = load_tiny(precision)
    quantize_(model, _torchao_config(config))
    assert _projection_storage(model) == ("torchao",)
    request = make_request(model, "t2va", 4)
    assert_exact(serve(model, request), request)


def test_torchao_config_from_pretrained_is_exact(tiny_saved_root: Path) -> None:
    """diffusers' ``TorchAoConfig`` in ``from_pretrained`` (the time embedder stays fp32 there)."""
    from diffusers import TorchAoConfig
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel.from_pretrained(
        tiny_saved_root / "bf16",
        torch_dtype=torch.bfloat16,
        quantization_config=TorchAoConfig(_torchao_config("Int8WeightOnlyConfig")),
    ).eval()
    assert _projection_storage(model) == ("torchao",)
    request = make_request(model, "fl2va", 4)
    assert_exact(serve(model, request), request)


def test_torchao_checkpoint_is_refused_unless_full_precision_tables_are_asked_for(tmp_path: Path) -> None:
    """``checkpoint=`` is refused before anything changes; the named option serves its full-precision tables.

    Those equal a model quantized the same way except for its AdaLN projections (``filter_fn``),
    differ from the all-quantized model, and ``disable()`` gives the quantized model back.
    """
    from torchao.quantization import quantize_

    config = _torchao_config("Int8WeightOnlyConfig")
    checkpoint = write_native_checkpoint(tiny_transformer("tiny"), tmp_path / "ck")
    model = tiny_transformer("tiny")
    quantize_(model, config)
    request = make_request(model, "t2va", 4)
    quantized = run_loop(model, request)
    before, hooks = {name: id(p) for name, p in model.named_parameters()}, hook_names(model)
    with pytest.raises(ConfigError, match=r"quantized \(torchao\).*quantized_projections='checkpoint'"):
        enable_adaln_cache(model, checkpoint)
    with pytest.raises(ConfigError, match=r"quantized \(torchao\)"):
        enable_adaln_cache(model, checkpoint, verify_checkpoint=False)
    _untouched(model, before, hooks)

    reference = tiny_transformer("tiny")
    quantize_(reference, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not _is_projection(m, fqn))
    unquantized_projections = run_loop(reference, request)
    assert maxdiff(unquantized_projections, quantized) > 0  # the option visibly changes the model

    handle = enable_adaln_cache(model, checkpoint, quantized_projections="checkpoint")
    handle.prepare(request.plans)
    assert_equal(run_loop(model, request), unquantized_projections)
    handle.disable()
    assert_equal(run_loop(model, request), quantized)
    assert type(model.norm_out.linear.weight).__module__.startswith("torchao")


def test_full_precision_tables_in_a_store_are_bound_to_the_quantized_time_embedder(tmp_path: Path) -> None:
    """Store entries of full-precision tables hit for the same quantized model, never for another one.

    ``quantize_`` also quantizes the time embedder, whose output is the tables' input: a model with
    the same checkpoint but a plain time embedder must not be served those entries.
    """
    from torchao.quantization import quantize_

    config = _torchao_config("Int8WeightOnlyConfig")
    checkpoint = write_native_checkpoint(tiny_transformer("tiny"), tmp_path / "ck")
    store = tmp_path / "store"

    def served(model: Any) -> tuple[Any, dict[str, int]]:
        handle = enable_adaln_cache(model, checkpoint, quantized_projections="checkpoint", store=store)
        handle.prepare(request.plans)
        result, stats = run_loop(model, request), handle.stats.as_dict()
        handle.disable()
        return result, stats

    first = tiny_transformer("tiny")
    quantize_(first, config)
    request = make_request(first, "t2va", 4)
    first_result, stats = served(first)
    assert (stats["built_plans"], stats["store_hits"]) == (3, 0)
    again = tiny_transformer("tiny")
    quantize_(again, config)
    again_result, stats = served(again)
    assert (stats["built_plans"], stats["store_hits"]) == (0, 3)
    assert_equal(again_result, first_result)

    plain_embedder = tiny_transformer("tiny")
    quantize_(plain_embedder, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and "time_embedder" not in fqn)
    resident = run_loop(plain_embedder, request)
    result, stats = served(plain_embedder)
    assert (stats["built_plans"], stats["store_hits"]) == (3, 0)
    unquantized_projections = tiny_transformer("tiny")
    quantize_(
        unquantized_projections,
        config,
        filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and "time_embedder" not in fqn and not _is_projection(m, fqn),
    )
    assert_equal(result, run_loop(unquantized_projections, request))
    assert maxdiff(result, resident) > 0


def test_quantized_options_that_cannot_be_exact_are_refused(load_tiny: Callable[[str], Any]) -> None:
    """``precision="fp32"`` (a recomputation from raw weights) and a missing checkpoint for the option."""
    from torchao.quantization import quantize_

    model = load_tiny("bf16-disk")
    quantize_(model, _torchao_config("Int8WeightOnlyConfig"))
    before, hooks = {name: id(p) for name, p in model.named_parameters()}, hook_names(model)
    with pytest.raises(ConfigError, match=r"--precision"):
        enable_adaln_cache(model, precision="fp32")
    with pytest.raises(ConfigError, match=r"needs checkpoint="):
        enable_adaln_cache(model, quantized_projections="checkpoint")
    with pytest.raises(ConfigError, match=r"quantized_projections must be"):
        enable_adaln_cache(model, quantized_projections="fp8")  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    _untouched(model, before, hooks)


def test_torchao_with_a_lora_loaded_before_enabling(load_tiny: Callable[[str], Any]) -> None:
    """peft LoRA over torchao projections is exact; adding one while enabled is refused with advice."""
    pytest.importorskip("peft")
    from peft import LoraConfig
    from torchao.quantization import quantize_

    model = load_tiny("bf16-disk")
    quantize_(model, _torchao_config("Int8WeightOnlyConfig"))
    with torch.random.fork_rng():
        torch.manual_seed(3)
        targets = ["adaln_proj.linear", "norm_out.linear", "to_q"]
        model.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    request = make_request(model, "t2va", 4)
    assert_exact(serve(model, request), request)
    assert_exact(serve(model, request, batched=True), request)  # the stacked-projection probe too

    handle = enable_adaln_cache(model)
    with pytest.raises(ConfigError, match=r"handle.disable\(\), load the LoRA"):
        model.add_adapter(LoraConfig(r=2, target_modules=["norm_out.linear"]), adapter_name="second")
    handle.disable()


# ------------------------------------------------------------------------------------ optimum-quanto


def _quanto() -> Any:
    return pytest.importorskip("optimum.quanto", reason=f"optimum-quanto is {EXTRA}")


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "unfrozen"])
@pytest.mark.parametrize("precision", ["fp32-memory", "bf16-disk"])
def test_quanto_qint8_is_exact(load_tiny: Callable[[str], Any], precision: str, frozen: bool) -> None:
    """``quantize(model, weights=qint8)``; unfrozen, ``QLinear`` quantizes its plain weight in its forward."""
    quanto = _quanto()
    model = load_tiny(precision)
    quanto.quantize(model, weights=quanto.qint8)
    if frozen:
        quanto.freeze(model)
    assert _projection_storage(model) == ("optimum-quanto",)
    request = make_request(model, "t2va", 4)
    assert_exact(serve(model, request), request)


def test_quanto_config_from_pretrained_and_full_precision_tables(tiny_saved_root: Path, tmp_path: Path) -> None:
    """diffusers' ``QuantoConfig("int8")``, and the option against a model whose projections are excluded."""
    quanto = _quanto()
    from diffusers import QuantoConfig
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel.from_pretrained(
        tiny_saved_root / "bf16", torch_dtype=torch.bfloat16, quantization_config=QuantoConfig(weights_dtype="int8")
    ).eval()
    request = make_request(model, "ref2va", 4)
    assert_exact(serve(model, request), request)

    checkpoint = write_native_checkpoint(tiny_transformer("tiny"), tmp_path / "ck")
    model = tiny_transformer("tiny")
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    reference = tiny_transformer("tiny")
    quanto.quantize(reference, weights=quanto.qint8, exclude=["*adaln_proj.linear", "norm_out.linear"])
    quanto.freeze(reference)
    assert_full_precision_tables(model, reference, checkpoint, request, r"quantized \(optimum-quanto\)")


# ------------------------------------------------------------------------------------------- GGUF


def _load_gguf(path: Path, config_dir: Path, compute: torch.dtype) -> Any:
    from diffusers import GGUFQuantizationConfig
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel.from_single_file(
        str(path),
        config=str(config_dir),
        local_files_only=True,
        torch_dtype=compute,
        quantization_config=GGUFQuantizationConfig(compute_dtype=compute),
    ).eval()


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gguf_from_single_file_is_exact(tiny_saved_root: Path, tmp_path: Path, compute: torch.dtype) -> None:
    """A Q8_0 GGUF file written with ``gguf``, loaded by ``from_single_file``; tables in the compute dtype."""
    pytest.importorskip("gguf", reason=f"gguf is {EXTRA}")
    logging.getLogger("diffusers").setLevel(logging.ERROR)  # "dequantizing ... to remain in FP32"
    path = tmp_path / "tiny-Q8_0.gguf"
    kinds = write_gguf(tiny_transformer("tiny"), path, "Q8_0")
    assert kinds["final_layer.adaln_proj.linear.weight"] == "Q8_0"
    model = _load_gguf(path, tiny_saved_root / "fp32", compute)
    assert model.norm_out.linear.weight.dtype == torch.uint8  # the packed bytes; the forward dequantizes
    assert _projection_storage(model) == ("gguf",)
    request = make_request(model, "t2va", 4)
    assert_exact(serve(model, request), request)


def test_gguf_full_precision_tables_equal_a_file_with_unquantized_projections(
    tiny_saved_root: Path, tmp_path: Path
) -> None:
    pytest.importorskip("gguf", reason=f"gguf is {EXTRA}")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    base = tiny_transformer("tiny")
    quantized_path, reference_path = tmp_path / "all.gguf", tmp_path / "no-adaln.gguf"
    write_gguf(base, quantized_path, "Q8_0")
    write_gguf(base, reference_path, "Q8_0", quantize=lambda name, t: t.dim() == 2 and "adaln_proj" not in name)
    config_dir = tiny_saved_root / "fp32"
    model = _load_gguf(quantized_path, config_dir, torch.float32)
    reference = _load_gguf(reference_path, config_dir, torch.float32)
    # The tables are projected from the checkpoint's mapped offsets; the reference's F32 projections
    # sit at the GGUF file's, another residue modulo 16 than a safetensors file of the model's gives
    # them, and t2va's first step is a one-row fp32 GEMV whose bits can depend on it. So the
    # checkpoint (the same bytes) is written with each tensor at the reference's address modulo 64.
    checkpoint = write_native_checkpoint(reference, tmp_path / "projections")
    request = make_request(model, "t2va", 4)
    assert_full_precision_tables(model, reference, checkpoint, request, r"quantized \(gguf\)")


# ------------------------------------------------------------------------------------- bitsandbytes


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_bitsandbytes_on_cpu_is_exact(load_tiny: Callable[[str], Any], kind: str) -> None:
    """bitsandbytes modules on CPU (diffusers' ``BitsAndBytesConfig`` needs a GPU, so built by hand).

    On an accelerator the combination is untested and refused (see the docs' "works with" table).
    """
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is installed by the bnb extra (make test installs it)")
    model = load_tiny("bf16-disk")
    for block in model.transformer_blocks:
        block.adaln_proj.linear = bnb_linear(block.adaln_proj.linear, kind)
    model.norm_out.linear = bnb_linear(model.norm_out.linear, kind)
    assert _projection_storage(model) == ("bitsandbytes",)
    request = make_request(model, "t2va", 4)
    assert_exact(serve(model, request), request)


def test_refusals_that_need_an_accelerator_or_ranks_to_reach() -> None:
    """bitsandbytes off the CPU and column sharding: refused by the same check enabling runs first.

    Called directly: this machine has no accelerator and the check runs before any rank work.
    """
    bnb = ProjectionStorage(quantized=("bitsandbytes",))
    options = {"checkpoint": None, "quantized_projections": "model", "precision": "match", "process_group": None}
    with pytest.raises(ConfigError, match=r"bitsandbytes-quantized AdaLN projections on cuda are untested"):
        check_storage_options(bnb, shard="layers", device=torch.device("cuda"), **options)
    check_storage_options(bnb, shard="layers", device=torch.device("cpu"), **options)
    options["process_group"] = object()  # any group: the refusal comes before the group is used
    with pytest.raises(ConfigError, match=r"--shard"):
        check_storage_options(
            ProjectionStorage(cast=("norm_out.linear",)), shard="columns", device=torch.device("cpu"), **options
        )


# ----------------------------------------------------------------------------------------- detection


def test_detection_has_no_false_positives(load_tiny: Callable[[str], Any]) -> None:
    """Plain, peft-wrapped and layerwise-cast projections are not 'quantized'; a cast model is 'cast'."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = load_tiny("bf16-disk")
    assert _projection_storage(model) == ()
    model.add_adapter(LoraConfig(r=2, target_modules=["adaln_proj.linear", "norm_out.linear"]))
    assert all(quantization_of(linear) is None for linear in (model.norm_out.linear, *projections(model)))
    cast = load_tiny("bf16-disk")
    cast.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    modules = [(i, block.adaln_proj.linear) for i, block in enumerate(cast.transformer_blocks)]
    storage = storage_of([*modules, (FINAL, cast.norm_out.linear)])
    assert storage.quantized == () and len(storage.cast) == len(cast.transformer_blocks)  # norm_out is skipped
