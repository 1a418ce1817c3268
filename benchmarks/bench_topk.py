"""Cost of the tie rule: `torch.topk` against dsv41's ordered top-k (topk.py, and the native kernel the
CPU policies take, native/topk.c) at the released sizes.

Run from the repository root: python -m benchmarks.bench_topk [--threads N]

Index top-k: K = 512 of C compressed positions per query, C up to 512K (a 1M context at ratio 2), for a
decode step (1 query) and a prefill chunk of 16 queries; candidate blocks: 2048 of C / 8 blocks. Scores
are bf16 summed ReLUs with many exact zeros, as the indexer gives. For scale, the last column is the
indexer's own scoring of those positions (32 heads of 128, relu(q·k)·w summed over heads, bf16), which
the selection follows. Median of 5 after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsv41.model import native
from dsv41.model.numerics import Numerics
from dsv41.model.topk import topk

NATIVE = Numerics("fast", "blas", native=True)

REPEATS = 5
HEADS, HEAD_DIM = 32, 128


def median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def scores(queries: int, positions: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, queries, positions, generator=g).relu().to(torch.bfloat16)     # half exactly 0


def scoring_ms(queries: int, positions: int) -> float:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, queries, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(1, positions, HEAD_DIM, generator=g).to(torch.bfloat16)
    w = torch.randn(1, queries, HEADS, generator=g).to(torch.bfloat16)
    return median_ms(lambda: (torch.einsum("bthd,bcd->bthc", q, k).relu() * w.unsqueeze(-1)).sum(dim=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"{'selection':<17} {'queries':>7} {'entries':>8} {'k':>5} {'torch.topk ms':>14} {'ordered ms':>11} "
          f"{'ratio':>6} {'native ms':>10} {'ratio':>6} {'indexer scoring ms':>19}")
    for label, k, divisor in (("index top-k", 512, 1), ("candidate blocks", 2048, 8)):
        for queries in (1, 16):
            for c in (65_536, 524_288):
                s = scores(queries, c // divisor)
                plain = median_ms(lambda: s.topk(k, dim=-1, sorted=False))
                ordered = median_ms(lambda: topk(s, k, sorted=False))
                fast = median_ms(lambda: NATIVE.topk(s, k, sorted=False)) if native.available() else float("nan")
                scoring = f"{scoring_ms(queries, c):>19.1f}" if divisor == 1 else f"{'':>19}"
                print(f"{label:<17} {queries:>7} {c // divisor:>8} {k:>5} {plain:>14.2f} {ordered:>11.2f} "
                      f"{ordered / plain:>5.2f}x {fast:>10.2f} {fast / plain:>5.2f}x{scoring}")


if __name__ == "__main__":
    main()
