"""Cold bytes are read with O_DIRECT, cached bytes from the page cache, and the result is the same.

Real files on the test's filesystem; the page cache is emptied with ``posix_fadvise(DONTNEED)``
(no root needed) and warmed by reading the file. Tests that need O_DIRECT skip where the
filesystem refuses it; the fallback itself is tested on tmpfs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from adalncache import AdalnCache, BuildError, CheckpointSource, ModulationSpec
from adalncache.source.files import write_safetensors
from adalncache.source.reads import resident_fraction
from adalncache.spec import FINAL, get_layout
from core_helpers import embed_for

SPEC = ModulationSpec(num_layers=4, hidden_size=64, time_embed_dim=256)


def _write(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    layout = get_layout("native")
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in SPEC.layers():
        out = SPEC.out_features(layer)
        tensors[layout.weight(layer)] = torch.randn(out, SPEC.time_embed_dim, generator=gen).to(torch.bfloat16)
        tensors[layout.bias(layer)] = torch.randn(out, generator=gen).to(torch.bfloat16)
    # Offsets that are not multiples of the block size, so every direct read rounds its range out.
    residues = {name: 2 * n + 2 for n, name in enumerate(tensors)}
    directory.mkdir(parents=True, exist_ok=True)
    path = write_safetensors(tensors, directory / "m.safetensors", residues=residues)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages only can be dropped
    finally:
        os.close(fd)
    return path, tensors


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path: Path, upto: int | None = None) -> None:
    """Read ``path`` (or its first ``upto`` bytes) into the page cache, without readahead past them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead beyond what is read
        os.pread(fd, upto if upto is not None else path.stat().st_size, 0)
    finally:
        os.close(fd)


def _supports_direct(path: Path) -> bool:
    """Whether this filesystem really serves an O_DIRECT read (some accept the open, refuse the read)."""
    import mmap

    if not hasattr(os, "RWF_NOWAIT"):
        return False
    plain = os.open(path, os.O_RDONLY)
    try:  # the way the source opens it: a reopen of the pass's own descriptor
        fd = os.open(f"/proc/self/fd/{plain}", os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    finally:
        os.close(plain)
    buf = mmap.mmap(-1, 4096)  # page-aligned
    try:
        return os.preadv(fd, [buf], 0) > 0
    except OSError:
        return False
    finally:
        buf.close()
        os.close(fd)


def _drop_works(path: Path) -> bool:
    """Whether POSIX_FADV_DONTNEED really empties this file's cache here (mincore says so)."""
    _drop(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        resident = resident_fraction(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    return resident is not None and resident < 0.1


def _check_stream(source: CheckpointSource, tensors: dict[str, torch.Tensor], read_ahead: int = 1) -> None:
    seen = []
    for layer, weight, bias in source.stream(source.spec.layers(), read_ahead=read_ahead):
        for name, t in ((source.layout.weight(layer), weight), (source.layout.bias(layer), bias)):
            assert torch.equal(t, tensors[name]), f"{name} differs"
            assert t.data_ptr() % 4096 == source.entry(name)[1].begin % 4096
        seen.append(layer)
    assert seen == source.spec.layers() and FINAL in seen


@pytest.fixture
def cold(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path, tensors = _write(tmp_path / "ckpt")
    if not _supports_direct(path):
        pytest.skip("this filesystem or platform has no O_DIRECT / RWF_NOWAIT")
    if not _drop_works(path):
        pytest.skip("POSIX_FADV_DONTNEED does not empty the page cache on this filesystem")
    return path, tensors


@pytest.mark.parametrize("read_ahead", [0, 1, 2])
def test_a_cold_file_is_read_directly_and_exactly(cold, read_ahead: int) -> None:
    path, tensors = cold
    source = CheckpointSource(path, SPEC)
    _drop(path)
    _check_stream(source, tensors, read_ahead)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert source.bytes_read == total
    # Dropping is advisory, so a few pages may survive; most bytes must have come directly.
    assert source.bytes_direct > total // 2


def test_a_cached_file_is_read_from_the_page_cache(cold) -> None:
    path, tensors = cold
    source = CheckpointSource(path, SPEC)
    _warm(path)
    _check_stream(source, tensors)
    assert source.bytes_direct == 0


def test_a_half_cached_file_mixes_both_and_stays_exact(cold) -> None:
    path, tensors = cold
    source = CheckpointSource(path, SPEC)
    _drop(path)
    size = path.stat().st_size
    _warm(path, size // 2)
    fd = os.open(path, os.O_RDONLY)
    try:
        resident = resident_fraction(fd, 0, size)
    finally:
        os.close(fd)
    assert resident is not None and 0.3 < resident < 0.7, resident  # the precondition: half cached
    _check_stream(source, tensors)
    assert 0 < source.bytes_direct < source.bytes_read


def test_direct_io_off_reads_through_the_page_cache(cold) -> None:
    path, tensors = cold
    source = CheckpointSource(path, SPEC, direct_io=False)
    _drop(path)
    _check_stream(source, tensors)
    assert source.bytes_direct == 0


def test_a_cold_file_truncated_during_the_pass_fails_the_build(cold) -> None:
    path, _ = cold
    source = CheckpointSource(path, SPEC)
    cache = AdalnCache(SPEC, source, max_plans=2, max_plan_width=2)
    embed = embed_for(SPEC)
    size = path.stat().st_size
    _drop(path)

    def embed_then_truncate(plan: torch.Tensor) -> torch.Tensor:
        with open(path, "r+b") as f:
            f.truncate(size // 2)
        return embed(plan)

    with pytest.raises(BuildError, match=r"truncated|ended|changed"):
        cache.build([torch.tensor([0.5, 0.25])], embed=embed_then_truncate)
    assert cache.resident_plans == []
    cache.check_invariants()


def test_a_filesystem_without_o_direct_falls_back_to_plain_reads() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) here")
    import tempfile

    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        path, tensors = _write(Path(tmp))
        if _supports_direct(path):
            pytest.skip("this tmpfs accepts O_DIRECT; nothing to fall back from")
        source = CheckpointSource(path, SPEC)
        _check_stream(source, tensors)
        assert source.bytes_direct == 0


def test_o_direct_refused_at_open_falls_back_to_plain_reads(cold, monkeypatch) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL at open, as older tmpfs does): plain reads, same bytes."""
    import errno

    path, tensors = cold
    real_open = os.open

    def open_without_direct(file: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    source = CheckpointSource(path, SPEC)
    _drop(path)
    _check_stream(source, tensors)
    assert source.bytes_direct == 0


def test_without_mincore_the_page_cache_is_asked_directly(cold, monkeypatch) -> None:
    """A file we neither own nor may write hides its cache from mincore: RWF_NOWAIT decides instead."""
    from adalncache.source.reads import DirectReads

    path, tensors = cold
    monkeypatch.setattr(DirectReads, "_mincore_trusted", lambda self, path, fd: False)
    source = CheckpointSource(path, SPEC)
    _drop(path)
    _check_stream(source, tensors)
    assert source.bytes_direct > 0  # at least the first miss went direct
    warm = CheckpointSource(path, SPEC)
    _warm(path)
    _check_stream(warm, tensors)
    assert warm.bytes_direct == 0


def test_a_file_replaced_during_a_cold_pass_is_read_from_the_file_the_pass_opened(cold) -> None:
    """A checkpoint renamed over mid-pass: the rest of the pass still reads the file it opened.

    Layer 0 is cached (read without O_DIRECT); the later layers are cold, so their O_DIRECT
    descriptor is opened only after the replacement (``read_ahead=0`` reads inside ``next()``).
    """
    path, tensors = cold
    source = CheckpointSource(path, SPEC)
    layer0 = [source.entry(source.layout.weight(0))[1], source.entry(source.layout.bias(0))[1]]
    _drop(path)
    _warm(path, max(e.end for e in layer0))
    other = {name: -t for name, t in tensors.items()}  # same layout, other bytes
    new_path = path.parent / "new.safetensors"
    write_safetensors(other, new_path, residues={name: 2 * n + 2 for n, name in enumerate(other)})
    _drop(new_path)
    seen = 0
    for layer, weight, bias in source.stream(source.spec.layers(), read_ahead=0):
        if seen == 0:
            os.replace(new_path, path)  # atomically, as downloaders and save_pretrained do
        assert torch.equal(weight, tensors[source.layout.weight(layer)]), f"layer {layer} came from the new file"
        assert torch.equal(bias, tensors[source.layout.bias(layer)])
        seen += 1
    assert seen == len(source.spec.layers())
    assert source.bytes_direct > 0  # the later layers did go direct
