"""Float64 oracles for one attention layer and one whole block, written from docs/ARCHITECTURE.md.

Each oracle is computed from the layer's weights alone, position by position, with no cache: query
latent and q_norm, wq_b, RoPE (§10, §11.1), window KV (§11.2), the r = 2 softmax pooling or the r = 1
projection (§11.3), the latent's RoPE at the group's first token (§11.4), index keys and indexer scores
(§11.6), visibility ⌊(p + 1)/r⌋ (§11.5), attention with the sink in the denominator only (§11.7),
inverse RoPE and the grouped wo_a (§11.8); for a block the hyper-connection mixes and Sinkhorn (§7),
the lagging pre (§5) and the MoE (§13). dsv41 runs the same layers in fast numerics with float32
(weights held dequantised, no activation quantisation, one exact softmax), in one call or in chunks
that cross the window, a pooling group and the cache.

The config is non-binding (`helpers.nonbinding_config`): top-K and the candidate stage are wider than
any position count here and every expert is active, so every visible compressed position is attended
and the oracle needs no top-K; the selection itself is checked to be exactly the visible positions.

Tolerance: the implementation rounds in float32 (unit roundoff 2⁻²⁴ ≈ 6e-8). A value here passes
through about ten float32 stages (projections of at most 256 terms, norms, rotations, an exp, the
grouped output), so its error is a few times 1e-7 of the tensor's scale (measured, printed with `-s`:
≤ 6e-7 for one layer or block, 1e-6 for the stack of eight blocks). TOL = 1e-5 of the tensor's largest
magnitude leaves a 10× margin and sits four orders below the effect of the mistakes the mutation tests
plant (each moves the result by more than 0.1 of its scale); those assert a distance of at least
MUTATION_FACTOR · TOL = 1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsv41.model.attention
import dsv41.model.moe
from dsv41.model import hyper
from dsv41.model.attention import Attention
from dsv41.model.step import Handoff, Step
from dsv41.model.indexer import Indexer
from dsv41.model.numerics import Numerics
from dsv41.model.rope import Rotary

import helpers

B = 2
SEQ = 26
# one prefill of all positions, or a prefill longer than the window (8) that ends inside a pooling group
# (19), a multi-token continuation that completes it (19 … 23), a decode step that opens a group (24)
# and one that completes it (25)
CHUNKINGS = {"one-call": [0, SEQ], "chunked": [0, 19, 24, 25, SEQ]}
TOL = 1e-5
MUTATION_FACTOR = 100
# attention chains: a layer runs after the layers whose state it reads (§3): 3 reads 2's compressed
# rows and selection; 6 scores against 4's keys and is restricted to 4's candidate blocks; 7 reads 4's
# rows and 6's selection
CHAINS = {"window": (0,), "pooled": (2, 3), "token": (4, 6, 7)}


# ------------------------------------------------------------------------------------------ utilities

def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


def distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the expectation's largest magnitude."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def report(name: str, value: float) -> None:
    print(f"{name}: {value:.2e}")


@pytest.fixture(scope="module")
def model():
    return helpers.build(helpers.nonbinding_config(), "fast", seed=0)


@pytest.fixture(scope="module")
def cfg(model):
    return model.cfg


def random_inputs(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ oracle pieces

def rms_norm(v: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w · v / sqrt(mean(v²) + eps) (§6.7)."""
    return f64(weight) * v / torch.sqrt(v.square().mean(-1, keepdim=True) + eps)


def linear(v: torch.Tensor, module) -> torch.Tensor:
    """v Wᵀ with the module's [out, in] weight (plain tensors in fast numerics)."""
    return v @ f64(module.weight).t()


def rope(v: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """§10 in float64 on the last R features, adjacent pairs (the slow reference of helpers)."""
    return helpers.rotate_reference(v, positions, freqs, inverse=inverse)


def compressor_latents(compressor, x: torch.Tensor, ratio: int, eps: float) -> torch.Tensor:
    """Pre-RoPE latents [B, ⌊P/r⌋, Dh] of a kv source from its normed input x [B, P, D] (§11.3)."""
    if ratio == 1:
        return rms_norm(linear(x, compressor.wkv), compressor.norm.weight, eps)
    a, g = linear(x, compressor.wkv), linear(x, compressor.wgate)
    pooled = []
    for j in range(x.shape[1] // ratio):
        group = slice(j * ratio, (j + 1) * ratio)
        weights = torch.softmax(g[:, group], dim=1)            # over the r tokens, per channel
        pooled.append((weights * a[:, group]).sum(dim=1))
    return rms_norm(torch.stack(pooled, dim=1), compressor.norm.weight, eps)


def index_keys(indexer, latent: torch.Tensor, ratio: int, freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """k_j = RoPE_{j·r}(k_norm(wk(latent_j))) from the unrotated latent (§11.6, trap 8)."""
    first = torch.arange(latent.shape[1]) * ratio
    return rope(rms_norm(linear(latent, indexer.wk), indexer.k_norm.weight, eps), first, freqs)


def indexer_scores(cfg, indexer, x, qr, keys, freqs) -> torch.Tensor:
    """I[p, j] = Σ_h relu(qI[p, h] · k_j) · wI[p, h] · Di^−½ · Hi^−½ for every j (§11.6)."""
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    qi = rope(linear(qr, indexer.wq_b).unflatten(-1, (Hi, Di)), torch.arange(x.shape[1]), freqs)
    wi = linear(x, indexer.weights_proj) * (Di ** -0.5 * Hi ** -0.5)
    return (torch.einsum("bphd,bcd->bphc", qi, keys).relu() * wi.unsqueeze(-1)).sum(dim=2)


def kv_source_of(cfg, layer_id: int) -> int:
    """§3: a layer with r > 0 reads the compressed KV and index keys of the latest kv source ≤ it."""
    return max(j for j in cfg.kv_source_layers if j <= layer_id)


def attention_oracle(cfg, layer_id: int, layers, xs: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Attention of layer `layer_id` on its attn_norm output xs[layer_id] [B, P, D], positions 0 … P − 1.

    `layers` maps layer ids to attention modules (their weights); a layer with r > 0 reads the latents
    its kv source compresses from xs[source]. Returns the output [B, P, D] and what a cache would hold.
    """
    layer, eps = layers[layer_id], cfg.norm_eps
    H, Dh, W, G, Or = cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.o_groups, cfg.o_lora_rank
    r, freqs = cfg.compress_ratios[layer_id], layer.rotary.freqs
    x = f64(xs[layer_id])
    P = x.shape[1]
    pos = torch.arange(P)
    # §11.1: norm on the low-rank latent only (trap 5), RoPE on the last R features of each head at p
    qr = rms_norm(linear(x, layer.wq_a), layer.q_norm.weight, eps)
    q = rope(linear(qr, layer.wq_b).unflatten(-1, (H, Dh)), pos, freqs)
    # §11.2: one shared K = V latent per position
    kv = rope(rms_norm(linear(x, layer.wkv), layer.kv_norm.weight, eps), pos, freqs)
    result = {"window_kv": kv}
    if r:
        source = layers[kv_source_of(cfg, layer_id)]
        latent = compressor_latents(source.compressor, f64(xs[kv_source_of(cfg, layer_id)]), r, eps)
        first = torch.arange(latent.shape[1]) * r                       # the group's first token (§11.4)
        result["compressed"] = rope(latent, first, freqs)
        result["index_keys"] = index_keys(source.indexer, latent, r, freqs, eps)
        if layer_id in cfg.index_source_layers:
            result["scores"] = indexer_scores(cfg, layer.indexer, x, qr, result["index_keys"], freqs)
    visible = (pos + 1) // r if r else torch.zeros(P, dtype=torch.long)   # §11.5, trap 9
    sink = f64(layer.attn_sink)
    out = torch.zeros(B, P, H, Dh, dtype=torch.float64)
    for p in range(P):
        rows = kv[:, max(0, p - W + 1):p + 1]                                # window max(0, p−W+1) … p
        if r:
            rows = torch.cat([rows, result["compressed"][:, :visible[p]]], dim=1)   # every visible one
        z = torch.einsum("bhd,bnd->bhn", q[:, p], rows) / math.sqrt(Dh)
        m = z.amax(dim=-1, keepdim=True)
        e = torch.exp(z - m)
        # §11.7: the sink, in scaled-logit units, only in the denominator; K and V are the same rows
        denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink.view(1, H, 1) - m)
        out[:, p] = torch.einsum("bhn,bnd->bhd", e / denom, rows)
    out = rope(out, pos, freqs, inverse=True)                                # trap 11
    # §11.8: group g = heads g·H/G … (g+1)·H/G − 1 through rows g·Or … (g+1)·Or − 1 of wo_a
    per, wo_a = H // G, f64(layer.wo_a.weight)
    u = torch.cat([out[:, :, g * per:(g + 1) * per].flatten(2) @ wo_a[g * Or:(g + 1) * Or].t()
                   for g in range(G)], dim=-1)
    result["out"] = linear(u, layer.wo_b)
    result["visible"] = visible
    return result


# ------------------------------------------------------------------------------------------ block oracle

def sinkhorn_oracle(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """§7.4 in its stated order: row softmax + eps, column step, then (row, column) × (iters − 1)."""
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def mixes_oracle(X: torch.Tensor, fn, scale, base, cfg):
    """hc_mixes (§7): one RMS over all S·D features (stream-major), no weight; pre / post / comb."""
    S = X.shape[2]
    flat = X.flatten(2)
    m = (flat @ f64(fn).t()) / torch.sqrt(flat.square().mean(-1, keepdim=True) + cfg.norm_eps)
    scale, base = f64(scale), f64(base)
    pre = torch.sigmoid(m[..., :S] * scale[0] + base[:S]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[..., S:2 * S] * scale[1] + base[S:2 * S])
    c = (m[..., 2 * S:] * scale[2] + base[2 * S:]).unflatten(-1, (S, S))        # c[i][j], row i
    return pre, post, sinkhorn_oracle(c, cfg.hc_sinkhorn_iters, cfg.hc_eps)


def hc_pre(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * X).sum(dim=2)


def hc_post(o: torch.Tensor, R: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Stream j = post_j · o + Σ_i comb[i][j] · R_i: the residual mixed by combᵀ (trap 2)."""
    S = R.shape[2]
    streams = [post[..., j:j + 1] * o + sum(comb[..., i, j:j + 1] * R[:, :, i] for i in range(S))
               for j in range(S)]
    return torch.stack(streams, dim=2)


def moe_oracle(cfg, moe, x: torch.Tensor) -> torch.Tensor:
    """§13 on x [B, P, D]: √softplus router, bias selects only, normalised raw scores × route_scale,
    SwiGLU with up clamped to ±limit and the gate to ≤ limit, routing weight before w2, shared expert."""
    limit = cfg.swiglu_limit
    score = torch.sqrt(torch.nn.functional.softplus(linear(x, moe.gate) / cfg.gate_temp))     # [B, P, E]
    chosen = (score + f64(moe.gate.bias)).topk(cfg.n_activated_experts, dim=-1).indices
    raw = score.gather(-1, chosen)
    weights = raw / (raw.sum(-1, keepdim=True) + 1e-20) * cfg.route_scale

    def swiglu_ffn(w1, w3, w2, weight):
        g, u = x @ f64(w1).t(), x @ f64(w3).t()
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (torch.nn.functional.silu(g) * u * weight) @ f64(w2).t()

    y = torch.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        weight = (weights * (chosen == e)).sum(-1, keepdim=True)                # 0 where e is not chosen
        bank = moe.experts
        y = y + swiglu_ffn(bank.w1.weight[e], bank.w3.weight[e], bank.w2.weight[e], weight)
    shared = moe.shared_experts
    return y + swiglu_ffn(shared.w1.weight, shared.w3.weight, shared.w2.weight, 1.0)


def block_oracle(cfg, layer_id: int, blocks, X: torch.Tensor, pre_in: torch.Tensor,
                 attn_inputs: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """§5: attention reads with the pre handed in, the FFN with the attention mixes' pre (trap 1).

    `blocks` maps layer ids to blocks; in a stack `attn_inputs` holds the attention inputs of the
    earlier layers (a consumer's kv source compressed its own), and this block's input is added to it.
    """
    block = blocks[layer_id]
    attn_inputs = {} if attn_inputs is None else attn_inputs
    X, pre_in = f64(X), f64(pre_in)
    pre_a, post_a, comb_a = mixes_oracle(X, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base, cfg)
    attn_inputs[layer_id] = rms_norm(hc_pre(X, pre_in), block.attn_norm.weight, cfg.norm_eps)
    o = attention_oracle(cfg, layer_id, {i: b.attn for i, b in blocks.items()}, attn_inputs)["out"]
    X1 = hc_post(o, X, post_a, comb_a)
    pre_f, post_f, comb_f = mixes_oracle(X1, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base, cfg)
    f = rms_norm(hc_pre(X1, pre_a), block.ffn_norm.weight, cfg.norm_eps)
    return hc_post(moe_oracle(cfg, block.ffn, f), X1, post_f, comb_f), pre_f


# ------------------------------------------------------------------------------------------ runs of dsv41

def steps(model, cache, bounds):
    """Per call: (s, e, the step Transformer.forward builds for every row at s … e − 1, a fresh handoff);
    the cache is opened before the caller runs the layers and advanced after."""
    for s, e in zip(bounds[:-1], bounds[1:]):
        step = model.step(range(B), (s,) * B, (e - s,) * B)
        cache.begin(step)
        yield s, e, step, Handoff()
        cache.advance(step)


def pack(x):
    """[B, T, …] → the packed [1, B·T, …] the layers take."""
    return x.flatten(0, 1)[None]


def unpack(x, T):
    return x[0].unflatten(0, (B, T))


@torch.no_grad()
def run_attention(model, layers, xs, bounds):
    """Run the attention of `layers` in order, call by call, on one cache → ({layer: out}, cache)."""
    cache = model.new_cache(B, helpers.MAX_SEQ)
    outs = {i: [] for i in layers}
    for s, e, step, handoff in steps(model, cache, bounds):
        for i in layers:
            outs[i].append(unpack(model.layers[i].attn(pack(xs[i][:, s:e]), step, handoff, cache), e - s))
    return {i: torch.cat(o, dim=1) for i, o in outs.items()}, cache


@torch.no_grad()
def run_block(model, layer, X, pre_in, bounds):
    cache = model.new_cache(B, helpers.MAX_SEQ)
    xs, pres = [], []
    for s, e, step, handoff in steps(model, cache, bounds):
        x, pre = model.layers[layer](pack(X[:, s:e]), pack(pre_in[:, s:e]), step, handoff, cache, None)
        xs.append(unpack(x, e - s))
        pres.append(unpack(pre, e - s))
    return torch.cat(xs, dim=1), torch.cat(pres, dim=1)


def attention_inputs(model, chain):
    return {i: random_inputs((B, SEQ, model.cfg.dim), seed=100 + i) for i in chain}


def oracle_for(model, i, xs):
    return attention_oracle(model.cfg, i, {j: block.attn for j, block in enumerate(model.layers)}, xs)


_ORACLES: dict = {}


def cached_attention_oracles(model, chain):
    if chain not in _ORACLES:
        xs = attention_inputs(model, chain)
        _ORACLES[chain] = xs, {i: oracle_for(model, i, xs) for i in chain}
    return _ORACLES[chain]


def block_inputs(cfg, seed: int):
    X = random_inputs((B, SEQ, cfg.hc_mult, cfg.dim), seed)
    # a pre as a previous block hands it over: σ(·) + eps, unnormalised and different per stream
    pre_in = torch.sigmoid(random_inputs((B, SEQ, cfg.hc_mult), seed + 1)) + cfg.hc_eps
    return X, pre_in


_BLOCK_ORACLES: dict = {}


def cached_block_oracle(model, layer):
    if layer not in _BLOCK_ORACLES:
        X, pre_in = block_inputs(model.cfg, seed=200 + layer)
        blocks = dict(enumerate(model.layers))
        _BLOCK_ORACLES[layer] = X, pre_in, block_oracle(model.cfg, layer, blocks, X, pre_in)
    return _BLOCK_ORACLES[layer]


# ------------------------------------------------------------------------------------------ attention

def record_indexer_scores(monkeypatch) -> list:
    """Spy on Indexer.scores: (indexer, positions [T], scores [1, T, C]) per call row, in row order (a
    call's rows of one length are scored as one batch, positions [B, T])."""
    recorded, real = [], Indexer.scores

    def scores(self, x, qr, keys, positions, *args, **kwargs):
        out = real(self, x, qr, keys, positions, *args, **kwargs)
        rows = positions.view(-1, positions.shape[-1])
        recorded.extend((self, rows[b].clone(), out[b:b + 1]) for b in range(rows.shape[0]))
        return out

    monkeypatch.setattr(Indexer, "scores", scores)
    return recorded


@pytest.mark.parametrize("bounds", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize("chain", CHAINS.values(), ids=CHAINS.keys())
def test_attention_against_float64_oracle(model, cfg, chain, bounds, monkeypatch):
    xs, oracles = cached_attention_oracles(model, chain)
    recorded = record_indexer_scores(monkeypatch)
    got, cache = run_attention(model, chain, xs, bounds)
    for i in chain:
        want, r = oracles[i], cfg.compress_ratios[i]
        d = distance(got[i], want["out"])
        report(f"layer {i} output", d)
        assert d < TOL, f"layer {i}: output off by {d:.2e} of its scale"
        # the ring ends holding the last W positions, position p in slot p mod W (§11.2)
        last = list(range(SEQ - cfg.window_size, SEQ))
        ring = cache.window[i][:, [p % cfg.window_size for p in last]]
        assert distance(ring, want["window_kv"][:, last]) < TOL
        if i in cfg.kv_source_layers:
            # rows rotated at j·r, index keys from the unrotated latent (§11.4, §11.6, trap 8)
            C = SEQ // r
            d_kv = distance(cache.sources[i].kv[:, :C], want["compressed"])
            d_keys = distance(cache.sources[i].index_keys[:, :C], want["index_keys"])
            report(f"layer {i} compressed rows / index keys", max(d_kv, d_keys))
            assert d_kv < TOL and d_keys < TOL
        if i in cfg.index_source_layers:
            calls = [(pos, sc) for ix, pos, sc in recorded if ix is model.layers[i].attn.indexer]
            # one scoring per row of each call that has a compressed position (§11.6: C = 0 runs no
            # indexer); the rows of a call score in order
            assert len(calls) == B * sum(1 for end in bounds[1:] if end // r)
            for n, (pos, sc) in enumerate(calls):
                row = n % B
                seen = torch.arange(sc.shape[-1]) < want["visible"][pos].unsqueeze(-1)      # [T, C]
                assert torch.isneginf(sc[0][~seen]).all()
                d_s = distance(sc[0][seen], want["scores"][row, pos, :sc.shape[-1]][seen])
                report(f"layer {i} indexer scores from {pos[0].item()}", d_s)
                assert d_s < TOL


def test_selection_is_every_visible_position(model):
    """With top-K wider than the context the index list is 0 … vis − 1 then −1 (§11.6, trap 12)."""
    chain = CHAINS["token"]
    xs, _ = cached_attention_oracles(model, chain)
    cache = model.new_cache(B, helpers.MAX_SEQ)
    for s, e, step, handoff in steps(model, cache, CHUNKINGS["chunked"]):
        for i in chain:
            model.layers[i].attn(pack(xs[i][:, s:e]), step, handoff, cache)
        for i in (4, 6):
            sel = handoff.selections[i].unflatten(0, (B, e - s))
            vis = (torch.arange(s, e) + 1) // model.cfg.compress_ratios[i]
            j = torch.arange(sel.shape[-1])
            expect = torch.where(j < vis.unsqueeze(-1), j, -1).expand(B, -1, -1)
            assert torch.equal(sel, expect), (i, s)


# ------------------------------------------------------------------------------------------ block

@pytest.mark.parametrize("bounds", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize("layer", [0, 2, 4])
def test_block_against_float64_oracle(model, layer, bounds):
    X, pre_in, (want_x, want_pre) = cached_block_oracle(model, layer)
    got_x, got_pre = run_block(model, layer, X, pre_in, bounds)
    d_x, d_pre = distance(got_x, want_x), distance(got_pre, want_pre)
    report(f"block {layer} stream / pre", max(d_x, d_pre))
    assert d_x < TOL and d_pre < TOL


def test_moe_clamps_bind_against_oracle(model):
    """§13 with inputs large enough that both clamps bind (the block test's inputs never reach 10)."""
    moe = model.layers[2].ffn
    x = random_inputs((B, SEQ, model.cfg.dim), seed=7) * 12
    limit = model.cfg.swiglu_limit
    g = f64(x) @ f64(moe.shared_experts.w1.weight).t()
    u = f64(x) @ f64(moe.shared_experts.w3.weight).t()
    # the test means something only if the gate exceeds +limit, stays below −limit unclamped, and u
    # leaves ±limit
    assert (g > limit).any() and (g < -limit).any() and (u.abs() > limit).any()
    with torch.no_grad():
        got = moe(x)
    d = distance(got, moe_oracle(model.cfg, moe, f64(x)))
    report("MoE with binding clamps", d)
    assert d < TOL


def test_moe_binding_routing_against_oracle():
    """Top-2 of 4 experts (`helpers.binding_config`): the bias decides the choice, the raw scores the
    weights (§13, trap 16)."""
    cfg = helpers.binding_config()
    moe = helpers.build(cfg, "fast", seed=0).layers[2].ffn
    x = random_inputs((B, SEQ, cfg.dim), seed=8)
    score = torch.sqrt(torch.nn.functional.softplus(linear(f64(x), moe.gate)))
    biased = (score + f64(moe.gate.bias)).sort(dim=-1, descending=True).values
    A = cfg.n_activated_experts
    # well posed: no token's choice is within float32 noise of a tie ...
    assert (biased[..., A - 1] - biased[..., A]).min() > 1e-4
    # ... and the bias changes the choice of some tokens, so selecting by the raw score would show
    by_score = score.topk(A, dim=-1).indices.sort(-1).values
    by_biased = (score + f64(moe.gate.bias)).topk(A, dim=-1).indices.sort(-1).values
    assert (by_score != by_biased).any()
    with torch.no_grad():
        got = moe(x)
    d = distance(got, moe_oracle(cfg, moe, f64(x)))
    report("MoE with binding routing", d)
    assert d < TOL


def stack_oracle(model, X: torch.Tensor, pre: torch.Tensor):
    """All backbone blocks in order (§4 step 5), the pre lagging across blocks, then the collapse
    with the last block's FFN pre (§4 step 6) → (stream, pre, hidden)."""
    attn_inputs, blocks = {}, dict(enumerate(model.layers))
    for i in range(model.cfg.n_layers):
        X, pre = block_oracle(model.cfg, i, blocks, X, pre, attn_inputs)
    return X, pre, hc_pre(X, pre)


_STACK_ORACLE: dict = {}


@torch.no_grad()
def run_stack(model, X, pre, bounds):
    """The block loop of Transformer.forward on a given stream, one step per call."""
    cache = model.new_cache(B, helpers.MAX_SEQ)
    hidden = []
    for s, e, step, handoff in steps(model, cache, bounds):
        x, p = pack(X[:, s:e]), pack(pre[:, s:e])
        for block in model.layers:
            x, p = block(x, p, step, handoff, cache, None)
        hidden.append(unpack(hyper.collapse(x, p), e - s))
    return torch.cat(hidden, dim=1)


def stack_inputs(model):
    """The embedding of random tokens on every stream (in float32) and the one-hot pre (§4 step 4)."""
    ids = helpers.token_ids(B, SEQ, model.cfg.vocab_size, seed=3)
    X = model.embed.weight[ids].float().unsqueeze(2).repeat(1, 1, model.cfg.hc_mult, 1)
    pre = torch.zeros(B, SEQ, model.cfg.hc_mult)
    pre[..., 0] = 1.0                                    # layer 0's attention reads stream 0
    return X, pre


@pytest.mark.parametrize("bounds", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_stack_of_blocks_against_float64_oracle(model, bounds):
    """Every layer role in place: consumers read their sources' state within each call (§3)."""
    X, pre = stack_inputs(model)
    if "stack" not in _STACK_ORACLE:
        _STACK_ORACLE["stack"] = stack_oracle(model, X, pre)
    want = _STACK_ORACLE["stack"][2]
    d = distance(run_stack(model, X, pre, bounds), want)
    report("stack of 8 blocks, collapsed", d)
    assert d < TOL


# ------------------------------------------------------------------------------------------ mutations
# Each plants one known porting mistake in dsv41 with monkeypatch and asserts the oracle comparison then
# fails by a wide margin, so the oracle tests above would catch it.

def mutated_attention_distance(model, chain=CHAINS["pooled"], bounds=CHUNKINGS["chunked"]):
    xs, oracles = cached_attention_oracles(model, chain)
    got, _ = run_attention(model, chain, xs, bounds)
    return max(distance(got[i], oracles[i]["out"]) for i in chain)


def mutated_block_distance(model, layer=2, bounds=CHUNKINGS["chunked"]):
    X, pre_in, (want_x, want_pre) = cached_block_oracle(model, layer)
    got_x, got_pre = run_block(model, layer, X, pre_in, bounds)
    return max(distance(got_x, want_x), distance(got_pre, want_pre))


def test_mutation_no_inverse_rope(model, monkeypatch):
    real = Rotary.rotate

    def rotate(self, x, positions, *, inverse=False, **kwargs):
        return x if inverse else real(self, x, positions, **kwargs)

    monkeypatch.setattr(Rotary, "rotate", rotate)
    for chain in (CHAINS["window"], CHAINS["pooled"]):
        d = mutated_attention_distance(model, chain)
        report(f"mutation: no inverse RoPE ({chain})", d)
        assert d > MUTATION_FACTOR * TOL


def test_mutation_interleaved_output_groups(model, monkeypatch):
    real = Attention._grouped_output

    def grouped_output(self, o, *args, **kwargs):
        # group g = heads g, g + G, g + 2G, … instead of the contiguous g·H/G … (g+1)·H/G − 1
        order = torch.arange(o.shape[2]).view(-1, model.cfg.o_groups).t().flatten()
        return real(self, o[:, :, order], *args, **kwargs)

    monkeypatch.setattr(Attention, "_grouped_output", grouped_output)
    d = mutated_attention_distance(model)
    report("mutation: interleaved wo_a groups", d)
    assert d > MUTATION_FACTOR * TOL


def test_mutation_visibility_one_token_early(model, monkeypatch):
    def visible(self, ratio):
        # a group visible from its last token on (p // r + 1 for r = 2) instead of after it (trap 9)
        return (self.positions + ratio) // ratio

    monkeypatch.setattr(Step, "visible", visible)
    d = mutated_attention_distance(model)
    report("mutation: visibility one token early", d)
    assert d > MUTATION_FACTOR * TOL


def test_mutation_sink_scaled(model, monkeypatch):
    real = dsv41.model.attention.sparse_attention

    def sparse_attention(q, pool, rows, sink, scale, *args, **kwargs):
        return real(q, pool, rows, sink * scale, scale, *args, **kwargs)   # sink scaled like a logit (trap 10)

    monkeypatch.setattr(dsv41.model.attention, "sparse_attention", sparse_attention)
    d = mutated_attention_distance(model)
    report("mutation: sink multiplied by the softmax scale", d)
    assert d > MUTATION_FACTOR * TOL


def entries_one_by_one(monkeypatch):
    """A decode step's sublayer entry is one native call (`Numerics.hc_enter`) that skips hyper.py's
    functions; declined, the block makes them one by one, where these mutations patch them."""
    monkeypatch.setattr(Numerics, "hc_enter", lambda self, *args, **kwargs: None)


def patch_pre(monkeypatch, model, layer, attention_reads, ffn_reads):
    """Make Block.forward collapse with another pre: "in" (handed in), "attn" or "ffn" (this block's mixes)."""
    entries_one_by_one(monkeypatch)
    block = model.layers[layer]
    real_mixes, real_collapse = hyper.mixes, hyper.collapse
    state = {}

    def mixes(x, fn, *args, **kwargs):
        out = real_mixes(x, fn, *args, **kwargs)
        state["sub"] = "attn" if fn is block.hc_attn_fn else "ffn"
        state[state["sub"]] = out[0]
        return out

    def collapse(x, pre, numerics=None):
        if state["sub"] == "attn":
            state["in"] = pre
            return real_collapse(x, state[attention_reads], numerics)
        return real_collapse(x, state[ffn_reads], numerics)

    monkeypatch.setattr(hyper, "mixes", mixes)
    monkeypatch.setattr(hyper, "collapse", collapse)


@pytest.mark.parametrize("attention_reads, ffn_reads", [("in", "in"), ("in", "ffn"), ("attn", "attn")],
                         ids=["ffn-reads-attention-pre", "ffn-reads-own-pre", "attention-reads-own-pre"])
def test_mutation_pre_not_lagging(model, monkeypatch, attention_reads, ffn_reads):
    # correct is ("in", "attn"): trap 1
    patch_pre(monkeypatch, model, 2, attention_reads, ffn_reads)
    d = mutated_block_distance(model)
    report(f"mutation: attention reads {attention_reads}, FFN reads {ffn_reads}", d)
    assert d > MUTATION_FACTOR * TOL


def test_mutation_comb_not_transposed(model, monkeypatch):
    real = hyper.expand

    def expand(out, residual, post, comb, numerics):
        return real(out, residual, post, comb.transpose(-1, -2), numerics)     # stream j gets row j (trap 2)

    monkeypatch.setattr(hyper, "expand", expand)
    entries_one_by_one(monkeypatch)
    d = mutated_block_distance(model)
    report("mutation: comb not transposed", d)
    assert d > MUTATION_FACTOR * TOL


def test_mutation_up_clamped_from_above_only(model, monkeypatch):
    real = dsv41.model.moe.swiglu

    def swiglu(gate, up, limit, *args, **kwargs):
        # the asymmetric clamp put on the wrong branch: up ≤ limit only, gate ±limit (trap 17)
        return real(gate.clamp(-limit, limit), up.clamp(max=limit), 0.0, *args, **kwargs)

    monkeypatch.setattr(dsv41.model.moe, "swiglu", swiglu)
    moe = model.layers[2].ffn
    x = random_inputs((B, SEQ, model.cfg.dim), seed=7) * 12
    with torch.no_grad():
        d = distance(moe(x), moe_oracle(model.cfg, moe, f64(x)))
    report("mutation: up clamped from above only", d)
    assert d > MUTATION_FACTOR * TOL
