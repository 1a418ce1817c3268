"""DSpark speculation on the trained demo: acceptance, tokens per verify pass, and the wall-clock speed-up.

For each numerics mode, the same greedy requests (chat-encoded and raw prompts, a fixed number of new
tokens) run plain and with --speculative, alternating, medians of --repeats. It prints:
- whether the two outputs are identical (speculation is lossless; greedy must match token for token);
- drafts accepted / proposed, and the mean tokens committed per verify pass (1 + accepted per cycle);
- the wall-clock ratio plain / speculative.
Run: python benchmarks/bench_demo_speculative.py [--threads N] [--tokens N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dsv41
from dsv41.chat import encode_messages
from dsv41.config import RuntimeConfig
from dsv41.demo import TRAINED_DEMO
from dsv41.engine.engine import GenerationConfig, generate_all
from dsv41.engine.sampling import SamplingParams
from dsv41.tokenizer import Tokenizer

CHATS = ["Hello, who are you?", "What news from the court?", "Speak, my lord, what would you have me do?"]
RAW = ["ROMEO:\n", "First Citizen:\nWe are accounted poor citizens", "KING HENRY VI:\n"]


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    chats = [tokenizer.encode_prompt(encode_messages([{"role": "user", "content": c}])) for c in CHATS]
    return chats + [[tokenizer.bos_id] + tokenizer.encode(r) for r in RAW]


def run(model, tokenizer, ids, tokens: int, speculative: bool):
    config = GenerationConfig(max_new_tokens=tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True,
                              speculative=speculative)
    start = time.perf_counter()
    done = [generate_all(model, tokenizer, [p], config)[0] for p in ids]       # one request at a time
    return time.perf_counter() - start, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_dir(TRAINED_DEMO)
    ids = prompts(tokenizer)
    print(f"trained demo, {len(ids)} prompts one at a time, {args.tokens} greedy tokens each, {args.threads} "
          f"thread(s), medians of {args.repeats}")
    print(f"{'numerics':<10} {'identical':>9} {'accepted':>13} {'tokens/pass':>11} {'plain s':>8} {'spec s':>7} "
          f"{'speed-up':>8}")
    for numerics, dtype in (("fast", "float32"), ("reference", "bfloat16")):
        model = dsv41.load(TRAINED_DEMO, RuntimeConfig(max_seq_len=1024, numerics=numerics, dtype=dtype))
        run(model, tokenizer, ids[:1], 4, False)                                   # warm-up, not timed
        run(model, tokenizer, ids[:1], 4, True)
        plain_t, spec_t = [], []
        for _ in range(args.repeats):
            t, plain = run(model, tokenizer, ids, args.tokens, False)
            plain_t.append(t)
            t, spec = run(model, tokenizer, ids, args.tokens, True)
            spec_t.append(t)
        same = all(a.token_ids == b.token_ids for a, b in zip(plain, spec))
        drafted, accepted = sum(c.drafted for c in spec), sum(c.accepted for c in spec)
        # after the prefill's token, each verify pass commits 1 + its accepted drafts
        after_first = sum(c.generated_tokens - 1 for c in spec)
        passes = after_first - accepted
        per_pass = after_first / passes if passes else float("nan")
        p, s = statistics.median(plain_t), statistics.median(spec_t)
        print(f"{numerics:<10} {'yes' if same else 'NO':>9} {f'{accepted}/{drafted}':>13} {per_pass:>11.2f} "
              f"{p:>8.2f} {s:>7.2f} {p / s:>7.2f}x")


if __name__ == "__main__":
    main()
