"""The settings that decide the output bits of a projection: one definition, read without raising.

Two parts of the cache must know everything besides the weights and the input that can change
the bits a GEMM produces:

* the store binding (:func:`numeric_environment`): an entry written under other settings must
  be a miss, never a wrong answer;
* the batched mode's probe (:func:`bit_settings`, part of each shape class): a verdict that
  stacking is bit-identical holds only under the settings it was probed with.

Both read :func:`bit_settings`, so they can never disagree again about what matters.

What is in it, and why:

* **Intra-op thread count** (``torch.get_num_threads()``). Measured on a 2-core AVX512 CPU
  without bf16 instructions (torch 2.13.0+cpu, MKL 2024.2, oneDNN 3.12): the same ``F.linear``
  on the same tensors, with 1 thread and with 2, bit-compared over 489 cases (bf16, fp16 and
  fp32 weights; K = 2688 and 32; N = 96768, 10752, 3072 and 144; M = 1..4 and stacked M up to
  200; several weight alignments). 1 vs 2 threads changed bits in 70 of them: bf16 at M = 2 and
  3 (a single plan's GEMM, K = 2688 for every N, and K = 32 with N = 96768), and fp32 at
  stacked M >= 16 with K = 2688. 4 threads also changed bf16 at M = 4, 6 and 98. fp16 never
  changed. Every case gave identical bits run after run at a fixed thread count. So a table
  built with one thread count is not the one a forward with another count computes: on a CPU
  the count is part of both the store binding and the batched probe's shape class. (A GPU's
  GEMM does not use the CPU threads, so there it is left out.)
* **Matmul precision switches.** From torch 2.9 on, each backend has an ``fp32_precision``
  switch (``torch.backends.fp32_precision``, ``cuda.matmul``, ``cudnn`` with ``conv``/``rnn``,
  ``mkldnn`` with ``matmul``/``conv``/``rnn``), ``"none"`` meaning "as the parent". They matter
  on a CPU as well: ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` (or
  ``torch.set_float32_matmul_precision("medium")``) changes the bits of an fp32 ``F.linear`` on
  the CPU above. Once any new switch is set, reading the legacy flags
  (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``,
  ``torch.get_float32_matmul_precision()``) can raise ``RuntimeError`` ("mix of the legacy and
  new APIs"), CPU builds included. Where the new switches exist they already reflect what the
  legacy setters did (``allow_tf32 = True`` reads back as ``cuda.matmul.fp32_precision ==
  "tf32"``), so only they are read, as the effective value of the two matmul leaves (CUDA and
  oneDNN; the conv and rnn switches never reach ``F.linear``). The legacy flags are read only on
  a torch that lacks the new switches, where reading them cannot raise.
* **Reduced-precision reductions** for bf16 and fp16 GEMMs on CUDA, and fp16 accumulation:
  separate switches the fp32 precision API does not cover.
* **Deterministic algorithms**: they may select other kernels.
* **Autocast** (:func:`autocast_settings`): under ``torch.autocast`` for the device's type a
  projection computes in the autocast dtype (an fp32 ``F.linear`` under CPU autocast to bf16
  runs and returns bf16), and so does the fp32 time embedder that computes its input. The
  autocast dtype of the device's type is recorded when autocast is on, and nothing when it is
  off (so entries written without autocast keep their binding). The cache also makes it part of
  the tables' identity, so tables built outside autocast are never served inside it.

Device identity (torch build, CUDA version, device name and capability, CPU capability) is added
by :func:`numeric_environment`; the probe's shape class already names the device.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

#: The matmul precision switch of the new API for each device type's GEMM library, with its
#: parents (most specific first). ``"none"`` means "inherit from the parent"; a chain of
#: ``"none"`` ends in IEEE arithmetic. Only matmul switches reach ``F.linear``: the conv and rnn
#: ones are left out, so setting them (for a VAE, say) costs no store miss.
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


def _legacy_precision() -> dict[str, Any]:
    """The switches of a torch without the new API (before 2.9), where reading them cannot raise."""
    return {
        "matmul_tf32": _backend_attr("cuda.matmul.allow_tf32"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def autocast_settings(device: torch.device | str) -> dict[str, Any]:
    """The autocast state that changes a projection's bits on ``device``: its dtype, when autocast is on.

    Autocast is per device type and per thread; only the state of ``device``'s type reaches its
    kernels. Empty when autocast is off for that type.
    """
    kind = torch.device(device).type
    if not torch.is_autocast_enabled(kind):
        return {}
    return {"autocast": str(torch.get_autocast_dtype(kind)).removeprefix("torch.")}


def autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype a projection on ``device`` computes and returns in under the current autocast, or None."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def bit_settings(device: torch.device | str) -> dict[str, Any]:
    """Every process-wide setting, besides shapes, dtypes and addresses, that can change GEMM bits on ``device``.

    Only what reaches ``device``'s kernels: the thread count and the oneDNN switch on a CPU, the
    CUDA switches on a GPU (a store filled by ``torchrun`` ranks with one CPU thread each still
    serves a GPU process with many). Other device types get every switch. Never raises, whichever
    mix of the legacy and the new precision APIs the caller used. Values are plain (str, int,
    bool, None), so the result is JSON-able and hashable as items.
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
        settings.update(_legacy_precision())
    for label, path in _CUDA_REDUCED if cuda else ():
        value = _backend_attr(path)
        if value is not _MISSING:
            settings[label] = value
    settings["deterministic"] = torch.are_deterministic_algorithms_enabled()
    settings.update(autocast_settings(device))
    return settings


def bit_settings_key(device: torch.device | str) -> tuple[tuple[str, Any], ...]:
    """:func:`bit_settings` as a hashable key (the batched probe's shape classes use it)."""
    return tuple(sorted(bit_settings(device).items()))


def numeric_environment(device: torch.device) -> dict[str, Any]:
    """Everything besides the weights that decides the bits of a projection on ``device``.

    :func:`bit_settings` plus the identity of the software and hardware that ran it. The store
    binds its entries to this, so a change of any of it is a miss.
    """
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
    """The part of :func:`numeric_environment` that belongs to the device rather than to the process.

    Two devices of one identity (two GPUs of one model, say) compute the same bits for the same
    kernels, so tables move between them as they are; across identities (a CPU and a GPU, two GPU
    models) they must be computed again.
    """
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)))
    return (device.type,)


__all__ = [
    "autocast_dtype",
    "autocast_settings",
    "bit_settings",
    "bit_settings_key",
    "device_identity",
    "numeric_environment",
]
