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
* byte counts of a model's parameters, and an Edit pipeline's input image.
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


def tiny_edit_image(seed: int = 0, size: tuple[int, int] = (32, 24)) -> Any:
    """A deterministic RGB ``PIL.Image`` of ``size`` (width, height): an Edit pipeline's input image."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


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

    Meta placeholders and empty tensors (the 0-element dtype marker a parked module keeps) hold
    none; anything else found on a served module is a weight the cache failed to free.
    """
    held = {}
    for path, tensor in reachable_tensors(module).items():
        if tensor.device.type != "meta" and tensor.numel() > 0:
            held[path] = tensor.numel() * tensor.element_size()
    return held
