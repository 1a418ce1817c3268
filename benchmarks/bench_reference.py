"""dsv41 against the public reference, side by side in one run: prefill, decode, batch decode, the memory floor.

The reference is not part of dsv41: pass a local copy of its `inference/` folder that runs on the CPU
(the vendored copy in GitHub tenstorrent/tt-metal, `models/demos/deepseek_v3_d_p/reference/deepseek_v41/`,
carries `kernel_cpu.py`):

    python benchmarks/bench_reference.py --reference path/to/deepseek_v41 [--threads 2] [--dim 512]

One random-weight config in the released layout (every layer role; fp8 dense, fp4 experts; no Engram or
vision, which the reference builds from a tokenizer and images) is built by dsv41 and copied byte for
byte into the reference model (tools/reference_parity.py). Then, alternating between the contenders,
medians of --repeats:
- prefill of --prefill tokens (tokens/s) and --decode single-token steps after it (ms per step), for the
  reference, dsv41 `reference` numerics (invariant and BLAS kernels) and dsv41 `fast` numerics (bf16,
  fp32, and bf16 with the fp4 experts kept stored);
- the machine's memory bandwidth (a large read, and a large copy), and what fast decode's weight reads
  would cost at it: the bytes a step must read (dense weights, the chosen experts, the head) over the
  read bandwidth, the floor (and over the copy figure, for comparison);
- decode at batch 16 against batch 1 (aggregate tokens/s), fast and reference/invariant, and what
  batch 16 could give at most: its memory floor, and its multiply-adds at the rate the native bf16
  product of 16 rows reaches on warm weights.
Ratios are printed against the reference measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import ModelConfig, RuntimeConfig   # noqa: E402
from dsv41.model import Transformer                   # noqa: E402
from dsv41.model import native                       # noqa: E402
from dsv41.model.arena import huge_page_buffer, pack_weights   # noqa: E402
from dsv41.model.init import init_random_             # noqa: E402
from tools.reference_parity import copy_weights, default_dtype, import_reference, reference_args   # noqa: E402

BATCH = 16


def config(dim: int, layers: int) -> ModelConfig:
    # past eight layers, more ratio-1 layers reading layer 4's compressed rows and layer 6's choices (the
    # reference restricts every later index source to the one candidate source's blocks)
    ratios = ([0, 0, 2, 2, 1, 1, 1, 1] + [1] * max(layers - 8, 0))[:layers]
    return ModelConfig(
        vocab_size=8192, dim=dim, moe_inter_dim=dim // 2, n_layers=layers, n_heads=8, n_routed_experts=32,
        n_shared_experts=1, n_activated_experts=6, q_lora_rank=dim // 2, head_dim=128, rope_head_dim=32,
        o_groups=4, o_lora_rank=dim // 4, window_size=32, compress_ratios=tuple(ratios),
        kv_source_layers=(2, 4), index_source_layers=(2, 4, 6), index_n_heads=4, index_head_dim=64, index_topk=64,
        candidate_source_layer=4, candidate_topk_blocks=16, candidate_block_size=4, route_scale=1.5,
        swiglu_limit=10.0, original_seq_len=256, rope_factor=4, compress_rope_theta=160000.0, n_mtp_layers=0)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Contender:
    """One implementation: `prefill(ids)` then `step(ids, position)` on its own cache."""

    def __init__(self, name: str, prefill, step):
        self.name, self.prefill, self.step = name, prefill, step
        self.prefill_s: list[float] = []
        self.step_s: list[float] = []

    def measure(self, ids: torch.Tensor, prefill: int) -> None:
        self.prefill_s.append(timed(lambda: self.prefill(ids[:, :prefill])))
        steps = [timed(lambda p=p: self.step(ids[:, p:p + 1], p)) for p in range(prefill, ids.shape[1])]
        self.step_s.append(statistics.median(steps))


def dsv41_contender(name: str, cfg: ModelConfig, seed: int, max_len: int, **runtime) -> tuple[Contender, Transformer]:
    rc = RuntimeConfig(max_seq_len=max_len, max_batch_size=BATCH, **runtime)
    model = init_random_(Transformer(cfg, rc), seed)
    if rc.huge_pages:
        pack_weights(model)                  # where a loaded model's weights live (docs/NUMERICS.md N32)
    state = {}

    def prefill(ids):
        state["cache"] = model.new_cache(ids.shape[0], max_len)
        out = model(ids, 0, state["cache"])
        model.logits(out.hidden[:, -1])

    def step(ids, position):
        out = model(ids, position, state["cache"])
        model.logits(out.hidden[:, -1])

    return Contender(name, prefill, step), model


def reference_contender(module, ours: Transformer, max_len: int) -> Contender:
    with default_dtype(torch.bfloat16):
        ref = module.Transformer(reference_args(module, ours.cfg, max_len))
    copy_weights(ours, ref)

    def run(ids, position):
        with default_dtype(torch.bfloat16):
            ref(ids, position)

    return Contender("public reference", lambda ids: run(ids, 0), run)


def bandwidth_gb_s() -> tuple[float, float]:
    """(copy, read) GB/s: best of 5 copies of 256 MB (read + write counted), best of 5 sums of it (a
    read only: what a decode step's weights cost; on the 2-core EPYC here about half the copy figure,
    since one core's misses in flight bound its reads). Both buffers on 2 MB pages where the kernel
    gives them, as the packed weights are: on 4 KB pages the same sum read 23 GB/s where it read 31 on
    the AMX Xeon (N32), a floor the weights would beat."""
    src = huge_page_buffer(1 << 28)[0].view(torch.float32).fill_(1.0)
    dst = huge_page_buffer(1 << 28)[0].view(torch.float32)
    copy = min(timed(lambda: dst.copy_(src)) for _ in range(5))
    read = min(timed(lambda: src.sum()) for _ in range(5))
    return 2 * src.numel() * 4 / copy / 1e9, src.numel() * 4 / read / 1e9


def multiply_add_rate(rows: int = BATCH) -> float | None:
    """Multiply-adds per second the native bf16 product reaches on all threads with `rows` activation rows
    against a weight the caches hold (256 × 1024, best of 5 × 200 calls): the most a batch step's
    products get from this machine. None without the native library."""
    w = (torch.randn(256, 1024, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    if native.linear(x, w) is None:
        return None
    best = min(timed(lambda: [native.linear(x, w) for _ in range(200)]) for _ in range(5))
    return 200 * rows * w.numel() / best


def decode_multiply_adds(model: Transformer, rows: int) -> int:
    """Multiply-adds a decode step of `rows` rows spends on weights at least: every weight but the
    embedding and the routed experts once per row, and each row's n_activated_experts experts."""
    dense = sum(p.numel() for name, p in model.named_parameters()
                if not (name.startswith("embed.") or ".ffn.experts." in name))
    expert = sum(w.weight[0].numel() * (2 if w.scale is not None else 1)           # fp4: two values a byte
                 for block in model.layers for w in (block.ffn.experts.w1, block.ffn.experts.w2, block.ffn.experts.w3))
    return rows * (dense + model.cfg.n_activated_experts * expert)


def decode_weight_bytes(model: Transformer, experts: float | None = None) -> int:
    """Weight bytes one fast decode step reads: everything but the embedding and the unchosen experts
    (`experts` chosen per layer: n_activated_experts at batch 1, more for a batch of rows)."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("embed.") or ".ffn.experts." in name:
            continue
        total += p.numel() * p.element_size()
    cfg = model.cfg
    for block in model.layers:
        bank = block.ffn.experts
        # a stored bank's expert: its fp4 bytes and their scales
        per_expert = sum(w.weight[0].nbytes + (0 if w.scale is None else w.scale[0].nbytes)
                         for w in (bank.w1, bank.w2, bank.w3))
        total += per_expert * (cfg.n_activated_experts if experts is None else experts)
    return total


def batch_speedup(model: Transformer, prefill: int, steps: int) -> tuple[float, float, float]:
    """(ms per step at batch 1, aggregate tokens/s at batch 16 over batch 1, distinct experts a layer
    the batch-16 steps chose on average) for fast decode."""
    rates, chosen = [], []

    def counting(call):
        def counted(*args, **kwargs):
            result = call(*args, **kwargs)
            if result is not None:
                chosen.append(result[-1].unique().numel())
            return result
        return counted

    # the MoE's ids, whichever way it ran: its own call, or the block's feed-forward half in one (N35)
    for block in model.layers:
        block.ffn.routed, block.ffn_half = counting(block.ffn.routed), counting(block.ffn_half)
    for batch in (1, BATCH):
        chosen.clear()
        ids = torch.randint(0, model.cfg.vocab_size, (batch, prefill + steps), generator=torch.Generator().manual_seed(4))
        cache = model.new_cache(batch, prefill + steps)
        model(ids[:, :prefill], 0, cache)
        times = []
        for p in range(prefill, prefill + steps):
            times.append(timed(lambda p=p: model.logits(model(ids[:, p:p + 1], p, cache).hidden[:, -1])))
        rates.append((statistics.median(times), batch / statistics.median(times)))
    for block in model.layers:
        del block.ffn.routed, block.ffn_half
    # the steps' share of the calls (the prefill's come first, one per layer)
    experts = statistics.mean(chosen[len(model.layers):])
    return rates[0][0] * 1e3, rates[1][1] / rates[0][1], experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, type=Path, help="the reference's inference/ folder (CPU port)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # as each side generates: the reference's generate and dsv41's engine step run in inference mode
    with torch.inference_mode():
        run(args)


def run(args: argparse.Namespace) -> None:
    cfg = config(args.dim, args.layers)
    max_len = args.prefill + args.decode + 8
    module = import_reference(args.reference)
    invariant, model = dsv41_contender("dsv41 reference/invariant", cfg, 0, max_len)
    contenders = [reference_contender(module, model, max_len), invariant,
                  dsv41_contender("dsv41 reference/blas", cfg, 0, max_len, kernels="blas")[0]]
    fast, fast_model = dsv41_contender("dsv41 fast (bf16)", cfg, 0, max_len, numerics="fast")
    # fp32 weights: twice the bytes, but on CPUs where torch's bf16 GEMM (oneDNN) runs slower than its
    # fp32 one, the faster of the two (README, "How the numerics compute")
    fast32, fast32_model = dsv41_contender("dsv41 fast (fp32)", cfg, 0, max_len, numerics="fast", dtype="float32")
    # fp4 experts kept in their stored bytes and decoded in the kernels: the bits of fast (bf16), a
    # quarter of the expert bytes read (docs/NUMERICS.md N30)
    stored, stored_model = dsv41_contender("dsv41 fast (bf16, stored)", cfg, 0, max_len, numerics="fast",
                                           stored_experts=True)
    contenders += [fast, fast32, stored]
    ids = torch.randint(0, cfg.vocab_size, (1, args.prefill + args.decode), generator=torch.Generator().manual_seed(1))
    params = sum(p.numel() for p in model.parameters())
    print(f"dim {cfg.dim}, {cfg.n_layers} layers, top-{cfg.n_activated_experts} of {cfg.n_routed_experts} experts, "
          f"{params / 1e6:.1f}M parameters; prefill {args.prefill}, {args.decode} decode steps; "
          f"{args.threads} thread(s), medians of {args.repeats}, alternating")
    for _ in range(args.repeats):
        for c in contenders:
            c.measure(ids, args.prefill)
    base_tps = args.prefill / statistics.median(contenders[0].prefill_s)
    base_ms = statistics.median(contenders[0].step_s) * 1e3
    print(f"{'':<26} {'prefill tok/s':>13} {'decode ms':>10} {'prefill ×':>10} {'decode ×':>9}")
    for c in contenders:
        tps, ms = args.prefill / statistics.median(c.prefill_s), statistics.median(c.step_s) * 1e3
        print(f"{c.name:<26} {tps:>13.1f} {ms:>10.2f} {tps / base_tps:>9.2f}x {base_ms / ms:>8.2f}x")
    copy_gb_s, read_gb_s = bandwidth_gb_s()
    for c, m in ((fast, fast_model), (fast32, fast32_model), (stored, stored_model)):
        need, ms = decode_weight_bytes(m), statistics.median(c.step_s) * 1e3
        at_read, at_copy = need / read_gb_s / 1e6, need / copy_gb_s / 1e6
        print(f"memory: {read_gb_s:.1f} GB/s read, {copy_gb_s:.1f} GB/s copy (read + write); a {c.name} decode step "
              f"reads {need / 1e6:.1f} MB of weights, floor {at_read:.2f} ms at the read bandwidth "
              f"({at_copy:.2f} ms at the copy figure): it runs at {100 * at_read / ms:.0f}% of it ({100 * at_copy / ms:.0f}%)")
    batches = {}
    for name, m in (("fast (bf16)", fast_model), ("fast (fp32)", fast32_model), ("fast (bf16, stored)", stored_model),
                    ("reference/invariant", model)):
        one_ms, scale, experts = batches[name] = batch_speedup(m, args.prefill, args.decode)
        one, many = decode_weight_bytes(m), decode_weight_bytes(m, experts)
        print(f"{name} decode batch {BATCH}: {scale:.2f}x the tokens/s of batch 1 ({one_ms:.2f} ms per batch-1 step); "
              f"its steps read {experts:.1f} of {cfg.n_routed_experts} experts a layer ({cfg.n_activated_experts} at "
              f"batch 1), {many / 1e6:.0f} MB against {one / 1e6:.0f}: at the memory floor batch {BATCH} gives at most "
              f"{BATCH * one / many:.2f}x")
    rate = multiply_add_rate()
    if rate is not None:
        # bounds against batch 1 as measured: batch 16 steps no faster than its memory floor, nor than its
        # products take at the rate this build's native product of 16 rows reaches on warm weights (dot
        # products, or AMX tiles where the CPU has them: N36, N37)
        one_ms, _, experts = batches["fast (bf16)"]
        macs = decode_multiply_adds(fast_model, BATCH)
        compute_ms, memory_ms = macs / rate * 1e3, decode_weight_bytes(fast_model, experts) / read_gb_s / 1e6
        print(f"compute: the native bf16 product of {BATCH} rows reaches {rate / 1e9:.1f} G multiply-adds/s here; a "
              f"fast (bf16) batch-{BATCH} step needs {macs / 1e9:.2f} G at least, {compute_ms:.1f} ms at that rate, and "
              f"reads its weights in {memory_ms:.1f} ms at the floor: against batch 1 as measured ({one_ms:.2f} ms), "
              f"batch {BATCH} gives at most {BATCH * one_ms / memory_ms:.2f}x at the memory floor and "
              f"{BATCH * one_ms / max(compute_ms, memory_ms):.2f}x with these kernels")


if __name__ == "__main__":
    main()
