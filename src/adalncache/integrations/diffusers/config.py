"""Settings of :func:`~adalncache.diffusers.enable_adaln_cache`, typed.

:class:`AdalnCacheConfig` holds what the integration decides (the checkpoint, the miss policy,
whether to park the time embedder); :class:`CacheOptions` holds what goes to the
:class:`~adalncache.AdalnCache` it builds. The cache validates its own options (its messages name
the CLI flags), so they are checked in one place whether the cache is built here or by hand.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ... import AdalnCache, Store
from ...errors import ConfigError
from ...spec import ModulationSpec
from ...tiers.tables import TablesArg
from .sources import Source

OnMiss = Literal["build", "raise"]
QuantizedProjections = Literal["model", "checkpoint"]
CheckpointArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class CacheOptions:
    """Options of the :class:`~adalncache.AdalnCache` an enabled model is served from.

    Attributes:
        max_plans: distinct plans (timestep sets) resident at once (CLI ``--max-plans``).
        max_plan_width: timesteps of the widest plan (CLI ``--plan-width``).
        precision: ``"match"`` (bit-identical to the resident projection) or ``"fp32"``.
        host_cache_bytes: bytes of host memory keeping copies of built plans (0: no host tier).
        store: a directory or :class:`~adalncache.Store` whose entries survive restarts.
        process_group: a ``torch.distributed`` group whose ranks share the building.
        shard: how ranks split a build, ``"layers"`` or ``"columns"``.
        read_ahead: layers read ahead of the one being projected during a pass.
        progress: show a progress bar for passes (``None``: when stderr is a terminal).
        batched: project several plans of a pass at once where a probe proves it bit-identical.
        tiled: project every plan tile by tile over the output columns where a probe proves it
            bit-identical: ``"auto"`` (where also faster, with the default projection), ``True``, ``False``.
        device: where the cache lives; it must be the model's device (``None``: the model's).
        tables: table files (``adalncache export``) served as a read-only tier below the store.
    """

    max_plans: int = 64
    max_plan_width: int = 4
    precision: str = "match"
    host_cache_bytes: int = 0
    store: Store | str | os.PathLike[str] | None = None
    process_group: Any = None
    shard: str = "layers"
    read_ahead: int = 1
    progress: bool | None = None
    batched: bool = False
    tiled: bool | str = "auto"
    device: torch.device | str | None = None
    tables: TablesArg | None = None

    def device_for(self, model_device: torch.device) -> torch.device:
        """The cache's device: the model's, which ``device`` may name but not change."""
        if self.device is None:
            return model_device
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {self.device!r} is not a torch device: set device= (CLI --device)") from exc
        if device.type != model_device.type or device.index not in (None, model_device.index):
            raise ConfigError(
                f"device={device} (CLI --device) differs from the model's device {model_device}: the cache "
                "serves the forward, so it must live where the model runs; move the model first"
            )
        return model_device

    def build(self, spec: ModulationSpec, source: Source | None, device: torch.device) -> AdalnCache:
        """The cache for ``spec`` over ``source`` on ``device`` (which validates every option)."""
        return AdalnCache(
            spec,
            source,
            max_plans=self.max_plans,
            max_plan_width=self.max_plan_width,
            device=device,
            precision=self.precision,
            host_cache_bytes=self.host_cache_bytes,
            store=self.store,
            process_group=self.process_group,
            shard=self.shard,
            read_ahead=self.read_ahead,
            progress=self.progress,
            batched=self.batched,
            tiled=self.tiled,
            tables=self.tables,
        )


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
        cache_options: the options of the :class:`~adalncache.AdalnCache` (:class:`CacheOptions`).
    """

    checkpoint: CheckpointArg | None = None
    on_miss: OnMiss = "build"
    free_time_embedder: bool | None = None
    layout: str = "auto"
    verify_checkpoint: bool = True
    quantized_projections: QuantizedProjections = "model"
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
        if not isinstance(self.cache_options, CacheOptions):
            raise ConfigError(f"cache_options must be a CacheOptions, got {type(self.cache_options).__name__}")
