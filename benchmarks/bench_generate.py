"""Generation speed of the demo model through the engine: prefill tokens/s, TTFT and decode ms/token,
for batch 1 and batch 4 (random weights: plumbing cost only, like docs/GENERATION-AND-DSPARK.md §1.4).

Run from the repository root: python -m benchmarks.bench_generate [--numerics fast] [--threads N]
Prefill is timed as a bare forward of the whole prompt (best of 3); TTFT and decode come from
`generate` with EOS ignored, so every row produces exactly --new tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

import dsv41
from dsv41.config import RuntimeConfig
from dsv41.demo import ensure_demo_checkpoint
from dsv41.engine.engine import GenerationConfig, generate_all
from dsv41.engine.sampling import SamplingParams
from dsv41.tokenizer import Tokenizer


def prompts_of(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[0] + torch.randint(3, vocab, (length - 1,), generator=g).tolist() for _ in range(batch)]


@torch.no_grad()
def prefill_seconds(model, prompts: list[list[int]], repeat: int = 3) -> float:
    ids = torch.tensor(prompts, device=model.device)
    best = float("inf")
    for _ in range(repeat):
        cache = model.new_cache(len(prompts), ids.shape[1])
        t0 = time.perf_counter()
        model.logits(model(ids, 0, cache).hidden[:, -1])
        best = min(best, time.perf_counter() - t0)
    return best


def bench(model, tok, batch: int, prompt_len: int, new_tokens: int) -> str:
    prompts = prompts_of(batch, prompt_len, tok.vocab_size)
    prefill_s = prefill_seconds(model, prompts)
    config = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    completions = generate_all(model, tok, prompts, config)
    ttft_ms = max(c.ttft_s for c in completions) * 1e3
    step_ms = 1e3 / min(c.tokens_per_s for c in completions)          # one step advances every row
    return (f"batch {batch}: prefill {batch * prompt_len / prefill_s:8.0f} tok/s ({prefill_s * 1e3:6.1f} ms for "
          f"{batch}×{prompt_len}) | TTFT {ttft_ms:6.1f} ms | decode {step_ms:6.1f} ms/step = "
          f"{step_ms / batch:6.1f} ms/token ({batch * 1e3 / step_ms:5.1f} tok/s over the batch)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numerics", choices=("reference", "fast"), default="reference")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=16, help="tokens generated per row")
    # The demo is launch-bound: on a small shared CPU, thread hand-off costs more than it saves (measured
    # 0.93 s/step with 2 threads vs 0.12 s with 1 while other processes ran; see tests/conftest.py).
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_demo_checkpoint()
    dtype = "bfloat16" if args.numerics == "reference" else "float32"
    model = dsv41.load(path, RuntimeConfig(max_batch_size=4, max_seq_len=256, numerics=args.numerics, dtype=dtype))
    tok = Tokenizer.from_dir(path)
    print(f"demo model, numerics {args.numerics} ({dtype}), {torch.get_num_threads()} thread(s), "
          f"prompt {args.prompt_len}, {args.new} new tokens per row")
    bench(model, tok, 1, args.prompt_len, 4)                           # warm-up
    for batch in (1, 4):
        print(bench(model, tok, batch, args.prompt_len, args.new), flush=True)


if __name__ == "__main__":
    main()
