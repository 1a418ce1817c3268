"""Whole-model throughput of a small V4.1-shaped config in both numerics modes and both kernel choices.

Run from the repository root: python -m benchmarks.bench_model [--threads N] [--prefill T] [--decode N]

The config has every layer role of the release in 8 layers (window, ratio-2 kv source + consumer, ratio-1
kv/candidate source + consumer, index-only candidate user + consumer) at dim 256, vocab 4096 and top-2 of
8 experts. "reference" keeps fp8/fp4 weights quantised and runs the reference's blockwise GEMMs (bf16 with
the release's rounding points); "fast" holds dequantised float32 weights. Kernels: "invariant" reduces
every matmul and transcendental in float64 (call-shape independent bits), "blas" uses the BLAS at the
call's shape (numerics.py). Prefill is one call of T positions from 0 (best of 3); decode is N further
1-token calls on the same cache (median per token).

One intra-op thread by default: the kernels are small, and on a shared 2-core machine two threads
measured 3-20x slower than one (thread hand-off while other processes hold a core). The load average is
printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from dsv41.config import RELEASED_CONFIG, ModelConfig, RuntimeConfig
from dsv41.model.init import init_random_
from dsv41.model import Transformer

CONFIG = dict(
    vocab_size=4096, dim=256, moe_inter_dim=128, n_layers=8, n_heads=8, n_routed_experts=8, n_shared_experts=1,
    n_activated_experts=2, q_lora_rank=128, head_dim=128, rope_head_dim=32, o_groups=4, o_lora_rank=64,
    window_size=32, compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
    index_n_heads=4, index_head_dim=64, index_topk=32, candidate_source_layer=4, candidate_topk_blocks=8,
    candidate_block_size=4, route_scale=1.5, swiglu_limit=10.0, original_seq_len=256, rope_factor=4,
    compress_rope_theta=160000.0,
)

PREFILL_REPEATS = 3


def config() -> ModelConfig:
    base = ModelConfig.from_json(_released()).to_dict()
    base.update(CONFIG, n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=[], engram_layer_ids=[],
                engram_num_embeddings=[], vision_n_layers=0)
    return ModelConfig.from_dict(base)


def _released() -> Path:
    return RELEASED_CONFIG


@torch.no_grad()
def measure(numerics: str, kernels: str, prefill: int, decode: int) -> tuple[float, float]:
    dtype = "float32" if numerics == "fast" else "bfloat16"
    max_len = prefill + decode
    runtime = RuntimeConfig(max_seq_len=max_len, numerics=numerics, dtype=dtype, kernels=kernels)
    model = init_random_(Transformer(config(), runtime), 0)
    ids = torch.randint(0, 4096, (1, max_len), generator=torch.Generator().manual_seed(1))
    model(ids[:, :8], 0, model.new_cache(1, max_len))                        # warm-up
    prefill_s = float("inf")
    for _ in range(PREFILL_REPEATS):                                           # best of: the machine is shared
        cache = model.new_cache(1, max_len)
        t0 = time.perf_counter()
        model(ids[:, :prefill], 0, cache)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
    steps = []
    for p in range(prefill, max_len):
        t0 = time.perf_counter()
        out = model(ids[:, p:p + 1], p, cache)
        model.logits(out.hidden[:, -1])
        steps.append(time.perf_counter() - t0)
    return prefill / prefill_s, statistics.median(steps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}; dim 256, 8 layers, vocab 4096, "
          f"top-2 of 8 experts; prefill {args.prefill} tokens, decode {args.decode} steps")
    combos = [("reference", "invariant"), ("reference", "blas"), ("fast", "blas"), ("fast", "invariant")]
    rows = {c: measure(*c, args.prefill, args.decode) for c in combos}
    base_tps, base_ms = rows[combos[0]]
    print(f"{'numerics':<10} {'kernels':<10} {'prefill tok/s':>14} {'decode ms/tok':>14} {'vs reference/invariant':>24}")
    for (mode, kernels), (tps, ms) in rows.items():
        print(f"{mode:<10} {kernels:<10} {tps:>14.1f} {ms:>14.2f}   prefill {tps / base_tps:5.2f}x, decode "
              f"{base_ms / ms:5.2f}x")


if __name__ == "__main__":
    main()
