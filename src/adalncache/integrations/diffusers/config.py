"""Settings of :func:`~adalncache.diffusers.enable_adaln_cache`, typed.

:class:`AdalnCacheConfig` holds what the integration decides (the checkpoint, the miss policy,
whether to park the time embedder); :class:`CacheOptions` holds what goes to the
:class:`~adalncache.AdalnCache` it builds: the cache's own options (:mod:`adalncache.options`,
where each is declared and checked once) and the device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ... import AdalnCache, options
from ...errors import ConfigError
from ...options import flag
from ...spec import ModulationSpec
from .sources import Source

OnMiss = Literal["build", "raise"]
QuantizedProjections = Literal["model", "checkpoint"]
CheckpointArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class CacheOptions(options.CacheOptions):
    """Options of the :class:`~adalncache.AdalnCache` an enabled model is served from.

    Every option of :class:`adalncache.options.CacheOptions` (each checked when this is built,
    the ConfigError naming its CLI flag), plus where the cache lives:

    Attributes:
        device: where the cache lives; it must be the model's device (``None``: the model's).
    """

    device: torch.device | str | None = None

    def device_for(self, model_device: torch.device) -> torch.device:
        """The cache's device: the model's, which ``device`` may name but not change."""
        if self.device is None:
            return model_device
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"device {self.device!r} is not a torch device: set device= (CLI {flag('device')})"
            ) from exc
        if device.type != model_device.type or device.index not in (None, model_device.index):
            raise ConfigError(
                f"device={device} (CLI {flag('device')}) differs from the model's device {model_device}: the cache "
                "serves the forward, so it must live where the model runs; move the model first"
            )
        return model_device

    def build(self, spec: ModulationSpec, source: Source | None, device: torch.device) -> AdalnCache:
        """The cache for ``spec`` over ``source`` on ``device``."""
        return AdalnCache(spec, source, device=device, **self.kwargs())


@dataclass(frozen=True)
class AdalnCacheConfig:
    """Settings of :func:`~adalncache.diffusers.enable_adaln_cache` for one transformer.

    Attributes:
        checkpoint: safetensors file, directory or list of files holding the projections (native or
            diffusers layout). ``None`` serves the model's own tensors from host memory.
        on_miss: what a forward does when its plan was not prepared: ``"build"`` builds it (one
            warning per handle), ``"raise"`` raises :class:`~adalncache.PlanNotCachedError`.
        free_time_embedder: also move the time embedder off the device. ``None`` (auto) frees it
            unless another diffusers hook is attached to the model, since such a hook might read
            ``temb``; the AdaLN projections are its only consumers in the stock forward.
        layout: checkpoint layout, ``"auto"``, ``"native"`` or ``"diffusers"``.
        verify_checkpoint: stream the checkpoint once at enable time and refuse it unless its
            projections equal the model's (keep it on: a fine-tune or a fused LoRA must not be
            served from the base file).
        quantized_projections: where the tables of quantized or layerwise-cast AdaLN projections
            come from. ``"model"`` (default): the model's own projections, through their own
            forward, so outputs equal the quantized model's; a ``checkpoint`` is then refused.
            ``"checkpoint"``: full-precision tables from the unquantized ``checkpoint`` (a plain
            linear of its weights): the AdaLN projections compute unquantized while the rest of
            the model stays quantized. No effect on a model with plain projections.
        overlap: run a pipeline request's rebuild pass on a background thread, started as soon as
            its plans are known (``QwenImagePipeline`` and the MiniMax-H3 modular pipeline: when
            the call begins, before the prompt is encoded, from its arguments), so its first step
            waits only for the first
            step's plans (built first, in a transaction of their own, unless the checkpoint is
            cold) and not for the whole pass (:mod:`.overlap`, :mod:`.calls`).
        cache_options: the options of the :class:`~adalncache.AdalnCache` (:class:`CacheOptions`).
    """

    checkpoint: CheckpointArg | None = None
    on_miss: OnMiss = "build"
    free_time_embedder: bool | None = None
    layout: str = "auto"
    verify_checkpoint: bool = True
    quantized_projections: QuantizedProjections = "model"
    overlap: bool = False
    cache_options: CacheOptions = field(default_factory=CacheOptions)

    def __post_init__(self) -> None:
        if self.on_miss not in ("build", "raise"):
            raise ConfigError(f"on_miss must be 'build' or 'raise', got {self.on_miss!r}")
        if self.free_time_embedder not in (None, True, False):
            raise ConfigError(f"free_time_embedder must be None, True or False, got {self.free_time_embedder!r}")
        if self.quantized_projections not in ("model", "checkpoint"):
            raise ConfigError(
                f"quantized_projections must be 'model' or 'checkpoint', got {self.quantized_projections!r}"
            )
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"overlap must be True or False, got {self.overlap!r}")
        if not isinstance(self.cache_options, CacheOptions):
            raise ConfigError(f"cache_options must be a CacheOptions, got {type(self.cache_options).__name__}")
