"""Model and runtime configuration.

`ModelConfig` mirrors the released `inference/config.json` key for key (docs/ARCHITECTURE.md §2) and is
validated once, at construction; `RuntimeConfig` holds what the released file does not decide (cache
sizes, device, dtype, numerics mode). The two never mix (STYLE.md P2).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError


# The released inference/config.json of DeepSeek-V4.1-Flash, shipped with the package (MIT).
RELEASED_CONFIG = Path(__file__).resolve().parent / "configs" / "deepseek-v4.1-flash.json"


class ConfigError(UserError):
    """A configuration that breaks a rule; the message names the key and the rule."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    n_mtp_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    norm_eps: float = 1e-20
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    candidate_source_layer: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 0
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_pad_id: int = 0
    engram_compressed_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    """"fp4", or anything else ("fp8", "bf16", null): routed experts stored like `dtype`, as the
    reference reads it (its experts take the fp4 dtype or the default one; `layers.expert_storage`)."""
    compress_rope_theta: float = 10000.0
    vision_n_layers: int = 0
    vision_dim: int = 0
    vision_n_heads: int = 0
    vision_inter_dim: int = 0
    vision_patch_size: int = 0
    vision_downsample_ratio: int = 0
    vision_max_n_token: int = 0
    vision_min_pixels: int = 0
    vision_max_wh_ratio: float | None = None
    vision_rope_theta: float = 10000.0
    image_token_id: int | None = None
    # Read by the reference but absent from the released JSON (docs/ARCHITECTURE.md §2).
    gate_temp: float = 1.0

    def __post_init__(self) -> None:
        _validate(self)

    # ---------------------------------------------------------------- loading and saving
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)} (dsv41 reads the inference/config.json spelling)")
        # A file must spell out every key: a missing one would silently take a default (trap 25).
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in raw and f.name not in OPTIONAL_JSON_KEYS]
        if missing:
            raise ConfigError(f"missing config keys: {', '.join(missing)}")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in raw:
                values[f.name] = _coerce(f.name, raw[f.name], f.type)
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- derived sizes
    @property
    def n_all_layers(self) -> int:
        """Backbone blocks plus DSpark stages: the length of `compress_ratios`."""
        return self.n_layers + self.n_mtp_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def group_width(self) -> int:
        """Features of the attention output that one `wo_a` group reads (H·Dh/G)."""
        return self.n_heads * self.head_dim // self.o_groups

    @property
    def hc_mix_width(self) -> int:
        """(2 + S)·S: pre, post and the S×S comb matrix (docs/ARCHITECTURE.md §7)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_hash_columns(self) -> int:
        """N = (max_ngram − 1) · heads hash columns per position (docs/ENGRAM-HASHING.md §2)."""
        return max(self.engram_max_ngram_size - 1, 0) * self.engram_n_heads

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def dspark_enabled(self) -> bool:
        return self.dspark_block_size > 0 and self.n_mtp_layers > 0


# Keys the released inference/config.json does not set; the reference's defaults apply (§2).
OPTIONAL_JSON_KEYS = frozenset({"gate_temp"})

_TUPLE_FIELDS = {"compress_ratios", "kv_source_layers", "index_source_layers", "dspark_target_layer_ids",
                 "engram_layer_ids", "engram_num_embeddings"}


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    if name in _TUPLE_FIELDS:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{name} must be a list of integers, got {value!r}")
        return tuple(value)
    ann = str(annotation)
    if ann == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    elif ann == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        value = float(value)
    elif ann == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
    elif ann == "int | None":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{name} must be an integer or null, got {value!r}")
    elif ann == "str | None":
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{name} must be a string or null, got {value!r}")
    elif ann == "float | None" and value is not None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a number or null, got {value!r}")
        value = float(value)
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _divides(name_a: str, a: int, name_b: str, b: int) -> None:
    _check(b > 0 and a % b == 0, f"{name_a} ({a}) must be divisible by {name_b} ({b})")


def _validate(c: ModelConfig) -> None:
    for name in ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
                 "n_activated_experts", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups",
                 "o_lora_rank", "window_size", "hc_mult", "hc_sinkhorn_iters"):
        _check(getattr(c, name) > 0, f"{name} must be positive, got {getattr(c, name)}")
    _check(len(c.compress_ratios) == c.n_layers + c.n_mtp_layers,
           f"compress_ratios has {len(c.compress_ratios)} entries; it must have n_layers + n_mtp_layers "
           f"= {c.n_layers} + {c.n_mtp_layers} = {c.n_layers + c.n_mtp_layers}")
    _check(all(r >= 0 for r in c.compress_ratios), "compress_ratios entries must be >= 0")
    _check(all(r == 0 for r in c.compress_ratios[c.n_layers:]),
           "compress_ratios entries of the DSpark stages (after n_layers) must be 0 (window-only attention)")
    _check(c.rope_head_dim % 2 == 0 and c.rope_head_dim <= c.head_dim,
           f"rope_head_dim ({c.rope_head_dim}) must be even and at most head_dim ({c.head_dim})")
    _divides("n_heads", c.n_heads, "o_groups", c.o_groups)
    _check(c.n_shared_experts == 1, f"n_shared_experts must be 1 (the reference asserts it), got {c.n_shared_experts}")
    _check(c.n_activated_experts <= c.n_routed_experts,
           f"n_activated_experts ({c.n_activated_experts}) must be <= n_routed_experts ({c.n_routed_experts})")
    _check(c.score_func == "sqrtsoftplus", f"score_func must be 'sqrtsoftplus', got {c.score_func!r}")
    _check(c.dtype in ("fp8", "bf16"), f"dtype must be 'fp8' or 'bf16', got {c.dtype!r}")
    _check(c.expert_dtype in ("fp4", "fp8", "bf16", None),
           f"expert_dtype must be 'fp4', 'fp8', 'bf16' or null, got {c.expert_dtype!r}")
    if c.dtype == "fp8":
        # fp8 Linears quantise activations in blocks of 32 along the input (docs/ARCHITECTURE.md §6.3).
        for name in ("dim", "q_lora_rank", "moe_inter_dim"):
            _divides(name, getattr(c, name), "the fp8 block size", 32)
        _divides("n_groups·o_lora_rank", c.o_groups * c.o_lora_rank, "the fp8 block size", 32)
    if c.expert_dtype == "fp4":
        _divides("dim", c.dim, "the fp4 block size", 32)
        _divides("moe_inter_dim", c.moe_inter_dim, "the fp4 block size", 32)
    _validate_sources(c)
    _validate_indexer(c)
    _validate_engram(c)
    _validate_dspark(c)
    _validate_vision(c)


def _validate_vision(c: ModelConfig) -> None:
    if not c.vision_enabled:
        return
    for name in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size", "vision_downsample_ratio",
                 "vision_max_n_token", "vision_min_pixels"):
        _check(getattr(c, name) > 0, f"{name} must be positive when vision_n_layers > 0, got {getattr(c, name)}")
    _divides("vision_dim", c.vision_dim, "vision_n_heads", c.vision_n_heads)
    # 2D RoPE: half of each head's features rotate by the patch row, half by its column (§16.3)
    _check((c.vision_dim // c.vision_n_heads) % 4 == 0,
           f"the ViT head width vision_dim / vision_n_heads = {c.vision_dim // c.vision_n_heads} must be a multiple "
           f"of 4 (2D RoPE)")
    # the smallest span, one token of one row: START, IMAGE, NEW_LINE, END
    _check(c.vision_max_n_token >= 4, f"vision_max_n_token must be at least 4, got {c.vision_max_n_token}")
    _check(c.vision_max_wh_ratio is None or c.vision_max_wh_ratio > 0,
           f"vision_max_wh_ratio must be positive or null, got {c.vision_max_wh_ratio}")
    _check(c.image_token_id is not None and 0 <= c.image_token_id < c.vocab_size,
           f"image_token_id must be a token id when vision_n_layers > 0, got {c.image_token_id}")


def _validate_sources(c: ModelConfig) -> None:
    ratios = c.compress_ratios
    for key in ("kv_source_layers", "index_source_layers"):
        ids = getattr(c, key)
        _check(list(ids) == sorted(set(ids)), f"{key} must be strictly increasing, got {list(ids)}")
        for layer in ids:
            _check(0 <= layer < c.n_layers, f"{key} names layer {layer}, which does not exist (n_layers = {c.n_layers})")
            _check(ratios[layer] > 0, f"{key} names layer {layer}, whose compress ratio is 0")
    for layer in c.kv_source_layers:
        _check(layer in c.index_source_layers,
               f"kv_source_layers names layer {layer}, which is not in index_source_layers (a kv source owns index keys)")
    for layer in range(c.n_layers):
        if ratios[layer] == 0:
            continue
        sources = [s for s in c.kv_source_layers if s <= layer]
        _check(bool(sources), f"layer {layer} has compress ratio {ratios[layer]} but no kv source at or before it")
        _check(ratios[sources[-1]] == ratios[layer],
               f"layer {layer} has compress ratio {ratios[layer]} but its kv source, layer {sources[-1]}, has ratio "
               f"{ratios[sources[-1]]}")
        idx = [s for s in c.index_source_layers if s <= layer]
        _check(bool(idx) and idx[-1] >= sources[-1],
               f"layer {layer} has no index source at or after its kv source {sources[-1]}")


def _validate_indexer(c: ModelConfig) -> None:
    if not c.index_source_layers:
        return
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        _check(getattr(c, name) > 0, f"{name} must be positive when index_source_layers is set")
    _check(c.index_head_dim >= c.rope_head_dim and c.rope_head_dim % 2 == 0,
           f"index_head_dim ({c.index_head_dim}) must be at least rope_head_dim ({c.rope_head_dim})")
    if c.candidate_source_layer is not None:
        src = c.candidate_source_layer
        _check(src in c.kv_source_layers,
               f"candidate_source_layer ({src}) must be one of kv_source_layers {list(c.kv_source_layers)}")
        _check(c.candidate_topk_blocks > 0 and c.candidate_block_size > 0,
               "candidate_topk_blocks and candidate_block_size must be positive when candidate_source_layer is set")


def _validate_engram(c: ModelConfig) -> None:
    if not c.engram_layer_ids:
        return
    for layer in c.engram_layer_ids:
        _check(0 <= layer < c.n_layers, f"engram_layer_ids names layer {layer}, which does not exist (n_layers = {c.n_layers})")
    _check(len(c.engram_num_embeddings) == len(c.engram_layer_ids),
           f"engram_num_embeddings has {len(c.engram_num_embeddings)} entries; engram_layer_ids has {len(c.engram_layer_ids)}")
    for name in ("engram_vocab_size", "engram_max_ngram_size", "engram_compressed_vocab_size", "engram_n_heads",
                 "engram_head_dim"):
        _check(getattr(c, name) > 0, f"{name} must be positive when engram_layer_ids is set")
    _check(c.engram_max_ngram_size >= 2, f"engram_max_ngram_size must be >= 2, got {c.engram_max_ngram_size}")
    _divides("engram_head_dim", c.engram_head_dim, "the Engram scale block", 32)


def _validate_dspark(c: ModelConfig) -> None:
    if not c.dspark_enabled:
        return
    for layer in c.dspark_target_layer_ids:
        _check(0 <= layer < c.n_layers, f"dspark_target_layer_ids names layer {layer}, which does not exist")
    _check(len(c.dspark_target_layer_ids) > 0, "dspark_target_layer_ids must not be empty when DSpark is enabled")
    _check(0 < c.dspark_n_activated_experts <= c.dspark_n_routed_experts,
           "dspark_n_activated_experts must be in 1..dspark_n_routed_experts")
    _check(0 <= c.dspark_noise_token_id < c.vocab_size, "dspark_noise_token_id must be a token id")


NUMERICS_MODES = ("reference", "fast")
KERNEL_CHOICES = ("invariant", "blas")


INDEXER_BUDGET_BYTES = 256 << 20
"""The indexer's default budget: at 1M context its transient stays under 1 GiB instead of ~96 GiB."""


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """What the released config does not decide: limits, placement and numerics (STYLE.md P2)."""

    max_batch_size: int = 1
    max_seq_len: int = 4096
    device: str = "cpu"
    dtype: str = "bfloat16"
    numerics: str = "reference"
    kernels: str | None = None
    """"invariant" or "blas" (numerics.py); None: invariant for reference numerics, blas for fast."""
    indexer_budget_bytes: int = INDEXER_BUDGET_BYTES
    """Largest tensor the indexer may allocate while scoring a call (it works in chunks to stay within it)."""
    stale_index_keys: bool = False
    """Reproduce the reference's stale index-key slot (docs/ARCHITECTURE.md §17 trap 15); off by default."""
    stored_experts: bool = False
    """Fast numerics on the CPU: hold fp4 routed experts in their stored bytes (a quarter of the memory)
    and decode them inside the expert kernels; the results are the dequantised experts' bits
    (docs/NUMERICS.md N30). Reference numerics hold every weight stored already."""
    huge_pages: bool = True
    """Load a CPU model's weights into one buffer advised for 2 MB pages (docs/NUMERICS.md N32): a decode
    step's weight stream then takes no TLB miss per 4 KB page. Off: each tensor in its own allocation."""

    def __post_init__(self) -> None:
        _check(self.max_batch_size > 0, f"max_batch_size must be positive, got {self.max_batch_size}")
        _check(self.max_seq_len > 0, f"max_seq_len must be positive, got {self.max_seq_len}")
        _check(self.indexer_budget_bytes > 0, f"indexer_budget_bytes must be positive, got {self.indexer_budget_bytes}")
        _check(self.numerics in NUMERICS_MODES, f"numerics must be one of {NUMERICS_MODES}, got {self.numerics!r}")
        _check(self.kernels in (None,) + KERNEL_CHOICES,
               f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        _check(self.dtype in ("bfloat16", "float32"), f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.numerics == "reference":
            _check(self.dtype == "bfloat16", "numerics='reference' runs in bfloat16; use numerics='fast' for float32")
            _check(not self.stored_experts, "stored_experts is for numerics='fast': reference numerics hold every "
                                            "weight in its stored format already")

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    @property
    def numerics_policy(self):
        """The `Numerics` object every module of a model built with this runtime shares."""
        from .model.numerics import Numerics
        return Numerics.for_device(self.numerics, self.kernels, self.device, self.dtype,
                                   stored_experts=self.stored_experts)
