"""A request's rebuild pass on a background thread, so its first step waits only for its own plans.

Why: a first request of a new schedule would otherwise wait for the whole pass before its first
denoising step. With ``overlap=True`` the integration starts the pass on a thread as soon as the
request's plans are known and the request's thread goes on; each forward waits only for what it
needs.

How plans become servable: a transaction (:mod:`adalncache.transaction`) publishes all of its
plans or none, and per-layer publication would make a half-built plan visible. So the pass is run
as **two transactions**: the first step's plans alone (small), then every plan of the request (the
first step's are hits there). A forward whose plan is one of the first step's waits for the first;
any other forward waits for the second. An overlapped miss therefore costs two passes
(``stats.passes``), the first over one plan. Except from a cold checkpoint (:func:`split_pays`):
each transaction reads every layer, and a cold one reads them with O_DIRECT, so the second would
read everything again; the pass is one transaction there, which every forward waits for.

Where the pass starts: when a pipeline call begins, from the schedule predicted from its
arguments (:mod:`.calls`; ``QwenImagePipeline``, the MiniMax-H3 modular pipeline), else at a
MiniMax-H3 loop's prepare block or a classic pipeline's first forward. A predicted pass stays
*predicted* until the request's schedule is known there and adopts it
(:meth:`BackgroundPasses.adopt`: the same keys in the same order, the same LoRA variant) or drops
it; a dropped one's failure is no request's (logged at debug level).

Failure: each transaction rolls back as a foreground one does (nothing of it published, the cache
exactly as usable as before it). Its error (the same :class:`~adalncache.BuildError` or
:class:`~adalncache.PlanError`) is kept and raised in the request's thread by the next forward
that needs a plan of the failed transaction, and by :meth:`BackgroundPass.finish` at the
request's end at the latest.

Threads: the request's thread waits on events, never while holding a lock; the pass takes the
handle's lock, then the cache's build lock, then its state lock, as a foreground build does. The
plans' inputs (the time embedder's output) are computed on the request's thread before the pass
starts (:meth:`.requests.RequestHolds.embed_ahead`): the pass thread only reads weights and
projects, so the request's own forwards, which run beside it, never meet a time embedder whose
weights a build lent or parked. A request whose plans are all resident takes the hit path on its
own thread and starts no pass. A Ctrl-C in the request's thread interrupts its wait; the pass then
finishes (or fails) on its own and gives its holds back, since :meth:`BackgroundPass.release` marks
it released.

The request's forwards key their plans on the host (the host path of :mod:`.hooks`), where they
wait: the device-side lookup of :mod:`.prepared` needs the request's slots, which a pass still
running does not have yet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...cache import PlanHold
from ...plans import PlanKey
from ...source.checkpoint import CheckpointSource

logger = logging.getLogger(__name__)

#: Holds a list of request plans resident (one transaction at most): the request lifecycle's hold (:mod:`.lifecycle`).
HoldFn = Callable[[list[Any]], PlanHold]


def split_pays(source: object) -> bool:
    """Whether a pass split in two transactions (the first step's plans, then all) pays on ``source``.

    Each transaction reads every layer. From memory, or from a checkpoint the page cache mostly
    holds, the second read is cheap and the first step waits for one plan's projections instead
    of all of them. From a cold checkpoint the pass is bound by the reading, which is O_DIRECT (the
    page cache keeps nothing): the first transaction alone costs the whole read, and the second
    reads it all again; one transaction is then faster for the first step and for the request.
    """
    if not isinstance(source, CheckpointSource):
        return True
    fraction = source.cached_fraction()
    return fraction is None or fraction >= 0.5


class BackgroundPass:
    """One request's pass on a daemon thread: the first step's plans, then all (module docstring).

    ``plans``: the request's plans in step order, as ``prepare`` takes them; ``keys``: the key of
    each (the forward's key of that step's plan). The holds it takes are the request's: they keep
    other requests' builds from evicting its plans until :meth:`release`.
    """

    def __init__(self, hold: HoldFn, plans: Sequence[Any], keys: Sequence[PlanKey], *, split: bool = True) -> None:
        if len(plans) != len(keys) or not plans:
            raise ValueError("BackgroundPass needs one key per plan and at least one plan")
        self._hold = hold
        self._plans = list(plans)
        #: The key of each step's plan in step order: what a predicted pass is compared on (``adopt``).
        self.keys = tuple(keys)
        #: Started from a pipeline call's predicted schedule and not adopted yet by its first forward.
        self.predicted = False
        #: The LoRA variant the plans are built under (compared when a prediction is adopted).
        self.variant: object = None
        self.first_keys = frozenset([keys[0]])
        #: Whether the first step's plans get a transaction of their own: ``split`` (the caller's
        #: :func:`split_pays`) and plans beyond the first step's (else one transaction does it all).
        self.split = split and len(set(keys)) > 1
        self._first = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()  # guards _holds, _released, _surfaced; never held while waiting
        self._holds: list[PlanHold] = []
        self._released = False
        self._surfaced = False
        self._first_error: BaseException | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="adalncache-pass", daemon=True)

    def start(self) -> BackgroundPass:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _keep(self, held: PlanHold) -> None:
        """Keep ``held`` for the request, or give it back at once when the request already ended."""
        with self._lock:
            if not self._released:
                self._holds.append(held)
                return
        held.release()

    def _run(self) -> None:
        try:
            if self.split:
                try:
                    self._keep(self._hold(self._plans[:1]))
                except BaseException as exc:
                    self._first_error = exc
                    raise
                finally:
                    self._first.set()
            self._keep(self._hold(self._plans))
        except BaseException as exc:  # kept for the request's thread, which raises it (module docstring)
            with self._lock:
                self.error = exc
                late = self._released and not self._surfaced  # no thread of the request will raise it
                self._surfaced = self._surfaced or late
            if late and not self.predicted:
                logger.warning("AdaLN cache: a background pass failed after its request ended: %s", exc)
            else:
                logger.debug("AdaLN cache: the background pass failed: %s", exc)
        finally:
            self._first.set()
            self._done.set()

    def wait_for(self, key: PlanKey) -> None:
        """Before a forward of plan ``key``: wait until it is servable; raise the pass's error if its
        transaction failed (the same exception object the foreground build would have raised)."""
        first = self.split and key in self.first_keys
        (self._first if first else self._done).wait()
        error = self._first_error if first else self.error
        if error is not None:
            with self._lock:
                self._surfaced = True
            raise error

    def join(self) -> None:
        """Wait for the pass to end (both transactions), whatever their outcome."""
        self._done.wait()

    def release(self) -> None:
        """Give the request's holds back; a pass still running gives its own back when it ends.

        Never waits and never raises: the next request's ``prepare`` and an interrupted loop call it.
        """
        with self._lock:
            self._released = True
            holds, self._holds = self._holds, []
            # The pass sets its error under this lock: either it is set now, or the pass sees _released.
            unreported = self.error is not None and not self._surfaced
            self._surfaced = self._surfaced or unreported
        for held in holds:
            held.release()
        if unreported and not self.predicted:
            logger.warning("AdaLN cache: a background pass failed after its request ended: %s", self.error)
        elif unreported:  # a prediction no request adopted: its failure is no request's (a real pass retries)
            logger.debug("AdaLN cache: a pass of a dropped prediction failed: %s", self.error)

    def finish(self) -> None:
        """The request's end: wait for the pass, release its holds, raise its error if no forward did."""
        self.join()
        with self._lock:
            unreported = self.error is not None and not self._surfaced
            self._surfaced = True
        self.release()
        if unreported:
            assert self.error is not None
            raise self.error


class BackgroundPasses:
    """One handle's background passes: the calling thread's pending one, and every one still running.

    Per thread, at most one request is pending (its pass); :meth:`join_all` waits for the passes of
    every thread (``disable()`` does, since a running pass uses the parked weights and the hooks).
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _running and _closed; never held while waiting
        self._running: list[BackgroundPass] = []
        self._closed = False

    def start(
        self,
        hold: HoldFn,
        plans: Sequence[Any],
        keys: Sequence[PlanKey],
        *,
        predicted: bool = False,
        variant: object = None,
        split: bool = True,
    ) -> bool:
        """Start the calling thread's request's pass (its previous one must have been taken).

        ``predicted``: ``plans`` are a pipeline call's predicted schedule, built under the LoRA
        ``variant`` (the request's first forward adopts the pass, or drops it: :meth:`adopt`).
        False, starting nothing, once :meth:`close` was called: ``disable()`` has joined the passes
        and is removing the hooks a new pass would use; the caller holds in the foreground instead.
        """
        background = BackgroundPass(hold, plans, keys, split=split)
        background.predicted, background.variant = predicted, variant
        with self._lock:
            if self._closed:
                return False
            self._running = [running for running in self._running if not running.done]
            self._running.append(background)  # registered before close() can take the list
        self._local.pending = background.start()
        return True

    def reopen(self) -> None:
        """Accept passes again: the handle was enabled again (after a cast) over the same requests."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Refuse new passes, then wait for every running one (the way into ``disable()``)."""
        with self._lock:
            self._closed = True
        self.join_all()

    def adopt(self, keys: Callable[[], Sequence[PlanKey]], variant: Callable[[], object]) -> bool:
        """At a request's first forward: whether the thread's pass started from a prediction is this
        request's (the same ``keys()`` in the same step order, under the same LoRA ``variant()``); it
        is then the request's pass. False when there is none or it predicted otherwise (the caller
        drops it). The callables are read only when a prediction is pending."""
        pending: BackgroundPass | None = getattr(self._local, "pending", None)
        if pending is None or not pending.predicted:
            return False
        if pending.keys != tuple(keys()) or pending.variant != variant():
            logger.info("AdaLN cache: the schedule predicted from the pipeline call was not the request's; dropped")
            return False
        pending.predicted = False
        logger.debug("AdaLN cache: the pass started from the pipeline call's predicted schedule is the request's")
        return True

    def drop_predicted(self) -> None:
        """The pipeline call ends: give back a predicted pass no forward adopted (never waits)."""
        pending: BackgroundPass | None = getattr(self._local, "pending", None)
        if pending is not None and pending.predicted:
            self.release()

    def take(self) -> BackgroundPass | None:
        """The calling thread's pending pass, which is no longer its request's."""
        pending: BackgroundPass | None = getattr(self._local, "pending", None)
        self._local.pending = None
        return pending

    def release(self) -> None:
        """The calling thread's request is over: give its pass's holds back (never waits)."""
        pending = self.take()
        if pending is not None:
            pending.release()

    def finish(self) -> None:
        """The calling thread's request ends: wait for its pass; raise its error if no forward did."""
        pending = self.take()
        if pending is not None:
            pending.finish()

    def wait_for(self, key: PlanKey) -> None:
        """Before a forward of ``key`` on this thread: wait for its pending pass to make it servable."""
        pending: BackgroundPass | None = getattr(self._local, "pending", None)
        if pending is not None:
            pending.wait_for(key)

    def join_all(self) -> None:
        """Wait until every pass started here (by any thread) has ended."""
        with self._lock:
            running, self._running = self._running, []
        for background in running:
            background.join()


__all__ = ["BackgroundPass", "BackgroundPasses"]
