"""Named fault points inside the cache: the seam ``adalncache.testing`` uses to inject failures.

The cache calls :meth:`FaultPoints.check` at a few named moments of a build (``"embed"``,
``"project"``, ``"publish"``, ``"host_write"``, ``"store_write"``, ``"store_read"``). The default
object does nothing; :func:`adalncache.testing.inject_faults` installs one that raises, so tests
reach every failure path without monkeypatching private names.
"""

from __future__ import annotations

POINTS = ("embed", "project", "publish", "host_write", "host_read", "store_write", "store_read")


class FaultPoints:
    """No faults: every check passes. Subclasses raise at chosen points."""

    def check(self, point: str) -> None:
        """Called by the cache at ``point``; raise to simulate a failure there."""


NO_FAULTS = FaultPoints()

__all__ = ["NO_FAULTS", "POINTS", "FaultPoints"]
