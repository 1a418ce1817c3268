"""The CPU kernel choices of fast numerics (numerics.py `cpu_kernels`), each against torch's default in
the same run:

- index scores (a product of two bf16 activations) whose key count grows by one per call, as in
  decoding, and at a repeated shape: bf16 (oneDNN builds a kernel per new shape) against fp32 copies;
- Sinkhorn (20 iterations on 4×4 matrices) at decode row counts: torch ops against NumPy;
- a whole fast decode step of the bench_reference config (batch 1 and 16) with and without the CPU
  kernels: two models with the same weights, their steps alternating.

    python benchmarks/bench_kernels.py [--threads 2] [--dim 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_reference import config                 # noqa: E402
from dsv41.config import RuntimeConfig                       # noqa: E402
from dsv41.model import Transformer, hyper                   # noqa: E402
from dsv41.model.init import init_random_                    # noqa: E402
from dsv41.model.numerics import FAST, Numerics              # noqa: E402

CPU = Numerics("fast", "blas", cpu_kernels=True)


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls * 1e6


def index_scores(heads: int = 4, width: int = 64, keys: int = 256, calls: int = 60) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, heads, width, generator=g).bfloat16()
    pool = torch.randn(1, keys + calls, width, generator=g).bfloat16()
    print(f"index scores, {heads} heads × {width}, {keys}+ keys (µs per call):")
    for name, policy in (("bf16 (torch default)", FAST), ("fp32 copies (cpu_kernels)", CPU)):
        score = lambda c: policy.activation_einsum("bthd,bcd->bthc", q, pool[:, :c])
        growing = per_call_us(lambda i: score(keys + i), calls)
        for _ in range(5):
            score(keys)
        repeated = per_call_us(lambda i: score(keys), calls)
        print(f"  {name:28s} a new key count each call {growing:8.1f}   one key count {repeated:7.1f}")


def sinkhorn(calls: int = 200) -> None:
    print("Sinkhorn, 20 iterations of 4×4 (µs per call):")
    for rows in (1, 16, hyper.INNERMOST_FROM - 1):
        c = torch.randn(rows, 1, 4, 4, generator=torch.Generator().manual_seed(rows))
        torch_us = per_call_us(lambda i: hyper.sinkhorn(c, 20, 1e-6, FAST), calls)
        host_us = per_call_us(lambda i: hyper.sinkhorn(c, 20, 1e-6, CPU), calls)
        print(f"  {rows:3d} rows: torch {torch_us:7.1f}   NumPy {host_us:7.1f}   ({torch_us / host_us:.2f}×)")


def decode(dim: int, layers: int, steps: int = 24) -> None:
    cfg = config(dim, layers)
    runtime = RuntimeConfig(max_seq_len=200, max_batch_size=16, numerics="fast")
    models = {}
    for name, cpu in (("torch default", False), ("cpu_kernels", True)):
        model = init_random_(Transformer(cfg, runtime), 0)
        for module in model.modules():
            if hasattr(module, "numerics"):
                module.numerics = Numerics("fast", "blas", cpu_kernels=cpu)
        models[name] = model
    print(f"fast decode step, dim {dim}, {layers} layers, after a 128-token prefill (ms, median of {steps - 2}):")
    for batch in (1, 16):
        ids = torch.randint(0, cfg.vocab_size, (batch, 128 + steps), generator=torch.Generator().manual_seed(1))
        caches = {name: model.new_cache(batch, 200) for name, model in models.items()}
        for name, model in models.items():
            model(ids[:, :128], 0, caches[name])
        times = {name: [] for name in models}
        for p in range(128, 128 + steps):
            for name, model in models.items():
                start = time.perf_counter()
                model.logits(model(ids[:, p:p + 1], p, caches[name]).hidden[:, -1])
                times[name].append(time.perf_counter() - start)
        base, cpu = (statistics.median(t[2:]) * 1e3 for t in times.values())
        print(f"  batch {batch:2d}: torch default {base:7.1f}   cpu_kernels {cpu:7.1f}   ({base / cpu:.2f}×)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        index_scores()
        sinkhorn()
        decode(args.dim, args.layers)


if __name__ == "__main__":
    main()
