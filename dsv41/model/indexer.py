"""The indexer: which compressed positions each query attends to (docs/ARCHITECTURE.md §11.5–11.6).

Shapes: B batch, T query positions, C compressed positions that exist, Hi indexer heads, Di indexer head
dim, Qr query rank, Dh latent width, K top-k, Nb kept candidate blocks, Bs block size; t query rows of a
chunk, c compressed positions of a logits tile.

A small side attention scores every visible compressed position: fp4-QDQ queries (one per head) against
one shared fp4-QDQ key per position, rectified, weighted per head by `weights_proj`, summed. Index keys
are owned by kv sources; index sources that are not kv sources (24, 28, 32, 36) score against their kv
source's keys and are restricted to the candidate source's kept blocks (two-level top-k).

Both top-k choices break exact ties by position (lower first, `topk.py`): summed ReLUs are often exactly
equal, and the choice must not depend on the call's shape, batch, chunking or device (trap 14).

Memory. Scored at once, a call's logits are [T, Hi, C]: 96 GiB (float64 and its fp32 rounding) for a
512-token chunk at C = 256K, Hi = 64. `Indexer.select` therefore runs scoring, candidate blocks and
top-k over chunks of t query rows, and `Indexer.scores` computes the logits in tiles of c columns when a
chunk's full width does not fit; `indexer_tiling` picks t and c so that no tensor of these stages
exceeds the indexer's byte budget (`Indexer.budget_bytes`), and says how many bytes are alive at once
(a few budgets). It holds at any C down to one row of the narrowest tile.

Bits. A row's scores, blocks and top-k depend on that row only; the query projections run once per
call, before any chunking (a BLAS projection of fewer rows sums in another order, docs/NUMERICS.md N1);
a logit and its head sum keep their bits in a chunk of rows and in an aligned column tile
(`column_tiles`) — exactly for the float64 products of bf16 / fp4 values, by measurement for BLAS
GEMMs and fp32 head sums (torch 2.13 + MKL, AVX-512, tests/test_indexer_memory.py). A call's rows of one
length are scored as one batch when their keys fit the budget, each BLAS product and head sum still at
the shapes of one row (`Indexer._tile`). So a chunked call is bit-identical to the call in one piece,
and a batched one to its rows scored one by one, in every numerics mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import INDEXER_BUDGET_BYTES
from .layers import ColumnParallelLinear, Linear, RMSNorm
from ..parallel.context import ParallelContext
from .numerics import Numerics
from .rope import Rotary
from .topk import topk as ordered_topk

NEG_INF = float("-inf")

# Default bound on one transient tensor of an indexer call (RuntimeConfig.indexer_budget_bytes sets it).
DEFAULT_BUDGET_BYTES = INDEXER_BUDGET_BYTES
# Bytes per (row, position) of the widest row tensor: the top-k's int64 keys (topk.py).
KEY_BYTES = 8
# Logit tiles start at multiples of COLUMN_ALIGN and are at least MIN_TILE_UNITS of them wide (except
# the last, which ends at C). The CPU's fp32 sum over heads walks the columns in vector blocks (64 on
# AVX-512) and finishes the partial last block by other code, and a BLAS product of 1 or 2 columns
# takes another kernel: both change a column's bits (measured, torch 2.13 + MKL). Aligned tiles put
# every column at the same place in its block as the untiled call, with the same tail.
COLUMN_ALIGN = 256
MIN_TILE_UNITS = 4
# Upper bounds on the bytes alive at once, per element of the phase's widest tensor (see
# `indexer_tiling`): a row chunk [t, C] (scores, restricted scores, a mask, the top-k's fp32 copy and
# three int64 key tensors alive together) and per compressed position (int64 position ramps).
ROW_LIVE_BYTES = 40
POSITION_LIVE_BYTES = 24


def visible_counts(start_pos: int, length: int, ratio: int, device=None) -> torch.Tensor:
    """[T]: compressed positions visible to each query, ⌊(p + 1) / r⌋ (§11.5, trap 9)."""
    positions = torch.arange(start_pos, start_pos + length, device=device)
    return (positions + 1) // ratio


# ---------------------------------------------------------------------------------------- the memory plan

@dataclass(frozen=True)
class IndexerTiling:
    """How one indexer call over n_queries rows and n_compressed positions is cut (all sizes in bytes)."""

    rows: int
    """Query rows per chunk (t)."""
    columns: int
    """Compressed positions per logits tile (c); n_compressed when the logits are not tiled."""
    largest_bytes: int
    """The largest tensor the chunked stages allocate: at most the budget unless one row of the
    narrowest tile (min(C, MIN_TILE_UNITS · COLUMN_ALIGN) columns) already exceeds it."""
    peak_bytes: int
    """An upper bound on the bytes these stages hold at once. Not counted: the query projections
    (q [T, Hi, Di], weights [T, Hi]: no C in them), the outputs (positions [T, k], the kept-block
    mask [T, C] bool of a candidate source) and kernels' internal scratch."""


def indexer_tiling(n_queries: int, n_compressed: int, n_heads: int, head_dim: int, budget_bytes: int, *,
                   itemsize: int = 2, invariant: bool = True) -> IndexerTiling:
    """The chunking of one indexer call (pure: sizes in, sizes out).

    itemsize: bytes of the model's dtype (2 bf16, 4 fp32); invariant: invariant kernels, whose logits
    are a float64 product rounded once (numerics.py) from float64 copies of a tile's keys and queries.
    Rows come first: the logits are tiled over C only when one chunk's full width does not fit.
    """
    if min(n_heads, head_dim, itemsize, budget_bytes) < 1 or min(n_queries, n_compressed) < 0:
        raise ValueError(f"indexer_tiling needs positive sizes, got {n_queries} queries, {n_compressed} "
                         f"positions, {n_heads} heads of {head_dim}, itemsize {itemsize}, budget {budget_bytes}")
    T, C, Hi, Di, e, budget = max(n_queries, 1), max(n_compressed, 1), n_heads, head_dim, itemsize, budget_bytes
    logit = 8 if invariant else e                     # one logit as the einsum makes it
    keys64 = 8 * Di if invariant else 0               # a tile's float64 keys, per column
    q64 = 8 * Hi * Di if invariant else 0             # a chunk's float64 queries, per row
    per_row = max(KEY_BYTES * C, Hi * logit * C, q64)
    if per_row <= budget and keys64 * C <= budget:
        rows, columns = min(T, budget // per_row), C
    else:
        least = min(C, COLUMN_ALIGN * MIN_TILE_UNITS)   # the narrowest tile
        rows = min(T, max(1, budget // max(KEY_BYTES * C, Hi * logit * least, q64)))
        width = budget // (rows * Hi * logit)
        if keys64:
            width = min(width, budget // keys64)
        columns = min(C, max(least, width // COLUMN_ALIGN * COLUMN_ALIGN))
    largest = max(KEY_BYTES * rows * C, rows * Hi * logit * columns, keys64 * columns, q64 * rows)
    # alive at once while a tile is scored: its logits with their fp32 and dtype roundings (invariant)
    # or logits, ReLU and weighted product (BLAS), the float64 operands, the tile's head sum, and the
    # chunk's score buffer when tiled; the row phase: ROW_LIVE_BYTES per element of [t, C]
    per_logit = 12 + 2 * e if invariant else 3 * e     # invariant: + the heads-innermost copy (N8)
    tile_live = per_logit * rows * Hi * columns + keys64 * columns + q64 * rows + e * rows * columns
    if columns < C:
        tile_live += e * rows * C
    peak = max(tile_live, ROW_LIVE_BYTES * rows * C) + POSITION_LIVE_BYTES * C
    return IndexerTiling(rows, columns, largest, peak)


def indexer_transient_bytes(n_queries: int, n_compressed: int, n_heads: int, head_dim: int,
                            budget_bytes: int = DEFAULT_BUDGET_BYTES, *, itemsize: int = 2,
                            invariant: bool = True) -> int:
    """Peak transient bytes of one indexer call (`IndexerTiling.peak_bytes`): what a load plan reserves
    for the indexer while prefilling a chunk of n_queries tokens against n_compressed positions."""
    return indexer_tiling(n_queries, n_compressed, n_heads, head_dim, budget_bytes, itemsize=itemsize,
                          invariant=invariant).peak_bytes


def column_tiles(n_compressed: int, columns: int) -> list[tuple[int, int]]:
    """[(start, end)] tiles of at most `columns` positions, of near-equal widths in COLUMN_ALIGN units.

    Every tile but the last is a whole number of units, so each starts at a multiple of COLUMN_ALIGN
    and the last ends at C; spreading the units evenly keeps the last tile over a unit wide (the
    tiling only runs with columns ≥ MIN_TILE_UNITS units), never the 1- or 2-column product that takes
    another BLAS kernel.
    """
    C = n_compressed
    if columns >= C:
        return [(0, C)]
    units = -(-C // COLUMN_ALIGN)
    n = -(-units // max(1, columns // COLUMN_ALIGN))
    tiles, start = [], 0
    for i in range(n):
        end = min(C, start + (units // n + (i < units % n)) * COLUMN_ALIGN)
        tiles.append((start, end))
        start = end
    return tiles


# ---------------------------------------------------------------------------------------- the indexer

class Indexer(nn.Module):
    def __init__(self, dim: int, q_lora_rank: int, head_dim: int, n_heads: int, index_head_dim: int,
                 norm_eps: float, *, owns_keys: bool, numerics: Numerics, dense: str = "fp8", device=None,
                 dtype=torch.bfloat16, budget_bytes: int = DEFAULT_BUDGET_BYTES, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        # Hi below is this rank's heads; the head weights' scale uses all of them (§11.6)
        self.n_heads, self.head_dim, self.numerics = parallel.local("indexer.weights_proj", n_heads), index_head_dim, numerics
        self.weight_scale = index_head_dim ** -0.5 * n_heads ** -0.5
        # bound on one transient tensor of a call (`indexer_tiling`); no result depends on it
        self.budget_bytes = budget_bytes
        self.wq_b = ColumnParallelLinear(q_lora_rank, n_heads * index_head_dim, dense, numerics=numerics, device=device,
                                         dtype=dtype, shard=parallel.shard("indexer.wq_b"))
        self.weights_proj = ColumnParallelLinear(dim, n_heads, "bf16", numerics=numerics, device=device, dtype=dtype,
                                                 shard=parallel.shard("indexer.weights_proj"))
        # the heads' partial score sums are added over the TP group before any choice is made
        self.heads_shard = self.weights_proj.shard
        self.owns_keys = owns_keys
        if owns_keys:
            self.wk = Linear(head_dim, index_head_dim, "bf16", numerics=numerics, device=device, dtype=dtype)
            self.k_norm = RMSNorm(index_head_dim, norm_eps, numerics=numerics, device=device)

    def tiling(self, n_queries: int, n_compressed: int, itemsize: int) -> IndexerTiling:
        """This indexer's chunking of a call (its budget and kernels)."""
        return indexer_tiling(n_queries, n_compressed, self.n_heads, self.head_dim, self.budget_bytes,
                              itemsize=itemsize, invariant=self.numerics.invariant)

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
             phases: torch.Tensor | None = None) -> torch.Tensor:
        """Index keys [B, n, Di] from pre-RoPE latents [B, n, Dh] rotated at their group's first token;
        `phases`: rotary's at these positions, if already computed."""
        k = self.k_norm(self.wk(latent))
        return self.numerics.qdq_index(rotary.rotate(k, positions, phases=phases))

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                phases: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [B, T, Hi, Di] fp4-QDQ after RoPE, head weights [B, T, Hi]) of the rows given; `phases`:
        rotary's at these positions, if already computed."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = self.numerics.qdq_index(rotary.rotate(q, positions, phases=phases))
        weights = self.weights_proj(x) * self.weight_scale
        return q, weights

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               visible: torch.Tensor, rotary: Rotary, queries: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        """[B, T, C] scores in bf16 (§11.6), −∞ where j ≥ visible_t.

        `queries`: these rows' (q, weights) already projected; a chunking caller projects a call's rows
        once, since a BLAS projection of fewer rows sums in another order (docs/NUMERICS.md N1).
        """
        q, weights = self.queries(x, qr, positions, rotary) if queries is None else queries
        B, T, C = q.shape[0], q.shape[1], keys.shape[1]
        tiles = column_tiles(C, self.tiling(B * T, C, q.element_size()).columns)
        score = None
        for start, end in tiles:
            part = self._tile(q, weights, keys[:, start:end])                                # [B, T, c]
            if self.heads_shard is not None:
                # every rank then holds the same scores, so all make the same top-k choices
                dist.all_reduce(part, group=self.heads_shard.group)
            if len(tiles) == 1:
                score = part
            else:
                if score is None:
                    score = part.new_empty(B, T, C)
                score[..., start:end] = part
            del part
        hidden = torch.arange(C, device=q.device) >= visible.unsqueeze(-1)
        return score.masked_fill(hidden, NEG_INF)

    def _tile(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B, T, c] head-weighted ReLU logits of a key tile [B, c, Di]. Under BLAS kernels each batch row
        runs at the shapes it has alone: a batched product and an fp32 head sum over a larger tensor
        round differently (NUMERICS.md N1, N8)."""
        whole = self.numerics.index_scores(q, weights, keys)
        if whole is not None:
            return whole
        if q.shape[0] > 1 and not self.numerics.invariant:
            return torch.cat([self._tile(q[b:b + 1], weights[b:b + 1], keys[b:b + 1]) for b in range(q.shape[0])])
        logits = self.numerics.activation_einsum("bthd,bcd->bthc", q, keys)                 # [B, T, Hi, c]
        return self.numerics.head_sum(logits.relu() * weights.unsqueeze(-1), 2)

    def select(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               visible: torch.Tensor, rotary: Rotary, topk: int, *, blocks: tuple[int, int] | None = None,
               keep: torch.Tensor | None = None, restrict: torch.Tensor | None = None,
               out: torch.Tensor | None = None,
               queries: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[B, T, k] compressed positions per query (`select_topk`), scored in chunks of query rows;
        positions and visible are [T] (every row) or [B, T] (each row its own).

        blocks = (Nb, Bs): also write the candidate stage's kept-block mask of each row into `keep`
        [B, T, C] (a candidate source); restrict [B, T, C]: score only the positions it keeps (a
        candidate user); out: where to write the positions. The chunks change no bit: a row's scores,
        blocks and top-k are its own. `queries`: the rows' (q, weights) when the caller projected them.
        """
        q, weights = self.queries(x, qr, positions, rotary) if queries is None else queries   # once (N1)
        B, T, C = q.shape[0], q.shape[1], keys.shape[1]
        rows = max(1, self.tiling(B * T, C, q.element_size()).rows // B)
        chosen = torch.empty(B, T, min(topk, C), dtype=torch.long, device=q.device) if out is None else out
        for a in range(0, T, rows):
            r = slice(a, a + rows)
            seen = visible[..., r]
            score = self.scores(x[:, r], qr[:, r], keys, positions[..., r], seen, rotary, (q[:, r], weights[:, r]))
            if blocks is not None:
                keep[:, r] = candidate_blocks(score, seen, *blocks, numerics=self.numerics)
            if restrict is not None:
                score = score.masked_fill(~restrict[:, r], NEG_INF)
            chosen[:, r] = select_topk(score, seen, topk, numerics=self.numerics)
            del score                                   # before the next chunk's: one chunk alive at a time
        return chosen


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int, *,
                     numerics: Numerics | None = None) -> torch.Tensor:
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
    values, indices = _topk(numerics, block_score, min(topk_blocks, n_blocks))
    keep = torch.zeros_like(block_score, dtype=torch.bool).scatter_(-1, indices, values > NEG_INF)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int, *,
                numerics: Numerics | None = None) -> torch.Tensor:
    """[B, T, k] compressed positions, k = min(K, C), ascending; −1 where j ≥ visible_t (trap 12, 14).

    Ties go to the lower position, so a query chooses the same positions whatever C its call has: an
    invisible position (−∞, and later than every visible one) never displaces a visible one.
    """
    k = min(topk, scores.shape[-1])
    chosen = _topk(numerics, scores, k)[1].sort(dim=-1).values
    return torch.where(chosen < visible.unsqueeze(-1), chosen, -1)


def _topk(numerics: Numerics | None, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tie-ruled top-k in no particular order: the policy's kernel where one is given."""
    return ordered_topk(scores, k, sorted=False) if numerics is None else numerics.topk(scores, k, sorted=False)
