"""The slot pool: which plan owns which slot, in which recency order, and which slots are free.

:class:`SlotPool` is the only code that changes the host-side slot map, the LRU order or the free
list. The cache asks it for slots, and tells it when a build published or failed; the pool
clears slot contents through the :class:`~adalncache.slab.Slab` when a slot stops being visible.

A slot is in exactly one of three states:

* **free**: in the free list, not in the map, ``plan_lengths[slot] == 0``, zero timesteps;
* **reserved**: handed to a build by :meth:`SlotPool.reserve`, in neither the map nor the free
  list; the build writes its rows. It becomes *resident* at :meth:`SlotPool.commit` (after the
  slab published timesteps and lengths) or *free* again at :meth:`SlotPool.release`;
* **resident**: in the map (which lookups consult), with its plan's length and timesteps.

Invariants (:meth:`SlotPool.check_invariants` asserts them; the tests call it after every step):

1. no two plans share a slot, and no slot is in the free list twice;
2. outside a build (nothing reserved), the resident and the free slots partition ``0..P-1``:
   no slot leaks, none is both;
3. a free slot has length 0; a resident slot's length and timesteps are its plan's.

Ordering rules, and why:

* **Reserve** takes free slots first, lowest index first (deterministic, so the ranks of a
  distributed cache pick the same slots), then evicts least-recently-used plans that are *not* in
  the request: a plan the request will use must never be evicted by its own build. Every
  eviction decision goes through :meth:`SlotPool._eviction_candidates`, the one place a later
  rule (plans held by a running request, say) has to change.
* **Commit** (the host-side map flip) is the last step of a publish: the map is what lookups
  consult, so a failure at any earlier point hides the whole request.
* **Release** (a failed build) returns the reserved slots and hides anything written to them.
  Plans evicted to make room stay evicted: they were only a cache.
* **Touch** marks plans most recently used, in the order given (a request's first-seen order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from .errors import PlanError, PlanNotCachedError
from .plans import PlanKey, format_plan, plan_key
from .slab import Slab


@dataclass
class Reservation:
    """The slots one build may write: ``slots`` per missing plan; ``evicted`` plans made room."""

    slots: dict[PlanKey, int] = field(default_factory=dict)
    evicted: list[PlanKey] = field(default_factory=list)


class SlotPool:
    """Slot map, LRU order and free list of one slab (see the module docstring for the rules)."""

    def __init__(self, slab: Slab) -> None:
        self._slab = slab
        self.num_slots = slab.max_plans
        # The published slot map; its order is the LRU order (least recently used first).
        self._map: OrderedDict[PlanKey, int] = OrderedDict()
        # Every slot that is neither resident nor reserved.
        self._free: list[int] = list(range(self.num_slots))

    # -- queries ----------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def slot_of(self, key: PlanKey) -> int | None:
        return self._map.get(key)

    def require(self, key: PlanKey) -> int:
        """The slot of resident ``key``; PlanNotCachedError ("does not cover") if it is not resident."""
        slot = self._map.get(key)
        if slot is None:
            raise PlanNotCachedError(
                f"the cache does not cover plan {format_plan(key)} ({len(self._map)} plan(s) resident): call "
                f"build() with it first"
            )
        return slot

    def keys(self) -> list[PlanKey]:
        """Resident plans, least recently used first."""
        return list(self._map)

    def items(self) -> list[tuple[PlanKey, int]]:
        """``(plan, slot)`` of every resident plan, least recently used first."""
        return list(self._map.items())

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    # -- transitions ------------------------------------------------------------------------

    def touch(self, keys: Iterable[PlanKey]) -> None:
        """Mark resident ``keys`` most recently used, in the order given (the last is the newest)."""
        for key in keys:
            self._map.move_to_end(key)

    def _eviction_candidates(self, wanted: Collection[PlanKey]) -> list[PlanKey]:
        """Resident plans a build for ``wanted`` may evict, least recently used first.

        The one place that decides what may be evicted: never a plan of the request itself.
        """
        return [k for k in self._map if k not in wanted]

    def reserve(self, missing: Sequence[PlanKey], wanted: Collection[PlanKey]) -> Reservation:
        """Slots for ``missing``: free ones first (lowest first), then LRU plans outside ``wanted``.

        Evicted plans are unpublished at once (a build that then fails does not bring them back).
        Raises PlanError, changing nothing, when even evicting every candidate leaves too few
        slots; the cache's own request check (at most ``max_plans`` distinct plans) rules that out.
        """
        candidates = self._eviction_candidates(wanted)
        if len(missing) > len(self._free) + len(candidates):
            raise PlanError(
                f"{len(missing)} plan(s) need slots but only {len(self._free)} are free and {len(candidates)} "
                f"may be evicted: raise max_plans (CLI --max-plans)"
            )
        reservation = Reservation()
        self._free.sort(reverse=True)  # pop() hands out the lowest free slot first: deterministic
        victims = iter(candidates)
        for key in missing:
            if not self._free:
                victim = next(victims)
                self.unpublish(victim)
                reservation.evicted.append(victim)
            reservation.slots[key] = self._free.pop()
        return reservation

    def unpublish(self, key: PlanKey) -> None:
        """Evict ``key``: the map forgets it first, so no lookup can reach a slot being cleared."""
        slot = self._map.pop(key)
        self._slab.clear(slot)
        self._free.append(slot)

    def release(self, slots: dict[PlanKey, int]) -> None:
        """Return the slots of a failed build to the free list, hiding anything written into them."""
        for key, slot in slots.items():
            if self._map.get(key) == slot:
                del self._map[key]
            self._slab.clear(slot)
            if slot not in self._free:
                self._free.append(slot)

    def commit(self, slots: dict[PlanKey, int]) -> None:
        """The host-side map flip, the last step of a publish: ``slots`` become resident, newest last."""
        self._map.update(slots)

    def clear(self) -> None:
        """Unpublish every plan (``invalidate()``, or tables built under an old identity)."""
        for key in list(self._map):
            self.unpublish(key)

    # -- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (call it outside a build)."""
        resident = set(self._map.values())
        free = set(self._free)
        assert len(resident) == len(self._map), "two plans share a slot"
        assert len(free) == len(self._free), "a slot is free twice"
        assert not resident & free, "a slot is both free and resident"
        assert resident | free == set(range(self.num_slots)), "a slot leaked"
        lengths, timesteps = self._slab.published()
        for slot in free:
            assert int(lengths[slot]) == 0, f"free slot {slot} has length {int(lengths[slot])}"
        for key, slot in self._map.items():
            n = int(lengths[slot])
            assert n == len(key), f"slot {slot}: length {n} but its plan {format_plan(key)} has {len(key)}"
            assert plan_key(timesteps[slot, :n].contiguous()) == key, f"slot {slot}: timesteps disagree with map"


__all__ = ["Reservation", "SlotPool"]
