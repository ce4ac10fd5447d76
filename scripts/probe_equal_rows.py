"""Do rows of equal inputs come out bitwise equal from one GEMM? The question batch plans rest on.

A pipeline's forward of B images has B rows of the same timestep; the cache projects them at the
forward's own M (``F.linear`` of a ``(M, K)`` input) and stores rows of equal inputs once only where
that one GEMM gave them the same bits. This prints, for every M in 1..64 and each dtype, whether the
M rows of one repeated input row came out bitwise equal (and how many distinct rows came out).

    python scripts/probe_equal_rows.py [--k 256] [--n 1536] [--max-m 64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def distinct_rows(y: torch.Tensor) -> int:
    """How many bitwise-distinct rows ``y`` has (compared as integers, so -0.0 and +0.0 differ)."""
    ints = {2: torch.int16, 4: torch.int32}[y.element_size()]
    return len({tuple(row) for row in y.contiguous().view(ints).tolist()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=256, help="input features (default 256)")
    parser.add_argument("--n", type=int, default=1536, help="output features (default 1536)")
    parser.add_argument("--max-m", type=int, default=64, help="largest M (default 64)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(args.n, args.k, generator=generator).to(dtype)
        bias = torch.randn(args.n, generator=generator).to(dtype)
        row = torch.randn(1, args.k, generator=generator).to(dtype)
        unequal = []
        for m in range(1, args.max_m + 1):
            y = F.linear(row.expand(m, args.k).contiguous(), weight, bias)
            count = distinct_rows(y)
            if count > 1:
                unequal.append(f"M={m}: {count} distinct")
        verdict = "equal at every M" if not unequal else "; ".join(unequal)
        print(f"{str(dtype).removeprefix('torch.')} K={args.k} N={args.n}, M=1..{args.max_m}: {verdict}")


if __name__ == "__main__":
    main()
