"""AdalnCache: a device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

The cache validates its construction, decides *when* work runs, and delegates:
:class:`~adalncache.slab.Slab` holds the four tensors and does every row read and write,
:class:`~adalncache.slots.SlotPool` alone changes the slot map, the LRU order, the free list and
the holds, :class:`~adalncache.transaction.BuildTransaction` runs a build that has something to
build (validate, tiers, reserve, pass, publish, in that order), the tiers
(:mod:`adalncache.tiers`) keep copies, :class:`~adalncache.streams.StreamSync` orders device work
across streams, and the collective (:mod:`adalncache.distributed`) makes ranks agree.

Threads. Every public method may be called from several threads. Two locks:

* the **build lock** serialises builds (and ``invalidate``/``close``): at most one pass runs;
* the **state lock** guards the slot map, the holds, the statistics and the identity; it is held
  for microseconds, never during a pass, so lookups and the hit path of other requests do not
  wait while a pass streams the weights.

The hit path (every plan resident under the current variant and autocast state, one process):
key the request (once, or pass ``keys=``), check, touch, count, under the state lock alone; no
stat, no device work. A request that holds its plans (:meth:`AdalnCache.hold`,
:meth:`AdalnCache.acquire`) also gets its slot tensor, made without a host-to-device copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .devices import allocation_error, check_available, resolve_device
from .distributed import make_collective
from .errors import AdalnCacheError, ConfigError, PlanError
from .faults import NO_FAULTS, FaultPoints
from .holds import PlanHold
from .identity import TableIdentity
from .numerics import autocast_dtype, device_identity
from .plans import PlanKey, distinct_plans, keyed_plans, plan_key
from .rebuild import EmbedFn, ProjectFn, default_project
from .relocation import TableParking, same_device
from .reports import BuildReport, CacheStats
from .rows import PlanRows
from .serving import SlabReads
from .slab import Slab
from .slots import SlotPool
from .source import WeightSource
from .source.absent import NoWeights
from .spec import ModulationSpec
from .streams import StreamSync, events_for
from .tiers.chain import TierChain
from .tiers.host import HOST_TIER_KNOB
from .tiers.tables import TablesArg, TablesTier
from .transaction import BuildSettings, BuildTransaction

if TYPE_CHECKING:
    from .tiers.host import HostTier
    from .tiers.store import Store

log = logging.getLogger(__name__)

PRECISIONS = ("match", "fp32")
SHARD_MODES = ("layers", "columns")


def _check_int(name: str, value: Any, flag: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}: set {name}= (CLI {flag})")
    return value


def _check_arguments(
    spec: Any, source: Any, *, max_plans: Any, max_plan_width: Any, host_cache_bytes: Any, read_ahead: Any,
    batched: Any, precision: Any, shard: Any, tables: Any, store: Any, tiled: Any = False,
) -> None:  # fmt: skip
    """Every construction argument the cache can check alone; ConfigError names the one to change."""
    if not isinstance(spec, ModulationSpec):
        raise ConfigError(f"spec must be a ModulationSpec, got {type(spec).__name__}")
    _check_int("max_plans", max_plans, "--max-plans", 1)
    _check_int("max_plan_width", max_plan_width, "--plan-width", 1)
    _check_int("host_cache_bytes", host_cache_bytes, "--host-cache-gb", 0)
    _check_int("read_ahead", read_ahead, "--read-ahead", 0)
    if not isinstance(batched, bool):
        raise ConfigError(f"batched must be True or False, got {batched!r}: set or drop --batched")
    if not (tiled is True or tiled is False or tiled == "auto"):
        raise ConfigError(f"tiled must be 'auto', True or False, got {tiled!r}: set --tiled auto, on or off")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}: set --precision")
    if shard not in SHARD_MODES:
        raise ConfigError(f"shard must be one of {list(SHARD_MODES)}, got {shard!r}: set --shard")
    if store is not None and not isinstance(store, (str, os.PathLike)) and not hasattr(store, "get_many"):
        raise ConfigError(
            f"store= must be a directory path or a Store, got {type(store).__name__} {store!r}: set store= "
            f"(CLI --store DIR), or None for no store"
        )
    if source is None:
        if tables is None:
            raise ConfigError(
                "source=None needs tables= (table files to serve from): pass a CheckpointSource or tables="
            )
        return
    source_spec = getattr(source, "spec", None)
    if source_spec is None or not callable(getattr(source, "stream", None)):
        raise ConfigError(
            f"source must be a CheckpointSource or TensorSource (a WeightSource), got {type(source).__name__}"
        )
    if source_spec != spec:
        raise ConfigError(
            f"the source was opened for {source_spec} but the cache was given {spec}: open the source with "
            f"the same ModulationSpec"
        )


class AdalnCache(SlabReads):
    """A device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

    The slab tensors (``plan_timesteps``, ``plan_lengths``, ``table``, and the views of ``table``:
    ``block_params``/``final_params`` for a two-part table, :meth:`layer_params` per layer) are
    allocated once on ``device``; their pointers never move unless :meth:`move_to` moves the
    cache to another device, and they are not registered in any module, so no ``state_dict``
    holds them.
    """

    def __init__(
        self,
        spec: ModulationSpec,
        source: WeightSource | None,
        *,
        max_plans: int = 64,
        max_plan_width: int = 4,
        device: torch.device | str = "cpu",
        precision: str = "match",
        host_cache_bytes: int = 0,
        store: Store | str | Any = None,
        process_group: Any = None,
        shard: str = "layers",
        read_ahead: int = 1,
        progress: bool | None = None,
        batched: bool = False,
        tables: TablesArg | None = None,
        tiled: bool | str = "auto",
    ) -> None:
        _check_arguments(
            spec, source, max_plans=max_plans, max_plan_width=max_plan_width, host_cache_bytes=host_cache_bytes,
            read_ahead=read_ahead, batched=batched, precision=precision, shard=shard, tables=tables, store=store,
            tiled=tiled,
        )  # fmt: skip
        self.device = resolve_device(device, argument="device")
        if self.device.type == "cuda" and self.device.index is None:
            # Pin the index now: a build or a reader thread must not land on whatever device is
            # current in its own thread.
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Settings that fix the number or size of later collectives are compared across ranks.
        agreed = {
            "precision": precision, "store": store is not None, "device_type": self.device.type,
            "tables": tables is not None,
        }  # fmt: skip
        self._dist = make_collective(process_group, shard, spec, device=self.device, config=agreed)
        self.spec = spec
        #: The weight source; without one (``source=None``) a :class:`~adalncache.source.absent.NoWeights`
        #: that serves table files only.
        self.source: WeightSource = source if source is not None else NoWeights(spec)
        self.precision = precision
        self.shard = shard
        self.read_ahead = read_ahead
        self.progress = progress
        #: Stack the plans of one width into one GEMM where a probe proved it bit-identical to the
        #: per-plan GEMM on this device (adalncache.batching); off by default.
        self.batched = batched
        #: Project every plan tile by tile over the output columns where a probe proved it bit-identical
        #: (adalncache.tiling): "auto" (the default) where it was also faster, with the default projection.
        self.tiled = tiled
        # Ranks must agree on every capacity, or their slot decisions would diverge.
        self.max_plans, self.max_plan_width, self.host_cache_bytes = self._dist.min_ints(
            [max_plans, max_plan_width, host_cache_bytes]
        )
        self.stats = CacheStats()
        failure: BaseException | None = None
        try:  # out of device memory, or a store directory, on one rank alone must fail every rank
            self._slab = self._allocate_slab()
            self._check_host_tier()
            self._tiers = TierChain.open(
                spec, self.source, host_cache_bytes=self.host_cache_bytes, store=store, device=self.device,
                collective=self._dist, stats=self.stats, tables=tables,
            )  # fmt: skip
        except BaseException as exc:
            failure = exc
        # Agreed before raising, or the other ranks would wait for this one in their first collective.
        self._dist.agree_construction(failure)
        if failure is not None:
            raise failure
        #: The per-slot events that order builds and reads across CUDA streams (no-ops on a CPU).
        self.stream_sync = StreamSync(self.max_plans, events_for(self.device))
        self._pool = SlotPool(self._slab, self.stream_sync)
        memo = self._tiers.store.memo if self._tiers.store is not None else None
        self._identity = TableIdentity(
            self.source, self._dist, self.stats, spec=spec, precision=precision, device=self.device, memo=memo
        )
        if self._tiers.tables is not None:
            # A table file that cannot serve this cache bit-exactly is refused now, on every rank.
            try:
                self._tiers.tables.check_bindings(self._identity.template(), self._identity.content.identify)
            except BaseException as exc:
                failure = exc
            self._dist.agree_construction(failure)
            if failure is not None:
                raise failure
        #: The table files given (``tables=``); served while the device matches their binding.
        self._table_files = self._tiers.tables
        self.fault_points: FaultPoints = NO_FAULTS
        self._lock = threading.RLock()  # state: slot map, holds, stats, identity (never held in a pass)
        self._build_lock = threading.RLock()  # one build at a time
        #: Set on the thread running a build (so while embed= and project= run): see _exclusive.
        self._in_build = threading.local()
        self._closed = False
        settings = BuildSettings(
            spec=spec, device=self.device, precision=precision, max_plans=self.max_plans,
            max_plan_width=self.max_plan_width, read_ahead=read_ahead, progress=progress, batched=batched,
            tiled=tiled,
        )  # fmt: skip
        self._builder = BuildTransaction(
            settings, source=self.source, slab=self._slab, pool=self._pool, tiers=self._tiers, identity=self._identity,
            collective=self._dist, stats=self.stats, sync=self.stream_sync, lock=self._lock,
            faults=lambda: self.fault_points,
        )  # fmt: skip
        #: Host copies of the tables built on devices of another identity, kept across moves.
        self._parking = TableParking()
        log.debug(
            "AdalnCache: %d plans x %d timesteps, %.1f MiB slab on %s",
            self.max_plans, self.max_plan_width, self.slab_bytes / 2**20, self.device,
        )  # fmt: skip

    # -- the slab tensors ---------------------------------------------------------------------

    @property
    def plan_timesteps(self) -> torch.Tensor:
        """``[P, W]`` f32 (``[P, W, C]`` for plans of ``C`` columns): each slot's plan, zero past its length."""
        return self._slab.plan_timesteps

    @property
    def plan_lengths(self) -> torch.Tensor:
        """``[P]`` i64: each slot's plan rows, 0 for a free slot."""
        return self._slab.plan_lengths

    @property
    def table(self) -> torch.Tensor:
        """``[P, W, spec.table_width]``: every served layer's output per plan row, side by side."""
        return self._slab.table

    @property
    def block_params(self) -> torch.Tensor:
        """``[P, W, L, block_width]``: the table's ``block`` part, a view of :attr:`table` (two-part tables)."""
        return self._slab.part_params("block")

    @property
    def final_params(self) -> torch.Tensor:
        """``[P, W, final_width]``: the table's ``final`` part, a view of :attr:`table` (two-part tables)."""
        return self._slab.part_params("final")

    # -- construction helpers ---------------------------------------------------------------

    _SLAB_KNOBS = "max_plans (CLI --max-plans) or max_plan_width (CLI --plan-width)"

    def _allocate_slab(self) -> Slab:
        """The slab, refused (ConfigError naming its bytes and the knobs) when the device cannot hold it."""
        nbytes = self.spec.slab_bytes(self.max_plans, self.max_plan_width)
        what = f"the slab of max_plans={self.max_plans} x max_plan_width={self.max_plan_width} plans"
        check_available(nbytes, self.device, what, self._SLAB_KNOBS)
        try:
            return Slab(self.spec, self.max_plans, self.max_plan_width, self.device)
        except (RuntimeError, MemoryError) as exc:  # the allocator's own failure (torch.OutOfMemoryError too)
            raise allocation_error(exc, nbytes, self.device, what, self._SLAB_KNOBS) from None

    def _check_host_tier(self) -> None:
        """Refuse a host tier the host cannot hold beside a CPU slab (before its arena is mapped)."""
        if not self.host_cache_bytes:
            return
        beside = self.spec.slab_bytes(self.max_plans, self.max_plan_width) if self.device.type == "cpu" else 0
        what = f"the host tier of host_cache_bytes={self.host_cache_bytes}" + (" beside the slab" if beside else "")
        check_available(self.host_cache_bytes + beside, torch.device("cpu"), what, HOST_TIER_KNOB)

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """The build lock, refused (PlanError) on a thread that is inside a build of this cache.

        The build lock is re-entrant (``hold`` builds under it), so without this check a call from
        inside ``embed``/``project`` would run a second build in the middle of the first: it would
        reserve a slot for a plan the outer build is writing, and one of the two slots would leak.
        """
        if getattr(self._in_build, "active", False):
            raise PlanError(
                f"{what} was called from inside a build of this cache (from its embed= or project=): a build cannot "
                f"start another on the same cache; compute the projections' input without calling the cache"
            )
        with self._build_lock:
            yield

    # -- introspection ----------------------------------------------------------------------

    @property
    def slab_bytes(self) -> int:
        return self._slab.nbytes

    def slab_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._slab.tensors()

    @property
    def resident_plans(self) -> list[PlanKey]:
        """Published plan keys, least recently used first."""
        with self._lock:
            return self._pool.keys()

    def slot_of(self, key: PlanKey) -> int | None:
        with self._lock:
            return self._pool.slot_of(key)

    @property
    def free_slots(self) -> list[int]:
        with self._lock:
            return self._pool.free_slots

    @property
    def held_slots(self) -> dict[int, int]:
        """How many requests hold each held slot (resident, or retired by an identity change)."""
        with self._lock:
            return self._pool.held_slots

    @property
    def variant(self) -> Hashable:
        return self._identity.variant

    @property
    def serve_dtype(self) -> torch.dtype:
        """The dtype rows are served in: the autocast dtype the tables were built under, else ``spec.dtype``."""
        return self._identity.serve_dtype

    @property
    def host_tier(self) -> HostTier | None:
        return self._tiers.host

    @property
    def store(self) -> Store | None:
        return self._tiers.store

    @property
    def tables(self) -> TablesTier | None:
        """The read-only table files (``tables=``), or None."""
        return self._tiers.tables

    @property
    def content_digest(self) -> str | None:
        """The content digest of the source's projection tensors, if known yet (no I/O; see :meth:`identify`)."""
        return self._identity.content.digest

    def identify(self, *, read: bool = True) -> str | None:
        """The content digest: from the digest memo, else (``read=True``) by one hashing-only read.

        ``None`` when it cannot be known (no weights; a column split that cuts the hashed row
        blocks; tensors on a device). In a process group every rank must call this together.
        """
        with self._exclusive("identify()"):
            return self._identity.content.identify(read=read)

    @property
    def world_size(self) -> int:
        """Ranks that build this cache together (1 without a process group)."""
        return self._dist.world

    @property
    def rank(self) -> int:
        """This process's rank in the cache's process group (0 without one)."""
        return self._dist.rank

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` gave the cache's host memory back (it can no longer build)."""
        return self._closed

    def __contains__(self, plan: torch.Tensor) -> bool:
        key = plan_key(plan, self.spec.plan_columns)
        with self._lock:
            return key in self._pool

    def __len__(self) -> int:
        with self._lock:
            return len(self._pool)

    def __repr__(self) -> str:
        return (
            f"AdalnCache({len(self)}/{self.max_plans} plans resident, width {self.max_plan_width}, "
            f"{self.spec.num_layers} layers, {self.precision}, {self.device})"
        )

    def binding(self) -> dict[str, Any] | None:
        """Everything a stored table depends on besides its plan (stores key entries by it).

        ``None`` while the source's content digest is not known (the store is then not used).
        """
        return self._identity.binding()

    # -- build and hold ---------------------------------------------------------------------

    def build(
        self,
        plans: Sequence[torch.Tensor],
        *,
        embed: EmbedFn | None = None,
        project: ProjectFn | None = None,
        variant: Hashable = None,
        keys: Sequence[PlanKey] | None = None,
    ) -> BuildReport:
        """Make every plan of ``plans`` resident (see :mod:`adalncache.transaction` for the order).

        ``embed``: the projections' input for a plan; a cache with no weight source (table files
        only) builds without it, since no pass can run there.

        ``keys``: ``plan_key`` of each plan, computed once per request by the caller, so the hit
        path does not key the plans again (the keys of plans that must be built are re-checked).
        """
        start = time.perf_counter()
        order, tensors = distinct_plans(plans, keys, self.spec.plan_columns)
        hit = self._hit(order, variant)
        report = hit if isinstance(hit, BuildReport) else self._build(order, tensors, embed, project, variant)
        report.seconds = time.perf_counter() - start
        return report

    def hold(
        self,
        plans: Sequence[torch.Tensor],
        *,
        embed: EmbedFn | None = None,
        project: ProjectFn | None = None,
        variant: Hashable = None,
        keys: Sequence[PlanKey] | None = None,
    ) -> PlanHold:
        """:meth:`build` the plans, then hold them until the returned hold is released.

        Until then no build evicts or rewrites them; a build that cannot find room beside held
        plans raises PlanError. Prefer :meth:`acquire`, which releases on exit.
        """
        start = time.perf_counter()
        plans, keys = keyed_plans(plans, keys, self.spec.plan_columns)
        held = self._hit(list(dict.fromkeys(keys)), variant, hold=keys)
        if held is None:
            with self._exclusive("hold()"):  # no build between this one and the hold
                order, tensors = distinct_plans(plans, keys, self.spec.plan_columns)
                report = self._build(order, tensors, embed, project, variant)
                with self._lock:
                    held = self._hold(keys, report)
        assert isinstance(held, PlanHold)
        held.report.seconds = time.perf_counter() - start
        return held

    def hold_resident(
        self, plans: Sequence[torch.Tensor], *, keys: Sequence[PlanKey] | None = None, variant: Hashable = None
    ) -> PlanHold | None:
        """Hold ``plans`` if every one is resident under ``variant`` and the current autocast state,
        else ``None``: the hit path of :meth:`hold`, which never waits for another thread's pass."""
        plans, keys = keyed_plans(plans, keys, self.spec.plan_columns)
        held = self._hit(list(dict.fromkeys(keys)), variant, hold=keys, local=True)
        return held if isinstance(held, PlanHold) else None

    @contextlib.contextmanager
    def acquire(
        self,
        plans: Sequence[torch.Tensor],
        *,
        embed: EmbedFn | None = None,
        project: ProjectFn | None = None,
        variant: Hashable = None,
        keys: Sequence[PlanKey] | None = None,
    ) -> Iterator[torch.Tensor]:
        """``with cache.acquire(plans, embed=...) as slots:`` builds what is missing, yields one slot per
        plan (in order, on the cache device), and holds the plans until the block ends."""
        held = self.hold(plans, embed=embed, project=project, variant=variant, keys=keys)
        try:
            yield held.slots
        finally:
            held.release()

    def _hit(
        self, order: list[PlanKey], variant: Hashable, hold: list[PlanKey] | None = None, *, local: bool = False
    ) -> BuildReport | PlanHold | None:
        """The hit path: touch and count when every plan is resident under the current identity.

        One process only (in a group every build agrees with the other ranks first), except for
        ``local`` (:meth:`hold_resident`), which in a group holds without touching: the LRU order
        decides the ranks' evictions and must change on every rank at once. Returns None when
        anything is missing or the variant or autocast state changed: the caller builds.
        """
        grouped = self._dist.world > 1
        if (grouped and not local) or self._closed:
            return None
        autocast = autocast_dtype(self.device)
        pool = self._pool
        with self._lock:
            if not self._identity.matches(variant, autocast):
                return None
            for key in order:
                if key not in pool:
                    return None
            if not grouped:
                pool.touch(order)
            self.stats.device_hits += len(order)
            report = BuildReport(plans=len(order), device_hits=len(order))
            return report if hold is None else self._hold(hold, report)

    def _build(
        self,
        order: list[PlanKey],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn | None,
        project: ProjectFn | None,
        variant: Hashable,
    ) -> BuildReport:
        report = BuildReport(plans=len(order))
        with self._exclusive("build()"):
            if self._closed:
                raise ConfigError(
                    "this AdalnCache was closed (close(), or the diffusers handle's disable()) and cannot build; "
                    "create a new one"
                )
            self._in_build.active = True
            try:
                self._builder.run(order, tensors, embed, project or default_project, variant, report)
            finally:
                self._in_build.active = False
        return report

    def _hold(self, keys: list[PlanKey], report: BuildReport) -> PlanHold:
        """Hold the slots of ``keys`` (resident; the state lock is held)."""
        slot_list = [self._pool.require(key) for key in keys]
        held = PlanHold(
            self._release, keys=keys, slot_list=slot_list, slots=self._slab.indices(slot_list), report=report,
            dtype=self._identity.serve_dtype,
        )  # fmt: skip
        self._pool.hold(held.held)
        # This thread's stream reads these slots from now on: after the writes that filled them.
        self.stream_sync.before_read(held.held)
        return held

    def _release(self, held: PlanHold) -> None:
        with self._lock:
            if held.released:
                return
            held.released = True
            self.stream_sync.after_read(held.held)  # a later rewrite waits for this thread's reads
            self._pool.unhold(held.held)

    def rows_of(self, key: PlanKey) -> PlanRows:
        """A copy of a resident plan's rows, on the cache device (tiers and verify read these)."""
        return self._builder.rows_of(key)

    # -- maintenance ------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Empty the slab and the host tier (held plans retire).

        Store entries stay: they are keyed by content, so they never go stale.
        """
        with self._exclusive("invalidate()"):
            self._builder.drop_all("invalidate()")

    def close(self) -> int:
        """Give back the host memory the cache holds: the host tier's arena (unlocked and freed) and the
        source's kept read buffers; returns the bytes released. Resident plans stay readable; building
        afterwards raises ConfigError. Idempotent."""
        with self._exclusive("close()"), self._lock:
            if self._closed:
                return 0
            self._closed = True
            released = self._tiers.release()
            release_buffers = getattr(self.source, "release_buffers", None)
            if callable(release_buffers):
                released += int(release_buffers())
            return released

    def check_invariants(self) -> None:
        """Assert the bookkeeping invariants (:mod:`adalncache.slots`; tests call this after every step).

        Waits for a build in progress (its reserved slots are by design in no set).
        """
        with self._exclusive("check_invariants()"), self._lock:
            self._pool.check_invariants()
            self._tiers.check_invariants()

    # -- devices ----------------------------------------------------------------------------

    def move_to(self, device: torch.device | str) -> None:
        """Serve from ``device`` from now on (see :mod:`adalncache.relocation` for what follows).

        The slab tensors are new tensors on the new device: code that kept the old ones (a CUDA
        graph) must take them again. Refused (``ConfigError``, nothing changed) for a cache of a
        process group, and while requests hold plans (their slot tensors are on the old device).
        """
        target = resolve_device(device, argument="device")
        if same_device(target, self.device):
            return
        if self._dist.world > 1:
            raise ConfigError(
                f"a cache built by a process group cannot move from {self.device} to {target}: every rank "
                "would have to move at once; create the cache (and enable it) on the device it serves"
            )
        with self._exclusive("move_to()"), self._lock:
            held = self._pool.held_slots
            if held:
                raise ConfigError(
                    f"cannot move the cache from {self.device} to {target}: {len(held)} slot(s) are held by "
                    "requests in flight, whose slot tensors are on the old device; move it (model.to(...)) "
                    "after their acquire() blocks end (handle.release() for a pipeline request)"
                )
            self._relocate(target)

    def _relocate(self, target: torch.device) -> None:
        identity = self._identity
        here, there = device_identity(self.device), device_identity(target)
        if here != there:
            self._parking.park(
                here, self._pool, self._slab, fingerprint=identity.fingerprint, variant=identity.variant,
                autocast=identity.autocast,
            )  # fmt: skip
            self._pool.clear()
            # The host tier held rows of the old device; a new one (pinned for CUDA) holds the new
            # one's, and the old arena (page-locked for a GPU) is given back now.
            self._tiers.release()
            self._tiers = TierChain.open(
                self.spec, self.source, host_cache_bytes=self.host_cache_bytes, store=self._tiers.store,
                device=target, collective=self._dist, stats=self.stats,
            )  # fmt: skip
        self._slab.relocate(target, keep_rows=here == there)
        self.stream_sync.reset(events_for(target))
        previous, self.device, identity.device = self.device, target, target
        if here != there and self._table_files is not None:
            # Table files are bound to a numeric environment, device included: served where they match.
            try:
                self._table_files.check_bindings(
                    identity.template(), identity.content.identify, generation=identity.generation
                )
                self._tiers.tables = self._table_files
            except AdalnCacheError as exc:
                log.warning("table files not served on %s (%s); plans are built there instead", target, exc)
                self._tiers.tables = None
        self._builder.relocate(target, self._tiers)
        if here != there:
            restored = self._parking.restore(there, self._pool, self._slab, fingerprint=identity.fingerprint)
            if restored is not None:
                identity.variant, identity.autocast = restored.variant, restored.autocast
        log.info("AdaLN cache moved from %s to %s (%d plan(s) resident there)", previous, target, len(self._pool))


__all__ = ["PRECISIONS", "SHARD_MODES", "AdalnCache", "AdalnCacheError", "BuildReport", "CacheStats", "PlanHold"]
