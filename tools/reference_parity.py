"""Compare dsv41's `reference` numerics with the public reference implementation, bit for bit.

The reference is not part of dsv41. Point this script at a local copy of its `inference/` folder that
runs on the CPU, for example the vendored copy in GitHub tenstorrent/tt-metal
(`models/demos/deepseek_v3_d_p/reference/deepseek_v41/`, which carries `kernel_cpu.py`, a torch port of
the GPU kernels):

    python tools/reference_parity.py --reference path/to/deepseek_v41
    python tools/reference_parity.py --reference path/to/deepseek_v41 --record tests/golden

For small random-weight configs with DSpark stages (no Engram: its hash needs the tokenizer), it builds a dsv41 model, copies its weights into the reference model by checkpoint name
(routed experts unstacked), and compares the last-position logits of a prefill and of every following
single-token decode step — the only incremental mode the reference has — and the DSpark drafts (ids,
logits, confidence) of every step.

What is compared:
- dsv41 with `kernels="blas"`, which runs each matmul at the reference's call shapes, must be
  bit-identical. Where the reference's `torch.topk` picks another member of an exact tie than dsv41's
  rule (equal scores: lower index first), the reference is run with dsv41's rule and the case reports
  how many choices that changed, apart from any mismatch: torch leaves tie order to the kernel, and the
  reference's own prefill and decode disagree there (docs/ARCHITECTURE.md §17 trap 14).
- with a vision tower ("vision" cases): a prompt holding one image span, made from a generated PNG by
  each side's own processor. The reference's patches must equal dsv41's bit for bit, and the prefill
  merges the span's rows (ViT, aligner, delimiters) and routes its positions with `bias_vl`.
- with a vision case selected, also the vision encoder alone at the released widths (one of the 32 ViT
  blocks, the aligner into dim 5120) on a 640 × 480 picture: the span's aligner rows must be
  bit-identical (a tiny ViT passing proves little about 1024-wide bf16 GEMMs, trap 22).
- both index-key semantics (trap 15): "stale" runs the reference as released against dsv41's
  `stale_index_keys=True`; "own" makes each reference index source read its own keys, dsv41's default.
- dsv41's default invariant kernels, for information: how far exact-sum matmuls land from the
  reference's fp32 BLAS sums (max |Δ logit|, argmax agreement).

`--world N` runs the cases at tensor parallelism N instead (N processes on gloo, dsv41 with
TP = EP = N against the reference at MP = N, the same comparison): each side's bf16 partial sums, fp32
all-reduces and all-gathers must agree bit for bit (docs/PARALLEL.md §4).

With `--record DIR` a --world run records the reference's MP = N outputs the same way (file names end
in `mpN`).

`--record DIR` writes the reference's outputs for the cases marked `golden` (own keys) as safetensors
files the test suite compares against (tests/test_golden.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from dsv41.config import ModelConfig, RuntimeConfig
from dsv41.model.init import init_random_
from dsv41.model import Transformer
from dsv41.parity import decode_trace
from dsv41.model.topk import ordered_keys

TINY = dict(vocab_size=256, dim=64, moe_inter_dim=32, n_layers=8, n_heads=4, n_routed_experts=4,
            n_shared_experts=1, q_lora_rank=32, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32,
            compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
            index_n_heads=2, index_head_dim=32, candidate_source_layer=4, route_scale=1.5, swiglu_limit=10.0,
            original_seq_len=64, rope_factor=4, compress_rope_theta=160000.0, n_mtp_layers=2, dspark_block_size=5,
            dspark_noise_token_id=255, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=32,
            dspark_n_routed_experts=4, dspark_n_activated_experts=2)
NON_BINDING = dict(n_activated_experts=4, window_size=8, index_topk=128, candidate_topk_blocks=128,
                   candidate_block_size=2)
BINDING = dict(n_activated_experts=2, window_size=32, index_topk=48, candidate_topk_blocks=8, candidate_block_size=4)
# 1024-wide fp8 GEMMs: 32 K blocks, where summing block by block (the reference) and one GEMM over all of K
# (dsv41 before 2026-12) round differently: the latter differed from the reference in a prefill (seed 1)
# and from decode step 16 on (seed 0), with every discrete choice non-binding.
WIDE = dict(dim=1024, moe_inter_dim=512, q_lora_rank=256, head_dim=128, rope_head_dim=32, n_heads=4,
            o_lora_rank=64, index_head_dim=64, dspark_markov_rank=64)
# a 2-block ViT of 4 heads × 16; a 97×61 picture plans to 8×5 patches, a 3×2 grid, a 10-position span
VISION = dict(vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=48, vision_patch_size=14,
              vision_downsample_ratio=3, vision_max_n_token=64, vision_min_pixels=84 * 84, vision_rope_theta=10000.0,
              image_token_id=200)
CASES = {
    # every discrete choice non-binding: all experts, top-k and candidate blocks wider than the context
    "non-binding": dict(config=dict(TINY, **NON_BINDING), golden=True),
    # every choice binding (ties among the summed ReLUs), and more than 64 indices per query
    "binding, >64 indices": dict(config=dict(TINY, **BINDING)),
    # wide fp8 GEMMs (blockwise accumulation)
    "wide fp8 GEMMs": dict(config=dict(TINY, **NON_BINDING, **WIDE), tokens=60, prefill=30),
    # bf16 checkpoint: dense Linears and routed experts in bf16 (expert_dtype null follows dtype)
    "bf16 dense + experts": dict(config=dict(TINY, **NON_BINDING, dtype="bf16", expert_dtype=None), golden=True),
    # an image span in the prompt: ViT, aligner, delimiter rows, bias_vl routing
    "vision": dict(config=dict(TINY, **NON_BINDING, **VISION), image=(97, 61), image_at=5, golden=True),
    "vision, binding": dict(config=dict(TINY, **BINDING, **VISION), image=(97, 61), image_at=20),
}
SEMANTICS = ("stale", "own")


@contextmanager
def default_dtype(dtype: torch.dtype):
    """The reference builds and runs with torch's default dtype set to bf16 (its generate.py does)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class TieRule:
    """Runs the reference's top-k calls with dsv41's tie rule and counts the choices that changed.

    A changed choice must be a tie — both selections hold the same multiset of scores — else it is
    recorded as a mismatch, which would be a bug in the rule.
    """

    def __init__(self):
        self.changed = 0
        self.mismatched = 0

    @contextmanager
    def installed(self):
        original = torch.Tensor.topk

        def topk(tensor, k, dim=-1, largest=True, sorted=True):
            theirs = original(tensor, k, dim=dim, largest=largest, sorted=sorted)
            if not largest or dim not in (-1, tensor.dim() - 1):
                return theirs
            indices = original(ordered_keys(tensor), k, dim=-1, sorted=sorted).indices
            mine = tensor.gather(-1, indices)
            # a choice is the set chosen; the order among equal scores changes nothing downstream
            rows = (indices.sort(-1).values != theirs.indices.sort(-1).values).any(-1)
            if rows.any():
                self.changed += int(rows.sum())
                same_scores = torch.equal(mine.sort(-1).values[rows], theirs.values.sort(-1).values[rows])
                self.mismatched += 0 if same_scores else int(rows.sum())
            return torch.return_types.topk((mine, indices))

        torch.Tensor.topk = topk
        try:
            yield
        finally:
            torch.Tensor.topk = original


@contextmanager
def own_index_keys(module):
    """Make every reference index source that owns keys score against its own key cache (trap 15)."""
    original = module.Indexer.forward

    def forward(self, *args, **kwargs):
        if self.owns_k:
            module.shared_attn.index_k = self.k_cache
        return original(self, *args, **kwargs)

    module.Indexer.forward = forward
    try:
        yield
    finally:
        module.Indexer.forward = original


def import_reference(folder: Path):
    sys.path.insert(0, str(folder.resolve().parent))
    return importlib.import_module(f"{folder.name}.model")


def reference_args(module, cfg: ModelConfig, max_seq_len: int):
    fields = module.ModelArgs.__dataclass_fields__
    values = {k: v for k, v in cfg.to_dict().items() if k in fields}
    values["candidate_source_layer"] = -1 if cfg.candidate_source_layer is None else cfg.candidate_source_layer
    return module.ModelArgs(**values, max_batch_size=1, max_seq_len=max_seq_len, temperature=0.0)


def copy_weights(ours: Transformer, ref: torch.nn.Module) -> None:
    """Every dsv41 tensor into the reference's parameter of the same checkpoint name, bytes unchanged."""
    target = ref.state_dict()
    written = set()
    for name, value in ours.state_dict().items():
        parts = [(name, value)]
        if ".ffn.experts." in name:
            prefix, proj, kind = name.rsplit(".", 2)
            first = ours.get_submodule(prefix.rpartition(".")[0]).expert_range[0]    # this rank's experts
            parts = [(f"{prefix}.{first + e}.{proj}.{kind}", value[e]) for e in range(value.shape[0])]
        for ref_name, tensor in parts:
            dst = target[ref_name]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{ref_name}: reference {tuple(dst.shape)}, dsv41 {tuple(tensor.shape)}")
            if dst.element_size() == 1:                        # fp8 / e8m0 / packed fp4: copy the bytes
                dst.view(torch.uint8).copy_(tensor.view(torch.uint8))
            else:
                dst.copy_(tensor)
            written.add(ref_name)
    tied = {n for n in target if n.startswith("mtp.") and n.endswith((".embed.weight", ".head.weight"))
            and ".markov_head." not in n}                       # the reference ties them to embed / head
    missing = sorted(set(target) - written - tied)
    if missing:
        raise ValueError(f"reference parameters dsv41 did not fill: {missing[:5]}")


def build_ours(cfg: ModelConfig, seed: int, max_seq: int, kernels: str, semantics: str) -> Transformer:
    runtime = RuntimeConfig(max_seq_len=max_seq, kernels=kernels, stale_index_keys=semantics == "stale")
    return init_random_(Transformer(cfg, runtime), seed)


def case_ids(cfg: ModelConfig, seed: int, tokens: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed + 1))


def case_picture(width: int, height: int, seed: int) -> bytes:
    """PNG bytes of a deterministic picture: colour gradients plus seeded noise."""
    import io

    from PIL import Image

    g = torch.Generator().manual_seed(seed + 7)
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    rgb = torch.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256])
    rgb = (rgb + torch.randint(0, 40, rgb.shape, generator=g)).clamp(0, 255).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb.permute(1, 2, 0).numpy(), "RGB").save(buf, "PNG")
    return buf.getvalue()


class VisionInputs:
    """One image span at `at` in the case's tokens, from both processors (the patches must agree)."""

    def __init__(self, module, cfg: ModelConfig, ids: torch.Tensor, picture: bytes, at: int, max_seq_len: int):
        from dsv41.vision.processor import load_image
        from dsv41.vision.spans import PromptImage

        self.picture, self.image = picture, load_image(picture, cfg)
        ip = importlib.import_module(module.__name__.rpartition(".")[0] + ".image_processor")
        patches, n_vit_h, n_vit_w, _, _ = ip.load_image({"data": picture}, reference_args(module, cfg, max_seq_len))
        self.same_patches = torch.equal(patches.flatten(1), self.image.patches)
        span = self.image.plan.span_length
        text = ids[0].masked_fill(ids[0] == cfg.image_token_id, 0)                 # no stray image ids
        self.ids = torch.cat([text[:at], torch.full((span,), cfg.image_token_id), text[at:len(text) - span]])[None]
        self.span = PromptImage(at, self.image)
        types = torch.full((self.ids.shape[1],), -1)
        types[at:at + span] = torch.tensor(self.image.plan.token_types())
        self.types = types[None]
        self.reference_image = ip.ImageInput(at, patches, n_vit_h, n_vit_w, self.types[0, at:at + span])

    def ours(self, model: Transformer, prefill: int):
        """The prefill's SpanRows for dsv41 (the span must lie inside the prefill, as in the reference)."""
        from dsv41.vision.spans import call_rows

        return call_rows([(0, 0, prefill, [(self.span, model.encode_image(self.image))])], prefill, model.device)

    def reference(self, prefill: int) -> dict:
        """The reference's VL keyword arguments of the prefill call."""
        return dict(images=[[self.reference_image]], token_types=self.types[:, :prefill])


def released_encoder_case(module, blocks: int = 1) -> bool:
    """dsv41's ViT + aligner against the reference's at the released widths (`blocks` ViT blocks)."""
    from dsv41.config import RELEASED_CONFIG
    from dsv41.vision.encoder import Aligner, ViT
    from dsv41.vision.processor import load_image

    cfg = ModelConfig.from_json(RELEASED_CONFIG).replace(vision_n_layers=blocks)
    ours = torch.nn.ModuleDict({"vision": ViT(cfg), "aligner": Aligner(cfg)})
    init_random_(ours, 0)
    vision = importlib.import_module(module.__name__.rpartition(".")[0] + ".vision")
    ip = importlib.import_module(module.__name__.rpartition(".")[0] + ".image_processor")
    args = reference_args(module, cfg, 64)
    with default_dtype(torch.bfloat16):
        theirs = torch.nn.ModuleDict({"vision": vision.ViT(args), "aligner": vision.Aligner(args)})
    theirs.load_state_dict(ours.state_dict())
    picture = case_picture(640, 480, 0)
    image = load_image(picture, cfg)
    patches, n_vit_h, n_vit_w, _, _ = ip.load_image({"data": picture}, args)
    plan = image.plan
    with torch.no_grad():
        mine = ours["aligner"](ours["vision"](image.patches, plan.n_vit_h, plan.n_vit_w), plan.n_vit_h, plan.n_vit_w)
        with default_dtype(torch.bfloat16):
            ref = theirs["aligner"](theirs["vision"](patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)
    same = torch.equal(patches.flatten(1), image.patches) and torch.equal(mine, ref)
    print(f"released ViT widths ({blocks} block, {plan.n_patches} patches) + aligner: bit-identical {same}")
    return same


def run_reference(module, ours: Transformer, ids, prefill, semantics: str, ties: TieRule, vision=None):
    with default_dtype(torch.bfloat16):
        ref = module.Transformer(reference_args(module, ours.cfg, ours.runtime.max_seq_len))
    copy_weights(ours, ref)
    seen = {"logits": [], "draft_ids": [], "draft_logits": [], "confidence": []}
    keys = own_index_keys(module) if semantics == "own" else _nothing()
    with default_dtype(torch.bfloat16), ties.installed(), keys:
        next_ids, logits, hidden = ref(ids[:, :prefill], 0, **({} if vision is None else vision.reference(prefill)))
        seen["logits"].append(logits)
        if len(ref.mtp):
            ref.forward_spec(next_ids, hidden, 0)
        for p in range(prefill, ids.shape[1]):
            next_ids, logits, hidden = ref(ids[:, p:p + 1], p)
            seen["logits"].append(logits)
            if len(ref.mtp):
                draft_ids, draft_logits, confidence = ref.forward_spec(next_ids, hidden, p)
                seen["draft_ids"].append(draft_ids)
                seen["draft_logits"].append(draft_logits)
                seen["confidence"].append(confidence.float())
    return {k: [t.float() if t.is_floating_point() else t for t in v] for k, v in seen.items()}


@contextmanager
def _nothing():
    yield


def compare(mine: dict, theirs: dict) -> dict[str, float | bool | None]:
    a, b = torch.stack(mine["logits"], 1), torch.stack(theirs["logits"], 1)
    drafts = [torch.equal(x, y) for key in ("draft_ids", "draft_logits", "confidence")
              for x, y in zip(mine[key], theirs[key])]
    return {"max_diff": (a - b).abs().max().item(), "argmax": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "exact": torch.equal(a, b), "drafts_exact": all(drafts) if drafts else None}


def record(directory: Path, label: str, cfg: ModelConfig, seed: int, ids, prefill, theirs: dict,
           vision: "VisionInputs | None" = None) -> Path:
    """One golden file: the config, the tokens and the reference's outputs (own index keys); a vision
    case adds the picture's PNG bytes, the reference's patches and the token types."""
    from safetensors.torch import save_file

    tensors = {"ids": ids.contiguous(), "logits": torch.cat(theirs["logits"]).contiguous()}
    if vision is not None:
        tensors["picture"] = torch.frombuffer(bytearray(vision.picture), dtype=torch.uint8)
        tensors["patches"] = vision.reference_image.patches.flatten(1).contiguous()
        tensors["token_types"] = vision.types.contiguous()
        directory = directory / "vision"
    if theirs["draft_ids"]:
        tensors["draft_ids"] = torch.cat(theirs["draft_ids"]).contiguous()
        tensors["draft_logits"] = torch.cat(theirs["draft_logits"]).contiguous()
        tensors["confidence"] = torch.cat(theirs["confidence"]).contiguous()
    meta = {"config": json.dumps(cfg.to_dict()), "seed": str(seed), "prefill": str(prefill), "case": label}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{label.split(',')[0].replace(' ', '-').replace('+', 'and')}-seed{seed}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def parallel_case(rank: int, world: int, port: int, folder: Path, directory: Path, label: str, seed: int,
                  tokens: int, prefill: int, semantics: str, out: Path, golden: Path | None) -> None:
    """One rank of a --world run: dsv41's part loaded from `directory`, the reference's at MP = world."""
    import os

    from dsv41.checkpoint.model_io import load_model
    from dsv41.parallel import init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ctx = init_parallel(world, world)
    module = import_reference(folder)
    runtime = RuntimeConfig(max_seq_len=2 * tokens, kernels="blas", stale_index_keys=semantics == "stale")
    ours = load_model(directory, runtime, parallel=ctx, check_memory=False, progress=False)
    ids = case_ids(ours.cfg, seed, tokens)
    ties = TieRule()
    theirs = run_reference(module, ours, ids, prefill, semantics, ties)
    result = compare(decode_trace(ours, ids, prefill), theirs)
    if rank == 0:
        out.write_text(json.dumps(dict(result, changed=ties.changed, mismatched=ties.mismatched)))
        if golden is not None:
            print(f"  recorded {record(golden, f'{label} mp{world}', ours.cfg, seed, ids, prefill, theirs)}")


def _runs(args):
    """(label, case, config, tokens, prefill, index-key semantics, seed) of every run asked for."""
    for label in args.cases:
        case = CASES[label]
        cfg = ModelConfig(**case["config"])
        tokens, prefill = case.get("tokens", args.tokens), case.get("prefill", args.prefill)
        for semantics in SEMANTICS:
            for seed in range(args.seeds):
                yield label, case, cfg, tokens, prefill, semantics, seed


def run_world(args, module_folder: Path) -> int:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from dsv41.checkpoint.model_io import save_model

    failures = 0
    print(f"{'case':<22} {'keys':<5} {'seed':>4} {'MP':>3} {'bit-identical':>13} {'drafts':>6} {'max|Δ|':>8}")
    for label, case, cfg, tokens, prefill, semantics, seed in _runs(args):
        with tempfile.TemporaryDirectory() as tmp:
            save_model(build_ours(cfg, seed, 2 * tokens, "blas", semantics), Path(tmp) / "ckpt")
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = Path(tmp) / "result.json"
            mp.start_processes(parallel_case, nprocs=args.world, start_method="spawn",
                               args=(args.world, port, module_folder, Path(tmp) / "ckpt", label, seed, tokens,
                                     prefill, semantics, out,
                                     args.record if case.get("golden") and semantics == "own" else None))
            r = json.loads(out.read_text())
        ok = r["exact"] and r["drafts_exact"] is not False and r["mismatched"] == 0
        failures += not ok
        print(f"{label:<22} {semantics:<5} {seed:>4} {args.world:>3} {str(r['exact']):>13} "
              f"{str(r['drafts_exact']):>6} {r['max_diff']:>8.3g}")
    print("every case bit-identical" if not failures else f"{failures} case(s) differ")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="the reference's inference folder")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=100, help="positions per case (prefill + decode)")
    parser.add_argument("--prefill", type=int, default=60)
    parser.add_argument("--cases", nargs="*", default=list(CASES), help=f"cases to run (default: all of {list(CASES)})")
    parser.add_argument("--record", type=Path, metavar="DIR", help="write golden files of the golden cases here")
    parser.add_argument("--world", type=int, default=1, help="tensor parallelism N: N processes on each side")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.world > 1:
        return run_world(args, args.reference)
    module = import_reference(args.reference)
    header = (f"{'case':<22} {'keys':<5} {'seed':>4} {'bit-identical':>13} {'drafts':>6} {'ties':>5} "
              f"{'invariant max|Δ|':>16} {'argmax':>7}")
    print(header)
    failures = 0
    for label, case, cfg, tokens, prefill, semantics, seed in _runs(args):
        ids, vision = case_ids(cfg, seed, tokens), None
        if "image" in case:
            vision = VisionInputs(module, cfg, ids, case_picture(*case["image"], seed), case["image_at"], 2 * tokens)
            ids = vision.ids
        blas = build_ours(cfg, seed, 2 * tokens, "blas", semantics)
        ties = TieRule()
        theirs = run_reference(module, blas, ids, prefill, semantics, ties, vision)
        span = lambda model: None if vision is None else vision.ours(model, prefill)
        exact = compare(decode_trace(blas, ids, prefill, span(blas)), theirs)
        fixed = build_ours(cfg, seed, 2 * tokens, "invariant", semantics)
        invariant = compare(decode_trace(fixed, ids, prefill, span(fixed)), theirs)
        ok = exact["exact"] and exact["drafts_exact"] is not False and ties.mismatched == 0
        if vision is not None and not vision.same_patches:
            ok = False
            print(f"{label}: the processors' patches differ")
        failures += not ok
        print(f"{label:<22} {semantics:<5} {seed:>4} {str(exact['exact']):>13} "
              f"{str(exact['drafts_exact']):>6} {ties.changed:>5} {invariant['max_diff']:>16.3g} "
              f"{invariant['argmax']:>7.3f}" + ("" if ties.mismatched == 0 else f"  NOT A TIE: {ties.mismatched}"))
        if args.record and case.get("golden") and semantics == "own":
            print(f"  recorded {record(args.record, label, cfg, seed, ids, prefill, theirs, vision)}")
    if any("image" in CASES[label] for label in args.cases):
        failures += not released_encoder_case(module)
    print("every case bit-identical" if not failures else f"{failures} case(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
