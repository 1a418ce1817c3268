"""Attention of DeepSeek-V4.1: one shared K=V latent, a sliding window, compressed sparse attention.

Shapes: B rows of the call (cache slots), N packed tokens of the call (step.py), D dim, Qr query rank,
H heads (this rank's, under tensor parallelism), Dh head dim (= latent width), R rope dim, G output groups, Or output rank per group, W window,
C compressed positions read per row, K top-k, k = min(K, C) entries a token lists, n entries of a token's
attention list.

Every layer attends to the last W positions (the row's ring in the cache + the row's own tokens in the
call). Layers with a compress ratio also attend to up to K compressed positions chosen by their index
source; kv sources compress their own KV, everyone else reads their kv source's rows (docs/ARCHITECTURE.md
§3, §11). The key pool of a call is [rings (B·W) | call tokens (N) | compressed rows], and each token's
list indexes into its own row's parts only; the compressed rows are each row's C rows (B·C) or, when
fewer, the k rows each token lists (N·k), so a call's pool does not grow with the context
(`_compressed`). What a source hands to the layers after it within one forward lives in a `Handoff`,
not in a global.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .cache import ModelCache, SourceState
from .compressor import Compressor
from .indexer import DEFAULT_BUDGET_BYTES, Indexer
from .layers import ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear, dense_storage
from .numerics import Numerics
from .roles import LayerRole
from .rope import Rotary
from .step import Handoff, Step
from ..parallel.context import ParallelContext

# Largest negative logit the running max starts from (§11.7).
SCORE_FLOOR = -1e30
# Without attention blocks, a query scores the whole pool in one product when it is at most this many
# times as long as the list: cheaper than copying every query's listed rows (`_attend_pool`: a
# 128-token prefill's attention 1.8x faster on the CPU here; the two break even near 7x).
POOL_SCORES_FACTOR = 6


def window_indices(step: Step, window: int) -> torch.Tensor:
    """[N, n] pool rows each token sees in its window (−1 for none), pool = [rings (B·W) | call (N) | …].

    Token i of row b at position p sees positions max(0, p − W + 1) … p: those before the row's start
    from ring slot q mod W of the row's ring, the rest from the row's own tokens in the call (generalises
    §11.2 to any start and length, row by row). Each token lists W entries, oldest first, −1 for
    positions before 0 — the layout of the reference's decode step. The order matters because the
    blockwise softmax rounds per block of 64 entries (§11.7): with `step.reference_layout`, a call whose
    rows all start at 0 lists min(T, W) entries, valid ones first, as the reference's prefill does, which
    gives other bits than its decode for the same position (docs/NUMERICS.md N3).
    """
    device, B = step.positions.device, step.n_rows
    p = step.positions.unsqueeze(1)                                            # [N, 1]
    # the row's first token: a token's index less its rank in its row (no copy of the offsets from the host)
    first = (torch.arange(step.n_tokens, device=device) - step.token_rank).unsqueeze(1)
    start = p - step.token_rank.unsqueeze(1)
    call = B * window + first                                                  # pool index of the row's start
    if step.reference_layout and not any(step.starts):
        q = (p - window + 1).clamp(min=0) + torch.arange(min(max(step.counts), window), device=device)
        return torch.where(q <= p, call + q, -1)
    q = p - window + 1 + torch.arange(window, device=device)                  # [N, W] positions
    ring = step.row.unsqueeze(1) * window + q % window
    rows = torch.where(q >= start, call + (q - start), ring)
    return torch.where(q >= 0, rows, -1)


class Picked(NamedTuple):
    """Rows of a cache kv [S, L, Dh] listed per token, as a pool part [M·k, Dh]: row t · k + j is
    kv[token_slot[t], selected[t, j]] (−1: none, never listed). A decode step's compressed rows, which
    the native attention reads in the cache (N40)."""
    kv: torch.Tensor
    token_slot: torch.Tensor
    selected: torch.Tensor

    def rows(self, numerics: Numerics) -> torch.Tensor:
        """The part copied out of the cache: in one native call where the policy takes it, else indexed."""
        gathered = numerics.gather_compressed(self.kv, self.token_slot, self.selected)
        if gathered is not None:
            return gathered
        return self.kv[self.token_slot.unsqueeze(1), self.selected.clamp(min=0)].flatten(0, 1)


def _gather_rows(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pool [B, N, Dh], rows [B, T, n] → fp32 [B, T, n, Dh]; an entry of −1 reads pool row 0, a finite
    value whose logit the caller sets to −∞, so its probability and thus its product with it are 0.

    n is one attention block (64) or, without blocks, a whole list of W + k ≤ W + K entries: the copy
    is bounded by T·(W + K)·Dh whatever the context.
    """
    B, P, Dh = pool.shape
    # one index into the flattened pool: a gather from an expanded [B, T, P, Dh] view would make its
    # backward allocate and sum that whole view (training, dsv41/training/forward.py)
    flat = rows.clamp(min=0) + P * torch.arange(B, device=rows.device).view(B, 1, 1)
    return pool.reshape(B * P, Dh)[flat].float()


def sparse_attention(q: torch.Tensor, pool: torch.Tensor | list[torch.Tensor], rows: torch.Tensor, sink: torch.Tensor,
                     scale: float, numerics: Numerics, picked: Picked | None = None) -> torch.Tensor:
    """Attention of q [B, T, H, Dh] over the listed rows [B, T, n] of pool [B, N, Dh] with a sink (§11.7).
    For B = 1 the pool may be the list of its parts [Nᵢ, Dh], and `picked` rows of a cache one more part
    after them: a native kernel reads them where they lie, anything else copies them into one pool first.

    K = V (one latent); the sink sits in the denominator only, in scaled-logit units; rows of −1 are
    ignored; a query with no row returns zeros. With an attention block (reference numerics, invariant
    kernels) the list is walked in blocks with an online softmax; reference numerics round the
    probabilities to bf16 against the running maximum before P·V, the denominator keeping fp32, as the
    reference kernel does. Invariant kernels pad the list with −1 to whole blocks: every block then has
    one length, and a block of −1 changes nothing, so a query's result depends only on its own entries
    (docs/NUMERICS.md N6).
    Without a block it is one exact fp32 softmax over the whole list.
    """
    whole = numerics.sparse_attention(q, pool, rows, sink, scale, SCORE_FLOOR, picked)
    if whole is not None:
        return whole
    if picked is not None:
        pool = [*pool, picked.rows(numerics)]
    if not torch.is_tensor(pool):
        pool = torch.cat(pool)[None]
    B, T, H, _ = q.shape
    block = numerics.attention_block
    if block is None and pool.shape[1] <= POOL_SCORES_FACTOR * rows.shape[-1]:
        return _attend_pool(q, pool, rows, sink, scale, numerics)
    if block is not None and numerics.invariant:
        rows = F.pad(rows, (0, -rows.shape[-1] % block), value=-1)
    qf, step = q.float(), block or rows.shape[-1]
    out = torch.zeros(qf.shape, device=q.device)
    denom = torch.zeros(B, T, H, 1, device=q.device)
    m = torch.full((B, T, H, 1), SCORE_FLOOR, device=q.device)
    for start in range(0, rows.shape[-1], step):
        part = rows[..., start:start + step]
        kv = _gather_rows(pool, part)                                              # [B, T, n, Dh]
        z = numerics.attention_scores(qf, kv)
        z = z.masked_fill(~(part >= 0).unsqueeze(2), float("-inf")) * scale
        m_new = torch.maximum(m, z.amax(dim=-1, keepdim=True))
        rescale = numerics.exp(m - m_new)
        p = numerics.exp(z - m_new)
        denom = denom * rescale + p.sum(dim=-1, keepdim=True)
        if numerics.round_probabilities:
            p = p.to(torch.bfloat16).float()
        out = out * rescale + numerics.attention_values(p, kv)
        m = m_new
    denom = denom + numerics.exp(sink.float().view(1, 1, -1, 1) - m)
    return (out / denom).to(q.dtype)


def _attend_pool(q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor, scale: float,
                 numerics: Numerics) -> torch.Tensor:
    """`sparse_attention` without blocks, for a pool [B, P, Dh] no longer than POOL_SCORES_FACTOR lists
    (a prefill): every query scores all P rows in one product, keeps its listed entries' scores, and
    adds their probabilities back at their pool rows for one P·V product. The softmax is the same; the
    per-query copy [B, T, n, Dh] of the listed rows is not made. A row listed twice counts twice, as it
    does gathered."""
    qf, pf = q.float(), pool.float()
    scores = numerics.einsum("bthd,bpd->bthp", qf, pf)                                # [B, T, H, P]
    listed = rows.clamp(min=0).unsqueeze(2).expand(-1, -1, q.shape[2], -1)            # [B, T, H, n]
    z = scores.gather(-1, listed).masked_fill(~(rows >= 0).unsqueeze(2), float("-inf")) * scale
    m = z.amax(dim=-1, keepdim=True).clamp(min=SCORE_FLOOR)
    p = numerics.exp(z - m)
    denom = p.sum(dim=-1, keepdim=True) + numerics.exp(sink.float().view(1, 1, -1, 1) - m)
    weights = torch.zeros_like(scores).scatter_add_(-1, listed, p)
    return (numerics.einsum("bthp,bpd->bthd", weights, pf) / denom).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, role: LayerRole, *, numerics: Numerics, device=None, dtype=torch.bfloat16,
                 indexer_budget_bytes: int = DEFAULT_BUDGET_BYTES, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.role, self.numerics = role, numerics
        self.head_dim, self.window = cfg.head_dim, cfg.window_size
        self.o_lora_rank, self.index_topk = cfg.o_lora_rank, cfg.index_topk
        # this rank's heads and output groups (all of them in one process, docs/PARALLEL.md §1)
        self.n_heads, self.o_groups = parallel.local("attn.attn_sink", cfg.n_heads), parallel.local("attn.wo_a", cfg.o_groups)
        self.candidate_topk_blocks, self.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.softmax_scale = cfg.head_dim ** -0.5
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        dense = dense_storage(cfg)
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, device=device, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dense, **kw)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, numerics=numerics, device=device)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, dense,
                                         shard=parallel.shard("attn.wq_b"), **kw)
        self.wkv = Linear(cfg.dim, cfg.head_dim, dense, **kw)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, numerics=numerics, device=device)
        # wo_a is used in a grouped einsum, not a quantised GEMM: held in bf16 (§6.2).
        self.wo_a = ColumnParallelLinear(cfg.group_width, cfg.o_groups * cfg.o_lora_rank, "bf16", stored_as=dense,
                                         shard=parallel.shard("attn.wo_a"), **kw)
        self.wo_b = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dense,
                                      shard=parallel.shard("attn.wo_b"), **kw)
        self.rotary = Rotary.for_layer(cfg, role.uses_compressed_rope, numerics)
        self.compressor = (Compressor(cfg.dim, cfg.head_dim, role.ratio, cfg.norm_eps, **kw)
                           if role.is_kv_source else None)
        self.indexer = (Indexer(cfg.dim, cfg.q_lora_rank, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim,
                                cfg.norm_eps, owns_keys=role.is_kv_source, dense=dense,
                                budget_bytes=indexer_budget_bytes, parallel=parallel, **kw)
                        if role.is_index_source else None)

    # -------------------------------------------------------------------------------- forward
    def projections(self, step: Step, handoff: Handoff) -> tuple:
        """What `Numerics.attention_in` takes after the rows: (wq_a, q_norm's weight and eps, wq_b, wkv,
        kv_norm's weight and eps, the step's RoPE phases, the heads)."""
        return (self.wq_a.weight, self.q_norm.weight, self.q_norm.eps, self.wq_b.weight, self.wkv.weight,
                self.kv_norm.weight, self.kv_norm.eps, handoff.step_phases(self.rotary, step), self.n_heads)

    def forward(self, x: torch.Tensor, step: Step, handoff: Handoff, cache: ModelCache,
                entered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [1, N, D] (the call's packed tokens after attn_norm) → [1, N, D]. `entered`: the query and key
        paths' (qr, q, kv) of x, when the block computed them with its entry (`Numerics.attention_entry`)."""
        pos, layer = step.positions, self.role.layer_id
        phases = handoff.step_phases(self.rotary, step)
        if entered is None:
            wq_a, q_norm, q_eps, wq_b, wkv, kv_norm, kv_eps, phases, heads = self.projections(step, handoff)
            entered = self.numerics.attention_in(x, wq_a, (q_norm, q_eps), wq_b, wkv, (kv_norm, kv_eps), phases, heads)
        if entered is not None:
            qr, q, kv = entered
        else:
            qr = self.q_norm(self.wq_a(x))                                          # [1, N, Qr]
            q = self.rotary.rotate(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), pos, phases=phases)
            kv = self.rotary.rotate(self.kv_norm(self.wkv(x)), pos, phases=phases)
        kv = self.numerics.qdq_window(kv)

        pool = [cache.read_window(layer, step), kv[0]]                              # [B·W + N, Dh]
        picked = None
        if self.window not in handoff.window_rows:
            handoff.window_rows[self.window] = window_indices(step, self.window)
        rows = handoff.window_rows[self.window]                                     # [N, W]
        if self.role.ratio:
            base = sum(p.shape[0] for p in pool)
            compressed, listed = self._compressed(x, qr, step, handoff, cache, base)   # [M, Dh] or Picked, [N, k]
            if isinstance(compressed, Picked):
                picked = compressed
            else:
                pool.append(compressed)
            rows = torch.cat([rows, listed], dim=-1)

        o = sparse_attention(q, pool, rows[None], self.attn_sink, self.softmax_scale, self.numerics, picked)
        cache.write_window(layer, kv[0], step)
        left = self.numerics.attention_out(o, phases, self.wo_a.weight, self.o_groups, self.wo_b.weight)  # trap 11
        if left is not None:
            return self.wo_b.reduced(left)
        o = self.rotary.rotate(o, pos, inverse=True, phases=phases)                 # trap 11
        return self.wo_b(self._grouped_output(o))

    def _grouped_output(self, o: torch.Tensor) -> torch.Tensor:
        """[B, T, H, Dh] → [B, T, G·Or]: group g (heads of g) through its own slice of wo_a (§11.8)."""
        groups = o.flatten(2).unflatten(-1, (self.o_groups, -1))                   # [B, T, G, H·Dh/G]
        wo_a = self.wo_a.dequantized_weight(groups.dtype).unflatten(0, (self.o_groups, self.o_lora_rank))
        return self.numerics.grouped_linear(groups, wo_a).flatten(2)

    # -------------------------------------------------------------------------------- compressed part
    def _compressed(self, x, qr, step: Step, handoff: Handoff, cache: ModelCache, base: int):
        """(compressed rows [M, Dh] of the kv source the call's lists read; per token its k entries [N, k]
        as base + rows of them, or −1: the rows' place in a pool that holds `base` rows before them).

        M = B·C (each row's compressed rows, row after row) or, when smaller, N·k: token i's selected
        rows at i·k … i·k + k − 1, left in the cache (`Picked`: the native attention reads them there, N40;
        anything else copies them out). A decode step or a chunk deep into a long context reads k rows
        per token instead of the row's C; either pool gives every listed entry the same values in the
        same order, hence the same bits.
        """
        role = self.role
        source = cache.sources[role.kv_source]
        published = [False] * step.n_rows
        if role.is_kv_source:
            published = self._compress(x, step, handoff, source)
            for slot, done in zip(step.slots, published):
                if done:
                    cache.published_keys[slot] = role.layer_id
        C = step.compressed_rows(role.ratio)
        if role.is_index_source:
            def keys_of(rows: slice) -> torch.Tensor:                                # [rows, C, Di]
                owners = [self._keys_owner(step, cache, r, published) for r in range(rows.start, rows.stop)]
                slots = step.slots[rows]
                if any(o != owners[0] for o in owners):
                    return torch.cat([cache.sources[o].index_keys[s:s + 1, :C] for o, s in zip(owners, slots)])
                keys = cache.sources[owners[0]].index_keys
                if slots == tuple(range(slots[0], slots[0] + len(slots))):          # a run of slots: a view
                    return keys[slots[0]:slots[0] + len(slots), :C]
                return keys[step.slot_index[rows], :C]
            owners = [self._keys_owner(step, cache, r, published) for r in range(step.n_rows)]
            chosen = self._select_decode(x, qr, step, handoff, C, [(cache.sources[o].index_keys, s)
                                                                   for o, s in zip(owners, step.slots)])
            handoff.publish_selection(role.layer_id, self.select(x, qr, step, handoff, C, keys_of)
                                      if chosen is None else chosen)
        selected = handoff.selection_for(role)                                      # [N, k]
        N, k = selected.shape
        if N * k < step.n_rows * C:
            listed = torch.arange(base, base + N * k, device=x.device).view(N, k)
            return Picked(source.kv, step.token_slot, selected), torch.where(selected >= 0, listed, -1)
        kv = source.kv[step.slot_index, :C]          # [B, C, Dh]; the slots' tensor: no copy from a list
        return kv.flatten(0, 1), torch.where(selected >= 0, step.row.unsqueeze(1) * C + (selected + base), -1)

    def _compress(self, x: torch.Tensor, step: Step, handoff: Handoff, source: SourceState) -> list[bool]:
        """Compress the groups each row completes into its slot's rows and index keys; → per row, whether
        it published any. A decode step of an r = 1 source publishes every row's token in one native call
        where the policy takes it (`Numerics.publish`, N34).

        The projections run over the call's tokens at once and the new latents of every row get their
        keys and rotations together (under exact-sum kernels a row's bits do not depend on the others),
        except where `Numerics.rows_alone`: each row on its own, so that it sums as it does alone (N1).
        A decode step's rows also pool together (`Compressor.decode_rows`)."""
        if self.role.ratio == 1 and max(step.counts) == 1:
            compressor = (self.compressor.wkv.weight, self.compressor.norm.weight, self.compressor.norm.eps)
            if self.numerics.publish(x[0], compressor, None, self._index_key_weights(),
                                     handoff.step_phases(self.rotary, step), source.kv, source.index_keys,
                                     list(step.slots), list(step.starts)):
                return [True] * step.n_rows
        together = step.n_rows > 1 and not self.numerics.rows_alone
        projected = self.compressor.project(x[0]) if together else None
        if together and max(step.counts) == 1:
            latent, done = self.compressor.decode_rows(projected, step, source, x.dtype)
            if done:
                self._publish(source, [step.slots[b] for b in done],
                              [step.starts[b] // self.role.ratio for b in done], latent)
            return [b in done for b in range(step.n_rows)]
        owners, rows, latents, published = [], [], [], []
        for r, (slot, start) in enumerate(zip(step.slots, step.starts)):
            seg = step.tokens_of(r)
            if together:
                own = projected[seg] if torch.is_tensor(projected) else tuple(t[seg] for t in projected)
                latent, first = self.compressor.from_projected(own, start, source, slot, x.dtype)   # [g, Dh]
            else:
                latent, first = self.compressor(x[0, seg], start, source, slot)
            g = latent.shape[0]
            if g and not together:
                self._publish(source, [slot] * g, list(range(first, first + g)), latent)
            owners += [slot] * g
            rows += range(first, first + g)
            latents.append(latent)
            published.append(g > 0)
        if together and any(published):
            self._publish(source, owners, rows, torch.cat(latents))
        return published

    def _publish(self, source: SourceState, owners: list[int], rows: list[int], latent: torch.Tensor) -> None:
        """Rotate the pre-RoPE latents [G, Dh] (compressed row rows[i] of slot owners[i]) at their groups'
        first tokens (trap 8), derive their index keys, and write both into the slots' compressed rows."""
        device = latent.device
        positions = torch.tensor(rows, device=device) * self.role.ratio
        phases = self.rotary.phases(positions)                      # once for the keys and the latents
        if self.numerics.publish(None, None, latent, self._index_key_weights(), phases, source.kv, source.index_keys,
                                 owners, rows):
            return
        keys = self.indexer.keys(latent[None], positions, self.rotary, phases)[0]
        kv = self.numerics.qdq_compressed(self.rotary.rotate(latent[None], positions, phases=phases))[0]
        source.publish_rows(torch.tensor(owners, device=device), torch.tensor(rows, device=device), kv, keys)

    def _index_key_weights(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(wk, k_norm weight, eps): what `Indexer.keys` derives a latent's index key with."""
        return self.indexer.wk.weight, self.indexer.k_norm.weight, self.indexer.k_norm.eps

    def _keys_owner(self, step: Step, cache: ModelCache, r: int, published: list[bool]) -> int:
        """Whose index keys row r scores against: the kv source's, or with `stale_index_keys` the last
        publisher's when this index source published none for the row this call (trap 15)."""
        slot, role = step.slots[r], self.role
        stale = step.stale_index_keys and role.is_kv_source and not published[r]
        if stale and cache.published_keys[slot] is not None:
            return cache.published_keys[slot]
        return role.kv_source

    def _rows_together(self, step: Step, C: int) -> bool:
        """Whether the call's rows are scored as one batch: more than one, all of one length, and the
        batch's keys [B, C, Di] (in float64 under exact-sum kernels) within the indexer's budget. A
        row's scores and choices keep the bits they have one row at a time (`Indexer._tile`)."""
        if step.n_rows == 1 or len(set(step.counts)) > 1:
            return False
        itemsize = 8 if self.numerics.invariant else 4
        return step.n_rows * C * self.indexer.head_dim * itemsize <= self.indexer.budget_bytes

    def _select_decode(self, x, qr, step: Step, handoff: Handoff, C: int, keys: list[tuple[torch.Tensor, int]]):
        """`select` of a decode step (one token per row) in one native call where the policy takes it
        (`Numerics.index_select`, N34), its kept-block mask published as `select` does; keys: per row the
        index keys it scores against and its slot in them. None where the policy declines."""
        role, indexer = self.role, self.indexer
        if C == 0 or max(step.counts) > 1 or indexer.heads_shard is not None:
            return None
        blocks = (self.candidate_topk_blocks, self.candidate_block_size) if role.is_candidate_source else None
        restrict = handoff.candidates_for(role) if blocks is None and role.candidate_source is not None else None
        chosen = self.numerics.index_select(x, qr, (indexer.wq_b.weight, indexer.weights_proj.weight, indexer.weight_scale),
                                            handoff.step_phases(self.rotary, step), keys, C, step.visible(role.ratio),
                                            self.index_topk, blocks, restrict)
        if chosen is None:
            return None
        if blocks is not None:
            handoff.publish_candidates(role.layer_id, chosen[1][None])
        return chosen[0]

    def select(self, x, qr, step: Step, handoff: Handoff, C: int, keys_of):
        """[N, k] compressed positions per token, ascending, −1 for none (§11.6); keys_of(rows): the index
        keys [len(rows), C, Di] of the call rows in the slice `rows` (from the cache, or in training from
        the call itself).

        Each row is scored in chunks of query rows (`Indexer.select`), so the indexer's transients stay
        within its budget whatever C is; the candidate source fills its [1, N, C] kept-block mask chunk
        by chunk. Rows of one length go together, as a batch of rows (`_rows_together`).
        """
        if C == 0:
            return torch.empty(step.n_tokens, 0, dtype=torch.long, device=x.device)
        role = self.role
        visible = step.visible(role.ratio)                                          # [N]
        blocks = keep = restrict = None
        if role.is_candidate_source:
            blocks = (self.candidate_topk_blocks, self.candidate_block_size)
            keep = torch.zeros(1, step.n_tokens, C, dtype=torch.bool, device=x.device)
        elif role.candidate_source is not None:
            restrict = handoff.candidates_for(role)                                 # [1, N, C]
        chosen = torch.empty(step.n_tokens, min(self.index_topk, C), dtype=torch.long, device=x.device)
        q, weights = self.indexer.queries(x, qr, step.positions, self.rotary,     # the call's rows at once
                                          handoff.step_phases(self.rotary, step))
        if self._rows_together(step, C):
            # rows of one length (a decode or verify step) score as one batch: their keys side by side
            B, T = step.n_rows, step.counts[0]
            keys = keys_of(slice(0, B))                                             # [B, C, Di]
            as_rows = lambda t: None if t is None else t.reshape(B, T, *t.shape[2:])
            self.indexer.select(as_rows(x), as_rows(qr), keys, step.positions.view(B, T), visible.view(B, T),
                                self.rotary, self.index_topk, blocks=blocks, keep=as_rows(keep),
                                restrict=as_rows(restrict), out=chosen.view(B, T, -1),
                                queries=(as_rows(q), as_rows(weights)))
        else:
            for r in range(step.n_rows):
                seg = step.tokens_of(r)
                self.indexer.select(x[:, seg], qr[:, seg], keys_of(slice(r, r + 1)), step.positions[seg], visible[seg],
                                    self.rotary, self.index_topk, blocks=blocks,
                                    keep=None if keep is None else keep[:, seg],
                                    restrict=None if restrict is None else restrict[:, seg], out=chosen[None, seg],
                                    queries=(q[:, seg], weights[:, seg]))
        if keep is not None:
            handoff.publish_candidates(role.layer_id, keep)
        return chosen
