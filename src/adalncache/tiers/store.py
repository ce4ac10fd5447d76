"""The store: published tables that survive restarts, shared safely by several processes.

The entry format (one file per binding and plan, verified on every read) is what every process sharing a
store must agree on; the rest of this module only moves these files around, atomically, and holds the
per-entry build locks (one build per fleet), which only save work. Layout, format and lock protocol:
docs/tables.md ("The store on disk", "One build per fleet").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import socket
import stat
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..geometry import TABLE_PART
from ..identity import canonical_json
from ..identity.binding import DigestMemo
from ..options import flag
from ..plans import PlanKey, key_to_plan
from ..slab import PlanRows
from ..source.files import NotARegularFile, dtype_named, fsync_dir, open_regular, read_regular
from ..spec import SUPPORTED_WEIGHT_DTYPES, ModulationSpec

log = logging.getLogger(__name__)

MAGIC = b"ADLNSTO1"
FORMAT_VERSION = 1
DIGEST_BYTES = 32


def part_names(count: int) -> list[str]:
    """The names an entry's header gives its parts (informative: the payload's order is the spec's); a
    two-part table's are ``block`` and ``final``, the only parts of entries written before headers listed them."""
    return ["block", "final"] if count == 2 else [TABLE_PART] if count == 1 else [f"part{i}" for i in range(count)]


class CorruptEntry(Exception):
    """Internal: an entry failed verification (the message says how); ``inode`` names the file read."""

    def __init__(self, message: str, inode: int | None = None) -> None:
        super().__init__(message)
        self.inode = inode


def encode_entry(bhash: str, key: PlanKey, rows: PlanRows) -> list[bytes | memoryview]:
    """The bytes of one entry file, in order: header, each part's rows, the digest of all before it."""
    parts = [part.detach().to("cpu").contiguous() for part in rows.parts]
    n = rows.timesteps.shape[0]
    names = part_names(len(parts))
    if any(part.dim() < 2 or part.shape[0] != n for part in parts):
        shapes = "/".join(str(tuple(part.shape)) for part in parts)
        raise ConfigError(f"store.put: rows of shape {shapes} do not fit a plan of {n} timesteps")
    payload = [part.view(torch.uint8).numpy().reshape(-1) for part in parts]
    columns = rows.timesteps.shape[1] if rows.timesteps.dim() == 2 else 1
    header: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "binding": bhash,
        "key": list(key),
        "timesteps": key_to_plan(key, columns).tolist(),
        "dtype": str(parts[0].dtype).removeprefix("torch."),
        **{f"{name}_shape": list(part.shape) for name, part in zip(names, parts)},
        "parts": names,
        "created": time.time(),
    }
    head = canonical_json(header)
    # Pad the header (JSON allows trailing spaces) so the payload starts 64-byte aligned: the
    # rows are then read as typed views of one buffer, with no copy.
    head += b" " * ((-(len(MAGIC) + 4 + len(head))) % 64)
    prefix = MAGIC + struct.pack("<I", len(head)) + head
    digest = hashlib.sha256(prefix)
    for chunk in payload:
        digest.update(chunk.data)
    return [prefix, *(p.data for p in payload), digest.digest()]


def parse_entry(path: Path) -> tuple[dict[str, Any], torch.Tensor, int, int]:
    """Read and verify an entry file; returns (header, raw bytes, payload offset, inode): the inode lets a
    caller move aside exactly the file it read, never a fresh rewrite another process renamed into place."""
    try:
        fd = open_regular(path)
    except NotARegularFile as exc:  # a FIFO or a device where an entry belongs: never opened for reading
        raise CorruptEntry(str(exc)) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        size, inode = st.st_size, st.st_ino
        if size < len(MAGIC) + 4 + DIGEST_BYTES:
            raise CorruptEntry(f"{size} bytes is too short for an entry", inode)
        raw = torch.empty(size, dtype=torch.uint8)
        buf = raw.numpy()
        got = f.readinto(buf.data)
        if got != size:
            raise CorruptEntry(f"read {got} of {size} bytes", inode)
    data = buf.data
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise CorruptEntry("bad magic", inode)
    if hashlib.sha256(data[: size - DIGEST_BYTES]).digest() != bytes(data[size - DIGEST_BYTES :]):
        raise CorruptEntry("digest mismatch", inode)
    (head_len,) = struct.unpack("<I", bytes(data[len(MAGIC) : len(MAGIC) + 4]))
    start = len(MAGIC) + 4
    if start + head_len > size - DIGEST_BYTES:
        raise CorruptEntry("header length out of range", inode)
    try:
        header = json.loads(bytes(data[start : start + head_len]))
    except ValueError as exc:
        raise CorruptEntry(f"header is not JSON: {exc}", inode) from None
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object", inode)
    return header, raw, start + head_len, inode


def entry_rows(header: dict[str, Any], raw: torch.Tensor, offset: int, spec: ModulationSpec | None) -> PlanRows:
    try:
        dtype = dtype_named(header["dtype"])
        if dtype is None or dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise CorruptEntry(f"unknown dtype {header['dtype']!r}")
        names = [str(name) for name in header.get("parts", part_names(2))]
        shapes = [[int(v) for v in header[f"{name}_shape"]] for name in names]
        key = tuple(int(v) for v in header["key"])
        timesteps = torch.tensor(header["timesteps"], dtype=torch.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptEntry(f"header lacks a field: {exc}") from None
    columns = timesteps.shape[1] if timesteps.dim() == 2 else 1
    n = len(key) // columns
    if spec is not None:
        want = [[n, *part.shape] for part in spec.table_parts()]
        if dtype != spec.dtype or shapes != want or columns != spec.plan_columns:
            shown = "/".join(str(shape) for shape in shapes)
            raise CorruptEntry(f"geometry {shown} {dtype} does not match the spec")
    if not shapes or any(not shape or shape[0] != n for shape in shapes):
        raise CorruptEntry("part shapes disagree with the plan")
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [item * math.prod(shape) for shape in shapes]
    if offset + sum(sizes) != raw.numel() - DIGEST_BYTES:
        raise CorruptEntry("payload size disagrees with the header")
    payload = raw[offset : offset + sum(sizes)].split(sizes)  # views: no copy
    return PlanRows(key_to_plan(key, columns), *(part.view(dtype).view(shape) for part, shape in zip(payload, shapes)))


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


def _check_max_bytes(max_bytes: Any, what: str) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ConfigError(f"max_bytes must be {what}, got {max_bytes!r} (CLI {flag('max_bytes')})")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
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
    """A directory of tables bound to what produced them (``max_bytes``: every write prunes the least recently used)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        lock_wait_s: float = 600.0,
        lock_stale_s: float = 30.0,
    ) -> None:
        if max_bytes is not None:
            _check_max_bytes(max_bytes, "None or an integer >= 0")
        for name, value in (("lock_wait_s", lock_wait_s), ("lock_stale_s", lock_stale_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r} (CLI {flag('lock_wait_s')})")
        self.path, self.max_bytes = Path(path), max_bytes
        #: How long a build waits for another process that is building the same entries before it builds them
        #: itself (0: never wait); a holder whose heartbeat stopped for ``lock_stale_s`` is not waited for.
        self.lock_wait_s, self.lock_stale_s = float(lock_wait_s), float(lock_stale_s)
        self.corrupt_moved = self.swept_temp = 0
        self._host = socket.gethostname().replace("-", "_")
        marker = self.path / "STORE"
        # Another process may be creating this store right now (subdirectories and a temp marker
        # before the marker itself): only names a store makes count as "a store being born".
        own = {"bindings", "entries", "corrupt", "digests", "locks", "STORE"}
        names = [p.name for p in self.path.iterdir()] if self.path.is_dir() and not marker.exists() else []
        if any(name not in own and not name.startswith(_TMP_PREFIX) for name in names):
            # Never scatter entries into a directory that holds something else (a typo'd --store ~).
            raise ConfigError(
                f"{self.path} is not empty and is not an adalncache store (no STORE marker): pass a new or empty "
                f"directory (store= / CLI {flag('store')})"
            )
        try:
            for sub in ("bindings", "entries", "corrupt"):
                (self.path / sub).mkdir(parents=True, exist_ok=True)
            if not marker.exists():
                self.write_atomic(marker, f"adalncache store format {FORMAT_VERSION}\n".encode())
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
        """Whether some binding equal to ``template`` in all but its ``content`` has an entry for any of ``keys``:
        a copied checkpoint (or store) whose digest is not known here yet, which one hashing read turns into hits."""
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

    def _entry_path(self, bhash: str, key: PlanKey) -> Path:
        return self.path / "entries" / bhash / (plan_hash(key) + _SUFFIX)

    def write_atomic(self, final: Path, *chunks: bytes | memoryview) -> None:
        """Write ``chunks`` to ``final`` (inside the store) so that readers see either nothing or all of it:
        the one atomic writer of the store's files (entries, bindings, the digest memo)."""
        # host and pid in the name let sweep_temp tell a live writer's file from an orphan.
        tmp = final.with_name(f"{_TMP_PREFIX}{self._host}-{os.getpid()}-{uuid.uuid4().hex}-{final.name}")
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
        fsync_dir(final.parent)

    def sweep_temp(self) -> int:
        """Delete temp files whose writer is gone (dead pid here, or older than an hour elsewhere)."""
        removed, now = 0, time.time()
        roots = [
            self.path,
            self.path / "bindings",
            self.path / "digests",
            *(p for p in (self.path / "entries").glob("*") if p.is_dir()),
        ]
        for root in roots:
            for tmp in root.glob(_TMP_PREFIX + "*"):
                parts = tmp.name[len(_TMP_PREFIX) :].split("-")
                try:
                    age = now - tmp.stat().st_mtime
                except OSError:
                    continue
                mine = len(parts) >= 2 and parts[0] == self._host and parts[1].isdigit()
                if age > _STALE_TMP_SECONDS or (mine and not _pid_alive(int(parts[1]))):
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                        removed += 1
        if removed:
            log.info("store %s: swept %d orphaned temp file(s)", self.path, removed)
        self.swept_temp += removed
        return removed

    def put(self, binding: Mapping[str, Any], key: PlanKey, rows: PlanRows) -> Path:
        """Write one plan's rows under ``binding`` atomically; returns the entry's path."""
        bhash = binding_hash(binding)
        described = self.path / "bindings" / f"{bhash}.json"
        if not described.exists():
            self.write_atomic(described, json.dumps(binding, sort_keys=True, indent=1, default=str).encode())
        (self.path / "entries" / bhash).mkdir(parents=True, exist_ok=True)
        path = self._entry_path(bhash, key)
        self.write_atomic(path, *encode_entry(bhash, key, rows))
        if self.max_bytes is not None:
            self.prune(self.max_bytes, keep={path})
        return path

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

    def entries(self) -> list[EntryInfo]:
        """Every entry file, least recently used first."""
        out: list[EntryInfo] = []
        for path in (self.path / "entries").glob("*/*" + _SUFFIX):
            if path.name.startswith(_TMP_PREFIX):
                continue  # a writer's file in progress (or an orphan sweep_temp removes): never an entry
            with contextlib.suppress(OSError):
                st = path.stat()
                if stat.S_ISREG(st.st_mode):
                    out.append(EntryInfo(path, path.parent.name, path.stem, st.st_size, st.st_mtime))
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

    #: errno values that say the store cannot be written at all (read-only, no permission) ...
    READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
    #: ... or not for now (those, or no space left).
    UNWRITABLE = READ_ONLY | {errno.ENOSPC, errno.EDQUOT}

    def health(self, *, verify: bool = True) -> dict[str, Any]:
        """Verify every entry's digest (unless ``verify=False``); count temp and moved-aside files."""
        ok, bad = 0, []
        for item in self.iter_entries() if verify else ():
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
        _check_max_bytes(max_bytes, "an integer >= 0")
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
        for held in self.held.values():
            _release(*held)
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
    """The lock files of one store (docs/tables.md, "One build per fleet")."""

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
            for lock in held.values():
                _release(*lock)
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
