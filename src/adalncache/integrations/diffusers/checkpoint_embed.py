"""The AdaLayerNormZero family's ``embed(plan)`` from a checkpoint alone, for ``build``/``export``/``verify``.

Why it exists: the command line fills stores and writes table files without the model in
memory, yet the tables must hold the projections of the very ``silu(temb)`` the served model
computes. Each of the family's classes computes ``temb`` its own way (casts, a ``* 1000``, a
second timestep, a guidance embedder outside the time embedder), and the one home of that
arithmetic is :func:`.adaln_zero.embed_input`, which calls the model's own modules. So this
builds the transformer on the meta device from the checkpoint's ``config.json``, as
``load_transformer`` (and ``from_pretrained``) builds it, in the projections' dtype, and loads
only the parameters of the modules that compute ``temb`` (the class's time embedding module and
Bria-FIBO's ``guidance_embed``), read at their file alignment as the source reads every tensor.
Every other module stays meta: nothing else is read or allocated.

Like Qwen-Image's checkpoint-only embed, the result is what a model loaded in the projections'
dtype computes (``torch_dtype`` equal to the checkpoint's projection dtype), which is what the
binding of the tables says (the spec's dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError
from ...families import adaln_zero
from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from .adaln_zero import embed_input
from .loading import _build_on_meta, _load_config, _transformer_class

#: A module outside the time embedding module whose output ``temb`` adds (Bria-FIBO's guidance).
GUIDANCE_MODULE = "guidance_embed"


def temb_modules(model: nn.Module) -> list[str]:
    """Module paths whose parameters ``temb`` is computed from, for this model's class."""
    paths = [adaln_zero.CLASSES[type(model).__name__].temb_module]
    if isinstance(getattr(model, GUIDANCE_MODULE, None), nn.Module):
        paths.append(GUIDANCE_MODULE)
    return paths


def _directory(source: CheckpointSource) -> Path:
    """The checkpoint's directory: where its ``config.json`` is (beside its weight files)."""
    return Path(source.files[0]).parent


def adaln_zero_embed_fn(
    source: CheckpointSource, spec: ModulationSpec, device: torch.device | str = "cpu"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``embed(plan)`` of an AdaLayerNormZero-family checkpoint, with the model's own embedding modules.

    Raises CheckpointError when the checkpoint lacks a tensor those modules need (a file of the
    projections alone), or its directory has no ``config.json`` of the class the spec names.
    """
    directory = _directory(source)
    cls, _ = _transformer_class(directory, None)
    config, unused = _load_config(cls, directory, None, directory, None)
    model = _build_on_meta(cls, config, unused, spec.dtype)
    device = torch.device(device)
    for prefix in temb_modules(model):
        module = model.get_submodule(prefix)
        for name, param in list(module.named_parameters()):
            key = f"{prefix}.{name}"
            try:
                source.entry(key)
            except KeyError:
                raise CheckpointError(
                    f"the checkpoint has no {key} ({', '.join(str(f) for f in source.files)}): build, export and "
                    "verify compute the projections' input with the model's time embedding; pass the whole "
                    "transformer checkpoint, not only its AdaLN projections"
                ) from None
            tensor = source.read_tensor(key)
            value = tensor if tensor.dtype == param.dtype else tensor.to(param.dtype)  # the stock dtype rule
            owner, _, attr = name.rpartition(".")
            holder: Any = module.get_submodule(owner) if owner else module
            # A CPU tensor already in the parameter's dtype stays the file's aligned buffer (.to is a no-op).
            setattr(holder, attr, nn.Parameter(value.to(device), requires_grad=False))
    model.eval()
    geometry = spec.model_geometry

    def embed(plan: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embed_input(model, geometry, plan, device).to(spec.dtype)

    return embed


__all__ = ["GUIDANCE_MODULE", "adaln_zero_embed_fn", "temb_modules"]
