"""The tiers below the slab, cheapest first: the host tier, then the store.

Why one object for both: the cache's build asks one question before a pass ("which missing plans
can be restored, and from where?") and gives one instruction after publish ("keep copies"), and
the rules around both are the same for every tier:

* a tier is only a cache: a lookup that fails falls through to the next tier (and finally to the
  rebuild pass); a write that fails is counted and logged, never raised, because the slab is
  already correct;
* in a process group the ranks agree (AND-reduce) on which plans *every* rank can serve from a
  tier before any rank uses it, so the ranks' slot decisions and passes stay identical;
* the host tier is asked first (a memory copy), the store second (a disk read), only for what
  the host tier did not have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..faults import FaultPoints
from ..plans import PlanKey
from ..reports import BuildReport, CacheStats
from ..rows import PlanRows
from ..spec import ModulationSpec
from .host import HostTier
from .store import Store

if TYPE_CHECKING:
    from ..distributed import Collective

log = logging.getLogger(__name__)


class TierChain:
    """The host tier and the store of one cache (either may be absent), with their lookup and write rules."""

    def __init__(
        self,
        spec: ModulationSpec,
        host: HostTier | None,
        store: Store | None,
        collective: Collective,
        stats: CacheStats,
    ) -> None:
        self.spec = spec
        self.host = host
        self.store = store
        self._dist = collective
        #: The cache's counters (the same object): tier hits are counted by the cache, the tiers'
        #: own events (pressure skips, evictions, write failures, corrupt entries) here.
        self.stats = stats

    @classmethod
    def open(
        cls,
        spec: ModulationSpec,
        source: Any,
        *,
        host_cache_bytes: int,
        store: Store | str | Any,
        device: torch.device,
        collective: Collective,
        stats: CacheStats,
    ) -> TierChain:
        """The host tier (``host_cache_bytes > 0``) and the store (``store=``, a directory or a Store)."""
        cuda = device.type == "cuda"
        host = HostTier(spec, host_cache_bytes, pin=cuda, device=device) if host_cache_bytes > 0 else None
        if store is not None and not getattr(source, "persistent", True):
            # An in-memory source's fingerprint names addresses in this process: its entries could
            # never be found again, so they would only fill the disk.
            raise ConfigError(
                f"store= needs a source whose identity survives the process (a CheckpointSource), got "
                f"{type(source).__name__}: pass the checkpoint path (checkpoint= in enable_adaln_cache, CLI "
                f"CHECKPOINT), or drop store= (--store)"
            )
        opened = None if store is None else store if isinstance(store, Store) else Store(store)
        return cls(spec, host, opened, collective, stats)

    def lookup(
        self, missing: Sequence[PlanKey], *, binding: Callable[[], dict[str, Any] | None], faults: FaultPoints
    ) -> tuple[dict[PlanKey, PlanRows], dict[PlanKey, PlanRows]]:
        """Plans every rank can restore from the host tier, then from the store (cheapest first).

        ``binding()`` gives the store binding of the current source, or ``None`` when the source
        changed since the slab's tables were built (then the store is not asked). Only an
        interrupt (a ``BaseException`` that is not an ``Exception``) escapes.
        """
        from_host: dict[PlanKey, PlanRows] = {}
        if self.host is not None:
            found = {}
            try:
                faults.check("host_read")
                found = self.host.lookup(missing)
            except Exception as exc:  # a tier is only a cache: fall through to the next one
                log.warning("host tier lookup failed (%s); rebuilding instead", exc)
            agreed = self._dist.agree_on([k in found for k in missing])
            from_host = {k: found[k] for k, ok in zip(missing, agreed) if ok}
        from_store: dict[PlanKey, PlanRows] = {}
        if self.store is not None:
            rest = [k for k in missing if k not in from_host]
            found = {}
            if rest:
                try:
                    bound = binding()
                    if bound is not None:
                        faults.check("store_read")
                        found = self.store.get_many(bound, rest, self.spec)
                except Exception as exc:
                    log.warning("store lookup failed (%s); rebuilding instead", exc)
                    found = {}
                agreed = self._dist.agree_on([k in found for k in rest])
                from_store = {k: found[k] for k, ok in zip(rest, agreed) if ok}
            self.stats.store_corrupt = self.store.corrupt_moved
        return from_host, from_store

    def write(
        self,
        order: Sequence[PlanKey],
        built: Sequence[PlanKey],
        *,
        rows_of: Callable[[PlanKey], PlanRows],
        binding: Callable[[], dict[str, Any]],
        faults: FaultPoints,
        report: BuildReport,
    ) -> None:
        """Copy published plans to the tiers: the request's group to the host tier, ``built`` to the store.

        Never raises an ``Exception``: the slab is already correct, so a failure is counted (in
        the stats and the report) and logged.
        """
        if self.host is not None:
            try:
                faults.check("host_write")
                if not self.host.admit(order, rows_of):
                    self.stats.host_pressure_skips += 1
            except Exception as exc:
                self._failed(report, 1, "host tier write", exc)
            self.stats.host_evicted = self.host.evicted_plans
        # Every rank writes the plans it built. A rank's entries are bound to its own source
        # fingerprint and numeric environment, which need not equal its peers' (local checkpoint
        # copies on several nodes): a single writer would leave the other ranks missing forever,
        # and since tier hits are AND-reduced, every rank would rebuild every time. Ranks sharing
        # one directory and fingerprint write the same bytes; the store's atomic rename makes that safe.
        if self.store is None or not built:
            return
        try:
            faults.check("store_write")
            bound = binding()
        except Exception as exc:
            self._failed(report, 1, "store write", exc)
            return
        # One entry per file: a failing entry (a full disk, a permission) must not keep the
        # others out, and each failure is counted so `adalncache build` can report them.
        failed: list[BaseException] = []
        for key in built:
            try:
                self.store.put(bound, key, rows_of(key))
            except Exception as exc:
                failed.append(exc)
        if failed:
            self._failed(report, len(failed), f"store write of {len(failed)} of {len(built)} plan(s)", failed[0])

    def _failed(self, report: BuildReport, count: int, what: str, exc: BaseException) -> None:
        self.stats.tier_write_failures += count
        report.tier_write_failures += count
        log.warning("%s failed after publish (slab unaffected): %s", what, exc)

    def host_plans(self) -> int:
        """How many plans the host tier holds (0 without one)."""
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


__all__ = ["TierChain"]
