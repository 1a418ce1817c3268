"""Attention pieces against brute force and slow formulas (docs/ARCHITECTURE.md §11): window rows, sparse
attention with a sink, visibility, top-K, candidate blocks, the compressor, indexer scores, and the
stale index-key switch (trap 15)."""

import math

import pytest
import torch

from dsv41.model import formats
from dsv41.model import attention
from dsv41.model.attention import sparse_attention, window_indices
from dsv41.model.cache import SourceState
from dsv41.model.compressor import Compressor
from dsv41.model.indexer import Indexer, candidate_blocks, select_topk, visible_counts
from dsv41.model.init import init_random_
from dsv41.model.numerics import FAST, Numerics
from dsv41.model.rope import Rotary
from dsv41.model.step import Step

import helpers

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------ window

def window_rows_brute_force(start_pos, T, W):
    """Label every pool row with the position it holds, then list, per query, the rows in its window.

    Pool = [ring slots 0 … W−1 | the call's T rows]; ring slot i holds the newest position q < start_pos
    with q mod W = i (or nothing).
    """
    holds = []
    for slot in range(W):
        older = [q for q in range(start_pos) if q % W == slot]
        holds.append(older[-1] if older else None)
    holds += list(range(start_pos, start_pos + T))
    out = []
    for p in range(start_pos, start_pos + T):
        out.append(sorted(r for r, q in enumerate(holds) if q is not None and max(0, p - W + 1) <= q <= p))
    return out


@pytest.mark.parametrize("reference_layout", [False, True])
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_window_indices_against_brute_force(W, reference_layout):
    for start_pos in range(0, 21):
        for T in range(1, 13):
            got = window_indices(Step.uniform(1, start_pos, T, reference_layout=reference_layout), W)
            # the reference lists min(T, W) entries in a call from 0; the canonical layout always W
            width = min(T, W) if reference_layout and start_pos == 0 else W
            assert got.shape == (T, width)
            expect = window_rows_brute_force(start_pos, T, W)
            for t in range(T):
                row = got[t].tolist()
                valid = [r for r in row if r >= 0]
                assert sorted(valid) == expect[t], (start_pos, T, W, t)
                assert len(valid) == len(set(valid))
                assert row.count(-1) == width - len(valid)


def test_window_indices_wrap_around_example():
    one = lambda start, T, **kw: window_indices(Step.uniform(1, start, T, **kw), 4).tolist()
    # W = 4, decode at p = 9: positions 6, 7, 8 from ring slots 2, 3, 0 and p itself from call row 0
    assert one(9, 1) == [[2, 3, 0, 4]]
    # the reference's prefill from 0 lists min(T, W) entries, valid first: query 1 sees 0, 1
    assert one(0, 3, reference_layout=True)[1] == [4, 5, -1]
    # decode before the ring is full lists W entries, −1 (positions before 0) first
    assert one(2, 1) == [[-1, 0, 1, 4]]
    # the canonical layout gives a position the same list in a prefill as in a decode step:
    # position 2 seen by a prefill of 3 from 0 (call rows 4, 5, 6) and by a decode step at 2
    assert one(0, 3)[2] == [-1, 4, 5, 6]


def test_window_indices_of_a_mixed_step_are_each_rows_own():
    """Rows at different positions in one call: each token lists what it would alone, with ring entries
    moved to its row's ring (b·W + slot) and call entries to its row's tokens (B·W + the row's offset)."""
    W, starts, counts = 4, (0, 9, 2, 30), (3, 1, 5, 6)
    mixed = window_indices(Step((5, 1, 7, 0), starts, counts), W)
    B, first = len(starts), 0
    for b, (start, count) in enumerate(zip(starts, counts)):
        alone = window_indices(Step.uniform(1, start, count), W)
        moved = torch.where(alone < 0, -1, torch.where(alone < W, b * W + alone, B * W + first + alone - W))
        assert torch.equal(mixed[first:first + count], moved), b
        first += count


# ------------------------------------------------------------------------------------------ sparse attention

def dense_attention_oracle(q, pool, rows, sink, scale, round_probs=False):
    """float64 dense softmax over all pool rows with a mask; sink only in the denominator (§11.7)."""
    q, pool, sink = q.double(), pool.double(), sink.double()
    B, T, H, Dh = q.shape
    N = pool.shape[1]
    mask = torch.zeros(B, T, N, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for r in rows[b, t].tolist():
                if r >= 0:
                    mask[b, t, r] = True
    out = torch.zeros(B, T, H, Dh, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if not mask[b, t].any():
                continue                                           # no valid row: zeros
            z = (pool[b] @ q[b, t].t()).t() * scale                # [H, N]
            z = z.masked_fill(~mask[b, t], NEG_INF)
            m = z.amax(-1, keepdim=True)
            e = torch.exp(z - m)
            denom = e.sum(-1, keepdim=True) + torch.exp(sink.view(H, 1) - m)
            if round_probs:
                e = e.to(torch.bfloat16).double()
            out[b, t] = (e @ pool[b]) / denom
    return out


REF_BLAS, REF_INVARIANT = Numerics("reference", "blas"), Numerics("reference", "invariant")


@pytest.fixture(scope="module")
def attention_inputs():
    g = torch.Generator().manual_seed(10)
    # n > 64: the reference's online softmax walks three blocks
    B, T, H, Dh, N, n = 2, 5, 3, 16, 200, 150
    q = torch.randn(B, T, H, Dh, generator=g)
    pool = torch.randn(B, N, Dh, generator=g)
    # distinct rows per query, as real index lists are (window rows and offset compressed rows)
    rows = torch.stack([torch.randperm(N, generator=g)[:n] for _ in range(B * T)]).view(B, T, n)
    rows[torch.rand(B, T, n, generator=g) < 0.3] = -1
    rows[0, 2] = -1                                                 # a query with no valid row
    sink = torch.randn(H, generator=g)
    return q, pool, rows, sink, Dh ** -0.5


@pytest.mark.parametrize("listed", [150, 30], ids=["pool scored whole", "rows gathered"])
def test_sparse_attention_matches_dense_oracle(attention_inputs, listed, monkeypatch):
    """Fast numerics score a pool of 200 rows whole for a list of 150 (at most POOL_SCORES_FACTOR
    times as long) and gather a list of 30; blocks of 64 without rounding under invariant kernels."""
    q, pool, rows, sink, scale = attention_inputs
    rows = rows[..., :listed]
    whole = []
    original = attention._attend_pool
    monkeypatch.setattr(attention, "_attend_pool", lambda *a: whole.append(1) or original(*a))
    for numerics in (FAST, Numerics("fast", "invariant")):
        got = sparse_attention(q, pool, rows, sink, scale, numerics)
        expect = dense_attention_oracle(q, pool, rows, sink, scale)
        torch.testing.assert_close(got.double(), expect, rtol=0, atol=1e-5)
        assert torch.equal(got[0, 2], torch.zeros_like(got[0, 2]))
    assert len(whole) == (listed == 150)


def test_scoring_the_pool_whole_equals_gathering_the_rows_a_twice_listed_row_included(attention_inputs,
                                                                                     monkeypatch):
    q, pool, rows, sink, scale = attention_inputs
    rows = rows.clone()
    rows[1, 3, -1] = rows[1, 3, 0] = 7
    whole = sparse_attention(q, pool, rows, sink, scale, FAST)
    monkeypatch.setattr(attention, "POOL_SCORES_FACTOR", 0)
    gathered = sparse_attention(q, pool, rows, sink, scale, FAST)
    torch.testing.assert_close(whole, gathered, rtol=0, atol=1e-6)
    rows[1, 3, -1] = -1
    assert not torch.allclose(sparse_attention(q, pool, rows, sink, scale, FAST)[1, 3], gathered[1, 3], atol=1e-4)


@pytest.mark.parametrize("numerics", [REF_BLAS, REF_INVARIANT], ids=["blas", "invariant"])
def test_sparse_attention_rounded_probabilities(attention_inputs, numerics):
    """Reference numerics: online softmax over blocks of 64, bf16 probabilities against the running
    maximum: within bf16 rounding of the dense oracle with rounded probabilities."""
    q, pool, rows, sink, scale = attention_inputs
    got = sparse_attention(q.bfloat16(), pool.bfloat16(), rows, sink, scale, numerics)
    expect = dense_attention_oracle(q.bfloat16(), pool.bfloat16(), rows, sink, scale, round_probs=True)
    torch.testing.assert_close(got.double(), expect, rtol=0, atol=1e-2)
    assert got.dtype == torch.bfloat16 and torch.equal(got[0, 2], torch.zeros_like(got[0, 2]))


def test_sparse_attention_rounds_per_block_of_64(attention_inputs):
    """Which block an entry falls in changes the rounding: moving every valid entry one block later
    (64 entries of −1 in front) changes nothing, moving them by half a block does."""
    q, pool, rows, sink, scale = attention_inputs
    q, pool = q.bfloat16(), pool.bfloat16()
    base = sparse_attention(q, pool, rows, sink, scale, REF_BLAS)
    pad = lambda n: torch.cat([torch.full(rows.shape[:2] + (n,), -1), rows], dim=-1)
    assert torch.equal(sparse_attention(q, pool, pad(64), sink, scale, REF_BLAS), base)
    assert not torch.equal(sparse_attention(q, pool, pad(32), sink, scale, REF_BLAS), base)


def test_invariant_kernels_ignore_trailing_padding(attention_inputs):
    """A longer call lists more −1 entries after a query's own (a larger k = min(K, C)): with invariant
    kernels the result is bit-identical; the BLAS path's short last block sums in another order."""
    q, pool, rows, sink, scale = attention_inputs
    q, pool = q.bfloat16(), pool.bfloat16()
    longer = torch.cat([rows, torch.full(rows.shape[:2] + (37,), -1)], dim=-1)
    assert torch.equal(sparse_attention(q, pool, longer, sink, scale, REF_INVARIANT),
                       sparse_attention(q, pool, rows, sink, scale, REF_INVARIANT))


def test_sink_is_not_scaled_and_has_no_value():
    # one key: out = v · e^z / (e^z + e^sink) with z = (q·k)·scale and the raw sink
    q = torch.ones(1, 1, 1, 4)
    pool = torch.tensor([[[0.5, 0.25, -0.5, 1.0]]])
    z = float((q.flatten() * pool.flatten()).sum()) * 0.5
    sink = torch.tensor([0.3])
    got = sparse_attention(q, pool, torch.zeros(1, 1, 1, dtype=torch.long), sink, 0.5, FAST)
    weight = math.exp(z) / (math.exp(z) + math.exp(0.3))
    torch.testing.assert_close(got.flatten(), pool.flatten() * weight, rtol=1e-6, atol=1e-7)


def test_row_order_does_not_matter(attention_inputs):
    q, pool, rows, sink, scale = attention_inputs
    perm = torch.randperm(rows.shape[-1], generator=torch.Generator().manual_seed(3))
    a = sparse_attention(q, pool, rows, sink, scale, FAST)
    b = sparse_attention(q, pool, rows[..., perm], sink, scale, FAST)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ visibility, top-K

def test_visible_counts_formula():
    for r in (1, 2, 4):
        for s in range(0, 9):
            for T in range(1, 6):
                got = visible_counts(s, T, r).tolist()
                assert got == [(p + 1) // r for p in range(s, s + T)]
    # r = 2: the query at p = 2j sees groups 0 … j−1 only (trap 9)
    assert visible_counts(4, 2, 2).tolist() == [2, 3]


def masked_scores(B, T, C, visible, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randperm(B * T * C, generator=g).float().view(B, T, C)   # distinct
    hidden = torch.arange(C) >= visible.view(1, -1, 1)
    return scores.masked_fill(hidden, NEG_INF)


@pytest.mark.parametrize("topk", [1, 3, 5, 40])
def test_select_topk_against_brute_force(topk):
    B, T, C = 2, 6, 11
    visible = torch.tensor([0, 1, 3, 6, 10, 11])
    scores = masked_scores(B, T, C, visible, seed=topk)
    got = select_topk(scores, visible, topk)
    k = min(topk, C)
    assert got.shape == (B, T, k)
    for b in range(B):
        for t in range(T):
            vis = int(visible[t])
            ranked = sorted(range(vis), key=lambda j: -scores[b, t, j].item())[:k]
            expect = sorted(ranked) + [-1] * (k - len(ranked))
            assert got[b, t].tolist() == expect, (b, t)


def brute_force_blocks(scores, visible, topk_blocks, block_size):
    B, T, C = scores.shape
    keep = torch.zeros(B, T, C, dtype=torch.bool)
    n_blocks = -(-C // block_size)
    for b in range(B):
        for t in range(T):
            vis = int(visible[t])
            block_score = {}
            for blk in range(n_blocks):
                vals = [scores[b, t, j].item() for j in range(blk * block_size, min(C, (blk + 1) * block_size))]
                best = max(vals)
                if best > NEG_INF:
                    block_score[blk] = best
            if vis > 0:
                block_score[(vis - 1) // block_size] = math.inf        # the newest block is pinned
            kept = sorted(block_score, key=lambda k: -block_score[k])[:min(topk_blocks, n_blocks)]
            for blk in kept:
                keep[b, t, blk * block_size:(blk + 1) * block_size] = True
    return keep


@pytest.mark.parametrize("topk_blocks,block_size", [(1, 2), (2, 2), (2, 3), (100, 2), (3, 4)])
def test_candidate_blocks_against_brute_force(topk_blocks, block_size):
    B, T, C = 2, 6, 11
    visible = torch.tensor([0, 1, 3, 6, 10, 11])
    scores = masked_scores(B, T, C, visible, seed=7 * topk_blocks + block_size)
    got = candidate_blocks(scores, visible, topk_blocks, block_size)
    assert got.shape == (B, T, C) and got.dtype == torch.bool
    assert torch.equal(got, brute_force_blocks(scores, visible, topk_blocks, block_size))


def test_candidate_pins_the_newest_partial_block_even_when_lowest():
    # 9 visible of 10, blocks of 2: block 4 holds only position 8 and scores lowest; it is kept anyway
    scores = torch.tensor([[[5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, -3.0, NEG_INF]]])
    visible = torch.tensor([9])
    keep = candidate_blocks(scores, visible, 2, 2)
    assert keep[0, 0].tolist() == [False] * 6 + [True, True] + [True, True]


def test_candidate_drops_blocks_with_nothing_visible_and_keeps_at_most_the_block_count():
    scores = torch.tensor([[[1.0, 2.0, 3.0, NEG_INF, NEG_INF, NEG_INF]]])
    keep = candidate_blocks(scores, torch.tensor([3]), 50, 2)      # Nb far above the 3 blocks
    assert keep[0, 0].tolist() == [True, True, True, True, False, False]
    nothing = candidate_blocks(torch.full((1, 1, 6), NEG_INF), torch.tensor([0]), 50, 2)
    assert not nothing.any()


# ------------------------------------------------------------------------------------------ compressor

def make_compressor(ratio, numerics, dim=64, head_dim=64, seed=0):
    dtype = torch.float32 if numerics == "fast" else torch.bfloat16
    comp = Compressor(dim, head_dim, ratio, 1e-20, numerics=Numerics.default(numerics), dtype=dtype)
    return init_random_(comp, seed), dtype


def fresh_state(B, ratio, head_dim=64):
    tail = torch.zeros(B, ratio, head_dim)
    return SourceState(kv=None, index_keys=None, tail_kv=tail, tail_score=torch.full_like(tail, NEG_INF))


def compress_rows(comp, x, start, state):
    """The compressor on each row b of x [B, T, D] (slot b of the state) → (latents [B, g, Dh], first)."""
    outs = [comp(x[b], start, state, b) for b in range(x.shape[0])]
    return torch.stack([o[0] for o in outs]), outs[0][1]


def pooled_by_formula(comp, x):
    """§11.3 r = 2: per channel c, Σ_t softmax_t(g_{t,c}) · a_{t,c} over each group, then RMSNorm (float64)."""
    xd = x.double()
    a = xd @ comp.wkv.weight.double().t()
    g = xd @ comp.wgate.weight.double().t()
    B, T, Dh = a.shape
    out = torch.zeros(B, T // 2, Dh, dtype=torch.float64)
    for j in range(T // 2):
        t0, t1 = 2 * j, 2 * j + 1
        for c in range(Dh):
            e0, e1 = torch.exp(g[:, t0, c]), torch.exp(g[:, t1, c])
            out[:, j, c] = (e0 * a[:, t0, c] + e1 * a[:, t1, c]) / (e0 + e1)
    return out


def rms_norm(x, weight, eps=1e-20):
    return weight.double() * x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)


def test_compressor_ratio_2_pools_by_per_channel_softmax():
    comp, dtype = make_compressor(2, "fast")
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(11))
    latent, first = compress_rows(comp, x, 0, fresh_state(2, 2))
    assert first == 0 and latent.shape == (2, 4, 64)
    expect = rms_norm(pooled_by_formula(comp, x), comp.norm.weight)
    torch.testing.assert_close(latent.double(), expect, rtol=0, atol=1e-5)


def test_compressor_ratio_2_reference_numerics():
    comp, dtype = make_compressor(2, "reference")
    assert comp.wkv.weight.dtype == torch.float32 and comp.wgate.weight.dtype == torch.float32
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    latent, _ = compress_rows(comp, x, 0, fresh_state(1, 2))
    assert latent.dtype == torch.bfloat16
    pooled = pooled_by_formula(comp, x).to(torch.bfloat16).double()      # bf16(pooled) before the norm
    expect = rms_norm(pooled, comp.norm.weight)
    torch.testing.assert_close(latent.double(), expect, rtol=0.01, atol=0.02)


@pytest.mark.parametrize("bounds", [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 3, 4, 9, 11], [0, 5, 11],
                                    [0, 1, 11], [0, 11]])
def test_compressor_chunk_split_invariance(bounds):
    comp, _ = make_compressor(2, "fast")
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(13))
    whole, _ = compress_rows(comp, x, 0, fresh_state(2, 2))                            # 5 groups; position 10 waits
    state = fresh_state(2, 2)
    rows = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        latent, first = compress_rows(comp, x[:, a:b], a, state)
        assert first == a // 2
        for i in range(latent.shape[1]):
            rows[first + i] = latent[:, i]
    assert sorted(rows) == list(range(5))
    # fp32 GEMMs of different row counts may round differently in the last bit
    torch.testing.assert_close(torch.stack([rows[j] for j in range(5)], 1), whole, rtol=0, atol=1e-5)
    # the odd tail is carried: one more position completes group 5 exactly as a one-shot call would
    y = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(14))
    latent, first = compress_rows(comp, y, 11, state)
    ref, _ = compress_rows(comp, torch.cat([x, y], 1), 0, fresh_state(2, 2))
    assert first == 5
    torch.testing.assert_close(latent[:, 0], ref[:, 5], rtol=0, atol=1e-6)


def test_compressor_ratio_1_is_a_normed_projection():
    comp, _ = make_compressor(1, "fast")
    assert not hasattr(comp, "wgate")
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(15))
    latent, first = comp(x[0], 7, None, 0)
    assert first == 7
    expect = rms_norm(x[0].double() @ comp.wkv.weight.double().t(), comp.norm.weight)
    torch.testing.assert_close(latent.double(), expect, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ indexer

@pytest.fixture(scope="module")
def indexer_parts():
    cfg = helpers.nonbinding_config()
    idx = init_random_(Indexer(cfg.dim, cfg.q_lora_rank, cfg.head_dim, 3, 32, 1e-20, owns_keys=True,
                               numerics=FAST, dtype=torch.float32), 5)
    rotary = Rotary.for_layer(cfg, True)
    g = torch.Generator().manual_seed(16)
    B, T, C = 2, 4, 9
    x = torch.randn(B, T, cfg.dim, generator=g)
    qr = torch.randn(B, T, cfg.q_lora_rank, generator=g)
    keys = torch.randn(B, C, 32, generator=g)
    positions = torch.arange(5, 5 + T)
    visible = visible_counts(5, T, 1)                                  # 6, 7, 8, 9
    return idx, rotary, x, qr, keys, positions, visible


def slow_index_scores(idx, rotary, x, qr, keys, positions, visible):
    H, Di = idx.n_heads, idx.head_dim
    q = (qr.double() @ idx.wq_b.weight.double().t()).view(*qr.shape[:2], H, Di)
    q = helpers.rotate_reference(q, positions, rotary.freqs)
    w = (x.double() @ idx.weights_proj.weight.double().t()) / math.sqrt(Di) / math.sqrt(H)
    B, T, C = x.shape[0], x.shape[1], keys.shape[1]
    out = torch.full((B, T, C), NEG_INF, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for j in range(int(visible[t])):
                out[b, t, j] = sum(max(float(q[b, t, h] @ keys[b, j].double()), 0.0) * float(w[b, t, h])
                                   for h in range(H))
    return out


def test_indexer_scores_against_slow_formula(indexer_parts):
    idx, rotary, x, qr, keys, positions, visible = indexer_parts
    got = idx.scores(x, qr, keys, positions, visible, rotary)
    expect = slow_index_scores(idx, rotary, x, qr, keys, positions, visible)
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    finite = torch.isfinite(expect)
    torch.testing.assert_close(got.double()[finite], expect[finite], rtol=1e-5, atol=1e-5)


def test_indexer_keys_against_formula(indexer_parts):
    idx, rotary, *_ = indexer_parts
    latent = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(17))
    positions = torch.tensor([0, 2, 4])                               # group starts j·r (trap 8)
    got = idx.keys(latent, positions, rotary)
    k = rms_norm(latent.double() @ idx.wk.weight.double().t(), idx.k_norm.weight)
    expect = helpers.rotate_reference(k, positions, rotary.freqs)
    torch.testing.assert_close(got.double(), expect, rtol=0, atol=1e-5)


def test_indexer_reference_numerics_quantises_queries():
    cfg = helpers.nonbinding_config()
    idx = init_random_(Indexer(cfg.dim, cfg.q_lora_rank, cfg.head_dim, 2, 32, 1e-20, owns_keys=False,
                               numerics=REF_INVARIANT, dtype=torch.bfloat16), 6)
    rotary = Rotary.for_layer(cfg, True)
    g = torch.Generator().manual_seed(18)
    x = torch.randn(1, 3, cfg.dim, generator=g).to(torch.bfloat16)
    qr = torch.randn(1, 3, cfg.q_lora_rank, generator=g).to(torch.bfloat16)
    keys = formats.fp4_qdq_e8m0(torch.randn(1, 4, 32, generator=g)).to(torch.bfloat16)
    positions, visible = torch.arange(3), visible_counts(0, 3, 1)
    got = idx.scores(x, qr, keys, positions, visible, rotary)
    assert got.dtype == torch.bfloat16
    q = idx.wq_b(qr).unflatten(-1, (2, 32))
    q = formats.fp4_qdq_e8m0(rotary.rotate(q, positions)).double()
    w = idx.weights_proj(x).double() / 8.0                            # 32^-½ · 2^-½
    expect = torch.full((1, 3, 4), NEG_INF, dtype=torch.float64)
    for t in range(3):
        for j in range(int(visible[t])):
            expect[0, t, j] = sum(max(float(q[0, t, h] @ keys[0, j].double()), 0.0) * float(w[0, t, h])
                                  for h in range(2))
    finite = torch.isfinite(expect)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got.double()[finite], expect[finite], rtol=0.02, atol=0.02)


# ------------------------------------------------------------------------------------------ stale index keys

def capture_layer(model, layer):
    """Record (x, selection, step) of every call of layer `layer`'s attention."""
    seen = []

    def hook(module, args, output):
        x, step, handoff, cache = args
        seen.append((x, handoff.selections[layer].clone(), step))
    model.layers[layer].attn.register_forward_hook(hook)
    return seen


def expected_selection(model, layer, x, step, keys):
    """Each row's tokens scored against its own slot's rows of `keys` [S, L, Di], then top-K (§11.6)."""
    attn = model.layers[layer].attn
    qr = attn.q_norm(attn.wq_a(x))
    C, visible = step.compressed_rows(attn.role.ratio), step.visible(attn.role.ratio)
    parts = []
    for b, slot in enumerate(step.slots):
        seg = step.tokens_of(b)
        parts.append(attn.indexer.scores(x[:, seg], qr[:, seg], keys[slot:slot + 1, :C], step.positions[seg],
                                         visible[seg], attn.rotary))
    return select_topk(torch.cat(parts, dim=1), visible, model.cfg.index_topk)[0]


@torch.no_grad()
def test_stale_index_keys_switch():
    """What is verified (trap 15): on a config where layer 2's top-K binds (4 of up to 10 groups),
    - a one-shot prefill gives bit-identical hidden states with and without the switch;
    - decode at an even position p (layer 2's group incomplete, nothing published) scores layer 2's
      queries against the keys of the kv source that published last, layer 4 (rows 0 … ⌊(p+1)/2⌋−1),
      and the default against layer 2's own keys; the selections and the hidden states differ;
    - decode at the following odd position (layer 2 publishes) uses layer 2's own keys in both modes.
    """
    cfg = helpers.binding_config()
    default = helpers.build(cfg, "fast", seed=3)
    stale = helpers.build(cfg, "fast", seed=3, stale_index_keys=True)
    ids = helpers.token_ids(2, 22, seed=4)
    seen = {"default": capture_layer(default, 2), "stale": capture_layer(stale, 2)}
    caches = {"default": default.new_cache(2, helpers.MAX_SEQ), "stale": stale.new_cache(2, helpers.MAX_SEQ)}
    models = {"default": default, "stale": stale}

    out = {k: models[k](ids[:, :20], 0, caches[k]).hidden for k in models}
    assert torch.equal(out["default"], out["stale"])

    # p = 20 (even): the stale switch reads layer 4's keys
    out = {k: models[k](ids[:, 20:21], 20, caches[k]).hidden for k in models}
    for mode, keys_from in (("default", 2), ("stale", 4)):
        x, got, step = seen[mode][-1]
        # layer 4 runs after layer 2, so its keys in the cache are still those of the previous call
        expect = expected_selection(models[mode], 2, x, step, caches[mode].sources[keys_from].index_keys)
        assert torch.equal(got, expect), mode
    assert not torch.equal(seen["default"][-1][1], seen["stale"][-1][1])
    assert (out["default"] - out["stale"]).abs().max() > 1e-3

    # p = 21 (odd): layer 2 completes group 10 and publishes; both modes use layer 2's own keys
    for k in models:
        models[k](ids[:, 21:22], 21, caches[k])
        x, got, step = seen[k][-1]
        assert torch.equal(got, expected_selection(models[k], 2, x, step, caches[k].sources[2].index_keys)), k


# ------------------------------------------------------------------------------------------ released sizes (trap 22)

def test_candidate_stage_with_more_than_2048_blocks():
    # released sizes: Nb = 2048 blocks of Bs = 8 kept out of 2050 (C = 16 396 visible positions)
    C, Bs, Nb = 2049 * 8 + 4, 8, 2048
    g = torch.Generator().manual_seed(30)
    scores = torch.rand(1, 1, C, generator=g, dtype=torch.float64).float() + 1.0
    scores[..., 8 * 5:8 * 6] = 0.1                   # two weak full blocks: 5 and 17
    scores[..., 8 * 17:8 * 18] = 0.2
    scores[..., 8 * 2049:] = 0.0                       # the newest block (partial, 4 positions) is the weakest
    keep = candidate_blocks(scores, torch.tensor([C]), Nb, Bs)
    kept_blocks = keep[0, 0, ::Bs]
    assert int(kept_blocks.sum()) == Nb
    dropped = (~kept_blocks).nonzero().flatten().tolist()
    assert dropped == [5, 17]
    assert keep[0, 0, 8 * 2049:].all()


def test_topk_512_of_a_long_context():
    C, K = 16396, 512
    g = torch.Generator().manual_seed(31)
    scores = torch.randperm(C, generator=g).float().view(1, 1, C)
    visible = torch.tensor([C - 3])
    scores[..., C - 3:] = NEG_INF
    got = select_topk(scores, visible, K)[0, 0]
    expect = scores[0, 0, :C - 3].topk(K).indices.sort().values
    assert torch.equal(got, expect)
    assert got.dtype == torch.int64                    # int64 indices: offsets may pass 2^31 (trap 24)


def test_sparse_attention_released_head_width():
    # 512-wide latent, window 128 + top-K 512 = 640 indices for one query, 4 of the 64 heads
    g = torch.Generator().manual_seed(32)
    q = torch.randn(1, 1, 4, 512, generator=g)
    pool = torch.randn(1, 128 + 1 + 700, 512, generator=g)
    rows = torch.randperm(pool.shape[1], generator=g)[:640].view(1, 1, 640)
    rows[..., 600:] = -1
    sink = torch.randn(4, generator=g)
    got = sparse_attention(q, pool, rows, sink, 512 ** -0.5, FAST)
    expect = dense_attention_oracle(q, pool, rows, sink, 512 ** -0.5)
    torch.testing.assert_close(got.double(), expect, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------ batched compression
@pytest.mark.parametrize("numerics, kernels, together", [
    ("fast", "blas", True), ("fast", "invariant", True), ("reference", "invariant", True),
    ("reference", "blas", False)])
def test_a_batched_step_compresses_its_rows_in_one_projection_unless_rows_run_alone(numerics, kernels, together,
                                                                                    monkeypatch):
    """A 3-row decode step projects its rows' latents in one call per kv source, except under reference
    numerics with BLAS kernels (`Numerics.rows_alone`: the reference's one-row shapes). Either way each
    row's compressed rows equal those of the row run alone: bit for bit under exact-sum kernels, within
    fp32 rounding under fast BLAS numerics, whose batched products sum in another order."""
    cfg = helpers.without_dspark(helpers.binding_config())
    model = helpers.build(cfg, numerics, kernels=kernels)
    ids = helpers.token_ids(3, 13)
    batched, alone = model.new_cache(3), [model.new_cache(1) for _ in range(3)]
    with torch.no_grad():
        model(ids[:, :12], 0, batched)
        for b, cache in enumerate(alone):
            model(ids[b:b + 1, :12], 0, cache)
        calls = []
        original = Compressor.project
        monkeypatch.setattr(Compressor, "project", lambda self, x: calls.append(x.shape[0]) or original(self, x))
        model(ids[:, 12:13], 12, batched)
        assert calls == ([3] if together else [1, 1, 1]) * len(cfg.kv_source_layers)
        for b, cache in enumerate(alone):
            model(ids[b:b + 1, 12:13], 12, cache)
    for layer in cfg.kv_source_layers:
        rows = 13 // cfg.compress_ratios[layer]
        for b, cache in enumerate(alone):
            got, want = batched.sources[layer].kv[b, :rows], cache.sources[layer].kv[0, :rows]
            if kernels == "invariant":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
