"""The CUDA paths on one GPU: the machine's ceilings, the grouped expert GEMM at the release's expert shapes,
Engram rows from a host table, and decode steps of a small config and of one release-sized layer.

Run from the repository root: python -m benchmarks.bench_cuda [--section NAME ...] [--quick]

Sections (all by default):
- env      the device, a device-to-device copy (GB/s, read + write counted), a read (a sum over the same
           1 GiB: the floor of a decode step's weight reads) and a bf16 8192³ product;
- grouped  one MoE layer's routed experts at the release's shapes (384 experts, 5120 → 2304 → 5120, bf16,
           top-6 of random routes): torch's grouped GEMM (fast numerics' choice on a GPU) against the
           per-expert loop, for decode- and prefill-sized calls; GB/s of the chosen experts' weights;
- engram   `EngramTable.lookup` from a host table (the release's 256-wide rows, fp8 + ue8m0) onto the GPU;
- small    the 8-layer config of bench_reference (every layer role, dim 512, 32 experts), random weights:
           prefill and decode at batch 1 / 16 / 64 in fast bf16 and in reference numerics;
- layer    one release-sized layer (dim 5120, 64 heads of 512, 384 experts, the release's layer-2 role:
           a ratio-2 compressed KV and index source) with the release's head, in fast bf16 (and one
           reference-numerics decode step): prefill tok/s, decode ms at batch 1 / 8 / 64, and the decode
           step's weight bytes against the read bandwidth measured here.
Token ids are handed over on the host, as the engine hands them (a model checks ids given on the device
there, which waits for the device once per step).
Weights are random (values do not change the work); `--quick` shrinks every size for a CPU check run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsv41.config import RELEASED_CONFIG, ModelConfig, RuntimeConfig
from dsv41.model import Transformer
from dsv41.model.engram.table import EngramTable
from dsv41.model.init import init_random_
from dsv41.model.moe import RoutedExperts
from dsv41.model.numerics import Numerics

from benchmarks.bench_reference import config as small_config, decode_weight_bytes

SECTIONS = ("env", "grouped", "engram", "small", "layer")
E8M0_SMALL = 121                         # the ue8m0 code of 2⁻⁶: a plausible weight scale
PREFILL_TOKENS = 16384                   # most tokens of one timed prefill call (its activations must fit)


class Clock:
    """Wall-clock milliseconds of a call, the device synchronised before and after (what a caller waits)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def ms(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - start) * 1e3

    def median_ms(self, fn, repeats: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self.ms(fn) for _ in range(repeats))


@torch.no_grad()
def fill_random_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter filled on its own device: floats N(0, 0.02²), fp8 weights from N(0, 1), ue8m0 scales
    2⁻⁶, packed fp4 bytes uniform; fast on a GPU where `init_random_` would draw on the host."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for p in module.parameters():
        if p.dtype in (torch.float32, torch.bfloat16, torch.float16):
            p.normal_(0.0, 0.02, generator=gen)
        elif p.dtype == torch.float8_e4m3fn:
            p.copy_(torch.randn(p.shape, device=p.device, generator=gen).to(p.dtype))
        elif p.dtype == torch.float8_e8m0fnu:
            p.view(torch.uint8).fill_(E8M0_SMALL)
        elif p.dtype in (torch.int8, torch.uint8):
            p.view(torch.uint8).random_(0, 256, generator=gen)
        else:
            p.zero_()


def env(device: torch.device, clock: Clock, quick: bool) -> float:
    """Prints the device and its ceilings; returns the read bandwidth (GB/s)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {name}")
    src = torch.ones(1 << (24 if quick else 28), device=device)
    dst = torch.empty_like(src)
    copy_ms = min(clock.ms(lambda: dst.copy_(src)) for _ in range(10))
    gb_s = 2 * src.numel() * 4 / copy_ms / 1e6
    read_ms = min(clock.ms(lambda: src.sum()) for _ in range(10))
    read_gb_s = src.numel() * 4 / read_ms / 1e6
    n = 1024 if quick else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm_ms = clock.median_ms(lambda: a @ b, 10)
    print(f"copy {gb_s:,.0f} GB/s ({src.numel() * 4 >> 20} MiB, read + write), read {read_gb_s:,.0f} GB/s; bf16 {n}³ "
          f"product {2 * n ** 3 / mm_ms / 1e9:,.0f} TFLOP/s")
    return read_gb_s


def released() -> ModelConfig:
    return ModelConfig.from_json(RELEASED_CONFIG)


def grouped(device: torch.device, clock: Clock, quick: bool) -> None:
    cfg = released()
    E, D, F, A = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    if quick:
        E, D, F = 16, 256, 128
    kw = dict(device=device, dtype=torch.bfloat16)
    banks = RoutedExperts(E, D, F, "fp4", cfg.swiglu_limit, numerics=Numerics("fast", "blas", "grouped"), **kw)
    fill_random_(banks, 0)
    loop = RoutedExperts(E, D, F, "fp4", cfg.swiglu_limit, numerics=Numerics("fast", "blas"), device="meta")
    for name in ("w1", "w2", "w3"):
        getattr(loop, name).weight = getattr(banks, name).weight                # the same weights, not a copy
    expert_bytes = 3 * D * F * 2
    print(f"routed experts: {E} experts {D} → {F} → {D} bf16 ({E * expert_bytes / 2 ** 30:.1f} GiB), top-{A}")
    print(f"{'tokens':>7} {'experts':>8} {'grouped ms':>11} {'GB/s':>7} {'TFLOP/s':>8} {'loop ms':>9} {'loop/grouped':>13}")
    gen = torch.Generator(device=device).manual_seed(1)
    for n in (1, 4, 16, 64, 256, 1024, 4096) if not quick else (1, 16):
        x = torch.randn(n, D, device=device, dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(n, E, device=device, generator=gen).topk(A, dim=-1).indices
        weights = torch.rand(n, A, device=device, generator=gen)
        touched = ids.unique().numel()
        g = clock.median_ms(lambda: banks(x, weights, ids), 10)
        loop_ms = clock.median_ms(lambda: loop(x, weights, ids), 5)
        flops = 2 * 3 * n * A * D * F
        print(f"{n:>7} {touched:>8} {g:>11.3f} {touched * expert_bytes / g / 1e6:>7,.0f} {flops / g / 1e9:>8.1f} "
              f"{loop_ms:>9.3f} {loop_ms / g:>12.2f}×")


def engram(device: torch.device, clock: Clock, quick: bool) -> None:
    cfg = released()
    rows, width = (1 << 16, 64) if quick else (1 << 22, cfg.engram_head_dim)
    columns = cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1)
    table = EngramTable(rows, width)                                             # host memory, as loaded
    table.weight.data.view(torch.uint8).copy_(torch.randint(0, 0x70, (rows, width), dtype=torch.uint8))
    table.scale.data.view(torch.uint8).fill_(E8M0_SMALL)
    row_bytes = width + width // 32
    print(f"Engram: host table of {rows:,} rows × {row_bytes} B ({rows * row_bytes / 2 ** 20:,.0f} MiB), {columns} "
          f"hash columns per token, looked up onto {device}")
    print(f"{'tokens':>7} {'rows':>7} {'ms':>8} {'rows/s':>12} {'MB/s':>8}")
    gen = torch.Generator().manual_seed(2)
    for n in (1, 16, 64, 512, 4096) if not quick else (1, 16, 64):
        ids = torch.randint(0, rows, (1, n, columns), generator=gen)
        ms = clock.median_ms(lambda: table.lookup(ids, device), 10)
        looked = n * columns
        print(f"{n:>7} {looked:>7} {ms:>8.3f} {looked / ms * 1e3:>12,.0f} {looked * row_bytes / ms / 1e3:>8,.0f}")


def steps(model: Transformer, clock: Clock, batch: int, prefill: int, decode: int) -> tuple[float, float]:
    """(prefill tok/s of `batch` rows of `prefill` tokens, median decode ms per step of `decode` steps)."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prefill + decode), generator=gen)      # on the host
    cache = model.new_cache(batch, prefill + decode)
    prefill_ms = clock.ms(lambda: model.logits(model(ids[:, :prefill], 0, cache).hidden[:, -1]))
    times = [clock.ms(lambda p=p: model.logits(model(ids[:, p:p + 1], p, cache).hidden[:, -1]))
             for p in range(prefill, prefill + decode)]
    return batch * prefill / prefill_ms * 1e3, statistics.median(times[1:] if len(times) > 2 else times)


def report(model: Transformer, clock: Clock, label: str, prefill: int, decode: int, batches, read_gb_s: float | None) -> None:
    steps(model, clock, 1, min(prefill, 16), 2)                                # warm-up (cuBLAS handles, kernels)
    for batch in batches:
        context = min(prefill, PREFILL_TOKENS // batch)      # a batch's prefill is one call of all its tokens
        tps, ms = steps(model, clock, batch, context, decode)
        floor = ""
        if batch == 1 and read_gb_s:
            need = decode_weight_bytes(model)
            floor = f", reads {need / 2 ** 20:,.0f} MiB: {need / (ms * 1e-3) / 1e9:,.0f} GB/s = " \
                    f"{need / (ms * 1e-3) / 1e9 / read_gb_s:.1%} of the read floor"
        print(f"  {label}, batch {batch:>2}: prefill {tps:>9,.0f} tok/s ({context} tokens a row), decode "
              f"{ms:>8.2f} ms/step ({batch / ms * 1e3:>8,.0f} tok/s){floor}")


def small(device: torch.device, clock: Clock, quick: bool, read_gb_s: float | None) -> None:
    cfg = small_config(256 if quick else 512, 8)
    prefill, decode = (32, 4) if quick else (512, 16)
    for numerics, dtype, batches in (("fast", "bfloat16", (1, 16, 64)), ("reference", "bfloat16", (1, 16))):
        runtime = RuntimeConfig(max_seq_len=prefill + decode, max_batch_size=64, device=str(device),
                                numerics=numerics, dtype=dtype)
        model = init_random_(Transformer(cfg, runtime), 0).to(device)
        print(f"small config: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_routed_experts} experts, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; {numerics} numerics "
              f"({model.numerics.kernels} kernels, {model.numerics.experts} experts)")
        with torch.inference_mode():
            report(model, clock, numerics, prefill, decode, batches if not quick else (1, 2),
                   read_gb_s if numerics == "fast" else None)
        del model


def layer_config(quick: bool) -> ModelConfig:
    base = released().to_dict()
    base.update(n_layers=1, compress_ratios=[2], kv_source_layers=[0], index_source_layers=[0],
                candidate_source_layer=None, n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
                engram_layer_ids=[], engram_num_embeddings=[], vision_n_layers=0)
    if quick:
        base.update(dim=512, n_routed_experts=16, moe_inter_dim=256, vocab_size=4096, n_heads=8, q_lora_rank=256,
                    o_lora_rank=128, head_dim=128, index_n_heads=4, index_head_dim=64, index_topk=32)
    return ModelConfig.from_dict(base)


def layer(device: torch.device, clock: Clock, quick: bool, read_gb_s: float | None) -> None:
    cfg = layer_config(quick)
    prefill, decode = (64, 4) if quick else (2048, 16)
    runtime = RuntimeConfig(max_seq_len=prefill + decode, max_batch_size=64, device=str(device), numerics="fast")
    model = Transformer(cfg, runtime, device=device)
    fill_random_(model, 0)
    params = sum(p.numel() for p in model.layers.parameters())
    print(f"one release-sized layer (ratio {cfg.compress_ratios[0]}, kv + index source): {params / 1e9:.2f}B parameters "
          f"in the block, head {tuple(model.head.weight.shape)} {model.head.weight.dtype}; fast numerics "
          f"({model.numerics.experts} experts)")
    with torch.inference_mode():
        report(model, clock, "fast bf16", prefill, decode, (1, 8, 64) if not quick else (1, 2), read_gb_s)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    runtime = RuntimeConfig(max_seq_len=prefill + decode, max_batch_size=1, device=str(device), numerics="reference")
    model = Transformer(cfg, runtime, device=device)
    fill_random_(model, 0)
    with torch.inference_mode():
        report(model, clock, "reference", min(prefill, 256), 3, (1,), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--section", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="small sizes: a check that the script runs")
    args = ap.parse_args()
    device = torch.device(args.device)
    clock = Clock(device)
    read_gb_s = env(device, clock, args.quick) if "env" in args.section else None
    for name in args.section:
        if name == "grouped":
            grouped(device, clock, args.quick)
        elif name == "engram":
            engram(device, clock, args.quick)
        elif name == "small":
            small(device, clock, args.quick, read_gb_s)
        elif name == "layer":
            layer(device, clock, args.quick, read_gb_s)


if __name__ == "__main__":
    main()
