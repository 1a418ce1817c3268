"""Attention of DeepSeek-V4.1: one shared K=V latent, a sliding window, compressed sparse attention.

Shapes: B batch, T query positions, D dim, Qr query rank, H heads, Dh head dim (= latent width),
R rope dim, G output groups, Or output rank per group, W window, C compressed positions, K top-k,
N = W + T + C rows of the key pool a call attends over.

Every layer attends to the last W positions (ring of the cache + the call's own rows). Layers with a
compress ratio also attend to up to K compressed positions chosen by their index source; kv sources
compress their own KV, everyone else reads their kv source's rows (ARCHITECTURE.md §3, §11). What a
source hands to the layers after it within one forward lives in `ForwardState`, not in a global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import torch.nn.functional as F

from .cache import ModelCache
from .compressor import Compressor
from ..config import ModelConfig
from .indexer import Indexer, candidate_blocks, select_topk, visible_counts
from .layers import Linear, RMSNorm, dense_storage
from .numerics import Numerics
from .roles import LayerRole
from .rope import Rotary

# Largest negative logit the running max starts from (§11.7).
SCORE_FLOOR = -1e30


@dataclass
class ForwardState:
    """Per-call metadata shared by all layers of one forward (explicit, STYLE.md P4)."""

    start_pos: int
    length: int
    positions: torch.Tensor                      # [T] absolute positions
    reference_layout: bool = False
    """List the window as the reference does (a call from position 0 lists only its own rows); else
    every call lists W entries per query, the one layout invariant kernels need (numerics.py)."""
    stale_index_keys: bool = False
    selections: dict[int, torch.Tensor] = field(default_factory=dict)   # index source → [B, T, k] rows or −1
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)   # candidate source → [B, T, C] mask
    _window_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_rows(self, window: int) -> torch.Tensor:
        """[T, W] window pool rows, the same for every layer of the call (computed once)."""
        if window not in self._window_rows:
            self._window_rows[window] = window_indices(self.start_pos, self.length, window, self.positions.device,
                                                       reference_layout=self.reference_layout)
        return self._window_rows[window]


def window_indices(start_pos: int, length: int, window: int, device=None, *,
                   reference_layout: bool = False) -> torch.Tensor:
    """[T, n] pool rows each query sees in its window (−1 for none), pool = [ring (W) | call (T) | …].

    Query p sees positions max(0, p − W + 1) … p: those before the call from ring slot q mod W, the
    rest from the call's own rows (generalises §11.2 to any start and length). Each query lists W
    entries, oldest first, −1 for positions before 0 — the layout of the reference's decode step. The
    order matters because the blockwise softmax rounds per block of 64 entries (§11.7): with
    `reference_layout` a call from position 0 lists min(T, W) entries, valid ones first, as the
    reference's prefill does, which gives other bits than its decode for the same position
    (docs/NUMERICS.md N3).
    """
    p = torch.arange(start_pos, start_pos + length, device=device).unsqueeze(1)
    if reference_layout and start_pos == 0:
        q = (p - window + 1).clamp(min=0) + torch.arange(min(length, window), device=device)
        return torch.where(q <= p, window + q, -1)
    q = p - window + 1 + torch.arange(window, device=device)                  # [T, W] positions
    rows = torch.where(q >= start_pos, window + (q - start_pos), q % window)
    return torch.where(q >= 0, rows, -1)


def _gather_rows(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pool [B, N, Dh], rows [B, T, n] → fp32 [B, T, n, Dh], zeros where the row is −1."""
    picked = torch.gather(pool.unsqueeze(1).expand(-1, rows.shape[1], -1, -1), 2,
                          rows.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, pool.shape[-1]))
    return picked.float() * (rows >= 0).unsqueeze(-1)


def sparse_attention(q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor,
                     scale: float, numerics: Numerics) -> torch.Tensor:
    """Attention of q [B, T, H, Dh] over the listed rows [B, T, n] of pool [B, N, Dh] with a sink (§11.7).

    K = V (one latent); the sink sits in the denominator only, in scaled-logit units; rows of −1 are
    ignored; a query with no row returns zeros. With an attention block (reference numerics, invariant
    kernels) the list is walked in blocks with an online softmax; reference numerics round the
    probabilities to bf16 against the running maximum before P·V, the denominator keeping fp32, as the
    reference kernel does. Invariant kernels pad the list with −1 to whole blocks: every block then has
    one length, and a block of −1 changes nothing, so a query's result depends only on its own entries
    (docs/NUMERICS.md N6).
    Without a block it is one exact fp32 softmax over the whole list.
    """
    B, T, H, _ = q.shape
    block = numerics.attention_block
    if block is not None and numerics.invariant:
        rows = F.pad(rows, (0, -rows.shape[-1] % block), value=-1)
    qf, step = q.float(), block or rows.shape[-1]
    out = torch.zeros(qf.shape, device=q.device)
    denom = torch.zeros(B, T, H, 1, device=q.device)
    m = torch.full((B, T, H, 1), SCORE_FLOOR, device=q.device)
    for start in range(0, rows.shape[-1], step):
        part = rows[..., start:start + step]
        kv = _gather_rows(pool, part)                                              # [B, T, n, Dh]
        z = numerics.einsum("bthd,btnd->bthn", qf, kv)
        z = z.masked_fill(~(part >= 0).unsqueeze(2), float("-inf")) * scale
        m_new = torch.maximum(m, z.amax(dim=-1, keepdim=True))
        rescale = numerics.exp(m - m_new)
        p = numerics.exp(z - m_new)
        denom = denom * rescale + p.sum(dim=-1, keepdim=True)
        if numerics.round_probabilities:
            p = p.to(torch.bfloat16).float()
        out = out * rescale + numerics.einsum("bthn,btnd->bthd", p, kv)
        m = m_new
    denom = denom + numerics.exp(sink.float().view(1, 1, -1, 1) - m)
    return (out / denom).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, role: LayerRole, *, numerics: Numerics, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.role, self.numerics = role, numerics
        self.n_heads, self.head_dim, self.window = cfg.n_heads, cfg.head_dim, cfg.window_size
        self.o_groups, self.o_lora_rank, self.index_topk = cfg.o_groups, cfg.o_lora_rank, cfg.index_topk
        self.candidate_topk_blocks, self.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.softmax_scale = cfg.head_dim ** -0.5
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        dense = dense_storage(cfg)
        self.attn_sink = nn.Parameter(torch.empty(cfg.n_heads, device=device, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dense, **kw)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, device=device)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, dense, **kw)
        self.wkv = Linear(cfg.dim, cfg.head_dim, dense, **kw)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device=device)
        # wo_a is used in a grouped einsum, not a quantised GEMM: held in bf16 (§6.2).
        self.wo_a = Linear(cfg.group_width, cfg.o_groups * cfg.o_lora_rank, "bf16", stored_as=dense, **kw)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dense, **kw)
        self.rotary = Rotary.for_layer(cfg, role.uses_compressed_rope)
        self.compressor = (Compressor(cfg.dim, cfg.head_dim, role.ratio, cfg.norm_eps, **kw)
                           if role.is_kv_source else None)
        self.indexer = (Indexer(cfg.dim, cfg.q_lora_rank, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim,
                                cfg.norm_eps, owns_keys=role.is_kv_source, dense=dense, **kw)
                        if role.is_index_source else None)

    # -------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, step: ForwardState, cache: ModelCache) -> torch.Tensor:
        """x [B, T, D] (after attn_norm) → [B, T, D]."""
        B, T, _ = x.shape
        pos = step.positions
        qr = self.q_norm(self.wq_a(x))                                              # [B, T, Qr]
        q = self.rotary.rotate(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), pos)   # [B, T, H, Dh]
        kv = self.numerics.qdq_window(self.rotary.rotate(self.kv_norm(self.wkv(x)), pos))      # [B, T, Dh]

        ring = cache.window[self.role.layer_id]
        pool = torch.cat([ring, kv], dim=1)                                         # [B, W + T, Dh]
        rows = step.window_rows(self.window).expand(B, -1, -1)
        if self.role.ratio:
            compressed, selected = self._compressed(x, qr, step, cache)
            pool = torch.cat([pool, compressed], dim=1)
            rows = torch.cat([rows, torch.where(selected >= 0, selected + self.window + T, -1)], dim=-1)

        o = sparse_attention(q, pool, rows, self.attn_sink, self.softmax_scale, self.numerics)
        self._write_ring(ring, kv, step.start_pos)
        o = self.rotary.rotate(o, pos, inverse=True)                                # trap 11
        return self.wo_b(self._grouped_output(o))

    def _grouped_output(self, o: torch.Tensor) -> torch.Tensor:
        """[B, T, H, Dh] → [B, T, G·Or]: group g (heads of g) through its own slice of wo_a (§11.8)."""
        groups = o.flatten(2).unflatten(-1, (self.o_groups, -1))                   # [B, T, G, H·Dh/G]
        wo_a = self.wo_a.dequantized_weight(groups.dtype).unflatten(0, (self.o_groups, self.o_lora_rank))
        return self.numerics.einsum("btgi,gri->btgr", groups, wo_a).flatten(2)

    def _write_ring(self, ring: torch.Tensor, kv: torch.Tensor, start_pos: int) -> None:
        """After attending: the last min(T, W) positions of the call go to slots p mod W."""
        T = kv.shape[1]
        keep = min(T, self.window)
        slots = torch.arange(start_pos + T - keep, start_pos + T, device=kv.device) % self.window
        ring[:, slots] = kv[:, T - keep:].to(ring.dtype)

    # -------------------------------------------------------------------------------- compressed part
    def _compressed(self, x: torch.Tensor, qr: torch.Tensor, step: ForwardState, cache: ModelCache):
        """(compressed rows [B, C, Dh] of the kv source, selection [B, T, k] into them or −1)."""
        role = self.role
        source = cache.sources[role.kv_source]
        published = False
        if role.is_kv_source:
            published = self._compress(x, step.start_pos, source)
            if published:
                cache.published_keys = role.layer_id
        C = (step.start_pos + step.length) // role.ratio
        if role.is_index_source:
            keys_owner = role.kv_source
            if step.stale_index_keys and role.is_kv_source and not published and cache.published_keys is not None:
                keys_owner = cache.published_keys                                   # trap 15, reference parity
            step.selections[role.layer_id] = self._select(x, qr, step, cache.sources[keys_owner].index_keys, C)
        return source.kv[:, :C], step.selections[role.index_source]

    def _compress(self, x: torch.Tensor, start_pos: int, source) -> bool:
        """Compress the groups this call completes into the source's rows and index keys."""
        latent, first = self.compressor(x, start_pos, source)                     # [B, n, Dh] pre-RoPE
        n = latent.shape[1]
        if n == 0:
            return False
        positions = (torch.arange(first, first + n, device=x.device) * self.role.ratio)   # trap 8
        source.index_keys[:, first:first + n] = self.indexer.keys(latent, positions, self.rotary).to(
            source.index_keys.dtype)
        rotated = self.rotary.rotate(latent, positions)
        source.kv[:, first:first + n] = self.numerics.qdq_compressed(rotated).to(source.kv.dtype)
        return True

    def _select(self, x: torch.Tensor, qr: torch.Tensor, step: ForwardState, keys: torch.Tensor, C: int):
        B, T = x.shape[:2]
        if C == 0:
            return torch.empty(B, T, 0, dtype=torch.long, device=x.device)
        visible = visible_counts(step.start_pos, T, self.role.ratio, x.device)
        scores = self.indexer.scores(x, qr, keys[:, :C], step.positions, visible, self.rotary)
        if self.role.is_candidate_source:
            step.candidates[self.role.layer_id] = candidate_blocks(
                scores, visible, self.candidate_topk_blocks, self.candidate_block_size)
        elif self.role.candidate_source is not None:
            scores = scores.masked_fill(~step.candidates[self.role.candidate_source], float("-inf"))
        return select_topk(scores, visible, self.index_topk)
