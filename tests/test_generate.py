"""Engine, tokenizer wrapper and scoring.

Stop rules, teacher forcing and call patterns are checked exactly against a mock model whose next
token is (last token + 1) mod V; batching, chunked prefill, seeds and scoring run on the demo model
(random weights) and compare against generating alone, a one-shot prefill, or a log-softmax computed
here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import dsv41
from dsv41.model.cache import ModelCache
from dsv41.model.step import Step
from dsv41.chat import BOS
from dsv41.config import RuntimeConfig
from dsv41.engine.engine import GenerationConfig, generate, generate_all
from dsv41.engine.request import StopStringFilter
from dsv41.model import ModelOutput
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.score import score
from dsv41.tokenizer import REPLACEMENT_CHAR, Tokenizer, TokenizerError

GREEDY = SamplingParams(temperature=0.0)
CONTEXT = 64


@pytest.fixture(scope="module")
def tok(demo_dir):
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def ref_model(demo_dir):
    return dsv41.load(demo_dir, RuntimeConfig(max_seq_len=CONTEXT, max_batch_size=4))


@pytest.fixture(scope="module")
def fast_model(demo_dir):
    return dsv41.load(demo_dir, RuntimeConfig(max_seq_len=CONTEXT, max_batch_size=4, numerics="fast",
                                              dtype="float32"))


class SuccessorModel:
    """Mock with the engine's model interface (dsv41.engine.protocol): the next token after t is
    (t + 1) mod V. Records each forward's rows as ((start, count), …)."""

    def __init__(self, vocab: int, max_seq_len: int = CONTEXT):
        self.vocab = vocab
        self.cfg = SimpleNamespace(vocab_size=vocab, dspark_enabled=False, dspark_block_size=0)
        self.runtime = RuntimeConfig(max_seq_len=max_seq_len)
        self.device = torch.device("cpu")
        self.calls: list[tuple[tuple[int, int], ...]] = []

    def new_cache(self, n_slots: int, max_seq_len: int) -> ModelCache:
        return ModelCache(n_slots=n_slots, max_seq_len=max_seq_len, window={}, sources={})

    def step(self, slots, starts, counts) -> Step:
        return Step(tuple(slots), tuple(starts), tuple(counts))

    def __call__(self, ids: torch.Tensor, step: Step, cache: ModelCache) -> ModelOutput:
        cache.begin(step)
        cache.advance(step)
        self.calls.append(tuple(zip(step.starts, step.counts)))
        return ModelOutput(hidden=ids.float()[:, None], dspark_hidden=None)

    def logits(self, hidden: torch.Tensor, rows=None) -> torch.Tensor:
        hidden = hidden if rows is None else hidden[torch.tensor(rows)]
        successor = (hidden[..., 0].long() + 1) % self.vocab
        return 10.0 * F.one_hot(successor, self.vocab).float()


@pytest.fixture
def mock(tok):
    return SuccessorModel(tok.vocab_size)


def run(model, tok, prompts, **kw):
    kw.setdefault("sampling", GREEDY)
    return generate_all(model, tok, prompts, GenerationConfig(**kw))


def random_prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 700, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------------------------ stop rules (mock)
def test_eos_ends_the_row_and_is_not_part_of_the_completion(mock, tok):
    V = tok.vocab_size
    [c] = run(mock, tok, [[V - 5]], max_new_tokens=20)
    # V-4 … V-1, then 0 (BOS), then 1 = EOS
    assert tok.eos_id == 1
    assert c.token_ids == [V - 4, V - 3, V - 2, V - 1, 0]
    assert (c.finish_reason, c.stop, c.generated_tokens) == ("eos", 1, 6)
    assert c.text == tok.decode(c.token_ids)


def test_stop_token_id(mock, tok):
    [c] = run(mock, tok, [[100]], max_new_tokens=20, stop_token_ids=(104,))
    assert c.token_ids == [101, 102, 103]
    assert (c.finish_reason, c.stop) == ("stop", 104)


def test_max_new_tokens(mock, tok):
    [c] = run(mock, tok, [[10, 20]], max_new_tokens=4)
    assert c.token_ids == [21, 22, 23, 24]
    assert (c.finish_reason, c.generated_tokens, c.prompt_tokens) == ("length", 4, 2)


def test_context_limit(mock, tok):
    # prompt 3 + 3 generated fills a 6-position context; the cache would raise if the engine overran it
    [c] = run(mock, tok, [[7, 8, 9]], max_new_tokens=10, max_context=6)
    assert c.token_ids == [10, 11, 12]
    assert c.finish_reason == "context"
    assert max(s + t for call in mock.calls for s, t in call) <= 6


def test_prompt_filling_the_context_returns_nothing_without_a_call(mock, tok):
    [c] = run(mock, tok, [[7, 8, 9]], max_new_tokens=10, max_context=3)
    assert (c.token_ids, c.finish_reason, c.ttft_s) == ([], "context", None)
    assert mock.calls == []


def test_stop_string_is_cut_from_text_and_never_streamed(mock, tok):
    ids = list(range(401, 421))
    full = tok.decode(ids)
    # a stop string straddling the boundary between the texts of tokens 410 and 411
    cut = len(tok.decode(ids[:10]))
    stop = full[cut - 1:cut + 1]
    at = full.find(stop)
    assert 0 < at <= cut - 1 and REPLACEMENT_CHAR not in full
    events = list(generate(mock, tok, [[400]], GenerationConfig(max_new_tokens=20, sampling=GREEDY,
                                                                  stop_strings=("zzz-never", stop))))
    [c] = [e.completion for e in events if e.completion]
    assert (c.text, c.finish_reason, c.stop) == (full[:at], "stop", stop)
    # the tokens that spelled the stop string stay: generation ran up to the first token completing it
    first_k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    assert c.token_ids == ids[:first_k]
    assert "".join(e.text for e in events) == full[:at]


def test_rows_at_their_own_positions_stop_on_their_own(mock, tok):
    prompts = [[5], [100, 200, 300], [50, 51]]
    got = run(mock, tok, prompts, max_new_tokens=4, stop_token_ids=(8,))
    assert [c.token_ids for c in got] == [[6, 7], [301, 302, 303, 304], [52, 53, 54, 55]]
    assert [c.finish_reason for c in got] == ["stop", "length", "length"]
    # one forward prefills every prompt whole, then each row decodes at its own position; row 0 leaves
    # the batch as soon as it stops
    assert mock.calls == [((0, 1), (0, 3), (0, 2)), ((1, 1), (3, 1), (2, 1)), ((2, 1), (4, 1), (3, 1)),
                          ((5, 1), (4, 1))]


def test_chunked_prefill_call_pattern(mock, tok):
    [c] = run(mock, tok, [list(range(20, 27))], max_new_tokens=3, prefill_chunk=3)
    assert c.token_ids == [27, 28, 29]
    assert mock.calls == [((0, 3),), ((3, 3),), ((6, 1),), ((7, 1),), ((8, 1),)]


def test_prompt_too_long_fails_before_any_model_call(mock, tok):
    with pytest.raises(ValueError, match=r"prompt 1 has 9 tokens, more than the context of 8 tokens"):
        generate(mock, tok, [[1, 2], list(range(9))], GenerationConfig(max_context=8))
    assert mock.calls == []


def test_empty_prompt_and_bad_ids_are_rejected(mock, tok):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(mock, tok, [[]])
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 100000"):
        generate(mock, tok, [[1, 100000]])


def test_stream_events_concatenate_to_the_text(mock, tok):
    events = list(generate(mock, tok, [[300], [450, 451]], GenerationConfig(max_new_tokens=12, sampling=GREEDY)))
    for row in (0, 1):
        mine = [e for e in events if e.request == row]
        [c] = [e.completion for e in mine if e.completion]
        assert "".join(e.text for e in mine) == c.text == tok.decode(c.token_ids)
        assert [e.token_id for e in mine if e.token_id is not None] == c.token_ids


# ------------------------------------------------------------------------------------ stop-string filter
def test_stop_filter_holds_back_a_possible_prefix():
    f = StopStringFilter(("bcd",))
    assert f.push("ab") == ("a", None)
    assert f.push("c") == ("", None)
    assert f.push("x") == ("bcx", None)
    assert f.push("bc") == ("", None)
    assert f.push("de") == ("", "bcd")
    assert f.text == "abcx"


def test_stop_filter_earliest_match_wins():
    f = StopStringFilter(("o", "lo w"))
    assert f.push("hello world") == ("hel", "lo w")
    assert f.text == "hel"


# ------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_adds_no_special_tokens_and_matches_special_strings(tok):
    ids = tok.encode(BOS + "Hello")
    assert ids[0] == tok.bos_id == 0 and ids.count(0) == 1
    assert tok.decode(ids) == BOS + "Hello"
    assert tok.encode("Hello") == ids[1:]
    assert tok.encode_prompt(BOS + "Hello") == ids
    with pytest.raises(TokenizerError, match="two BOS"):
        tok.encode_prompt(BOS + BOS + "Hello")


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_stream_decoder_never_emits_partial_characters(tok):
    text = "héllo wörld 日本語 ok ✓"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())                  # multi-byte characters span several tokens
    decoder = tok.stream()
    deltas = [decoder.push(i) for i in ids] + [decoder.finish()]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == text == tok.decode(ids)


# ------------------------------------------------------------------------------------ real model
def test_batched_rows_match_generating_each_alone(ref_model, tok):
    prompts = random_prompts((3, 7, 5))
    batched = run(ref_model, tok, prompts, max_new_tokens=5, ignore_eos=True)
    alone = [run(ref_model, tok, [p], max_new_tokens=5, ignore_eos=True)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) == 5 for c in batched)


def test_same_seed_same_tokens(ref_model, tok):
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    prompts = random_prompts((4, 6))
    first, second, other = (run(ref_model, tok, prompts, max_new_tokens=5, sampling=sampling, seed=s,
                                ignore_eos=True) for s in (7, 7, 8))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_chunked_prefill_gives_the_same_greedy_tokens(fast_model, tok):
    [prompt] = random_prompts((11,), seed=5)
    one_shot = run(fast_model, tok, [prompt], max_new_tokens=5, ignore_eos=True)
    chunked = run(fast_model, tok, [prompt], max_new_tokens=5, ignore_eos=True, prefill_chunk=3)
    assert chunked[0].token_ids == one_shot[0].token_ids


def test_padded_vocabulary_is_never_sampled(tok):
    class Padded(SuccessorModel):
        def logits(self, hidden, rows=None):
            out = super().logits(hidden, rows)
            out[..., -1] = 100.0                              # an id the tokenizer cannot decode
            return out

    [c] = run(Padded(tok.vocab_size + 8), tok, [[40]], max_new_tokens=3)
    assert c.token_ids == [41, 42, 43]


# ------------------------------------------------------------------------------------ scoring
def _direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        cache = model.new_cache(1, len(ids))
        x = torch.tensor([ids])
        logits = model.logits(model(x, 0, cache).hidden)[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), x[0, 1:]]


def test_score_logprobs_match_a_direct_log_softmax(fast_model):
    seqs = random_prompts((9, 5), seed=11)
    result = score(fast_model, seqs)
    assert result.logits.shape == (2, 9, fast_model.cfg.vocab_size) and result.lengths == [9, 5]
    for i, seq in enumerate(seqs):
        direct = _direct_logprobs(fast_model, seq)      # alone, unpadded
        torch.testing.assert_close(result.token_logprobs[i], direct, atol=1e-4, rtol=0)
        assert result.perplexity[i] == pytest.approx(float(torch.exp(-direct.double().mean())), rel=1e-4)
    assert torch.all(result.logits[1, 5:] == 0)               # padding


def test_score_prefill_then_decode_agrees_with_full_prefill_fast(fast_model):
    seqs = random_prompts((12, 8), seed=12)
    full, stepped = score(fast_model, seqs), score(fast_model, seqs, prefill=4)
    torch.testing.assert_close(stepped.logits, full.logits, atol=1e-4, rtol=0)


def test_score_prefill_then_decode_equals_full_prefill_reference(ref_model):
    """Reference numerics with invariant kernels: bit for bit (tests/test_invariance.py has the why)."""
    seqs = random_prompts((12, 8), seed=12)
    full, stepped = score(ref_model, seqs), score(ref_model, seqs, prefill=3)
    assert torch.equal(full.logits, stepped.logits) and full.perplexity == stepped.perplexity


def test_score_rejects_bad_prefill_and_long_sequences(fast_model):
    with pytest.raises(ValueError, match="prefill"):
        score(fast_model, [[1, 2, 3]], prefill=4)
    with pytest.raises(ValueError, match="sequence 0 has 65 tokens"):
        score(fast_model, [[1] * 65])
