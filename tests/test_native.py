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
from dsv41.model.numerics import NATIVE_MAX_ROWS, Numerics

TORCH, NATIVE = Numerics("reference", "invariant"), Numerics("reference", "invariant", native=True)

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
    x = wide_activations(NATIVE_MAX_ROWS, 512, seed=2)
    q, q_scale = formats.fp8_act_quant(x.float())
    rows_scale = block_scales(s, storage, 72)
    expect = TORCH.block_scaled_matmul(q, q_scale, w, rows_scale, storage)
    for rows in range(1, NATIVE_MAX_ROWS + 1):
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
    assert not Numerics.for_device("fast", None, "cpu").native
    assert not Numerics.for_device("reference", None, "meta").native
    for mode, kernels in (("reference", "blas"), ("fast", "blas"), ("fast", "invariant")):
        with pytest.raises(ConfigError, match="native"):
            Numerics(mode, kernels, native=True)


def test_a_failed_build_raises_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    target = tmp_path / "blockgemm.so"
    with pytest.raises(Exception):
        native.build(target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("storage, old, new", [
    ("fp4", "* 0x1p-10f", "* 0x1p-9f"),
    ("fp8", "double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;", "float s0 = 0, s1 = 0, s2 = 0, s3 = 0;"),
])
def test_a_mutated_kernel_fails_the_comparison(storage, old, new, tmp_path, monkeypatch):
    """Mutation: the same comparison against a kernel built from a broken copy of the source."""
    source = native.SOURCE.read_text()
    assert old in source
    mutated = tmp_path / "blockgemm.c"
    mutated.write_text(source.replace(old, new))
    monkeypatch.setattr(native, "SOURCE", mutated)
    target = tmp_path / "mutated.so"
    native.build(target)
    lib = native.load(target)
    w, s = every_code_weight(storage, 72, 512, seed=1)
    q, q_scale = formats.fp8_act_quant(wide_activations(1, 512, seed=2).float())
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
    source = native.SOURCE.read_text()
    assert old in source
    mutated = tmp_path / "blockgemm.c"
    mutated.write_text(source.replace(old, new))
    monkeypatch.setattr(native, "SOURCE", mutated)
    native.build(tmp_path / "mutated.so")
    lib = native.load(tmp_path / "mutated.so")
    monkeypatch.setattr(native, "_library", lambda: lib)
    x = act_quant_inputs()
    assert not same_quantisation(native.fp8_act_quant(x), formats.fp8_act_quant(x))


def test_scales_are_taken_per_output_row():
    """The fp8 32 × 32 scale tiles reach the kernel as one scale per output row and K block."""
    _, s = every_code_weight("fp8", 72, 512, seed=1)
    rows = block_scales(s, "fp8", 72)
    assert rows.shape == (72, 16) and torch.equal(rows[33], formats.e8m0_to_float(s)[1])
