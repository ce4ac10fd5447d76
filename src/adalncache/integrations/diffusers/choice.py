"""Where an enabling serves from: the weight source of a model's projections, decided before anything changes.

Four ways, checked in this order against the model and the options (a bad combination is a
:class:`~adalncache.ConfigError` raised before the model is touched):

* ``checkpoint=``: a checkpoint verified against the model's projections (not for quantized
  projections, which have nothing equal to compare; for those it means full-precision tables
  from the checkpoint, asked for on purpose with ``quantized_projections="checkpoint"``);
* ``tables=`` and no checkpoint: no source at all; the table files are checked against the
  model's projections, which are then freed (not parked);
* quantized projections and no checkpoint: the model's own quantized tensors, read through
  their modules;
* otherwise: the model's own projection tensors, moved to host memory (a ``TensorSource``).

A model built by ``load_transformer`` never held its projections: its source comes with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...devices import HostBuffer
from ...spec import Layer, ModulationSpec
from .casting import casting_paths
from .config import AdalnCacheConfig
from .family import DiffusersFamily, check_materialised
from .hooks import other_hooks_present
from .lora import LoraTracker, Variant
from .modules import base_linear
from .parking import ParkTarget
from .quantized import (
    ProjectionStorage,
    check_storage_options,
    full_precision_variant,
    opaque_model_source,
    own_tensors,
    storage_of,
)
from .registry import for_spec
from .sources import NeverLoaded, Source, check_tables_against_model, checkpoint_source, model_source


@dataclass
class SourceChoice:
    """What one enabling serves from, and what parking needs to know about it.

    ``source``: ``None`` for table files alone (the cache then serves them with no weights).
    ``device``: the cache's. ``modules``: ``(layer, current module)`` of every projection.
    ``host_tensors``: what parking restores from (``None``: re-read them from the source).
    ``plain_tables``: full-precision tables of quantized projections from the checkpoint, built
    under ``plain_variant``. ``casting_at_enable``: served modules with a layerwise-casting hook.
    """

    source: Source | None
    device: torch.device
    modules: list[tuple[Layer, Any]]
    free_time_embedder: bool
    host_tensors: Any = None
    host_buffers: list[HostBuffer] = field(default_factory=list)
    storage: ProjectionStorage = field(default_factory=ProjectionStorage)
    plain_tables: bool = False
    plain_variant: Variant = None
    casting_at_enable: frozenset[str] = frozenset()

    def park_targets(self, family: DiffusersFamily, model: Any) -> list[ParkTarget]:
        """What enabling frees from the device: every served projection, and the time embedder's
        linears when nothing else reads them (``free_time_embedder``)."""
        targets = [
            ParkTarget(base_linear(module), layer, family.projection_path(layer)) for layer, module in self.modules
        ]
        if self.free_time_embedder:
            targets += [
                ParkTarget(base_linear(linear), None, path) for path, linear in family.time_embedder_linears(model)
            ]
        return targets


def choose_source(
    model: Any,
    spec: ModulationSpec,
    config: AdalnCacheConfig,
    lora: LoraTracker,
    execution_device: torch.device,
    never_loaded: NeverLoaded | None,
) -> SourceChoice:
    """Check the model and the options and choose the source (module docstring); the model is not changed.

    Starts ``lora`` tracking (and, for full-precision tables of quantized projections, sets the
    variant they are built under).
    """
    family = for_spec(spec)
    if never_loaded is None:
        check_materialised(family, model, spec)
    lora.start()
    options = config.cache_options
    device = options.device_for(execution_device)
    free_time_embedder = config.free_time_embedder
    if free_time_embedder is None:
        free_time_embedder = not other_hooks_present(model)
    modules = family.projection_modules(model, spec)
    if never_loaded is not None:  # the loader checked it serves this model's projections
        return SourceChoice(never_loaded.source, device, modules, free_time_embedder)
    storage = storage_of(modules, family.projection_path)
    check_storage_options(
        storage,
        checkpoint=config.checkpoint,
        quantized_projections=config.quantized_projections,
        precision=options.precision,
        shard=options.shard,
        process_group=options.process_group,
        device=device,
        tables=options.tables,
    )
    choice = SourceChoice(
        None,
        device,
        modules,
        free_time_embedder,
        storage=storage,
        casting_at_enable=casting_paths(family.served_modules(model, spec)),
    )
    if config.checkpoint is not None:
        # Quantized projections are never compared with a checkpoint (there is nothing equal to
        # compare): reaching here means full-precision tables from it were asked for on purpose.
        choice.source = checkpoint_source(
            config.checkpoint,
            spec,
            modules,
            layout=config.layout,
            verify=config.verify_checkpoint and not storage.opaque,
        )
        if storage.opaque:
            choice.plain_tables = True
            # disable() gives back the quantized weights
            choice.host_tensors = own_tensors(modules, execution_device, family.projection_path)
            choice.plain_variant = lora.variant = full_precision_variant(model)
    elif options.tables is not None:
        # Table files and no checkpoint: the projections are needed by no plan the files hold,
        # so after a check against bound files they are freed, not parked (no source).
        check_tables_against_model(spec, modules, options.tables, device=device, precision=options.precision)
    elif storage.opaque:
        choice.source, choice.host_tensors = opaque_model_source(spec, modules, execution_device)
    else:
        choice.source, choice.host_tensors, choice.host_buffers = model_source(spec, modules, execution_device)
    return choice


__all__ = ["SourceChoice", "choose_source"]
