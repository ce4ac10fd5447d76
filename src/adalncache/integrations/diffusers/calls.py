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
swapped for a subclass of its own, made for this instance alone, that adds only ``__call__`` (same
name and module, so saving the pipeline writes the same class name); that ``__call__`` finds the
class's own ``__call__`` at each call (a wrapper another library puts there later runs too).
:meth:`CallWatch.remove` swaps the class back, unless another library has patched the subclass
since (cache-dit wraps ``pipe.__class__.__call__``): the class then stays, with the watch gone,
so that library's wrapper keeps working. Over a class another library already patched that way
(cache-dit's ``_original_call``), nothing is installed: the pass starts where the schedule is
known, as without a prediction.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: The attribute of a swapped class that names the pipeline's own class.
OWN_CLASS = "_adalncache_own_class"

#: Class attributes by which a library says it has wrapped a pipeline class's ``__call__`` (cache-dit).
FOREIGN_CALL_PATCHES = ("_original_call",)

#: What starts a call's predicted pass: given the pipeline and the call's arguments by name, a
#: context manager for the call (the handle's ``predicted_request``), or None when nothing is predicted.
Predict = Callable[[Any, Mapping[str, Any]], Any]


def pipeline_class(pipeline: Any) -> type:
    """The pipeline's own class (the one before :class:`CallWatch` swapped it)."""
    cls = type(pipeline)
    own: type = cls.__dict__.get(OWN_CLASS, cls)
    return own


def _swapped_class(own: type) -> type:
    """A subclass of ``own`` whose ``__call__`` runs the instance's watch first, then ``own``'s own."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        stock = own.__call__.__get__(self, own)  # looked up now: a wrapper put on the class later runs too
        watch: CallWatch | None = self.__dict__.get(CallWatch.ATTRIBUTE)
        started = watch.before(self, stock, args, kwargs) if watch is not None else None
        if started is None:
            return stock(*args, **kwargs)
        with started:
            return stock(*args, **kwargs)

    __call__.__doc__ = own.__call__.__doc__
    namespace = {"__call__": __call__, "__module__": own.__module__, "__qualname__": own.__qualname__, OWN_CLASS: own}
    return type(own.__name__, (own,), namespace)


class CallWatch:
    """A pipeline's ``__call__`` watched: ``predict`` sees each call's arguments first."""

    #: The instance attribute the swapped ``__call__`` finds its watch under.
    ATTRIBUTE = "_adalncache_call_watch"

    def __init__(self, pipeline: Any, predict: Predict) -> None:
        self.pipeline = pipeline
        self.predict = predict
        self._installed = False
        #: The instance's own subclass, and its namespace as installed (to tell whether another library patched it).
        self._swapped: type | None = None
        self._namespace: dict[str, Any] = {}

    def install(self) -> None:
        pipeline = self.pipeline
        if pipeline.__dict__.get(self.ATTRIBUTE) is not None:
            return  # already watched
        own = pipeline_class(pipeline)
        if any(hasattr(own, name) for name in FOREIGN_CALL_PATCHES):
            logger.info(
                "AdaLN cache: %s's __call__ is wrapped by another library; overlapped passes start where the "
                "schedule is known, not before the prompt is encoded",
                own.__name__,
            )
            return
        self._swapped = _swapped_class(own)
        self._namespace = dict(self._swapped.__dict__)
        pipeline.__dict__[self.ATTRIBUTE] = self
        pipeline.__class__ = self._swapped
        self._installed = True

    def remove(self) -> None:
        """Give the pipeline its own class back (or, if another library patched the swapped class since,
        keep the class and drop only the watch, so that library's wrapper stays)."""
        if not self._installed:
            return
        pipeline = self.pipeline
        pipeline.__dict__.pop(self.ATTRIBUTE, None)
        untouched = dict(self._swapped.__dict__) == self._namespace
        if type(pipeline) is self._swapped and untouched:
            pipeline.__class__ = pipeline_class(pipeline)
        elif not untouched:
            logger.info("AdaLN cache: another library patched the pipeline's class since; it keeps the class")
        self._installed = False

    def before(self, pipeline: Any, stock: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The call's context manager from ``predict``, or None (arguments that do not bind: the
        pipeline's own ``__call__`` raises its own TypeError; a prediction that fails: none).

        ``stock``: the class's own ``__call__``, bound to ``pipeline``, whose signature the
        arguments are bound to.
        """
        try:
            signature = inspect.signature(stock)
            bound = signature.bind(*args, **kwargs)
        except (TypeError, ValueError):
            return None
        bound.apply_defaults()
        call: dict[str, Any] = {}
        for name, value in bound.arguments.items():
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
