"""Mixture of experts: √softplus router, stacked routed experts, one shared expert (docs/ARCHITECTURE.md §13).

Shapes: n tokens (B·T flattened), D dim, F expert hidden, E routed experts (local to this rank),
A experts per token, P = n·A token–expert pairs.

Routing is a pure function (selection by score + bias, weights from the raw scores, trap 16; ties to
the lower expert id). Routed experts are stored stacked ([E, out, in] logically). How they run is the
numerics policy's `experts` choice:
- "loop" (always in reference numerics or with invariant kernels): each expert that has rows runs once
  over all of them, in ascending expert order, as the reference's expert loop does — the quantised
  blockwise GEMM, or one matmul per projection — so a row's result does not depend on its neighbours,
  and a decode step reads only its chosen experts' weights, in place. Quantised experts under
  invariant kernels run a call with no more pairs than experts (a decode step) as one batched GEMM per
  projection over the pairs' gathered stored bytes instead: exact block sums give the same bits
  (docs/NUMERICS.md N7). Weights held dequantised (fast numerics) run outside autograd with every
  product written in place and one SwiGLU over all pairs; under BLAS kernels a bank whose experts are
  nearly all busy (a batch of decode rows) runs as one zero-padded batched product per projection;
- "grouped" (fast numerics on accelerators): one grouped GEMM per projection over the pairs sorted by
  expert, with group offsets on the device (no per-expert host synchronisation, STYLE.md P7).
Under fast numerics with `stored_experts` the fp4 banks stay in their stored bytes: the native kernel
decodes each tile of rows as it multiplies, and the torch path dequantises one expert at a time, into
the values a held bank has, so the results keep the held bank's bits (docs/NUMERICS.md N30).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .layers import Linear, quantized_linear, quantized_pairs, stored_dtypes, weight_shapes
from .numerics import Numerics
from ..config import ConfigError
from ..parallel.context import ParallelContext

# Routing weights are normalised with their own constant, not norm_eps (§13, trap 3).
ROUTE_NORM_EPS = 1e-20
# Held weights under BLAS kernels: the bank runs as one padded batched product per projection when
# E experts × the busiest expert's rows are at most this many rows per (token, expert) pair, and no
# expert has more rows than PADDED_MOST_ROWS (beyond, the per-call cost is amortised and the padding
# costs more: a 128-token prefill ran 1.1–1.2× slower padded).
PADDED_ROWS_PER_PAIR = 4
PADDED_MOST_ROWS = 16


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float, *,
          numerics: Numerics, gate_temp: float = 1.0, bias_vl: torch.Tensor | None = None,
          image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, D] → (weights [n, A] fp32, expert ids [n, A]); bias (or bias_vl on image tokens) only selects."""
    logits = numerics.widened_linear(x, weight)
    if gate_temp != 1.0:
        logits = logits / gate_temp
    fused = numerics.route(logits, bias, topk, route_scale, ROUTE_NORM_EPS, bias_vl, image_mask)
    if fused is not None:
        return fused
    scores = numerics.softplus(logits).sqrt()                                                   # [n, E]
    select_bias = bias
    if bias_vl is not None and image_mask is not None:
        select_bias = torch.where(image_mask.unsqueeze(-1), bias_vl, bias)
    ids = numerics.topk(scores + select_bias, topk)[1]
    weights = scores.gather(1, ids)
    if topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTE_NORM_EPS)
    return weights * route_scale, ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, numerics: Numerics) -> torch.Tensor:
    """silu(min(g, limit)) · clamp(u, ±limit) in fp32; the gate is clamped from above only (trap 17)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return numerics.silu(gate) * up


class Expert(nn.Module):
    """The shared expert: SwiGLU with fp8 weights w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float, *, numerics: Numerics, storage: str = "fp8",
                 device=None, dtype=torch.bfloat16):
        super().__init__()
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        self.w1 = Linear(dim, inter_dim, storage, **kw)
        self.w2 = Linear(inter_dim, dim, storage, **kw)
        self.w3 = Linear(dim, inter_dim, storage, **kw)
        self.swiglu_limit, self.numerics = swiglu_limit, numerics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.w1.quantized:
            fused = self.numerics.dense_swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight, self.swiglu_limit)
            if fused is not None:
                return fused
        return self.w2(swiglu(self.w1(x), self.w3(x), self.swiglu_limit, self.numerics).to(x.dtype))

    def added_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y + forward(x) in fp32 (y fp32 [n, D], x [n, D]): the routed sum plus the shared expert's
        output, which a decode step's few rows add in the native call, into y."""
        if not self.w1.quantized and y.is_contiguous():
            fused = self.numerics.dense_swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight,
                                               self.swiglu_limit, into=y)
            if fused is not None:
                return fused
        return y + self.forward(x).float()


class StackedWeight(nn.Module):
    """E matrices [out, in] in one storage format: `weight [E, …]` and, if quantised, `scale [E, …]`."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, storage: str, *, numerics: Numerics,
                 device=None, dtype=torch.bfloat16, keep_stored: bool = False):
        super().__init__()
        self.storage, self.in_features, self.out_features = storage, in_features, out_features
        w_dtype, s_dtype = stored_dtypes(storage, numerics, dtype, keep_stored)
        w_shape, s_shape = weight_shapes(in_features, out_features, storage)
        if s_dtype is None:
            w_shape = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty((n_experts, *w_shape), device=device, dtype=w_dtype), requires_grad=False)
        if s_dtype is not None:
            self.scale = nn.Parameter(torch.empty((n_experts, *s_shape), device=device, dtype=s_dtype), requires_grad=False)
        else:
            self.register_parameter("scale", None)

    def apply_pairs(self, x: torch.Tensor, experts: torch.Tensor, numerics: Numerics,
                    beside: "StackedWeight | None" = None) -> torch.Tensor:
        """x [P, in], row p through expert experts[p]: one batched quantised GEMM over the pairs'
        gathered stored bytes (never a dequantised copy) → bf16 [P, out]; with `beside` (a bank of the
        same input width), both banks' rows in one call → [P, out + beside.out]."""
        weight, scale, out = self.weight[experts], self.scale[experts], self.out_features
        if beside is not None:
            # rows join whole scale blocks: an expert's hidden width is a multiple of 32 (w2's input blocks)
            weight = torch.cat([weight, beside.weight[experts]], dim=1)
            scale = torch.cat([scale, beside.scale[experts]], dim=1)
            out += beside.out_features
        return quantized_pairs(x, weight, scale, self.storage, out, numerics)

    def held(self, expert: int, numerics: Numerics, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s matrix [out, in] in the compute dtype: the held bank's row in place, or a
        stored one dequantised (fast numerics' stored experts)."""
        if self.scale is None:
            return self.weight[expert]
        return numerics.expert_matrix(self.weight[expert], self.scale[expert], dtype)

    def apply(self, x: torch.Tensor, expert: int, numerics: Numerics) -> torch.Tensor:
        """x [m, in] through expert `expert`: the quantised blockwise GEMM (bf16 out) or one matmul."""
        if self.scale is not None:
            return quantized_linear(x, self.weight[expert], self.scale[expert], self.storage, self.out_features,
                                    numerics)
        w = self.weight[expert]
        return numerics.linear(x.to(w.dtype), w)


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored stacked; checkpoint `experts.{e}.w1.weight` is row e of `experts.w1.weight`."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, storage: str, swiglu_limit: float, *,
                 numerics: Numerics, partial: bool = False, device=None, dtype=torch.bfloat16):
        super().__init__()
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        self.n_experts, self.numerics, self.swiglu_limit = n_experts, numerics, swiglu_limit
        self.partial, self.dtype = partial, dtype
        # fp4 banks held in their stored bytes under fast numerics (computed as if dequantised to dtype)
        self.stored = numerics.stored_experts and storage == "fp4"
        kw["keep_stored"] = self.stored
        self.w1 = StackedWeight(n_experts, dim, inter_dim, storage, **kw)
        self.w2 = StackedWeight(n_experts, inter_dim, dim, storage, **kw)
        self.w3 = StackedWeight(n_experts, dim, inter_dim, storage, **kw)

    def _native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """The policy's native routed experts of these banks (stored ones with their scales), or None."""
        scales = (self.w1.scale, self.w3.scale, self.w2.scale) if self.stored else None
        return self.numerics.routed_experts(x, ids, weights, self.w1.weight, self.w3.weight, self.w2.weight,
                                            self.swiglu_limit, shared=shared, scales=scales, dtype=self.dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [n, D], weights/ids [n, A] (local expert ids, −1 = not on this rank) → Σ_pairs out [n, D] fp32."""
        out = self._native(x, weights, ids)
        if out is not None:
            return out
        n, A = ids.shape
        token = torch.arange(n, device=x.device).repeat_interleave(A)
        expert, w = ids.flatten(), weights.flatten()
        local = None
        if self.partial:
            # expert parallelism: pairs another rank owns become a sentinel expert E that sorts last,
            # with weight 0, and are masked out below; no data-dependent size, so no host sync here
            local = expert >= 0
            expert, w = torch.where(local, expert, self.n_experts), torch.where(local, w, 0.0)
        # Pairs in expert order: the grouped GEMM needs it, and the fp32 sum over a token's experts then
        # runs in ascending expert order, as the reference's expert loop adds them.
        order = torch.argsort(expert, stable=True)
        token, expert, w = token[order], expert[order], w[order]
        if self.numerics.grouped_experts:
            out = self._grouped(x[token], expert, w)
        elif self.numerics.pairs_at_once(self.w1.storage) and expert.numel() <= self.n_experts:
            out = self._pairs(x[token], expert.clamp(max=self.n_experts - 1), w)
        else:
            out = self._per_expert(x[token], expert, w)
        if local is not None:
            out = torch.where(local[order].unsqueeze(-1), out, 0.0)      # the sentinel's rows hold no result
        out = out.float()
        return torch.zeros(n, x.shape[1], device=x.device, dtype=out.dtype).index_add_(0, token, out)

    def with_shared(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: Expert) -> torch.Tensor | None:
        """`forward` plus the shared expert's output, fp32 [n, D] (MoE's `shared.added_to(forward(…), x)`,
        the same bits), in one native call where the policy takes both; else None."""
        if shared.w1.quantized or shared.swiglu_limit != self.swiglu_limit:
            return None
        return self._native(x, weights, ids, shared=(shared.w1.weight, shared.w3.weight, shared.w2.weight))

    def _finish(self, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # the routing weight multiplies before w2, so it passes through w2's activation QDQ (trap 17)
        return (swiglu(gate, up, self.swiglu_limit, self.numerics) * w.unsqueeze(-1)).to(dtype)

    def _per_expert(self, x: torch.Tensor, expert: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Pairs sorted by expert → outputs [P, D]: each expert with rows runs once over all of them, as
        the reference's expert loop does (a matmul per pair sums differently: docs/NUMERICS.md N7)."""
        ends = torch.bincount(expert, minlength=self.n_experts).cumsum(0).tolist()[:self.n_experts]
        spans = [(e, start, end) for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)) if end > start]
        if not spans:                                   # expert parallelism: no pair is this rank's
            return x.new_zeros(x.shape[0], self.w2.out_features)
        if self.stored and self._recording(x):
            raise ConfigError("stored experts have no backward (their products are written in place): "
                              "train with stored_experts=False")
        if (self.w1.scale is None or self.stored) and not self._recording(x):
            most = max(end - start for _, start, end in spans)
            busy = self.n_experts * most <= PADDED_ROWS_PER_PAIR * x.shape[0]
            # the padded product reads the whole bank in place: not from stored bytes
            if not self.numerics.invariant and busy and most <= PADDED_MOST_ROWS and not self.stored:
                return self._padded(x, spans, w, most)
            return self._held(x, spans, w)
        out = x.new_zeros(x.shape[0], self.w2.out_features)
        for e, start, end in spans:
            rows = x[start:end]
            gate, up = self.w1.apply(rows, e, self.numerics), self.w3.apply(rows, e, self.numerics)
            h = self._finish(gate, up, w[start:end], x.dtype)
            out[start:end] = self.w2.apply(h, e, self.numerics).to(x.dtype)
        return out

    def _recording(self, x: torch.Tensor) -> bool:
        """Whether autograd records this call (training): products written in place have no backward."""
        banks = (self.w1.weight, self.w2.weight, self.w3.weight)
        return torch.is_grad_enabled() and (x.requires_grad or any(b.requires_grad for b in banks))

    def _held(self, x: torch.Tensor, spans: list[tuple[int, int, int]], w: torch.Tensor) -> torch.Tensor:
        """The loop over weights held in the compute dtype, outside autograd: every expert's products
        written in place into one result per projection, and the SwiGLU once over all pairs
        (elementwise, so each pair's values are its expert's): about half the torch ops of the loop
        above for a decode step."""
        dtype = self.dtype if self.stored else self.w1.weight.dtype
        x = x.to(dtype)

        def matrix(bank: StackedWeight, e: int) -> torch.Tensor:                                # [in, out]
            return bank.held(e, self.numerics, dtype).transpose(0, 1)

        gate, up = x.new_empty(2, x.shape[0], self.w1.out_features).unbind(0)
        for e, start, end in spans:
            rows = x[start:end]
            self.numerics.matmul_into(rows, matrix(self.w1, e), gate[start:end])
            self.numerics.matmul_into(rows, matrix(self.w3, e), up[start:end])
        h = self._finish(gate, up, w, x.dtype)
        out = x.new_empty(x.shape[0], self.w2.out_features)
        for e, start, end in spans:
            self.numerics.matmul_into(h[start:end], matrix(self.w2, e), out[start:end])
        return out

    def _padded(self, x: torch.Tensor, spans: list[tuple[int, int, int]], w: torch.Tensor, most: int) -> torch.Tensor:
        """Most experts busy (a batch of decode rows): every expert's rows padded with zeros to `most`,
        and one batched product per projection over the whole bank, read in place. Each BLAS call costs
        ~20 µs beyond its arithmetic on the CPU, so E experts × 3 calls cost more than three products
        over E · most rows (at most PADDED_ROWS_PER_PAIR per pair). Rows of the EP sentinel expert
        (past the spans) go to a scratch row and read back expert 0's first row, which the caller masks."""
        E, P, R = self.n_experts, x.shape[0], most
        scatter = [E * R] * P
        for e, start, end in spans:
            scatter[start:end] = range(e * R, e * R + end - start)
        into = torch.tensor(scatter, device=x.device)
        back = into.clamp(max=E * R - 1)

        def project(rows: torch.Tensor, bank: StackedWeight) -> torch.Tensor:
            padded = rows.new_zeros(E * R + 1, rows.shape[1]).index_copy_(0, into, rows)
            return torch.bmm(padded[:E * R].view(E, R, -1), bank.weight.transpose(1, 2)).flatten(0, 1)[back]

        x = x.to(self.w1.weight.dtype)
        h = self._finish(project(x, self.w1), project(x, self.w3), w, x.dtype)
        return project(h, self.w2)

    def _pairs(self, x: torch.Tensor, expert: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Few pairs (a decode step): every pair at once through its expert's gathered bytes, instead of
        one quantised GEMM per expert and projection; the same bits (exact block sums)."""
        gate, up = self.w1.apply_pairs(x, expert, self.numerics, beside=self.w3).chunk(2, dim=-1)
        return self.w2.apply_pairs(self._finish(gate, up, w, x.dtype), expert, self.numerics).to(x.dtype)

    def _grouped(self, x: torch.Tensor, expert: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Pairs sorted by expert (weights held dequantised by fast numerics) → outputs [P, D]: one
        grouped GEMM per projection, expert e owning rows [ends[e−1], ends[e]); the offsets stay on the
        device. Pairs of the EP sentinel expert E fall past the last offset and are masked by the caller.
        The offsets come from a search of the sorted ids, not `bincount`, whose output size waits on the
        device (a host synchronisation per layer on CUDA, measured: 16 of a decode step's 25)."""
        experts = torch.arange(self.n_experts, device=expert.device)
        ends = torch.searchsorted(expert, experts, right=True).to(torch.int32)

        def project(a: torch.Tensor, bank: StackedWeight) -> torch.Tensor:
            return torch._grouped_mm(a, bank.weight.to(a.dtype).transpose(1, 2), offs=ends)

        gate, up = project(x, self.w1), project(x, self.w3)
        return project(self._finish(gate, up, w, x.dtype), self.w2)


class MoE(nn.Module):
    def __init__(self, dim: int, inter_dim: int, n_experts: int, n_activated: int, route_scale: float,
                 swiglu_limit: float, expert_storage: str, *, vision: bool, gate_temp: float = 1.0,
                 dense_storage: str = "fp8", numerics: Numerics, device=None, dtype=torch.bfloat16,
                 parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.numerics = numerics
        self.n_experts, self.topk, self.route_scale, self.gate_temp = n_experts, n_activated, route_scale, gate_temp
        # expert parallelism: this rank's contiguous range; the others' outputs arrive in the all-reduce
        self.expert_range = parallel.expert_range(n_experts)
        self.experts_parallel, self.experts_group = parallel.ep_size > 1, parallel.ep_group
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        self.gate = Router(dim, n_experts, vision=vision, device=device)
        local = self.expert_range[1] - self.expert_range[0]
        self.experts = RoutedExperts(local, dim, inter_dim, expert_storage, swiglu_limit,
                                     partial=local != n_experts, **kw)
        self.shared_experts = Expert(dim, inter_dim, swiglu_limit, storage=dense_storage, **kw)

    def route(self, x: torch.Tensor, image_mask: torch.Tensor | None = None):
        return route(x, self.gate.weight, self.gate.bias, self.topk, self.route_scale, numerics=self.numerics,
                     gate_temp=self.gate_temp, bias_vl=self.gate.bias_vl, image_mask=image_mask)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] (after ffn_norm) → [B, T, D]; image_mask [B, T] selects bias_vl."""
        return self.routed(x, image_mask)[0]

    def routed(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the output [B, T, D], the chosen expert ids [B·T, A]); training counts expert load from the ids."""
        flat = x.flatten(0, 1)
        fused = self._fused(flat) if image_mask is None else None
        if fused is not None:
            return fused[0].view_as(x), fused[1]
        weights, chosen = self.route(flat, None if image_mask is None else image_mask.flatten())
        lo, hi = self.expert_range
        ids = torch.where((chosen >= lo) & (chosen < hi), chosen - lo, -1) if self.experts.partial else chosen
        # one native call for both where it takes them; under EP the shared expert adds after the all-reduce
        y = None if self.experts_parallel else self.experts.with_shared(flat, weights, ids, self.shared_experts)
        if y is None:
            y = self.experts(flat, weights, ids)                              # fp32 [n, D]
            if self.experts_parallel:
                dist.all_reduce(y, group=self.experts_group)                   # in fp32, as the reference (§13)
            y = self.shared_experts.added_to(y, flat)
        return y.to(x.dtype).view_as(x), chosen

    def _fused(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`routed` of a decode step's tokens as one native call of the policy's (the gate, the router, the
        routed and shared experts; the same bits), where every expert is this rank's, the gate runs at
        temperature 1 and the shared expert is held like the banks' dtype; else None."""
        parts = self.fused_parts()
        return None if parts is None else self.numerics.moe(flat, *parts)

    def fused_parts(self) -> tuple | None:
        """What a decode step's one native call takes after its tokens (the gate and its bias, top-k, route
        scale and eps, the SwiGLU limit, the banks, the shared expert, the banks' scales when stored),
        or None where this layer keeps its own calls: expert parallelism, a gate temperature, a quantised
        shared expert or one with another SwiGLU limit."""
        experts, shared = self.experts, self.shared_experts
        if experts.partial or self.experts_parallel or self.gate_temp != 1.0 or shared.w1.quantized \
                or shared.swiglu_limit != experts.swiglu_limit:
            return None
        scales = (experts.w1.scale, experts.w3.scale, experts.w2.scale) if experts.stored else None
        return (self.gate.weight, self.gate.bias, self.topk, self.route_scale, ROUTE_NORM_EPS, experts.swiglu_limit,
                (experts.w1.weight, experts.w3.weight, experts.w2.weight),
                (shared.w1.weight, shared.w3.weight, shared.w2.weight), scales)


class Router(nn.Module):
    """`gate.weight [E, D]` (bf16), `gate.bias [E]` and, with vision, `gate.bias_vl [E]` (fp32)."""

    def __init__(self, dim: int, n_experts: int, *, vision: bool, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim, device=device, dtype=torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_experts, device=device, dtype=torch.float32), requires_grad=False)
        if vision:
            self.bias_vl = nn.Parameter(torch.empty(n_experts, device=device, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("bias_vl", None)
