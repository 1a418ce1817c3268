"""The continuous-batching engine: rows at their own positions in one forward, admission to a slot pool,
token-budget scheduling, cancellation, per-request seeds, and prefix reuse.

Scheduling and bookkeeping run on a mock model whose next token after t is (t + 1) mod V
(tests/test_generate.py), so every call pattern is exact; numerics run on the demo model (reference
numerics, invariant kernels: bit-for-bit comparisons are meaningful).
"""

from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.config import RuntimeConfig
from dsv41.engine.engine import Engine, EngineConfig
from dsv41.engine.request import Request
from dsv41.engine.sampling import SamplingParams
from dsv41.tokenizer import Tokenizer

from test_generate import SuccessorModel

GREEDY = SamplingParams(temperature=0.0)


def completions(engine: Engine, events: list | None = None) -> list:
    """Run to the end → the completions by request id (token events appended to `events`)."""
    done = []
    for e in engine.run():
        if e.completion is not None:
            done.append(e.completion)
        elif events is not None:
            events.append(e)
    return sorted(done, key=lambda c: c.request)


@pytest.fixture(scope="module")
def tok(demo_dir):
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def demo(demo_dir):
    return dsv41.load(demo_dir, RuntimeConfig(max_seq_len=128))


# ------------------------------------------------------------------------------------------ the model

@torch.no_grad()
def test_a_forward_mixing_prefill_decode_and_verify_rows_equals_each_row_alone(demo):
    """Slot 0 prefills a chunk at 0, slot 1 decodes at 20, slot 2 verifies 6 positions at 13 — in one
    forward — and each row's hidden states and DSpark rows are bit-identical to running that row alone
    (Engram hashing, window rings, pooling tails and compressed rows all per slot)."""
    g = torch.Generator().manual_seed(7)
    history = {s: torch.randint(3, demo.cfg.vocab_size, (40,), generator=g) for s in range(3)}
    rows = [(0, 0, 7), (1, 20, 1), (2, 13, 6)]                               # (slot, start, count)

    def prepared(cache, slot, history_row):
        """Feed positions 0 … start − 1 of a row's history into `slot` of `cache`."""
        start = {r[0]: r[1] for r in rows}[history_row]
        if start:
            demo(history[history_row][:start], demo.step((slot,), (0,), (start,)), cache)
        return cache

    mixed_cache = demo.new_cache(3, 64)
    for slot in range(3):
        prepared(mixed_cache, slot, slot)
    ids = torch.cat([history[slot][start:start + count] for slot, start, count in rows])
    mixed = demo(ids, demo.step(*zip(*rows)), mixed_cache)
    first = 0
    for slot, start, count in rows:
        alone_cache = prepared(demo.new_cache(1, 64), 0, slot)
        alone = demo(history[slot][start:start + count], demo.step((0,), (start,), (count,)), alone_cache)
        assert torch.equal(mixed.hidden[first:first + count], alone.hidden), slot
        assert torch.equal(mixed.dspark_hidden[first:first + count], alone.dspark_hidden), slot
        first += count


# ------------------------------------------------------------------------------------------ scheduling (mock)

def test_requests_wait_for_a_free_slot_and_take_it_when_one_leaves(tok):
    mock = SuccessorModel(tok.vocab_size)
    engine = Engine(mock, tok, EngineConfig(n_slots=2, prefix_cache=0))
    for start in (10, 20, 30, 40, 50):
        engine.submit(Request((start,), max_new_tokens=3, sampling=GREEDY))
    engine.step()
    assert engine.queue_depth == 3 and len(engine.running) == 2
    done = completions(engine)
    assert [c.token_ids for c in done] == [[s + 1, s + 2, s + 3] for s in (10, 20, 30, 40, 50)]
    assert max(len(call) for call in mock.calls) == 2                   # never more rows than slots


def test_a_logit_bias_past_the_vocabulary_is_refused_at_submit_and_running_rows_go_on(tok):
    engine = Engine(SuccessorModel(tok.vocab_size), tok, EngineConfig(n_slots=2, prefix_cache=0))
    engine.submit(Request((10,), max_new_tokens=3, sampling=GREEDY))
    engine.step()
    bad = SamplingParams(temperature=0.0, logit_bias=((tok.vocab_size, 5.0),))
    with pytest.raises(ValueError, match=f"logit_bias names token {tok.vocab_size}; the vocabulary has"):
        engine.submit(Request((20,), max_new_tokens=3, sampling=bad))
    forced = SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))
    engine.submit(Request((30,), max_new_tokens=2, sampling=forced))
    assert [c.token_ids for c in completions(engine)] == [[11, 12, 13], [7, 7]]


def test_a_long_prompt_is_prefilled_in_chunks_beside_decoding_rows(tok):
    mock = SuccessorModel(tok.vocab_size)
    engine = Engine(mock, tok, EngineConfig(n_slots=2, token_budget=8, prefill_chunk=8, prefix_cache=0))
    engine.submit(Request((100,), max_new_tokens=6, sampling=GREEDY))
    engine.step()                                                        # request 0 prefilled, now decoding
    engine.submit(Request(tuple(range(200, 230)), max_new_tokens=2, sampling=GREEDY))
    done = completions(engine)
    assert done[0].token_ids == [101, 102, 103, 104, 105, 106] and done[1].token_ids == [230, 231]
    # the 30-token prompt goes in chunks of at most 7 beside request 0's decode row (budget 8)
    assert mock.calls[1:6] == [((1, 1), (0, 7)), ((2, 1), (7, 7)), ((3, 1), (14, 7)), ((4, 1), (21, 7)),
                               ((5, 1), (28, 2))]
    assert all(sum(n for _, n in call) <= 8 for call in mock.calls)


def test_cancel_frees_the_slot_for_the_next_request(tok):
    mock = SuccessorModel(tok.vocab_size)
    engine = Engine(mock, tok, EngineConfig(n_slots=1, prefix_cache=0))
    first = engine.submit(Request((10,), max_new_tokens=50, sampling=GREEDY))
    second = engine.submit(Request((500,), max_new_tokens=2, sampling=GREEDY))
    engine.step()
    engine.step()
    [event] = engine.cancel(first)
    assert event.completion.finish_reason == "cancelled" and event.completion.token_ids == [11, 12]
    done = completions(engine)
    assert [c.request for c in done] == [second] and done[0].token_ids == [501, 502]
    assert engine.cancel(first) == []                                    # already over


# ------------------------------------------------------------------------------------------ seeds (demo)

def test_a_seeded_request_samples_the_same_alone_and_beside_others(demo, tok):
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    prompts = [tok.encode(t) for t in ("Hello", "The quick brown fox", "Numbers: 1 2 3")]

    def run(ps, seeds, n_slots):
        engine = Engine(demo, tok, EngineConfig(n_slots=n_slots))
        for p, seed in zip(ps, seeds):
            engine.submit(Request(tuple(p), max_new_tokens=12, sampling=sampling, seed=seed, ignore_eos=True))
        return completions(engine)

    together = run(prompts, (11, 12, 13), 3)
    for p, seed, c in zip(prompts, (11, 12, 13), together):
        assert run([p], (seed,), 1)[0].token_ids == c.token_ids
    assert together[0].token_ids != run([prompts[0]], (99,), 1)[0].token_ids


# ------------------------------------------------------------------------------------------ prefix reuse (demo)

def second_turn(tok, first_prompt, first):
    return list(first_prompt) + first.token_ids + [tok.eos_id] + tok.encode(" and then?")


def test_prefix_reuse_continues_the_kept_slot_and_equals_a_cold_run(demo, tok):
    """Turn 2's prompt extends turn 1's prompt and completion: the engine continues the kept slot (no
    recomputation of the kept positions) and gives the cold run's bits: the generated tokens and the
    log-probabilities of each, with the 20 most likely alternatives."""
    first_prompt = tok.encode("User: what is the capital of France? Assistant:")
    warm = Engine(demo, tok, EngineConfig(n_slots=2))
    warm.submit(Request(tuple(first_prompt), max_new_tokens=10, sampling=GREEDY, ignore_eos=True))
    [first] = completions(warm)
    prompt = second_turn(tok, first_prompt, first)
    warm.submit(Request(tuple(prompt), max_new_tokens=10, sampling=GREEDY, ignore_eos=True, logprobs=20))
    before = warm.stats.tokens
    warm_events, ref_events = [], []
    [reused] = completions(warm, events=warm_events)
    kept = len(first_prompt) + 9                         # the 10th token was sampled, never fed
    assert reused.cached_tokens == kept and warm.stats.prefix_hits == 1
    assert warm.stats.tokens - before == (len(prompt) - kept) + 9        # only new positions were fed

    cold = Engine(demo, tok, EngineConfig(n_slots=1))
    cold.submit(Request(tuple(prompt), max_new_tokens=10, sampling=GREEDY, ignore_eos=True, logprobs=20))
    [ref] = completions(cold, events=ref_events)
    assert ref.cached_tokens == 0
    assert reused.token_ids == ref.token_ids
    assert [(e.logprob, e.top_logprobs) for e in warm_events] == [(e.logprob, e.top_logprobs) for e in ref_events]
    assert all(e.top_logprobs and len(e.top_logprobs) == 20 for e in ref_events)


def test_prefix_reuse_needs_the_whole_kept_sequence(demo, tok):
    """A prompt that shares only part of a kept sequence, or equals it, gets a cold prefill: the ring and
    the pooling tail cannot be cut back to an earlier length."""
    first_prompt = tok.encode("The quick brown fox jumps over the lazy dog.")
    engine = Engine(demo, tok, EngineConfig(n_slots=2))
    engine.submit(Request(tuple(first_prompt), max_new_tokens=4, sampling=GREEDY, ignore_eos=True))
    [first] = completions(engine)
    engine.submit(Request(tuple(first_prompt[:-3] + [7, 8, 9, 10]), max_new_tokens=2, sampling=GREEDY))
    assert completions(engine)[0].cached_tokens == 0
    # the partial match above took no slot from the kept sequence; an extension still finds it
    engine.submit(Request(tuple(first_prompt + first.token_ids + [5]), max_new_tokens=2, sampling=GREEDY))
    assert completions(engine)[0].cached_tokens == len(first_prompt) + 3


def test_kept_sequences_give_way_to_new_requests(tok):
    """Kept sequences occupy idle slots only: a request that needs a slot evicts the least recently kept."""
    mock = SuccessorModel(tok.vocab_size)
    engine = Engine(mock, tok, EngineConfig(n_slots=2))
    for start in (10, 20):
        engine.submit(Request((start,), max_new_tokens=2, sampling=GREEDY))
    completions(engine)
    assert len(engine.prefix) == 2 and not engine.free
    engine.submit(Request((30,), max_new_tokens=2, sampling=GREEDY))            # evicts the one from 10
    completions(engine)
    engine.submit(Request((20, 21, 22), max_new_tokens=1, sampling=GREEDY))     # extends the one from 20
    engine.submit(Request((10, 11, 12), max_new_tokens=1, sampling=GREEDY))     # its slot is gone
    done = completions(engine)
    assert [c.cached_tokens for c in done] == [2, 0]


def test_a_request_for_prompt_logits_computes_every_position_even_after_a_kept_prefix(tok):
    """Prompt logits promise entry t for every prompt token t, so such a request never continues a kept
    sequence (scoring after a chat turn must not come back short)."""
    mock = SuccessorModel(tok.vocab_size)
    engine = Engine(mock, tok, EngineConfig(n_slots=2))
    engine.submit(Request((10, 11), max_new_tokens=3, sampling=GREEDY))
    [first] = completions(engine)
    prompt = (10, 11) + tuple(first.token_ids) + (40,)
    engine.submit(Request(prompt, max_new_tokens=0, prompt_logits=True))
    [scored] = completions(engine)
    assert scored.cached_tokens == 0 and scored.prompt_logits.shape[0] == len(prompt)
    assert scored.prompt_logits.argmax(-1).tolist() == [(t + 1) % tok.vocab_size for t in prompt]
