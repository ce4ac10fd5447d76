"""Identity: what a table is bound to, in the encodings every binding, hash and memo is computed over.

Below the weight sources (they hash what they read into a :class:`DigestSink`): canonical JSON (equal
values give equal bytes in every process and release), file identity (a ``stat``, never a re-hash),
the numeric environment (:func:`bit_settings`, read by both the store binding and the batched probe's
shape classes, so they never disagree; why each part is in it: docs/exactness.md), and the content
digest's leaves and tensor digests (docs/tables.md, "The content digest"). How a cache learns,
remembers and checks the digest and binds its tables is :mod:`adalncache.identity.binding`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import torch

from ..geometry import FINAL, Layer

# -- canonical JSON -------------------------------------------------------------------------------


def canonical_json(value: Any, *, strict: bool = False) -> bytes:
    """``value`` as canonical JSON bytes: sorted keys, compact separators, ``str`` for what JSON cannot
    express (so the encoder never raises halfway through a build). ``strict``: for a format another program
    re-checks (vLLM-Omni's manifest), anything JSON cannot express, NaN and infinity included, raises."""
    if strict:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def plain_json(value: Any) -> Any:
    """``value`` as JSON reads it back (a tuple becomes a list), so two bindings compare as stored."""
    return json.loads(canonical_json(value))


# -- file identity --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileIdentity:
    """``stat`` identity of a file, re-checked at the start of every pass and lookup. The ctime is in it
    because a rewrite in place can put the mtime back, never the ctime (docs/tables.md, "Which rewrites
    are detected")."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        return cls.from_stat(os.stat(path))

    @classmethod
    def from_stat(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class FileStamp:
    """The key the digest memo remembers a file's tensor digests under: its stat identity, the host and
    resolved path (a copy is a new identity: one hashing read, never a wrong digest) and its header's sha256."""

    host: str
    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    header: str

    @classmethod
    def of(cls, path: Path, header: str) -> FileStamp:
        i, where = FileIdentity.of(path), str(Path(path).resolve())
        return cls(socket.gethostname(), where, i.device, i.inode, i.size, i.mtime_ns, i.ctime_ns, header)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def key(self) -> str:
        """The memo's name for this identity (the record itself is compared in full)."""
        return hashlib.sha256(canonical_json(self.as_json())).hexdigest()[:32]


# -- the numeric environment ----------------------------------------------------------------------

#: The matmul precision switch of the new API for each device type's GEMM library, with its parents
#: (most specific first); a chain of ``"none"`` ends in IEEE arithmetic.
_MATMUL_PRECISION: dict[str, tuple[str, tuple[str, ...]]] = {
    "cuda": ("cuda_matmul_fp32_precision", ("cuda.matmul.fp32_precision", "cudnn.fp32_precision", "fp32_precision")),
    "cpu": (
        "mkldnn_matmul_fp32_precision",
        ("mkldnn.matmul.fp32_precision", "mkldnn.fp32_precision", "fp32_precision"),
    ),
}
#: CUDA switches no fp32 precision setting covers (reading them never raises).
_CUDA_REDUCED: tuple[tuple[str, str], ...] = (
    ("bf16_reduced", "cuda.matmul.allow_bf16_reduced_precision_reduction"),
    ("fp16_reduced", "cuda.matmul.allow_fp16_reduced_precision_reduction"),
    ("fp16_accumulation", "cuda.matmul.allow_fp16_accumulation"),
)
_MISSING = object()


def _backend_attr(path: str) -> Any:
    """``torch.backends.<path>``, or ``_MISSING`` where this torch has no such attribute."""
    obj: Any = torch.backends
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return _MISSING
    return obj


def _has_new_precision_api() -> bool:
    return _backend_attr("cuda.matmul.fp32_precision") is not _MISSING


def _effective_precision(chain: tuple[str, ...]) -> str:
    """The first switch of ``chain`` that is set (not ``"none"``); IEEE when none is."""
    for path in chain:
        value = _backend_attr(path)
        if value is not _MISSING and str(value) != "none":
            return str(value)
    return "ieee"


def autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype a projection on ``device`` computes in under the current autocast (per device type and
    thread: only ``device``'s type reaches its kernels), or None."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def bit_settings(device: torch.device | str) -> dict[str, Any]:
    """Every process-wide setting, besides shapes, dtypes and addresses, that can change GEMM bits on ``device``.

    Only what reaches ``device``'s kernels (a store filled by ranks with one CPU thread each still serves
    a GPU process with many); another device type gets every switch. Never raises, whichever mix of the
    legacy and new precision APIs the caller used; the values are plain (JSON-able).
    """
    kind = torch.device(device).type
    cpu, cuda = kind != "cuda", kind != "cpu"  # an unknown device type gets both
    settings: dict[str, Any] = {}
    if cpu:
        settings["num_threads"] = torch.get_num_threads()
    if _has_new_precision_api():
        for label, chain in (_MATMUL_PRECISION[k] for k, wanted in (("cuda", cuda), ("cpu", cpu)) if wanted):
            settings[label] = _effective_precision(chain)
    else:
        settings["matmul_tf32"] = _backend_attr("cuda.matmul.allow_tf32")
        settings["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    for label, path in _CUDA_REDUCED if cuda else ():
        value = _backend_attr(path)
        if value is not _MISSING:
            settings[label] = value
    settings["deterministic"] = torch.are_deterministic_algorithms_enabled()
    autocast = autocast_dtype(device)
    if autocast is not None:  # named only while on: entries written without autocast keep their binding
        settings["autocast"] = str(autocast).removeprefix("torch.")
    return settings


def bit_settings_key(device: torch.device | str) -> tuple[tuple[str, Any], ...]:
    """:func:`bit_settings` as a hashable key (the batched probe's shape classes use it)."""
    return tuple(sorted(bit_settings(device).items()))


def numeric_environment(device: torch.device) -> dict[str, Any]:
    """:func:`bit_settings` plus the software and hardware that decide a projection's bits on ``device``."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_type": device.type,
        **bit_settings(device),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        # cuBLAS vs cuBLASLt and the workspace configuration pick different GEMM kernels.
        blas = getattr(torch.backends.cuda, "preferred_blas_library", None)
        env["blas"] = str(blas()) if callable(blas) else None
        env["cublas_workspace"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    else:
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["machine"] = platform.machine()
    return env


def device_identity(device: torch.device) -> tuple[Any, ...]:
    """The part of :func:`numeric_environment` that belongs to the device: two devices of one identity (two
    GPUs of one model) compute the same bits, so tables move between them as they are."""
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)))
    return (device.type,)


# -- the content digest ---------------------------------------------------------------------------

#: Row blocks per tensor: 64 lets column splits of 1, 2, 4, 8, ... ranks compose to the same value.
LEAVES = 64
ALGORITHM = "blake3"
PREFIX = ALGORITHM + ":"
_TENSOR_TAG = b"adalncache-tensor-v1"
#: Hashing threads per call: one on a small machine (the pass needs the cores for its GEMMs),
#: several on a large one, where a pass is bound by reading and one thread could fall behind the disk.
_CPUS = os.cpu_count() or 1
HASH_THREADS = 1 if _CPUS <= 4 else min(8, _CPUS // 2)


def hash_hex(*parts: bytes | memoryview) -> str:
    """The hex BLAKE3 of ``parts`` concatenated (:data:`HASH_THREADS` threads for large inputs)."""
    h = blake3.blake3(max_threads=HASH_THREADS)
    for part in parts:
        h.update(part)
    return str(h.hexdigest())


def role_of(layer: Layer, part: str) -> str:
    """The layout-free name of a projection tensor: ``block.{i}.weight``, ``final.bias``, ``<module path>.bias``."""
    if layer == FINAL:
        return f"final.{part}"
    return f"block.{layer}.{part}" if isinstance(layer, int) else f"{layer}.{part}"


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
        known = {d for d in (self.complete(role), other.complete(role), out.complete(role)) if d is not None}
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
        shape = tuple(int(s) for s in data["shape"])
        return cls(str(data["dtype"]), shape, None if digest is None else str(digest), leaves)


_UPSTREAM_TAG = b"adalncache-upstream-v1"


def upstream_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """``blake3:<hex>`` of the tensors upstream of the projections, by their diffusers names: a tag, then per
    name in sorted order the name, dtype, shape and raw bytes, hashed as they are, not cast (why: docs/tables.md,
    "The upstream digest")."""
    parts: list[bytes | memoryview] = [_UPSTREAM_TAG]
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        parts += [canonical_json([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])]
        parts.append(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return PREFIX + hash_hex(*parts)


def checkpoint_upstream(source: Any) -> str | None:
    """The upstream digest a checkpoint names by its own tensors (the family's
    :meth:`~adalncache.geometry.Family.upstream` keys, read through ``source.entry`` / ``read_tensor``: what
    ``build``, ``export`` and ``verify`` compute the rows with); None for a checkpoint of the projections alone."""
    family = source.spec.family
    if family.missing_upstream(source):
        return None
    names = family.upstream_names(source.spec, source.layout)
    return upstream_digest({name: source.read_tensor(key) for key, name in names.items()})


#: What a process knows of a weight source's tensors, by role.
Knowledge = dict[str, TensorDigest]


def merge_knowledge(parts: Iterable[Mapping[str, TensorDigest]]) -> Knowledge | None:
    """The union of several ranks' (or records') knowledge; ``None`` when two contradict each other."""
    out: Knowledge = {}
    for part in parts:
        for role, record in part.items():
            have = out.get(role)
            merged = record if have is None else have.merged(record, role)
            if merged is None:
                return None
            out[role] = TensorDigest(merged.dtype, tuple(merged.shape), merged.digest, dict(merged.leaves))
    return out


class DigestSink:
    """Collects the leaf hashes of the bytes a read hashes. Thread-safe: the reader thread feeds it while the
    pass projects, hashing right after the bytes arrive (BLAKE3 releases the GIL), hidden behind the GEMMs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: Knowledge = {}
        self.hashed_bytes = 0

    def feed(
        self, role: str, dtype: str, shape: tuple[int, ...], rows: tuple[int, int] | None, data: torch.Tensor
    ) -> None:
        """Hash the leaves of tensor ``role`` that lie wholly inside ``data``: the bytes of its rows
        ``rows = (start, stop)`` (all of it when None), contiguous on the CPU, as stored in the file."""
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
            self._records.setdefault(role, TensorDigest(dtype, tuple(shape))).leaves.update(found)
            self.hashed_bytes += flat.numel()

    def knowledge(self) -> Knowledge:
        """What was hashed, by role (tensor digests composed where every leaf was read)."""
        with self._lock:
            out = {r: TensorDigest(t.dtype, t.shape, t.digest, dict(t.leaves)) for r, t in self._records.items()}
        for role, record in out.items():
            record.complete(role)
        return out
