"""Hyper-connections: the residual stream carried as S parallel streams (docs/ARCHITECTURE.md §5, §7).

Shapes: B batch, T positions, S streams (hc_mult), D dim, M = (2 + S)·S mix width.

Each sublayer computes, from the flattened stream, `pre` (how to read the streams; used by the *next*
sublayer, trap 1), `post` (how much of the sublayer output each stream receives) and `comb` (a doubly
stochastic S×S residual mix made by Sinkhorn, applied transposed, trap 2). All of it is fp32.
"""

from __future__ import annotations

import numpy as np
import torch

from .numerics import Numerics


# Positions from which the positions-innermost layout pays for its two copies (measured on the CPU:
# 0.9× at 16 positions, 1.5× at 64, 5× at 1024); training always takes it, for its backward.
INNERMOST_FROM = 64


def sinkhorn(c: torch.Tensor, iters: int, eps: float, numerics: Numerics) -> torch.Tensor:
    """c [..., S, S] logits → near doubly stochastic; row softmax first, ends on a column step (§7.4)."""
    few = _few(c.shape[:-2].numel(), c)
    if few and numerics.host_mixes:
        a = c.detach().cpu().numpy().copy()
        return torch.from_numpy(_host_sinkhorn(a, iters, a.dtype.type(eps))).to(c.device)
    if numerics.reference_order or few:
        return _sinkhorn(c, iters, eps, numerics, rows=-1, columns=-2)
    return _PositionsInnermost.apply(c, iters, eps, numerics)


def _few(rows: int, *tensors: torch.Tensor) -> bool:
    """Fewer rows than the positions-innermost layout pays for, and no autograd recording them."""
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return rows < INNERMOST_FROM and not recording


class _PositionsInnermost(torch.autograd.Function):
    """Sinkhorn on an [S, S, ...] copy: every division then runs over contiguous positions instead of
    broadcasting over S-wide rows (about 3× faster on the CPU). The backward recomputes the steps in
    that layout, so no gradient ever flows through a permuted view (which costs as much again)."""

    @staticmethod
    def forward(ctx, c, iters, eps, numerics):
        ctx.save_for_backward(c)
        ctx.steps = (iters, eps, numerics)
        return _natural(_sinkhorn(_innermost(c), *ctx.steps, rows=1, columns=0))

    @staticmethod
    def backward(ctx, grad):
        (c,) = ctx.saved_tensors
        with torch.enable_grad():
            t = _innermost(c.detach()).requires_grad_()
            (g,) = torch.autograd.grad(_sinkhorn(t, *ctx.steps, rows=1, columns=0), t, _innermost(grad))
        return _natural(g), None, None, None


def _innermost(c: torch.Tensor) -> torch.Tensor:
    return c.movedim(-2, 0).movedim(-1, 1).contiguous()


def _natural(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(0, -1).movedim(0, -1).contiguous()


def _sinkhorn(c: torch.Tensor, iters: int, eps: float, numerics: Numerics, *, rows: int, columns: int) -> torch.Tensor:
    # the row softmax written out as exp / sum, as the reference kernel computes it (same rounding)
    c = numerics.exp(c - c.amax(dim=rows, keepdim=True))
    c = c / c.sum(dim=rows, keepdim=True) + eps
    c = c / (c.sum(dim=columns, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=rows, keepdim=True) + eps)
        c = c / (c.sum(dim=columns, keepdim=True) + eps)
    return c


def _host_sinkhorn(a: np.ndarray, iters: int, eps: np.floating) -> np.ndarray:
    """`_sinkhorn`'s steps in NumPy, in place on a [..., S, S]: a decode step's few 4×4 matrices cost
    each torch op its fixed dispatch overhead (numerics.py `cpu_kernels`, docs/NUMERICS.md N10)."""
    a -= a.max(axis=-1, keepdims=True)
    np.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    a += eps
    a /= a.sum(axis=-2, keepdims=True) + eps
    for _ in range(iters - 1):
        a /= a.sum(axis=-1, keepdims=True) + eps
        a /= a.sum(axis=-2, keepdims=True) + eps
    return a


def _host_split_mixes(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, s: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`split_mixes` in NumPy (few rows, fast numerics on the CPU): a dozen NumPy ops instead of ~140
    torch ones. σ(z) is computed as (1 + tanh(z/2)) / 2, which cannot overflow."""
    a = m.detach().cpu().numpy()
    e = a.dtype.type(eps)
    z = a * np.repeat(scale.detach().cpu().numpy(), (s, s, s * s)).astype(a.dtype) + base.detach().cpu().numpy()
    gates = np.tanh(z[..., :2 * s] * a.dtype.type(0.5))
    pre = gates[..., :s] * a.dtype.type(0.5) + (a.dtype.type(0.5) + e)
    post = gates[..., s:] + a.dtype.type(1)
    comb = _host_sinkhorn(np.ascontiguousarray(z[..., 2 * s:]).reshape(*a.shape[:-1], s, s), iters, e)
    return tuple(torch.from_numpy(t).to(m.device) for t in (pre, post, comb))


def split_mixes(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: int, iters: int,
                eps: float, numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m [..., M] → pre [..., S], post [..., S], comb [..., S, S] (§7.3)."""
    s = streams
    native = numerics.split_mixes(m, scale, base, s, iters, eps)
    if native is not None:
        return native
    if numerics.host_mixes and _few(m.shape[:-1].numel(), m, scale, base):
        return _host_split_mixes(m, scale, base, s, iters, eps)
    pre = numerics.sigmoid(m[..., :s] * scale[0] + base[:s]) + eps
    post = 2 * numerics.sigmoid(m[..., s:2 * s] * scale[1] + base[s:2 * s])
    comb = (m[..., 2 * s:] * scale[2] + base[2 * s:]).unflatten(-1, (s, s))
    return pre, post, sinkhorn(comb, iters, eps, numerics)


def collapse(x: torch.Tensor, pre: torch.Tensor, numerics: Numerics | None = None) -> torch.Tensor:
    """hc_pre: bf16(Σ_i pre_i · X_i); x [B, T, S, D], pre [B, T, S] → [B, T, D]. With a policy, a decode
    step's few rows may take its native kernel (the same bits)."""
    native = None if numerics is None else numerics.hc_collapse(x, pre)
    if native is not None:
        return native
    return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)


def expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
           numerics: Numerics) -> torch.Tensor:
    """hc_post: stream j = bf16(post_j · o + Σ_i comb[i][j] · R_i); → [B, T, S, D]."""
    native = numerics.hc_expand(out, residual, post, comb)
    if native is not None:
        return native
    mixed = numerics.stream_mix(comb, residual)       # the reference's rounding in reference numerics
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


def identity_pre(batch: int, length: int, streams: int, device=None) -> torch.Tensor:
    """The one-hot pre-mix that feeds layer 0's attention with stream 0 (§4 step 4)."""
    pre = torch.zeros(batch, length, streams, device=device, dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre


def mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int,
          norm_eps: float, hc_eps: float, numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_mixes: x [B, T, S, D] → (pre, post, comb) with fn [M, S·D], scale [3], base [M] (§7).

    One RMS statistic over all S·D features, no norm weight (§7.2).
    """
    native = numerics.hc_mixes(x, fn, scale, base, iters, norm_eps, hc_eps)
    if native is not None:
        return native
    flat = x.flatten(2).float()
    m = numerics.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return split_mixes(m, scale, base, x.shape[2], iters, hc_eps, numerics)
