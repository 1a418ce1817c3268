"""Fast numerics with stored experts (docs/NUMERICS.md N30): fp4 routed experts held in their stored
bytes compute the bits of the same experts held dequantised.

- the decoder against formats.dequantize_fp4_weight cast to bf16 / fp32, for every (byte, scale) pair;
- the native routed experts from stored banks against held banks, bit for bit: a decode step's few
  rows per expert (decoded in registers), many rows (decoded once per tile), scales outside the range
  the vector decode takes (the float product), the shared expert in the same call;
- the trained demo loaded both ways: the same logits in a prefill, chunks, decode steps and a batch,
  and the same engine completions; with the native library off too (the torch path dequantises one
  expert at a time); a quarter of the expert bytes;
- an AVX2 build (no AVX-512) decodes the same bits; planted mistakes in the decoders are caught; the
  option's misuse gets one clear error.
"""

from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.config import ConfigError, RuntimeConfig
from dsv41.demo import TRAINED_DEMO
from dsv41.model import formats, native
from dsv41.model.numerics import Numerics
from helpers import engine_run, run_chunks, token_ids
from test_native import mutated_library
from test_native_fast import _cpu_has

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bits, or both NaN."""
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return (a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())


def every_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Row s holds all 256 code bytes (512 values) under scale byte s: every (byte, scale) pair."""
    packed = torch.arange(256, dtype=torch.uint8).view(torch.int8).repeat(256, 1)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16).view(torch.float8_e8m0fnu)
    return packed, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_decoder_gives_the_dequantised_values_for_every_byte_and_scale(dtype):
    packed, scale = every_pair()
    got = native.fp4_rows(packed, scale, dtype)
    want = formats.dequantize_fp4_weight(packed, scale).to(dtype)
    assert same_bits(got, want).all()
    # byte 1 is (1/2, 0) at 2^0; byte 0x7f is (−6, 6), at 2^1 (−12, 12): low nibble first
    assert got[127, 2:4].tolist() == [0.5, 0.0] and got[128, 2 * 0x7f:2 * 0x80].tolist() == [-12.0, 12.0]


def stored_case(n: int, A: int, E: int, D: int, I: int, seed: int, odd_scales: bool = False):
    """x [n, D], ids/weights [n, A], and (stored banks with scales, the same banks held in bf16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(n)])
    ids[-1, -1] = -1                                             # another rank's pair
    weights = torch.rand(n, A, generator=g)
    stored = []
    for shape in ((E, I, D), (E, I, D), (E, D, I)):
        q, s = formats.quantize_fp4_weight(torch.randn(*shape, generator=g) * shape[-1] ** -0.5)
        if odd_scales:
            # blocks outside the vector decode's exponent range (scale bytes 0 and 1: values below the
            # normal range; huge ones would overflow the sums); the rows' other blocks stay in it
            raw = s.view(torch.uint8)
            raw[:, ::3, 0], raw[:, 1::5, -1] = 1, 0
        stored.append((q, s))
    return x, ids, weights, stored


def held_banks(stored, dtype=torch.bfloat16):
    return [formats.dequantize_fp4_weight(q, s).to(dtype).contiguous() for q, s in stored]


@pytest.mark.parametrize("n, odd_scales", [(1, False), (3, False), (12, False), (3, True), (12, True)])
def test_stored_routed_experts_are_the_held_banks_bits(n, odd_scales):
    # 12 tokens on 6 of 8 experts put more rows on an expert than a tile's activation rows
    x, ids, weights, stored = stored_case(n, 6 if n == 12 else 3, 8, 128, 96, seed=n, odd_scales=odd_scales)
    banks, scales = [q for q, _ in stored], tuple(s for _, s in stored)
    shared = tuple(b[0].clone() for b in held_banks(stored))
    for dtype in (torch.bfloat16, torch.float32):
        held = held_banks(stored, dtype)
        for extra in ({}, {"shared": tuple(t.to(dtype) for t in shared)}):
            want = native.routed_experts(x.to(dtype), ids, weights, *held, 6.0, **extra)
            got = native.routed_experts(x.to(dtype), ids, weights, *banks, 6.0, scales=scales, dtype=dtype, **extra)
            assert torch.equal(got, want), (dtype, extra.keys())
    assert not torch.equal(want, torch.zeros_like(want))


@pytest.fixture(scope="module")
def demo_pair():
    """The trained demo loaded twice in fast bf16: experts held dequantised, and stored."""
    def load(stored: bool):
        return dsv41.load(TRAINED_DEMO, RuntimeConfig(max_seq_len=160, max_batch_size=3, numerics="fast",
                                                      stored_experts=stored))
    return load(False), load(True)


def expert_bytes(model) -> int:
    """Bytes of the main blocks' routed experts (the DSpark stages' are stored alike)."""
    return sum(t.nbytes for name, t in model.state_dict().items() if name.startswith("layers.") and ".ffn.experts." in name)


def test_stored_demo_holds_the_experts_stored_bytes(demo_pair):
    held, stored = demo_pair
    cfg = held.cfg
    n = cfg.n_layers * cfg.n_routed_experts * 3 * cfg.dim * cfg.moe_inter_dim     # values in the banks
    assert expert_bytes(held) == 2 * n
    assert expert_bytes(stored) == n // 2 + n // 32                                # nibbles + a byte per 32
    assert stored.layers[0].ffn.experts.w1.weight.dtype == torch.int8


@torch.inference_mode()
def test_stored_demo_gives_the_held_demos_logits_however_positions_are_fed(demo_pair):
    held, stored = demo_pair
    ids = token_ids(3, 48, held.cfg.vocab_size, seed=5)
    for bounds in ([0, 48], [0, 20, 33, 48]):
        (a, a_draft), (b, b_draft) = (run_chunks(m, ids, bounds) for m in demo_pair)
        assert torch.equal(a, b) and torch.equal(a_draft, b_draft), bounds
    caches = [m.new_cache(3, 160) for m in demo_pair]
    for model, cache in zip(demo_pair, caches):
        model(ids[:, :40], 0, cache)
    for p in range(40, 48):                                      # decode steps of a 3-row batch
        a, b = (m.logits(m(ids[:, p:p + 1], p, c).hidden[:, -1]) for m, c in zip(demo_pair, caches))
        assert torch.equal(a, b), p


@torch.inference_mode()
def test_stored_demo_completes_as_the_held_demo_on_the_engine(demo_pair):
    prompts = [token_ids(1, n, demo_pair[0].cfg.vocab_size, seed=n)[0].tolist() for n in (9, 30)]
    held, stored = (engine_run(m, prompts, 12) for m in demo_pair)
    assert [c.token_ids for c in held] == [c.token_ids for c in stored] and len(held[1].token_ids) == 12


@torch.inference_mode()
def test_without_the_native_library_stored_experts_give_the_same_bits(demo_pair, monkeypatch):
    held, stored = demo_pair
    ids = token_ids(2, 12, held.cfg.vocab_size, seed=9)
    with_library = run_chunks(stored, ids, [0, 12])[0]
    monkeypatch.setattr(native, "_library", lambda: None)          # every kernel takes its torch path
    want = run_chunks(held, ids, [0, 12])[0]
    assert torch.equal(run_chunks(stored, ids, [0, 12])[0], want)
    assert not torch.equal(want, with_library)                       # the torch paths did run


def avx2_build(monkeypatch):
    """Build the library for an AVX2 CPU without AVX-512 (this CPU must run it): the decoder's AVX2 path."""
    if not _cpu_has("avx2", "fma", "f16c", "bmi2"):
        pytest.skip("this CPU cannot run an AVX2 build")
    monkeypatch.setattr(native, "FLAGS", tuple("-march=haswell" if f == "-march=native" else f for f in native.FLAGS))


def check_decoder_and_experts() -> None:
    test_the_decoder_gives_the_dequantised_values_for_every_byte_and_scale(torch.bfloat16)
    test_the_decoder_gives_the_dequantised_values_for_every_byte_and_scale(torch.float32)
    for n, odd_scales in ((1, False), (3, True), (12, False)):
        test_stored_routed_experts_are_the_held_banks_bits(n, odd_scales)


def test_an_avx2_build_decodes_the_same_bits(tmp_path, monkeypatch):
    avx2_build(monkeypatch)
    native.build(tmp_path / "avx2.so")
    lib = native.load(tmp_path / "avx2.so")
    monkeypatch.setattr(native, "_library", lambda: lib)
    check_decoder_and_experts()


@pytest.mark.parametrize("source, old, new, build", [
    # the AVX-512 decode: the scale's exponent one too high
    ("fp4.h", "(int16_t)((s - 127) * 128)", "(int16_t)((s - 126) * 128)", "native"),
    # its range: scale byte 1 (results below the normal range) taken by the exponent add
    ("fp4.h", "#define FP4_WIDE_LOW 2", "#define FP4_WIDE_LOW 1", "native"),
    # a decode step's tiles (N31): the exponent adds worked out a tile at a time one too low, and the
    # vector range check passing every scale (blocks with scale byte 0 or 1 then decoded by the add)
    ("fp4.h", "_mm512_set1_epi32(127)), 7)", "_mm512_set1_epi32(128)), 7)", "native"),
    ("fp4.h", "if (wide != live) return 0;", "if (wide != live && 0) return 0;", "native"),
    # the float product (AVX-512: scales outside the range): the two nibbles of a byte swapped
    ("gemv.c", "src[j / 2] >> (4 * (j & 1))", "src[j / 2] >> (4 * (~j & 1))", "native"),
    # the AVX2 decode: the sign taken from the wrong bit of the code
    ("gemv.c", "_mm256_srli_epi32(codes, 3), 31)", "_mm256_srli_epi32(codes, 2), 31)", "avx2"),
])
def test_a_mutated_decoder_is_caught(source, old, new, build, tmp_path, monkeypatch):
    if build == "avx2":
        avx2_build(monkeypatch)
    elif not _cpu_has("avx512f", "avx512bw"):
        pytest.skip("this CPU builds gemv.c without the AVX-512 decode")
    lib = mutated_library(source, old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        check_decoder_and_experts()


def test_stored_experts_misuse_is_one_clear_error():
    with pytest.raises(ConfigError, match="stored_experts is for numerics='fast'"):
        RuntimeConfig(numerics="reference", stored_experts=True)
    with pytest.raises(ConfigError, match="decoded by the CPU kernels; on cuda"):
        Numerics.for_device("fast", None, "cuda", stored_experts=True)
    with pytest.raises(ConfigError, match="fast numerics with the expert loop"):
        Numerics("fast", "blas", "grouped", stored_experts=True)
    assert Numerics.for_device("fast", None, "cpu", stored_experts=True).stored_experts


def test_stored_experts_refuse_a_backward(demo_pair):
    _, stored = demo_pair
    experts = stored.layers[0].ffn.experts
    x = torch.randn(3, stored.cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])[:, :stored.cfg.n_activated_experts]
    weights = torch.ones(ids.shape)
    with torch.enable_grad(), pytest.raises(ConfigError, match="no backward"):
        experts(x, weights, ids)


def test_expert_parallel_ranks_load_their_stored_experts(demo_pair):
    """Under expert parallelism each rank loads its experts' stored bytes and scales: the parts of two
    ranks put back together are the one-process stored banks."""
    from dsv41.checkpoint.model_io import load_model
    from dsv41.parallel import ParallelContext

    _, stored = demo_pair
    whole = stored.state_dict()
    runtime = RuntimeConfig(max_seq_len=64, numerics="fast", stored_experts=True)
    parts = [load_model(TRAINED_DEMO, runtime, check_memory=False,
                        parallel=ParallelContext(rank=r, world_size=2, tp_size=2, ep_size=2)).state_dict()
             for r in range(2)]
    names = [n for n in whole if n.startswith("layers.") and ".ffn.experts." in n]
    assert len(names) == 6 * stored.cfg.n_layers                     # w1, w2, w3 and their scales
    for name in names:
        rebuilt = torch.cat([p[name] for p in parts])
        assert rebuilt.dtype == whole[name].dtype and torch.equal(rebuilt.view(torch.uint8), whole[name].view(torch.uint8))


def test_the_released_plan_holds_stored_experts_at_their_checkpoint_bytes(released_cfg):
    """The released config on the meta device: fast numerics' routed experts take the checkpoint's
    268.95 GiB when stored (docs/CHECKPOINT.md §4, what reference numerics hold), 2 bytes a value held."""
    from dsv41.checkpoint.plan import plan_load

    def experts(**runtime) -> int:
        return plan_load(released_cfg, RuntimeConfig(max_seq_len=4096, **runtime)).weights["routed experts"]

    values = released_cfg.n_layers * released_cfg.n_routed_experts * 3 * released_cfg.dim * released_cfg.moe_inter_dim
    stored = experts(numerics="fast", stored_experts=True)
    assert stored == experts() and stored / 2 ** 30 == pytest.approx(268.95, abs=0.01)
    assert stored == values // 2 + values // 32
    assert experts(numerics="fast") == 2 * values
