"""The pass at GEMM speed changes no bit: in-place reads against staged ones, tiled projections
against whole ones, every table compared by ``torch.equal``.

In place: a checkpoint just written is in the page cache, so the default source projects from its
mapping; ``in_place=False`` stages every byte. The fp32 files hold the projections at offsets that
are not 16-byte aligned, and the plans include one-timestep plans (M=1, the GEMV whose bits depend
on the weight's address on some CPUs): the mapping keeps the file offset's address modulo 4096,
as the staging buffers do.

Tiled: the layers here are a few hundred rows wide, so the tile is set smaller than a layer
(``rebuild.TILE_ROWS``) for the test; a forced mismatch goes through the ``project=`` seam.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from adalncache import AdalnCache, CheckpointSource, ConfigError, ModulationSpec, rebuild
from adalncache.plans import plan_key
from adalncache.rebuild import clear_verdicts, verdicts
from adalncache.source.files import write_safetensors
from adalncache.spec import FINAL, Layer, get_layout
from core_helpers import assert_plan_exact, embed_for, load_reference, make_weights

#: Rows per tile here: each block layer (288 rows) is three tiles, the final layer (32) one. Not
#: smaller: on the dev CPU a bf16 GEMV of K=64 over 64 rows or fewer takes another kernel path,
#: which gave other bits for one output of a one-row plan (docs/exactness.md).
TILE = 96


@pytest.fixture(autouse=True)
def _fresh_verdicts() -> Iterator[None]:
    clear_verdicts()
    yield
    clear_verdicts()


def _checkpoint(tmp_path: Path, dtype: torch.dtype) -> tuple[Path, ModulationSpec]:
    """A native single-file checkpoint whose projection tensors sit 8 bytes past a 16-byte boundary."""
    spec = ModulationSpec(num_layers=3, hidden_size=16, time_embed_dim=64, dtype=dtype)
    weights = make_weights(spec)
    layout = get_layout("native")
    names = [n for layer in spec.layers() for n in (layout.weight(layer), layout.bias(layer))]
    path = write_safetensors(weights, tmp_path / "model.safetensors", residues=dict.fromkeys(names, 8))
    return path, spec


def _plans(widths: list[int]) -> list[torch.Tensor]:
    return [
        torch.tensor([1.0 - (n + i / 7) / len(widths) for i in range(width)], dtype=torch.float32)
        for n, width in enumerate(widths)
    ]


PLANS = _plans([1, 2, 2, 2, 1, 3, 2, 4, 2])


def _build(source: CheckpointSource, *, tiled: Any = False, **kw: Any) -> tuple[AdalnCache, Any]:
    cache = AdalnCache(source.spec, source, max_plans=len(PLANS), max_plan_width=4, tiled=tiled, progress=False)
    report = cache.build(PLANS, embed=embed_for(source.spec), **kw)
    return cache, report


def _assert_same_tables(a: AdalnCache, b: AdalnCache) -> None:
    for plan in PLANS:
        ra, rb = a.rows_of(plan_key(plan)), b.rows_of(plan_key(plan))
        assert all(torch.equal(x, y) for x, y in zip(ra.parts, rb.parts, strict=True)), f"plan {plan.tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_tables_equal_staged_tables(tmp_path: Path, dtype: torch.dtype) -> None:
    path, spec = _checkpoint(tmp_path, dtype)
    in_place = CheckpointSource(path, spec)
    staged = CheckpointSource(path, spec, in_place=False)
    mapped, report = _build(in_place)
    copied, _ = _build(staged)
    assert in_place.bytes_in_place == report.bytes_read > 0  # every byte projected from the mapping
    assert staged.bytes_in_place == 0
    _assert_same_tables(mapped, copied)
    weights = load_reference(path)
    for plan in PLANS:  # and both are the resident projection's rows
        assert_plan_exact(mapped, weights, "native", embed_for(spec), plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_tables_equal_per_plan_tables(tmp_path: Path, dtype: torch.dtype, monkeypatch: Any) -> None:
    monkeypatch.setattr(rebuild, "TILE_ROWS", TILE)
    path, spec = _checkpoint(tmp_path, dtype)
    source = CheckpointSource(path, spec)
    whole, _ = _build(source, tiled=False)
    tiled, first = _build(source, tiled=True)
    _assert_same_tables(whole, tiled)
    probed = verdicts("tiled")
    assert probed and {cls[4] for cls in probed} == {f"tiles of {TILE} rows"}
    assert {cls[3] for cls in probed} == {1, 2, 3, 4}  # one class per plan width (the input rows M)
    # The second pass runs on the verdicts: every class proven exact is tiled in every block layer.
    again, second = _build(source, tiled=True)
    _assert_same_tables(whole, again)
    exact_widths = {cls[3] for cls, ok in verdicts("tiled").items() if ok}
    assert second.tiled_layers == 3 * len(exact_widths)  # three blocks; the final layer is one tile
    assert first.tiled_layers <= second.tiled_layers
    weights = load_reference(path)
    for plan in PLANS:
        assert_plan_exact(again, weights, "native", embed_for(spec), plan)


def test_cpu_bf16_tiles_every_plan_width(tmp_path: Path, monkeypatch: Any) -> None:
    """On this CPU a bf16 projection sliced into column tiles gives the whole GEMM's bits at M = 1..4
    (docs/exactness.md), so the probe accepts every width and the second pass tiles every block."""
    monkeypatch.setattr(rebuild, "TILE_ROWS", TILE)
    path, spec = _checkpoint(tmp_path, torch.bfloat16)
    source = CheckpointSource(path, spec)
    _build(source, tiled=True)
    assert all(verdicts("tiled").values())
    _, second = _build(source, tiled=True)
    assert second.tiled_layers == 3 * 4


def test_a_projection_that_changes_bits_when_tiled_falls_back_for_its_class(
    tmp_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    """A projection that adds 1 to a tile's output for plans of 2 timesteps: the probe refuses that
    class (per plan from then on); the other widths are tiled; every row is still the whole GEMM's."""
    monkeypatch.setattr(rebuild, "TILE_ROWS", TILE)
    path, spec = _checkpoint(tmp_path, torch.bfloat16)
    source = CheckpointSource(path, spec)

    def project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        tiled = weight.shape[0] < spec.out_features(layer)
        return y + 1 if tiled and x.shape[0] == 2 else y

    whole, _ = _build(source, tiled=False)
    tiled, report = _build(source, tiled=True, project=project)
    _assert_same_tables(whole, tiled)
    assert report.tiled_layers == 2 * 3  # widths 1, 3, 4 probed at layer 0, tiled at layers 1 and 2
    assert verdicts("tiled") == {}  # a custom projection's verdicts live for its pass only


def test_a_spot_check_mismatch_refuses_the_class(tmp_path: Path, monkeypatch: Any, caplog: Any) -> None:
    """A projection exact when tiled at the probe (layer 0) but not later: the spot check of layer 1
    catches it, that layer is projected whole, and the class stays refused."""
    monkeypatch.setattr(rebuild, "TILE_ROWS", TILE)
    path, spec = _checkpoint(tmp_path, torch.bfloat16)
    source = CheckpointSource(path, spec)

    def project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        tiled = weight.shape[0] < spec.out_features(layer)
        return y + 1 if tiled and layer not in (0, FINAL) and x.shape[0] == 4 else y

    whole, _ = _build(source, tiled=False)
    with caplog.at_level("WARNING", logger="adalncache.rebuild"):
        tiled, report = _build(source, tiled=True, project=project)
    _assert_same_tables(whole, tiled)
    assert "tiled projection" in caplog.text and "differed from the per-plan one at layer 1" in caplog.text
    assert report.tiled_layers == 3 * 2  # widths 1, 2, 3 at layers 1 and 2; width 4 at neither


def test_auto_tiles_only_the_default_projection(tmp_path: Path, monkeypatch: Any) -> None:
    """``tiled="auto"`` (the default) leaves a custom projection whole: it need not accept a slice of
    the weight (the diffusers integration's module forward does not)."""
    monkeypatch.setattr(rebuild, "TILE_ROWS", TILE)
    path, spec = _checkpoint(tmp_path, torch.bfloat16)
    source = CheckpointSource(path, spec)
    seen: list[int] = []

    def project(layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        seen.append(weight.shape[0])
        return F.linear(x, weight, bias)

    cache = AdalnCache(spec, source, max_plans=len(PLANS), max_plan_width=4, progress=False)
    assert cache.tiled == "auto"
    report = cache.build(PLANS, embed=embed_for(spec), project=project)
    assert report.tiled_layers == 0 and set(seen) == {spec.out_features(0), spec.out_features(FINAL)}
    _build(source, tiled="auto")  # the default projection: probed, tiled where exact and faster
    assert verdicts("tiled")


def test_tiles_cover_the_width_without_a_short_last_tile() -> None:
    assert rebuild.tile_bounds(288, 96) == [(0, 96), (96, 192), (192, 288)]
    assert rebuild.tile_bounds(300, 96) == [(0, 96), (96, 192), (192, 300)]
    assert rebuild.tile_bounds(96, 96) == [(0, 96)] and rebuild.tile_bounds(50, 96) == [(0, 50)]
    assert rebuild.tile_bounds(96768, 2048)[-1] == (94208, 96768)


def test_tiled_is_checked(tmp_path: Path) -> None:
    path, spec = _checkpoint(tmp_path, torch.bfloat16)
    with pytest.raises(ConfigError, match="--tiled"):
        AdalnCache(spec, CheckpointSource(path, spec), tiled="yes")
