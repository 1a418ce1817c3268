"""Speculative decoding with DSpark on the engine: the acceptance rule is lossless, rollback restores the
cache row by row, and greedy speculation reproduces greedy decoding token for token, for many rows at
once (docs/GENERATION-AND-DSPARK.md §3)."""

from __future__ import annotations

import pytest
import torch

import helpers
from dsv41.model.dspark import Draft
from dsv41.engine.engine import Engine, EngineConfig
from dsv41.engine.request import Request
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.speculative import accept_drafts


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
    [c] = helpers.engine_run(model, [prompt], 30, speculative=True)
    assert c.token_ids == helpers.greedy_tokens(model, prompt, 30)
    assert c.drafted > 0


def test_rows_verify_their_own_drafts_in_one_forward(model):
    """Four requests at different lengths speculate side by side (each verify row accepts its own prefix
    and rolls back its own suffix), beside one that does not speculate: each equals its greedy run."""
    prompts = [helpers.token_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 12, 7, 20, 5)]
    engine = Engine(model, None, EngineConfig(n_slots=5, speculative=True))
    for i, p in enumerate(prompts):
        engine.submit(Request(tuple(p), max_new_tokens=18, sampling=SamplingParams(temperature=0.0),
                              ignore_eos=True, speculative=i != 2))
    done = sorted((e.completion for e in engine.run() if e.completion), key=lambda c: c.request)
    for p, c in zip(prompts, done):
        assert c.token_ids == helpers.greedy_tokens(model, p, 18)
    assert [c.drafted > 0 for c in done] == [True, True, False, True, True]


def test_sampled_speculation_with_a_seed_is_the_same_alone_and_in_a_batch(model):
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    prompts = [helpers.token_ids(1, n, seed=20 + n)[0].tolist() for n in (4, 9, 15)]
    together = helpers.engine_run(model, prompts, 16, speculative=True, sampling=sampling, seeds=[5, 6, 7])
    for p, seed, c in zip(prompts, (5, 6, 7), together):
        [alone] = helpers.engine_run(model, [p], 16, speculative=True, sampling=sampling, seeds=[seed])
        assert alone.token_ids == c.token_ids


def oracle_drafter(model, prompts, expect):
    """A DSpark stand-in proposing each row's true next two tokens and then a wrong one (then guesses)."""
    V, Bs = model.cfg.vocab_size, model.cfg.dspark_block_size
    by_prompt_len = {len(p): e for p, e in zip(prompts, expect)}
    lengths = {}

    def draft(token, last_pos, cache, choose=None, *, slots=None):
        B = token.shape[0]
        ids = token.new_empty(B, Bs + 1)
        ids[:, 0] = token
        logits = torch.full((B, Bs, V), -10.0)
        for b, (slot, last) in enumerate(zip(slots, last_pos)):
            wanted_from = by_prompt_len[lengths.setdefault(slot, last + 1)]
            j = last + 1 - lengths[slot]                     # wanted_from[j] is the token of position last + 1
            for i in range(Bs):
                w = wanted_from[min(j + i + 1, len(wanted_from) - 1)]
                logits[b, i, w if i < 2 else (w + 1) % V] = 10.0
        for i in range(Bs):
            ids[:, i + 1] = choose(logits[:, i])
        return Draft(ids=ids, logits=logits, confidence=torch.zeros(B, Bs))
    return draft


def test_partly_accepted_drafts_roll_the_cache_back(model, monkeypatch):
    """A drafter that proposes each row's own next two tokens, then a wrong one: two drafts are accepted
    per cycle, the third is rejected and its positions rolled back, row by row; the output is still
    exactly greedy decoding (with no rollback the ring and pooling tail would hold rejected tokens)."""
    prompts = [helpers.token_ids(1, n, seed=4 + n)[0].tolist() for n in (9, 14)]
    expect = [helpers.greedy_tokens(model, p, 40) for p in prompts]
    monkeypatch.setattr(model, "dspark_draft", oracle_drafter(model, prompts, expect))
    done = helpers.engine_run(model, prompts, 40, speculative=True)
    for c, e in zip(done, expect):
        assert c.token_ids == e
        assert c.accepted >= 2 * (c.drafted // model.cfg.dspark_block_size - 1) and c.accepted < c.drafted


def test_speculation_needs_dspark():
    plain = helpers.build(helpers.without_dspark(helpers.nonbinding_config()), "fast")
    with pytest.raises(ValueError, match="DSpark"):
        helpers.engine_run(plain, [[1, 2, 3]], 4, speculative=True)


def test_rollback_restores_ring_and_tail(model):
    """Verify-and-reject by hand, at an even and an odd boundary of the ratio-2 groups, for two rows at
    different positions in one call."""
    ids = helpers.token_ids(2, 30, seed=3)
    wrong = helpers.token_ids(2, 30, seed=99)
    straight = model.new_cache(2, helpers.MAX_SEQ)
    model(ids[:, :20], 0, straight)
    expect = model(ids[:, 20:30], 20, straight).hidden
    for keep in ((0, 2), (3, 0), (2, 3)):
        cache = model.new_cache(2, helpers.MAX_SEQ)
        model(ids[:, :17], 0, cache)
        step = model.step((0, 1), (17, 17), (6, 6))
        call = torch.cat([torch.cat([ids[b, 17:17 + k], wrong[b, 17 + k:23]]) for b, k in enumerate(keep)])
        snap = cache.snapshot(step)
        model(call, step, cache)
        cache.rollback(snap, list(keep))
        for b, k in enumerate(keep):
            rest = model.step((b,), (17 + k,), (13 - k,))
            got = model(ids[b, 17 + k:30], rest, cache).hidden[3 - k:]
            torch.testing.assert_close(got, expect[b], rtol=0, atol=1e-4)


def test_rollback_of_a_decode_step_restores_the_tails(model):
    """A decode step's rows pool together (`Compressor.decode_rows`, one position each): rolled back, a
    row that completed a ratio-2 group (position 17) and one that opened a group (position 18) continue
    exactly as if the wrong tokens had never been fed."""
    ids = helpers.token_ids(2, 30, seed=4)
    wrong = helpers.token_ids(2, 30, seed=98)
    expect = [model(ids[b:b + 1], 0, model.new_cache(1, helpers.MAX_SEQ)).hidden[0] for b in range(2)]
    for keep in ((0, 0), (1, 0), (0, 1)):
        cache = model.new_cache(2, helpers.MAX_SEQ)
        model(ids[0, :17], model.step((0,), (0,), (17,)), cache)
        model(ids[1, :18], model.step((1,), (0,), (18,)), cache)
        step = model.step((0, 1), (17, 18), (1, 1))
        call = torch.stack([(ids if k else wrong)[b, 17 + b] for b, k in enumerate(keep)])
        snap = cache.snapshot(step)
        model(call, step, cache)
        cache.rollback(snap, list(keep))
        for b, k in enumerate(keep):
            start = 17 + b + k
            got = model(ids[b, start:30], model.step((b,), (start,), (30 - start,)), cache).hidden
            assert torch.equal(got, expect[b][start:]), keep


def test_repetition_penalty_is_refused(model):
    with pytest.raises(ValueError, match="repetition penalty"):
        helpers.engine_run(model, [[1, 2, 3]], 4, speculative=True, sampling=SamplingParams(repetition_penalty=1.2))
