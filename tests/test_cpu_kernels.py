"""The CPU kernel choices of fast numerics (numerics.py `cpu_kernels`) and the decode-step op savings
that come with them (the in-place expert loop, RoPE phases once per forward), each against an
independent formula or the path it replaces."""

import math
import warnings

import pytest
import torch

from dsv41.model import hyper
from dsv41.model.init import init_random_
from dsv41.model.moe import RoutedExperts
from dsv41.model.numerics import FAST, Numerics
from dsv41.model.rope import Rotary
from dsv41.model.step import Handoff, Step

CPU = Numerics("fast", "blas", cpu_kernels=True)


def sinkhorn_float64(c: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    """§7.4 on one matrix of Python floats: row softmax + eps, a column step, then (row, column) steps."""
    S = len(c)
    c = [[math.exp(v - max(row)) for v in row] for row in c]
    c = [[v / sum(row) + eps for v in row] for row in c]

    def columns(c):
        sums = [sum(c[i][j] for i in range(S)) for j in range(S)]
        return [[c[i][j] / (sums[j] + eps) for j in range(S)] for i in range(S)]

    c = columns(c)
    for _ in range(iters - 1):
        c = columns([[v / (sum(row) + eps) for v in row] for row in c])
    return c


# ------------------------------------------------------------------------------------------ Sinkhorn

@pytest.mark.parametrize("iters", [1, 20])
def test_host_sinkhorn_matches_the_formula(iters, monkeypatch):
    calls = []
    host = hyper._host_sinkhorn
    monkeypatch.setattr(hyper, "_host_sinkhorn", lambda *a: calls.append(1) or host(*a))
    logits = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(1)) * 3
    got = hyper.sinkhorn(logits, iters, 1e-6, CPU)
    assert calls and got.dtype == torch.float32 and got.shape == logits.shape
    for b in range(3):
        expect = torch.tensor(sinkhorn_float64(logits[b, 0].double().tolist(), iters, 1e-6), dtype=torch.float64)
        torch.testing.assert_close(got[b, 0].double(), expect, rtol=0, atol=3e-7)
    # against the torch steps of the same policy without the CPU kernels: the same fp32 math
    torch.testing.assert_close(got, hyper.sinkhorn(logits, iters, 1e-6, FAST), rtol=0, atol=3e-7)


def test_host_sinkhorn_keeps_float64():
    logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = hyper.sinkhorn(logits, 20, 1e-6, CPU)
    assert got.dtype == torch.float64
    for b in range(2):
        expect = torch.tensor(sinkhorn_float64(logits[b].tolist(), 20, 1e-6), dtype=torch.float64)
        torch.testing.assert_close(got[b], expect, rtol=1e-12, atol=1e-14)


def test_host_sinkhorn_only_for_few_rows_outside_autograd(monkeypatch):
    def refused(*a):
        raise AssertionError("the host kernel ran")

    monkeypatch.setattr(hyper, "_host_sinkhorn", refused)
    many = torch.randn(hyper.INNERMOST_FROM, 4, 4)
    hyper.sinkhorn(many, 20, 1e-6, CPU)                              # the positions-innermost torch steps
    few = torch.randn(2, 4, 4, requires_grad=True)
    hyper.sinkhorn(few, 20, 1e-6, CPU).sum().backward()              # training keeps its backward
    assert few.grad is not None
    hyper.sinkhorn(few.detach(), 20, 1e-6, FAST)                     # the policy decides
    with pytest.raises(AssertionError, match="host kernel ran"):
        hyper.sinkhorn(few.detach(), 20, 1e-6, CPU)


def test_host_mixes_match_the_formula_without_overflow():
    g = torch.Generator().manual_seed(7)
    s = 4
    m = torch.randn(3, 1, (2 + s) * s, generator=g) * 2
    m[0, 0, :2 * s] = torch.tensor([300.0, -300.0] * s)               # σ saturates; exp(−z) would overflow
    scale, base = torch.tensor([0.7, 1.3, 0.9]), torch.randn((2 + s) * s, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre, post, comb = hyper.split_mixes(m, scale, base, s, 20, 1e-6, CPU)
    z = m.double() * torch.repeat_interleave(scale.double(), torch.tensor([s, s, s * s])) + base.double()
    torch.testing.assert_close(pre.double(), torch.sigmoid(z[..., :s]) + 1e-6, rtol=0, atol=2e-7)
    torch.testing.assert_close(post.double(), 2 * torch.sigmoid(z[..., s:2 * s]), rtol=0, atol=4e-7)
    for b in range(3):
        expect = sinkhorn_float64(z[b, 0, 2 * s:].view(s, s).tolist(), 20, 1e-6)
        torch.testing.assert_close(comb[b, 0].double(), torch.tensor(expect, dtype=torch.float64), rtol=0, atol=3e-7)
    for got, want in zip((pre, post, comb), hyper.split_mixes(m, scale, base, s, 20, 1e-6, FAST)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=4e-7)


# ------------------------------------------------------------------------------------------ index scores

def test_activation_einsum_is_fp32_math_rounded_once():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 64, generator=g).bfloat16()
    keys = torch.randn(1, 67, 64, generator=g).bfloat16()
    got = CPU.activation_einsum("bthd,bcd->bthc", q, keys)
    assert got.dtype == torch.bfloat16
    # bf16 products are exact in float64; the fp32 sum is within one fp32 rounding of the float64 one,
    # far below a bf16 ulp, so the rounded result matches the float64 formula rounded to bf16 except at
    # a rounding boundary
    expect = torch.einsum("bthd,bcd->bthc", q.double(), keys.double())
    assert (got.double() - expect).abs().max() <= expect.abs().max() * 2 ** -8
    assert torch.equal(got, torch.einsum("bthd,bcd->bthc", q.float(), keys.float()).bfloat16())
    # other policies take `einsum` unchanged
    assert torch.equal(FAST.activation_einsum("bthd,bcd->bthc", q, keys), torch.einsum("bthd,bcd->bthc", q, keys))
    f32 = q.float()
    assert torch.equal(CPU.activation_einsum("bthd,bcd->bthc", f32, keys.float()),
                       torch.einsum("bthd,bcd->bthc", f32, keys.float()))


# ------------------------------------------------------------------------------------------ expert loop

def experts_by_formula(bank: RoutedExperts, x, weights, ids, limit):
    """Σ over a token's pairs of w · SwiGLU expert outputs, one pair at a time, in float64."""
    out = torch.zeros(x.shape[0], bank.w2.out_features, dtype=torch.float64)
    for t in range(x.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            if e < 0:
                continue
            g = x[t].double() @ bank.w1.weight[e].double().t()
            u = (x[t].double() @ bank.w3.weight[e].double().t()).clamp(-limit, limit)
            g = g.clamp(max=limit)
            out[t] += (g * torch.sigmoid(g) * u * float(weights[t, a])) @ bank.w2.weight[e].double().t()
    return out


@pytest.mark.parametrize("kernels", ["blas", "invariant"])
@pytest.mark.parametrize("partial", [False, True], ids=["all experts", "expert-parallel"])
def test_the_in_place_expert_loop_equals_the_loop_it_replaces(kernels, partial, monkeypatch):
    numerics = Numerics("fast", kernels)
    bank = init_random_(RoutedExperts(32, 64, 32, "fp4", 1.0, numerics=numerics, partial=partial), 4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(32, generator=g)[:3] for _ in range(5)])
    if partial:
        ids[ids >= 24] = -1                                           # pairs another rank owns
    weights = torch.rand(5, 3, generator=g)
    monkeypatch.setattr(bank, "_padded", lambda *a: pytest.fail("few busy experts ran padded"))
    with torch.no_grad():
        held = bank(x, weights, ids)                                 # in place: autograd records nothing
    bank.w1.weight.requires_grad_(True)
    with torch.enable_grad():
        recorded = bank(x, weights, ids)                             # the per-expert loop, with a backward
    assert recorded.requires_grad
    assert torch.equal(held, recorded.detach())
    expect = experts_by_formula(bank, x, weights, ids, 1.0)
    torch.testing.assert_close(held.double(), expect, rtol=0, atol=expect.abs().max().item() * 2 ** -7)


@pytest.mark.parametrize("partial", [False, True], ids=["all experts", "expert-parallel"])
def test_a_busy_bank_runs_padded_and_equals_the_loop(partial, monkeypatch):
    bank = init_random_(RoutedExperts(8, 64, 32, "fp4", 1.0, numerics=Numerics("fast", "blas"), partial=partial), 8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(16, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])   # 32 pairs, every expert busy
    if partial:
        ids[ids >= 6] = -1
    weights = torch.rand(16, 2, generator=g)

    def refused(*a):
        raise AssertionError("the per-expert loop ran")

    monkeypatch.setattr(bank, "_held", refused)
    with torch.no_grad():
        padded = bank(x, weights, ids)
    monkeypatch.undo()
    bank.w1.weight.requires_grad_(True)
    with torch.enable_grad():
        loop = bank(x, weights, ids).detach()
    torch.testing.assert_close(padded, loop, rtol=2 ** -7, atol=1e-6)
    expect = experts_by_formula(bank, x, weights, ids, 1.0)
    torch.testing.assert_close(padded.double(), expect, rtol=0, atol=expect.abs().max().item() * 2 ** -7)
    # a rank that owns none of the pairs gives zeros, held or not
    for grad in (False, True) if partial else ():
        with torch.set_grad_enabled(grad):
            assert torch.equal(bank(x[:1], weights[:1], torch.tensor([[-1, -1]])), torch.zeros(1, 64))
    # one token's six pairs of a 32-expert bank stay in the loop: padding would read 32 experts for 6
    few = init_random_(RoutedExperts(32, 64, 32, "fp4", 1.0, numerics=Numerics("fast", "blas")), 10)
    monkeypatch.setattr(few, "_padded", lambda *a: refused())
    with torch.no_grad():
        few(x[:1], torch.rand(1, 6, generator=g), torch.randperm(32, generator=g)[:6].view(1, 6))


# ------------------------------------------------------------------------------------------ RoPE phases

def test_a_forward_computes_each_tables_phases_once():
    freqs = torch.tensor([1.0, 0.5, 0.25, 0.125])
    a, b, other = Rotary(8, freqs), Rotary(8, freqs.clone()), Rotary(8, freqs / 3)
    step = Step((0, 1), (5, 9), (2, 1))
    handoff = Handoff()
    shared = handoff.step_phases(a, step)
    assert handoff.step_phases(b, step) is shared                    # equal tables share one computation
    assert handoff.step_phases(other, step) is not shared
    expect = torch.polar(torch.ones(3, 4), torch.tensor([5.0, 6.0, 9.0]).unsqueeze(-1) * freqs)
    assert torch.equal(shared, expect)
    x = torch.randn(1, 3, 2, 16, generator=torch.Generator().manual_seed(6)).bfloat16()
    for inverse in (False, True):
        assert torch.equal(a.rotate(x, step.positions, inverse=inverse, phases=shared),
                           a.rotate(x, step.positions, inverse=inverse))
