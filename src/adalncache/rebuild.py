"""The rebuild pass: stream this rank's layers once and project every plan into its reserved slot, per
plan at its own M (a GEMM's bits depend on M), or by an alternative only where a probe proved it
bit-identical: **stacked** (``batched=True``) or **tiled** (``tiled=``) (docs/exactness.md, rules 1, 7, 8).

A layer is projected at its input's own M (``m <= n`` rows for a plan of ``n``) and its rows ``m`` to
``n`` are zeroed. The pass is purely local (no collective inside it: a failure on one rank never leaves
a peer blocked), and every failure is labelled with its phase for the ``BuildError`` the cache raises.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .errors import PlanError, failing_at, mark_failed_at
from .identity import DigestSink, bit_settings_key
from .options import CacheOptions
from .plans import PlanKey, format_plan, plan_key
from .reports import BuildReport, FaultPoints
from .slab import Slab, same_bits
from .source import WeightSource
from .spec import Layer, ModulationSpec

if TYPE_CHECKING:
    from .distributed import Collective

log = logging.getLogger(__name__)

#: ``embed(plan) -> (len(plan), in_features)``, or a mapping from input name to ``(m, in_features)``
#: tensors: the exact input of the projections for a plan.
EmbedFn = Callable[[torch.Tensor], "torch.Tensor | Mapping[str, torch.Tensor]"]
#: A plan's projection inputs by name (one name, every layer's, when ``embed`` returns a tensor).
Inputs = dict[str, torch.Tensor]
#: One projection input of each plan of a pass.
PlanInputs = dict[PlanKey, torch.Tensor]
#: ``project(layer, x, weight, bias) -> (len(plan), out_features)``; default ``F.linear``. ``bias`` is
#: None for a layer without one, as ``nn.Linear(..., bias=False)`` passes it.
ProjectFn = Callable[[Layer, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

#: Output rows of the weight per tile. 2,048 rows of a 2,688-wide bf16 weight are 10.5 MiB, which
#: stays in the last-level cache while every plan of a request uses it; a layer no wider than one
#: tile is projected whole. Part of every shape class, so a new value is probed anew.
TILE_ROWS = 2048


def default_project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The resident projection: ``F.linear``."""
    return F.linear(x, weight, bias)


def labelled(stream: Iterator[Any], layers: Sequence[Layer]) -> Iterator[Any]:
    """Iterate ``stream`` while labelling a read failure with the layer that was being read."""
    for layer in layers:
        try:
            item = next(stream)
        except StopIteration:
            return
        except BaseException as exc:
            mark_failed_at(exc, f"read of layer {layer}")
            raise
        yield item


# -- probes: an alternative to the per-plan projection, only where proven exact -----------------

#: Shape classes and their verdicts for the default projection, shared by every cache of this
#: process, one dict per alternative ("stacked", "tiled", and the tiled probe's "tiled speed").
#: True: bits proven equal so far.
_SHARED: dict[str, dict[Hashable, bool]] = {}
_LOCK = threading.Lock()


def shared_verdicts(kind: str) -> dict[Hashable, bool]:
    """The process-wide verdicts of alternative ``kind`` (created empty on first use)."""
    with _LOCK:
        return _SHARED.setdefault(kind, {})


def clear_verdicts() -> None:
    """Forget every probe result of every alternative (tests; or after changing torch's backend settings)."""
    with _LOCK:
        for table in _SHARED.values():
            table.clear()


def verdicts(kind: str = "stacked") -> dict[Hashable, bool]:
    """A copy of the probe results so far of alternative ``kind``, keyed by shape class."""
    with _LOCK:
        return dict(_SHARED.get(kind, {}))


def shape_class(weight: torch.Tensor, x: torch.Tensor, rows: int, *extra: Hashable) -> tuple[Hashable, ...]:
    """What selects the kernel of ``F.linear(x, weight)``, for a probe's shape class (each alternative adds
    ``extra`` and the settings that decide bits)."""
    return (
        str(weight.device),
        weight.dtype,
        x.dtype,
        rows,
        *extra,
        tuple(weight.shape),
        weight.data_ptr() % 64,
        x.data_ptr() % 64,
    )


def _describe(cls: Hashable) -> str:
    if not isinstance(cls, tuple):
        return repr(cls)
    device, wdtype, xdtype, rows, extra = cls[:5]
    shape = next((c for c in cls[5:] if isinstance(c, tuple)), ())
    plans = f"{extra} plans of {rows} input rows" if isinstance(extra, int) else f"plans of {rows} input rows, {extra}"
    return f"{plans}, weight {tuple(shape)} {wdtype} on {device}, input {xdtype}"


class ProbedClasses:
    """The verdicts of one exact alternative to the per-plan projection, by shape class: unknown until its
    probe, accepted while every later spot check agrees, refused for good at the first mismatch. Process-wide
    for the default projection (the device's kernels'), per pass for a custom ``project`` (it may change)."""

    def __init__(self, what: str, verdicts: dict[Hashable, bool]) -> None:
        self.what = what
        self._verdicts = verdicts

    def get(self, cls: Hashable) -> bool | None:
        """True: proven equal so far; False: refused; None: not probed yet."""
        with _LOCK:
            return self._verdicts.get(cls)

    def probe(self, cls: Hashable, exact: Sequence[torch.Tensor], other: Sequence[torch.Tensor], layer: Layer) -> bool:
        """Record (and return) whether every ``other`` row block is bitwise ``exact``'s, for ``cls``."""
        same = all(same_bits(y, part) for y, part in zip(exact, other, strict=True))
        with _LOCK:
            self._verdicts[cls] = same
        if same:
            log.info("%s is bit-identical for %s (probed at layer %s)", self.what, _describe(cls), layer)
        else:
            log.info("%s is NOT bit-identical for %s: projecting per plan", self.what, _describe(cls))
        return same

    def spot_check(self, cls: Hashable, alone: torch.Tensor, other: torch.Tensor, layer: Layer) -> bool:
        """One plan's per-plan rows against the alternative's; a mismatch refuses ``cls`` (logged as a warning)."""
        if same_bits(alone, other):
            return True
        with _LOCK:
            self._verdicts[cls] = False
        log.warning(
            "%s differed from the per-plan one at layer %s (%s); projecting this shape class per plan from now on",
            self.what,
            layer,
            _describe(cls),
        )
        return False


class _Projector:
    """What both alternatives keep for one pass: the plans' inputs, the projection, the verdicts, the layer turn,
    and the build's report, whose ``stacked_layers``, ``per_plan_layers`` and ``tiled_layers`` they count."""

    def __init__(self, xs: PlanInputs, project: ProjectFn, classes: ProbedClasses, report: BuildReport) -> None:
        self.xs, self.project, self._classes, self.report = xs, project, classes, report
        self._layer_count = 0

    def _turn(self) -> int:
        """This layer's turn: which plan of a group the spot check projects alone (a different one each layer)."""
        self._layer_count += 1
        return self._layer_count - 1

    def _whole(
        self, layer: Layer, keys: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> dict[PlanKey, torch.Tensor]:
        return {key: self.project(layer, self.xs[key], weight, bias) for key in keys}


class StackedProjector(_Projector):
    """Projects the plans of one pass, stacking each group of one input width where its class is proven exact."""

    def __init__(
        self, keys: Sequence[PlanKey], xs: PlanInputs, project: ProjectFn, report: BuildReport, *, shared: bool
    ):
        classes = ProbedClasses("stacked projection", shared_verdicts("stacked") if shared else {})
        super().__init__(xs, project, classes, report)
        groups: dict[int, list[PlanKey]] = {}
        for key in keys:
            groups.setdefault(xs[key].shape[0], []).append(key)
        #: Plans whose inputs have the same rows (the GEMM's M), in groups of two or more.
        self.groups = [g for g in groups.values() if len(g) >= 2]
        self.grouped = {key for group in self.groups for key in group}
        # The stacked input of each group, built once per pass (its rows in the group's order).
        self._stacked_x = [torch.cat([xs[k] for k in group]) for group in self.groups]

    def project_layer(
        self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> list[tuple[PlanKey, torch.Tensor]]:
        """The grouped plans' outputs for this layer, as (key, y) pairs; ungrouped plans are the caller's."""
        out: list[tuple[PlanKey, torch.Tensor]] = []
        turn = self._turn()
        for group, stacked_x in zip(self.groups, self._stacked_x, strict=True):
            m = self.xs[group[0]].shape[0]
            addresses = tuple(self.xs[k].data_ptr() % 64 for k in group)
            cls = (*shape_class(weight, stacked_x, m, len(group)), addresses, bit_settings_key(weight.device))
            verdict = self._classes.get(cls)
            if verdict is None:
                exact = self._per_plan(layer, group, weight, bias)
                parts = self.project(layer, stacked_x, weight, bias).split(m)
                self._classes.probe(cls, list(exact.values()), parts, layer)
                out.extend(exact.items())  # the probed layer always keeps the per-plan rows
                continue
            if verdict:
                parts = self.project(layer, stacked_x, weight, bias).split(m)
                check = turn % len(group)
                alone = self.project(layer, self.xs[group[check]], weight, bias)
                if self._classes.spot_check(cls, alone, parts[check], layer):
                    self.report.stacked_layers += 1
                    out.extend(zip(group, parts, strict=True))
                    continue
            out.extend(self._per_plan(layer, group, weight, bias).items())
        return out

    def _per_plan(
        self, layer: Layer, group: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> dict[PlanKey, torch.Tensor]:
        self.report.per_plan_layers += 1
        return self._whole(layer, group, weight, bias)


def tile_bounds(width: int, tile_rows: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each tile of ``width`` output rows: ``tile_rows`` each, the last one taking the
    remainder, never short: a GEMM a few rows wide can take another kernel path (docs/exactness.md, rule 8)
    in a shape the probe's class does not single out."""
    if width <= tile_rows:
        return [(0, width)]
    starts = list(range(0, width - tile_rows + 1, tile_rows))
    return [(start, starts[i + 1] if i + 1 < len(starts) else width) for i, start in enumerate(starts)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TiledProjector(_Projector):
    """Projects the plans of one pass tile by tile where their shape class is proven exact. ``mode``:
    ``"auto"`` tiles a class its probe found exact and faster, default projection only (a custom ``project=``
    need not accept a slice of the weight); ``True`` tiles every class found exact."""

    def __init__(self, xs: PlanInputs, project: ProjectFn, report: BuildReport, *, shared: bool, mode: bool | str):
        self.mode, self.tile_rows = mode, TILE_ROWS
        verdicts = shared_verdicts("tiled") if shared else {}
        super().__init__(xs, project, ProbedClasses(f"tiled projection ({self.tile_rows}-row tiles)", verdicts), report)
        #: Whether the probe found the tiled projection faster, by class (auto mode reads it).
        self._faster: dict[Hashable, bool] = shared_verdicts("tiled speed") if shared else {}

    def project_layer(
        self, layer: Layer, keys: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> list[tuple[PlanKey, torch.Tensor]]:
        """Every one of ``keys``'s outputs for this layer, as (key, y) pairs, each at its plan's own M."""
        turn = self._turn()
        if weight.shape[0] <= self.tile_rows:
            return list(self._whole(layer, keys, weight, bias).items())
        classes: dict[Hashable, list[PlanKey]] = {}
        for key in keys:
            x = self.xs[key]
            shape = shape_class(weight, x, x.shape[0], f"tiles of {self.tile_rows} rows")
            classes.setdefault((*shape, bit_settings_key(weight.device)), []).append(key)
        out: dict[PlanKey, torch.Tensor] = {}
        accepted: list[tuple[Hashable, list[PlanKey]]] = []
        for cls, group in classes.items():
            verdict = self._classes.get(cls)
            if verdict is None:
                out.update(self._probe(layer, cls, group, weight, bias))
            elif verdict and (self.mode is True or self._faster.get(cls, False)):
                accepted.append((cls, group))
            else:
                out.update(self._whole(layer, group, weight, bias))
        if accepted:
            tiled = self._tiled(layer, [k for _, group in accepted for k in group], weight, bias)
            for cls, group in accepted:
                check = group[turn % len(group)]
                alone = self.project(layer, self.xs[check], weight, bias)
                if self._classes.spot_check(cls, alone, tiled[check], layer):
                    self.report.tiled_layers += 1
                    out.update((k, tiled[k]) for k in group)
                else:
                    out.update(self._whole(layer, group, weight, bias))
        return [(key, out[key]) for key in keys]

    def _tiled(
        self, layer: Layer, keys: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> dict[PlanKey, torch.Tensor]:
        """Every plan of ``keys`` projected one tile of output columns at a time, all plans per tile."""
        width = weight.shape[0]
        out: dict[PlanKey, torch.Tensor] = {}
        for start, stop in tile_bounds(width, self.tile_rows):
            w_tile, b_tile = weight[start:stop], (bias[start:stop] if bias is not None else None)
            for key in keys:
                y = self.project(layer, self.xs[key], w_tile, b_tile)
                if key not in out:
                    out[key] = torch.empty((y.shape[0], width), dtype=y.dtype, device=y.device)
                out[key][:, start:stop] = y
        return out

    def _probe(
        self, layer: Layer, cls: Hashable, group: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> dict[PlanKey, torch.Tensor]:
        """Project ``group`` whole (the rows written) and tiled, timed; record whether tiling is exact and faster.
        The whole projection is timed on its second run: the first touches the weight first (page faults)."""
        device = weight.device
        whole = self._whole(layer, group, weight, bias)
        _sync(device)
        start = time.perf_counter()
        tiled = self._tiled(layer, group, weight, bias)
        _sync(device)
        middle = time.perf_counter()
        self._whole(layer, group, weight, bias)
        _sync(device)
        faster = middle - start < time.perf_counter() - middle
        self._faster[cls] = faster
        if self._classes.probe(cls, [whole[k] for k in group], [tiled[k] for k in group], layer):
            log.info(
                "tiled projection %s than whole for %d plan(s) at layer %s",
                "faster" if faster else "slower",
                len(group),
                layer,
            )
        return whole  # the probed layer always keeps the whole rows


# -- the pass ----------------------------------------------------------------------------------


@dataclass(eq=False)
class RebuildPass:
    """One pass over the weight source for one build: embed, stream, project, write into the slab. ``out_dtype``:
    under autocast, the dtype the resident projection returns, which every projection must return."""

    spec: ModulationSpec
    source: WeightSource
    slab: Slab
    collective: Collective
    options: CacheOptions
    faults: FaultPoints
    _: KW_ONLY
    out_dtype: torch.dtype | None
    digests: DigestSink | None

    def _write(self, slot: int, layer: Layer, y: torch.Tensor, columns: Any, rows: int) -> None:
        if self.out_dtype is not None and y.dtype != self.out_dtype:
            raise PlanError(
                f"under torch.autocast the projection of layer {layer} returned {y.dtype}, but the resident "
                f"projection returns {self.out_dtype}: a project= function must run its GEMM under the "
                f"caller's autocast, as F.linear does"
            )
        self.slab.write_projection(slot, layer, y, columns, rows)

    def _checked_input(self, name: str | None, x: object, rows: int) -> torch.Tensor:
        """One projection input of a plan of ``rows`` rows, checked for shape and dtype, on the cache device."""
        spec = self.spec
        what = "embed(plan)" if name is None else f"embed(plan)[{name!r}]"
        k = spec.in_features
        if name is None:
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (rows, k):
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise PlanError(
                    f"embed(plan) must return a ({rows}, {k}) tensor for a plan of {rows} timesteps, got {shape}"
                )
        elif not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= rows:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise PlanError(
                f"{what} must be an (m, {k}) tensor with 1 <= m <= {rows} (the rows the forward feeds the layers "
                f"taking {name!r}) for a plan of {rows} rows, got {shape}"
            )
        precision = self.options.precision
        want_dtype = torch.float32 if precision == "fp32" else spec.dtype
        if precision == "match" and x.dtype != want_dtype:
            raise PlanError(
                f"{what} returned {x.dtype} but precision='match' projects in the weights' dtype "
                f"{spec.dtype}: return silu(temb).to({spec.dtype}) as the model's forward does"
            )
        return x.to(self.slab.device, want_dtype)

    def embed_all(
        self, keys: Sequence[PlanKey], tensors: dict[PlanKey, torch.Tensor], embed: EmbedFn
    ) -> dict[PlanKey, Inputs]:
        """Each plan's projection inputs by name, checked for shape and dtype, on the cache device."""
        out: dict[PlanKey, Inputs] = {}
        names = self.spec.inputs
        columns = self.spec.plan_columns
        for key in keys:
            plan = tensors[key]
            rows = plan.shape[0]
            with failing_at(f"embed of plan {format_plan(key, columns=columns)}"):
                self.faults.check("embed")
                # A copy: the caller's tensor is not embed's to change, and a change made to the copy
                # is seen below instead of filing rows of other timesteps under this plan's key.
                given = plan.clone()
                x = embed(given)
                changed = plan_key(given, columns)
                if changed != key:
                    raise PlanError(
                        f"embed(plan) changed its plan in place (to {format_plan(changed, columns=columns)}): the rows "
                        f"it returns would be filed under {format_plan(key, columns=columns)}; compute from the plan "
                        f"without writing to it"
                    )
                if isinstance(x, Mapping):
                    if set(x) != set(names):
                        raise PlanError(
                            f"embed(plan) returned inputs {sorted(map(str, x))}, but this cache's layers take "
                            f"{sorted(names)}: return one tensor per input name (spec.input_of(layer))"
                        )
                    out[key] = {name: self._checked_input(name, x[name], rows) for name in names}
                else:
                    one = self._checked_input(None, x, rows)
                    out[key] = dict.fromkeys(names, one)
        return out

    def run(
        self,
        keys: list[PlanKey],
        slots: dict[PlanKey, int],
        tensors: dict[PlanKey, torch.Tensor],
        embed: EmbedFn,
        project: ProjectFn,
        report: BuildReport,
    ) -> None:
        """Stream this rank's layers once; project each plan at its input's own M into its reserved slot."""
        options = self.options
        with torch.no_grad():
            xs = self.embed_all(keys, tensors, embed)
            work = self.collective.local_work(self.spec.layers(), self.slab)
            fp32 = options.precision == "fp32"
            disable = (not options.progress) if options.progress is not None else None
            bar = tqdm(total=len(work.layers), desc="adalncache pass", unit="layer", leave=False, disable=disable)
            try:
                stream = self.source.stream(
                    work.layers,
                    device=self.slab.device,
                    columns=work.columns,
                    read_ahead=options.read_ahead,
                    digests=self.digests,
                )
                rows = {key: tensors[key].shape[0] for key in keys}
                default = project is default_project
                stackers: dict[str, StackedProjector] = {}
                if options.batched:
                    with failing_at("projection setup (batched)"):
                        for name in self.spec.inputs:
                            stackers[name] = StackedProjector(
                                keys, {k: xs[k][name] for k in keys}, project, report, shared=default
                            )
                alone = {
                    name: [k for k in keys if name not in stackers or k not in stackers[name].grouped]
                    for name in self.spec.inputs
                }
                tilers: dict[str, TiledProjector] = {}
                if options.tiled is True or (options.tiled == "auto" and default):
                    tilers = {
                        name: TiledProjector(
                            {k: xs[k][name] for k in keys}, project, report, shared=default, mode=options.tiled
                        )
                        for name in self.spec.inputs
                    }
                with contextlib.closing(stream), failing_at("read"):  # type: ignore[type-var]  # a generator: close() exists
                    for lw in labelled(stream, work.layers):
                        weight, bias = (lw.weight, lw.bias)
                        if fp32:
                            weight, bias = weight.float(), (bias.float() if bias is not None else None)
                        name = self.spec.input_of(lw.layer)
                        with failing_at(f"projection of layer {lw.layer}"):
                            stacker = stackers.get(name)
                            if stacker is not None:
                                self.faults.check("project")
                                for key, y in stacker.project_layer(lw.layer, weight, bias):
                                    self._write(slots[key], lw.layer, y, work.columns, rows[key])
                            tiler = tilers.get(name)
                            if tiler is not None and alone[name]:
                                self.faults.check("project")
                                for key, y in tiler.project_layer(lw.layer, alone[name], weight, bias):
                                    self._write(slots[key], lw.layer, y, work.columns, rows[key])
                            else:
                                for key in alone[name]:
                                    self.faults.check("project")
                                    y = project(lw.layer, xs[key][name], weight, bias)
                                    self._write(slots[key], lw.layer, y, work.columns, rows[key])
                        report.layers_read.append(str(lw.layer))
                        bar.update(1)
            finally:
                bar.close()
