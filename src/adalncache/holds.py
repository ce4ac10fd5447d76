"""A request's hold on its plans: what a request in flight keeps, and gives back when it ends.

Why holds exist: a request resolves its slots once, at its first step (that is what a CUDA graph
or a step loop wants), and reads them at every later step. Without a hold, another request's
build could evict those plans and write other rows into the same slots, and the first request
would silently read the wrong modulation for its remaining steps. While a :class:`PlanHold` is
alive, no build evicts or rewrites its slots (the slot pool reference-counts them), and a build
that cannot find room without doing so raises ``PlanError`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from types import TracebackType

import torch

from .plans import PlanKey
from .reports import BuildReport


class PlanHold:
    """The plans of one request, held until :meth:`release` (or the end of a ``with`` block).

    ``slots``: one slot per plan of the request, in the order given, as a LongTensor on the cache
    device (built without a host-to-device copy; read-only, it may be shared). ``keys``: the plans'
    keys, in the same order. ``report``: what the build that made them resident did. ``dtype``:
    the dtype the rows are served in (the autocast dtype they were built under, else the slab's).
    ``variant``: the identity variant (LoRA signature) the plans were held under, recorded with the
    hold so a caller never stamps a variant read later (after a change) on these rows. ``epoch``:
    the cache's :attr:`~adalncache.AdalnCache.retirements` when the hold was taken; a different
    count later means a held plan may have been retired (its rows are no longer current).
    """

    def __init__(
        self,
        release: Callable[[PlanHold], None],
        *,
        keys: list[PlanKey],
        slot_list: list[int],
        slots: torch.Tensor,
        report: BuildReport,
        dtype: torch.dtype,
        variant: Hashable = None,
        epoch: int = 0,
    ) -> None:
        self._release = release
        self.keys = keys
        self.slot_list = slot_list
        #: The distinct slots held, each once.
        self.held = list(dict.fromkeys(slot_list))
        self.slots = slots
        self.report = report
        self.dtype = dtype
        self.variant = variant
        self.epoch = epoch
        self.released = False

    def release(self) -> None:
        """Give the plans back (idempotent): builds may evict or rewrite them again.

        Call it on the thread (CUDA: the stream) that read the rows: the cache records there when
        the reads are done, and a later rewrite of these slots waits for that.
        """
        self._release(self)

    def __enter__(self) -> PlanHold:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"PlanHold({len(self.keys)} plan(s) in {len(self.held)} slot(s), {state})"


__all__ = ["PlanHold"]
