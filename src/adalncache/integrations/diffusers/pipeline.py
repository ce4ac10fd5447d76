"""The AdaLN cache on a pipeline: one handle per transformer; a prepare block per loop (modular pipelines)
or a watched scheduler (classic pipelines such as ``QwenImagePipeline``, see :mod:`.scheduling`).

A pipeline may hold ``transformer`` and ``transformer_ref``, each with its own weights and so its
own cache. :class:`AdalnCachePrepareStep` sits in front of each denoise loop's denoiser and, at the
first step, hands the request's whole ``row_timestep_plan`` to that denoiser's transformer's cache,
so every step's plan is built in one pass before any step runs; ``prepare`` also *holds* those
plans for the running thread, so no other request's build evicts them mid-loop.

With ``overlap=True`` the pass starts earlier still: when the call begins, before the text
encoder runs, from the plans predicted from the call's inputs (:mod:`.calls`,
:func:`.minimax_h3.predicted_plans`); the block then adopts that pass when the schedule the
set-timesteps block made has the same keys (:meth:`.handle.AdalnCacheHandle.start_prepare`), and
starts one itself otherwise. Step 0's forward waits only for step 0's plans (:mod:`.overlap`).

The hold is released when the loop ends: each loop's ``loop_step`` is wrapped (an instance
attribute, removed again by ``disable``) so that the step after which no step follows, or any
exception raised inside a step, releases it. An interrupt that lands between two steps (in the
progress bar) leaves the hold to the thread's next request, whose ``prepare`` releases it first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from diffusers.modular_pipelines.modular_pipeline import (
    LoopSequentialPipelineBlocks,
    ModularPipelineBlocks,
)
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam

from ...errors import ConfigError, PlanMismatchError
from .calls import CallWatch
from .config import AdalnCacheConfig, CheckpointArg
from .handle import AdalnCacheHandle, adaln_cache_handle, enable_transformer
from .registry import family_of, recognised
from .scheduling import ScheduleWatch

#: Name of the block inserted in front of each loop denoiser.
PREPARE_BLOCK = "adaln_cache_prepare"

#: The pipeline components that are MiniMax-H3 transformers the cache can serve.
PIPELINE_TRANSFORMERS = ("transformer", "transformer_ref")


class AdalnCachePrepareStep(ModularPipelineBlocks):
    """Denoise-loop block that builds a request's whole ``row_timestep_plan`` before step 0.

    Inserted in front of each MiniMax-H3 loop denoiser by :func:`enable_adaln_cache`. At the first
    iteration it hands every step's plan to the denoiser's transformer's cache in one ``prepare``
    call (at most one rebuild pass; none when the plans are resident), so no step waits on a build,
    and the plans stay held until the loop's last step (see the module docstring). A transformer
    without an enabled cache makes it a no-op.
    """

    model_name = "minimax-h3"  # type: ignore[assignment]  # diffusers declares it None on the base class

    def __init__(self, transformer_name: str = "transformer") -> None:
        self.transformer_name = transformer_name
        super().__init__()

    @property
    def description(self) -> str:
        return (
            "Builds the AdaLN tables of every step of the request in one pass before the first denoising "
            "step (adalncache)."
        )

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam(
                name="row_timestep_plan",
                type_hint=list,
                required=True,
                description="One `(timestep, timestep_indices)` pair per step.",
            ),
            InputParam.template("attention_kwargs"),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return []

    @torch.no_grad()
    def __call__(self, components: Any, block_state: Any, i: int, t: torch.Tensor) -> tuple[Any, Any]:
        if i == 0:
            handle = adaln_cache_handle(getattr(components, self.transformer_name, None))
            if handle is not None and handle.config.overlap:
                # The pass runs beside the loop; step 0's forward waits for step 0's plans only.
                handle.start_prepare(block_state.row_timestep_plan, attention_kwargs=block_state.attention_kwargs)
            elif handle is not None:
                handle.prepare(block_state.row_timestep_plan, attention_kwargs=block_state.attention_kwargs)
        return components, block_state


def _release_hold(components: Any, transformer_name: str, *, check: bool = True) -> None:
    """Release the request's hold; ``check`` (the request's end): first wait for its background pass and
    raise its error if no forward did, then raise PlanMismatchError for a forward that matched no plan."""
    handle = adaln_cache_handle(getattr(components, transformer_name, None))
    if handle is not None and check:
        handle.finish()
    elif handle is not None:
        handle.release(check=False)


def wrap_loop_step(loop: LoopSequentialPipelineBlocks, transformer_name: str) -> None:
    """Make ``loop`` release the prepared hold after its last step and on any exception in a step."""
    original = loop.loop_step

    def loop_step(components: Any, block_state: Any, **kwargs: Any) -> Any:
        try:
            result = original(components, block_state, **kwargs)
        except BaseException:
            _release_hold(components, transformer_name, check=False)  # the step's own error goes first
            raise
        step, timesteps = kwargs.get("i"), getattr(block_state, "timesteps", None)
        if step is not None and timesteps is not None and step >= len(timesteps) - 1:
            _release_hold(components, transformer_name)
        return result

    loop.loop_step = loop_step  # type: ignore[method-assign, assignment]  # the one patch of the loop, undone on disable


def unwrap_loop_step(loop: LoopSequentialPipelineBlocks) -> None:
    """Undo :func:`wrap_loop_step` (the class's own ``loop_step`` shows through again)."""
    loop.__dict__.pop("loop_step", None)


def denoise_loops(blocks: Any) -> Iterator[LoopSequentialPipelineBlocks]:
    """Every loop block in a block tree whose sub-blocks include a MiniMax-H3 loop denoiser."""
    if isinstance(blocks, LoopSequentialPipelineBlocks):
        if any(hasattr(block, "transformer_name") for block in blocks.sub_blocks.values()):
            yield blocks
        return
    for block in getattr(blocks, "sub_blocks", {}).values():
        yield from denoise_loops(block)


class PipelineAdalnCacheHandle:
    """The AdaLN cache enabled on a MiniMax-H3 modular pipeline: one handle per transformer.

    ``handles`` maps component names (``transformer``, ``transformer_ref``) to their
    :class:`AdalnCacheHandle`; indexing works too (``handle["transformer"]``). ``cache`` and
    ``stats`` are those of the only transformer when there is one, else dicts by name.
    """

    def __init__(self, pipeline: Any, handles: dict[str, AdalnCacheHandle]) -> None:
        self.pipeline = pipeline
        self.handles = handles
        self._inserted: list[tuple[LoopSequentialPipelineBlocks, str]] = []
        self._watch: ScheduleWatch | None = None
        self._calls: CallWatch | None = None

    def __getitem__(self, name: str) -> AdalnCacheHandle:
        return self.handles[name]

    @property
    def enabled(self) -> bool:
        return any(handle.enabled for handle in self.handles.values())

    @property
    def cache(self) -> Any:
        if len(self.handles) == 1:
            return next(iter(self.handles.values())).cache
        return {name: handle.cache for name, handle in self.handles.items()}

    @property
    def stats(self) -> Any:
        if len(self.handles) == 1:
            return next(iter(self.handles.values())).stats
        return {name: handle.stats for name, handle in self.handles.items()}

    def prepare(
        self,
        plans: Sequence[Any],
        *,
        attention_kwargs: Mapping[str, Any] | None = None,
        component: str | None = None,
    ) -> Any:
        """Prepare ``plans`` on one component's cache (``component``) or on every one."""
        if component is not None:
            if component not in self.handles:
                raise ConfigError(
                    f"component={component!r} has no AdaLN cache on this pipeline; choose one of {sorted(self.handles)}"
                )
            return self.handles[component].prepare(plans, attention_kwargs=attention_kwargs)
        reports = {
            name: handle.prepare(plans, attention_kwargs=attention_kwargs) for name, handle in self.handles.items()
        }
        return next(iter(reports.values())) if len(reports) == 1 else reports

    def release(self) -> None:
        """Release the plans the calling thread's last ``prepare`` holds, on every transformer (then
        raise PlanMismatchError if a forward of that request matched none of its prepared plans)."""
        for handle in self.handles.values():
            handle.release(check=False)
        self.check_request()

    def check_request(self) -> None:
        """``check_request()`` of every transformer's handle (PlanMismatchError after checking them all)."""
        errors: list[PlanMismatchError] = []
        for handle in self.handles.values():
            try:
                handle.check_request()
            except PlanMismatchError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def finish(self) -> None:
        """End the calling thread's request on every transformer (:meth:`.handle.AdalnCacheHandle.finish`)."""
        for handle in self.handles.values():
            handle.finish()

    def join_background(self) -> None:
        """Wait until every transformer's background passes have ended."""
        for handle in self.handles.values():
            handle.join_background()

    def disable(self, *, allow_changed_checkpoint: bool = False) -> None:
        """Disable every transformer's cache, then remove the inserted loop blocks and the watches.

        In that order: a transformer's disable that is refused (another library's wrapper would be
        dropped, a changed checkpoint) leaves the pipeline as it was, its watches included.
        """
        mismatches: list[PlanMismatchError] = []
        for handle in self.handles.values():
            try:
                handle.disable(allow_changed_checkpoint=allow_changed_checkpoint)
            except PlanMismatchError as exc:  # raised once that handle is disabled: disable the others too
                mismatches.append(exc)
        for loop, key in self._inserted:
            if key in loop.sub_blocks:
                del loop.sub_blocks[key]
            unwrap_loop_step(loop)
        self._inserted.clear()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._calls is not None:
            self._calls.remove()
            self._calls = None
        if mismatches:
            raise mismatches[0]

    def watch_scheduler(self) -> None:
        """A classic pipeline (no modular blocks): each request's schedule is prepared at its first forward."""
        if getattr(self.pipeline, "_blocks", None) is not None or "transformer" not in self.handles:
            return
        handle = self.handles["transformer"]
        self._watch = ScheduleWatch(
            getattr(self.pipeline, "scheduler", None), handle.expect_schedule, last_step=handle.release
        )
        self._watch.install()

    def watch_calls(self) -> None:
        """With ``overlap=True``: each call's pass starts when the call begins, before the prompt is
        encoded, from the schedule predicted from its arguments (:mod:`.calls`)."""
        if any(handle.config.overlap for handle in self.handles.values()):
            self._calls = CallWatch(self.pipeline, self._predicted_request)
            self._calls.install()

    def _predicted_request(self, pipeline: Any, call: Mapping[str, Any]) -> Any:
        """A context manager for the call holding each predicted pass (the handles' ``predicted_request``),
        or None when no transformer's schedule is predicted for this call."""
        predicted = []
        for name, handle in self.handles.items():
            if handle.enabled and handle.config.overlap:
                plans = handle.family.predict_schedule(handle.model, pipeline, call, name)
                if plans:
                    predicted.append((handle, plans))
        if not predicted:
            return None
        attention_kwargs = call.get("attention_kwargs")

        @contextlib.contextmanager
        def requests() -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                for handle, plans in predicted:
                    stack.enter_context(handle.predicted_request(plans, attention_kwargs=attention_kwargs))
                yield

        return requests()

    def insert_prepare_blocks(self) -> None:
        """Put a prepare block in front of the denoiser of every denoise loop that has none yet."""
        blocks = getattr(self.pipeline, "_blocks", None)
        if blocks is None:
            return
        for loop in denoise_loops(blocks):
            if PREPARE_BLOCK in loop.sub_blocks:
                continue
            names = list(loop.sub_blocks)
            index, denoiser = next(
                (i, loop.sub_blocks[name])
                for i, name in enumerate(names)
                if hasattr(loop.sub_blocks[name], "transformer_name")
            )
            step = AdalnCachePrepareStep(transformer_name=denoiser.transformer_name)
            loop.sub_blocks.insert(PREPARE_BLOCK, step, index)
            wrap_loop_step(loop, denoiser.transformer_name)
            self._inserted.append((loop, PREPARE_BLOCK))

    def __repr__(self) -> str:
        return f"PipelineAdalnCacheHandle({', '.join(f'{n}={h!r}' for n, h in self.handles.items())})"


def enable_pipeline(
    pipeline: Any,
    checkpoint: CheckpointArg | Mapping[str, CheckpointArg] | None,
    config_for: Callable[[CheckpointArg | None, str], AdalnCacheConfig],
) -> PipelineAdalnCacheHandle:
    """Enable the cache on every MiniMax-H3 transformer of ``pipeline``; all or none.

    ``checkpoint``: one path when the pipeline holds one transformer, else a mapping by component
    name. ``config_for(path, name)`` gives each transformer's settings. A transformer whose cache
    is already enabled (``load_transformer``) keeps it: only the prepare blocks are added for it.
    """
    components: dict[str, Any] = {
        name: getattr(pipeline, name, None)
        for name in PIPELINE_TRANSFORMERS
        if recognised(getattr(pipeline, name, None)) is not None
    }
    if not components:
        transformer = getattr(pipeline, "transformer", None)
        if isinstance(transformer, torch.nn.Module):
            family_of(transformer)  # a refused or unknown class: the ConfigError says why
        raise ConfigError(
            "enable_adaln_cache needs a transformer of a supported family, or a pipeline holding one as "
            f"`transformer` (or `transformer_ref`), got {type(pipeline).__name__}"
        )
    checkpoints: dict[str, CheckpointArg | None]
    if isinstance(checkpoint, Mapping):
        unknown = sorted(set(checkpoint) - set(components))
        if unknown:
            raise ConfigError(
                f"checkpoint= names {unknown}, which this pipeline does not hold; use {sorted(components)}"
            )
        checkpoints = {name: checkpoint.get(name) for name in components}
    elif checkpoint is not None and len(components) > 1:
        raise ConfigError(
            "checkpoint= is one path but the pipeline holds both transformer and transformer_ref, which "
            "are different checkpoints; pass {'transformer': ..., 'transformer_ref': ...}"
        )
    else:
        checkpoints = {name: checkpoint for name in components}
    handles: dict[str, AdalnCacheHandle] = {}
    # A transformer that already serves from its own cache (loaded by load_transformer) is adopted
    # as it is: its projections were never loaded, so there is nothing to enable again.
    adopted = {name: handle for name, model in components.items() if (handle := adaln_cache_handle(model))}
    for name, handle in adopted.items():
        if checkpoints[name] is not None:
            raise ConfigError(
                f"{name} already serves its AdaLN projections from its own cache (load_transformer enabled it): "
                f"drop checkpoint= for {name}"
            )
        if config_for(None, name).overlap and not handle.config.overlap:
            raise ConfigError(
                f"overlap=True cannot be turned on for {name}, whose cache load_transformer enabled without it: "
                "pass overlap=True to load_transformer instead"
            )
    try:
        for name, model in components.items():
            handles[name] = adopted.get(name) or enable_transformer(model, config_for(checkpoints[name], name))
    except BaseException:
        for name, handle in handles.items():
            if name not in adopted:
                handle.disable()
        raise
    pipeline_handle = PipelineAdalnCacheHandle(pipeline, handles)
    pipeline_handle.insert_prepare_blocks()
    pipeline_handle.watch_scheduler()
    pipeline_handle.watch_calls()
    return pipeline_handle
