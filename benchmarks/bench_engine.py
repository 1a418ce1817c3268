"""The continuous-batching engine on the demo model (random weights: plumbing cost, not language).

Run from the repository root: python -m benchmarks.bench_engine [--numerics fast] [--threads N] [--quick]

1. Mixed prompt lengths: prompts of 5, 50, 500 and 2000 tokens in one batch (1 new token each) against
   prefilling one prompt of their total length; and what the previous shared-position engine would
   cost (a prefill of the shortest, then one forward per position of the longest: measured decode step
   × positions).
2. Aggregate decode tokens/s at 1, 4 and 16 concurrent requests (16-token prompts, 32 new tokens), and
   16 requests arriving over time (one every `--gap` ms): tokens/s and TTFT p50 / p99.
3. A second chat turn with prefix reuse: TTFT continuing the kept first turn against a cold prefill of
   the same prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dsv41
from dsv41.config import RuntimeConfig
from dsv41.demo import ensure_demo_checkpoint
from dsv41.engine.engine import Engine, EngineConfig
from dsv41.engine.request import Request
from dsv41.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def random_prompt(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple([0] + torch.randint(3, vocab, (n - 1,), generator=g).tolist())


def run(engine: Engine, requests: list[Request], arrivals_s: list[float] | None = None) -> tuple[float, list]:
    """Submit (at their arrival times, relative to the start) and run to the end → (seconds, completions)."""
    pending = list(zip(arrivals_s or [0.0] * len(requests), requests))
    done, start = [], time.perf_counter()
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            engine.submit(pending.pop(0)[1])
        if not engine.has_work:
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        done += [e.completion for e in engine.step() if e.completion is not None]
    return time.perf_counter() - start, done


def mixed_lengths(model, lengths: list[int]) -> None:
    vocab, total = model.cfg.vocab_size, sum(lengths)
    context = total + 8
    mixed = Engine(model, None, EngineConfig(n_slots=len(lengths), max_context=context, prefix_cache=0))
    seconds, _ = run(mixed, [Request(random_prompt(n, vocab, n), max_new_tokens=1, sampling=GREEDY) for n in lengths])
    alone = Engine(model, None, EngineConfig(n_slots=1, max_context=context, prefix_cache=0))
    one, _ = run(alone, [Request(random_prompt(total, vocab, 1), max_new_tokens=1, sampling=GREEDY)])
    step = decode_step_seconds(model, len(lengths), context)
    shared = one * min(lengths) / total + step * (max(lengths) - min(lengths))
    print(f"1. prompts of {lengths} in one batch: {seconds:.2f} s; one prompt of their total ({total}): {one:.2f} s "
          f"(ratio {seconds / one:.2f}); shared-position engine (estimate): {shared:.1f} s "
          f"({shared / seconds:.0f}x slower)")


def decode_step_seconds(model, rows: int, context: int) -> float:
    engine = Engine(model, None, EngineConfig(n_slots=rows, max_context=context, prefix_cache=0))
    for i in range(rows):
        engine.submit(Request(random_prompt(16, model.cfg.vocab_size, i), max_new_tokens=12, sampling=GREEDY,
                              ignore_eos=True))
    engine.step()
    times = []
    while engine.has_work:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def concurrency(model, counts: list[int], new_tokens: int, gap_ms: float) -> None:
    vocab = model.cfg.vocab_size
    print(f"2. {new_tokens} new tokens per request, 16-token prompts")
    for n in counts:
        engine = Engine(model, None, EngineConfig(n_slots=n, max_context=64 + new_tokens, prefix_cache=0))
        reqs = [Request(random_prompt(16, vocab, i), max_new_tokens=new_tokens, sampling=GREEDY, ignore_eos=True)
                for i in range(n)]
        seconds, done = run(engine, reqs)
        print(f"   {n:>2} concurrent: {n * new_tokens / seconds:7.1f} tok/s aggregate, "
              f"TTFT p50 {percentile([c.ttft_s for c in done], 50) * 1e3:6.0f} ms")
    n = max(counts)
    engine = Engine(model, None, EngineConfig(n_slots=n, max_context=64 + new_tokens, prefix_cache=0))
    reqs = [Request(random_prompt(16, vocab, 100 + i), max_new_tokens=new_tokens, sampling=GREEDY, ignore_eos=True)
            for i in range(n)]
    seconds, done = run(engine, reqs, [i * gap_ms / 1e3 for i in range(n)])
    ttft = [c.ttft_s for c in done]
    print(f"   {n} arriving every {gap_ms:.0f} ms: {n * new_tokens / seconds:7.1f} tok/s aggregate, TTFT p50 "
          f"{percentile(ttft, 50) * 1e3:.0f} ms, p99 {percentile(ttft, 99) * 1e3:.0f} ms")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def second_turn(model, first_len: int, turn_len: int) -> None:
    vocab = model.cfg.vocab_size
    first = random_prompt(first_len, vocab, 7)
    warm = Engine(model, None, EngineConfig(n_slots=2, max_context=first_len + turn_len + 64))
    _, [c1] = run(warm, [Request(first, max_new_tokens=16, sampling=GREEDY, ignore_eos=True)])
    prompt = first + tuple(c1.token_ids) + random_prompt(turn_len, vocab, 8)[1:]
    _, [reused] = run(warm, [Request(prompt, max_new_tokens=1, sampling=GREEDY)])
    cold = Engine(model, None, EngineConfig(n_slots=1, max_context=len(prompt) + 8))
    _, [ref] = run(cold, [Request(prompt, max_new_tokens=1, sampling=GREEDY)])
    print(f"3. second chat turn of {len(prompt)} tokens ({reused.cached_tokens} kept): TTFT {reused.ttft_s * 1e3:.0f} ms "
          f"with prefix reuse, {ref.ttft_s * 1e3:.0f} ms cold ({ref.ttft_s / reused.ttft_s:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numerics", choices=("reference", "fast"), default="reference")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gap", type=float, default=150.0, help="ms between arrivals in part 2")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (prompts up to 500, 8 new tokens)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = "float32" if args.numerics == "fast" else "bfloat16"
    lengths = [5, 50, 200, 500] if args.quick else [5, 50, 500, 2000]
    model = dsv41.load(ensure_demo_checkpoint(), RuntimeConfig(max_seq_len=4096, numerics=args.numerics, dtype=dtype))
    print(f"demo model, {args.numerics} numerics ({model.numerics.kernels} kernels), {torch.get_num_threads()} "
          f"thread(s)")
    with torch.no_grad():
        mixed_lengths(model, lengths)
        concurrency(model, [1, 4, 16], 8 if args.quick else 32, args.gap)
        second_turn(model, 200 if args.quick else 1000, 20)


if __name__ == "__main__":
    main()
