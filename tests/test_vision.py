"""The vision path piece by piece, against expectations written here (docs/ARCHITECTURE.md §16).

- Processor plans: the spec's worked plans and edge sizes (1×1, 20000², thin strips) on the released
  config, each derived by hand in a comment; invariants of the plan and of its token types on random sizes.
- Pixels: a solid-colour picture padded with grey and scaled to [−1, 1] in bf16; the patch layout.
- The ViT and the aligner against direct float64 formulas on a tiny config, with mutated formulas
  (column-first RoPE, causal attention, another cell feature order) shown not to match.
- Spans: placeholder expansion, token types, span checks, prefix keys, the rows of split calls.
- Decoding: malformed bytes and refused modes raise ImageError; the documented mode conversions.
"""

from __future__ import annotations

import io
import math
import random
import struct

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from dsv41.config import ModelConfig
from dsv41.errors import ImageError
from dsv41.vision.encoder import Aligner, ViT, pool_cells, rope_2d, rotate
from dsv41.vision.processor import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, ImagePlan, load_image,
                                    open_image, patchify, pixels, plan_image, preprocess)
from dsv41.vision.spans import (PromptImage, call_rows, check_spans, expand_images, position_keys, span_rows,
                                token_types)

TEXT_MODEL = dict(vocab_size=256, dim=64, moe_inter_dim=32, n_layers=1, n_heads=4, n_routed_experts=4,
                  n_shared_experts=1, n_activated_experts=4, q_lora_rank=32, head_dim=64, rope_head_dim=16,
                  o_groups=2, o_lora_rank=32, window_size=8, compress_ratios=(0,))
# a 2-block ViT of 2 heads × 16 (RoPE width 8); images grow to 84² pixels; spans of at most 64 tokens
TINY_VISION = dict(vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=24, vision_patch_size=14,
                   vision_downsample_ratio=3, vision_max_n_token=64, vision_min_pixels=84 * 84,
                   vision_rope_theta=10000.0, image_token_id=200)
SMALL = ModelConfig(**TEXT_MODEL, **TINY_VISION)
IMAGE_ID = 200
BF16_TOLERANCE = 2e-2


def bf16(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32).to(torch.bfloat16))


def scaled(v: int) -> float:
    """An 8-bit channel value as the ViT sees it (§16.2 step 3)."""
    return bf16((v / 255 - 0.5) / 0.5)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (width * height * 3,), dtype=torch.uint8, generator=g)
    return Image.frombytes("RGB", (width, height), data.numpy().tobytes())


def solid(width: int, height: int, colour=(255, 0, 127)):
    return preprocess(Image.new("RGB", (width, height), colour), SMALL)


# ------------------------------------------------------------------------------------------------ plans

# (width, height) → (n_vit_h, n_vit_w, n_h, n_w, span); released config: 544² = 295936 pixels at least,
# p = 14, r = 3 (cell 42), 1024 tokens at most; shrinking solves ρ = h/w, mw = √(1022/ρ + ¼) − ½, mh = mw·ρ.
HAND_PLANS = {
    # 786432 px: no growth; ⌈768/14⌉ = 55, ⌈1024/14⌉ = 74; ⌈55/3⌉ = 19, ⌈74/3⌉ = 25; 19·26 + 2
    (1024, 768): (55, 74, 19, 25, 496),
    # 307200 px: no growth; ⌈480/14⌉ = 35, ⌈640/14⌉ = 46; 12, 16; 12·17 + 2
    (640, 480): (35, 46, 12, 16, 206),
    # grow by √29.5936 = 5.44 to 544²; ⌈544/14⌉ = 39; ⌈39/3⌉ = 13; 13·14 + 2
    (100, 100): (39, 39, 13, 13, 184),
    # ⌈1080/14⌉ = 78, ⌈1920/14⌉ = 138 → 26·47 + 2 = 1224 > 1024; ρ = 0.5625, mw = 42.13, mh = 23.70;
    # β = min(42·42/1920, 23·42/1080) = 966/1080; h·β = 966 → 69 patches, w·β = 1717.3 → 122; ⌈122/3⌉ = 41
    (1920, 1080): (69, 122, 23, 41, 968),
    # grow by 544 to 544², as 100×100
    (1, 1): (39, 39, 13, 13, 184),
    # ⌈20000/14⌉ = 1429 → far too long; ρ = 1, mw = mh = √1022.25 − ½ = 31.47; β = 31·42/20000;
    # 1302 px = 93 patches a side; 31 cells; 31·32 + 2
    (20000, 20000): (93, 93, 31, 31, 994),
    # grow by √(295936/5000) = 7.6933 to 7 × 38466 (w × h); 1 × 2748 patches, 916 rows: 916·2 + 2 > 1024;
    # ρ = 38466/7, mw = √(1022/ρ + ¼) − ½ = 0.16 < 1 → one column of 511 cells: 42 × 21462 px
    (1, 5000): (1533, 3, 511, 1, 1024),
    # the same growth across: 38466 × 7 → 38472 × 14 px, one row of ⌈2748/3⌉ = 916 cells: 917 + 2 fits
    (5000, 1): (1, 2748, 1, 916, 919),
    # grow by √(295936/120000) = 1.5704 to 4 × 62815; 1496 rows do not fit; mw = 0.061 < 1 → as 1×5000
    (3, 40000): (1533, 3, 511, 1, 1024),
    # the same across: one row of 1496 cells does not fit; mw = 4005.6 but mh = 0.255 < 1 → one row of
    # 1021 cells: 42882 × 42 px, 1022 + 2
    (40000, 3): (3, 3063, 1, 1021, 1024),
}


@pytest.mark.parametrize("size", list(HAND_PLANS), ids=[f"{w}x{h}" for w, h in HAND_PLANS])
def test_plan_matches_hand_derivation(released_cfg, size):
    n_vit_h, n_vit_w, n_h, n_w, span = HAND_PLANS[size]
    plan = plan_image(*size, released_cfg)
    assert plan == ImagePlan(14 * n_vit_w, 14 * n_vit_h, n_vit_h, n_vit_w, n_h, n_w)
    assert plan.span_length == span
    assert plan.n_patches == n_vit_h * n_vit_w


def check_token_types(plan: ImagePlan) -> None:
    types = plan.token_types()
    assert types[0] == IMAGE_START and types[-1] == IMAGE_END
    rows = [types[1 + i * (plan.n_w + 1):1 + (i + 1) * (plan.n_w + 1)] for i in range(plan.n_h)]
    assert all(row == [IMAGE] * plan.n_w + [IMAGE_NEW_LINE] for row in rows)
    assert len(types) == 2 + plan.n_h * (plan.n_w + 1)


def test_plan_invariants_on_random_sizes(released_cfg):
    rng = random.Random(0)
    sizes = [(round(math.exp(rng.uniform(0, math.log(30000)))), round(math.exp(rng.uniform(0, math.log(30000)))))
             for _ in range(400)] + list(HAND_PLANS)
    for width, height in sizes:
        plan = plan_image(width, height, released_cfg)
        assert plan.width > 0 and plan.height > 0, (width, height)
        assert plan.width % 14 == 0 and plan.height % 14 == 0, (width, height)
        assert (plan.n_vit_w, plan.n_vit_h) == (plan.width // 14, plan.height // 14), (width, height)
        assert (plan.n_h, plan.n_w) == (math.ceil(plan.n_vit_h / 3), math.ceil(plan.n_vit_w / 3)), (width, height)
        assert plan.span_length == plan.n_h * (plan.n_w + 1) + 2 <= 1024, (width, height)
        check_token_types(plan)


def test_plan_of_an_empty_size_is_refused(released_cfg):
    with pytest.raises(ImageError, match="at least one pixel"):
        plan_image(0, 10, released_cfg)


# ----------------------------------------------------------------------------------------------- pixels

def test_solid_colour_is_padded_with_grey_and_scaled():
    picture = Image.new("RGB", (30, 20), (255, 0, 127))
    image = preprocess(picture, SMALL)
    # 600 px < 84² = 7056: grow by √11.76 = 3.43 to 102 × 68 → 112 × 70 px, 8 × 5 patches, 3 × 2 cells
    assert image.plan == ImagePlan(112, 70, 5, 8, 2, 3)
    values = pixels(picture, image.plan, SMALL)
    assert values.dtype == torch.bfloat16 and values.shape == (3, 70, 112)
    grey, colour = scaled(127), torch.tensor([scaled(255), scaled(0), scaled(127)], dtype=torch.bfloat16)
    assert colour.tolist() == [1.0, -1.0, bf16(-1 / 255)]
    is_colour = (values == colour[:, None, None]).all(0)
    is_grey = (values == grey).all(0)
    assert bool((is_colour | is_grey).all())
    # a 3:2 picture in a 112 × 70 box: 105 × 70, centred with 7 grey columns split 3 / 4 or 4 / 3
    columns = is_colour.all(0).nonzero().flatten().tolist()
    assert bool((is_colour.any(0) == is_colour.all(0)).all())
    assert columns == list(range(columns[0], columns[0] + 105)) and columns[0] in (3, 4)
    assert float(values.min()) >= -1.0 and float(values.max()) <= 1.0


def test_noise_pixels_stay_in_range_and_patches_follow_pixels():
    picture = noise(50, 40)
    image = preprocess(picture, SMALL)
    values = pixels(picture, image.plan, SMALL)
    assert float(values.min()) >= -1.0 and float(values.max()) <= 1.0
    assert torch.equal(image.patches, patchify(values, 14))
    assert image.patches.shape == (image.plan.n_patches, 3 * 14 * 14)


def test_patchify_layout():
    p, n_vit_h, n_vit_w = 3, 2, 4
    image = torch.arange(3 * n_vit_h * p * n_vit_w * p, dtype=torch.float32).view(3, n_vit_h * p, n_vit_w * p)
    patches = patchify(image, p)
    assert patches.shape == (n_vit_h * n_vit_w, 3 * p * p)
    for a in range(n_vit_h):
        for b in range(n_vit_w):
            for c in range(3):
                for y in range(p):
                    for x in range(p):
                        assert patches[a * n_vit_w + b, c * p * p + y * p + x] == image[c, a * p + y, b * p + x]


def test_digest_tells_images_apart():
    assert solid(30, 20).digest == solid(30, 20).digest
    assert solid(30, 20).digest != solid(30, 20, (255, 0, 128)).digest


def test_load_image_is_open_then_preprocess():
    picture = noise(50, 40, seed=1)
    loaded = load_image(encode(picture, "PNG"), SMALL)
    assert loaded.digest == preprocess(picture, SMALL).digest
    assert torch.equal(loaded.patches, preprocess(picture, SMALL).patches)


def test_preprocess_without_a_vision_encoder_is_refused():
    with pytest.raises(ImageError, match="no vision encoder"):
        preprocess(Image.new("RGB", (8, 8)), ModelConfig(**TEXT_MODEL))


# ---------------------------------------------------------------------------------------- ViT reference

def randomise_(module: torch.nn.Module, seed: int) -> None:
    """Small random bf16 weights: norms around 1, Linears ~ 1/√fan_in, biases ~ 0.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            r = torch.randn(param.shape, generator=g)
            if "norm" in name:
                param.copy_(1 + 0.2 * r)
            elif name.endswith("bias"):
                param.copy_(0.1 * r)
            else:
                param.copy_(r / math.sqrt(param.shape[1]))


def w64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


def rms_norm64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w64(weight)


def angles64(n_vit_h: int, n_vit_w: int, rope_width: int, row_first: bool = True) -> torch.Tensor:
    """[P, rope_width]: [a·f_0 … a·f_{k−1}, b·f_0 … b·f_{k−1}] for patch (row a, column b), f_i = 10000^(−2i/width)."""
    freqs = torch.tensor([10000.0 ** (-2 * i / rope_width) for i in range(rope_width // 2)], dtype=torch.float64)
    out = []
    for a in range(n_vit_h):
        for b in range(n_vit_w):
            first, second = (a, b) if row_first else (b, a)
            out.append(torch.cat([first * freqs, second * freqs]))
    return torch.stack(out)


def rotate_half64(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [P, H, Dh] with angles [P, Dh/2]: [x1·cos − x2·sin, x2·cos + x1·sin] over the whole head."""
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def vit64(vit: ViT, patches: torch.Tensor, n_vit_h: int, n_vit_w: int, *, row_first: bool = True,
          causal: bool = False) -> torch.Tensor:
    """The ViT of §16.3 in float64 from the module's weights."""
    dim, heads = SMALL.vision_dim, SMALL.vision_n_heads
    head_dim, n = dim // heads, n_vit_h * n_vit_w
    x = patches.double() @ w64(vit.patch_embed.proj.weight).T + w64(vit.patch_embed.proj.bias)
    angles = angles64(n_vit_h, n_vit_w, head_dim // 2, row_first)
    mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else torch.zeros(n, n, dtype=torch.bool)
    for block in vit.blocks:
        attn, mlp = block.attn, block.mlp
        h = rms_norm64(x, block.norm1.weight)
        qkv = h @ w64(attn.wqkv.weight).T + w64(attn.wqkv.bias)
        q, k, v = (t.reshape(n, heads, head_dim) for t in qkv.split(dim, dim=-1))
        q, k = rotate_half64(q, angles), rotate_half64(k, angles)
        scores = torch.einsum("phd,qhd->hpq", q, k) * head_dim ** -0.5
        weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
        out = torch.einsum("hpq,qhd->phd", weights, v).reshape(n, dim)
        x = x + out @ w64(attn.wo.weight).T + w64(attn.wo.bias)
        h = rms_norm64(x, block.norm2.weight)
        gate, up = (h @ w64(mlp.w1.weight).T).split(SMALL.vision_inter_dim, dim=-1)
        x = x + (F.silu(gate) * up) @ w64(mlp.w2.weight).T
    return rms_norm64(x, vit.norm.weight)


def random_patches(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3 * 14 * 14, generator=g) * 2 - 1).to(torch.bfloat16)


@pytest.fixture(scope="module")
def vit() -> ViT:
    model = ViT(SMALL)
    randomise_(model, seed=0)
    return model


def test_rope_tables_are_row_first():
    cos, sin = rope_2d(3, 4, 8, 10000.0)
    want = angles64(3, 4, 8)
    assert cos.dtype == torch.float32 and cos.shape == (12, 1, 8)
    assert torch.allclose(cos[:, 0].double(), want.cos(), atol=1e-6)
    assert torch.allclose(sin[:, 0].double(), want.sin(), atol=1e-6)
    assert not torch.allclose(cos[:, 0].double(), angles64(3, 4, 8, row_first=False).cos(), atol=1e-2)


def test_rotate_is_rotate_half_over_the_whole_head():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 2, 16, generator=g).to(torch.bfloat16)
    cos, sin = rope_2d(3, 4, 8, 10000.0)
    got = rotate(x, cos, sin)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, rotate_half64(x.double(), angles64(3, 4, 8))) < 1e-2


def test_vit_matches_float64_formula(vit):
    patches = random_patches(12, seed=1)
    got = vit(patches, 3, 4)
    assert got.dtype == torch.bfloat16 and got.shape == (12, 32)
    assert relative_error(got, vit64(vit, patches, 3, 4)) < BF16_TOLERANCE


def test_vit_norms_use_eps_1e_6(vit):
    """At an RMS of 1e−3, ε = 1e−6 equals the mean square: the text model's 1e−20 would land √2 away."""
    g = torch.Generator().manual_seed(2)
    x = (1e-3 * torch.randn(5, 32, generator=g)).to(torch.bfloat16)
    norms = [vit.norm] + [n for block in vit.blocks for n in (block.norm1, block.norm2)]
    for norm in norms:
        assert relative_error(norm(x), rms_norm64(x.double(), norm.weight)) < 1e-2


@pytest.mark.parametrize("mutation", [dict(row_first=False), dict(causal=True)], ids=["column-first", "causal"])
def test_vit_reference_discriminates(vit, mutation):
    """A wrong formula must land far outside the tolerance the right one meets."""
    patches = random_patches(12, seed=1)
    assert relative_error(vit(patches, 3, 4), vit64(vit, patches, 3, 4, **mutation)) > 5 * BF16_TOLERANCE


# ------------------------------------------------------------------------------------ aligner reference

def pool64(x: torch.Tensor, n_vit_h: int, n_vit_w: int, order: str = "c,kh,kw") -> torch.Tensor:
    """[P, Dv] → [M, Dv·9]: zero-padded 3 × 3 cells, row-major; feature c·9 + kh·3 + kw (or kh·3Dv + kw·Dv + c)."""
    dv = x.shape[-1]
    grid = x.double().view(n_vit_h, n_vit_w, dv)
    n_h, n_w = -(-n_vit_h // 3), -(-n_vit_w // 3)
    out = torch.zeros(n_h * n_w, dv * 9, dtype=torch.float64)
    for i in range(n_h):
        for j in range(n_w):
            for kh in range(3):
                for kw in range(3):
                    row, col = 3 * i + kh, 3 * j + kw
                    if row >= n_vit_h or col >= n_vit_w:
                        continue
                    for c in range(dv):
                        feature = c * 9 + kh * 3 + kw if order == "c,kh,kw" else (kh * 3 + kw) * dv + c
                        out[i * n_w + j, feature] = grid[row, col, c]
    return out


def aligner64(aligner: Aligner, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
    h = pool64(x, n_vit_h, n_vit_w) @ w64(aligner.w1.weight).T + w64(aligner.w1.bias)
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return h @ w64(aligner.w2.weight).T + w64(aligner.w2.bias)


def vit_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, SMALL.vision_dim, generator=g).to(torch.bfloat16)


def test_pool_cells_pads_and_orders_features():
    x = vit_rows(4 * 5, seed=4)                            # a 4 × 5 grid pads to 6 × 6: 2 × 2 cells
    got = pool_cells(x, 4, 5, 3)
    assert got.shape == (4, 32 * 9)
    assert torch.equal(got.double(), pool64(x, 4, 5))
    assert not torch.equal(got.double(), pool64(x, 4, 5, order="kh,kw,c"))


def test_aligner_matches_float64_formula():
    aligner = Aligner(SMALL)
    randomise_(aligner, seed=5)
    x = vit_rows(4 * 5, seed=6)
    got = aligner(x, 4, 5)
    assert got.dtype == torch.bfloat16 and got.shape == (4, SMALL.dim)
    assert relative_error(got, aligner64(aligner, x, 4, 5)) < BF16_TOLERANCE


# ------------------------------------------------------------------------------------------------ spans

@pytest.fixture(scope="module")
def images():
    """Two images of the small config and their hand-derived spans.

    30×20: 102 × 68 → 8 × 5 patches, 3 × 2 cells, 2·4 + 2 = 10 positions.
    20×50: 600 → 1000 px grows by √7.056 = 2.656 to 53 × 132 → 4 × 10 patches, 2 × 4 cells, 4·3 + 2 = 14."""
    a, b = solid(30, 20), solid(20, 50, (0, 255, 0))
    assert (a.plan.span_length, b.plan.span_length) == (10, 14)
    return a, b


def test_expand_images_replaces_placeholders(images):
    a, b = images
    ids, spans = expand_images([5, IMAGE_ID, 6, 7, IMAGE_ID, 8], [a, b], IMAGE_ID)
    assert ids == [5] + [IMAGE_ID] * 10 + [6, 7] + [IMAGE_ID] * 14 + [8]
    assert [(s.start, s.end) for s in spans] == [(1, 11), (13, 27)]
    assert spans[0].image is a and spans[1].image is b
    assert expand_images([1, 2, 3], [], IMAGE_ID) == ([1, 2, 3], ())


@pytest.mark.parametrize("n_marks, n_images", [(1, 2), (2, 1), (1, 0)])
def test_expand_images_count_mismatch(images, n_marks, n_images):
    with pytest.raises(ImageError, match=f"{n_marks} image placeholder token.*{n_images} image"):
        expand_images([1] + [IMAGE_ID] * n_marks, [images[0]] * n_images, IMAGE_ID)


def test_token_types_mark_text_and_span_positions(images):
    a, b = images
    ids, spans = expand_images([5, IMAGE_ID, 6, 7, IMAGE_ID, 8], [a, b], IMAGE_ID)
    span_a = [IMAGE_START] + [IMAGE] * 3 + [IMAGE_NEW_LINE] + [IMAGE] * 3 + [IMAGE_NEW_LINE] + [IMAGE_END]
    span_b = [IMAGE_START] + ([IMAGE] * 2 + [IMAGE_NEW_LINE]) * 4 + [IMAGE_END]
    assert token_types(len(ids), spans) == [TEXT] + span_a + [TEXT, TEXT] + span_b + [TEXT]
    assert (TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END) == (-1, 0, 1, 2, 3)


def test_check_spans(images):
    a, b = images
    ids, spans = expand_images([5, IMAGE_ID, 6, 7, IMAGE_ID, 8], [a, b], IMAGE_ID)
    prompt = tuple(ids)
    check_spans(prompt, spans, IMAGE_ID)
    check_spans(prompt, (), None)
    bad = {
        "inside the span before": (PromptImage(1, a), PromptImage(5, b)),
        "past the prompt": (PromptImage(1, a), PromptImage(20, b)),
        "holds tokens other than": (PromptImage(0, a),),
        "no vision encoder": spans,
    }
    for message, wrong in bad.items():
        with pytest.raises(ImageError, match=message):
            check_spans(prompt, wrong, None if message == "no vision encoder" else IMAGE_ID)


def test_position_keys_follow_the_image(images):
    a, b = images
    same_as_a = solid(30, 20)
    other = solid(30, 20, (1, 2, 3))
    keys = {}
    for name, image in (("a", a), ("same", same_as_a), ("other", other)):
        ids, spans = expand_images([5, IMAGE_ID, 6], [image], IMAGE_ID)
        keys[name] = position_keys(ids, spans)
    assert keys["a"] == keys["same"]
    assert keys["a"][0] == 5 and keys["a"][-1] == 6
    assert keys["a"][1:11] == tuple((a.digest, i) for i in range(10))
    assert keys["a"][0] == keys["other"][0] and keys["a"][-1] == keys["other"][-1]
    assert all(x != y for x, y in zip(keys["a"][1:11], keys["other"][1:11]))
    ids, spans = expand_images([5, IMAGE_ID, 6], [a], IMAGE_ID)
    assert position_keys(ids[:4], spans) == keys["a"][:4]           # a prefix that ends inside the span


def test_span_rows_put_delimiters_and_cells_in_reading_order(images):
    a, _ = images                                                   # 2 rows × 3 cells
    cells = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 4) + 1
    start, end, newline = torch.full((4,), -1.0), torch.full((4,), -2.0), torch.full((4,), -3.0)
    rows = span_rows(a, cells, start, end, newline)
    assert rows[:, 0].tolist() == [-1, 1, 2, 3, -3, 4, 5, 6, -3, -2]
    assert torch.equal(rows, rows[:, :1].expand(-1, 4))


def test_call_rows_split_a_span_across_calls(images):
    a, _ = images
    ids, spans = expand_images([1, 2, 3, IMAGE_ID, 4, 5], [a], IMAGE_ID)   # span at positions 3 … 12 of 15
    span = spans[0]
    encoded = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 4)
    types = [IMAGE_START, IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE_END]

    first = call_rows([(0, 0, 8, [(span, encoded)])], 8)           # positions 0 … 7
    assert first.index.tolist() == [3, 4, 5, 6, 7]
    assert torch.equal(first.rows, encoded[:5])
    assert first.types.tolist() == [TEXT] * 3 + types[:5]

    # positions 8 … 14, packed after another sequence's 4 text tokens
    second = call_rows([(0, 0, 4, []), (4, 8, 7, [(span, encoded)])], 11)
    assert second.index.tolist() == [4, 5, 6, 7, 8]
    assert torch.equal(second.rows, encoded[5:])
    assert second.types.tolist() == [TEXT] * 4 + types[5:] + [TEXT] * 2

    assert call_rows([(0, 13, 2, [(span, encoded)])], 2) is None   # only the text after the span


# --------------------------------------------------------------------------------------------- decoding

def truncated_png() -> bytes:
    whole = encode(noise(64, 64), "PNG")
    return whole[:len(whole) // 2]


MALFORMED = {
    "empty": (lambda: b"", {}, "no bytes"),
    "not an image": (lambda: b"plain words, not a picture", {}, "not an image Pillow can read"),
    "truncated png": (truncated_png, {}, "cannot be decoded"),
    "too many pixels": (lambda: encode(Image.new("RGB", (20, 20)), "PNG"), dict(max_pixels=100),
                        "20×20 = 400 pixels, more than the limit of 100"),
    "mode I": (lambda: encode(Image.new("I", (5, 5), 7), "TIFF"), {}, "mode I .*not supported"),
    "mode F": (lambda: encode(Image.new("F", (5, 5), 0.5), "TIFF"), {}, "mode F .*not supported"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_images_are_refused(case):
    make, options, message = MALFORMED[case]
    with pytest.raises(ImageError, match=f"^photo.png: .*{message}"):
        open_image(make(), what="photo.png", **options)


def test_load_image_refuses_malformed_bytes():
    with pytest.raises(ImageError, match="no bytes"):
        load_image(b"", SMALL)


def pixel_list(image: Image.Image) -> list:
    return [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]


def test_rgba_drops_alpha():
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (4 * 3 * 4,), dtype=torch.uint8, generator=g).tolist()
    rgba = Image.frombytes("RGBA", (4, 3), bytes(data))
    got = open_image(encode(rgba, "PNG"))
    assert got.mode == "RGB"
    assert pixel_list(got) == [tuple(data[i:i + 3]) for i in range(0, len(data), 4)]
    assert pixel_list(got) == pixel_list(rgba.convert("RGB"))


def test_grey_with_alpha_and_palette():
    la = Image.new("LA", (3, 2), (90, 10))
    assert pixel_list(open_image(encode(la, "PNG"))) == [(90, 90, 90)] * 6
    palette = [10, 20, 30, 200, 100, 50, 0, 255, 0]
    indexed = Image.new("P", (3, 1))
    indexed.putpalette(palette)
    for x in range(3):
        indexed.putpixel((x, 0), 2 - x)
    assert pixel_list(open_image(encode(indexed, "PNG"))) == [(0, 255, 0), (200, 100, 50), (10, 20, 30)]


def test_cmyk_goes_through_pillows_conversion():
    cmyk = Image.new("CMYK", (4, 4), (10, 200, 30, 40))
    want = cmyk.convert("RGB").getpixel((0, 0))
    assert pixel_list(open_image(encode(cmyk, "TIFF"))) == [want] * 16
    from_jpeg = pixel_list(open_image(encode(cmyk, "JPEG", quality=95)))
    assert all(abs(v - w) <= 4 for pixel in from_jpeg for v, w in zip(pixel, want))


SIXTEEN_BIT = [0x1234, 0xFFFF, 0x00FF, 0x8000, 0x0100, 0x7FFF]
HIGH_BYTES = [0x12, 0xFF, 0x00, 0x80, 0x01, 0x7F]


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_sixteen_bit_grey_keeps_the_high_byte(fmt):
    grey = Image.frombytes("I;16", (3, 2), struct.pack("<6H", *SIXTEEN_BIT))
    got = open_image(encode(grey, fmt))
    assert got.mode == "RGB"
    assert pixel_list(got) == [(v, v, v) for v in HIGH_BYTES]


def test_big_endian_sixteen_bit_grey_keeps_the_high_byte():
    grey = Image.frombytes("I;16B", (3, 2), struct.pack(">6H", *SIXTEEN_BIT))
    assert pixel_list(open_image(encode(grey, "TIFF"))) == [(v, v, v) for v in HIGH_BYTES]


def test_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert pixel_list(open_image(data)) == [(255, 0, 0)] * 16
