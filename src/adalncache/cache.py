"""AdalnCache: a device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

The cache validates, decides the order of work, and delegates: :class:`~adalncache.slab.Slab`
holds the four tensors and does every row read and write, :class:`~adalncache.slots.SlotPool`
alone changes the slot map, the LRU order and the free list, :class:`~adalncache.rebuild.RebuildPass`
streams the weights and projects, the tiers (:mod:`adalncache.tiers`) keep copies, and the
collective (:mod:`adalncache.distributed`) makes the ranks of a process group agree.

A slot is either *free* (length 0, in the free list) or *resident* (in the host-side slot map,
with its length and timesteps published). ``build`` moves plans between the two in a fixed
order, chosen so that a failure at any point leaves nothing half-built visible:

1. key the request; nothing missing -> touch and return (the hot path: no device work);
2. validate the *whole* request before any state changes, so a rejected request costs nothing;
3. take what the host tier, the store and the table files hold; one rebuild pass for the rest
   (without weights, ``source=None``, a plan no tier holds is a ``PlanNotCachedError`` here);
4. reserve slots from the free list, then from least-recently-used plans *outside* the request;
5. write contents, then flip ``plan_lengths``, then update the host-side slot map: the map is
   what lookups consult, so it changes last and a failure before it hides the whole request;
6. after publish, copy to the tiers; a tier failure is counted and logged, never raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .devices import resolve_device
from .distributed import make_collective
from .errors import (
    AdalnCacheError,
    BuildError,
    CheckpointError,
    ConfigError,
    PlanError,
    PlanNotCachedError,
    failing_at,
    failure_phase,
)
from .faults import NO_FAULTS, FaultPoints
from .identity import TableIdentity
from .plans import PlanKey, distinct_plans, format_plan, plan_key, validate_plan
from .rebuild import EmbedFn, ProjectFn, RebuildPass, default_project
from .reports import BuildReport, CacheStats
from .rows import PlanRows
from .slab import Slab
from .slots import Reservation, SlotPool
from .source import WeightSource
from .source.absent import NoWeights
from .spec import ModulationSpec
from .tiers.chain import TierChain
from .tiers.tables import TablesArg, TablesTier

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
    batched: Any, precision: Any, shard: Any, tables: Any,
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
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}: set --precision")
    if shard not in SHARD_MODES:
        raise ConfigError(f"shard must be one of {list(SHARD_MODES)}, got {shard!r}: set --shard")
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


class AdalnCache:
    """A device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

    The slab tensors (``plan_timesteps``, ``plan_lengths``, ``block_params``, ``final_params``)
    are allocated once on ``device``; their pointers never move, and they are not registered in
    any module, so no ``state_dict`` holds them.
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
    ) -> None:
        _check_arguments(
            spec, source, max_plans=max_plans, max_plan_width=max_plan_width, host_cache_bytes=host_cache_bytes,
            read_ahead=read_ahead, batched=batched, precision=precision, shard=shard, tables=tables,
        )  # fmt: skip
        self.device = resolve_device(device, argument="device")
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
        # Ranks must agree on every capacity, or their slot decisions would diverge.
        self.max_plans, self.max_plan_width, self.host_cache_bytes = self._dist.min_ints(
            [max_plans, max_plan_width, host_cache_bytes]
        )
        self.stats = CacheStats()
        failure: BaseException | None = None
        try:  # out of device memory, or a store directory, on one rank alone must fail every rank
            self._slab = Slab(spec, self.max_plans, self.max_plan_width, self.device)
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
        self.plan_timesteps, self.plan_lengths, self.block_params, self.final_params = self._slab.tensors()
        self._pool = SlotPool(self._slab)
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
        self.fault_points: FaultPoints = NO_FAULTS
        log.debug(
            "AdalnCache: %d plans x %d timesteps, %.1f MiB slab on %s",
            self.max_plans, self.max_plan_width, self.slab_bytes / 2**20, self.device,
        )  # fmt: skip

    # -- introspection ----------------------------------------------------------------------

    @property
    def slab_bytes(self) -> int:
        return self._slab.nbytes

    def slab_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._slab.tensors()

    @property
    def resident_plans(self) -> list[PlanKey]:
        """Published plan keys, least recently used first."""
        return self._pool.keys()

    def slot_of(self, key: PlanKey) -> int | None:
        return self._pool.slot_of(key)

    @property
    def free_slots(self) -> list[int]:
        return self._pool.free_slots

    @property
    def variant(self) -> Hashable:
        return self._identity.variant

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
        return self._identity.content.identify(read=read)

    @property
    def world_size(self) -> int:
        """Ranks that build this cache together (1 without a process group)."""
        return self._dist.world

    @property
    def rank(self) -> int:
        """This process's rank in the cache's process group (0 without one)."""
        return self._dist.rank

    def __contains__(self, plan: torch.Tensor) -> bool:
        return plan_key(plan) in self._pool

    def __len__(self) -> int:
        return len(self._pool)

    def __repr__(self) -> str:
        return (
            f"AdalnCache({len(self._pool)}/{self.max_plans} plans resident, width {self.max_plan_width}, "
            f"{self.spec.num_layers} layers, {self.precision}, {self.device})"
        )

    # -- identity ---------------------------------------------------------------------------

    def _drop_all(self, why: str) -> None:
        """Forget every device and host-tier plan (they were built under another identity)."""
        if len(self._pool):
            log.info("dropping %d resident plan(s): %s", len(self._pool), why)
        self._pool.clear()
        self._tiers.clear_host()

    def binding(self) -> dict[str, Any] | None:
        """Everything a stored table depends on besides its plan (stores key entries by it).

        ``None`` while the source's content digest is not known (the store is then not used).
        """
        return self._identity.binding()

    # -- build ------------------------------------------------------------------------------

    def build(
        self,
        plans: Sequence[torch.Tensor],
        *,
        embed: EmbedFn,
        project: ProjectFn | None = None,
        variant: Hashable = None,
    ) -> BuildReport:
        """Make every plan of ``plans`` resident; see the module docstring for the order of work."""
        start = time.perf_counter()
        order, tensors = distinct_plans(plans)
        report = BuildReport(plans=len(order))
        try:
            held = bool(len(self._pool) or self._tiers.host_plans())
            self._identity.check(variant, order, self._pool.items(), holds_tables=held, drop=self._drop_all)
        except (CheckpointError, BuildError) as exc:
            self.stats.failed_builds += 1
            if isinstance(exc, BuildError):
                raise  # a peer's (or this rank's) agreed checkpoint failure
            raise BuildError(f"the weight source cannot be used: {exc}", failed_at="checkpoint") from exc
        missing = [key for key in order if key not in self._pool]
        if missing:
            self._validate_request(order, missing, tensors, embed)
            self._fill(order, missing, tensors, embed, project or default_project, report)
        else:
            self._pool.touch(order)
            self.stats.device_hits += len(order)
            report.device_hits = len(order)
        report.seconds = time.perf_counter() - start
        if missing:
            log.info(
                "build: %d plan(s): %d device, %d host, %d store, %d table hits, %d built in %d pass(es), %d evicted, "
                "%.3f s", report.plans, report.device_hits, report.host_hits, report.store_hits, report.table_hits,
                report.built, report.passes, report.evicted, report.seconds,
            )  # fmt: skip
        return report

    def _validate_request(
        self, order: list[PlanKey], missing: list[PlanKey], tensors: dict[PlanKey, torch.Tensor], embed: EmbedFn
    ) -> None:
        """Reject a request the slab cannot take before touching any state (PlanError names the knob)."""
        for key in missing:
            validate_plan(tensors[key], max_plan_width=self.max_plan_width)
        if len(order) > self.max_plans:
            raise PlanError(
                f"the request needs {len(order)} distinct plans but the slab holds {self.max_plans}: raise "
                f"max_plans (CLI --max-plans) to at least {len(order)}, or split the request"
            )
        if not callable(embed):
            raise PlanError("build() needs embed=, a function plan -> (len(plan), in_features) input rows")

    def _fill(
        self,
        order: list[PlanKey],
        missing: list[PlanKey],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn,
        project: ProjectFn,
        report: BuildReport,
    ) -> None:
        """Steps 3-6 of the module docstring for the ``missing`` plans of a validated request."""
        report.device_hits = len(order) - len(missing)
        bytes_before = self.source.bytes_read
        try:
            from_host, from_store, from_tables = self._tiers.lookup(
                missing, identity=self._identity, faults=self.fault_points
            )
        except BaseException as exc:
            raise self._lookup_failed(exc, len(missing)) from exc
        restored = {**from_host, **from_store, **from_tables}
        to_build = [k for k in missing if k not in restored]
        if to_build and not getattr(self.source, "serves_weights", True):
            where = f"the table files ({self._tiers.tables.searched()})" if self._tiers.tables else "no tier"
            raise PlanNotCachedError(
                f"plan {format_plan(to_build[0])} ({len(to_build)} plan(s) of this request) is not in {where} and "
                f"this cache has no weight source to build it: pass checkpoint= (enable_adaln_cache, or a "
                f"CheckpointSource), or export these tables (adalncache export CHECKPOINT --task T --steps N -o FILE)"
            )
        try:
            if to_build:  # a pass follows: it hashes only if no memo knows the digest (every rank asks here)
                self._identity.content.resolve()
            # One build per fleet: another process may be building these very entries.
            served = self._tiers.claim(to_build, identity=self._identity, report=report)
        except BaseException as exc:
            self._tiers.release_claim()
            raise self._lookup_failed(exc, len(missing)) from exc
        from_store.update(served)
        restored.update(served)
        to_build = [k for k in to_build if k not in served]
        hashed_before = self.stats.hashed_bytes
        reservation = self._pool.reserve(missing, set(order))
        self.stats.evicted_plans += len(reservation.evicted)
        report.evicted = len(reservation.evicted)
        try:
            self._write_and_publish(reservation, restored, to_build, tensors, embed, project, report)
        except BaseException as exc:
            self._pool.release(reservation.slots)
            self._tiers.release_claim()
            self.stats.failed_builds += 1
            if isinstance(exc, BuildError):
                raise
            phase = failure_phase(exc) or "build"
            raise BuildError(
                f"build of {len(missing)} plan(s) failed at {phase}: {type(exc).__name__}: {exc}; nothing "
                f"of this request was published and a retry rebuilds it",
                rank=self._dist.rank if self._dist.world > 1 else None,
                failed_at=phase,
            ) from exc
        self._pool.touch(order)
        report.host_hits, report.store_hits, report.table_hits = len(from_host), len(from_store), len(from_tables)
        report.built = len(to_build)
        report.passes = 1 if to_build else 0
        if to_build:
            try:  # every rank got here: the pass succeeded everywhere (the digest agreement is a collective)
                self._identity.content.after_pass()
            except Exception as exc:
                log.warning("content digest not learnt from the pass (%s); store writes are skipped", exc)
        report.hashed_bytes = self.stats.hashed_bytes - hashed_before
        report.bytes_read = self.source.bytes_read - bytes_before
        self.stats.record(report)
        # After publish: copies only. A tier failure is counted and logged, never raised.
        self._tiers.write(
            order, to_build, rows_of=self.rows_of, binding=self._identity.binding, faults=self.fault_points,
            report=report,
        )  # fmt: skip

    def _lookup_failed(self, exc: BaseException, plans: int) -> BuildError:
        """The BuildError of a failure before any slot is reserved (nothing to undo).

        Tier errors fall through to a rebuild inside the lookup; only an interrupt (or another
        BaseException) gets here, and the contract still owes the caller a BuildError.
        """
        self.stats.failed_builds += 1
        return BuildError(
            f"build of {plans} plan(s) failed at tier lookup: {type(exc).__name__}: {exc}; nothing "
            f"of this request was published and a retry rebuilds it",
            failed_at="tier lookup",
        )

    def _write_and_publish(
        self,
        reservation: Reservation,
        restored: dict[PlanKey, PlanRows],
        to_build: list[PlanKey],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn,
        project: ProjectFn,
        report: BuildReport,
    ) -> None:
        """Write every reserved slot, agree with the other ranks, publish. Raises on any failure."""
        slots = reservation.slots
        # Local work only up to the agreement: no collective runs in here, so a failure on one
        # rank can never leave a peer blocked waiting for it.
        failure: BaseException | None = None
        try:
            for key, rows in restored.items():
                self._slab.write_rows(slots[key], rows)
            if to_build:
                self._rebuild_pass().run(to_build, slots, tensors, embed, project, report)
            with failing_at("publish"):
                self.fault_points.check("publish")
        except BaseException as exc:
            failure = exc
        # Every rank learns whether any rank failed before anyone exchanges results.
        self._dist.raise_if_any_failed(failure, "build")
        if failure is not None:
            raise failure
        if to_build:
            shared: BaseException | None = None
            try:
                self._dist.share_results(self._slab, [slots[k] for k in to_build], [len(k) for k in to_build])
            except BaseException as exc:
                shared = exc
            # Publish only once every rank holds every row.
            self._dist.raise_if_any_failed(shared, "exchange of results")
            if shared is not None:
                raise shared
        keys = list(slots)
        self._slab.publish([slots[k] for k in keys], [tensors[k] for k in keys])
        # The host-side map is what lookups consult: it changes last, all at once.
        self._pool.commit(slots)

    def _rebuild_pass(self) -> RebuildPass:
        return RebuildPass(
            spec=self.spec, source=self.source, slab=self._slab, collective=self._dist, precision=self.precision,
            read_ahead=self.read_ahead, progress=self.progress, batched=self.batched, faults=self.fault_points,
            digests=self._identity.content.pass_sink(),
        )  # fmt: skip

    def rows_of(self, key: PlanKey) -> PlanRows:
        """A copy of a resident plan's rows, on the cache device (tiers and verify read these)."""
        return self._slab.read_rows(self._pool.require(key), len(key))

    # -- lookups ----------------------------------------------------------------------------

    def resolve_slots(self, plans: Sequence[torch.Tensor], *, keys: Sequence[PlanKey] | None = None) -> torch.Tensor:
        """One slot per plan as a LongTensor on the cache device (pass ``keys`` to skip device syncs)."""
        if keys is None:
            keys = [plan_key(p) for p in plans]
        slots = [self._pool.require(k) for k in keys]
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)

    def lookup(self, plan: torch.Tensor, *, key: PlanKey | None = None) -> torch.Tensor:
        """The slot of a resident plan as a 0-d LongTensor on the cache device."""
        return self._slab.index(self._pool.require(plan_key(plan) if key is None else key))

    def block_rows(self, layer: int, slot: int | torch.Tensor, num_timesteps: int) -> torch.Tensor:
        """``Y`` of block ``layer``: the ``(num_timesteps, block_width)`` output of its projection."""
        return self._slab.block_rows(layer, slot, num_timesteps)

    def block(self, layer: int, slot: int | torch.Tensor, num_timesteps: int) -> tuple[torch.Tensor, ...]:
        """The six ``(num_timesteps * modalities, hidden)`` tensors, as ``Y.view(-1, 6H).chunk(6, -1)``."""
        rows = self.block_rows(layer, slot, num_timesteps)
        return rows.reshape(-1, 6 * self.spec.hidden_size).chunk(6, dim=-1)

    def block_all(self, slot: int | torch.Tensor, num_timesteps: int) -> list[tuple[torch.Tensor, ...]]:
        """:meth:`block` for every layer from one gather of the slot."""
        rows = self._slab.block_all_rows(slot, num_timesteps)
        width = 6 * self.spec.hidden_size
        return [rows[:, layer].reshape(-1, width).chunk(6, dim=-1) for layer in range(self.spec.num_layers)]

    def final_rows(self, slot: int | torch.Tensor, num_timesteps: int) -> torch.Tensor:
        """``Z``: the ``(num_timesteps, final_width)`` output of the output-layer projection."""
        return self._slab.final_rows(slot, num_timesteps)

    def final(self, slot: int | torch.Tensor, num_timesteps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shift, scale)`` of the output layer."""
        shift, scale = self.final_rows(slot, num_timesteps).chunk(2, dim=-1)
        return shift, scale

    # -- maintenance ------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Empty the slab and the host tier. Store entries stay: they are keyed by content, never stale."""
        self._pool.clear()
        self._tiers.clear_host()

    def check_invariants(self) -> None:
        """Assert the bookkeeping invariants (:mod:`adalncache.slots`; tests call this after every step)."""
        self._pool.check_invariants()
        self._tiers.check_invariants()


__all__ = ["PRECISIONS", "SHARD_MODES", "AdalnCache", "AdalnCacheError", "BuildReport", "CacheStats"]
