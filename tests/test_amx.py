"""bf16 products on AMX tiles (dsv41/model/native/amx.c, docs/NUMERICS.md N37) against formulas.

Past 4 activation rows, `gemv`'s bf16 products and a routed expert's group of rows multiply on the tiles.
Expected: the float64 product within fp32's error bound plus the bf16 rounding of the result, the
routed experts' SwiGLU mixture within bf16's, and the property the tiles give: each output's bits
depend on its own weight row, activation row and K, not on the rows beside it (a row placed among 5 or
among 70 others gives the same fp32 sum; a token's experts give the same output whether each has 6
rows or 12). A stored fp4 expert's rows, decoded block by block as the tiles take them, give the bits of the
same expert held in bf16. A group of at most 8 rows packs its activations in blocks of 8 columns, a
larger one in blocks of 16 (N42): a token's outputs have the same bits either way. A kernel that packs
the activations' pairs in the wrong order, multiplies a stored block other than the one it decoded, or
reads a narrow block at a wide one's stride, must fail the same checks.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.model import native

from test_native import mutated_library
from test_native_fast import experts_formula, product_bound
from test_stored_experts import held_banks, stored_case

pytestmark = pytest.mark.skipif(not (native.available() and native.amx_products()),
                                reason="no AMX bf16 tiles on this CPU: the dot products and torch take these rows")

# (rows N, K): whole tiles read in place, a partial last tile, and K tails of 1 and 8 values past 32
SHAPES = [(48, 256), (17, 33), (40, 40), (100, 1000)]


def fp32_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.empty(1, x.shape[0], w.shape[0], dtype=torch.float32)
    assert native.gemv(x[None], w[None], out)
    return out[0]


def check_products() -> None:
    g = torch.Generator().manual_seed(37)
    for N, K in SHAPES:
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        rows = torch.randn(70, K, generator=g).to(torch.bfloat16)
        for M in (5, 16, 17, 70):
            x = rows[:M]
            got = fp32_product(x, w)
            exact = x.double() @ w.double().t()
            assert ((got.double() - exact).abs() <= product_bound(x[None], w[None])[0]).all(), (N, K, M)
            # the bf16 product is the fp32 one rounded once
            assert torch.equal(native.linear(x, w), got.to(torch.bfloat16)), (N, K, M)
        # row 0 of a 5-row product placed as row 37 of a 70-row one: the same fp32 bits
        among = torch.cat([rows[5:42], rows[:1], rows[42:]])
        assert torch.equal(fp32_product(among, w)[37], fp32_product(rows[:5], w)[0]), (N, K)


def test_amx_products_are_the_product_and_each_rows_bits_stand_alone():
    check_products()


def test_amx_products_read_strided_pairs_in_place():
    g = torch.Generator().manual_seed(38)
    x = torch.randn(9, 3, 64, generator=g).to(torch.bfloat16).transpose(0, 1)        # [P, M, K], strided
    w = torch.randn(3, 30, 80, generator=g).to(torch.bfloat16)[:, :, :64]            # row stride 80
    out = torch.zeros(9, 3, 30, dtype=torch.float32).transpose(0, 1)
    assert native.gemv(x, w, out)
    exact = torch.einsum("pmk,pnk->pmn", x.double(), w.double())
    assert ((out.double() - exact).abs() <= product_bound(x, w)).all()


def expert_rows(n: int, E: int, D: int, I: int, seed: int):
    """n tokens on 3 of E experts each, every expert on 3n/E rows (more than the dot products take)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[t % E, (t + 1) % E, (t + 3) % E] for t in range(n)])
    weights = torch.rand(n, 3, generator=g)
    w1, w3 = (torch.randn(E, I, D, generator=g).div(D ** 0.5).mul(4).to(torch.bfloat16) for _ in range(2))
    w2 = torch.randn(E, D, I, generator=g).div(I ** 0.5).to(torch.bfloat16)
    return x, ids, weights, w1, w3, w2


def check_experts() -> None:
    x, ids, weights, w1, w3, w2 = expert_rows(32, 8, 64, 40, seed=39)              # 12 rows an expert
    out = native.routed_experts(x, ids, weights, w1, w3, w2, 2.0)
    expect = experts_formula(x, ids, weights, w1, w3, w2, 2.0, True)
    assert torch.allclose(out.double(), expect, rtol=2 ** -7, atol=2 ** -7 * expect.abs().max().item())
    # the first 16 tokens alone: 6 rows an expert, the same bits
    half = native.routed_experts(x[:16], ids[:16], weights[:16], w1, w3, w2, 2.0)
    assert torch.equal(half, out[:16])


def test_amx_expert_groups_are_the_swiglu_mixture_whatever_their_size():
    check_experts()


def check_stored_groups() -> None:
    """16 tokens on 4 of 8 experts: 8 rows an expert, so every group multiplies on the tiles, its stored
    rows decoded in registers (every scale in the decode's range) and against the held bank in place."""
    x, ids, weights, stored = stored_case(16, 4, 8, 128, 96, seed=40)
    banks, scales = [q for q, _ in stored], tuple(s for _, s in stored)
    got = native.routed_experts(x, ids, weights, *banks, 6.0, scales=scales, dtype=torch.bfloat16)
    assert torch.equal(got, native.routed_experts(x, ids, weights, *held_banks(stored), 6.0))


def test_amx_stored_expert_groups_are_the_held_banks_bits():
    check_stored_groups()


def check_stored_pairs() -> None:
    """9 tokens on 2 of 8 experts, every expert's group 2, 3 or 4 rows: a stored bank's groups past one row
    multiply on the tiles (N40), a held bank's up to 4 rows by the dot products. Both sums are exact here
    (fp4 values times bf16 activations of one scale), so the two orders give one answer."""
    x, _, weights, stored = stored_case(9, 2, 8, 128, 96, seed=41)
    ids = torch.tensor([[0, 3], [0, 3], [1, 3], [1, 3], [1, 4], [2, 4], [2, 4], [2, 5], [2, 5]])
    banks, scales = [q for q, _ in stored], tuple(s for _, s in stored)
    got = native.routed_experts(x, ids, weights[:, :2], *banks, 6.0, scales=scales, dtype=torch.bfloat16)
    assert torch.equal(got, native.routed_experts(x, ids, weights[:, :2], *held_banks(stored), 6.0))


def test_amx_stored_expert_groups_of_two_to_four_rows_are_the_held_banks_bits():
    check_stored_pairs()


def check_stored_widths() -> None:
    """32 tokens on 4 of 8 experts (16 rows an expert: blocks of 16 columns), then the first 16 of them
    alone (8 rows an expert: blocks of 8): each token's output has the same bits in both calls, and both
    are the held banks' bits."""
    x, ids, weights, stored = stored_case(32, 4, 8, 128, 96, seed=42)
    ids = torch.tensor([[(t + j) % 8 for j in (0, 2, 4, 6)] for t in range(32)])
    banks, scales = [q for q, _ in stored], tuple(s for _, s in stored)
    wide = native.routed_experts(x, ids, weights, *banks, 6.0, scales=scales, dtype=torch.bfloat16)
    narrow = native.routed_experts(x[:16], ids[:16], weights[:16], *banks, 6.0, scales=scales, dtype=torch.bfloat16)
    assert torch.equal(narrow, wide[:16])
    assert torch.equal(wide, native.routed_experts(x, ids, weights, *held_banks(stored), 6.0))


def test_amx_stored_expert_groups_have_the_same_bits_in_narrow_and_wide_blocks():
    check_stored_widths()


@pytest.mark.parametrize("old, new, checks", [
    # a pair's values taken from the pair before it (every odd pair)
    ("row + 2 * q, 2 * sizeof", "row + 2 * (q / 2 * 2), 2 * sizeof", (check_products, check_experts)),
    # the second of a pair of tiles multiplying the first tile's rows (N40)
    ("_tile_loadd(6, w1 + k, w_stride * 2);", "_tile_loadd(6, w + k, w_stride * 2);", (check_products,)),
    # a stored block decoded into the slot the tiles are about to load, not the other one
    # (a stored group of 2 to 4 rows is caught only if it runs on the tiles)
    ("slots[(k / 32 + 1) % 2]", "slots[(k / 32) % 2]", (check_stored_groups, check_stored_pairs)),
    # a block of 8 columns loaded at the stride of 16 (N42)
    ("_tile_loadd(5, bk, columns * 4);", "_tile_loadd(5, bk, 64);", (check_experts, check_stored_widths)),
])
def test_a_mutated_amx_kernel_is_caught(old, new, checks, tmp_path, monkeypatch):
    lib = mutated_library("amx.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    for check in checks:
        with pytest.raises(AssertionError):
            check()


def test_narrow_sums_put_at_a_wide_blocks_places_are_caught(tmp_path, monkeypatch):
    lib = mutated_library("gemv.c", "* columns + k % columns]", "* AMX_ROWS + k % columns]", tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    for check in (check_experts, check_stored_widths):
        with pytest.raises(AssertionError):
            check()


def test_the_heads_rows_past_four_multiply_on_the_tiles(monkeypatch):
    """Fast bf16 logits of more than 4 rows (a batch's decode step) take the tiles, bf16 by bf16 into fp32
    sums: the float64 product within fp32's error, each row's bits its own whatever the batch beside
    it; 4 rows still widen to fp32 as they are read (the decode-step product)."""
    from test_native_fast import FAST_NATIVE
    g = torch.Generator().manual_seed(39)
    w = torch.randn(300, 96, generator=g).to(torch.bfloat16)
    x = torch.randn(16, 96, generator=g).to(torch.bfloat16)
    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda *a, **k: calls.append((a[0].dtype, a[0].shape[0])) or real(*a, **k))
    got = {n: FAST_NATIVE.head_logits(x[:n], w) for n in (4, 5, 16)}
    assert calls == [(torch.float32, 4), (torch.bfloat16, 5), (torch.bfloat16, 16)]
    for n, logits in got.items():
        assert logits.dtype == torch.float32
        exact = x[:n].double() @ w.double().t()
        assert ((logits.double() - exact).abs() <= product_bound(x[None, :n], w[None])[0]).all(), n
    assert torch.equal(got[16][:5], got[5])
