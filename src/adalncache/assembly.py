"""Assembling a cache's parts from (spec, source, options, device), and again for another device.

Why one function: the parts of a cache (the collective, the slab, the tiers, the slot pool, the
identity, the build transaction) depend on each other in one order, and some of that order is a
protocol between ranks (what one rank fails to build, every rank must learn before any of them
enters a collective). Written out once here, the cache only decides *when* work runs.

Who owns what: :class:`~adalncache.placement.Site` is the one owner of the device and of the tier
chain (whose host tier holds device-bound copies and whose table files are served only where their
binding fits the device). The identity and the build transaction read them there; nothing else
keeps a copy, so a move is one assignment of a re-assembled placement (:func:`place`, the same
function construction uses), never a patch of fields in several objects.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .devices import allocation_error, check_available
from .distributed import Collective, make_collective
from .errors import AdalnCacheError
from .faults import FaultPoints
from .identity import device_identity
from .identity.binding import TableIdentity
from .options import CacheOptions, knob
from .placement import Placement, Site
from .relocation import HostTableStash
from .reports import CacheStats
from .slab import Slab
from .slots import SlotPool
from .source import WeightSource
from .spec import ModulationSpec
from .streams import StreamSync, events_for
from .tiers.chain import TierChain
from .tiers.host import HOST_TIER_KNOB
from .transaction import BuildSettings, BuildTransaction

if TYPE_CHECKING:
    from .tiers.tables import TablesTier

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What to lower when the slab does not fit.
SLAB_KNOBS = f"{knob('max_plans')} or {knob('max_plan_width')}"


def agreed(collective: Collective, make: Callable[[], T]) -> T:
    """``make()``, after every rank of the group learnt whether it failed on any rank.

    Out of device memory, or an unusable store directory, on one rank alone must fail every rank:
    raised before agreeing, the other ranks would wait for this one in their next collective.
    """
    try:
        result = make()
    except BaseException as exc:
        collective.agree_construction(exc)
        raise
    collective.agree_construction(None)
    return result


def place(
    spec: ModulationSpec,
    source: WeightSource,
    options: CacheOptions,
    device: torch.device,
    *,
    collective: Collective,
    stats: CacheStats,
    store: Any,
    files: TablesTier | None = None,
) -> Placement:
    """The tier chain for ``device``: a host tier of ``options.host_cache_bytes`` (pinned for CUDA),
    ``store`` (a path or an open Store), and ``options.tables`` opened (at construction) or the
    already open ``files`` (on a move; checked against the device by :func:`serve_files`)."""
    tiers = TierChain.open(
        spec,
        source,
        host_cache_bytes=options.host_cache_bytes,
        store=store,
        device=device,
        collective=collective,
        stats=stats,
        tables=options.tables if files is None else None,
    )
    return Placement(device, tiers, tiers.tables if files is None else files)


def serve_files(placement: Placement, identity: TableIdentity, *, strict: bool) -> None:
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


@dataclass
class Parts:
    """Everything :func:`assemble` builds for one cache (the cache decides when each part works)."""

    options: CacheOptions
    collective: Collective
    stats: CacheStats
    slab: Slab
    sync: StreamSync
    pool: SlotPool
    identity: TableIdentity
    builder: BuildTransaction
    stash: HostTableStash
    site: Site


def pinned(device: torch.device) -> torch.device:
    """``device`` with its index: a build or a reader thread must not land on whatever CUDA device
    is current in its own thread."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def allocate_slab(spec: ModulationSpec, options: CacheOptions, device: torch.device) -> Slab:
    """The slab, refused (ConfigError naming its bytes and the knobs) when the device cannot hold it."""
    nbytes = spec.slab_bytes(options.max_plans, options.max_plan_width)
    what = f"the slab of max_plans={options.max_plans} x max_plan_width={options.max_plan_width} plans"
    check_available(nbytes, device, what, SLAB_KNOBS)
    try:
        return Slab(spec, options.max_plans, options.max_plan_width, device)
    except (RuntimeError, MemoryError) as exc:  # the allocator's own failure (torch.OutOfMemoryError too)
        raise allocation_error(exc, nbytes, device, what, SLAB_KNOBS) from None


def check_host_tier(spec: ModulationSpec, options: CacheOptions, device: torch.device) -> None:
    """Refuse a host tier the host cannot hold beside a CPU slab (before its arena is mapped)."""
    if not options.host_cache_bytes:
        return
    beside = spec.slab_bytes(options.max_plans, options.max_plan_width) if device.type == "cpu" else 0
    what = f"the host tier of host_cache_bytes={options.host_cache_bytes}" + (" beside the slab" if beside else "")
    check_available(options.host_cache_bytes + beside, torch.device("cpu"), what, HOST_TIER_KNOB)


def assemble(
    spec: ModulationSpec,
    source: WeightSource,
    options: CacheOptions,
    device: torch.device,
    *,
    lock: threading.RLock,
    faults: Callable[[], FaultPoints],
) -> Parts:
    """The parts of a cache, in the one order that works across ranks.

    ``lock``: the cache's state lock (the transaction holds it while the slot map changes);
    ``faults``: the cache's fault points, read per build.
    """
    # Settings that fix the number or size of later collectives are compared across ranks.
    config = {
        "precision": options.precision,
        "store": options.store is not None,
        "device_type": device.type,
        "tables": options.tables is not None,
    }
    collective = make_collective(options.process_group, options.shard, spec, device=device, config=config)
    # Ranks must agree on every capacity, or their slot decisions would diverge.
    max_plans, max_plan_width, host_cache_bytes = collective.min_ints(
        [options.max_plans, options.max_plan_width, options.host_cache_bytes]
    )
    options = dataclasses.replace(
        options, max_plans=max_plans, max_plan_width=max_plan_width, host_cache_bytes=host_cache_bytes
    )
    stats = CacheStats()

    def local() -> tuple[Slab, Placement]:
        slab = allocate_slab(spec, options, device)
        check_host_tier(spec, options, device)
        return slab, place(spec, source, options, device, collective=collective, stats=stats, store=options.store)

    slab, placement = agreed(collective, local)
    site = Site(placement)
    sync = StreamSync(options.max_plans, events_for(device))
    pool = SlotPool(slab, sync)
    store = placement.tiers.store
    memo = store.memo if store is not None else None
    identity = TableIdentity(
        source, collective, stats, spec=spec, precision=options.precision, device=lambda: site.device, memo=memo
    )
    # Passes hash what they read only where something is bound to the content digest (same on every
    # rank: the store and table settings were agreed above).
    identity.content.wanted = store is not None or placement.files is not None
    # A table file that cannot serve this cache bit-exactly is refused now, on every rank.
    if placement.files is not None:
        agreed(collective, lambda: serve_files(placement, identity, strict=True))
    settings = BuildSettings(
        spec=spec,
        precision=options.precision,
        max_plans=options.max_plans,
        max_plan_width=options.max_plan_width,
        read_ahead=options.read_ahead,
        progress=options.progress,
        batched=options.batched,
        tiled=options.tiled,
    )
    builder = BuildTransaction(
        settings,
        source=source,
        slab=slab,
        pool=pool,
        site=site,
        identity=identity,
        collective=collective,
        stats=stats,
        sync=sync,
        lock=lock,
        faults=faults,
    )
    return Parts(options, collective, stats, slab, sync, pool, identity, builder, HostTableStash(), site)


def relocated(parts: Parts, spec: ModulationSpec, source: WeightSource, target: torch.device) -> Placement:
    """Move the parts to ``target`` and return its placement (the caller holds both locks, no plan held).

    Within one device identity the slab's rows are copied as they are and the tiers stay. Across
    identities the resident tables are stashed (host copies by identity), the tiers are placed
    anew for ``target`` (the store kept: it is keyed by the numeric environment), the table files
    are served only where they fit, and tables stashed for ``target``'s identity come back.
    """
    old = parts.site.placement
    identity, pool, slab = parts.identity, parts.pool, parts.slab
    here, there = device_identity(old.device), device_identity(target)
    moved = here != there
    if moved:
        parts.stash.stash(
            here, pool, slab, fingerprint=identity.fingerprint, variant=identity.variant, autocast=identity.autocast
        )
        pool.clear()
        # The host tier held rows of the old device; a new one (pinned for CUDA) holds the new
        # one's, and the old arena (page-locked for a GPU) is given back now.
        old.tiers.release()
        new = place(
            spec,
            source,
            parts.options,
            target,
            collective=parts.collective,
            stats=parts.stats,
            store=old.tiers.store,
            files=old.files,
        )
    else:
        new = Placement(target, old.tiers, old.files)
    slab.relocate(target, keep_rows=not moved)
    parts.sync.reset(events_for(target))
    parts.site.placement = new
    if moved:
        serve_files(new, identity, strict=False)
        restored = parts.stash.restore(there, pool, slab, fingerprint=identity.fingerprint)
        if restored is not None:
            identity.variant, identity.autocast = restored.variant, restored.autocast
    return new


__all__ = ["Parts", "agreed", "assemble", "place", "relocated", "serve_files"]
