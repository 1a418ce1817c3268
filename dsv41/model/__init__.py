"""The DeepSeek-V4.1 model: layers, attention with compressor and indexer, MoE, hyper-connections,
Engram, DSpark stages, the per-sequence cache and the per-step metadata (docs/ARCHITECTURE.md)."""

from .transformer import ModelOutput, Transformer

__all__ = ["ModelOutput", "Transformer"]
