"""Offloading with the cache enabled: diffusers' group offloading and accelerate's offloads.

Each cached run is compared with ``torch.equal`` to the *same* offloading of the stock model. The
served weights are no parameters while enabled, so offloading never onloads them: the bytes each
forward onloads drop by exactly their size, and a rebuild pass onloads nothing. On a CPU-only
machine the offload and onload devices are both the CPU (the bytes and the exactness are what is
checked); streams, and model offload bouncing the cache between a GPU and the host, run in the
``cuda`` tests where CUDA is present. See docs/diffusers.md for what cannot run on a CPU and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

from accelerate import cpu_offload, cpu_offload_with_hook
from diffusers.hooks import apply_group_offloading
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

from adalncache.diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
from adalncache.errors import ConfigError
from adalncache.source.files import checkpoint_files
from adalncache.tools.measure import OnloadMeter, drop_page_cache, resident_served_bytes
from adalncache.tools.tiny import make_request, run_loop
from compose_helpers import gemv_residues

STEPS = 4
CPU = torch.device("cpu")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (streams, CPU<->GPU offload)")


def _stock(root: Path) -> Any:
    return MiniMaxH3Transformer3DModel.from_pretrained(root / "bf16", torch_dtype=torch.bfloat16)


def _offload(model: Any, kind: str, device: torch.device = CPU, **extra: Any) -> None:
    if kind == "block":
        apply_group_offloading(
            model,
            onload_device=device,
            offload_device=CPU,
            offload_type="block_level",
            num_blocks_per_group=1,
            **extra,
        )
    else:
        model.enable_group_offload(onload_device=device, offload_device=CPU, offload_type="leaf_level", **extra)


def _served_bytes(model: Any, *, time_embedder: bool) -> int:
    total = 0
    for name, param in model.named_parameters():
        served = ".adaln_proj.linear." in name or name.startswith("norm_out.linear.")
        if served or (time_embedder and name.startswith("time_embedder.")):
            total += param.numel() * param.element_size()
    return total


@pytest.mark.parametrize("order", ["load_transformer, then offload", "offload, then enable_adaln_cache"])
@pytest.mark.parametrize("kind", ["block", "leaf"])
def test_group_offloading_is_exact_and_never_onloads_the_projections(
    tiny_saved_root: Path, kind: str, order: str
) -> None:
    stock = _stock(tiny_saved_root)
    served = {True: _served_bytes(stock, time_embedder=True), False: _served_bytes(stock, time_embedder=False)}
    _offload(stock, kind)
    request = make_request(stock, "fl2va", STEPS, seed=3)
    stock_meter = OnloadMeter(stock)
    expected = run_loop(stock, request)

    if order.startswith("load_transformer"):
        model: Any = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
        _offload(model, kind)
        handle: Any = adaln_cache_handle(model)
    else:
        model = _stock(tiny_saved_root)
        _offload(model, kind)
        handle = enable_adaln_cache(model, tiny_saved_root / "bf16")
    meter = OnloadMeter(model)
    handle.prepare(request.plans)
    assert meter.calls == 0  # the rebuild pass ran beneath every offloading hook
    got = run_loop(model, request)
    assert got.equal(expected)
    # The time embedder is parked too unless another hook was there first (then it stays, in auto mode).
    parked_time_embedder = model.time_embedder.linear_1.weight.device.type == "meta"
    assert parked_time_embedder == order.startswith("load_transformer")
    assert stock_meter.bytes - meter.bytes == len(request.plan) * served[parked_time_embedder]
    # diffusers re-applies group offloading after a LoRA load or unload (remove, then add): the
    # offloading hooks sit outside ours, so ours keep serving.
    from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading

    _maybe_remove_and_reapply_group_offloading(model)
    assert run_loop(model, request).equal(expected)
    assert handle.stats.passes == 1
    handle.disable()
    assert run_loop(model, request).equal(expected)


def test_accelerate_cpu_offload_reads_no_projection_and_is_exact(tiny_saved_root: Path) -> None:
    """cpu_offload (what enable_sequential_cpu_offload applies) collects the state dict: the parked
    weights are in it as lazy views of the checkpoint, so collecting it reads none of them."""
    stock = _stock(tiny_saved_root)
    cpu_offload(stock, execution_device=CPU)
    request = make_request(_stock(tiny_saved_root), "t2va", STEPS, seed=3)
    expected = run_loop(stock, request)

    model: Any = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    handle: Any = adaln_cache_handle(model)
    files = checkpoint_files(tiny_saved_root / "bf16")[0]
    dropped = drop_page_cache(files)
    read_before = handle.source.bytes_read
    cpu_offload(model, execution_device=CPU)
    assert handle.source.bytes_read == read_before
    if dropped:
        assert resident_served_bytes(files) == 0
    handle.prepare(request.plans)
    assert run_loop(model, request).equal(expected)


def test_accelerate_model_offload_hook_is_exact(tiny_saved_root: Path) -> None:
    """cpu_offload_with_hook (what enable_model_cpu_offload applies) moves the model with .to()."""
    reference = _stock(tiny_saved_root)
    request = make_request(reference, "ref2va", STEPS, seed=3)
    expected = run_loop(reference, request)
    model: Any = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    adaln_cache_handle(model).prepare(request.plans)
    _, hook = cpu_offload_with_hook(model, execution_device=CPU)
    assert run_loop(model, request).equal(expected)
    hook.offload()
    assert run_loop(model, request).equal(expected)
    assert adaln_cache_handle(model).stats.passes == 1


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "built-in-forward"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_model_cpu_offload_of_a_diffusion_pipeline_is_exact(
    tiny_saved_root: Path, precision: str, prepared: bool
) -> None:
    """DiffusionPipeline.enable_model_cpu_offload (the MiniMax-H3 modular pipeline has none; a
    minimal pipeline holding the transformer stands in). device='cpu': no accelerator here.

    The reference is the stock model under the same offload: accelerate moves the model with
    ``.to("cpu:0")`` before each forward, which copies every weight to a fresh 64-byte-aligned
    allocation, and t2va's first step runs the fp32 time embedder (and an fp32 model's
    projections) as one-row GEMVs, whose bits depend on the weight's address modulo 16 on some
    CPUs; the model not offloaded keeps its weights at the file's offsets and is not bit-identical
    to the offloaded one there. The cache's build (prepared, or on the spot in the first forward)
    must project from weights where the offloaded model holds them."""
    from diffusers import DiffusionPipeline

    class TransformerOnly(DiffusionPipeline):
        model_cpu_offload_seq = "transformer"

        def __init__(self, transformer: Any) -> None:
            super().__init__()
            self.register_modules(transformer=transformer)

    dtype = torch.bfloat16 if precision == "bf16" else None
    reference = TransformerOnly(
        MiniMaxH3Transformer3DModel.from_pretrained(tiny_saved_root / precision, torch_dtype=dtype)
    )
    reference.enable_model_cpu_offload(device="cpu")
    request = make_request(reference.transformer, "t2va", STEPS, seed=5)
    with gemv_residues() as expected_gemvs:
        expected = run_loop(reference.transformer, request)
    pipe = TransformerOnly(load_transformer(tiny_saved_root / precision, torch_dtype=dtype))
    pipe.enable_model_cpu_offload(device="cpu")
    with gemv_residues() as gemvs:
        if prepared:
            adaln_cache_handle(pipe.transformer).prepare(request.plans)
        cached = run_loop(pipe.transformer, request)
    assert cached.equal(expected)
    assert gemvs == expected_gemvs  # the build's one-row GEMVs (the loop's own run none)


def test_offloading_with_accelerate_before_enabling_is_refused_with_advice(tiny_saved_root: Path) -> None:
    model = _stock(tiny_saved_root)
    cpu_offload(model, execution_device=CPU)
    with pytest.raises(ConfigError, match="enable the cache first, then offload"):
        enable_adaln_cache(model)


def test_save_pretrained_while_enabled_writes_the_stock_model(tiny_saved_root: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model: Any = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    mine = load_file(tmp_path / "saved" / "diffusion_pytorch_model.safetensors")
    theirs = load_file(tiny_saved_root / "bf16" / "diffusion_pytorch_model.safetensors")
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name


@CUDA
@pytest.mark.parametrize("kind", ["block", "leaf"])
def test_cuda_group_offloading_with_streams_is_exact(tiny_saved_root: Path, kind: str) -> None:
    cuda = torch.device("cuda")
    stock = _stock(tiny_saved_root)
    _offload(stock, kind, cuda, use_stream=True)
    request = make_request(stock, "t2va", STEPS, seed=3, device=cuda)
    expected = run_loop(stock, request)
    model: Any = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    _offload(model, kind, cuda, use_stream=True)
    handle: Any = adaln_cache_handle(model)
    handle.prepare(request.plans)
    assert handle.cache.block_params.device.type == "cuda"  # the cache follows the onload device
    assert run_loop(model, request).equal(expected)


@CUDA
def test_cuda_model_offload_bounces_the_cache_without_a_pass(tiny_saved_root: Path) -> None:
    cuda = torch.device("cuda")
    reference = _stock(tiny_saved_root).to(cuda)
    request = make_request(reference, "t2va", STEPS, seed=3, device=cuda)
    expected = run_loop(reference, request)
    model: Any = load_transformer(tiny_saved_root / "bf16", torch_dtype=torch.bfloat16)
    _, hook = cpu_offload_with_hook(model, execution_device=cuda)
    handle: Any = adaln_cache_handle(model)
    for _ in range(2):
        assert run_loop(model, request).equal(expected)
        hook.offload()
        assert handle.cache.block_params.device.type == "cpu"
    assert handle.stats.passes == 1
