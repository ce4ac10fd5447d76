"""The slab of precomputed AdaLN tables and the state machine that keeps it honest.

A slab holds ``max_plans`` slots of ``max_plan_width`` timestep rows each. A slot is either
*free* (length 0, in the free list) or *resident* (in the host-side slot map, with its length and
timesteps published). ``build`` moves plans between the two in a fixed order, chosen so that a
failure at any point leaves nothing half-built visible (the seed design note):

1. key the request; nothing missing -> touch and return (the hot path: no device work);
2. validate the *whole* request before any state changes, so a rejected request costs nothing;
3. take what the host tier and the store hold; one rebuild pass for the rest;
4. reserve slots from the free list, then from least-recently-used plans *outside* the request;
5. write contents, then flip ``plan_lengths``, then update the host-side slot map: the map is
   what lookups consult, so it changes last and a failure before it hides the whole request;
6. after publish, copy to the tiers; a tier failure is counted and logged, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .batching import StackedProjector
from .errors import AdalnCacheError, BuildError, CheckpointError, ConfigError, PlanError, PlanNotCachedError
from .faults import NO_FAULTS, FaultPoints
from .plans import PlanKey, distinct_plans, format_plan, plan_key, validate_plan
from .rows import PlanRows
from .source import Columns, WeightSource
from .spec import FINAL, Layer, ModulationSpec

if TYPE_CHECKING:
    from .distributed import LocalWork
    from .tiers.host import HostTier
    from .tiers.store import Store

log = logging.getLogger(__name__)

#: ``embed(plan) -> (len(plan), in_features)``: the exact input of the projections for a plan.
EmbedFn = Callable[[torch.Tensor], torch.Tensor]
#: ``project(layer, x, weight, bias) -> (len(plan), out_features)``; default ``F.linear``.
ProjectFn = Callable[[Layer, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

PRECISIONS = ("match", "fp32")
SHARD_MODES = ("layers", "columns")


def _default_project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias)


@dataclass
class CacheStats:
    """Counters over the cache's life. Hits and builds count distinct plans per ``build`` call."""

    device_hits: int = 0
    host_hits: int = 0
    store_hits: int = 0
    built_plans: int = 0
    passes: int = 0
    evicted_plans: int = 0
    host_evicted: int = 0
    host_pressure_skips: int = 0
    tier_write_failures: int = 0
    fingerprint_changes: int = 0
    variant_changes: int = 0
    failed_builds: int = 0
    store_corrupt: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class BuildReport:
    """What one ``build`` call did."""

    plans: int = 0
    device_hits: int = 0
    host_hits: int = 0
    store_hits: int = 0
    built: int = 0
    evicted: int = 0
    passes: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    tier_write_failures: int = 0
    #: batched mode only: (layer, width group) projections served by one stacked GEMM, and those
    #: that ran per plan (the probe of a new shape class, or a class found not bit-identical).
    stacked_layers: int = 0
    per_plan_layers: int = 0
    layers_read: list[str] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("layers_read")
        return out


def _check_int(name: str, value: Any, flag: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}: set {name}= (CLI {flag})")
    return value


class AdalnCache:
    """A device slab of bit-exact AdaLN tables, rebuilt transactionally from a weight source.

    See DESIGN.md section 2 for the contract. The slab tensors (``plan_timesteps``,
    ``plan_lengths``, ``block_params``, ``final_params``) are allocated once on ``device``; their
    pointers never move, and they are not registered in any module, so no ``state_dict`` holds them.
    """

    def __init__(
        self,
        spec: ModulationSpec,
        source: WeightSource,
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
    ) -> None:
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
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {device!r} is not a torch device: set device= (CLI --device)") from exc
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for but CUDA is not available: set --device cpu")

        from .distributed import make_collective  # local: distributed imports torch.distributed lazily

        # Settings that fix the number or size of later collectives are compared across ranks.
        agreed = {"precision": precision, "store": store is not None, "device_type": self.device.type}
        self._dist = make_collective(process_group, shard, spec, device=self.device, config=agreed)
        self.spec = spec
        self.source = source
        self.precision = precision
        self.shard = shard
        self.read_ahead = read_ahead
        self.progress = progress
        #: Stack the plans of one width into one GEMM where a probe proved it bit-identical to the
        #: per-plan GEMM on this device (adalncache.batching); off by default.
        self.batched = batched
        # Ranks must agree on every capacity, or their slot decisions would diverge.
        self.max_plans, self.max_plan_width, host_cache_bytes = self._dist.min_ints(
            [max_plans, max_plan_width, host_cache_bytes]
        )
        self.host_cache_bytes = host_cache_bytes

        P, W, L = self.max_plans, self.max_plan_width, spec.num_layers
        dev = self.device
        tier_failure: BaseException | None = None
        try:  # out of device memory on one rank alone must fail every rank (agreed below)
            self.plan_timesteps = torch.zeros(P, W, dtype=torch.float32, device=dev)
            self.plan_lengths = torch.zeros(P, dtype=torch.int64, device=dev)
            self.block_params = torch.zeros(P, W, L, spec.block_width, dtype=spec.dtype, device=dev)
            self.final_params = torch.zeros(P, W, spec.final_width, dtype=spec.dtype, device=dev)
            # 0-d slot indices already on the device, so lookups never copy host -> device.
            self._slot_index = torch.arange(P, dtype=torch.int64, device=dev)
        except BaseException as exc:
            tier_failure = exc

        # Host-side state. _slots is the published slot map and, through its order, the LRU
        # (least recently used first). _free holds every slot not in _slots.
        self._slots: OrderedDict[PlanKey, int] = OrderedDict()
        self._free: list[int] = list(range(P))
        self._fingerprint = source.fingerprint
        self._variant: Hashable = None
        self.stats = CacheStats()
        self.fault_points: FaultPoints = NO_FAULTS
        self._warned_rank = False

        self._host: HostTier | None = None
        self._store: Store | None = None
        try:
            if tier_failure is not None:
                raise tier_failure
            if host_cache_bytes > 0:
                from .tiers.host import HostTier

                self._host = HostTier(spec, host_cache_bytes, pin=dev.type == "cuda")
            if store is not None:
                if not getattr(source, "persistent", True):
                    # An in-memory source's fingerprint names addresses in this process: its entries
                    # could never be found again, so they would only fill the disk.
                    raise ConfigError(
                        f"store= needs a source whose identity survives the process (a CheckpointSource), "
                        f"got {type(source).__name__}: pass the checkpoint path (checkpoint= in "
                        f"enable_adaln_cache, CLI CHECKPOINT), or drop store= (--store)"
                    )
                from .tiers.store import Store as _Store

                self._store = store if isinstance(store, _Store) else _Store(store)
        except BaseException as exc:
            tier_failure = exc
        # A slab or tier that fails on one rank only (a store directory it cannot use) must fail
        # every rank's construction, or the others would wait for it in their first collective.
        self._dist.agree_construction(tier_failure)
        if tier_failure is not None:
            raise tier_failure
        log.debug("AdalnCache: %d plans x %d timesteps, %.1f MiB slab on %s", P, W, self.slab_bytes / 2**20, dev)

    # -- introspection ----------------------------------------------------------------------

    @property
    def slab_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slab_tensors())

    def slab_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.plan_timesteps, self.plan_lengths, self.block_params, self.final_params)

    @property
    def resident_plans(self) -> list[PlanKey]:
        """Published plan keys, least recently used first."""
        return list(self._slots)

    def slot_of(self, key: PlanKey) -> int | None:
        return self._slots.get(key)

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    @property
    def variant(self) -> Hashable:
        return self._variant

    @property
    def host_tier(self) -> HostTier | None:
        return self._host

    @property
    def store(self) -> Store | None:
        return self._store

    @property
    def world_size(self) -> int:
        """Ranks that build this cache together (1 without a process group)."""
        return self._dist.world

    @property
    def rank(self) -> int:
        """This process's rank in the cache's process group (0 without one)."""
        return self._dist.rank

    def __contains__(self, plan: torch.Tensor) -> bool:
        return plan_key(plan) in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __repr__(self) -> str:
        return (
            f"AdalnCache({len(self._slots)}/{self.max_plans} plans resident, width {self.max_plan_width}, "
            f"{self.spec.num_layers} layers, {self.precision}, {self.device})"
        )

    # -- identity ---------------------------------------------------------------------------

    def _drop_all(self, why: str) -> None:
        """Forget every device and host-tier plan (they were built under another identity)."""
        if self._slots:
            log.info("dropping %d resident plan(s): %s", len(self._slots), why)
        for key in list(self._slots):
            self._unpublish(key)
        if self._host is not None:
            self._host.clear()

    def _check_identity(self, variant: Hashable, request: Sequence[PlanKey] = ()) -> None:
        """Re-stat the source and compare the variant; drop tables built under an old identity.

        In a process group the three flags (and a digest of ``request``) are reduced in one
        collective, so every rank drops, or keeps, the same tables and the slot maps stay equal.
        """
        invalid: CheckpointError | None = None
        try:
            self.source.refresh()
        except CheckpointError as exc:
            invalid = exc
        fingerprint = self.source.fingerprint
        (failed, changed, variant_changed), diverged = self._dist.agree_identity(
            [invalid is not None, fingerprint != self._fingerprint, variant != self._variant],
            request,
            list(self._slots.items()),
        )
        if diverged:
            # The ranks' slot maps differ (invalidate() on some ranks only, say): their next
            # decisions would differ too, so every rank starts again from an empty slab.
            log.warning("rank %d: the ranks' slabs diverged; dropping every table on every rank", self._dist.rank)
            self._drop_all("the ranks' slabs diverged")
        if failed:
            # The file changed (on some rank) and no longer validates: whatever the slab holds came
            # from the old file, so it can no longer be trusted either.
            self.stats.fingerprint_changes += 1
            self._fingerprint = None  # type: ignore[assignment]
            self._drop_all("the checkpoint changed on disk and no longer validates")
            self._dist.raise_if_any_failed(invalid, "checkpoint")
            assert invalid is not None  # alone, only this rank can have failed
            raise invalid
        if changed:
            self.stats.fingerprint_changes += 1
            self._drop_all("the weight source's fingerprint changed")
            self._fingerprint = fingerprint
        if variant_changed:
            if self._slots or (self._host is not None and len(self._host)):
                self.stats.variant_changes += 1
                self._drop_all(f"variant changed ({self._variant!r} -> {variant!r})")
            self._variant = variant

    def binding(self) -> dict[str, Any]:
        """Everything a stored table depends on besides its plan (stores key entries by it)."""
        from .tiers.store import numeric_environment

        return {
            "fingerprint": self._fingerprint,
            "spec": self.spec.describe(),
            "precision": self.precision,
            "variant": repr(self._variant),
            "shard": self._dist.describe_shard(),
            "environment": numeric_environment(self.device),
        }

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
            self._check_identity(variant, order)
        except (CheckpointError, BuildError) as exc:
            self.stats.failed_builds += 1
            if isinstance(exc, BuildError):
                raise  # a peer's (or this rank's) agreed checkpoint failure
            raise BuildError(f"the weight source cannot be used: {exc}", failed_at="checkpoint") from exc
        missing = [key for key in order if key not in self._slots]
        if not missing:
            for key in order:
                self._slots.move_to_end(key)
            self.stats.device_hits += len(order)
            report.device_hits = len(order)
            report.seconds = time.perf_counter() - start
            return report

        # Validate everything before touching any state: a rejected request leaves the slab as it was.
        for key in missing:
            validate_plan(tensors[key], max_plan_width=self.max_plan_width)
        if len(order) > self.max_plans:
            raise PlanError(
                f"the request needs {len(order)} distinct plans but the slab holds {self.max_plans}: raise "
                f"max_plans (CLI --max-plans) to at least {len(order)}, or split the request"
            )
        if not callable(embed):
            raise PlanError("build() needs embed=, a function plan -> (len(plan), in_features) input rows")

        report.device_hits = len(order) - len(missing)
        wanted = set(order)
        bytes_before = self.source.bytes_read
        try:
            from_host, from_store = self._tier_lookup(missing)
        except BaseException as exc:
            # Tier errors fall through to a rebuild inside _tier_lookup; only an interrupt (or
            # another BaseException) gets here. Nothing is reserved yet, so there is nothing to undo,
            # but the contract still owes the caller a BuildError rather than a raw interrupt.
            self.stats.failed_builds += 1
            raise BuildError(
                f"build of {len(missing)} plan(s) failed at tier lookup: {type(exc).__name__}: {exc}; nothing "
                f"of this request was published and a retry rebuilds it",
                failed_at="tier lookup",
            ) from exc
        to_build = [k for k in missing if k not in from_host and k not in from_store]

        slots = self._reserve(missing, wanted, report)
        try:
            # Local work only up to the agreement: no collective runs in here, so a failure on one
            # rank can never leave a peer blocked waiting for it.
            failure: BaseException | None = None
            try:
                for key, rows in from_host.items():
                    self._write_rows(slots[key], rows)
                for key, rows in from_store.items():
                    self._write_rows(slots[key], rows)
                if to_build:
                    work = self._run_pass(to_build, slots, tensors, embed, project or _default_project, report)
                with self._failing_at("publish"):
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
                    self._dist.share_results(
                        self, [slots[k] for k in to_build], [tensors[k].numel() for k in to_build], work
                    )
                except BaseException as exc:
                    shared = exc
                # Publish only once every rank holds every row.
                self._dist.raise_if_any_failed(shared, "exchange of results")
                if shared is not None:
                    raise shared
            self._publish(missing, slots, tensors)
        except BaseException as exc:
            self._release(slots)
            self.stats.failed_builds += 1
            if isinstance(exc, BuildError):
                raise
            failed_at = getattr(exc, "adalncache_failed_at", None) or "build"
            raise BuildError(
                f"build of {len(missing)} plan(s) failed at {failed_at}: {type(exc).__name__}: {exc}; nothing "
                f"of this request was published and a retry rebuilds it",
                rank=self._dist.rank if self._dist.world > 1 else None,
                failed_at=failed_at,
            ) from exc

        for key in order:
            self._slots.move_to_end(key)
        report.host_hits = len(from_host)
        report.store_hits = len(from_store)
        report.built = len(to_build)
        report.passes = 1 if to_build else 0
        report.bytes_read = self.source.bytes_read - bytes_before
        self.stats.device_hits += report.device_hits
        self.stats.host_hits += report.host_hits
        self.stats.store_hits += report.store_hits
        self.stats.built_plans += report.built
        self.stats.passes += report.passes
        self._tier_write(order, to_build, report)
        report.seconds = time.perf_counter() - start
        log.info(
            "build: %d plan(s): %d device, %d host, %d store hits, %d built in %d pass(es), %d evicted, %.3f s",
            report.plans,
            report.device_hits,
            report.host_hits,
            report.store_hits,
            report.built,
            report.passes,
            report.evicted,
            report.seconds,
        )
        return report

    # -- slots ------------------------------------------------------------------------------

    def _reserve(self, missing: list[PlanKey], wanted: set[PlanKey], report: BuildReport) -> dict[PlanKey, int]:
        """Slots for ``missing``: free ones first, then the least recently used plans not in ``wanted``."""
        slots: dict[PlanKey, int] = {}
        self._free.sort(reverse=True)  # pop() hands out the lowest free slot first: deterministic
        victims: Iterator[PlanKey] = (k for k in list(self._slots) if k not in wanted)
        for key in missing:
            if not self._free:
                victim = next(victims)  # exists: len(wanted) <= max_plans was checked
                self._unpublish(victim)
                self.stats.evicted_plans += 1
                report.evicted += 1
            slots[key] = self._free.pop()
        return slots

    def _unpublish(self, key: PlanKey) -> None:
        """Evict ``key``: the map forgets it first so no lookup can reach a slot being cleared."""
        slot = self._slots.pop(key)
        self.plan_lengths[slot] = 0
        self.plan_timesteps[slot].zero_()
        self._free.append(slot)

    def _release(self, slots: dict[PlanKey, int]) -> None:
        """Return the slots of a failed build to the free list, hiding anything written into them."""
        for key, slot in slots.items():
            if self._slots.get(key) == slot:
                del self._slots[key]
            self.plan_lengths[slot] = 0
            self.plan_timesteps[slot].zero_()
            if slot not in self._free:
                self._free.append(slot)

    def _publish(self, keys: list[PlanKey], slots: dict[PlanKey, int], tensors: dict[PlanKey, torch.Tensor]) -> None:
        # Contents first: timesteps (the block and final rows are already written).
        for key in keys:
            plan = tensors[key]
            row = self.plan_timesteps[slots[key]]
            row.zero_()
            row[: plan.numel()].copy_(plan.to(self.device))
        # Lengths flip after contents, so a device-side reader never sees a half-filled slot.
        index = torch.tensor([slots[k] for k in keys], dtype=torch.int64)
        lengths = torch.tensor([tensors[k].numel() for k in keys], dtype=torch.int64)
        self.plan_lengths.index_copy_(0, index.to(self.device), lengths.to(self.device))
        # The host-side map is what lookups consult: it changes last, all at once.
        self._slots.update((k, slots[k]) for k in keys)

    # -- the rebuild pass -------------------------------------------------------------------

    @contextlib.contextmanager
    def _failing_at(self, where: str) -> Iterator[None]:
        """Label an exception with the phase it came from, for BuildError messages."""
        try:
            yield
        except BaseException as exc:
            if getattr(exc, "adalncache_failed_at", None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, "adalncache_failed_at", where)  # noqa: B010
            raise

    def _embed_all(
        self, keys: list[PlanKey], tensors: dict[PlanKey, torch.Tensor], embed: EmbedFn
    ) -> dict[PlanKey, torch.Tensor]:
        out: dict[PlanKey, torch.Tensor] = {}
        want_dtype = torch.float32 if self.precision == "fp32" else self.spec.dtype
        for key in keys:
            plan = tensors[key]
            with self._failing_at(f"embed of plan {format_plan(key)}"):
                self.fault_points.check("embed")
                x = embed(plan)
                if not isinstance(x, torch.Tensor) or tuple(x.shape) != (plan.numel(), self.spec.time_embed_dim):
                    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise PlanError(
                        f"embed(plan) must return a ({plan.numel()}, {self.spec.time_embed_dim}) tensor for a "
                        f"plan of {plan.numel()} timesteps, got {shape}"
                    )
                if self.precision == "match" and x.dtype != want_dtype:
                    raise PlanError(
                        f"embed(plan) returned {x.dtype} but precision='match' projects in the weights' dtype "
                        f"{self.spec.dtype}: return silu(temb).to({self.spec.dtype}) as the model's forward does"
                    )
                out[key] = x.to(self.device, want_dtype)
        return out

    def _run_pass(
        self,
        keys: list[PlanKey],
        slots: dict[PlanKey, int],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn,
        project: ProjectFn,
        report: BuildReport,
    ) -> LocalWork:
        """Stream this rank's layers once, project each plan with its own M into its reserved slot.

        Purely local (no collectives): the caller agrees on failures, then shares the results.
        """
        with torch.no_grad():
            xs = self._embed_all(keys, tensors, embed)
            plan_of = self._dist.local_work(self.spec.layers())
            fp32 = self.precision == "fp32"
            bar = tqdm(
                total=len(plan_of.layers),
                desc="adalncache pass",
                unit="layer",
                leave=False,
                disable=(not self.progress) if self.progress is not None else None,
            )
            try:
                stream = self.source.stream(
                    plan_of.layers, device=self.device, columns=plan_of.columns, read_ahead=self.read_ahead
                )
                stacker = None
                if self.batched:
                    with self._failing_at("projection setup (batched)"):
                        shared = project is _default_project
                        stacker = StackedProjector(keys, xs, project, shared=shared)
                alone = [k for k in keys if stacker is None or k not in stacker.grouped]
                with contextlib.closing(stream), self._failing_at("read"):  # type: ignore[type-var]
                    for lw in self._labelled(stream, plan_of.layers):
                        current = f"layer {lw.layer}"
                        weight, bias = (lw.weight.float(), lw.bias.float()) if fp32 else (lw.weight, lw.bias)
                        if stacker is not None:
                            with self._failing_at(f"projection of {current}"):
                                self.fault_points.check("project")
                                for key, y in stacker.project_layer(lw.layer, weight, bias):
                                    self._write_projection(slots[key], lw.layer, y, plan_of.columns, current)
                        for key in alone:
                            with self._failing_at(f"projection of {current}"):
                                self.fault_points.check("project")
                                y = project(lw.layer, xs[key], weight, bias)
                                self._write_projection(slots[key], lw.layer, y, plan_of.columns, current)
                        report.layers_read.append(str(lw.layer))
                        bar.update(1)
                if stacker is not None:
                    report.stacked_layers = stacker.stats.stacked_layers
                    report.per_plan_layers = stacker.stats.per_plan_layers
            finally:
                bar.close()
            return plan_of

    @staticmethod
    def _labelled(stream: Iterator[Any], layers: Sequence[Layer]) -> Iterator[Any]:
        """Iterate ``stream`` while labelling a read failure with the layer that was being read."""
        for layer in layers:
            try:
                item = next(stream)
            except StopIteration:
                return
            except BaseException as exc:
                if getattr(exc, "adalncache_failed_at", None) is None:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(exc, "adalncache_failed_at", f"read of layer {layer}")  # noqa: B010
                raise
            yield item

    def _write_projection(self, slot: int, layer: Layer, y: torch.Tensor, columns: Columns | None, where: str) -> None:
        n = y.shape[0] if y.dim() == 2 else -1
        width = self.spec.out_features(layer)
        lo, hi = columns.bounds(width) if columns is not None else (0, width)
        if y.dim() != 2 or y.shape[1] != hi - lo or n > self.max_plan_width:
            raise PlanError(f"the projection of {where} returned shape {tuple(y.shape)}, expected (M, {hi - lo})")
        if columns is not None:
            dest = self._dist.column_staging(self, slot, layer, n)
        elif layer == FINAL:
            dest = self.final_params[slot, :n]
        else:
            dest = self.block_params[slot, :n, layer]
        dest.copy_(y)

    def _write_rows(self, slot: int, rows: PlanRows) -> None:
        n = rows.timesteps.numel()
        self.block_params[slot, :n].copy_(rows.block, non_blocking=True)
        self.final_params[slot, :n].copy_(rows.final, non_blocking=True)

    def rows_of(self, key: PlanKey) -> PlanRows:
        """A copy of a resident plan's rows, on the cache device (tiers and verify read these)."""
        slot = self._slots.get(key)
        if slot is None:
            raise PlanNotCachedError(f"the cache does not cover plan {format_plan(key)}")
        n = len(key)
        return PlanRows(
            self.plan_timesteps[slot, :n].clone(),
            self.block_params[slot, :n].clone(),
            self.final_params[slot, :n].clone(),
        )

    # -- tiers ------------------------------------------------------------------------------

    def _tier_lookup(self, missing: list[PlanKey]) -> tuple[dict[PlanKey, PlanRows], dict[PlanKey, PlanRows]]:
        """Plans every rank can restore from the host tier, then from the store (cheapest first)."""
        from_host: dict[PlanKey, PlanRows] = {}
        if self._host is not None:
            found = {}
            try:
                self.fault_points.check("host_read")
                found = self._host.lookup(missing)
            except Exception as exc:  # a tier is only a cache: fall through to the next one
                log.warning("host tier lookup failed (%s); rebuilding instead", exc)
            agreed = self._dist.agree_on([k in found for k in missing])
            from_host = {k: found[k] for k, ok in zip(missing, agreed) if ok}
        from_store: dict[PlanKey, PlanRows] = {}
        if self._store is not None:
            rest = [k for k in missing if k not in from_host]
            found = {}
            if rest:
                try:
                    self.source.refresh()
                    if self.source.fingerprint == self._fingerprint:
                        self.fault_points.check("store_read")
                        found = self._store.get_many(self.binding(), rest, self.spec)
                except Exception as exc:
                    log.warning("store lookup failed (%s); rebuilding instead", exc)
                    found = {}
                agreed = self._dist.agree_on([k in found for k in rest])
                from_store = {k: found[k] for k, ok in zip(rest, agreed) if ok}
            self.stats.store_corrupt = self._store.corrupt_moved
        return from_host, from_store

    def _tier_write(self, order: list[PlanKey], built: list[PlanKey], report: BuildReport) -> None:
        """Copy published plans to the tiers; never raises (the slab is already correct)."""
        if self._host is not None:
            try:
                self.fault_points.check("host_write")
                admitted = self._host.admit(order, self.rows_of)
                if not admitted:
                    self.stats.host_pressure_skips += 1
            except Exception as exc:
                self.stats.tier_write_failures += 1
                report.tier_write_failures += 1
                log.warning("host tier write failed after publish (slab unaffected): %s", exc)
            self.stats.host_evicted = self._host.evicted_plans
        if self._store is not None and built and self._dist.writes_store():
            try:
                self.fault_points.check("store_write")
                binding = self.binding()
            except Exception as exc:
                self.stats.tier_write_failures += 1
                report.tier_write_failures += 1
                log.warning("store write failed after publish (slab unaffected): %s", exc)
                return
            # One entry per file: a failing entry (a full disk, a permission) must not keep the
            # others out, and each failure is counted so `adalncache build` can report them.
            failed: list[BaseException] = []
            for key in built:
                try:
                    self._store.put(binding, key, self.rows_of(key))
                except Exception as exc:
                    failed.append(exc)
            if failed:
                self.stats.tier_write_failures += len(failed)
                report.tier_write_failures += len(failed)
                log.warning(
                    "store write failed for %d of %d plan(s) after publish (slab unaffected); first: %s",
                    len(failed), len(built), failed[0],
                )  # fmt: skip

    # -- lookups ----------------------------------------------------------------------------

    def _slot_for(self, key: PlanKey) -> int:
        slot = self._slots.get(key)
        if slot is None:
            raise PlanNotCachedError(
                f"the cache does not cover plan {format_plan(key)} ({len(self._slots)} plan(s) resident): call "
                f"build() with it first"
            )
        return slot

    def resolve_slots(self, plans: Sequence[torch.Tensor], *, keys: Sequence[PlanKey] | None = None) -> torch.Tensor:
        """One slot per plan as a LongTensor on the cache device (pass ``keys`` to skip device syncs)."""
        if keys is None:
            keys = [plan_key(p) for p in plans]
        slots = [self._slot_for(k) for k in keys]
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)

    def lookup(self, plan: torch.Tensor, *, key: PlanKey | None = None) -> torch.Tensor:
        """The slot of a resident plan as a 0-d LongTensor on the cache device."""
        return self._slot_index[self._slot_for(plan_key(plan) if key is None else key)]

    def _slot_rows(self, table: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        if isinstance(slot, torch.Tensor):
            # index_select keeps a device slot on the device: no host read, no sync.
            return table.index_select(0, slot.reshape(1).to(table.device))[0]
        return table[slot]

    def _check_rows(self, num_timesteps: int, layer: int | None = None) -> None:
        # Slicing would silently cut an over-long request to the slab width; say so instead.
        if not 1 <= num_timesteps <= self.max_plan_width:
            raise PlanError(
                f"num_timesteps must be in 1..{self.max_plan_width} (the slab's plan width, CLI --plan-width), "
                f"got {num_timesteps}: pass len(plan) of a resident plan"
            )
        if layer is not None and not 0 <= layer < self.spec.num_layers:
            raise PlanError(f"layer must be in 0..{self.spec.num_layers - 1}, got {layer}")

    def block_rows(self, layer: int, slot: int | torch.Tensor, num_timesteps: int) -> torch.Tensor:
        """``Y`` of block ``layer``: the ``(num_timesteps, block_width)`` output of its projection."""
        self._check_rows(num_timesteps, layer)
        return self._slot_rows(self.block_params.select(2, layer), slot)[:num_timesteps]

    def block(self, layer: int, slot: int | torch.Tensor, num_timesteps: int) -> tuple[torch.Tensor, ...]:
        """The six ``(num_timesteps * modalities, hidden)`` tensors, as ``Y.view(-1, 6H).chunk(6, -1)``."""
        rows = self.block_rows(layer, slot, num_timesteps)
        return rows.reshape(-1, 6 * self.spec.hidden_size).chunk(6, dim=-1)

    def block_all(self, slot: int | torch.Tensor, num_timesteps: int) -> list[tuple[torch.Tensor, ...]]:
        """:meth:`block` for every layer from one gather of the slot."""
        self._check_rows(num_timesteps)
        rows = self._slot_rows(self.block_params, slot)[:num_timesteps]
        width = 6 * self.spec.hidden_size
        return [rows[:, layer].reshape(-1, width).chunk(6, dim=-1) for layer in range(self.spec.num_layers)]

    def final_rows(self, slot: int | torch.Tensor, num_timesteps: int) -> torch.Tensor:
        """``Z``: the ``(num_timesteps, final_width)`` output of the output-layer projection."""
        self._check_rows(num_timesteps)
        return self._slot_rows(self.final_params, slot)[:num_timesteps]

    def final(self, slot: int | torch.Tensor, num_timesteps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shift, scale)`` of the output layer."""
        shift, scale = self.final_rows(slot, num_timesteps).chunk(2, dim=-1)
        return shift, scale

    # -- maintenance ------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Empty the slab and the host tier. Store entries stay: they are keyed by fingerprint."""
        for key in list(self._slots):
            self._unpublish(key)
        if self._host is not None:
            self._host.clear()

    def check_invariants(self) -> None:
        """Assert the bookkeeping invariants (tests call this after every operation)."""
        resident = set(self._slots.values())
        free = set(self._free)
        assert len(resident) == len(self._slots), "two plans share a slot"
        assert len(free) == len(self._free), "a slot is free twice"
        assert not resident & free, "a slot is both free and resident"
        assert resident | free == set(range(self.max_plans)), "a slot leaked"
        lengths = self.plan_lengths.cpu()
        timesteps = self.plan_timesteps.cpu()
        for slot in free:
            assert int(lengths[slot]) == 0, f"free slot {slot} has length {int(lengths[slot])}"
        for key, slot in self._slots.items():
            n = int(lengths[slot])
            assert n == len(key), f"slot {slot}: length {n} but its plan has {len(key)} timesteps"
            assert plan_key(timesteps[slot, :n].contiguous()) == key, f"slot {slot}: timesteps disagree with map"
        if self._host is not None:
            self._host.check_invariants()


__all__ = ["PRECISIONS", "SHARD_MODES", "AdalnCache", "AdalnCacheError", "BuildReport", "CacheStats"]
