"""What an image costs on this machine: preprocessing, the vision encoder, and the span in the prefill.

Run from the repository root: python benchmarks/bench_vision.py [--threads N] [--blocks N]

- Preprocessing (decode, plan, pad, patches) of photographs of several sizes, best of 5.
- The released ViT and aligner widths (1024-wide, 16 heads, 5632-wide MLP, aligner 9216 → 5120) with
  `--blocks` of the 32 blocks, random bf16 weights, on the patches of a 1024 × 768 image (55 × 74 =
  4,070 patches); the time per block and the 32-block estimate.
- The random demo: a prompt with one image against the same prompt with its placeholder left as one
  text token, to show the span's share of a prefill, and the tower's encode time.
"""

from __future__ import annotations

import argparse
import io
import time

import torch
from PIL import Image

from dsv41.config import RELEASED_CONFIG, ModelConfig, RuntimeConfig
from dsv41.vision.encoder import Aligner, ViT
from dsv41.vision.processor import load_image


def best_s(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def photo(width: int, height: int, fmt: str = "JPEG") -> bytes:
    g = torch.Generator().manual_seed(width)
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    rgb = torch.stack([x * 255 // width, y * 255 // height, (x ^ y) % 256]).to(torch.uint8)
    rgb = (rgb.int() + torch.randint(0, 16, rgb.shape, generator=g, dtype=torch.int32)).clamp(0, 255).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb.permute(1, 2, 0).numpy(), "RGB").save(buf, fmt)
    return buf.getvalue()


def preprocessing(cfg: ModelConfig) -> None:
    print("preprocessing (released config): decode, plan, pad, patches")
    for w, h in ((640, 480), (1024, 768), (1920, 1080), (4000, 3000)):
        data = photo(w, h)
        image = load_image(data, cfg)
        s = best_s(lambda: load_image(data, cfg))
        plan = image.plan
        print(f"  {w:>4} × {h:<4} JPEG {len(data) / 1e6:5.2f} MB → {plan.n_vit_h} × {plan.n_vit_w} patches, "
              f"{plan.span_length:>4} positions: {s * 1e3:7.1f} ms")


def encoder(cfg: ModelConfig, blocks: int) -> None:
    trimmed = cfg.replace(vision_n_layers=blocks)
    vit, aligner = ViT(trimmed), Aligner(trimmed)
    for module in (vit, aligner):
        for p in module.parameters():
            p.data.copy_((torch.randn(p.shape) * p.shape[-1] ** -0.5).to(p.dtype))
    image = load_image(photo(1024, 768), cfg)
    plan = image.plan

    def run():
        with torch.no_grad():
            aligner(vit(image.patches, plan.n_vit_h, plan.n_vit_w), plan.n_vit_h, plan.n_vit_w)

    def embed_only():
        with torch.no_grad():
            aligner(vit.norm(vit.patch_embed(image.patches)), plan.n_vit_h, plan.n_vit_w)

    total, fixed = best_s(run, 3), best_s(embed_only, 3)
    per_block = (total - fixed) / blocks
    print(f"released ViT widths, {plan.n_patches} patches (1024 × 768): {per_block:.2f} s per block, patch embed + "
          f"aligner {fixed:.2f} s; the 32 blocks ≈ {32 * per_block + fixed:.1f} s per image")


def demo_span() -> None:
    import dsv41
    from dsv41.demo import ensure_demo_checkpoint
    from dsv41.vision.spans import PromptImage, call_rows

    model = dsv41.load(ensure_demo_checkpoint(), RuntimeConfig(max_seq_len=256))
    image = load_image(photo(400, 300), model.cfg)
    span = image.plan.span_length
    prefix = torch.randint(3, 500, (40,)).tolist()
    with_image = prefix + [model.cfg.image_token_id] * span + prefix
    text_only = prefix + prefix + prefix[:span]

    def prefill(ids, images):
        with torch.no_grad():
            model(torch.tensor([ids]), 0, model.new_cache(1), images=images)

    rows = model.encode_image(image)
    spans = call_rows([(0, 0, len(with_image), [(PromptImage(len(prefix), image), rows)])], len(with_image))
    encode = best_s(lambda: model.encode_image(image))
    a, b = best_s(lambda: prefill(with_image, spans), 3), best_s(lambda: prefill(text_only, None), 3)
    print(f"random demo, a {len(with_image)}-position prompt with a {span}-position span: prefill {a * 1e3:.0f} ms "
          f"(text of the same length {b * 1e3:.0f} ms, {a / b:.2f}×); the tower's encode {encode * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=2, help="ViT blocks to time at the released widths")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_json(RELEASED_CONFIG)
    print(f"{args.threads} thread(s)")
    preprocessing(cfg)
    encoder(cfg, args.blocks)
    demo_span()


if __name__ == "__main__":
    main()
