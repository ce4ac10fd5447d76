"""AdalnCache: a device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

The cache's parts are built by :func:`adalncache.assembly.assemble` from (spec, source, options,
device); the cache decides *when* work runs, and delegates:
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
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Unpack

from .assembly import assemble, pinned, relocated
from .devices import resolve_device
from .errors import AdalnCacheError, ConfigError, PlanError
from .faults import NO_FAULTS, FaultPoints
from .holds import PlanHold
from .identity import autocast_dtype
from .introspection import CacheIntrospection
from .options import PRECISIONS, SHARD_MODES, CacheKwargs, CacheOptions, option_keywords
from .plans import PlanKey, distinct_plans, keyed_plans
from .rebuild import EmbedFn, ProjectFn, default_project
from .relocation import same_device
from .reports import BuildReport, CacheStats
from .rows import PlanRows
from .source import WeightSource
from .source.memory import NoWeights
from .spec import ModulationSpec

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


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
    """The cache's fault points, read per build through a weak reference.

    Why weak: the build transaction keeps this callable, and a closure over the cache itself would
    put the cache in a reference cycle; a cache of a process group would then keep the group (and
    its gloo worker threads) alive until a garbage collection, which at interpreter exit aborts.
    """

    def read() -> FaultPoints:
        owner = cache()
        return owner.fault_points if owner is not None else NO_FAULTS

    return read


class AdalnCache(CacheIntrospection):
    """A device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

    The slab tensors (``plan_timesteps``, ``plan_lengths``, ``table``, and the views of ``table``:
    ``block_params``/``final_params`` for a two-part table, :meth:`layer_params` per layer) are
    allocated once on ``device``; their pointers never move unless :meth:`move_to` moves the
    cache to another device, and they are not registered in any module, so no ``state_dict``
    holds them.
    """

    @option_keywords()
    def __init__(
        self,
        spec: ModulationSpec,
        source: WeightSource | None,
        *,
        device: torch.device | str = "cpu",
        **options: Unpack[CacheKwargs],
    ) -> None:
        """Allocate the slab on ``device`` and open the tiers; ConfigError names the argument to change.

        Args:
            spec: the geometry and dtype of the served projections.
            source: where the projections' weights are read (None: table files only, ``tables=``).
            device: where the slab lives and every pass projects.
            {cache options}
        """
        _check_spec_and_source(spec, source, options.get("tables"))
        given = CacheOptions.of(options, where="AdalnCache()")
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
        parts = assemble(
            spec,
            self.source,
            given,
            pinned(resolve_device(device, argument="device")),
            lock=self._lock,
            faults=_fault_points_of(weakref.ref(self)),
        )
        self._parts = parts
        #: The options in force: as given, with the capacities every rank of a group agreed on.
        self.options = parts.options
        self.stats = parts.stats
        #: The per-slot events that order builds and reads across CUDA streams (no-ops on a CPU).
        self.stream_sync = parts.sync
        self._dist, self._slab, self._pool = parts.collective, parts.slab, parts.pool
        self._identity, self._builder, self._site = parts.identity, parts.builder, parts.site
        log.debug(
            "AdalnCache: %d plans x %d timesteps, %.1f MiB slab on %s",
            self.max_plans,
            self.max_plan_width,
            self.slab_bytes / 2**20,
            self.device,
        )

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

    def identify(self, *, read: bool = True) -> str | None:
        """The content digest: from the digest memo, else (``read=True``) by one hashing-only read.

        ``None`` when it cannot be known (no weights; a column split that cuts the hashed row
        blocks; tensors on a device). In a process group every rank must call this together.
        """
        with self._exclusive("identify()"):
            return self._identity.content.identify(read=read)

    @property
    def hash_passes(self) -> bool:
        """Whether each pass hashes the projection bytes it reads, learning and checking the content digest.

        On where something is bound to the digest (a ``store``, ``tables``); off otherwise, so a
        pass costs its reads and projections only. ``export_tables`` and ``verify_tables`` turn it
        on (they bind or check tables); set it to learn the digest during the passes you run anyway
        instead of by a later hashing read (``identify()``). Every rank of a group sets it alike.
        """
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
        """Make every plan of ``plans`` resident (see :mod:`adalncache.transaction` for the order).

        ``embed``: the projections' input for a plan; a cache with no weight source (table files
        only) builds without it, since no pass can run there.

        ``keys``: ``plan_key`` of each plan, computed once per request by the caller, so the hit
        path does not key the plans again (the keys of plans that must be built are re-checked).
        """
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
        """:meth:`build` the plans, then hold them until the returned hold is released.

        Until then no build evicts or rewrites them; a build that cannot find room beside held
        plans raises PlanError. Prefer :meth:`acquire`, which releases on exit.
        """
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
        """The hit path: touch and count when every plan is resident under the current identity.

        One process only (in a group every build agrees with the other ranks first), except for
        ``local`` (:meth:`hold_resident`), which in a group counts without touching: the LRU order
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
        """How many held plans were ever retired (``invalidate()``, tables of an old identity dropped).

        Why: a hold keeps reading its retired slots' old rows; a caller that serves many forwards
        from one hold (a prepared request) compares this with the hold's ``epoch`` to stop doing so.
        """
        return self._pool.retirements

    def invalidate(self) -> None:
        """Empty the slab and the host tier (held plans retire).

        Store entries stay: they are keyed by content, so they never go stale.
        """
        with self._exclusive("invalidate()"):
            self._builder.drop_all("invalidate()")

    def close(self) -> int:
        """Give back what the cache holds beyond its slab: the host tier's arena (unlocked and freed), the
        source's kept read buffers, and its process group; returns the bytes released. Resident plans stay
        readable; building afterwards raises ConfigError. Idempotent.

        Why the process group: a cache that kept it would keep ``torch.distributed``'s group (and its
        worker threads) alive past ``destroy_process_group()``; close a cache of a group before
        destroying the group.
        """
        with self._exclusive("close()"), self._lock:
            if self._closed:
                return 0
            self._closed = True
            self._dist.release()
            self.options = self._parts.options = dataclasses.replace(self.options, process_group=None)
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

    def __enter__(self) -> AdalnCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                    "requests in flight, whose slot tensors are on the old device; move it (or the model it serves) "
                    "after their acquire() blocks end (handle.release() for a pipeline request)"
                )
            self._relocate(target)

    def _relocate(self, target: torch.device) -> None:
        previous = self.device
        relocated(self._parts, self.spec, self.source, target)
        log.info("AdaLN cache moved from %s to %s (%d plan(s) resident there)", previous, target, len(self._pool))


__all__ = ["PRECISIONS", "SHARD_MODES", "AdalnCache", "AdalnCacheError", "BuildReport", "CacheStats", "PlanHold"]
