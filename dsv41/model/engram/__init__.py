"""Engram: compressed token map, n-gram hashing, fp8 tables and the gated module (docs/ENGRAM-HASHING.md,
docs/ARCHITECTURE.md §9)."""

from .hashing import (
    DEAD,
    VERIFIED_MULTIPLIERS,
    EngramHistory,
    EngramLayout,
    NgramHasher,
    derive_multipliers,
    hash_compressed,
    is_prime,
)
from .module import Engram, stream_gate
from .table import EngramTable, map_safetensors_tensor
from .token_map import build_token_map, key_normalizer, load_or_build_token_map

__all__ = [
    "DEAD", "VERIFIED_MULTIPLIERS", "EngramHistory", "EngramLayout", "NgramHasher", "derive_multipliers",
    "hash_compressed", "is_prime", "Engram", "stream_gate", "EngramTable", "map_safetensors_tensor",
    "build_token_map", "key_normalizer", "load_or_build_token_map",
]
