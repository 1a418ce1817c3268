"""Teacher-forced scoring: next-token logits and log-probabilities of given token sequences.

Shapes: N sequences, T positions (the longest sequence), V vocab.

Each sequence is a request of the engine that generates nothing and keeps the logits of every prompt
position, so scoring takes the engine's one chunked-prefill path; sequences of different lengths run
side by side in their own slots. Logits of a sequence's positions past its end are 0 in the padded
result, and `lengths` says where each sequence ends.

`prefill=N` feeds positions 0 … N − 1 at once and every later position on its own, the decode path a
generation takes: comparing it with a whole-sequence prefill checks that the cache reproduces what the
model computes in one pass (with invariant kernels, bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .engine import Engine, EngineConfig
from .request import Request, check_prompts
from ..errors import InputError


@dataclass
class ScoreResult:
    token_logprobs: list[torch.Tensor]
    """Per sequence, fp32 [len − 1]: entry t is log p(token t + 1 | tokens 0 … t)."""
    perplexity: list[float]
    """exp(−mean log-prob) per sequence; NaN for a one-token sequence."""
    logits: torch.Tensor
    """fp32 [N, T, V]: entry t is the next-token logits after token t; 0 past a sequence's end."""
    lengths: list[int]


def next_token_logprobs(logits_TV: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """fp32 [T − 1]: log-softmax of entry t evaluated at token t + 1."""
    logp = F.log_softmax(logits_TV[:-1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:], device=logp.device)[:, None]).squeeze(-1)


def _perplexity(logprobs: torch.Tensor) -> float:
    return math.exp(-float(logprobs.double().mean())) if logprobs.numel() else float("nan")


def score(model, sequences: list[list[int]], prefill: int | None = None, *,
          max_context: int | None = None) -> ScoreResult:
    """Score token sequences against the model (context: max_context or the model's max_seq_len)."""
    context = max_context or model.runtime.max_seq_len
    check_prompts(sequences, context, model.cfg.vocab_size, what="sequence")
    width = max(len(s) for s in sequences)
    if prefill is not None and not 1 <= prefill <= width:
        raise InputError(f"prefill must be in 1 … {width} (the longest sequence), got {prefill}")
    engine = Engine(model, None, EngineConfig(n_slots=len(sequences), max_context=context, prefix_cache=0,
                                              token_budget=max(sum(map(len, sequences)), 1), prefill_chunk=width))
    for seq in sequences:
        engine.submit(Request(prompt=tuple(seq), max_new_tokens=0, prompt_logits=True, first_chunk=prefill,
                              prefill_chunk=None if prefill is None else 1))
    done = sorted((e.completion for e in engine.run() if e.completion is not None), key=lambda c: c.request)
    logits = torch.zeros(len(sequences), width, model.cfg.vocab_size)
    for i, c in enumerate(done):
        logits[i, :c.prompt_tokens] = c.prompt_logits
    per_seq = [next_token_logprobs(logits[i, :len(s)], s) for i, s in enumerate(sequences)]
    return ScoreResult(token_logprobs=per_seq, perplexity=[_perplexity(lp) for lp in per_seq], logits=logits,
                       lengths=[len(s) for s in sequences])
