"""Does O_DIRECT throughput depend on which pages a buffer got? (a VM artifact, see RESULTS.md)

Reads the bench checkpoint's projections cold with O_DIRECT into four buffers allocated one after
the other, each read twice. On the 2-core dev VM the first buffer of a process reads at about
1.4 s and the other three at about 0.92 s, repeatably. Run after ``make bench`` (it reuses the
generated checkpoint): ``.venv/bin/python bench/probe_direct_pages.py``.
"""

import os
import time
from pathlib import Path

import torch

from adalncache.source.checkpoint import CheckpointSource
from adalncache.source.reads import CHUNK, DIRECT_BLOCK, DirectReads, place
from adalncache.spec import ModulationSpec
from adalncache.tools.bench import drop_page_cache, tensor_ranges

spec = ModulationSpec(num_layers=4, hidden_size=5376, time_embed_dim=2688)
src = CheckpointSource(Path("/tmp/adalncache-bench/ckpt-4x5376x2688"), spec)
files = list(src.files)
ranges = tensor_ranges(src)
N = max(n for _, _, n in ranges)


def via(buf: torch.Tensor, chunk: int = CHUNK) -> float:
    d = DirectReads()
    fds = {p: os.open(p, os.O_RDONLY) for p in {p for p, _, _ in ranges}}
    s = time.perf_counter()
    for p, off, n in ranges:
        view = place(buf, n, off, modulus=DIRECT_BLOCK, margin=DIRECT_BLOCK)
        base = view.data_ptr()
        done = 0
        while done < n:
            k = min(chunk, n - done)
            got = d.read(fds[p], p, base + done, k, off + done)
            assert got, "O_DIRECT unavailable or the file ended"
            done += got
    t = time.perf_counter() - s
    d.close()
    for fd in fds.values():
        os.close(fd)
    return t


bufs = []
for _ in range(4):
    b = torch.empty(N + 3 * DIRECT_BLOCK, dtype=torch.uint8)
    b.fill_(0)
    bufs.append(b)
for _ in range(2):
    out = []
    for i, b in enumerate(bufs):
        drop_page_cache(files)
        out.append(f"{i}:{via(b):.3f}")
    print(out, flush=True)
