"""MiniMax-H3's ``embed(plan)`` built from a checkpoint's time-embedder weights.

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

import torch
import torch.nn.functional as F

from .errors import CheckpointError, ConfigError
from .source import CheckpointSource
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


def _missing(source: CheckpointSource) -> list[str]:
    missing = []
    for name in source.layout.time_embedder_tensors():
        try:
            source.entry(name)
        except KeyError:
            missing.append(name)
    return missing


def time_embed_fn(
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


__all__ = ["has_time_embedder", "time_embed_fn"]
