"""Every tensor of the released checkpoint layout, derived from a ModelConfig (docs/CHECKPOINT.md §3).

For the released config this is the index's weight_map exactly: 96,085 tensors, 510,286,023,000 bytes
(docs/CHECKPOINT.md §3.5, §4). Each family below is one small generator; `released_inventory` strings them
together in module order.

Naming and storage convention (docs/CHECKPOINT.md §2, docs/ARCHITECTURE.md §6.2), stated once here and applied by
`_linear`: a Linear at module path P stores `P.weight` as [out, in] and, when quantised, `P.scale`
(F8_E8M0, one power of two per block):
    fp8   P.weight F8_E4M3 [out, in]        P.scale [⌈out/32⌉, ⌈in/32⌉]   32×32 blocks
    fp4   P.weight I8      [out, ⌈in/2⌉]    P.scale [out, ⌈in/32⌉]        1×32 blocks, 2 values per byte
    bf16  P.weight BF16    [out, in]        (no scale)
Norms store `P.weight` [width] BF16. Bare parameters (attn_sink, hc_*, image_*, Engram q/k weights) have
no suffix. Which Linears follow `dtype` and which `expert_dtype` is decided in the families below.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from ..config import ModelConfig
from ..model.roles import LayerRole, derive_roles
from .spec import TensorSpec

# Weight block size of fp8 Linears, fp4 experts and the Engram table rows (docs/CHECKPOINT.md §2; 32, not
# DeepSeek-V3's 128).
BLOCK = 32
# hc_*_scale holds one scale each for the pre, post and comb mixes (docs/ARCHITECTURE.md §7).
HC_SCALES = 3

FP8, FP4, BF16, F32 = "fp8", "fp4", "bf16", "f32"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _linear(path: str, out_features: int, in_features: int, storage: str) -> Iterator[TensorSpec]:
    if storage == FP8:
        yield TensorSpec(f"{path}.weight", "F8_E4M3", (out_features, in_features))
        yield TensorSpec(f"{path}.scale", "F8_E8M0", (_ceil(out_features, BLOCK), _ceil(in_features, BLOCK)))
    elif storage == FP4:
        yield TensorSpec(f"{path}.weight", "I8", (out_features, _ceil(in_features, 2)))
        yield TensorSpec(f"{path}.scale", "F8_E8M0", (out_features, _ceil(in_features, BLOCK)))
    elif storage == BF16:
        yield TensorSpec(f"{path}.weight", "BF16", (out_features, in_features))
    else:
        raise ValueError(f"{path}: unknown Linear storage {storage!r}")


def _norm(path: str, width: int) -> TensorSpec:
    return TensorSpec(f"{path}.weight", "BF16", (width,))


def _with_bias(path: str, out_features: int, in_features: int) -> Iterator[TensorSpec]:
    """A bf16 Linear with a bias (ViT and aligner, docs/CHECKPOINT.md §3.1)."""
    yield from _linear(path, out_features, in_features, BF16)
    yield TensorSpec(f"{path}.bias", "BF16", (out_features,))


def _dense(cfg: ModelConfig) -> str:
    """Storage of the ordinary Linears: `dtype` (docs/ARCHITECTURE.md §2)."""
    return FP8 if cfg.dtype == "fp8" else BF16


def _expert(cfg: ModelConfig) -> str:
    """Storage of routed experts: fp4 when `expert_dtype` says so (the release), else as `dtype` — the
    reference's reading of the key (`layers.expert_storage`)."""
    return FP4 if cfg.expert_dtype == "fp4" else _dense(cfg)


# ---------------------------------------------------------------------------------------- families
def _globals(cfg: ModelConfig) -> Iterator[TensorSpec]:
    yield TensorSpec("embed.weight", "BF16", (cfg.vocab_size, cfg.dim))
    yield _norm("norm", cfg.dim)
    yield TensorSpec("head.weight", "BF16", (cfg.vocab_size, cfg.dim))


def _image_markers(cfg: ModelConfig) -> Iterator[TensorSpec]:
    for marker in ("image_start", "image_end", "image_newline"):
        yield TensorSpec(marker, "BF16", (cfg.dim,))


def _aligner(cfg: ModelConfig) -> Iterator[TensorSpec]:
    pooled = cfg.vision_dim * cfg.vision_downsample_ratio**2  # 3×3 patches per LLM token (§16.4)
    yield from _with_bias("aligner.w1", cfg.dim, pooled)
    yield from _with_bias("aligner.w2", cfg.dim, cfg.dim)


def _vision(cfg: ModelConfig) -> Iterator[TensorSpec]:
    vd = cfg.vision_dim
    yield from _with_bias("vision.patch_embed.proj", vd, 3 * cfg.vision_patch_size**2)  # RGB patches
    for b in range(cfg.vision_n_layers):
        p = f"vision.blocks.{b}"
        yield from _with_bias(f"{p}.attn.wqkv", 3 * vd, vd)
        yield from _with_bias(f"{p}.attn.wo", vd, vd)
        yield from _linear(f"{p}.mlp.w1", 2 * cfg.vision_inter_dim, vd, BF16)  # gate and up halves
        yield from _linear(f"{p}.mlp.w2", vd, cfg.vision_inter_dim, BF16)
        yield _norm(f"{p}.norm1", vd)
        yield _norm(f"{p}.norm2", vd)
    yield _norm("vision.norm", vd)


def _attention(cfg: ModelConfig, p: str) -> Iterator[TensorSpec]:
    dense = _dense(cfg)
    yield from _linear(f"{p}.wq_a", cfg.q_lora_rank, cfg.dim, dense)
    yield _norm(f"{p}.q_norm", cfg.q_lora_rank)
    yield from _linear(f"{p}.wq_b", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, dense)
    yield from _linear(f"{p}.wkv", cfg.head_dim, cfg.dim, dense)
    yield _norm(f"{p}.kv_norm", cfg.head_dim)
    # wo_a is stored like any Linear; the loader dequantises it to bf16 (docs/CHECKPOINT.md §5).
    yield from _linear(f"{p}.wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.group_width, dense)
    yield from _linear(f"{p}.wo_b", cfg.dim, cfg.o_groups * cfg.o_lora_rank, dense)
    yield TensorSpec(f"{p}.attn_sink", "F32", (cfg.n_heads,))


def _compressor(cfg: ModelConfig, p: str, ratio: int) -> Iterator[TensorSpec]:
    """KV sources only; bf16 in the file, the gate exists only for pooling ratios > 1 (§3.3)."""
    yield from _linear(f"{p}.wkv", cfg.head_dim, cfg.dim, BF16)
    if ratio > 1:
        yield from _linear(f"{p}.wgate", cfg.head_dim, cfg.dim, BF16)
    yield _norm(f"{p}.norm", cfg.head_dim)


def _indexer(cfg: ModelConfig, p: str, owns_keys: bool) -> Iterator[TensorSpec]:
    """Index sources; only KV sources turn their latent into index keys (wk, k_norm) (§3.3)."""
    yield from _linear(f"{p}.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, _dense(cfg))
    yield from _linear(f"{p}.weights_proj", cfg.index_n_heads, cfg.dim, BF16)
    if owns_keys:
        yield from _linear(f"{p}.wk", cfg.index_head_dim, cfg.head_dim, BF16)
        yield _norm(f"{p}.k_norm", cfg.index_head_dim)


def _router(cfg: ModelConfig, p: str, n_experts: int) -> Iterator[TensorSpec]:
    yield from _linear(p, n_experts, cfg.dim, BF16)
    yield TensorSpec(f"{p}.bias", "F32", (n_experts,))
    if cfg.vision_enabled:  # image-span routing bias exists only in vision builds (docs/PARAMETERS.md §1)
        yield TensorSpec(f"{p}.bias_vl", "F32", (n_experts,))


def _swiglu(p: str, dim: int, hidden: int, storage: str) -> Iterator[TensorSpec]:
    """w1 gate and w3 up [hidden, dim], w2 down [dim, hidden] (docs/ARCHITECTURE.md §13)."""
    yield from _linear(f"{p}.w1", hidden, dim, storage)
    yield from _linear(f"{p}.w2", dim, hidden, storage)
    yield from _linear(f"{p}.w3", hidden, dim, storage)


def _moe(cfg: ModelConfig, p: str, n_experts: int) -> Iterator[TensorSpec]:
    yield from _router(cfg, f"{p}.gate", n_experts)
    for e in range(n_experts):
        yield from _swiglu(f"{p}.experts.{e}", cfg.dim, cfg.moe_inter_dim, _expert(cfg))
    yield from _swiglu(f"{p}.shared_experts", cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts, _dense(cfg))


def _hyper_connections(cfg: ModelConfig, p: str) -> Iterator[TensorSpec]:
    for sub in ("attn", "ffn"):
        yield TensorSpec(f"{p}.hc_{sub}_fn", "F32", (cfg.hc_mix_width, cfg.hc_mult * cfg.dim))
        yield TensorSpec(f"{p}.hc_{sub}_base", "F32", (cfg.hc_mix_width,))
        yield TensorSpec(f"{p}.hc_{sub}_scale", "F32", (HC_SCALES,))


def _engram(cfg: ModelConfig, p: str, rows: int) -> Iterator[TensorSpec]:
    """The table is fp8 rows with one scale per 32 values whatever `dtype` says (§3.3, §9)."""
    width = cfg.engram_head_dim
    yield TensorSpec(f"{p}.embed.weight", "F8_E4M3", (rows, width))
    yield TensorSpec(f"{p}.embed.scale", "F8_E8M0", (rows, _ceil(width, BLOCK)))
    # wkv maps the N looked-up rows to S keys plus one shared value (docs/ARCHITECTURE.md §9).
    yield from _linear(f"{p}.wkv", (cfg.hc_mult + 1) * cfg.dim, cfg.engram_hash_columns * width, _dense(cfg))
    yield TensorSpec(f"{p}.q_weight", "BF16", (cfg.hc_mult, cfg.dim))
    yield TensorSpec(f"{p}.k_weight", "BF16", (cfg.hc_mult, cfg.dim))


def _block(cfg: ModelConfig, p: str, role: LayerRole, n_experts: int) -> Iterator[TensorSpec]:
    yield from _attention(cfg, f"{p}.attn")
    if role.is_kv_source:
        yield from _compressor(cfg, f"{p}.attn.compressor", role.ratio)
    if role.is_index_source:
        yield from _indexer(cfg, f"{p}.attn.indexer", owns_keys=role.is_kv_source)
    yield _norm(f"{p}.attn_norm", cfg.dim)
    yield _norm(f"{p}.ffn_norm", cfg.dim)
    yield from _moe(cfg, f"{p}.ffn", n_experts)
    yield from _hyper_connections(cfg, p)
    if role.has_engram:
        yield from _engram(cfg, f"{p}.engram", cfg.engram_num_embeddings[role.engram_index])


def dspark_experts(cfg: ModelConfig) -> int:
    """Routed experts per DSpark stage; the reference falls back to the backbone count when unset."""
    return cfg.dspark_n_routed_experts or cfg.n_routed_experts


def _dspark_stage(cfg: ModelConfig, stage: int, role: LayerRole) -> Iterator[TensorSpec]:
    """`mtp.S`: a window-only block plus stage-0 input and last-stage output extras (§3.4)."""
    p = f"mtp.{stage}"
    yield from _block(cfg, p, role, dspark_experts(cfg))
    if stage == 0:
        targets = len(cfg.dspark_target_layer_ids)
        yield from _linear(f"{p}.main_proj", cfg.dim, targets * cfg.dim, _dense(cfg))
        yield _norm(f"{p}.main_norm", cfg.dim)
    if stage == cfg.n_mtp_layers - 1:
        rank = cfg.dspark_markov_rank
        yield _norm(f"{p}.norm", cfg.dim)
        yield TensorSpec(f"{p}.markov_head.embed.weight", "BF16", (cfg.vocab_size, rank))
        yield TensorSpec(f"{p}.markov_head.head.weight", "BF16", (cfg.vocab_size, rank))
        yield from _linear(f"{p}.confidence_head.proj", 1, cfg.dim + rank, BF16)


# ---------------------------------------------------------------------------------------- public
# ---------------------------------------------------------------------------------------- module names
# Modules hold routed experts stacked: the stored `…ffn.experts.{e}.w1.weight` is row e of the module's
# `…ffn.experts.w1.weight`. Every other module tensor has its stored name.
EXPERT_STACK = re.compile(r"^(?P<prefix>.+\.ffn\.experts)\.(?P<proj>w[123])\.(?P<kind>weight|scale)$")
PER_EXPERT = re.compile(r"^(?P<prefix>.+\.ffn\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<kind>weight|scale)$")


def is_expert_stack(module_name: str) -> bool:
    return EXPERT_STACK.match(module_name) is not None


def stored_names(module_name: str, n_experts: int, first_expert: int = 0) -> list[str]:
    """Checkpoint names that make up one module tensor (one, or one per expert for stacked experts)."""
    m = EXPERT_STACK.match(module_name)
    if not m:
        return [module_name]
    return [f"{m['prefix']}.{first_expert + e}.{m['proj']}.{m['kind']}" for e in range(n_experts)]


def module_name_of(stored_name: str) -> str:
    m = PER_EXPERT.match(stored_name)
    return f"{m['prefix']}.{m['proj']}.{m['kind']}" if m else stored_name


def released_inventory(cfg: ModelConfig) -> dict[str, TensorSpec]:
    roles = derive_roles(cfg)
    families = [_globals(cfg)]
    families += [_block(cfg, f"layers.{r.layer_id}", r, cfg.n_routed_experts) for r in roles if not r.is_dspark]
    if cfg.dspark_enabled:
        families += [_dspark_stage(cfg, s, roles[cfg.n_layers + s]) for s in range(cfg.n_mtp_layers)]
    if cfg.vision_enabled:
        families += [_image_markers(cfg), _aligner(cfg), _vision(cfg)]
    out: dict[str, TensorSpec] = {}
    for family in families:
        for spec in family:
            if spec.name in out:
                raise AssertionError(f"inventory names {spec.name} twice")
            out[spec.name] = spec
    return out


def inventory_bytes(inventory: dict[str, TensorSpec]) -> int:
    return sum(s.nbytes for s in inventory.values())


def routed_expert_count(name: str, cfg: ModelConfig) -> int:
    """Experts in the MoE a tensor name belongs to: DSpark stages have their own count (§5)."""
    return dspark_experts(cfg) if name.startswith("mtp.") else cfg.n_routed_experts
