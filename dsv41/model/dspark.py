"""DSpark draft stages (`mtp.0` … `mtp.{n−1}`): propose a block of tokens for speculative decoding.

Shapes: B batch, T main rows, D dim, Dt = D · len(dspark_target_layer_ids), Bs draft rows
(dspark_block_size: the last sampled token + Bs − 1 noise tokens), S streams, V vocab, Rm Markov rank.

Each stage is a block with window-only attention (θ = rope_theta, no YaRN) and a smaller MoE, whose
window ring holds KV made from the backbone (docs/ARCHITECTURE.md §15): the stream means entering the target
layers, projected by `main_proj` + `main_norm` of stage 0. Drafting runs the Bs draft rows at positions
p + 1 … p + Bs through the stages; each row attends to the ring and to every draft row (no causal mask).
The last stage's norm and the backbone's tied head give logits, a rank-Rm Markov head adds a bias from
the previous draft token, and a confidence head scores each row.

The reference writes one main row per call; here `observe` writes any number of rows (every accepted
position of a speculative step), and `draft` proposes from the last observed position
(docs/GENERATION-AND-DSPARK.md §3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import hyper
from .attention import Attention, sparse_attention
from .cache import ModelCache
from ..config import ModelConfig
from .block import Block
from .layers import Embedding, Head, Linear, RMSNorm, dense_storage
from .numerics import Numerics
from .roles import LayerRole
from .step import Handoff, Step
from ..parallel.context import ParallelContext


@dataclass(frozen=True)
class DraftStep:
    """Metadata of one draft call: row b drafts for slot slots[b] at positions last_pos[b] + 1 … + Bs."""

    slots: tuple[int, ...]
    last_pos: tuple[int, ...]


class DSparkAttention(Attention):
    """Window attention whose ring is filled from the backbone's main rows, queried by the draft rows."""

    def write_main(self, main_x: torch.Tensor, step: Step, cache: ModelCache) -> None:
        """main_x [N, D] (the step's tokens) → fp8-QDQ KV into each row's ring slots p mod W."""
        kv = self.numerics.qdq_window(self.rotary.rotate(self.kv_norm(self.wkv(main_x[None])), step.positions))
        cache.write_window(self.role.layer_id, kv[0], step)

    def forward(self, x: torch.Tensor, step: DraftStep, handoff: Handoff, cache: ModelCache) -> torch.Tensor:
        """Draft rows x [B, Bs, D] (after attn_norm) → [B, Bs, D]."""
        B, Bs, _ = x.shape
        last = torch.tensor(step.last_pos, device=x.device)
        positions = last.unsqueeze(1) + 1 + torch.arange(Bs, device=x.device)              # [B, Bs]
        qr = self.q_norm(self.wq_a(x))
        q = self.rotary.rotate(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), positions)
        kv = self.numerics.qdq_window(self.rotary.rotate(self.kv_norm(self.wkv(x)), positions))
        ring = cache.window[self.role.layer_id][list(step.slots)]
        pool = torch.cat([ring, kv], dim=1)                                                # [B, W + Bs, Dh]
        rows = self._draft_rows(step, Bs, x.device).unsqueeze(1).expand(B, Bs, -1)
        o = sparse_attention(q, pool, rows, self.attn_sink, self.softmax_scale, self.numerics)
        o = self.rotary.rotate(o, positions, inverse=True)
        return self.wo_b(self._grouped_output(o))

    def _draft_rows(self, step: DraftStep, Bs: int, device) -> torch.Tensor:
        """[B, n]: each row's filled ring slots in slot order (as the reference lists them), then every
        draft row (no causal mask). Rows at different positions list all W slots, −1 for unfilled ones;
        the reference's layout (only the filled ones) where every row is at one position and the kernels
        follow the reference."""
        filled = torch.tensor([min(self.window, p + 1) for p in step.last_pos], device=device)
        width = int(filled[0]) if len(set(step.last_pos)) == 1 and not self.numerics.invariant else self.window
        ring = torch.arange(width, device=device).expand(len(step.slots), -1)
        ring = torch.where(ring < filled.unsqueeze(1), ring, -1)
        drafts = (self.window + torch.arange(Bs, device=device)).expand(len(step.slots), -1)
        return torch.cat([ring, drafts], dim=1)


class MarkovHead(nn.Module):
    """`embed [V, Rm]` and `head [V, Rm]`: bias_i = head · embed[id_i] (fp32, §15 step 4)."""

    def __init__(self, vocab_size: int, rank: int, *, numerics: Numerics, device=None,
                 parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.embed = Embedding(vocab_size, rank, device=device, shard=parallel.shard("embed"))
        self.head = Head(vocab_size, rank, numerics=numerics, device=device, shard=parallel.shard("head"))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.embed(ids)                                                       # [B, Rm]
        return self.head(embedded), embedded


class ConfidenceHead(nn.Module):
    """c_i = proj([z_i; e_i]) in fp32 — a raw logit (§15 step 5)."""

    def __init__(self, width: int, *, numerics: Numerics, device=None):
        super().__init__()
        self.proj = Linear(width, 1, "fp32", numerics=numerics, device=device, stored_as="bf16")

    def forward(self, z: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([z, markov], dim=-1).float()).squeeze(-1)


class DSparkStage(Block):
    """One stage: a block with DSpark attention and the DSpark MoE; stage 0 projects the backbone's
    target streams, the last stage owns the draft head (§15). The embedding and head are the
    backbone's (tied; passed in, not stored)."""

    attention_cls = DSparkAttention

    def __init__(self, cfg: ModelConfig, role: LayerRole, *, numerics: Numerics, device=None, dtype=torch.bfloat16,
                 parallel: ParallelContext | None = None, **block):
        parallel = parallel or ParallelContext()
        super().__init__(cfg, role, numerics=numerics, device=device, dtype=dtype, parallel=parallel, **block)
        index = role.layer_id - cfg.n_layers
        if index == 0:
            width = cfg.dim * len(cfg.dspark_target_layer_ids)
            self.main_proj = Linear(width, cfg.dim, dense_storage(cfg), numerics=numerics, device=device, dtype=dtype)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=numerics, device=device)
        if index == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=numerics, device=device)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, numerics=numerics,
                                          device=device, parallel=parallel)
            self.confidence_head = ConfidenceHead(cfg.dim + cfg.dspark_markov_rank, numerics=numerics, device=device)

    def forward(self, x: torch.Tensor, pre: torch.Tensor, step: DraftStep, handoff: Handoff, cache: ModelCache,
                image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows x [B, Bs, S, D]: the block's calls one by one (a draft's rows are not a decode step's
        packed tokens, which the block's fused calls take)."""
        return self.run(x, pre, lambda h: self.attn(h, step, handoff, cache), lambda h: self.ffn(h, image_mask))


@dataclass
class Draft:
    ids: torch.Tensor
    """[B, Bs + 1]: the token given, then Bs drafts (for positions p + 2 … p + Bs + 1)."""
    logits: torch.Tensor
    """[B, Bs, V] fp32 draft logits, Markov bias included (row i proposes ids[:, i + 1])."""
    confidence: torch.Tensor
    """[B, Bs] fp32 raw confidence logits."""


def observe(stages: nn.ModuleList, dspark_hidden: torch.Tensor, step: Step, cache: ModelCache) -> None:
    """Write the main rows of a step's tokens (dspark_hidden [N, Dt]) into every stage's ring."""
    first = stages[0]
    main_x = first.main_norm(first.main_proj(dspark_hidden))                            # [N, D]
    for stage in stages:
        stage.attn.write_main(main_x, step, cache)


def draft(stages: nn.ModuleList, embed: Embedding, head: Head, cfg: ModelConfig, token: torch.Tensor,
          step: DraftStep, cache: ModelCache,
          choose: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
          dtype: torch.dtype = torch.bfloat16) -> Draft:
    """Propose Bs tokens after `token` [B] (row b's token for position last_pos[b] + 1), given the rings;
    `dtype` is the model's compute dtype."""
    B, Bs = token.shape[0], cfg.dspark_block_size
    ids = token.new_full((B, Bs), cfg.dspark_noise_token_id)
    ids[:, 0] = token
    x = embed(ids).to(dtype).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()  # [B, Bs, S, D]
    pre = hyper.identity_pre(B, Bs, cfg.hc_mult, device=token.device)
    for stage in stages:
        x, pre = stage(x, pre, step, Handoff(), cache, None)                            # drafts are text
    last = stages[-1]
    z = hyper.collapse(x, pre)                                                          # [B, Bs, D]
    logits = head(last.norm(z))                                                         # [B, Bs, V]
    return _markov_chain(last, z, logits, token, choose or (lambda row: row.argmax(-1)))


def _markov_chain(last: nn.Module, z: torch.Tensor, logits: torch.Tensor, token: torch.Tensor,
                  choose: Callable[[torch.Tensor], torch.Tensor]) -> Draft:
    """Row by row: add the Markov bias of the previous token, choose the next draft (§15 step 4)."""
    Bs = logits.shape[1]
    out = token.new_empty(token.shape[0], Bs + 1)
    out[:, 0] = token
    embedded = []
    for i in range(Bs):
        bias, e = last.markov_head(out[:, i])
        logits[:, i] += bias
        embedded.append(e)
        out[:, i + 1] = choose(logits[:, i])
    confidence = last.confidence_head(z, torch.stack(embedded, dim=1))
    return Draft(ids=out, logits=logits, confidence=confidence)
