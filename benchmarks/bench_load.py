"""Peak resident memory while loading a released-layout checkpoint, as a ratio of the model's size.

The loader builds the model on the meta device and materialises each tensor once from the shards, so
the peak should stay under 1.25x the final model size. Run: python benchmarks/bench_load.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

CHILD = r"""
import sys, time, torch
from dsv41 import load
from dsv41.config import RuntimeConfig

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
t = time.perf_counter()
numerics, _, kept = sys.argv[2].partition("+")
model = load(sys.argv[1], RuntimeConfig(max_seq_len=256, numerics=numerics, stored_experts=kept == "stored"),
             progress=False)
seconds = time.perf_counter() - t
peak = status("VmHWM")
size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(f"{peak - base} {size} {seconds}")
"""


def make_checkpoint(directory: str) -> None:
    import torch

    from dsv41.checkpoint.model_io import save_model
    from dsv41.config import ModelConfig, RuntimeConfig
    from dsv41.model.init import init_random_
    from dsv41.model import Transformer

    cfg = ModelConfig(vocab_size=8192, dim=1024, moe_inter_dim=512, n_layers=6, n_heads=8, n_routed_experts=32,
                      n_shared_experts=1, n_activated_experts=4, q_lora_rank=256, head_dim=128, rope_head_dim=32,
                      o_groups=4, o_lora_rank=128, window_size=64, compress_ratios=(0, 2, 2, 1, 1, 1),
                      kv_source_layers=(1, 3), index_source_layers=(1, 3, 5), index_n_heads=4, index_head_dim=64,
                      index_topk=64, candidate_source_layer=3, candidate_topk_blocks=16, candidate_block_size=8,
                      route_scale=1.5, swiglu_limit=10.0, original_seq_len=256, rope_factor=4)
    with torch.no_grad():
        model = init_random_(Transformer(cfg, RuntimeConfig(max_seq_len=256)), 0)
    save_model(model, directory, max_shard_bytes=64 << 20)


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        t = time.perf_counter()
        make_checkpoint(directory)
        print(f"wrote the checkpoint in {time.perf_counter() - t:.1f} s")
        print(f"{'numerics':<12} {'model MiB':>10} {'peak MiB':>10} {'peak/size':>10} {'load s':>8}")
        # fast+stored: fast numerics with the fp4 experts kept in their stored bytes (docs/NUMERICS.md N30)
        for numerics in ("reference", "fast", "fast+stored"):
            out = subprocess.run([sys.executable, "-c", CHILD, directory, numerics], capture_output=True, text=True,
                                 check=True).stdout.split()
            peak, size, seconds = int(out[0]), int(out[1]), float(out[2])
            print(f"{numerics:<12} {size / 2**20:>10.1f} {peak / 2**20:>10.1f} {peak / size:>10.2f} {seconds:>8.2f}")


if __name__ == "__main__":
    main()
