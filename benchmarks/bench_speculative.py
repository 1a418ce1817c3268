"""What DSpark speculation costs and what it would give on the demo model, in both numerics modes.

Measures, on the same cache state: one single-token decode step, one DSpark draft (Bs rows through the
stages + the Markov chain), and one (Bs + 1)-row verify pass with its snapshot and rollback. From these,
the speed-up over plain decoding at a mean accepted length L (tokens committed per verify pass) is
L · t_decode / (t_draft + t_verify). The random demo's real acceptance is ~0 (the trained demo's is measured by
bench_demo_speculative.py); the
release reports L ≈ 2.5–3.3 (docs/GENERATION-AND-DSPARK.md §5). Run: python benchmarks/bench_speculative.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dsv41
from dsv41.config import RuntimeConfig
from dsv41.demo import ensure_demo_checkpoint


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


@torch.no_grad()
def measure(model, prompt_len: int, repeats: int) -> tuple[float, float, float]:
    Bs = model.cfg.dspark_block_size
    ids = torch.randint(0, model.cfg.vocab_size, (1, prompt_len + Bs + 1), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, prompt_len + 2 * Bs + 2)
    out = model(ids[:, :prompt_len], 0, cache)
    model.dspark_observe(out.dspark_hidden, 0, cache)
    last, token = prompt_len - 1, ids[:, prompt_len]

    def decode():
        step = model.step((0,), (last + 1,), (1,))
        snap = cache.snapshot(step)
        model(token, step, cache)
        cache.rollback(snap, [0])

    def draft():
        model.dspark_draft(token, last, cache)

    def verify():
        step = model.step((0,), (last + 1,), (Bs + 1,))
        snap = cache.snapshot(step)
        model(ids[0, prompt_len:prompt_len + Bs + 1], step, cache)
        cache.rollback(snap, [0])

    return timed(decode, repeats), timed(draft, repeats), timed(verify, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_demo_checkpoint()
    print(f"demo model, {args.threads} thread(s), prompt {args.prompt}; times are medians of {args.repeats}")
    print(f"{'numerics':<10} {'decode ms':>10} {'draft ms':>9} {'verify ms':>10}   speed-up at L = 1 … 6")
    for numerics, dtype in (("reference", "bfloat16"), ("fast", "float32")):
        model = dsv41.load(path, RuntimeConfig(max_seq_len=512, numerics=numerics, dtype=dtype))
        t_dec, t_draft, t_ver = measure(model, args.prompt, args.repeats)
        gains = " ".join(f"{L * t_dec / (t_draft + t_ver):.2f}x" for L in range(1, 7))
        print(f"{numerics:<10} {t_dec * 1e3:>10.1f} {t_draft * 1e3:>9.1f} {t_ver * 1e3:>10.1f}   {gains}")


if __name__ == "__main__":
    main()
