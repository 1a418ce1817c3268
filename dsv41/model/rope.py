"""Rotary position embedding on the last R features, adjacent pairs as complex numbers (§10).

Shapes: T positions, R rope dim (the last R features of a vector).

Layers with a compress ratio use θ = compress_rope_theta with YaRN; ratio-0 layers (and DSpark) use
θ = rope_theta without YaRN. There is no mscale correction. Angles are fp32(p) · ω, computed for the
positions a call needs (identical, element by element, to a precomputed table).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from .numerics import Numerics


def yarn_frequencies(rope_dim: int, theta: float, original_seq_len: int, factor: float,
                     beta_fast: float, beta_slow: float) -> torch.Tensor:
    """ω_i, i = 0 … R/2 − 1, in fp32; YaRN-blended when original_seq_len > 0 (§10)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len <= 0:
        return freqs

    def boundary(rotations: float) -> float:
        # the feature pair whose wavelength makes `rotations` turns over the original context
        return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(boundary(beta_fast)), 0)
    high = min(math.ceil(boundary(beta_slow)), rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / factor * (1 - keep) + freqs * keep


class Rotary(nn.Module):
    """One rotary table (its frequencies); `rotate` applies it at given absolute positions, through the
    numerics policy's native kernel where it takes the call (the same bits)."""

    def __init__(self, rope_dim: int, freqs: torch.Tensor, numerics: Numerics | None = None):
        super().__init__()
        self.rope_dim, self.numerics = rope_dim, numerics
        self.register_buffer("freqs", freqs, persistent=False)
        # equal for every layer with the same table: a forward computes their phases once (step.Handoff)
        self.table_key = (rope_dim, tuple(freqs.tolist()))

    @classmethod
    def for_layer(cls, cfg: ModelConfig, compressed: bool, numerics: Numerics | None = None) -> "Rotary":
        """The one table of a layer: θ = compress_rope_theta with YaRN for r > 0, else θ = rope_theta."""
        if compressed:
            freqs = yarn_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len,
                                     cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
        else:
            freqs = yarn_frequencies(cfg.rope_head_dim, cfg.rope_theta, 0, 1.0, 0.0, 0.0)
        return cls(cfg.rope_head_dim, freqs, numerics)

    def phases(self, positions: torch.Tensor) -> torch.Tensor:
        """complex64 [..., R/2] = exp(i · fp32(p) · ω) for positions of any shape."""
        angles = positions.to(self.freqs.device, torch.float32).unsqueeze(-1) * self.freqs
        return torch.polar(torch.ones_like(angles), angles)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False,
               phases: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate the last R features of x [B, T, (heads,) F] at positions [T] (every row) or [B, T];
        fp32 math, x.dtype out. `phases`: `self.phases(positions)` already computed."""
        if self.freqs.is_meta or x.is_meta:
            return x
        phases = self.phases(positions) if phases is None else phases
        if phases.device != x.device:
            phases = phases.to(x.device)
        lead = list(positions.shape) if positions.dim() == 2 else [1, positions.numel()]
        if self.numerics is not None:
            rotated = self.numerics.rope(x, phases.view(*lead, -1), inverse)
            if rotated is not None:
                return rotated
        if inverse:
            phases = phases.conj()
        shape = lead + [1] * (x.dim() - 3) + [self.rope_dim // 2]
        tail = torch.view_as_complex(x[..., -self.rope_dim:].float().unflatten(-1, (-1, 2)).contiguous())
        rotated = torch.view_as_real(tail * phases.view(shape)).flatten(-2).to(x.dtype)
        return torch.cat([x[..., :-self.rope_dim], rotated], dim=-1)
