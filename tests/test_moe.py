"""MoE against slow formulas (docs/ARCHITECTURE.md §13, traps 16–17): the router, SwiGLU clamps, and the whole
layer (grouped and gathered expert paths) against a per-expert Python loop written here."""

import math

import pytest
import torch

from dsv41.config import ConfigError
from dsv41.model import formats, gpu_kernels, native
from dsv41.model.init import init_random_
from dsv41.model.moe import MoE, route, swiglu
from dsv41.model.numerics import FAST, Numerics

E, A, D, F_ = 8, 2, 64, 32
LIMIT = 1.0          # a small clamp so both SwiGLU clamps are active with random weights


# ------------------------------------------------------------------------------------------ router

def route_by_formula(x, weight, bias, topk, route_scale, bias_vl=None, image_mask=None):
    """Slow §13 router in float64, one token at a time."""
    n = x.shape[0]
    logits = x.double() @ weight.double().t()
    scores = torch.sqrt(torch.log1p(torch.exp(logits)))              # √softplus
    out_w, out_ids = [], []
    for t in range(n):
        b = bias_vl if (image_mask is not None and bool(image_mask[t])) else bias
        biased = [(scores[t, e].item() + b[e].item(), e) for e in range(weight.shape[0])]
        chosen = [e for _, e in sorted(biased, reverse=True)[:topk]]
        raw = [scores[t, e].item() for e in chosen]
        # the reference normalises only when more than one expert is chosen (norm_topk_prob and topk > 1)
        total = sum(raw) + 1e-20 if topk > 1 else 1.0
        out_w.append([r / total * route_scale for r in raw])
        out_ids.append(chosen)
    return torch.tensor(out_w, dtype=torch.float64), torch.tensor(out_ids)


def sort_pairs(w, ids):
    order = ids.argsort(dim=-1)
    return w.gather(-1, order), ids.gather(-1, order)


@pytest.fixture(scope="module")
def router_inputs():
    g = torch.Generator().manual_seed(20)
    x = torch.randn(12, D, generator=g).to(torch.bfloat16)
    weight = (torch.randn(E, D, generator=g) / 8).to(torch.bfloat16)
    bias = torch.randn(E, generator=g) * 0.3
    bias_vl = torch.randn(E, generator=g) * 0.3
    image_mask = torch.arange(12) % 3 == 0
    return x, weight, bias, bias_vl, image_mask


@pytest.mark.parametrize("topk", [1, 2, 3])
def test_route_against_formula(router_inputs, topk):
    x, weight, bias, bias_vl, image_mask = router_inputs
    w, ids = route(x, weight, bias, topk, 1.5, numerics=FAST, bias_vl=bias_vl, image_mask=image_mask)
    assert w.dtype == torch.float32
    w_ref, ids_ref = route_by_formula(x, weight, bias, topk, 1.5, bias_vl, image_mask)
    w, ids = sort_pairs(w, ids)
    w_ref, ids_ref = sort_pairs(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-6, atol=1e-7)
    if topk > 1:
        torch.testing.assert_close(w.sum(-1).double(), torch.full((12,), 1.5, dtype=torch.float64))


def test_bias_selects_but_never_scales(router_inputs):
    x, weight, _, _, _ = router_inputs
    bias = torch.zeros(E)
    bias[5] = 100.0                                                  # expert 5 always chosen
    w, ids = route(x, weight, bias, 2, 1.0, numerics=FAST)
    assert (ids == 5).any(-1).all()
    scores = torch.sqrt(torch.nn.functional.softplus(x.float() @ weight.float().t()))
    raw = scores.gather(1, ids)
    torch.testing.assert_close(w, raw / (raw.sum(-1, keepdim=True) + 1e-20))


def test_bias_vl_only_on_image_tokens(router_inputs):
    x, weight, bias, _, _ = router_inputs
    bias_vl = torch.zeros(E)
    bias_vl[7] = 100.0
    mask = torch.zeros(12, dtype=torch.bool)
    mask[[1, 4]] = True
    _, ids = route(x, weight, bias, 2, 1.0, numerics=FAST, bias_vl=bias_vl, image_mask=mask)
    assert (ids[mask] == 7).any(-1).all()
    _, ids_text = route(x, weight, bias, 2, 1.0, numerics=FAST)
    assert torch.equal(ids[~mask], ids_text[~mask])


# ------------------------------------------------------------------------------------------ SwiGLU

def test_swiglu_clamps_are_asymmetric():
    gate = torch.tensor([-30.0, -12.0, 0.5, 12.0, 30.0])
    up = torch.tensor([-30.0, 3.0, -12.0, 12.0, 1.0])
    got = swiglu(gate, up, 10.0, FAST)

    def silu(v):
        return v / (1 + math.exp(-v))
    # gate clamped from above only (≤ 10); up clamped to ±10
    expect = [silu(-30.0) * -10.0, silu(-12.0) * 3.0, silu(0.5) * -10.0, silu(10.0) * 10.0, silu(10.0) * 1.0]
    torch.testing.assert_close(got, torch.tensor(expect), rtol=1e-6, atol=1e-12)
    assert got.dtype == torch.float32
    # with limit 0 nothing is clamped
    torch.testing.assert_close(swiglu(gate, up, 0.0, FAST), torch.nn.functional.silu(gate) * up)


# ------------------------------------------------------------------------------------------ the layer

def make_moe(numerics):
    dtype = torch.float32 if numerics == "fast" else torch.bfloat16
    moe = MoE(D, F_, E, A, 1.5, LIMIT, "fp4", vision=True, numerics=Numerics.default(numerics), dtype=dtype)
    return init_random_(moe, 21), dtype


def expert_matrix(bank, e):
    """Logical [out, in] fp32 weight of expert e, dequantised here from the stored bytes."""
    if bank.scale is None:
        return bank.weight[e].float()
    return formats.dequantize_fp4_weight(bank.weight[e], bank.scale[e])


def dense_matrix(linear):
    if linear.scale is None:
        return linear.weight.float()
    return formats.dequantize_fp8_weight(linear.weight, linear.scale)


def ffn_oracle(x_row, w1, w3, w2, weight, quantised):
    """One SwiGLU FFN on one token: [D] → [D] fp32 (bf16-valued in reference numerics)."""
    if quantised:
        xa = formats.fp8_qdq(x_row.float())                          # activation QDQ (§6.3)
        g = (xa @ w1.t()).to(torch.bfloat16).float()                   # Linear outputs are bf16
        u = (xa @ w3.t()).to(torch.bfloat16).float()
    else:
        g, u = x_row.float() @ w1.t(), x_row.float() @ w3.t()
    u = u.clamp(-LIMIT, LIMIT)
    g = g.clamp(max=LIMIT)
    h = g / (1 + torch.exp(-g)) * u * weight                             # weight before w2 (trap 17)
    if quantised:
        h = formats.fp8_qdq(h.to(torch.bfloat16).float())
        return (h @ w2.t()).to(torch.bfloat16).float()
    return h @ w2.t()


def moe_oracle(moe, x, image_mask, quantised):
    flat = x.flatten(0, 1)
    mask = None if image_mask is None else image_mask.flatten()
    weights, ids = route_by_formula(flat.float(), moe.gate.weight, moe.gate.bias, A, 1.5, moe.gate.bias_vl, mask)
    y = torch.zeros(flat.shape[0], D, dtype=torch.float32)
    experts = moe.experts
    for e in range(E):
        w1, w3, w2 = expert_matrix(experts.w1, e), expert_matrix(experts.w3, e), expert_matrix(experts.w2, e)
        for t in range(flat.shape[0]):
            for a in range(A):
                if int(ids[t, a]) == e:
                    y[t] += ffn_oracle(flat[t], w1, w3, w2, float(weights[t, a]), quantised)   # fp32 sum
    sh = moe.shared_experts
    for t in range(flat.shape[0]):
        y[t] += ffn_oracle(flat[t], dense_matrix(sh.w1), dense_matrix(sh.w3), dense_matrix(sh.w2), 1.0, quantised)
    return y.to(x.dtype).view_as(x)


@pytest.mark.parametrize("storage", ["fp4", "fp8"])
def test_decode_pairs_at_once_equal_the_expert_loop_bit_for_bit(storage, monkeypatch):
    """Reference numerics with invariant kernels: a one-token call runs its pairs as one batched GEMM per
    projection (the per-expert loop is not called), and each token's output equals its row of a
    16-token call, which runs the per-expert loop."""
    moe = init_random_(MoE(D, F_, E, A, 1.5, LIMIT, storage, vision=False, numerics=Numerics.default("reference")), 22)
    x = torch.randn(1, 16, D, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    together = moe(x)
    loop = moe.experts._per_expert

    def refused(*args):
        raise AssertionError("a one-token call ran the per-expert loop")

    monkeypatch.setattr(moe.experts, "_per_expert", refused)
    for t in range(16):
        assert torch.equal(moe(x[:, t:t + 1]), together[:, t:t + 1])
    monkeypatch.setattr(moe.experts, "_per_expert", loop)
    assert not Numerics("reference", "blas").pairs_at_once(storage)         # BLAS sums follow the call shape
    assert not Numerics.default("reference").pairs_at_once("bf16")          # float64 sums of bf16: not exact


@pytest.mark.parametrize("tokens", [3, 16], ids=["gathered", "grouped"])
def test_moe_fast_float32_against_loop(tokens):
    moe, dtype = make_moe("fast")
    x = torch.randn(1, tokens, D, generator=torch.Generator().manual_seed(tokens))
    mask = torch.arange(tokens).view(1, -1) % 4 == 1
    got = moe(x, mask)
    assert got.dtype == torch.float32
    expect = moe_oracle(moe, x, mask, quantised=False)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [3, 16], ids=["gathered", "grouped"])
def test_moe_reference_numerics_against_loop(tokens):
    moe, dtype = make_moe("reference")
    assert moe.experts.w1.weight.dtype == torch.int8 and moe.experts.w1.scale.dtype == torch.float8_e8m0fnu
    x = torch.randn(2, tokens, D, generator=torch.Generator().manual_seed(100 + tokens)).to(torch.bfloat16)
    got = moe(x)
    assert got.dtype == torch.bfloat16
    expect = moe_oracle(moe, x, None, quantised=True)
    # Both round at the same points, so they agree bit for bit here (measured: 0 differing elements).
    # A GEMM summing in another order could move an intermediate by one bf16 ulp, so allow up to 1% of
    # elements to differ by one output ulp. Moving the routing weight after w2, or clamping the gate
    # from below too, changes > 90% of the elements by up to 0.08 on this data.
    scale = expect.float().abs().max().item()
    diff = (got.float() - expect.float()).abs()
    assert (diff > 0).float().mean() <= 0.01
    assert diff.max() <= scale * 2 ** -8


def test_grouped_expert_gemm_against_the_loop_and_the_oracle():
    """The accelerator path (torch's grouped GEMM with device-side offsets, no host sync) run on the CPU,
    at a decode-sized call (fewer pairs than experts, empty groups) and a prefill-sized one."""
    moe, _ = make_moe("fast")
    grouped = MoE(D, F_, E, A, 1.5, LIMIT, "fp4", vision=True, numerics=Numerics("fast", "blas", "grouped"),
                  dtype=torch.float32)
    grouped.load_state_dict(moe.state_dict())
    assert grouped.experts.numerics.grouped_experts and not moe.experts.numerics.grouped_experts
    for n, seed in ((1, 7), (16, 8)):
        x = torch.randn(1, n, D, generator=torch.Generator().manual_seed(seed))
        want = moe_oracle(moe, x, None, quantised=False)
        torch.testing.assert_close(grouped(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


def test_the_expert_kernel_follows_the_device_and_numerics():
    triton = gpu_kernels.available()
    assert Numerics.for_device("fast", None, "cuda") == Numerics("fast", "blas", "grouped", triton=triton)
    assert Numerics.for_device("fast", None, "cuda", "float32").experts == "loop"     # grouped kernels take bf16
    assert not Numerics.for_device("fast", None, "mps").triton
    assert Numerics.for_device("reference", None, "cuda") == Numerics("reference", "invariant")
    with pytest.raises(ConfigError, match="Triton kernels sum in their own order"):
        Numerics("reference", "invariant", triton=True)
    assert Numerics.for_device("fast", None, "cpu") == Numerics("fast", "blas", "loop", cpu_kernels=True,
                                                               native=native.available())
    assert not Numerics.for_device("fast", "invariant", "cpu").cpu_kernels          # they sum in their own order
    assert not Numerics.for_device("reference", "blas", "cpu").cpu_kernels         # the reference's bits
    assert not Numerics.for_device("fast", None, "meta").cpu_kernels
    assert Numerics.for_device("fast", "invariant", "cuda").experts == "loop"      # grouping sums in its own order
    assert Numerics.for_device("reference", None, "cuda:0").experts == "loop"
    for mode, kernels in (("reference", "blas"), ("fast", "invariant")):
        with pytest.raises(ConfigError, match="grouped expert GEMM needs fast numerics with BLAS"):
            Numerics(mode, kernels, "grouped")
        with pytest.raises(ConfigError, match="CPU kernels sum in their own order"):
            Numerics(mode, kernels, cpu_kernels=True)
