"""Batched mode: stacked GEMMs only where a probe proved them bit-identical, never a different row.

Every check compares a batched build with a per-plan build (and the per-plan build with an
independent ``F.linear`` reference) by ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from adalncache import AdalnCache, CheckpointSource, ConfigError, ModulationSpec
from adalncache.plans import plan_key
from adalncache.rebuild import clear_verdicts, verdicts
from adalncache.spec import FINAL, Layer
from core_helpers import assert_plan_exact, embed_for, load_reference, make_weights, write_checkpoint


@pytest.fixture(autouse=True)
def _fresh_verdicts() -> Iterator[None]:
    clear_verdicts()
    yield
    clear_verdicts()


def _source(tmp_path: Path, dtype: torch.dtype) -> tuple[CheckpointSource, dict[str, torch.Tensor]]:
    spec = ModulationSpec(num_layers=3, hidden_size=16, time_embed_dim=64, dtype=dtype)
    path = write_checkpoint(tmp_path / "ckpt", make_weights(spec), shards=2)
    return CheckpointSource(path, spec), load_reference(path)


def _plans(widths: list[int]) -> list[torch.Tensor]:
    out = []
    for n, width in enumerate(widths):
        out.append(torch.tensor([1.0 - (n + i / 7) / len(widths) for i in range(width)], dtype=torch.float32))
    return out


def _build(source: CheckpointSource, plans: list[torch.Tensor], batched: bool, **kw: Any) -> tuple[AdalnCache, Any]:
    cache = AdalnCache(source.spec, source, max_plans=len(plans), max_plan_width=4, batched=batched)
    report = cache.build(plans, embed=embed_for(source.spec), **kw)
    return cache, report


def _assert_same_slabs(a: AdalnCache, b: AdalnCache, plans: list[torch.Tensor]) -> None:
    for p in plans:
        ra, rb = a.rows_of(plan_key(p)), b.rows_of(plan_key(p))
        assert torch.equal(ra.block, rb.block) and torch.equal(ra.final, rb.final), f"plan {p.tolist()} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_build_equals_per_plan_build(tmp_path: Path, dtype: torch.dtype) -> None:
    source, weights = _source(tmp_path, dtype)
    plans = _plans([2] * 6 + [1] * 3 + [3])  # three width groups, one of a single plan (never stacked)
    per_plan, _ = _build(source, plans, batched=False)
    batched, report = _build(source, plans, batched=True)
    _assert_same_slabs(per_plan, batched, plans)
    for p in plans:
        assert_plan_exact(batched, weights, "native", embed_for(source.spec), p)
    # Two groups (widths 2 and 1) x four layers (three blocks, final): each ran stacked or per plan.
    assert report.stacked_layers + report.per_plan_layers == 2 * 4
    # A second pass reuses the verdicts: no probe, so every group of a proven class is stacked.
    again, report2 = _build(source, plans, batched=True)
    _assert_same_slabs(per_plan, again, plans)
    proven = sum(verdicts().values())
    assert report2.stacked_layers >= proven


def test_cpu_bf16_stacks_width_two_plans(tmp_path: Path) -> None:
    """At this test's small widths a bf16 GEMM on CPU gives the same bits stacked as per plan for
    plans of 2 timesteps, so the probe accepts them and a second pass stacks every layer. (At the
    real widths that depends on the host's kernels and thread count: docs/exactness.md.)"""
    source, _ = _source(tmp_path, torch.bfloat16)
    plans = _plans([2] * 8)
    _, first = _build(source, plans, batched=True)
    assert first.per_plan_layers == 2  # the probes: one block shape and the output layer's
    assert first.stacked_layers == 2  # blocks 1 and 2 from the block probe's verdict
    _, second = _build(source, plans, batched=True)
    assert second.stacked_layers == 4 and second.per_plan_layers == 0


def test_a_spot_check_mismatch_falls_back_and_refuses_the_class(tmp_path: Path, caplog: Any) -> None:
    """A projection whose stacked bits change after the probe layer is caught on that very layer."""
    source, _ = _source(tmp_path, torch.bfloat16)
    plans = _plans([2] * 5)

    def project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        if layer not in (0, FINAL) and x.shape[0] > 2:  # stacked, past the probe layers: wrong bits
            y = y + 1
        return y

    per_plan, _ = _build(source, plans, batched=False, project=project)
    with caplog.at_level("WARNING", logger="adalncache.rebuild"):
        batched, report = _build(source, plans, batched=True, project=project)
    _assert_same_slabs(per_plan, batched, plans)
    assert "differed from the per-plan one at layer 1" in caplog.text
    assert report.stacked_layers == 0 and report.per_plan_layers == 4
    # A custom projection's verdicts live for one pass: the next pass probes again, is caught
    # again, and still writes only per-plan rows. The process-wide verdicts hold none of it.
    caplog.clear()
    with caplog.at_level("WARNING", logger="adalncache.rebuild"):
        again, report2 = _build(source, plans, batched=True, project=project)
    _assert_same_slabs(per_plan, again, plans)
    assert report2.stacked_layers == 0 and "differed from the per-plan one at layer 1" in caplog.text
    assert verdicts() == {}


def test_a_probe_that_finds_different_bits_keeps_per_plan_rows(tmp_path: Path) -> None:
    source, _ = _source(tmp_path, torch.bfloat16)
    plans = _plans([2] * 4)
    calls: list[int] = []

    def project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        y = F.linear(x, weight, bias)
        return y * 2 if x.shape[0] > 2 else y  # stacking is never exact

    per_plan, _ = _build(source, plans, batched=False, project=project)
    calls.clear()
    batched, report = _build(source, plans, batched=True, project=project)
    _assert_same_slabs(per_plan, batched, plans)
    assert report.stacked_layers == 0 and report.per_plan_layers == 4
    # Each class is probed once (two stacked calls: blocks and output layer), then per plan only.
    assert calls.count(8) == 2


def test_same_bits_is_stricter_than_torch_equal() -> None:
    from adalncache.rebuild import same_bits

    plus, minus = torch.zeros(3, dtype=torch.bfloat16), -torch.zeros(3, dtype=torch.bfloat16)
    assert torch.equal(plus, minus) and not same_bits(plus, minus)
    assert same_bits(plus, plus.clone()) and not same_bits(plus, plus.float())


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_batched_must_be_a_bool(tmp_path: Path, bad: Any) -> None:
    source, _ = _source(tmp_path, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"batched.*--batched"):
        AdalnCache(source.spec, source, batched=bad)


def test_cli_build_batched_then_verify(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    """``build --batched`` writes entries; ``verify`` recomputes them per plan and finds them equal."""
    pytest.importorskip("diffusers")
    from adalncache.cli import main
    from tiers_support import write_h3_checkpoint

    model = load_tiny("bf16-disk")
    ckpt = write_h3_checkpoint(model, tmp_path / "ckpt")
    store = tmp_path / "store"
    argv = ["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "6", "--batched", "-q"]
    assert main(argv) == 0
    assert main(["verify", "--store", str(store), "--checkpoint", str(ckpt), "-q"]) == 0


@pytest.mark.parametrize("precision", ["bf16-disk", "fp32-disk"])
def test_diffusers_integration_batched_loop_is_bit_identical(load_tiny: Callable[[str], Any], precision: str) -> None:
    """``enable_adaln_cache(..., batched=True)`` through a real denoising loop equals the resident model."""
    pytest.importorskip("diffusers")
    from adalncache.diffusers import enable_adaln_cache
    from adalncache.plans import minimax_h3_plans
    from adalncache.tools.tiny import make_request, run_loop

    model = load_tiny(precision)
    request = make_request(model, "t2va", 6, seed=2)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, batched=True, max_plans=8)
    report = handle.prepare(minimax_h3_plans("t2va", 6))
    assert report.stacked_layers + report.per_plan_layers > 0  # the plans were grouped
    cached = run_loop(model, request)
    handle.disable()
    for step, (r, c) in enumerate(zip(resident.outputs, cached.outputs, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(r, c, strict=True)), f"step {step} differs"
