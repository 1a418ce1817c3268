"""The communication formulas of benchmarks/bench_parallel.py against the bytes counted in one process.

One process builds rank 0's slice of a world of 2 (TP and/or EP = 2) of a tiny config with Engram and
DSpark, with the collectives stubbed out (`no_collectives`: the shapes are a rank's, the values are not),
and counts what each call site passes in one decode step and one draft (`counting`). The real gloo runs
are the benchmark's; this checks the formulas' pieces (which layers, which widths, which dtypes) fast.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import helpers
from dsv41.config import RuntimeConfig
from dsv41.model import Transformer
from dsv41.model.engram.hashing import table_rows
from dsv41.model.init import init_random_
from dsv41.parallel import ParallelContext

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_parallel.py"
PREFILL, BATCH = 20, 2


def _bench():
    spec = importlib.util.spec_from_file_location("bench_parallel", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


def _config():
    engram = dict(engram_layer_ids=(1, 3), engram_vocab_size=500, engram_max_ngram_size=3, engram_pad_id=2,
                  engram_compressed_vocab_size=200, engram_n_heads=2, engram_head_dim=32)
    engram["engram_num_embeddings"] = table_rows(2, 3, 2, 500)
    return helpers.binding_config(**engram)


def _bytes(seen: dict) -> dict[str, int]:
    return {site: entry[1] for site, entry in seen.items()}


def _nonzero(formula: dict[str, int]) -> dict[str, int]:
    return {site: n for site, n in formula.items() if n}


@pytest.mark.parametrize("tp, ep, numerics", [(2, 2, "fast"), (2, 2, "reference"), (2, 1, "fast"), (1, 2, "fast")])
@torch.no_grad()
def test_formulas_match_the_counted_bytes(tp, ep, numerics):
    cfg = _config()
    runtime = RuntimeConfig(max_seq_len=32, max_batch_size=BATCH, numerics=numerics,
                            dtype="float32" if numerics == "fast" else "bfloat16")
    # a group object, so every module that reduces when it has one does (the stubs never look at it)
    ctx = ParallelContext(rank=0, world_size=2, tp_size=tp, ep_size=ep, tp_group="stub", ep_group="stub")
    model = init_random_(Transformer(cfg, runtime, parallel=ctx), 0)
    model.set_token_map(torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)
    ids = helpers.token_ids(BATCH, PREFILL + 1)
    itemsize = 4 if numerics == "fast" else 2
    with bench.no_collectives():
        cache = model.new_cache(BATCH, 32)
        res = model(ids[:, :PREFILL], 0, cache)
        model.dspark_observe(res.dspark_hidden, 0, cache)
        with bench.counting() as seen:
            model.dspark_draft(ids[:, PREFILL], PREFILL - 1, cache)
        assert _bytes(seen) == _nonzero(bench.draft_comm_bytes(cfg, tp, ep, BATCH))
        with bench.counting() as seen:
            res = model(ids[:, PREFILL:], PREFILL, cache)
            model.logits(res.hidden[:, -1])
        assert _bytes(seen) == _nonzero(bench.decode_comm_bytes(cfg, tp, ep, BATCH, PREFILL + 1, itemsize=itemsize))
    if tp > 1:
        # a decode step's rows have one length, so each index source scores them as one batch: one
        # all-reduce per index source, whatever the batch
        assert seen["indexer"][0] == len(cfg.index_source_layers)


def test_released_decode_terms(released_cfg):
    got = bench.decode_comm_bytes(released_cfg, 8, 8, 1, 65536)
    D = released_cfg.dim
    assert got["wo_b"] == got["moe"] == 40 * D * 4
    assert got["indexer"] == (3 * 32768 + 5 * 65536) * 2          # ratio-2 sources 2, 8, 14; ratio-1 from 20
    assert got["engram"] == 2 * 24 * 256 * 2
    assert got["head"] == 129280 // 8 * 4
    assert bench.decode_comm_bytes(released_cfg, 1, 1, 1, 65536) == dict.fromkeys(bench.DECODE_SITES, 0)
