"""Content identity of the projection tensors: a digest of their bytes that any split of the reading composes to.

A store entry or a table file is valid for the *bytes* of the projections it was built from, not
for one file on one disk. So the binding names those bytes, and a copied checkpoint (new inode,
new mtime, another host) binds to the same tables as the original.

The digest is defined so that it can be computed while a rebuild pass reads the bytes anyway, by
whichever rank reads them, in whatever layout the file has:

* **Leaves.** A projection tensor of ``R`` rows (output features) is cut into :data:`LEAVES` row
  blocks, leaf ``j`` covering rows ``[j*R//64, (j+1)*R//64)``; each leaf is hashed on its own
  (the row-major bytes as stored). A rank of a column-parallel build reads ``R/world``
  consecutive rows, which hold whole leaves whenever ``world`` divides 64 (every leaf boundary
  is then a rank boundary); a rank of a layer-parallel build reads whole tensors.
* **Tensor digest.** The hash of a tag, the tensor's *role* (``block.3.weight``,
  ``final.bias``: the layout's names do not enter), its dtype and shape, and its 64 leaf hashes
  in order.
* **Content digest.** ``blake3:`` and the hash of a tag, the spec, and every role with its tensor
  digest, in sorted order. Native and diffusers layouts of the same weights, sharded or not, get
  the same value; one flipped bit, another dtype or another shape gives another.

Anything not read completely (a column split that cuts leaves, a device tensor a source cannot
hash) leaves the digest *unknown*: a store lookup is then skipped (a miss), never a guess.

Why BLAKE3: a cryptographic hash, so a crafted checkpoint cannot be made to match a shipped
table file, and fast enough to hide behind a pass (about 4 GiB/s per core, against 0.9 GiB/s for
SHA-256 on the development machine; it releases the GIL while it hashes). The algorithm's name
is part of every digest string, so it can change later without confusing old records.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

from ..canonical import canonical_json
from ..spec import FINAL, Layer, ModulationSpec

#: Row blocks per tensor: 64 lets column splits of 1, 2, 4, 8, ... ranks compose to the same value.
LEAVES = 64
ALGORITHM = "blake3"
PREFIX = ALGORITHM + ":"
_TENSOR_TAG = b"adalncache-tensor-v1"
_CONTENT_TAG = b"adalncache-content-v1"
#: Hashing threads per call: one on a small machine (the pass needs the cores for its GEMMs),
#: several on a large one, where a pass is bound by reading and one thread could fall behind the disk.
_CPUS = os.cpu_count() or 1
HASH_THREADS = 1 if _CPUS <= 4 else min(8, _CPUS // 2)


def hasher() -> Any:
    """A fresh BLAKE3 hasher using :data:`HASH_THREADS` threads for large inputs."""
    return blake3.blake3(max_threads=HASH_THREADS)


def hash_hex(*parts: bytes | memoryview) -> str:
    """The hex BLAKE3 of ``parts`` concatenated."""
    h = hasher()
    for part in parts:
        h.update(part)
    return str(h.hexdigest())


def role_of(layer: Layer, part: str) -> str:
    """The layout-free name of a projection tensor: ``block.{i}.weight``, ``final.bias``, ``<module path>.bias``."""
    if layer == FINAL:
        return f"final.{part}"
    if isinstance(layer, int):
        return f"block.{layer}.{part}"
    return f"{layer}.{part}"


def projection_roles(spec: ModulationSpec) -> list[tuple[str, Layer, str]]:
    """``(role, layer, part)`` of every projection tensor of ``spec``, in pass order."""
    return [(role_of(layer, part), layer, part) for layer in spec.layers() for part in spec.tensors_of(layer)]


def leaf_bounds(rows: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` rows of each leaf of a tensor with ``rows`` rows."""
    return [(j * rows // LEAVES, (j + 1) * rows // LEAVES) for j in range(LEAVES)]


@dataclass
class TensorDigest:
    """What is known of one projection tensor's bytes: its whole digest, or some of its leaves."""

    dtype: str
    shape: tuple[int, ...]
    digest: str | None = None
    leaves: dict[int, str] = field(default_factory=dict)

    def complete(self, role: str) -> str | None:
        """The tensor digest, composed from the leaves once all of them are known."""
        if self.digest is None and len(self.leaves) == LEAVES:
            head = canonical_json([role, self.dtype, list(self.shape)])
            self.digest = hash_hex(_TENSOR_TAG, head, *(bytes.fromhex(self.leaves[j]) for j in range(LEAVES)))
        return self.digest

    def merged(self, other: TensorDigest, role: str) -> TensorDigest | None:
        """Both records together, or ``None`` when they contradict each other (other bytes)."""
        if (self.dtype, tuple(self.shape)) != (other.dtype, tuple(other.shape)):
            return None
        leaves = dict(self.leaves)
        for j, value in other.leaves.items():
            if leaves.setdefault(j, value) != value:
                return None
        out = TensorDigest(self.dtype, tuple(self.shape), leaves=leaves)
        mine, theirs, composed = self.complete(role), other.complete(role), out.complete(role)
        known = {d for d in (mine, theirs, composed) if d is not None}
        if len(known) > 1:
            return None
        out.digest = known.pop() if known else None
        return out

    def as_json(self) -> dict[str, Any]:
        """The record as a memo keeps it: the digest alone when known, else the leaves."""
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.digest is not None:
            out["digest"] = self.digest
        else:
            out["leaves"] = {str(j): v for j, v in sorted(self.leaves.items())}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorDigest:
        """Inverse of :meth:`as_json` (ValueError/KeyError/TypeError on a malformed record)."""
        leaves = {int(j): str(v) for j, v in dict(data.get("leaves", {})).items()}
        if any(not 0 <= j < LEAVES for j in leaves):
            raise ValueError("leaf index out of range")
        digest = data.get("digest")
        return cls(
            str(data["dtype"]), tuple(int(s) for s in data["shape"]), None if digest is None else str(digest), leaves
        )


#: What a process knows of a weight source's tensors, by role.
Knowledge = dict[str, TensorDigest]


def merge_knowledge(parts: Iterable[Mapping[str, TensorDigest]]) -> Knowledge | None:
    """The union of several ranks' (or records') knowledge; ``None`` when two contradict each other."""
    out: Knowledge = {}
    for part in parts:
        for role, record in part.items():
            have = out.get(role)
            if have is None:
                out[role] = TensorDigest(record.dtype, tuple(record.shape), record.digest, dict(record.leaves))
                continue
            merged = have.merged(record, role)
            if merged is None:
                return None
            out[role] = merged
    return out


def content_digest(spec: ModulationSpec, knowledge: Mapping[str, TensorDigest]) -> str | None:
    """``blake3:<hex>`` of the spec and every projection tensor, or ``None`` if any tensor is not fully known."""
    parts: list[bytes] = [_CONTENT_TAG, canonical_json(spec.describe())]
    for role in sorted(r for r, _, _ in projection_roles(spec)):
        record = knowledge.get(role)
        digest = record.complete(role) if record is not None else None
        if digest is None:
            return None
        parts += [role.encode(), bytes.fromhex(digest)]
    return PREFIX + hash_hex(*parts)


class DigestSink:
    """Collects the leaf hashes of the bytes a pass reads; the reader thread feeds it.

    Thread-safe, because a source reads on its own thread while the pass projects. The hashing
    itself runs on the feeding thread (BLAKE3 releases the GIL), right after the bytes arrive, so
    a compute-bound pass hides it behind its GEMMs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: Knowledge = {}
        self.hashed_bytes = 0

    def feed(
        self, role: str, dtype: str, shape: tuple[int, ...], rows: tuple[int, int] | None, data: torch.Tensor
    ) -> None:
        """Hash the leaves of tensor ``role`` that lie wholly inside ``data``.

        ``data``: the bytes of rows ``rows = (start, stop)`` of the tensor (all of it when None),
        contiguous on the CPU, as stored in the file (any dtype; it is read as bytes).
        """
        total = shape[0] if shape else 1
        start, stop = rows if rows is not None else (0, total)
        flat = data.detach().reshape(-1).view(torch.uint8)
        row_bytes = flat.numel() // max(1, stop - start) if stop > start else 0
        array = flat.numpy()
        found: dict[int, str] = {}
        for j, (lo, hi) in enumerate(leaf_bounds(total)):
            if start <= lo and hi <= stop:
                found[j] = hash_hex(array[(lo - start) * row_bytes : (hi - start) * row_bytes].data)
        with self._lock:
            record = self._records.setdefault(role, TensorDigest(dtype, tuple(shape)))
            record.leaves.update(found)
            self.hashed_bytes += flat.numel()

    def knowledge(self) -> Knowledge:
        """What was hashed, by role (tensor digests composed where every leaf was read)."""
        with self._lock:
            out = {r: TensorDigest(t.dtype, t.shape, t.digest, dict(t.leaves)) for r, t in self._records.items()}
        for role, record in out.items():
            record.complete(role)
        return out


__all__ = [
    "ALGORITHM",
    "LEAVES",
    "DigestSink",
    "Knowledge",
    "TensorDigest",
    "content_digest",
    "hash_hex",
    "hasher",
    "leaf_bounds",
    "merge_knowledge",
    "projection_roles",
    "role_of",
]
