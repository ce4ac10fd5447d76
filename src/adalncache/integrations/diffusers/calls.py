"""A pipeline's call seen before it runs: its schedule predicted, its pass started early.

Why: with ``overlap=True`` a request's pass runs on a background thread, but a pipeline knows its
schedule only after it has encoded the prompt (``QwenImagePipeline`` sets its scheduler's
timesteps then; a MiniMax-H3 modular pipeline's set-timesteps block runs after its text encoder),
so a pass started from the schedule cannot overlap the encoding. The call's arguments are enough
to compute the plans before anything runs (Qwen-Image: steps, size, batch, ``sigmas``, the prompt
embeddings' dtype; MiniMax-H3: the task its inputs pick, steps, the schedulers' shifts): the
model's family predicts them
(:meth:`~.family.DiffusersFamily.predict_schedule`) and the handle starts its pass
(:meth:`~.handle.AdalnCacheHandle.predicted_request`) before the pipeline's own ``__call__``.

Nothing is trusted: where the request's schedule is known (a classic pipeline's first forward, a
modular pipeline's prepare block) the predicted plans are compared with it, bit for bit, and the
pass is adopted only when they are the same; otherwise it is dropped and the real schedule is
built. A prediction that fails (an argument the family cannot read) starts nothing.

How: ``pipe(...)`` looks ``__call__`` up on the pipeline's class, so the instance's class is
swapped for a subclass of it that adds only ``__call__`` (same name and module, so saving the
pipeline writes the same class name); :meth:`CallWatch.remove` swaps it back.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: The attribute of a swapped class that names the pipeline's own class.
OWN_CLASS = "_adalncache_own_class"

#: What starts a call's predicted pass: given the pipeline and the call's arguments by name, a
#: context manager for the call (the handle's ``predicted_request``), or None when nothing is predicted.
Predict = Callable[[Any, Mapping[str, Any]], Any]

_SWAPPED: dict[type, type] = {}


def pipeline_class(pipeline: Any) -> type:
    """The pipeline's own class (the one before :class:`CallWatch` swapped it)."""
    cls = type(pipeline)
    own: type = cls.__dict__.get(OWN_CLASS, cls)
    return own


def _swapped_class(own: type) -> type:
    """The subclass of ``own`` whose ``__call__`` runs the instance's watch first (one per class)."""
    if own not in _SWAPPED:
        stock = own.__call__
        signature = inspect.signature(stock)

        @functools.wraps(stock)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            watch: CallWatch | None = self.__dict__.get(CallWatch.ATTRIBUTE)
            started = watch.before(self, signature, args, kwargs) if watch is not None else None
            if started is None:
                return stock(self, *args, **kwargs)
            with started:
                return stock(self, *args, **kwargs)

        namespace = {"__call__": __call__, "__module__": own.__module__, "__qualname__": own.__qualname__}
        _SWAPPED[own] = type(own.__name__, (own,), {**namespace, OWN_CLASS: own})
    return _SWAPPED[own]


class CallWatch:
    """A classic pipeline's ``__call__`` watched: ``predict`` sees each call's arguments first."""

    #: The instance attribute the swapped ``__call__`` finds its watch under.
    ATTRIBUTE = "_adalncache_call_watch"

    def __init__(self, pipeline: Any, predict: Predict) -> None:
        self.pipeline = pipeline
        self.predict = predict
        self._installed = False

    def install(self) -> None:
        pipeline = self.pipeline
        if pipeline.__dict__.get(self.ATTRIBUTE) is not None:
            return  # already watched
        pipeline.__dict__[self.ATTRIBUTE] = self
        pipeline.__class__ = _swapped_class(pipeline_class(pipeline))
        self._installed = True

    def remove(self) -> None:
        """Give the pipeline its own class back."""
        if self._installed:
            pipeline = self.pipeline
            pipeline.__dict__.pop(self.ATTRIBUTE, None)
            pipeline.__class__ = pipeline_class(pipeline)
            self._installed = False

    def before(
        self, pipeline: Any, signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Any:
        """The call's context manager from ``predict``, or None (arguments that do not bind: the
        pipeline's own ``__call__`` raises its own TypeError; a prediction that fails: none)."""
        try:
            bound = signature.bind(pipeline, *args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        call: dict[str, Any] = {}
        for name, value in list(bound.arguments.items())[1:]:  # self left out
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)  # a modular pipeline's inputs, by name like any other argument
            else:
                call[name] = value
        try:
            return self.predict(pipeline, call)
        except Exception as exc:  # a prediction is an optimisation: the first forward builds the real schedule
            logger.debug("AdaLN cache: no schedule predicted for this call: %s", exc)
            return None


__all__ = ["CallWatch", "pipeline_class"]
