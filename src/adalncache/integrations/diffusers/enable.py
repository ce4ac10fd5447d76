"""The entry point: :func:`enable_adaln_cache` on a transformer or a MiniMax-H3 modular pipeline."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ... import Store
from ...errors import ConfigError
from ...tiers.tables import TablesArg
from .config import AdalnCacheConfig, CacheOptions, CheckpointArg, OnMiss, QuantizedProjections
from .handle import AdalnCacheHandle, enable_transformer
from .minimax_h3 import is_minimax_h3_transformer
from .pipeline import PipelineAdalnCacheHandle, enable_pipeline


def enable_adaln_cache(
    model_or_pipeline: Any,
    checkpoint: CheckpointArg | Mapping[str, CheckpointArg] | None = None,
    *,
    on_miss: OnMiss = "build",
    free_time_embedder: bool | None = None,
    layout: str = "auto",
    verify_checkpoint: bool = True,
    quantized_projections: QuantizedProjections = "model",
    max_plans: int = 64,
    max_plan_width: int = 4,
    precision: str = "match",
    host_cache_bytes: int = 0,
    store: Store | str | os.PathLike[str] | None = None,
    process_group: Any = None,
    shard: str = "layers",
    read_ahead: int = 1,
    progress: bool | None = None,
    batched: bool = False,
    tiled: bool | str = "auto",
    device: torch.device | str | None = None,
    tables: TablesArg | Mapping[str, TablesArg] | None = None,
) -> AdalnCacheHandle | PipelineAdalnCacheHandle:
    """Serve the AdaLN modulation of a MiniMax-H3 transformer (or pipeline) from bit-exact tables.

    The projection weights of every block's ``adaln_proj.linear`` and of ``norm_out.linear`` (and,
    unless another hook might read ``temb``, the time embedder's) leave the device; meta
    placeholders of the right shape keep module names, ``repr`` and the LoRA loaders working.

    Args:
        model_or_pipeline: a ``MiniMaxH3Transformer3DModel`` or a MiniMax-H3 modular pipeline
            (its ``transformer`` and ``transformer_ref``, each with its own cache).
        checkpoint: the safetensors file(s) or directory holding the projections (native or
            diffusers layout); for a pipeline with both transformers, a mapping by component name.
            ``None``: the model's own tensors move to host memory and are the source.
        on_miss: ``"build"`` builds an unprepared plan at its first forward (warning once);
            ``"raise"`` raises ``PlanNotCachedError`` instead.
        free_time_embedder: also move the time embedder's weights off the device. ``None`` (auto):
            yes unless another diffusers hook sits on the model (it might read ``temb``, which the
            stock forward only feeds to the served projections).
        layout: the checkpoint's key layout, ``"auto"``, ``"native"`` or ``"diffusers"``.
        verify_checkpoint: stream the checkpoint once and refuse it (``ConfigError``) unless its
            projections equal the model's, bit for bit: a fine-tune or a fused LoRA must not be
            served from the base file. Turn off only for a checkpoint known to be the model's own.
        quantized_projections: for a model whose AdaLN projections are quantized (torchao,
            optimum-quanto, GGUF, bitsandbytes) or kept in fp8 by layerwise casting: ``"model"``
            serves tables of the model's own projections (outputs equal the quantized model's) and
            refuses a ``checkpoint``; ``"checkpoint"`` serves full-precision tables from the
            unquantized ``checkpoint`` on purpose, so the AdaLN projections compute unquantized
            while the rest of the model stays quantized.
        max_plans: distinct plans (timestep sets) resident at once; a request's distinct plans must
            fit (CLI ``--max-plans``).
        max_plan_width: timesteps of the widest plan (CLI ``--plan-width``).
        precision: ``"match"`` is bit-identical to the resident projection; ``"fp32"`` projects in
            fp32 and stores in the projection dtype (CLI ``--precision``).
        host_cache_bytes: host memory for copies of built plans, so an evicted plan comes back
            without a pass (0: none).
        store: a directory or :class:`~adalncache.Store` holding plans across restarts (bound to
            the checkpoint, so it needs ``checkpoint=`` to hit in another process).
        process_group: a ``torch.distributed`` group; every rank enables with the same settings and
            the ranks share each pass.
        shard: how ranks split a pass: ``"layers"`` or ``"columns"`` (CLI ``--shard``).
        read_ahead: layers read ahead of the one being projected during a pass.
        progress: show a progress bar for passes (``None``: when stderr is a terminal).
        batched: project several plans at once where a probe proves the result bit-identical.
        tiled: project every plan tile by tile over the output columns where a probe proves the
            result bit-identical (``"auto"``: where also faster, with the default projection only,
            which the integration's LoRA-aware projection is not; ``True``; ``False``).
        device: where the cache lives; it must be the model's device (``None``: the model's, or
            the device an offloading hook runs it on). The cache serves the forward, so a different
            device is a ``ConfigError``; when the model moves (``.to()``), the cache follows.
        tables: table files written by ``adalncache export`` (either format), searched in order as a
            read-only tier below the store; for a pipeline with both transformers, a mapping by
            component name. A file that does not fit the model (geometry, dtype, precision,
            numeric environment, or a bound file's content digest) is refused with ``ConfigError``.
            With ``checkpoint=None`` the model's own projections are checked against bound files,
            then freed (neither on the device nor in host memory): plans the files hold are
            served, any other plan raises ``PlanNotCachedError``, and ``disable()`` cannot bring
            the projections back. Pass ``checkpoint=`` to build missing plans and to restore.

    An unknown keyword is a ``TypeError`` naming it. Each option is checked where it is used: the
    cache's options by :class:`~adalncache.AdalnCache` (a ``ConfigError`` naming the argument and
    its CLI flag), before the model is modified.

    On a pipeline, a transformer whose cache is already enabled (one ``load_transformer`` loaded)
    keeps it; only the prepare blocks are added for it. To avoid loading the projections at all,
    load the transformer with :func:`~adalncache.diffusers.load_transformer` instead.

    Returns:
        A handle with ``.cache``, ``.prepare(plans)``, ``.stats`` and ``.disable()``; for a
        pipeline, one per transformer behind a :class:`PipelineAdalnCacheHandle`.
    """

    def options_for(files: TablesArg | None) -> CacheOptions:
        return CacheOptions(
            max_plans=max_plans,
            max_plan_width=max_plan_width,
            precision=precision,
            host_cache_bytes=host_cache_bytes,
            store=store,
            process_group=process_group,
            shard=shard,
            read_ahead=read_ahead,
            progress=progress,
            batched=batched,
            tiled=tiled,
            device=device,
            tables=files,
        )

    # One set of options for every transformer, unless the table files differ per component.
    options = options_for(None if isinstance(tables, Mapping) else tables)

    def config_for(path: CheckpointArg | None, component: str | None = None) -> AdalnCacheConfig:
        # One config per served transformer; only the checkpoint and the table files differ between them.
        files: Any = tables
        if isinstance(tables, Mapping):
            if component is None:
                raise ConfigError(
                    "tables= is a mapping by component name, which only a pipeline takes; pass one path (or a "
                    "list of paths) for a single transformer"
                )
            files = tables.get(component)
        return AdalnCacheConfig(
            checkpoint=path,
            on_miss=on_miss,
            free_time_embedder=free_time_embedder,
            layout=layout,
            verify_checkpoint=verify_checkpoint,
            quantized_projections=quantized_projections,
            cache_options=options if not isinstance(tables, Mapping) else options_for(files),
        )

    if is_minimax_h3_transformer(model_or_pipeline):
        if isinstance(checkpoint, Mapping):
            raise ConfigError(
                "checkpoint= is a mapping by component name, which only a pipeline takes; pass one path "
                "for a single transformer"
            )
        return enable_transformer(model_or_pipeline, config_for(checkpoint))
    return enable_pipeline(model_or_pipeline, checkpoint, config_for)
