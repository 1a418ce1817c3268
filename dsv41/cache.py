"""Per-sequence state, created by the engine for a batch and passed to every forward (STYLE.md P3).

Shapes: B batch, W window, Dh head dim, Di index head dim, r compress ratio, L max context.

| state                | owner                         | shape                  | ARCHITECTURE.md |
|----------------------|-------------------------------|------------------------|-----------------|
| window ring          | every layer, DSpark included  | [B, W, Dh]             | §11.2           |
| compressed KV        | kv sources                    | [B, L / r, Dh]         | §11.4           |
| index keys           | kv sources                    | [B, L / r, Di]         | §11.6           |
| compressor tail      | r > 1 kv sources              | [B, r, Dh] × 2, fp32   | §11.3           |
| Engram hash history  | the model                     | [B, L]                 | ENGRAM-HASHING §4 |

Position p lives in ring slot p mod W; compressed row j stands for positions j·r … j·r + r − 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .roles import LayerRole


class CacheError(ValueError):
    """A call that does not fit the cache it was given (too long, wrong batch, out of order)."""


@dataclass
class SourceState:
    """What a kv source carries between calls: its compressed rows, index keys and pooling tail."""

    kv: torch.Tensor
    index_keys: torch.Tensor
    tail_kv: torch.Tensor | None
    tail_score: torch.Tensor | None


@dataclass
class ModelCache:
    """All per-sequence state of one batch of sequences sharing start positions."""

    batch_size: int
    max_seq_len: int
    window: dict[int, torch.Tensor]
    sources: dict[int, SourceState]
    engram_history: object | None = None
    length: int = 0
    """Positions 0 … length − 1 have been written; the next call starts at `length` or restarts at 0."""
    published_keys: int | None = None
    """The kv source whose index keys were published last (only read in stale-key mode, trap 15)."""
    extras: dict = field(default_factory=dict)

    def check_call(self, start_pos: int, length: int, batch: int) -> None:
        if batch != self.batch_size:
            raise CacheError(f"batch of {batch} rows given to a cache created for {self.batch_size}")
        if start_pos < 0 or start_pos > self.length:
            raise CacheError(f"start_pos {start_pos} leaves a gap: the cache holds positions 0 … {self.length - 1}")
        if 0 < start_pos < self.length:
            # the window ring and the pooling tail already hold later positions in the slots this call
            # would read; continuing at `length` or restarting at 0 is exact
            raise CacheError(f"start_pos {start_pos} rewinds a cache that holds positions 0 … {self.length - 1}: "
                             f"continue at {self.length} or restart at 0")
        if start_pos + length > self.max_seq_len:
            raise CacheError(f"positions {start_pos} … {start_pos + length - 1} exceed the cache's context of "
                             f"{self.max_seq_len} tokens")

    def reset(self) -> None:
        self.length = 0
        self.published_keys = None


def create_cache(cfg: ModelConfig, roles: tuple[LayerRole, ...], batch_size: int, max_seq_len: int, *,
                 device=None, dtype: torch.dtype = torch.bfloat16, engram_history=None) -> ModelCache:
    """Allocate every layer's state for `batch_size` sequences of up to `max_seq_len` positions."""
    if batch_size <= 0 or max_seq_len <= 0:
        raise CacheError(f"batch_size and max_seq_len must be positive, got {batch_size} and {max_seq_len}")
    window = {r.layer_id: torch.zeros(batch_size, cfg.window_size, cfg.head_dim, device=device, dtype=dtype)
              for r in roles}
    sources = {}
    for r in roles:
        if not r.is_kv_source:
            continue
        rows = max_seq_len // r.ratio
        tail = (torch.zeros(batch_size, r.ratio, cfg.head_dim, device=device, dtype=torch.float32)
                if r.ratio > 1 else None)
        sources[r.layer_id] = SourceState(
            kv=torch.zeros(batch_size, rows, cfg.head_dim, device=device, dtype=dtype),
            index_keys=torch.zeros(batch_size, rows, cfg.index_head_dim, device=device, dtype=dtype),
            tail_kv=tail, tail_score=None if tail is None else torch.full_like(tail, float("-inf")),
        )
    return ModelCache(batch_size=batch_size, max_seq_len=max_seq_len, window=window, sources=sources,
                      engram_history=engram_history)
