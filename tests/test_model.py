"""The whole model: cached paths against the one-shot prefill (STYLE.md P12 rung 2), independence of two
models in one process, call errors, and the released layout built on the meta device (docs/CHECKPOINT.md §3).

Tiny configs from `helpers`; with 24 positions and a window of 8 every split crosses the ring's
wrap-around, and splits at odd positions start and end inside ratio-2 groups (the compressor tail).
"""

import pytest
import torch

from dsv41.errors import InputError
from dsv41.model.cache import CacheError
from dsv41.config import RuntimeConfig
from dsv41.model import Transformer

import helpers

LENGTH = 24
SPLITS = {
    "prefill 7 + decode": [0, 7] + list(range(8, LENGTH + 1)),
    "chunks of 5": [0, 5, 10, 15, 20, LENGTH],
    "odd boundaries": [0, 3, 4, 9, 10, 15, 21, LENGTH],
    "chunk longer than the window": [0, 11, LENGTH],
}


def run_all(model, ids):
    """hidden, logits and DSpark hidden of every split, keyed like SPLITS plus "one-shot"."""
    out = {}
    for name, bounds in {"one-shot": [0, LENGTH], **SPLITS}.items():
        hidden, dspark = helpers.run_chunks(model, ids, bounds)
        out[name] = (hidden, model.logits(hidden), dspark)
    return out


# ------------------------------------------------------------------------------------------ (a) fast

@pytest.fixture(scope="module")
def fast_runs():
    model = helpers.build(helpers.nonbinding_config(), "fast", seed=0)
    return model, run_all(model, helpers.token_ids(2, LENGTH, seed=5))


@pytest.mark.parametrize("split", list(SPLITS))
def test_fast_float32_cached_paths_equal_one_shot(fast_runs, split):
    # Non-binding choices: the paths differ only by fp32 summation order (measured ≤ 3e-5 hidden,
    # ≤ 6e-6 logits over 3 seeds), so 1e-4 catches any logic error.
    _, runs = fast_runs
    hidden, logits, dspark = runs[split]
    ref_hidden, ref_logits, ref_dspark = runs["one-shot"]
    assert hidden.dtype == torch.float32 and logits.dtype == torch.float32
    torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(dspark, ref_dspark, rtol=0, atol=1e-4)


def test_dspark_hidden_is_the_mean_of_the_streams_entering_the_targets(fast_runs):
    model, runs = fast_runs
    entering = {}

    def capture(layer):
        def hook(module, args):
            entering[layer] = args[0].float().mean(dim=2)[0].unflatten(0, (2, LENGTH))   # packed [1, N, …]
        return hook
    handles = [model.layers[i].register_forward_pre_hook(capture(i)) for i in (5, 6, 7)]
    try:
        helpers.run_chunks(model, helpers.token_ids(2, LENGTH, seed=5), [0, LENGTH])
    finally:
        for h in handles:
            h.remove()
    _, _, dspark = runs["one-shot"]
    assert dspark.shape == (2, LENGTH, 3 * model.cfg.dim)
    torch.testing.assert_close(dspark, torch.cat([entering[i] for i in (5, 6, 7)], -1), rtol=0, atol=1e-6)


def test_backbone_does_not_depend_on_dspark_stages(fast_runs):
    _, runs = fast_runs
    model = helpers.build(helpers.without_dspark(helpers.nonbinding_config()), "fast", seed=0)
    hidden, dspark = helpers.run_chunks(model, helpers.token_ids(2, LENGTH, seed=5), [0, LENGTH])
    assert dspark is None
    assert torch.equal(hidden, runs["one-shot"][0])


# ------------------------------------------------------------------------------------------ (b) reference

@pytest.fixture(scope="module")
def reference_runs():
    model = helpers.build(helpers.nonbinding_config(), "reference", seed=0)
    return model, run_all(model, helpers.token_ids(2, LENGTH, seed=5))


@pytest.mark.parametrize("split", list(SPLITS))
def test_reference_cached_paths_bit_identical(reference_runs, split):
    """Reference numerics with invariant kernels: every split gives the one-shot prefill's bits (a 1-row
    decode and a 24-row prefill sum their matmuls exactly; numerics.py). With the BLAS they differed by up
    to 0.37 in the logits here."""
    _, runs = reference_runs
    hidden, logits, dspark = runs[split]
    ref_hidden, ref_logits, ref_dspark = runs["one-shot"]
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(hidden, ref_hidden) and torch.equal(logits, ref_logits) and torch.equal(dspark, ref_dspark)


# ------------------------------------------------------------------------------------------ (d) no globals

@torch.no_grad()
def test_two_models_in_one_process_do_not_interact():
    """B (binding, reference bf16, window 4, no DSpark) runs alone; then A (non-binding, fast fp32) is built
    and runs alone; then a second B is built and both decode in alternation, each with its own cache. Every
    result equals the one from running alone, and the process default dtype is untouched."""
    ids = helpers.token_ids(2, 12, seed=6)
    bounds = [0, 5] + list(range(6, 13))
    cfg_b = helpers.without_dspark(helpers.binding_config(window_size=4))
    dtype_before = torch.get_default_dtype()
    alone_b, _ = helpers.run_chunks(helpers.build(cfg_b, "reference", seed=2), ids, bounds)
    a = helpers.build(helpers.nonbinding_config(), "fast", seed=1)
    alone_a, _ = helpers.run_chunks(a, ids, bounds)
    b = helpers.build(cfg_b, "reference", seed=2)
    assert torch.get_default_dtype() == dtype_before

    cache_a, cache_b = a.new_cache(2, helpers.MAX_SEQ), b.new_cache(2, helpers.MAX_SEQ)
    out_a, out_b = [a(ids[:, :5], 0, cache_a).hidden], [b(ids[:, :5], 0, cache_b).hidden]
    for p in range(5, 12):
        out_b.append(b(ids[:, p:p + 1], p, cache_b).hidden)
        out_a.append(a(ids[:, p:p + 1], p, cache_a).hidden)
    assert torch.equal(torch.cat(out_a, 1), alone_a)
    assert torch.equal(torch.cat(out_b, 1), alone_b)


# ------------------------------------------------------------------------------------------ (e) errors

@pytest.fixture(scope="module")
def small_model():
    return helpers.build(helpers.nonbinding_config(), "fast", seed=0)


def test_prompt_longer_than_the_cache(small_model):
    cache = small_model.new_cache(1, 16)
    with pytest.raises(CacheError) as err:
        small_model(helpers.token_ids(1, 20), 0, cache)
    assert "0 … 19" in str(err.value) and "16" in str(err.value)
    assert cache.length == 0
    small_model(helpers.token_ids(1, 16), 0, cache)                      # exactly full is fine
    with pytest.raises(CacheError, match="16 … 16"):
        small_model(helpers.token_ids(1, 1), 16, cache)


def test_gap_in_start_pos(small_model):
    cache = small_model.new_cache(1, 32)
    small_model(helpers.token_ids(1, 5), 0, cache)
    with pytest.raises(CacheError) as err:
        small_model(helpers.token_ids(1, 1), 7, cache)
    assert "7" in str(err.value) and "0 … 4" in str(err.value)
    with pytest.raises(CacheError):
        small_model(helpers.token_ids(1, 1), -1, cache)
    assert cache.length == 5


def test_wrong_batch(small_model):
    cache = small_model.new_cache(2, 32)
    with pytest.raises(CacheError) as err:
        small_model(helpers.token_ids(3, 4), 0, cache)
    assert "3" in str(err.value) and "2" in str(err.value)


def test_token_ids_out_of_range(small_model):
    cache = small_model.new_cache(1, 32)
    for bad in (256, -1):
        ids = helpers.token_ids(1, 4)
        ids[0, 2] = bad
        with pytest.raises(ValueError) as err:
            small_model(ids, 0, cache)
        assert "[0, 256)" in str(err.value) and str(bad) in str(err.value)
    with pytest.raises(InputError, match="integer tensor"):
        small_model(helpers.token_ids(1, 4).float(), 0, cache)
    assert cache.length == 0


def test_host_ids_are_checked_on_the_host_then_moved():
    # the engine hands its ids over on the host: an accelerator model checks them there and copies them,
    # reading no device value (a meta model has none to read: checking after the copy would raise)
    model = Transformer(helpers.nonbinding_config(), RuntimeConfig(), device="meta")
    moved = model._checked_ids(torch.tensor([0, 5, 255]))
    assert moved.device.type == "meta" and moved.shape == (3,)
    with pytest.raises(InputError, match=r"\[0, 256\), got min 0 max 256"):
        model._checked_ids(torch.tensor([0, 256]))


def test_rewinding_is_rejected_and_leaves_the_cache_usable(small_model):
    """The window ring and the pooling tail already hold later positions in the slots a rewind would
    read, so a call before the cache's end is refused (rollback of a verified suffix is the speculative
    path's job, tested there), and the cache then continues exactly."""
    ids = helpers.token_ids(2, LENGTH, seed=5)
    one, _ = helpers.run_chunks(small_model, ids, [0, LENGTH])
    cache = small_model.new_cache(2, helpers.MAX_SEQ)
    first = small_model(ids[:, :20], 0, cache).hidden
    with pytest.raises(CacheError, match="rewinds slot 0, which holds positions 0 … 19: continue at 20"):
        small_model(ids[:, 18:], 18, cache)
    assert cache.length == 20
    rest = small_model(ids[:, 20:], 20, cache).hidden
    torch.testing.assert_close(torch.cat([first, rest], 1), one, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------ (f) released layout

F8, E8, BF16, F32, I8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32, torch.int8
KV_SOURCES, INDEX_SOURCES, ENGRAM = (2, 8, 14, 20), (2, 8, 14, 20, 24, 28, 32, 36), {1: 384006168, 14: 384016682}


def fp8(name, out, inp):
    return {f"{name}.weight": (F8, (out, inp)), f"{name}.scale": (E8, (-(-out // 32), -(-inp // 32)))}


def expected_layer(L):
    """docs/CHECKPOINT.md §3.2–3.3 for layer L, with dsv41's two deliberate differences: routed experts are
    stacked ([E, out, in/2] int8 + [E, out, in/32] e8m0), wo_a is held dequantised in bf16 (§6.2), the
    ratio-2 compressor in fp32 (§3.3)."""
    p = f"layers.{L}."
    exp = {}
    exp.update(fp8(p + "attn.wq_a", 1280, 5120))
    exp.update(fp8(p + "attn.wq_b", 32768, 1280))
    exp.update(fp8(p + "attn.wkv", 512, 5120))
    exp[p + "attn.wo_a.weight"] = (BF16, (8192, 4096))
    exp.update(fp8(p + "attn.wo_b", 5120, 8192))
    exp[p + "attn.q_norm.weight"] = (BF16, (1280,))
    exp[p + "attn.kv_norm.weight"] = (BF16, (512,))
    exp[p + "attn.attn_sink"] = (F32, (64,))
    exp[p + "attn_norm.weight"] = exp[p + "ffn_norm.weight"] = (BF16, (5120,))
    exp[p + "ffn.gate.weight"] = (BF16, (384, 5120))
    exp[p + "ffn.gate.bias"] = exp[p + "ffn.gate.bias_vl"] = (F32, (384,))
    exp.update(fp8(p + "ffn.shared_experts.w1", 2304, 5120))
    exp.update(fp8(p + "ffn.shared_experts.w3", 2304, 5120))
    exp.update(fp8(p + "ffn.shared_experts.w2", 5120, 2304))
    for w, (out, inp) in {"w1": (2304, 5120), "w3": (2304, 5120), "w2": (5120, 2304)}.items():
        exp[p + f"ffn.experts.{w}.weight"] = (I8, (384, out, inp // 2))
        exp[p + f"ffn.experts.{w}.scale"] = (E8, (384, out, inp // 32))
    for sub in ("attn", "ffn"):
        exp[p + f"hc_{sub}_fn"] = (F32, (24, 20480))
        exp[p + f"hc_{sub}_base"] = (F32, (24,))
        exp[p + f"hc_{sub}_scale"] = (F32, (3,))
    if L in KV_SOURCES:
        pooled = L != 20
        exp[p + "attn.compressor.wkv.weight"] = (F32 if pooled else BF16, (512, 5120))
        if pooled:
            exp[p + "attn.compressor.wgate.weight"] = (F32, (512, 5120))
        exp[p + "attn.compressor.norm.weight"] = (BF16, (512,))
        exp[p + "attn.indexer.wk.weight"] = (BF16, (128, 512))
        exp[p + "attn.indexer.k_norm.weight"] = (BF16, (128,))
    if L in INDEX_SOURCES:
        exp[p + "attn.indexer.weights_proj.weight"] = (BF16, (32, 5120))
        exp.update(fp8(p + "attn.indexer.wq_b", 4096, 1280))
    if L in ENGRAM:
        exp[p + "engram.embed.weight"] = (F8, (ENGRAM[L], 256))
        exp[p + "engram.embed.scale"] = (E8, (ENGRAM[L], 8))
        exp.update(fp8(p + "engram.wkv", 25600, 6144))
        exp[p + "engram.q_weight"] = exp[p + "engram.k_weight"] = (BF16, (4, 5120))
    return exp


@pytest.fixture(scope="module")
def meta_state(released_cfg):
    model = Transformer(released_cfg, RuntimeConfig(max_seq_len=4096), device="meta")
    return {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}


def test_released_layout_globals(meta_state):
    assert meta_state["embed.weight"] == (BF16, (129280, 5120))
    assert meta_state["head.weight"] == (F32, (129280, 5120))           # held fp32 (trap 20)
    assert meta_state["norm.weight"] == (BF16, (5120,))


@pytest.mark.parametrize("layer", [0, 1, 2, 3, 8, 14, 19, 20, 21, 24, 25, 36, 39])
def test_released_layout_per_layer(meta_state, layer):
    got = {k: v for k, v in meta_state.items() if k.startswith(f"layers.{layer}.")}
    expect = expected_layer(layer)
    assert sorted(set(got) - set(expect)) == [] and sorted(set(expect) - set(got)) == []
    for name, spec in expect.items():
        assert got[name] == spec, name


def expected_dspark_stage(S):
    """docs/CHECKPOINT.md §3.4 for stage mtp.S: a window-only block with 128 experts, plus the extras."""
    layer = {k.replace("layers.0.", f"mtp.{S}.", 1): v for k, v in expected_layer(0).items()}
    exp = {}
    for name, (dtype, shape) in layer.items():
        if ".ffn.gate." in name or ".ffn.experts." in name:
            shape = (128,) + shape[1:]                                  # 128 routed experts
        exp[name] = (dtype, shape)
    if S == 0:
        exp.update(fp8("mtp.0.main_proj", 5120, 15360))
        exp["mtp.0.main_norm.weight"] = (BF16, (5120,))
    if S == 2:
        exp["mtp.2.norm.weight"] = (BF16, (5120,))
        exp["mtp.2.markov_head.embed.weight"] = (BF16, (129280, 256))
        exp["mtp.2.markov_head.head.weight"] = (F32, (129280, 256))     # held fp32, like the head
        exp["mtp.2.confidence_head.proj.weight"] = (F32, (1, 5376))     # held fp32 (§6.2)
    return exp


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_released_layout_dspark_stages(meta_state, stage):
    got = {k: v for k, v in meta_state.items() if k.startswith(f"mtp.{stage}.")}
    assert got == expected_dspark_stage(stage)


def expected_vision() -> dict:
    """docs/CHECKPOINT.md §3.1: the ViT, the aligner and the span delimiters, all bf16."""
    exp = {f"image_{k}": (BF16, (5120,)) for k in ("start", "end", "newline")}
    exp.update({"aligner.w1.weight": (BF16, (5120, 9216)), "aligner.w1.bias": (BF16, (5120,)),
                "aligner.w2.weight": (BF16, (5120, 5120)), "aligner.w2.bias": (BF16, (5120,)),
                "vision.patch_embed.proj.weight": (BF16, (1024, 588)), "vision.patch_embed.proj.bias": (BF16, (1024,)),
                "vision.norm.weight": (BF16, (1024,))})
    for b in range(32):
        p = f"vision.blocks.{b}"
        exp.update({f"{p}.attn.wqkv.weight": (BF16, (3072, 1024)), f"{p}.attn.wqkv.bias": (BF16, (3072,)),
                    f"{p}.attn.wo.weight": (BF16, (1024, 1024)), f"{p}.attn.wo.bias": (BF16, (1024,)),
                    f"{p}.mlp.w1.weight": (BF16, (5632, 1024)), f"{p}.mlp.w2.weight": (BF16, (1024, 2816)),
                    f"{p}.norm1.weight": (BF16, (1024,)), f"{p}.norm2.weight": (BF16, (1024,))})
    return exp


def test_released_layout_vision(meta_state):
    assert {k: v for k, v in meta_state.items() if k.startswith(("vision.", "aligner.", "image_"))} == expected_vision()


def test_released_layout_every_name(meta_state):
    expect = {"embed.weight", "head.weight", "norm.weight"} | set(expected_vision())
    for L in range(40):
        expect |= set(expected_layer(L))
    for S in range(3):
        expect |= set(expected_dspark_stage(S))
    assert set(meta_state) == expect
    # 3 globals + 40 × (29 + 6 stacked) + 11 compressor + 32 indexer + 12 Engram names
    # + 3 DSpark stages × 35 + 3 stage-0 extras + 4 stage-2 extras + 259 ViT + 4 aligner + 3 delimiters
    assert len(meta_state) == 1458 + 3 * 35 + 3 + 4 + 259 + 4 + 3


def test_restarting_at_zero_is_exact(small_model):
    ids = helpers.token_ids(2, LENGTH, seed=6)
    one, _ = helpers.run_chunks(small_model, ids, [0, LENGTH])
    cache = small_model.new_cache(2, helpers.MAX_SEQ)
    small_model(helpers.token_ids(2, 30, seed=7), 0, cache)           # an unrelated earlier sequence
    torch.testing.assert_close(small_model(ids, 0, cache).hidden, one, rtol=0, atol=1e-4)
