"""The slab tensors and every row read and write on them (:class:`Slab`), the slot pool that alone changes
the slot map, the LRU order and the holds (:class:`SlotPool`, not thread-safe by itself: the cache calls it
under its state lock), and :class:`PlanRows`, in which tiers copy a plan's table out and back in without
knowing the slab's layout. The tensors: docs/api.md ("Slab attributes"); the slot states, invariants
and why each transition runs in its order: docs/state-machine.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .devices import StreamSync
from .errors import ConfigError, PlanError, PlanNotCachedError
from .options import knob
from .plans import PlanKey, format_plan, plan_key, shared_rows
from .source import Columns
from .spec import Layer, ModulationSpec


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: unlike ``torch.equal`` it tells -0.0 from +0.0 (and any NaN payload apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None or not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def gather_rows(view: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (:attr:`Slab.row_map` entries) of a ``[P + 1, W, ...]`` slab view, in one gather with no
    host work; every slab view is a slice of its last dimension, so the flattening is a view, never a copy."""
    return view.flatten(0, 1).index_select(0, index)


class PlanRows(tuple[torch.Tensor, ...]):
    """One plan's table: ``timesteps`` (the plan, f32), then one tensor ``(n, *part.shape)`` per table part."""

    __slots__ = ()

    def __new__(cls, timesteps: torch.Tensor, *parts: torch.Tensor) -> PlanRows:
        if not parts:
            raise ValueError("PlanRows needs the plan and at least one part of its rows")
        return super().__new__(cls, (timesteps, *parts))

    def __getnewargs__(self) -> tuple[torch.Tensor, ...]:
        # Pickled (torch.save, a process group's objects) as the positional arguments __new__ takes.
        return tuple(self)

    @property
    def timesteps(self) -> torch.Tensor:
        """The plan (the slab's ``plan_timesteps`` row): ``(n,)``, or ``(n, columns)``."""
        return self[0]

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The rows of each table part, in the spec's part order."""
        return tuple(self[1:])

    @property
    def block(self) -> torch.Tensor:
        """The first part of a two-part table (its stacked blocks' rows)."""
        return self[1]

    @property
    def final(self) -> torch.Tensor:
        """The second part of a two-part table (its output layer's rows)."""
        if len(self) < 3:
            raise AttributeError("these rows have one part: read .parts[0]")
        return self[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(t.shape)) for t in self)
        return f"PlanRows({shapes})"


class Slab:
    """The slab tensors of one cache and every row read and write on them."""

    def __init__(self, spec: ModulationSpec, max_plans: int, max_plan_width: int, device: torch.device) -> None:
        self.spec = spec
        self.max_plans = max_plans
        self.max_plan_width = max_plan_width
        #: ``(stored, row_of)`` of each slot whose plan shares slab rows (:meth:`lay_out`; the others: one each).
        self._layouts: dict[int, tuple[list[int], list[int]]] = {}
        self._allocate(device, max_plan_width)

    def _allocate(self, device: torch.device, capacity: int) -> None:
        P, W, spec = self.max_plans, self.max_plan_width, self.spec
        C = spec.plan_columns
        self.plan_timesteps = torch.zeros((P, W) if C == 1 else (P, W, C), dtype=torch.float32, device=device)
        self.plan_lengths = torch.zeros(P, dtype=torch.int64, device=device)
        # One slot more than the pool hands out: the poison slot (index P), NaN rows (see poison_slot).
        self._storage = torch.zeros(P + 1, W, spec.table_width, dtype=spec.dtype, device=device)
        self._storage[P].fill_(float("nan"))
        self.table = self._storage[:P]
        # Served views ([P + 1, ...]: a device slot tensor may name the poison slot) and the public
        # ones ([P, ...]: the slots plans live in), both made once per allocation.
        self._served_parts = {
            part.name: self._storage[..., part.start : part.stop].view(P + 1, W, *part.shape)
            for part in spec.table_parts()
        }
        self._served_layers = {
            layer: self._storage[..., spec.offset(layer) : spec.offset(layer) + spec.out_features(layer)]
            for layer in spec.layers()
        }
        self._parts = {name: view[:P] for name, view in self._served_parts.items()}
        self._layers = {layer: view[:P] for layer, view in self._served_layers.items()}
        # 0-d slot indices already on the device, so lookups never copy host -> device.
        self._slot_index = torch.arange(P, dtype=torch.int64, device=device)
        # Slot tensors of slot lists that are not a contiguous run, by slot tuple (see indices()).
        self._index_cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.device = device
        #: ``[P + 1, R]``: the flat slab row (``slot * W + row``) each plan row of a slot reads; R grows
        #: to the rows of the widest plan published. Rows past a plan's own read the poison slot.
        self.row_map = self._identity_rows(torch.arange(P + 1, device=device), capacity)

    def _identity_rows(self, slots: torch.Tensor, capacity: int) -> torch.Tensor:
        """The row map of slots holding one slab row per plan row: ``slot * W + i``, then the poison row."""
        W = self.max_plan_width
        rows = torch.arange(capacity, dtype=torch.int64, device=slots.device)
        return torch.where(rows < W, slots.reshape(-1, 1) * W + rows, self.max_plans * W)

    @property
    def row_capacity(self) -> int:
        """The most plan rows a read may ask for: the width, or the rows of the widest plan published."""
        return int(self.row_map.shape[1])

    def relocate(self, device: torch.device, *, keep_rows: bool) -> None:
        """Put the tensors on ``device`` (new tensors: the only time the pointers change), copying every slot
        (``keep_rows``) or empty (every slot unpublished first). The old tensors are freed once the copy is done,
        so a move never holds two slabs on one device."""
        old, old_map = self.tensors(), self.row_map
        self._allocate(device, self.row_capacity)
        if keep_rows:
            for new, tensor in zip((*self.tensors(), self.row_map), (*old, old_map)):
                new.copy_(tensor)
        else:
            self._layouts.clear()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that own the slab's memory: ``plan_timesteps``, ``plan_lengths``, ``table``."""
        return (self.plan_timesteps, self.plan_lengths, self.table)

    @property
    def nbytes(self) -> int:
        """Bytes the slab holds on its device, poison slot included (``spec.slab_bytes``; not the row map)."""
        others = sum(t.numel() * t.element_size() for t in (self.plan_timesteps, self.plan_lengths))
        return others + self._storage.numel() * self._storage.element_size()

    @property
    def poison_slot(self) -> int:
        """The index of the poison slot (``max_plans``): NaN rows, never handed out, never written."""
        return self.max_plans

    def poison_intact(self) -> bool:
        """Whether every value of the poison slot is still NaN (a host read: for invariant checks)."""
        return bool(torch.isnan(self._storage[self.max_plans]).all().item())

    def served_layer(self, layer: Layer) -> torch.Tensor:
        """``layer``'s columns of every slot and of the poison slot, ``[P + 1, W, out_features]``: what served
        modules gather from with a device slot tensor."""
        self.layer_params(layer)  # the one check of the layer id
        return self._served_layers[layer]

    def served_part(self, name: str) -> torch.Tensor:
        """Table part ``name`` of every slot and of the poison slot, ``[P + 1, W, *part.shape]``."""
        self.part_params(name)  # the one check of the part name
        return self._served_parts[name]

    def part_params(self, name: str) -> torch.Tensor:
        """Table part ``name`` of every slot, ``[P, W, *part.shape]`` (a view of ``table``)."""
        try:
            return self._parts[name]
        except KeyError:
            raise self.no_part(name) from None

    def no_part(self, name: str) -> ConfigError:
        """The error for a read of table part ``name``, which this table does not have."""
        return ConfigError(
            f"this cache's table has no {name!r} part (its parts: {', '.join(self._parts)}; a "
            f"{self.spec.family.title} table): read cache.table, or cache.layer_params(layer) / "
            f"cache.layer_rows(layer, slot, n)"
        )

    def layer_params(self, layer: Layer) -> torch.Tensor:
        """``layer``'s columns of every slot, ``[P, W, out_features]`` (a view of ``table``)."""
        if isinstance(layer, bool):  # True == 1 as a dict key: never a layer id
            raise PlanError(self._unknown_layer(layer))
        try:
            return self._layers[layer]
        except (KeyError, TypeError):
            raise PlanError(self._unknown_layer(layer)) from None

    def _unknown_layer(self, layer: object) -> str:
        layers = self.spec.layers()
        return (
            f"layer {layer!r} is not served by this cache (its {len(layers)} layers run from {layers[0]!r} to "
            f"{layers[-1]!r})"
        )

    def index(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as a 0-d LongTensor on the device (no host -> device copy)."""
        return self._slot_index[slot]

    #: Slot tensors kept for lists of slots that are not a contiguous run (a request per entry).
    INDEX_CACHE = 256

    def indices(self, slots: Sequence[int]) -> torch.Tensor:
        """``slots`` as a read-only 1-D LongTensor on the device, without a host -> device copy: a view of the
        preallocated index for a run of consecutive slots, else gathered on the device once and kept, so a
        request that resolves its slots at every step pays once. Callers hold the cache's lock (shared tensors).
        """
        n = len(slots)
        if n == 0:
            return self._slot_index[:0]
        first = slots[0]
        if all(slot == first + i for i, slot in enumerate(slots)):
            return self._slot_index[first : first + n]
        key = tuple(slots)
        found = self._index_cache.get(key)
        if found is not None:
            self._index_cache.move_to_end(key)
            return found
        found = torch.stack([self._slot_index[slot] for slot in slots])
        self._index_cache[key] = found
        if len(self._index_cache) > self.INDEX_CACHE:
            self._index_cache.popitem(last=False)
        return found

    # -- writes (before publish: nothing here is visible to lookups yet) -------------------

    def lay_out(self, slot: int, key: PlanKey) -> None:
        """Let the rows of equal keying inputs of ``key``, about to be written into ``slot``, share slab rows
        when it has more rows than the width (a plan that fits keeps one slab row per plan row)."""
        self._layouts.pop(slot, None)
        if self.spec.plan_rows(key) > self.max_plan_width:
            self._layouts[slot] = shared_rows(key, self.spec.plan_columns)

    def layout(self, slot: int, rows: int) -> tuple[list[int], list[int]]:
        """``(stored, row_of)`` of ``slot``'s plan of ``rows`` rows: the plan row each slab row holds, the slab
        row each plan row reads."""
        return self._layouts.get(slot) or (list(range(rows)), list(range(rows)))

    def _compact(self, slot: int, y: torch.Tensor, what: str) -> tuple[torch.Tensor, int | None]:
        """``y`` (a plan's first ``M`` rows) cut to its slab rows where ``slot``'s plan shares rows, once every row
        was found bitwise equal to the one stored for it (checked at every write: docs/exactness.md, rule 9);
        ``(y, None)`` for a plan that does not share."""
        if slot not in self._layouts:
            return y, None
        (stored, row_of), m = self._layouts[slot], y.shape[0]
        first = torch.tensor([stored[row_of[i]] for i in range(m)], dtype=torch.int64, device=y.device)
        if not same_bits(y[first], y):
            raise PlanError(
                f"a plan of {len(row_of)} rows holds {len(stored)} distinct values, but {what} gave rows of equal "
                f"inputs different bits, so every row needs its own slab row and the slab holds at most "
                f"{self.max_plan_width} per plan: raise {knob('max_plan_width')} to at least {len(row_of)}"
            )
        kept = [i for i in stored if i < m]  # first occurrences: those of the rows the layer took come first
        return y[torch.tensor(kept, dtype=torch.int64, device=y.device)], len(stored)

    def write_projection(
        self, slot: int, layer: Layer, y: torch.Tensor, columns: Columns | None = None, rows: int | None = None
    ) -> None:
        """Copy ``y`` (``(M, out_features)``, or the column slice) into ``slot``'s rows of ``layer``; rows ``M`` to
        ``rows`` are zeroed, so a slot's table never depends on what it held before."""
        width = self.spec.out_features(layer)
        lo, hi = columns.bounds(width) if columns is not None else (0, width)
        most = len(self._layouts[slot][1]) if slot in self._layouts else self.max_plan_width
        if y.dim() != 2 or y.shape[1] != hi - lo or y.shape[0] > most:
            raise PlanError(f"the projection of layer {layer} returned shape {tuple(y.shape)}, expected (M, {hi - lo})")
        y, stored = self._compact(slot, y, f"the projection of layer {layer} at M={y.shape[0]}")
        if stored is not None:
            rows = stored
        m = y.shape[0]
        view = self.layer_params(layer)[slot, : max(m, rows or 0), lo:hi]
        view[:m].copy_(y)
        view[m:].zero_()  # rows the layer did not take (none when it took them all)

    def write_rows(self, slot: int, rows: PlanRows) -> None:
        """Restore a plan's rows from a tier into ``slot`` (its plan is written at publish); a plan that
        shares slab rows (:meth:`lay_out`) keeps each distinct row once, checked first as a build's are."""
        n = rows.timesteps.shape[0]
        for part, tensor in zip(self._parts.values(), rows.parts, strict=True):
            kept, _ = self._compact(slot, tensor.reshape(n, -1), "the stored table")
            tensor = kept.reshape(-1, *tensor.shape[1:])
            part[slot, : tensor.shape[0]].copy_(tensor, non_blocking=True)

    def row_view(self, slot: int, n: int) -> torch.Tensor:
        """``table[slot, :n]``: the rows a distributed exchange fills in place."""
        return self.table[slot, :n]

    def publish(self, slots: Sequence[int], plans: Sequence[torch.Tensor]) -> None:
        """Make ``slots`` (rows already written) hold ``plans`` on the device: lengths flip after the plans, all
        in one copy, so a device-side reader that trusts ``plan_lengths`` never sees a half-filled slot."""
        counts = []
        for slot, plan in zip(slots, plans, strict=True):
            if slot in self._layouts:  # the slab holds the plan's distinct rows; the map gives each plan row its own
                stored, row_of = self._layouts[slot]
                plan = plan[torch.tensor(stored, dtype=torch.int64, device=plan.device)]
                if len(row_of) > self.row_capacity:  # a new tensor: a reader holding the old one reads it unchanged
                    every = torch.arange(self.max_plans + 1, device=self.device)
                    grown = self._identity_rows(every, max(len(row_of), 2 * self.row_capacity))
                    grown[:, : self.row_capacity] = self.row_map
                    self.row_map = grown
                W = self.max_plan_width
                entries = torch.full((self.row_capacity,), self.max_plans * W, dtype=torch.int64)
                entries[: len(row_of)] = torch.tensor(row_of, dtype=torch.int64) + slot * W
                self.row_map[slot].copy_(entries.to(self.device))
            row = self.plan_timesteps[slot]
            row.zero_()
            row[: plan.shape[0]].copy_(plan.to(self.device))
            counts.append(plan.shape[0])
        index = torch.tensor(list(slots), dtype=torch.int64)
        lengths = torch.tensor(counts, dtype=torch.int64)
        self.plan_lengths.index_copy_(0, index.to(self.device), lengths.to(self.device))

    def clear(self, slot: int) -> None:
        """Hide whatever ``slot`` holds: length 0 and a zero plan (its rows are overwritten on reuse)."""
        self.plan_lengths[slot] = 0
        self.plan_timesteps[slot].zero_()
        if self._layouts.pop(slot, None) is not None:
            self.row_map[slot].copy_(self._identity_rows(self._slot_index[slot], self.row_capacity)[0])

    # -- reads ------------------------------------------------------------------------------

    def read_rows(self, slot: int, n: int) -> PlanRows:
        """A contiguous copy of ``slot``'s first ``n`` rows, part by part (tiers and ``verify`` keep these); a
        plan that shares slab rows is read out with every plan row, as tiers and table files hold it."""
        index = torch.tensor(self.layout(slot, n)[1], dtype=torch.int64, device=self.device)
        return PlanRows(*(view[slot].index_select(0, index) for view in (self.plan_timesteps, *self._parts.values())))

    def _check_count(self, num_timesteps: int) -> None:
        if isinstance(num_timesteps, bool) or not isinstance(num_timesteps, int):
            raise PlanError(
                f"num_timesteps must be an integer in 1..{self.row_capacity}, got {num_timesteps!r}: pass "
                f"len(plan) of a resident plan"
            )
        # Slicing would silently cut an over-long request to the slab width; say so instead.
        if not 1 <= num_timesteps <= self.row_capacity:
            raise PlanError(
                f"num_timesteps must be in 1..{self.row_capacity} (the slab's plan width, {knob('max_plan_width')}, "
                f"or the rows of its widest plan), got {num_timesteps}: pass len(plan) of a resident plan"
            )

    @staticmethod
    def _slot_rows(table: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        if isinstance(slot, torch.Tensor):
            # index_select keeps a device slot on the device: no host read, no sync (and no copy at
            # all for a slot already on the table's device, the served forwards' case).
            index = slot.reshape(1)
            return table.index_select(0, index if index.device == table.device else index.to(table.device))[0]
        return table[slot]

    def row_index(self, slot: int | torch.Tensor, n: int) -> torch.Tensor:
        """The flat slab rows (:func:`gather_rows`) of ``slot``'s first ``n`` plan rows, found on the device."""
        self._check_count(n)
        return self._slot_rows(self.row_map, slot)[:n]

    def _rows(self, view: torch.Tensor, slot: int | torch.Tensor, n: int) -> torch.Tensor:
        """``view``'s rows for the slot's first ``n`` plan rows: a slice of a plan that fits the width,
        else one gather through the row map."""
        if isinstance(n, int) and not isinstance(n, bool) and n > self.max_plan_width:
            return gather_rows(view, self.row_index(slot, n))
        self._check_count(n)
        return self._slot_rows(view, slot)[:n]

    def layer_rows(self, layer: Layer, slot: int | torch.Tensor, n: int) -> torch.Tensor:
        """The ``(n, out_features)`` output of ``layer``'s projection for the slot's first ``n`` rows."""
        return self._rows(self.served_layer(layer), slot, n)

    def part_rows(
        self, name: str, slot: int | torch.Tensor, n: int, select: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Table part ``name``'s rows for the slot's first ``n`` plan rows; ``select`` narrows the part's view
        before the gather (one block of a stacked part), so a device slot gathers only what is read."""
        table = self.served_part(name)
        return self._rows(table if select is None else select(table), slot, n)


@dataclass
class Reservation:
    """The slots one build may write: ``slots`` per missing plan; ``evicted`` plans made room."""

    slots: dict[PlanKey, int] = field(default_factory=dict)
    evicted: list[PlanKey] = field(default_factory=list)


class SlotPool:
    """Slot map, LRU order, free list and holds of one slab (the rules: docs/state-machine.md)."""

    def __init__(self, slab: Slab, sync: StreamSync) -> None:
        self._slab = slab
        self.num_slots = slab.max_plans
        self.sync = sync
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

    def in_use(self, slot: int) -> bool:
        """Whether ``slot`` holds a plan someone may read: resident, or retired while held."""
        return slot in self._retired or slot in self._map.values()

    def held_plans(self) -> int:
        """How many resident plans are held by requests in flight."""
        return sum(1 for slot in self._map.values() if slot in self._holds)

    def room(self, wanted: Collection[PlanKey]) -> tuple[int, int]:
        """``(free slots, plans a build for wanted may evict)``."""
        return len(self._free), len(self._eviction_candidates(wanted))

    # -- transitions ------------------------------------------------------------------------

    def touch(self, keys: Iterable[PlanKey]) -> None:
        """Mark resident ``keys`` most recently used, in the order given (the last is the newest)."""
        for key in keys:
            self._map.move_to_end(key)

    def _eviction_candidates(self, wanted: Collection[PlanKey]) -> list[PlanKey]:
        """Resident plans a build for ``wanted`` may evict, least recently used first: the one place that
        decides it (never a plan of the request, never a held one)."""
        return [k for k in self._map if self._map[k] not in self._holds if k not in wanted]

    def reserve(self, missing: Sequence[PlanKey], wanted: Collection[PlanKey]) -> Reservation:
        """Slots for ``missing``: free ones first (lowest first), then LRU plans outside ``wanted``, evicted at
        once. PlanError, changing nothing, when even every candidate leaves too few slots."""
        candidates = self._eviction_candidates(wanted)
        if len(missing) > len(self._free) + len(candidates):
            raise PlanError(self.no_room_message(len(missing), wanted))
        reservation = Reservation()
        self._free.sort(reverse=True)  # pop() hands out the lowest free slot first: every rank picks the same
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
        """Evict ``key`` (the map forgets it first, so no lookup reaches a slot being cleared); a held slot
        retires instead and keeps everything until its last hold is released."""
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
        """The host-side map flip, the last step of a publish (after recording the event readers wait on)."""
        self.sync.after_write(list(slots.values()), publish=True)
        self._map.update(slots)

    def clear(self) -> None:
        """Unpublish every plan (``invalidate()``, or tables built under an old identity); held ones retire."""
        for key in list(self._map):
            self.unpublish(key)

    # -- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the invariants of docs/state-machine.md (outside a build; each assertion names its rule)."""
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
        lengths, timesteps = self._slab.plan_lengths.cpu(), self._slab.plan_timesteps.cpu()
        spec = self._slab.spec
        for slot in free:
            assert int(lengths[slot]) == 0, f"free slot {slot} has length {int(lengths[slot])}"
        row_map = self._slab.row_map.cpu()
        width = self._slab.max_plan_width
        for key, slot in [*self._map.items(), *((k, s) for s, k in self._retired.items())]:
            n, rows = int(lengths[slot]), spec.plan_rows(key)
            stored, row_of = self._slab.layout(slot, rows)
            assert n == len(stored), f"slot {slot}: length {n} but its plan {format_plan(key)} has {len(stored)} rows"
            plan = timesteps[slot, row_of].contiguous()
            assert plan_key(plan, spec.plan_columns) == key, f"slot {slot}: timesteps disagree with map"
            mapped = [slot * width + r for r in row_of]
            assert row_map[slot, :rows].tolist() == mapped, f"slot {slot}: its row map disagrees with its plan"
