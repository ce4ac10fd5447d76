"""The rebuild pass: stream this rank's layers once and project every plan into its reserved slot.

Why each plan is projected on its own, at its own M: the bits of a GEMM depend on M (and on the
kernel M selects), and the forward projects one plan's timesteps at a time. The batched mode
(:mod:`adalncache.batching`) stacks plans only where a probe proved the bits unchanged.

The pass is purely local: no collective runs inside it, so a failure on one rank can never leave
a peer blocked. Every failure is labelled with the phase it came from (``embed of plan ...``,
``read of layer 3``, ``projection of layer 3``) for the ``BuildError`` the cache raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .batching import StackedProjector
from .errors import PlanError, failing_at, mark_failed_at
from .faults import FaultPoints
from .plans import PlanKey, format_plan, plan_key
from .reports import BuildReport
from .slab import Slab
from .source import WeightSource
from .source.digest import DigestSink
from .spec import Layer, ModulationSpec

if TYPE_CHECKING:
    from .distributed import Collective

#: ``embed(plan) -> (len(plan), in_features)``: the exact input of the projections for a plan.
EmbedFn = Callable[[torch.Tensor], torch.Tensor]
#: ``project(layer, x, weight, bias) -> (len(plan), out_features)``; default ``F.linear``.
ProjectFn = Callable[[Layer, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
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

    def _write(self, slot: int, layer: Layer, y: torch.Tensor, columns: Any) -> None:
        if self.out_dtype is not None and y.dtype != self.out_dtype:
            raise PlanError(
                f"under torch.autocast the projection of layer {layer} returned {y.dtype}, but the resident "
                f"projection returns {self.out_dtype}: a project= function must run its GEMM under the "
                f"caller's autocast, as F.linear does"
            )
        self.slab.write_projection(slot, layer, y, columns)

    def embed_all(
        self, keys: Sequence[PlanKey], tensors: dict[PlanKey, torch.Tensor], embed: EmbedFn
    ) -> dict[PlanKey, torch.Tensor]:
        """Each plan's projection input, checked for shape and dtype, on the cache device."""
        out: dict[PlanKey, torch.Tensor] = {}
        want_dtype = torch.float32 if self.precision == "fp32" else self.spec.dtype
        for key in keys:
            plan = tensors[key]
            with failing_at(f"embed of plan {format_plan(key)}"):
                self.faults.check("embed")
                # A copy: the caller's tensor is not embed's to change, and a change made to the copy
                # is seen below instead of filing rows of other timesteps under this plan's key.
                given = plan.clone()
                x = embed(given)
                if plan_key(given) != key:
                    raise PlanError(
                        f"embed(plan) changed its plan in place (to {format_plan(plan_key(given))}): the rows it "
                        f"returns would be filed under {format_plan(key)}; compute from the plan without writing to it"
                    )
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
                out[key] = x.to(self.slab.device, want_dtype)
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
        """Stream this rank's layers once; project each plan with its own M into its reserved slot."""
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
                    work.layers, device=self.slab.device, columns=work.columns, read_ahead=self.read_ahead,
                    digests=self.digests,
                )  # fmt: skip
                stacker = None
                if self.batched:
                    with failing_at("projection setup (batched)"):
                        stacker = StackedProjector(keys, xs, project, shared=project is default_project)
                alone = [k for k in keys if stacker is None or k not in stacker.grouped]
                with contextlib.closing(stream), failing_at("read"):  # type: ignore[type-var]
                    for lw in labelled(stream, work.layers):
                        weight, bias = (lw.weight.float(), lw.bias.float()) if fp32 else (lw.weight, lw.bias)
                        with failing_at(f"projection of layer {lw.layer}"):
                            if stacker is not None:
                                self.faults.check("project")
                                for key, y in stacker.project_layer(lw.layer, weight, bias):
                                    self._write(slots[key], lw.layer, y, work.columns)
                            for key in alone:
                                self.faults.check("project")
                                y = project(lw.layer, xs[key], weight, bias)
                                self._write(slots[key], lw.layer, y, work.columns)
                        report.layers_read.append(str(lw.layer))
                        bar.update(1)
                if stacker is not None:
                    report.stacked_layers = stacker.stats.stacked_layers
                    report.per_plan_layers = stacker.stats.per_plan_layers
            finally:
                bar.close()


__all__ = ["EmbedFn", "ProjectFn", "RebuildPass", "default_project", "labelled"]
