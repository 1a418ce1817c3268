"""Basic layers: RMSNorm, Linear in the release's storage formats, embedding and head.

Shapes: B batch, T positions, D dim, V vocab; `...` is any leading shape.

A `Linear` is built from the storage the checkpoint uses ("fp8", "fp4", "bf16", "fp32") and the
run's `Numerics` policy:
- `reference` keeps fp8 / fp4 weights quantised (weight + ue8m0 `scale`, named as in the checkpoint),
  quantises activations to fp8 and runs the reference's blockwise GEMM (docs/ARCHITECTURE.md §6.3); outputs
  are bf16.
- `fast` holds every quantised weight dequantised in the compute dtype and skips activation
  quantisation.
Every product goes through the policy's kernels (`numerics.py`).

Under tensor parallelism (a `Shard` from the parallel context, docs/PARALLEL.md) a Linear holds its
rank's rows (`ColumnParallelLinear`: query heads, output groups, indexer heads; no collective, the
heads stay on their rank) or columns (`RowParallelLinear`: each rank's partial product is summed over
the TP group in fp32, as the reference reduces), and the embedding and head hold a vocabulary slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import formats
from .numerics import Numerics
from ..parallel.context import Shard

STORAGES = ("fp8", "fp4", "bf16", "fp32")


class RMSNorm(nn.Module):
    """`bf16(w · x / sqrt(mean(x²) + eps))` with statistics and scaling in fp32 (§6.7); with a policy,
    the policy's kernel where it has one (`Numerics.rms_norm`)."""

    def __init__(self, dim: int, eps: float, *, numerics: Numerics | None = None, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.eps, self.numerics = eps, numerics
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics is not None:
            out = self.numerics.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def weight_shapes(in_features: int, out_features: int, storage: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Stored (weight, scale) shapes of a quantised or plain [out, in] matrix (docs/CHECKPOINT.md §2)."""
    b = formats.FP8_WEIGHT_BLOCK
    if storage == "fp8":
        return (out_features, in_features), (-(-out_features // b), -(-in_features // b))
    if storage == "fp4":
        return (out_features, in_features // 2), (out_features, in_features // 32)
    return (out_features, in_features), None


def stored_dtypes(storage: str, numerics: Numerics, compute_dtype: torch.dtype, keep_stored: bool = False
                  ) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, scale dtype or None) a module holds for a given storage and numerics policy;
    `keep_stored`: an fp4 weight stays stored under fast numerics too (stored routed experts)."""
    if storage == "fp8" and numerics.quantized:
        return torch.float8_e4m3fn, torch.float8_e8m0fnu
    if storage == "fp4" and (numerics.quantized or keep_stored):
        return torch.int8, torch.float8_e8m0fnu
    if storage == "fp32":
        return torch.float32, None
    if storage == "bf16" and numerics.quantized:
        return torch.bfloat16, None
    return compute_dtype, None


def block_scales(scale: torch.Tensor, storage: str, out_features: int) -> torch.Tensor:
    """A quantised [..., out, in] weight's power-of-two scales as the blockwise GEMM takes them: fp32
    [..., out, in/32], one per output row and K block (§6.2)."""
    if storage == "fp4":
        return formats.e8m0_to_float(scale)
    return formats.e8m0_to_float(scale).repeat_interleave(formats.FP8_WEIGHT_BLOCK, dim=-2)[..., :out_features, :]


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str,
                     out_features: int, numerics: Numerics) -> torch.Tensor:
    """§6.3: fp8 activation quantisation per 32, the blockwise GEMM (not one GEMM over the dequantised
    weight, which rounds differently: docs/NUMERICS.md N5), bf16 out; x [..., in]."""
    whole = numerics.quantized_linear(x, weight, scale, storage, pairs=False)
    if whole is not None:
        return whole
    q, q_scale = numerics.fp8_act_quant(x)
    flat = q.reshape(-1, q.shape[-1])
    y = numerics.block_scaled_matmul(flat, q_scale.reshape(flat.shape[0], -1), weight,
                                     block_scales(scale, storage, out_features), storage)
    return y.to(torch.bfloat16).view(*x.shape[:-1], out_features)


def quantized_pairs(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str,
                    out_features: int, numerics: Numerics) -> torch.Tensor:
    """`quantized_linear` of P rows, each through its own weight: x [P, in], weight/scale [P, …] → bf16
    [P, out]. Only where `numerics.pairs_at_once(storage)`: exact block sums make each pair's bits
    those of running its row alone."""
    whole = numerics.quantized_linear(x, weight, scale, storage, pairs=True)
    if whole is not None:
        return whole
    q, q_scale = numerics.fp8_act_quant(x)
    y = numerics.block_scaled_matmul(q.unsqueeze(1), q_scale.unsqueeze(1), weight,
                                     block_scales(scale, storage, out_features), storage)
    return y.squeeze(1).to(torch.bfloat16)


def dense_storage(cfg) -> str:
    """Storage of the dense Linears: `dtype` of the config ("fp8" in the release, docs/CHECKPOINT.md §3)."""
    return "fp8" if cfg.dtype == "fp8" else "bf16"


def expert_storage(cfg) -> str:
    """Storage of the routed experts: fp4 when `expert_dtype` is "fp4", else that of the dense Linears.

    This is how the reference reads the key (its experts take the fp4 dtype or the default one), so
    "fp8", "bf16" and null all mean "as `dtype`" (docs/ARCHITECTURE.md §2)."""
    return "fp4" if cfg.expert_dtype == "fp4" else dense_storage(cfg)


class Linear(nn.Module):
    """y = x Wᵀ with W in one of the release's storage formats (no bias anywhere in the text model)."""

    def __init__(self, in_features: int, out_features: int, storage: str, *, numerics: Numerics,
                 device=None, dtype: torch.dtype = torch.bfloat16, stored_as: str | None = None,
                 shard: Shard | None = None):
        super().__init__()
        if storage not in STORAGES:
            raise ValueError(f"unknown Linear storage {storage!r}; expected one of {STORAGES}")
        self.shard = shard
        if shard is not None and shard.dim == 0:
            out_features = shard.size(out_features)
        elif shard is not None:
            in_features = shard.size(in_features)
        # The checkpoint's format when it differs from the module's (wo_a: fp8 stored, bf16 held).
        self.stored_as = stored_as or storage
        if storage == "fp4" and in_features % 32:
            raise ValueError(f"fp4 Linear needs in_features divisible by 32, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.storage, self.numerics, self.compute_dtype = storage, numerics, dtype
        w_dtype, s_dtype = stored_dtypes(storage, numerics, dtype)
        w_shape, s_shape = weight_shapes(in_features, out_features, storage)
        if s_dtype is None:
            w_shape = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(w_shape, device=device, dtype=w_dtype), requires_grad=False)
        if s_dtype is not None:
            self.scale = nn.Parameter(torch.empty(s_shape, device=device, dtype=s_dtype), requires_grad=False)
        else:
            self.register_parameter("scale", None)

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical [out, in] weight."""
        if self.storage == "fp8" and self.quantized:
            return formats.dequantize_fp8_weight(self.weight, self.scale).to(dtype)
        if self.storage == "fp4" and self.quantized:
            return formats.dequantize_fp4_weight(self.weight, self.scale).to(dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return quantized_linear(x, self.weight, self.scale, self.storage, self.out_features, self.numerics)
        return self.numerics.linear(x.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, storage={self.storage}, "
                f"numerics={self.numerics.mode}/{self.numerics.kernels}")


class ColumnParallelLinear(Linear):
    """A Linear holding its rank's output rows (a dim-0 `Shard`); its outputs stay on the rank."""

    def __init__(self, in_features: int, out_features: int, storage: str, *, shard: Shard | None, **kw):
        if shard is not None and shard.dim != 0:
            raise ValueError(f"a column-parallel Linear cuts its output rows, not dim {shard.dim}")
        super().__init__(in_features, out_features, storage, shard=shard, **kw)


class RowParallelLinear(Linear):
    """A Linear holding its rank's input columns (a dim-1 `Shard`): y = Σ_ranks x_r W_rᵀ, the partial
    products upcast to fp32, all-reduced over the TP group, cast back (§11.8)."""

    def __init__(self, in_features: int, out_features: int, storage: str, *, shard: Shard | None, **kw):
        if shard is not None and shard.dim != 1:
            raise ValueError(f"a row-parallel Linear cuts its input columns, not dim {shard.dim}")
        super().__init__(in_features, out_features, storage, shard=shard, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduced(super().forward(x))

    def reduced(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product y summed over the TP group (itself without tensor parallelism)."""
        if self.shard is None:
            return y
        partial = y.float()
        dist.all_reduce(partial, group=self.shard.group)
        return partial.to(y.dtype)


class Embedding(nn.Module):
    """Token embedding [V, D] (bf16 in the release); under tensor parallelism the rank's vocabulary rows:
    ids outside them read zeros, and the all-reduce over the TP group adds the one real row (§8)."""

    def __init__(self, vocab_size: int, dim: int, *, device=None, dtype=torch.bfloat16, shard: Shard | None = None):
        super().__init__()
        self.vocab_size, self.shard = vocab_size, shard
        rows = vocab_size if shard is None else shard.size(vocab_size)
        self.first = 0 if shard is None else shard.start(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill(elsewhere.unsqueeze(-1), 0)
        dist.all_reduce(y, group=self.shard.group)
        return y


class Head(nn.Module):
    """Output projection [V, D] giving fp32 logits (§8, trap 20): held in fp32 as the reference holds it,
    or (`Numerics.head_dtype`) in the checkpoint's bf16 and widened as it is read; under tensor
    parallelism each rank projects its vocabulary rows and the logits are all-gathered in rank order."""

    def __init__(self, vocab_size: int, dim: int, *, numerics: Numerics, device=None, shard: Shard | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.numerics, self.shard = numerics, shard
        rows = vocab_size if shard is None else shard.size(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.numerics.head_logits(x, self.weight)
        if self.shard is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.shard.parts)]
        dist.all_gather(parts, logits.contiguous(), group=self.shard.group)
        return torch.cat(parts, dim=-1)
