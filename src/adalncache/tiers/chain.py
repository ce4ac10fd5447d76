"""The tiers below the slab, cheapest first: the host tier, then the store, then read-only table files.

One object for all of them because a build asks one question before a pass (which missing plans can be
restored, and from where?) and gives one instruction after publish (keep copies), under rules the same for
every tier: a tier is only a cache (a failed lookup falls through, a failed write is counted, never raised),
and the ranks of a group agree on its hits before any uses them (docs/distributed.md, docs/tables.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..errors import ConfigError
from ..options import flag
from ..plans import PlanKey
from ..reports import BuildReport, CacheStats, FaultPoints
from ..slab import PlanRows
from ..spec import ModulationSpec
from .host import HostTier
from .store import NO_CLAIM, POLL_S, BuildLocks, Claim, Staleness, Store, plan_hash
from .tables import TablesArg, TablesTier

if TYPE_CHECKING:
    from ..distributed import Collective
    from ..identity.binding import TableIdentity

log = logging.getLogger(__name__)

#: Seconds a store found unwritable is left alone before its writes and locks are tried again.
UNWRITABLE_RETRY_S = 60.0


class Restored(NamedTuple):
    """The missing plans each tier can restore (agreed by every rank)."""

    host: dict[PlanKey, PlanRows]
    store: dict[PlanKey, PlanRows]
    tables: dict[PlanKey, PlanRows]


class TierChain:
    """The host tier and the store of one cache (either may be absent), with their lookup and write rules."""

    def __init__(
        self,
        spec: ModulationSpec,
        source: Any,
        *,
        host_cache_bytes: int,
        store: Store | str | Any,
        device: torch.device,
        collective: Collective,
        stats: CacheStats,
        tables: TablesArg | None = None,
    ) -> None:
        """The host tier (``host_cache_bytes > 0``), the store (``store=``) and table files (``tables=``)."""
        cuda = device.type == "cuda"
        self.host = HostTier(spec, host_cache_bytes, pin=cuda, device=device) if host_cache_bytes > 0 else None
        if store is not None and not getattr(source, "persistent", True):
            # An in-memory source's fingerprint names addresses in this process: its entries could
            # never be found again, so they would only fill the disk.
            raise ConfigError(
                f"store= needs a source whose identity survives the process (a CheckpointSource), got "
                f"{type(source).__name__}: pass the checkpoint path (an integration's checkpoint=, CLI "
                f"CHECKPOINT), or drop store= ({flag('store')})"
            )
        self.spec = spec
        self.store = None if store is None else store if isinstance(store, Store) else Store(store)
        self.tables = None if tables is None else TablesTier(tables, spec, source=source)
        #: The entry locks held by the build in progress (one build per fleet), released after its store write.
        self._claim: Claim = NO_CLAIM
        self._dist = collective
        #: The cache's counters (the same object): tier hits are counted by the cache, the tiers'
        #: own events (pressure skips, evictions, write failures, corrupt entries) here.
        self.stats = stats
        #: Until when (monotonic) the store's writes and locks are skipped: it could not be written.
        self._unwritable_until = 0.0
        #: Whether the build in progress was already counted in ``store_unwritable``.
        self._counted_unwritable = False
        self._warned_unwritable = False

    def lookup(
        self, missing: Sequence[PlanKey], *, identity: TableIdentity, faults: FaultPoints, embed: Any = None
    ) -> Restored:
        """Plans every rank can restore from the host tier, then the store, then table files (cheapest first).

        ``embed``: the build's ``embed(plan)`` (None without one), which a table file that records its rows'
        projection input is checked against. The store is asked only under a known binding (a hashing read
        first where it pays: :meth:`_binding`). Only an interrupt (not an ``Exception``) escapes.
        """
        self._counted_unwritable = False  # a new build (every build with something missing starts here)
        host, store, tables = self.host, self.store, self.tables

        def read_host(keys: list[PlanKey]) -> dict[PlanKey, PlanRows]:
            faults.check("host_read")
            return host.lookup(keys) if host is not None else {}

        def read_store(keys: list[PlanKey]) -> dict[PlanKey, PlanRows]:
            faults.check("store_read")
            bound = self._binding(identity, keys)
            return store.get_many(bound, keys, self.spec) if store is not None and bound is not None else {}

        def read_tables(keys: list[PlanKey]) -> dict[PlanKey, PlanRows]:
            return tables.lookup(keys, identity, agree=self._dist.any_of, embed=embed) if tables is not None else {}

        from_host = self._agreed(list(missing), "host tier", read_host) if host is not None else {}
        rest = [k for k in missing if k not in from_host]
        from_store = self._agreed(rest, "store", read_store) if store is not None and rest else {}
        if store is not None:
            self.stats.store_corrupt = store.corrupt_moved
        rest = [k for k in rest if k not in from_store]
        from_tables: dict[PlanKey, PlanRows] = {}
        if tables is not None and rest and identity.variant is None:
            from_tables = self._agreed(rest, "table file", read_tables)
            self.stats.tables_corrupt = tables.corrupt
        return Restored(from_host, from_store, from_tables)

    def _agreed(
        self, keys: list[PlanKey], what: str, read: Callable[[list[PlanKey]], dict[PlanKey, PlanRows]]
    ) -> dict[PlanKey, PlanRows]:
        """What every rank restores of ``keys`` with ``read``; a failure is a miss (a tier is only a cache)."""
        found: dict[PlanKey, PlanRows] = {}
        try:
            found = read(keys)
        except Exception as exc:
            log.warning("%s lookup failed (%s); rebuilding instead", what, exc)
        agreed = self._dist.agree_on([k in found for k in keys])
        return {k: found[k] for k, ok in zip(keys, agreed) if ok}

    def _binding(
        self, identity: TableIdentity, rest: Sequence[PlanKey], *, count: bool = True
    ) -> dict[str, Any] | None:
        """The store binding; a hashing read first when the store probably holds these plans under it."""
        assert self.store is not None
        bound = identity.current_binding()
        if bound is not None:
            return bound
        # Every rank asks the same question at the same point (the digest is unknown on all or none).
        worth = self.store.holds_other_content(identity.template(), rest)
        if self._dist.any_of([worth])[0]:
            log.info(
                "store %s holds these plans for another copy of these weights: hashing the checkpoint once",
                self.store.path,
            )
            identity.content.identify()
            bound = identity.current_binding()
        if bound is None and count:
            identity.content.note_unknown("store lookup")
        return bound

    def claim(
        self, to_build: Sequence[PlanKey], *, identity: TableIdentity, report: BuildReport
    ) -> dict[PlanKey, PlanRows]:
        """Claim the store entries this build is about to compute, or wait for another process building them.

        Returns the plans that appeared in the store meanwhile; the caller builds the rest, holding the locks
        until :meth:`write` (or :meth:`release_claim`). A process group never locks: its ranks already build
        once together, and a wait inside a collective build would stall every rank.
        """
        self.release_claim()
        store = self.store
        if store is None or not to_build or self._dist.world > 1 or store.lock_wait_s <= 0 or self._store_skipped():
            return {}
        # Named without the content digest, which a cold process does not know yet: every process
        # about to build the same entries (same settings, same checkpoint files, copies included)
        # meets at the same lock files.
        namespace = identity.lock_namespace()
        locks = BuildLocks(store.path / "locks")
        todo = {key: plan_hash(key) for key in to_build}
        served: dict[PlanKey, PlanRows] = {}
        start = time.monotonic()
        watch = Staleness(store.lock_stale_s)
        pause, waited = POLL_S[0], False
        while todo:
            try:
                claim, busy = locks.try_claim(namespace, todo)
            except OSError as exc:  # the locks only save work: without them this process builds alone
                self._unwritable(exc, "its entry locks", mark=exc.errno in Store.UNWRITABLE)
                break
            if waited:
                # A holder writes its entries before it lets go: what exists now is restored, not
                # rebuilt. (It records the content digest first, so a waiter on the same host learns
                # it from the memo; one on another host, by a hashing read once the entries exist.)
                bound = self._binding(identity, list(todo), count=False)
                present = store.contains(bound, list(todo)) if bound is not None else set()
                found = store.get_many(bound, sorted(present), self.spec) if bound is not None and present else {}
                served.update(found)
                claim.drop(list(found))
                todo = {k: h for k, h in todo.items() if k not in found}
                busy = [k for k in busy if k in todo]
            if claim or not todo:
                self._claim = claim  # all, or some, are ours: build what is left now (busy ones duplicated)
                break
            waited = True
            elapsed = time.monotonic() - start
            if watch.stale(locks.beat(namespace, todo[busy[0]])) or elapsed > store.lock_wait_s:
                why = "its heartbeat stopped" if elapsed <= store.lock_wait_s else f"waited {elapsed:.0f} s"
                log.warning(
                    "store %s: another process holds %d entries but %s; building them here", store.path, len(todo), why
                )
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        if waited:
            report.waited_s = time.monotonic() - start
            self.stats.lock_waits += 1
        return served

    def release_claim(self) -> None:
        """Release the entry locks of the build in progress (failure paths; :meth:`write` does it too)."""
        claim, self._claim = self._claim, NO_CLAIM
        claim.release()

    def write(
        self,
        order: Sequence[PlanKey],
        built: Sequence[PlanKey],
        *,
        rows_of: Callable[[PlanKey], PlanRows],
        binding: Callable[[], dict[str, Any] | None],
        faults: FaultPoints,
        report: BuildReport,
    ) -> None:
        """Copy published plans to the tiers: the request's group to the host tier, ``built`` to the store.

        Never raises an ``Exception`` (a failure is counted in the stats and the report, and logged); the
        entry locks of the build are released at the end.
        """
        try:
            if self.host is not None:
                try:
                    faults.check("host_write")
                    if not self.host.admit(order, rows_of):
                        self.stats.host_pressure_skips += 1
                except Exception as exc:
                    self._failed(report, 1, "host tier write", exc)
                self.stats.host_evicted = self.host.evicted_plans
            # Every rank writes the plans it built: its entries are bound to its own numeric environment, so a
            # single writer would leave the other ranks missing forever (docs/distributed.md); ranks sharing one
            # directory and binding write the same bytes, which the store's atomic rename makes safe.
            if self.store is None or not built or self._store_skipped():
                return
            try:
                faults.check("store_write")
                bound = binding()
            except Exception as exc:
                self._failed(report, 1, "store write", exc)
                return
            if bound is None:
                # The content digest is still unknown (a column split that cuts leaves, weights that
                # cannot be hashed): an entry could never be found again, so none is written.
                log.info("store write of %d plan(s) skipped: the weights' content digest is not known", len(built))
                return
            # One entry per file: a failing entry (a full disk, a permission) must not keep the
            # others out, and each failure is counted so `adalncache build` can report them.
            failed: list[BaseException] = []
            no_room: list[OSError] = []
            for key in built:
                try:
                    self.store.put(bound, key, rows_of(key))
                except OSError as exc:
                    failed.append(exc)
                    if exc.errno in Store.READ_ONLY:  # the next entries would fail alike
                        self._unwritable(exc, "its writes", mark=True)
                        break
                    if exc.errno in Store.UNWRITABLE:
                        no_room.append(exc)
                except Exception as exc:
                    failed.append(exc)
            if no_room and len(no_room) == len(built):
                # Not one entry found room: the disk is full (one entry failing alone is just counted).
                self._unwritable(no_room[0], "its writes", mark=True)
            if failed:
                what = f"store write of {len(failed)} of {len(built)} plan(s)"
                self._failed(report, len(failed), what, failed[0], quiet=self._warned_unwritable)
        finally:
            self.release_claim()

    def _failed(self, report: BuildReport, count: int, what: str, exc: BaseException, *, quiet: bool = False) -> None:
        self.stats.tier_write_failures += count
        report.tier_write_failures += count
        (log.debug if quiet else log.warning)("%s failed after publish (slab unaffected): %s", what, exc)

    def _store_skipped(self) -> bool:
        """Whether the store's writes and locks are skipped for this build (it was found unwritable lately)."""
        if time.monotonic() >= self._unwritable_until:
            return False
        self._count_unwritable()
        return True

    def _count_unwritable(self) -> None:
        if not self._counted_unwritable:
            self._counted_unwritable = True
            self.stats.store_unwritable += 1

    def _unwritable(self, exc: OSError, what: str, *, mark: bool) -> None:
        """The store refused ``what``: count the build, log the first time, skip the store for a while (``mark``)."""
        self._count_unwritable()
        if mark:
            self._unwritable_until = time.monotonic() + UNWRITABLE_RETRY_S
        assert self.store is not None
        if self._warned_unwritable:
            log.debug("store %s: %s failed (%s); building without them", self.store.path, what, exc)
            return
        self._warned_unwritable = True
        log.warning(
            "store %s cannot be written (%s: %s): its hits are still served, but this cache builds without its locks "
            "and writes, counted in store_unwritable (tried again after %.0f s)",
            self.store.path,
            what,
            exc,
            UNWRITABLE_RETRY_S,
        )

    def host_plans(self) -> int:
        return len(self.host) if self.host is not None else 0

    def clear_host(self) -> None:
        """Forget the host tier's copies (the store's entries stay: they are keyed by fingerprint)."""
        if self.host is not None:
            self.host.clear()

    def release(self) -> int:
        """Give the host tier's arena back (the store keeps its files); returns the bytes released."""
        return self.host.release() if self.host is not None else 0

    def check_invariants(self) -> None:
        if self.host is not None:
            self.host.check_invariants()


__all__ = ["UNWRITABLE_RETRY_S", "TierChain"]
