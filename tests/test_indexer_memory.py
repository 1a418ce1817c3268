"""The indexer's transient memory is bounded by its budget, and the budget changes no bit.

Scored in one piece, a call's index logits are [T, Hi, C] (96 GiB for a 512-token chunk at C = 256K,
Hi = 64). `Indexer.select` scores chunks of query rows and `Indexer.scores` tiles the logits over the
compressed positions when a chunk's full width does not fit (indexer.py, `indexer_tiling`).

(a) Bits: on the binding config (top-4 positions, 2 candidate blocks, exact ties), the model's logits,
    index selections and candidate masks are bit-identical with a 1-row budget, an odd-sized-chunk
    budget and the default, in all four numerics × kernels combinations, for a one-shot prefill and
    for a prefill followed by decode steps, and so is every query row's score except under fast numerics
    with BLAS kernels, whose sums take the call's shape; an indexer over C = 5000 positions gives the same scores,
    blocks and positions with its logits cut in column tiles as in one piece.
(b) Memory: `indexer_tiling` against a brute-force search and a term-by-term formula; an allocation
    tracker (a TorchDispatchMode that follows every new storage until it is freed) measures the largest
    tensor and the bytes alive at once while the indexer selects, which stay within the budget and the
    plan's peak; with the chunking disabled (mutation) the measured largest tensor exceeds the budget.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import helpers
from dsv41.model import formats, indexer
from dsv41.model.attention import Attention
from dsv41.model.indexer import (
    COLUMN_ALIGN, DEFAULT_BUDGET_BYTES, KEY_BYTES, MIN_TILE_UNITS, POSITION_LIVE_BYTES, ROW_LIVE_BYTES,
    Indexer, IndexerTiling, column_tiles, indexer_tiling, indexer_transient_bytes,
)
from dsv41.model.init import init_random_
from dsv41.model.numerics import Numerics
from dsv41.model.rope import Rotary

COMBOS = [("reference", "invariant"), ("reference", "blas"), ("fast", "blas"), ("fast", "invariant")]
COMBO_IDS = [f"{m}-{k}" for m, k in COMBOS]
LENGTH = 40
# 7-row chunks on the C = 40 layers under invariant kernels, 14-row ones under BLAS kernels: 40 rows end
# in an odd-sized chunk either way
ODD_BUDGET = 4480
PATTERNS = {"one-shot": [0, LENGTH], "prefill 17, then decode": [0, 17, 18, 19, 20, LENGTH]}


# ------------------------------------------------------------------------------------------ helpers

class Allocations(TorchDispatchMode):
    """Every storage an op allocates, followed until its last tensor dies: the largest one and the most
    bytes alive at once. Views and in-place results (schema outputs that alias an input) add no bytes;
    storages made while `paused` are not followed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}                    # data_ptr → [tensors alive, bytes]
        self.now = self.peak = self.largest = 0
        self.paused = False

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.now -= entry[1]
                del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self.live:
                self.live[key][0] += 1
            elif self.paused or size == 0 or (i < len(returns) and returns[i].alias_info is not None):
                continue
            else:
                self.live[key] = [1, size]
                self.now += size
                self.peak = max(self.peak, self.now)
                self.largest = max(self.largest, size)
            weakref.finalize(t, self._release, key)
        return out


def skip_projections(monkeypatch, tracker: Allocations) -> None:
    """The query projections [T, Hi, Di] are those of any projection of the chunk (no C in them)."""
    real = Indexer.queries

    def queries(self, *args):
        tracker.paused = True
        try:
            return real(self, *args)
        finally:
            tracker.paused = False

    monkeypatch.setattr(Indexer, "queries", queries)


def set_budget(model, budget: int) -> None:
    for layer in model.layers:
        if layer.attn.indexer is not None:
            layer.attn.indexer.budget_bytes = budget


class Record:
    """Per index source and call: selections, candidate masks, and the rows of each `Indexer.scores`
    call (its chunks) with the scores it returned."""

    def __init__(self, model, monkeypatch):
        self.selections, self.candidates, self.chunks = [], [], []
        self.handles = [layer.attn.register_forward_hook(self._hook) for layer in model.layers
                        if layer.attn.role.is_index_source]
        real = Indexer.scores

        def scores(ix, x, qr, keys, positions, *args):
            out = real(ix, x, qr, keys, positions, *args)
            self.chunks.append((positions.shape[-1], positions.expand(out.shape[:2]), out))
            return out

        monkeypatch.setattr(Indexer, "scores", scores)

    def _hook(self, module, args, _out):
        handoff, layer = args[2], module.role.layer_id
        self.selections.append(handoff.selections[layer].clone())
        if layer in handoff.candidates:
            self.candidates.append(handoff.candidates[layer].clone())


def run_pattern(model, ids, bounds, budget, monkeypatch):
    """(logits [B, T, V], record) of one call pattern with every indexer at `budget`."""
    set_budget(model, budget)
    with monkeypatch.context() as m:
        record = Record(model, m)
        try:
            hidden, _ = helpers.run_chunks(model, ids, bounds)
        finally:
            for handle in record.handles:
                handle.remove()
    return model.logits(hidden), record


@pytest.fixture(scope="module", params=COMBOS, ids=COMBO_IDS)
def binding_model(request):
    numerics, kernels = request.param
    return helpers.build(helpers.binding_config(), numerics, seed=0, kernels=kernels)


# ------------------------------------------------------------------------------------------ (a) bits

@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_model_logits_bit_equal_whatever_the_budget(binding_model, pattern, monkeypatch):
    model = binding_model
    ids = helpers.token_ids(2, LENGTH, seed=5)
    with torch.no_grad():
        runs = {b: run_pattern(model, ids, pattern, b, monkeypatch) for b in (DEFAULT_BUDGET_BYTES, ODD_BUDGET, 1)}
    logits, ref = runs[DEFAULT_BUDGET_BYTES]
    K = model.cfg.index_topk

    # the premise: top-k binds, and scores tie at the k-th score
    assert max(int((s >= 0).sum(-1).max()) for s in ref.selections) == K
    ties = 0
    for _, _, s in ref.chunks:
        s = s.float()
        if s.shape[-1] > K:
            kth = s.topk(K, dim=-1).values[..., -1:]
            ties += int((((s == kth).sum(-1) > 1) & (kth[..., 0] > float("-inf"))).sum())
    assert ties > 0

    # the budgets really cut: whole call rows, odd-sized chunks, single rows
    rows_per_call = set(pattern[i + 1] - pattern[i] for i in range(len(pattern) - 1))
    assert {n for n, _, _ in ref.chunks} == rows_per_call
    odd = [n for n, _, _ in runs[ODD_BUDGET][1].chunks]
    assert max(odd) < LENGTH and len(set(odd) - rows_per_call) > 1
    assert {n for n, _, _ in runs[1][1].chunks} == {1}

    for budget in (ODD_BUDGET, 1):
        got, record = runs[budget]
        assert torch.equal(got, logits), budget
        assert len(record.selections) == len(ref.selections)
        assert all(torch.equal(a, b) for a, b in zip(record.selections, ref.selections))
        assert all(torch.equal(a, b) for a, b in zip(record.candidates, ref.candidates))
        # every query row's scores, whichever chunk (or batch of call rows) scored it, where the sums
        # do not take the call's shape: exact-sum kernels, or reference numerics' bf16 rounding. Fast
        # BLAS numerics keep no bits across call shapes (NUMERICS.md N1): on an AVX2-only CPU a row's
        # fp32 scores moved with the chunk's row count, though its selections did not.
        if model.numerics.reference_order:
            assert query_rows(record.chunks) == query_rows(ref.chunks)


def query_rows(chunks) -> list[tuple[int, bytes]]:
    """(position, score bytes) of every query row the chunks scored, sorted: rows scored one call row at a
    time and rows scored as a batch of call rows compare equal exactly when every row's scores are equal."""
    rows = [(int(p), r.float().numpy().tobytes()) for _, positions, s in chunks
            for p, r in zip(positions.reshape(-1), s.reshape(-1, s.shape[-1]))]
    return sorted(rows)


def long_indexer(mode: str, kernels: str, n_heads: int):
    """An indexer of `n_heads` heads of 32 and the inputs of 6 queries over C = 5000 positions whose keys
    repeat every 613 positions, so equal scores tie all along every row."""
    cfg = helpers.nonbinding_config()
    dtype = torch.float32 if mode == "fast" else torch.bfloat16
    idx = init_random_(Indexer(cfg.dim, cfg.q_lora_rank, cfg.head_dim, n_heads, 32, 1e-20, owns_keys=False,
                               numerics=Numerics(mode, kernels), dtype=dtype), 7)
    g = torch.Generator().manual_seed(3)
    T, C = 6, 5000
    x = torch.randn(1, T, cfg.dim, generator=g).to(dtype)
    qr = torch.randn(1, T, cfg.q_lora_rank, generator=g).to(dtype)
    base = formats.fp4_qdq_e8m0(torch.randn(1, 613, 32, generator=g)).to(dtype)
    keys = base[:, torch.arange(C) % 613]
    positions = torch.arange(C - T - 3, C - 3)                       # the last 3 positions invisible
    restrict = torch.rand(1, T, C, generator=g) < 0.7
    return idx, (x, qr, keys, positions, positions + 1, Rotary.for_layer(cfg, True)), restrict


def select_all(idx, inputs, restrict, topk=2500):
    """Scores, (positions, kept blocks) as a candidate source and positions as a candidate user."""
    T, C = inputs[0].shape[1], inputs[2].shape[1]
    keep = torch.zeros(1, T, C, dtype=torch.bool)
    a = torch.empty(1, T, min(topk, C), dtype=torch.long)
    b = torch.empty_like(a)
    idx.select(*inputs, topk, blocks=(50, 8), keep=keep, out=a)
    idx.select(*inputs, topk, restrict=restrict, out=b)
    return a, keep, b


@pytest.mark.parametrize("n_heads", [4, 32])
@pytest.mark.parametrize("mode,kernels", COMBOS, ids=COMBO_IDS)
def test_column_tiles_and_row_chunks_bit_equal(mode, kernels, n_heads):
    """Hi = 32 matters: the CPU's fp32 sum over ≥ 32 heads takes another path for a column in the last
    partial vector block, which misaligned tiles would move."""
    idx, inputs, restrict = long_indexer(mode, kernels, n_heads)
    T, C = 6, 5000
    idx.budget_bytes = 1 << 40
    whole_scores = idx.scores(*inputs)
    whole = select_all(idx, inputs, restrict)
    kth = whole_scores.float().topk(2500, dim=-1).values[..., -1:]
    assert ((whole_scores.float() == kth).sum(-1) > 1).all()          # ties at the k-th score in every row
    tiled = set()
    for budget in (1, 100_000, 300_000, 1_000_000, 3_000_000):
        idx.budget_bytes = budget
        plan = idx.tiling(T, C, inputs[0].element_size())
        tiled.add((plan.rows < T, plan.columns < C))
        assert torch.equal(idx.scores(*inputs), whole_scores), budget
        assert all(torch.equal(p, q) for p, q in zip(select_all(idx, inputs, restrict), whole)), budget
    assert (True, True) in tiled and (False, True) in tiled or (True, False) in tiled


@pytest.mark.parametrize("columns", [1024, 1280, 2048, 3840])
def test_column_tiles_layout(columns):
    unit = COLUMN_ALIGN
    for C in list(range(1, 40)) + list(range(columns - 3, columns + 3)) + list(range(2 * columns - 300, 12000, 97)):
        tiles = column_tiles(C, columns)
        assert tiles[0][0] == 0 and tiles[-1][1] == C
        assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
        assert all(e - s <= max(columns, C if len(tiles) == 1 else 0) for s, e in tiles)
        if len(tiles) > 1:
            assert all(s % unit == 0 and (e - s) % unit == 0 for s, e in tiles[:-1])
            assert tiles[-1][1] - tiles[-1][0] > unit                   # never a 1- or 2-column product


# ------------------------------------------------------------------------------------------ (b) memory

def plan_by_search(T, C, Hi, Di, budget, e, invariant) -> IndexerTiling:
    """The rule written as searches: the most rows whose full-width chunk fits; else the most rows whose
    narrowest tile fits and the widest aligned tile for them; then the bytes term by term."""
    logit = 8 if invariant else e

    def tensors(t, c):
        """The chunk's tensors that grow with C or t: top-k keys, logits, float64 keys and queries."""
        return [KEY_BYTES * t * C, t * Hi * c * logit, 8 * Di * c * invariant, 8 * Hi * Di * t * invariant]

    fits = [t for t in range(1, T + 1) if max(tensors(t, C)) <= budget]
    if fits:
        rows, columns = max(fits), C
    else:
        least = min(C, COLUMN_ALIGN * MIN_TILE_UNITS)
        rows = max([t for t in range(1, T + 1) if max(tensors(t, least)[:2] + tensors(t, least)[3:]) <= budget],
                   default=1)
        # aligned widths up to the first at or past C (a tile that reaches C is all of C)
        widths = [c for c in range(COLUMN_ALIGN, C + COLUMN_ALIGN, COLUMN_ALIGN)
                  if max(tensors(rows, c)[1:3]) <= budget]
        columns = min(C, max(widths + [least]))
    largest = max(tensors(rows, columns))
    tile = ((12 + 2 * e) if invariant else 3 * e) * rows * Hi * columns   # logits and what they become
    tile += 8 * Di * columns * invariant + 8 * Hi * Di * rows * invariant   # float64 operands
    tile += e * rows * columns                                         # the tile's head sum
    tile += e * rows * C * (columns < C)                               # the chunk's score buffer
    peak = max(tile, ROW_LIVE_BYTES * rows * C) + POSITION_LIVE_BYTES * C
    return IndexerTiling(rows, columns, largest, peak)


def test_tiling_against_brute_force_search():
    for T in (1, 5, 40):
        for C in (1, 20, 40, 700, 5000, 20000):
            for Hi, Di in ((2, 32), (32, 32), (64, 128)):
                for e, invariant in ((2, True), (2, False), (4, False), (4, True)):
                    for budget in (1, 4480, 100_000, 3_000_000, 1 << 40):
                        got = indexer_tiling(T, C, Hi, Di, budget, itemsize=e, invariant=invariant)
                        assert got == plan_by_search(T, C, Hi, Di, budget, e, invariant), (T, C, Hi, Di, e, budget)
                        assert indexer_transient_bytes(T, C, Hi, Di, budget, itemsize=e,
                                                       invariant=invariant) == got.peak_bytes
                        floor = indexer_tiling(1, C, Hi, Di, 1, itemsize=e, invariant=invariant).largest_bytes
                        if budget >= floor:
                            assert got.largest_bytes <= budget


def test_tiling_at_a_million_tokens():
    """A 512-token chunk at 1M context, ratio 4 (C = 256K), 64 heads of 128, bf16, invariant kernels."""
    T, C, Hi, Di = 512, 1 << 18, 64, 128
    whole = indexer_tiling(T, C, Hi, Di, 1 << 62)
    assert (whole.rows, whole.columns) == (T, C)
    assert whole.largest_bytes == 8 * T * Hi * C == 64 << 30           # the float64 logits
    assert whole.peak_bytes >= 96 << 30                                 # with their fp32 rounding
    plan = indexer_tiling(T, C, Hi, Di, DEFAULT_BUDGET_BYTES)
    assert plan.largest_bytes <= DEFAULT_BUDGET_BYTES and plan.peak_bytes < 1 << 30
    # a million compressed positions (ratio 1): the logits are tiled over C as well
    wide = indexer_tiling(T, 1 << 20, Hi, Di, DEFAULT_BUDGET_BYTES)
    assert wide.columns < 1 << 20 and wide.largest_bytes <= DEFAULT_BUDGET_BYTES


def measure(monkeypatch, idx, inputs, restrict) -> Allocations:
    tracker = Allocations()
    with monkeypatch.context() as m:
        skip_projections(m, tracker)
        T, C = inputs[0].shape[1], inputs[2].shape[1]
        keep = torch.zeros(1, T, C, dtype=torch.bool)
        out = torch.empty(1, T, min(2500, C), dtype=torch.long)
        with tracker:
            idx.select(*inputs, 2500, blocks=(50, 8), keep=keep, out=out)
            idx.select(*inputs, 2500, restrict=restrict, out=out)
    return tracker


def check_within(tracker: Allocations, plan: IndexerTiling, budget: int) -> None:
    assert tracker.largest <= budget, f"largest tensor {tracker.largest} B over the budget of {budget} B"
    assert tracker.largest <= plan.largest_bytes
    assert tracker.peak <= plan.peak_bytes, f"{tracker.peak} B alive at once, plan says {plan.peak_bytes} B"


@pytest.mark.parametrize("mode,kernels", COMBOS, ids=COMBO_IDS)
def test_largest_tensor_stays_within_the_budget(mode, kernels, monkeypatch):
    idx, inputs, restrict = long_indexer(mode, kernels, 32)
    T, C, e = 6, 5000, inputs[0].element_size()
    for budget in (300_000, 1_000_000, 3_000_000):
        idx.budget_bytes = budget
        plan = idx.tiling(T, C, e)
        check_within(measure(monkeypatch, idx, inputs, restrict), plan, budget)
    # below the floor (one row, the narrowest tile) the plan says what it allocates
    idx.budget_bytes = 1
    assert measure(monkeypatch, idx, inputs, restrict).largest == idx.tiling(T, C, e).largest_bytes > 1

    # mutation: with the chunking disabled the measurement catches it
    idx.budget_bytes = 300_000
    plan = idx.tiling(T, C, e)
    monkeypatch.setattr(indexer, "indexer_tiling", lambda n, c, *a, **k: IndexerTiling(n, c, 0, 0))
    with pytest.raises(AssertionError, match="over the budget"):
        check_within(measure(monkeypatch, idx, inputs, restrict), plan, 300_000)


@torch.no_grad()
def test_model_indexer_allocations_within_the_budget(monkeypatch):
    """The whole model, reference numerics: what every index source allocates while selecting stays within
    a 12 000-byte budget (18-row chunks of the 40-position rows), but not with the default budget."""
    model = helpers.build(helpers.binding_config(), "reference", seed=0)
    ids = helpers.token_ids(2, LENGTH, seed=5)
    largest = {}
    for budget in (12_000, DEFAULT_BUDGET_BYTES):
        set_budget(model, budget)
        tracker = Allocations()
        real = Indexer.select

        def select(self, *args, **kwargs):
            with tracker:
                return real(self, *args, **kwargs)

        with monkeypatch.context() as m:
            skip_projections(m, tracker)
            m.setattr(Indexer, "select", select)
            helpers.run_chunks(model, ids, [0, LENGTH])
        largest[budget] = tracker.largest
    assert largest[12_000] <= 12_000 < largest[DEFAULT_BUDGET_BYTES]


def test_attention_passes_its_budget_to_the_indexer():
    cfg = helpers.binding_config()
    model = helpers.build(cfg, "fast", seed=0)
    role = model.layers[4].attn.role
    attn = Attention(cfg, role, numerics=model.numerics, dtype=torch.float32, indexer_budget_bytes=12345)
    assert attn.indexer.budget_bytes == 12345
    assert model.layers[4].attn.indexer.budget_bytes == DEFAULT_BUDGET_BYTES


@pytest.mark.parametrize("n_heads", [32, 64])
def test_invariant_scores_of_a_position_do_not_depend_on_how_many_positions_follow(n_heads, monkeypatch):
    """docs/NUMERICS.md N8: fast numerics with invariant kernels score a column with the same bits whether
    the call holds C positions (a decode step) or C + k (a verify call), at the released head counts.
    Mutation: torch's strided sum over heads moves bits with C, and the test sees it."""
    idx, (x, qr, keys, positions, _, rotary), _ = long_indexer("fast", "invariant", n_heads)
    idx.budget_bytes = 1 << 40
    visible = torch.full((positions.numel(),), 5000)                   # every column scored, none masked

    def differing():
        full = idx.scores(x, qr, keys[:, :4301], positions, visible, rotary)
        return sum(int((idx.scores(x, qr, keys[:, :c], positions, visible, rotary) != full[..., :c]).sum())
                   for c in (4001, 4002, 4007, 4100, 4300))

    assert differing() == 0
    monkeypatch.setattr(Numerics, "head_sum", lambda self, t, dim: t.sum(dim=dim))
    assert differing() > 0
