"""Rank agreement and work sharing for distributed builds (``process_group=``; docs/distributed.md).

The cache talks to its peers only through a :class:`Collective`: trivial in a single process (the base
class itself), over a ``torch.distributed`` group in :class:`ProcessGroupCollective`, where every
decision that must be identical everywhere is reduced across ranks before anyone acts on it, and a
failure on one rank before publish makes every rank raise :class:`~adalncache.errors.BuildError`
naming it, within two small collectives. Rows move only through the :class:`~adalncache.slab.Slab`
this module is handed: it never sees the cache, whose slot decisions stay the cache's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .devices import indexed
from .errors import AdalnCacheError, BuildError, ConfigError, PlanError, failure_phase
from .options import flag, knob
from .source import Columns
from .spec import Layer, ModulationSpec

if TYPE_CHECKING:
    from .slab import Slab

log = logging.getLogger(__name__)

#: Bytes of the phase label and of the error text each rank sends in an agreement.
_AT_BYTES = 192
_TEXT_BYTES = 832
_HEADER = 5  # failed flag, then two 16-bit lengths


@dataclass(frozen=True)
class LocalWork:
    """What this rank reads in a pass: which layers, and which slice of their output features."""

    layers: list[Layer]
    columns: Columns | None = None


class PeerBuildFailure(AdalnCacheError, RuntimeError):
    """The ``__cause__`` of a BuildError on a rank that did not fail itself: the rank, phase and text of
    another rank's error (the exception itself lives in another process)."""

    def __init__(self, message: str, *, rank: int, failed_at: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.failed_at = failed_at


class Collective:
    """The agreement protocol the cache relies on, as a single process runs it: alone, every decision is
    already agreed, so every method is trivial."""

    rank: int = 0
    world: int = 1

    def min_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over ranks, in one collective."""
        return list(values)

    def any_of(self, flags: Sequence[bool]) -> list[bool]:
        """Element-wise OR over ranks, in one collective."""
        return [bool(f) for f in flags]

    def agree_identity(
        self, flags: Sequence[bool], request: Sequence[Any], state: Sequence[Any] = ()
    ) -> tuple[list[bool], bool]:
        """:meth:`any_of` ``flags``, and whether the ranks' ``state`` (slot maps in LRU order) differs (the
        caller then drops every table on every rank). PlanError on every rank when the ``request`` (plan
        keys) differs: SPMD builds need the same plans in the same order, or the slot maps diverge.
        """
        return self.any_of(flags), False

    def agree_on(self, mask: Sequence[bool]) -> list[bool]:
        """Element-wise AND over ranks: which plans every rank can serve from a tier."""
        return list(mask)

    def raise_if_any_failed(self, failure: BaseException | None, phase: str) -> None:
        """Raise BuildError on every rank if any rank failed (no-op alone: the caller re-raises)."""

    def agree_construction(self, failure: BaseException | None) -> None:
        """Make every rank's construction fail if one rank's did (no-op alone: the caller re-raises)."""

    def local_work(self, layers: Sequence[Layer], slab: Slab) -> LocalWork:
        """What this rank reads and projects in a pass (everything, alone) into ``slab``."""
        return LocalWork(list(layers))

    def share_results(self, slab: Slab, slots: list[int], lengths: list[int]) -> None:
        """Give every rank the rows the others projected into ``slab`` (nothing to share alone)."""

    def hash_work(self, layers: Sequence[Layer]) -> LocalWork:
        """What this rank reads in a hashing-only read: the share a pass would read (everything, alone)."""
        return LocalWork(list(layers))

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, in one collective."""
        return [value]

    def describe_shard(self) -> str:
        """What the tables' bits reproduce (part of the store binding): a single process here."""
        return "single"

    def release(self) -> None:
        """Drop every reference to the process group (the cache was closed; nothing collective runs again)."""


def _digest(values: Any) -> int:
    """A 60-bit digest of ``repr(values)``, stable across processes (``hash()`` is salted per process)."""
    return int(hashlib.sha256(repr(values).encode()).hexdigest()[:15], 16)


def _named_widths(spec: ModulationSpec) -> list[tuple[str, int]]:
    """Each distinct output width with a name for messages: its table part's where the part has one width,
    else the first layer's that has it."""
    named: dict[int, str] = {}
    for part in spec.table_parts():
        widths = {spec.out_features(layer) for layer in spec.layers() if part.start <= spec.offset(layer) < part.stop}
        if len(widths) == 1:
            named.setdefault(widths.pop(), part.name)
    for layer in spec.layers():
        named.setdefault(spec.out_features(layer), f"layer {layer}")
    return [(name, width) for width, name in named.items()]


def _column_index(spec: ModulationSpec, columns: Columns) -> torch.Tensor:
    """The table-row columns a rank of a column split holds: its slice of every layer, in layer order."""
    parts = []
    for layer in spec.layers():
        lo, hi = columns.bounds(spec.out_features(layer))
        parts.append(torch.arange(spec.offset(layer) + lo, spec.offset(layer) + hi, dtype=torch.int64))
    return torch.cat(parts)


def _split(units: Sequence[Layer], world: int) -> list[list[Layer]]:
    """Contiguous shares of ``units`` per rank; the first ``len % world`` ranks get one more, so the smallest
    projection (the output layer, last) falls to one with fewer: the shares stay close in bytes read."""
    base, extra = divmod(len(units), world)
    shares, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        shares.append(list(units[start : start + size]))
        start += size
    return shares


class ProcessGroupCollective(Collective):
    """Agreement and sharing over a ``torch.distributed`` process group (the shard modes, and why each gives
    its bits: docs/distributed.md). Tensors travel as raw bytes (``view(torch.uint8)``), so every dtype
    crosses every backend unchanged."""

    def __init__(
        self,
        process_group: Any,
        shard: str,
        spec: ModulationSpec,
        *,
        device: torch.device | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        import torch.distributed as dist

        self._d = dist
        self.group = process_group
        self.shard = shard
        self.spec = spec
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        backend = str(dist.get_backend(process_group)).lower()
        self.backend = backend
        # NCCL only moves CUDA tensors: agreement tensors live on this rank's (current) device.
        on_cuda = device if device is not None and device.type == "cuda" else torch.device("cuda")
        self.comm_device = indexed(on_cuda) if "nccl" in backend else torch.device("cpu")
        self._global = [dist.get_global_rank(process_group, r) for r in range(self.world)]
        self._shares = _split(spec.layers(), self.world)
        self._gather: dict[str, torch.Tensor] | None = None
        if shard == "columns":
            bad = [f"{name} width {width}" for name, width in _named_widths(spec) if width % self.world]
            if bad:
                widths = " and ".join(str(w) for w in sorted({spec.out_features(layer) for layer in spec.layers()}))
                raise ConfigError(
                    f"shard='columns' splits every projection's output features evenly over the {self.world} "
                    f"ranks, but the {' and '.join(bad)} is not divisible by {self.world}: use shard='layers' "
                    f"(CLI {flag('shard')} layers) or a world size dividing {widths}"
                )
            # Column j of the gathered row (rank-major: each rank's slice of every layer, in layer
            # order) is column _gathered[j] of the table row.
            self._own = _column_index(spec, Columns(self.rank, self.world))
            self._gathered = torch.cat([_column_index(spec, Columns(r, self.world)) for r in range(self.world)])
        # Everything that fixes the size or number of later collectives must match on every rank.
        identity = {"spec": spec.describe(), "shard": shard, "world": self.world, **(config or {})}
        if not self._same_everywhere(_digest(sorted(identity.items()))):
            raise ConfigError(
                f"the ranks of the process group created AdalnCache with different settings (this rank: "
                f"{identity}); every rank must pass the same spec, {knob('shard')}, {knob('precision')} and store= "
                f"(all or none)"
            )
        log.debug("distributed cache: rank %d of %d, %s, backend %s", self.rank, self.world, shard, backend)

    # -- small collectives ------------------------------------------------------------------

    def _reduce(self, values: Sequence[int], op: Any) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64, device=self.comm_device)
        self._d.all_reduce(t, op=op, group=self.group)
        return [int(v) for v in t.tolist()]

    def _same_everywhere(self, value: int) -> bool:
        top, neg_bottom = self._reduce([value, -value], self._d.ReduceOp.MAX)
        return top == -neg_bottom

    def min_ints(self, values: Sequence[int]) -> list[int]:
        return self._reduce(values, self._d.ReduceOp.MIN) if values else []

    def any_of(self, flags: Sequence[bool]) -> list[bool]:
        if not flags:
            return []
        return [v > 0 for v in self._reduce([int(bool(f)) for f in flags], self._d.ReduceOp.MAX)]

    def agree_identity(
        self, flags: Sequence[bool], request: Sequence[Any], state: Sequence[Any] = ()
    ) -> tuple[list[bool], bool]:
        d, e = _digest(list(request)), _digest(list(state))
        out = self._reduce([*(int(bool(f)) for f in flags), d, -d, e, -e], self._d.ReduceOp.MAX)
        if out[-4] != -out[-3]:
            raise PlanError(
                f"rank {self.rank} of {self.world}: the ranks called build() with different plans; a "
                f"distributed cache is SPMD, so every rank must request the same plans in the same order"
            )
        return [v > 0 for v in out[:-4]], out[-2] != -out[-1]

    def agree_on(self, mask: Sequence[bool]) -> list[bool]:
        if not mask:
            return []
        return [v > 0 for v in self._reduce([int(bool(m)) for m in mask], self._d.ReduceOp.MIN)]

    def agree_construction(self, failure: BaseException | None) -> None:
        """One all-gather of construction failures: the failing rank re-raises its own, the others a ConfigError."""
        failed = self._gather_failures(failure, "construction")
        if not failed or failure is not None:
            return  # nothing failed, or this rank did and its caller re-raises the original
        r, at, text = failed[0]
        cause = PeerBuildFailure(f"rank {r} failed at {at}: {text}", rank=r, failed_at=at)
        raise ConfigError(
            f"rank {r} of {self.world} could not create its AdalnCache ({text}); every rank of the process "
            f"group refuses, so none is left waiting for it"
        ) from cause

    def raise_if_any_failed(self, failure: BaseException | None, phase: str) -> None:
        """One all-gather of every rank's failure (flag, phase, text); raise BuildError everywhere if any."""
        failed = self._gather_failures(failure, phase)
        if not failed:
            return
        first, first_at, first_text = failed[0]
        others = "".join(f"; rank {r} also failed at {a}: {t}" for r, a, t in failed[1:])
        message = (
            f"distributed build failed on rank {first} of {self.world} at {first_at}: {first_text}{others}; "
            f"nothing of this request was published on any rank and a retry rebuilds it"
        )
        log.warning("rank %d: %s", self.rank, message)
        if failure is not None:
            raise BuildError(message, rank=first, failed_at=first_at) from failure
        cause = PeerBuildFailure(f"rank {first} failed at {first_at}: {first_text}", rank=first, failed_at=first_at)
        raise BuildError(message, rank=first, failed_at=first_at) from cause

    def _gather_failures(self, failure: BaseException | None, phase: str) -> list[tuple[int, str, str]]:
        """(rank, phase, text) of every rank that failed, from one all-gather of fixed-size records."""
        at = (failure_phase(failure) or phase) if failure is not None else ""
        text = f"{type(failure).__name__}: {failure}" if failure is not None else ""
        at_b, text_b = (s.encode("utf-8", errors="replace")[:n] for s, n in ((at, _AT_BYTES), (text, _TEXT_BYTES)))
        payload = bytes([1 if failure is not None else 0])
        payload += len(at_b).to_bytes(2, "little") + len(text_b).to_bytes(2, "little") + at_b + text_b
        size = _HEADER + _AT_BYTES + _TEXT_BYTES
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(self.comm_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            self._d.all_gather(everyone, mine, group=self.group)
        except Exception as exc:
            # A peer that died (or hung past the group's timeout) cannot report: say so, rather
            # than blaming this rank. The group is unusable after this; nothing was published.
            raise BuildError(
                f"rank {self.rank} of {self.world}: the agreement after the {phase} with the other ranks failed "
                f"(a rank died, hung past the process group's timeout, or the group was torn down): "
                f"{type(exc).__name__}: {exc}; nothing of this request was published on this rank",
                failed_at=f"agreement after {phase}",
            ) from (failure if failure is not None else exc)
        failed: list[tuple[int, str, str]] = []
        for r, t in enumerate(everyone):
            raw = bytes(t.cpu().tolist())
            if raw[0]:
                n_at, n_text = int.from_bytes(raw[1:3], "little"), int.from_bytes(raw[3:5], "little")
                at_b, text_b = raw[_HEADER : _HEADER + n_at], raw[_HEADER + n_at : _HEADER + n_at + n_text]
                failed.append((r, at_b.decode("utf-8", errors="replace"), text_b.decode("utf-8", errors="replace")))
        return failed

    # -- the work of a pass -----------------------------------------------------------------

    def local_work(self, layers: Sequence[Layer], slab: Slab) -> LocalWork:
        """This rank's layers (``layers`` shard) or its column slice of every layer (``columns``; the exchange
        buffers are allocated here, inside the pass whose failures are agreed, so the exchange after the
        agreement cannot fail on one rank alone)."""
        self._gather = self._column_buffers(slab) if self.shard == "columns" else None
        return self.hash_work(layers)

    def hash_work(self, layers: Sequence[Layer]) -> LocalWork:
        if self.shard == "columns":
            return LocalWork(list(layers), Columns(self.rank, self.world))
        mine = set(self._shares[self.rank])
        return LocalWork([layer for layer in layers if layer in mine])

    def gather_objects(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._d.all_gather_object(out, value, group=self.group)
        return out

    def _column_buffers(self, slab: Slab) -> dict[str, torch.Tensor]:
        spec, W, dev = slab.spec, slab.max_plan_width, self.comm_device
        share = spec.table_width // self.world
        return {
            "send": torch.empty(W, share, dtype=spec.dtype, device=dev),
            "recv": torch.empty(self.world, W, share, dtype=spec.dtype, device=dev),
            "own": self._own.to(slab.device),
            "gathered": self._gathered.to(slab.device),
        }

    def share_results(self, slab: Slab, slots: list[int], lengths: list[int]) -> None:
        if self.shard == "columns":
            self._share_columns(slab, slots, lengths)
        else:
            self._share_layers(slab, slots, lengths)

    def _broadcast(self, t: torch.Tensor, owner: int, works: list[Any]) -> None:
        """Broadcast ``t`` (contiguous) in place from ``owner``; async when it already lives on the comm device."""
        if t.numel() == 0:
            return
        if t.device == self.comm_device:
            works.append(
                self._d.broadcast(t.view(torch.uint8), src=self._global[owner], group=self.group, async_op=True)
            )
            return
        staged = t.to(self.comm_device)
        self._d.broadcast(staged.view(torch.uint8), src=self._global[owner], group=self.group)
        t.copy_(staged)

    def _share_layers(self, slab: Slab, slots: list[int], lengths: list[int]) -> None:
        works: list[Any] = []
        spec = slab.spec
        for owner, share in enumerate(self._shares):
            if not share:
                continue
            # The owner's layers are a run of the pass order, so their columns are one contiguous
            # range of a table row: each row travels in place with no packing.
            lo, hi = spec.offset(share[0]), spec.offset(share[-1]) + spec.out_features(share[-1])
            for slot, n in zip(slots, lengths):
                rows = slab.row_view(slot, n)
                for t in range(n):
                    self._broadcast(rows[t, lo:hi], owner, works)
        for work in works:
            work.wait()

    def _share_columns(self, slab: Slab, slots: list[int], lengths: list[int]) -> None:
        buffers = self._gather if self._gather is not None else self._column_buffers(slab)
        world = self.world
        for slot, n in zip(slots, lengths):
            rows = slab.row_view(slot, n)
            send = buffers["send"][:n]
            recv = buffers["recv"][:, :n]
            send.copy_(rows.index_select(1, buffers["own"]))
            parts = [recv[r] for r in range(world)]  # each recv[r] is contiguous
            self._d.all_gather(
                [p.view(torch.uint8) for p in parts], send.contiguous().view(torch.uint8), group=self.group
            )
            # recv is [world, n, share]: rank r's slice of every layer; the table row wants each
            # layer's slices side by side, which the gathered-column index says where.
            rows.index_copy_(1, buffers["gathered"], recv.permute(1, 0, 2).reshape(n, -1).to(rows.device))

    def release(self) -> None:
        # The group object (and through it gloo's worker threads) must not outlive
        # destroy_process_group() because a closed cache still references it.
        self.group = None
        self._gather = None

    def describe_shard(self) -> str:
        # Layer sharding reproduces the single-process bits; column sharding reproduces a
        # column-parallel runtime of this world size, which is a different table.
        return "single" if self.shard == "layers" else f"columns/{self.world}"


def make_collective(
    process_group: Any,
    shard: str,
    spec: ModulationSpec,
    *,
    device: torch.device | None = None,
    config: dict[str, Any] | None = None,
) -> Collective:
    """The collective for ``process_group`` (``None``: a single process); ``config``: further settings every
    rank must share (compared across ranks at construction)."""
    if process_group is None:
        return Collective()
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch builds without distributed
        raise ConfigError("process_group= needs torch.distributed, which this torch build lacks") from exc
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "process_group= was given but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) (torchrun does the rendezvous) first, or pass "
            "process_group=None"
        )
    try:
        dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"process_group= is not a usable torch.distributed process group: {exc}") from exc
    if rank < 0:
        raise ConfigError("process_group= does not contain this rank: create the cache only on its members")
    if device is not None and device.type == "cuda" and "nccl" not in str(dist.get_backend(process_group)):
        log.info("cache on CUDA with a %s process group: rows are staged through host memory", dist.get_backend())
    return ProcessGroupCollective(process_group, shard, spec, device=device, config=config)
