"""Optional stacked projections: one GEMM for every plan of one shape class, only where proven exact.

Why this exists: on a CPU the per-plan GEMMs of a pass cost far more than reading the weights
(49 plans of M=2 re-stream a 496 MiB weight 49 times per layer). Stacking the plans of one width
into a single GEMM streams it once. But stacking changes the GEMM's M, and whether the bits stay
those of the per-plan GEMM depends on the device, the kernel library and the shapes (measured: on
a CPU, bf16 stacked equals per-plan except at M=1 and fp32 differs almost everywhere; cuBLAS
differs at M=32). So nothing is assumed:

* **Probe.** The first time a shape class is seen in this process (device, dtypes, input rows M,
  number of stacked plans, K, N, the weight's address modulo 64, the projection function), the
  layer is projected both ways: per plan (those rows are the ones written) and stacked. The class
  is marked stackable only if every plan's rows are ``torch.equal``.
* **Spot check.** Every later stacked layer also projects one plan on its own (a different plan
  each layer) and compares. A mismatch marks the class unstackable (logged as a warning) and the
  layer is recomputed per plan. The other plans of a stacked layer are not checked one by one:
  the guarantee is that of the probe plus the spot checks, for a class that pins what selects
  the kernel (device, dtypes, shapes, addresses modulo 64, and every setting of
  :func:`adalncache.identity.bit_settings`: thread count, matmul precision switches...).

Comparisons are bitwise (``same_bits``: -0.0 and +0.0 differ), stricter than ``torch.equal``.

The default stays per plan (``AdalnCache(batched=False)``); ``adalncache verify`` recomputes per
plan and so confirms entries built in batched mode.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from .identity import bit_settings_key
from .plans import PlanKey
from .spec import Layer

log = logging.getLogger(__name__)

#: ``project(layer, x, weight, bias) -> y``, as ``AdalnCache.build(project=...)`` takes it.
Project = Callable[[Layer, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

#: Shape classes and their verdicts for the default projection, shared by every cache of this
#: process (the property belongs to the device's kernels, not to one cache), one dict per
#: alternative ("stacked" here, "tiled" in :mod:`adalncache.tiling`). True: bits proven equal so far.
_SHARED: dict[str, dict[Hashable, bool]] = {"stacked": {}}
_VERDICTS = _SHARED["stacked"]
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


@dataclass
class StackStats:
    """What the stacked mode did in one pass (exposed on the BuildReport)."""

    stacked_layers: int = 0  #: (layer, group) projections served by one stacked GEMM
    per_plan_layers: int = 0  #: (layer, group) projections that ran per plan (probe, no verdict yet, refused)


def _group_by_rows(keys: Sequence[PlanKey], xs: dict[PlanKey, torch.Tensor]) -> list[list[PlanKey]]:
    """Plans whose inputs have the same number of rows (the GEMM's M), in groups of two or more."""
    groups: dict[int, list[PlanKey]] = {}
    for key in keys:
        groups.setdefault(xs[key].shape[0], []).append(key)
    return [g for g in groups.values() if len(g) >= 2]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: unlike ``torch.equal`` it tells -0.0 from +0.0 (and any NaN payload apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None or not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


class ProbedClasses:
    """The verdicts of one exact alternative to the per-plan projection, by shape class.

    The one probe and spot-check bookkeeping that every such alternative shares (stacking plans
    here, tiling the output columns in :mod:`adalncache.tiling`): a class is unknown until its probe
    compares the alternative's rows with the per-plan rows bit for bit, accepted while every later
    spot check agrees, and refused (for good, in this process or pass) at the first mismatch.
    ``verdicts`` is a process-wide dict for the default projection, or a fresh one per pass for a
    custom ``project``; ``what`` names the alternative in the log.
    """

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


def shape_class(weight: torch.Tensor, x: torch.Tensor, rows: int, *extra: Hashable) -> tuple[Hashable, ...]:
    """What selects the kernel of ``F.linear(x, weight)``, for a probe's shape class.

    Device, dtypes, input rows per plan, ``extra`` (how many plans are stacked, say), the weight's
    shape, the weight's and the input's addresses modulo 64, and every setting that decides bits.
    """
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


class StackedProjector:
    """Projects the plans of one pass, stacking each width group where its shape class is proven exact.

    Verdicts for the default projection (a plain ``F.linear``) are shared by the whole process;
    a custom ``project`` (the diffusers integration's LoRA-aware forward, for one) may behave
    differently from one call to the next (another adapter, scale or weight copy), so its
    verdicts live for one pass only and every pass probes again.
    """

    def __init__(
        self, keys: Sequence[PlanKey], xs: dict[PlanKey, torch.Tensor], project: Project, *, shared: bool
    ) -> None:
        self.groups = _group_by_rows(keys, xs)
        self.grouped = {key for group in self.groups for key in group}
        self.xs = xs
        self.project = project
        self.stats = StackStats()
        self._classes = ProbedClasses("stacked projection", _VERDICTS if shared else {})
        # The stacked input of each group, built once per pass (its rows in the group's order).
        self._stacked_x = [torch.cat([xs[k] for k in group]) for group in self.groups]
        self._layer_count = 0

    def _class(self, group: Sequence[PlanKey], x: torch.Tensor, weight: torch.Tensor) -> Hashable:
        return (
            *shape_class(weight, x, self.xs[group[0]].shape[0], len(group)),
            tuple(self.xs[k].data_ptr() % 64 for k in group),
            bit_settings_key(weight.device),
        )

    def project_layer(
        self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> list[tuple[PlanKey, torch.Tensor]]:
        """The grouped plans' outputs for this layer, as (key, y) pairs; ungrouped plans are the caller's."""
        out: list[tuple[PlanKey, torch.Tensor]] = []
        turn = self._layer_count
        self._layer_count += 1
        for group, stacked_x in zip(self.groups, self._stacked_x, strict=True):
            out.extend(self._project_group(layer, group, stacked_x, weight, bias, turn))
        return out

    def _per_plan(
        self, layer: Layer, group: Sequence[PlanKey], weight: torch.Tensor, bias: torch.Tensor | None
    ) -> list[tuple[PlanKey, torch.Tensor]]:
        self.stats.per_plan_layers += 1
        return [(key, self.project(layer, self.xs[key], weight, bias)) for key in group]

    def _split(self, group: Sequence[PlanKey], y: torch.Tensor) -> list[torch.Tensor]:
        m = self.xs[group[0]].shape[0]
        return [y[i * m : (i + 1) * m] for i in range(len(group))]

    def _project_group(
        self,
        layer: Layer,
        group: Sequence[PlanKey],
        stacked_x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        turn: int,
    ) -> list[tuple[PlanKey, torch.Tensor]]:
        cls = self._class(group, stacked_x, weight)
        verdict = self._classes.get(cls)
        if verdict is False:
            return self._per_plan(layer, group, weight, bias)
        if verdict is None:
            exact = self._per_plan(layer, group, weight, bias)
            parts = self._split(group, self.project(layer, stacked_x, weight, bias))
            self._classes.probe(cls, [y for _, y in exact], parts, layer)
            return exact  # the probed layer always keeps the per-plan rows
        parts = self._split(group, self.project(layer, stacked_x, weight, bias))
        check = turn % len(group)
        alone = self.project(layer, self.xs[group[check]], weight, bias)
        if not self._classes.spot_check(cls, alone, parts[check], layer):
            return self._per_plan(layer, group, weight, bias)
        self.stats.stacked_layers += 1
        return list(zip(group, parts, strict=True))


def _describe(cls: Hashable) -> str:
    if not isinstance(cls, tuple):
        return repr(cls)
    device, wdtype, xdtype, rows, extra = cls[:5]
    shape = next((c for c in cls[5:] if isinstance(c, tuple)), ())
    plans = f"{extra} plans of {rows} input rows" if isinstance(extra, int) else f"plans of {rows} input rows, {extra}"
    return f"{plans}, weight {tuple(shape)} {wdtype} on {device}, input {xdtype}"


__all__ = [
    "ProbedClasses",
    "StackStats",
    "StackedProjector",
    "clear_verdicts",
    "same_bits",
    "shape_class",
    "shared_verdicts",
    "verdicts",
]
