"""The indexer: which compressed positions each query attends to (ARCHITECTURE.md §11.5–11.6).

Shapes: B batch, T query positions, C compressed positions that exist, Hi indexer heads, Di indexer head
dim, Qr query rank, Dh latent width, K top-k, Nb kept candidate blocks, Bs block size.

A small side attention scores every visible compressed position: fp4-QDQ queries (one per head) against
one shared fp4-QDQ key per position, rectified, weighted per head by `weights_proj`, summed. Index keys
are owned by kv sources; index sources that are not kv sources (24, 28, 32, 36) score against their kv
source's keys and are restricted to the candidate source's kept blocks (two-level top-k).

Both top-k choices break exact ties by position (lower first, `topk.py`): summed ReLUs are often exactly
equal, and the choice must not depend on the call's shape, batch, chunking or device (trap 14).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear, RMSNorm
from .numerics import Numerics
from .rope import Rotary
from .topk import topk as ordered_topk

NEG_INF = float("-inf")


def visible_counts(start_pos: int, length: int, ratio: int, device=None) -> torch.Tensor:
    """[T]: compressed positions visible to each query, ⌊(p + 1) / r⌋ (§11.5, trap 9)."""
    positions = torch.arange(start_pos, start_pos + length, device=device)
    return (positions + 1) // ratio


class Indexer(nn.Module):
    def __init__(self, dim: int, q_lora_rank: int, head_dim: int, n_heads: int, index_head_dim: int,
                 norm_eps: float, *, owns_keys: bool, numerics: Numerics, dense: str = "fp8", device=None,
                 dtype=torch.bfloat16):
        super().__init__()
        self.n_heads, self.head_dim, self.numerics = n_heads, index_head_dim, numerics
        self.wq_b = Linear(q_lora_rank, n_heads * index_head_dim, dense, numerics=numerics, device=device, dtype=dtype)
        self.weights_proj = Linear(dim, n_heads, "bf16", numerics=numerics, device=device, dtype=dtype)
        self.owns_keys = owns_keys
        if owns_keys:
            self.wk = Linear(head_dim, index_head_dim, "bf16", numerics=numerics, device=device, dtype=dtype)
            self.k_norm = RMSNorm(index_head_dim, norm_eps, device=device)

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Index keys [B, n, Di] from pre-RoPE latents [B, n, Dh] rotated at their group's first token."""
        k = self.k_norm(self.wk(latent))
        return self.numerics.qdq_index(rotary.rotate(k, positions))

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               visible: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """[B, T, C] scores in bf16 (§11.6), −∞ where j ≥ visible_t."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))            # [B, T, Hi, Di]
        q = self.numerics.qdq_index(rotary.rotate(q, positions))
        weights = self.weights_proj(x) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)   # [B, T, Hi]
        logits = self.numerics.einsum("bthd,bcd->bthc", q, keys)
        score = (logits.relu() * weights.unsqueeze(-1)).sum(dim=2)               # [B, T, C]
        hidden = torch.arange(keys.shape[1], device=x.device) >= visible.unsqueeze(-1)
        return score.masked_fill(hidden, NEG_INF)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """Level one of the two-level top-k: a [B, T, C] mask of the kept blocks (§11.6, trap 13).

    A block scores the max over its positions; the block holding the query's newest visible position is
    pinned with +∞ (it is only partly filled and could lose to an older full block); blocks whose score
    is −∞ (nothing visible) are never kept.
    """
    width = scores.shape[-1]
    padded = F.pad(scores.float(), (0, -width % block_size), value=NEG_INF)
    block_score = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)           # [B, T, nb]
    n_blocks = block_score.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")                 # −1 when nothing is visible
    pinned = torch.arange(n_blocks, device=scores.device) == newest.unsqueeze(-1)
    block_score = block_score.masked_fill(pinned, float("inf"))
    values, indices = ordered_topk(block_score, min(topk_blocks, n_blocks), sorted=False)
    keep = torch.zeros_like(block_score, dtype=torch.bool).scatter_(-1, indices, values > NEG_INF)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """[B, T, k] compressed positions, k = min(K, C), ascending; −1 where j ≥ visible_t (trap 12, 14).

    Ties go to the lower position, so a query chooses the same positions whatever C its call has: an
    invisible position (−∞, and later than every visible one) never displaces a visible one.
    """
    k = min(topk, scores.shape[-1])
    chosen = ordered_topk(scores, k, sorted=False)[1].sort(dim=-1).values
    return torch.where(chosen < visible.view(1, -1, 1), chosen, -1)
