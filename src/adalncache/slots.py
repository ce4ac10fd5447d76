"""The slot pool: which plan owns which slot, in which recency order, and which slots are free.

:class:`SlotPool` is the only code that changes the host-side slot map, the LRU order or the free
list. The cache asks it for slots, and tells it when a build published or failed; the pool
clears slot contents through the :class:`~adalncache.slab.Slab` when a slot stops being visible.

A slot is in exactly one of four states:

* **free**: in the free list, not in the map, ``plan_lengths[slot] == 0``, zero timesteps;
* **reserved**: handed to a build by :meth:`SlotPool.reserve`, in neither the map nor the free
  list; the build writes its rows. It becomes *resident* at :meth:`SlotPool.commit` (after the
  slab published timesteps and lengths) or *free* again at :meth:`SlotPool.release`;
* **resident**: in the map (which lookups consult), with its plan's length and timesteps. A
  resident slot may be *held* (:meth:`SlotPool.hold`, reference-counted): a request in flight
  reads it, so no build may evict or rewrite it;
* **retired**: a held slot whose plan left the map (``invalidate()``, or tables built under an
  old identity). No new lookup finds it, but its holders still read it, so it keeps its rows,
  length and timesteps untouched until the last hold is released; then it is cleared and freed.

Invariants (:meth:`SlotPool.check_invariants` asserts them; the tests call it after every step):

1. no two plans share a slot, and no slot is in the free list twice;
2. outside a build (nothing reserved), the resident, the retired and the free slots partition
   ``0..P-1``: no slot leaks, none is in two states;
3. a free slot has length 0; a resident or retired slot's length and timesteps are its plan's;
4. every held slot is resident or retired, and every retired slot is held.

Ordering rules, and why:

* **Reserve** takes free slots first, lowest index first (deterministic, so the ranks of a
  distributed cache pick the same slots), then evicts least-recently-used plans that are *not* in
  the request (a plan the request will use must never be evicted by its own build) and that no
  request holds (a request in flight reads them). Every eviction decision goes through
  :meth:`SlotPool._eviction_candidates`.
* **Unpublish** (an eviction, ``invalidate()``, an identity change): the map forgets the plan
  first, so no lookup can reach a slot being cleared; a held slot is retired instead of cleared.
* **Commit** (the host-side map flip) is the last step of a publish: the map is what lookups
  consult, so a failure at any earlier point hides the whole request.
* **Release** (a failed build) returns the reserved slots and hides anything written to them.
  Plans evicted to make room stay evicted: they were only a cache.
* **Touch** marks plans most recently used, in the order given (a request's first-seen order).

Device ordering (CUDA): every first write to a slot (a reservation, a clearing) first waits for
the reads still queued on it, and a commit records the event readers wait on
(:class:`~adalncache.streams.StreamSync`). The pool is not thread-safe by itself: the cache calls
it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from .errors import PlanError, PlanNotCachedError
from .options import knob
from .plans import PlanKey, format_plan, plan_key
from .slab import Slab
from .streams import NoEvents, StreamSync


@dataclass
class Reservation:
    """The slots one build may write: ``slots`` per missing plan; ``evicted`` plans made room."""

    slots: dict[PlanKey, int] = field(default_factory=dict)
    evicted: list[PlanKey] = field(default_factory=list)


class SlotPool:
    """Slot map, LRU order and free list of one slab (see the module docstring for the rules)."""

    def __init__(self, slab: Slab, sync: StreamSync | None = None) -> None:
        self._slab = slab
        self.num_slots = slab.max_plans
        self.sync = sync if sync is not None else StreamSync(self.num_slots, NoEvents())
        # The published slot map; its order is the LRU order (least recently used first).
        self._map: OrderedDict[PlanKey, int] = OrderedDict()
        # Every slot that is neither resident, retired nor reserved.
        self._free: list[int] = list(range(self.num_slots))
        # Hold counts of the slots requests in flight read (only counts > 0 are kept).
        self._holds: dict[int, int] = {}
        # Held slots whose plan left the map, with that plan: cleared at their last release.
        self._retired: dict[int, PlanKey] = {}
        #: How many held slots were ever retired: a hold that recorded another count may read rows
        #: that are no longer what its plan's key would build now (``invalidate()``, a new identity).
        self.retirements = 0

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
                f"the cache does not cover plan {format_plan(key, columns=self._slab.spec.plan_columns)} "
                f"({len(self._map)} plan(s) resident): call "
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

    @property
    def held_slots(self) -> dict[int, int]:
        """Hold count of every held slot (resident or retired)."""
        return dict(self._holds)

    @property
    def retired_slots(self) -> dict[int, PlanKey]:
        """Held slots whose plan is no longer resident, with that plan."""
        return dict(self._retired)

    def in_use(self, slot: int) -> bool:
        """Whether ``slot`` holds a plan someone may read: resident, or retired while held."""
        return slot in self._retired or slot in self._map.values()

    def held_plans(self) -> int:
        """How many resident plans are held by requests in flight."""
        return sum(1 for slot in self._map.values() if slot in self._holds)

    def room(self, wanted: Collection[PlanKey]) -> tuple[int, int]:
        """``(free slots, plans a build for wanted may evict)``: the most slots a build could reserve."""
        return len(self._free), len(self._eviction_candidates(wanted))

    # -- transitions ------------------------------------------------------------------------

    def touch(self, keys: Iterable[PlanKey]) -> None:
        """Mark resident ``keys`` most recently used, in the order given (the last is the newest)."""
        for key in keys:
            self._map.move_to_end(key)

    def _eviction_candidates(self, wanted: Collection[PlanKey]) -> list[PlanKey]:
        """Resident plans a build for ``wanted`` may evict, least recently used first.

        The one place that decides what may be evicted: never a plan of the request itself, and
        never a plan a request in flight holds.
        """
        return [k for k in self._map if self._map[k] not in self._holds if k not in wanted]

    def reserve(self, missing: Sequence[PlanKey], wanted: Collection[PlanKey]) -> Reservation:
        """Slots for ``missing``: free ones first (lowest first), then LRU plans outside ``wanted``.

        Evicted plans are unpublished at once (a build that then fails does not bring them back).
        Raises PlanError, changing nothing, when even evicting every candidate leaves too few
        slots; the cache's own request check (at most ``max_plans`` distinct plans) rules that out.
        """
        candidates = self._eviction_candidates(wanted)
        if len(missing) > len(self._free) + len(candidates):
            raise PlanError(self.no_room_message(len(missing), wanted))
        reservation = Reservation()
        self._free.sort(reverse=True)  # pop() hands out the lowest free slot first: deterministic
        victims = iter(candidates)
        for key in missing:
            if not self._free:
                victim = next(victims)
                self.unpublish(victim)
                reservation.evicted.append(victim)
            reservation.slots[key] = self._free.pop()
        # The build writes these slots next: reads still queued on them (a released request's,
        # an evicted plan's last gathers) must finish first.
        self.sync.before_write(reservation.slots.values())
        return reservation

    def no_room_message(self, need: int, wanted: Collection[PlanKey]) -> str:
        """Why a build for ``wanted`` cannot reserve ``need`` slots, and what to change."""
        free, evictable = self.room(wanted)
        held = self.held_plans()
        retired = len(self._retired)
        busy = f"{held} resident plan(s) are held by requests in flight"
        if retired:
            busy += f" and {retired} slot(s) still hold plans of an old identity for them"
        return (
            f"{need} plan(s) need slots but only {free} are free and {evictable} may be evicted: {busy}, "
            f"and a build never evicts a held plan; raise {knob('max_plans')}, or release "
            f"requests (end their acquire() block) before building more"
        )

    def unpublish(self, key: PlanKey) -> None:
        """Evict ``key``: the map forgets it first, so no lookup can reach a slot being cleared.

        A held slot is retired instead: its holders keep reading it, so it keeps everything until
        the last hold is released (:meth:`unhold`).
        """
        slot = self._map.pop(key)
        if slot in self._holds:
            self._retired[slot] = key
            self.retirements += 1
            return
        self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        # The clearing may run outside a build, on the releasing thread's stream: the next writer
        # of the slot waits for it, as for any write.
        self.sync.before_write([slot])
        self._slab.clear(slot)
        self.sync.after_write([slot])
        self._free.append(slot)

    def hold(self, slots: Iterable[int]) -> None:
        """Count one more request reading each of ``slots`` (resident slots, each given once)."""
        for slot in slots:
            self._holds[slot] = self._holds.get(slot, 0) + 1

    def unhold(self, slots: Iterable[int]) -> None:
        """One request stopped reading ``slots``; a retired slot is freed at its last release."""
        for slot in slots:
            count = self._holds[slot] - 1
            if count:
                self._holds[slot] = count
                continue
            del self._holds[slot]
            if slot in self._retired:
                del self._retired[slot]
                self._free_slot(slot)

    def release(self, slots: dict[PlanKey, int]) -> None:
        """Return the slots of a failed build to the free list, hiding anything written into them."""
        for key, slot in slots.items():
            if self._map.get(key) == slot:
                del self._map[key]
            self._slab.clear(slot)
            if slot not in self._free:
                self._free.append(slot)

    def commit(self, slots: dict[PlanKey, int]) -> None:
        """The host-side map flip, the last step of a publish: ``slots`` become resident, newest last.

        The event readers wait on is recorded first, after every device write of the build.
        """
        self.sync.after_write(list(slots.values()), publish=True)
        self._map.update(slots)

    def clear(self) -> None:
        """Unpublish every plan (``invalidate()``, or tables built under an old identity); held ones retire."""
        for key in list(self._map):
            self.unpublish(key)

    # -- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (call it outside a build)."""
        resident = set(self._map.values())
        free = set(self._free)
        retired = set(self._retired)
        assert len(resident) == len(self._map), "two plans share a slot"
        assert len(free) == len(self._free), "a slot is free twice"
        assert not resident & free, "a slot is both free and resident"
        assert not retired & (resident | free), "a retired slot is also free or resident"
        assert resident | free | retired == set(range(self.num_slots)), "a slot leaked"
        assert set(self._holds) <= resident | retired, "a held slot is neither resident nor retired"
        assert retired <= set(self._holds), "a retired slot is not held"
        assert all(count > 0 for count in self._holds.values()), "a hold count is not positive"
        poison = self._slab.poison_slot
        assert poison not in resident | free | retired | set(self._holds), "the poison slot was handed out"
        assert self._slab.poison_intact(), "the poison slot's rows are not all NaN"
        lengths, timesteps = self._slab.published()
        spec = self._slab.spec
        for slot in free:
            assert int(lengths[slot]) == 0, f"free slot {slot} has length {int(lengths[slot])}"
        for key, slot in [*self._map.items(), *((k, s) for s, k in self._retired.items())]:
            n, rows = int(lengths[slot]), spec.plan_rows(key)
            assert n == rows, f"slot {slot}: length {n} but its plan {format_plan(key)} has {rows}"
            plan = timesteps[slot, :n].contiguous()
            assert plan_key(plan, spec.plan_columns) == key, f"slot {slot}: timesteps disagree with map"


__all__ = ["Reservation", "SlotPool"]
