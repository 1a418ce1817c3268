"""The native blockwise GEMM (dsv41/model/native/, docs/NUMERICS.md N11) against the invariant torch path.

The torch path is itself checked against the §6.3 formula written out in tests/test_numerics.py; here
the C kernel must give its bits exactly, on blocks that span every e4m3 binade (subnormals next to
±448) against every weight code, for plain weights and for pairs, at every row count it takes; its
activation quantiser must give formats.fp8_act_quant's bytes and scales on every e4m3 tie and its
neighbours, subnormals, ±0, ±inf and NaN. Kernels built from mutated sources (the fp4 integer sums
scaled by 2⁻⁹ instead of 2⁻¹⁰; the fp8 sums in fp32; ties rounded away from zero; subnormals
truncated) must fail the same comparisons.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.config import ConfigError
from dsv41.model import formats, native
from dsv41.model.layers import block_scales, quantized_linear, quantized_pairs
from dsv41.model.numerics import NATIVE_MIX_ROWS, Numerics

TORCH, NATIVE = Numerics("reference", "invariant"), Numerics("reference", "invariant", native=True)
# Row counts that reach every path of blockgemm.c: the row kernel (1–7), register tiles of 6 rows with
# each tail (8–13) or, with AVX-512, row vectors in groups of 24 with a 16- or 8-row tail (8–13, 24, 37),
# and chunks of 256 rows ending in a partial one (263).
ROW_COUNTS = (*range(1, 14), 24, 37, 263)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here: the torch path runs instead")


def wide_activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows whose fp8 codes reach from subnormals to ±448 within a block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-14, 9, (rows, k), generator=g).float())
    x[:, ::32] = 448.0 * torch.sign(torch.randn(rows, k // 32, generator=g))
    return x.to(torch.bfloat16)


def every_code_weight(storage: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored bytes covering every finite code of `storage`, with ue8m0 scales around 1."""
    g = torch.Generator().manual_seed(seed)
    if storage == "fp4":
        packed = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=g)
        packed[0, :min(128, k // 2)] = torch.arange(-128, 128, 2, dtype=torch.int8)[:k // 2]
        scale = torch.randint(120, 134, (n, k // 32), dtype=torch.uint8, generator=g)
        return packed, scale.view(torch.float8_e8m0fnu)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[0, :min(256, k)] = torch.arange(256, dtype=torch.uint8)[:k]
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scale = torch.randint(120, 134, (-(-n // 32), k // 32), dtype=torch.uint8, generator=g)
    return codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_native_linear_is_the_invariant_path_at_every_row_count(storage):
    """fp32 GEMM outputs (before the bf16 rounding that would hide a last-bit difference) and the
    Linear's bf16 ones."""
    w, s = every_code_weight(storage, 72, 512, seed=1)
    x = wide_activations(max(ROW_COUNTS), 512, seed=2)
    q, q_scale = formats.fp8_act_quant(x.float())
    rows_scale = block_scales(s, storage, 72)
    expect = TORCH.block_scaled_matmul(q, q_scale, w, rows_scale, storage)
    for rows in ROW_COUNTS:
        assert torch.equal(NATIVE.block_scaled_matmul(q[:rows], q_scale[:rows], w, rows_scale, storage), expect[:rows])
    assert torch.equal(quantized_linear(x, w, s, storage, 72, NATIVE), quantized_linear(x, w, s, storage, 72, TORCH))


def test_native_pairs_are_the_invariant_path():
    """Six (row, expert) pairs through their own fp4 weights, as a decode step's routed experts run."""
    g = torch.Generator().manual_seed(3)
    bank = torch.randint(-128, 128, (6, 96, 256), dtype=torch.int8, generator=g)
    scale = torch.randint(118, 136, (6, 96, 16), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    x = wide_activations(6, 512, seed=4)
    assert torch.equal(quantized_pairs(x, bank, scale, "fp4", 96, NATIVE), quantized_pairs(x, bank, scale, "fp4", 96, TORCH))


def test_native_fp4_sums_are_exact_where_float32_in_order_is_not():
    """The block of tests/test_numerics.py built so that an index-order fp32 sum loses a term
    (16 × 448·6, then 2⁻⁹·0.5, then 15 × −448·6): the kernel's integer sum keeps it."""
    q = torch.tensor([[0x7E] * 16 + [0x01] + [0xFE] * 15], dtype=torch.uint8).view(torch.float8_e4m3fn)
    packed = torch.tensor([[0x77] * 8 + [0x71] + [0x77] * 7], dtype=torch.uint8).view(torch.int8)
    got = native.block_gemm(q.unsqueeze(0), torch.ones(1, 1, 1), packed.unsqueeze(0), torch.ones(1, 1, 1), "fp4")
    assert got.item() == 2688 + 2 ** -10


def test_native_nan_activation_scale_gives_nan():
    w, s = every_code_weight("fp4", 8, 64, seed=5)
    x = wide_activations(1, 64, seed=6)
    x[0, 3] = float("nan")
    out = quantized_linear(x, w, s, "fp4", 8, NATIVE)
    assert torch.equal(out.isnan(), quantized_linear(x, w, s, "fp4", 8, TORCH).isnan()) and out.isnan().all()


def test_without_the_library_the_policy_takes_the_torch_path(monkeypatch):
    w, s = every_code_weight("fp8", 40, 256, seed=7)
    x = wide_activations(2, 256, seed=8)
    expect = quantized_linear(x, w, s, "fp8", 40, NATIVE)
    monkeypatch.setattr(native, "_library", lambda: None)
    assert native.block_gemm(*[torch.empty(1, 1, 32)] * 4, "fp8") is None
    assert torch.equal(quantized_linear(x, w, s, "fp8", 40, NATIVE), expect)


def test_policy_takes_native_only_where_its_bits_are_the_policys():
    assert Numerics.for_device("reference", None, "cpu").native
    assert not Numerics.for_device("reference", "blas", "cpu").native
    assert not Numerics.for_device("reference", None, "meta").native
    for mode, kernels in (("reference", "blas"), ("fast", "invariant")):
        with pytest.raises(ConfigError, match="native"):
            Numerics(mode, kernels, native=True)


def test_a_failed_build_raises_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    target = tmp_path / "blockgemm.so"
    with pytest.raises(Exception):
        native.build(target)
    assert list(tmp_path.iterdir()) == []


def mutated_library(name: str, old: str, new: str, tmp_path, monkeypatch):
    """The library built with `old` replaced by `new` in source `name` (which must hold it). A mutated
    header is written beside copies of every source, whose quoted includes then find it first."""
    header = name.endswith(".h")
    sources = []
    for source in (*native.SOURCES, *native.HEADERS):
        if source.name == name:
            text = source.read_text()
            assert old in text
            (tmp_path / name).write_text(text.replace(old, new))
            source = tmp_path / name
        elif header and source in native.SOURCES:
            (tmp_path / source.name).write_text(source.read_text())
            source = tmp_path / source.name
        if source.suffix == ".c":
            sources.append(source)
    monkeypatch.setattr(native, "SOURCES", tuple(sources))
    native.build(tmp_path / "mutated.so")
    return native.load(tmp_path / "mutated.so")


@pytest.mark.parametrize("lanes, storage, rows, old, new", [
    # the row kernel without vector lanes: fp4's integer sum scaled by 2^-9, fp8 blocks summed in fp32
    (0, "fp4", 1, "* 0x1p-10f", "* 0x1p-9f"),
    (0, "fp8", 1, "double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;", "float s0 = 0, s1 = 0, s2 = 0, s3 = 0;"),
    # with AVX-512 lanes: nibbles read high first, fp8 products summed in fp32 lanes
    (1, "fp4", 1, "_mm_unpacklo_epi8(even, odd)", "_mm_unpacklo_epi8(odd, even)"),
    (1, "fp8", 1, "return _mm512_reduce_add_pd(_mm512_add_pd(d0, d1));", "return _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));"),
    # the tiled kernel: fp4 values read as 2·w, and the blocks accumulated against K order
    (0, "fp4", 13, "wt[j][c] = 0.5 * (double)v_int[j];", "wt[j][c] = (double)v_int[j];"),
    (0, "fp8", 13, "for (int64_t k = 0; k < nb; k++) {\n            decode_tile",
     "for (int64_t k = nb - 1; k >= 0; k--) {\n            decode_tile"),
    # with AVX-512 lanes down the rows: the blocks against K order, a 16-row tail's second vector lost,
    # an fp4 block's second half decoded from its first
    (1, "fp8", 13, "for (int64_t k = 0; k < nb; k++) {\n            decode_columns",
     "for (int64_t k = nb - 1; k >= 0; k--) {\n            decode_columns"),
    (1, "fp4", 13, "if (RP - r == 16) column_rows(2,", "if (RP - r == 16) column_rows(1,"),
    (1, "fp4", 37, "_mm512_storeu_pd(w[c] + 16, _mm512_cvtps_pd(_mm512_castps512_ps256(v1)));",
     "_mm512_storeu_pd(w[c] + 16, _mm512_cvtps_pd(_mm512_castps512_ps256(v0)));"),
])
def test_a_mutated_kernel_fails_the_comparison(lanes, storage, rows, old, new, tmp_path, monkeypatch):
    """Mutation: the same comparison against a kernel built from a broken copy of the source (each row
    kernel's case where this CPU builds that kernel)."""
    if lanes is not None and native._library().dsv41_vector_blocks() != lanes:
        pytest.skip(f"this CPU builds the row kernel {'without' if lanes else 'with'} AVX-512 lanes")
    lib = mutated_library("blockgemm.c", old, new, tmp_path, monkeypatch)
    w, s = every_code_weight(storage, 72, 512, seed=1)
    q, q_scale = formats.fp8_act_quant(wide_activations(rows, 512, seed=2).float())
    expect = TORCH.block_scaled_matmul(q, q_scale, w, block_scales(s, storage, 72), storage)
    assert torch.equal(NATIVE.block_scaled_matmul(q, q_scale, w, block_scales(s, storage, 72), storage), expect)
    monkeypatch.setattr(native, "_library", lambda: lib)
    assert not torch.equal(NATIVE.block_scaled_matmul(q, q_scale, w, block_scales(s, storage, 72), storage), expect)


def act_quant_inputs() -> torch.Tensor:
    """fp32 rows spanning 2⁻³⁰…2²⁰, with every e4m3 midpoint (a tie), its two neighbours, ±0, ±inf,
    NaN and a block below the amax floor."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 1024, generator=g) * torch.exp2(torch.randint(-30, 20, (64, 1024), generator=g).float())
    values = formats.byte_values("e4m3")
    grid = values[torch.isfinite(values)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    x[0, :mid.numel()] = mid
    x[1, :mid.numel()] = torch.nextafter(mid, torch.tensor(1e9))
    x[2, :mid.numel()] = torch.nextafter(mid, torch.tensor(-1e9))
    x[3, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    x[4], x[5] = 0.0, 1e-6
    return x


def same_quantisation(a, b) -> bool:
    qa, qb = a[0].view(torch.uint8), b[0].view(torch.uint8)
    nan = a[0].float().isnan()
    return (torch.equal(nan, b[0].float().isnan()) and torch.equal(qa[~nan], qb[~nan])
            and torch.equal(a[1].nan_to_num(-1.0), b[1].nan_to_num(-1.0)))


def test_native_activation_quantisation_is_formats():
    x = act_quant_inputs()
    assert same_quantisation(native.fp8_act_quant(x), formats.fp8_act_quant(x))
    bf16 = x.to(torch.bfloat16)[6:]
    assert same_quantisation(NATIVE.fp8_act_quant(bf16), formats.fp8_act_quant(bf16.float()))


@pytest.mark.parametrize("old, new", [
    ("+ ((mag.bits >> 20) & 1u)", ""),                               # ties away from zero, not to even
    ("rintf(a * 512.0f)", "truncf(a * 512.0f)"),                     # subnormals truncated
])
def test_a_mutated_activation_quantiser_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("quantize.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    x = act_quant_inputs()
    assert not same_quantisation(native.fp8_act_quant(x), formats.fp8_act_quant(x))


def test_scales_are_taken_per_output_row():
    """The fp8 32 × 32 scale tiles reach the kernel as one scale per output row and K block."""
    _, s = every_code_weight("fp8", 72, 512, seed=1)
    rows = block_scales(s, "fp8", 72)
    assert rows.shape == (72, 16) and torch.equal(rows[33], formats.e8m0_to_float(s)[1])


def fsum_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] · w [N, K]ᵀ with every sum correctly rounded (math.fsum of the exact float64 products),
    rounded once more to fp32."""
    import math
    rows = [[math.fsum((xi * wi).tolist()) for wi in w.double()] for xi in x.double()]
    return torch.tensor(rows, dtype=torch.float64).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_float64_products_are_the_invariant_path(dtype, monkeypatch):
    """The invariant `linear` (head, hyper-connection mixes) and wo_a's groups at decode sizes: exact
    products summed in double give the torch path's bits and the correctly rounded sum's."""
    calls = []
    for name in ("gemv", "linear"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, real=real, **k: calls.append(k) or real(*a, **k))
    g = torch.Generator().manual_seed(11)
    for K in (33, 512, 2048):
        w = (torch.randn(40, K, generator=g) * torch.exp2(torch.randint(-8, 8, (40, K), generator=g).float())).to(dtype)
        for M in range(1, 5):
            x = torch.randn(M, K, generator=g).to(dtype)
            got = NATIVE.linear(x, w)
            assert torch.equal(got, TORCH.linear(x, w))
            assert torch.equal(got, fsum_product(x, w).to(dtype))
    assert len(calls) == 12 and all(k["exact"] for k in calls)
    groups = torch.randn(1, 3, 4, 64, generator=g).to(dtype)
    wo_a = torch.randn(4, 16, 64, generator=g).to(dtype)
    assert torch.equal(NATIVE.grouped_linear(groups, wo_a), TORCH.grouped_linear(groups, wo_a)) and len(calls) == 13
    # five rows: the torch path
    assert torch.equal(NATIVE.linear(torch.ones(5, 33, dtype=dtype), w[:, :33]), TORCH.linear(torch.ones(5, 33, dtype=dtype), w[:, :33]))
    assert len(calls) == 13


def test_a_mutated_float64_product_is_caught(tmp_path, monkeypatch):
    lib = mutated_library("gemv.c", "for (; k < K; k++) {\n        const double v", "for (; k + 1 < K; k++) {\n        const double v",
                          tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_float64_products_are_the_invariant_path(torch.float32, monkeypatch)


def test_router_scores_widen_the_bf16_weight_in_the_kernel(monkeypatch):
    """`widened_linear` (the router's logits) reads the bf16 weight itself, with the bits of the fp32
    copy's product under invariant kernels (the widening is exact) and within fp32 error in fast
    numerics; many rows, or no native kernels, take the copy and torch's product."""
    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda x, w, **k: calls.append(w.dtype) or real(x, w, **k))
    g = torch.Generator().manual_seed(12)
    w = torch.randn(32, 512, generator=g).to(torch.bfloat16)
    fast, fast_native = Numerics("fast", "blas"), Numerics("fast", "blas", native=True)
    for M in (1, 4):
        x = torch.randn(M, 512, generator=g).to(torch.bfloat16)
        assert torch.equal(NATIVE.widened_linear(x, w), TORCH.linear(x.float(), w.float()))
        want = fsum_product(x.float(), w.float())
        bound = 512 * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T)
        assert ((fast_native.widened_linear(x, w).double() - want).abs() <= bound).all()
    assert calls == [torch.bfloat16] * 4
    many = torch.randn(40, 512, generator=g)
    assert torch.equal(fast_native.widened_linear(many, w), fast.linear(many, w.float())) and len(calls) == 4


def mix_inputs(streams: int, rows: int, seed: int):
    """Mix projections spanning 2⁻⁸…2⁸ (gates near 0 and 1, Sinkhorn logits far apart), per-part scales."""
    g = torch.Generator().manual_seed(seed)
    width = (2 + streams) * streams
    m = torch.randn(1, rows, width, generator=g) * torch.exp2(torch.randint(-8, 8, (1, rows, width), generator=g).float())
    return m, torch.rand(3, generator=g) * 2, torch.randn(width, generator=g)


@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_native_mixes_are_the_reference_order_path(streams):
    from dsv41.model import hyper
    # 200 rows: past hyper.INNERMOST_FROM, where torch's path runs positions innermost
    for rows, iters, seed in ((1, 20, 1), (16, 20, 2), (64, 20, 3), (7, 1, 4), (200, 20, 7)):
        m, scale, base = mix_inputs(streams, rows, seed)
        want = hyper.split_mixes(m, scale, base, streams, iters, 1e-6, TORCH)
        got = hyper.split_mixes(m, scale, base, streams, iters, 1e-6, NATIVE)
        assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(got, want))
    assert NATIVE.split_mixes(m, scale, base, streams, iters, 1e-6) is not None
    wide = mix_inputs(5, 2, 5)
    assert NATIVE.split_mixes(*wide, 5, 20, 1e-6) is None              # the order is known up to 4 streams
    many = mix_inputs(streams, NATIVE_MIX_ROWS + 1, 6)
    assert NATIVE.split_mixes(*many, streams, 20, 1e-6) is None        # past the cap: torch over all rows


def test_a_mutated_mix_is_caught(tmp_path, monkeypatch):
    """Sums over a matrix row or column taken in reverse order: other bits than torch's."""
    lib = mutated_library("mixes.c", "float s = c[0];\n    for (int64_t j = 1; j < S; j++) s = s + c[j * stride];",
                          "float s = c[(S - 1) * stride];\n    for (int64_t j = S - 2; j >= 0; j--) s = s + c[j * stride];",
                          tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_mixes_are_the_reference_order_path(4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_native_stream_collapse_and_expand_are_the_reference_order_path(dtype, streams):
    """hc_pre and hc_post at decode and prefill row counts: the torch path's bits, NaN and ±0 included."""
    from dsv41.model import hyper
    g = torch.Generator().manual_seed(streams)
    for rows, width in ((1, 96), (16, 300), (64, 96), (200, 96)):      # 300: a chunk of 256 and a tail
        scale = torch.exp2(torch.randint(-12, 12, (1, rows, streams, width), generator=g).float())
        R = (torch.randn(1, rows, streams, width, generator=g) * scale).to(dtype)
        R[0, 0, :, :3] = torch.tensor([0.0, -0.0, float("nan")]).to(dtype)
        o = (torch.randn(1, rows, width, generator=g) * 100).to(dtype)
        o[0, 0, :2] = torch.tensor([-0.0, 0.0]).to(dtype)
        pre, post = torch.rand(1, rows, streams, generator=g), 2 * torch.rand(1, rows, streams, generator=g)
        comb = hyper.sinkhorn(torch.randn(1, rows, streams, streams, generator=g), 20, 1e-6, TORCH)
        for want, got in ((hyper.collapse(R, pre), hyper.collapse(R, pre, NATIVE)),
                          (hyper.expand(o, R, post, comb, TORCH), hyper.expand(o, R, post, comb, NATIVE))):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               want.nan_to_num().view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert NATIVE.hc_collapse(R, pre) is not None
    rows = NATIVE_MIX_ROWS + 1                                          # past the cap: hyper.py's path
    assert NATIVE.hc_collapse(torch.zeros(1, rows, streams, 8, dtype=dtype), torch.zeros(1, rows, streams)) is None


def test_a_mutated_stream_collapse_is_caught(tmp_path, monkeypatch):
    """hc_pre's sum over the streams taken in reverse: other bits than torch's."""
    lib = mutated_library("mixes.c", "for (int64_t i = 0; i < S; i++) {\n                const float w = pre",
                          "for (int64_t i = S - 1; i >= 0; i--) {\n                const float w = pre", tmp_path,
                          monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_stream_collapse_and_expand_are_the_reference_order_path(torch.float32, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_rotation_is_the_torch_rotation(dtype):
    """Rotary.rotate at decode sizes: the torch path's bits, for heads or none, shared or per-row
    positions, forward and inverse, values spanning 2⁻²⁰…2²⁰ and NaN."""
    from dsv41.model.rope import Rotary, yarn_frequencies
    freqs = yarn_frequencies(32, 160000.0, 256, 4.0, 32.0, 1.0)
    plain, fused = Rotary(32, freqs), Rotary(32, freqs, NATIVE)
    g = torch.Generator().manual_seed(21)
    for shape, positions in (((1, 1, 8, 96), torch.tensor([1000])), ((3, 2, 96), torch.tensor([[5, 6], [70, 71], [9000, 9001]])),
                             ((1, 16, 4, 64), torch.arange(16) * 997)):
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
        x.view(-1)[7] = float("nan")
        x = x.to(dtype)
        for inverse in (False, True):
            want = plain.rotate(x, positions, inverse=inverse)
            got = fused.rotate(x, positions, inverse=inverse)
            assert torch.equal(got.isnan(), want.isnan()) and got.dtype == want.dtype
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert NATIVE.rope(x, plain.phases(positions).view(1, 16, -1)) is not None
    assert NATIVE.rope(torch.zeros(1, 65, 64), plain.phases(torch.arange(65)).view(1, 65, -1)) is None
    # a conjugated table is refused (the kernel conjugates for the inverse itself)
    assert NATIVE.rope(x, plain.phases(positions).view(1, 16, -1).conj()) is None


def test_a_mutated_rotation_is_caught(tmp_path, monkeypatch):
    """The imaginary part's products fused into one multiply-add: other bits than torch's."""
    lib = mutated_library("rope.c", "store_value(out, bf16, at + 1, a * d + bi * c);",
                          "store_value(out, bf16, at + 1, __builtin_fmaf(a, d, bi * c));", tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_rotation_is_the_torch_rotation(torch.float32)


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_native_whole_quantised_linear_is_the_torch_path(storage):
    """Activation quantisation, the blockwise GEMM from the stored ue8m0 scale bytes (0 = 2⁻¹²⁷ among
    them) and the bf16 rounding in one call: the torch path's bf16 bits at every row count, for
    output rows that end inside a 32-row scale tile (72 = 2 · 32 + 8)."""
    w, s = every_code_weight(storage, 72, 512, seed=5)
    s.view(torch.uint8)[1 if storage == "fp8" else 40] = 0          # outputs 32 … 63 / 40: all blocks at 2⁻¹²⁷
    x = wide_activations(max(ROW_COUNTS), 512, seed=6)
    # output 0 of the last row an exact bf16 tie, 1 + 2⁻⁸: 1·1 + 2⁻⁴·2⁻⁴ (fp8) or 1·1 + 2⁻⁷·0.5 (fp4),
    # activation scale 2⁻⁸, weight scale 1; to nearest even it is 1
    x[-1] = 0
    x[-1, :2] = torch.tensor([1.0, 2.0 ** -4 if storage == "fp8" else 2.0 ** -7])
    one = torch.tensor([1.0, 2.0 ** -4])
    if storage == "fp8":
        w.view(torch.uint8)[0, :32] = 0
        w[0, :2] = one.to(torch.float8_e4m3fn)
    else:
        w[0, :16] = 0
        w[0, 0] = 0x12                                               # e2m1 codes 2 (1.0) low, 1 (0.5) high
    s.view(torch.uint8)[0, 0] = 127
    for rows in ROW_COUNTS:
        xs = torch.cat([x[:rows - 1], x[-1:]])                       # the tie in the last row
        want = quantized_linear(xs, w, s, storage, 72, TORCH)
        assert NATIVE.quantized_linear(xs, w, s, storage, pairs=False) is not None
        assert torch.equal(quantized_linear(xs, w, s, storage, 72, NATIVE), want)
    assert want[-1, 0] == 1.0 and (want[:, 32:64] if storage == "fp8" else want[:, 40]).abs().max() < 1e-30
    assert (want[:, 32:64] if storage == "fp8" else want[:, 40]).abs().max() > 0


@pytest.mark.parametrize("name, old, new", [
    ("bf16.h", "u += 0x7fffu + ((u >> 16) & 1u);", "u += 0x8000u;"),                       # bf16 ties away from zero
    ("blockgemm.c", "(byte ? (uint32_t)byte << 23 : 0x00400000u)", "((uint32_t)byte << 23)"),   # 2^-127 read as 0
])
def test_a_mutated_whole_quantised_linear_is_caught(name, old, new, tmp_path, monkeypatch):
    lib = mutated_library(name, old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    failed = 0
    for storage in ("fp8", "fp4"):
        try:
            test_native_whole_quantised_linear_is_the_torch_path(storage)
        except AssertionError:
            failed += 1
    assert failed > 0


def test_native_attention_products_are_the_float64_einsums(monkeypatch):
    """A block's logits and P·V (bf16-valued operands, as attention.py has them) at decode and prefill
    row counts: the invariant einsums' bits, for more heads than the kernel's rows at once (20 = 8 + 8 + 4)."""
    calls = []
    real, real_kn = native.gemv, native.exact_kn
    monkeypatch.setattr(native, "gemv", lambda *a, **k: calls.append(k["exact"]) or real(*a, **k))
    monkeypatch.setattr(native, "exact_kn", lambda *a: calls.append("kn") or real_kn(*a))
    g = torch.Generator().manual_seed(31)
    for B, T, H in ((1, 1, 8), (2, 2, 20), (4, 1, 3), (1, 37, 8)):
        q = (torch.randn(B, T, H, 128, generator=g) * 8).to(torch.bfloat16).float()
        kv = torch.randn(B, T, 64, 128, generator=g).to(torch.bfloat16).float()
        p = torch.rand(B, T, H, 64, generator=g).to(torch.bfloat16).float()
        assert torch.equal(NATIVE.attention_scores(q, kv), TORCH.attention_scores(q, kv))
        assert torch.equal(NATIVE.attention_values(p, kv), TORCH.attention_values(p, kv))
    assert calls == [True, "kn"] * 4
    q = torch.zeros(5, 1, 8, 128, dtype=torch.float64)                     # not fp32: the einsum
    NATIVE.attention_scores(q, torch.zeros(5, 1, 64, 128, dtype=torch.float64))
    assert len(calls) == 8


def test_a_mutated_value_product_is_caught(tmp_path, monkeypatch):
    """P·V with its partial sums rounded to fp32 at every step: other bits than the float64 einsum."""
    lib = mutated_library("gemv.c", "dst[n] += a * (double)row[n];", "dst[n] = (float)(dst[n] + a * (double)row[n]);",
                          tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_attention_products_are_the_float64_einsums(monkeypatch)


def qdq_inputs(dtype) -> torch.Tensor:
    """[1, 4, 8, 64] values spanning 2⁻⁴⁰…2⁴⁰ (blocks below the amax floors among them), e2m1 and e4m3
    ties after scaling, ±0, ±inf and NaN."""
    g = torch.Generator().manual_seed(41)
    x = torch.randn(1, 4, 8, 64, generator=g) * torch.exp2(torch.randint(-40, 40, (1, 4, 8, 64), generator=g).float())
    x[0, 0, 0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])       # e2m1 midpoints at scale 1
    x[0, 0, 0, 8:32] = 0.0
    x[0, 0, 1, :4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    x[0, 1, 0] = 1e-30
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_qdq_points_are_formats(dtype):
    x = qdq_inputs(dtype)
    for got, want in ((NATIVE.qdq_window(x), formats.fp8_qdq(x, 32)), (NATIVE.qdq_index(x), formats.fp4_qdq_e8m0(x, 32))):
        assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.nan_to_num().view(bits), want.nan_to_num().view(bits))
    assert native.qdq(x, "window") is not None
    assert NATIVE._native_qdq(torch.zeros(1, 65, 32), "window") is None          # a prefill: formats.py's


@pytest.mark.parametrize("old, new", [
    ("(i % 2) ? mag >= midpoint[i] : mag > midpoint[i]", "mag > midpoint[i]"),     # e2m1 ties always down
    ("store_value(out, bf16, r * K + k, e4m3[q[k]] * scale[k / BLOCK]);",
     "store_value(out, bf16, r * K + k, e4m3[q[k]] * scale[0]);"),
])
def test_a_mutated_qdq_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("quantize.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_qdq_points_are_formats(torch.float32)


def topk_inputs() -> torch.Tensor:
    """Rows of many exact ties (small integers, −0 beside +0), ±inf and NaNs of both signs, enough of
    them to split over threads."""
    g = torch.Generator().manual_seed(41)
    scores = torch.randint(-2, 3, (300, 400), generator=g).float()
    scores[0, :50] = float("-inf")
    scores[1] = 0.0
    scores[1, ::2] = -0.0                                                     # one score with +0
    scores[2, ::2] = -0.0
    scores[3, 7], scores[3, 9], scores[3, 11] = float("nan"), -float("nan"), float("inf")
    return scores


@pytest.mark.parametrize("k", [1, 3, 64, 400])
def test_native_topk_is_the_tie_rule(k):
    """topk.py's keys (its own test checks them against a brute force) chosen by a heap in C: the same
    indices in the same order and the same values, through the policy too."""
    from dsv41.model.topk import topk as ordered_topk
    scores = topk_inputs()
    want = ordered_topk(scores, k)
    got = native.topk(scores, k)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    unsorted = NATIVE.topk(scores, k, sorted=False)
    assert torch.equal(unsorted[1].sort(-1).values, want[1].sort(-1).values)
    assert torch.equal(unsorted[0].view(torch.int32), scores.gather(-1, unsorted[1]).view(torch.int32))
    halves = (scores * 1.01).to(torch.bfloat16)                               # bf16 scores, ties kept
    got, want = native.topk(halves, k), ordered_topk(halves, k)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert native.topk(scores.double(), k) is None                            # float64: topk.py's path
    want = ordered_topk(scores, k)
    assert want[1][1].tolist() == list(range(k))                              # ±0 only: the lowest indices


@pytest.mark.parametrize("old, new", [
    ("const float folded = score + 0.0f;", "const float folded = score;"),                   # −0 below +0
    # ties to the higher index:
    ("#define LOW_BITS(index) (0xFFFFFFFFu - (uint32_t)(index))", "#define LOW_BITS(index) ((uint32_t)(index))"),
])
def test_a_mutated_topk_is_caught(old, new, tmp_path, monkeypatch):
    lib = mutated_library("topk.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        test_native_topk_is_the_tie_rule(3)
