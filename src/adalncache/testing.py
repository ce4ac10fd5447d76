"""Test seams, public so users can test their own error handling: make chosen layer reads
(:class:`FaultInjectingSource`) or named build phases (:func:`inject_faults`) fail, without monkeypatching.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError
from .identity import DigestSink
from .reports import NO_FAULTS, POINTS, FaultPoints
from .source import Columns, LayerWeights, WeightSource
from .spec import FINAL, Layer

if TYPE_CHECKING:
    from .cache import AdalnCache


def _make_exc(exc: BaseException | type[BaseException], where: str) -> BaseException:
    if isinstance(exc, BaseException):
        return exc
    return exc(f"injected fault at {where}")


class FaultInjectingSource:
    """A weight source that fails when a layer of ``fail_at`` (one, several, or None until :meth:`arm`) is read,
    raising ``exc`` (an instance or class) for the first ``times`` reads (None: always); everything else
    is the wrapped source's."""

    def __init__(
        self,
        source: WeightSource,
        fail_at: Layer | Iterable[Layer] | None = None,
        exc: BaseException | type[BaseException] = OSError,
        *,
        times: int | None = 1,
    ) -> None:
        self.source = source
        self.faults = 0
        self.arm(fail_at, exc, times=times)

    def arm(
        self,
        fail_at: Layer | Iterable[Layer] | None,
        exc: BaseException | type[BaseException] = OSError,
        *,
        times: int | None = 1,
    ) -> None:
        """Choose where the next reads fail (``None`` disarms)."""
        if fail_at is None:
            layers: set[Layer] = set()
        elif isinstance(fail_at, (int, str)):
            layers = {fail_at}
        else:
            layers = set(fail_at)
        spec = self.source.spec
        bad = {layer for layer in layers if not spec.has_layer(layer)}
        if bad:
            served = spec.layers()
            names = (
                f"layers 0..{spec.num_layers - 1} or 'final'"
                if spec.geometry is None
                else f"served layers ({served[0]!r} ... {served[-1]!r})"
            )
            raise ConfigError(f"fail_at must name {names}, got {bad}")
        self.fail_at = layers
        self.exc = exc
        self.remaining = times

    def disarm(self) -> None:
        self.arm(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    @property
    def fingerprint(self) -> str:
        return self.source.fingerprint

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def refresh(self) -> bool:
        return self.source.refresh()

    def stream(
        self,
        layers: Sequence[Layer],
        *,
        device: torch.device | str = "cpu",
        columns: Columns | None = None,
        read_ahead: int = 1,
        digests: DigestSink | None = None,
    ) -> Iterator[LayerWeights]:
        inner = self.source.stream(layers, device=device, columns=columns, read_ahead=read_ahead, digests=digests)
        with contextlib.closing(inner):  # type: ignore[type-var]  # a generator: close() exists
            for layer in layers:
                if layer in self.fail_at and (self.remaining is None or self.remaining > 0):
                    if self.remaining is not None:
                        self.remaining -= 1
                    self.faults += 1
                    raise _make_exc(self.exc, f"read of layer {layer}")
                yield next(inner)

    def describe(self) -> dict[str, Any]:
        return self.source.describe()


class _Injected(FaultPoints):
    def __init__(self, points: set[str], exc: BaseException | type[BaseException], times: int | None) -> None:
        self.points = points
        self.exc = exc
        self.remaining = times
        self.fired = 0

    def check(self, point: str) -> None:
        if point in self.points and (self.remaining is None or self.remaining > 0):
            if self.remaining is not None:
                self.remaining -= 1
            self.fired += 1
            raise _make_exc(self.exc, point)


@contextlib.contextmanager
def inject_faults(
    cache: AdalnCache,
    at: str | Iterable[str],
    exc: BaseException | type[BaseException] = RuntimeError,
    *,
    times: int | None = 1,
) -> Iterator[_Injected]:
    """Within the block, make ``cache``'s build raise ``exc`` at the named phase(s)."""
    points = {at} if isinstance(at, str) else set(at)
    unknown = points - set(POINTS)
    if unknown:
        raise ConfigError(f"unknown fault point(s) {sorted(unknown)}: choose from {list(POINTS)}")
    injected = _Injected(points, exc, times)
    previous = cache.fault_points
    cache.fault_points = injected
    try:
        yield injected
    finally:
        cache.fault_points = previous if previous is not injected else NO_FAULTS


__all__ = ["FINAL", "FaultInjectingSource", "inject_faults"]
