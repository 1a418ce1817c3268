"""One block of DeepSeek-V4.1 (docs/ARCHITECTURE.md §5): hyper-connections around attention and MoE.

Shapes: B batch, T positions, S streams (hc_mult), D dim.
"""

from __future__ import annotations

import torch
from torch import nn

from . import hyper
from .attention import Attention
from .indexer import DEFAULT_BUDGET_BYTES
from .cache import ModelCache
from ..config import ModelConfig
from .engram import Engram
from .layers import RMSNorm, dense_storage, expert_storage
from .moe import MoE
from .numerics import Numerics
from .roles import LayerRole
from .step import Handoff, Step
from ..parallel.context import ParallelContext


class Block(nn.Module):
    """One layer: attention and MoE, each between a stream collapse and a stream expansion (§5)."""

    attention_cls = Attention

    def __init__(self, cfg: ModelConfig, role: LayerRole, *, numerics: Numerics, device=None, dtype=torch.bfloat16,
                 indexer_budget_bytes: int = DEFAULT_BUDGET_BYTES, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.role, self.numerics = role, numerics
        self.hc_iters, self.norm_eps, self.hc_eps = cfg.hc_sinkhorn_iters, cfg.norm_eps, cfg.hc_eps
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        self.attn = self.attention_cls(cfg, role, indexer_budget_bytes=indexer_budget_bytes, parallel=parallel, **kw)
        n_experts, n_active = ((cfg.dspark_n_routed_experts, cfg.dspark_n_activated_experts) if role.is_dspark
                               else (cfg.n_routed_experts, cfg.n_activated_experts))
        self.ffn = MoE(cfg.dim, cfg.moe_inter_dim, n_experts, n_active, cfg.route_scale, cfg.swiglu_limit,
                       expert_storage(cfg), vision=cfg.vision_enabled, gate_temp=cfg.gate_temp,
                       dense_storage=dense_storage(cfg), parallel=parallel, **kw)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=numerics, device=device)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=numerics, device=device)
        width, flat = cfg.hc_mix_width, cfg.hc_mult * cfg.dim
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", _fp32_param((width, flat), device))
            self.register_parameter(f"hc_{sub}_base", _fp32_param((width,), device))
            self.register_parameter(f"hc_{sub}_scale", _fp32_param((3,), device))
        self.engram = None
        if role.has_engram:
            self.engram = Engram(cfg, role.engram_index, numerics=numerics, device=device, dtype=dtype, parallel=parallel)

    def _mixes(self, x: torch.Tensor, sub: str):
        return hyper.mixes(x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                           getattr(self, f"hc_{sub}_base"), iters=self.hc_iters, norm_eps=self.norm_eps,
                           hc_eps=self.hc_eps, numerics=self.numerics)

    def forward(self, x: torch.Tensor, pre: torch.Tensor, step: Step, handoff: Handoff, cache: ModelCache,
                image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, N, S, D], pre [1, N, S] (from the previous sublayer, trap 1) → (x, pre for the next)."""
        attend = lambda h, entered=None: self.attn(h, step, handoff, cache, entered=entered)
        projections = None if image_mask is not None else (lambda: self.attn.projections(step, handoff))
        return self.run(x, pre, attend, lambda h: self.ffn(h, image_mask), projections=projections)

    def run(self, x: torch.Tensor, pre: torch.Tensor, attend, feed_forward, *,
            projections=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block around its two sublayers, given as functions of their normed input: the cached
        inference forward passes its attention over the cache, training (dsv41/training) a cache-free one.
        `projections` (the cached forward's, without images): the attention's `Attention.projections`, and
        feed_forward is this block's MoE; then a decode step may make the block's way into the attention
        and its feed-forward half one native call each (`Numerics.attention_entry`, `.ffn_half`; N35),
        and `attend` takes the query and key paths computed on the way in."""
        entry = None if projections is None else self.attention_entry(x, pre, projections())
        if entry is None:
            x, (pre_attn, post, comb), h = self._enter(x, pre, "attn")
            out = attend(h)
        else:
            (pre_attn, post, comb), h, entered = entry
            out = attend(h, entered)
        if projections is not None:
            half = self.ffn_half(x, pre_attn, out, post, comb)
            if half is not None:
                return half[:2]
        x, (pre_ffn, post, comb), h = self._enter(x, pre_attn, "ffn", out, post, comb)
        return hyper.expand(feed_forward(h), x, post, comb, self.numerics), pre_ffn

    def attention_entry(self, x, pre, projections: tuple):
        """((pre, post, comb) of the attention's mixes, its normed input h, the query and key paths (qr, q,
        kv)) in one native call, or None where the policy declines."""
        mixes = (self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.hc_iters, self.norm_eps, self.hc_eps)
        return self.numerics.attention_entry(x, pre, mixes, (self.attn_norm.weight, self.attn_norm.eps), projections)

    def ffn_half(self, x, pre, out, post, comb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(streams, the FFN's pre, the MoE's chosen ids) of the feed-forward half in one native call, or
        None where the policy or the MoE declines (then the block makes its calls one by one)."""
        parts = self.ffn.fused_parts()
        if parts is None:
            return None
        mixes = (self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.hc_iters, self.norm_eps, self.hc_eps)
        return self.numerics.ffn_half(x, pre, out, post, comb, mixes, (self.ffn_norm.weight, self.ffn_norm.eps), parts)

    def _enter(self, x: torch.Tensor, pre: torch.Tensor, sub: str, out: torch.Tensor | None = None,
               post: torch.Tensor | None = None, comb: torch.Tensor | None = None):
        """Into sublayer `sub`: the streams x [1, N, S, D] (with `out`, the previous sublayer's output
        expanded into them first, with its post and comb) → (the streams, this sublayer's mixes (pre, post,
        comb), its normed input [1, N, D] from the previous mixes' `pre`, trap 1). A decode step's rows take
        one native call for the four (`Numerics.hc_enter`)."""
        norm = getattr(self, f"{sub}_norm")
        fused = self.numerics.hc_enter(x, pre, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                       getattr(self, f"hc_{sub}_base"), self.hc_iters, self.norm_eps, self.hc_eps,
                                       norm.weight, norm.eps, out, post, comb)
        if fused is not None:
            return fused
        if out is not None:
            x = hyper.expand(out, x, post, comb, self.numerics)
        return x, self._mixes(x, sub), norm(hyper.collapse(x, pre, self.numerics))


def _fp32_param(shape: tuple[int, ...], device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=torch.float32), requires_grad=False)
