"""Token sampling as a pure function of logits and an explicit torch.Generator (STYLE.md P10).

Shape legend: B batch rows, V vocabulary, L previous-token positions.

Order of transforms: repetition penalty -> logit bias -> temperature -> top-k -> top-p -> min-p -> draw.
`probabilities` returns the final distribution so the speculative decoder can use the same
p_t / p_d (docs/GENERATION-AND-DSPARK.md §3); `sample` draws from it. Nothing here touches the global
RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError

# Below this temperature a distribution is one-hot at the argmax (docs/GENERATION-AND-DSPARK.md §3,
# step 1: "one-hot argmax when T_s < 1e-5"); temperature 0 is therefore greedy decoding.
GREEDY_TEMPERATURE = 1e-5

PreviousTokens = list[list[int]] | torch.Tensor | None


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise InputError(f"SamplingParams.{field} must be {rule}; got {value!r}")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_bias_pair(pair: object) -> bool:
    if not (isinstance(pair, tuple) and len(pair) == 2):
        return False
    token, bias = pair
    return isinstance(token, int) and not isinstance(token, bool) and token >= 0 and _is_real(bias) \
        and -100 <= bias <= 100


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; CTRL-style (Keskar et al. 2019)
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, added to its logit) pairs, OpenAI's `logit_bias`: ±100 bans or forces a token."""

    def __post_init__(self) -> None:
        t, k, p, m, r = (self.temperature, self.top_k, self.top_p, self.min_p,
                         self.repetition_penalty)
        _require(_is_real(t) and t >= 0, "temperature", "a finite number >= 0", t)
        _require(isinstance(k, int) and not isinstance(k, bool) and k >= 0, "top_k",
                 "an integer >= 0 (0 = off)", k)
        _require(_is_real(p) and 0 < p <= 1, "top_p", "in (0, 1]", p)
        _require(_is_real(m) and 0 <= m <= 1, "min_p", "in [0, 1]", m)
        _require(_is_real(r) and r > 0, "repetition_penalty", "a finite number > 0", r)
        bias = self.logit_bias
        _require(isinstance(bias, tuple) and all(_is_bias_pair(pair) for pair in bias), "logit_bias",
                 "(token id >= 0, bias in [-100, 100]) pairs", bias)
        _require(len({i for i, _ in bias}) == len(bias), "logit_bias", "pairs with distinct token ids", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def seen_token_mask(previous_tokens: PreviousTokens, batch: int, vocab: int,
                    device: torch.device) -> torch.Tensor:
    """[B, V] bool: token v occurs in row b's history. Tensor rows may be padded with ids < 0."""
    ids_BL = _history_tensor(previous_tokens, batch, device)
    if ids_BL.numel() and int(ids_BL.max()) >= vocab:
        raise InputError(f"previous_tokens holds id {int(ids_BL.max())} >= vocab size {vocab}")
    ids_BL = ids_BL.masked_fill(ids_BL < 0, vocab)  # padding lands in a spare column
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, ids_BL, True)
    return seen[:, :vocab]


def _history_tensor(previous_tokens: PreviousTokens, batch: int,
                    device: torch.device) -> torch.Tensor:
    if isinstance(previous_tokens, torch.Tensor):
        ids_BL = previous_tokens.to(device=device, dtype=torch.long)
    else:
        rows = list(previous_tokens)
        if len(rows) != batch:
            raise InputError(f"previous_tokens has {len(rows)} rows for a batch of {batch}")
        width = max((len(r) for r in rows), default=0)
        ids_BL = torch.tensor([list(r) + [-1] * (width - len(r)) for r in rows],
                              dtype=torch.long, device=device).reshape(batch, width)
    if ids_BL.dim() != 2 or ids_BL.shape[0] != batch:
        raise InputError(f"previous_tokens must be [B={batch}, L]; got {tuple(ids_BL.shape)}")
    return ids_BL


def apply_repetition_penalty(logits_BV: torch.Tensor, previous_tokens: PreviousTokens,
                             penalty: float) -> torch.Tensor:
    # CTRL rule: for tokens already seen, positive logits are divided by the penalty and
    # negative ones multiplied, so a penalty > 1 always makes them less likely.
    if penalty == 1.0 or previous_tokens is None:
        return logits_BV
    batch, vocab = logits_BV.shape
    seen_BV = seen_token_mask(previous_tokens, batch, vocab, logits_BV.device)
    penalised_BV = torch.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
    return torch.where(seen_BV, penalised_BV, logits_BV)


def apply_logit_bias(logits_BV: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """Add each pair's bias to its token's logit (a new tensor; the model's logits stay as they were)."""
    if not bias:
        return logits_BV
    ids = [i for i, _ in bias]
    if max(ids) >= logits_BV.shape[-1]:
        raise InputError(f"logit_bias names token {max(ids)}; the vocabulary has {logits_BV.shape[-1]} tokens")
    out_BV = logits_BV.clone()
    out_BV[:, ids] += torch.tensor([b for _, b in bias], dtype=out_BV.dtype, device=out_BV.device)
    return out_BV


def _mask_top_k(logits_BV: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= logits_BV.shape[-1]:
        return logits_BV
    top_idx_BK = logits_BV.topk(k, dim=-1).indices  # exactly k survivors, ties broken by topk
    keep_BV = torch.zeros_like(logits_BV, dtype=torch.bool).scatter_(1, top_idx_BK, True)
    return logits_BV.masked_fill(~keep_BV, float("-inf"))


def _renormalise(probs_BV: torch.Tensor, keep_BV: torch.Tensor) -> torch.Tensor:
    kept_BV = probs_BV * keep_BV
    return kept_BV / kept_BV.sum(dim=-1, keepdim=True)


def _keep_top_p(probs_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep the shortest prefix (by descending probability) whose mass reaches top_p: token i of
    # the sorted order stays iff the mass strictly before it is still below top_p.
    if top_p >= 1.0:
        return probs_BV
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    # Exclusive prefix sums (not cumsum - p, whose rounding can differ from the inclusive sums);
    # the leading 0 means the most likely token always survives.
    cumulative_BV = torch.cumsum(sorted_BV, dim=-1)
    mass_before_BV = torch.cat([torch.zeros_like(cumulative_BV[:, :1]), cumulative_BV[:, :-1]], 1)
    keep_sorted_BV = mass_before_BV < top_p
    keep_BV = torch.zeros_like(keep_sorted_BV).scatter_(1, order_BV, keep_sorted_BV)
    return _renormalise(probs_BV, keep_BV)


def _keep_min_p(probs_BV: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p == 0.0:
        return probs_BV
    floor_B1 = min_p * probs_BV.max(dim=-1, keepdim=True).values
    return _renormalise(probs_BV, probs_BV >= floor_B1)


def _one_hot_argmax(logits_BV: torch.Tensor) -> torch.Tensor:
    best_B1 = logits_BV.argmax(dim=-1, keepdim=True)
    return torch.zeros_like(logits_BV).scatter_(1, best_B1, 1.0)


def _as_logits(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise InputError(f"logits must be [B, V]; got shape {tuple(logits.shape)}")
    return logits.float()


def probabilities(logits: torch.Tensor, params: SamplingParams,
                  previous_tokens: PreviousTokens = None) -> torch.Tensor:
    """[B, V] fp32 distribution after every transform; one-hot at the argmax when greedy."""
    logits_BV = apply_repetition_penalty(_as_logits(logits), previous_tokens,
                                         params.repetition_penalty)
    logits_BV = apply_logit_bias(logits_BV, params.logit_bias)
    if params.greedy:
        return _one_hot_argmax(logits_BV)
    logits_BV = _mask_top_k(logits_BV / params.temperature, params.top_k)
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return _keep_min_p(_keep_top_p(probs_BV, params.top_p), params.min_p)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           previous_tokens: PreviousTokens = None) -> torch.Tensor:
    """[B] long token ids drawn from `probabilities`; greedy needs no generator."""
    probs_BV = probabilities(logits, params, previous_tokens)
    if params.greedy:
        return probs_BV.argmax(dim=-1)
    if generator is None:
        raise InputError("sampling with temperature > 0 needs an explicit torch.Generator")
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
