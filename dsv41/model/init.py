"""Deterministic random weights for V4.1-architecture models (tests, benchmarks, the demo model).

Every matrix is drawn in fp32 and then stored in its module's format (quantised where the module keeps
fp8 / fp4), so a random model exercises exactly the numerics a released checkpoint does.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from . import formats
from .layers import Embedding, Head, Linear, RMSNorm
from .engram.table import EngramTable
from .moe import Router, StackedWeight


def _normal(shape, std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _store_matrix(param_w: nn.Parameter, param_s: nn.Parameter | None, storage: str, w: torch.Tensor) -> None:
    """Write the logical fp32 matrix w [out, in] into (weight, scale) in the module's format."""
    if param_s is None:
        param_w.data.copy_(w.to(param_w.dtype))
    elif storage == "fp4":
        q, s = formats.quantize_fp4_weight(w)
        param_w.data.copy_(q)
        param_s.data.copy_(s)
    else:
        q, s = formats.quantize_fp8_weight(w)
        param_w.data.copy_(q)
        param_s.data.copy_(s)


def representable(w: torch.Tensor, stored_as: str) -> torch.Tensor:
    """w rounded through the checkpoint's format, so saving a random model is exact."""
    if stored_as == "fp8":
        return formats.dequantize_fp8_weight(*formats.quantize_fp8_weight(w))
    if stored_as == "fp4":
        return formats.dequantize_fp4_weight(*formats.quantize_fp4_weight(w))
    if stored_as == "bf16":
        return w.to(torch.bfloat16).float()
    return w


def init_linear(m: Linear, gen: torch.Generator, std: float | None = None) -> None:
    std = std if std is not None else m.in_features ** -0.5
    w = representable(_normal((m.out_features, m.in_features), std, gen), m.stored_as)
    _store_matrix(m.weight, m.scale, m.storage, w)


def init_stacked(m: StackedWeight, gen: torch.Generator) -> None:
    for e in range(m.weight.shape[0]):
        # rounded through the stored format first, so a fast-numerics model saves and reloads exactly
        w = representable(_normal((m.out_features, m.in_features), m.in_features ** -0.5, gen), m.storage)
        if m.scale is None:
            m.weight.data[e].copy_(w.to(m.weight.dtype))
        else:
            q, s = (formats.quantize_fp4_weight(w) if m.storage == "fp4" else formats.quantize_fp8_weight(w))
            m.weight.data[e].copy_(q)
            m.scale.data[e].copy_(s)


def _generator(seed: int, name: str) -> torch.Generator:
    """One stream per tensor name, so a tensor's values do not depend on which other parts exist."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _init_module(module: nn.Module, gen: torch.Generator) -> None:
    if isinstance(module, Linear):
        init_linear(module, gen)
    elif isinstance(module, StackedWeight):
        init_stacked(module, gen)
    elif isinstance(module, RMSNorm):
        module.weight.data.copy_((1 + 0.1 * _normal(module.weight.shape, 1.0, gen)).to(module.weight.dtype))
    elif isinstance(module, (Embedding, Head)):
        std = 1.0 if isinstance(module, Embedding) else module.weight.shape[1] ** -0.5
        # both are bf16 in the checkpoint (the head is held in fp32)
        module.weight.data.copy_(_normal(module.weight.shape, std, gen).to(torch.bfloat16).to(module.weight.dtype))
    elif isinstance(module, Router):
        module.weight.data.copy_(_normal(module.weight.shape, module.weight.shape[1] ** -0.5, gen).to(torch.bfloat16))
        module.bias.data.copy_(0.1 * _normal(module.bias.shape, 1.0, gen))
        if module.bias_vl is not None:
            module.bias_vl.data.copy_(0.1 * _normal(module.bias_vl.shape, 1.0, gen))
    elif isinstance(module, EngramTable):
        init_engram_table(module, gen)
    elif isinstance(module, nn.Linear):                          # the vision encoder's bf16 Linears
        module.weight.data.copy_(_normal(module.weight.shape, module.in_features ** -0.5, gen).to(module.weight.dtype))
        if module.bias is not None:
            module.bias.data.copy_((0.02 * _normal(module.bias.shape, 1.0, gen)).to(module.bias.dtype))


def _init_bare_parameter(leaf: str, p: nn.Parameter, gen: torch.Generator) -> None:
    if leaf.endswith("_fn"):
        p.data.copy_(_normal(p.shape, 0.5 / math.sqrt(p.shape[1]), gen))
    elif leaf.endswith("_base"):
        p.data.copy_(0.5 * _normal(p.shape, 1.0, gen))
    elif leaf.endswith("_scale") and leaf.startswith("hc_"):
        p.data.copy_(1.0 + 0.1 * _normal(p.shape, 1.0, gen))
    elif leaf == "attn_sink":
        p.data.copy_(_normal(p.shape, 1.0, gen))
    elif leaf in ("image_start", "image_end", "image_newline"):
        p.data.copy_(_normal(p.shape, 1.0, gen).to(p.dtype))
    elif leaf in ("q_weight", "k_weight"):
        p.data.copy_((1 + 0.1 * _normal(p.shape, 1.0, gen)).to(p.dtype))


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter of a dsv41 model deterministically from `seed` and the tensor's name."""
    for name, module in model.named_modules():
        _init_module(module, _generator(seed, name))
    for name, p in model.named_parameters():
        _init_bare_parameter(name.rsplit(".", 1)[-1], p, _generator(seed, name))
    return model


def init_engram_table(table: EngramTable, gen: torch.Generator) -> None:
    """Random rows stored as e4m3 with one ue8m0 scale per 32 values of a row (docs/CHECKPOINT.md §2)."""
    weight, scale = formats.quantize_fp8_rows(_normal((table.rows, table.head_dim), 1.0, gen))
    table.weight.data.copy_(weight)
    table.scale.data.copy_(scale)
