"""Basic layers: RMSNorm, Linear in the release's storage formats, embedding and head.

Shapes: B batch, T positions, D dim, V vocab; `...` is any leading shape.

A `Linear` is built from the storage the checkpoint uses ("fp8", "fp4", "bf16", "fp32") and the
numerics mode of the run:
- `reference` keeps fp8 / fp4 weights quantised (weight + ue8m0 `scale`, named as in the checkpoint)
  and quantises activations to fp8 before the GEMM (ARCHITECTURE.md §6.3); outputs are bf16.
- `fast` holds every quantised weight dequantised in the compute dtype and skips activation
  quantisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import formats

STORAGES = ("fp8", "fp4", "bf16", "fp32")


class RMSNorm(nn.Module):
    """`bf16(w · x / sqrt(mean(x²) + eps))` with statistics and scaling in fp32 (§6.7)."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def weight_shapes(in_features: int, out_features: int, storage: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Stored (weight, scale) shapes of a quantised or plain [out, in] matrix (CHECKPOINT.md §2)."""
    b = formats.FP8_WEIGHT_BLOCK
    if storage == "fp8":
        return (out_features, in_features), (-(-out_features // b), -(-in_features // b))
    if storage == "fp4":
        return (out_features, in_features // 2), (out_features, in_features // 32)
    return (out_features, in_features), None


def stored_dtypes(storage: str, numerics: str, compute_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, scale dtype or None) a module holds for a given storage and numerics mode."""
    if storage == "fp8" and numerics == "reference":
        return torch.float8_e4m3fn, torch.float8_e8m0fnu
    if storage == "fp4" and numerics == "reference":
        return torch.int8, torch.float8_e8m0fnu
    if storage == "fp32":
        return torch.float32, None
    if storage == "bf16" and numerics == "reference":
        return torch.bfloat16, None
    return compute_dtype, None


def dense_storage(cfg) -> str:
    """Storage of the dense Linears: `dtype` of the config ("fp8" in the release, CHECKPOINT.md §3)."""
    return "fp8" if cfg.dtype == "fp8" else "bf16"


class Linear(nn.Module):
    """y = x Wᵀ with W in one of the release's storage formats (no bias anywhere in the text model)."""

    def __init__(self, in_features: int, out_features: int, storage: str = "fp8", *, numerics: str = "reference",
                 device=None, dtype: torch.dtype = torch.bfloat16, stored_as: str | None = None):
        super().__init__()
        if storage not in STORAGES:
            raise ValueError(f"unknown Linear storage {storage!r}; expected one of {STORAGES}")
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
            # §6.3: fp8 activation QDQ per 32, fp32 GEMM over exact dequantised values, bf16 out.
            xq = formats.fp8_qdq(x.float())
            return F.linear(xq, self.dequantized_weight()).to(torch.bfloat16)
        if self.weight.dtype == torch.float32:
            return F.linear(x.float(), self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, storage={self.storage}, numerics={self.numerics}"


class Embedding(nn.Module):
    """Token embedding [V, D] (bf16 in the release); a vocab slice under tensor parallelism."""

    def __init__(self, vocab_size: int, dim: int, *, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Head(nn.Module):
    """Output projection [V, D] held in fp32 so logits come out in fp32 (§8, trap 20)."""

    def __init__(self, vocab_size: int, dim: int, *, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, device=device, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())
