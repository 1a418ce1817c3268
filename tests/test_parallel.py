"""Tensor and expert parallelism in real gloo worlds of 2 and 4 processes on loopback, against one
process (docs/PARALLEL.md §4).

Expectations, on the demo model (every layer role, Engram, DSpark; top-k choices that bind):
- expert parallelism alone is bit-identical to one process in `reference` numerics: a token's experts
  are added in ascending order on one rank, or as (0 + a) + b across two, the same fp32 sum (fast
  numerics' BLAS kernels choose another GEMM for a rank's fewer experts: within rounding);
- tensor parallelism in `fast` numerics (fp32) agrees within the rounding of the split reductions
  (measured ≤ 1e-5 on the logits), and greedy generation, speculative greedy generation and DSpark
  drafts are identical;
- tensor parallelism in `reference` numerics reduces bf16 partial products in fp32, as the reference
  does at MP > 1: 1 bf16 ulp at the first reduction, which routing choices then amplify; the test
  checks the first reduction against its formula (test_parallel_layers.py) and that the run is
  deterministic;
- fast numerics with the fp4 experts kept stored give the held experts' bits in every layout.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

import parallel_worker
from dsv41.checkpoint.model_io import load_model

FAST_TOLERANCE = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world: int, directory, layouts, numerics_modes, out_dir) -> dict:
    try:
        mp.start_processes(parallel_worker.rank_main, nprocs=world, start_method="spawn", join=True,
                           args=(world, _free_port(), str(directory), layouts, numerics_modes, str(out_dir)))
    except Exception:
        errors = sorted(out_dir.glob("error-rank*.txt"))
        raise AssertionError("\n".join(e.read_text() for e in errors) or "a rank failed") from None
    return {(tp, ep, n): torch.load(out_dir / f"tp{tp}-ep{ep}-{n}.pt") for tp, ep in layouts for n in numerics_modes}


@pytest.fixture(scope="module")
def single(demo_dir):
    return {n: parallel_worker.probe(load_model(demo_dir, parallel_worker.runtime(n), check_memory=False))
            for n in ("reference", "fast")}


@pytest.fixture(scope="module")
def world2(demo_dir, tmp_path_factory):
    return _run_world(2, demo_dir, [(2, 1), (1, 2), (2, 2)], ("reference", "fast", "fast-stored"),
                      tmp_path_factory.mktemp("w2"))


@pytest.fixture(scope="module")
def world4(demo_dir, tmp_path_factory):
    return _run_world(4, demo_dir, [(4, 4), (2, 4)], ("fast",), tmp_path_factory.mktemp("w4"))


def _same(a: dict, b: dict) -> None:
    for key in ("prefill", "decode", "draft_logits"):
        assert torch.equal(a[key], b[key]), key
    for key in ("draft_ids", "greedy_spec0", "greedy_spec1"):
        assert (torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]), key


def _close(a: dict, b: dict) -> float:
    worst = 0.0
    for key in ("prefill", "decode", "draft_logits"):
        worst = max(worst, float((a[key] - b[key]).abs().max()))
    assert worst <= FAST_TOLERANCE
    assert torch.equal(a["draft_ids"], b["draft_ids"])
    assert a["greedy_spec0"] == b["greedy_spec0"] and a["greedy_spec1"] == b["greedy_spec1"]
    assert a["greedy_spec1"] == a["greedy_spec0"]                  # speculation stays lossless under TP
    return worst


def test_expert_parallel_is_bit_identical_in_reference_numerics(single, world2):
    _same(world2[(1, 2, "reference")], single["reference"])


def test_expert_parallel_fast_matches_one_process(single, world2):
    """BLAS kernels pick the expert GEMM by how many pairs a rank has (fewer experts per rank), so only
    within rounding here."""
    _close(world2[(1, 2, "fast")], single["fast"])


@pytest.mark.parametrize("layout", [(2, 1), (1, 2), (2, 2)])
def test_stored_experts_across_ranks_give_the_held_experts_bits(world2, layout):
    """Each rank's part of the stored banks (fp4 bytes and scales, docs/NUMERICS.md N30) decodes to its
    part of the held banks, so the forward across processes, its collectives included, keeps the held
    run's bits: logits, drafts and greedy generations. (In fp32 the experts decode into fp32 rows,
    `fp4_rows`; a scale's exponent planted one off there fails this test. The bf16 tiles' decode is
    tested in one process, tests/test_stored_experts.py.)"""
    _same(world2[(*layout, "fast-stored")], world2[(*layout, "fast")])
    stored = world2[(*layout, "fast-stored")]["held"]["layers.0.ffn.experts.w1.weight"]
    held = world2[(*layout, "fast")]["held"]["layers.0.ffn.experts.w1.weight"]
    assert stored[:-1] == held[:-1] and stored[-1] * 2 == held[-1]      # two fp4 values a byte


def test_each_rank_holds_its_part(world2, single):
    held = world2[(2, 2, "fast")]["held"]
    assert held["embed.weight"][0] == 768 // 2 and held["head.weight"][0] == 768 // 2
    assert held["layers.0.attn.wq_b.weight"][0] == 8 * 64 // 2 and held["layers.0.attn.attn_sink"][0] == 4
    assert held["layers.0.attn.wo_b.weight"][1] == 4 * 32 // 2
    assert held["layers.0.ffn.experts.w1.weight"][0] == 8 // 2
    assert held["layers.0.ffn.shared_experts.w1.weight"] == world2[(1, 2, "fast")]["held"]["layers.0.ffn.shared_experts.w1.weight"]


@pytest.mark.parametrize("layout", [(2, 1), (2, 2)])
def test_tensor_parallel_fast_matches_one_process(single, world2, layout):
    _close(world2[(*layout, "fast")], single["fast"])


@pytest.mark.parametrize("layout", [(4, 4), (2, 4)])
def test_four_ranks_match_one_process(single, world4, layout):
    _close(world4[(*layout, "fast")], single["fast"])


def test_tensor_parallel_reference_is_the_reference_reduction(single, world2):
    """Not bit-identical to one process (bf16 partials are summed, as the reference does at MP = 2),
    but every rank agrees and EP on top changes nothing."""
    tp, both = world2[(2, 1, "reference")], world2[(2, 2, "reference")]
    _same(tp, both)
    assert torch.isfinite(tp["prefill"]).all()
    assert not torch.equal(tp["prefill"], single["reference"]["prefill"])
