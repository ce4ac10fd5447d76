"""enable_adaln_cache(..., tables=): a diffusers model served from exported table files.

The tables are exported from a checkpoint of the same tiny model (``adalncache export``); the
denoising loop's outputs must equal the resident model's bit for bit, with the projections freed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from adalncache.cli import main
from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError, PlanNotCachedError
from adalncache.source.memory import NoWeights
from adalncache.tools.tiny import make_request, run_loop
from tiers_support import write_h3_checkpoint

STEPS = 4


def _projection_weights(model: Any) -> list[torch.Tensor]:
    linears = [b.adaln_proj.linear for b in model.transformer_blocks] + [model.norm_out.linear]
    return [getattr(lin, "base_layer", lin).weight for lin in linears]


@pytest.fixture
def exported(load_tiny: Callable[[str], Any], tmp_path: Path) -> tuple[Path, Path]:
    """A bf16 checkpoint of the tiny model and the bound table file of its t2va schedule."""
    ckpt = write_h3_checkpoint(load_tiny("bf16-disk"), tmp_path / "ckpt")
    out = tmp_path / "t2va.safetensors"
    assert main(["export", str(ckpt), "-o", str(out), "--task", "t2va", "--steps", str(STEPS), "-q"]) == 0
    return ckpt, out


def test_served_from_tables_alone_bit_identical_with_the_projections_freed(
    load_tiny: Callable[[str], Any], exported: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, tables = exported
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", STEPS, seed=3)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, tables=tables)
    assert isinstance(handle.cache.source, NoWeights)  # no weight source anywhere
    assert all(w.device.type == "meta" for w in _projection_weights(model))
    assert not any(p.original is not None for p in handle._parking.parked if p.layer is not None)
    cached = run_loop(model, request)
    assert cached.equal(resident)
    assert handle.stats.table_hits > 0 and handle.stats.passes == 0
    # A request the file does not cover: a clear PlanNotCachedError, never tables built from nothing.
    with pytest.raises(PlanNotCachedError, match="not in the table files") as info:
        run_loop(model, make_request(model, "fl2va", STEPS, seed=3))
    assert str(tables) in str(info.value)
    # state_dict cannot include weights that no longer exist: it says so.
    with pytest.raises(ConfigError, match="freed"):
        model.state_dict()
    with caplog.at_level(logging.WARNING):
        handle.disable()
    assert "cannot run without the cache" in caplog.text
    assert all(w.device.type == "meta" for w in _projection_weights(model))


def test_an_upstream_change_of_a_model_served_from_tables_alone_is_refused(
    load_tiny: Callable[[str], Any], exported: tuple[Path, Path]
) -> None:
    """Table files and no weights: the tables of a changed time embedder cannot be built, so the next
    forward refuses the change (ConfigError naming the tensor), never serves the old rows for it."""
    _, tables = exported
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", STEPS, seed=3)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, tables=tables, free_time_embedder=False)
    assert run_loop(model, request).equal(resident)
    with torch.no_grad():
        model.time_embedder.linear_1.weight.mul_(2)
    with pytest.raises(ConfigError, match=r"time_embedder\.linear_1\.weight .*cannot rebuild"):
        run_loop(model, request)
    handle.disable()


def test_tables_with_a_checkpoint_build_misses_and_restore(
    load_tiny: Callable[[str], Any], exported: tuple[Path, Path]
) -> None:
    ckpt, tables = exported
    model = load_tiny("bf16-disk")
    before = [w.detach().clone() for w in _projection_weights(model)]
    fl2va = make_request(model, "fl2va", STEPS, seed=5)
    t2va = make_request(model, "t2va", STEPS, seed=5)
    resident = run_loop(model, fl2va), run_loop(model, t2va)
    handle = enable_adaln_cache(model, ckpt, tables=[tables])
    assert run_loop(model, fl2va).equal(resident[0])  # not in the file: built from the checkpoint
    passes = handle.stats.passes
    assert passes >= 1
    assert run_loop(model, t2va).equal(resident[1]) and handle.stats.table_hits > 0
    handle.disable()
    assert all(torch.equal(w, b) for w, b in zip(_projection_weights(model), before))


def test_a_file_of_other_weights_is_refused_and_the_model_left_as_it_was(
    load_tiny: Callable[[str], Any], exported: tuple[Path, Path]
) -> None:
    _, tables = exported
    model = load_tiny("bf16-disk")
    with torch.no_grad():
        model.transformer_blocks[0].adaln_proj.linear.weight.mul_(2)  # a fine-tune, say
    before = [w.detach().clone() for w in _projection_weights(model)]
    with pytest.raises(ConfigError, match="other projection weights"):
        enable_adaln_cache(model, tables=tables)
    assert all(torch.equal(w, b) for w, b in zip(_projection_weights(model), before))
    with pytest.raises(ConfigError, match="only a pipeline"):
        enable_adaln_cache(model, tables={"transformer": tables})
    fp32 = load_tiny("fp32-disk")
    with pytest.raises(ConfigError, match="float32"):
        enable_adaln_cache(fp32, tables=tables)
    assert all(w.device.type != "meta" for w in _projection_weights(fp32))
