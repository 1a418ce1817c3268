"""Compare dsv41's `reference` numerics with the public reference implementation, bit for bit.

The reference is not part of dsv41. Point this script at a local copy of its `inference/` folder that
runs on the CPU, for example the vendored copy in GitHub tenstorrent/tt-metal
(`models/demos/deepseek_v3_d_p/reference/deepseek_v41/`, which carries `kernel_cpu.py`, a torch port of
the GPU kernels):

    python tools/reference_parity.py --reference path/to/deepseek_v41

For a few small random-weight configs with DSpark stages (no Engram or vision: those need the
tokenizer and images), it builds a dsv41 model, copies its weights into the reference model by
checkpoint name (routed experts unstacked), and compares the last-position logits of a prefill and of
every following single-token decode step, the only incremental mode the reference has, and the DSpark
drafts (ids, logits, confidence) of every step. dsv41 runs with `stale_index_keys=True`, the
reference's behaviour (ARCHITECTURE.md §17 trap 15).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from dsv41.config import ModelConfig, RuntimeConfig
from dsv41.init import init_random_
from dsv41.model import Transformer

TINY = dict(vocab_size=256, dim=64, moe_inter_dim=32, n_layers=8, n_heads=4, n_routed_experts=4,
            n_shared_experts=1, q_lora_rank=32, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32,
            compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
            index_n_heads=2, index_head_dim=32, candidate_source_layer=4, route_scale=1.5, swiglu_limit=10.0,
            original_seq_len=64, rope_factor=4, compress_rope_theta=160000.0, n_mtp_layers=2, dspark_block_size=5,
            dspark_noise_token_id=255, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=32,
            dspark_n_routed_experts=4, dspark_n_activated_experts=2)
TINY["compress_ratios"] = TINY["compress_ratios"] + (0, 0)
CASES = {
    # every discrete choice non-binding: all experts, top-k and candidate blocks wider than the context
    "non-binding": dict(TINY, n_activated_experts=4, window_size=8, index_topk=128, candidate_topk_blocks=128,
                        candidate_block_size=2),
    # every choice binding, and more than 64 indices per query (several softmax blocks)
    "binding, >64 indices": dict(TINY, n_activated_experts=2, window_size=32, index_topk=48,
                                 candidate_topk_blocks=8, candidate_block_size=4),
}


@contextmanager
def default_dtype(dtype: torch.dtype):
    """The reference builds and runs with torch's default dtype set to bf16 (its generate.py does)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


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
            parts = [(f"{prefix}.{e}.{proj}.{kind}", value[e]) for e in range(value.shape[0])]
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


def compare(module, cfg: ModelConfig, seed: int, tokens: int, prefill: int) -> dict[str, float | bool]:
    max_seq = 2 * tokens
    ours = init_random_(Transformer(cfg, RuntimeConfig(max_seq_len=max_seq, kernels="blas", stale_index_keys=True)), seed)
    with default_dtype(torch.bfloat16):
        ref = module.Transformer(reference_args(module, cfg, max_seq))
    copy_weights(ours, ref)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed + 1))
    mine, theirs = _run_ours(ours, ids, prefill, max_seq), _run_reference(ref, ids, prefill)
    a, b = torch.stack(mine["logits"], 1), torch.stack(theirs["logits"], 1).float()
    result = {"max_diff": (a - b).abs().max().item(), "argmax": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
              "exact": torch.equal(a, b)}
    drafts = [torch.equal(x, y) for key in ("draft_ids", "draft_logits", "confidence")
              for x, y in zip(mine[key], theirs[key])]
    result["drafts_exact"] = all(drafts) if drafts else None
    return result


def _run_ours(model, ids, prefill, max_seq):
    cache = model.new_cache(1, max_seq)
    out = model(ids[:, :prefill], 0, cache)
    seen = {"logits": [model.logits(out.hidden[:, -1])], "draft_ids": [], "draft_logits": [], "confidence": []}
    if model.cfg.dspark_enabled:
        model.dspark_observe(out.dspark_hidden, 0, cache)
    for p in range(prefill, ids.shape[1]):
        out = model(ids[:, p:p + 1], p, cache)
        logits = model.logits(out.hidden[:, -1])
        seen["logits"].append(logits)
        if model.cfg.dspark_enabled:
            model.dspark_observe(out.dspark_hidden, p, cache)
            d = model.dspark_draft(logits.argmax(-1), p, cache)
            seen["draft_ids"].append(d.ids)
            seen["draft_logits"].append(d.logits)
            seen["confidence"].append(d.confidence)
    return seen


def _run_reference(ref, ids, prefill):
    seen = {"logits": [], "draft_ids": [], "draft_logits": [], "confidence": []}
    with default_dtype(torch.bfloat16):
        next_ids, logits, hidden = ref(ids[:, :prefill], 0)
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
                seen["confidence"].append(confidence)
    return seen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="the reference's inference folder")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--prefill", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    module = import_reference(args.reference)
    print(f"{'case':<24} {'seed':>4} {'max |Δ logit|':>14} {'argmax agree':>13} {'bit-identical':>14} "
          f"{'DSpark drafts identical':>24}")
    for label, values in CASES.items():
        cfg = ModelConfig(**values)
        for seed in range(args.seeds):
            r = compare(module, cfg, seed, args.tokens, args.prefill)
            print(f"{label:<24} {seed:>4} {r['max_diff']:>14.3g} {r['argmax']:>13.3f} {str(r['exact']):>14} "
                  f"{str(r['drafts_exact']):>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
