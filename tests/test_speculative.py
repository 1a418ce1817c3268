"""Speculative decoding with DSpark: the acceptance rule is lossless, rollback restores the cache, and
greedy speculation reproduces greedy decoding token for token (GENERATION-AND-DSPARK.md §3)."""

from __future__ import annotations

import pytest
import torch

import helpers
from dsv41.model.dspark import Draft
from dsv41.engine.speculative import accept_drafts, speculative_generate


def test_acceptance_rule_reproduces_the_target_distribution():
    """First emitted token ~ p_target whatever p_draft is (Monte Carlo, 20,000 draws)."""
    p_t = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    p_d = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20_000):
        d = torch.multinomial(p_d[0], 1, generator=gen)
        accepted, following = accept_drafts(p_t, p_d, d, gen)
        counts[int(d) if accepted else following] += 1
    torch.testing.assert_close(counts / counts.sum(), p_t[0], rtol=0, atol=0.015)


def test_greedy_acceptance_is_argmax_agreement():
    p_t = torch.eye(5)[[2, 4, 1]]                                # one-hot targets: 2, 4, then bonus 1
    p_d = torch.eye(5)[[2, 3]]
    gen = torch.Generator().manual_seed(0)
    assert accept_drafts(p_t, p_d, torch.tensor([2, 3]), gen) == (1, 4)   # 2 kept, 3 rejected → 4
    assert accept_drafts(p_t, torch.eye(5)[[2, 4]], torch.tensor([2, 4]), gen) == (2, 1)   # bonus


@pytest.fixture(scope="module")
def model():
    """Binding choices (top-2 of 4 experts, top-4 positions, 2 candidate blocks) in reference numerics:
    a verify pass must choose what the decode steps choose (ties included) for greedy equality to hold."""
    return helpers.build(helpers.binding_config(), "reference", seed=2)



def test_greedy_speculation_equals_greedy_decoding(model):
    prompt = helpers.token_ids(1, 12, seed=3)[0].tolist()
    expect = helpers.greedy_tokens(model, prompt, 30)
    result = speculative_generate(model, prompt, 30)
    assert result.token_ids == expect
    assert result.stats.cycles > 0


def test_partly_accepted_drafts_roll_the_cache_back(model, monkeypatch):
    """A drafter that proposes the target's own next two tokens, then a wrong one: two drafts are
    accepted per cycle, the third is rejected and its positions rolled back; the output is still
    exactly greedy decoding (with no rollback the ring and pooling tail would hold rejected tokens)."""
    prompt = helpers.token_ids(1, 9, seed=4)[0].tolist()
    expect = helpers.greedy_tokens(model, prompt, 40)
    V, Bs = model.cfg.vocab_size, model.cfg.dspark_block_size

    def oracle_draft(token, last_pos, cache, choose=None):
        j = last_pos + 1 - len(prompt)                            # expect[j] is the token of position last_pos + 1
        wanted = [expect[j + i] if i <= 2 and j + i < len(expect) else (expect[min(j + i, 39)] + 1) % V
                  for i in range(1, Bs + 1)]
        wanted[2] = (wanted[2] + 1) % V                            # the third draft is always wrong
        logits = torch.full((1, Bs, V), -10.0)
        ids = token.new_empty(1, Bs + 1)
        ids[:, 0] = token
        for i, w in enumerate(wanted):
            logits[0, i, w] = 10.0
            ids[:, i + 1] = choose(logits[:, i])
        return Draft(ids=ids, logits=logits, confidence=torch.zeros(1, Bs))

    monkeypatch.setattr(model, "dspark_draft", oracle_draft)
    result = speculative_generate(model, prompt, 40)
    assert result.token_ids == expect
    assert result.stats.accepted >= 2 * (result.stats.cycles - 1)
    assert result.stats.per_position[2] == 0


def test_speculation_needs_dspark():
    plain = helpers.build(helpers.without_dspark(helpers.nonbinding_config()), "fast")
    with pytest.raises(RuntimeError, match="DSpark"):
        speculative_generate(plain, [1, 2, 3], 4)


def test_rollback_restores_ring_and_tail(model):
    """Verify-and-reject by hand, at an even and an odd boundary of the ratio-2 groups."""
    ids = helpers.token_ids(1, 30, seed=3)
    wrong = helpers.token_ids(1, 30, seed=99)
    straight = model.new_cache(1, helpers.MAX_SEQ)
    model(ids[:, :20], 0, straight)
    expect = model(ids[:, 20:30], 20, straight).hidden
    for keep in (0, 2, 3):
        cache = model.new_cache(1, helpers.MAX_SEQ)
        model(ids[:, :17], 0, cache)
        call = torch.cat([ids[:, 17:17 + keep], wrong[:, 17 + keep:23]], 1)
        snap = cache.snapshot(17, 6)
        model(call, 17, cache)
        cache.rollback(snap, keep)
        got = model(ids[:, 17 + keep:30], 17 + keep, cache).hidden[:, 3 - keep:]
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-4)


def test_repetition_penalty_is_refused(model):
    from dsv41.engine.sampling import SamplingParams

    with pytest.raises(ValueError, match="repetition penalty"):
        speculative_generate(model, [1, 2, 3], 4, params=SamplingParams(repetition_penalty=1.2))
