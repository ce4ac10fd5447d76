"""A request on an enabled model, from its start to its end: one :class:`Request` per thread, the
builder that holds its plans, its background pass, and the watch that makes each pipeline call one.

Where a request starts and ends, what it holds, and which forwards find their slot on the device
(NaN and a deferred :class:`~adalncache.PlanMismatchError` on a miss) or take the exact host path:
docs/diffusers.md ("Requests", "No host sync in a prepared request's forward", "The first request");
the states of its background pass: docs/state-machine.md. Lock order: a build runs under the
handle's lock; a background pass takes it, then the cache's build lock, then its state lock, as a
foreground build does; the request's thread only waits on events, never while holding a lock.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F

from ...cache import PlanHold
from ...errors import ConfigError, PlanError, PlanMismatchError, PlanNotCachedError
from ...identity import autocast_dtype
from ...options import AdalnCacheConfig, flag, knob
from ...plans import PlanKey, plan_key, slab_rows
from ...source.checkpoint import CheckpointSource
from ...spec import Layer, ModulationSpec
from .family import (
    DiffusersFamily,
    base_linear,
    bypassing_hooks,
    execution_device,
    forward_argument,
    swapped_parameters,
)
from .parking import TimeEmbedderLoan, WeightParking
from .quantized import casting_compute_dtype, fresh_alias, state_kept_by_weight
from .signature import Signature, Tuners, Variant, applied_lora_scale, lora_scale_of
from .sources import Quantization

if TYPE_CHECKING:
    from ... import AdalnCache, BuildReport

logger = logging.getLogger(__name__)


def request_plans(plans: Any) -> list[Any]:
    """``prepare``'s / ``request``'s ``plans`` as a list, or :class:`~adalncache.PlanError`: a single tensor,
    mapping or string is iterable, and taken apart it would be refused for its pieces, not the argument."""
    if isinstance(plans, (torch.Tensor, Mapping, str, bytes)) or not isinstance(plans, (Sequence, Iterable)):
        raise PlanError(
            f"plans must be a list of plans (one per forward: its timestep tensor, or a mapping of its keying "
            f"inputs by argument name; the CLI's {flag('timesteps')} / {flag('steps')}), "
            f"got {type(plans).__name__}: wrap a single plan in a list"
        )
    plans = list(plans)
    for plan in plans:
        # A meta tensor has no values to key: refused before a family stacks it with real tensors.
        values = plan.values() if isinstance(plan, Mapping) else plan if isinstance(plan, (tuple, list)) else [plan]
        if any(isinstance(value, torch.Tensor) and value.is_meta for value in values):
            raise PlanError("a plan must hold data, got a meta tensor: pass the tensors the forward receives")
    return plans


def plan_tensors(plans: Sequence[Any]) -> list[torch.Tensor]:
    """Each plan's timestep tensor (a ``(timestep, timestep_indices)`` pair's first element)."""
    return [plan[0] if isinstance(plan, (tuple, list)) else plan for plan in plans]


def mismatch_error(misses: int) -> PlanMismatchError:
    """The error for ``misses`` forwards of a request served the poison slot."""
    return PlanMismatchError(
        f"{misses} forward(s) of this request had keying inputs (timestep, and guidance or a second "
        "timestep for the families keyed by them) that match none of the plans prepared for it, so "
        "their modulation was the poison slot's NaN rows and their outputs are NaN, never another "
        "step's rows; pass handle.prepare(plans) the plans the loop's forwards receive (each step's "
        "timestep tensor, as the transformer gets it), or run without prepare() to key each forward "
        "on the host (the cache stays usable)"
    )


def split_pays(source: object) -> bool:
    """Whether a background pass split in two transactions (the first step's plans, then all) pays on
    ``source``: not from a cold checkpoint, whose O_DIRECT reads the second transaction would repeat
    (docs/diffusers.md, "The first request")."""
    if not isinstance(source, CheckpointSource):
        return True
    fraction = source.cached_fraction()
    return fraction is None or fraction >= 0.5


# -- builds ---------------------------------------------------------------------------------------


#: A build's ``embed``: the projections' input for a plan.
Embed = Callable[[torch.Tensor], Any]


@dataclass(eq=False)
class Builder:
    """How one enabling holds plans: the cache's hit path, else one build under the handle's lock, with
    the request's LoRA scale applied and the parked time embedder lent back (by the first ``embed``, so
    a build that hits costs no copy). ``plain_tables``: full-precision tables of quantized projections
    (``quantized_projections="checkpoint"``), a plain linear decided by that setting, never by the weight's type.
    """

    model: Any
    spec: ModulationSpec
    family: DiffusersFamily
    cache: AdalnCache
    parking: WeightParking
    signature: Signature
    lock: threading.RLock
    device: Callable[[], torch.device]
    plain_tables: bool
    on_miss: str
    quantization: Quantization | None = None
    _loan: TimeEmbedderLoan | None = field(default=None, init=False)
    _warned_miss: bool = field(default=False, init=False)

    def variant_of(self, attention_kwargs: Mapping[str, Any] | None) -> Variant:
        """The variant a forward (or a request) called with ``attention_kwargs`` is served under."""
        return self.signature.read(lora_scale_of(attention_kwargs))[1]

    def hold(
        self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None, *, embed: Embed | None = None
    ) -> PlanHold:
        """Hold a request's plans under its LoRA scale (``embed``: inputs computed ahead, for another thread)."""
        scale = lora_scale_of(attention_kwargs)
        if not math.isfinite(scale):  # every row would be NaN or inf: never a request worth building
            raise ConfigError(f'attention_kwargs["scale"] (the LoRA scale) must be finite, got {scale}')
        tuners, variant, refs = self.signature.read(scale)
        return self._hold(plan_tensors(plans), None, scale, tuners, variant, refs, embed=embed)

    def hold_forward(self, plan: torch.Tensor, key: PlanKey, attention_kwargs: Mapping[str, Any] | None) -> PlanHold:
        """Before a forward on the host path: hold its plan (the host copy of its keying inputs), or refuse."""
        scale = lora_scale_of(attention_kwargs)
        tuners, variant, refs = self.signature.read(scale)
        if self.on_miss == "raise":
            held = self.cache.hold_resident([plan], keys=[key], variant=variant)
            if held is not None:
                return held
            if variant != self.signature.variant:
                raise PlanNotCachedError(
                    "the AdaLN cache does not cover this forward: the LoRA state of the AdaLN projections (or a "
                    "module upstream of them) changed since the tables were built; call handle.prepare(plans) "
                    "(on_miss='raise')"
                )
            raise PlanNotCachedError(
                f"the AdaLN cache does not cover this forward's plan {plan.tolist()} under the current LoRA and "
                "autocast state; call handle.prepare(plans) before the loop (under the loop's autocast), or "
                "enable with on_miss='build'"
            )
        held = self._hold([plan], [key], scale, tuners, variant, refs)
        if held.report.passes:
            message = (
                "AdaLN cache: a forward's plan was not prepared and was built on the spot (one rebuild pass); call "
                "handle.prepare(plans) before the loop to build all steps in one pass"
            )
            logger.log(logging.INFO if self._warned_miss else logging.WARNING, message)
            self._warned_miss = True
        return held

    def embed_ahead(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> Embed:
        """A build's ``embed`` for ``plans`` whose inputs are computed now, for a pass on another thread: there a
        forward running meanwhile would see the lent time embedder. Same scale, loan and grad mode: same bits."""
        columns = self.cache.spec.plan_columns
        scale = lora_scale_of(attention_kwargs)
        tuners, _, _ = self.signature.read(scale)
        with self.lock, self.lending(), torch.no_grad(), applied_lora_scale(tuners, scale):
            inputs = {plan_key(t, columns): self.embed(t) for t in plan_tensors(plans)}

        def embed(plan: torch.Tensor) -> Any:
            key = plan_key(plan, columns)
            if key not in inputs:  # every plan of the request was embedded: a pass builds no other
                raise KeyError(f"no input was computed ahead for plan {plan.tolist()}")
            return inputs[key]

        return embed

    def _hold(
        self,
        plans: Sequence[torch.Tensor],
        keys: Sequence[PlanKey] | None,
        scale: float,
        tuners: Tuners,
        variant: Variant,
        refs: list[torch.Tensor],
        *,
        embed: Embed | None = None,
    ) -> PlanHold:
        """Hold ``plans`` resident under ``variant``: the cache's hit path, else a build under the lock."""
        held = self.cache.hold_resident(plans, keys=keys, variant=variant)
        if held is not None:
            return held
        if (
            variant is not None
            and not self.plain_tables
            and self.cache.shard == "columns"
            and self.cache.world_size > 1
        ):
            # The adapter's forward runs on the whole projection, not on a rank's column slice.
            raise ConfigError(
                f"LoRA adapters on the AdaLN projections need shard='layers' ({knob('shard')} layers): with "
                "shard='columns' each rank holds a column slice of the base weight, which the adapter's "
                "full-width forward cannot run on; unload the adapter or build with shard='layers'"
            )
        # Inputs computed ahead need no loan of the time embedder: the pass never runs it.
        lending = self.lending() if embed is None else contextlib.nullcontext()
        with self.lock:
            with lending, torch.no_grad(), applied_lora_scale(tuners, scale):
                held = self.cache.hold(
                    plans, embed=embed or self.embed, project=self.project, variant=variant, keys=keys
                )
            if self.signature.built_under(variant, refs):
                logger.info("AdaLN cache: tables rebuilt for a new LoRA or upstream signature")
        return held

    @contextlib.contextmanager
    def lending(self) -> Iterator[None]:
        """For one build: the parked time embedder is lent back by the first embed, parked again at exit."""
        linears = [base_linear(linear) for _, linear in self.family.time_embedder_linears(self.model)]
        with TimeEmbedderLoan(self.parking, self.device(), linears) as loan:
            self._loan = loan
            try:
                yield
            finally:
                self._loan = None

    def embed(self, plan: torch.Tensor) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The projections' exact input for ``plan``, on the cache's device."""
        if self._loan is not None:
            self._loan.take()
        return self.family.embed(self.model, self.spec, plan, self.device())

    def project(self, layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``layer``'s output for ``x`` with the source's weights, through the module's own (LoRA-wrapped,
        quantized, layerwise-cast) forward beneath every hook (ours would serve the table, an offloading hook
        move the weights)."""
        if self.plain_tables:
            return F.linear(x, weight, bias)
        module = self.family.projection_module(self.model, layer)
        base = base_linear(module)
        # A layer without a bias swaps in its weight alone: the module's bias stays None.
        tensors = {name: t for name, t in (("weight", weight), ("bias", bias)) if t is not None}
        compute = casting_compute_dtype(module)
        for name, tensor in tensors.items():
            tensor = self.parking.at_model_residue(layer, name, tensor, self.device())
            if compute is not None:  # the layerwise-casting hook, bypassed below, would cast them so
                tensor = tensor.to(compute)
            tensors[name] = fresh_alias(tensor)
        if self.quantization is not None:  # loaded quantized: the weight as the quantizer loads it
            tensors["weight"] = self.quantization.weight(self.family.projection_path(layer), tensors["weight"])
        # The class forward, not a bypass of the instance's: another thread's forward calling the output
        # layer meanwhile would run the bypass (the plain linear) on its own input.
        with bypassing_hooks({base} - {module}), swapped_parameters(base, tensors), state_kept_by_weight(base):
            out: torch.Tensor = type(module).forward(module, x)
            return out


# -- a pass on a background thread ----------------------------------------------------------------

#: Holds a list of plans resident (one transaction at most): the builder's hold, for one request.
HoldFn = Callable[[list[Any]], PlanHold]


class BackgroundPass:
    """One request's pass on a daemon thread (``overlap=True``): the first step's plans, then all
    (unless ``split`` is off: :func:`split_pays`); docs/state-machine.md says why and what a failure
    leaves. Its error (the same object) is raised in the request's thread by the next forward that
    needs a plan of it, or by :meth:`finish`. ``keys``: each step's key in step order (what a predicted
    pass is compared on). Its holds are the request's until :meth:`release`; a pass still running then
    gives its own back when it ends.
    """

    def __init__(self, hold: HoldFn, plans: Sequence[Any], keys: Sequence[PlanKey], *, split: bool = True) -> None:
        if len(plans) != len(keys) or not plans:
            raise ValueError("BackgroundPass needs one key per plan and at least one plan")
        self._hold = hold
        self._plans = list(plans)
        self.keys = tuple(keys)
        #: Started from a call's predicted schedule, not adopted yet; the variant it is compared under.
        self.predicted = False
        self.variant: object = None
        self.split = split and len(set(keys)) > 1
        self._first = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()  # guards _holds, _released, _surfaced; never held while waiting
        self._holds: list[PlanHold] = []
        self._released = False
        self._surfaced = False
        self._first_error: BaseException | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="adalncache-pass", daemon=True)

    def start(self) -> BackgroundPass:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _keep(self, held: PlanHold) -> None:
        """Keep ``held`` for the request, or give it back at once when the request already ended."""
        with self._lock:
            if not self._released:
                self._holds.append(held)
                return
        held.release()

    def _run(self) -> None:
        try:
            if self.split:
                try:
                    self._keep(self._hold(self._plans[:1]))
                except BaseException as exc:
                    self._first_error = exc
                    raise
                finally:
                    self._first.set()
            self._keep(self._hold(self._plans))
        except BaseException as exc:  # kept for the request's thread, which raises it
            with self._lock:
                self.error = exc
                late = self._released and not self._surfaced  # no thread of the request will raise it
                self._surfaced = self._surfaced or late
            if late and not self.predicted:
                logger.warning("AdaLN cache: a background pass failed after its request ended: %s", exc)
            else:
                logger.debug("AdaLN cache: the background pass failed: %s", exc)
        finally:
            self._first.set()
            self._done.set()

    def wait_for(self, key: PlanKey) -> None:
        """Before a forward of plan ``key``: wait until it is servable; raise its transaction's error."""
        first = self.split and key == self.keys[0]
        (self._first if first else self._done).wait()
        error = self._first_error if first else self.error
        if error is not None:
            with self._lock:
                self._surfaced = True
            raise error

    def join(self) -> None:
        self._done.wait()

    def release(self) -> None:
        """Give the request's holds back (never waits, never raises: an interrupted request calls it)."""
        with self._lock:
            self._released = True
            holds, self._holds = self._holds, []
            # The pass sets its error under this lock: either it is set now, or the pass sees _released.
            unreported = self.error is not None and not self._surfaced
            self._surfaced = self._surfaced or unreported
        for held in holds:
            held.release()
        if unreported and not self.predicted:
            logger.warning("AdaLN cache: a background pass failed after its request ended: %s", self.error)
        elif unreported:  # a prediction no request adopted: its failure is no request's (a real pass retries)
            logger.debug("AdaLN cache: a pass of a dropped prediction failed: %s", self.error)

    def finish(self) -> None:
        """The request's end: wait for the pass, release its holds, raise its error if no forward did."""
        self.join()
        with self._lock:
            unreported = self.error is not None and not self._surfaced
            self._surfaced = True
        self.release()
        if unreported:
            assert self.error is not None
            raise self.error


# -- the request ----------------------------------------------------------------------------------


class Request:
    """One request of one thread: what it holds and how its forwards find their slots. ``call``: a pipeline
    call's, the thread's until the call ends (emptied by a move or a second schedule, never replaced)."""

    def __init__(self, *, call: bool = False) -> None:
        self.call = call
        self.hold: PlanHold | None = None
        self.background: BackgroundPass | None = None
        #: Patterns per plan -> (``[R, patterns]`` int32 keys, ``[R]`` slots) on the device; None: host path.
        self.groups: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._misses: torch.Tensor | None = None

    def held(self, hold: PlanHold, cache: AdalnCache, *, on_device: bool = True) -> None:
        """Hold ``hold``'s plans for this request; ``on_device``: its forwards find their slots on the device."""
        self.hold = hold
        if not on_device:
            return
        try:
            # The hold's variant: reading the signature again would stamp a change made meanwhile on old rows.
            self.variant, self.device, self.columns = hold.variant, cache.device, cache.spec.plan_columns
            self.autocast = autocast_dtype(cache.device)
            self._retirements = lambda: cache.retirements
            by_length: dict[int, list[tuple[PlanKey, int]]] = {}
            for key, slot in dict(zip(hold.keys, hold.slot_list, strict=True)).items():
                by_length.setdefault(len(key), []).append((key, slot))
            # Never inference tensors (prepare() may run in inference mode): a later loop outside it
            # updates the miss counter in place.
            with torch.inference_mode(False):
                self.groups = {
                    length: (
                        torch.tensor([key for key, _ in pairs], dtype=torch.int32).to(cache.device),
                        torch.tensor([slot for _, slot in pairs], dtype=torch.int64).to(cache.device),
                    )
                    for length, pairs in by_length.items()
                }
                self._poison = torch.tensor(cache.poison_slot, dtype=torch.int64).to(cache.device)
                self._misses = torch.zeros((), dtype=torch.int64, device=cache.device)
        except BaseException:
            self.drop()
            raise

    def slot_of(self, plan: torch.Tensor, variant: object) -> tuple[torch.Tensor, torch.dtype] | None:
        """``(slot, dtype)`` of a forward with ``plan`` under ``variant``, found with device operations only (a
        CUDA graph captures them): a miss is the poison slot, counted; None (decided on host state): host path."""
        hold, groups = self.hold, self.groups
        if hold is None or groups is None or hold.released or plan.device != self.device or plan.dtype != torch.float32:
            return None
        if self._retirements() != hold.epoch:  # a held plan was retired (invalidate, a new identity): maybe stale
            return None
        shaped = plan.dim() == 1 if self.columns == 1 else plan.dim() == 2 and plan.shape[1] == self.columns
        if not shaped or plan.numel() not in groups:
            return None
        if variant != self.variant or autocast_dtype(self.device) != self.autocast:
            return None
        keys, slots = groups[plan.numel()]
        bits = plan.detach().contiguous().view(torch.int32).reshape(1, -1)
        found = (keys == bits).all(dim=1)
        hit = found.any()
        assert self._misses is not None
        self._misses.add_(hit.logical_not().to(torch.int64))
        return torch.where(hit, slots[found.to(torch.int64).argmax()], self._poison), hold.dtype

    def take_misses(self) -> int:
        """The forwards served the poison slot since the last call (a host read, off the critical path)."""
        if self._misses is None:
            return 0
        count = int(self._misses.item())
        if count:
            self._misses.zero_()
        return count

    def drop(self) -> int:
        """Give everything back (never waits, never raises); returns the misses not yet reported."""
        misses = self.take_misses()
        hold, background = self.hold, self.background
        self.hold, self.background, self.groups, self._misses = None, None, None, None
        if background is not None:
            background.release()
        if hold is not None:
            hold.release()
        return misses


class ThreadState(threading.local):
    """Per thread, for one enabled model: its request, the misses of its ended requests not yet reported,
    the pipeline calls it is inside, the timesteps a scheduler set in the call, and the forward in progress.

    ``row_buffer`` (the flat slab rows the served modules gather with) is written in place, so the address
    compiled graphs and CUDA graphs hold stays while the model stays on one device and the batch its width.
    """

    def __init__(self, device: torch.device) -> None:
        self.request: Request | None = None
        self.pending = 0
        self.calls = 0
        self.timesteps: torch.Tensor | None = None
        self.slot: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.row_buffer = torch.zeros(1, dtype=torch.int64, device=device)
        self.prepared_outside = False

    def serve_slot(self, slot: torch.Tensor, dtype: torch.dtype | None, rows: torch.Tensor) -> None:
        """Point the served modules at ``slot`` and its flat slab ``rows`` (device tensors, never read here)."""
        if self.row_buffer.shape != rows.shape or self.row_buffer.device != rows.device:
            self.row_buffer = torch.zeros_like(rows)  # another batch width, or the model moved: a new buffer
        self.slot, self.dtype = slot, dtype
        self.row_buffer.copy_(rows)

    def clear(self) -> None:
        """Forget the forward's slot, so a stray call outside a forward fails instead of reading stale rows."""
        self.slot, self.dtype = None, None

    def require(self, what: str) -> None:
        if self.slot is None:
            raise ConfigError(
                f"{what} is served by the AdaLN cache and can only run inside the transformer's forward while the "
                "cache is enabled; call handle.disable() to use the module on its own"
            )


class Enabled(Protocol):
    """What :class:`Requests` reads of its handle, at each use (an enabling again replaces them)."""

    model: Any
    enabled: bool
    cache: AdalnCache
    family: DiffusersFamily
    builder: Builder | None
    config: AdalnCacheConfig

    def follow(self, device: torch.device | None) -> None: ...


class Requests:
    """One enabled model's requests: each thread's (:class:`ThreadState`), and every background pass.
    The handle's request verbs are these methods; the transformer hook calls :meth:`serve`."""

    def __init__(self, handle: Enabled, device: torch.device) -> None:
        self._handle = handle
        self.state = ThreadState(device)
        self._lock = threading.Lock()  # guards _running and _closed; never held while waiting
        self._running: list[BackgroundPass] = []
        self._closed = False

    # -- the verbs of a loop of one's own ---------------------------------------------------------

    def prepare(
        self,
        plans: Sequence[Any],
        attention_kwargs: Mapping[str, Any] | None,
        *,
        what: str = "prepare()",
        on_device: bool = True,
    ) -> BuildReport:
        """End the thread's request, then hold ``plans`` as its new one (in its call, if one is running)."""
        self._end(check=True)  # the previous request is over: its mismatch raises here, before any build
        hold = self._serving(what).hold(self._family_plans(plans), attention_kwargs)
        self._open().held(hold, self._handle.cache, on_device=on_device)
        return hold.report

    def release(self, *, check: bool = True) -> None:
        if not isinstance(check, bool):  # "no" would be truthy: a report the caller meant to defer would raise
            raise ConfigError(f"release(check=...) takes True or False, got {check!r}")
        self._end(check=check)

    def check(self) -> None:
        """Raise PlanMismatchError for the thread's forwards served the poison slot since the last check."""
        state = self.state
        if state.request is not None:
            state.pending += state.request.take_misses()
        misses, state.pending = state.pending, 0
        if misses:
            raise mismatch_error(misses)

    @contextlib.contextmanager
    def request(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> Iterator[PlanHold]:
        """Hold ``plans`` for a ``with`` block, the thread's request inside it (the one before is again after
        it, unless a ``prepare`` inside ended both)."""
        builder = self._serving("prepare()")
        held = builder.hold(self._family_plans(plans), attention_kwargs)
        block = Request()
        block.held(held, self._handle.cache)
        state = self.state
        previous, state.request = state.request, block
        try:
            yield held
        finally:
            state.pending += block.drop()
            if state.request is block:
                state.request = previous
            elif previous is not None and previous is not state.request:
                state.pending += previous.drop()
        self.check()  # a forward of the block matched no plan of it (the block ended without an error)

    def start_prepare(
        self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None, *, what: str = "start_prepare()"
    ) -> None:
        """:meth:`prepare` by a background pass (or adopt the call's predicted pass when it holds these plans)."""
        keyed = self._family_plans(plans)
        if self._adopted(keyed, attention_kwargs):
            return
        self._end(check=True)
        self._background(self._serving(what), keyed, attention_kwargs, self._open())

    def finish(self) -> None:
        """The request's end: wait for its pass, raise the pass's error if no forward did, then release."""
        request = self.state.request
        background = request.background if request is not None else None
        if background is not None and not background.predicted:
            try:
                background.finish()
            except BaseException:
                self._end(check=False)
                raise
        self._end(check=True)

    # -- a pipeline call ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def call(
        self, plans: Sequence[Any] | None = None, attention_kwargs: Mapping[str, Any] | None = None
    ) -> Iterator[None]:
        """A pipeline call's request, from its start to its end however the call ends. ``plans``: the call's
        schedule predicted from its arguments, whose pass starts now with ``overlap=True`` (:meth:`_adopted`).
        A call inside a call of this thread (one pipeline calling another) is part of the outer one's request.
        """
        if plans is not None:
            plans = request_plans(plans)
        state = self.state
        if state.calls:
            state.calls += 1
            try:
                yield
            finally:
                state.calls -= 1
            return
        self._end(check=True)  # the thread's previous request is over
        request = state.request = Request(call=True)
        state.calls, state.timesteps = 1, None
        if plans is not None:
            self._predict(request, plans, attention_kwargs)
        try:
            yield
        except BaseException as exc:
            self._end_call(request)
            misses, state.pending = state.pending, 0
            if misses:  # the call's own error goes first; the mismatch is said, never raised over it
                note = str(mismatch_error(misses))
                logger.warning("AdaLN cache: the failed call's request also had a mismatch: %s", note)
                exc.add_note(f"AdaLN cache: {note}")
            raise
        self._end_call(request)
        self.check()

    def _end_call(self, request: Request) -> None:
        """Everything the call's request holds goes back, its pass too, never waited for (a failure of it
        that no forward of the call needed is logged: the call's outputs never read those plans)."""
        state = self.state
        state.calls, state.timesteps = 0, None
        if state.request is request:
            state.request = None
        state.pending += request.drop()

    def _predict(self, request: Request, plans: list[Any], attention_kwargs: Mapping[str, Any] | None) -> None:
        """Start the pass of a call's predicted schedule (``overlap=True``); an optimisation, never an error."""
        handle = self._handle
        builder = handle.builder
        if not handle.config.overlap or not handle.enabled or builder is None:
            return
        try:
            handle.follow(execution_device(handle.model))
            keyed = self._family_plans(plans)
            if keyed and self.fits(keyed, warn=False):
                self._background(builder, keyed, attention_kwargs, request, predicted=True)
        except Exception as exc:  # the schedule, when known, is built as without a prediction
            logger.debug("AdaLN cache: the predicted schedule's pass did not start: %s", exc)

    def schedule(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> None:
        """A pipeline's schedule, known inside its call (a modular pipeline's prepare block, a classic
        pipeline's first forward): held by the call's request (adopting its predicted pass when it is the
        same), by a background pass with ``overlap``. Outside a bracketed call (another library patched
        the pipeline's class) it is held for the thread with its forwards on the host path."""
        keyed = self._family_plans(plans)  # a bad plan is a PlanError before the previous request ends
        if self._adopted(keyed, attention_kwargs):
            return
        current = self.state.request
        in_call = current is not None and current.call
        self._end(check=True)
        builder = self._serving("the pipeline's schedule")
        if self._handle.config.overlap:
            self._background(builder, keyed, attention_kwargs, self._open())
            return
        self._open().held(builder.hold(keyed, attention_kwargs), self._handle.cache, on_device=in_call)

    def expect(self, timesteps: torch.Tensor) -> None:
        """A scheduler set ``timesteps`` on this thread: the next forward prepares the whole schedule."""
        self.state.timesteps = timesteps.detach().clone()

    def fits(self, plans: list[Any], *, warn: bool = True) -> bool:
        """Whether the cache can hold every plan of a schedule at once (else its plans build per forward)."""
        cache = self._handle.cache
        columns = cache.spec.plan_columns
        keys = {plan_key(plan, columns) for plan in plan_tensors(plans)}
        distinct, width = len(keys), max(slab_rows(key, columns, cache.max_plan_width) for key in keys)
        if distinct <= cache.max_plans and width <= cache.max_plan_width:
            return True
        if warn:  # not an error: each forward still builds its own plan
            logger.warning(
                "AdaLN cache: this request's schedule has %d distinct plans of up to %d rows, more than max_plans=%d "
                "x max_plan_width=%d hold; its plans build step by step (one pass each): raise max_plans (%s) or "
                "max_plan_width (%s) to build it in one pass",
                distinct,
                width,
                cache.max_plans,
                cache.max_plan_width,
                flag("max_plans"),
                flag("max_plan_width"),
            )
        return False

    # -- the forward -------------------------------------------------------------------------------

    def serve(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> PlanHold | None:
        """The one question a forward asks: its slot, for its keying inputs (set on the thread's state); returns
        what the forward holds."""
        handle = self._handle
        model, family, state = handle.model, handle.family, self.state
        builder = handle.builder
        assert builder is not None  # the hooks are registered after the builder exists
        self._schedule_at_first_forward(args, kwargs)
        plan = family.forward_plan(model, args, kwargs)
        attention_kwargs = forward_argument(model, "attention_kwargs", args, kwargs)
        request = state.request
        # A CPU forward under accelerate's offload hook takes the host path, whose device it follows.
        offloaded = plan.device.type == "cpu" and getattr(model, "_hf_hook", None) is not None
        if request is not None and request.groups is not None and not offloaded:
            served = request.slot_of(plan, builder.variant_of(attention_kwargs))
            if served is not None:
                state.serve_slot(*served, handle.cache.row_index(served[0], int(plan.shape[0])))
                return None  # the request holds its plans until it ends
        # The forward's one device-to-host read: keys, lookups and the build use this copy (the same bits).
        host = plan.detach().to("cpu")
        key = plan_key(host, handle.cache.spec.plan_columns)
        device = plan.device
        if offloaded:
            # A CPU tensor says "cpu" where the forward runs on "cpu:0" (accelerate's model offload), whose
            # .to() gave the weights fresh addresses: follow the hook's device, so a build projects like the model.
            named = execution_device(model)
            device = named if named is not None and named.type == "cpu" else device
        handle.follow(device)
        background = state.request.background if state.request is not None else None
        if background is not None:
            try:
                background.wait_for(key)
            except BaseException:
                self._end(check=False)  # the request fails here: what its pass did hold goes back now
                raise
        held = builder.hold_forward(host, key, attention_kwargs)
        try:
            state.serve_slot(held.slots, held.dtype, handle.cache.row_index(held.slots, int(host.shape[0])))
        except BaseException:
            held.release()
            raise
        return held

    def _schedule_at_first_forward(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """A classic pipeline: the schedule its scheduler set since the last forward, prepared now if it
        fits the cache (else its plans build per forward)."""
        state = self.state
        timesteps, state.timesteps = state.timesteps, None
        if timesteps is None:
            return
        if timesteps.is_floating_point() and not bool(torch.isfinite(timesteps).all()):
            raise PlanError(
                f"the pipeline's scheduler set non-finite timesteps {timesteps.tolist()} for this request of "
                f"{timesteps.numel()} step(s): the model would compute NaN outputs from them, and no table holds "
                "such a plan. diffusers' flow-match scheduler with shift_terminal (Qwen-Image's config) divides 0 by "
                "0 for a single step: use num_inference_steps >= 2, or a scheduler config without shift_terminal"
            )
        handle = self._handle
        plans = handle.family.schedule_plans(handle.model, timesteps, args, kwargs)
        if plans is None:
            logger.info("AdaLN cache: the forward's timestep is not one of the schedule's; plans build per forward")
        elif self.fits(self._family_plans(plans)):
            self.schedule(plans, forward_argument(handle.model, "attention_kwargs", args, kwargs))

    # -- ends, moves, disabling --------------------------------------------------------------------

    def close(self) -> None:
        """The way into ``disable()``: refuse new background passes, then wait for the running ones (a plain
        join would let another thread start a pass that runs on the parked weights as they are restored)."""
        with self._lock:
            self._closed = True
        self.join()

    def reopen(self) -> None:
        """Accept passes again: the handle is enabled again (after a cast, or a refused disable)."""
        with self._lock:
            self._closed = False

    def join(self) -> None:
        """Wait until every pass started here (by any thread) has ended."""
        with self._lock:
            running, self._running = self._running, []
        for background in running:
            background.join()

    def current(self) -> Request | None:
        """The calling thread's request (None: none is live)."""
        return self.state.request

    # -- helpers -----------------------------------------------------------------------------------

    def _end(self, *, check: bool) -> None:
        """End the thread's request (a call's stays the call's, empty); ``check``: raise its mismatch."""
        state = self.state
        request = state.request
        if request is not None:
            state.pending += request.drop()
            if not request.call:
                state.request = None
        if check:
            self.check()

    def _open(self) -> Request:
        """The request new plans go to: the running call's, else a new one, the thread's from now on."""
        state = self.state
        if state.request is None or not state.request.call:
            state.request = Request()
        return state.request

    def _serving(self, what: str) -> Builder:
        """The enabling's builder, or ConfigError when disabled; the cache follows where the model runs."""
        handle, builder = self._handle, self._handle.builder
        if not handle.enabled or builder is None:
            raise ConfigError(f"{what} needs the AdaLN cache enabled; this handle was disabled")
        handle.follow(execution_device(handle.model))
        return builder

    def _family_plans(self, plans: Any) -> list[Any]:
        """``plans`` as the forward keys them (the family's ``request_plan`` of each)."""
        handle = self._handle
        return [handle.family.request_plan(handle.model, plan) for plan in request_plans(plans)]

    def _keys(self, plans: Sequence[Any]) -> list[PlanKey]:
        columns = self._handle.cache.spec.plan_columns
        return [plan_key(t, columns) for t in plan_tensors(plans)]

    def _adopted(self, plans: list[Any], attention_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the thread's request holds a pass predicted for exactly ``plans`` (keys in order, variant):
        it is then the request's; another is dropped by the caller's end of the request."""
        request, builder = self.state.request, self._handle.builder
        background = request.background if request is not None else None
        if background is None or not background.predicted or builder is None:
            return False
        if background.keys != tuple(self._keys(plans)) or background.variant != builder.variant_of(attention_kwargs):
            logger.info("AdaLN cache: the schedule predicted from the pipeline call was not the request's; dropped")
            return False
        background.predicted = False
        logger.debug("AdaLN cache: the pass started from the pipeline call's predicted schedule is the request's")
        return True

    def _background(
        self,
        builder: Builder,
        plans: list[Any],
        attention_kwargs: Mapping[str, Any] | None,
        request: Request,
        *,
        predicted: bool = False,
    ) -> None:
        """Hold ``plans`` for ``request`` by a background pass; ``predicted``: a call's predicted schedule
        (a pass is started only where one is needed, and nothing is held in the foreground)."""
        cache = self._handle.cache
        if autocast_dtype(cache.device) is not None or all(t in cache for t in plan_tensors(plans)):
            # Autocast is thread-local (a pass thread would not see it); a resident request is a hit.
            if not predicted:
                request.held(builder.hold(plans, attention_kwargs), cache)
            return
        keys = self._keys(plans)
        inputs = builder.embed_ahead(plans, attention_kwargs)  # the time embedder runs here, not beside forwards
        background = BackgroundPass(
            lambda chunk: builder.hold(chunk, attention_kwargs, embed=inputs),
            plans,
            keys,
            split=len(set(keys)) > 1 and split_pays(cache.source),  # mincore only where a split is possible
        )
        background.predicted = predicted
        background.variant = builder.variant_of(attention_kwargs) if predicted else None
        with self._lock:
            started = not self._closed
            if started:
                self._running = [running for running in self._running if not running.done]
                self._running.append(background)  # registered before close() can take the list
        if started:
            request.background = background.start()
        elif not predicted:  # disable() has begun on another thread: no pass that would outlive its join
            request.held(builder.hold(plans, attention_kwargs), cache)


# -- where a request starts: a pipeline's call and its scheduler ----------------------------------

#: The attribute of a swapped class that names the pipeline's own class.
OWN_CLASS = "_adalncache_own_class"

#: Class attributes by which a library says it has wrapped a pipeline class's ``__call__`` (cache-dit).
FOREIGN_CALL_PATCHES = ("_original_call",)

#: Given the pipeline and the call's arguments by name: a context manager bracketing the call.
Bracket = Callable[[Any, Mapping[str, Any]], contextlib.AbstractContextManager[None]]


def pipeline_class(pipeline: Any) -> type:
    """The pipeline's own class (the one before :class:`PipelineWatch` swapped it)."""
    cls = type(pipeline)
    own: type = cls.__dict__.get(OWN_CLASS, cls)
    return own


def _swapped_class(own: type) -> type:
    """A subclass of ``own`` whose ``__call__`` runs inside the instance's bracket, then ``own``'s own."""

    # functools.wraps: the signature is the pipeline's own (pipelines and tools bind arguments to it).
    @functools.wraps(own.__call__)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        stock = own.__call__.__get__(self, own)  # looked up now: a wrapper put on the class later runs too
        watch: PipelineWatch | None = self.__dict__.get(PipelineWatch.ATTRIBUTE)
        if watch is None:
            return stock(*args, **kwargs)
        with watch.bracket(self, watch.arguments(stock, args, kwargs)):
            return stock(*args, **kwargs)

    namespace = {"__call__": __call__, "__module__": own.__module__, "__qualname__": own.__qualname__, OWN_CLASS: own}
    return type(own.__name__, (own,), namespace)


class PipelineWatch:
    """A pipeline's calls watched at both ends: ``__call__`` bracketed (each call is a request, from its
    start to its ``finally``) and, given ``expect``, a classic pipeline's ``scheduler.set_timesteps``
    wrapped (an instance attribute) to hand ``expect`` each call's timesteps, known only then (they may
    depend on the image size). ``pipe(...)`` looks ``__call__`` up on the class, so the instance's class
    is swapped for a same-named subclass made for it alone; how that meets another library's patch of
    the class (cache-dit's): docs/diffusers.md ("The first request").
    """

    #: The instance attribute the swapped ``__call__`` finds its watch under.
    ATTRIBUTE = "_adalncache_call_watch"
    #: Marks our ``set_timesteps`` wrapper, so a second enabling does not wrap it again.
    SCHEDULE_ATTRIBUTE = "_adalncache_schedule_watch"

    def __init__(self, pipeline: Any, bracket: Bracket, expect: Callable[[torch.Tensor], None] | None) -> None:
        self.pipeline, self.bracket, self.expect = pipeline, bracket, expect
        self._swapped: type | None = None
        self._namespace: dict[str, Any] = {}
        self._scheduler: Any = None  # the scheduler whose set_timesteps is ours

    def install(self) -> None:
        pipeline = self.pipeline
        own = pipeline_class(pipeline)
        if pipeline.__dict__.get(self.ATTRIBUTE) is not None:
            pass  # already watched
        elif any(hasattr(own, name) for name in FOREIGN_CALL_PATCHES):
            logger.info(
                "AdaLN cache: %s's __call__ is wrapped by another library; its calls are not bracketed (their "
                "schedules are held for the thread, keyed on the host)",
                own.__name__,
            )
        else:
            self._swapped = _swapped_class(own)
            self._namespace = dict(self._swapped.__dict__)
            pipeline.__dict__[self.ATTRIBUTE] = self
            pipeline.__class__ = self._swapped
        expect, scheduler = self.expect, cast(Any, getattr(pipeline, "scheduler", None))
        if expect is None or not callable(getattr(scheduler, "set_timesteps", None)):
            return
        if getattr(scheduler.__dict__.get("set_timesteps"), self.SCHEDULE_ATTRIBUTE, False):
            return  # already watched (by another handle of the same pipeline)
        original = scheduler.set_timesteps

        # functools.wraps keeps the signature visible: pipelines inspect it for `sigmas`/`timesteps`.
        @functools.wraps(original)
        def set_timesteps(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            timesteps = getattr(scheduler, "timesteps", None)
            if isinstance(timesteps, torch.Tensor):
                expect(timesteps)
            return result

        setattr(set_timesteps, self.SCHEDULE_ATTRIBUTE, True)
        scheduler.set_timesteps = set_timesteps
        self._scheduler = scheduler

    def remove(self) -> None:
        if self._scheduler is not None:
            self._scheduler.__dict__.pop("set_timesteps", None)
            self._scheduler = None
        if self._swapped is None:
            return
        pipeline = self.pipeline
        pipeline.__dict__.pop(self.ATTRIBUTE, None)
        untouched = dict(self._swapped.__dict__) == self._namespace
        if type(pipeline) is self._swapped and untouched:
            pipeline.__class__ = pipeline_class(pipeline)
        elif not untouched:
            logger.info("AdaLN cache: another library patched the pipeline's class since; it keeps the class")
        self._swapped = None

    @staticmethod
    def arguments(stock: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults applied, a ``**kwargs`` parameter's entries among them
        (``{}`` when they do not bind: the pipeline's own ``__call__`` raises its own TypeError)."""
        try:
            signature = inspect.signature(stock)
            bound = signature.bind(*args, **kwargs)
        except (TypeError, ValueError):
            return {}
        bound.apply_defaults()
        call: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)  # a modular pipeline's inputs, by name like any other argument
            else:
                call[name] = value
        return call


__all__ = ["BackgroundPass", "PipelineWatch", "Request", "Requests"]
