"""One build that reaches past the hit path, run as a transaction: all of it becomes visible, or none.

:class:`BuildTransaction` runs the steps of docs/state-machine.md ("One build, step by step") in their
order. A failure before publish releases the reserved slots and raises :class:`~adalncache.BuildError`
(``__cause__`` the original error); an interrupt (a ``BaseException`` that is not an ``Exception``) gets
the same rollback and then propagates as itself, so Ctrl-C stops the program.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .devices import StreamSync
from .distributed import Collective
from .errors import BuildError, CheckpointError, ConfigError, PlanError, PlanNotCachedError, failing_at, failure_phase
from .identity import autocast_dtype
from .identity.binding import TableIdentity
from .options import CacheOptions, flag, knob
from .plans import PlanKey, format_plan, key_to_plan, plan_key, validate_plan
from .rebuild import EmbedFn, ProjectFn, RebuildPass
from .reports import BuildReport, CacheStats, FaultPoints
from .slab import PlanRows, Reservation, Slab, SlotPool
from .source import WeightSource
from .spec import ModulationSpec
from .tiers.chain import TierChain

if TYPE_CHECKING:
    from .tiers.tables import TablesTier

log = logging.getLogger(__name__)


_NEEDS_EMBED = (
    "build() needs embed=, a function plan -> (len(plan), in_features) input rows (or a mapping of them by input name)"
)


def _no_embed(plan: torch.Tensor) -> torch.Tensor:
    """The embed of a build given none: its source serves no weights, so no pass ever calls it."""
    raise PlanError(_NEEDS_EMBED)


def _interrupt(exc: BaseException) -> BaseException | None:
    """The interrupt behind ``exc`` (itself, or the cause of this rank's BuildError), if it is one."""
    root = exc.__cause__ if isinstance(exc, BuildError) else exc
    if root is not None and not isinstance(root, Exception):
        return root
    return None


def _failed(plans: int, phase: str, exc: BaseException, rank: int | None = None) -> BuildError:
    """The BuildError of a build of ``plans`` plans that failed at ``phase`` with ``exc`` (its cause)."""
    return BuildError(
        f"build of {plans} plan(s) failed at {phase}: {type(exc).__name__}: {exc}; nothing of this request was "
        f"published and a retry rebuilds it",
        rank=rank,
        failed_at=phase,
    )


@dataclass(frozen=True)
class Placement:
    """Where a cache builds and serves: the device, its tier chain, and the table files of ``tables=``
    (``tiers.tables`` is them where their binding fits this device, else None)."""

    device: torch.device
    tiers: TierChain
    files: TablesTier | None


@dataclass(eq=False)
class Site:
    """The one owner of a cache's current :class:`Placement`: the cache, its identity and its build
    transaction read the device and tiers here, so a move replaces them with one assignment."""

    placement: Placement

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def tiers(self) -> TierChain:
        return self.placement.tiers


@dataclass(eq=False)
class BuildTransaction:
    """Runs the builds of one cache (one at a time) on the cache's parts. ``lock``, the cache's state lock,
    is held while the slot map, the stats or the identity change (never during a pass)."""

    spec: ModulationSpec
    options: CacheOptions
    source: WeightSource
    slab: Slab
    pool: SlotPool
    site: Site
    identity: TableIdentity
    collective: Collective
    stats: CacheStats
    sync: StreamSync
    lock: threading.RLock
    faults: Callable[[], FaultPoints]

    @property
    def _tiers(self) -> TierChain:
        return self.site.tiers

    def checked_autocast(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype a build on ``device`` runs under, refused when the slab cannot hold it exactly."""
        dtype = autocast_dtype(device)
        if dtype is None:
            return None
        spec = self.spec
        if self.options.precision == "fp32":
            raise ConfigError(
                f"precision='fp32' projects in fp32, but torch.autocast({device.type!r}) makes the "
                f"projection run in {dtype}: build outside autocast, or use precision='match' (CLI {flag('precision')})"
            )
        if spec.dtype != dtype and spec.dtype != torch.float32:
            raise ConfigError(
                f"under torch.autocast to {dtype} the projections return {dtype}, which the slab's {spec.dtype} "
                f"cannot hold exactly: run without autocast, or with autocast to {spec.dtype}"
            )
        return dtype

    # -- the whole build ----------------------------------------------------------------------

    def run(
        self,
        order: list[PlanKey],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn | None,
        project: ProjectFn,
        variant: Hashable,
        report: BuildReport,
    ) -> None:
        """Make every plan of ``order`` resident; fills ``report``. ``embed`` may be ``None`` only for a
        source that serves no weights."""
        autocast = self.checked_autocast(self.site.device)
        self.sync.begin_build()
        try:
            self._check_identity(variant, autocast, order)
            with self.lock:
                missing = [key for key in order if key not in self.pool]
                if not missing:
                    self.pool.touch(order)
                    self.stats.device_hits += len(order)
                    report.device_hits = len(order)
                    return
            self._validate_request(order, missing, tensors, embed)
            self._fill(order, missing, tensors, embed if embed is not None else _no_embed, project, report)
        finally:
            self.sync.end_build()

    def _check_identity(self, variant: Hashable, autocast: torch.dtype | None, order: list[PlanKey]) -> None:
        """The identity check; a source that no longer validates is a BuildError (``failed_at="checkpoint"``)."""
        with self.lock:
            held = bool(len(self.pool) or self._tiers.host_plans())
            resident = self.pool.items()
        try:
            self.identity.check(variant, autocast, order, resident, holds_tables=held, drop=self.drop_all)
        except (CheckpointError, BuildError) as exc:
            self._count_failure()
            if isinstance(exc, BuildError):
                raise  # a peer's (or this rank's) agreed checkpoint failure
            raise BuildError(f"the weight source cannot be used: {exc}", failed_at="checkpoint") from exc
        except BaseException as exc:
            if _interrupt(exc) is not None:
                self._count_failure()
            raise

    def drop_all(self, why: str) -> None:
        """Forget every device and host-tier plan (they were built under another identity)."""
        with self.lock:
            if len(self.pool):
                log.info("dropping %d resident plan(s): %s", len(self.pool), why)
            self.pool.clear()
            self._tiers.clear_host()

    def _count_failure(self) -> None:
        with self.lock:
            self.stats.failed_builds += 1

    # -- validation ---------------------------------------------------------------------------

    def _validate_request(
        self, order: list[PlanKey], missing: list[PlanKey], tensors: dict[PlanKey, torch.Tensor], embed: EmbedFn | None
    ) -> None:
        """Reject a request the slab cannot take before touching any state (PlanError names the knob)."""
        options = self.options
        columns = self.spec.plan_columns
        for key in missing:
            validate_plan(tensors[key], max_plan_width=options.max_plan_width, columns=columns)
            actual = plan_key(tensors[key], columns)
            if actual != key:
                # Keys the caller computed (keys=) that are not these plans' would file a table
                # under the wrong plan: refused before anything is built.
                raise PlanError(
                    f"keys= does not match plans: the key given for plan {format_plan(actual, columns=columns)} is "
                    f"{format_plan(key, columns=columns)}; pass keys=[plan_key(p) for p in plans]"
                )
        if len(order) > options.max_plans:
            raise PlanError(
                f"the request needs {len(order)} distinct plans but the slab holds {options.max_plans}: raise "
                f"{knob('max_plans')} to at least {len(order)}, or split the request"
            )
        if not callable(embed) and (embed is not None or getattr(self.source, "serves_weights", True)):
            raise PlanError(_NEEDS_EMBED)
        with self.lock:
            free, evictable = self.pool.room(order)
            message = self.pool.no_room_message(len(missing), order) if len(missing) > free + evictable else None
        # Holds are local state: every rank must refuse together, or the others would wait in the pass.
        if self.collective.any_of([message is not None])[0]:
            raise PlanError(message or "another rank cannot find room for this request beside its held plans")

    # -- tiers, reserve, write, agree, publish, copy -------------------------------------------

    def _fill(
        self,
        order: list[PlanKey],
        missing: list[PlanKey],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn,
        project: ProjectFn,
        report: BuildReport,
    ) -> None:
        report.device_hits = len(order) - len(missing)
        bytes_before = self.source.bytes_read
        faults = self.faults()
        from_host, from_store, from_tables, to_build = self._restorable(missing, report, faults, embed)
        restored = {**from_host, **from_store, **from_tables}
        hashed_before = self.stats.hashed_bytes
        with self.lock:
            reservation = self.pool.reserve(missing, set(order))
            self.stats.evicted_plans += len(reservation.evicted)
        report.evicted = len(reservation.evicted)
        try:
            self._write_and_publish(reservation, restored, to_build, tensors, embed, project, report, faults)
        except BaseException as exc:
            self._tiers.release_claim()
            with self.lock:
                self.pool.release(reservation.slots)
                self.stats.failed_builds += 1
            interrupt = _interrupt(exc)
            if interrupt is not None:
                try:
                    raise interrupt from None  # Ctrl-C is the user's: rolled back, then propagated as itself
                finally:
                    del interrupt  # this frame is in its traceback: kept, it would make a reference cycle
            if isinstance(exc, BuildError):
                raise
            rank = self.collective.rank if self.collective.world > 1 else None
            raise _failed(len(missing), failure_phase(exc) or "build", exc, rank) from exc
        report.host_hits, report.store_hits, report.table_hits = len(from_host), len(from_store), len(from_tables)
        report.built = len(to_build)
        report.passes = 1 if to_build else 0
        report.hashed_bytes = self.stats.hashed_bytes - hashed_before
        report.bytes_read = self.source.bytes_read - bytes_before
        with self.lock:
            self.pool.touch(order)
            self.stats.record(report)
        log.info(
            "build: %d plan(s): %d device, %d host, %d store, %d table hits, %d built in %d pass(es), %d evicted",
            report.plans,
            report.device_hits,
            report.host_hits,
            report.store_hits,
            report.table_hits,
            report.built,
            report.passes,
            report.evicted,
        )
        # After publish: copies only. A tier failure is counted and logged, never raised.
        self._tiers.write(
            order, to_build, rows_of=self.rows_of, binding=self.identity.binding, faults=faults, report=report
        )

    def _restorable(
        self, missing: list[PlanKey], report: BuildReport, faults: FaultPoints, embed: EmbedFn
    ) -> tuple[dict[PlanKey, PlanRows], dict[PlanKey, PlanRows], dict[PlanKey, PlanRows], list[PlanKey]]:
        """What the tiers restore of ``missing`` (host, store with the entries claimed, table files), and
        what a pass must build: refused (PlanNotCachedError) when there is no weight source to build it."""
        try:
            from_host, from_store, from_tables = self._tiers.lookup(
                missing, identity=self.identity, faults=faults, embed=None if embed is _no_embed else embed
            )
        except BaseException:
            # Tier errors fall through to a rebuild inside the lookup; only an interrupt (or
            # another BaseException) gets here. Nothing is reserved yet, so there is nothing to undo.
            self._count_failure()
            raise
        restored = {**from_host, **from_store, **from_tables}
        to_build = [k for k in missing if k not in restored]
        if to_build and not getattr(self.source, "serves_weights", True):
            self._count_failure()
            where = f"the table files ({self._tiers.tables.searched()})" if self._tiers.tables else "no tier"
            raise PlanNotCachedError(
                f"plan {format_plan(to_build[0], columns=self.spec.plan_columns)} ({len(to_build)} plan(s) "
                f"of this request) is not in {where} and "
                f"this cache has no weight source to build it: pass checkpoint= (an integration's, or a "
                f"CheckpointSource), or export these tables (adalncache export CHECKPOINT {flag('task')} T "
                f"{flag('steps')} N {flag('output').split('/')[0]} FILE)"
            )
        try:
            if to_build:  # a pass follows: it hashes only if no memo knows the digest (every rank asks here)
                self.identity.content.resolve()
            # One build per fleet: another process may be building these very entries.
            served = self._tiers.claim(to_build, identity=self.identity, report=report)
        except BaseException as exc:
            self._tiers.release_claim()
            self._count_failure()
            if _interrupt(exc) is not None or isinstance(exc, BuildError):
                raise
            raise _failed(len(missing), "tier lookup", exc) from exc
        from_store.update(served)
        return from_host, from_store, from_tables, [k for k in to_build if k not in served]

    def _write_and_publish(
        self,
        reservation: Reservation,
        restored: dict[PlanKey, PlanRows],
        to_build: list[PlanKey],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn,
        project: ProjectFn,
        report: BuildReport,
        faults: FaultPoints,
    ) -> None:
        """Write every reserved slot, agree with the other ranks, publish. Raises on any failure."""
        slots = reservation.slots
        # Local work only up to the agreement: no collective runs in here, so a failure on one
        # rank can never leave a peer blocked waiting for it. Every rank learns whether any rank
        # failed before anyone exchanges results (a failure is agreed inside its except block, which
        # drops it after: kept in a local, this frame would sit in its own traceback, a cycle).
        try:
            for key, slot in slots.items():
                self.slab.lay_out(slot, key)
            for key, rows in restored.items():
                self.slab.write_rows(slots[key], rows)
            if to_build:
                with failing_at("checkpoint"):
                    # The files' identity settles first (a file written in the last milliseconds could
                    # change again without its ctime moving), then must still be what the identity check accepted.
                    sink = self.identity.content.pass_sink()
                    self._check_unchanged("before its pass")
                rebuild = RebuildPass(
                    self.spec,
                    self.source,
                    self.slab,
                    self.collective,
                    self.options,
                    faults,
                    out_dtype=self.identity.autocast,
                    digests=sink,
                )
                rebuild.run(to_build, slots, tensors, embed, project, report)
            with failing_at("checkpoint"):
                # Rewritten or replaced since the identity check (mid-pass, say): what was read may mix old and new
                # bytes, and restored rows may be of the old ones; none of it is published.
                self._check_unchanged("while it was built" if to_build else "while its rows were restored")
            with failing_at("publish"):
                faults.check("publish")
        except BaseException as exc:
            self.collective.raise_if_any_failed(exc, "build")
            raise
        self.collective.raise_if_any_failed(None, "build")
        if to_build:
            # Every rank read its share with no file changing: compose the digest of what was read (a
            # collective). Bytes that hash to another digest than the one bound fail every rank alike.
            try:
                with failing_at("checkpoint"):
                    self.identity.after_pass()
            except CheckpointError:
                self.drop_all("the bytes read are not the content the resident tables were built from")
                raise
            except Exception as exc:
                log.warning("content digest not learnt from the pass (%s); store writes are skipped", exc)
            # Publish only once every rank holds every row.
            try:
                counts = [len(self.slab.layout(slots[k], self.spec.plan_rows(k))[0]) for k in to_build]
                self.collective.share_results(self.slab, [slots[k] for k in to_build], counts)
            except BaseException as exc:
                self.collective.raise_if_any_failed(exc, "exchange of results")
                raise
            self.collective.raise_if_any_failed(None, "exchange of results")
        keys = list(slots)
        columns = self.spec.plan_columns
        with self.lock:
            # Timesteps from the keys, not from the callers' tensors: the slab holds exactly what the map says.
            self.slab.publish([slots[k] for k in keys], [key_to_plan(k, columns) for k in keys])
            # The host-side map is what lookups consult: it changes last, all at once.
            self.pool.commit(slots)

    def _check_unchanged(self, stage: str) -> None:
        """CheckpointError naming the files if the source is no longer what this build's identity check accepted."""
        changed_files = getattr(self.source, "changed_files", None)
        changed = list(changed_files()) if callable(changed_files) else []
        if not changed and self.source.fingerprint != self.identity.fingerprint:
            changed = list(getattr(self.source, "files", None) or [type(self.source).__name__])
        if changed:
            raise CheckpointError(
                f"checkpoint file {', '.join(str(p) for p in changed)} changed on disk (rewritten or replaced) after "
                f"this build checked it, {stage}: nothing of this request is published; build again to read the "
                f"new bytes"
            )

    def rows_of(self, key: PlanKey) -> PlanRows:
        """A copy of a resident plan's rows, on the cache device (tiers and verify read these)."""
        with self.lock:
            slot = self.pool.require(key)
        self.sync.before_read([slot])
        rows = self.slab.read_rows(slot, self.spec.plan_rows(key))
        self.sync.after_read([slot])
        return rows
