"""Top-k with exact ties broken by a fixed rule: equal scores, lower index first.

Shapes: [..., n] scores, k chosen along the last dim.

`torch.topk` leaves the order of equal scores to the kernel: the CPU and the GPU, or one kernel at
two call shapes, pick different members of a tie at the k-boundary. The indexer's scores are summed
ReLUs, so many are exactly 0 (docs/ARCHITECTURE.md §17 trap 14), and a 6-row verify call then chose other
compressed positions than the 1-row decode call at the same position. Here every score is widened to a
unique int64 key — the score's order-preserving integer image in the high 32 bits, the complement of
its index in the low 32 — so no two entries tie and any top-k kernel returns the same set. The cost
is a few elementwise passes and an int64 top-k instead of a float one (docs/NUMERICS.md N4,
benchmarks/bench_topk.py).
"""

from __future__ import annotations

import torch

_LOW_BITS = 32
_LOW_MASK = (1 << _LOW_BITS) - 1
_INT32_MAGNITUDE = 0x7FFFFFFF


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys, ordered as (score, −index): larger score first, then lower index first."""
    s = scores.to(torch.float32) + 0.0               # −0 → +0: the two zeros are one score
    bits = s.view(torch.int32)
    # negative floats order backwards as integers: flip their magnitude bits
    monotone = torch.where(bits < 0, bits ^ _INT32_MAGNITUDE, bits).to(torch.int64)
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return (monotone << _LOW_BITS) | (_LOW_MASK - index)


def topk(scores: torch.Tensor, k: int, *, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest scores along the last dim, ties to the lower index.

    With `sorted`, results are in descending (score, −index) order, as `torch.topk` orders distinct
    scores; without, in no particular order (callers sort the indices themselves).
    """
    if scores.shape[-1] >= 1 << _LOW_BITS:
        raise ValueError(f"top-k over {scores.shape[-1]} entries: indices must fit in 32 bits")
    indices = ordered_keys(scores).topk(k, dim=-1, sorted=sorted).indices
    return scores.gather(-1, indices), indices

