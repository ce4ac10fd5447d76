"""Whole tiny MiniMax-H3 models in the original (native) single-file layout: safetensors and GGUF.

``MiniMaxH3Transformer3DModel.from_single_file`` reads the layout MiniMax publishes: one file,
``blocks.*`` / ``final_layer.*`` names, the attention's ``q``, ``k``, ``v`` stacked in one
``qkv_proj`` and the SwiGLU input as ``[gate; value]``. The projections-only checkpoints of
:mod:`.tiny` cannot be loaded that way, so this module writes the whole model: the exact inverse of
diffusers' ``convert_minimax_h3_transformer_checkpoint_to_diffusers`` (a round trip gives back an
equal state dict), as safetensors or, through the ``gguf`` package, as a GGUF file whose 2-D
weights are quantized (what published GGUF checkpoints of diffusion transformers hold).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

#: diffusers name fragment -> native fragment, applied in this order (the inverse of diffusers' renames).
_RENAMES = (
    ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
    ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("audio_proj_in.", "audio_patch_proj."),
    ("audio_proj_out.", "final_layer.audio_out."),
    ("context_embedder.", "condition_proj."),
    ("norm_out.norm.", "final_layer.norm."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    (".attn.norm_q.", ".attn.q_norm."),
    (".attn.norm_k.", ".attn.k_norm."),
    (".attn.to_out.0.", ".attn.out_proj."),
    (".ff.net.0.proj.", ".mlp.fc1."),
    (".ff.net.2.", ".mlp.fc2."),
)


def _native_name(key: str) -> str:
    if key.startswith("transformer_blocks."):
        key = "blocks." + key[len("transformer_blocks.") :]
    elif key.startswith("proj_in."):
        key = "video_patch_proj." + key[len("proj_in.") :]
    elif key.startswith("proj_out."):
        key = "final_layer.video_out." + key[len("proj_out.") :]
    for diffusers_name, native_name in _RENAMES:
        key = key.replace(diffusers_name, native_name)
    return key


def native_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under the native single-file names (views where no rearranging is needed)."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    for key in [k for k in state if k.endswith(".attn.to_q.weight")]:
        stem = key[: -len(".attn.to_q.weight")]
        q, k, v = (state.pop(f"{stem}.attn.to_{name}.weight") for name in "qkv")
        state[f"{stem}.attn.qkv_proj.weight"] = torch.cat([q, k, v])  # the published "stacked" [q; k; v]
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".ff.net.0.proj.weight"):
            value_half, gate = torch.chunk(value, 2)  # SwiGLU reads [value; gate]; the native file holds [gate; value]
            value = torch.cat([gate, value_half])
        out[_native_name(key)] = value.contiguous()
    return out


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
) -> dict[str, str]:
    """Write the whole model as a native-layout GGUF file; returns each tensor's stored type.

    2-D weights are quantized to ``qtype`` (a ``gguf.GGMLQuantizationType`` name such as
    ``"Q8_0"``, ``"Q4_0"``, ``"BF16"``) when ``quantize(name, tensor)`` allows it (default: every
    2-D weight) and their rows are a whole number of ``qtype`` blocks; everything else is stored
    as F32, as published diffusion GGUFs keep norms and biases.
    """
    import gguf
    import numpy as np

    try:
        quant_type = getattr(gguf.GGMLQuantizationType, qtype)
    except AttributeError:
        raise ConfigError(f"qtype={qtype!r} is not a gguf.GGMLQuantizationType name") from None
    block, _ = gguf.GGML_QUANT_SIZES[quant_type]
    wanted = quantize or (lambda name, tensor: tensor.dim() == 2)
    writer = gguf.GGUFWriter(os.fspath(path), arch="minimax-h3")
    kinds: dict[str, str] = {}
    try:
        for name, tensor in native_state_dict(model).items():
            array = tensor.float().numpy()
            if wanted(name, tensor) and array.shape[-1] % block == 0:
                writer.add_tensor(name, gguf.quants.quantize(array, quant_type), raw_dtype=quant_type)
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


__all__ = ["native_state_dict", "write_gguf", "write_native_single_file"]
