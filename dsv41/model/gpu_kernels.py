"""Triton kernels for fast numerics on CUDA, where torch's eager ops cost a kernel launch each.

Shapes: rows R, S streams, M = (2 + S)·S mix width.

A decode step is bound by launches on a GPU, not by its bytes (benchmarks/bench_cuda.py): the
hyper-connection split (§7.3) is ~120 launches per sublayer in torch, most of them Sinkhorn's 20 row /
column normalisations of 4 × 4 matrices. `split_mixes` is one launch, one program per row, the
matrix held in registers. It sums in its own order (a 4-wide tree) and Triton's exp and sigmoid are
not torch's, so only fast numerics take it (numerics.py `triton`).

Triton is optional: without it (the CPU wheel, CI) `available()` is False and the policy never asks.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                          # the CPU build of torch has no Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _split_mixes_kernel(m_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                            S: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, S)
        ij = s[:, None] * S + s[None, :]                                      # [S, S] row-major
        row = m_ptr + r * ((2 + S) * S)
        z_pre = tl.load(row + s) * tl.load(scale_ptr) + tl.load(base_ptr + s)
        z_post = tl.load(row + S + s) * tl.load(scale_ptr + 1) + tl.load(base_ptr + S + s)
        tl.store(pre_ptr + r * S + s, tl.sigmoid(z_pre) + eps)
        tl.store(post_ptr + r * S + s, 2.0 * tl.sigmoid(z_post))
        c = tl.load(row + 2 * S + ij) * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * S + ij)
        # the row softmax, then alternating column / row normalisations, ending on a column (§7.4)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + eps
        c = c / (tl.sum(c, axis=0)[None, :] + eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + eps)
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
        tl.store(comb_ptr + r * (S * S) + ij, c)


def split_mixes(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: int, iters: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """hyper.py `split_mixes` of fp32 m [..., M] on CUDA in one launch: (pre [..., S], post [..., S],
    comb [..., S, S]); None where the kernel does not apply (no Triton, S not a power of two, not fp32)."""
    S = streams
    if triton is None or S & (S - 1) or m.dtype != torch.float32 or m.shape[-1] != (2 + S) * S:
        return None
    lead = m.shape[:-1]
    rows = lead.numel()
    flat = m.reshape(rows, -1).contiguous()
    pre, post = m.new_empty(rows, S), m.new_empty(rows, S)
    comb = m.new_empty(rows, S, S)
    if rows:
        _split_mixes_kernel[(rows,)](flat, scale.float().contiguous(), base.float().contiguous(), pre, post, comb,
                                     iters, eps, S=S)
    return pre.view(*lead, S), post.view(*lead, S), comb.view(*lead, S, S)
