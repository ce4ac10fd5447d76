"""Helpers for the core tests: tiny real checkpoints on disk and an independent reference projection.

The reference (:func:`reference_rows`) reads the weights with safetensors' own loader, not through
adalncache, and projects each plan with ``F.linear`` at its own M, so a bug in the source or the
cache cannot also hide in the check.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from adalncache import AdalnCache, ModulationSpec
from adalncache.spec import FINAL, LAYOUTS, Layer

SPEC = ModulationSpec(num_layers=3, hidden_size=8, time_embed_dim=32)


def make_weights(spec: ModulationSpec, layout: str = "native", seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic projection weights of ``spec`` (plus an unrelated tensor, as real files have)."""
    lay = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {"unrelated.weight": torch.randn(5, 7, generator=g)}
    for layer in spec.layers():
        w, b = spec.weight_shape(layer), (spec.out_features(layer),)
        out[lay.weight(layer)] = (torch.randn(*w, generator=g) / 4).to(spec.dtype)
        out[lay.bias(layer)] = torch.randn(*b, generator=g).to(spec.dtype)
    return out


def write_checkpoint(
    directory: Path, weights: Mapping[str, torch.Tensor], *, shards: int = 1, name: str = "model"
) -> Path:
    """Write real safetensors files; with ``shards > 1`` also the ``*.safetensors.index.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(weights)
    if shards == 1:
        path = directory / f"{name}.safetensors"
        save_file({k: weights[k].contiguous() for k in keys}, str(path))
        return path
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        fname = f"{name}-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: weights[k].contiguous() for k in part}, str(directory / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (directory / f"{name}.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def embed_for(spec: ModulationSpec, seed: int = 1):
    """A deterministic MiniMax-like embed: a tiny fp32 MLP of the plan, SiLU in fp32, then the cast."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(16, 1, generator=g)
    w2 = torch.randn(spec.time_embed_dim, 16, generator=g) / 4

    def embed(plan: torch.Tensor) -> torch.Tensor:
        temb = F.linear(F.silu(F.linear(plan[:, None], w1)), w2)
        return F.silu(temb).to(spec.dtype)

    return embed


def load_reference(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint file or sharded directory, read with safetensors itself."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def reference_rows(
    weights: Mapping[str, torch.Tensor], spec: ModulationSpec, layout: str, embed, plan: torch.Tensor, layer: Layer
) -> torch.Tensor:
    lay = LAYOUTS[layout]
    return F.linear(embed(plan), weights[lay.weight(layer)], weights[lay.bias(layer)])


def assert_plan_exact(
    cache: AdalnCache, weights: Mapping[str, torch.Tensor], layout: str, embed, plan: torch.Tensor
) -> None:
    """Every layer's rows of ``plan`` equal the independent projection bit for bit."""
    slot = cache.lookup(plan)
    n = plan.numel()
    for layer in cache.spec.layers():
        want = reference_rows(weights, cache.spec, layout, embed, plan, layer)
        got = cache.final_rows(slot, n) if layer == FINAL else cache.block_rows(int(layer), slot, n)
        assert torch.equal(got, want), f"layer {layer} of plan {plan.tolist()} differs"


def snapshot(cache: AdalnCache) -> dict[str, object]:
    """Everything observable about the cache's state, for "nothing changed" assertions."""
    return {
        "slots": {key: cache.slot_of(key) for key in cache.resident_plans},
        "order": cache.resident_plans,
        "free": sorted(cache.free_slots),
        "lengths": cache.plan_lengths.clone(),
        "timesteps": cache.plan_timesteps.clone(),
        "block": cache.block_params.clone(),
        "final": cache.final_params.clone(),
        "stats": cache.stats.as_dict(),
    }


def assert_same_state(before: dict[str, object], cache: AdalnCache) -> None:
    after = snapshot(cache)
    for key, value in before.items():
        other = after[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and torch.equal(value, other), f"{key} changed"
        else:
            assert value == other, f"{key} changed: {value} -> {other}"


def rewrite_in_place(path: Path, weights: Mapping[str, torch.Tensor], *, keep_mtime: bool = False) -> None:
    """Write ``weights`` over ``path``'s bytes: same inode, same size, same header (the tensors' names,
    shapes and dtypes must be the file's), as a trainer saving over its checkpoint does.

    ``keep_mtime`` puts the modification time back afterwards (``os.utime``), as ``touch -d`` or a
    careful copy tool would; the change time cannot be put back by anyone.
    """
    before = os.stat(path)
    scratch = path.with_name(path.name + ".rewrite")
    save_file({k: weights[k].contiguous() for k in sorted(weights)}, str(scratch))
    data = scratch.read_bytes()
    scratch.unlink()
    assert len(data) == before.st_size, "rewrite_in_place needs weights of the file's names, shapes and dtypes"
    with open(path, "r+b") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert after.st_ino == before.st_ino and after.st_size == before.st_size


def stat_identity(path: Path) -> tuple[int, ...]:
    """What a checkpoint's file identity is made of: device, inode, size, mtime and ctime."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class DirtyMapping:
    """A shared, writable mapping of ``path`` whose every page was written once already (dirty).

    ext4 updates a file's mtime and ctime when a clean page of a shared mapping takes its first write
    fault; later writes to that page, until writeback cleans it (about 30 s, or an ``fsync``), fault no
    more and move neither time. Opening the mapping writes each page's first byte back unchanged: that
    moves the times once, as any write does. :meth:`write` then changes bytes no ``stat`` can see.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        for offset in range(0, len(self.map), mmap.PAGESIZE):
            self.map[offset] = self.map[offset]
        #: When the pages were dirtied (a caller that waits long may see writeback clean them).
        self.dirtied = time.monotonic()

    def write(self, data: bytes, offset: int = 0) -> bool:
        """Write ``data`` at ``offset`` through the mapping; whether the file's stat identity stayed put."""
        before = stat_identity(self.path)
        self.map[offset : offset + len(data)] = data
        return stat_identity(self.path) == before

    def close(self) -> None:
        """Unmap (no ``msync``: the pages stay dirty in the page cache until writeback)."""
        self.map.close()


def replace_atomically(path: Path, weights: Mapping[str, torch.Tensor]) -> None:
    """Write ``weights`` to a new file and rename it over ``path`` (a new inode), as downloaders and
    ``save_pretrained`` do."""
    scratch = path.with_name(path.name + ".new")
    save_file({k: weights[k].contiguous() for k in sorted(weights)}, str(scratch))
    os.replace(scratch, path)


class RewriteBetweenLayers:
    """A weight source that runs an action once, right after a pass received a chosen layer.

    Wraps any source (everything else is the wrapped source's). ``arm(layer, action)``: after the
    consumer got ``layer`` from a stream, ``action()`` runs (say, :func:`rewrite_in_place` of the
    checkpoint: a trainer saving over the file while the pass is between layers), once.
    """

    def __init__(self, source: object) -> None:
        self.source = source
        self.after: Layer | None = None
        self.action = None
        self.fired = 0

    def arm(self, layer: Layer, action) -> None:
        self.after, self.action = layer, action

    def disarm(self) -> None:
        self.after, self.action = None, None

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    @property
    def fingerprint(self) -> str:
        return self.source.fingerprint

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def refresh(self) -> bool:
        return self.source.refresh()

    def stream(self, layers, **kwargs):
        inner = self.source.stream(layers, **kwargs)
        with contextlib.closing(inner):
            for item in inner:
                yield item
                if self.action is not None and item.layer == self.after:
                    action, self.action = self.action, None
                    self.fired += 1
                    action()
