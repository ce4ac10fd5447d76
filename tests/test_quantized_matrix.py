"""Every quantization users run, on every family: served exactly, freed entirely, given back as it was.

The matrix: torchao int8 and float8 weight-only (``quantize_`` on the whole model), torchao through
``TorchAoConfig`` at ``from_pretrained``, GGUF single files (Q8_0 and the K-quant Q4_K) through
``from_single_file``, optimum-quanto qint8, and bitsandbytes 8-bit and 4-bit (nf4) modules, on
MiniMax-H3, Qwen-Image and two AdaLayerNormZero classes (AuraFlow and HunyuanImage-2.1). Each cell
asserts that

- the cache serves the quantized model's own outputs (``torch.equal`` over several forwards, one
  pass building every plan first);
- while enabled no tensor reachable from a served module holds data
  (:func:`tiny_helpers.weight_bytes_held` walks parameters, buffers, library state such as
  bitsandbytes' ``state.CB``/``SCB`` and ``quant_state``, and tensor subclasses' inner tensors);
- ``disable()`` puts back the same quantized classes and bytes (every reachable tensor, its type
  and ``torch.equal`` of its data) and the same outputs.

bitsandbytes' ``BitsAndBytesConfig`` refuses to load without a GPU, so its modules are built by hand
from each projection (on CPU, as users of CPU bitsandbytes build them). A cell that cannot run says
why in its skip reason; the docs' "Works with" table says the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

import adaln_zero_helpers as tiny_adaln_zero
from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.integrations.diffusers.family import base_linear, family_of
from adalncache.integrations.diffusers.quantized import storage_of
from adalncache.tools.tiny import (
    SIZES,
    make_request,
    native_state_dict,
    projection_linears,
    run_loop,
    tiny_transformer,
)
from adalncache.tools.tiny_qwen import BASE, modulation_linears, tiny_qwen_inputs, tiny_qwen_transformer
from test_adaln_zero_serving import request_plans, run
from tiny_helpers import (
    auraflow_original_state_dict,
    bnb_linear,
    reachable_tensors,
    weight_bytes_held,
    write_gguf,
)

EXTRA = "installed by the compose extra (make test installs it)"
BNB = "bitsandbytes is installed by the bnb extra (make test installs it)"

# ----------------------------------------------------------------------------------------- families


def _seeded(build: Callable[[], Any], linears: Callable[[Any], list[Any]]) -> Any:
    """``build()`` under seed 0 with its AdaLN projections widened, as the tiny models' builders do."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build()
        with torch.no_grad():
            for linear in linears(model):
                linear.weight.mul_(4.0)
                linear.bias.normal_(0.0, 0.5)
    return model.eval()


def _minimax(wide: bool) -> Any:
    if not wide:
        return tiny_transformer("tiny")
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return _seeded(lambda: MiniMaxH3Transformer3DModel(**{**SIZES["tiny"], "time_embed_dim": 256}), projection_linears)


def _minimax_run(model: Any) -> list[torch.Tensor]:
    result = run_loop(model, make_request(model, "t2va", 4))
    return [t for pair in result.outputs for t in pair] + [result.latents, result.audio_latents]


QWEN_TIMESTEPS = (0.9, 0.85, 0.5)


def _qwen(wide: bool) -> Any:
    if not wide:
        return tiny_qwen_transformer("plain")
    from diffusers import QwenImageTransformer2DModel

    config = {**BASE, "attention_head_dim": 128, "axes_dims_rope": (32, 48, 48)}
    return _seeded(lambda: QwenImageTransformer2DModel(**config), modulation_linears)


def _qwen_plans(model: Any) -> list[torch.Tensor]:
    """The timesteps of :func:`_qwen_run`, in the model's dtype as the pipeline passes them."""
    return [torch.tensor([t]).to(model.img_in.bias.dtype) for t in QWEN_TIMESTEPS]  # a GGUF weight is uint8


def _qwen_run(model: Any) -> list[torch.Tensor]:
    inputs = tiny_qwen_inputs(model, 1, dtype=model.img_in.bias.dtype)
    outputs = []
    for timestep in _qwen_plans(model):
        inputs["timestep"] = timestep
        with torch.no_grad():
            outputs.append(model(**inputs)[0])
    return outputs


def _adaln_zero(name: str, **wide: Any) -> Callable[[bool], Any]:
    return lambda is_wide: tiny_adaln_zero.build(name, **(wide if is_wide else {}))


@dataclass(frozen=True)
class Family:
    """A family's tiny model (``wide``: projections 256 inputs wide, a whole K-quant block), a run
    of several forwards, what ``prepare`` takes for them, and, if diffusers has a single-file loader
    for the class, its single-file layout, the GGUF architecture name and what names the AdaLN
    projections' tensors there."""

    build: Callable[[bool], Any]
    run: Callable[[Any], list[torch.Tensor]]
    plans: Callable[[Any], list[Any]]
    single_file: Callable[[Any], dict[str, torch.Tensor]] | None = None
    arch: str = ""
    projections: tuple[str, ...] = ()


FAMILIES = {
    "MiniMax-H3": Family(
        _minimax,
        _minimax_run,
        lambda model: make_request(model, "t2va", 4).plans,
        native_state_dict,
        "minimax-h3",
        ("adaln_proj",),
    ),
    "Qwen-Image": Family(
        _qwen,
        _qwen_run,
        _qwen_plans,
        lambda model: dict(model.state_dict()),  # its single-file layout is diffusers' own
        "qwen-image",
        ("img_mod", "txt_mod", "norm_out"),
    ),
    "AuraFlow": Family(
        _adaln_zero("AuraFlowTransformer2DModel", attention_head_dim=128, caption_projection_dim=256),
        run,
        request_plans,
        auraflow_original_state_dict,
        "auraflow",
        ("modX", "modC", "modF"),
    ),
    "HunyuanImage-2.1": Family(_adaln_zero("HunyuanImageTransformer2DModel"), run, request_plans),
}


def _served(model: Any) -> dict[str, nn.Module]:
    """Each served projection's linear (the module that held the weight), by module path."""
    family = family_of(model)
    return {
        family.projection_path(layer): base_linear(family.projection_module(model, layer))
        for layer in family.model_layers(model)
    }


# ------------------------------------------------------------------------------------ quantizations


def _torchao(model: Any, config: str) -> Any:
    quantization = pytest.importorskip("torchao.quantization", reason=f"torchao is {EXTRA}")
    quantization.quantize_(model, getattr(quantization, config)())
    return model


def _torchao_config(model: Any, tmp_path: Path) -> Any:
    quantization = pytest.importorskip("torchao.quantization", reason=f"torchao is {EXTRA}")
    from diffusers import TorchAoConfig

    model.save_pretrained(tmp_path / "saved")
    config = TorchAoConfig(quantization.Int8WeightOnlyConfig())
    # bf16: torchao's quantizer loads the rest of the model in bf16 whatever torch_dtype says (it warns).
    return (
        type(model).from_pretrained(tmp_path / "saved", torch_dtype=torch.bfloat16, quantization_config=config).eval()
    )


def _gguf(model: Any, tmp_path: Path, qtype: str, family: Family) -> Any:
    pytest.importorskip("gguf", reason=f"gguf is {EXTRA}")
    from diffusers import GGUFQuantizationConfig

    logging.getLogger("diffusers").setLevel(logging.ERROR)  # "dequantizing ... to remain in FP32"
    path = tmp_path / f"tiny-{qtype}.gguf"
    assert family.single_file is not None
    tensors = family.single_file(model)

    def quantize(name: str, tensor: torch.Tensor) -> bool:
        # Q4_K: the AdaLN projections only (diffusers dequantizes K-quants slowly on CPU; the rest as F32).
        return tensor.dim() == 2 and (qtype != "Q4_K" or any(part in name for part in family.projections))

    kinds = write_gguf(model, path, qtype, quantize=quantize, tensors=tensors, arch=family.arch)
    projections = [name for name in kinds if name.endswith("weight") and any(p in name for p in family.projections)]
    assert projections and all(kinds[name] == qtype for name in projections), kinds
    model.save_pretrained(tmp_path / "config")
    return (
        type(model)
        .from_single_file(
            str(path),
            config=str(tmp_path / "config"),
            local_files_only=True,
            torch_dtype=torch.float32,
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        )
        .eval()
    )


def _quanto(model: Any) -> Any:
    quanto = pytest.importorskip("optimum.quanto", reason=f"optimum-quanto is {EXTRA}")
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    return model


def _bitsandbytes(model: Any, kind: str) -> Any:
    """The model in bf16 (as ``BitsAndBytesConfig`` loads it: ``torch_dtype=torch.bfloat16``) with its
    AdaLN projections as bitsandbytes modules."""
    pytest.importorskip("bitsandbytes", reason=BNB)
    return _bnb_projections(model.to(torch.bfloat16), kind)


def _bnb_projections(model: Any, kind: str) -> Any:
    for path, linear in _served(model).items():
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, bnb_linear(linear, kind))
    return model


#: Each quantization: the library that detection must name, and how a fresh fp32 model gets quantized.
QUANTIZATIONS: dict[str, tuple[str, Callable[[Any, Path, Family], Any]]] = {
    "torchao-int8": ("torchao", lambda model, tmp, family: _torchao(model, "Int8WeightOnlyConfig")),
    "torchao-float8": ("torchao", lambda model, tmp, family: _torchao(model, "Float8WeightOnlyConfig")),
    "TorchAoConfig": ("torchao", lambda model, tmp, family: _torchao_config(model, tmp)),
    "gguf-Q8_0": ("gguf", lambda model, tmp, family: _gguf(model, tmp, "Q8_0", family)),
    "gguf-Q4_K": ("gguf", lambda model, tmp, family: _gguf(model, tmp, "Q4_K", family)),
    "quanto-qint8": ("optimum-quanto", lambda model, tmp, family: _quanto(model)),
    "bnb-int8": ("bitsandbytes", lambda model, tmp, family: _bitsandbytes(model, "int8")),
    "bnb-nf4": ("bitsandbytes", lambda model, tmp, family: _bitsandbytes(model, "nf4")),
}

#: The cells that cannot run, and why (the docs' "Works with" table says the same).
CANNOT = {
    ("gguf-Q8_0", "HunyuanImage-2.1"): "diffusers 0.42.1 has no single-file loader for "
    "HunyuanImageTransformer2DModel (not in SINGLE_FILE_LOADABLE_CLASSES), and GGUF loads only through one",
    ("gguf-Q4_K", "HunyuanImage-2.1"): "diffusers 0.42.1 has no single-file loader for "
    "HunyuanImageTransformer2DModel (not in SINGLE_FILE_LOADABLE_CLASSES), and GGUF loads only through one",
}


def _snapshot(modules: dict[str, nn.Module]) -> dict[str, tuple[type, torch.Tensor | None]]:
    """Every tensor reachable from each module: its type, and a copy of its data when it holds its own
    (a wrapper subclass holds none: its inner tensors are walked and copied)."""
    out: dict[str, tuple[type, torch.Tensor | None]] = {}
    for path, module in modules.items():
        for where, tensor in reachable_tensors(module).items():
            wrapper = type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__")
            data = None if wrapper or tensor.device.type == "meta" else tensor.detach().as_subclass(torch.Tensor)
            out[f"{path}{where}"] = (type(tensor), None if data is None else data.clone())
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("family_name", list(FAMILIES))
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_quantized_model_is_served_exactly_freed_and_given_back(
    quantization: str, family_name: str, tmp_path: Path
) -> None:
    if (quantization, family_name) in CANNOT:
        pytest.skip(CANNOT[(quantization, family_name)])
    family = FAMILIES[family_name]
    library, quantize = QUANTIZATIONS[quantization]
    model = quantize(family.build(quantization == "gguf-Q4_K"), tmp_path, family)
    served = _served(model)
    assert storage_of(list(served.items())).quantized == (library,)

    expected = family.run(model)  # the first forward: bitsandbytes moves its 8-bit weight into state
    before = _snapshot(served)
    handle = enable_adaln_cache(model)
    handle.prepare(family.plans(model))
    assert _equal(family.run(model), expected)
    assert handle.stats.passes == 1, handle.stats.as_dict()
    held = {path: weight_bytes_held(module) for path, module in served.items()}
    assert not any(held.values()), {path: tensors for path, tensors in held.items() if tensors}
    handle.disable()

    after = _snapshot(_served(model))
    assert after.keys() == before.keys()
    for where, (cls, data) in before.items():
        assert after[where][0] is cls, where
        restored = after[where][1]
        assert (data is None and restored is None) or (data is not None and restored is not None), where
        assert data is None or (restored is not None and torch.equal(restored, data)), where
    assert _equal(family.run(model), expected)


def test_bitsandbytes_8bit_state_leaves_with_the_weight_and_comes_back() -> None:
    """``Linear8bitLt`` keeps its int8 weight and scales in ``module.state`` (``CB``, ``SCB``) after a
    forward: enabling takes them off the module with the weight, ``disable()`` puts the same objects back."""
    pytest.importorskip("bitsandbytes", reason=BNB)
    model = _bitsandbytes(tiny_qwen_transformer("plain"), "int8")
    module = model.norm_out.linear
    expected = _qwen_run(model)
    state, weight = module.state, module.weight
    cb, scb = state.CB, state.SCB
    assert cb is not None and scb is not None and weight.CB is None  # what the bug left on the module
    handle = enable_adaln_cache(model)
    handle.prepare(_qwen_plans(model))
    assert _equal(_qwen_run(model), expected)
    assert state.CB is None and state.SCB is None and weight_bytes_held(module) == {}
    handle.disable()
    assert module.weight is weight and state.CB is cb and state.SCB is scb and weight.CB is None
    assert _equal(_qwen_run(model), expected)


def test_bitsandbytes_in_a_model_of_another_dtype_is_refused() -> None:
    """bf16 bitsandbytes projections in an fp32 model: which dtype the forward feeds them decides the
    bits they return, and the cache cannot tell it, so enabling refuses (measured on Qwen-Image with
    4-bit projections: served, the outputs would differ) and leaves the model as it was."""
    pytest.importorskip("bitsandbytes", reason=BNB)
    model = _bnb_projections(tiny_qwen_transformer("plain"), "nf4")
    expected = _qwen_run(model)
    with pytest.raises(ConfigError, match=r"bfloat16 parameters in a float32 model.*torch_dtype="):
        enable_adaln_cache(model)
    assert all(p.device.type != "meta" for p in model.parameters())
    assert _equal(_qwen_run(model), expected)
