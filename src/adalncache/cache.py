"""AdalnCache: a device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

The cache decides *when* work runs (locks, the hit path, holds, moves; docs/api.md); its parts do it:
the slab and slot pool, the build transaction, the tiers, the stream events and the rank collective.
Construction builds them in the one order that works across ranks: settings that fix later collectives
compared, capacities min-reduced, whatever can fail on one rank alone agreed first (:func:`_agreed`).
No part holds a closure over the cache: a cache of a process group must be freed by reference
counting alone (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import torch
from typing_extensions import Unpack

from .devices import DeviceEvents, StreamSync, allocation_error, check_available, indexed, resolve_device
from .distributed import Collective, make_collective
from .errors import AdalnCacheError, ConfigError, PlanError, PlanNotCachedError
from .geometry import RowSplit
from .identity import autocast_dtype, device_identity
from .identity.binding import TableIdentity
from .options import AdalnCacheConfig, CacheKwargs, CacheOptions, knob, option_keywords
from .plans import PlanKey, distinct_plans, keyed_plans, plan_key
from .rebuild import EmbedFn, ProjectFn, default_project
from .reports import NO_FAULTS, BuildReport, CacheStats, FaultPoints
from .slab import PlanRows, Slab, SlotPool
from .source import WeightSource
from .source.memory import NoWeights
from .spec import Layer, ModulationSpec
from .tiers.chain import TierChain
from .tiers.host import HOST_TIER_KNOB
from .transaction import BuildTransaction, Placement, Site

if TYPE_CHECKING:
    from .tiers.host import HostTier
    from .tiers.store import Store
    from .tiers.tables import TablesTier

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What to lower when the slab does not fit.
SLAB_KNOBS = f"{knob('max_plans')} or {knob('max_plan_width')}"


def _check_spec_and_source(spec: Any, source: Any, tables: Any) -> None:
    """The arguments beside the options that the cache can check alone; ConfigError names the one to change."""
    if not isinstance(spec, ModulationSpec):
        raise ConfigError(f"spec must be a ModulationSpec, got {type(spec).__name__}")
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


def _fault_points_of(cache: weakref.ref[AdalnCache]) -> Callable[[], FaultPoints]:
    """The cache's fault points, read per build through a weak reference (the transaction keeps this
    callable: a closure over the cache itself would put the cache in a reference cycle)."""

    def read() -> FaultPoints:
        owner = cache()
        return owner.fault_points if owner is not None else NO_FAULTS

    return read


def _agreed(collective: Collective, make: Callable[[], T]) -> T:
    """``make()``, after every rank of the group learnt whether it failed on any rank."""
    try:
        result = make()
    except BaseException as exc:
        collective.agree_construction(exc)
        raise
    collective.agree_construction(None)
    return result


def _allocate_slab(spec: ModulationSpec, options: CacheOptions, device: torch.device) -> Slab:
    """The slab, refused (ConfigError naming its bytes and the knobs) when the device cannot hold it;
    then a host tier the host cannot hold beside a CPU slab (before its arena is mapped)."""
    nbytes = spec.slab_bytes(options.max_plans, options.max_plan_width)
    what = f"the slab of max_plans={options.max_plans} x max_plan_width={options.max_plan_width} plans"
    check_available(nbytes, device, what, SLAB_KNOBS)
    try:
        slab = Slab(spec, options.max_plans, options.max_plan_width, device)
    except (RuntimeError, MemoryError) as exc:  # the allocator's own failure (torch.OutOfMemoryError too)
        raise allocation_error(exc, nbytes, device, what, SLAB_KNOBS) from None
    if options.host_cache_bytes:
        beside = nbytes if device.type == "cpu" else 0
        what = f"the host tier of host_cache_bytes={options.host_cache_bytes}" + (" beside the slab" if beside else "")
        check_available(options.host_cache_bytes + beside, torch.device("cpu"), what, HOST_TIER_KNOB)
    return slab


def _serve_files(placement: Placement, identity: TableIdentity, *, strict: bool) -> None:
    """Serve the table files where they fit the placement's device (their binding names a numeric
    environment, device included). ``strict`` (construction): a file that does not fit raises;
    otherwise (a move) it is logged and the files are not served on that device."""
    files = placement.files
    if files is None:
        return
    try:
        files.check_bindings(identity.template(), identity.content.identify, generation=identity.generation)
    except AdalnCacheError as exc:
        if strict:
            raise
        log.warning("table files not served on %s (%s); plans are built there instead", placement.device, exc)
        placement.tiers.tables = None
        return
    placement.tiers.tables = files


@dataclass(eq=False)
class PlanHold:
    """The plans of one request, held until :meth:`release` (or the end of a ``with`` block). ``variant`` is
    recorded so a caller never stamps a variant read later on these rows; ``epoch`` is
    :attr:`AdalnCache.retirements` when the hold was taken (another count later: a plan may have retired)."""

    _release: Callable[[PlanHold], None] = field(repr=False)
    keys: list[PlanKey]
    slot_list: list[int]
    slots: torch.Tensor
    report: BuildReport
    dtype: torch.dtype
    variant: Hashable = None
    epoch: int = 0
    released: bool = False
    #: The distinct slots held, each once.
    held: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.held = list(dict.fromkeys(self.slot_list))

    def release(self) -> None:
        """Give the plans back (idempotent). Call it on the thread (CUDA: the stream) that read the rows:
        the cache records there when the reads are done, and a later rewrite of these slots waits for that."""
        self._release(self)

    def __enter__(self) -> PlanHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"PlanHold({len(self.keys)} plan(s) in {len(self.held)} slot(s), {state})"


class _Option(Generic[T]):
    """A read-only cache attribute: the option of its name in force (``cache.options``; on the class, its default)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cache: AdalnCache | None, owner: type | None = None) -> T:
        return getattr(cache.options if cache is not None else AdalnCacheConfig, self.name)

    def __set__(self, cache: AdalnCache, value: object) -> None:  # a data descriptor: assignment never shadows it
        raise AttributeError(f"{self.name} is read-only: it is the option in force, cache.options.{self.name}")


class StashedTables(NamedTuple):
    """One device identity's tables, kept on the host while the cache serves another device."""

    rows: list[tuple[PlanKey, PlanRows]]
    fingerprint: str | None
    variant: Hashable
    autocast: torch.dtype | None


class AdalnCache:
    """A device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source. The slab
    tensors are allocated once and registered in no module (docs/api.md, "Slab attributes")."""

    @option_keywords(cache=True)
    def __init__(
        self,
        spec: ModulationSpec,
        source: WeightSource | None,
        *,
        device: torch.device | str = "cpu",
        config: AdalnCacheConfig | None = None,
        **options: Unpack[CacheKwargs],
    ) -> None:
        """Allocate the slab on ``device`` and open the tiers; ConfigError names the argument to change.

        Args:
            source: where the projections' weights are read (None: table files only, ``tables=``).
            config: the options as one :class:`~adalncache.options.AdalnCacheConfig`; a keyword given
                beside it replaces its field.
            {cache options}
        """
        given = AdalnCacheConfig.of(options, where="AdalnCache()", config=config, cache=True)
        _check_spec_and_source(spec, source, given.tables)
        self.spec = spec
        #: The weight source; without one (``source=None``) a :class:`~adalncache.source.memory.NoWeights`
        #: that serves table files only.
        self.source: WeightSource = source if source is not None else NoWeights(spec)
        self.fault_points: FaultPoints = NO_FAULTS
        self._lock = threading.RLock()  # state: slot map, holds, stats, identity (never held in a pass)
        self._build_lock = threading.RLock()  # one build at a time
        #: Set on the thread running a build (so while embed= and project= run): see _exclusive.
        self._in_build = threading.local()
        self._closed = False
        #: Host copies of the tables of other device identities, while the cache serves this one.
        self._stashed: dict[tuple[Any, ...], StashedTables] = {}
        target = indexed(resolve_device(device, argument="device"))
        # Settings that fix the number or size of later collectives are compared across ranks.
        agreed = {
            "precision": given.precision,
            "store": given.store is not None,
            "device_type": target.type,
            "tables": given.tables is not None,
        }
        self._dist = collective = make_collective(given.process_group, given.shard, spec, device=target, config=agreed)
        # Ranks must agree on every capacity, or their slot decisions would diverge.
        max_plans, max_plan_width, host_cache_bytes = collective.min_ints(
            [given.max_plans, given.max_plan_width, given.host_cache_bytes]
        )
        #: The options in force: as given, with the capacities every rank of a group agreed on.
        self.options = options_ = dataclasses.replace(
            given, max_plans=max_plans, max_plan_width=max_plan_width, host_cache_bytes=host_cache_bytes
        )
        self.stats = stats = CacheStats()

        def local() -> tuple[Slab, Placement]:
            return _allocate_slab(spec, options_, target), self._place(target, options_.store)

        self._slab, placement = _agreed(collective, local)
        self._site = site = Site(placement)
        #: The per-slot events that order builds and reads across CUDA streams (no-ops on a CPU).
        self.stream_sync = sync = StreamSync(options_.max_plans, DeviceEvents(target))
        self._pool = pool = SlotPool(self._slab, sync)
        store = placement.tiers.store
        memo = store.memo if store is not None else None
        self._identity = identity = TableIdentity(
            self.source, collective, stats, spec=spec, precision=given.precision, device=lambda: site.device, memo=memo
        )
        # Passes hash what they read only where something is bound to the content digest (same on every
        # rank: the store and table settings were agreed above).
        identity.content.wanted = store is not None or placement.files is not None
        # A table file that cannot serve this cache bit-exactly is refused now, on every rank.
        if placement.files is not None:
            _agreed(collective, lambda: _serve_files(placement, identity, strict=True))
        faults = _fault_points_of(weakref.ref(self))
        self._builder = BuildTransaction(
            spec, options_, self.source, self._slab, pool, site, identity, collective, stats, sync, self._lock, faults
        )
        log.debug(
            "AdalnCache: %d plans x %d timesteps, %.1f MiB slab on %s",
            max_plans,
            max_plan_width,
            self.slab_bytes / 2**20,
            target,
        )

    def _place(self, device: torch.device, store: Any, files: TablesTier | None = None) -> Placement:
        """The tier chain for ``device``, with ``options.tables`` opened (construction) or the already open
        ``files`` (a move; checked against the device by :func:`_serve_files`)."""
        tiers = TierChain(
            self.spec,
            self.source,
            host_cache_bytes=self.options.host_cache_bytes,
            store=store,
            device=device,
            collective=self._dist,
            stats=self.stats,
            tables=self.options.tables if files is None else None,
        )
        return Placement(device, tiers, tiers.tables if files is None else files)

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """The build lock, refused (PlanError) on a thread inside a build of this cache: the lock is re-entrant
        (``hold`` builds under it), so a call from ``embed``/``project`` would run a second build in the middle
        of the first, reserve a slot for a plan the outer build is writing, and leak one of the two."""
        if getattr(self._in_build, "active", False):
            raise PlanError(
                f"{what} was called from inside a build of this cache (from its embed= or project=): a build cannot "
                f"start another on the same cache; compute the projections' input without calling the cache"
            )
        with self._build_lock:
            yield

    def identify(self, *, read: bool = True) -> str | None:
        """The content digest: from the digest memo, else (``read=True``) by one hashing-only read; ``None``
        when it cannot be known (docs/api.md). In a process group every rank must call this together."""
        with self._exclusive("identify()"):
            return self._identity.content.identify(read=read)

    @property
    def hash_passes(self) -> bool:
        """Whether each pass hashes the projection bytes it reads, learning and checking the content digest:
        on where something is bound to it (a ``store``, ``tables``), else off so a pass costs its reads and
        projections only (docs/api.md). Every rank of a group sets it alike."""
        return self._identity.content.wanted

    @hash_passes.setter
    def hash_passes(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"hash_passes takes True or False, got {value!r}")
        with self._exclusive("hash_passes"):
            self._identity.content.wanted = value

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
        """Make every plan of ``plans`` resident (the order: docs/state-machine.md). ``embed`` may be omitted
        only without a weight source. ``keys``: ``plan_key`` of each plan, computed once per request, so the
        hit path does not key again (plans to build are re-keyed)."""
        start = time.perf_counter()
        order, tensors = distinct_plans(plans, keys, self.spec.plan_columns)
        report = self._hit(order, variant) or self._build(order, tensors, embed, project, variant)
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
        """:meth:`build` the plans, then hold them (no build evicts or rewrites them) until the hold is
        released; a build that cannot find room beside held plans raises PlanError. See :meth:`acquire`."""
        start = time.perf_counter()
        plans, keys = keyed_plans(plans, keys, self.spec.plan_columns)
        held = self._hold_if_resident(keys, variant, local=False)
        if held is None:
            with self._exclusive("hold()"):  # no build between this one and the hold
                order, tensors = distinct_plans(plans, keys, self.spec.plan_columns)
                report = self._build(order, tensors, embed, project, variant)
                with self._lock:
                    held = self._hold(keys, report, variant)
        held.report.seconds = time.perf_counter() - start
        return held

    def hold_resident(
        self, plans: Sequence[torch.Tensor], *, keys: Sequence[PlanKey] | None = None, variant: Hashable = None
    ) -> PlanHold | None:
        """Hold ``plans`` if every one is resident under ``variant`` and the current autocast state,
        else ``None``: the hit path of :meth:`hold`, which never waits for another thread's pass."""
        plans, keys = keyed_plans(plans, keys, self.spec.plan_columns)
        return self._hold_if_resident(keys, variant, local=True)

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

    def _hit(self, order: list[PlanKey], variant: Hashable, *, local: bool = False) -> BuildReport | None:
        """The hit path: touch and count when every plan is resident under the current identity, else None. One
        process only (a group's builds agree first), except ``local`` (:meth:`hold_resident`), which in a group
        counts without touching: the LRU order decides evictions and must change on every rank at once."""
        grouped = self._dist.world > 1
        if (grouped and not local) or self._closed:
            return None
        autocast = autocast_dtype(self.device)
        pool = self._pool
        with self._lock:
            if not self._identity.matches(variant, autocast) or not all(key in pool for key in order):
                return None
            if not grouped:
                pool.touch(order)
            self.stats.device_hits += len(order)
            return BuildReport(plans=len(order), device_hits=len(order))

    def _hold_if_resident(self, keys: list[PlanKey], variant: Hashable, *, local: bool) -> PlanHold | None:
        """The hit path of a hold: hold ``keys`` in the same state-lock section that found them resident."""
        with self._lock:
            report = self._hit(list(dict.fromkeys(keys)), variant, local=local)
            return None if report is None else self._hold(keys, report, variant)

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
                    "this AdalnCache was closed (close(), or the disable() of the integration that owned it) and "
                    "cannot build; create a new one"
                )
            self._in_build.active = True
            try:
                self._builder.run(order, tensors, embed, project or default_project, variant, report)
            finally:
                self._in_build.active = False
        return report

    def _hold(self, keys: list[PlanKey], report: BuildReport, variant: Hashable) -> PlanHold:
        """Hold the slots of ``keys`` (resident under ``variant``; the state lock is held)."""
        slot_list = [self._pool.require(key) for key in keys]
        held = PlanHold(
            self._release,
            keys=keys,
            slot_list=slot_list,
            slots=self._slab.indices(slot_list),
            report=report,
            dtype=self._identity.serve_dtype,
            variant=variant,
            epoch=self._pool.retirements,
        )
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

    @property
    def retirements(self) -> int:
        """How many held plans were ever retired: a caller serving many forwards from one hold (a prepared
        request) compares it with the hold's ``epoch`` to stop reading retired slots' old rows."""
        return self._pool.retirements

    def invalidate(self) -> None:
        """Empty the slab and the host tier (held plans retire); store entries are keyed by content and stay."""
        with self._exclusive("invalidate()"):
            self._builder.drop_all("invalidate()")

    def close(self) -> int:
        """Give back the host tier's arena, the source's kept read buffers and the process group (which would
        otherwise outlive ``destroy_process_group()``, docs/distributed.md); returns the bytes released.
        Resident plans stay readable; building afterwards raises ConfigError. Idempotent."""
        with self._exclusive("close()"), self._lock:
            if self._closed:
                return 0
            self._closed = True
            self._dist.release()
            self.options = self._builder.options = dataclasses.replace(self.options, process_group=None)
            released = self._tiers.release()
            release_buffers = getattr(self.source, "release_buffers", None)
            if callable(release_buffers):
                released += int(release_buffers())
            return released

    def check_invariants(self) -> None:
        """Assert the bookkeeping invariants (docs/state-machine.md); waits for a build in progress (its
        reserved slots are by design in no set)."""
        with self._exclusive("check_invariants()"), self._lock:
            self._pool.check_invariants()
            self._tiers.check_invariants()

    def __enter__(self) -> AdalnCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- devices ----------------------------------------------------------------------------

    def move_to(self, device: torch.device | str) -> None:
        """Serve from ``device`` from now on (docs/api.md): new slab tensors, which code that kept the old ones
        (a CUDA graph) must take again. ConfigError, nothing changed, in a process group or while plans are held."""
        target = resolve_device(device, argument="device")
        if indexed(target) == indexed(self.device):
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
                    "requests in flight, whose slot tensors are on the old device; move it (or the model it serves) "
                    "after their acquire() blocks end (handle.release() for a pipeline request)"
                )
            self._relocate(target)

    def _relocate(self, target: torch.device) -> None:
        """Move the parts to ``target`` (both locks held, no plan held). Rows never cross device identities
        (another kind of device computes other bits): across them the tables are stashed, the tiers placed
        anew (the store kept: it is keyed by the numeric environment) and ``target``'s stash comes back."""
        old, identity, pool, slab = self._site.placement, self._identity, self._pool, self._slab
        here, there = device_identity(old.device), device_identity(target)
        moved = here != there
        if moved:
            self._stash(here)
            pool.clear()
            # The host tier held rows of the old device; a new one (pinned for CUDA) holds the new
            # one's, and the old arena (page-locked for a GPU) is given back now.
            old.tiers.release()
            new = self._place(target, old.tiers.store, old.files)
        else:
            new = Placement(target, old.tiers, old.files)
        slab.relocate(target, keep_rows=not moved)
        self.stream_sync.reset(DeviceEvents(target))
        self._site.placement = new
        if moved:
            _serve_files(new, identity, strict=False)
            restored = self._restore(there)
            if restored is not None:
                identity.variant, identity.autocast = restored.variant, restored.autocast
        log.info("AdaLN cache moved from %s to %s (%d plan(s) resident there)", old.device, target, len(pool))

    def _stash(self, identity: tuple[Any, ...]) -> None:
        """Keep host copies of every resident table under the device ``identity``, least recently used first."""
        rows = []
        for key, slot in self._pool.items():
            copy = self._slab.read_rows(slot, self.spec.plan_rows(key))
            rows.append((key, PlanRows(*(tensor.to("cpu") for tensor in copy))))
        if rows:
            tables = self._identity
            self._stashed[identity] = StashedTables(rows, tables.fingerprint, tables.variant, tables.autocast)
        else:
            self._stashed.pop(identity, None)

    def _restore(self, identity: tuple[Any, ...]) -> StashedTables | None:
        """Publish the tables stashed for ``identity`` into the emptied pool if they were built from the source
        as it is now (its fingerprint); what came back, or None."""
        stashed = self._stashed.pop(identity, None)
        if stashed is None or stashed.fingerprint != self._identity.fingerprint:
            return None
        pool, slab = self._pool, self._slab
        rows = dict(stashed.rows[-pool.num_slots :])
        keys = list(rows)
        reservation = pool.reserve(keys, set(keys))
        for key, slot in reservation.slots.items():
            slab.lay_out(slot, key)
            slab.write_rows(slot, rows[key])
        # Contents first, then timesteps and lengths, then the host-side map: as a build publishes.
        slab.publish([reservation.slots[k] for k in keys], [rows[k].timesteps for k in keys])
        pool.commit(reservation.slots)
        pool.touch(keys)
        return stashed

    # -- reads ------------------------------------------------------------------------------

    def resolve_slots(self, plans: Sequence[torch.Tensor], *, keys: Sequence[PlanKey] | None = None) -> torch.Tensor:
        """One slot per plan as a read-only LongTensor on the cache device, made without a host-to-device copy."""
        plans, keys = keyed_plans(plans, keys, self.spec.plan_columns)
        with self._lock:
            slots = [self._pool.require(k) for k in keys]
            tensor = self._slab.indices(slots)
        self.stream_sync.before_read(slots)
        return tensor

    def lookup(self, plan: torch.Tensor, *, key: PlanKey | None = None) -> torch.Tensor:
        """The slot of a resident plan as a 0-d LongTensor on the cache device."""
        key = plan_key(plan, self.spec.plan_columns) if key is None else key
        with self._lock:
            slot = self._pool.require(key)
        self.stream_sync.before_read([slot])
        return self._slab.index(slot)

    def _read(
        self, slot: int | torch.Tensor, read: Callable[[], torch.Tensor], dtype: torch.dtype | None
    ) -> torch.Tensor:
        """``read()`` of a slot's rows, ordered after their writes, in the served dtype: views for an integer
        slot; for a device slot tensor a gathered copy, recorded as a read a later rewrite of any slot waits for."""
        known = [self._check_slot(slot)] if not isinstance(slot, torch.Tensor) else None
        self.stream_sync.before_read(known)
        rows = read()
        if known is None:
            self.stream_sync.after_read(None)
        want = dtype if dtype is not None else self._identity.serve_dtype
        return rows if rows.dtype == want else rows.to(want)

    def _check_slot(self, slot: object) -> int:
        """An integer slot, checked on the host: in range, and holding a plan (resident, or retired but held).
        (A device slot tensor is never read on the host: that would sync the device.)"""
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise PlanError(
                f"slot must be an integer or the slot tensor lookup()/resolve_slots() returned, got "
                f"{type(slot).__name__}"
            )
        if not 0 <= slot < self._slab.max_plans:
            raise PlanError(
                f"slot must be in 0..{self._slab.max_plans - 1} (the slab's max_plans), got {slot}: pass a slot "
                f"lookup() or resolve_slots() returned"
            )
        with self._lock:
            in_use = self._pool.in_use(slot)
        if not in_use:
            raise PlanNotCachedError(
                f"the cache does not cover slot {slot}: slot {slot} holds no plan (it is free, or being built); pass "
                f"the slot lookup() or resolve_slots() returned for a resident plan, and hold it while reading"
            )
        return slot

    @property
    def poison_slot(self) -> int:
        """The poison slot's index (``max_plans``): NaN rows a served forward that matched no prepared plan
        gathers, so its output is NaN, never another plan's."""
        return self._slab.poison_slot

    def served_params(self, layer: Layer) -> torch.Tensor:
        """:meth:`layer_params` with the poison slot after the last slot: ``[P + 1, W, out_features]``."""
        return self._slab.served_layer(layer)

    def served_part(self, name: str) -> torch.Tensor:
        """Table part ``name`` with the poison slot after the last slot: ``[P + 1, W, *part.shape]``."""
        return self._slab.served_part(name)

    def layer_params(self, layer: Layer) -> torch.Tensor:
        """``layer``'s columns of every slot: a ``[P, W, out_features]`` view of :attr:`table`, made once per
        slab, that served modules gather from with a device slot tensor (no host read)."""
        return self._slab.layer_params(layer)

    def row_index(self, slot: int | torch.Tensor, n: int) -> torch.Tensor:
        """The flat slab rows ``slot``'s first ``n`` plan rows read, found on the device (for ``slab.gather_rows``)."""
        return self._slab.row_index(slot, n)

    def layer_rows(
        self, layer: Layer, slot: int | torch.Tensor, n: int, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The ``(n, out_features)`` output of ``layer``'s projection for the slot's first ``n`` plan rows."""
        return self._read(slot, lambda: self._slab.layer_rows(layer, slot, n), dtype)

    # The family's modulation reads: its row split (``spec.family.rows``) says which table part holds
    # what and how a row splits; the cache gathers the part's rows, ordered and in the served dtype.

    def _rows(self, read: str, slot: object = None) -> RowSplit:
        """The family's row split, or (after an integer ``slot``'s checks) the ConfigError of a table without
        ``read``'s part, naming what to read instead."""
        split = self.spec.family.rows
        if split is None:
            if slot is not None and not isinstance(slot, torch.Tensor):
                self._check_slot(slot)  # a bad slot is named first, as by every row read
            raise self._slab.no_part(read)
        return split

    def _gather(self, slot: int | torch.Tensor, n: int, dtype: torch.dtype | None) -> Callable[..., torch.Tensor]:
        """``gather(part, select=None)`` (:data:`~adalncache.geometry.Gather`), reading as :meth:`_read` does."""
        return lambda part, select=None: self._read(slot, lambda: self._slab.part_rows(part, slot, n, select), dtype)

    def block_rows(
        self, layer: int, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``Y`` of block ``layer``: the ``(num_timesteps, block_width)`` output of its projection."""
        return self._rows("block", slot).block_rows(self._gather(slot, num_timesteps, dtype), layer)

    def block(
        self, layer: int, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The six ``(num_timesteps * modalities, hidden)`` tensors, as ``Y.view(-1, 6H).chunk(6, -1)``."""
        split = self._rows("block", slot)
        return split.block(split.block_rows(self._gather(slot, num_timesteps, dtype), layer), self.spec)

    def block_all(
        self, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> list[tuple[torch.Tensor, ...]]:
        """:meth:`block` for every layer from one gather of the slot."""
        return self._rows("block", slot).block_all(self._gather(slot, num_timesteps, dtype), self.spec)

    def final_rows(
        self, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``Z``: the ``(num_timesteps, final_width)`` output of the output-layer projection."""
        return self._rows("final", slot).final_rows(self._gather(slot, num_timesteps, dtype))

    def final(
        self, slot: int | torch.Tensor, num_timesteps: int, *, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shift, scale)`` of the output layer."""
        split = self._rows("final", slot)
        return split.final(split.final_rows(self._gather(slot, num_timesteps, dtype)))

    # -- what the cache tells about itself ---------------------------------------------------

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
        """``[P, W, L, block_width]``: the table's blocks part, a view of :attr:`table` (two-part tables)."""
        return self._slab.part_params(self._rows("block").block_part)

    @property
    def final_params(self) -> torch.Tensor:
        """``[P, W, final_width]``: the table's output-layer part, a view of :attr:`table` (two-part tables)."""
        return self._slab.part_params(self._rows("final").final_part)

    @property
    def device(self) -> torch.device:
        """Where the slab lives and passes project (changed only by :meth:`move_to`)."""
        return self._site.device

    @property
    def _tiers(self) -> TierChain:
        return self._site.tiers

    max_plans: _Option[int] = _Option()
    max_plan_width: _Option[int] = _Option()
    host_cache_bytes: _Option[int] = _Option()
    precision: _Option[str] = _Option()
    shard: _Option[str] = _Option()
    read_ahead: _Option[int] = _Option()
    progress: _Option[bool | None] = _Option()
    #: Whether plans of one width are stacked into one GEMM where a probe proved it exact (docs/exactness.md).
    batched: _Option[bool] = _Option()
    #: Whether layers are projected tile by tile where a probe proved it exact (``"auto"``: and faster).
    tiled: _Option[bool | str] = _Option()

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
        """Everything a stored table depends on besides its plan; ``None`` while the content digest is unknown."""
        return self._identity.binding()
