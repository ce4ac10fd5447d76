"""The digest memo: which projection-tensor digests a file held when it had a given identity.

Hashing the projections costs a read of every byte (24.2 GiB on the released model). The memo
makes that a one-time cost per file identity: a pass that hashes records what it learnt under
each file's :class:`~adalncache.identity.files.FileStamp` (stat identity, ctime, host, resolved
path, header hash), and a later process whose files still carry those stamps knows the content
digest with a ``stat`` and a small JSON read.

Where it lives:

* in the store, ``<store>/digests/<stamp key>.json``, one record per *file* (a checkpoint whose
  one shard was re-saved re-hashes only that shard), shared by every process using the store;
* in this process, always (a dictionary), so a cache without a store, or a second cache over the
  same files, does not hash twice.

A record is used only when its stamp equals the file's current stamp field by field (the key is
just an index). Several processes may record the same file at once: the read-merge-write runs
under ``flock`` of a lock file beside the record and the record is replaced atomically; where the
lock is not shared (some network filesystems) a lost update only means a later re-hash, never a
wrong digest, because every record is checked against the file's identity when read.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..source.header import read_regular
from .digest import ALGORITHM, LEAVES, TensorDigest
from .files import FileStamp

log = logging.getLogger(__name__)

#: Format of a memo record.
RECORD_FORMAT = 1

_process_lock = threading.Lock()
#: stamp key -> (stamp, tensor name -> record): what this process learnt, store or no store.
_process_memo: dict[str, tuple[FileStamp, dict[str, TensorDigest]]] = {}  # records by role

Writer = Callable[[Path, bytes], None]


def _merge(into: dict[str, TensorDigest], tensors: Mapping[str, TensorDigest]) -> dict[str, TensorDigest]:
    """Union of two records of one file (by role); a contradicting tensor keeps the newer one (just read)."""
    out = dict(into)
    for role, record in tensors.items():
        have = out.get(role)
        merged = have.merged(record, role) if have is not None else None
        out[role] = merged if merged is not None else record
    return out


class DigestMemo:
    """Tensor digests by file identity: in this process, and in ``directory`` when given (a store's)."""

    def __init__(self, directory: Path | None = None, *, write: Writer | None = None) -> None:
        self.directory = directory
        self._write = write

    def lookup(self, stamp: FileStamp) -> dict[str, TensorDigest]:
        """What is known of the projection tensors the file ``stamp`` names holds, by role (may be empty)."""
        with _process_lock:
            held = _process_memo.get(stamp.key)
        found = dict(held[1]) if held is not None and held[0] == stamp else {}
        if self.directory is not None:
            on_disk = self._read(stamp)
            if on_disk:
                found = _merge(on_disk, found)
                with _process_lock:
                    _process_memo[stamp.key] = (stamp, found)
        return found

    def record(self, stamp: FileStamp, tensors: Mapping[str, TensorDigest]) -> None:
        """Remember ``tensors`` (role -> record) for the file ``stamp`` names; never raises on I/O.

        Only bytes this process read itself belong here: a digest composed with other ranks'
        leaves describes their copies, which need not equal this host's file.
        """
        if not tensors:
            return
        with _process_lock:
            held = _process_memo.get(stamp.key)
            base = held[1] if held is not None and held[0] == stamp else {}
            _process_memo[stamp.key] = (stamp, _merge(base, tensors))
        if self.directory is None or self._write is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._locked(stamp):
                merged = _merge(self._read(stamp), tensors)
                body = {
                    "format": RECORD_FORMAT,
                    "hash": ALGORITHM,
                    "leaves": LEAVES,
                    "stamp": stamp.as_json(),
                    "recorded": time.time(),
                    "tensors": {role: rec.as_json() for role, rec in sorted(merged.items())},
                }
                self._write(self._path(stamp), json.dumps(body, indent=1, sort_keys=True).encode())
        except OSError as exc:
            log.warning(
                "digest memo %s: cannot record %s (%s); the next process hashes it again",
                self.directory,
                stamp.path,
                exc,
            )

    def forget(self, stamp: FileStamp) -> None:
        """Drop what is recorded for ``stamp``, here and in the store (it named other bytes); never raises."""
        with _process_lock:
            _process_memo.pop(stamp.key, None)
        if self.directory is None or self._write is None:
            return
        try:
            with self._locked(stamp):
                self._path(stamp).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("digest memo %s: cannot forget %s (%s)", self.directory, stamp.path, exc)

    def _path(self, stamp: FileStamp) -> Path:
        assert self.directory is not None
        return self.directory / f"{stamp.key}.json"

    @contextlib.contextmanager
    def _locked(self, stamp: FileStamp) -> Iterator[None]:
        fd = os.open(self._path(stamp).with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # drops the lock

    def _read(self, stamp: FileStamp) -> dict[str, TensorDigest]:
        """The on-disk record of ``stamp``, if its stamp matches in full; anything unreadable is no record."""
        try:
            data: Any = json.loads(read_regular(self._path(stamp)))
            if (
                data.get("format") != RECORD_FORMAT
                or data.get("hash") != ALGORITHM
                or data.get("leaves") != LEAVES
                or data.get("stamp") != stamp.as_json()
            ):
                return {}
            return {str(role): TensorDigest.from_json(rec) for role, rec in dict(data["tensors"]).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.info("digest memo: ignoring unreadable record %s (%s)", self._path(stamp), exc)
            return {}

    def records(self) -> list[dict[str, Any]]:
        """Every on-disk record (for ``inspect``): its stamp, when it was recorded, how many tensors."""
        if self.directory is None or not self.directory.is_dir():
            return []
        out = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                data = json.loads(read_regular(path))
                out.append({"stamp": data["stamp"], "recorded": data.get("recorded"), "tensors": len(data["tensors"])})
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out


def forget_process_memo() -> None:
    """Drop what this process remembers (tests use it to act as a fresh process)."""
    with _process_lock:
        _process_memo.clear()


__all__ = ["DigestMemo", "forget_process_memo"]
