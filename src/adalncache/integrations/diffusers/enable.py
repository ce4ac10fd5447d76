"""The entry point: :func:`enable_adaln_cache` on a transformer of a supported family, or a pipeline holding one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import Unpack

from ...errors import ConfigError
from ...options import OPTION_NAMES, ServingKwargs, TablesArg, option_keywords
from .config import AdalnCacheConfig, CacheOptions, CheckpointArg, OnMiss, QuantizedProjections
from .handle import AdalnCacheHandle, enable_transformer
from .pipeline import PipelineAdalnCacheHandle, enable_pipeline
from .registry import family_of


@option_keywords()
def enable_adaln_cache(
    model_or_pipeline: Any,
    checkpoint: CheckpointArg | Mapping[str, CheckpointArg] | None = None,
    *,
    on_miss: OnMiss = "build",
    free_time_embedder: bool | None = None,
    layout: str = "auto",
    verify_checkpoint: bool = True,
    quantized_projections: QuantizedProjections = "model",
    overlap: bool = False,
    device: torch.device | str | None = None,
    tables: TablesArg | Mapping[str, TablesArg] | None = None,
    **options: Unpack[ServingKwargs],
) -> AdalnCacheHandle | PipelineAdalnCacheHandle:
    """Serve the AdaLN modulation of a supported transformer (or pipeline) from bit-exact tables.

    The served projections' weights (MiniMax-H3: every block's ``adaln_proj.linear`` and
    ``norm_out.linear``; Qwen-Image: every block's ``img_mod.1`` and ``txt_mod.1`` and
    ``norm_out.linear``; the AdaLayerNormZero family: every ``norm1``, ``norm1_context`` and
    single-block ``norm`` projection and ``norm_out.linear``, the token refiners' AdaLN staying)
    and, unless another hook might read ``temb``, the time embedder's leave
    the device; meta placeholders of the right shape keep module names, ``repr`` and the LoRA
    loaders working. A transformer whose modulation depends on the prompt, or of an unknown
    class, is refused with ``ConfigError`` saying why; nothing changes.

    Args:
        model_or_pipeline: a ``MiniMaxH3Transformer3DModel``, ``QwenImageTransformer2DModel`` or a
            transformer of the AdaLayerNormZero family (HunyuanImage-2.1, HunyuanVideo-1.5,
            Motif-Video, Bria, Bria-FIBO, LongCat-Image, Ovis-Image; docs/families.md); a
            MiniMax-H3 modular pipeline (its ``transformer`` and ``transformer_ref``, each with its
            own cache); or a pipeline such as ``QwenImagePipeline`` (its scheduler is watched and
            each request's first forward prepares the whole schedule in one pass).
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
        overlap: on a pipeline, start each request's rebuild pass on a background thread as soon
            as its plans are known (``QwenImagePipeline`` and the MiniMax-H3 modular pipeline: when
            the call begins, before the prompt is encoded, from the plans its arguments give; once
            the request's schedule is known they are checked against it, bit for bit, and that
            one is built instead when they differ); its first step waits only for the first
            step's plans, built first in a small
            transaction of their own (a miss then counts two passes; one pass from a cold
            checkpoint, which would otherwise be read twice). A failure of the background pass is
            raised in the request, by the next forward that needs a plan of it, with the same
            typed error and rollback as a foreground pass (docs/diffusers.md). For a transformer
            ``load_transformer`` enabled, pass ``overlap`` there.
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
        {cache options}

    The cache's options are those of :class:`adalncache.options.CacheOptions` (listed above, from
    there). An unknown keyword is a ``TypeError`` naming it; a bad value a ``ConfigError`` naming
    the argument and its CLI flag, before the model is modified.

    On a pipeline, a transformer whose cache is already enabled (one ``load_transformer`` loaded)
    keeps it; only the prepare blocks are added for it. To avoid loading the projections at all,
    load the transformer with :func:`~adalncache.diffusers.load_transformer` instead.

    Returns:
        A handle with ``.cache``, ``.prepare(plans)``, ``.stats`` and ``.disable()``; for a
        pipeline, one per transformer behind a :class:`PipelineAdalnCacheHandle`.
    """

    def options_for(files: TablesArg | None) -> CacheOptions:
        unknown = [name for name in options if name not in OPTION_NAMES]
        if unknown:
            raise TypeError(f"enable_adaln_cache() got an unexpected keyword argument {unknown[0]!r}")
        return CacheOptions(**options, device=device, tables=files)

    # One set of options for every transformer, unless the table files differ per component.
    shared = options_for(None if isinstance(tables, Mapping) else tables)

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
            overlap=overlap,
            cache_options=shared if not isinstance(tables, Mapping) else options_for(files),
        )

    if isinstance(model_or_pipeline, torch.nn.Module):
        family_of(model_or_pipeline)  # a refused or unknown class: ConfigError naming why, nothing changed
        if isinstance(checkpoint, Mapping):
            raise ConfigError(
                "checkpoint= is a mapping by component name, which only a pipeline takes; pass one path "
                "for a single transformer"
            )
        return enable_transformer(model_or_pipeline, config_for(checkpoint))
    return enable_pipeline(model_or_pipeline, checkpoint, config_for)
