"""The training forward: whole sequences from position 0, no inference cache, autograd through every part.

Shapes: B sequences of T tokens, N = B·T packed tokens, S streams, D dim, H heads, Dh latent width,
W window, C compressed positions of a row, k listed per token, V vocab, Dt DSpark conditioning width,
A DSpark anchors (draft blocks) of Bs rows.

It runs the model's own modules (projections, norms, RoPE, hyper-connections, MoE, Engram's gate, the
compressor's pooling, the indexer's scoring and top-k choice) with the same packed layout as the
inference forward, so a batch of sequences from 0 gives the inference prefill's logits
(tests/test_training_forward.py). What differs: keys come from the call's own tokens and compressed
rows, held in a `TrainingScope` that lives and dies with the call, instead of a cache; and attention
over the window and the chosen compressed positions is computed densely under a mask
(`masked_attention`), the same softmax as the inference's per-token lists.

Three signals leave the forward besides the hidden states (docs/TRAINING.md):
- the indexer's KL term: its score distribution over a query's visible compressed positions pulled
  towards the main attention's (summed over heads, renormalised, no gradient). The indexer sees
  detached inputs, so this term trains only the indexer, and the language-model loss the rest;
- per MoE the chosen expert ids' counts (the load the router bias is balanced from);
- DSpark draft logits and confidences for anchors sampled along each sequence (`dspark`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..model import hyper
from ..model.engram import EngramHistory
from ..model.step import Handoff, Step


@dataclass
class TrainingScope:
    """What one training call's layers hand to each other (the cache-free stand-in for ModelCache)."""

    step: Step
    handoff: Handoff = field(default_factory=Handoff)
    sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Per kv source: (compressed KV [B, C, Dh], index keys [B, C, Di]) of the call's rows."""
    index_kl: list[torch.Tensor] = field(default_factory=list)
    loads: list[tuple[torch.nn.Module, torch.Tensor]] = field(default_factory=list)
    """(MoE, expert counts [E]) per MoE the call ran."""

    @property
    def batch(self) -> int:
        return self.step.n_rows

    @property
    def length(self) -> int:
        return self.step.counts[0]


@dataclass
class BackboneOutput:
    hidden: torch.Tensor
    """[B, T, D] collapsed streams before the final norm."""
    dspark_hidden: torch.Tensor | None
    """[B, T, Dt] stream means entering the DSpark target layers."""
    index_kl: torch.Tensor
    """Mean over index sources of the indexer's KL term (0 without index sources)."""
    loads: list[tuple[torch.nn.Module, torch.Tensor]]


def backbone(model, engram_tables, ids: torch.Tensor) -> BackboneOutput:
    """ids [B, T] (each row a sequence from position 0) through the blocks; engram_tables: one fp32
    [rows, De] table per Engram layer (the trainable form of the fp8 tables)."""
    cfg = model.cfg
    B, T = ids.shape
    step = Step.uniform(B, 0, T, device=ids.device)
    scope = TrainingScope(step)
    S, N = cfg.hc_mult, B * T
    hash_ids = None
    if cfg.engram_layer_ids:
        hash_ids = model.hasher(ids, 0, EngramHistory.create(B, T, device=ids.device))     # [B, T, E, Nc]
    x = model.embed(ids.flatten()[None]).to(stream_dtype(model)).unsqueeze(2).repeat(1, 1, S, 1)   # [1, N, S, D]
    pre = hyper.identity_pre(1, N, S, device=ids.device)
    targets = []
    for block in model.layers:
        if block.engram is not None:
            e = block.role.engram_index
            rows = F.embedding(hash_ids[:, :, e].reshape(1, N, -1), engram_tables[e]).flatten(-2)
            x = block.engram(x, rows, None)
        if block.role.is_dspark_target:
            targets.append(x.float().mean(dim=2).to(x.dtype))
        x, pre = block.run(x, pre, lambda h, b=block: attention(b.attn, h, scope),
                           lambda h, b=block: routed(b.ffn, h, scope.loads))
    hidden = hyper.collapse(x, pre)[0].unflatten(0, (B, T))
    dspark_hidden = torch.cat(targets, dim=-1)[0].unflatten(0, (B, T)) if targets else None
    kl = torch.stack(scope.index_kl).mean() if scope.index_kl else hidden.new_zeros(())
    return BackboneOutput(hidden, dspark_hidden, kl, scope.loads)


def stream_dtype(model) -> torch.dtype:
    """The streams' dtype: the model's compute dtype, or float64 for a model converted to float64
    (the gradient checks of tests/test_training_forward.py)."""
    return torch.promote_types(model.dtype, model.embed.weight.dtype)


def routed(ffn, h: torch.Tensor, loads: list) -> torch.Tensor:
    """The MoE's output; its expert counts go to `loads` (the router bias is balanced from them)."""
    y, chosen = ffn.routed(h)
    loads.append((ffn, torch.bincount(chosen.flatten(), minlength=ffn.n_experts)))
    return y


# ------------------------------------------------------------------------------------------ attention
def attention(attn, x: torch.Tensor, scope: TrainingScope) -> torch.Tensor:
    """x [1, N, D] (after attn_norm) → [1, N, D]: window + compressed sparse attention of the call alone."""
    step, pos = scope.step, scope.step.positions
    B, T = scope.batch, scope.length
    qr = attn.q_norm(attn.wq_a(x))
    q = attn.rotary.rotate(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)), pos)     # [1, N, H, Dh]
    kv = attn.numerics.qdq_window(attn.rotary.rotate(attn.kv_norm(attn.wkv(x)), pos))          # [1, N, Dh]
    keys, mask = kv[0].unflatten(0, (B, T)), window_mask(T, attn.window, x.device).expand(B, T, T)
    if attn.role.ratio:
        compressed, selected = _compressed(attn, x, qr, q, scope)                        # [B, C, Dh], [N, k]
        keys = torch.cat([keys, compressed], dim=1)
        mask = torch.cat([mask, selection_mask(selected.unflatten(0, (B, T)), compressed.shape[1])], dim=-1)
    o = masked_attention(q[0].unflatten(0, (B, T)), keys, mask, attn.attn_sink, attn.softmax_scale).flatten(0, 1)[None]
    o = attn.rotary.rotate(o, pos, inverse=True)
    return attn.wo_b(attn._grouped_output(o))


def window_mask(T: int, window: int, device=None) -> torch.Tensor:
    """[T, T] bool: query t sees positions t − W + 1 … t (the sliding window, §11.2)."""
    t = torch.arange(T, device=device)
    offset = t.unsqueeze(1) - t
    return (offset >= 0) & (offset < window)


def selection_mask(selected: torch.Tensor, C: int) -> torch.Tensor:
    """selected [B, T, k] compressed positions (−1: none) → [B, T, C] bool."""
    mask = torch.zeros(*selected.shape[:2], C + 1, dtype=torch.bool, device=selected.device)
    return mask.scatter_(-1, torch.where(selected >= 0, selected, C), True)[..., :C]


def masked_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B, T, H, Dh] over keys [B, P, Dh] (K = V) where mask [B, T, P] allows, with the per-head sink in
    the denominator (§11.7) → q.dtype [B, T, H, Dh]. `sparse_attention` in fast numerics over the same
    entries, computed densely: at training lengths the [B, H, T, P] logits are small, and two matmuls
    beat gathering a copy of every listed key per query."""
    z = torch.einsum("bthd,bpd->bhtp", q.float() * scale, keys.float()).masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1, 1, 1).expand(z.shape[0], -1, z.shape[2], 1)
    p = torch.cat([z, sink], dim=-1).softmax(dim=-1)[..., :-1]                 # the sink only in the sum
    o = torch.einsum("bhtp,bpd->bthd", p, keys.float())
    return o.to(q.dtype)


def _compressed(attn, x, qr, q, scope: TrainingScope) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kv source's compressed rows [B, C, Dh], per token the k positions it attends to [N, k], −1: none)."""
    role, step = attn.role, scope.step
    B, T = scope.batch, scope.length
    if role.is_kv_source:
        latents = torch.stack([attn.compressor.latents(x[0, step.tokens_of(b)]) for b in range(B)])  # [B, C, Dh]
        positions = torch.arange(latents.shape[1], device=x.device) * role.ratio                    # trap 8
        kv = attn.numerics.qdq_compressed(attn.rotary.rotate(latents, positions))
        # the keys see the latents detached: the indexer learns from its KL term only
        keys = attn.indexer.keys(latents.detach(), positions, attn.rotary)
        scope.sources[role.layer_id] = (kv, keys)
    kv, keys = scope.sources[role.kv_source]
    C = kv.shape[1]
    if role.is_index_source:
        with torch.no_grad():
            selection = attn.select(x, qr, step, scope.handoff, C, lambda rows: keys[rows])
        scope.handoff.publish_selection(role.layer_id, selection)
        visible = step.visible(role.ratio)[:T]
        scope.index_kl.append(index_kl(attn, x.detach().unflatten(1, (B, T))[0], qr.detach().unflatten(1, (B, T))[0],
                                       q.detach()[0].unflatten(0, (B, T)), keys, kv.detach(), visible))
    return kv, scope.handoff.selection_for(role)


def index_kl(attn, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, kv: torch.Tensor,
             visible: torch.Tensor) -> torch.Tensor:
    """KL(main attention ‖ indexer) over each query's visible compressed positions, mean over queries.

    x [B, T, D], qr [B, T, Qr], q [B, T, H, Dh] (main queries), keys [B, C, Di], kv [B, C, Dh],
    visible [T]. The target is the main attention's softmax over the compressed positions alone, per
    head, summed over heads and renormalised (DeepSeek's sparse-attention training).
    """
    T = x.shape[1]
    positions = torch.arange(T, device=x.device)
    scores = attn.indexer.scores(x, qr, keys, positions, visible, attn.rotary).float()     # [B, T, C]
    seen = torch.arange(kv.shape[1], device=x.device) < visible.unsqueeze(-1)            # [T, C]
    has = visible > 0
    with torch.no_grad():
        z = torch.einsum("bthd,bcd->bthc", q.float(), kv.float()) * attn.softmax_scale
        z = z.masked_fill(~seen[None, :, None], float("-inf"))[:, has]
        target = z.softmax(-1).sum(2)
        target = target / target.sum(-1, keepdim=True)                                   # [B, T', C]
    logp = scores[:, has].log_softmax(-1).masked_fill(~seen[has][None], 0.0)
    return (torch.xlogy(target, target) - target * logp).sum(-1).mean()


# ------------------------------------------------------------------------------------------ DSpark
@dataclass
class DraftOutput:
    logits: torch.Tensor
    """[A, Bs, V] fp32 draft logits with the Markov bias (row i proposes the token of position p + 2 + i)."""
    confidence: torch.Tensor
    """[A, Bs] raw confidence logits."""
    targets: torch.Tensor
    """[A, Bs] the true tokens of positions p + 2 … p + Bs + 1."""


def anchors(length: int, block: int, offset: int) -> torch.Tensor:
    """Anchor positions p (the last observed main row) every `block` positions from `offset`, each with
    room for its Bs targets p + 2 … p + Bs + 1 inside a sequence of `length`."""
    return torch.arange(offset % block, length - block - 1, block)


def dspark(model, ids: torch.Tensor, dspark_hidden: torch.Tensor, positions: torch.Tensor,
           scope_loads: list | None = None) -> DraftOutput:
    """Draft blocks at anchor `positions` [P] of every row of ids [B, T], as `Transformer.dspark_draft`
    would after observing main rows 0 … p: ring = the window of main rows up to p, draft rows = the
    token of p + 1 then noise tokens. The backbone's streams, embedding and head are detached: the draft
    loss trains the stages only."""
    cfg, stages = model.cfg, model.mtp
    B, T = ids.shape
    Bs, S, W = cfg.dspark_block_size, cfg.hc_mult, cfg.window_size
    b_idx = torch.arange(B, device=ids.device).repeat_interleave(positions.numel())       # [A]
    p_idx = positions.to(ids.device).repeat(B)                                            # [A]
    A = b_idx.numel()
    first = stages[0]
    main_x = first.main_norm(first.main_proj(dspark_hidden.detach()))                    # [B, T, D]
    draft_ids = ids.new_full((A, Bs), cfg.dspark_noise_token_id)
    draft_ids[:, 0] = ids[b_idx, p_idx + 1]
    x = F.embedding(draft_ids, model.embed.weight.detach()).to(stream_dtype(model)).unsqueeze(2).repeat(1, 1, S, 1)
    pre = hyper.identity_pre(A, Bs, S, device=ids.device)
    draft_pos = p_idx.unsqueeze(1) + 1 + torch.arange(Bs, device=ids.device)               # [A, Bs]
    window = p_idx.unsqueeze(1) - W + 1 + torch.arange(W, device=ids.device)               # [A, W]
    loads = [] if scope_loads is None else scope_loads
    for stage in stages:
        ring = _ring(stage.attn, main_x, T)[b_idx.unsqueeze(1), window.clamp(min=0)]        # [A, W, Dh]
        x, pre = stage.run(x, pre, lambda h, s=stage, r=ring: _draft_attention(s.attn, h, r, window, draft_pos),
                           lambda h, s=stage: routed(s.ffn, h, loads))
    last = stages[-1]
    z = hyper.collapse(x, pre)                                                            # [A, Bs, D]
    logits = F.linear(last.norm(z).float(), model.head.weight.detach().float())
    previous = ids[b_idx.unsqueeze(1), p_idx.unsqueeze(1) + 1 + torch.arange(Bs, device=ids.device)]
    bias, embedded = last.markov_head(previous)                                           # teacher-forced chain
    logits = logits + bias
    confidence = last.confidence_head(z, embedded)
    return DraftOutput(logits, confidence, ids[b_idx.unsqueeze(1), p_idx.unsqueeze(1) + 2 + torch.arange(Bs, device=ids.device)])


def _ring(attn, main_x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T, Dh] the KV `DSparkAttention.write_main` puts in a stage's ring for main rows 0 … T − 1."""
    positions = torch.arange(T, device=main_x.device)
    return attn.numerics.qdq_window(attn.rotary.rotate(attn.kv_norm(attn.wkv(main_x)), positions))


def _draft_attention(attn, h: torch.Tensor, ring: torch.Tensor, window: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Draft rows h [A, Bs, D] over their ring [A, W, Dh] (not where the window reaches before 0) and every
    draft row (no causal mask) → [A, Bs, D]."""
    A, Bs, _ = h.shape
    qr = attn.q_norm(attn.wq_a(h))
    q = attn.rotary.rotate(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)), positions)
    kv = attn.numerics.qdq_window(attn.rotary.rotate(attn.kv_norm(attn.wkv(h)), positions))
    seen = torch.cat([window >= 0, window.new_ones(A, Bs, dtype=torch.bool)], dim=1)     # [A, W + Bs]
    o = masked_attention(q, torch.cat([ring, kv], dim=1), seen.unsqueeze(1).expand(A, Bs, -1), attn.attn_sink,
                         attn.softmax_scale)
    o = attn.rotary.rotate(o, positions, inverse=True)
    return attn.wo_b(attn._grouped_output(o))
