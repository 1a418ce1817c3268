"""Engram module: the per-stream gate against the seed formula, the module against a slow dense
float64 version, and the released shapes (docs/ARCHITECTURE.md §9, trap 18)."""

import math

import pytest
import torch

from dsv41.model import formats
from dsv41.config import ModelConfig
from helpers import RELEASED_CONFIG
from dsv41.model.engram import Engram, stream_gate
from dsv41.model.numerics import REFERENCE

RELEASE = RELEASED_CONFIG  # ../shared/spec/config.json (DEVELOPING.md)
EPS = 1e-20


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_json(RELEASE)


def seed_gate(x, key, w, dim_root=None):
    """The seed document's "Gate per stream" (docs/PARAMETERS.md §7), one stream at a time with Python floats:
    a = Σ_f X·w·k / (rms(X)·rms(k)·√D), g = σ(sign(a)·√max(|a|, 1e-6)), sign as the IEEE sign bit."""
    D = len(x)
    rms_x = math.sqrt(sum(v * v for v in x) / D + EPS)
    rms_k = math.sqrt(sum(v * v for v in key) / D + EPS)
    a = sum(xf * wf * kf for xf, wf, kf in zip(x, w, key)) / (rms_x * rms_k * (dim_root or math.sqrt(D)))
    s = math.copysign(math.sqrt(max(abs(a), 1e-6)), a)
    return 1.0 / (1.0 + math.exp(-s))


def check_gate(B, T, S, D, gen, dim_root=None):
    x = torch.randn(B, T, S, D, generator=gen)
    key = torch.randn(B, T, S, D, generator=gen) * 3
    w = torch.randn(S, D, generator=gen).abs() + 0.5
    x[0, 0, 1] = x[0, 0, 1] * 1e-12  # tiny stream: eps 1e-20 must not swamp its rms
    key[-1, -1, 0] = 0.0  # zero key: a = +0
    got = stream_gate(x, key, w, EPS, REFERENCE)
    assert got.shape == (B, T, S) and got.dtype == torch.float32
    for b in range(B):
        for t in range(T):
            for k in range(S):
                want = seed_gate(x[b, t, k].tolist(), key[b, t, k].tolist(), w[k].tolist(), dim_root)
                assert got[b, t, k].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    return got


def test_gate_matches_seed_formula():
    got = check_gate(2, 3, 4, 64, torch.Generator().manual_seed(0))
    # Copysign semantics: a dot product of exactly +0 gives σ(+0.001), not σ(0) = 0.5.
    assert got[-1, -1, 0].item() == pytest.approx(1 / (1 + math.exp(-1e-3)), rel=1e-6)
    assert got[-1, -1, 0].item() > 0.5


def test_gate_matches_seed_formula_at_released_width():
    # D = 5120 and 4 streams, with the seed's literal √5120.
    check_gate(1, 1, 4, 5120, torch.Generator().manual_seed(1), dim_root=math.sqrt(5120))


def test_gate_clamp_and_sign():
    x = torch.ones(1, 1, 2, 32)
    key = torch.ones(1, 1, 2, 32)
    w = torch.tensor([[1e-9] * 32, [-1e-9] * 32])  # |a| = 1e-9 < 1e-6: clamped, sign kept
    got = stream_gate(x, key, w, EPS, REFERENCE)[0, 0]
    assert got[0].item() == pytest.approx(1 / (1 + math.exp(-1e-3)), rel=1e-6)
    assert got[1].item() == pytest.approx(1 / (1 + math.exp(1e-3)), rel=1e-6)


# ---------------------------------------------------------------- module vs slow dense ----------


def small_config(cfg):
    return cfg.replace(dim=64, hc_mult=4, engram_head_dim=64, engram_n_heads=2, engram_max_ngram_size=3,
                       engram_num_embeddings=(53, 71))


def randomise(module: Engram, gen: torch.Generator) -> None:
    rows, De = module.embed.weight.shape
    module.embed.weight.data.copy_((torch.randn(rows, De, generator=gen) * 20).to(torch.float8_e4m3fn))
    scale = torch.randint(118, 130, (rows, De // 32), dtype=torch.uint8, generator=gen)
    module.embed.scale.data.copy_(scale.view(torch.float8_e8m0fnu))
    w = torch.randn(module.wkv.out_features, module.wkv.in_features, generator=gen) * 0.05
    qw, qs = formats.quantize_fp8_weight(w)
    module.wkv.weight.data.copy_(qw)
    module.wkv.scale.data.copy_(qs)
    module.q_weight.data.copy_(torch.randn(module.q_weight.shape, generator=gen).to(torch.bfloat16))
    module.k_weight.data.copy_(torch.randn(module.k_weight.shape, generator=gen).to(torch.bfloat16))


def e8m0_f64(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.view(torch.uint8).to(torch.float64) - 127)


def dense_engram(module: Engram, x, ids, mask):
    """§9 steps 1-7 with the whole table and `wkv` dequantised; math in float64."""
    S, D, De = module.streams, module.dim, module.head_dim
    table = module.embed.weight.to(torch.float64) * e8m0_f64(module.embed.scale).repeat_interleave(32, -1)
    rows = table[ids].to(torch.bfloat16).flatten(-2)  # [B, T, N·De]: column c at De·c ... (step 1)
    w_blocks = e8m0_f64(module.wkv.scale).repeat_interleave(32, 0).repeat_interleave(32, 1)
    wkv = module.wkv.weight.to(torch.float64) * w_blocks
    act = formats.fp8_qdq(rows.float()).to(torch.float64)  # fp8 activation quantisation (§6.3)
    kv = (act @ wkv.T).to(torch.bfloat16).to(torch.float64)  # step 2, bf16 Linear output
    key, value = kv[..., : S * D].reshape(*kv.shape[:-1], S, D), kv[..., S * D:]
    w = module.q_weight.to(torch.float64) * module.k_weight.to(torch.float64)
    h = x.to(torch.float64)
    rms = lambda v: torch.sqrt(v.square().mean(-1) + EPS)  # noqa: E731
    a = (h * w * key).sum(-1) / (rms(h) * rms(key) * math.sqrt(D))
    g = torch.sigmoid(torch.copysign(a.abs().clamp_min(1e-6).sqrt(), a))
    g = torch.where(mask[..., None], g, torch.zeros_like(g))
    return rows, h + g[..., None] * value[..., None, :]


def test_module_matches_dense_version(cfg):
    small = small_config(cfg)
    gen = torch.Generator().manual_seed(3)
    module = Engram(small, 1, REFERENCE)
    randomise(module, gen)
    B, T, S, D, N = 2, 5, 4, 64, 4
    assert module.n_columns == N and module.embed.weight.shape == (71, 64)
    x = (torch.randn(B, T, S, D, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.randint(0, 71, (B, T, N), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2] = False
    rows_ref, out_ref = dense_engram(module, x, ids, mask)
    rows = module.gather(ids, "cpu")
    assert rows.shape == (B, T, N * 64) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, rows_ref)
    out = module(x, rows, mask)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.to(torch.float64), out_ref, rtol=2**-7, atol=1e-2)
    assert torch.equal(out[1, 2], x[1, 2])  # image position: gate zero, stream untouched
    assert not torch.equal(out[0, 0], x[0, 0])
    # The value is shared by all streams, the gate differs per stream.
    delta = out.float() - x.float()
    assert (delta[0, 0, 0] - delta[0, 0, 1]).abs().max() > 0


def test_no_mask_equals_all_text(cfg):
    gen = torch.Generator().manual_seed(4)
    module = Engram(small_config(cfg), 0, REFERENCE)
    randomise(module, gen)
    x = torch.randn(1, 3, 4, 64, generator=gen).to(torch.bfloat16)
    rows = module.gather(torch.randint(0, 53, (1, 3, 4), generator=gen))
    assert torch.equal(module(x, rows), module(x, rows, torch.ones(1, 3, dtype=torch.bool)))


def test_gather_checks_columns(cfg):
    module = Engram(small_config(cfg), 0, REFERENCE)
    with pytest.raises(ValueError, match="4 hash columns"):
        module.gather(torch.zeros(1, 1, 24, dtype=torch.int64))


def test_released_shapes_and_gate_parameter_count(cfg):
    module = Engram(cfg, 0, REFERENCE, device="meta")
    gate_params = module.q_weight.numel() + module.k_weight.numel()
    assert gate_params == 40_960
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    assert shapes == {
        "embed.weight": ((384006168, 256), torch.float8_e4m3fn),
        "embed.scale": ((384006168, 8), torch.float8_e8m0fnu),
        "wkv.weight": ((25600, 6144), torch.float8_e4m3fn),
        "wkv.scale": ((800, 192), torch.float8_e8m0fnu),
        "q_weight": ((4, 5120), torch.bfloat16),
        "k_weight": ((4, 5120), torch.bfloat16),
    }
    assert Engram(cfg, 1, REFERENCE, device="meta").embed.weight.shape[0] == 384016682
