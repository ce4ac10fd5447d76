"""The slab: three preallocated tensors holding every resident plan's tables, and all row traffic.

``max_plans`` slots of ``max_plan_width`` plan rows each:

* ``plan_timesteps [P, W] f32`` (``[P, W, C]`` for plans of ``C > 1`` columns): a slot's plan,
  zero past its length;
* ``plan_lengths [P] i64``: a slot's number of plan rows, 0 for a slot that holds nothing;
* ``table [P, W, table_width]``: every served layer's projection output, per plan row, side by
  side (layer ``l`` owns columns ``[spec.offset(l), spec.offset(l) + spec.out_features(l))``).

The table parts a family declares (``spec.table_parts()``) and each layer's columns are views of
``table`` made once per allocation (:meth:`Slab.part_params`, :meth:`Slab.layer_params`): strided,
not contiguous, so whoever needs contiguous bytes (a file, a collective) copies or goes row by row.

The table has one slot more than the pool hands out: the *poison slot* (index ``max_plans``),
filled with NaN and never written, which a served forward whose plan matched no prepared plan
gathers (found on the device, without a host read): NaN out, never another plan's rows. The
public views (``table``, :meth:`Slab.part_params`, :meth:`Slab.layer_params`) stay ``[P, ...]``;
:meth:`Slab.served_layer` and :meth:`Slab.served_part` include it.

Allocated once on the cache's device; their pointers never move (hooks and CUDA graphs may hold
them) unless the cache itself moves to another device (:meth:`Slab.relocate`), and they are not
registered in any module, so no ``state_dict`` holds them.

Every read and write of rows goes through :class:`Slab`. It does not decide *which* slot a plan
gets or when a slot is visible to lookups: that is :class:`adalncache.slots.SlotPool`'s job. The
slab only knows how to write a slot (a layer's projection, restored rows, the plan and then the
lengths), clear one, and read one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from .errors import ConfigError, PlanError
from .options import knob
from .rows import PlanRows
from .source import Columns
from .spec import Layer, ModulationSpec


class Slab:
    """The slab tensors of one cache and every row read and write on them."""

    def __init__(self, spec: ModulationSpec, max_plans: int, max_plan_width: int, device: torch.device) -> None:
        self.spec = spec
        self.max_plans = max_plans
        self.max_plan_width = max_plan_width
        self._allocate(device)

    def _allocate(self, device: torch.device) -> None:
        P, W, spec = self.max_plans, self.max_plan_width, self.spec
        C = spec.plan_columns
        self.plan_timesteps = torch.zeros((P, W) if C == 1 else (P, W, C), dtype=torch.float32, device=device)
        self.plan_lengths = torch.zeros(P, dtype=torch.int64, device=device)
        # One slot more than the pool hands out: the poison slot (index P), NaN rows that a served
        # forward whose plan matched no prepared plan gathers instead of any real slot's rows.
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

    def relocate(self, device: torch.device, *, keep_rows: bool) -> None:
        """Put the tensors on ``device``: new tensors, so the pointers change (the only time).

        ``keep_rows`` copies every slot as it is (rows valid on the new device too); otherwise the
        new slab is empty, and the caller must have unpublished every slot first. The old tensors
        are freed once the copy is done, so a move never holds two slabs on one device.
        """
        old = self.tensors()
        self._allocate(device)
        if keep_rows:
            for new, tensor in zip(self.tensors(), old):
                new.copy_(tensor)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that own the slab's memory: ``plan_timesteps``, ``plan_lengths``, ``table``."""
        return (self.plan_timesteps, self.plan_lengths, self.table)

    @property
    def nbytes(self) -> int:
        """Bytes the slab holds on its device, the poison slot's rows included."""
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
        """``layer``'s columns of every slot and of the poison slot, ``[P + 1, W, out_features]``.

        What served modules gather from with a device slot tensor: a forward that matched no
        prepared plan gathers the poison slot's NaN rows, so its output is NaN, never plausible.
        """
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
            raise ConfigError(
                f"this cache's table has no {name!r} part (its parts: {', '.join(self._parts)}; a "
                f"{self.spec.family.title} table): read cache.table, or cache.layer_params(layer) / "
                f"cache.layer_rows(layer, slot, n)"
            ) from None

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
        """``slots`` as a 1-D LongTensor on the device, without a host -> device copy. Read-only.

        A single slot or a run of consecutive slots is a view of the preallocated index; any other
        list is gathered from it on the device once and kept (keyed by the slot numbers, which
        never change meaning), so a request that resolves its slots at every step pays for it once.
        Callers hold the cache's lock (the kept tensors are shared).
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

    def projection_view(self, slot: int, layer: Layer, n: int, columns: Columns | None = None) -> torch.Tensor:
        """Where ``n`` rows of ``layer``'s projection go: a view of the slot (of its column slice)."""
        table = self.layer_params(layer)[slot, :n]
        if columns is None:
            return table
        lo, hi = columns.bounds(self.spec.out_features(layer))
        return table[..., lo:hi]

    def write_projection(
        self, slot: int, layer: Layer, y: torch.Tensor, columns: Columns | None = None, rows: int | None = None
    ) -> None:
        """Copy ``y`` (``(M, out_features)``, or the column slice) into ``slot``'s rows of ``layer``.

        ``rows``: the plan's row count when ``layer`` took fewer rows (``M < rows``); rows ``M``
        to ``rows`` of the layer are zeroed, so a slot's table never depends on what it held before.
        """
        width = self.spec.out_features(layer)
        lo, hi = columns.bounds(width) if columns is not None else (0, width)
        if y.dim() != 2 or y.shape[1] != hi - lo or y.shape[0] > self.max_plan_width:
            raise PlanError(f"the projection of layer {layer} returned shape {tuple(y.shape)}, expected (M, {hi - lo})")
        m = y.shape[0]
        if rows is not None and rows > m:
            view = self.projection_view(slot, layer, rows, columns)
            view[:m].copy_(y)
            view[m:].zero_()
            return
        self.projection_view(slot, layer, m, columns).copy_(y)

    def write_rows(self, slot: int, rows: PlanRows) -> None:
        """Restore a plan's rows from a tier into ``slot`` (its plan is written at publish)."""
        n = rows.timesteps.shape[0]
        for part, tensor in zip(self._parts.values(), rows.parts, strict=True):
            part[slot, :n].copy_(tensor, non_blocking=True)

    def row_view(self, slot: int, n: int) -> torch.Tensor:
        """``table[slot, :n]``: the rows a distributed exchange fills in place."""
        return self.table[slot, :n]

    def publish(self, slots: Sequence[int], plans: Sequence[torch.Tensor]) -> None:
        """Make ``slots`` hold ``plans`` on the device: the plans first, then the lengths.

        The rows must already be written. Lengths flip after the plans, all in one copy, so a
        device-side reader that trusts ``plan_lengths`` never sees a half-filled slot.
        """
        for slot, plan in zip(slots, plans, strict=True):
            row = self.plan_timesteps[slot]
            row.zero_()
            row[: plan.shape[0]].copy_(plan.to(self.device))
        index = torch.tensor(list(slots), dtype=torch.int64)
        lengths = torch.tensor([plan.shape[0] for plan in plans], dtype=torch.int64)
        self.plan_lengths.index_copy_(0, index.to(self.device), lengths.to(self.device))

    def clear(self, slot: int) -> None:
        """Hide whatever ``slot`` holds: length 0 and a zero plan (its rows are overwritten on reuse)."""
        self.plan_lengths[slot] = 0
        self.plan_timesteps[slot].zero_()

    # -- reads ------------------------------------------------------------------------------

    def read_rows(self, slot: int, n: int) -> PlanRows:
        """A contiguous copy of ``slot``'s first ``n`` rows, part by part (tiers and ``verify`` keep these)."""
        contiguous = torch.contiguous_format
        return PlanRows(
            self.plan_timesteps[slot, :n].clone(memory_format=contiguous),
            *(part[slot, :n].clone(memory_format=contiguous) for part in self._parts.values()),
        )

    def published(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of ``(plan_lengths, plan_timesteps)`` (for invariant checks)."""
        return self.plan_lengths.cpu(), self.plan_timesteps.cpu()

    def _check_count(self, num_timesteps: int) -> None:
        if isinstance(num_timesteps, bool) or not isinstance(num_timesteps, int):
            raise PlanError(
                f"num_timesteps must be an integer in 1..{self.max_plan_width}, got {num_timesteps!r}: pass "
                f"len(plan) of a resident plan"
            )
        # Slicing would silently cut an over-long request to the slab width; say so instead.
        if not 1 <= num_timesteps <= self.max_plan_width:
            raise PlanError(
                f"num_timesteps must be in 1..{self.max_plan_width} (the slab's plan width, "
                f"{knob('max_plan_width')}), got {num_timesteps}: pass len(plan) of a resident plan"
            )

    @staticmethod
    def _slot_rows(table: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        if isinstance(slot, torch.Tensor):
            # index_select keeps a device slot on the device: no host read, no sync (and no copy at
            # all for a slot already on the table's device, the served forwards' case).
            index = slot.reshape(1)
            return table.index_select(0, index if index.device == table.device else index.to(table.device))[0]
        return table[slot]

    def layer_rows(self, layer: Layer, slot: int | torch.Tensor, n: int) -> torch.Tensor:
        """The ``(n, out_features)`` output of ``layer``'s projection for the slot's first ``n`` rows."""
        table = self.served_layer(layer)
        self._check_count(n)
        return self._slot_rows(table, slot)[:n]

    # The two-part table's readers: its stacked blocks (``block``) and its output layer (``final``).

    def block_rows(self, layer: int, slot: int | torch.Tensor, num_timesteps: int) -> torch.Tensor:
        """``Y`` of block ``layer``: the ``(num_timesteps, block_width)`` output of its projection."""
        blocks = self.served_part("block")
        self._check_count(num_timesteps)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < blocks.shape[2]:
            raise PlanError(
                f"layer must be in 0..{blocks.shape[2] - 1} (a block index), got {layer!r}: the output layer's "
                f"rows are final_rows() and final()"
            )
        return self._slot_rows(blocks.select(2, layer), slot)[:num_timesteps]

    def block_all_rows(self, slot: int | torch.Tensor, num_timesteps: int) -> torch.Tensor:
        """Every block's rows of ``slot`` from one gather: ``(num_timesteps, L, block_width)``."""
        blocks = self.served_part("block")
        self._check_count(num_timesteps)
        return self._slot_rows(blocks, slot)[:num_timesteps]

    def final_rows(self, slot: int | torch.Tensor, num_timesteps: int) -> torch.Tensor:
        """``Z``: the ``(num_timesteps, final_width)`` output of the output-layer projection."""
        final = self.served_part("final")
        self._check_count(num_timesteps)
        return self._slot_rows(final, slot)[:num_timesteps]


__all__ = ["Slab"]
