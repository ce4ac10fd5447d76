"""Content identity: the store binds entries to the bytes of the projections, not to one file's stat identity.

Real checkpoints on disk, real stores, real copies (new inode, new mtime): a copied checkpoint or a
copied store hits after at most one hashing read; the digest memo makes later processes hash
nothing; edited bytes (even with the mtime put back) never hit old entries.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from adalncache import (
    AdalnCache,
    BuildError,
    CheckpointError,
    CheckpointSource,
    ConfigError,
    Store,
    TensorSource,
    plan_key,
)
from adalncache.identity import LEAVES, DigestSink, leaf_bounds
from adalncache.identity.binding import CheckedRead, content_digest, forget_process_memo
from adalncache.source import Columns
from adalncache.source.files import write_safetensors
from adalncache.spec import FINAL, LAYOUTS
from adalncache.tiers.store import binding_hash
from core_helpers import DirtyMapping, make_weights, stat_identity, write_checkpoint
from tiers_support import plan, projection_dict, simple_embed, small_spec

TESTS = Path(__file__).resolve().parent
PLANS = [plan(0.9, 0.8), plan(0.5), plan(0.3, 0.2, 0.1)]
#: Rows divisible by 8 (columns of 1, 2, 4, 8 ranks) and 144 rows for blocks (hidden 8): leaves of 2-3 rows.
SPEC = small_spec(hidden=8, layers=2, k=16)


@pytest.fixture(autouse=True)
def _fresh_process_memo() -> None:
    """Each test starts as a fresh process would: nothing hashed yet."""
    forget_process_memo()


def _ckpt(directory: Path, seed: int = 0, layout: str = "native", name: str = "model.safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_safetensors(projection_dict(SPEC, seed, layout), directory / name)


def _cache(ckpt: Path | list[Path], store: Path | Store | None = None, **kw: object) -> AdalnCache:
    return AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=4, max_plan_width=4, store=store, **kw)


def _digest_by_reading(source: CheckpointSource, world: int, mode: str) -> str | None:
    """The content digest as ``world`` ranks would compose it from the shares they read."""
    sinks = []
    for rank in range(world):
        sink = DigestSink()
        if mode == "columns":
            list(source.stream(SPEC.layers(), columns=Columns(rank, world), digests=sink))
        else:
            mine = SPEC.layers()[rank::world]
            list(source.stream(mine, digests=sink))
        sinks.append(sink)
    from adalncache.identity import merge_knowledge

    merged = merge_knowledge([s.knowledge() for s in sinks])
    assert merged is not None
    return content_digest(SPEC, merged)


def test_digest_composes_over_layer_and_column_splits_and_layouts(tmp_path: Path) -> None:
    source = CheckpointSource(_ckpt(tmp_path / "a"), SPEC)
    whole = _digest_by_reading(source, 1, "layers")
    assert whole is not None and whole.startswith("blake3:")
    for world in (2, 3):
        assert _digest_by_reading(source, world, "layers") == whole
    for world in (2, 4, 8):
        assert _digest_by_reading(source, world, "columns") == whole
    # 3 column ranks cut leaves (3 does not divide 64): unknown, never a guess.
    assert _digest_by_reading(source, 3, "columns") is None
    # The same weights in the diffusers layout, sharded with an index: the same digest.
    other = write_checkpoint(tmp_path / "d", projection_dict(SPEC, 0, "diffusers"), shards=2)
    assert _digest_by_reading(CheckpointSource(other, SPEC), 1, "layers") == whole
    # The same weights in memory (a model's own tensors): the same digest.
    sink = DigestSink()
    list(TensorSource(projection_dict(SPEC, 0), SPEC).stream(SPEC.layers(), digests=sink))
    assert content_digest(SPEC, sink.knowledge()) == whole


def test_one_flipped_bit_or_another_dtype_or_shape_changes_the_digest(tmp_path: Path) -> None:
    base = projection_dict(SPEC, 0)
    whole = _digest_by_reading(CheckpointSource(_ckpt(tmp_path / "a"), SPEC), 1, "layers")
    flipped = dict(base)
    w = flipped["blocks.1.adaln_proj.linear.weight"].clone()
    w.view(torch.int16)[7, 3] ^= 1
    flipped["blocks.1.adaln_proj.linear.weight"] = w
    path = write_safetensors(flipped, tmp_path / "b.safetensors")
    assert _digest_by_reading(CheckpointSource(path, SPEC), 1, "layers") not in (None, whole)
    fp16 = SPEC.with_dtype(torch.float16)
    sink = DigestSink()
    list(TensorSource(projection_dict(fp16, 0), fp16).stream(fp16.layers(), digests=sink))
    assert content_digest(fp16, sink.knowledge()) not in (None, whole)
    wider = small_spec(hidden=8, layers=2, k=32)
    sink = DigestSink()
    list(TensorSource(projection_dict(wider, 0), wider).stream(wider.layers(), digests=sink))
    assert content_digest(wider, sink.knowledge()) not in (None, whole)


def test_leaf_bounds_tile_the_rows_at_the_released_widths() -> None:
    for rows in (96768, 10752, 144, 16):
        bounds = leaf_bounds(rows)
        assert len(bounds) == LEAVES and bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    # Released widths: every leaf boundary is a column-rank boundary for 1, 2, 4 and 8 ranks.
    for rows in (96768, 10752):
        starts = {lo for lo, _ in leaf_bounds(rows)}
        assert all({r * rows // w for r in range(w)} <= starts for w in (1, 2, 4, 8))


def test_copied_checkpoint_hits_after_one_hashing_read(tmp_path: Path) -> None:
    ckpt, store = _ckpt(tmp_path / "orig"), tmp_path / "store"
    first = _cache(ckpt, store)
    embed = simple_embed(SPEC)
    report = first.build(PLANS, embed=embed)
    assert report.passes == 1 and report.built == 3
    assert report.hashed_bytes == SPEC.projection_bytes  # hashed while streaming, no second read
    assert first.stats.hash_reads == 0 and first.content_digest is not None
    # Another disk: a copy has a new inode and mtime (and lives in another directory).
    copy = tmp_path / "copy" / "model.safetensors"
    copy.parent.mkdir()
    shutil.copyfile(ckpt, copy)
    forget_process_memo()
    second = _cache(copy, store)
    report = second.build(PLANS, embed=embed)
    assert (report.store_hits, report.passes, report.built) == (3, 0, 0)
    assert second.stats.hash_reads == 1 and report.bytes_read == SPEC.projection_bytes
    assert second.content_digest == first.content_digest
    for p in PLANS:
        assert torch.equal(second.rows_of(plan_key(p)).block, first.rows_of(plan_key(p)).block)
    # The copy's digest is now in the memo: a third cache on it reads nothing at all.
    forget_process_memo()
    third = _cache(copy, store)
    report = third.build(PLANS, embed=embed)
    assert report.store_hits == 3 and report.bytes_read == 0 and third.stats.hash_reads == 0


def test_copied_store_next_to_a_copied_checkpoint_hits(tmp_path: Path) -> None:
    ckpt, store = _ckpt(tmp_path / "host-a"), tmp_path / "host-a" / "store"
    embed = simple_embed(SPEC)
    _cache(ckpt, store).build(PLANS, embed=embed)
    other = tmp_path / "host-b"
    shutil.copytree(tmp_path / "host-a", other)  # checkpoint and store, as rsync to another host would
    forget_process_memo()
    cache = _cache(other / "model.safetensors", other / "store")
    report = cache.build(PLANS, embed=embed)
    assert (report.store_hits, report.passes) == (3, 0) and cache.stats.hash_reads == 1


def test_memo_hit_in_a_new_process_reads_nothing(tmp_path: Path) -> None:
    ckpt, store = _ckpt(tmp_path / "m"), tmp_path / "store"
    first = _cache(ckpt, store)
    first.build(PLANS, embed=simple_embed(SPEC))
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(TESTS)!r})
        from tiers_support import plan, simple_embed, small_spec
        from adalncache import AdalnCache, CheckpointSource
        spec = small_spec(hidden=8, layers=2, k=16)
        source = CheckpointSource({str(ckpt)!r}, spec)
        cache = AdalnCache(spec, source, max_plans=4, max_plan_width=4, store={str(store)!r})
        report = cache.build([plan(0.9, 0.8), plan(0.5), plan(0.3, 0.2, 0.1)], embed=simple_embed(spec))
        out = {{"report": report.as_dict(), "digest": cache.content_digest, "stats": cache.stats.as_dict()}}
        print(json.dumps(out))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["report"]["store_hits"] == 3 and child["report"]["bytes_read"] == 0
    assert child["stats"]["hash_reads"] == 0 and child["digest"] == first.content_digest


def test_edited_bytes_with_the_mtime_put_back_never_hit_old_entries(tmp_path: Path) -> None:
    ckpt, store = _ckpt(tmp_path / "e"), tmp_path / "store"
    embed = simple_embed(SPEC)
    first = _cache(ckpt, store)
    first.build(PLANS, embed=embed)
    before = os.stat(ckpt)
    edited = projection_dict(SPEC, 0)
    edited["final_layer.adaln_proj.linear.bias"] = edited["final_layer.adaln_proj.linear.bias"] + 1
    write_safetensors(edited, tmp_path / "e" / "tmp.safetensors")
    with open(tmp_path / "e" / "tmp.safetensors", "rb") as src, open(ckpt, "r+b") as dst:
        dst.write(src.read())  # same inode, same size: only the bytes differ
    os.utime(ckpt, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back; ctime cannot be
    assert os.stat(ckpt).st_mtime_ns == before.st_mtime_ns and os.stat(ckpt).st_ino == before.st_ino
    cache = _cache(ckpt, store)
    report = cache.build(PLANS, embed=embed)
    assert report.store_hits == 0 and report.passes == 1  # the old entries were not served
    assert cache.content_digest not in (None, first.content_digest)
    # ... and the rebuilt rows are the edited model's (final layer shifted), the old ones untouched.
    key = plan_key(PLANS[0])
    assert not torch.equal(cache.rows_of(key).final, first.rows_of(key).final)
    bindings = {b["content"] for b in Store(store).bindings().values()}
    assert bindings == {first.content_digest, cache.content_digest}


def test_unknown_digest_is_a_miss_and_old_format_bindings_never_hit(tmp_path: Path) -> None:
    ckpt, store_dir = _ckpt(tmp_path / "u"), tmp_path / "store"
    embed = simple_embed(SPEC)
    # A format-1 store: entries bound to the file's stat fingerprint, as the previous version wrote them.
    store = Store(store_dir)
    old = {"fingerprint": CheckpointSource(ckpt, SPEC).fingerprint, "spec": SPEC.describe(), "precision": "match"}
    rows = AdalnCache(SPEC, TensorSource(projection_dict(SPEC, 0), SPEC), max_plans=4, max_plan_width=4)
    rows.build(PLANS, embed=embed)
    for p in PLANS:
        store.put(old, plan_key(p), rows.rows_of(plan_key(p)))
    cache = _cache(ckpt, store_dir)
    assert cache.binding() is None and cache.content_digest is None  # nothing hashed yet: no binding
    report = cache.build(PLANS, embed=embed)
    assert report.store_hits == 0 and report.passes == 1 and cache.stats.store_unbound == 1
    assert cache.binding() is not None and cache.binding()["content"] == cache.content_digest
    assert binding_hash(old) not in {binding_hash(cache.binding())}


def test_identify_and_a_sharded_checkpoint_record_per_file(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "s", make_weights(SPEC, seed=3), shards=3)
    store = tmp_path / "store"
    cache = _cache(directory, store)
    digest = cache.identify()
    assert digest is not None and cache.stats.hash_reads == 1
    records = Store(store).memo.records()
    assert len(records) == 3  # one record per file: a re-saved shard re-hashes only itself
    forget_process_memo()
    again = _cache(directory, store)
    assert again.identify(read=False) == digest and again.stats.hash_reads == 0


def test_fp32_content_at_other_offsets_is_another_binding(tmp_path: Path) -> None:
    """fp32 weights re-saved at other offsets: the same content digest, but a one-row GEMV on a CPU can
    give other bits at another address modulo 16, so the store keeps their entries apart."""
    spec = small_spec(torch.float32, hidden=8, layers=2, k=16)
    weights = projection_dict(spec, 0)
    a = write_safetensors(weights, tmp_path / "a.safetensors")
    b = write_safetensors(weights, tmp_path / "b.safetensors", residues=dict.fromkeys(weights, 4))
    store = tmp_path / "store"
    embed = simple_embed(spec)
    first = AdalnCache(spec, CheckpointSource(a, spec), max_plans=4, max_plan_width=4, store=store)
    first.build(PLANS, embed=embed)
    second = AdalnCache(spec, CheckpointSource(b, spec), max_plans=4, max_plan_width=4, store=store)
    report = second.build(PLANS, embed=embed)
    assert second.content_digest == first.content_digest
    assert report.store_hits == 0 and report.passes == 1
    assert first.binding()["alignment"] != second.binding()["alignment"]


def test_inspect_shows_both_identities(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from adalncache.cli import main

    ckpt, store = _ckpt(tmp_path / "i"), tmp_path / "store"
    Store(store)
    assert main(["inspect", str(ckpt), "--store", str(store)]) == 0
    shown = capsys.readouterr().out
    assert "file identity" in shown and "content digest  not known yet" in shown
    assert main(["inspect", str(ckpt), "--store", str(store), "--hash", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    digest = _cache(ckpt).identify()
    assert info["content"] == digest and "hashed now" in info["content_from"] and info["fingerprint"]
    forget_process_memo()
    assert main(["inspect", str(ckpt), "--store", str(store)]) == 0
    shown = capsys.readouterr().out
    assert f"content digest  {digest}" in shown and "from the digest memo" in shown


def _rows_of(weights: dict[str, torch.Tensor], p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent projection of ``p`` from ``weights`` (native names): every block, then the final layer."""
    lay, x = LAYOUTS["native"], simple_embed(SPEC)(p)
    blocks = [F.linear(x, weights[lay.weight(i)], weights[lay.bias(i)]) for i in range(SPEC.num_layers)]
    return torch.stack(blocks, dim=1), F.linear(x, weights[lay.weight(FINAL)], weights[lay.bias(FINAL)])


def test_an_in_place_rewrite_that_keeps_the_mtime_never_poisons_a_shared_store(tmp_path: Path) -> None:
    """A trainer saves other weights over the checkpoint in place (same inode, size and header) and the
    mtime is put back (``os.utime``): the serving process notices (the change time moved), hashes the
    new bytes and writes its entries under their digest, so another process whose checkpoint is an
    untouched copy of the old weights still gets the old weights' rows from the shared store."""
    ckpt, store = _ckpt(tmp_path / "w"), tmp_path / "store"
    old, new = projection_dict(SPEC, 0), projection_dict(SPEC, 5)
    untouched = tmp_path / "copy" / "model.safetensors"
    untouched.parent.mkdir()
    shutil.copy2(ckpt, untouched)
    embed = simple_embed(SPEC)
    writer = _cache(ckpt, store)
    writer.build(PLANS[:1], embed=embed)
    old_digest = writer.content_digest
    before = os.stat(ckpt)
    scratch = write_safetensors(new, tmp_path / "w" / "scratch.safetensors")
    data = scratch.read_bytes()
    assert len(data) == before.st_size and data[:64] == ckpt.read_bytes()[:64]  # same size, same header
    with open(ckpt, "r+b") as handle:
        handle.write(data)
    os.utime(ckpt, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(ckpt).st_mtime_ns == before.st_mtime_ns and os.stat(ckpt).st_ino == before.st_ino
    report = writer.build(PLANS, embed=embed)
    assert writer.stats.fingerprint_changes == 1 and report.built == len(PLANS)
    assert writer.content_digest not in (None, old_digest)
    for p in PLANS:
        block, final = _rows_of(new, p)
        assert torch.equal(writer.rows_of(plan_key(p)).block, block) and torch.equal(
            writer.rows_of(plan_key(p)).final, final
        )
    forget_process_memo()  # another process, whose checkpoint is an untouched copy of the old weights
    reader = _cache(untouched, store)
    reader.build(PLANS, embed=embed)
    assert reader.content_digest == old_digest
    for p in PLANS:
        block, final = _rows_of(old, p)
        rows = reader.rows_of(plan_key(p))
        assert torch.equal(rows.block, block) and torch.equal(rows.final, final), "the shared store was poisoned"


def test_passes_hash_only_where_something_is_bound_to_the_digest(tmp_path: Path) -> None:
    """No store and no table files: a pass reads and projects, no byte hashed, the digest unknown (a
    later identify() reads for it). A store, or hash_passes=True: every pass hashes what it reads."""
    ckpt = _ckpt(tmp_path / "ckpt")
    plans = [plan(0.5), plan(0.25)]
    bare = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=4, max_plan_width=1)
    assert bare.hash_passes is False
    bare.build(plans[:1], embed=simple_embed(SPEC))
    assert bare.stats.hashed_bytes == 0 and bare.content_digest is None and bare.binding() is None
    bare.hash_passes = True
    bare.build(plans[1:], embed=simple_embed(SPEC))
    assert bare.stats.hashed_bytes == SPEC.projection_bytes and bare.content_digest is not None
    forget_process_memo()
    asked = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=4, max_plan_width=1)
    assert asked.identify() == bare.content_digest  # a hashing-only read when asked, passes hashing or not
    assert asked.stats.hash_reads == 1 and asked.stats.hashed_bytes == SPEC.projection_bytes
    stored = _cache(ckpt, tmp_path / "store")
    assert stored.hash_passes is True
    stored.build(plans[:1], embed=simple_embed(SPEC))
    assert stored.stats.hashed_bytes == SPEC.projection_bytes
    assert stored.content_digest == bare.content_digest  # the same bytes, the same digest
    with pytest.raises(ConfigError, match="hash_passes takes True or False"):
        bare.hash_passes = "yes"  # type: ignore[assignment]  # the wrong type is the point


# ---------------------------------------------------------------------------------------------
# a rewrite the stat cannot see: a write through a shared mapping to a page already dirty


def _new_bytes(directory: Path, seed: int = 5) -> bytes:
    """Another model's checkpoint bytes with this one's header (same names, shapes, dtypes, offsets)."""
    return write_safetensors(projection_dict(SPEC, seed), directory / "other.safetensors").read_bytes()


def test_a_write_to_a_dirty_shared_page_moves_no_stat_and_the_next_hashing_pass_refuses_it(tmp_path: Path) -> None:
    """Written through a shared mapping whose pages are already dirty, the checkpoint's bytes change and its
    device, inode, size, mtime and ctime do not (ext4). A pass that hashes (a store is bound to the
    digest) finds other bytes than the digest held for that identity: the build fails at the checkpoint
    with a CheckpointError that says what happened and what to do, nothing of it is published (the old
    tables are dropped, the store gets no entry of the new bytes under the old digest), and the retry
    hashes the new bytes and builds from them."""
    ckpt, store = _ckpt(tmp_path / "d"), tmp_path / "store"
    old, new = projection_dict(SPEC, 0), projection_dict(SPEC, 5)
    data, embed = _new_bytes(tmp_path / "d"), simple_embed(SPEC)
    mapping = DirtyMapping(ckpt)  # its first write of each page moved mtime and ctime, as any write does
    try:
        cache = _cache(ckpt, store)
        cache.build(PLANS[:1], embed=embed)  # learns the digest under the identity after that write
        held = cache.content_digest
        before = stat_identity(ckpt)
        assert mapping.write(data), "writeback cleaned the pages in between (a sync elsewhere): rerun"
        assert stat_identity(ckpt) == before and Path(ckpt).read_bytes() == data
        with pytest.raises(BuildError) as caught:
            cache.build(PLANS[1:], embed=embed)
        assert caught.value.failed_at == "checkpoint"
        cause = caught.value.__cause__
        assert isinstance(cause, CheckpointError), cause
        text = str(cause)
        assert "rewritten without its stat identity changing" in text and str(ckpt) in text and held in text
        assert "shared memory mapping to a page already dirty" in text and "adalncache verify --store" in text
        assert cache.resident_plans == [] and cache.content_digest is None  # nothing published, old tables dropped
        assert {b["content"] for b in Store(store).bindings().values()} == {held} and len(Store(store).entries()) == 1
        report = cache.build(PLANS, embed=embed)  # the retry reads the new bytes anew
        assert (report.built, report.store_hits, report.passes) == (3, 0, 1) and cache.stats.hash_reads == 1
        assert cache.content_digest not in (None, held)
        for p in PLANS:
            block, final = _rows_of(new, p)
            rows = cache.rows_of(plan_key(p))
            assert torch.equal(rows.block, block) and torch.equal(rows.final, final)
            assert not torch.equal(rows.final, _rows_of(old, p)[1])
    finally:
        mapping.close()


def test_without_a_store_hash_passes_refuses_an_unseen_rewrite_and_no_hashing_mixes_old_and_new(
    tmp_path: Path,
) -> None:
    """No store: with ``hash_passes`` on, the next pass after the unseen rewrite fails as above; with it off
    (the default) nothing is bound to the digest, so the pass projects the new bytes beside the resident
    plans of the old ones (docs/tables.md says so; the check is the ``stat`` identity, which did not move)."""
    old, new = projection_dict(SPEC, 0), projection_dict(SPEC, 5)
    embed = simple_embed(SPEC)
    for hashing in (True, False):
        ckpt = _ckpt(tmp_path / str(hashing))
        data = _new_bytes(tmp_path / str(hashing))
        mapping = DirtyMapping(ckpt)
        try:
            cache = _cache(ckpt)
            cache.hash_passes = hashing
            cache.build(PLANS[:1], embed=embed)
            assert mapping.write(data), "writeback cleaned the pages in between (a sync elsewhere): rerun"
            if hashing:
                with pytest.raises(BuildError, match="rewritten without its stat identity changing"):
                    cache.build(PLANS[1:], embed=embed)
                assert cache.resident_plans == []
                continue
            cache.build(PLANS[1:], embed=embed)
            assert torch.equal(cache.rows_of(plan_key(PLANS[0])).final, _rows_of(old, PLANS[0])[1])
            assert torch.equal(cache.rows_of(plan_key(PLANS[1])).final, _rows_of(new, PLANS[1])[1])
        finally:
            mapping.close()


def test_memoed_store_hits_serve_an_unseen_rewrite_unless_the_source_rehashes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh process over the rewritten file takes the old digest from the store's memo (the identity is
    unchanged) and serves the old entries without reading (``passes=0``): what a ``stat`` cannot see.
    ``CheckpointSource(rehash=True)`` distrusts the memo: the first use hashes the file, says the memo
    held other bytes, replaces the record, and builds from the new bytes; after it, a plain process
    hits the new entries."""
    ckpt, store = _ckpt(tmp_path / "r"), tmp_path / "store"
    old, new = projection_dict(SPEC, 0), projection_dict(SPEC, 5)
    data, embed = _new_bytes(tmp_path / "r"), simple_embed(SPEC)
    mapping = DirtyMapping(ckpt)
    try:
        writer = _cache(ckpt, store)
        writer.build(PLANS, embed=embed)
        held = writer.content_digest
        assert mapping.write(data), "writeback cleaned the pages in between (a sync elsewhere): rerun"
    finally:
        mapping.close()
    forget_process_memo()
    stale = _cache(ckpt, store)
    report = stale.build(PLANS, embed=embed)
    assert (report.passes, report.store_hits, report.bytes_read) == (0, 3, 0) and stale.content_digest == held
    assert torch.equal(stale.rows_of(plan_key(PLANS[0])).final, _rows_of(old, PLANS[0])[1])
    forget_process_memo()
    rehashing = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC, rehash=True), max_plans=4, max_plan_width=4, store=store)
    with caplog.at_level("WARNING", logger="adalncache"):
        report = rehashing.build(PLANS, embed=embed)
    assert (report.store_hits, report.built, report.passes) == (0, 3, 1) and rehashing.stats.hash_reads == 1
    assert rehashing.content_digest not in (None, held)
    assert "rewritten without their stat changing" in caplog.text
    for p in PLANS:
        assert torch.equal(rehashing.rows_of(plan_key(p)).final, _rows_of(new, p)[1])
    forget_process_memo()
    plain = _cache(ckpt, store)
    report = plain.build(PLANS, embed=embed)
    assert (report.store_hits, report.passes) == (3, 0) and plain.content_digest == rehashing.content_digest
    with pytest.raises(ConfigError, match="rehash must be True or False"):
        CheckpointSource(ckpt, SPEC, rehash="yes")  # type: ignore[arg-type]  # the wrong type is the point


def test_a_checked_read_refuses_bytes_rewritten_unseen(tmp_path: Path) -> None:
    """What restoring weights from the checkpoint calls: every layer is streamed and hashed, and after the
    last one the bytes must hash to the digest held, else a CheckpointError (before the caller has used
    anything). Without a digest held it learns one; a partial read cannot be checked."""
    ckpt = _ckpt(tmp_path / "c")
    data = _new_bytes(tmp_path / "c")
    mapping = DirtyMapping(ckpt)
    try:
        source = CheckpointSource(ckpt, SPEC)
        learnt = CheckedRead(source)
        assert len(list(learnt.layers())) == len(SPEC.layers())
        cache = _cache(ckpt)
        assert learnt.digest is not None and learnt.digest == cache.identify()
        assert len(list(CheckedRead(source, cache.content_digest).layers())) == len(SPEC.layers())  # unchanged: fine
        assert mapping.write(data), "writeback cleaned the pages in between (a sync elsewhere): rerun"
        check = CheckedRead(source, learnt.digest)
        seen = []
        with pytest.raises(CheckpointError, match="rewritten without its stat identity changing") as caught:
            for weights in check.layers():
                seen.append(weights.layer)
        assert seen == SPEC.layers() and "restore the checkpoint" in str(caught.value)
        assert check.digest not in (None, learnt.digest)
        with pytest.raises(ValueError, match="every layer"):
            list(CheckedRead(source, learnt.digest).layers([0]))
    finally:
        mapping.close()


def test_verify_store_exits_1_naming_the_entries_of_a_checkpoint_rewritten_unseen(
    load_tiny: Callable[[str], Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``adalncache verify --store`` recomputes the entries from the bytes on disk now: after a rewrite no
    ``stat`` saw (a projection weight doubled through a dirty shared mapping), it exits 1 and names them."""
    pytest.importorskip("diffusers")
    from adalncache.cli import main
    from adalncache.source.files import SafetensorsHeader
    from tiers_support import write_h3_checkpoint

    ckpt, store = write_h3_checkpoint(load_tiny("bf16-disk"), tmp_path / "ckpt", shards=1), tmp_path / "store"
    build = ["build", str(ckpt), "--store", str(store), "--task", "t2va", "--steps", "3", "-q"]
    verify = ["verify", "--store", str(store), "--checkpoint", str(ckpt), "-q"]
    assert main(build) == 0
    [file] = sorted(Path(ckpt).glob("*.safetensors"))
    name = next(n for n in SafetensorsHeader.read(file).entries if n.endswith("adaln_proj.linear.weight"))
    entry = SafetensorsHeader.read(file).entries[name]
    mapping = DirtyMapping(file)
    try:
        forget_process_memo()
        assert main(build) == 0  # a new process learns the digest under the identity after that first write
        assert main(verify) == 0
        doubled = torch.frombuffer(bytearray(mapping.map[entry.begin : entry.end]), dtype=torch.bfloat16) * 2
        assert mapping.write(doubled.view(torch.uint8).numpy().tobytes(), entry.begin), "writeback intervened: rerun"
    finally:
        mapping.close()
    forget_process_memo()
    capsys.readouterr()
    assert main(verify) == 1
    shown = capsys.readouterr().out
    assert "FAILED" in shown and all(e.path.name in shown for e in Store(store).entries())
    assert shown.count("MISMATCH") == len(Store(store).entries())
