"""The CPU kernel choices of both numerics (numerics.py `cpu_kernels`, `native`), each against torch's
default in the same run:

- index scores (a product of two bf16 activations) whose key count grows by one per call, as in
  decoding, and at a repeated shape: bf16 (oneDNN builds a kernel per new shape) against fp32 copies;
- one-row products at decode shapes: torch's bf16 and fp32 `mm` against the native bf16 product
  (fast), and the invariant float64 product against the native exact one (reference);
- the hyper-connection mixes (20 Sinkhorn iterations on 4×4 matrices) at decode row counts: torch ops
  against NumPy and the native kernel;
- one layer's routed experts for 1 and 16 tokens: the torch loop against the native call;
- the routed experts of 12 dim-1024 layers read in turn, as a decode step reads them (held bf16 and
  stored fp4 banks, 1 and 16 tokens): the rate the native kernel reads the chosen experts' bytes at,
  against a plain sum of a buffer in the same run (N41);
- a whole decode step of the bench_reference config (batch 1 and 16) under each policy: models with
  the same weights, their steps alternating; fast numerics without and with the CPU kernels and the
  native ones, reference numerics (invariant kernels) without and with the native ones.

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

from benchmarks.bench_reference import bandwidth_gb_s, config  # noqa: E402
from dsv41.config import RuntimeConfig                       # noqa: E402
from dsv41.model import Transformer, hyper, native           # noqa: E402
from dsv41.model.arena import WeightArena                     # noqa: E402
from dsv41.model.init import init_random_                    # noqa: E402
from dsv41.model.moe import RoutedExperts                    # noqa: E402
from dsv41.model.numerics import FAST, REFERENCE, Numerics   # noqa: E402

CPU = Numerics("fast", "blas", cpu_kernels=True)
CPU_NATIVE = Numerics("fast", "blas", cpu_kernels=True, native=True)
REFERENCE_NATIVE = Numerics("reference", "invariant", native=True)


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


def products(calls: int = 200) -> None:
    print("one-row products x [1, K] · w [N, K]ᵀ (µs per call):")
    g = torch.Generator().manual_seed(2)
    for K, N in ((512, 256), (256, 512), (512, 8192), (4096, 1024)):
        w = torch.randn(N, K, generator=g).bfloat16()
        x = torch.randn(1, K, generator=g).bfloat16()
        w32, x32 = w.float(), x.float()
        bf16 = per_call_us(lambda i: torch.mm(x, w.t()), calls)
        fp32 = per_call_us(lambda i: torch.mm(x32, w32.t()), calls)
        fast = per_call_us(lambda i: CPU_NATIVE.linear(x, w), calls)
        exact = per_call_us(lambda i: REFERENCE.linear(x32, w32), calls)
        exact_native = per_call_us(lambda i: REFERENCE_NATIVE.linear(x32, w32), calls)
        print(f"  {K:5d} → {N:5d}: bf16 mm {bf16:7.1f}  fp32 mm {fp32:7.1f}  native bf16 {fast:7.1f} ({bf16 / fast:.2f}×)"
              f"   float64 fp32 {exact:8.1f}  native exact {exact_native:7.1f} ({exact / exact_native:.2f}×)")


def mixes(calls: int = 200) -> None:
    print("hyper-connection mixes with Sinkhorn, 20 iterations of 4×4 (µs per call):")
    for rows in (1, 16, hyper.INNERMOST_FROM - 1):
        g = torch.Generator().manual_seed(rows)
        m, scale, base = torch.randn(rows, 1, 24, generator=g), torch.rand(3, generator=g), torch.randn(24, generator=g)
        us = {name: per_call_us(lambda i, p=policy: hyper.split_mixes(m, scale, base, 4, 20, 1e-6, p), calls)
              for name, policy in (("torch", FAST), ("NumPy", CPU), ("native", CPU_NATIVE),
                                   ("reference torch", REFERENCE), ("reference native", REFERENCE_NATIVE))}
        print(f"  {rows:3d} rows: " + "   ".join(f"{name} {v:7.1f}" for name, v in us.items())
              + f"   (fast {us['NumPy'] / us['native']:.2f}× NumPy, reference "
                f"{us['reference torch'] / us['reference native']:.2f}×)")


def experts(calls: int = 50) -> None:
    print("routed experts, 32 of dim 512 × 256, top 6, bf16 (µs per call):")
    layers = [RoutedExperts(32, 512, 256, "bf16", 10.0, numerics=policy) for policy in (CPU, CPU_NATIVE)]
    init_random_(layers[0], 0)
    layers[1].load_state_dict(layers[0].state_dict())
    for tokens in (1, 16):
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, 512, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(32, generator=g)[:6] for _ in range(tokens)])
        w = torch.rand(tokens, 6, generator=g)
        loop, fused = (per_call_us(lambda i, layer=layer: layer(x, w, ids), calls) for layer in layers)
        print(f"  {tokens:2d} tokens: torch {loop:8.1f}   native {fused:8.1f}   ({loop / fused:.2f}×)")


def in_arena(banks: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's banks moved into one `WeightArena` (2 MB pages), as `pack_weights` places a model's."""
    named = {f"{i}.{j}": t for i, layer in enumerate(banks) for j, t in enumerate(layer)}
    arena = WeightArena.of(named)
    return [tuple(arena.place(f"{i}.{j}", t) for j, t in enumerate(layer)) for i, layer in enumerate(banks)]


def cold_experts(layers: int = 12, E: int = 32, D: int = 1024, I: int = 512, A: int = 6, rounds: int = 5) -> None:
    """Each round calls the native routed experts on every layer's banks in turn, so a layer's banks
    are read cold (12 layers of stored banks are ~320 MB, held ~1.2 GB), as a decode step reads them."""
    g = torch.Generator().manual_seed(0)

    def codes(*shape):
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)

    def exponents(*shape):                      # scales 2^-7 … 2^3: the tiles decode them in registers
        return torch.randint(120, 131, shape, generator=g, dtype=torch.uint8)

    def values(*shape):
        return (torch.randn(shape, generator=g) / 32).bfloat16()

    stored = in_arena([(codes(E, I, D // 2), codes(E, I, D // 2), codes(E, D, I // 2), exponents(E, I, D // 32),
                        exponents(E, I, D // 32), exponents(E, D, I // 32)) for _ in range(layers)])
    held = in_arena([(values(E, I, D), values(E, I, D), values(E, D, I)) for _ in range(layers)])
    expert_bytes = {"held bf16": 3 * I * D * 2, "stored fp4": 3 * I * D // 2 + 3 * I * D // 32}
    _, read = bandwidth_gb_s()
    print(f"routed experts of {layers} layers in turn, {E} of dim {D} × {I}, top {A}, bf16 operands, 2 MB pages "
          f"(ms a layer, best of {rounds}; a plain sum reads {read:.1f} GB/s here):")
    for tokens in (1, 16):
        x = torch.randn(tokens, D, generator=g).bfloat16()
        routes = [torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(tokens)]) for _ in range(layers)]
        w = torch.rand(tokens, A, generator=g)
        chosen = sum(len(torch.unique(ids)) for ids in routes) / layers
        line = []
        for name, layer_banks in (("held bf16", held), ("stored fp4", stored)):
            w1, w3, w2, *scales = layer_banks[0]
            if native.routed_experts(x, routes[0], w, w1, w3, w2, 10.0, scales=tuple(scales) or None,
                                     dtype=torch.bfloat16) is None:
                line.append(f"{name}: the native kernel declined")
                continue
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                for (w1, w3, w2, *scales), ids in zip(layer_banks, routes):
                    native.routed_experts(x, ids, w, w1, w3, w2, 10.0, scales=tuple(scales) or None,
                                          dtype=torch.bfloat16)
                best = min(best, (time.perf_counter() - start) / layers)
            rate = chosen * expert_bytes[name] / best / 1e9
            line.append(f"{name} {best * 1e3:6.3f} ({rate:5.1f} GB/s, {rate / read:4.0%} of the sum)")
        print(f"  {tokens:2d} tokens, {chosen:4.1f} experts a layer: " + "   ".join(line))


def decode(dim: int, layers: int, steps: int = 24) -> None:
    cfg = config(dim, layers)
    arms = (("fast, torch default", "fast", Numerics("fast", "blas")), ("fast, cpu_kernels", "fast", CPU),
            ("fast, + native", "fast", CPU_NATIVE), ("reference, torch", "reference", REFERENCE),
            ("reference, native", "reference", REFERENCE_NATIVE))
    models = {}
    for name, mode, policy in arms:
        model = init_random_(Transformer(cfg, RuntimeConfig(max_seq_len=200, max_batch_size=16, numerics=mode)), 0)
        for module in model.modules():
            if hasattr(module, "numerics"):
                module.numerics = policy
        models[name] = model
    print(f"decode step, dim {dim}, {layers} layers, after a 128-token prefill (ms, median of {steps - 2}):")
    for batch in (1, 16):
        ids = torch.randint(0, cfg.vocab_size, (batch, 128 + steps), generator=torch.Generator().manual_seed(1))
        caches = {name: model.new_cache(batch, 200) for name, model in models.items()}
        for name, model in models.items():
            model(ids[:, :128], 0, caches[name])
        times = {name: [] for name in models}
        logits = {}
        for p in range(128, 128 + steps):
            for name, model in models.items():
                start = time.perf_counter()
                logits[name] = model.logits(model(ids[:, p:p + 1], p, caches[name]).hidden[:, -1])
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
        same = torch.equal(logits["reference, torch"], logits["reference, native"])
        print(f"  batch {batch:2d}: " + "   ".join(f"{name} {v:7.1f}" for name, v in ms.items()))
        print(f"            fast native {ms['fast, cpu_kernels'] / ms['fast, + native']:.2f}× cpu_kernels, "
              f"{ms['fast, torch default'] / ms['fast, + native']:.2f}× torch default; reference native "
              f"{ms['reference, torch'] / ms['reference, native']:.2f}× (last logits bit-equal: {same})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        index_scores()
        if native.available():
            products()
            experts()
            cold_experts()
        mixes()
        decode(args.dim, args.layers)


if __name__ == "__main__":
    main()
