"""Lossless speculative decoding with the DSpark draft stages (GENERATION-AND-DSPARK.md §3).

Shapes: k drafts per cycle (dspark_block_size), V vocab; one sequence (batch 1: rows that accept
different numbers of drafts would no longer share positions).

A cycle at last filled position p with the next token t (for position p + 1):
1. draft k tokens d_1 … d_k from the DSpark rings, sampling each from its draft distribution p_d;
2. verify: one target forward over [t, d_1 … d_k] at positions p + 1 … p + k + 1 (a snapshot of the
   cache is taken first), giving the target distributions p_t of positions p + 2 … p + k + 2;
3. accept d_i while u_i < min(1, p_t(d_i) / p_d(d_i)); at the first rejection sample from
   normalise(max(p_t − p_d, 0)), or, if all k were accepted, a bonus token from the last p_t;
4. roll the cache back to the accepted positions and feed their main rows to the DSpark rings.
The output distribution is the target's (standard speculative sampling); at temperature 0 both
distributions are one-hot and the output equals greedy decoding of the target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, probabilities

# A residual with less mass than this falls back to the target distribution (§3 step 5).
RESIDUAL_FLOOR = 1e-8
# Ratios are taken against max(p_d, this) (§3 step 4).
DRAFT_PROB_FLOOR = 1e-8


def accept_drafts(p_target: torch.Tensor, p_draft: torch.Tensor, drafts: torch.Tensor,
                  generator: torch.Generator) -> tuple[int, int]:
    """The standard rule on one sequence: p_target [k + 1, V], p_draft [k, V], drafts [k].

    → (accepted count a, the token that follows them: a residual sample or the bonus token).
    """
    k = drafts.shape[0]
    for i in range(k):
        d = int(drafts[i])
        ratio = p_target[i, d] / max(float(p_draft[i, d]), DRAFT_PROB_FLOOR)
        u = torch.rand((), generator=generator, device=p_target.device)
        if u >= min(1.0, float(ratio)):
            residual = (p_target[i] - p_draft[i]).clamp(min=0)
            mass = float(residual.sum())
            dist = residual / mass if mass > RESIDUAL_FLOOR else p_target[i]
            return i, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(p_target[k], 1, generator=generator))


@dataclass
class SpeculativeStats:
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)
    """How often draft i (1-based: index i − 1) was accepted."""

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify pass: accepted drafts + the one sampled token."""
        return (self.accepted + self.cycles) / max(self.cycles, 1)


@dataclass
class SpeculativeResult:
    token_ids: list[int]
    stats: SpeculativeStats
    seconds: float


@torch.no_grad()
def speculative_generate(model, prompt: list[int], max_new_tokens: int, *, params: SamplingParams | None = None,
                         seed: int = 0, eos_id: int | None = None, max_seq_len: int | None = None,
                         prefill_chunk: int = 512) -> SpeculativeResult:
    """Generate up to `max_new_tokens` after `prompt` (token ids), drafting with DSpark.

    Stops at EOS, at `max_new_tokens`, or when a verify pass would no longer fit the context.
    """
    if not model.cfg.dspark_enabled:
        raise RuntimeError("speculative decoding needs DSpark stages (n_mtp_layers / dspark_block_size are 0)")
    params = params or SamplingParams(temperature=0.0)
    if params.repetition_penalty != 1.0:
        # each verified row would need its own history (prompt + drafts before it); not supported
        raise ValueError("speculative decoding does not support a repetition penalty")
    k = model.cfg.dspark_block_size
    context = max_seq_len or model.runtime.max_seq_len
    if len(prompt) + 1 > context:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds {context}")
    start = time.perf_counter()
    gen = torch.Generator(device=model.device).manual_seed(seed)
    cache = model.new_cache(1, context)
    token, last = _prefill(model, prompt, cache, params, gen, prefill_chunk), len(prompt) - 1
    out, stats = [token], SpeculativeStats(per_position=[0] * k)
    while len(out) < max_new_tokens and eos_id not in out and last + 2 + k <= context:
        committed = _cycle(model, cache, token, last, params, gen, stats)
        out += committed
        last += len(committed)
        token = committed[-1]
    out = out[:max_new_tokens]
    if eos_id is not None and eos_id in out:
        out = out[:out.index(eos_id)]
    return SpeculativeResult(out, stats, time.perf_counter() - start)


def _prefill(model, prompt, cache, params, gen, chunk) -> int:
    ids = torch.tensor([prompt], device=model.device)
    for s in range(0, len(prompt), chunk):
        out = model(ids[:, s:s + chunk], s, cache)
        model.dspark_observe(out.dspark_hidden, s, cache)
    p = probabilities(model.logits(out.hidden[:, -1]), params)
    return int(torch.multinomial(p, 1, generator=gen))


def _cycle(model, cache, token: int, last: int, params, gen, stats: SpeculativeStats) -> list[int]:
    """One draft–verify–accept cycle; returns the committed tokens (accepted drafts + one more)."""
    draft_probs = []

    def choose(row_logits):
        p = probabilities(row_logits, params)
        draft_probs.append(p[0])
        return torch.multinomial(p, 1, generator=gen)[:, 0]

    d = model.dspark_draft(torch.tensor([token], device=model.device), last, cache, choose)
    drafts = d.ids[0, 1:]
    call = d.ids[:, :]                                                    # [1, k + 1]: t, d_1 … d_k
    snap = cache.snapshot(last + 1, call.shape[1])
    out = model(call, last + 1, cache)
    p_target = probabilities(model.logits(out.hidden[0]), params)         # [k + 1, V]
    accepted, following = accept_drafts(p_target, torch.stack(draft_probs), drafts, gen)
    cache.rollback(snap, accepted + 1)                                    # keep t and the accepted drafts
    model.dspark_observe(out.dspark_hidden[:, :accepted + 1], last + 1, cache)
    stats.cycles += 1
    stats.drafted += drafts.shape[0]
    stats.accepted += accepted
    for i in range(accepted):
        stats.per_position[i] += 1
    return drafts[:accepted].tolist() + [following]
