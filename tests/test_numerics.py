"""The numerics policy (numerics.py) and the tie rule of top-k (topk.py), against formulas in the test.

- ordered top-k: the k largest scores, equal scores to the lower index, the same set whatever the
  batch or the other rows (brute force with Python's stable sort);
- the quantised GEMM: the reference's blockwise accumulation written out here in float64 / fp32 steps;
  invariant kernels reproduce it bit for bit at any row count; one GEMM over the dequantised weight
  (dsv41 before) does not;
- invariant matmuls and transcendentals give each row the same bits at any row count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41.model import formats, numerics
from dsv41.model.layers import block_scales, quantized_linear
from dsv41.model.numerics import Numerics
from dsv41.model.topk import ordered_keys, topk

INVARIANT, BLAS = Numerics("reference", "invariant"), Numerics("reference", "blas")


# ------------------------------------------------------------------------------------------ top-k

def brute_force(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]       # stable: ties to the lower index


@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_topk_breaks_ties_by_lower_index(k):
    g = torch.Generator().manual_seed(k)
    scores = torch.randint(-2, 3, (6, 20), generator=g).float()        # many exact ties
    scores[0, :5] = float("-inf")
    scores[1] = 0.0
    scores[2, ::2] = -0.0                                               # −0 and +0 are one score
    values, indices = topk(scores, k)
    for r in range(scores.shape[0]):
        assert indices[r].tolist() == brute_force(scores[r].tolist(), k), r
        assert torch.equal(values[r], scores[r, indices[r]])
    unsorted = topk(scores, k, sorted=False)[1].sort(-1).values
    assert torch.equal(unsorted, indices.sort(-1).values)


def test_topk_same_choice_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (2, 6, 50), generator=g).to(torch.bfloat16)
    batch = topk(scores, 9, sorted=False)[1].sort(-1).values
    for b in range(2):
        for t in range(6):
            alone = topk(scores[b:b + 1, t:t + 1], 9, sorted=False)[1].sort(-1).values
            assert torch.equal(alone[0, 0], batch[b, t])


def test_ordered_keys_are_unique_and_ordered():
    values = torch.tensor([float("-inf"), -3.5, -1.0, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    keys = ordered_keys(values)
    assert keys.unique().numel() == keys.numel()
    # strictly increasing in the score, except that −0 and +0 tie and the lower index wins
    order = keys.argsort(descending=True).tolist()
    assert order == [7, 6, 5, 3, 4, 2, 1, 0]


# ------------------------------------------------------------------------------------------ quantised GEMM

def blockwise_formula(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, storage: str) -> torch.Tensor:
    """§6.3 step by step: fp8 activations per 32; per K block the exact partial sum (float64 holds it
    exactly) rounded to fp32, times both power-of-two scales, added in K order to an fp32 accumulator."""
    q, q_scale = formats.fp8_act_quant(x.float())
    values = formats.decode_bytes(w, "e2m1x2" if storage == "fp4" else "e4m3")
    scale_rows = block_scales(w_scale, storage, w.shape[0])
    M, K, N = q.shape[0], q.shape[1], values.shape[0]
    out = torch.zeros(M, N)
    for m in range(M):
        acc = torch.zeros(N)
        for k in range(K // 32):
            cols = slice(32 * k, 32 * k + 32)
            partial = (q[m, cols].double() * values[:, cols].double()).sum(-1).float()
            acc = acc + partial * q_scale[m, k] * scale_rows[:, k]
        out[m] = acc
    return out.to(torch.bfloat16)


@pytest.fixture(scope="module")
def quantised():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 512, generator=g) * torch.rand(1, 512, generator=g) * 4).to(torch.bfloat16)
    fp8 = formats.quantize_fp8_weight(torch.randn(96, 512, generator=g))
    fp4 = formats.quantize_fp4_weight(torch.randn(96, 512, generator=g) * 0.05)
    return x, {"fp8": fp8, "fp4": fp4}


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_quantised_linear_is_the_blockwise_formula(quantised, storage):
    x, weights = quantised
    w, s = weights[storage]
    expect = blockwise_formula(x, w, s, storage)
    assert torch.equal(quantized_linear(x, w, s, storage, 96, INVARIANT), expect)
    for rows in (1, 2, 5):                                             # any row count, the same bits
        assert torch.equal(quantized_linear(x[:rows], w, s, storage, 96, INVARIANT), expect[:rows])
    # the BLAS path sums each block in float32: within a rounding of the formula
    blas = quantized_linear(x, w, s, storage, 96, BLAS).float()
    assert ((blas - expect.float()).abs() <= expect.float().abs() * 2 ** -7).all()


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_quantised_linear_decoded_in_pieces_is_the_formula(quantised, storage, monkeypatch):
    """The invariant GEMM decodes the weight piece by piece (40 rows of 64 values, uneven against 96)
    and sums the blocks in K chunks of 3: the same bits as the formula, for one row and for several."""
    x, weights = quantised
    w, s = weights[storage]
    expect = blockwise_formula(x, w, s, storage)
    monkeypatch.setattr(numerics, "DECODE_CHUNK_ELEMENTS", 40 * 64)
    monkeypatch.setattr(numerics, "BLOCK_PARTIALS_ELEMENTS", 3 * 9 * 96)
    for rows in (1, 9):
        assert torch.equal(quantized_linear(x[:rows], w, s, storage, 96, INVARIANT), expect[:rows])


def test_invariant_linear_in_pieces_is_one_rounding(monkeypatch):
    """A float64 weight copy too large for one piece is taken in pieces of rows: each output still
    the float64 product rounded once (the head, 129280 rows in the release)."""
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(3, 64, generator=g), torch.randn(100, 64, generator=g)
    monkeypatch.setattr(numerics, "FLOAT64_CHUNK_ELEMENTS", 7 * 64)
    assert torch.equal(INVARIANT.linear(x, w), (x.double() @ w.double().t()).float())


def test_fp4_blocks_are_exact_in_float32_over_the_widest_range():
    """Blocks whose activations span every e4m3 binade, subnormals next to ±448, against every e2m1
    code: the split float32 sums equal the float64 formula bit for bit. Block 0 of row 0 is built so
    that a float32 sum in index order loses a term: 16 × 448·6, then 2⁻⁹·0.5, then 15 × −448·6."""
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (4, 1024), dtype=torch.uint8, generator=g)
    codes[:, ::32] = 0x7E                                                # 448 in every block (0x7F is NaN)
    codes[codes == 0x7F] = 0x01                                          # 2⁻⁹, the smallest subnormal
    codes[codes == 0xFF] = 0x81
    codes[0, :32] = torch.tensor([0x7E] * 16 + [0x01] + [0xFE] * 15, dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    packed = torch.randint(-128, 128, (48, 512), dtype=torch.int8, generator=g)
    packed[0, :16] = torch.tensor([0x77] * 8 + [0x71] + [0x77] * 7, dtype=torch.uint8).view(torch.int8)
    values = formats.decode_bytes(packed, "e2m1x2")
    blocks = (q.double().view(4, 1, 32, 32) * values.double().view(1, 48, 32, 32)).sum(-1).float()   # [M, N, nb]
    expect = torch.zeros(4, 48)
    for k in range(32):
        expect = expect + blocks[..., k]
    got = INVARIANT.block_scaled_matmul(q, torch.ones(4, 32), packed, torch.ones(48, 32), "fp4")
    assert torch.equal(got, expect)
    in_order = torch.zeros((), dtype=torch.float32)
    for a, w in zip(q[0, :32].float(), values[0, :32]):
        in_order = in_order + a * w
    assert blocks[0, 0, 0].item() == 2688 + 2 ** -10 and in_order.item() == 2688.0


def test_one_gemm_over_the_dequantised_weight_is_not_the_blockwise_result(quantised):
    """Mutation: what dsv41 computed before — one fp32 GEMM over all of K — sums in another order: its
    fp32 results differ in the last bits, which a bf16 rounding tie turns into a different output."""
    x, weights = quantised
    w, s = weights["fp8"]
    q, q_scale = formats.fp8_act_quant(x.float())
    one_gemm = F.linear(formats.fp8_qdq(x.float()), formats.dequantize_fp8_weight(w, s))
    blockwise = INVARIANT.block_scaled_matmul(q, q_scale, w, block_scales(s, "fp8", 96), "fp8")
    assert (one_gemm != blockwise).float().mean() > 0.05
    torch.testing.assert_close(one_gemm, blockwise, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------ invariance

def test_invariant_linear_is_row_count_independent_and_correctly_rounded():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 1024, generator=g).to(torch.bfloat16).float()
    w = torch.randn(24, 1024, generator=g).to(torch.bfloat16).float()
    full = INVARIANT.linear(x, w)
    exact = (x.double() @ w.double().t()).float()                     # bf16 products: exact sums in float64
    assert torch.equal(full, exact)
    for rows in (1, 2, 3, 7, 16):
        assert torch.equal(INVARIANT.linear(x[:rows], w), full[:rows])


@pytest.mark.parametrize("fn", ["exp", "sigmoid", "silu", "softplus"])
def test_invariant_transcendentals_do_not_depend_on_the_tensor_size(fn):
    """The CPU computes a tensor's last partial SIMD vector with scalar code (sigmoid(−0.33175597) differs
    in the last bit between a 31- and a 32-element tensor here); invariant kernels evaluate in float64."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, generator=g) * 3
    x[17] = -0.33175596594810486
    full = getattr(INVARIANT, fn)(x)
    for start, n in ((0, 1), (10, 8), (17, 15), (3, 31), (0, 33), (5, 100)):
        assert torch.equal(getattr(INVARIANT, fn)(x[start:start + n]), full[start:start + n])
    torch.testing.assert_close(full, getattr(BLAS, fn)(x), rtol=2e-7, atol=1e-30)


def test_policy_defaults_and_validation():
    assert Numerics.default("reference") == Numerics("reference", "invariant")
    assert Numerics.default("fast") == Numerics("fast", "blas")
    assert INVARIANT.attention_block == 64 and Numerics("fast", "blas").attention_block is None
    with pytest.raises(ValueError, match="kernels"):
        Numerics("reference", "turbo")
