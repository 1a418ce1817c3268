"""The KV compressor of a kv source (docs/ARCHITECTURE.md §11.3).

Shapes: n positions of one row in the call, D dim, Dh head dim (latent width), r ratio, g new latents.

r = 1 is a plain projection (bf16 `wkv`, no gate). r > 1 pools each group of r consecutive positions
{j·r … j·r + r − 1} with a per-channel softmax over the group (fp32 `wkv` and `wgate`, fp32 pooling).
Groups are aligned to absolute positions, so a call may start or end inside a group: the positions of
the unfinished group wait in the slot's tail (the reference handles only prefill from 0 and T = 1).
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
        # r > 1 pools in fp32, so its weights are held in fp32 (docs/CHECKPOINT.md §3.3).
        storage = "fp32" if ratio > 1 else "bf16"
        kw = dict(numerics=numerics, device=device, dtype=dtype, stored_as="bf16")
        self.wkv = Linear(dim, head_dim, storage, **kw)
        if ratio > 1:
            self.wgate = Linear(dim, head_dim, storage, **kw)
        self.norm = RMSNorm(head_dim, norm_eps, numerics=numerics, device=device)

    def forward(self, x: torch.Tensor, start_pos: int, state: SourceState, slot: int) -> tuple[torch.Tensor, int]:
        """x [n, D] (one row's normed attention input, positions start_pos …) → (latents [g, Dh] pre-RoPE,
        the compressed row of the first). g may be 0."""
        return self.from_projected(self.project(x), start_pos, state, slot, x.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [n, D] → r = 1: the normed latents [n, Dh]; r > 1: fp32 (kv, score) [n, Dh] of each position."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        h = x.float()
        return self.wkv(h), self.wgate(h)

    def from_projected(self, projected, start_pos: int, state: SourceState, slot: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """One row's `project` output (positions start_pos …) → (latents [g, Dh], first compressed row)."""
        if self.ratio == 1:
            return projected, start_pos
        r = self.ratio
        kv, score = projected
        n = kv.shape[0]
        lead = start_pos % r                                        # positions of the open group already seen
        if lead:
            tail_kv, tail_score = state.tail(slot, lead)
            kv, score = torch.cat([tail_kv, kv]), torch.cat([tail_score, score])
        first = start_pos - lead
        state.carry(slot, first, kv, score, start_pos + n)
        return self.pool(kv, score, dtype), first // r

    def decode_rows(self, projected, step, state: SourceState, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
        """`from_projected` of a decode step's rows at once (one position each; `project` of its B tokens)
        → (latents [G, Dh] of the rows whose group that position completes, in row order; those rows)."""
        if self.ratio == 1:
            return projected, list(range(step.n_rows))
        r = self.ratio
        groups_kv, groups_score = state.append_tails(step.slots, step.slot_index, step.starts, *projected)
        done = [b for b, start in enumerate(step.starts) if start % r == r - 1]
        if len(done) < step.n_rows:
            if not done:
                return groups_kv.new_empty(0, groups_kv.shape[-1], dtype=dtype), []
            pick = torch.tensor(done, device=groups_kv.device)
            groups_kv, groups_score = groups_kv[pick], groups_score[pick]
        return self.pool(groups_kv.flatten(0, 1), groups_score.flatten(0, 1), dtype), done

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] of one row from position 0, all at once (training) → latents [⌊n/r⌋, Dh] pre-RoPE."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        h = x.float()
        return self.pool(self.wkv(h), self.wgate(h), x.dtype)

    def pool(self, kv: torch.Tensor, score: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """kv, score [n, Dh] fp32 from a group's first position → the normed latents of the whole groups."""
        r = self.ratio
        g = kv.shape[0] // r
        if g == 0:                                                  # a decode step inside its group: ~6 ops saved
            return kv.new_empty(0, kv.shape[-1], dtype=dtype)
        groups = kv[:g * r].unflatten(0, (g, r))                    # [g, r, Dh]
        weights = self.numerics.softmax(score[:g * r].unflatten(0, (g, r)), dim=1)
        pooled = (groups * weights).sum(dim=1)
        return self.norm(pooled.to(dtype))
