"""How a cache learns what its tables are bound to, remembers it, checks it, and binds its tables to it.

:class:`TableIdentity` re-checks the source's fingerprint, the caller's variant (the active LoRA
adapters) and the autocast state at the start of every build that has something to build (the hit
path does not ``stat``), drops tables built under an old identity, and forms the binding every tier
compares by equality. :class:`ContentIdentity` learns the content digest the cheapest way available
(the memo, the pass that builds anyway, or a hashing-only read when it pays; unknown until then: a
miss, never a wrong answer) and, while something is bound to it, checks every read against it;
:class:`CheckedRead` checks reads outside a pass. What the binding names and which rewrite each
check catches: docs/tables.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from ..options import flag
from ..plans import PlanKey
from ..reports import CacheStats
from ..source import LayerWeights, WeightSource
from ..source.files import read_regular
from ..spec import Layer, ModulationSpec
from . import (
    ALGORITHM,
    LEAVES,
    PREFIX,
    DigestSink,
    FileStamp,
    Knowledge,
    TensorDigest,
    canonical_json,
    checkpoint_upstream,
    hash_hex,
    merge_knowledge,
    numeric_environment,
    role_of,
)

if TYPE_CHECKING:
    from ..distributed import Collective

log = logging.getLogger(__name__)

#: Format of the store binding: 3 adds the upstream digest; 2 named the content digest without it, and
#: format 1 (without this key) the source's stat fingerprint. Entries of an older format are never looked
#: up again: a miss, so the next build writes them anew.
BINDING_FORMAT = 3
#: Format of a memo record.
RECORD_FORMAT = 1
#: The longest a pass waits for a checkpoint's files to stop changing before it gives up (a writer is busy).
SETTLE_LIMIT_S = 10.0
_CONTENT_TAG = b"adalncache-content-v1"


def projection_roles(spec: ModulationSpec) -> list[tuple[str, Layer, str]]:
    """``(role, layer, part)`` of every projection tensor of ``spec``, in pass order."""
    return [(role_of(layer, part), layer, part) for layer in spec.layers() for part in spec.tensors_of(layer)]


def content_digest(spec: ModulationSpec, knowledge: Mapping[str, TensorDigest]) -> str | None:
    """``blake3:<hex>`` of the spec and every projection tensor (sorted by role), or ``None`` if any
    tensor is not fully known."""
    parts: list[bytes] = [_CONTENT_TAG, canonical_json(spec.describe())]
    for role in sorted(r for r, _, _ in projection_roles(spec)):
        record = knowledge.get(role)
        digest = record.complete(role) if record is not None else None
        if digest is None:
            return None
        parts += [role.encode(), bytes.fromhex(digest)]
    return PREFIX + hash_hex(*parts)


def upstream_of(source: Any) -> str | None:
    """The upstream digest of what ``source``'s rows are computed from (:attr:`WeightSource.upstream
    <adalncache.source.WeightSource.upstream>`, called when it is a callable), or None where none is named."""
    given = getattr(source, "upstream", _UNSET)
    if given is _UNSET:  # a source written before the attribute: a checkpoint-like one names its own tensors
        readable = callable(getattr(source, "read_tensor", None)) and callable(getattr(source, "entry", None))
        return checkpoint_upstream(source) if readable else None
    if callable(given):
        given = given()
    return None if given is None else str(given)


_UNSET = object()


def rewritten(files: str, read: str, held: str, outcome: str) -> CheckpointError:
    """The error of bytes that hash to another digest than the one held for files whose stat did not move."""
    return CheckpointError(
        f"{files} was rewritten without its stat identity changing: the projection bytes just read hash to {read}, "
        f"not to {held}, the content held for the files' unchanged device, inode, size, mtime and ctime (a write "
        f"through a shared memory mapping to a page already dirty keeps both times on ext4; a network share may "
        f"serve cached attributes; a clock may have been set back). {outcome}; tables built from the old bytes may "
        f"still be in a store: adalncache verify {flag('store')} DIR {flag('checkpoint')} CHECKPOINT names every "
        f"entry that no longer matches"
    )


def settle_margin_ns(ctime_ns: int) -> int:
    """How long after its last change a file's ctime is trusted to move on the next write: two ticks of the
    kernel's coarse clock at HZ=100, or two seconds on a file system that keeps whole seconds."""
    return 2_000_000_000 if ctime_ns % 1_000_000_000 == 0 else 20_000_000


# -- the memo -------------------------------------------------------------------------------------

_process_lock = threading.Lock()
#: stamp key -> (stamp, role -> record): what this process learnt, store or no store.
_process_memo: dict[str, tuple[FileStamp, dict[str, TensorDigest]]] = {}


def forget_process_memo() -> None:
    """Drop what this process remembers (tests use it to act as a fresh process)."""
    with _process_lock:
        _process_memo.clear()


def _merge(into: Mapping[str, TensorDigest], tensors: Mapping[str, TensorDigest]) -> dict[str, TensorDigest]:
    """Union of two records of one file (by role); a contradicting tensor keeps the newer one (just read)."""
    out = dict(into)
    for role, record in tensors.items():
        have = out.get(role)
        merged = have.merged(record, role) if have is not None else None
        out[role] = merged if merged is not None else record
    return out


class DigestMemo:
    """Tensor digests by :class:`~adalncache.identity.FileStamp`: in this process, and in ``directory`` when
    given (a store's ``digests/``, one record per file), used only when the stamp equals the file's current one
    field by field (docs/tables.md). Records are merged under ``flock`` of a lock file beside them and
    replaced atomically; where the lock is not shared (some network filesystems) a lost update only means
    a later re-hash."""

    def __init__(self, directory: Path | None = None, *, write: Callable[[Path, bytes], None] | None = None) -> None:
        self.directory = directory
        self._write = write

    def lookup(self, stamp: FileStamp) -> dict[str, TensorDigest]:
        """What is known of the projection tensors the file ``stamp`` names holds, by role (may be empty)."""
        with _process_lock:
            held = _process_memo.get(stamp.key)
        found = dict(held[1]) if held is not None and held[0] == stamp else {}
        on_disk = self._read(stamp) if self.directory is not None else {}
        if on_disk:
            found = _merge(on_disk, found)
            with _process_lock:
                _process_memo[stamp.key] = (stamp, found)
        return found

    def record(self, stamp: FileStamp, tensors: Mapping[str, TensorDigest]) -> None:
        """Remember ``tensors`` for the file ``stamp`` names; never raises on I/O. Only bytes this process
        read itself belong here: other ranks' leaves describe their copies, not this host's file."""
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
                body = {**self._kind(stamp), "recorded": time.time()}
                body["tensors"] = {role: rec.as_json() for role, rec in sorted(merged.items())}
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

    @staticmethod
    def _kind(stamp: FileStamp) -> dict[str, Any]:
        """What a record must say of itself to be used: its format, hash, leaves and the full stamp."""
        return {"format": RECORD_FORMAT, "hash": ALGORITHM, "leaves": LEAVES, "stamp": stamp.as_json()}

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
            if any(data.get(key) != value for key, value in self._kind(stamp).items()):
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


# -- the content digest of a source ---------------------------------------------------------------


def _files_of(source: Any) -> str:
    files = getattr(source, "files", None)
    return ", ".join(str(f) for f in files) if files else type(source).__name__


class ContentIdentity:
    """What this cache knows of its source's content digest, and how it learns and checks it."""

    def __init__(
        self, source: WeightSource, spec: ModulationSpec, collective: Collective, stats: CacheStats, memo: DigestMemo
    ) -> None:
        self.source = source
        self.spec = spec
        self._dist = collective
        self.stats = stats
        #: A source whose identity dies with the process (tensors in memory) never writes to disk.
        self.memo = memo if getattr(source, "persistent", True) else DigestMemo(None)
        #: The content digest, once known (reset when the source's identity changes).
        self.digest: str | None = None
        #: The sink of the read in progress, the file stamps it started from, whether they were settled
        #: (their change times safely in the past), and the digest it was bound to.
        self._pending: tuple[DigestSink, dict[str, FileStamp] | None, bool, str | None] | None = None
        #: ``CheckpointSource(rehash=True)``: the memo is not trusted until this cache has hashed the
        #: files itself (again after every change of their identity).
        self._rehash = bool(getattr(source, "rehash", False))
        self._distrust = self._rehash
        self._warned_unknown = False
        self._warned_skew = False
        #: Whether passes hash what they read: something is bound to the digest (a store, table
        #: files, an export or a verification). Without, hashing would only cost the pass time.
        self.wanted = True

    # -- what the source is -----------------------------------------------------------------

    @property
    def hashable(self) -> bool:
        """Whether this source serves bytes that name its content: not a cache over table files alone
        (no weights), nor quantized tensors only their modules read (their identity dies with the process)."""
        return bool(getattr(self.source, "serves_weights", True)) and not getattr(self.source, "opaque", False)

    @property
    def verifies(self) -> bool:
        """Whether every pass hashes what it reads: a source whose bytes live in files (which can change
        under a running process), not tensors in this process's memory."""
        return self.hashable and bool(getattr(self.source, "persistent", True))

    def _names(self) -> list[tuple[str, str]]:
        """``(role, tensor name)`` of every projection tensor, in pass order."""
        layout = self.source.layout
        return [(role, layout.tensor(layer, part)) for role, layer, part in projection_roles(self.spec)]

    def stamps(self) -> dict[str, FileStamp] | None:
        """The file identity holding each projection tensor, by role; None when it cannot be taken."""
        if not self.hashable:
            return None
        entry = getattr(self.source, "entry", None)
        if not callable(entry):
            # Tensors in memory: their fingerprint (addresses, versions) names them in this process only.
            fingerprint = self.source.fingerprint
            pseudo = FileStamp(socket.gethostname(), f"<tensors in process {fingerprint}>", 0, 0, 0, 0, 0, fingerprint)
            return {role: pseudo for role, _ in self._names()}
        by_path: dict[Any, FileStamp] = {}
        out: dict[str, FileStamp] = {}
        try:
            for role, name in self._names():
                header, _ = entry(name)
                if header.path not in by_path:
                    by_path[header.path] = FileStamp.of(header.path, header.digest)
                out[role] = by_path[header.path]
        except (OSError, KeyError):
            return None
        return out

    def alignment(self) -> list[int] | None:
        """Each projection tensor's address modulo 64 bytes as this source serves it, in pass order (a
        one-row fp32 or fp16 GEMV's bits depend on it: docs/exactness.md); None when there are no weights."""
        if not self.hashable:
            return None
        entry = getattr(self.source, "entry", None)
        if callable(entry):
            return [int(entry(name)[1].begin) % 64 for _, name in self._names()]
        tensors = getattr(self.source, "tensors", {})
        return [int(tensors[name].data_ptr()) % 64 for _, name in self._names()]

    def _remembered(self, stamps: Mapping[str, FileStamp] | None) -> Knowledge:
        """What the memo holds for the current files, by role."""
        per_file: dict[FileStamp, dict[str, TensorDigest]] = {}
        out: Knowledge = {}
        for role, stamp in (stamps or {}).items():
            if stamp not in per_file:
                per_file[stamp] = self.memo.lookup(stamp)
            record = per_file[stamp].get(role)
            if record is not None:
                out[role] = record
        return out

    # -- agreeing on the digest -------------------------------------------------------------

    def _agree(self, knowledge: Knowledge) -> str | None:
        """Compose the digest from this rank's knowledge and (in a group) every peer's, in one collective."""
        if self._dist.world > 1:
            gathered = self._dist.gather_objects({role: record.as_json() for role, record in knowledge.items()})
            merged = merge_knowledge(
                {role: TensorDigest.from_json(rec) for role, rec in part.items()} for part in gathered
            )
            if merged is None:
                log.warning(
                    "rank %d: the ranks read different bytes for the same projection tensor (different copies of "
                    "the checkpoint?): the content digest stays unknown and the store is not used",
                    self._dist.rank,
                )
                return None
            knowledge = merged
        return content_digest(self.spec, knowledge)

    def resolve(self) -> str | None:
        """The digest if known, else whatever the memo (and, in a group, the peers) can tell; no data read."""
        if self.digest is None:
            self.digest = self._agree({} if self._distrust else self._remembered(self.stamps()))
        return self.digest

    def reset(self) -> None:
        """The source's identity changed: the digest is unknown until re-learnt."""
        self.digest = None
        self._pending = None
        self._distrust = self._rehash

    def note_unknown(self, what: str) -> None:
        """Count (and log once) a store use skipped because the digest is not known yet."""
        self.stats.store_unbound += 1
        if not self._warned_unknown:
            self._warned_unknown = True
            log.info(
                "content digest of %s not known yet: %s skipped (a miss, never a wrong answer); the next pass, or "
                "identify(), hashes it",
                type(self.source).__name__,
                what,
            )

    # -- learning and checking it -----------------------------------------------------------

    def settled_stamps(self) -> tuple[dict[str, FileStamp] | None, bool]:
        """The files' stamps once none changed within :func:`settle_margin_ns` (waiting at most
        :data:`SETTLE_LIMIT_S`, else CheckpointError), and whether they are settled: a ctime in the future
        (another host's clock) cannot be judged, so it is not waited for and the memo records nothing."""
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while True:
            now = time.time_ns()
            stamps = self.stamps()
            if stamps is None:
                return None, False
            unique = set(stamps.values())
            if any(s.ctime_ns > now for s in unique):
                if not self._warned_skew:
                    self._warned_skew = True
                    log.info(
                        "checkpoint files change in the future by this host's clock (another host's clock?): "
                        "their identity is not recorded in the digest memo"
                    )
                return stamps, False
            wait = max((s.ctime_ns + settle_margin_ns(s.ctime_ns) - now for s in unique), default=0)
            if wait <= 0:
                return stamps, True
            if time.monotonic() + wait / 1e9 > deadline:
                raise CheckpointError(
                    f"{', '.join(sorted({s.path for s in unique}))} kept changing for {SETTLE_LIMIT_S:.0f} s: the "
                    f"checkpoint is being written; build again once the write is done"
                )
            time.sleep(wait / 1e9)

    def pass_sink(self) -> DigestSink | None:
        """A sink for the next pass to feed (None: nothing to hash), after the files' identity settled: every
        pass hashes a checkpoint while the digest is :attr:`wanted`, tensors in memory only while it is unknown."""
        if not self.wanted:
            self._pending = None
            return None
        return self._sink()

    def _sink(self) -> DigestSink | None:
        """A sink for a read that hashes (a pass, or :meth:`identify`'s hashing-only read)."""
        self._pending = None
        if not self.hashable or (self.digest is not None and not self.verifies):
            return None
        before, settled = self.settled_stamps()
        sink = DigestSink()
        self._pending = (sink, before, settled, self.digest)
        return sink

    def forget(self, stamps: Mapping[str, FileStamp] | None) -> None:
        """The memo's records of these files are wrong (other bytes behind the same identity): drop them."""
        for stamp in set((stamps or {}).values()):
            self.memo.forget(stamp)

    def after_pass(self) -> str | None:
        """Remember what the read hashed and compose the digest (every rank calls this after a pass). Raises
        :func:`rewritten`'s CheckpointError, on every rank alike, when the bytes hash to another digest than
        the one the read was bound to: the digest is unknown again and the memo's records are dropped."""
        if self._pending is None:
            return self.digest
        sink, before, settled, held = self._pending
        self._pending = None
        own = sink.knowledge()
        self.stats.hashed_bytes += sink.hashed_bytes
        now = self.stamps()
        if before is None or now != before:
            # A file changed while it was read: its bytes may be a mix, so nothing is recorded and
            # nothing is bound (the next build sees the change and starts again).
            log.warning("the checkpoint changed during the pass: its content digest is not recorded")
            own = {}
        elif held is None and settled:
            if self._distrust:
                self._note_distrusted(before, own)
            per_file: dict[FileStamp, dict[str, TensorDigest]] = {}
            for role, record in own.items():
                per_file.setdefault(before[role], {})[role] = record
            for stamp, records in per_file.items():
                self.memo.record(stamp, records)
        # What was read decides; where the reading was partial (a column split that cuts leaves),
        # the memo fills in what it knows of the same files.
        read = self._agree(own)
        if read is None and not self._distrust:
            knowledge = merge_knowledge([self._remembered(now), own]) if own else self._remembered(now)
            read = self._agree(knowledge or {})
        if held is not None and read is not None and read != held:
            self.digest = None
            self.forget(before)
            raise rewritten(
                _files_of(self.source),
                read,
                held,
                "Nothing of this pass is published and the digest memo's records of these files are dropped: build "
                "again to read the new bytes",
            )
        self.digest = read if held is None else held
        if read is not None:
            self._distrust = False
        return self.digest

    def _note_distrusted(self, stamps: Mapping[str, FileStamp], read: Knowledge) -> None:
        """``rehash=True`` found the memo holding other bytes for these very stamps: say so (the record
        is then replaced by what was read)."""
        remembered = self._remembered(stamps)
        differ = sorted(
            role
            for role, record in read.items()
            if role in remembered and remembered[role].merged(record, role) is None
        )
        if differ:
            log.warning(
                "%s: the digest memo held other bytes for %d projection tensor(s) (%s, ...) under the files' unchanged "
                "stat identity: they were rewritten without their stat changing; the record is replaced by what was "
                "just read",
                _files_of(self.source),
                len(differ),
                differ[0],
            )

    def identify(self, *, read: bool = True) -> str | None:
        """The digest: from the memo, else (``read=True``) by a hashing-only read of this rank's share. Every
        rank calls it together; a read that fails on one rank still takes part in the agreement, then raises."""
        if self.resolve() is not None or not read or not self.hashable:
            return self.digest
        sink = self._sink()  # asked for: hashes whether or not passes do (``wanted``)
        assert sink is not None
        failure: Exception | None = None
        try:
            work = self._dist.hash_work(self.spec.layers())
            for _ in self.source.stream(work.layers, device="cpu", columns=work.columns, read_ahead=1, digests=sink):
                pass
            self.stats.hash_reads += 1
        except Exception as exc:
            failure = exc
        digest = self.after_pass()
        if failure is not None:
            raise failure
        return digest


class CheckedRead:
    """Projection bytes read outside a pass (weights restored from the checkpoint, a check at load), hashed
    and checked against ``held``, since a stat cannot see every rewrite (docs/tables.md).

    ``held``: ``AdalnCache.content_digest``, ``identify(read=False)``, or :attr:`digest` of an earlier
    ``CheckedRead`` of every layer; None learns it without checking. :meth:`layers` raises, on the
    ``next()`` after the last layer, a ``CheckpointError`` when the bytes hash to another digest: use
    nothing it yielded until the loop has ended.
    """

    def __init__(self, source: WeightSource, held: str | None = None) -> None:
        self.source = source
        self.held = held
        #: The content digest of what :meth:`layers` read, once it read every projection tensor of a
        #: source that can hash them (None before, or for tensors on a device).
        self.digest: str | None = None

    def layers(
        self, layers: Sequence[Layer] | None = None, *, device: torch.device | str = "cpu"
    ) -> Iterator[LayerWeights]:
        """Stream ``layers`` (default: every layer), hashing every byte; check the digest after the last."""
        spec = self.source.spec
        todo = list(spec.layers() if layers is None else layers)
        if self.held is not None and set(todo) != set(spec.layers()):
            raise ValueError("a content digest can only be checked by a read of every layer (pass layers=None)")
        sink = DigestSink()
        yield from self.source.stream(todo, device=device, digests=sink)
        self.digest = content_digest(spec, sink.knowledge())
        if self.held is not None and self.digest is not None and self.digest != self.held:
            raise rewritten(
                _files_of(self.source),
                self.digest,
                self.held,
                "None of the bytes just read may be used (weights restored from them would not be the model's): "
                "restore the checkpoint, or load the model anew from it",
            )


# -- the identity of resident tables --------------------------------------------------------------


class TableIdentity:
    """The source fingerprint, variant and autocast state the resident tables were built under, and their binding."""

    def __init__(
        self,
        source: WeightSource,
        collective: Collective,
        stats: CacheStats,
        *,
        spec: ModulationSpec,
        precision: str,
        device: Callable[[], torch.device],
        memo: DigestMemo | None = None,
    ) -> None:
        self.source = source
        self._dist = collective
        self.stats = stats  # the cache's counters (the same object)
        self.spec = spec
        self.precision = precision
        #: The cache's device, read where the cache's placement keeps it (it changes on a move).
        self._device = device
        self.fingerprint: str | None = source.fingerprint
        self.variant: Hashable = None
        #: The autocast dtype of the device's type the tables were built under (None: no autocast).
        self.autocast: torch.dtype | None = None
        self.content = ContentIdentity(source, spec, collective, stats, memo or DigestMemo(None))
        #: How many times the source's identity changed (agreed by every rank): table files bound to
        #: its content are checked again whenever it moves.
        self.generation = 0
        #: ``(fingerprint, upstream digest)``: learnt once per source identity (a rewrite of the
        #: checkpoint may change its time embedder too).
        self._upstream: tuple[str | None, str | None] | None = None

    @property
    def upstream(self) -> str | None:
        """The upstream digest of the rows (:func:`upstream_of`), for the source's current identity."""
        if self._upstream is None or self._upstream[0] != self.fingerprint:
            found = upstream_of(self.source)
            if found is None and callable(getattr(self.source, "upstream", None)):
                return None  # asked again: a model still being loaded has no upstream tensors yet
            self._upstream = (self.fingerprint, found)
        return self._upstream[1]

    @property
    def serve_dtype(self) -> torch.dtype:
        """The dtype the resident projection returns under the tables' identity (the autocast dtype
        when they were built under autocast, else the weights' dtype)."""
        return self.autocast if self.autocast is not None else self.spec.dtype

    def matches(self, variant: Hashable, autocast: torch.dtype | None) -> bool:
        """Whether tables built now would have the resident tables' variant and autocast state."""
        return self.fingerprint is not None and autocast == self.autocast and variant == self.variant

    def check(
        self,
        variant: Hashable,
        autocast: torch.dtype | None,
        request: Sequence[PlanKey],
        resident: Sequence[tuple[PlanKey, int]],
        *,
        holds_tables: bool,
        drop: Callable[[str], None],
    ) -> None:
        """Re-stat the source, compare the variant and the autocast state; ``drop(why)`` old tables.

        ``resident``: the slot map in LRU order; ``holds_tables``: whether the slab or the host tier holds
        anything. In a group the flags and digests of ``request`` and ``resident`` are reduced in one
        collective, so every rank drops, or keeps, the same tables. When the source no longer validates:
        its ``CheckpointError`` alone, a ``BuildError`` naming the rank in a group.
        """
        invalid: CheckpointError | None = None
        try:
            self.source.refresh()
        except CheckpointError as exc:
            invalid = exc
        fingerprint = self.source.fingerprint
        different = variant != self.variant or autocast != self.autocast
        (failed, changed, variant_changed), diverged = self._dist.agree_identity(
            [invalid is not None, fingerprint != self.fingerprint, different], request, resident
        )
        if diverged:
            # The ranks' slot maps differ (invalidate() on some ranks only): their next decisions
            # would differ too, so every rank starts again from an empty slab.
            log.warning("rank %d: the ranks' slabs diverged; dropping every table on every rank", self._dist.rank)
            drop("the ranks' slabs diverged")
        if failed or changed:
            self.content.reset()
            self.generation += 1
            self.stats.fingerprint_changes += 1
        if failed:
            # The file no longer validates (on some rank): the slab's tables came from the old file.
            self.fingerprint = None
            drop("the checkpoint changed on disk and no longer validates")
            self._dist.raise_if_any_failed(invalid, "checkpoint")
            assert invalid is not None  # alone, only this rank can have failed
            raise invalid
        if changed:
            drop("the weight source's fingerprint changed")
            self.fingerprint = fingerprint
        if variant_changed:
            if holds_tables:
                self.stats.variant_changes += 1
                drop(f"variant changed ({self.variant!r} -> {variant!r}, autocast {self.autocast} -> {autocast})")
            self.variant = variant
            self.autocast = autocast

    def after_pass(self) -> str | None:
        """The content digest of what the pass read (a collective); on CheckpointError (other bytes than
        the digest held) the identity is treated as changed: table files are checked again."""
        try:
            return self.content.after_pass()
        except CheckpointError:
            self.generation += 1
            raise

    def template(self) -> dict[str, Any]:
        """The binding with its content left open: everything besides the weights' bytes."""
        template: dict[str, Any] = {
            "binding": BINDING_FORMAT,
            "content": None,
            "spec": self.spec.describe(),
            "upstream": self.upstream,
            "precision": self.precision,
            "variant": repr(self.variant),
            "shard": self._dist.describe_shard(),
            "environment": numeric_environment(self._device()),
        }
        if self.spec.dtype in (torch.float32, torch.float16):
            template["alignment"] = self.content.alignment()
        return template

    def binding(self) -> dict[str, Any] | None:
        """Everything a stored table depends on besides its plan, or ``None`` while the content digest is unknown."""
        content = self.content.resolve()
        return None if content is None else {**self.template(), "content": content}

    def current_binding(self) -> dict[str, Any] | None:
        """:meth:`binding`, or ``None`` if the source changed since the resident tables were built."""
        self.source.refresh()
        return self.binding() if self.source.fingerprint == self.fingerprint else None

    def lock_namespace(self) -> str:
        """A name shared by every process that would build the same store entries, known before any hashing:
        the binding without its content, plus each file's size and header hash, so copies of one checkpoint
        build once (two checkpoints with identical headers only make one wait, never serve wrong rows)."""
        stamps = self.content.stamps() or {}
        files = sorted({(stamp.size, stamp.header) for stamp in stamps.values()})
        fallback = self.fingerprint if not stamps else None
        return hashlib.sha256(canonical_json([self.template(), files, fallback])).hexdigest()[:32]
