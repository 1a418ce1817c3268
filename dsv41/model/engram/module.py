"""Engram: adds a gated n-gram memory read to the hyper-connection streams (docs/ARCHITECTURE.md §9).

Shapes: B batch, T positions, S streams (hc_mult), D dim, N hash columns, De row width
(engram_head_dim). Hash ids for this layer are int64 [B, T, N]; gathered rows are bf16 [B, T, N·De],
column c occupying features De·c .. De·c + De - 1.

The work is split in two so the (possibly disk-backed) row gather can be issued ahead of the layer:
`gather(hash_ids, device)` reads and dequantises the rows (§9 step 1); `forward(x, rows, mask)` does
the projection and the per-stream gate (§9 steps 2-7).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..layers import Linear, dense_storage
from ..numerics import Numerics
from .table import EngramTable
from ...parallel.context import ParallelContext

GATE_SQRT_FLOOR = 1e-6  # |a| is clamped to this before the signed square root (§9 step 5)


def stream_gate(x: torch.Tensor, key: torch.Tensor, weight: torch.Tensor, eps: float,
                numerics: Numerics) -> torch.Tensor:
    """fp32 x, key [B, T, S, D] and weight [S, D] -> gate [B, T, S] (§9 steps 4-5, trap 18).

    Normalised per stream over D, not jointly over the streams; rms(v) = sqrt(mean(v²) + eps)."""
    dim = x.shape[-1]
    inv_norms = torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    a = (x * weight * key).sum(-1) * inv_norms * dim**-0.5  # [B, T, S]
    # Signed sqrt with the IEEE sign bit (copysign): a = +0 gives sigmoid(+0.001), not 0.5.
    magnitude = a.abs().clamp_min(GATE_SQRT_FLOOR).sqrt()
    return numerics.sigmoid(torch.copysign(magnitude, a))


class Engram(nn.Module):
    """One Engram layer: table `embed`, projection `wkv` to S keys + one value, gate `q_weight`·`k_weight`."""

    def __init__(self, cfg, engram_index: int, numerics: Numerics, *, device=None, dtype=torch.bfloat16,
                 parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        rows = cfg.engram_num_embeddings[engram_index]
        # tensor parallelism: this rank's rows; the ranks' lookups are summed in `forward`
        self.rows_parallel, self.rows_group = parallel.tp_size > 1, parallel.tp_group
        self.layer_id, self.numerics = cfg.engram_layer_ids[engram_index], numerics
        self.streams, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps  # eps 1e-20 (§6.7, trap 3)
        self.n_columns, self.head_dim = cfg.engram_hash_columns, cfg.engram_head_dim
        self.embed = EngramTable(rows, self.head_dim, device=device, part=parallel.engram_rows(rows))
        # wkv follows `dtype` like every dense Linear (the table itself is always fp8, §9)
        self.wkv = Linear(self.n_columns * self.head_dim, (self.streams + 1) * self.dim, dense_storage(cfg),
                          numerics=numerics, device=device, dtype=dtype)
        # bf16 in the checkpoint; only their product is ever used (§9 step 3). Identity gate weights
        # until loaded, as the reference initialises them.
        self.q_weight = nn.Parameter(torch.ones(self.streams, self.dim, dtype=torch.bfloat16, device=device),
                                     requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(self.streams, self.dim, dtype=torch.bfloat16, device=device),
                                     requires_grad=False)

    def gather(self, hash_ids: torch.Tensor, device=None) -> torch.Tensor:
        """int64 [B, T, N] -> bf16 [B, T, N·De] on `device` (§9 step 1)."""
        if hash_ids.shape[-1] != self.n_columns:
            raise ValueError(f"Engram layer {self.layer_id} expects {self.n_columns} hash columns, "
                             f"got shape {tuple(hash_ids.shape)}")
        return self.embed.lookup(hash_ids, device, self.numerics).flatten(-2)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x bf16 [B, T, S, D], rows bf16 [B, T, N·De], text_mask [B, T] (False = image) -> [B, T, S, D]."""
        S, D = self.streams, self.dim
        if self.rows_parallel:
            # each row lives on one rank and reads zeros elsewhere: the bf16 sum is that row, exactly.
            # Here, not in `gather`, which may run on a background thread beside the blocks' collectives.
            rows = rows.contiguous()
            dist.all_reduce(rows, group=self.rows_group)
        kv = self.wkv(rows)  # [B, T, (S+1)·D], §9 step 2
        key = kv[..., : S * D].float().unflatten(-1, (S, D))  # [B, T, S, D], stream-major
        value = kv[..., S * D:].float()  # [B, T, D], shared by every stream
        weight = self.q_weight.float() * self.k_weight.float()  # [S, D]
        h = x.float()
        gate = stream_gate(h, key, weight, self.eps, self.numerics)  # [B, T, S]
        if text_mask is not None:
            gate = gate.masked_fill(~text_mask.to(device=gate.device, dtype=torch.bool)[..., None], 0.0)  # §9 step 6
        return (h + gate[..., None] * value[:, :, None, :]).to(x.dtype)  # §9 step 7, fp32 add

    def extra_repr(self) -> str:
        return f"layer={self.layer_id}, columns={self.n_columns}, head_dim={self.head_dim}, streams={self.streams}"
