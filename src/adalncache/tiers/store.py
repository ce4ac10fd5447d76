"""Persistent store: published tables that survive restarts, shared safely by several processes.

Layout of a store directory::

    <root>/STORE                         marker with the format version
    <root>/bindings/<bhash>.json         what a binding hash stands for (for ``inspect``)
    <root>/entries/<bhash>/<phash>.entry one plan's table under one binding
    <root>/corrupt/                      entries that failed verification, moved aside
    <root>/digests/<key>.json            the digest memo: tensor digests by file identity
    <root>/locks/<bhash>/<phash>.lock    per-entry build locks (one build per fleet)

An entry is ``MAGIC | u32 header length | JSON header | part bytes ... | sha256`` where the trailing
digest covers everything before it: the plan's rows of each table part (``spec.table_parts()``) in
order, each ``(n, *part.shape)`` contiguous, listed in the header's ``parts`` with their shapes as
``<part>_shape`` (entries written before ``parts`` existed hold ``block`` then ``final``). Why this
shape: one file per (binding, plan) makes every write independent (no shared index to lock), the
header lets ``inspect`` and ``verify`` read an entry without the cache, and a whole-file digest
catches truncation and flipped bits alike.

* Binding: ``bhash`` is the sha256 of the canonical JSON of :meth:`AdalnCache.binding` (content
  digest of the projection tensors, spec with dtype, precision, variant, shard mode, numeric
  environment). Any change gives another directory, so a mismatch is a miss, never a wrong answer.
  Bindings of the first format named the checkpoint files' stat fingerprint instead of their
  content; no binding of today can equal one, so their entries are never looked up again.
* Atomic writes: a uniquely named temp file in the target directory, fsync, ``os.replace``,
  fsync of the directory. A temp file (``.tmp-<host>-<pid>-...``) is never an entry: readers,
  ``entries()`` (so ``inspect``, ``verify``, ``prune`` and the LRU) skip it, so a writer killed at
  any moment leaves at worst a temp file, which is swept when its writer is gone, and a live
  writer's file is never pruned, reported corrupt or verified. Only regular files are read.
* Every read verifies the digest and the header against the request; a bad entry is moved to
  ``corrupt/`` (counted in ``corrupt_moved``) and the cache rebuilds it.
* Recency is recorded explicitly with ``os.utime`` on every hit and write (not atime, which
  ``noatime``/``relatime`` mounts do not maintain); :meth:`Store.prune` deletes least recently
  used entries first.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..canonical import canonical_json
from ..errors import ConfigError
from ..identity.memo import DigestMemo
from ..numerics import numeric_environment
from ..options import flag
from ..plans import PlanKey
from ..slab import PlanRows
from ..source.header import read_regular
from ..spec import ModulationSpec
from .entryfile import FORMAT_VERSION, MAGIC, CorruptEntry, encode_entry, entry_rows, parse_entry

log = logging.getLogger(__name__)

_SUFFIX = ".entry"
_TMP_PREFIX = ".tmp-"
#: A temp file this old is swept even when its writer's liveness cannot be checked (another host).
_STALE_TMP_SECONDS = 3600.0


def binding_hash(binding: Mapping[str, Any]) -> str:
    """The directory name of a binding: sha256 of its canonical JSON."""
    return hashlib.sha256(canonical_json(binding)).hexdigest()[:32]


def plan_hash(key: PlanKey) -> str:
    """The file stem of a plan: sha256 of its fp32 bit patterns (little-endian int32)."""
    return hashlib.sha256(struct.pack(f"<{len(key)}i", *key)).hexdigest()[:32]


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``inspect`` lists it."""

    path: Path
    binding: str
    plan: str
    size: int
    last_used: float


@dataclass(frozen=True)
class StoredEntry:
    """A verified entry: its header and rows (``verify`` compares these with a recomputation)."""

    info: EntryInfo
    header: dict[str, Any]
    rows: PlanRows

    @property
    def key(self) -> PlanKey:
        return tuple(int(v) for v in self.header["key"])


class Store:
    """A directory of tables bound to what produced them (see the module docstring).

    ``max_bytes``: when set, every write prunes least-recently-used entries down to it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        lock_wait_s: float = 600.0,
        lock_stale_s: float = 30.0,
    ) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ConfigError(f"max_bytes must be None or an integer >= 0, got {max_bytes!r} (CLI {flag('max_bytes')})")
        for name, value in (("lock_wait_s", lock_wait_s), ("lock_stale_s", lock_stale_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r} (CLI {flag('lock_wait_s')})")
        self.path = Path(path)
        self.max_bytes = max_bytes
        #: How long a build waits for another process that is building the same entries before it
        #: builds them itself (0: never wait); a holder whose heartbeat stopped for ``lock_stale_s``
        #: is not waited for.
        self.lock_wait_s = float(lock_wait_s)
        self.lock_stale_s = float(lock_stale_s)
        self.corrupt_moved = 0
        self.swept_temp = 0
        self._host = socket.gethostname().replace("-", "_")
        marker = self.path / "STORE"
        # Another process may be creating this store right now (subdirectories and a temp marker
        # before the marker itself): only names a store makes count as "a store being born".
        own = {"bindings", "entries", "corrupt", "digests", "locks", "STORE"}
        if (
            self.path.is_dir()
            and not marker.exists()
            and any(p.name not in own and not p.name.startswith(_TMP_PREFIX) for p in self.path.iterdir())
        ):
            # Never scatter entries into a directory that holds something else (a typo'd --store ~).
            raise ConfigError(
                f"{self.path} is not empty and is not an adalncache store (no STORE marker): pass a new or empty "
                f"directory (store= / CLI {flag('store')})"
            )
        try:
            for sub in ("bindings", "entries", "corrupt"):
                (self.path / sub).mkdir(parents=True, exist_ok=True)
            if not marker.exists():
                self._atomic_write(marker, f"adalncache store format {FORMAT_VERSION}\n".encode())
        except OSError as exc:
            raise ConfigError(
                f"cannot use {self.path} as a store directory: {exc} (set store= / CLI {flag('store')})"
            ) from exc
        self.sweep_temp()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, max_bytes={self.max_bytes})"

    @property
    def memo(self) -> DigestMemo:
        """The digest memo kept in this store (tensor digests by file identity, shared by its users)."""
        return DigestMemo(self.path / "digests", write=self.write_atomic)

    def holds_other_content(self, template: Mapping[str, Any], keys: Iterable[PlanKey]) -> bool:
        """Whether some binding equal to ``template`` in all but its ``content`` has an entry for any of ``keys``.

        That is a copied checkpoint (or a copied store) whose digest is not known here yet: one
        hashing read will probably turn these entries into hits.
        """
        want = canonical_json({k: v for k, v in template.items() if k != "content"})
        keys = list(keys)
        for bhash, binding in self.bindings().items():
            if not isinstance(binding, dict) or not binding.get("content"):
                continue
            if canonical_json({k: v for k, v in binding.items() if k != "content"}) != want:
                continue
            if any(self._entry_path(bhash, key).is_file() for key in keys):
                return True
        return False

    # -- files ------------------------------------------------------------------------------

    def _entry_path(self, bhash: str, key: PlanKey) -> Path:
        return self.path / "entries" / bhash / (plan_hash(key) + _SUFFIX)

    def _temp_name(self, final: Path) -> Path:
        # host and pid in the name let sweep_temp tell a live writer's file from an orphan.
        return final.with_name(f"{_TMP_PREFIX}{self._host}-{os.getpid()}-{uuid.uuid4().hex}-{final.name}")

    def write_atomic(self, final: Path, *chunks: bytes | memoryview) -> None:
        """Write ``chunks`` to ``final`` (inside the store) so that readers see either nothing or all of it.

        The one atomic writer of the store's files (entries, bindings, the digest memo).
        """
        self._atomic_write(final, *chunks)

    def _atomic_write(self, final: Path, *chunks: bytes | memoryview) -> None:
        """Write ``chunks`` to ``final`` so that readers see either nothing or all of it."""
        tmp = self._temp_name(final)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for chunk in chunks:
                    view = memoryview(chunk)
                    while view:
                        written = os.write(fd, view)
                        view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(final.parent)

    def sweep_temp(self) -> int:
        """Delete temp files whose writer is gone (dead pid here, or older than an hour elsewhere)."""
        removed = 0
        now = time.time()
        roots = [
            self.path,
            self.path / "bindings",
            self.path / "digests",
            *(p for p in (self.path / "entries").glob("*") if p.is_dir()),
        ]
        for root in roots:
            for tmp in root.glob(_TMP_PREFIX + "*"):
                parts = tmp.name[len(_TMP_PREFIX) :].split("-")
                orphan = False
                try:
                    age = now - tmp.stat().st_mtime
                except OSError:
                    continue
                if len(parts) >= 2 and parts[0] == self._host and parts[1].isdigit():
                    orphan = not _pid_alive(int(parts[1])) or age > _STALE_TMP_SECONDS
                else:
                    orphan = age > _STALE_TMP_SECONDS
                if orphan:
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                        removed += 1
        if removed:
            log.info("store %s: swept %d orphaned temp file(s)", self.path, removed)
        self.swept_temp += removed
        return removed

    # -- writing ----------------------------------------------------------------------------

    def _ensure_binding(self, binding: Mapping[str, Any], bhash: str) -> None:
        target = self.path / "bindings" / f"{bhash}.json"
        if not target.exists():
            self._atomic_write(target, json.dumps(binding, sort_keys=True, indent=1, default=str).encode())
        (self.path / "entries" / bhash).mkdir(parents=True, exist_ok=True)

    def put(self, binding: Mapping[str, Any], key: PlanKey, rows: PlanRows) -> Path:
        """Write one plan's rows under ``binding`` atomically; returns the entry's path."""
        bhash = binding_hash(binding)
        self._ensure_binding(binding, bhash)
        chunks = encode_entry(bhash, key, rows)
        path = self._entry_path(bhash, key)
        self._atomic_write(path, *chunks)
        if self.max_bytes is not None:
            self.prune(self.max_bytes, keep={path})
        return path

    # -- reading ----------------------------------------------------------------------------

    def contains(self, binding: Mapping[str, Any], keys: Iterable[PlanKey]) -> set[PlanKey]:
        """The ``keys`` that have an entry under ``binding`` (by name only: nothing is read or verified)."""
        bhash = binding_hash(binding)
        return {key for key in keys if self._entry_path(bhash, key).is_file()}

    def _move_aside(self, path: Path, why: str, inode: int | None) -> None:
        target = self.path / "corrupt" / f"{path.parent.name}-{path.stem}-{uuid.uuid4().hex[:8]}{_SUFFIX}"
        try:
            if inode is not None and os.stat(path).st_ino != inode:
                return  # another process already replaced it with a fresh entry
            os.replace(path, target)
        except FileNotFoundError:
            return  # another process moved it first
        except OSError as exc:
            log.warning("store: cannot move corrupt entry %s aside (%s); deleting it", path, exc)
            with contextlib.suppress(OSError):
                path.unlink()
        self.corrupt_moved += 1
        log.warning("store: entry %s is corrupt (%s): moved to %s, it will be rebuilt", path, why, target)

    def get_many(
        self, binding: Mapping[str, Any], keys: Iterable[PlanKey], spec: ModulationSpec
    ) -> dict[PlanKey, PlanRows]:
        """Verified rows of the ``keys`` stored under ``binding``; anything else is a miss."""
        bhash = binding_hash(binding)
        found: dict[PlanKey, PlanRows] = {}
        for key in keys:
            path = self._entry_path(bhash, key)
            inode: int | None = None
            try:
                header, raw, offset, inode = parse_entry(path)
                if header.get("binding") != bhash or tuple(header.get("key", ())) != tuple(key):
                    raise CorruptEntry("header names another binding or plan", inode)
                rows = entry_rows(header, raw, offset, spec)
            except FileNotFoundError:
                continue
            except CorruptEntry as exc:
                self._move_aside(path, str(exc), exc.inode if exc.inode is not None else inode)
                continue
            with contextlib.suppress(OSError):
                os.utime(path)  # explicit recency for prune
            found[key] = rows
        return found

    # -- listing, health, pruning -----------------------------------------------------------

    def entries(self) -> list[EntryInfo]:
        """Every entry file, least recently used first."""
        out: list[EntryInfo] = []
        for directory in sorted((self.path / "entries").glob("*")):
            if not directory.is_dir():
                continue
            for path in directory.glob("*" + _SUFFIX):
                if path.name.startswith(_TMP_PREFIX):
                    continue  # a writer's file in progress (or an orphan sweep_temp removes): never an entry
                try:
                    st = path.stat()
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                out.append(EntryInfo(path, directory.name, path.stem, st.st_size, st.st_mtime))
        out.sort(key=lambda e: (e.last_used, str(e.path)))
        return out

    def bindings(self) -> dict[str, dict[str, Any]]:
        """Binding hash -> the binding it stands for."""
        out: dict[str, dict[str, Any]] = {}
        for path in sorted((self.path / "bindings").glob("*.json")):
            try:
                out[path.stem] = json.loads(read_regular(path))
            except (OSError, ValueError):
                out[path.stem] = {"error": "unreadable binding description"}
        return out

    def read_entry(self, info: EntryInfo) -> StoredEntry:
        """Read and verify one listed entry (raises CorruptEntry; does not move it)."""
        header, raw, offset, _ = parse_entry(info.path)
        return StoredEntry(info, header, entry_rows(header, raw, offset, None))

    def iter_entries(self, infos: Iterable[EntryInfo] | None = None) -> Iterator[StoredEntry | tuple[EntryInfo, str]]:
        """Verified entries, or ``(info, problem)`` for those that fail verification."""
        for info in self.entries() if infos is None else infos:
            try:
                item: StoredEntry | tuple[EntryInfo, str] = self.read_entry(info)
            except FileNotFoundError:
                continue  # pruned or moved aside by another process since it was listed
            except (CorruptEntry, OSError) as exc:
                item = (info, str(exc))
            yield item

    # -- can it be written? -----------------------------------------------------------------

    #: errno values that say the store cannot be written at all (read-only, no permission) ...
    READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
    #: ... or not for now (those, or no space left).
    UNWRITABLE = READ_ONLY | {errno.ENOSPC, errno.EDQUOT}

    def health(self, *, verify: bool = True) -> dict[str, Any]:
        """Verify every entry's digest (unless ``verify=False``); count temp and moved-aside files."""
        ok = 0
        bad: list[str] = []
        if verify:
            for item in self.iter_entries():
                if isinstance(item, StoredEntry):
                    ok += 1
                else:
                    bad.append(f"{item[0].path}: {item[1]}")
        temps = sum(1 for _ in self.path.rglob(_TMP_PREFIX + "*"))
        corrupt = sum(1 for _ in (self.path / "corrupt").glob("*"))
        return {"ok": ok, "corrupt": bad, "temp_files": temps, "moved_aside": corrupt}

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def prune(self, max_bytes: int, *, keep: Iterable[Path] = ()) -> int:
        """Delete least-recently-used entries until they total at most ``max_bytes``; returns how many."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"max_bytes must be an integer >= 0, got {max_bytes!r} (CLI {flag('max_bytes')})")
        protected = set(keep)
        listed = self.entries()
        total = sum(e.size for e in listed)
        removed = 0
        for entry in listed:
            if total <= max_bytes:
                break
            if entry.path in protected:
                continue
            try:
                entry.path.unlink()
            except FileNotFoundError:
                pass  # another process pruned it: it no longer counts either way
            except OSError as exc:
                log.warning("store: cannot delete %s: %s", entry.path, exc)
                continue
            total -= entry.size
            removed += 1
        # Moved-aside entries are kept for diagnosis until the next prune, which clears them.
        for path in (self.path / "corrupt").glob("*"):
            with contextlib.suppress(OSError):
                path.unlink()
        self.sweep_temp()
        if removed:
            log.info("store %s: pruned %d entries, %d bytes remain", self.path, removed, total)
        return removed


__all__ = ["MAGIC", "EntryInfo", "Store", "StoredEntry", "binding_hash", "numeric_environment", "plan_hash"]
