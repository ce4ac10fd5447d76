"""The benchmark's results: side-by-side comparisons (ratios of medians), values and notes.

A :class:`Comparison` is one subject timed (or measured) against one baseline in the same run;
:class:`Results` collects them with the section's raw values and notes, prints each comparison as
it is added, and is what :mod:`.report` writes out as JSON, Markdown and a chart.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Comparison:
    """``name``: ``subject`` against ``baseline`` (medians of ``runs`` samples each), with a target."""

    name: str
    subject: str
    baseline: str
    subject_s: list[float]
    baseline_s: list[float]
    target: float | None = None
    note: str = ""
    unit: str = "s"

    @property
    def ratio(self) -> float:
        return statistics.median(self.subject_s) / statistics.median(self.baseline_s)

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "subject": self.subject,
            "baseline": self.baseline,
            "subject_median_s": statistics.median(self.subject_s),
            "baseline_median_s": statistics.median(self.baseline_s),
            "subject_s": self.subject_s,
            "baseline_s": self.baseline_s,
            "ratio": self.ratio,
            "target": self.target,
            "met": self.met,
            "note": self.note,
            "unit": self.unit,
        }

    def fmt(self, samples: list[float]) -> str:
        value = statistics.median(samples)
        return f"{value / 2**20:.0f} MiB" if self.unit == "bytes" else fmt_s(value)

    def line(self) -> str:
        target = "" if self.target is None else f"  (target <= {self.target:g}: {'met' if self.met else 'MISSED'})"
        return (
            f"{self.name}: {self.subject} {self.fmt(self.subject_s)} / {self.baseline} "
            f"{self.fmt(self.baseline_s)} = {self.ratio:.3f}x{target}" + (f"  [{self.note}]" if self.note else "")
        )


def fmt_s(seconds: float) -> str:
    """Seconds in the unit that reads best (us, ms or s)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


@dataclass
class Results:
    """Everything one run measured: its configuration, comparisons, raw values and notes."""

    config: dict[str, Any]
    comparisons: list[Comparison] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, comparison: Comparison) -> Comparison:
        self.comparisons.append(comparison)
        print(comparison.line(), flush=True)
        return comparison

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", flush=True)

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "comparisons": [c.as_dict() for c in self.comparisons],
            "values": self.values,
            "notes": self.notes,
        }


def median_runs(fn: Callable[[], float], runs: int, before: Callable[[], None] | None = None) -> list[float]:
    """``runs`` samples of ``fn`` (seconds), ``before`` run ahead of each one (a cache drop, say)."""
    out = []
    for _ in range(runs):
        if before is not None:
            before()
        out.append(fn())
    return out


__all__ = ["Comparison", "Results", "fmt_s", "median_runs"]
