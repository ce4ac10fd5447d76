"""Tiled projections: every plan of a pass projected tile by tile over a layer's output columns.

Why: on a CPU a per-plan pass re-streams each layer's whole weight from memory once per plan
(a 496 MiB weight at the released widths, 49 times for a 50-step request). Projecting all plans
one tile of output columns at a time (rows ``[t0, t0 + T)`` of the weight, every plan per tile)
keeps the tile in the CPU's caches while every plan uses it. Each plan is still projected at its
own M, from the same input, so each output element is the same dot product; whether the kernel
sums it in the same order for a slice of the weight as for the whole is again a property of the
device and the library, so nothing is assumed. The machinery is the stacked mode's
(:class:`~adalncache.batching.ProbedClasses`):

* **Probe.** The first time a shape class is seen (device, dtypes, plan width M, tile rows, K, N,
  the weight's and the input's addresses modulo 64, the settings that decide bits, and in this
  process or this pass as for stacking), the class's plans are projected whole (those rows are
  written) and tiled, timed both ways; the class is exact only if every plan's rows are bitwise
  equal, and faster only if the tiled projection took less time.
* **Spot check.** Every later tiled layer also projects one plan of each class whole (a different
  plan each layer) and compares; a mismatch refuses the class and projects it per plan again.

``mode``: ``"auto"`` tiles a class that its probe found exact and faster, with the default
projection only (a custom ``project=`` must accept any slice of the weight's rows, which the
diffusers integration's module forward does not); ``True`` tiles every class found exact, with
any projection; ``False`` never tiles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .batching import ProbedClasses, Project, shape_class, shared_verdicts
from .identity import bit_settings_key
from .plans import PlanKey
from .spec import Layer

log = logging.getLogger(__name__)

#: Output rows of the weight per tile. 2,048 rows of a 2,688-wide bf16 weight are 10.5 MiB, which
#: stays in the last-level cache while every plan of a request uses it; a layer no wider than one
#: tile is projected whole. Part of every shape class, so a new value is probed anew.
TILE_ROWS = 2048


@dataclass
class TileStats:
    """What the tiled mode did in one pass (exposed on the BuildReport)."""

    tiled_layers: int = 0  #: (layer, shape class) projections served tile by tile
    untiled_layers: int = 0  #: (layer, shape class) projections that ran whole (probe, refused, slower)


def tile_bounds(width: int, tile_rows: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each tile of ``width`` output rows: ``tile_rows`` each, the last one
    taking the remainder (between ``tile_rows`` and twice that).

    Why no short last tile: a GEMM a few rows wide can take another kernel path than a wide one
    (measured on the dev CPU: a bf16 GEMV of K=64 gives other bits for one output in 48 when the
    weight has 64 rows or fewer, never at 96 or more), and a short remainder tile would be such a
    GEMM, in a shape the probe's class does not single out.
    """
    if width <= tile_rows:
        return [(0, width)]
    starts = list(range(0, width - tile_rows + 1, tile_rows))
    return [(start, starts[i + 1] if i + 1 < len(starts) else width) for i, start in enumerate(starts)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TiledProjector:
    """Projects the plans of one pass tile by tile where their shape class is proven exact (and faster, in auto)."""

    def __init__(
        self,
        xs: dict[PlanKey, torch.Tensor],
        project: Project,
        *,
        shared: bool,
        mode: bool | str = True,
        tile_rows: int | None = None,
    ) -> None:
        self.xs = xs
        self.project = project
        self.mode = mode
        self.tile_rows = int(tile_rows if tile_rows is not None else TILE_ROWS)
        self.stats = TileStats()
        verdicts = shared_verdicts("tiled") if shared else {}
        self._classes = ProbedClasses(f"tiled projection ({self.tile_rows}-row tiles)", verdicts)
        #: Whether the probe found the tiled projection faster, by class (auto mode reads it).
        self._faster: dict[Hashable, bool] = shared_verdicts("tiled speed") if shared else {}
        self._layer_count = 0

    def _class(self, x: torch.Tensor, weight: torch.Tensor) -> Hashable:
        return (*shape_class(weight, x, x.shape[0], f"tiles of {self.tile_rows} rows"), bit_settings_key(weight.device))

    def project_layer(
        self, layer: Layer, keys: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> list[tuple[PlanKey, torch.Tensor]]:
        """Every one of ``keys``'s outputs for this layer, as (key, y) pairs, each at its plan's own M."""
        turn = self._layer_count
        self._layer_count += 1
        if weight.shape[0] <= self.tile_rows:
            return [(key, self.project(layer, self.xs[key], weight, bias)) for key in keys]
        classes: dict[Hashable, list[PlanKey]] = {}
        for key in keys:
            classes.setdefault(self._class(self.xs[key], weight), []).append(key)
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
                    self.stats.tiled_layers += 1
                    out.update((k, tiled[k]) for k in group)
                else:
                    out.update(self._whole(layer, group, weight, bias))
        return [(key, out[key]) for key in keys]

    def _whole(
        self, layer: Layer, group: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> dict[PlanKey, torch.Tensor]:
        self.stats.untiled_layers += 1
        return {key: self.project(layer, self.xs[key], weight, bias) for key in group}

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

        The first whole projection is not timed: it is the first touch of the layer's weight (page
        faults of a mapped checkpoint, cache misses), which made tiling, timed second over warm
        memory, look faster than it is. The whole projection is timed again after the tiled one.
        """
        device = weight.device
        whole = self._whole(layer, group, weight, bias)
        _sync(device)
        start = time.perf_counter()
        tiled = self._tiled(layer, group, weight, bias)
        _sync(device)
        middle = time.perf_counter()
        for key in group:
            self.project(layer, self.xs[key], weight, bias)
        _sync(device)
        faster = middle - start < time.perf_counter() - middle
        self._faster[cls] = faster
        exact = self._classes.probe(cls, [whole[k] for k in group], [tiled[k] for k in group], layer)
        if exact:
            log.info(
                "tiled projection %s than whole for %d plan(s) at layer %s",
                "faster" if faster else "slower",
                len(group),
                layer,
            )
        return whole  # the probed layer always keeps the whole rows


__all__ = ["TILE_ROWS", "TileStats", "TiledProjector", "tile_bounds"]
