"""The training forward against the inference forward, and its gradients against finite differences.

The demo's config (every layer role; its window, both top-k choices and the candidate blocks all bind
at these lengths), fast float32 numerics. Expectations:
- a batch of sequences from position 0 through `training.forward.backbone` gives the hidden states of
  the cached inference prefill (an independent path: cache rings, per-token attention lists, the
  compressor's tail), and the DSpark draft of `training.forward.dspark` at an anchor gives what
  `Transformer.dspark_draft` proposes after observing the same main rows, chain teacher-forced;
- gradients of every component agree with central finite differences of the loss, computed with the
  whole forward in float64 and the forward's discrete choices (top-k positions, candidate blocks,
  experts) held fixed: the loss is piecewise smooth, and autograd differentiates the piece it is on.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dsv41.config import ModelConfig
from dsv41.demo import demo_config_dict, train_tokenizer
from dsv41.model import hyper
from dsv41.model.attention import Attention
from dsv41.model.engram import build_token_map
from dsv41.model.numerics import FAST, Numerics
from dsv41.training import forward
from dsv41.training.model import TrainingModel
from dsv41.training.objective import compute_losses

B, T = 2, 48


@pytest.fixture(scope="module")
def model() -> TrainingModel:
    tokenizer = train_tokenizer()
    token_map = build_token_map(tokenizer)
    cfg = ModelConfig.from_dict(demo_config_dict(tokenizer.get_vocab_size(), int(token_map.max()) + 1))
    torch.manual_seed(0)
    m = TrainingModel.create(cfg, token_map, max_seq_len=T, seed=3)
    with torch.no_grad():                 # non-trivial router biases and sinks: every part of the math shows
        for name, p in m.transformer.named_parameters():
            if name.endswith(("gate.bias", "attn_sink")):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    for table, trained in zip(_tables(m), m.engram_tables):
        trained.data.copy_(table.lookup(torch.arange(table.rows).unsqueeze(1)).squeeze(1).float())
    return m


def _tables(m):
    from dsv41.training.model import engram_tables_of
    return engram_tables_of(m.transformer)


@pytest.fixture(scope="module")
def ids(model) -> torch.Tensor:
    return torch.randint(3, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(11))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def test_backbone_equals_the_cached_prefill(model, ids):
    out = forward.backbone(model.transformer, model.engram_tables, ids)
    ref = model.transformer(ids, 0, model.transformer.new_cache(B, T))
    assert relative(out.hidden, ref.hidden) < 1e-5
    assert relative(out.dspark_hidden, ref.dspark_hidden) < 1e-5
    # every MoE reported its load: 8 backbone layers, A choices per token
    assert len(out.loads) == model.cfg.n_layers
    assert all(int(c.sum()) == B * T * model.cfg.n_activated_experts for _, c in out.loads)


@torch.no_grad()
def test_mutation_attending_to_every_compressed_position_is_seen(model, ids, monkeypatch):
    # the indexer's choice binds here (top-16 of up to 48): ignoring it changes the function
    ref = forward.backbone(model.transformer, model.engram_tables, ids).hidden
    monkeypatch.setattr(forward, "selection_mask", lambda selected, C: torch.ones(*selected.shape[:2], C, dtype=torch.bool))
    assert relative(forward.backbone(model.transformer, model.engram_tables, ids).hidden, ref) > 1e-2


@torch.no_grad()
def test_mutation_a_window_one_too_wide_is_seen(model, ids, monkeypatch):
    ref = forward.backbone(model.transformer, model.engram_tables, ids).hidden
    real = forward.window_mask
    monkeypatch.setattr(forward, "window_mask", lambda T_, W, device=None: real(T_, W + 1, device))
    assert relative(forward.backbone(model.transformer, model.engram_tables, ids).hidden, ref) > 1e-3


@pytest.mark.parametrize("p", [0, 5, 30])
@torch.no_grad()
def test_draft_equals_the_inference_draft(model, ids, p):
    t = model.transformer
    out = forward.backbone(t, model.engram_tables, ids)
    d = forward.dspark(t, ids, out.dspark_hidden, torch.tensor([p]))
    cache = t.new_cache(B, T)
    t.dspark_observe(t(ids[:, :p + 1], 0, cache).dspark_hidden, 0, cache)
    chosen = iter(range(2, 2 + t.cfg.dspark_block_size))
    draft = t.dspark_draft(ids[:, p + 1], p, cache, lambda row: ids[:, p + next(chosen)])
    assert relative(d.logits, draft.logits) < 1e-5
    assert relative(d.confidence, draft.confidence) < 1e-5
    torch.testing.assert_close(d.targets, ids[:, p + 2:p + 2 + t.cfg.dspark_block_size])


def test_anchors_leave_room_for_every_target():
    a = forward.anchors(40, 5, 3)
    assert a.tolist() == [3, 8, 13, 18, 23, 28, 33] and int(a.max()) + 5 + 1 <= 39


# ------------------------------------------------------------------------------------------ gradients
@contextlib.contextmanager
def float64_forward():
    """The model's fp32 casts (they pin fp32 where bf16 runs would round) leave float64 tensors alone,
    so a model converted to float64 computes its whole forward in float64."""
    real = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else real(self, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.float = real


COMPONENTS = [
    "transformer.embed.weight", "transformer.layers.0.hc_attn_fn", "transformer.layers.0.hc_ffn_base",
    "transformer.layers.0.hc_attn_scale", "transformer.layers.1.attn.wq_a.weight",
    "transformer.layers.1.attn.wo_a.weight", "transformer.layers.1.attn.attn_sink",
    "transformer.layers.2.attn.compressor.wkv.weight", "transformer.layers.2.attn.compressor.wgate.weight",
    "transformer.layers.4.attn.compressor.wkv.weight", "transformer.layers.2.attn.indexer.wq_b.weight",
    "transformer.layers.2.attn.indexer.wk.weight", "transformer.layers.6.attn.indexer.weights_proj.weight",
    "transformer.layers.3.ffn.gate.weight", "transformer.layers.3.ffn.experts.w1.weight",
    "transformer.layers.3.ffn.experts.w2.weight", "transformer.layers.3.ffn.shared_experts.w3.weight",
    "transformer.layers.1.engram.wkv.weight", "transformer.layers.3.engram.q_weight", "engram_tables.0",
    "transformer.layers.5.attn_norm.weight", "transformer.head.weight",
    "transformer.mtp.0.main_proj.weight", "transformer.mtp.1.attn.wkv.weight",
    "transformer.mtp.1.markov_head.embed.weight", "transformer.mtp.1.confidence_head.proj.weight",
]


class FrozenChoices:
    """Records the discrete choices of a forward (the indexers' selections and candidate blocks, the
    routers' experts) and replays them, so a perturbed forward is the same smooth function: summed
    ReLU scores tie at 0 and a perturbation would otherwise flip which tied position is chosen."""

    def __init__(self, monkeypatch):
        self.calls: list = []
        self.replaying = False
        self.position = 0
        self.selecting = False                  # inside an attention's selection: its top-k are its own
        real_select, real_topk = Attention.select, Numerics.topk

        def select(attn, x, qr, step, handoff, C, keys_of):
            if not self.replaying:
                self.selecting = True
                try:
                    chosen = real_select(attn, x, qr, step, handoff, C, keys_of)
                finally:
                    self.selecting = False
                self.calls.append((chosen, dict(handoff.candidates)))
                return chosen
            chosen, candidates = self._next()
            handoff.candidates.update(candidates)
            return chosen

        def topk(numerics, scores, k, **kw):                 # the routers' choices
            if self.selecting:
                return real_topk(numerics, scores, k, **kw)
            if not self.replaying:
                self.calls.append(real_topk(numerics, scores, k, **kw)[1])
                return scores.gather(-1, self.calls[-1]), self.calls[-1]
            ids = self._next()
            return scores.gather(-1, ids), ids

        monkeypatch.setattr(Attention, "select", select)
        monkeypatch.setattr(Numerics, "topk", topk)

    def _next(self):
        self.position += 1
        return self.calls[self.position - 1]

    def replay(self):
        self.replaying, self.position = True, 0


@pytest.fixture(scope="module")
def float64_model(model):
    import copy
    m = copy.deepcopy(model)
    for name, p in m.named_parameters():
        if p.dtype == torch.float32:
            p.data = p.data.double()
    for _, module in m.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.dtype == torch.float32:
                module._buffers[key] = buffer.double()
    return m


@pytest.mark.parametrize("name", COMPONENTS, ids=lambda n: n.replace("transformer.", ""))
def test_gradient_matches_finite_differences(float64_model, name, monkeypatch):
    m = float64_model
    choices = FrozenChoices(monkeypatch)
    ids = torch.randint(3, m.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    param = dict(m.named_parameters())[name]

    def loss() -> torch.Tensor:
        # the term that trains this parameter: the others see it only through detached inputs
        terms = compute_losses(m, ids, anchor_offset=1)
        if ".indexer." in name:
            return terms.index_kl
        if name.startswith("transformer.mtp."):
            return terms.draft + terms.confidence
        return terms.lm

    with float64_forward():
        m.zero_grad(set_to_none=True)
        term = loss()
        assert term.dtype == torch.float64
        term.backward()
        grad = param.grad.clone()
        assert grad.abs().sum() > 0, f"no gradient reaches {name}"
        direction = grad / grad.norm()
        eps = 1e-5 * max(1.0, float(param.detach().abs().max()))
        choices.replay()
        with torch.no_grad():
            base = param.detach().clone()
            param.copy_(base + eps * direction)
            up = float(loss())
            choices.replay()
            param.copy_(base - eps * direction)
            down = float(loss())
            param.copy_(base)
    numeric, analytic = (up - down) / (2 * eps), float(grad.norm())
    assert abs(numeric - analytic) <= 1e-5 * analytic + 1e-9, (numeric, analytic)


def test_sinkhorn_backward_matches_finite_differences():
    # the fast Sinkhorn's own backward (recomputed in the positions-innermost layout)
    c = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True, generator=torch.Generator().manual_seed(2))
    assert torch.autograd.gradcheck(lambda t: hyper.sinkhorn(t, 20, 1e-6, FAST), (c,))


def test_indexer_and_draft_losses_train_only_their_own_parameters(model, ids):
    # the KL term reaches the indexers only; the draft losses reach the DSpark stages only
    t = model.transformer
    model.zero_grad(set_to_none=True)
    out = forward.backbone(t, model.engram_tables, ids)
    out.index_kl.backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached and all(".indexer." in n for n in reached)
    model.zero_grad(set_to_none=True)
    out = forward.backbone(t, model.engram_tables, ids)
    d = forward.dspark(t, ids, out.dspark_hidden, forward.anchors(T, t.cfg.dspark_block_size, 0))
    torch.nn.functional.cross_entropy(d.logits.flatten(0, 1), d.targets.flatten()).backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached and all(n.startswith("transformer.mtp.") for n in reached)
    model.zero_grad(set_to_none=True)
