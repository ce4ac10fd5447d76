"""The content digest of a weight source: known from the memo, learnt during a pass, or read on purpose.

The store binds entries to the *content* of the projection tensors (see
:mod:`adalncache.identity.digest`), so a copied checkpoint or a copied store still hits. Knowing
that digest costs a read of every projection byte, so :class:`ContentIdentity` gets it the
cheapest way available, in this order:

1. **the memo** (:mod:`adalncache.identity.memo`): every file still carries the identity it had
   when it was hashed: a ``stat`` per file and a small JSON read;
2. **the pass that builds anyway**: the reader thread hashes the bytes it streams, so the digest
   is known before the pass's entries are written, at no extra read;
3. **a hashing-only read** (:meth:`ContentIdentity.identify`), when it pays: the store holds
   entries for a binding equal to this one in everything but the content (a copied checkpoint
   next to its store), or a bound table file must be checked.

Until one of them has happened the digest is *unknown* and the store is not consulted: a miss,
never a wrong answer. In a process group every rank contributes what it knows (its memo, the
share it read) and the ranks compose the same digest in one collective; a rank records in its
memo only the bytes it read itself, never a digest composed with its peers' (their copies of the
checkpoint need not be this host's).

A checkpoint on disk is hashed by *every* pass, digest known or not, wherever something is bound
to the digest (:attr:`ContentIdentity.wanted`: a store, table files, an export or a verification):
the binding a pass writes its entries under must name the bytes that pass projected, and only
hashing them proves it. A cache with neither store nor table files binds nothing to the digest:
its passes do not hash (the hashing cost them about half again on two CPU cores), and the file
identity checked before and after each pass is what stands between a rewrite and its tables. A
pass that finds other bytes than the digest it was bound to (a rewrite no file identity showed:
another host writing a network share, a clock that cannot be trusted) raises, forgets the memo's
records of those files, and leaves the digest unknown. Before a pass the files' identity must be
*settled*: a file changed within the last few clock ticks (:func:`settle_margin_ns`) could change
again within the same tick without its ctime moving, so the pass waits those milliseconds first;
after that any write changes the ctime, which the pass's checks and the memo compare.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from ..reports import CacheStats
from ..spec import ModulationSpec
from .digest import (
    DigestSink,
    Knowledge,
    TensorDigest,
    content_digest,
    merge_knowledge,
    projection_roles,
)
from .files import FileStamp
from .memo import DigestMemo

if TYPE_CHECKING:
    from ..distributed import Collective
    from ..source import WeightSource

log = logging.getLogger(__name__)

#: The longest a pass waits for a checkpoint's files to stop changing before it gives up (a writer is busy).
SETTLE_LIMIT_S = 10.0


def settle_margin_ns(ctime_ns: int) -> int:
    """How long after its last change a file's ctime is trusted to move on the next write.

    File times come from the kernel's coarse clock, which advances once per tick (1 to 10 ms), so
    two writes within one tick can leave the same ctime. Two ticks at the slowest common rate
    (HZ=100) is 20 ms; a file system that keeps whole seconds (its ctime a multiple of 1 s) needs
    two of those.
    """
    return 2_000_000_000 if ctime_ns % 1_000_000_000 == 0 else 20_000_000


def _as_json(knowledge: Mapping[str, TensorDigest]) -> dict[str, Any]:
    return {role: record.as_json() for role, record in knowledge.items()}


class ContentIdentity:
    """What this cache knows of its source's content digest, and how it learns it."""

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
        #: The sink of the pass in progress, the file identities it started from, whether they were
        #: settled (their change times safely in the past), and the digest it was bound to.
        self._pending: tuple[DigestSink, dict[str, FileStamp] | None, bool, str | None] | None = None
        self._warned_unknown = False
        self._warned_skew = False
        #: Whether passes hash what they read: something is bound to the digest (a store, table
        #: files, an export or a verification). Without, hashing would only cost the pass time.
        self.wanted = True

    # -- what the source is -----------------------------------------------------------------

    @property
    def hashable(self) -> bool:
        """Whether this source serves bytes that name its content: not a cache over table files
        alone (no weights), nor the model's own quantized tensors (only their modules read them;
        their in-memory identity dies with the process anyway)."""
        return bool(getattr(self.source, "serves_weights", True)) and not getattr(self.source, "opaque", False)

    def stamps(self) -> dict[str, FileStamp] | None:
        """The file identity holding each projection tensor, by role; None when it cannot be taken."""
        if not self.hashable:
            return None
        roles = projection_roles(self.spec)
        entry = getattr(self.source, "entry", None)
        if callable(entry):  # a checkpoint: one stamp per file
            layout = self.source.layout
            by_path: dict[Any, FileStamp] = {}
            out: dict[str, FileStamp] = {}
            try:
                for role, layer, part in roles:
                    header, _ = entry(layout.weight(layer) if part == "weight" else layout.bias(layer))
                    if header.path not in by_path:
                        by_path[header.path] = FileStamp.of(header.path, header.digest)
                    out[role] = by_path[header.path]
            except (OSError, KeyError):
                return None
            return out
        # Tensors in memory: their fingerprint (addresses, versions) names them in this process only.
        fingerprint = self.source.fingerprint
        pseudo = FileStamp(socket.gethostname(), f"<tensors in process {fingerprint}>", 0, 0, 0, 0, 0, fingerprint)
        return dict.fromkeys((role for role, _, _ in roles), pseudo)

    def alignment(self) -> list[int] | None:
        """Each projection tensor's address modulo 64 bytes as this source serves it, in pass order.

        On a CPU an fp32 (or fp16) GEMV with one row gives different bits for the same weight at
        another address modulo 16 bytes, so for those dtypes the same content at other offsets (a
        re-saved file) is another table. A checkpoint's buffers keep the file offset's residue; a
        tensor in memory has its own address. None when there are no weights.
        """
        if not self.hashable:
            return None
        roles = projection_roles(self.spec)
        layout = self.source.layout
        names = [layout.weight(layer) if part == "weight" else layout.bias(layer) for _, layer, part in roles]
        entry = getattr(self.source, "entry", None)
        if callable(entry):
            return [int(entry(name)[1].begin) % 64 for name in names]
        tensors = getattr(self.source, "tensors", {})
        return [int(tensors[name].data_ptr()) % 64 for name in names]

    def _remembered(self, stamps: Mapping[str, FileStamp] | None) -> Knowledge:
        """What the memo holds for the current files, by role."""
        if not stamps:
            return {}
        per_file: dict[FileStamp, dict[str, TensorDigest]] = {}
        out: Knowledge = {}
        for role, stamp in stamps.items():
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
            gathered = self._dist.gather_objects(_as_json(knowledge))
            parts = [{role: TensorDigest.from_json(rec) for role, rec in part.items()} for part in gathered]
            merged = merge_knowledge(parts)
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
            self.digest = self._agree(self._remembered(self.stamps()))
        return self.digest

    def reset(self) -> None:
        """The source's identity changed: the digest is unknown until re-learnt."""
        self.digest = None
        self._pending = None

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

    # -- learning it ------------------------------------------------------------------------

    @property
    def verifies(self) -> bool:
        """Whether every pass hashes what it reads: a source whose bytes live in files (which can change
        under a running process), not tensors in this process's memory."""
        return self.hashable and bool(getattr(self.source, "persistent", True))

    def settled_stamps(self) -> tuple[dict[str, FileStamp] | None, bool]:
        """The files' identities once no file changed within :func:`settle_margin_ns`; and whether they are settled.

        Waits (a few milliseconds, at most :data:`SETTLE_LIMIT_S`) while a file changed too recently
        for a later write to be sure to move its ctime. A change time in the future (another host's
        clock, on a network share) cannot be judged: not waited for, reported as not settled (the
        memo then records nothing for it). Raises CheckpointError when the files keep changing.
        """
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
        """A sink for the next pass to feed (None: nothing to hash), after the files' identity settled.

        A checkpoint is hashed by every pass while the digest is :attr:`wanted` (see the module
        docstring); tensors in memory only while their digest is unknown.
        """
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
        """Remember what the pass hashed and compose the digest (every rank calls this after a pass).

        Raises CheckpointError, on every rank alike (the digest is composed collectively), when the
        bytes read hash to another digest than the one the pass was bound to: the digest is then
        unknown again and the memo's records of the files are dropped.
        """
        if self._pending is None:
            return self.digest
        sink, before, settled, expected = self._pending
        self._pending = None
        own = sink.knowledge()
        self.stats.hashed_bytes += sink.hashed_bytes
        now = self.stamps()
        if before is None or now != before:
            # A file changed while it was read: its bytes may be a mix, so nothing is recorded and
            # nothing is bound (the next build sees the change and starts again).
            log.warning("the checkpoint changed during the pass: its content digest is not recorded")
            own = {}
        elif expected is None and settled:
            per_file: dict[FileStamp, dict[str, TensorDigest]] = {}
            for role, record in own.items():
                per_file.setdefault(before[role], {})[role] = record
            for stamp, records in per_file.items():
                self.memo.record(stamp, records)
        # What was read decides; where the reading was partial (a column split that cuts leaves),
        # the memo fills in what it knows of the same files.
        read = self._agree(own)
        if read is None:
            knowledge = merge_knowledge([self._remembered(now), own]) if own else self._remembered(now)
            read = self._agree(knowledge or {})
        if expected is not None and read is not None and read != expected:
            self.digest = None
            self.forget(before)
            raise CheckpointError(
                f"the projection bytes just read from {self._files()} hash to {read}, not to {expected}, the "
                f"content this process knew for them, though no file's stat identity changed (another host "
                f"rewrote a network share, or a clock jumped?): nothing of this pass is published and the memo's "
                f"records of these files are dropped; build again to read them anew"
            )
        self.digest = read if expected is None else expected
        return self.digest

    def _files(self) -> str:
        files = getattr(self.source, "files", None)
        return ", ".join(str(f) for f in files) if files else type(self.source).__name__

    def identify(self, *, read: bool = True) -> str | None:
        """The digest: from the memo, else (``read=True``) by a hashing-only read of this rank's share.

        In a process group every rank must call this together. A read that fails on one rank
        still takes part in the agreement (with what it hashed), then raises.
        """
        if self.resolve() is not None or not read or not self.hashable:
            return self.digest
        sink = self._sink()  # asked for: hashes whether or not passes do (``wanted``)
        assert sink is not None
        failure: Exception | None = None
        try:
            work = self._dist.hash_work(self.spec.layers())
            stream = self.source.stream(
                work.layers, device=torch.device("cpu"), columns=work.columns, read_ahead=1, digests=sink
            )
            for _ in stream:
                pass
            self.stats.hash_reads += 1
        except Exception as exc:
            failure = exc
        digest = self.after_pass()
        if failure is not None:
            raise failure
        return digest


__all__ = ["ContentIdentity"]
