"""A fast decode step's compressed branch in two native calls (dsv41/model/native/compressed.c,
docs/NUMERICS.md N34): a kv source's new rows published into the cache, and an index source's choice of
compressed positions (queries, scores, candidate blocks or restriction, top-k).

Each call is checked bit-equal to the layer's calls one by one, against formulas written here (float64
RoPE and norms; the top-k rule on the kernel's own scores, with ties planted), in a model's decode steps
where every choice binds, and with mutated sources that must fail the same checks.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.config import RuntimeConfig
from dsv41.model import Transformer, native
from dsv41.model.indexer import Indexer, candidate_blocks
from dsv41.model.init import init_random_
from dsv41.model.layers import RMSNorm
from dsv41.model.numerics import NATIVE_WIDE_ROWS, Numerics
from dsv41.model.rope import Rotary, yarn_frequencies

from test_native import mutated_library

FAST, FAST_NATIVE = Numerics("fast", "blas"), Numerics("fast", "blas", native=True)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here: the torch path runs instead")

D, Qr, Dh, Hi, Di, R = 64, 32, 48, 4, 32, 16


def _bf16(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _rotary() -> Rotary:
    return Rotary(R, yarn_frequencies(R, 160000.0, 64, 4.0, 32.0, 1.0), FAST_NATIVE)


def _rope64(t: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """The last R features of t [n, F] rotated at positions [n], pairs as complex numbers, in float64."""
    angle = positions.double()[:, None] * rotary.freqs.double()
    t = t.double().clone()
    a, b = t[:, -R::2].clone(), t[:, -R + 1::2].clone()
    t[:, -R::2], t[:, -R + 1::2] = a * torch.cos(angle) - b * torch.sin(angle), a * torch.sin(angle) + b * torch.cos(angle)
    return t


def _norm64(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t = t.double()
    return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * weight.double()


# ---------------------------------------------------------------------------------------- publication

def _publish_case(g: torch.Generator, norm_dtype: torch.dtype):
    return dict(wk=_bf16(g, Di, Dh, scale=Dh ** -0.5), k_norm=(torch.rand(Di, generator=g) + 0.5).to(norm_dtype),
                wkv=_bf16(g, Dh, D, scale=D ** -0.5), norm=(torch.rand(Dh, generator=g) + 0.5).to(norm_dtype))


@pytest.mark.parametrize("from_tokens", [False, True], ids=["latents", "tokens"])
@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
def test_a_kv_sources_new_rows_are_one_native_call_with_the_bits_of_the_calls(from_tokens, norm_dtype):
    """`dsv41_publish`: rows 3, 0, 5 of slots 1, 0, 1 get RoPE(latent) and the index key RoPE(k_norm(latent ·
    wkᵀ)), bit-equal to `Indexer.keys` and `Rotary.rotate` (and, from tokens, the r = 1 compressor's
    norm(x · wkvᵀ) first); every other cache row stays as it was; within bf16 of float64."""
    g = torch.Generator().manual_seed(40)
    w, rotary = _publish_case(g, norm_dtype), _rotary()
    slots, rows = [1, 0, 1], [3, 0, 5]
    positions = torch.tensor(rows) * 2 + 7
    phases = rotary.phases(positions)
    x = _bf16(g, 3, D)
    norm, k_norm = RMSNorm(Dh, 1e-6, numerics=FAST_NATIVE), RMSNorm(Di, 1e-5, numerics=FAST_NATIVE)
    norm.weight.data, k_norm.weight.data = w["norm"], w["k_norm"]
    latent = norm(FAST_NATIVE.linear(x, w["wkv"])) if from_tokens else _bf16(g, 3, Dh)
    kv, keys = torch.full((2, 8, Dh), 7.0).bfloat16(), torch.full((2, 8, Di), 7.0).bfloat16()
    compressor = (w["wkv"], w["norm"], 1e-6) if from_tokens else None
    assert FAST_NATIVE.publish(x if from_tokens else None, compressor, None if from_tokens else latent,
                               (w["wk"], w["k_norm"], 1e-5), phases, kv, keys, slots, rows)

    want_kv = rotary.rotate(latent[None], positions, phases=phases)[0]
    want_keys = rotary.rotate(k_norm(FAST_NATIVE.linear(latent, w["wk"]))[None], positions, phases=phases)[0]
    written = torch.zeros(2, 8, dtype=torch.bool)
    written[slots, rows] = True
    assert torch.equal(kv[slots, rows], want_kv) and torch.equal(keys[slots, rows], want_keys)
    assert (kv[~written] == 7).all() and (keys[~written] == 7).all()

    latent64 = _norm64(x.double() @ w["wkv"].double().T, w["norm"], 1e-6) if from_tokens else latent.double()
    kv64 = _rope64(latent64, positions, rotary)
    keys64 = _rope64(_norm64(latent.double() @ w["wk"].double().T, w["k_norm"], 1e-5), positions, rotary)
    for got, want in ((kv[slots, rows], kv64), (keys[slots, rows], keys64)):
        assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()


def test_the_policy_publishes_natively_only_what_it_can_write():
    g = torch.Generator().manual_seed(41)
    w, rotary = _publish_case(g, torch.bfloat16), _rotary()
    latent, phases = _bf16(g, 2, Dh), rotary.phases(torch.tensor([4, 6]))
    indexer = (w["wk"], w["k_norm"], 1e-5)
    cache = lambda dtype=torch.bfloat16: (torch.zeros(2, 4, Dh, dtype=dtype), torch.zeros(2, 4, Di, dtype=dtype))
    publish = lambda policy, rows, latent=latent, kv_keys=None: policy.publish(
        None, None, latent, indexer, phases, *(kv_keys or cache()), [0, 1], rows)
    assert publish(FAST_NATIVE, [2, 3])
    assert not publish(FAST, [2, 3])
    assert not publish(FAST_NATIVE, [2, 4])                                  # a row past the cache's
    assert not publish(FAST_NATIVE, [2, 3], kv_keys=cache(torch.float32))    # an fp32 cache
    assert not publish(FAST_NATIVE, [2, 3], latent.float())
    many = latent[:1].expand(NATIVE_WIDE_ROWS + 1, -1)
    assert not FAST_NATIVE.publish(None, None, many, indexer, rotary.phases(torch.arange(len(many))), *cache(),
                                   [0] * len(many), [0] * len(many))


# ---------------------------------------------------------------------------------------- the choice

def _indexer(g: torch.Generator) -> Indexer:
    indexer = Indexer(D, Qr, Dh, Hi, Di, 1e-6, owns_keys=False, numerics=FAST_NATIVE, dense="bf16")
    indexer.wq_b.weight.data = _bf16(g, Hi * Di, Qr, scale=Qr ** -0.5)
    indexer.weights_proj.weight.data = _bf16(g, Hi, D, scale=D ** -0.5)
    return indexer


def _keys(g: torch.Generator, C: int) -> torch.Tensor:
    """Index keys [3 slots, C + 4, Di] with planted ties: in slot 2 each key repeats two positions later,
    and every key is non-negative, so a query whose logits are all positive scores exact equals."""
    keys = _bf16(g, 3, C + 4, Di).abs()
    keys[2, 2:] = keys[2, :-2].clone()
    return keys


def _choice_case(seed: int, stage: str):
    g = torch.Generator().manual_seed(seed)
    C, K, blocks = 37, 6, (3, 4)
    indexer, rotary = _indexer(g), _rotary()
    x, qr = _bf16(g, 1, 3, D), _bf16(g, 1, 3, Qr)
    keys = _keys(g, C)
    positions = torch.tensor([80, 73, 41])
    visible = torch.tensor([37, 30, 4])                # the last row sees fewer positions than it chooses
    # whole blocks of 4 kept, alternately per row: a planted tie (two positions apart) stays inside one
    restrict = ((torch.arange(C) // 4 + torch.arange(3)[:, None]) % 2 == 0)[None] if stage == "restricted" else None
    return indexer, rotary, x, qr, keys, positions, visible, C, K, blocks if stage == "candidates" else None, restrict


def _choice_one_by_one(indexer, rotary, x, qr, keys, slots, positions, visible, C, K, blocks, restrict):
    """`Attention.select`'s one-row calls: `Indexer.select` of each row against its slot's keys."""
    phases = rotary.phases(positions)
    q, weights = indexer.queries(x, qr, positions, rotary, phases)
    chosen = torch.empty(3, min(K, C), dtype=torch.long)
    keep = torch.zeros(1, 3, C, dtype=torch.bool)
    for r, slot in enumerate(slots):
        seg = slice(r, r + 1)
        indexer.select(x[:, seg], qr[:, seg], keys[slot:slot + 1, :C], positions[seg], visible[seg], rotary, K,
                       blocks=blocks, keep=None if blocks is None else keep[:, seg],
                       restrict=None if restrict is None else restrict[:, seg], out=chosen[None, seg],
                       queries=(q[:, seg], weights[:, seg]))
    return chosen, keep[0], q, weights


@pytest.mark.parametrize("stage", ["plain", "candidates", "restricted"])
def test_a_decode_steps_choice_is_one_native_call_with_the_bits_of_the_calls(stage):
    """`dsv41_index_select` of three rows (slots 2, 0, 2; the last sees 4 of 37 positions, fewer than its 6): the chosen
    positions and kept blocks equal `Indexer.select`'s row by row; and, on the indexer's own scores,
    they are the rule written out here: ascending, the k best by (score, lower position first), −1 from
    the visible count on, a kept block among the Nb best by its max with the newest visible one pinned."""
    indexer, rotary, x, qr, keys, positions, visible, C, K, blocks, restrict = _choice_case(42, stage)
    slots = [2, 0, 2]
    parts = (indexer.wq_b.weight, indexer.weights_proj.weight, indexer.weight_scale)
    chosen, keep = FAST_NATIVE.index_select(x, qr, parts, rotary.phases(positions), [(keys, s) for s in slots], C,
                                            visible, K, blocks, restrict)
    want, want_keep, q, weights = _choice_one_by_one(indexer, rotary, x, qr, keys, slots, positions, visible, C, K,
                                                     blocks, restrict)
    assert torch.equal(chosen, want)
    assert (keep is None) == (blocks is None) and (keep is None or torch.equal(keep, want_keep))

    ties = 0
    for r, slot in enumerate(slots):
        scores = indexer.scores(x[:, r:r + 1], qr[:, r:r + 1], keys[slot:slot + 1, :C], positions[r:r + 1],
                                visible[r:r + 1], rotary, (q[:, r:r + 1], weights[:, r:r + 1]))[0, 0].float()
        if blocks is not None:
            nb, bs = blocks
            block_max = [scores[b:b + bs].max().item() for b in range(0, C, bs)]
            newest = (visible[r].item() - 1) // bs
            order = sorted(range(len(block_max)), key=lambda b: (b != newest, -block_max[b], b))[:nb]
            expect = torch.zeros(C, dtype=torch.bool)
            for b in order:
                if block_max[b] > float("-inf") or b == newest:
                    expect[b * bs:(b + 1) * bs] = True
            assert torch.equal(keep[r], expect)
        if restrict is not None:
            scores = scores.masked_fill(~restrict[0, r], float("-inf"))
        ranked = sorted(range(C), key=lambda j: (-scores[j].item(), j))[:min(K, C)]
        ties += len(set(scores[ranked].tolist())) < len(ranked)
        expect = sorted(ranked)
        assert chosen[r].tolist() == [j if j < visible[r] else -1 for j in expect]
    assert ties, "no tie among the chosen scores: the case does not test the tie rule"


def test_the_policy_chooses_natively_for_decode_rows_only():
    indexer, rotary, x, qr, keys, positions, visible, C, K, blocks, restrict = _choice_case(43, "plain")
    parts = (indexer.wq_b.weight, indexer.weights_proj.weight, indexer.weight_scale)
    phases = rotary.phases(positions)
    choose = lambda policy, x=x, qr=qr, slots=(2, 0, 2), C=C, parts=parts: policy.index_select(
        x, qr, parts, phases, [(keys, s) for s in slots], C, visible, K, None, None)
    assert choose(FAST_NATIVE) is not None
    assert choose(FAST) is None
    assert choose(FAST_NATIVE, x.float(), qr.float()) is None
    assert choose(FAST_NATIVE, slots=(2, 0, 3)) is None                               # a slot past the keys
    assert choose(FAST_NATIVE, C=C + 5) is None                                       # more positions than held
    assert choose(FAST_NATIVE, parts=(parts[0].float(), parts[1], parts[2])) is None
    with torch.enable_grad():
        recording = (parts[0].float().requires_grad_().bfloat16(), parts[1], parts[2])
        assert choose(FAST_NATIVE, parts=recording) is None


# ---------------------------------------------------------------------------------------- in a model

@pytest.mark.parametrize("stale", [False, True], ids=["own-keys", "stale-keys"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_models_decode_steps_take_both_calls_with_the_bits_of_the_layer_calls(batch, stale, monkeypatch):
    """binding_config (top-4 of the compressed positions, 2 candidate blocks of 2: every choice binds),
    layers 2 (r = 2 kv and index source), 4 (r = 1 kv, index and candidate source) and 6 (an index source
    restricted to layer 4's blocks): ten decode steps' logits, with the two calls and without them."""
    from helpers import MAX_SEQ, binding_config, token_ids, without_dspark
    runtime = RuntimeConfig(max_seq_len=2 * MAX_SEQ, max_batch_size=2, numerics="fast", stale_index_keys=stale)
    model = init_random_(Transformer(without_dspark(binding_config()), runtime), 0)
    ids = token_ids(batch, 40, model.cfg.vocab_size)

    def run() -> list[torch.Tensor]:
        cache = model.new_cache(batch, 2 * MAX_SEQ)
        with torch.no_grad():
            out = [model.logits(model(ids[:, :30], 0, cache).hidden)]
            calls.clear()                   # the decode steps' calls (a prefill of up to 32 rows may call too)
            return out + [model.logits(model(ids[:, p:p + 1], p, cache).hidden) for p in range(30, 40)]

    calls = []
    real_select, real_publish = native.index_select, native.publish
    monkeypatch.setattr(native, "index_select", lambda *a: calls.append("select") or real_select(*a))
    monkeypatch.setattr(native, "publish", lambda *a: calls.append("publish") or real_publish(*a))
    fused = run()
    # three index sources a step; layer 4 publishes every step, layer 2 (r = 2) every other one
    assert calls.count("select") == 3 * 10 and calls.count("publish") == 10 + 5
    monkeypatch.setattr(native, "index_select", lambda *a: None)
    monkeypatch.setattr(native, "publish", lambda *a: False)
    assert all(torch.equal(a, b) for a, b in zip(fused, run()))


# ---------------------------------------------------------------------------------------- mutations

@pytest.mark.parametrize("old, new, check", [
    ("block_score[b] = b == newest ? INFINITY : best;", "block_score[b] = best;", "candidates"),
    ("if (!restrict_mask[r * C + j]) s[j] = BF16_NEG_INF;", "if (!restrict_mask[r * C + j]) s[j] = s[j];", "restricted"),
    ("picked[i] < visible[r] ? picked[i] : -1", "picked[i] <= visible[r] ? picked[i] : -1", "plain"),
    ("qsort(picked, (size_t)k, sizeof(int64_t), ascending);", "", "plain"),
    ("q + r * Hi * Di, w + r * Hi,", "q + r * Hi * Di, w,", "plain"),
    ("dsv41_rope(1, N, Hi, Di, R, 1, 1, 0, q_raw, phases, q);", "memcpy(q, q_raw, (size_t)(N * Hi * Di) * 2);", "plain"),
    ("dsv41_rope(1, G, 1, Di, R, 1, 1, 0, keys, phases, rotated_keys);",
     "dsv41_rope(1, G, 1, Di, R, 1, 1, 1, keys, phases, rotated_keys);", "publish"),
    ("dsv41_rms_norm(G, Dh, eps, own, 1, norm, norm_bf16, own);", "", "publish"),
])
def test_a_mutated_compressed_branch_is_caught(old, new, check, tmp_path, monkeypatch):
    lib = mutated_library("compressed.c", old, new, tmp_path, monkeypatch)
    monkeypatch.setattr(native, "_library", lambda: lib)
    with pytest.raises(AssertionError):
        if check == "publish":
            test_a_kv_sources_new_rows_are_one_native_call_with_the_bits_of_the_calls(True, torch.bfloat16)
        else:
            test_a_decode_steps_choice_is_one_native_call_with_the_bits_of_the_calls(check)
