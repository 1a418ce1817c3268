"""Hyper-connections: the residual stream carried as S parallel streams (docs/ARCHITECTURE.md §5, §7).

Shapes: B batch, T positions, S streams (hc_mult), D dim, M = (2 + S)·S mix width.

Each sublayer computes, from the flattened stream, `pre` (how to read the streams; used by the *next*
sublayer, trap 1), `post` (how much of the sublayer output each stream receives) and `comb` (a doubly
stochastic S×S residual mix made by Sinkhorn, applied transposed, trap 2). All of it is fp32.
"""

from __future__ import annotations

import torch

from .numerics import Numerics


def sinkhorn(c: torch.Tensor, iters: int, eps: float, numerics: Numerics) -> torch.Tensor:
    """c [..., S, S] logits → near doubly stochastic; row softmax first, ends on a column step (§7.4)."""
    # the row softmax written out as exp / sum, as the reference kernel computes it (same rounding)
    c = numerics.exp(c - c.amax(dim=-1, keepdim=True))
    c = c / c.sum(dim=-1, keepdim=True) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def split_mixes(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: int, iters: int,
                eps: float, numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m [..., M] → pre [..., S], post [..., S], comb [..., S, S] (§7.3)."""
    s = streams
    pre = numerics.sigmoid(m[..., :s] * scale[0] + base[:s]) + eps
    post = 2 * numerics.sigmoid(m[..., s:2 * s] * scale[1] + base[s:2 * s])
    comb = (m[..., 2 * s:] * scale[2] + base[2 * s:]).unflatten(-1, (s, s))
    return pre, post, sinkhorn(comb, iters, eps, numerics)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """hc_pre: bf16(Σ_i pre_i · X_i); x [B, T, S, D], pre [B, T, S] → [B, T, D]."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)


def expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post: stream j = bf16(post_j · o + Σ_i comb[i][j] · R_i); → [B, T, S, D]."""
    # summed over i as a plain reduction (not a matmul) so the fp32 rounding matches the reference
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(dim=2)
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


def identity_pre(batch: int, length: int, streams: int, device=None) -> torch.Tensor:
    """The one-hot pre-mix that feeds layer 0's attention with stream 0 (§4 step 4)."""
    pre = torch.zeros(batch, length, streams, device=device, dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre


def mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int,
          norm_eps: float, hc_eps: float, numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_mixes: x [B, T, S, D] → (pre, post, comb) with fn [M, S·D], scale [3], base [M] (§7).

    One RMS statistic over all S·D features, no norm weight (§7.2).
    """
    flat = x.flatten(2).float()
    m = numerics.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return split_mixes(m, scale, base, x.shape[2], iters, hc_eps, numerics)
