"""What the resident tables were built from, and when they stop being valid.

A table is exact only for the weights and settings it was projected under. Three of those can
change while a cache lives: the weight source (a checkpoint rewritten on disk, seen through its
fingerprint), the caller's *variant* (whatever else shapes the projection, such as the active
LoRA adapters) and the *autocast* state of the cache device's type (under ``torch.autocast`` the
projection and its input compute in the autocast dtype). :class:`TableIdentity` remembers them,
re-checks them at the start of every build that has something to build, and tells the cache to
drop tables built under an old identity. It also forms the store binding: everything a stored
table depends on besides its plan.

A build whose plans are all resident does not re-stat the source: that is the hit path every
request takes, and a checkpoint changed on disk matters only to what is read from it next (a
pass, or a store entry bound to its content). The variant and the autocast state are compared
on every build, hits included (:meth:`TableIdentity.matches`).

The binding names the *content* of the projection tensors (:mod:`adalncache.identity.content`), not the
files' stat identity: a copied checkpoint, or a store copied to another host, binds to the same
entries. The stat fingerprint still decides when the slab's tables must be dropped (any rewrite,
even one that turns out to hold the same bytes, since that is cheap to see and safe to assume).
While the content digest is unknown there is no binding, and the store is not used.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..canonical import canonical_json
from ..errors import CheckpointError
from ..numerics import numeric_environment
from ..plans import PlanKey
from ..reports import CacheStats
from ..source import WeightSource
from ..spec import ModulationSpec
from .content import ContentIdentity
from .memo import DigestMemo

if TYPE_CHECKING:
    from ..distributed import Collective

log = logging.getLogger(__name__)

#: Format of the store binding: 2 names the content digest (format 1, without this key, named the
#: source's stat fingerprint; its entries are never looked up again).
BINDING_FORMAT = 2


class TableIdentity:
    """The source fingerprint and the variant the resident tables were built under."""

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
        #: The content digest of the source, and how it is learnt.
        self.content = ContentIdentity(source, spec, collective, stats, memo or DigestMemo(None))
        #: How many times the source's identity changed (agreed by every rank): table files bound to
        #: its content are checked again whenever it moves.
        self.generation = 0

    @property
    def device(self) -> torch.device:
        return self._device()

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

        ``resident``: the slot map in LRU order; ``holds_tables``: whether the slab or the host
        tier holds anything. In a process group the three flags, a digest of ``request`` and one
        of ``resident`` are reduced in one collective, so every rank drops, or keeps, the same
        tables and the slot maps stay equal. Raises the ``CheckpointError`` (alone) or a
        ``BuildError`` naming the rank (in a group) when the source no longer validates.
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
            # The ranks' slot maps differ (invalidate() on some ranks only, say): their next
            # decisions would differ too, so every rank starts again from an empty slab.
            log.warning("rank %d: the ranks' slabs diverged; dropping every table on every rank", self._dist.rank)
            drop("the ranks' slabs diverged")
        if failed or changed:
            self.content.reset()
            self.generation += 1
        if failed:
            # The file changed (on some rank) and no longer validates: whatever the slab holds came
            # from the old file, so it can no longer be trusted either.
            self.stats.fingerprint_changes += 1
            self.fingerprint = None
            drop("the checkpoint changed on disk and no longer validates")
            self._dist.raise_if_any_failed(invalid, "checkpoint")
            assert invalid is not None  # alone, only this rank can have failed
            raise invalid
        if changed:
            self.stats.fingerprint_changes += 1
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
        the digest bound) the identity is treated as changed: table files are checked again."""
        try:
            return self.content.after_pass()
        except CheckpointError:
            self.generation += 1
            raise

    def template(self) -> dict[str, Any]:
        """The binding with its content left open: everything besides the weights' bytes.

        For fp32 and fp16 weights it also names where each tensor sits modulo 64 bytes, which
        decides the bits of a one-row GEMV on a CPU (bf16 showed no such effect).
        """
        template: dict[str, Any] = {
            "binding": BINDING_FORMAT,
            "content": None,
            "spec": self.spec.describe(),
            "precision": self.precision,
            "variant": repr(self.variant),
            "shard": self._dist.describe_shard(),
            "environment": numeric_environment(self.device),
        }
        if self.spec.dtype in (torch.float32, torch.float16):
            template["alignment"] = self.content.alignment()
        return template

    def binding(self) -> dict[str, Any] | None:
        """Everything a stored table depends on besides its plan, or ``None`` while the content digest is unknown."""
        content = self.content.resolve()
        return None if content is None else {**self.template(), "content": content}

    def content_now(self) -> str | None:
        """The content digest: from the memo, else by one hashing-only read (a collective in a group)."""
        return self.content.identify(read=True)

    def hash_now(self) -> None:
        """Learn the content digest by a hashing-only read, if the memo does not have it."""
        self.content.identify(read=True)

    def note_unbound(self, what: str) -> None:
        self.content.note_unknown(what)

    def lock_namespace(self) -> str:
        """A name shared by every process that would build the same store entries, known before any hashing.

        The binding without its content, plus each checkpoint file's size and header hash: equal
        for copies of one checkpoint, so their processes build once. (Two different checkpoints with
        identical headers would share it too; that only makes one wait, never serves wrong rows.)
        """
        stamps = self.content.stamps() or {}
        files = sorted({(stamp.size, stamp.header) for stamp in stamps.values()})
        fallback = self.fingerprint if not stamps else None
        return hashlib.sha256(canonical_json([self.template(), files, fallback])).hexdigest()[:32]

    def current_binding(self) -> dict[str, Any] | None:
        """:meth:`binding`, or ``None`` if the source changed since the resident tables were built."""
        self.source.refresh()
        return self.binding() if self.source.fingerprint == self.fingerprint else None


__all__ = ["TableIdentity"]
