"""The rebuild pass: stream this rank's layers once and project every plan into its reserved slot.

Why each plan is projected on its own, at its own M: the bits of a GEMM depend on M (and on the
kernel M selects), and the forward projects one plan's rows at a time. The batched mode
(:mod:`adalncache.batching`) stacks plans only where a probe proved the bits unchanged.

``embed(plan)`` gives the projections' input: one tensor (every layer's input), or a mapping from
input name (``spec.input_of(layer)``) to tensor, for a family whose layers take differently cast
inputs or fewer rows of the same embedding. Each input has ``m <= n`` rows for a plan of ``n``
rows (exactly the rows the forward feeds the module); a layer is projected at its input's own
``M = m``, and its table rows ``m`` to ``n`` are zeroed so a slot's tables never depend on what it
held before.

The pass is purely local: no collective runs inside it, so a failure on one rank can never leave
a peer blocked. Every failure is labelled with the phase it came from (``embed of plan ...``,
``read of layer 3``, ``projection of layer 3``) for the ``BuildError`` the cache raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .batching import StackedProjector
from .errors import PlanError, failing_at, mark_failed_at
from .faults import FaultPoints
from .identity import DigestSink
from .plans import PlanKey, format_plan, plan_key
from .reports import BuildReport
from .slab import Slab
from .source import WeightSource
from .spec import Layer, ModulationSpec
from .tiling import TiledProjector

if TYPE_CHECKING:
    from .distributed import Collective

#: ``embed(plan) -> (len(plan), in_features)``, or a mapping from input name to ``(m, in_features)``
#: tensors: the exact input of the projections for a plan.
EmbedFn = Callable[[torch.Tensor], "torch.Tensor | Mapping[str, torch.Tensor]"]
#: A plan's projection inputs by name (one name, every layer's, when ``embed`` returns a tensor).
Inputs = dict[str, torch.Tensor]
#: ``project(layer, x, weight, bias) -> (len(plan), out_features)``; default ``F.linear``. ``bias`` is
#: None for a layer without one, as ``nn.Linear(..., bias=False)`` passes it.
ProjectFn = Callable[[Layer, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias.float() if bias is not None else None


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


class RebuildPass:
    """One pass over the weight source for one build: embed, stream, project, write into the slab."""

    def __init__(
        self,
        *,
        spec: ModulationSpec,
        source: WeightSource,
        slab: Slab,
        collective: Collective,
        precision: str,
        read_ahead: int,
        progress: bool | None,
        batched: bool,
        faults: FaultPoints,
        out_dtype: torch.dtype | None = None,
        digests: DigestSink | None = None,
        tiled: bool | str = False,
    ) -> None:
        self.spec = spec
        self.source = source
        self.slab = slab
        self.collective = collective
        self.precision = precision
        self.read_ahead = read_ahead
        self.progress = progress
        self.batched = batched
        self.faults = faults
        #: Under autocast, the dtype the resident projection returns; every projection must return it
        #: (the slab holds its values exactly, and the cache serves them back in it).
        self.out_dtype = out_dtype
        #: Hashes the bytes the pass reads (the content identity), when the digest is not known yet.
        self.digests = digests
        #: Project the plans that are not stacked tile by tile where proven exact (adalncache.tiling):
        #: True, False, or "auto" (exact and faster, default projection only).
        self.tiled = tiled

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
        want_dtype = torch.float32 if self.precision == "fp32" else spec.dtype
        if self.precision == "match" and x.dtype != want_dtype:
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
        with torch.no_grad():
            xs = self.embed_all(keys, tensors, embed)
            work = self.collective.local_work(self.spec.layers(), self.slab)
            fp32 = self.precision == "fp32"
            bar = tqdm(
                total=len(work.layers),
                desc="adalncache pass",
                unit="layer",
                leave=False,
                disable=(not self.progress) if self.progress is not None else None,
            )
            try:
                stream = self.source.stream(
                    work.layers,
                    device=self.slab.device,
                    columns=work.columns,
                    read_ahead=self.read_ahead,
                    digests=self.digests,
                )
                rows = {key: tensors[key].shape[0] for key in keys}
                stackers: dict[str, StackedProjector] = {}
                if self.batched:
                    with failing_at("projection setup (batched)"):
                        for name in self.spec.inputs:
                            by_key = {key: xs[key][name] for key in keys}
                            stackers[name] = StackedProjector(keys, by_key, project, shared=project is default_project)
                alone = {
                    name: [k for k in keys if name not in stackers or k not in stackers[name].grouped]
                    for name in self.spec.inputs
                }
                tilers = self._tilers(keys, xs, project)
                with contextlib.closing(stream), failing_at("read"):  # type: ignore[type-var]  # a generator: close() exists
                    for lw in labelled(stream, work.layers):
                        weight, bias = (lw.weight.float(), _float(lw.bias)) if fp32 else (lw.weight, lw.bias)
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
                if stackers:
                    report.stacked_layers = sum(st.stats.stacked_layers for st in stackers.values())
                    report.per_plan_layers = sum(st.stats.per_plan_layers for st in stackers.values())
                report.tiled_layers = sum(t.stats.tiled_layers for t in tilers.values())
            finally:
                bar.close()

    def _tilers(
        self, keys: Sequence[PlanKey], xs: dict[PlanKey, Inputs], project: ProjectFn
    ) -> dict[str, TiledProjector]:
        """One tiled projector per input name, when this pass tiles (``"auto"``: the default projection only)."""
        default = project is default_project
        if self.tiled is False or (self.tiled == "auto" and not default):
            return {}
        return {
            name: TiledProjector({key: xs[key][name] for key in keys}, project, shared=default, mode=self.tiled)
            for name in self.spec.inputs
        }


__all__ = ["EmbedFn", "Inputs", "ProjectFn", "RebuildPass", "default_project", "labelled"]
