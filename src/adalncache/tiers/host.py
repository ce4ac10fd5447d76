"""Host tier: copies of published plans in one preallocated, byte-bounded host arena.

One arena because page-locking is slow: it happens once, for exactly the capacity (torch's pinned allocator
would round 20 GB up to 32 GiB and never give it back), when the cache device is CUDA, so restores are
asynchronous DMA. The arena is cut into units of one plan row (rounded up to 64 bytes, so every dtype view is
aligned); a plan owns contiguous units, part by part, so a hit is one copy per part.
"""

from __future__ import annotations

import errno
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..devices import HostBuffer, Registrar, allocation_error
from ..options import knob
from ..plans import PlanKey, key_to_plan
from ..slab import PlanRows
from ..spec import ModulationSpec

log = logging.getLogger(__name__)

#: The argument (and CLI flag) that sizes the host tier, for messages that tell what to lower.
HOST_TIER_KNOB = knob("host_cache_bytes")

#: Unit alignment in bytes: keeps every view aligned for any dtype and for fast DMA.
_ALIGN = 64

GroupId = frozenset[PlanKey]


@dataclass
class _Entry:
    """One plan held in the arena: ``units`` contiguous units from ``start``; ``groups`` hold it."""

    start: int
    units: int
    groups: set[GroupId]


class HostTier:
    """Byte-bounded host copies of published plans, admitted and evicted by request group (the distinct plans of
    one request), least recently used first; a plan several groups hold is freed with the last. ``pin``
    page-locks the arena. Over capacity is never an error (:meth:`admit` returns False, the caller counts the
    skip). Not thread-safe: the cache calls it from its own build, one at a time.
    """

    def __init__(
        self,
        spec: ModulationSpec,
        capacity_bytes: int,
        *,
        pin: bool = False,
        registrar: Registrar | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.spec = spec
        self.capacity_bytes = int(capacity_bytes)
        self.unit_bytes = -(-spec.row_bytes // _ALIGN) * _ALIGN
        self.total_units = self.capacity_bytes // self.unit_bytes
        # Only whole units are usable; the remainder (< one unit) is never allocated.
        nbytes = self.total_units * self.unit_bytes
        try:
            self._buffer = HostBuffer(nbytes, pin=pin, registrar=registrar, device=device)
        except (MemoryError, OSError) as exc:  # mmap's ENOMEM, or a refused page lock
            if isinstance(exc, OSError) and exc.errno not in (errno.ENOMEM, errno.EAGAIN):
                raise
            what = f"the host tier of host_cache_bytes={self.capacity_bytes}"
            raise allocation_error(exc, nbytes, torch.device("cpu"), what, HOST_TIER_KNOB) from None
        self.pinned = self._buffer.pinned
        self.arena = self._buffer.tensor
        self._owner: list[PlanKey | None] = [None] * self.total_units
        self._free_units = self.total_units
        self._plans: dict[PlanKey, _Entry] = {}
        self._groups: OrderedDict[GroupId, None] = OrderedDict()  # least recently used first
        self.evicted_plans = 0
        if self.total_units == 0 and self.capacity_bytes > 0:
            log.warning(
                "host tier of %d bytes cannot hold one timestep row (%d bytes): it will skip every group; raise %s",
                self.capacity_bytes,
                spec.row_bytes,
                HOST_TIER_KNOB,
            )

    @property
    def used_bytes(self) -> int:
        return (self.total_units - self._free_units) * self.unit_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes not owned by any plan (including the sub-unit remainder that can never be used)."""
        return self.capacity_bytes - self.used_bytes

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: object) -> bool:
        return key in self._plans

    def refcount(self, key: PlanKey) -> int:
        entry = self._plans.get(key)
        return len(entry.groups) if entry else 0

    def __repr__(self) -> str:
        return (
            f"HostTier({len(self._plans)} plans in {len(self._groups)} groups, "
            f"{self.used_bytes}/{self.capacity_bytes} bytes{', pinned' if self.pinned else ''})"
        )

    def _views(self, key: PlanKey, entry: _Entry) -> PlanRows:
        spec, offset = self.spec, entry.start * self.unit_bytes
        n, item = spec.plan_rows(key), spec.itemsize
        parts = []
        for part in spec.table_parts():
            nbytes = n * (part.stop - part.start) * item
            parts.append(self.arena[offset : offset + nbytes].view(spec.dtype).view(n, *part.shape))
            offset += nbytes
        return PlanRows(key_to_plan(key, spec.plan_columns), *parts)

    def lookup(self, keys: Iterable[PlanKey]) -> dict[PlanKey, PlanRows]:
        """Views of the held plans among ``keys`` (the arena's own memory: copy before the next admit); a hit
        marks the groups holding the plan as recently used."""
        found: dict[PlanKey, PlanRows] = {}
        for key in keys:
            entry = self._plans.get(key)
            if entry is None:
                continue
            found[key] = self._views(key, entry)
            for group in entry.groups:
                self._groups.move_to_end(group)
        return found

    def _find_run(self, units: int) -> int | None:
        """First start of ``units`` contiguous free units, or None."""
        run = 0
        for index, owner in enumerate(self._owner):
            run = run + 1 if owner is None else 0
            if run == units:
                return index - units + 1
        return None

    def _take(self, key: PlanKey, start: int, units: int) -> None:
        self._owner[start : start + units] = [key] * units
        self._free_units -= units

    def _give_back(self, entry: _Entry) -> None:
        self._owner[entry.start : entry.start + entry.units] = [None] * entry.units
        self._free_units += entry.units

    def _unhold(self, key: PlanKey, group: GroupId) -> None:
        """``group`` no longer holds ``key``: a plan no group holds is freed and counted as evicted."""
        entry = self._plans.get(key)
        if entry is None:
            return
        entry.groups.discard(group)
        if not entry.groups:
            del self._plans[key]
            self._give_back(entry)
            self.evicted_plans += 1

    def _evict_group(self, group: GroupId) -> None:
        del self._groups[group]
        for key in group:
            self._unhold(key, group)

    def admit(self, group_keys: Iterable[PlanKey], rows_of: Callable[[PlanKey], PlanRows]) -> bool:
        """Hold every plan of one request (``group_keys``), copying new ones with ``rows_of(key)``, evicting
        least-recently-used groups to make room; False (nothing changed) when the group cannot fit even in an
        empty tier. If a copy fails, every unit this call took is returned and the group is not recorded, then
        the error propagates (groups evicted to make room stay evicted: they were only a cache).
        """
        group: GroupId = frozenset(group_keys)
        if not group:
            return True
        if group in self._groups:
            self._groups.move_to_end(group)
            return True
        rows = self.spec.plan_rows
        need = sum(rows(key) for key in group)
        if need > self.total_units:
            log.info("host tier: a group of %d timestep rows exceeds the tier (%d): skipped", need, self.total_units)
            return False

        # Claim the plans already held first, so evicting other groups cannot free them.
        held = [key for key in group if key in self._plans]
        for key in held:
            self._plans[key].groups.add(group)
        new = [key for key in group if key not in self._plans]
        placed: dict[PlanKey, _Entry] = {}
        try:
            for key in sorted(new, key=rows, reverse=True):  # widest first: less fragmentation
                start = self._find_run(rows(key))
                while start is None:
                    victim = next(iter(self._groups), None)
                    if victim is None:
                        raise _NoRoom
                    self._evict_group(victim)
                    start = self._find_run(rows(key))
                self._take(key, start, rows(key))
                placed[key] = _Entry(start, rows(key), {group})
            for key, entry in placed.items():
                found = rows_of(key)
                views = self._views(key, entry)
                # A blocking copy: on CUDA it waits for the stream, so the arena bytes are complete
                # before anyone can look them up, and no earlier async restore still reads them.
                for view, part in zip(views.parts, found.parts, strict=True):
                    view.copy_(part)
        except BaseException as exc:
            for entry in placed.values():
                self._give_back(entry)
            for key in held:  # claimed, so no eviction freed them; one whose other groups were evicted goes now
                self._unhold(key, group)
            if isinstance(exc, _NoRoom):
                # Only the group's own shared plans fragment the arena: skip rather than fail.
                log.info("host tier: no contiguous room for a group of %d rows: skipped", need)
                return False
            raise
        # Publish last: entries become visible only once their bytes are complete.
        self._plans.update(placed)
        self._groups[group] = None
        return True

    def release(self) -> int:
        """Forget everything and give the arena back (unlocked and freed); returns its bytes. The tier then
        skips every group (capacity 0). Called when the cache is closed (``AdalnCache.close()``)."""
        released = self.total_units * self.unit_bytes
        self.clear()
        self._buffer.release()
        self._buffer = HostBuffer(0)
        self.arena, self.pinned, self.capacity_bytes, self.total_units = self._buffer.tensor, False, 0, 0
        self._owner, self._free_units = [], 0
        return released

    def clear(self) -> None:
        """Forget everything (an identity change or ``invalidate``); not counted as evictions."""
        self._plans.clear()
        self._groups.clear()
        self._owner = [None] * self.total_units
        self._free_units = self.total_units

    def check_invariants(self) -> None:
        """Assert the arena accounting and the reference counts (tests call this after each step)."""
        owned = 0
        for key, entry in self._plans.items():
            rows = self.spec.plan_rows(key)
            assert entry.units == rows, f"plan {key}: {entry.units} units for {rows} plan rows"
            assert entry.groups, f"plan {key} is held by no group"
            for index in range(entry.start, entry.start + entry.units):
                assert self._owner[index] == key, f"unit {index} not owned by the plan that claims it"
            owned += entry.units
        assert owned == sum(o is not None for o in self._owner), "a unit is owned by no live plan"
        assert self._free_units == self.total_units - owned, "free unit count disagrees with ownership"
        assert self.free_bytes + self.used_bytes == self.capacity_bytes, "arena bytes unaccounted"
        assert self.used_bytes == owned * self.unit_bytes, "used bytes disagree with owned units"
        for group in self._groups:
            for key in group:
                holder = self._plans.get(key)
                assert holder is not None, f"group lists plan {key} the tier does not hold"
                assert group in holder.groups, f"plan {key} does not count group holding it"
        for key, entry in self._plans.items():
            for group in entry.groups:
                assert group in self._groups, f"plan {key} counts a group that no longer exists"


class _NoRoom(Exception):
    """Internal: no contiguous run even after evicting every other group."""


__all__ = ["HOST_TIER_KNOB", "HostTier"]
