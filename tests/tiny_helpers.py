"""What only the tests need of the tiny MiniMax-H3 and Qwen-Image models (``adalncache.tools.tiny*``).

* **projections-only checkpoints** (:func:`write_native_checkpoint`): the AdaLN projections alone,
  sharded with an index like the MiniMax release, each tensor at the model tensor's own address
  modulo 64 (the rebuild source reads nothing else, and an fp32 GEMV's bits depend on that address);
* **whole models in the original single-file layout** (:func:`write_native_single_file`,
  :func:`write_gguf`): what ``MiniMaxH3Transformer3DModel.from_single_file`` reads, the attention's
  ``q``, ``k``, ``v`` stacked in one ``qkv_proj`` and the SwiGLU input as ``[gate; value]``
  (:func:`adalncache.tools.tiny.native_state_dict`, the exact inverse of diffusers' conversion), as
  safetensors or, through the ``gguf`` package, as a GGUF file whose 2-D weights are quantized (what
  published GGUF checkpoints of diffusion transformers hold);
* byte counts of a model's parameters (all, or the AdaLN projections' and the time embedder's), and an
  Edit pipeline's input image.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adalncache.errors import ConfigError
from adalncache.source.files import write_safetensors
from adalncache.spec import FINAL, get_layout
from adalncache.tools.tiny import native_state_dict, projection_linears


def projection_tensors(model: nn.Module, layout: str = "native") -> dict[str, torch.Tensor]:
    """The AdaLN projection weights and biases of ``model`` under ``layout``'s tensor names."""
    key_layout = get_layout(layout)
    linears = projection_linears(model)
    layers: list[Any] = [*range(len(linears) - 1), FINAL]
    tensors: dict[str, torch.Tensor] = {}
    for layer, linear in zip(layers, linears):
        tensors[key_layout.weight(layer)] = linear.weight.detach()
        tensors[key_layout.bias(layer)] = linear.bias.detach()
    return tensors


def write_native_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    shards: int = 2,
    layout: str = "native",
    match_alignment: bool = True,
) -> Path:
    """Write the model's AdaLN projections as a sharded safetensors checkpoint in ``layout``.

    ``path`` is a directory; it receives ``shards`` files ``model-0000i-of-0000N.safetensors`` and a
    ``model.safetensors.index.json`` weight map, exactly the shape of the MiniMax release. Only
    the projections are written: they are all a rebuild source reads. With ``match_alignment``
    every tensor lands at the model tensor's own address modulo 64, so an fp32 model (built in
    memory, 64-byte aligned, or loaded from disk at odd offsets) projects bit-identically from it.
    Returns the directory.
    """
    if not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"write_native_checkpoint shards must be a positive integer, got {shards!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = projection_tensors(model, layout)
    names = list(tensors)
    # Pairs (weight, bias) stay together so a layer never straddles two shards.
    pairs = [names[i : i + 2] for i in range(0, len(names), 2)]
    shards = min(shards, len(pairs))
    per_shard = -(-len(pairs) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(shards):
        chunk = [name for pair in pairs[index * per_shard : (index + 1) * per_shard] for name in pair]
        if not chunk:
            continue
        file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in chunk}
        residues = {name: t.data_ptr() % 64 for name, t in part.items()} if match_alignment else None
        write_safetensors(part, directory / file_name, residues=residues, metadata={"format": "pt"})
        for name in chunk:
            weight_map[name] = file_name
            total += tensors[name].numel() * tensors[name].element_size()
    index_path = directory / "model.safetensors.index.json"
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return directory


def write_native_single_file(model: Any, path: str | os.PathLike[str]) -> Path:
    """Write the whole model as one native-layout ``.safetensors`` file (what ``from_single_file`` reads).

    Written by ``safetensors`` itself, tensors packed as a published file packs them (no padding
    entries a loader would report as unused weights).
    """
    from safetensors.torch import save_file

    path = Path(path)
    save_file(native_state_dict(model), os.fspath(path), metadata={"format": "pt"})
    return path


def write_gguf(
    model: Any,
    path: str | os.PathLike[str],
    qtype: str = "Q8_0",
    *,
    quantize: Callable[[str, torch.Tensor], bool] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    arch: str = "minimax-h3",
) -> dict[str, str]:
    """Write the whole model as a GGUF file in its single-file layout; returns each tensor's stored type.

    ``tensors``: the state dict in the layout the class's ``from_single_file`` reads (default: a
    MiniMax-H3 ``model``'s native layout). 2-D weights are quantized to ``qtype`` (a
    ``gguf.GGMLQuantizationType`` name such as ``"Q8_0"``, ``"Q4_0"``, ``"Q4_K"``, ``"BF16"``)
    when ``quantize(name, tensor)`` allows it (default: every 2-D weight) and their rows are a
    whole number of ``qtype`` blocks; everything else is stored as F32, as published diffusion
    GGUFs keep norms and biases.
    """
    import gguf
    import numpy as np

    try:
        quant_type = getattr(gguf.GGMLQuantizationType, qtype)
    except AttributeError:
        raise ConfigError(f"qtype={qtype!r} is not a gguf.GGMLQuantizationType name") from None
    block, _ = gguf.GGML_QUANT_SIZES[quant_type]
    wanted = quantize or (lambda name, tensor: tensor.dim() == 2)
    writer = gguf.GGUFWriter(os.fspath(path), arch=arch)
    kinds: dict[str, str] = {}
    try:
        for name, tensor in (native_state_dict(model) if tensors is None else tensors).items():
            array = tensor.float().numpy()
            if wanted(name, tensor) and array.shape[-1] % block == 0:
                packed = _quantize_q4_k(array) if qtype == "Q4_K" else gguf.quants.quantize(array, quant_type)
                writer.add_tensor(name, packed, raw_dtype=quant_type)
                kinds[name] = qtype
            else:
                writer.add_tensor(name, array.astype(np.float32))
                kinds[name] = "F32"
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return kinds


def auraflow_original_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """An ``AuraFlowTransformer2DModel``'s state dict in the original release's names: what its
    ``from_single_file`` reads (the exact inverse of diffusers'
    ``convert_auraflow_transformer_checkpoint_to_diffusers``, whose final modulation swaps its
    shift and scale halves)."""
    config = model.config
    names = {
        "register_tokens": "register_tokens",
        "time_step_proj.linear_1": "t_embedder.mlp.0",
        "time_step_proj.linear_2": "t_embedder.mlp.2",
        "context_embedder": "cond_seq_linear",
        "proj_out": "final_linear",
        "pos_embed.pos_embed": "positional_encoding",
        "pos_embed.proj": "init_x_linear",
    }
    ff = {"linear_1": "c_fc1", "linear_2": "c_fc2", "out_projection": "c_proj"}
    for i in range(config.num_mmdit_layers):
        ours, theirs = f"joint_transformer_blocks.{i}", f"double_layers.{i}"
        for path, original in (("ff", "mlpX"), ("ff_context", "mlpC")):
            names.update({f"{ours}.{path}.{k}": f"{theirs}.{original}.{v}" for k, v in ff.items()})
        names[f"{ours}.norm1.linear"], names[f"{ours}.norm1_context.linear"] = f"{theirs}.modX.1", f"{theirs}.modC.1"
        attention = {"to_q": "w2q", "to_k": "w2k", "to_v": "w2v", "to_out.0": "w2o", "add_q_proj": "w1q"}
        attention.update({"add_k_proj": "w1k", "add_v_proj": "w1v", "to_add_out": "w1o"})
        names.update({f"{ours}.attn.{k}": f"{theirs}.attn.{v}" for k, v in attention.items()})
    for i in range(config.num_single_dit_layers):
        ours, theirs = f"single_transformer_blocks.{i}", f"single_layers.{i}"
        names.update({f"{ours}.ff.{k}": f"{theirs}.mlp.{v}" for k, v in ff.items()})
        names[f"{ours}.norm1.linear"] = f"{theirs}.modCX.1"
        attention = {"to_q": "w1q", "to_k": "w1k", "to_v": "w1v", "to_out.0": "w1o"}
        names.update({f"{ours}.attn.{k}": f"{theirs}.attn.{v}" for k, v in attention.items()})
    out = {}
    for key, tensor in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if key == "norm_out.linear.weight":
            shift, scale = tensor.chunk(2, dim=0)
            out["modF.1.weight"] = torch.cat([scale, shift])
        elif key in names:
            out[names[key]] = tensor
        else:
            out[f"{names[module]}.{leaf}"] = tensor  # a KeyError names a parameter the mapping misses
    return out


def _quantize_q4_k(array: Any) -> Any:
    """``array`` (rows a multiple of 256 wide) as Q4_K blocks, the bytes a K-quant GGUF holds.

    The ``gguf`` package reads K-quants but writes none, so this is llama.cpp's block layout with a
    plain round-to-nearest choice of scales: per 256 values an fp16 ``d`` and ``dmin``, eight 6-bit
    sub-block scales and mins packed in 12 bytes, and 4-bit values, two to a byte. Any choice of
    scales is a valid file; the test only needs the library to dequantize what is there.
    """
    import numpy as np

    rows = array.astype(np.float32).reshape(-1, 8, 32)  # 256-value blocks of eight 32-value sub-blocks
    low = np.minimum(rows.min(axis=-1), 0.0)
    scale = (rows.max(axis=-1) - low) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16)
    safe_d, safe_dmin = np.where(d == 0, 1, d).astype(np.float32), np.where(dmin == 0, 1, dmin).astype(np.float32)
    sc = np.clip(np.rint(scale / safe_d[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / safe_dmin[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None, None] * sc[..., None]
    offset = dmin.astype(np.float32)[:, None, None] * mn[..., None]
    q = np.clip(np.rint((rows + offset) / np.where(step == 0, 1, step)), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6), (sc[:, 4:] & 15) | (mn[:, 4:] << 4)],
        axis=-1,
    )
    pairs = q.reshape(-1, 4, 2, 32)  # each 64 values: the first 32 in the low nibbles, the next 32 in the high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales, qs], -1
    )
    return blocks.reshape(*array.shape[:-1], array.shape[-1] // 256 * 144)


def parameter_bytes(model: nn.Module, device: str | torch.device | None = None) -> int:
    """Bytes of the model's parameters that hold real storage (meta placeholders count 0).

    ``device`` restricts the count to one device type (e.g. ``"cpu"``, ``"cuda"``).
    """
    wanted = None if device is None else torch.device(device).type
    return sum(
        param.numel() * param.element_size()
        for param in model.parameters()
        if param.device.type != "meta" and (wanted is None or param.device.type == wanted)
    )


def adaln_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the AdaLN projection parameters (and the time embedder's) held on a real device."""
    modules: list[Any] = [*projection_linears(model), model.time_embedder]
    params = [p for module in modules for p in module.parameters() if p.device.type != "meta"]
    return sum(p.numel() * p.element_size() for p in params)


def tiny_edit_image(seed: int = 0, size: tuple[int, int] = (32, 24)) -> Any:
    """A deterministic RGB ``PIL.Image`` of ``size`` (width, height): an Edit pipeline's input image."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def bnb_linear(linear: nn.Linear, kind: str) -> nn.Module:
    """A bitsandbytes module of ``linear``'s weight in bf16, on CPU (``"int8"``: ``Linear8bitLt``;
    ``"nf4"``: ``Linear4bit``): diffusers' ``BitsAndBytesConfig`` refuses to load without a GPU."""
    import bitsandbytes as bnb

    weight = linear.weight.data.to(torch.bfloat16)
    bias = None if linear.bias is None else linear.bias.data.to(torch.bfloat16)  # AuraFlow's have none
    if kind == "nf4":
        new = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias is not None, compute_dtype=torch.bfloat16, quant_type="nf4"
        )
        new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")._quantize("cpu")
    else:
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias is not None, has_fp16_weights=False)
        new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        new.bias = nn.Parameter(bias, requires_grad=False)
    return new.to("cpu")


def reachable_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``module``, by the path that reaches it.

    Walked: parameters, buffers, submodules and every other attribute, through containers and
    through the objects they hold (a quantization library's state: bitsandbytes' ``state.CB`` /
    ``state.SCB``, a ``QuantState``'s ``absmax``), and into tensor subclasses (their
    ``__tensor_flatten__`` inner tensors: torchao's ``qdata`` and ``scale``, quanto's ``_data`` and
    ``_scale``; and their attributes: ``Int8Params.CB``, ``Params4bit.quant_state``). Not walked:
    functions and classes, and the AdaLN cache's own objects (its hooks hold the host copies it
    restores from, by design): what is checked is what the *model* still holds.
    """
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value: Any, path: str) -> None:
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool, type)):
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found[path] = value
            flatten = getattr(value, "__tensor_flatten__", None)
            if flatten is not None and type(value) not in (torch.Tensor, nn.Parameter):
                for inner in flatten()[0]:
                    walk(getattr(value, inner), f"{path}.{inner}")
            for name, attribute in getattr(value, "__dict__", {}).items():
                walk(attribute, f"{path}.{name}")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]")
        elif isinstance(value, (list, tuple, set, frozenset)):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")
        elif callable(value) and not isinstance(value, nn.Module):
            return  # functions, bound methods, hooks
        elif (type(value).__module__ or "").startswith("adalncache"):
            return
        elif hasattr(value, "__dict__"):
            for name, attribute in vars(value).items():
                walk(attribute, f"{path}.{name}" if path else name)

    walk(module, "")
    return found


def weight_bytes_held(module: nn.Module) -> dict[str, int]:
    """The tensors reachable from ``module`` (:func:`reachable_tensors`) that hold data, with their bytes.

    Meta placeholders, empty tensors (the 0-element dtype marker a parked module keeps) and
    single-element ones (optimum-quanto's ``input_scale`` / ``output_scale`` buffers: activation
    scales, not derived from the weight; a weight, or its scales, has at least one element per
    output row) hold none; anything else found on a served module is a weight the cache failed
    to free.
    """
    held = {}
    for path, tensor in reachable_tensors(module).items():
        if tensor.device.type != "meta" and tensor.numel() > 1:
            held[path] = tensor.numel() * tensor.element_size()
    return held


def register_state_machine_profiles(name: str, *, ci: tuple[int, int], soak: tuple[int, int]) -> None:
    """The two hypothesis profiles of a state-machine test: ``adalncache-{name}-ci`` (``make test``:
    derandomized, the first bug shrunk only, so a mutant fails within the CI budget) and
    ``adalncache-{name}-soak`` (``make soak``: random). ``ci`` and ``soak``: (examples, steps per example)."""
    from hypothesis import HealthCheck, settings

    common: dict[str, Any] = {
        "database": None,
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    }
    settings.register_profile(
        f"adalncache-{name}-ci",
        max_examples=ci[0],
        stateful_step_count=ci[1],
        derandomize=True,
        print_blob=False,
        report_multiple_bugs=False,
        **common,
    )
    settings.register_profile(
        f"adalncache-{name}-soak", max_examples=soak[0], stateful_step_count=soak[1], derandomize=False, **common
    )
