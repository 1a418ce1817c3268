"""The vision encoder: a ViT over one image's patches, and the aligner that pools it into LLM rows (§16.3–§16.4).

Shapes: P patches (n_vit_h · n_vit_w, row-major), C = 3 · p² patch features, Dv vision_dim, Hv heads,
Dhv = Dv / Hv head width, Iv vision_inter_dim, r the pooling side (vision_downsample_ratio), M LLM cells
(n_h · n_w, row-major), D the LLM's dim.

Everything runs in bf16, as stored; norms and rotations are computed in fp32 (§16.3). Attention is
bidirectional over every patch of the image. Module and tensor names are the checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..model.layers import RMSNorm

VIT_NORM_EPS = 1e-6
"""The ViT's own epsilon (trap 3: the text model uses 1e−20)."""


def _linear(in_features: int, out_features: int, bias: bool, device) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=torch.bfloat16)
    layer.requires_grad_(False)
    return layer


def rope_2d(n_vit_h: int, n_vit_w: int, rope_width: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [P, 1, rope_width]: for the patch in row a, column b, the angles
    [a · f_0 … a · f_{k−1}, b · f_0 … b · f_{k−1}] with f_i = θ^(−2i / rope_width), k = rope_width / 2."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_width, 2, dtype=torch.float32, device=device) / rope_width))
    rows = torch.arange(n_vit_h, device=device).repeat_interleave(n_vit_w)
    cols = torch.arange(n_vit_w, device=device).repeat(n_vit_h)
    angles = (torch.stack([rows, cols], dim=-1).float()[..., None] * freqs).flatten(1)          # [P, rope_width]
    return angles.cos()[:, None], angles.sin()[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half over the whole head [P, Hv, Dhv] in fp32 (fp32 cos/sin: bf16 tables deviate, §16.3)."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    """`proj`: Linear C → Dv with bias (the patches arrive flattened; no convolution)."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.proj = _linear(3 * cfg.vision_patch_size ** 2, cfg.vision_dim, True, device)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    """`wqkv` Dv → 3·Dv and `wo` Dv → Dv, both with bias; scale Dhv^−½ (SDPA's default)."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.n_heads = cfg.vision_n_heads
        self.head_dim = cfg.vision_dim // cfg.vision_n_heads
        self.wqkv = _linear(cfg.vision_dim, 3 * cfg.vision_dim, True, device)
        self.wo = _linear(cfg.vision_dim, cfg.vision_dim, True, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        P = x.shape[0]
        q, k, v = self.wqkv(x).view(P, 3, self.n_heads, self.head_dim).unbind(1)             # [P, Hv, Dhv] each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))   # [Hv, P, Dhv]
        return self.wo(out.transpose(0, 1).reshape(P, -1))


class VisionMLP(nn.Module):
    """`w1` Dv → 2·Iv (gate half, then up half) and `w2` Iv → Dv, no biases: w2(silu(gate) · up)."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.w1 = _linear(cfg.vision_dim, 2 * cfg.vision_inter_dim, False, device)
        self.w2 = _linear(cfg.vision_inter_dim, cfg.vision_dim, False, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.w1(x)
        width = both.shape[-1] // 2
        return self.w2(F.silu(both[..., :width]) * both[..., width:])


class VisionBlock(nn.Module):
    """Pre-norm: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.norm1 = RMSNorm(cfg.vision_dim, VIT_NORM_EPS, device=device)
        self.attn = VisionAttention(cfg, device)
        self.norm2 = RMSNorm(cfg.vision_dim, VIT_NORM_EPS, device=device)
        self.mlp = VisionMLP(cfg, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        after_attention = x + self.attn(self.norm1(x), cos, sin)
        return after_attention + self.mlp(self.norm2(after_attention))


class ViT(nn.Module):
    """`vision.*`: patch embedding, vision_n_layers blocks, a final norm."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.rope_width = cfg.vision_dim // cfg.vision_n_heads // 2
        self.theta = cfg.vision_rope_theta
        self.patch_embed = PatchEmbed(cfg, device)
        self.blocks = nn.ModuleList(VisionBlock(cfg, device) for _ in range(cfg.vision_n_layers))
        self.norm = RMSNorm(cfg.vision_dim, VIT_NORM_EPS, device=device)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """bf16 [P, C] → [P, Dv]."""
        x = self.patch_embed(patches)
        cos, sin = rope_2d(n_vit_h, n_vit_w, self.rope_width, self.theta, device=x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def pool_cells(x: torch.Tensor, n_vit_h: int, n_vit_w: int, r: int) -> torch.Tensor:
    """[P, Dv] → [M, Dv · r²]: zero-pad the grid to multiples of r at the bottom and right, cut it into
    r × r cells (row-major), each cell's features ordered channel, then row, then column (c·r² + i·r + j).

    The result is the transpose of a contiguous [Dv · r², M] (the layout `F.unfold` gives), so the
    aligner's first GEMM sees the operand the reference's does."""
    grid = x.view(n_vit_h, n_vit_w, -1).permute(2, 0, 1)
    grid = F.pad(grid, (0, -n_vit_w % r, 0, -n_vit_h % r))
    dv, hp, wp = grid.shape
    cells = grid.reshape(dv, hp // r, r, wp // r, r).permute(0, 2, 4, 1, 3)       # [Dv, r, r, rows, cols]
    return cells.reshape(dv * r * r, (hp // r) * (wp // r)).transpose(0, 1)


class Aligner(nn.Module):
    """`aligner.*`: Linear Dv·r² → D (bias), exact GELU, Linear D → D (bias), on r × r cells of patches."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.ratio = cfg.vision_downsample_ratio
        self.w1 = _linear(cfg.vision_dim * self.ratio ** 2, cfg.dim, True, device)
        self.w2 = _linear(cfg.dim, cfg.dim, True, device)

    def forward(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """[P, Dv] → [M, D]."""
        return self.w2(F.gelu(self.w1(pool_cells(x, n_vit_h, n_vit_w, self.ratio))))
