"""Fast numerics' native kernels (dsv41/model/native/gemv.c, docs/NUMERICS.md N12) against formulas.

Fast numerics sum in any order, so the expectation is the float64 product with fp32's error bound for
a sum of K products (K · 2⁻²³ · Σ|x·w|), and the bf16 result is exactly the kernel's own fp32 result
rounded to nearest even (ties included, NaN kept). The routed experts are checked against the SwiGLU
mixture written out here in float64. Kernels built from mutated sources (the last K element dropped,
ties rounded away from zero, the up projection left unclamped from below) must fail the same checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.config import ConfigError, RuntimeConfig
from dsv41.model import Transformer
from dsv41.model import native
from dsv41.model.init import init_random_
from dsv41.model.moe import RoutedExperts
from dsv41.model.numerics import (HEAD_WIDEN_ROWS, NATIVE_EXPERT_PAIRS, NATIVE_FP32_FROM, NATIVE_GEMV_ROWS, NATIVE_WIDE_ROWS,
                                  Numerics)

import helpers
from test_native import mutated_library

FAST, FAST_NATIVE = Numerics("fast", "blas"), Numerics("fast", "blas", native=True)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here: the torch path runs instead")


def product_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32's error bound for x [P, M, K] · w [P, N, K]ᵀ summed in any order."""
    K = x.shape[-1]
    return K * 2.0 ** -23 * torch.einsum("pmk,pnk->pmn", x.double().abs(), w.double().abs()) + 1e-30


def _cpu_has(*flags: str) -> bool:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return all(f" {flag}" in text for flag in flags)


def run_gemv(x, w, out_dtype):
    out = torch.empty(x.shape[0], x.shape[1], w.shape[1], dtype=out_dtype)
    assert native.gemv(x, w, out)
    return out


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [1, 15, 33, 100, 512, 1000])
def test_gemv_is_the_product_within_fp32_error(w_dtype, x_dtype, K):
    g = torch.Generator().manual_seed(K)
    for M in range(1, 9):
        x = torch.randn(2, M, K, generator=g).to(x_dtype)
        w = torch.randn(2, 37, K, generator=g).to(w_dtype)
        exact = torch.einsum("pmk,pnk->pmn", x.double(), w.double())
        out = run_gemv(x, w, torch.float32)
        assert ((out.double() - exact).abs() <= product_bound(x, w)).all()
        # bf16 results: the same sums rounded once, as torch's cast rounds them
        assert torch.equal(run_gemv(x, w, torch.bfloat16), out.to(torch.bfloat16))


def test_without_wide_tiles_a_row_alone_is_bit_equal_to_the_row_among_others():
    """Without AVX-512 tiles every row count sums in one order: the AVX2 loop inlined per count (1 … 4
    rows, sums in registers) must add what the general loop adds, in its order."""
    if native.wide_products(False):
        pytest.skip("this CPU builds gemv.c with AVX-512 tiles, which sum several rows in their own order")
    g = torch.Generator().manual_seed(3)
    for w_dtype in (torch.bfloat16, torch.float32):
        for K in (33, 512, 1000):
            x = torch.randn(1, 5, K, generator=g)
            w = torch.randn(1, 37, K, generator=g).to(w_dtype)
            together = run_gemv(x, w, torch.float32)
            for m in range(5):
                assert torch.equal(run_gemv(x[:, m:m + 1], w, torch.float32)[0, 0], together[0, m]), (w_dtype, K, m)


@pytest.mark.parametrize("K", [31, 32, 33, 512, 1000])
def test_wide_tiles_are_the_product_within_fp32_error(K):
    """Past the 4-row tiles: activation rows 4 at a time against each weight tile, every tail (rows,
    outputs and the masked K tail of the bf16 dot products)."""
    g = torch.Generator().manual_seed(K + 1)
    for dtype in (torch.bfloat16, torch.float32):
        for M in (5, 16, 31, NATIVE_WIDE_ROWS):
            x = torch.randn(1, M, K, generator=g).to(dtype)
            w = torch.randn(1, 39, K, generator=g).to(dtype)
            out = run_gemv(x, w, torch.float32)
            exact = torch.einsum("pmk,pnk->pmn", x.double(), w.double())
            assert ((out.double() - exact).abs() <= product_bound(x, w)).all(), (dtype, M)


def rounding_cases() -> torch.Tensor:
    """fp32 values on every kind of bf16 boundary: exact midpoints (ties to even, both parities), their
    neighbours, 0, ±inf, NaN, the largest finite values (not −0: a sum that starts at +0 gives +0)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(200, generator=g).to(torch.bfloat16).float()
    bits = base.view(torch.int32)
    mid = (bits | 0x8000).view(torch.float32)                         # halfway to the next bf16 value
    special = torch.tensor([0.0, float("inf"), -float("inf"), float("nan"), 3.3895314e38, -3.3895314e38])
    return torch.cat([mid, torch.nextafter(mid, torch.tensor(1e30)), torch.nextafter(mid, torch.tensor(-1e30)),
                      special])


def test_bf16_results_round_to_nearest_even_like_torch():
    values = rounding_cases()
    x = values.view(1, -1, 1)                                         # M rows of one value each, K = 1
    for rows in torch.split(torch.arange(values.numel()), 8):
        chunk = x[:, rows]
        out = run_gemv(chunk, torch.ones(1, 1, 1), torch.bfloat16)
        expect = chunk.to(torch.bfloat16)
        assert torch.equal(out.isnan(), expect.isnan())
        assert torch.equal(out.view(torch.int16)[~out.isnan()], expect.view(torch.int16)[~expect.isnan()])


def test_gemv_reads_and_writes_strided_views_in_place():
    """A grouped einsum's operands (heads interleaved in a row) and a row slice of a larger result."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16)        # [M, G, I]
    w = torch.randn(4, 16, 64, generator=g).to(torch.bfloat16)       # [G, R, I]
    out = torch.full((5, 4, 16), 7.0)                                 # rows 1 … 3 are the result
    assert native.gemv(x.transpose(0, 1), w, out[1:4].transpose(0, 1))
    exact = torch.einsum("mgi,gri->mgr", x.double(), w.double())
    bound = product_bound(x.transpose(0, 1), w).transpose(0, 1)
    assert ((out[1:4].double() - exact).abs() <= bound).all()
    assert (out[0] == 7).all() and (out[4] == 7).all()


def test_the_policy_takes_the_native_product_for_few_rows_only(monkeypatch):
    calls = []
    for name in ("gemv", "linear"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, real=real, **k: calls.append(a[0].shape) or real(*a, **k))
    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 256, generator=g).to(torch.bfloat16)
    # bf16 products run natively up to 32 rows where the build has AVX512-BF16 dot products (past 4 rows
    # on AMX tiles where it has them, N37), else 4
    most = NATIVE_WIDE_ROWS if native.wide_products(True) else NATIVE_GEMV_ROWS
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        got = FAST_NATIVE.linear(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
        exact = x.double() @ w.double().t()
        assert ((got.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + product_bound(x[None], w[None])[0]).all()
    assert calls == [(1, 256), (most, 256)]
    out = torch.empty(2, 48, dtype=torch.bfloat16)
    x = x[:NATIVE_GEMV_ROWS + 1]
    FAST_NATIVE.matmul_into(x[:2], w.t(), out)
    assert torch.allclose(out.float(), FAST.linear(x[:2], w).float(), rtol=2 ** -7, atol=1e-2) and len(calls) == 3
    groups = torch.randn(1, 2, 4, 64, generator=g).to(torch.bfloat16)
    wo_a = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16)
    got = FAST_NATIVE.grouped_linear(groups, wo_a)
    assert len(calls) == 4 and got.shape == (1, 2, 4, 8)
    assert torch.allclose(got.float(), FAST.grouped_linear(groups, wo_a).float(), rtol=2 ** -7, atol=1e-2)
    # small fp32 weights stay with the BLAS (faster there), autograd with torch
    FAST_NATIVE.linear(x[:1].float(), w.float())
    leaf = w.float().requires_grad_()
    FAST_NATIVE.linear(x[:1].float(), leaf).sum().backward()
    assert len(calls) == 4 and leaf.grad is not None
    # a head-sized fp32 weight takes the native product, within fp32 error of the float64 one
    head = torch.randn(NATIVE_FP32_FROM // 256, 256, generator=g)
    xf = torch.randn(1, 256, generator=g)
    got = FAST_NATIVE.linear(xf, head)
    assert len(calls) == 5 and got.dtype == torch.float32
    assert ((got.double() - xf.double() @ head.double().t()).abs() <= product_bound(xf[None], head[None])[0]).all()
    # and so does a batch of rows of it where the build has AVX-512 tiles
    FAST_NATIVE.linear(torch.randn(NATIVE_WIDE_ROWS, 256, generator=g), head)
    assert len(calls) == (6 if native.wide_products(False) else 5)


def test_amx_products_are_found_from_the_cpu_flags():
    assert native.amx_products() == _cpu_has("amx_bf16", "amx_tile")


def test_bf16_products_and_the_shared_expert_run_natively_to_their_row_limits(monkeypatch):
    # a bf16 product of up to NATIVE_WIDE_ROWS rows and a shared expert of up to NATIVE_EXPERT_PAIRS take
    # the native kernels (past 4 rows on AMX tiles where the build has them, N37); one row more does not
    if not native.wide_products(True):
        pytest.skip("this CPU builds gemv.c without AVX512-BF16 dot products")
    calls = []
    for name in ("gemv", "linear", "routed_experts"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    w1, w3 = (torch.randn(24, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    w2 = torch.randn(64, 24, generator=g).to(torch.bfloat16)
    for rows in (NATIVE_WIDE_ROWS, NATIVE_WIDE_ROWS + 1, NATIVE_EXPERT_PAIRS, NATIVE_EXPERT_PAIRS + 1):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        calls.clear()
        got = FAST_NATIVE.linear(x, w)
        exact = x.double() @ w.double().t()
        assert ((got.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + product_bound(x[None], w[None])[0]).all()
        shared = FAST_NATIVE.dense_swiglu(x, w1, w3, w2, 10.0)
        assert calls == ["linear"] * (rows <= NATIVE_WIDE_ROWS) + ["routed_experts"] * (rows <= NATIVE_EXPERT_PAIRS)
        assert (shared is not None) == (rows <= NATIVE_EXPERT_PAIRS)


def test_fast_bf16_holds_the_head_in_bf16_and_widens_it_as_it_reads_it(monkeypatch):
    # the reference holds the head in fp32; only fast bf16 with the native product keeps bf16 (half the
    # bytes), and its logits are the fp32 head's within fp32 summation error, for a decode row natively
    # and for many rows through the chunked widening
    assert FAST_NATIVE.head_dtype(torch.bfloat16) == torch.bfloat16
    for policy, dtype in ((FAST, torch.bfloat16), (FAST_NATIVE, torch.float32),
                          (Numerics("reference", "invariant", native=True), torch.bfloat16)):
        assert policy.head_dtype(dtype) == torch.float32
    model = Transformer(helpers.nonbinding_config(), RuntimeConfig(numerics="fast"))
    assert model.head.weight.dtype == torch.bfloat16
    assert Transformer(helpers.nonbinding_config(), RuntimeConfig()).head.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(12)
    w = torch.randn(HEAD_WIDEN_ROWS + 40, 64, generator=g).to(torch.bfloat16)
    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    for rows in (1, NATIVE_WIDE_ROWS + 1):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        got = FAST_NATIVE.head_logits(x, w)
        exact = x.double() @ w.double().t()
        assert got.dtype == torch.float32 and got.shape == (rows, w.shape[0])
        assert ((got.double() - exact).abs() <= product_bound(x[None], w[None])[0]).all()
    assert calls == [(1, 64)]                     # the second call's rows went to the chunked widening
    # a decode row through a head-sized bf16 weight gives the fp32 head's bits: the widening is exact
    # and both run the same native product
    w = torch.randn(NATIVE_FP32_FROM // 64, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(FAST_NATIVE.head_logits(x, w), FAST_NATIVE.head_logits(x, w.float()))


def test_policy_construction():
    assert Numerics.for_device("fast", None, "cpu").native == native.available()
    assert not Numerics.for_device("fast", None, "meta").native
    Numerics("fast", "blas", native=True)
    for mode, kernels in (("reference", "blas"), ("fast", "invariant")):
        with pytest.raises(ConfigError, match="native"):
            Numerics(mode, kernels, native=True)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def experts_formula(x, ids, weights, w1, w3, w2, limit, rounded: bool):
    """Σ over a token's experts (ascending) of w2 · (silu(min(g, limit)) · clamp(u, ±limit) · weight),
    in float64; `rounded` rounds g, u, h and each expert's output to bf16 as the layer does."""
    r = bf16 if rounded else (lambda t: t)
    x = x.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for a in sorted(range(ids.shape[1]), key=lambda a: ids[t, a].item()):
            e = ids[t, a].item()
            if e < 0:
                continue
            g, u = r(w1[e].double() @ x[t]), r(w3[e].double() @ x[t])
            if limit > 0:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = r(g * torch.sigmoid(g) * u * weights[t, a].double())
            out[t] += r(w2[e].double() @ h)
    return out


def expert_case(n: int, A: int, E: int, D: int, I: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(n)])
    ids[:, 0] = 3                                    # one expert with more rows than a kernel group
    ids[1, 1] = -1                                   # another rank's pair
    weights = torch.rand(n, A, generator=g)
    w1, w3 = (torch.randn(E, I, D, generator=g).div(D ** 0.5).mul(4).to(dtype) for _ in range(2))
    w2 = torch.randn(E, D, I, generator=g).div(I ** 0.5).to(dtype)
    return x, ids, weights, w1, w3, w2


@pytest.mark.parametrize("limit", [0.0, 2.0])
def test_routed_experts_are_the_swiglu_mixture(limit):
    x, ids, weights, w1, w3, w2 = expert_case(20, 3, 8, 64, 40, torch.float32, seed=7)
    out = native.routed_experts(x, ids, weights, w1, w3, w2, limit)
    assert torch.allclose(out.double(), experts_formula(x, ids, weights, w1, w3, w2, limit, False), rtol=1e-5, atol=1e-5)
    x, ids, weights, w1, w3, w2 = expert_case(20, 3, 8, 64, 40, torch.bfloat16, seed=8)
    out = native.routed_experts(x, ids, weights, w1, w3, w2, limit)
    expect = experts_formula(x, ids, weights, w1, w3, w2, limit, True)
    # the bf16 roundings of the formula, up to a last-bit flip where fp32 sums differ in order
    assert torch.allclose(out.double(), expect, rtol=2 ** -7, atol=2 ** -7 * expect.abs().max().item())
    assert native.routed_experts(x, ids.clamp(max=7) + 1, weights, w1, w3, w2, limit) is None   # id 8 of 8


def test_the_experts_silu_holds_far_out():
    """Gate values from −150 to 60 unclamped (e^−g overflows fp32 below −88.7, and silu(g) is then −0):
    fp32 hidden values against float64 to fp32's error, with no NaN."""
    D = I = 48
    x = torch.zeros(1, D)
    x[0, 0] = 1.0
    w1, w3 = torch.zeros(1, I, D), torch.zeros(1, I, D)
    w1[0, :, 0] = torch.linspace(-150.0, 60.0, I)
    w3[0, :, 0] = 0.125
    w2 = torch.eye(D, I).unsqueeze(0)           # each hidden value is an output
    ids, weights = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    out = native.routed_experts(x, ids, weights, w1, w3, w2, 0.0)
    expect = experts_formula(x, ids, weights, w1, w3, w2, 0.0, False)
    assert not out.isnan().any()
    assert torch.allclose(out.double(), expect, rtol=1e-6, atol=1e-30)


def test_routed_experts_layer_takes_the_kernel_and_matches_its_torch_path():
    x, ids, weights, w1, w3, w2 = expert_case(6, 3, 8, 64, 32, torch.bfloat16, seed=9)
    layers = [RoutedExperts(8, 64, 32, "bf16", 2.0, numerics=numerics) for numerics in (FAST, FAST_NATIVE)]
    for layer in layers:
        layer.w1.weight.data, layer.w3.weight.data, layer.w2.weight.data = w1, w3, w2
    with torch.no_grad():
        plain, fused = (layer(x, weights, ids.clamp(min=0)) for layer in layers)
    assert torch.allclose(fused, plain, rtol=2 ** -7, atol=2 ** -7 * plain.abs().max().item())
    assert not torch.equal(fused, torch.zeros_like(fused))


@pytest.mark.parametrize("old, new, check", [
    ("for (; k < K; k++) {", "for (; k + 1 < K; k++) {", "product"),          # the tail's last element lost
    ("u += 0x7fffu + ((u >> 16) & 1u);", "u += 0x8000u;", "rounding"),        # ties away from zero
    ("u = u < -limit ? -limit :", "u = u < -limit ? u :", "experts"),        # up unclamped from below
    # the same in the AVX-512 SwiGLU lanes, and their exp without ln 2's low part
    ("u = _mm512_min_ps(_mm512_max_ps(u, bottom), top);", "u = _mm512_min_ps(u, top);", "experts lanes"),
    ("r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);", "", "experts exp"),
    # the AVX-512 register tiles (2 … 8 rows): a tile's first output row written for all four
    ("put(g, p, m0 + r, n + i, acc[r][i]);", "put(g, p, m0 + r, n + i, acc[r][0]);", "tiles"),
    # the AVX512-BF16 dot products: the K tail's last pair lost, one vector's lane sum taken twice
    ("(__mmask32)((1u << (K - k)) - 1u)", "(__mmask32)((1u << (K - k - 1)) - 1u)", "dot"),
    ("_mm512_unpackhi_ps(c, d)", "_mm512_unpackhi_ps(c, c)", "dot"),
    # the AVX2 loop inlined per row count: 3 rows given the 2-row copy (the third row's sum not made)
    ("case 3: k = ROW_DOT_LOOP(x, 3,", "case 3: k = ROW_DOT_LOOP(x, 2,", "product"),
    # the vector loop inlined per row count, AVX-512 or AVX2 (N31): one decode row given no row's sums
    ("case 1: k = ROW_DOT_LOOP(x, 1,", "case 1: k = ROW_DOT_LOOP(x, 0,", "product"),
])
def test_a_mutated_fast_kernel_is_caught(old, new, check, tmp_path, monkeypatch):
    if check == "tiles" and not native.wide_products(False):
        pytest.skip("this CPU builds gemv.c without AVX-512 tiles")
    if check == "dot" and not native.wide_products(True):
        pytest.skip("this CPU builds gemv.c without AVX512-BF16 dot products")
    if old.startswith("case 3") and (native.wide_products(False) or not _cpu_has("avx2", "fma")):
        pytest.skip("this CPU builds gemv.c without the AVX2 loop")
    if old.startswith("case 1") and not (_cpu_has("avx512f") or _cpu_has("avx2", "fma")):
        pytest.skip("this CPU builds gemv.c without a vector loop")
    lanes = _cpu_has("avx512f")
    if check.startswith("experts") and lanes != (check != "experts"):
        pytest.skip("this CPU builds the other SwiGLU loop")
    source = {"rounding": "bf16.h", "experts exp": "exp.h"}.get(check, "gemv.c")
    lib = mutated_library(source, old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        if check in ("product", "tiles"):
            test_gemv_is_the_product_within_fp32_error(torch.float32, torch.float32, 33)
        elif check == "dot":
            test_gemv_is_the_product_within_fp32_error(torch.bfloat16, torch.bfloat16, 33)
        elif check == "rounding":
            test_bf16_results_round_to_nearest_even_like_torch()
        else:
            test_routed_experts_are_the_swiglu_mixture(2.0)
            test_the_experts_silu_holds_far_out()


def attention_formula(q, pool, rows, sink, scale):
    """float64 softmax with the sink over each query's listed rows (−1: none; twice listed: twice)."""
    B, T, H, Dh = q.shape
    out = torch.zeros(B, T, H, Dh, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            listed = [j for j in rows[b, t].tolist() if j >= 0]
            for h in range(H):
                if not listed:
                    continue
                kv = pool[b, listed].double()
                z = kv @ q[b, t, h].double() * scale
                m = max(z.max().item(), -1e30)
                p = torch.exp(z - m)
                out[b, t, h] = p @ kv / (p.sum() + math.exp(sink[h].item() - m))
    return out


# (heads, head width): the scalar loops (a width not a multiple of 32), and the AVX-512 path's head
# groups of 8, 2 and 4 (N39)
ATTENTION_SHAPES = [(4, 40), (8, 64), (6, 32), (4, 96)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: f"H{s[0]}-Dh{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sparse_attention_is_the_softmax_with_its_sink(dtype, shape, monkeypatch):
    """A decode step's attention without blocks (fast numerics), through attention.py: the float64
    formula within fp32 error (fp32) or one bf16 rounding (bf16), with unlisted entries, a row listed
    twice, a query with no row (zeros) and more than one batch row."""
    from dsv41.model.attention import sparse_attention
    g = torch.Generator().manual_seed(12)
    (H, Dh), (B, T, N, n) = shape, (2, 3, 50, 9)
    q = torch.randn(B, T, H, Dh, generator=g).to(dtype)
    pool = torch.randn(B, N, Dh, generator=g).to(dtype)
    rows = torch.randint(0, N, (B, T, n), generator=g)
    rows[0, 0, :4] = -1
    rows[0, 1, 1] = rows[0, 1, 0]
    rows[1, 2] = -1
    sink = torch.randn(H, generator=g)
    calls = []
    real = native.sparse_attention
    monkeypatch.setattr(native, "sparse_attention", lambda *a: calls.append(1) or real(*a))
    got = sparse_attention(q, pool, rows, sink, 0.125, FAST_NATIVE)
    want = attention_formula(q, pool, rows, sink, 0.125)
    assert calls == [1] and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    assert ((got.double() - want).abs() <= tol * (want.abs() + 1)).all()
    assert (got[1, 2] == 0).all()
    assert torch.allclose(got.float(), sparse_attention(q, pool, rows, sink, 0.125, FAST).float(), atol=tol * 4)


@pytest.mark.parametrize("old, new", [
    ("denom += expf(sink[h] - m);", "denom += 0.0f;"),                   # the sink left out of the denominator
    # the AVX-512 path: the same, the rows' weights taken without the max (the sink's keeps it), the
    # second of two rows scored as the first, a group's heads all summed with the first head's weights
    ("denom[h] += expf(sink[h0 + h] - m);", "denom[h] += 0.0f;"),
    ("_mm512_set1_ps(m))));", "_mm512_set1_ps(0.0f))));"),
    ("k1 = _mm512_loadu_ps(kvs + (j + two) * Dh + d);", "k1 = _mm512_loadu_ps(kvs + j * Dh + d);"),
    ("_mm512_set1_ps(p[h * n + j]);", "_mm512_set1_ps(p[j]);"),
])
def test_a_mutated_sparse_attention_is_caught(old, new, tmp_path, monkeypatch):
    """Off the formula every way."""
    lanes = old != "denom += expf(sink[h] - m);"
    if lanes and not _cpu_has("avx512f"):
        pytest.skip("this CPU builds attention.c without AVX-512 lanes")
    lib = mutated_library("attention.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_sparse_attention_is_the_softmax_with_its_sink(torch.float32, (8, 64) if lanes else (4, 40), monkeypatch)


def check_pool_in_parts() -> None:
    """A one-row call's pool in three parts (a decode step's rings, its own rows, its compressed rows),
    listed across every boundary between them: the bits of the parts concatenated, and the formula."""
    g = torch.Generator().manual_seed(40)
    T, H, Dh = 3, 8, 64
    # views into one buffer with rows between them, so that a kernel reading the wrong rows reads values
    # (other than the listed ones), not past an allocation
    store = torch.randn(100, Dh, generator=g).to(torch.bfloat16)
    parts = [store[0:24], store[40:43], store[60:70]]
    pool = torch.cat(parts)[None]
    q = torch.randn(1, T, H, Dh, generator=g).to(torch.bfloat16)
    rows = torch.randint(0, 37, (1, T, 30), generator=g)
    rows[0, 0, :6] = torch.tensor([23, 24, 26, 27, 36, -1])          # the last and first rows of each part
    sink = torch.randn(H, generator=g)
    got = native.sparse_attention(q, parts, rows, sink, 0.125, -1e30)
    assert torch.equal(got, native.sparse_attention(q, pool, rows, sink, 0.125, -1e30))
    want = attention_formula(q, pool, rows, sink, 0.125)
    assert ((got.double() - want).abs() <= 2.0 ** -8 * (want.abs() + 1)).all()


def check_picked_rows() -> None:
    """The pool's last part picked from a cache [S, L, Dh] per token (a decode step's compressed rows,
    read where they lie, N40): the bits of the same rows copied out; a picked row past the cache's rows or
    a slot past its slots declines the call."""
    g = torch.Generator().manual_seed(41)
    T, H, Dh, S, L, k = 3, 8, 64, 4, 9, 5
    kv = torch.randn(S, L, Dh, generator=g).to(torch.bfloat16)
    window = torch.randn(20, Dh, generator=g).to(torch.bfloat16)
    token_slot = torch.tensor([2, 0, 3])
    selected = torch.randint(0, L, (T, k), generator=g)
    selected[1, 3:] = -1
    rows = torch.cat([torch.randint(0, 20, (T, 6), generator=g),
                      torch.where(selected >= 0, 20 + torch.arange(T * k).view(T, k), -1)], dim=-1)[None]
    q = torch.randn(1, T, H, Dh, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    copied = kv[token_slot.unsqueeze(1), selected.clamp(min=0)].flatten(0, 1)
    got = native.sparse_attention(q, [window], rows, sink, 0.125, -1e30, (kv, token_slot, selected))
    assert torch.equal(got, native.sparse_attention(q, torch.cat([window, copied])[None], rows, sink, 0.125, -1e30))
    past = selected.clone()
    past[2, 0] = L
    assert native.sparse_attention(q, [window], rows, sink, 0.125, -1e30, (kv, token_slot, past)) is None
    assert native.sparse_attention(q, [window], rows, sink, 0.125, -1e30, (kv, torch.tensor([2, 0, S]), selected)) is None


def test_native_sparse_attention_reads_a_pool_in_parts_where_they_lie():
    check_pool_in_parts()
    check_picked_rows()
    # a call of several rows takes its pool whole
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    assert native.sparse_attention(q, [torch.zeros(4, 64, dtype=torch.bfloat16)] * 2, torch.zeros(2, 1, 2, dtype=torch.long),
                                   torch.zeros(8), 0.125, -1e30) is None


@pytest.mark.parametrize("old, new", [
    ("row >= pool->end[i]", "row > pool->end[i]"),                        # a part's first row read from the part before
    ("int64_t at = row - first;", "int64_t at = row;"),                   # a later part's rows counted from the pool's start
])
def test_a_mutated_pool_in_parts_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("attention.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        check_pool_in_parts()


def test_a_mutated_pick_is_caught(tmp_path, monkeypatch):
    """Every picked row read from the first token's slot."""
    lib = mutated_library("attention.c", "pool->pick_slot[at / pool->pick_k]", "pool->pick_slot[0]", tmp_path,
                          monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        check_picked_rows()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rms_norm_is_the_formula(dtype, monkeypatch):
    """Fast numerics' decode-row RMSNorm through the module: the float64 formula within fp32 error
    (fp32) or one bf16 rounding (bf16), a zero row included (eps alone); prefill-sized calls keep torch's."""
    from dsv41.model.layers import RMSNorm
    g = torch.Generator().manual_seed(13)
    norm = RMSNorm(300, 1e-6, numerics=FAST_NATIVE, dtype=dtype)
    norm.weight.data = torch.randn(300, generator=g).to(dtype)
    x = (torch.randn(1, 5, 300, generator=g) * 30).to(dtype)
    x[0, 2] = 0
    calls = []
    real = native.rms_norm
    monkeypatch.setattr(native, "rms_norm", lambda *a: calls.append(1) or real(*a))
    got = norm(x)
    norm(torch.zeros(1, 65, 300, dtype=dtype))                            # 65 positions: torch's
    h = x.double()
    want = norm.weight.double() * h / torch.sqrt(h.square().mean(-1, keepdim=True) + 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    assert calls == [1] and got.dtype == dtype and (got[0, 2] == 0).all()
    assert ((got.double() - want).abs() <= tol * (want.abs() + 1e-3)).all()


def test_a_mutated_rms_norm_is_caught(tmp_path, monkeypatch):
    """The mean taken over D − 1 values: off the formula."""
    lib = mutated_library("norm.c", "squares / (float)D + eps", "squares / (float)(D - 1) + eps", tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_rms_norm_is_the_formula(torch.float32, monkeypatch)


def index_score_formula(q, weights, keys):
    """float64 Σ_h relu(q_h · k) · w_h, and the bound of the kernel's roundings: the logit, the
    weighted logit and the sum each rounded once in bf16 (2⁻⁸ relative each), fp32 sums below that."""
    logits = torch.einsum("bthd,bcd->bthc", q.double(), keys.double())
    terms = logits.relu() * weights.double().unsqueeze(-1)
    scale = (logits.abs() * weights.double().abs().unsqueeze(-1)).sum(2)
    return terms.sum(2), 2.0 ** -6 * scale + 1e-30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_index_scores_are_the_relu_weighted_head_sum(dtype):
    g = torch.Generator().manual_seed(9)
    for B, T, H, D, C in ((1, 1, 4, 64, 70), (3, 2, 5, 33, 300), (16, 1, 8, 128, 600)):
        q = torch.randn(B, T, H, D, generator=g).to(dtype)
        weights = torch.randn(B, T, H, generator=g).to(dtype)
        pool = torch.randn(B, C + 7, D, generator=g).to(dtype)
        keys = pool[:, 3:C + 3]                                        # a column tile of the pool, in place
        got = native.index_scores(q, weights, keys)
        expect, bound = index_score_formula(q, weights, keys)
        assert got.dtype == dtype and got.shape == (B, T, C)
        assert ((got.double() - expect).abs() <= bound).all(), (B, T, H, D, C)
    # a NaN logit stays NaN, as torch's ReLU keeps it
    q[0, 0, 0, 0] = float("nan")
    assert native.index_scores(q, weights, keys)[0, 0].isnan().all()


def test_the_indexer_takes_native_scores_batch_rows_alone(monkeypatch):
    """Fast numerics score a decode step's rows in one call, each row's scores its own: a batch of rows
    gives each row the bits it gets alone, within the bound of the torch path's."""
    from dsv41.model.indexer import Indexer
    g = torch.Generator().manual_seed(10)
    q = torch.randn(4, 1, 4, 64, generator=g).to(torch.bfloat16)
    weights = torch.randn(4, 1, 4, generator=g).to(torch.bfloat16)
    keys = torch.randn(4, 90, 64, generator=g).to(torch.bfloat16)
    batch = FAST_NATIVE.index_scores(q, weights, keys)
    for b in range(4):
        assert torch.equal(FAST_NATIVE.index_scores(q[b:b + 1], weights[b:b + 1], keys[b:b + 1]), batch[b:b + 1])
    expect, bound = index_score_formula(q, weights, keys)
    assert ((batch.double() - expect).abs() <= bound).all()
    assert FAST.index_scores(q, weights, keys) is None                  # no native kernels: the torch path
    assert Numerics("reference", "invariant", native=True).index_scores(q, weights, keys) is None
    # the indexer's tile takes the policy's one call for the whole batch
    monkeypatch.setattr(native, "index_scores", lambda *a: batch.neg())
    assert torch.equal(Indexer._tile(type("Layer", (), {"numerics": FAST_NATIVE})(), q, weights, keys), batch.neg())


@pytest.mark.parametrize("old, new", [
    ("l = l < 0.0f ? 0.0f : l;", ""),                                                 # no ReLU
    ("for (int64_t h = 0; h < H; h++) {\n            const float *qh", "for (int64_t h = 1; h < H; h++) {\n            const float *qh"),
])
def test_a_mutated_index_score_kernel_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("indexer.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_index_scores_are_the_relu_weighted_head_sum(torch.float32)


def hc_mixes_formula(x, fn, scale, base, iters, norm_eps, hc_eps):
    """hyper.py `mixes` in float64: the projection over the RMS statistic, then torch's split."""
    from dsv41.model import hyper
    flat = x.flatten(-2).double()
    m = flat @ fn.double().T / torch.sqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return hyper.split_mixes(m, scale.double(), base.double(), x.shape[-2], iters, hc_eps, FAST)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_hc_mixes_are_the_projection_and_split(dtype, monkeypatch):
    """Fast numerics' decode-row mixes in one call: the float64 formula within fp32 error, a zero row
    included (eps alone), each row the same alone as in its batch; prefill-sized calls and reference
    numerics keep the torch path (its mean's bits)."""
    from dsv41.model import hyper
    g = torch.Generator().manual_seed(21)
    S, D, iters = 4, 300, 20
    x = (torch.randn(1, 5, S, D, generator=g) * 3).to(dtype)
    x[0, 3] = 0
    fn = torch.randn((2 + S) * S, S * D, generator=g) / math.sqrt(S * D)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + S) * S, generator=g) * 0.1
    calls = []
    real = native.hc_mixes
    monkeypatch.setattr(native, "hc_mixes", lambda *a: calls.append(1) or real(*a))
    mix = lambda x, numerics: hyper.mixes(x, fn, scale, base, iters=iters, norm_eps=1e-6, hc_eps=1e-6, numerics=numerics)
    got = mix(x, FAST_NATIVE)
    alone = mix(x[:, 1:2], FAST_NATIVE)
    assert calls == [1, 1]
    mix(torch.zeros(1, 4097, S, D, dtype=dtype), FAST_NATIVE)                  # past the cap: torch's
    mix(x, Numerics("reference", "invariant", native=True))
    assert calls == [1, 1]
    for part, want, one in zip(got, hc_mixes_formula(x, fn, scale, base, iters, 1e-6, 1e-6), alone):
        assert part.dtype == torch.float32 and part.shape == want.shape
        assert (part.double() - want).abs().max() < 2e-6
        assert torch.equal(one, part[:, 1:2])


@pytest.mark.parametrize("old, new", [
    ("= block[r][j] * inv[r0 + r];", "= block[r][j];"),             # the projection left unnormalised
    ("= block[r][j] * inv[r0 + r];", "= block[r][j] * inv[r0];"),   # a block's second row by the first's statistic
])
def test_a_mutated_hc_mixes_kernel_is_caught(old, new, tmp_path, monkeypatch):
    """Off the formula either way."""
    lib = mutated_library("mixes.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_hc_mixes_are_the_projection_and_split(torch.float32, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_compressed_entries_gather_in_one_call_as_the_index_does(dtype, monkeypatch):
    """attention.py `Picked.rows`, the copy of a decode step's selected compressed rows for an attention
    that does not read them in their cache: the rows the torch index reads (row 0 for −1), each token
    from its own slot; a selected row past the pool declines; a reference-numerics decode step takes it
    (fast numerics' native attention reads the rows in the cache, N40)."""
    g = torch.Generator().manual_seed(27)
    kv = torch.randn(3, 40, 16, generator=g).to(dtype)
    token_slot = torch.tensor([2, 0, 2])
    selected = torch.randint(0, 40, (3, 5), generator=g)
    selected[1, 3:] = -1
    picked = FAST_NATIVE.gather_compressed(kv, token_slot, selected)
    assert torch.equal(picked, kv[token_slot.unsqueeze(1), selected.clamp(min=0)].flatten(0, 1))
    past = selected.clone()
    past[2, 4] = 40                                                             # row 40 of 40
    assert FAST_NATIVE.gather_compressed(kv, token_slot, past) is None
    assert FAST.gather_compressed(kv, token_slot, selected) is None
    from helpers import MAX_SEQ, binding_config, token_ids, without_dspark
    runtime = RuntimeConfig(max_seq_len=MAX_SEQ)
    model = init_random_(Transformer(without_dspark(binding_config()), runtime), 0)
    calls = []
    real = native.gather_compressed
    monkeypatch.setattr(native, "gather_compressed", lambda *a: calls.append(1) or real(*a))
    ids, cache = token_ids(1, 50, model.cfg.vocab_size), model.new_cache(1, MAX_SEQ)
    with torch.no_grad():
        model(ids[:, :49], 0, cache)
        before = len(calls)
        model(ids[:, 49:], 49, cache)
    assert len(calls) > before


@pytest.mark.parametrize("old, new", [
    ("row = selected[q] < 0 ? 0 : selected[q];", "row = selected[q] < 0 ? 1 : selected[q];"),   # −1 copies row 1
    ("(token_slot[i] * L + row) * row_bytes", "(token_slot[0] * L + row) * row_bytes"),   # the first token's slot
])
def test_a_mutated_compressed_gather_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("attention.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_the_compressed_entries_gather_in_one_call_as_the_index_does(torch.float32, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sublayer_entry_is_one_native_call_with_the_bits_of_four(dtype):
    """block.py `Block._enter` in one call (mixes.c `dsv41_hc_enter`): the previous output expanded into
    the streams, their mixes, and the normed collapse with the previous mixes' pre (trap 1), each part
    bit-equal to its own native call; without an output, the streams are the input."""
    from dsv41.model import hyper
    from dsv41.model.layers import RMSNorm
    g = torch.Generator().manual_seed(26)
    S, D, iters = 4, 200, 20
    x = (torch.randn(1, 5, S, D, generator=g) * 3).to(dtype)
    out = (torch.randn(1, 5, D, generator=g) * 2).to(dtype)
    fn = torch.randn((2 + S) * S, S * D, generator=g) / math.sqrt(S * D)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + S) * S, generator=g) * 0.1
    pre, post, comb = hyper.mixes(x, fn.flip(0), scale, base, iters=iters, norm_eps=1e-6, hc_eps=1e-6,
                                  numerics=FAST_NATIVE)
    norm = RMSNorm(D, 1e-6, numerics=FAST_NATIVE, dtype=dtype)
    norm.weight.data = (torch.rand(D, generator=g) + 0.5).to(dtype)
    for given in (out, None):
        got = FAST_NATIVE.hc_enter(x, pre, fn, scale, base, iters, 1e-6, 1e-6, norm.weight, norm.eps,
                                   given, post, comb)
        streams = x if given is None else hyper.expand(given, x, post, comb, FAST_NATIVE)
        want = (streams, hyper.mixes(streams, fn, scale, base, iters=iters, norm_eps=1e-6, hc_eps=1e-6,
                                     numerics=FAST_NATIVE), norm(hyper.collapse(streams, pre, FAST_NATIVE)))
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert FAST.hc_enter(x, pre, fn, scale, base, iters, 1e-6, 1e-6, norm.weight, norm.eps) is None
    many = x[:, :1].expand(1, 65, S, D)                                         # past the norm's rows
    assert FAST_NATIVE.hc_enter(many, pre[:, :1].expand(1, 65, S), fn, scale, base, iters, 1e-6, 1e-6,
                                norm.weight, norm.eps) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_entry_and_the_mixes_on_two_threads(dtype, monkeypatch, two_threads):
    """Several rows on two threads: the entry takes them in pairs of rows, the mixes' projections in
    blocks of rows and of fn's rows; the same bits as the separate calls, and each row its own."""
    test_a_sublayer_entry_is_one_native_call_with_the_bits_of_four(dtype)
    test_native_hc_mixes_are_the_projection_and_split(dtype, monkeypatch)


def test_a_mutated_row_split_of_a_sublayer_entry_is_caught(tmp_path, monkeypatch, two_threads):
    """Every pair of rows given the first pair's pre: off the separate calls."""
    lib = mutated_library("mixes.c", "norm_eps, hc_eps, 1, pre + r * S,", "norm_eps, hc_eps, 1, pre,", tmp_path,
                          monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_a_sublayer_entry_is_one_native_call_with_the_bits_of_four(torch.float32)


def test_a_model_enters_each_sublayer_of_a_decode_step_in_one_call(monkeypatch):
    from helpers import MAX_SEQ, binding_config, token_ids, without_dspark
    runtime = RuntimeConfig(max_seq_len=2 * MAX_SEQ, numerics="fast", dtype="bfloat16", kernels="blas")
    model = init_random_(Transformer(without_dspark(binding_config()), runtime), 0)
    ids = token_ids(1, 80, model.cfg.vocab_size)
    calls = {name: [] for name in ("hc_enter", "attention_entry", "ffn_half")}
    for name, real in [(name, getattr(native, name)) for name in calls]:
        monkeypatch.setattr(native, name, lambda *a, name=name, real=real: calls[name].append(a[0].shape[1]) or real(*a))

    def prefill_and_step() -> None:
        cache = model.new_cache(1, 2 * MAX_SEQ)
        with torch.no_grad():
            model(ids[:, :79], 0, cache)                                        # 79 rows: the layers' calls
            assert not any(calls.values())
            model(ids[:, 79:], 79, cache)

    prefill_and_step()
    # the attention's entry inside the way into it, the FFN's inside the feed-forward half (N35)
    assert calls == {"hc_enter": [], "attention_entry": [1] * model.cfg.n_layers, "ffn_half": [1] * model.cfg.n_layers}
    for name in ("attention_entry", "ffn_half"):
        monkeypatch.setattr(native, name, lambda *a: None)
    for made in calls.values():
        made.clear()
    prefill_and_step()
    assert calls["hc_enter"] == [1] * (2 * model.cfg.n_layers)                  # each sublayer's entry, one call


@pytest.mark.parametrize("old, new", [
    ("dsv41_hc_collapse(rows, S, D, bf16, x, pre, h);", "dsv41_hc_collapse(rows, S, D, bf16, x, pre_out, h);"),
    ("        x = streams;\n    }", "    }"),                                    # the streams before the output
])
def test_a_mutated_sublayer_entry_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("mixes.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_a_sublayer_entry_is_one_native_call_with_the_bits_of_four(torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_shared_expert_of_a_decode_step_is_one_native_call(dtype, monkeypatch):
    """The shared expert's few rows go through the routed-experts kernel (every row on expert 0 at
    weight 1) and give the torch path's result up to its roundings' last bits; many rows keep torch."""
    from dsv41.model.moe import Expert
    g = torch.Generator().manual_seed(23)
    layers = {}
    for name, policy in (("torch", FAST), ("native", FAST_NATIVE)):
        layers[name] = Expert(64, 96, 1.5, numerics=policy, dtype=dtype)
    for torch_layer, native_layer in zip(layers["torch"].modules(), layers["native"].modules()):
        for (_, a), (_, b) in zip(torch_layer.named_parameters(recurse=False), native_layer.named_parameters(recurse=False)):
            a.data = (torch.randn(a.shape, generator=g) / 8).to(a.dtype)
            b.data = a.data.clone()
    calls = []
    real = native.routed_experts
    monkeypatch.setattr(native, "routed_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = (torch.randn(1, 3, 64, generator=g) * 4).to(dtype)
    got, want = layers["native"](x), layers["torch"](x)
    assert calls == [1] and got.dtype == want.dtype == dtype and got.shape == want.shape
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + 1e-3).all()
    many = (torch.randn(1, 200, 64, generator=g)).to(dtype)
    assert torch.equal(layers["native"](many), layers["torch"](many)) and calls == [1]


# ------------------------------------------------------------------------------------------ the router

@pytest.mark.parametrize("topk", [1, 2, 3])
def test_the_native_router_is_the_formula(topk, monkeypatch):
    """moe.py `route` under fast numerics takes topk.c's router: test_moe's float64 §13 formula (ids
    equal, weights to fp32 rounding), bias_vl on image tokens, logits past softplus's threshold of 20."""
    from dsv41.model.moe import route
    from test_moe import route_by_formula, sort_pairs
    g = torch.Generator().manual_seed(31)
    x = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    weight = (torch.randn(8, 64, generator=g) / 8).to(torch.bfloat16)
    weight[6] = (x[3].float() * 0.5).to(torch.bfloat16)           # token 3's logit of expert 6 is past 20
    bias, bias_vl = torch.randn(8, generator=g) * 0.3, torch.randn(8, generator=g) * 0.3
    image = torch.arange(12) % 3 == 0
    calls = []
    real = native.route
    monkeypatch.setattr(native, "route", lambda *a: calls.append(1) or real(*a))
    w, ids = route(x, weight, bias, topk, 1.5, numerics=FAST_NATIVE, bias_vl=bias_vl, image_mask=image)
    assert calls == [1] and w.dtype == torch.float32 and ids.dtype == torch.int64
    logits = x.float() @ weight.float().t()
    assert logits[3, 6] > 20
    w_ref, ids_ref = route_by_formula(x, weight, bias, topk, 1.5, bias_vl, image)
    (w, ids), (w_ref, ids_ref) = sort_pairs(w, ids), sort_pairs(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=2e-6, atol=1e-7)


def test_the_native_router_breaks_ties_to_the_lower_expert_and_rows_do_not_interact():
    logits = torch.zeros(3, 8)
    logits[1, [2, 5]] = 1.0                          # a tie between experts 2 and 5 for one place
    logits[2] = torch.linspace(-1, 1, 8)
    weights, ids = native.route(logits, torch.zeros(8), 3, 1.0, 1e-20)
    assert ids[0].tolist() == [0, 1, 2] and ids[1].tolist() == [2, 5, 0] and ids[2].tolist() == [7, 6, 5]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))
    for r in range(3):
        alone = native.route(logits[r:r + 1], torch.zeros(8), 3, 1.0, 1e-20)
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], ids[r])


@pytest.mark.parametrize("old, new", [
    ("x > 20.0f ? x : log1pf(expf(x))", "x > 20.0f ? 20.0f : log1pf(expf(x))"),   # the threshold's identity lost
    ("image[t]) ? bias_vl : bias", "image[t]) ? bias : bias"),                  # image tokens with the text bias
    ("weights[t * k + a] / (sum + eps)", "weights[t * k + a] / (sum + 1.0f)"),    # normalised off the sum
])
def test_a_mutated_router_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("topk.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        for topk in (1, 2, 3):
            test_the_native_router_is_the_formula(topk, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_shared_expert_adds_onto_the_routed_sum_in_the_call(dtype, monkeypatch):
    """MoE's `y + shared(x).float()` as one native call that accumulates into y: the same bits as the
    shared expert's own output added after it; many rows keep torch."""
    from dsv41.model.moe import Expert
    g = torch.Generator().manual_seed(24)
    layer = Expert(64, 96, 1.5, numerics=FAST_NATIVE, dtype=dtype)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=g) / 8).to(p.dtype)
    x = (torch.randn(3, 64, generator=g) * 4).to(dtype)
    y = torch.randn(3, 64, generator=g) * 3
    want = y + layer(x).float()
    calls = []
    real = native.routed_experts
    monkeypatch.setattr(native, "routed_experts", lambda *a, **k: calls.append(k.get("into")) or real(*a, **k))
    into = y.clone()
    got = layer.added_to(into, x)
    assert len(calls) == 1 and calls[0].data_ptr() == into.data_ptr() and got is into
    assert torch.equal(got, want)
    many, y_many = torch.randn(200, 64, generator=g).to(dtype), torch.randn(200, 64, generator=g)
    assert torch.equal(layer.added_to(y_many.clone(), many), y_many + layer(many).float()) and len(calls) == 1


def test_a_shared_expert_that_overwrites_the_routed_sum_is_caught(tmp_path, monkeypatch):
    lib = mutated_library("gemv.c", "if (!accumulate)\n", "if (1)\n", tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_the_shared_expert_adds_onto_the_routed_sum_in_the_call(torch.float32, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_shared_expert_joins_the_routed_call_with_the_bits_of_two(dtype, monkeypatch):
    """MoE's routed sum and its shared expert in one native call (the shared expert as one more expert,
    added last): the bits of the routed call followed by the shared one accumulating into it, and one
    call instead of two."""
    from dsv41.model.moe import MoE
    # the layer's own calls, as where the whole MoE does not fuse (N33; a gate temperature, EP, images)
    monkeypatch.setattr(native, "moe", lambda *a: None)
    g = torch.Generator().manual_seed(25)
    moe = MoE(64, 32, 8, 3, 1.5, 2.0, "bf16", vision=False, dense_storage="bf16", numerics=FAST_NATIVE, dtype=dtype)
    for p in moe.parameters():
        p.data = (torch.randn(p.shape, generator=g) / 4).to(p.dtype)
    x = (torch.randn(1, 5, 64, generator=g) * 3).to(dtype)
    flat = x.flatten(0, 1)
    weights, ids = moe.route(flat)
    with torch.no_grad():
        want = moe.shared_experts.added_to(moe.experts(flat, weights, ids), flat).to(dtype).view_as(x)
        calls = []
        real = native.routed_experts
        monkeypatch.setattr(native, "routed_experts", lambda *a, **k: calls.append(k.get("shared")) or real(*a, **k))
        got, chosen = moe.routed(x)
    assert torch.equal(chosen, ids) and len(calls) == 1 and calls[0] is not None
    assert torch.equal(got, want)
    assert not torch.equal(got, moe.experts(flat, weights, ids).to(dtype).view_as(x))   # the shared part counts
    many = x.repeat(1, 2, 1)                                                    # 10 rows: one call still
    calls.clear()
    with torch.no_grad():
        moe.routed(many)
    assert len(calls) == 1 and calls[0] is not None


@pytest.mark.parametrize("old, new", [
    ("weights != NULL && at >= 0 ? weights[at] : 1.0f", "weights != NULL ? weights[at >= 0 ? at : 0] : 1.0f"),
    ("return e == E ? s :", "return e == E ? w :"),                             # expert 0's weights instead
])
def test_a_mutated_shared_pair_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("gemv.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_the_shared_expert_joins_the_routed_call_with_the_bits_of_two(torch.float32, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_traced_model_takes_the_torch_path_where_eager_takes_the_kernels(monkeypatch, dtype):
    # torch.compile traces with data-less fake tensors; a kernel handed their pointers would write
    # through garbage, so every wrapper declines while tracing and the graph holds the torch ops
    # (frames the tracer skips run eagerly, on real tensors, and may take the kernels). bf16 also
    # takes the products' row-count check (`wide_products`) and the NumPy mixes: neither may reach
    # the loader or NumPy in a traced frame, where each would break the graph.
    from helpers import MAX_SEQ, binding_config, token_ids, without_dspark
    runtime = RuntimeConfig(max_seq_len=MAX_SEQ, numerics="fast", dtype=dtype, kernels="blas")
    model = init_random_(Transformer(without_dspark(binding_config()), runtime), 0)
    assert model.numerics.native
    ids = token_ids(1, 9)
    reached = []
    real = native._loaded()
    monkeypatch.setattr(native, "_loaded", lambda: reached.append(torch.compiler.is_compiling()) or real)

    def decode(cache):
        model(ids[:, :8], 0, cache)
        return model.logits(model(ids[:, 8:], 8, cache).hidden[:, -1])

    with torch.no_grad():
        eager = decode(model.new_cache(1, 16))
        assert reached and not any(reached)
        reached.clear()
        torch._dynamo.reset()
        if dtype == "float32":
            traced = torch.compile(decode, backend="eager")(model.new_cache(1, 16))
        else:
            explained = torch._dynamo.explain(decode)(model.new_cache(1, 16))
        torch._dynamo.reset()
    assert not any(reached), "a kernel was reached while tracing"
    if dtype == "float32":   # bf16 sums in the torch path's order, not the kernels': another top-k may bind
        torch.testing.assert_close(traced, eager, rtol=1e-4, atol=1e-4)
    else:
        where = {(f.filename, f.name) for r in explained.break_reasons for f in r.user_stack}
        assert explained.graph_break_count > 0      # the id check's .item() still breaks: the list is real
        assert not [w for w in where if w[0].endswith("native/__init__.py") or w[1].startswith("_host")], where


def _projection_weights(g: torch.Generator, D: int, Qr: int, H: int, Dh: int, G: int, Or: int, norm_dtype):
    bf = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).bfloat16()
    return dict(wq_a=bf(Qr, D, s=D ** -0.5), q_norm=(torch.rand(Qr, generator=g) + 0.5).to(norm_dtype),
                wq_b=bf(H * Dh, Qr, s=Qr ** -0.5), wkv=bf(Dh, D, s=D ** -0.5),
                kv_norm=(torch.rand(Dh, generator=g) + 0.5).to(norm_dtype),
                wo_a=bf(G, Or, H * Dh // G, s=(H * Dh // G) ** -0.5), wo_b=bf(D, G * Or, s=(G * Or) ** -0.5))


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [1, 3])
def test_the_attention_projections_are_two_native_calls_with_the_bits_of_eleven(N, norm_dtype):
    """sublayers.c: into the attention (wq_a, q_norm, wq_b, RoPE; wkv, kv_norm, RoPE) and out of it
    (RoPE⁻¹, wo_a's groups, wo_b), each bit-equal to the layer's calls one by one, and within bf16's
    rounding of the float64 formula written out here (so both cannot be wrong the same way)."""
    from dsv41.model.layers import RMSNorm
    from dsv41.model.rope import Rotary, yarn_frequencies
    g = torch.Generator().manual_seed(33)
    D, Qr, H, Dh, R, G, Or = 96, 64, 4, 32, 16, 2, 24
    w = _projection_weights(g, D, Qr, H, Dh, G, Or, norm_dtype)
    x = torch.randn(1, N, D, generator=g).bfloat16()
    rotary = Rotary(R, yarn_frequencies(R, 10000.0, 0, 1.0, 0.0, 0.0), FAST_NATIVE)
    positions = torch.arange(40, 40 + N)
    phases = rotary.phases(positions)
    qr, q, kv = FAST_NATIVE.attention_in(x, w["wq_a"], (w["q_norm"], 1e-6), w["wq_b"], w["wkv"], (w["kv_norm"], 1e-5),
                                         phases, H)
    q_norm, kv_norm = RMSNorm(Qr, 1e-6, numerics=FAST_NATIVE), RMSNorm(Dh, 1e-5, numerics=FAST_NATIVE)
    q_norm.weight.data, kv_norm.weight.data = w["q_norm"], w["kv_norm"]
    want_qr = q_norm(FAST_NATIVE.linear(x, w["wq_a"]))
    want_q = rotary.rotate(FAST_NATIVE.linear(want_qr, w["wq_b"]).unflatten(-1, (H, Dh)), positions, phases=phases)
    want_kv = rotary.rotate(kv_norm(FAST_NATIVE.linear(x, w["wkv"])), positions, phases=phases)
    assert torch.equal(qr, want_qr) and torch.equal(q, want_q) and torch.equal(kv, want_kv)

    o = torch.randn(1, N, H, Dh, generator=g).bfloat16()
    y = FAST_NATIVE.attention_out(o, phases, w["wo_a"].flatten(0, 1), G, w["wo_b"])
    back = rotary.rotate(o, positions, inverse=True, phases=phases)
    grouped = FAST_NATIVE.grouped_linear(back.flatten(2).unflatten(-1, (G, -1)), w["wo_a"]).flatten(2)
    assert torch.equal(y, FAST_NATIVE.linear(grouped, w["wo_b"]))

    # float64: the rotation, the norm, the groups written out
    def rope64(t, sign):
        angle = positions.double()[:, None] * rotary.freqs.double()                  # [N, R/2]
        c, s = torch.cos(angle), sign * torch.sin(angle)
        t = t.double().clone()
        a, b = t[..., -R::2].clone(), t[..., -R + 1::2].clone()
        shape = (N,) + (1,) * (t.dim() - 3) + (R // 2,)
        c, s = c.view(shape), s.view(shape)
        t[..., -R::2], t[..., -R + 1::2] = a * c - b * s, a * s + b * c
        return t
    norm64 = lambda t, wt, eps: t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * wt.double()
    x64 = x.double()[0]
    qr64 = norm64(x64 @ w["wq_a"].double().T, w["q_norm"], 1e-6)
    q64 = rope64((qr.double()[0] @ w["wq_b"].double().T).view(1, N, H, Dh), 1.0)
    kv64 = rope64(norm64(x64 @ w["wkv"].double().T, w["kv_norm"], 1e-5).view(1, N, Dh), 1.0)
    back64 = rope64(o.double(), -1.0).view(N, G, -1)
    y64 = torch.einsum("ngi,gri->ngr", back64, w["wo_a"].double()).reshape(N, G * Or) @ w["wo_b"].double().T
    for got, want in ((qr[0], qr64), (q, q64), (kv, kv64)):
        assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()
    assert (y[0].double() - y64).abs().max() <= 0.03 * y64.abs().max()


def test_the_policy_fuses_the_projections_of_decode_rows_only():
    g = torch.Generator().manual_seed(34)
    D, Qr, H, Dh, G, Or = 64, 32, 2, 32, 2, 16
    w = _projection_weights(g, D, Qr, H, Dh, G, Or, torch.bfloat16)
    phases = torch.polar(torch.ones(65, 8), torch.rand(65, 8, generator=g))
    args = lambda x, ph: (x, w["wq_a"], (w["q_norm"], 1e-6), w["wq_b"], w["wkv"], (w["kv_norm"], 1e-6), ph, H)
    x = torch.randn(1, 2, D, generator=g).bfloat16()
    assert FAST_NATIVE.attention_in(*args(x, phases[:2])) is not None
    assert FAST.attention_in(*args(x, phases[:2])) is None                         # no library in the policy
    assert FAST_NATIVE.attention_in(*args(x.float(), phases[:2])) is None          # fp32 rows: torch's GEMM
    many = torch.randn(1, 65, D, generator=g).bfloat16()                            # a prefill's rows
    assert FAST_NATIVE.attention_in(*args(many, phases)) is None
    assert Numerics("reference", "invariant", native=True).attention_in(*args(x, phases[:2])) is None
    o = torch.randn(1, 2, H, Dh, generator=g).bfloat16()
    assert FAST_NATIVE.attention_out(o, phases[:2], w["wo_a"].flatten(0, 1), G, w["wo_b"]) is not None
    assert FAST_NATIVE.attention_out(o, phases[:2], w["wo_a"].flatten(0, 1).float(), G, w["wo_b"]) is None
    with torch.enable_grad():
        recording = w["wo_b"].float().requires_grad_().bfloat16()
        assert FAST_NATIVE.attention_out(o, phases[:2], w["wo_a"].flatten(0, 1), G, recording) is None


def _two_rows_decoding(model) -> list[torch.Tensor]:
    """The logits of two rows' 30-token prefill and their ten decode steps after it."""
    from helpers import MAX_SEQ, token_ids
    ids = token_ids(2, 40, model.cfg.vocab_size)
    cache = model.new_cache(2, 2 * MAX_SEQ)
    with torch.no_grad():
        out = [model.logits(model(ids[:, :30], 0, cache).hidden)]
        out += [model.logits(model(ids[:, p:p + 1], p, cache).hidden) for p in range(30, 40)]
    return out


def test_a_decode_step_takes_the_fused_projections_with_the_bits_of_the_layer_calls(monkeypatch):
    from helpers import MAX_SEQ, binding_config, without_dspark
    runtime = RuntimeConfig(max_seq_len=2 * MAX_SEQ, max_batch_size=2, numerics="fast", dtype="bfloat16")
    model = init_random_(Transformer(without_dspark(binding_config()), runtime), 0)
    run = lambda: _two_rows_decoding(model)
    monkeypatch.setattr(native, "attention_entry", lambda *a: None)     # the attention's own call, not the block's
    calls = []
    real_in, real_out = native.attention_in, native.attention_out
    monkeypatch.setattr(native, "attention_in", lambda *a: calls.append("in") or real_in(*a))
    monkeypatch.setattr(native, "attention_out", lambda *a: calls.append("out") or real_out(*a))
    fused = run()
    assert calls.count("in") == calls.count("out") == 10 * model.cfg.n_layers      # the decode steps only
    monkeypatch.setattr(native, "attention_in", lambda *a: None)
    monkeypatch.setattr(native, "attention_out", lambda *a: None)
    assert all(torch.equal(a, b) for a, b in zip(fused, run()))


@pytest.mark.parametrize("old, new", [
    ("dsv41_rope(1, N, H, Dh, R, 1, 1, 1, o, phases, rotated);", "dsv41_rope(1, N, H, Dh, R, 1, 1, 0, o, phases, rotated);"),
    ("dsv41_rms_norm(N, Dh, kv_eps, kv_raw, 1, kv_norm, kv_norm_bf16, kv_raw);", ""),
    ("rotated, I, H * Dh, wo_a", "rotated, H * Dh, I, wo_a"),
])
def test_a_mutated_projection_call_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("sublayers.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_the_attention_projections_are_two_native_calls_with_the_bits_of_eleven(3, torch.bfloat16)


def _moe_case(g: torch.Generator, n: int, stored: bool):
    from dsv41.model import formats
    D, I, E, A = 64, 32, 8, 3
    x = torch.randn(n, D, generator=g).bfloat16()
    gate, bias = (torch.randn(E, D, generator=g) / 8).bfloat16(), torch.randn(E, generator=g) * 0.1
    shared = tuple((torch.randn(*s, generator=g) / 8).bfloat16() for s in ((I, D), (I, D), (D, I)))
    held = tuple((torch.randn(E, *s, generator=g) / 8).bfloat16() for s in ((I, D), (I, D), (D, I)))
    if not stored:
        return x, gate, bias, A, held, shared, None, held
    banks, scales, values = [], [], []
    for w in held:
        codes = torch.randint(-128, 128, (*w.shape[:-1], w.shape[-1] // 2), generator=g, dtype=torch.int8)
        scale = torch.randint(118, 128, (*w.shape[:-1], w.shape[-1] // 32), generator=g, dtype=torch.uint8)
        scale = scale.view(torch.float8_e8m0fnu)
        banks.append(codes), scales.append(scale)
        values.append(torch.stack([formats.dequantize_fp4_weight(c, s) for c, s in zip(codes, scale)]).bfloat16())
    return x, gate, bias, A, tuple(banks), shared, tuple(scales), tuple(values)


@pytest.mark.parametrize("stored", [False, True], ids=["held", "stored"])
@pytest.mark.parametrize("n", [1, 4])
def test_a_decode_steps_moe_is_one_native_call_with_the_bits_of_three(n, stored):
    """sublayers.c `dsv41_moe`: the gate's widened logits, the router, the routed and shared experts,
    bit-equal to the three calls one by one (`widened_linear`, `route`, `routed_experts` with the shared
    expert, then the layer's cast), and within bf16 rounding of the float64 mixture written out here
    for the experts it chose, which are the top-k of its float64 scores plus bias."""
    from dsv41.model.moe import ROUTE_NORM_EPS
    g = torch.Generator().manual_seed(35 + n)
    x, gate, bias, A, banks, shared, scales, values = _moe_case(g, n, stored)
    y, ids = FAST_NATIVE.moe(x, gate, bias, A, 1.5, ROUTE_NORM_EPS, 6.0, banks, shared, scales)
    logits = FAST_NATIVE.widened_linear(x, gate)
    weights, want_ids = FAST_NATIVE.route(logits, bias, A, 1.5, ROUTE_NORM_EPS, None, None)
    want = FAST_NATIVE.routed_experts(x, want_ids, weights, *banks, 6.0, shared=shared, scales=scales,
                                      dtype=torch.bfloat16)
    assert torch.equal(ids, want_ids) and torch.equal(y, want.bfloat16())

    scores = torch.sqrt(torch.nn.functional.softplus(x.double() @ gate.double().T))
    assert torch.equal(ids.sort(-1).values, (scores + bias.double()).topk(A, dim=-1).indices.sort(-1).values)
    w64 = scores.gather(1, ids)
    w64 = w64 / w64.sum(-1, keepdim=True) * 1.5

    def expert(v, w1, w3, w2):
        gate_, up = (v @ w1.double().T).clamp(max=6.0), (v @ w3.double().T).clamp(-6.0, 6.0)
        return (gate_ * torch.sigmoid(gate_) * up) @ w2.double().T

    y64 = torch.stack([sum(w64[t, a] * expert(x[t].double(), *(b[ids[t, a]] for b in values)) for a in range(A))
                       + expert(x[t].double(), *shared) for t in range(n)])
    assert (y.double() - y64).abs().max() <= 0.03 * y64.abs().max()


def test_the_policy_fuses_the_moe_of_decode_rows_only():
    from dsv41.model.moe import ROUTE_NORM_EPS
    g = torch.Generator().manual_seed(36)
    x, gate, bias, A, banks, shared, _, _ = _moe_case(g, 2, False)
    call = lambda policy, x, banks=banks: policy.moe(x, gate, bias, A, 1.0, ROUTE_NORM_EPS, 0.0, banks, shared)
    assert call(FAST_NATIVE, x) is not None
    assert call(FAST, x) is None
    assert call(FAST_NATIVE, x.float()) is None                                       # fp32 rows
    assert call(FAST_NATIVE, x[:1].expand(NATIVE_WIDE_ROWS + 1, -1).contiguous()) is None  # a prefill's rows
    assert call(FAST_NATIVE, x, tuple(b.float() for b in banks)) is None              # banks of another dtype


@pytest.mark.parametrize("stored", [False, True], ids=["held", "stored"])
def test_a_decode_step_takes_the_fused_moe_with_the_bits_of_the_layer_calls(stored, monkeypatch):
    monkeypatch.setattr(native, "ffn_half", lambda *a: None)              # the MoE's own call, not the block's (N35)
    _a_native_call_with_the_bits_of_the_layer_calls("moe", monkeypatch, rows=lambda x: x.shape[0],
                                                    stored_experts=stored)


@pytest.mark.parametrize("old, new", [
    ("dsv41_route(N, E, A, scale, eps,", "dsv41_route(N, E, A, 1.0f, eps,"),
    ("w1, w3, w2, s1, s3, s2,\n                                      c1", "w1, w3, w2, NULL, NULL, NULL,\n                                      c1"),
    ("y[i] = float_to_bf16(sum[i]);", "{ uint32_t u; memcpy(&u, &sum[i], 4); y[i] = (uint16_t)(u >> 16); }"),
])
def test_a_mutated_moe_call_is_caught(old, new, tmp_path, monkeypatch):
    if "memcpy" in new:
        new = new.replace("memcpy", "__builtin_memcpy")
    lib = mutated_library("sublayers.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_a_decode_steps_moe_is_one_native_call_with_the_bits_of_three(4, False)


# ------------------------------------------------------------------------------------------ the block's calls

def _ffn_half_case(g: torch.Generator, n: int, stored: bool):
    from dsv41.model import hyper
    S, iters = 4, 20
    x, gate, bias, A, banks, shared, scales, values = _moe_case(g, n, stored)
    D = x.shape[1]
    streams = (torch.randn(1, n, S, D, generator=g) * 2).bfloat16()
    fn = torch.randn((2 + S) * S, S * D, generator=g) / math.sqrt(S * D)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + S) * S, generator=g) * 0.1
    pre, post, comb = hyper.mixes(streams, fn.flip(0), scale, base, iters=iters, norm_eps=1e-6, hc_eps=1e-6,
                                  numerics=FAST_NATIVE)
    out = (torch.randn(1, n, D, generator=g) * 2).bfloat16()
    norm = ((torch.rand(D, generator=g) + 0.5).bfloat16(), 1e-6)
    moe = (gate, bias, A, 1.5, 1e-20, 6.0, banks, shared, scales)
    return streams, pre, out, post, comb, (fn, scale, base, iters, 1e-6, 1e-6), norm, moe


@pytest.mark.parametrize("stored", [False, True], ids=["held", "stored"])
@pytest.mark.parametrize("n", [1, 3])
def test_a_blocks_feed_forward_half_is_one_native_call_with_the_bits_of_three(n, stored):
    """sublayers.c `dsv41_ffn_half`: the FFN's entry (the attention's output expanded into the streams,
    the FFN's mixes, the normed collapse), the MoE and the expansion of its output, bit-equal to
    `hc_enter`, `moe` and `hc_expand` one by one; and the expansion is the formula written out here in
    float64 from those calls' own mixes and MoE output."""
    g = torch.Generator().manual_seed(50 + n)
    streams, pre, out, post, comb, mixes, norm, moe = _ffn_half_case(g, n, stored)
    got_streams, got_pre, got_ids = FAST_NATIVE.ffn_half(streams, pre, out, post, comb, mixes, norm, moe)
    entered, (pre_ffn, post_ffn, comb_ffn), h = FAST_NATIVE.hc_enter(streams, pre, *mixes, *norm, out, post, comb)
    y, ids = FAST_NATIVE.moe(h[0], *moe)
    want = FAST_NATIVE.hc_expand(y[None], entered, post_ffn, comb_ffn)
    assert torch.equal(got_streams, want) and torch.equal(got_pre, pre_ffn) and torch.equal(got_ids, ids)
    mixed = post_ffn.double()[..., None] * y.double()[None, :, None] + torch.einsum(
        "bnij,bnid->bnjd", comb_ffn.double(), entered.double())
    assert (got_streams.double() - mixed).abs().max() <= 2.0 ** -7 * mixed.abs().max()


@pytest.mark.parametrize("stored", [False, True], ids=["held", "stored"])
def test_a_feed_forward_half_on_two_threads_has_the_bits_of_three(stored, two_threads):
    """8 rows on two threads: the entry by pairs of rows, the experts' loops and the last expansion by
    rows, still bit-equal to the calls one by one."""
    test_a_blocks_feed_forward_half_is_one_native_call_with_the_bits_of_three(8, stored)


def test_a_mutated_row_split_of_the_last_expansion_is_caught(tmp_path, monkeypatch, two_threads):
    """Every row expanded with the first row's post: off the calls one by one."""
    lib = mutated_library("mixes.c", "post + r * S, comb + r * S * S, (char *)out", "post, comb + r * S * S, (char *)out",
                          tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_a_blocks_feed_forward_half_is_one_native_call_with_the_bits_of_three(8, False)


def test_the_policy_fuses_the_feed_forward_half_of_decode_rows_only():
    g = torch.Generator().manual_seed(52)
    streams, pre, out, post, comb, mixes, norm, moe = _ffn_half_case(g, 2, False)
    call = lambda policy, streams=streams, out=out, moe=moe: policy.ffn_half(streams, pre, out, post, comb, mixes,
                                                                           norm, moe)
    assert call(FAST_NATIVE) is not None
    assert call(FAST) is None
    assert call(FAST_NATIVE, streams.float(), out.float()) is None                  # fp32 rows
    many = NATIVE_WIDE_ROWS + 1
    assert FAST_NATIVE.ffn_half(streams[:, :1].expand(1, many, -1, -1), pre[:, :1].expand(1, many, -1), out[:, :1].expand(1, many, -1),
                                post[:, :1].expand(1, many, -1), comb[:, :1].expand(1, many, -1, -1), mixes, norm, moe) is None
    held_fp32 = moe[:6] + (tuple(b.float() for b in moe[6]),) + moe[7:]
    assert call(FAST_NATIVE, moe=held_fp32) is None                                  # banks of another dtype


def _a_native_call_with_the_bits_of_the_layer_calls(name: str, monkeypatch, rows=lambda x: x.shape[1], **runtime):
    """A model's two rows decoding call native.`name` once a layer per decode step, with both rows (`rows`
    of its first argument: [1, N, …] by default), and give the bits they give with it declining."""
    from helpers import MAX_SEQ, binding_config, without_dspark
    runtime = RuntimeConfig(max_seq_len=2 * MAX_SEQ, max_batch_size=2, numerics="fast", **runtime)
    model = init_random_(Transformer(without_dspark(binding_config()), runtime), 0)
    calls = []
    real = getattr(native, name)
    monkeypatch.setattr(native, name, lambda *a: calls.append(rows(a[0])) or real(*a))
    fused = _two_rows_decoding(model)
    assert calls == [2] * (10 * model.cfg.n_layers)                                   # the decode steps only
    monkeypatch.setattr(native, name, lambda *a: None)
    assert all(torch.equal(a, b) for a, b in zip(fused, _two_rows_decoding(model)))


@pytest.mark.parametrize("stored", [False, True], ids=["held", "stored"])
def test_a_decode_step_takes_the_feed_forward_half_with_the_bits_of_the_layer_calls(stored, monkeypatch):
    _a_native_call_with_the_bits_of_the_layer_calls("ffn_half", monkeypatch, stored_experts=stored)


@pytest.mark.parametrize("old, new", [
    ("dsv41_hc_expand_rows(N, S, D, 1, y, entered, post_ffn, comb_ffn, streams_out,",
     "dsv41_hc_expand_rows(N, S, D, 1, y, entered, post, comb, streams_out,"),           # the attention's mixes
    ("dsv41_hc_expand_rows(N, S, D, 1, y, entered, post_ffn, comb_ffn, streams_out,",
     "dsv41_hc_expand_rows(N, S, D, 1, y, residual, post_ffn, comb_ffn, streams_out,"),  # the streams before
    ("status = dsv41_moe(N, D, E, A, I, threads, h,", "status = dsv41_moe(N, D, E, A, I, threads, o,"),
])
def test_a_mutated_feed_forward_half_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("sublayers.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_a_blocks_feed_forward_half_is_one_native_call_with_the_bits_of_three(3, False)


def _entry_case(g: torch.Generator, n: int):
    from dsv41.model import hyper
    from dsv41.model.rope import Rotary, yarn_frequencies
    S, D, Qr, H, Dh, R, iters = 4, 96, 64, 4, 32, 16, 20
    w = _projection_weights(g, D, Qr, H, Dh, 2, 24, torch.float32)
    streams = (torch.randn(1, n, S, D, generator=g) * 2).bfloat16()
    fn = torch.randn((2 + S) * S, S * D, generator=g) / math.sqrt(S * D)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + S) * S, generator=g) * 0.1
    pre = hyper.mixes(streams, fn.flip(0), scale, base, iters=iters, norm_eps=1e-6, hc_eps=1e-6, numerics=FAST_NATIVE)[0]
    norm = ((torch.rand(D, generator=g) + 0.5).bfloat16(), 1e-6)
    phases = Rotary(R, yarn_frequencies(R, 10000.0, 0, 1.0, 0.0, 0.0)).phases(torch.arange(50, 50 + n))
    projections = (w["wq_a"], w["q_norm"], 1e-6, w["wq_b"], w["wkv"], w["kv_norm"], 1e-5, phases, H)
    return streams, pre, (fn, scale, base, iters, 1e-6, 1e-6), norm, projections


@pytest.mark.parametrize("n", [1, 3])
def test_a_blocks_way_into_its_attention_is_one_native_call_with_the_bits_of_two(n):
    """sublayers.c `dsv41_attention_entry`: the attention's entry (its mixes and normed input) and the
    query and key paths of that input, bit-equal to `hc_enter` and `attention_in` one by one (each of
    which has its own float64 check above)."""
    g = torch.Generator().manual_seed(60 + n)
    streams, pre, mixes, norm, projections = _entry_case(g, n)
    (got_pre, got_post, got_comb), got_h, (qr, q, kv) = FAST_NATIVE.attention_entry(streams, pre, mixes, norm, projections)
    same, want_mixes, h = FAST_NATIVE.hc_enter(streams, pre, *mixes, *norm)
    wq_a, q_norm, q_eps, wq_b, wkv, kv_norm, kv_eps, phases, heads = projections
    want = FAST_NATIVE.attention_in(h, wq_a, (q_norm, q_eps), wq_b, wkv, (kv_norm, kv_eps), phases, heads)
    assert same is streams and torch.equal(got_h, h)
    assert all(torch.equal(a, b) for a, b in zip((got_pre, got_post, got_comb), want_mixes))
    assert all(torch.equal(a, b) for a, b in zip((qr, q, kv), want))


def test_the_policy_enters_the_attention_in_one_call_for_decode_rows_only():
    g = torch.Generator().manual_seed(62)
    streams, pre, mixes, norm, projections = _entry_case(g, 2)
    assert FAST_NATIVE.attention_entry(streams, pre, mixes, norm, projections) is not None
    assert FAST.attention_entry(streams, pre, mixes, norm, projections) is None
    assert FAST_NATIVE.attention_entry(streams.float(), pre, mixes, norm, projections) is None
    many = NATIVE_WIDE_ROWS + 1
    assert FAST_NATIVE.attention_entry(streams[:, :1].expand(1, many, -1, -1), pre[:, :1].expand(1, many, -1), mixes,
                                       norm, projections) is None
    as_fp32 = (projections[0].float(),) + projections[1:]
    assert FAST_NATIVE.attention_entry(streams, pre, mixes, norm, as_fp32) is None


def test_a_decode_step_enters_each_attention_in_one_call_with_the_bits_of_the_layer_calls(monkeypatch):
    _a_native_call_with_the_bits_of_the_layer_calls("attention_entry", monkeypatch)


@pytest.mark.parametrize("old, new", [
    ("status = dsv41_attention_in(N, D, Qr, H, Dh, R, threads, h,", "status = dsv41_attention_in(N, D, Qr, H, Dh, R, threads, streams,"),
    ("mix_threads, pre, norm_weight, norm_bf16, eps, pre_out, post_out, comb_out, h);",
     "mix_threads, pre_out, norm_weight, norm_bf16, eps, pre_out, post_out, comb_out, h);"),   # trap 1 broken
])
def test_a_mutated_attention_entry_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("sublayers.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_a_blocks_way_into_its_attention_is_one_native_call_with_the_bits_of_two(3)


@pytest.mark.parametrize("stored", [False, True], ids=["held", "stored"])
def test_a_batch_decode_step_has_the_same_bits_on_one_thread_and_two(stored):
    """The native kernels split their work between threads without changing a sum (each output, row or
    group is one thread's, in one order): decode steps of 9 rows (the fused block calls, experts' groups
    of 1 to 9 rows on the dot products and the tiles, the head) of a model wide enough that its products
    take both threads give the same logits on one thread and on two."""
    from helpers import MAX_SEQ, binding_config, token_ids, without_dspark
    cfg = without_dspark(binding_config(dim=256, moe_inter_dim=128, q_lora_rank=128, o_lora_rank=64,
                                        n_routed_experts=8, vocab_size=512))
    assert cfg.dim * cfg.q_lora_rank >= native.GEMV_THREAD_FROM          # the products take both threads
    runtime = RuntimeConfig(max_seq_len=MAX_SEQ, numerics="fast", dtype="bfloat16", stored_experts=stored)
    model = init_random_(Transformer(cfg, runtime), 3)
    ids = token_ids(9, 24, cfg.vocab_size)
    before, logits = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = model.new_cache(9, MAX_SEQ)
            with torch.inference_mode():
                model(ids[:, :18], 0, cache)
                logits.append(torch.stack([model.logits(model(ids[:, p:p + 1], p, cache).hidden[:, -1])
                                           for p in range(18, 24)]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits[0], logits[1])


def test_a_decode_step_reads_its_pool_where_it_lies_with_the_bits_of_one_pool(monkeypatch):
    """A fast decode step's attention takes its window rings and rows as parts and its compressed rows in
    their cache (N40); handing the kernel one concatenated pool instead gives the same logits."""
    from helpers import MAX_SEQ, binding_config, token_ids, without_dspark
    cfg = without_dspark(binding_config(dim=128, n_routed_experts=8, vocab_size=256))
    model = init_random_(Transformer(cfg, RuntimeConfig(max_seq_len=MAX_SEQ, numerics="fast", dtype="bfloat16")), 5)
    ids = token_ids(3, 40, cfg.vocab_size)
    real, kinds = native.sparse_attention, []

    def one_pool(q, pool, rows, sink, scale, floor, picked=None):
        parts = [pool] if torch.is_tensor(pool) else list(pool)
        kinds.append((len(parts), picked is not None))
        if picked is not None:
            kv, token_slot, selected = picked
            parts.append(kv[token_slot.unsqueeze(1), selected.clamp(min=0)].flatten(0, 1))
        return real(q, torch.cat(parts)[None] if len(parts) > 1 else parts[0], rows, sink, scale, floor)

    logits = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(native, "sparse_attention", one_pool)
        cache = model.new_cache(3, MAX_SEQ)
        with torch.inference_mode():
            model(ids[:, :34], 0, cache)
            logits.append(torch.stack([model.logits(model(ids[:, p:p + 1], p, cache).hidden[:, -1])
                                       for p in range(34, 40)]))
    assert torch.equal(logits[0], logits[1])
    assert (2, True) in kinds and (2, False) in kinds        # compressed layers pick, window layers do not


@pytest.mark.parametrize("source, old, new, stored", [
    # a sublayer entry whose row pairs (one per thread) all take the first pair's pre
    ("mixes.c", "norm_eps, hc_eps, 1, pre + r * S,", "norm_eps, hc_eps, 1, pre,", False),
    # the experts' gate and up tiles split by cost (N40) with the first thread's share one tile short
    ("gemv.c", "gu_end = tile_at(G, I_units, prefix, cost, index + 1, nt);",
     "gu_end = tile_at(G, I_units, prefix, cost, index + 1, nt) - (index + 1 < nt);", True),
])
def test_a_kernel_whose_bits_follow_the_threads_is_caught_by_the_batch_step(source, old, new, stored, tmp_path,
                                                                           monkeypatch):
    lib = mutated_library(source, old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_a_batch_decode_step_has_the_same_bits_on_one_thread_and_two(stored)
