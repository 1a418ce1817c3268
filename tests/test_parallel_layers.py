"""Each parallel layer against its formula, in a real gloo world of 4 (docs/PARALLEL.md §1).

- row-parallel `wo_b` (reference numerics): bf16(Σ_r fp32(bf16(x_r W_rᵀ))), the reference's MP = 4
  arithmetic, written here with the one-process blockwise GEMM on each quarter (with 4 partials a bf16
  sum would round differently; with 2 it could not be told apart);
- vocab-parallel embedding: the one-process lookup, exactly (the other rank adds zeros);
- vocab-parallel head: the one-process logits, exactly (each logit is one row's dot product);
- an Engram table cut in rows (11 rows: 3 + 3 + 3 + 2): the one-process lookup, exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import parallel_worker
from dsv41.model.layers import quantized_linear
from dsv41.model.numerics import Numerics
from test_parallel import _free_port

WORLD = 4


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("layers")
    try:
        mp.start_processes(parallel_worker.layers_main, nprocs=WORLD, start_method="spawn", args=(WORLD, _free_port(), str(d)))
    except Exception:
        raise AssertionError("\n".join(p.read_text() for p in d.glob("error-rank*.txt")) or "a rank failed") from None
    return torch.load(d / "layers.pt")


def test_row_parallel_linear_is_the_reference_reduction(out):
    numerics = Numerics.default("reference")
    x, w, s = out["x"], out["weight"], out["scale"]
    width = 128 // WORLD
    parts = [quantized_linear(x[:, a:a + width], w[:, a:a + width], s[:, a // 32:(a + width) // 32], "fp8", 64,
                              numerics).float() for a in range(0, 128, width)]
    expected = sum(parts[1:], parts[0]).to(torch.bfloat16)
    assert torch.equal(out["wo_b"], expected)
    whole = quantized_linear(x, w, s, "fp8", 64, numerics)
    assert (out["wo_b"].float() - whole.float()).abs().max() <= 2 * whole.float().abs().max() * 2 ** -8


def test_vocab_parallel_embedding_and_head_are_exact(out):
    expected = F.embedding(out["ids"], out["vocab"])
    assert torch.equal(out["embed"], expected)
    one_process = Numerics.default("reference").linear(expected.float(), out["vocab"].float())
    assert torch.equal(out["head"], one_process)
    assert torch.allclose(out["head"], expected.float() @ out["vocab"].float().t(), atol=1e-5)


def test_engram_rows_cut_over_ranks_sum_to_the_lookup(out):
    table = out["table"].float()                                   # scales of 1.0: the codes are the values
    assert torch.equal(out["engram"], table[[0, 10, 5, 6]].to(torch.bfloat16)[None])
