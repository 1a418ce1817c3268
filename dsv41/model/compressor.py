"""The KV compressor of a kv source (ARCHITECTURE.md §11.3).

Shapes: B batch, T positions in the call, D dim, Dh head dim (latent width), r ratio, n new latents.

r = 1 is a plain projection (bf16 `wkv`, no gate). r > 1 pools each group of r consecutive positions
{j·r … j·r + r − 1} with a per-channel softmax over the group (fp32 `wkv` and `wgate`, fp32 pooling).
Groups are aligned to absolute positions, so a call may start or end inside a group: the positions of
the unfinished group wait in the cache's tail (the reference handles only prefill from 0 and T = 1).
The latent comes out before RoPE because the indexer derives its keys from the unrotated form.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import SourceState
from .layers import Linear, RMSNorm
from .numerics import Numerics


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, norm_eps: float, *, numerics: Numerics, device=None,
                 dtype=torch.bfloat16):
        super().__init__()
        self.ratio, self.numerics = ratio, numerics
        # r > 1 pools in fp32, so its weights are held in fp32 (CHECKPOINT.md §3.3).
        storage = "fp32" if ratio > 1 else "bf16"
        kw = dict(numerics=numerics, device=device, dtype=dtype, stored_as="bf16")
        self.wkv = Linear(dim, head_dim, storage, **kw)
        if ratio > 1:
            self.wgate = Linear(dim, head_dim, storage, **kw)
        self.norm = RMSNorm(head_dim, norm_eps, device=device)

    def forward(self, x: torch.Tensor, start_pos: int, state: SourceState) -> tuple[torch.Tensor, int]:
        """x [B, T, D] (the normed attention input) → (latents [B, n, Dh] pre-RoPE, index of the first).

        The first latent is compressed row j0 = start_pos // r; n may be 0.
        """
        if self.ratio == 1:
            return self.norm(self.wkv(x)), start_pos
        r = self.ratio
        h = x.float()
        kv, score = self.wkv(h), self.wgate(h)                      # [B, T, Dh] fp32
        lead = start_pos % r                                        # positions of the open group already seen
        if lead:
            kv = torch.cat([state.tail_kv[:, :lead], kv], dim=1)
            score = torch.cat([state.tail_score[:, :lead], score], dim=1)
        state.recent = (start_pos - lead, kv, score)               # lets a rollback rebuild the tail
        n = kv.shape[1] // r
        rest = kv.shape[1] - n * r
        if rest:
            state.tail_kv[:, :rest] = kv[:, n * r:]
            state.tail_score[:, :rest] = score[:, n * r:]
        kv = kv[:, :n * r].unflatten(1, (n, r))                     # [B, n, r, Dh]
        weights = self.numerics.softmax(score[:, :n * r].unflatten(1, (n, r)), dim=2)
        pooled = (kv * weights).sum(dim=2)
        return self.norm(pooled.to(x.dtype)), start_pos // r
