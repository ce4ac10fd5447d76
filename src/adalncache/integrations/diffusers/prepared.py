"""A prepared request's forwards served with no host read of the timestep: capturable in a CUDA graph.

Why: the host path (:mod:`.hooks`) copies each forward's timestep to the host to key it, a sync
that a CUDA graph cannot capture and that ``torch.compile(mode="reduce-overhead")`` must break the
graph for. A request whose plans were prepared (``handle.prepare``, ``handle.request``, a
pipeline's schedule) was keyed once, on the host, at ``prepare``: :class:`PreparedRequest` keeps
those keys on the device, and a forward compares its own keying inputs with them *on the device*
(the exact fp32 bit patterns, as the host keys do) and picks its slot with ``torch.where``.

Never a wrong row: a forward whose inputs match no prepared plan gets the slab's *poison slot*
(NaN rows, never handed out), so its output is NaN, never a plausible other step's modulation,
and a device-side counter records the miss. The counter is read off the critical path and raised
as :class:`~adalncache.PlanMismatchError` at the first of: the request's end (its hold released),
the scheduler's last step, the next ``prepare``, ``disable()``, or ``handle.check_request()``.

What stays on the host path (checked on the host, without reading a device tensor): a forward with
no prepared request on its thread, a plan whose shape or dtype no prepared plan has, a forward on
another device, under another LoRA signature or autocast state than the request was prepared
under, after its hold was released (a move of the cache), or after a held plan of the cache was
retired (``cache.invalidate()``, a checkpoint change): the held rows may be stale then. Those
forwards key and hold their plan on the host as before, so they are served exactly, or refused
with the host path's error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch

from ...cache import PlanHold
from ...errors import PlanMismatchError
from ...identity import autocast_dtype
from ...plans import PlanKey


class PreparedRequest:
    """One prepared request's keys on the device, its slots, and its device-side miss counter.

    ``hold`` holds the plans (released by :meth:`release`); ``variant`` and ``autocast`` are the
    LoRA signature and the autocast dtype the request was prepared under; ``poison`` is the slab's
    poison slot; ``retirements`` reads the cache's count of retired held plans, which the hold
    recorded as its ``epoch``: once it changed (``invalidate()``, tables of an old identity
    dropped), the held rows may be stale and forwards go to the host path, which rebuilds. The
    keys are grouped by their number of bit patterns (rows x columns), which a
    forward's plan shape gives on the host, so the device compares only plans of its own shape.
    """

    def __init__(
        self,
        hold: PlanHold,
        *,
        variant: Hashable,
        device: torch.device,
        poison: int,
        columns: int,
        retirements: Callable[[], int],
    ) -> None:
        self.hold = hold
        self.variant = variant
        self.retirements = retirements
        self.device = device
        self.columns = columns
        self.autocast = autocast_dtype(device)
        slots: dict[PlanKey, int] = dict(zip(hold.keys, hold.slot_list, strict=True))
        by_length: dict[int, list[PlanKey]] = {}
        for key in slots:
            by_length.setdefault(len(key), []).append(key)
        # Never inference tensors, though prepare() may run under torch.inference_mode(): the miss
        # counter is updated in place, which a later loop outside inference mode could not do.
        with torch.inference_mode(False):
            self._device_state(slots, by_length, device, poison)

    def _device_state(
        self, slots: dict[PlanKey, int], by_length: dict[int, list[PlanKey]], device: torch.device, poison: int
    ) -> None:
        """The keys, slots, poison slot and miss counter on the device (outside inference mode)."""
        #: Patterns per plan -> (``[R, patterns]`` int32 keys, ``[R]`` slots), on the device.
        self.groups = {
            length: (
                torch.tensor(keys, dtype=torch.int32).to(device),
                torch.tensor([slots[key] for key in keys], dtype=torch.int64).to(device),
            )
            for length, keys in by_length.items()
        }
        self.poison = torch.tensor(poison, dtype=torch.int64).to(device)
        #: Forwards served the poison slot since the last :meth:`take_misses` (a device tensor).
        self.misses = torch.zeros((), dtype=torch.int64, device=device)

    def covers(self, plan: torch.Tensor, variant: Hashable) -> bool:
        """Whether a forward with ``plan`` under ``variant`` is this request's to serve (host checks only)."""
        if self.hold.released or plan.device != self.device or plan.dtype != torch.float32:
            return False
        if self.retirements() != self.hold.epoch:  # a held plan was retired: its rows may be stale
            return False
        shaped = plan.dim() == 1 if self.columns == 1 else plan.dim() == 2 and plan.shape[1] == self.columns
        if not shaped or plan.numel() not in self.groups:
            return False
        return variant == self.variant and autocast_dtype(self.device) == self.autocast

    def slot_of(self, plan: torch.Tensor) -> torch.Tensor:
        """The slot of ``plan`` as a 0-d device tensor, found on the device; the poison slot on a miss.

        Device operations only (no ``.item()``, no ``bool()`` of a tensor, no host copy), so a
        CUDA graph captures it; a miss adds one to :attr:`misses`.
        """
        keys, slots = self.groups[plan.numel()]
        bits = plan.detach().contiguous().view(torch.int32).reshape(1, -1)
        found = (keys == bits).all(dim=1)
        hit = found.any()
        slot = torch.where(hit, slots[found.to(torch.int64).argmax()], self.poison)
        self.misses.add_(hit.logical_not().to(torch.int64))
        return slot

    def take_misses(self) -> int:
        """The forwards served the poison slot since the last call (a host read, off the critical path)."""
        count = int(self.misses.item())
        if count:
            self.misses.zero_()
        return count

    def release(self) -> int:
        """Release the hold; returns the misses not yet reported."""
        try:
            return self.take_misses()
        finally:
            self.hold.release()


def mismatch_error(misses: int) -> PlanMismatchError:
    """The error for ``misses`` forwards of a request served the poison slot."""
    return PlanMismatchError(
        f"{misses} forward(s) of this request had keying inputs (timestep, and guidance or a second "
        "timestep for the families keyed by them) that match none of the plans prepared for it, so "
        "their modulation was the poison slot's NaN rows and their outputs are NaN, never another "
        "step's rows; pass handle.prepare(plans) the plans the loop's forwards receive (each step's "
        "timestep tensor, as the transformer gets it), or run without prepare() to key each forward "
        "on the host (the cache stays usable)"
    )


class PreparedRequests(threading.local):
    """Per thread: the prepared request its forwards are served from, and a mismatch not yet raised.

    A thread has at most one prepared request: ``handle.prepare`` replaces it (the previous one is
    over), ``handle.request`` stands in for it during its ``with`` block.
    """

    def __init__(self) -> None:
        self.request: PreparedRequest | None = None
        self.pending = 0

    def start(self, request: PreparedRequest) -> PreparedRequest | None:
        """Make ``request`` the thread's; returns the one it replaces (the caller released it or keeps it)."""
        previous, self.request = self.request, request
        return previous

    def release(self) -> None:
        """Release the thread's request (no-op when none); its misses wait for :meth:`check`."""
        request, self.request = self.request, None
        if request is not None:
            self.pending += request.release()

    def finish(self, request: PreparedRequest, previous: PreparedRequest | None) -> None:
        """End ``request`` (a ``with`` block's), putting ``previous`` back; its misses wait for :meth:`check`."""
        if self.request is request:
            self.request = previous
        elif previous is not None:  # a prepare inside the block replaced it: the outer request is over too
            self.pending += previous.release()
        self.pending += request.release()

    def check(self) -> None:
        """Raise :class:`~adalncache.PlanMismatchError` if a forward of this thread was served the poison slot."""
        if self.request is not None:
            self.pending += self.request.take_misses()
        misses, self.pending = self.pending, 0
        if misses:
            raise mismatch_error(misses)

    def slot_of(self, plan: torch.Tensor, variant: Hashable) -> tuple[torch.Tensor, torch.dtype] | None:
        """``(slot, dtype)`` of a forward with ``plan``, found on the device, or ``None`` for the host path."""
        request = self.request
        if request is None or not request.covers(plan, variant):
            return None
        return request.slot_of(plan), request.hold.dtype


__all__ = ["PreparedRequest", "PreparedRequests", "mismatch_error"]
