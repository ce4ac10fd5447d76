"""The family seam: the core serves a geometry that is not MiniMax-H3's, exactly, from every tier.

The synthetic family of tests/seam_helpers.py has layers of different widths named by module path,
two projection inputs with different row counts, and two-column plans. Every table is compared
with ``torch.equal`` against an independent ``F.linear`` per plan and layer at the input's own M
(rows past it zero): built, restored from the host tier, from the store, from a table file, and
built by a gloo group of two ranks (both shard modes).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import seam_helpers as S
import seam_workers as SW
from adalncache import (
    AdalnCache,
    BuildError,
    CheckpointSource,
    ConfigError,
    PlanError,
    PlanNotCachedError,
    Store,
    TensorSource,
)
from adalncache.formats import TableFile, is_table_file
from adalncache.geometry import TABLE_ROWS, ModelGeometry, ServedLayer, TablePart
from adalncache.offline import export_tables, verify_tables
from adalncache.plans import plan_key
from adalncache.rebuild import clear_verdicts, verdicts
from adalncache.spec import ModulationSpec


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return S.write_checkpoint(tmp_path / "ckpt")


def _cache(ckpt: Path, **kwargs: Any) -> AdalnCache:
    kwargs.setdefault("max_plans", 4)
    return AdalnCache(S.SPEC, CheckpointSource(ckpt, S.SPEC), **kwargs)


# -- geometry ---------------------------------------------------------------------------------


def test_the_geometry_is_read_through_neutral_members() -> None:
    spec = S.SPEC
    assert spec.layers() == [layer.id for layer in S.LAYERS]
    assert [spec.offset(layer) for layer in spec.layers()] == [0, 24, 64, 88, 96]
    assert spec.table_width == 112 and spec.row_bytes == 112 * 2
    assert spec.inputs == ("a", "b") and spec.input_of("blocks.1.mod_b") == "b"
    assert spec.plan_columns == 2 and spec.plan_inputs == ("timestep", "guidance")
    assert spec.plan_rows(plan_key(S.PLANS[2], 2)) == 3
    assert [(p.name, p.tensor, p.shape) for p in spec.table_parts()] == [("table", TABLE_ROWS, (112,))]
    assert spec.describe() == {
        "family": "synthetic",
        "layers": [[layer.id, layer.out_features, layer.input] for layer in S.LAYERS],
        "in_features": 16,
        "plan_inputs": ["timestep", "guidance"],
        "dtype": "bfloat16",
    }
    assert spec.slab_bytes(3, 2) == (3 + 1) * 2 * 112 * 2 + 3 * 2 * 4 * 2 + 3 * 8  # the poison slot's rows too
    with pytest.raises(ConfigError, match=r"block_width describes the MiniMax-H3 geometry.*out_features"):
        spec.block_width  # noqa: B018
    with pytest.raises(ConfigError, match="not a served layer"):
        spec.out_features("blocks.9.mod_a")
    # The default geometry's neutral view is MiniMax-H3's, with its identity unchanged.
    h3 = ModulationSpec(num_layers=2, hidden_size=8, time_embed_dim=16)
    assert h3.layers() == [0, 1, "final"] and h3.table_width == 2 * 144 + 16 and h3.plan_columns == 1
    identity = {"num_layers": 2, "hidden_size": 8, "time_embed_dim": 16, "modalities": 3, "dtype": "bfloat16"}
    assert h3.describe() == identity


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"layers": ()}, "at least one served layer"),
        ({"layers": (ServedLayer("x", 8), ServedLayer("x", 8))}, "appears twice"),
        ({"layers": (ServedLayer("x", 0),)}, "out_features must be a positive integer"),
        ({"plan_inputs": ("t", "t")}, "distinct names"),
        ({"parts": (TablePart("table", TABLE_ROWS, 0, 100, (100,)),)}, "must cover"),
    ],
)
def test_a_malformed_geometry_is_refused(change: dict[str, Any], says: str) -> None:
    fields: dict[str, Any] = {
        "family": S.FAMILY,
        "layers": S.LAYERS,
        "in_features": 16,
        "plan_inputs": ("timestep", "guidance"),
    }
    with pytest.raises(ConfigError, match=says):
        ModelGeometry(**{**fields, **change})


# -- build and serve ----------------------------------------------------------------------------


def test_build_serves_every_layer_at_its_inputs_own_rows(ckpt: Path) -> None:
    weights = S.load_reference(ckpt)
    cache = _cache(ckpt)
    report = cache.build(S.PLANS, embed=S.embed)
    assert report.plans == 3 and report.built == 3 and report.passes == 1
    S.assert_exact(cache, weights, S.PLANS[:3])
    # The layer views are columns of the one table, and the plan is stored with its columns.
    slot = int(cache.lookup(S.PLANS[2]))
    assert cache.plan_timesteps.shape == (4, 4, 2) and torch.equal(cache.plan_timesteps[slot, :3], S.PLANS[2])
    assert cache.layer_params("blocks.0.mod_b").data_ptr() == cache.table.data_ptr() + 24 * 2
    assert cache.layer_params("blocks.0.mod_b").shape == (4, 4, 40)
    cache.check_invariants()
    with pytest.raises(ConfigError, match=r"no 'block' part.*layer_rows"):
        cache.block_params  # noqa: B018
    with pytest.raises(PlanError, match="not served by this cache"):
        cache.layer_rows("blocks.7.mod_a", slot, 1)


def test_a_reused_slot_zeroes_the_rows_past_a_layers_input(ckpt: Path) -> None:
    """Rows a layer does not take are zero even where the slot held another plan's rows before."""
    weights = S.load_reference(ckpt)
    cache = _cache(ckpt, max_plans=1, max_plan_width=3)
    first = S.plan((0.1, 1.0), (0.2, 1.0), (0.3, 1.0))
    second = S.plan((0.6, 2.0), (0.5, 2.0), (0.4, 2.0))
    cache.build([first], embed=S.embed)
    slot = int(cache.lookup(first))
    assert cache.layer_rows("blocks.0.mod_b", slot, 3)[2].abs().sum() == 0  # b takes 2 of the 3 rows
    cache.build([second], embed=S.embed)
    assert int(cache.lookup(second)) == slot
    S.assert_exact(cache, weights, [second])


def test_row_reads_of_named_layers_refuse_bad_slots_counts_and_layers(ckpt: Path) -> None:
    """The typed checks of the row reads hold for a family whose layers are module paths."""
    cache = _cache(ckpt, max_plans=3)
    cache.build(S.PLANS[:1], embed=S.embed)
    slot = int(cache.lookup(S.PLANS[0]))
    free = next(s for s in range(3) if s != slot)
    layer = "blocks.0.mod_a"
    with pytest.raises(PlanError, match=r"slot must be in 0\.\.2"):
        cache.layer_rows(layer, 3, 1)
    with pytest.raises(PlanError, match=r"slot must be in 0\.\.2"):
        cache.layer_rows(layer, -1, 1)
    with pytest.raises(PlanNotCachedError, match=f"slot {free} holds no plan"):
        cache.layer_rows(layer, free, 1)
    with pytest.raises(PlanError, match="num_timesteps must be an integer"):
        cache.layer_rows(layer, slot, 1.5)  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    with pytest.raises(PlanError, match="not served by this cache"):
        cache.layer_params(0)
    assert cache.layer_rows(layer, slot, 1).shape == (1, 24)


def test_an_embed_that_changes_its_two_column_plan_or_builds_is_refused(ckpt: Path) -> None:
    cache = _cache(ckpt, max_plans=3)
    given = S.PLANS[1].clone()

    def mutating(p: torch.Tensor) -> dict[str, torch.Tensor]:
        p[0, 1] = 9.0  # the guidance column
        return S.embed(p)

    with pytest.raises(BuildError, match=r"changed its plan in place.*\(0\.7, 9\)") as info:
        cache.build([given], embed=mutating)
    assert isinstance(info.value.__cause__, PlanError)
    assert torch.equal(given, S.PLANS[1]) and len(cache) == 0

    def reentrant(p: torch.Tensor) -> dict[str, torch.Tensor]:
        cache.build([p], embed=S.embed)
        return S.embed(p)

    with pytest.raises(BuildError, match="from inside a build of this cache"):
        cache.build(S.PLANS[:1], embed=reentrant)
    cache.check_invariants()
    report = cache.build(S.PLANS[:3], embed=S.embed)  # every slot still usable: none leaked
    assert report.built == 3
    S.assert_exact(cache, S.load_reference(ckpt), S.PLANS[:3])


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (lambda p: {"a": S.embed(p)["a"]}, r"returned inputs \['a'\].*take \['a', 'b'\]"),
        (lambda p: {**S.embed(p), "b": torch.cat([S.embed(p)["a"]] * 2)}, r"1 <= m <="),
        (lambda p: {**S.embed(p), "a": S.embed(p)["a"].float()}, "precision='match'"),
    ],
    ids=["missing input", "too many rows", "wrong dtype"],
)
def test_a_bad_embed_mapping_fails_the_build_and_changes_nothing(ckpt: Path, bad: Any, says: str) -> None:
    cache = _cache(ckpt)
    cache.build(S.PLANS[:1], embed=S.embed)
    with pytest.raises(BuildError, match=says) as info:
        cache.build(S.PLANS[1:3], embed=bad)
    assert isinstance(info.value.__cause__, PlanError)
    assert cache.resident_plans == [plan_key(S.PLANS[0], 2)]
    cache.check_invariants()


def test_plans_must_have_the_specs_columns(ckpt: Path) -> None:
    cache = _cache(ckpt)
    with pytest.raises(PlanError, match=r"shape \(rows, 2\)"):
        cache.build([torch.tensor([0.5])], embed=S.embed)
    with pytest.raises(PlanError, match=r"shape \(rows, 2\)"):
        cache.build([torch.zeros(1, 3)], embed=S.embed)
    with pytest.raises(PlanError, match=r"at least one row"):
        cache.build([torch.zeros(0, 2)], embed=S.embed)
    with pytest.raises(PlanError, match=r"3 rows but the slab holds at most 2.*--plan-width"):
        _cache(ckpt, max_plan_width=2).build([S.PLANS[2]], embed=S.embed)
    assert len(cache) == 0


def test_batched_projections_stack_by_the_inputs_real_rows(ckpt: Path) -> None:
    """Stacked GEMMs group plans by their input's own M (input b has fewer rows than the plan)."""
    weights = S.load_reference(ckpt)
    plans = [S.plan((0.1 * i, 1.0), (0.1 * i + 0.05, 2.0)) for i in range(1, 5)] + [S.plan((0.7, 1.5))]
    cache = _cache(ckpt, max_plans=len(plans), batched=True)
    clear_verdicts()
    report = cache.build(plans, embed=S.embed)
    # Input a (2 layers): one group of the four 2-row plans; input b (3 layers): one group of all
    # five plans, whose b inputs all have 1 row. One (layer, group) projection each.
    assert report.stacked_layers + report.per_plan_layers == 2 + 3
    classes = {(cls[3], cls[4]) for cls in verdicts()}  # (M, plans stacked) of each probed class
    assert {(2, 4), (1, 5)} <= classes
    S.assert_exact(cache, weights, plans)


# -- tiers --------------------------------------------------------------------------------------


def test_the_host_tier_restores_exactly_without_a_pass(ckpt: Path) -> None:
    weights = S.load_reference(ckpt)
    cache = _cache(ckpt, max_plans=3, host_cache_bytes=1 << 20)
    cache.build(S.PLANS, embed=S.embed)
    other = [S.plan((0.33, 2.0), (0.31, 2.0)), S.plan((0.15, 0.0)), S.plan((0.11, 5.0))]
    cache.build(other, embed=S.embed)  # evicts the first request from the slab
    assert all(p not in cache for p in S.PLANS[:3])
    report = cache.build(S.PLANS, embed=S.embed)
    assert report.host_hits == 3 and report.passes == 0
    S.assert_exact(cache, weights, S.PLANS[:3])
    cache.check_invariants()


def test_the_store_restores_exactly_in_another_cache(ckpt: Path, tmp_path: Path) -> None:
    weights = S.load_reference(ckpt)
    store = tmp_path / "store"
    first = _cache(ckpt, store=str(store))
    first.build(S.PLANS, embed=S.embed)
    entries = [item for item in Store(store).iter_entries() if not isinstance(item, tuple)]
    assert len(entries) == 3 and all(entry.header["parts"] == ["table"] for entry in entries)
    bindings = Store(store).bindings()
    assert [b["spec"]["family"] for b in bindings.values()] == ["synthetic"]
    second = _cache(ckpt, store=str(store))
    report = second.build(S.PLANS, embed=S.embed)
    assert report.store_hits == 3 and report.passes == 0
    S.assert_exact(second, weights, S.PLANS[:3])


def test_a_bound_table_file_serves_exactly_without_weights(ckpt: Path, tmp_path: Path) -> None:
    weights = S.load_reference(ckpt)
    out = tmp_path / "tables.safetensors"
    plans = S.PLANS[:3]
    with pytest.raises(ConfigError, match="--format sglang cannot hold Synthetic tables"):
        export_tables(_cache(ckpt), plans, tmp_path / "x.safetensors", embed=S.embed, format="sglang")
    with pytest.raises(ConfigError, match="--model-variant does not apply"):
        export_tables(_cache(ckpt), plans, tmp_path / "x.safetensors", embed=S.embed, model_variant="fl2va")
    report = export_tables(_cache(ckpt), plans, out, embed=S.embed, progress=False)
    assert report.plans == 3 and report.width == 3 and is_table_file(out)
    table = TableFile(out)  # the geometry comes from the file alone
    assert table.spec.describe() == S.SPEC.describe() and table.spec.model_geometry.layers == S.LAYERS
    assert table.describe()["family"] == "synthetic"
    layers = json.loads(table.metadata["adalncache.layers"])
    assert layers == [[layer, S.SPEC.offset(layer), S.SPEC.out_features(layer)] for layer in S.SPEC.layers()]
    assert verify_tables(TableFile(out, S.SPEC), CheckpointSource(ckpt, S.SPEC), embed=S.embed, progress=False).ok
    served = AdalnCache(S.SPEC, None, max_plans=4, tables=str(out))
    built = served.build(S.PLANS, embed=S.embed)
    assert built.table_hits == 3 and built.passes == 0
    S.assert_exact(served, weights, plans)


def test_a_bound_table_file_is_not_served_once_the_checkpoint_is_replaced(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "tables.safetensors"
    export_tables(_cache(ckpt), S.PLANS[:3], out, embed=S.embed, progress=False)
    cache = AdalnCache(S.SPEC, CheckpointSource(ckpt, S.SPEC), max_plans=4, tables=str(out))
    assert cache.build(S.PLANS, embed=S.embed).table_hits == 3
    os.replace(S.write_checkpoint(tmp_path / "other", seed=1), ckpt)
    cache.invalidate()
    report = cache.build(S.PLANS, embed=S.embed)
    assert report.table_hits == 0 and report.built == 3
    S.assert_exact(cache, S.load_reference(ckpt), S.PLANS[:3])


def test_an_unbound_table_file_of_this_family_is_refused(ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    bare = tmp_path / "bare.safetensors"
    cache = _cache(ckpt)
    cache.build(S.PLANS[:1], embed=S.embed)
    save_file(
        {
            "plan_timesteps": cache.plan_timesteps[:1].clone(),
            "plan_lengths": cache.plan_lengths[:1].clone(),
            TABLE_ROWS: cache.table[:1].clone(),
        },
        str(bare),
        metadata={"format_version": "2"},
    )
    with pytest.raises(ConfigError, match=r"carries no binding.*--format adalncache"):
        AdalnCache(S.SPEC, None, tables=str(bare))


def test_a_tensor_source_serves_the_same_tables(ckpt: Path) -> None:
    weights = S.load_reference(ckpt)
    cache = AdalnCache(S.SPEC, TensorSource(weights, S.SPEC), max_plans=4)
    cache.build(S.PLANS, embed=S.embed)
    S.assert_exact(cache, weights, S.PLANS[:3])


# -- a gloo group of two ranks ----------------------------------------------------------------------


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_two_ranks_build_the_single_process_tables(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ctx = mp.start_processes(
        SW.entry,
        args=(2, str(tmp_path / "rendezvous"), str(ckpt), str(out)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("the 2-rank group did not finish within 180 s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    weights = S.load_reference(ckpt)
    alone = _cache(ckpt)
    alone.build(S.PLANS, embed=S.embed)
    for shard in SW.SHARDS:
        for rank in range(2):
            got = torch.load(out / f"{shard}-{rank}.pt", weights_only=False)
            assert got["ok"], got.get("traceback")
            assert got["slots"] == {plan_key(p, 2): alone.slot_of(plan_key(p, 2)) for p in S.PLANS[:3]}
            assert torch.equal(got["table"], alone.table), f"{shard}, rank {rank}: tables differ"
            assert torch.equal(got["plans"], alone.plan_timesteps)
    S.assert_exact(alone, weights, S.PLANS[:3])
