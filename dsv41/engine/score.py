"""Teacher-forced scoring: next-token logits and log-probabilities of given token sequences.

Shapes: N sequences, T positions (the longest sequence), V vocab.

Sequences of different lengths run as one batch, right-padded with PAD_FILL. Attention is causal, so
padding after a sequence's end never reaches its real positions; the logits at padded positions are
set to 0 and `lengths` says where each sequence ends.

`prefill=N` runs positions 0 … N − 1 as one call and every later position as its own single-token
call, which is the decode path a generation takes: comparing it with a full prefill checks that the
cache reproduces what the model computes in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .generate import check_prompts

# Any id the model accepts; causal attention keeps it from influencing real positions.
PAD_FILL = 0


@dataclass
class ScoreResult:
    token_logprobs: list[torch.Tensor]
    """Per sequence, fp32 [len − 1]: entry t is log p(token t + 1 | tokens 0 … t)."""
    perplexity: list[float]
    """exp(−mean log-prob) per sequence; NaN for a one-token sequence."""
    logits: torch.Tensor
    """fp32 [N, T, V]: entry t is the next-token logits after token t; 0 at padded positions."""
    lengths: list[int]


def pad_sequences(sequences: list[list[int]], device) -> torch.Tensor:
    """[N, T] long, right-padded with PAD_FILL."""
    width = max(len(s) for s in sequences)
    ids_NT = torch.full((len(sequences), width), PAD_FILL, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids_NT[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    return ids_NT.to(device)


@torch.no_grad()
def teacher_forced_logits(model, ids_NT: torch.Tensor, prefill: int | None) -> torch.Tensor:
    """fp32 [N, T, V]: one call for the first `prefill` positions (all when None), then one per position."""
    T = ids_NT.shape[1]
    first = T if prefill is None else prefill
    cache = model.new_cache(ids_NT.shape[0], T)
    pieces = [model.logits(model(ids_NT[:, :first], 0, cache).hidden).float()]
    for pos in range(first, T):
        pieces.append(model.logits(model(ids_NT[:, pos:pos + 1], pos, cache).hidden).float())
    return torch.cat(pieces, dim=1)


def next_token_logprobs(logits_NTV: torch.Tensor, ids_NT: torch.Tensor) -> torch.Tensor:
    """fp32 [N, T − 1]: log-softmax of entry t evaluated at token t + 1."""
    logp_NTV = F.log_softmax(logits_NTV[:, :-1].float(), dim=-1)
    return logp_NTV.gather(-1, ids_NT[:, 1:, None]).squeeze(-1)


def _perplexity(logprobs: torch.Tensor) -> float:
    return math.exp(-float(logprobs.double().mean())) if logprobs.numel() else float("nan")


def score(model, sequences: list[list[int]], prefill: int | None = None, *,
          max_context: int | None = None) -> ScoreResult:
    """Score token sequences against the model (context: max_context or the model's max_seq_len)."""
    check_prompts(sequences, max_context or model.runtime.max_seq_len, model.cfg.vocab_size, what="sequence")
    ids_NT = pad_sequences(sequences, model.device)
    if prefill is not None and not 1 <= prefill <= ids_NT.shape[1]:
        raise ValueError(f"prefill must be in 1 … {ids_NT.shape[1]} (the longest sequence), got {prefill}")
    logits_NTV = teacher_forced_logits(model, ids_NT, prefill)
    lengths = [len(s) for s in sequences]
    for i, n in enumerate(lengths):
        logits_NTV[i, n:] = 0.0
    logprobs_NT = next_token_logprobs(logits_NTV, ids_NT)
    per_seq = [logprobs_NT[i, :n - 1].cpu() for i, n in enumerate(lengths)]
    return ScoreResult(token_logprobs=per_seq, perplexity=[_perplexity(lp) for lp in per_seq],
                       logits=logits_NTV.cpu(), lengths=lengths)
