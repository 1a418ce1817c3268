"""Does `torch.compile` speed up a decode step? The same model's step eager and compiled, alternating, in
one run (docs/NUMERICS.md N22).

While torch.compile traces, the native kernels decline (their wrappers cannot take data-less fake
tensors), so the compiled step is the torch path of the same policy, fused by inductor. Printed: the
seconds the first compiled steps took (tracing, inductor's C++ build, recompiles as the key count
grows), the graphs and graph breaks, the steady step of each, their ratio, and the largest logit
difference.

    python benchmarks/bench_compile.py [--threads 2] [--dim 256] [--layers 8] [--batch 1] [--mode default]
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
from dsv41.model import Transformer                          # noqa: E402
from dsv41.model.init import init_random_                    # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--warmup", type=int, default=6, help="compiled steps before timing (recompiles happen here)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mode", default="default", help="torch.compile mode (default, reduce-overhead, max-autotune)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config(args.dim, args.layers)
    length = args.prompt + args.warmup + args.steps + 1
    runtime = RuntimeConfig(max_seq_len=length, max_batch_size=args.batch, numerics="fast", dtype=args.dtype)
    model = init_random_(Transformer(cfg, runtime), 0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, length), generator=torch.Generator().manual_seed(1))
    print(f"dim {args.dim}, {args.layers} layers, batch {args.batch}, {args.dtype}, {args.threads} threads; "
          f"policy {model.numerics}; torch.compile mode {args.mode!r}")

    def step(tokens: torch.Tensor, position: int, cache) -> torch.Tensor:
        return model.logits(model(tokens, position, cache).hidden[:, -1])

    torch._dynamo.reset()
    compiled = torch.compile(step, mode=args.mode)
    caches = {"eager": model.new_cache(args.batch, length), "compiled": model.new_cache(args.batch, length)}
    fns = {"eager": step, "compiled": compiled}
    times: dict[str, list[float]] = {name: [] for name in fns}
    largest = 0.0
    with torch.no_grad():
        for cache in caches.values():
            model(ids[:, :args.prompt], 0, cache)
        start = time.perf_counter()
        for p in range(args.prompt, args.prompt + args.warmup):
            for name, fn in fns.items():
                fn(ids[:, p:p + 1], p, caches[name])
        first = time.perf_counter() - start
        for p in range(args.prompt + args.warmup, args.prompt + args.warmup + args.steps):
            out = {}
            for name, fn in fns.items():
                s = time.perf_counter()
                out[name] = fn(ids[:, p:p + 1], p, caches[name])
                times[name].append(time.perf_counter() - s)
            largest = max(largest, (out["eager"].float() - out["compiled"].float()).abs().max().item())
    counters = torch._dynamo.utils.counters
    breaks = sum(counters["graph_break"].values())
    print(f"first {args.warmup} steps (compiling): {first:.1f} s; graphs {counters['stats']['unique_graphs']}, "
          f"graph breaks {breaks}")
    eager, comp = (statistics.median(times[n]) * 1e3 for n in ("eager", "compiled"))
    print(f"steady step, median of {args.steps}: eager {eager:.2f} ms, compiled {comp:.2f} ms "
          f"(compiled / eager {comp / eager:.2f}×)")
    print(f"largest logit difference, compiled vs eager: {largest:.3g}")
    for reason, n in counters["graph_break"].most_common(5):
        print(f"  {n:4d} × {reason[:110]}")


if __name__ == "__main__":
    main()
