"""One build per fleet: per-entry locks in a shared store, so processes that miss the same plans build them once.

Twenty serving processes starting together on a cold store would each read the 24 GiB checkpoint
and compute the same tables. With these locks the first process to claim an entry builds it; the
others wait for it to appear in the store and restore it from there.

* **Mechanism.** ``flock`` on ``<store>/locks/<binding hash>/<plan hash>.lock``: the kernel drops
  the lock when its holder dies, SIGKILL included, so a crashed builder is taken over at once. A
  holder releases by unlinking the file while still holding it, then closing it; a waiter that
  obtains a lock on an unlinked inode sees that its path now names another file (or none) and
  tries again. Only non-blocking attempts are made, always in plan-hash order, so no two
  processes can wait for each other; a short-lived gate lock per binding makes each attempt on a
  request's entries one step, so identical requests never split the entries between them.
* **Heartbeat.** The holder rewrites its lock files every :data:`HEARTBEAT_S` seconds (its pid,
  host and a counter). A waiter watches the counter on its *own* monotonic clock (no clock
  comparison between hosts): a holder whose counter stopped for ``lock_stale_s`` is hung, or on a
  dead host whose network-filesystem lease has not expired yet, and is not waited for.
* **Bounded.** A waiter builds the entries itself once they appear (restored from the store),
  once it obtains their locks (the holder finished or died: it re-checks the store first), when
  the holder looks stale, or after ``lock_wait_s``. The lock only saves work: entries are written
  atomically, verified on read, and bit-identical whoever builds them, so the worst case is
  duplicated work, never a wrong or torn entry.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from ..plans import PlanKey

log = logging.getLogger(__name__)

#: Seconds between a holder's heartbeats.
HEARTBEAT_S = 1.0
#: First and longest pause between a waiter's polls.
POLL_S = (0.05, 0.5)


class Claim:
    """The entry locks this process holds for one build; :meth:`release` frees them (idempotent)."""

    def __init__(self, held: dict[PlanKey, tuple[Path, int]]) -> None:
        self.held = held
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if held:
            self._write_beat(0)
            self._beat = threading.Thread(target=self._heartbeat, name="adalncache-lock-heartbeat", daemon=True)
            self._beat.start()

    def __bool__(self) -> bool:
        return bool(self.held)

    def _write_beat(self, count: int) -> None:
        body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "beat": count}).encode()
        for _, fd in self.held.values():
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, body, 0)
                os.fsync(fd)

    def _heartbeat(self) -> None:
        count = 0
        while not self._stop.wait(HEARTBEAT_S):
            count += 1
            self._write_beat(count)

    def drop(self, keys: list[PlanKey]) -> None:
        """Release the locks of ``keys`` now (their entries turned out to exist already)."""
        for key in keys:
            if key in self.held:
                _release(*self.held.pop(key))

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        for path, fd in self.held.values():
            _release(path, fd)
        self.held = {}


NO_CLAIM = Claim({})


def _release(path: Path, fd: int) -> None:
    # Unlink while holding: a waiter holding the old inode then sees the path changed and retries.
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """A descriptor of ``path`` locked exclusively by this process, or None if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the previous holder released (unlinked) it between our open and our lock
        os.close(fd)
        return _try_lock(path)
    return fd


class BuildLocks:
    """The lock files of one store (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, bhash: str, phash: str) -> Path:
        return self.root / bhash / f"{phash}.lock"

    def try_claim(self, bhash: str, keys: dict[PlanKey, str]) -> tuple[Claim, list[PlanKey]]:
        """Lock every key this process can (``keys``: key -> plan hash); returns the claim and the keys others hold."""
        (self.root / bhash).mkdir(parents=True, exist_ok=True)
        held: dict[PlanKey, tuple[Path, int]] = {}
        busy: list[PlanKey] = []
        # The gate makes the attempt on all entries one step: two processes asking for the same
        # plans at the same instant cannot each get half of them (and both build). It is held for
        # the attempts only, never while building; a process that dies holding it releases it.
        gate = os.open(self.root / bhash / ".gate", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            for key, phash in sorted(keys.items(), key=lambda item: item[1]):
                path = self.path(bhash, phash)
                fd = _try_lock(path)
                if fd is None:
                    busy.append(key)
                else:
                    held[key] = (path, fd)
        except BaseException:
            for path, fd in held.values():
                _release(path, fd)
            raise
        finally:
            os.close(gate)
        return Claim(held), busy

    def beat(self, bhash: str, phash: str) -> bytes | None:
        """The current content of a lock file (its holder's heartbeat), or None if there is none."""
        try:
            return self.path(bhash, phash).read_bytes()
        except OSError:
            return None


class Staleness:
    """Whether a holder's heartbeat has stopped, judged on this process's monotonic clock."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._seen: bytes | None = None
        self._since = time.monotonic()

    def stale(self, beat: bytes | None) -> bool:
        now = time.monotonic()
        if beat != self._seen:
            self._seen, self._since = beat, now
            return False
        return now - self._since > self.stale_s


__all__ = ["HEARTBEAT_S", "NO_CLAIM", "POLL_S", "BuildLocks", "Claim", "Staleness"]
