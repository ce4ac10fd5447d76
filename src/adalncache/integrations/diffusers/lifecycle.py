"""Each thread's request on an enabled model, from its ``prepare`` to its end: :class:`RequestLifecycle`.

Why a class of its own: the handle (:mod:`.handle`) puts one enabling together and takes it
apart; what a request does while the model is enabled is a separate job with its own per-thread
state. A thread's request is held in one of three ways (``prepare``, ``request``, a pipeline's
schedule, which :mod:`.scheduling` keeps here until the request's first forward), optionally by
a pass on a background thread (:mod:`.overlap`), and its forwards are served either on the device
from the request's prepared keys (:mod:`.prepared`) or on the host path, each forward holding its
own plan (:mod:`.requests`). The request ends at ``release``, ``finish``, the thread's next
request, a move of the cache or ``disable()``; a forward that matched none of its plans is
reported then as :class:`~adalncache.PlanMismatchError`.

The handle keeps its public methods (``prepare``, ``release``, ``check_request``, ``request``,
``start_prepare``, ``finish``, ``join_background``, ``expect_schedule``) and delegates them here.
This class reaches the enabling only through the callables it is given, read at each call: an
enabling again (after a cast) replaces the holds, the cache and the family under it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...cache import PlanHold
from ...errors import ConfigError
from ...identity import autocast_dtype
from ...plans import PlanKey, plan_key
from .modules import execution_device
from .overlap import BackgroundPasses, split_pays
from .prepared import PreparedRequest, PreparedRequests
from .requests import RequestHolds, plan_tensors, request_plans
from .scheduling import PendingSchedule

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ... import AdalnCache, BuildReport
    from .family import DiffusersFamily


class RequestLifecycle:
    """The calling thread's request on one enabled model: held, served, checked and released.

    ``holds``: the enabling's :class:`~.requests.RequestHolds` (None while none is registered);
    ``enabled``: whether the handle is enabled; ``cache`` and ``family``: the enabling's (an
    enabling again after a cast replaces them); ``follow``: the handle's ``_follow(device)``,
    which moves the cache to where the forwards run (and abandons this thread's request when it
    moves); ``overlap``: a pipeline's schedule is held by a background pass.
    """

    def __init__(
        self,
        model: Any,
        *,
        holds: Callable[[], RequestHolds | None],
        enabled: Callable[[], bool],
        cache: Callable[[], AdalnCache],
        family: Callable[[], DiffusersFamily],
        follow: Callable[[torch.device | None], None],
        overlap: bool,
    ) -> None:
        self._model = model
        self._holds = holds
        self._enabled = enabled
        self._cache = cache
        self._family = family
        self._follow = follow
        self._overlap = overlap
        #: Per thread: its prepared request, whose forwards find their slots on the device (``prepared``).
        self._prepared = PreparedRequests()
        #: Per thread: its request's pass on a background thread (``overlap``), and all those running.
        self._passes = BackgroundPasses()
        #: Per thread: a pipeline's schedule waiting for its request's first forward (the hooks' ``before``).
        self.schedule = PendingSchedule(model, family, cache, self.hold_schedule)

    # ------------------------------------------------------------------ a request's start and end

    def prepare(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> BuildReport:
        """``handle.prepare``: end the thread's previous request, then hold ``plans`` as its new one."""
        self.release()  # the thread's previous request is over: its plans may make room for this one
        held = self._request_hold(plans, attention_kwargs, "prepare()")
        self._prepared.start(self._prepared_request(held))
        return held.report

    def release(self, *, check: bool = True) -> None:
        """``handle.release``: give the thread's holds back, then report a mismatch (unless ``check=False``)."""
        if not isinstance(check, bool):  # "no" would be truthy: a report the caller meant to defer would raise
            raise ConfigError(f"release(check=...) takes True or False, got {check!r}")
        self.abandon()
        if check:
            self._prepared.check()

    def abandon(self) -> None:
        """Give the thread's holds back without checking: a mismatch waits for the next check.

        For a move of the cache (the holds name slots of the old device) and the way into
        ``disable()`` (which checks once the model is restored).
        """
        self._passes.release()
        self._prepared.release()

    def check(self) -> None:
        """``handle.check_request``: raise PlanMismatchError for the thread's forwards that matched no plan."""
        self._prepared.check()

    @contextlib.contextmanager
    def request(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> Iterator[PlanHold]:
        """``handle.request``: hold ``plans`` for the ``with`` block, the thread's request inside it."""
        held = self._request_hold(plans, attention_kwargs, "prepare()")
        request = self._prepared_request(held)
        previous = self._prepared.start(request)  # the block's forwards are this request's
        try:
            yield held
        except BaseException:
            self._prepared.finish(request, previous)
            raise
        self._prepared.finish(request, previous)
        self._prepared.check()  # a forward of the block matched no plan of it: PlanMismatchError

    def start_prepare(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> None:
        """``handle.start_prepare``: end the previous request, then hold ``plans`` from a background pass
        (the pass started from the call's predicted schedule, when it predicted these plans)."""
        family = self._family()
        keyed = [family.request_plan(self._model, plan) for plan in request_plans(plans)]
        if self._adopted(keyed, attention_kwargs):
            return
        self.release()
        holds = self._serving("start_prepare()")
        self._start_background(holds, keyed, attention_kwargs)

    def finish(self) -> None:
        """``handle.finish``: wait for the thread's pass, raise its error, then :meth:`release`."""
        try:
            self._passes.finish()
        except BaseException:
            self.release(check=False)
            raise
        self.release()

    def stop_background(self) -> None:
        """The way into ``disable()``: refuse new background passes, then wait for the running ones.

        Why not :meth:`join_background`: another thread could start a pass between the join and
        the hooks' removal, and that pass would run on the parked weights as they are restored.
        """
        self._passes.close()

    def reopen_background(self) -> None:
        """After :meth:`stop_background`, the handle enabled again (a cast): passes may start again."""
        self._passes.reopen()

    def join_background(self) -> None:
        """``handle.join_background``: wait until every background pass (any thread's) has ended."""
        self._passes.join_all()

    # ------------------------------------------------------------------ what the hooks call

    @contextlib.contextmanager
    def predicted(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> Iterator[None]:
        """``handle.predicted_request``: a pipeline call's schedule, predicted from its arguments before
        it encodes the prompt, built by a background pass from now on (with ``overlap``).

        The request's first forward adopts the pass when the schedule the scheduler set is the same
        plans in the same order (:meth:`hold_schedule`); otherwise it is dropped and the real one
        built, so a wrong prediction costs time, never a row. One the call never adopted is given
        back when the block ends. ``plans`` that are not a list of plans is a PlanError, as for ``prepare``.
        """
        plans = request_plans(plans)
        if self._overlap and self._enabled() and (holds := self._holds()) is not None:
            self.abandon()  # the thread's previous request is over (a mismatch is reported at the first forward)
            try:
                self._follow(execution_device(self._model))
                family = self._family()
                keyed = [family.request_plan(self._model, plan) for plan in plans]
                if keyed and self.schedule.fits(keyed, warn=False):
                    self._start_background(holds, keyed, attention_kwargs, predicted=True)
            except Exception as exc:  # an optimisation: the first forward prepares the real schedule and raises
                logger.debug("AdaLN cache: the predicted schedule's pass did not start: %s", exc)
        try:
            yield
        finally:
            self._passes.drop_predicted()

    def hold_schedule(self, plans: list[Any], attention_kwargs: Mapping[str, Any] | None) -> None:
        """Hold a pipeline's whole schedule (already keyed as the forward keys it) for this thread."""
        if self._adopted(plans, attention_kwargs):
            return
        self.release()  # the thread's previous request is over (PlanMismatchError if it had a mismatch)
        self._follow(execution_device(self._model))
        holds = self._holds()
        assert holds is not None  # the hooks that call this are registered after the holds exist
        if self._overlap:
            self._start_background(holds, plans, attention_kwargs)
            return
        held = holds.for_request(plans, attention_kwargs)
        self._prepared.start(self._prepared_request(held))

    def serve_prepared(
        self, timestep: torch.Tensor, attention_kwargs: Mapping[str, Any] | None
    ) -> tuple[torch.Tensor, torch.dtype] | None:
        """A forward's ``(slot, dtype)`` from the thread's prepared request, found on the device, or None.

        None sends the forward down the host path: no prepared request, no holds (disabled), or a
        CPU forward under accelerate's offload hook (whose device the host path follows).
        """
        holds = self._holds()
        if self._prepared.request is None or holds is None:
            return None
        if timestep.device.type == "cpu" and getattr(self._model, "_hf_hook", None) is not None:
            return None
        return self._prepared.slot_of(timestep, holds.variant_of(attention_kwargs))

    def hold_forward(
        self, plan: torch.Tensor, key: PlanKey, attention_kwargs: Mapping[str, Any] | None, device: torch.device
    ) -> PlanHold:
        """Before a forward (the transformer hook calls it): hold ``plan`` resident on ``device``, or refuse.

        ``plan`` is the host copy of the forward's timestep, ``key`` its key, ``device`` where the
        forward runs (its timestep's), which the cache follows; the hook releases the hold when the
        forward returns.
        """
        if device.type == "cpu" and getattr(self._model, "_hf_hook", None) is not None:
            # A CPU tensor reports "cpu" even when the forward runs on "cpu:0" (accelerate's model
            # offload with device="cpu"), whose .to() gave the weights fresh addresses: follow the
            # device the hook names, as prepare() does, so a build here projects like the model.
            named = execution_device(self._model)
            device = named if named is not None and named.type == "cpu" else device
        self._follow(device)
        self._await_background(key)
        holds = self._holds()
        assert holds is not None  # the hooks are registered after the holds exist
        return holds.for_forward(plan, key, attention_kwargs)

    # ------------------------------------------------------------------ helpers

    def _serving(self, what: str) -> RequestHolds:
        """The enabling's holds, or ConfigError when the handle was disabled."""
        holds = self._holds()
        if not self._enabled() or holds is None:
            raise ConfigError(f"{what} needs the AdaLN cache enabled; this handle was disabled")
        self._follow(execution_device(self._model))
        return holds

    def _request_hold(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None, what: str) -> PlanHold:
        holds = self._serving(what)
        family = self._family()
        return holds.for_request(
            [family.request_plan(self._model, plan) for plan in request_plans(plans)], attention_kwargs
        )

    def _prepared_request(self, held: PlanHold) -> PreparedRequest:
        """``held`` as a request whose forwards find their slots on the device (released if that fails)."""
        try:
            # The variant the plans were held under, recorded with the hold: reading the LoRA
            # signature again here would stamp a change made meanwhile on the old rows.
            cache = self._cache()
            poison, columns = cache.poison_slot, cache.spec.plan_columns
            return PreparedRequest(
                held,
                variant=held.variant,
                device=cache.device,
                poison=poison,
                columns=columns,
                retirements=lambda: cache.retirements,
            )
        except BaseException:
            held.release()
            raise

    def _start_background(
        self,
        holds: RequestHolds,
        plans: list[Any],
        attention_kwargs: Mapping[str, Any] | None,
        *,
        predicted: bool = False,
    ) -> None:
        """Hold ``plans`` (keyed as forwards key them) for this thread from a background pass.

        ``predicted``: ``plans`` are a pipeline call's predicted schedule (:meth:`predicted`): a pass
        is started only where one is needed, and nothing is held in the foreground.
        """
        cache = self._cache()
        if autocast_dtype(cache.device) is not None or all(t in cache for t in plan_tensors(plans)):
            # Autocast is thread-local (a pass thread would not see it); a resident request is a hit.
            if not predicted:
                held = holds.for_request(plans, attention_kwargs)
                self._prepared.start(self._prepared_request(held))
            return
        keys = self._keys(plans)
        inputs = holds.embed_ahead(plans, attention_kwargs)  # the time embedder runs here, not beside forwards
        variant = holds.variant_of(attention_kwargs) if predicted else None
        hold = lambda chunk: holds.for_request(chunk, attention_kwargs, embed=inputs)  # noqa: E731
        split = len(set(keys)) > 1 and split_pays(cache.source)  # mincore only where a split is possible
        started = self._passes.start(hold, plans, keys, predicted=predicted, variant=variant, split=split)
        if not started and not predicted:
            # disable() has begun on another thread: no new pass, which would outlive its join.
            self._prepared.start(self._prepared_request(holds.for_request(plans, attention_kwargs)))

    def _adopted(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the thread's pass started from the call's prediction (:meth:`predicted`) is the pass
        of ``plans`` (keyed as forwards key them) and now the request's; it is dropped when it is not."""
        holds = self._holds()
        return holds is not None and self._passes.adopt(
            lambda: self._keys(plans), lambda: holds.variant_of(attention_kwargs)
        )

    def _keys(self, plans: Sequence[Any]) -> list[PlanKey]:
        """The key of each plan (keyed as forwards key them), in step order."""
        columns = self._cache().spec.plan_columns
        return [plan_key(t, columns) for t in plan_tensors(plans)]

    def _await_background(self, key: PlanKey) -> None:
        """Before a forward of ``key``: wait for the thread's background pass to make it servable."""
        try:
            self._passes.wait_for(key)
        except BaseException:
            self.release(check=False)  # the request fails here: what its pass did hold goes back now
            raise
