"""DSpark draft stages (docs/ARCHITECTURE.md §15): rings, drafting, the Markov chain, the confidence head.

Bit-for-bit agreement with the public reference is measured by tools/reference_parity.py (the reference
is not shipped); these tests check the contract against direct computations.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from dsv41.errors import InputError
from dsv41.checkpoint.model_io import load_model, save_model
from dsv41.config import RuntimeConfig


@pytest.fixture(scope="module")
def fast_model():
    return helpers.build(helpers.nonbinding_config(), "fast", seed=3)


def _prefill(model, ids, observe_rows=None):
    cache = model.new_cache(ids.shape[0], helpers.MAX_SEQ)
    out = model(ids, 0, cache)
    model.dspark_observe(out.dspark_hidden, 0, cache)
    return cache, out


def test_observing_rows_at_once_equals_one_by_one(fast_model):
    ids = helpers.token_ids(2, 20, seed=4)
    whole, out = _prefill(fast_model, ids)
    split = fast_model.new_cache(2, helpers.MAX_SEQ)
    fast_model(ids, 0, split)
    for p in range(20):                                          # the reference's one row per call
        fast_model.dspark_observe(out.dspark_hidden[:, p:p + 1], p, split)
    for stage in fast_model.mtp:
        layer = stage.attn.role.layer_id
        torch.testing.assert_close(whole.window[layer], split.window[layer], rtol=0, atol=1e-5)


def test_drafts_depend_only_on_the_observed_rows_and_leave_the_cache_alone():
    """A draft is a function of the token and the main rows observed so far: observed at once after a
    prefill, or row by row after decode steps, the drafts are bit-identical (reference numerics,
    invariant kernels); drafting writes nothing; greedy drafts are the argmax chain of their rows."""
    model = helpers.build(helpers.binding_config(), "reference", seed=3)
    cfg, ids = model.cfg, helpers.token_ids(2, 20, seed=5)
    cache, out = _prefill(model, ids)
    stepped = model.new_cache(2, helpers.MAX_SEQ)
    for p in range(20):
        o = model(ids[:, p:p + 1], p, stepped)
        model.dspark_observe(o.dspark_hidden, p, stepped)
    token = model.logits(out.hidden[:, -1]).argmax(-1)
    rings = {k: v.clone() for k, v in cache.window.items()}
    a, b = model.dspark_draft(token, 19, cache), model.dspark_draft(token, 19, stepped)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logits, b.logits) and torch.equal(a.confidence, b.confidence)
    assert all(torch.equal(rings[k], cache.window[k]) for k in rings)
    assert torch.equal(a.ids[:, 0], token) and torch.equal(a.ids[:, 1:], a.logits.argmax(-1))
    # the drafts read the rings: observing other rows changes them
    other = model.new_cache(2, helpers.MAX_SEQ)
    model(ids, 0, other)
    model.dspark_observe(model(ids.flip(1), 0, model.new_cache(2, helpers.MAX_SEQ)).dspark_hidden, 0, other)
    assert not torch.equal(model.dspark_draft(token, 19, other).logits, a.logits)
    assert a.logits.shape == (2, cfg.dspark_block_size, cfg.vocab_size)


def test_markov_bias_and_confidence_follow_the_formula(fast_model):
    """Row i's logits carry + M_head · M_embed[id_i] and c_i = proj([z_i; M_embed[id_i]]) (§15): two drafts
    from the same state that choose different first drafts differ in row 1 by exactly those terms."""
    ids = helpers.token_ids(1, 10, seed=6)
    cache, _ = _prefill(fast_model, ids)
    token = torch.tensor([7])
    a = fast_model.dspark_draft(token, 9, cache, choose=lambda row: torch.full_like(row[:, 0], 3).long())
    b = fast_model.dspark_draft(token, 9, cache, choose=lambda row: torch.full_like(row[:, 0], 11).long())
    assert a.ids[0, 1] == 3 and b.ids[0, 1] == 11
    torch.testing.assert_close(a.logits[:, 0], b.logits[:, 0], rtol=0, atol=0)     # row 0: the same token
    last = fast_model.mtp[-1]
    embed, head = last.markov_head.embed.weight.float(), last.markov_head.head.weight.float()
    delta = embed[3] - embed[11]                                                    # [Rm]
    torch.testing.assert_close(a.logits[0, 1] - b.logits[0, 1], head @ delta, rtol=1e-4, atol=1e-4)
    w_markov = last.confidence_head.proj.weight.float()[0, fast_model.cfg.dim:]
    torch.testing.assert_close(a.confidence[0, 1] - b.confidence[0, 1], w_markov @ delta, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.confidence[0, 0], b.confidence[0, 0], rtol=0, atol=0)


def test_drafts_need_dspark_stages():
    model = helpers.build(helpers.without_dspark(helpers.nonbinding_config()), "fast")
    with pytest.raises(InputError, match="no DSpark stages"):
        model.dspark_draft(torch.tensor([1]), 0, model.new_cache(1, helpers.MAX_SEQ))


def test_dspark_weights_round_trip_through_the_released_layout(tmp_path):
    model = helpers.build(helpers.binding_config(), "reference", seed=8)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path, RuntimeConfig(max_seq_len=helpers.MAX_SEQ))
    names = [n for n in loaded.state_dict() if n.startswith("mtp.")]
    assert "mtp.0.main_proj.weight" in names and "mtp.1.markov_head.head.weight" in names
    ids = helpers.token_ids(1, 14, seed=9)
    drafts = []
    for m in (model, loaded):
        cache, out = _prefill(m, ids)
        drafts.append(m.dspark_draft(m.logits(out.hidden[:, -1]).argmax(-1), 13, cache))
    assert torch.equal(drafts[0].ids, drafts[1].ids)
    assert torch.equal(drafts[0].logits, drafts[1].logits)
    assert torch.equal(drafts[0].confidence, drafts[1].confidence)
