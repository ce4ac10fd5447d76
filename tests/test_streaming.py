"""CheckpointSource.stream reuses its staging buffers without ever overwriting a live tensor.

The pass reads layer k+1 into the buffer of layer k-1 while layer k is projected. These tests pin
the two properties that make that safe and exact: a consumer that keeps layers (a list, a dict)
still sees every layer's own bytes, and every buffer keeps the file offset's address modulo 64.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from adalncache import CheckpointSource, ModulationSpec
from adalncache.errors import CheckpointError, ConfigError
from adalncache.identity import DigestSink
from adalncache.source import reads as reads_module
from adalncache.source.files import write_safetensors
from adalncache.source.reads import StagingPool
from adalncache.spec import FINAL, get_layout


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[CheckpointSource, dict[str, torch.Tensor]]:
    spec = ModulationSpec(num_layers=5, hidden_size=8, time_embed_dim=16)
    layout = get_layout("native")
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in spec.layers():
        out = spec.out_features(layer)
        tensors[layout.weight(layer)] = torch.randn(out, 16, generator=gen).to(torch.bfloat16)
        tensors[layout.bias(layer)] = torch.randn(out, generator=gen).to(torch.bfloat16)
    # Odd residues modulo 64, so a buffer that lost its alignment would show.
    residues = {name: 2 * n + 2 for n, name in enumerate(tensors)}
    path = write_safetensors(tensors, tmp_path / "m.safetensors", residues=residues)
    # Staged: these tests are about the staging buffers (a file just written is in the page cache,
    # which the default would project from in place).
    return CheckpointSource(path, spec, in_place=False), tensors


def _expect(source: CheckpointSource, tensors: dict[str, torch.Tensor], lw: object) -> None:
    layer, weight, bias = lw
    assert torch.equal(weight, tensors[source.layout.weight(layer)])
    assert torch.equal(bias, tensors[source.layout.bias(layer)])
    for name, t in ((source.layout.weight(layer), weight), (source.layout.bias(layer), bias)):
        _, entry = source.entry(name)
        # Modulo 4096: the resident model's mapped views (and O_DIRECT) align to the page.
        assert t.data_ptr() % 4096 == entry.begin % 4096


@pytest.mark.parametrize("read_ahead", [0, 1, 2, 3])
def test_streamed_layers_are_exact_and_aligned(checkpoint, read_ahead: int) -> None:
    source, tensors = checkpoint
    seen = []
    for lw in source.stream(source.spec.layers(), read_ahead=read_ahead):
        _expect(source, tensors, lw)
        seen.append(lw.layer)
    assert seen == source.spec.layers()
    assert source.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("read_ahead", [0, 1, 2])
def test_kept_layers_are_never_overwritten(checkpoint, read_ahead: int) -> None:
    source, tensors = checkpoint
    kept = list(source.stream(source.spec.layers(), read_ahead=read_ahead))
    for lw in kept:
        _expect(source, tensors, lw)
    # A derived view keeps the storage alive too (no weakref to the yielded tensor would see it).
    views = {lw.layer: lw.weight.t() for lw in source.stream(source.spec.layers(), read_ahead=read_ahead)}
    for layer, view in views.items():
        assert torch.equal(view.t(), tensors[source.layout.weight(layer)])
    assert FINAL in views


def test_buffers_are_reused_by_a_well_behaved_consumer(checkpoint, monkeypatch) -> None:
    source, tensors = checkpoint
    fresh: list[int] = []
    clear = StagingPool.clear

    def record(self: StagingPool) -> None:
        fresh.append(self.fresh)
        clear(self)

    monkeypatch.setattr(StagingPool, "clear", record)
    source.keep_buffers = False  # each pass frees its pool at the end, which records its count
    for read_ahead in (1, 2):
        for lw in source.stream(source.spec.layers(), read_ahead=read_ahead):
            _expect(source, tensors, lw)
    # (read_ahead + 1) slots x (weight, bias), allocated once each, for six layers.
    assert fresh == [4, 6]


def test_keep_buffers_reuses_the_pool_across_passes(checkpoint) -> None:
    source, tensors = checkpoint
    assert source.keep_buffers  # the default: a serving process runs pass after pass
    for lw in source.stream(source.spec.layers(), read_ahead=1):
        _expect(source, tensors, lw)
    pool = source._kept
    assert pool is not None and pool.fresh == 4
    for lw in source.stream(source.spec.layers(), read_ahead=1):
        _expect(source, tensors, lw)
    assert source._kept is pool and pool.fresh == 4  # no new buffer in the second pass
    kept = list(source.stream(source.spec.layers(), read_ahead=1))  # a consumer keeping layers
    for lw in kept:
        _expect(source, tensors, lw)


def test_release_buffers_frees_the_kept_pool(checkpoint) -> None:
    source, tensors = checkpoint
    assert source.release_buffers() == 0  # nothing kept before the first pass
    for lw in source.stream(source.spec.layers(), read_ahead=1):
        _expect(source, tensors, lw)
    pool = source._kept
    assert pool is not None
    held = pool.nbytes
    assert source.kept_bytes == held
    widest = max(t.numel() * t.element_size() for t in tensors.values())
    assert widest < held <= 4 * (widest + 3 * 4096)  # (read_ahead + 1) slots x (weight, bias), plus slack
    assert source.release_buffers() == held and source._kept is None and source.kept_bytes == 0
    assert source.release_buffers() == 0
    for lw in source.stream(source.spec.layers(), read_ahead=1):  # the next pass allocates afresh
        _expect(source, tensors, lw)
    assert source._kept is not None and source._kept is not pool


def test_keep_buffers_off_frees_the_pool_after_each_pass(tmp_path: Path, checkpoint) -> None:
    source, tensors = checkpoint
    off = CheckpointSource(source.path, source.spec, keep_buffers=False, in_place=False)
    for lw in off.stream(off.spec.layers(), read_ahead=1):
        _expect(off, tensors, lw)
    assert off._kept is None and off.kept_bytes == 0 and off.release_buffers() == 0


def test_a_different_read_ahead_keeps_the_buffers_it_can_use(checkpoint) -> None:
    source, tensors = checkpoint
    for lw in source.stream(source.spec.layers(), read_ahead=2):
        _expect(source, tensors, lw)
    assert source._kept is not None and source._kept.fresh == 6
    for lw in source.stream(source.spec.layers(), read_ahead=1):  # two of the three slots reused
        _expect(source, tensors, lw)
    assert source._kept.fresh == 6 and source._kept.slots == 2
    for lw in source.stream(source.spec.layers(), read_ahead=2):  # the third slot allocated again
        _expect(source, tensors, lw)
    assert source._kept.fresh == 8


# -- in place: projecting from the pass's mapping of the file (CPU, bytes in the page cache) ----


def _in_place(source: CheckpointSource) -> CheckpointSource:
    return CheckpointSource(source.path, source.spec)  # the default: in place where the cache holds the bytes


@pytest.mark.parametrize("read_ahead", [0, 1, 2])
def test_in_place_layers_are_exact_aligned_and_copy_nothing(checkpoint, read_ahead: int) -> None:
    """A file just written is in the page cache: every tensor is a view of the mapping, at the file
    offset's address modulo 4096 (what from_pretrained's mapped views hold), hashed like a staged
    read, and no staging buffer is ever filled."""
    staged, tensors = checkpoint
    source = _in_place(staged)
    assert source.in_place
    sinks = []
    for src in (source, staged):
        sink = DigestSink()
        for lw in src.stream(src.spec.layers(), read_ahead=read_ahead, digests=sink):
            _expect(src, tensors, lw)
        sinks.append(sink.knowledge())
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert source.bytes_read == source.bytes_in_place == total
    assert staged.bytes_in_place == 0 and staged.bytes_read == total
    assert sinks[0] == sinks[1]  # hashed from the mapping: the same digests as the staged bytes
    pool = source._kept
    assert pool is None or pool.fresh == 0  # no buffer was allocated, let alone filled


def test_in_place_stages_what_the_page_cache_does_not_hold(checkpoint, monkeypatch) -> None:
    """A tensor the page cache does not hold wholly is staged (O_DIRECT for its cold bytes), the rest in place."""
    staged, tensors = checkpoint
    source = _in_place(staged)
    weight0 = source.entry(source.layout.weight(0))[1]
    real = reads_module.resident_fraction

    def cold_weight0(fd: int, offset: int, nbytes: int) -> float | None:
        return 0.0 if offset == weight0.begin else real(fd, offset, nbytes)

    monkeypatch.setattr(reads_module, "resident_fraction", cold_weight0)
    for lw in source.stream(source.spec.layers(), read_ahead=1):
        _expect(source, tensors, lw)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert source.bytes_read == total and source.bytes_in_place == total - weight0.nbytes


def test_in_place_refuses_a_file_truncated_before_a_layer_is_mapped(checkpoint) -> None:
    """A file cut short during a pass, before the reader reaches a layer: CheckpointError naming the
    file (never a view past its end, which would raise SIGBUS when touched)."""
    staged, _ = checkpoint
    source = _in_place(staged)
    stream = source.stream(source.spec.layers(), read_ahead=0)  # read_ahead=0: each read runs inside next()
    first = next(stream)
    assert source.bytes_in_place > 0
    del first
    cut = source.entry(source.layout.weight(1))[1].begin + 2
    os.truncate(source.path, cut)
    with pytest.raises(CheckpointError, match="truncated"):
        next(stream)
    stream.close()


def test_in_place_is_off_on_request_and_checked(checkpoint) -> None:
    staged, tensors = checkpoint
    for lw in staged.stream(staged.spec.layers(), read_ahead=1):
        _expect(staged, tensors, lw)
    assert staged.bytes_in_place == 0
    with pytest.raises(ConfigError, match="in_place"):
        CheckpointSource(staged.path, staged.spec, in_place="yes")  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
