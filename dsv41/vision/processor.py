"""From image bytes to ViT patches: decoding (Pillow), the size plan and the pixel layout (§16.1–§16.2).

Shapes: P ViT patches of one image (n_vit_h · n_vit_w, row-major), p patch side (14), C = 3 · p² patch
features (channel-major: c · p² + y · p + x), L span length n_h · (n_w + 1) + 2.

The plan is a pure function of the original size and the config: at least `vision_min_pixels` pixels
(scaled up, sides truncated), sides rounded up to multiples of p, then shrunk while the span would exceed
`vision_max_n_token`. The pixels are the image padded into that size around its centre with grey
(127, 127, 127), scaled to [−1, 1] in fp32 and rounded to bf16. Mode conversions and limits are in
docs/VISION.md §2.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..config import ModelConfig
from ..errors import ImageError

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
"""Token types: text, and the four kinds of image-span position (§16.1)."""

PAD_GREY = (127, 127, 127)
MAX_IMAGE_PIXELS = 89_478_485
"""Refused before decoding (a decompression bomb); Pillow's own warning threshold, held here rather than
in Pillow's process-wide setting."""
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


@dataclass(frozen=True)
class ImagePlan:
    """Where an image of the original size goes: its padded pixel size and both grids."""

    width: int
    height: int
    """The padded pixel size (multiples of the patch side)."""
    n_vit_h: int
    n_vit_w: int
    n_h: int
    n_w: int
    """The LLM grid after the aligner's r × r pooling."""

    @property
    def n_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def span_length(self) -> int:
        return span_length(self.n_h, self.n_w)

    def token_types(self) -> list[int]:
        """START, then each row's IMAGE tokens and a NEW_LINE, then END."""
        return [IMAGE_START] + ([IMAGE] * self.n_w + [IMAGE_NEW_LINE]) * self.n_h + [IMAGE_END]


def span_length(n_h: int, n_w: int) -> int:
    return n_h * (n_w + 1) + 2


def _llm_grid(height: int, width: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil(height // p / r), math.ceil(width // p / r)


def _shrink_to_fit(height: float, width: float, p: int, r: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving (height, width) whose span fits max_tokens (§16.2 step 2).

    With mw cells per row and mh = mw · h/w rows, the span is mh · (mw + 1) + 2 tokens; mw solves that
    quadratic at max_tokens. A strip too thin for one whole cell keeps one row or column of cells."""
    aspect = height / width
    cells_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    cells_h = cells_w * aspect
    cell = p * r
    if cells_w < 1.0:
        return (max_tokens - 2) // 2 * cell, cell
    if cells_h < 1.0:
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(cells_w) * cell / width, math.floor(cells_h) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_image(width: int, height: int, cfg: ModelConfig) -> ImagePlan:
    """The plan for an image of `width` × `height` pixels under the config's vision settings."""
    if width < 1 or height < 1:
        raise ImageError(f"an image must have at least one pixel, got {width}×{height}")
    p, r, max_tokens = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    w, h = width, height
    if cfg.vision_max_wh_ratio is not None and w > h * cfg.vision_max_wh_ratio:
        w = h * cfg.vision_max_wh_ratio
    if w * h < cfg.vision_min_pixels:
        grow = (cfg.vision_min_pixels / (w * h)) ** 0.5
        w, h = int(w * grow), int(h * grow)
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    n_h, n_w = _llm_grid(best_h, best_w, p, r)
    if span_length(n_h, n_w) > max_tokens:
        best_h, best_w = _shrink_to_fit(h, w, p, r, max_tokens)
        n_h, n_w = _llm_grid(best_h, best_w, p, r)
        if span_length(n_h, n_w) > max_tokens:                       # the solve guarantees it; say so if not
            raise ImageError(f"no plan fits a {width}×{height} image in {max_tokens} tokens")
    return ImagePlan(best_w, best_h, best_h // p, best_w // p, n_h, n_w)


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image ready for the ViT: its plan, its patches and a digest of them (the prefix key)."""

    plan: ImagePlan
    patches: torch.Tensor
    """bf16 [P, C]."""
    digest: str
    """sha256 of the patch bytes: two inputs with one digest encode to the same span."""


def open_image(data: bytes, *, what: str = "image", max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode image bytes to an 8-bit RGB picture (the first frame of an animation).

    Refused with an ImageError naming `what`: bytes that are not an image, a truncated file, more than
    `max_pixels` pixels (checked from the header, before decoding), 32-bit integer or float modes.
    16-bit greyscale keeps its high byte; every other mode (palette, CMYK, grey, with or without alpha)
    goes through Pillow's RGB conversion, which drops alpha as the reference does."""
    if not data:
        raise ImageError(f"{what}: no bytes")
    try:
        source = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"{what}: not an image Pillow can read ({len(data)} bytes, starting {data[:8]!r})") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{what}: cannot be opened ({e})") from None
    with source:
        w, h = source.size
        if w * h > max_pixels:
            raise ImageError(f"{what}: {w}×{h} = {w * h:,} pixels, more than the limit of {max_pixels:,}")
        if source.mode in ("I", "F"):
            raise ImageError(f"{what}: mode {source.mode} (32-bit integer or float pixels) is not supported; "
                             f"save it as 8- or 16-bit")
        try:
            source.load()
            if source.mode in SIXTEEN_BIT_MODES:
                source = _high_byte(source)
            return source.convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise ImageError(f"{what}: cannot be decoded ({e})") from None


def _high_byte(image: Image.Image) -> Image.Image:
    """16-bit greyscale (either byte order) → 8-bit greyscale keeping the high byte (Pillow's RGB
    conversion would clip)."""
    values = np.asarray(image).astype(np.uint16)
    return Image.fromarray((values >> 8).astype(np.uint8), "L")


def pixels(image: Image.Image, plan: ImagePlan, cfg: ModelConfig) -> torch.Tensor:
    """bf16 [3, height, width] in [−1, 1]: the image fitted into the plan's size (§16.2 step 3)."""
    size = (plan.width, plan.height)
    ratio = cfg.vision_max_wh_ratio
    if ratio is not None and image.width >= ratio * image.height:
        fitted = image.resize(size)                     # a strip past the ratio is stretched, not padded
    else:
        fitted = ImageOps.pad(image, size, color=PAD_GREY)
    raw = torch.frombuffer(bytearray(fitted.tobytes()), dtype=torch.uint8).view(plan.height, plan.width, 3)
    unit = raw.permute(2, 0, 1).float() / 255
    return ((unit - 0.5) / 0.5).to(torch.bfloat16)


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """[3, H, W] → [P, 3 · p²]: patches row-major, each flattened channel-major."""
    c, height, width = image.shape
    grid = image.reshape(c, height // p, p, width // p, p).permute(1, 3, 0, 2, 4)
    return grid.reshape((height // p) * (width // p), c * p * p)


def preprocess(image: Image.Image, cfg: ModelConfig) -> ImageInput:
    """An RGB picture → the ViT's input under the config's plan."""
    if not cfg.vision_enabled:
        raise ImageError("this model has no vision encoder (vision_n_layers is 0); it cannot take images")
    plan = plan_image(image.width, image.height, cfg)
    patches = patchify(pixels(image, plan, cfg), cfg.vision_patch_size).contiguous()
    digest = hashlib.sha256(patches.view(torch.int16).numpy().tobytes()).hexdigest()
    return ImageInput(plan, patches, digest)


def load_image(data: bytes, cfg: ModelConfig, *, what: str = "image",
               max_pixels: int = MAX_IMAGE_PIXELS) -> ImageInput:
    """Image bytes → the ViT's input (open_image, then preprocess)."""
    return preprocess(open_image(data, what=what, max_pixels=max_pixels), cfg)
