"""One model, one answer: the same positions give the same result however they are fed.

On configs where every discrete choice binds and exact ties occur (the demo's, and `binding_config`:
top-2 of 4 experts, top-4 compressed positions, 2 candidate blocks, many summed ReLUs exactly 0):
- with reference numerics and invariant kernels (the default), a one-shot prefill, chunked prefills,
  stepwise decode and multi-token verify calls give bit-identical hidden states and the same index and
  candidate selections; a row batched with others equals its solo run; `score` does not depend on
  `prefill`; speculative greedy decoding equals plain greedy decoding token for token;
- with fast float32 numerics and BLAS kernels, the same selections and logits equal to rounding.
Mutation checks: torch's own top-k tie order, or BLAS kernels in reference numerics, break them.
"""

from __future__ import annotations

import pytest
import torch

import dsv41
import helpers
from dsv41.model import indexer
from dsv41.model.attention import Attention
from dsv41.config import RuntimeConfig
from dsv41.engine.engine import GenerationConfig, generate_all
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.score import score
from dsv41.tokenizer import Tokenizer

LENGTH = 40
SHAPES = {
    "one-shot": [0, LENGTH],
    "chunks of 5": list(range(0, LENGTH + 1, 5)),
    "odd chunks": [0, 3, 4, 9, 10, 17, 29, LENGTH],
    "prefill 7, then decode": [0, 7] + list(range(8, LENGTH + 1)),
    "prefill 10, then verify calls of 6": [0, 10, 16, 22, 28, 34, LENGTH],
}


def torch_topk(scores, k, *, sorted=True):
    """The pre-fix selection: whatever order torch's kernel gives tied scores."""
    out = scores.topk(k, dim=-1, sorted=sorted)
    return out.values, out.indices


class Selections:
    """Records, per absolute position, what every index source chose (valid entries only)."""

    def __init__(self, model):
        self.seen: dict[tuple[int, int, int], list[int]] = {}
        self.blocks: dict[tuple[int, int, int], list[int]] = {}
        self.handles = [layer.attn.register_forward_hook(self._hook) for layer in model.layers
                        if layer.attn.role.is_index_source]

    def _hook(self, module: Attention, args, _out):
        step, handoff = args[1], args[2]
        layer = module.role.layer_id
        picked = handoff.selections[layer]                                      # [N, k]
        for i, (slot, position) in enumerate(zip(step.token_slot.tolist(), step.positions.tolist())):
            key = (layer, slot, position)
            self.seen[key] = [j for j in picked[i].tolist() if j >= 0]
            if layer in handoff.candidates:
                visible = (position + 1) // module.role.ratio
                self.blocks[key] = handoff.candidates[layer][0, i, :visible].nonzero().flatten().tolist()

    def remove(self):
        for h in self.handles:
            h.remove()


def run_shape(model, ids, bounds):
    """hidden [B, T, D] and the selections of one call pattern."""
    record = Selections(model)
    try:
        hidden, _ = helpers.run_chunks(model, ids, bounds)
    finally:
        record.remove()
    return hidden, record


@pytest.fixture(scope="module")
def binding_reference():
    model = helpers.build(helpers.binding_config(), "reference", seed=0)
    ids = helpers.token_ids(2, LENGTH, seed=5)
    return model, ids, {name: run_shape(model, ids, b) for name, b in SHAPES.items()}


def test_binding_config_really_binds_with_ties(binding_reference, monkeypatch):
    """The premise: top-k binds (more visible positions than K) and scores tie at the k-th score."""
    model, ids, runs = binding_reference
    _, record = runs["one-shot"]
    K = model.cfg.index_topk
    assert max(len(v) for v in record.seen.values()) == K
    scores = []
    original = indexer.Indexer.scores
    monkeypatch.setattr(indexer.Indexer, "scores", lambda self, *a: scores.append(original(self, *a)) or scores[-1])
    helpers.run_chunks(model, ids, [0, LENGTH])
    ties = 0
    for s in scores:                                                  # [B, T, C] per index source
        s = s.float()
        kth = s.topk(min(K, s.shape[-1]), dim=-1).values[..., -1:]
        ties += int((((s == kth).sum(-1) > 1) & (kth[..., 0] > float("-inf"))).sum())
    assert ties > 0, "no tie at the k-th score"


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "one-shot"])
def test_reference_numerics_bit_identical_across_call_shapes(binding_reference, shape):
    _, _, runs = binding_reference
    hidden, record = runs[shape]
    one_hidden, one_record = runs["one-shot"]
    assert torch.equal(hidden, one_hidden)
    assert record.seen == one_record.seen and record.blocks == one_record.blocks


def test_torch_tie_order_breaks_it(monkeypatch):
    """Mutation: with torch's own top-k at the k-boundary, a verify call chooses other positions than the
    one-shot prefill (the bug behind speculative ≠ greedy on the demo)."""
    monkeypatch.setattr(indexer, "_topk", lambda numerics, scores, k: torch_topk(scores, k, sorted=False))
    model = helpers.build(helpers.binding_config(), "reference", seed=0)
    ids = helpers.token_ids(2, LENGTH, seed=5)
    shapes = [SHAPES["prefill 10, then verify calls of 6"], SHAPES["prefill 7, then decode"]]
    one = run_shape(model, ids, SHAPES["one-shot"])
    assert any(run_shape(model, ids, b)[1].seen != one[1].seen for b in shapes)


def test_blas_kernels_in_reference_numerics_move_with_the_call_shape():
    """Mutation: BLAS kernels (the reference's own arithmetic) give a decode row other bits than the same
    row of a prefill (a 1-row GEMM sums in another order), which binding choices then amplify."""
    model = helpers.build(helpers.binding_config(), "reference", seed=0, kernels="blas")
    ids = helpers.token_ids(2, LENGTH, seed=5)
    one, _ = helpers.run_chunks(model, ids, SHAPES["one-shot"])
    stepped, _ = helpers.run_chunks(model, ids, SHAPES["prefill 7, then decode"])
    assert not torch.equal(one, stepped)


def test_fast_float32_same_selections_and_logits_to_rounding():
    model = helpers.build(helpers.binding_config(), "fast", seed=0)
    ids = helpers.token_ids(2, LENGTH, seed=5)
    one_hidden, one = run_shape(model, ids, SHAPES["one-shot"])
    for name, bounds in SHAPES.items():
        hidden, record = run_shape(model, ids, bounds)
        assert record.seen == one.seen and record.blocks == one.blocks, name
        # fp32 summation order only: measured ≤ 4e-6 on the logits
        torch.testing.assert_close(model.logits(hidden), model.logits(one_hidden), rtol=0, atol=1e-4)


def test_a_row_batched_with_others_equals_its_solo_run(binding_reference):
    model, ids, runs = binding_reference
    one_hidden, _ = runs["one-shot"]
    for row in range(ids.shape[0]):
        solo, _ = helpers.run_chunks(model, ids[row:row + 1], [0, 12, 13, LENGTH])
        assert torch.equal(solo[0], one_hidden[row])
    # and beside a different neighbour
    other = torch.cat([ids[:1], helpers.token_ids(1, LENGTH, seed=99)])
    mixed, _ = helpers.run_chunks(model, other, [0, LENGTH])
    assert torch.equal(mixed[0], one_hidden[0])


# ------------------------------------------------------------------------------------------ the demo

@pytest.fixture(scope="module")
def demo(demo_dir):
    return dsv41.load(demo_dir, RuntimeConfig(max_seq_len=160, max_batch_size=4)), Tokenizer.from_dir(demo_dir)


@pytest.mark.parametrize("text,n", [("Hello, who are you?", 48), ("The quick brown fox", 40),
                                    ("Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100", 36),
                                    ("DeepSeek-V4.1 carries its residual stream as four parallel streams. "
                                     "Each block reads the streams with a learned mix.", 30)])
def test_demo_speculative_greedy_equals_greedy(demo, text, n):
    model, tok = demo
    prompt = tok.encode(text)
    [c] = helpers.engine_run(model, [prompt], n, speculative=True)
    assert c.token_ids == helpers.greedy_tokens(model, prompt, n)


def test_demo_batch_equals_solo_at_temperature_0(demo):
    model, tok = demo
    prompts = [tok.encode(t) for t in ("Hi", "The capital of France is Paris, and the capital of",
                                       "Code: def f(x): return x * 2 + 1")]
    config = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    batched = generate_all(model, tok, prompts, config)
    alone = [generate_all(model, tok, [p], config)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]


def test_demo_score_does_not_depend_on_prefill(demo):
    model, tok = demo
    seqs = [tok.encode("The quick brown fox jumps over the lazy dog. Hello, world! How are you today?"),
            tok.encode("User: what is the capital of France? Assistant: Paris.")]
    full = score(model, seqs)
    for prefill in (1, 5, 17):
        stepped = score(model, seqs, prefill=prefill)
        assert stepped.perplexity == full.perplexity
        assert all(torch.equal(a, b) for a, b in zip(stepped.token_logprobs, full.token_logprobs))
