"""A family's ``embed(plan)`` built from a checkpoint's time-embedder weights (MiniMax-H3, Qwen-Image).

Why it exists: a cache filled without the model in memory (``adalncache build``, ``verify``, a
torchrun build) still needs the projections' exact input for each plan. That input is MiniMax-H3's
own: diffusers' ``Timesteps`` (``flip_sin_to_cos=True``, ``downscale_freq_shift=0``) and
``TimestepEmbedding`` loaded with the checkpoint's time-embedder weights (the names come from the
key layout), then SiLU in the embedder's dtype and only then the cast to the projection dtype.
The weights are read into buffers that keep their file offset modulo 64, as the source keeps the
projections', because an fp32 GEMV's bits depend on the weight's address: a copy at another
alignment would give other bits than the model loaded from the same file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .errors import CheckpointError, ConfigError
from .families import adaln_zero, qwen_image
from .source.checkpoint import CheckpointSource
from .spec import ModulationSpec


def _read_float(source: CheckpointSource, name: str) -> torch.Tensor:
    """One time-embedder tensor as the file holds it (its address keeps the file offset's alignment)."""
    header, entry = source.entry(name)
    if entry.torch_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"{header.path}: tensor {name} has dtype {entry.dtype}, expected F32, BF16 or F16")
    return source.read_tensor(name)


def has_time_embedder(source: CheckpointSource) -> bool:
    """Whether the checkpoint holds every time-embedder tensor of its layout."""
    return not _missing(source)


def _time_embedder_tensors(source: CheckpointSource) -> list[str]:
    """The time-embedder tensors the checkpoint's model needs.

    The AdaLayerNormZero family's layout lists every class's time embedders; a checkpoint needs
    its own class's timestep embedder (the optional ones depend on its config, and the
    checkpoint-only embed names any that is missing).
    """
    names = source.layout.time_embedder_tensors()
    spec = source.spec
    if spec.family.name != adaln_zero.FAMILY.name:
        return names
    class_name = adaln_zero.class_of(spec.model_geometry)
    first = adaln_zero.layout_of(class_name).time_embedders[0]
    return [name for name in names if name.startswith(f"{first}.linear_")]


def _missing(source: CheckpointSource) -> list[str]:
    missing = []
    for name in _time_embedder_tensors(source):
        try:
            source.entry(name)
        except KeyError:
            missing.append(name)
    return missing


def time_embed_fn(
    source: CheckpointSource, spec: ModulationSpec, device: torch.device | str = "cpu"
) -> Callable[[torch.Tensor], Any]:
    """``embed(plan)`` of the checkpoint's family from its time-embedder weights, on ``device``.

    MiniMax-H3's below; Qwen-Image's (:func:`qwen_image_embed_fn`) for a Qwen-Image spec.
    """
    if spec.family.name == qwen_image.FAMILY.name:
        return qwen_image_embed_fn(source, spec, device)
    return minimax_h3_embed_fn(source, spec, device)


def minimax_h3_embed_fn(
    source: CheckpointSource, spec: ModulationSpec, device: torch.device | str = "cpu"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``embed(plan)`` of MiniMax-H3 from the checkpoint's time-embedder weights, on ``device``.

    Raises CheckpointError when the checkpoint has no time embedder (a file of the projections
    alone) or its shapes do not produce ``spec.time_embed_dim`` features; ConfigError without
    diffusers.
    """
    try:
        from diffusers.models.embeddings import TimestepEmbedding, Timesteps
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("build and verify need diffusers (pip install 'adalncache[diffusers]')") from exc
    missing = _missing(source)
    if missing:
        raise CheckpointError(
            f"the checkpoint has no time-embedder weights ({', '.join(missing)} missing from "
            f"{', '.join(str(f) for f in source.files)}): build and verify compute the projections' input "
            f"from them; pass the whole transformer checkpoint, not only its AdaLN projections"
        )
    names = source.layout.time_embedder_tensors()
    w1, b1, w2, b2 = (_read_float(source, name) for name in names)
    if w1.dim() != 2 or w2.dim() != 2 or w2.shape[1] != w1.shape[0] or w2.shape[0] != spec.time_embed_dim:
        raise CheckpointError(
            f"time-embedder shapes {list(w1.shape)} and {list(w2.shape)} do not produce the projections' "
            f"{spec.time_embed_dim} input features"
        )
    freq_dim, hidden = w1.shape[1], w1.shape[0]
    device = torch.device(device)
    time_proj = Timesteps(num_channels=freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
    embedder = TimestepEmbedding(in_channels=freq_dim, time_embed_dim=hidden, out_dim=spec.time_embed_dim)
    for linear, (w, b) in ((embedder.linear_1, (w1, b1)), (embedder.linear_2, (w2, b2))):
        linear.weight = torch.nn.Parameter(w if device.type == "cpu" else w.to(device), requires_grad=False)
        linear.bias = torch.nn.Parameter(b if device.type == "cpu" else b.to(device), requires_grad=False)
    embedder.eval()
    embed_dtype = w1.dtype

    def embed(plan: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            temb = time_proj(plan.to(device))
            temb = embedder(temb.to(embed_dtype))
            return F.silu(temb).to(spec.dtype)

    return embed


def qwen_image_embed_fn(
    source: CheckpointSource, spec: ModulationSpec, device: torch.device | str = "cpu"
) -> Callable[[torch.Tensor], Any]:
    """``embed(plan)`` of Qwen-Image from the checkpoint: diffusers' own ``QwenTimestepProjEmbeddings``.

    The module the transformer runs, given the checkpoint's weights (read at their file alignment)
    and run in the spec's dtype, as a model loaded in that dtype runs it: the plan's timestep cast
    to the dtype, ``time_proj``, the embedder, plus the ``additional_t_cond`` embedding for a
    two-column plan; then SiLU. With ``zero_cond_t`` (the geometry's second input) the first half
    of the rows is the second input.
    """
    try:
        from diffusers.models.transformers.transformer_qwenimage import QwenTimestepProjEmbeddings
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("build and verify need diffusers (pip install 'adalncache[diffusers]')") from exc
    missing = _missing(source)
    if missing:
        raise CheckpointError(
            f"the checkpoint has no time-embedder weights ({', '.join(missing)} missing): build and verify compute "
            "the projections' input from them; pass the whole transformer checkpoint"
        )
    layered = spec.plan_columns == 2
    module = QwenTimestepProjEmbeddings(spec.in_features, use_additional_t_cond=layered).eval()
    device = torch.device(device)
    names = source.layout.time_embedder_tensors()
    tensors = {name: _read_float(source, name) for name in names}
    if layered:
        tensors[qwen_image.ADDITION_WEIGHT] = _read_float(source, qwen_image.ADDITION_WEIGHT)
    prefix = qwen_image.TIME_TEXT_EMBED + "."
    for name, tensor in tensors.items():
        owner, _, attr = name.removeprefix(prefix).rpartition(".")
        value = tensor if tensor.dtype == spec.dtype else tensor.to(spec.dtype)
        setattr(
            module.get_submodule(owner), attr, torch.nn.Parameter(value.to(device), requires_grad=False)
        )  # a CPU tensor of the spec's dtype stays the file's view: .to is a no-op
    zero_cond = qwen_image.FIRST in spec.inputs
    hidden = torch.empty(0, dtype=spec.dtype, device=device)

    def embed(plan: torch.Tensor) -> Any:
        plan = plan.to(device)
        timestep = (plan[:, 0] if plan.dim() == 2 else plan).to(spec.dtype)
        additional = plan[:, 1].to(torch.long) if plan.dim() == 2 else None
        with torch.no_grad():
            temb = module(timestep, hidden, additional)
            if not zero_cond:
                return F.silu(temb)
            return {qwen_image.INPUT: F.silu(temb), qwen_image.FIRST: F.silu(temb.chunk(2, dim=0)[0])}

    return embed


__all__ = ["has_time_embedder", "minimax_h3_embed_fn", "qwen_image_embed_fn", "time_embed_fn"]
