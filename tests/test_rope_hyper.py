"""Rotary embedding (docs/ARCHITECTURE.md §10) and hyper-connections (§7) against formulas written here."""

import math

import pytest
import torch

from dsv41.model import hyper
from dsv41.model.numerics import FAST, REFERENCE
from dsv41.model.rope import Rotary, yarn_frequencies

import helpers


# ------------------------------------------------------------------------------------------ YaRN

def yarn_by_formula(R, theta, L0, factor, beta_fast, beta_slow):
    """§10 written out with Python floats, one frequency at a time."""
    def d(beta):
        return R * math.log(L0 / (2 * math.pi * beta)) / (2 * math.log(theta))
    low, high = max(math.floor(d(beta_fast)), 0), min(math.ceil(d(beta_slow)), R - 1)
    out = []
    for i in range(R // 2):
        w = float(torch.tensor(theta, dtype=torch.float32) ** (-2 * i / R))
        ramp = min(max((i - low) / max(high - low, 0.001), 0.0), 1.0)
        out.append((w / factor) * ramp + w * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64), low, high


def test_yarn_released_boundaries_and_bands(released_cfg):
    c = released_cfg
    got = yarn_frequencies(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len, c.rope_factor,
                           c.beta_fast, c.beta_slow)
    expect, low, high = yarn_by_formula(64, 160000.0, 65536, 16.0, 32.0, 1.0)
    assert (low, high) == (15, 25)
    assert got.dtype == torch.float32 and got.shape == (32,)
    torch.testing.assert_close(got.double(), expect, rtol=2e-7, atol=0)
    base = 160000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(got[:16].double(), base[:16], rtol=1e-6, atol=0)          # unchanged
    torch.testing.assert_close(got[25:].double(), base[25:] / 16, rtol=1e-6, atol=0)     # divided by 16
    blended = got[16:25].double() / base[16:25]
    assert ((blended < 1) & (blended > 1 / 16)).all()                                   # strictly in between


def test_no_yarn_for_window_layers(released_cfg):
    got = Rotary.for_layer(released_cfg, False).freqs
    torch.testing.assert_close(got.double(), 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64),
                               rtol=1e-6, atol=0)


def test_yarn_tiny_config_matches_formula():
    c = helpers.nonbinding_config()
    got = yarn_frequencies(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len, c.rope_factor,
                           c.beta_fast, c.beta_slow)
    expect, _, _ = yarn_by_formula(16, 160000.0, 64, 4.0, 32.0, 1.0)
    torch.testing.assert_close(got.double(), expect, rtol=2e-7, atol=0)


# ------------------------------------------------------------------------------------------ rotation

@pytest.fixture(scope="module")
def rotary(released_cfg):
    return Rotary.for_layer(released_cfg, True)


def test_rotation_is_complex_multiplication_on_the_last_pairs(rotary):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 80, generator=g)                     # [B, T, heads, F]; rope on the last 64
    positions = torch.tensor([0, 1, 7, 1000, 65535])
    got = rotary.rotate(x, positions)
    expect = helpers.rotate_reference(x, positions, rotary.freqs)
    torch.testing.assert_close(got.double(), expect, rtol=0, atol=2e-5)
    assert torch.equal(got[..., :16], x[..., :16])                # the non-rope part is untouched


def test_rotation_without_heads_axis_and_bf16(rotary):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 64, generator=g).to(torch.bfloat16)
    positions = torch.tensor([3, 4, 5, 6])
    got = rotary.rotate(x, positions)
    assert got.dtype == torch.bfloat16
    expect = helpers.rotate_reference(x.float(), positions, rotary.freqs)
    # fp32 math, one rounding to bf16 at the end (§6.5)
    torch.testing.assert_close(got, expect.to(torch.bfloat16), rtol=0, atol=0.02)


def test_pair_convention_is_adjacent_not_half(rotary):
    # one unit vector in feature 0 of the rope slice moves into feature 1 (its pair), never into 32
    x = torch.zeros(1, 1, 64)
    x[..., 0] = 1.0
    got = rotary.rotate(x, torch.tensor([1]))
    w0 = float(rotary.freqs[0])
    assert got[0, 0, 0].item() == pytest.approx(math.cos(w0), abs=1e-6)
    assert got[0, 0, 1].item() == pytest.approx(math.sin(w0), abs=1e-6)
    assert got[0, 0, 2:].abs().max().item() == 0


def test_inverse_undoes_rotation(rotary):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 4, 64, generator=g)
    positions = torch.arange(100, 106)
    back = rotary.rotate(rotary.rotate(x, positions), positions, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-5)
    expect = helpers.rotate_reference(x, positions, rotary.freqs, inverse=True)
    torch.testing.assert_close(rotary.rotate(x, positions, inverse=True).double(), expect, rtol=0, atol=2e-5)


# ------------------------------------------------------------------------------------------ Sinkhorn

def sinkhorn_loop(c, iters, eps):
    """§7.4 on one S×S matrix of Python floats, in exactly the stated order."""
    S = len(c)
    rows = []
    for i in range(S):
        m = max(c[i])
        e = [math.exp(v - m) for v in c[i]]
        z = sum(e)
        rows.append([v / z + eps for v in e])
    c = rows

    def col_norm(c):
        sums = [sum(c[i][j] for i in range(S)) for j in range(S)]
        return [[c[i][j] / (sums[j] + eps) for j in range(S)] for i in range(S)]

    def row_norm(c):
        return [[c[i][j] / (sum(c[i]) + eps) for j in range(S)] for i in range(S)]

    c = col_norm(c)
    for _ in range(iters - 1):
        c = col_norm(row_norm(c))
    return c


@pytest.mark.parametrize("positions", [5, hyper.INNERMOST_FROM + 6])     # both layouts fast numerics takes
def test_sinkhorn_matches_the_loop(positions):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(positions, 4, 4, generator=g, dtype=torch.float64) * 3
    got = hyper.sinkhorn(logits, 20, 1e-6, FAST)
    for b in range(positions):
        expect = torch.tensor(sinkhorn_loop(logits[b].tolist(), 20, 1e-6), dtype=torch.float64)
        torch.testing.assert_close(got[b], expect, rtol=1e-12, atol=1e-14)


def test_sinkhorn_ends_on_a_column_step():
    # with 1 iteration the result is exactly softmax + eps then one column normalisation
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 4, generator=g, dtype=torch.float64)
    got = hyper.sinkhorn(logits, 1, 1e-6, FAST)
    expect = torch.tensor(sinkhorn_loop(logits.tolist(), 1, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-14)
    # columns then sum to 1 up to eps while rows need not
    assert (got.sum(0) - 1).abs().max() < 1e-5


def test_sinkhorn_is_doubly_stochastic_for_random_logits():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 4, 4, generator=g) * 0.5
    c = hyper.sinkhorn(logits, 20, 1e-6, FAST)
    assert (c.sum(-1) - 1).abs().max() < 1e-5
    assert (c.sum(-2) - 1).abs().max() < 1e-5
    assert (c > 0).all()


def test_sinkhorn_peaky_logits_columns_exact_rows_approximate():
    # 20 iterations do not fully converge peaked matrices (measured: row sums off by up to 5e-4 for
    # logits of std 1, 6e-2 for std 4); the columns are exact because the procedure ends on them. This
    # is the reference's fixed iteration count, reproduced, not an error.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 4, 4, generator=g) * 4
    c = hyper.sinkhorn(logits, 20, 1e-6, FAST)
    assert (c.sum(-2) - 1).abs().max() < 1e-5
    assert (c.sum(-1) - 1).abs().max() < 0.1


# ------------------------------------------------------------------------------------------ mixes

def test_split_mixes_pre_post_comb_formulas():
    g = torch.Generator().manual_seed(6)
    S = 4
    m = torch.randn(3, 24, generator=g)
    scale = torch.tensor([0.7, 1.3, 0.9])
    base = torch.randn(24, generator=g)
    pre, post, comb = hyper.split_mixes(m, scale, base, S, 20, 1e-6, FAST)
    for t in range(3):
        for i in range(S):
            sig = 1 / (1 + math.exp(-(m[t, i].item() * 0.7 + base[i].item())))
            assert pre[t, i].item() == pytest.approx(sig + 1e-6, rel=1e-6)
            sig = 1 / (1 + math.exp(-(m[t, S + i].item() * 1.3 + base[S + i].item())))
            assert post[t, i].item() == pytest.approx(2 * sig, rel=1e-6)
        c = [[m[t, 8 + 4 * i + j].item() * 0.9 + base[8 + 4 * i + j].item() for j in range(S)] for i in range(S)]
        torch.testing.assert_close(comb[t].double(), torch.tensor(sinkhorn_loop(c, 20, 1e-6), dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6)
    assert not torch.allclose(pre.sum(-1), torch.ones(3))          # pre is not normalised (trap 1)


def test_mixes_uses_one_rms_over_all_streams():
    g = torch.Generator().manual_seed(7)
    B, T, S, D = 2, 3, 4, 16
    x = torch.randn(B, T, S, D, generator=g).to(torch.bfloat16)
    fn = torch.randn(24, S * D, generator=g) * 0.1
    scale, base = torch.tensor([1.0, 0.5, 2.0]), torch.randn(24, generator=g)
    pre, post, comb = hyper.mixes(x, fn, scale, base, iters=20, norm_eps=1e-20, hc_eps=1e-6, numerics=FAST)
    flat = x.double().reshape(B, T, S * D)                      # stream-major flattening
    m = (flat @ fn.double().t()) / torch.sqrt(flat.square().mean(-1, keepdim=True) + 1e-20)
    pre2, post2, comb2 = hyper.split_mixes(m.float(), scale, base, S, 20, 1e-6, FAST)
    torch.testing.assert_close(pre, pre2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post, post2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb2, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ pre / post

def expand_loop(o, R, post, comb, transpose=True):
    """hc_post by a double loop: stream j = post_j·o + Σ_i comb[i][j]·R_i (trap 2)."""
    B, T, S, D = R.shape
    out = torch.zeros(B, T, S, D, dtype=torch.float64)
    for j in range(S):
        acc = post[:, :, j, None].double() * o.double()
        for i in range(S):
            w = comb[:, :, i, j] if transpose else comb[:, :, j, i]
            acc = acc + w[..., None].double() * R[:, :, i].double()
        out[:, :, j] = acc
    return out


@pytest.fixture(scope="module")
def streams():
    g = torch.Generator().manual_seed(8)
    B, T, S, D = 2, 3, 4, 32
    R = torch.randn(B, T, S, D, generator=g).to(torch.bfloat16)
    o = torch.randn(B, T, D, generator=g).to(torch.bfloat16)
    post = 2 * torch.rand(B, T, S, generator=g)
    comb = hyper.sinkhorn(torch.randn(B, T, S, S, generator=g) * 2, 20, 1e-6, FAST)
    return o, R, post, comb


@pytest.mark.parametrize("numerics", [REFERENCE, FAST], ids=["reduction", "matmul"])
def test_expand_applies_comb_transposed(streams, numerics):
    o, R, post, comb = streams
    got = hyper.expand(o, R, post, comb, numerics)
    assert got.dtype == torch.bfloat16 and got.shape == R.shape
    expect = expand_loop(o, R, post, comb)
    torch.testing.assert_close(got, expect.to(torch.bfloat16), rtol=0, atol=0.02)
    wrong = expand_loop(o, R, post, comb, transpose=False)
    # the non-transposed sum is a different function: differences far above bf16 rounding
    assert (wrong - expect).abs().max() > 0.5
    assert (got.double() - wrong).abs().max() > 0.5


@pytest.mark.parametrize("numerics", [REFERENCE, FAST], ids=["reduction", "matmul"])
def test_expand_in_float32_is_tight(streams, numerics):
    o, R, post, comb = streams
    got = hyper.expand(o.float(), R.float(), post, comb, numerics)
    torch.testing.assert_close(got.double(), expand_loop(o, R, post, comb), rtol=0, atol=1e-5)


def test_collapse_is_the_pre_weighted_sum(streams):
    _, R, post, _ = streams
    got = hyper.collapse(R, post)
    expect = sum(post[:, :, i, None].double() * R[:, :, i].double() for i in range(4))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expect.to(torch.bfloat16), rtol=0, atol=0.02)


def test_identity_pre_reads_stream_zero(streams):
    _, R, _, _ = streams
    pre = hyper.identity_pre(2, 3, 4)
    assert pre.dtype == torch.float32
    assert torch.equal(hyper.collapse(R, pre), R[:, :, 0])
