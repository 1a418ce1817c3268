"""Sampling: each transform against an independent formula, determinism under an explicit
generator, and the empirical distribution of draws."""

import math

import pytest
import torch

from dsv41.engine.sampling import SamplingParams, probabilities, sample


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _logits(seed, batch=4, vocab=50, scale=3.0):
    return torch.randn(batch, vocab, generator=_gen(seed)) * scale


def _support(probs_row):
    return set(torch.nonzero(probs_row > 0).flatten().tolist())


def test_greedy_is_argmax():
    logits = _logits(0, batch=8)
    tokens = sample(logits, SamplingParams(temperature=0.0), generator=None)
    assert tokens.dtype == torch.long and tokens.shape == (8,)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    probs = probabilities(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_no_filters_is_plain_softmax_with_temperature():
    logits = _logits(1)
    probs = probabilities(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, dim=-1))


@pytest.mark.parametrize("k", [1, 5, 17])
def test_top_k_keeps_exactly_k(k):
    logits = _logits(2)
    probs = probabilities(logits, SamplingParams(top_k=k))
    for row in range(logits.shape[0]):
        expected = set(torch.argsort(logits[row], descending=True)[:k].tolist())
        assert _support(probs[row]) == expected
        kept = torch.tensor(sorted(expected))
        torch.testing.assert_close(probs[row, kept], torch.softmax(logits[row, kept], dim=-1))


def _slow_top_p_support(probs_row, top_p):
    # Walk tokens by descending probability; stop once the collected mass reaches top_p.
    pairs = sorted(enumerate(probs_row.double().tolist()), key=lambda kv: -kv[1])
    kept, mass = set(), 0.0
    for token, p in pairs:
        kept.add(token)
        mass += p
        if mass >= top_p:
            break
    return kept, [p for _, p in pairs]


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_is_the_minimal_prefix(top_p):
    logits = _logits(3, batch=16)
    probs = probabilities(logits, SamplingParams(top_p=top_p))
    full = torch.softmax(logits, dim=-1)
    for row in range(logits.shape[0]):
        expected, ordered = _slow_top_p_support(full[row], top_p)
        prefix_masses = [sum(ordered[: i + 1]) for i in range(len(ordered))]
        if min(abs(m - top_p) for m in prefix_masses) < 1e-5:
            continue  # too close to a boundary to be decided in fp32
        assert _support(probs[row]) == expected
        assert math.isclose(float(probs[row].sum()), 1.0, rel_tol=1e-5)


def test_top_p_always_keeps_one_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    probs = probabilities(logits, SamplingParams(top_p=1e-9))
    assert _support(probs[0]) == {0} and float(probs[0, 0]) == 1.0


def test_min_p():
    logits = _logits(4, batch=6, vocab=30, scale=2.0)
    probs = probabilities(logits, SamplingParams(min_p=0.1))
    full = torch.softmax(logits, dim=-1)
    for row in range(6):
        floor = 0.1 * float(full[row].max())
        expected = {v for v in range(30) if float(full[row, v]) >= floor}
        assert _support(probs[row]) == expected
        kept = torch.tensor(sorted(expected))
        torch.testing.assert_close(probs[row, kept], full[row, kept] / full[row, kept].sum())


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0],
                           [1.0, 1.0, -1.0, 0.0, 1.8]])
    history = [[0, 1, 1], [2, 3, 4, 4]]
    # Seen tokens: positive logits / 2, negative * 2, zero stays zero.
    penalised = torch.tensor([[1.0, -2.0, 0.5, 3.0, -2.0],
                              [1.0, 1.0, -2.0, 0.0, 0.9]])
    params = SamplingParams(repetition_penalty=2.0)
    torch.testing.assert_close(probabilities(logits, params, history),
                               torch.softmax(penalised, dim=-1))
    padded = torch.tensor([[0, 1, 1, -1], [2, 3, 4, 4]])
    torch.testing.assert_close(probabilities(logits, params, padded),
                               torch.softmax(penalised, dim=-1))
    # The penalty moves row 1's argmax from the repeated token 4 to token 0.
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert logits.argmax(-1).tolist() == [3, 4]
    assert sample(logits, greedy, None, history).tolist() == [3, 0]


def test_repetition_penalty_rejects_out_of_vocab_history():
    with pytest.raises(ValueError, match="vocab"):
        probabilities(torch.zeros(1, 4), SamplingParams(repetition_penalty=1.2), [[4]])


def test_logit_bias_is_added_to_the_logits_after_the_penalty_and_before_temperature():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, logit_bias=((1, 4.0), (3, -1.5)))
    # by hand: token 3 was seen (3 / 2 = 1.5), then the biases, then / 0.5, in float64
    expected = torch.tensor([[2.0, 3.0, 0.5, 0.0, -2.0]], dtype=torch.float64) / 0.5
    got = probabilities(logits, params, [[3]])
    torch.testing.assert_close(got.double(), torch.softmax(expected, dim=-1), rtol=1e-6, atol=1e-7)
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0]]                 # the caller's logits are kept
    assert sample(logits, SamplingParams(temperature=0.0, logit_bias=((4, 100.0),)), None).tolist() == [4]
    assert sample(logits, SamplingParams(temperature=0.0, logit_bias=((3, -100.0),)), None).tolist() == [0]
    with pytest.raises(ValueError, match="logit_bias names token 5; the vocabulary has 5"):
        probabilities(logits, SamplingParams(logit_bias=((5, 1.0),)))


def test_same_seed_same_tokens_and_different_seed_differs():
    flat = torch.zeros(64, 1000)
    params = SamplingParams()
    first = sample(flat, params, _gen(123))
    assert torch.equal(first, sample(flat, params, _gen(123)))
    assert not torch.equal(first, sample(flat, params, _gen(124)))


def test_global_rng_is_untouched():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    sample(_logits(5), SamplingParams(top_p=0.9, top_k=10, min_p=0.01), _gen(0))
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ValueError, match="Generator"):
        sample(_logits(5), SamplingParams(), None)


def test_sample_draws_from_probabilities():
    logits = _logits(6, batch=32)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    probs = probabilities(logits, params)
    expected = torch.multinomial(probs, 1, generator=_gen(9)).squeeze(-1)
    assert torch.equal(sample(logits, params, _gen(9)), expected)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.6, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
])
def test_empirical_frequencies_match(params):
    draws = 20000
    logits = torch.tensor([[1.5, 1.0, 0.5, 0.0, -0.5, -1.0]]).repeat(draws, 1)
    tokens = sample(logits, params, _gen(2024))
    freq = torch.bincount(tokens, minlength=6).double() / draws
    probs = probabilities(logits[:1], params)[0].double()
    # 5 standard errors of a Bernoulli frequency at n = 20000.
    tolerance = 5 * torch.sqrt(probs * (1 - probs) / draws) + 1e-12
    assert torch.all((freq - probs).abs() <= tolerance), (freq, probs)
    assert torch.all(freq[probs == 0] == 0)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("logit_bias", ((1, 100.5),)), ("logit_bias", ((-1, 0.0),)), ("logit_bias", ((1, 1.0), (1, 2.0))),
    ("logit_bias", [(1, 1.0)]), ("logit_bias", ((True, 1.0),)), ("logit_bias", ((1, float("nan")),)),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_params_are_frozen():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5


def test_logits_must_be_2d():
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        probabilities(torch.zeros(5), SamplingParams())
