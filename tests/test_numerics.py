"""The settings that decide output bits (adalncache.identity): one definition, read without raising.

Why these tests: the store binding and the batched probe both key on these settings, so a
setting that raises when read would break every store write and batched build, and a setting
left out would let a table built under other numerics be served as exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from adalncache import AdalnCache, CheckpointSource, identity
from adalncache.identity import bit_settings, bit_settings_key, numeric_environment
from adalncache.rebuild import clear_verdicts, verdicts
from core_helpers import SPEC, assert_plan_exact, embed_for, load_reference, make_weights, write_checkpoint

EMBED = embed_for(SPEC)
#: Two plans of width 2 (stacked together in batched mode) and one of width 1.
PLANS = [torch.tensor([0.9, 0.6]), torch.tensor([0.8, 0.4]), torch.tensor([0.5])]


@pytest.fixture(autouse=True)
def _fresh_verdicts() -> Iterator[None]:
    clear_verdicts()
    yield
    clear_verdicts()


@contextlib.contextmanager
def new_precision_api(cuda: str = "tf32", onednn: str = "tf32") -> Iterator[None]:
    """Set the matmul switches of the new API (CUDA's and oneDNN's) for the block, then restore them.

    Once either is set, torch refuses to read the legacy flags (``allow_tf32``,
    ``get_float32_matmul_precision()``): the hazard :mod:`adalncache.identity` must survive.
    """
    matmul, onednn_matmul = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    previous = matmul.fp32_precision, onednn_matmul.fp32_precision
    matmul.fp32_precision, onednn_matmul.fp32_precision = cuda, onednn
    try:
        yield
    finally:
        matmul.fp32_precision, onednn_matmul.fp32_precision = previous


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt", make_weights(SPEC, seed=5))


def _cache(path: Path, store: Path, **kw: object) -> AdalnCache:
    return AdalnCache(SPEC, CheckpointSource(path, SPEC), max_plans=len(PLANS), store=store, **kw)


def test_bit_settings_read_the_new_precision_api_without_raising() -> None:
    with new_precision_api():
        cpu, cuda = bit_settings("cpu"), bit_settings("cuda")
        environment = numeric_environment(torch.device("cpu"))
    assert cpu["mkldnn_matmul_fp32_precision"] == "tf32" and cuda["cuda_matmul_fp32_precision"] == "tf32"
    # Only what reaches the device's kernels: the CPU threads and oneDNN on a CPU, the CUDA switches on a GPU.
    assert "num_threads" in cpu and "cuda_matmul_fp32_precision" not in cpu
    assert "num_threads" not in cuda and "mkldnn_matmul_fp32_precision" not in cuda
    # One definition: the store binding's environment carries every bit-deciding setting.
    assert cpu.items() <= environment.items()
    assert bit_settings("cpu")["mkldnn_matmul_fp32_precision"] == "ieee"  # restored: "none" resolves to IEEE


def test_store_write_store_hit_and_batched_build_under_the_new_precision_api(tmp_path: Path) -> None:
    path, store = _checkpoint(tmp_path), tmp_path / "store"
    weights = load_reference(path)
    with new_precision_api(onednn="ieee"):  # set explicitly: the same arithmetic as the default
        cache = _cache(path, store, batched=True)
        report = cache.build(PLANS, embed=EMBED)
        assert (report.built, report.passes, report.tier_write_failures) == (len(PLANS), 1, 0)
        # the batched path ran: the width-2 group was probed on its first layer, then served
        assert report.stacked_layers + report.per_plan_layers == len(SPEC.layers())
        assert report.per_plan_layers >= 1
        for plan in PLANS:
            assert_plan_exact(cache, weights, "native", EMBED, plan)
        hit = _cache(path, store, batched=True).build(PLANS, embed=EMBED)
        assert (hit.store_hits, hit.passes, hit.bytes_read) == (len(PLANS), 0, 0)
    # "ieee" set and "none" (inherited) are the same arithmetic: the entries serve the default too.
    assert _cache(path, store).build(PLANS, embed=EMBED).store_hits == len(PLANS)
    with new_precision_api(onednn="bf16"):  # bf16 arithmetic for fp32 GEMMs on a CPU: another binding
        other = _cache(path, store).build(PLANS, embed=EMBED)
        assert other.store_hits == 0 and other.built == len(PLANS)


def test_thread_count_is_part_of_the_binding_and_of_the_probe_class(tmp_path: Path) -> None:
    """1 and 2 intra-op threads can give different GEMM bits (see adalncache.identity): never mix them."""
    path, store = _checkpoint(tmp_path), tmp_path / "store"
    with num_threads(1):
        one = bit_settings_key("cpu")
        assert _cache(path, store, batched=True).build(PLANS, embed=EMBED).built == len(PLANS)
    with num_threads(2):
        assert bit_settings_key("cpu") != one
        report = _cache(path, store, batched=True).build(PLANS, embed=EMBED)
        assert report.store_hits == 0 and report.built == len(PLANS)
    with num_threads(1):
        assert _cache(path, store).build(PLANS, embed=EMBED).store_hits == len(PLANS)
    # The probe's shape classes end with the bit-deciding settings: the same shapes under two
    # thread counts are different classes, each probed on its own.
    assert {dict(cls[-1])["num_threads"] for cls in verdicts()} == {1, 2}


def test_a_torch_without_the_new_api_reads_the_legacy_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "_has_new_precision_api", lambda: False)
    settings = bit_settings("cpu")
    assert settings["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert "mkldnn_matmul_fp32_precision" not in settings and "num_threads" in settings
