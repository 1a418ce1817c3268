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

from dataclasses import dataclass

import torch

from ..config import ModelConfig
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
    recent: tuple[int, torch.Tensor, torch.Tensor] | None = None
    """(first position, kv, score) of the positions the last call pooled or carried, for `restore_tail`."""

    def restore_tail(self, end: int) -> None:
        """Make the tail hold the open group at `end` (positions ⌊end/r⌋·r … end − 1), which the last
        call saw: it started at or after that group's first position."""
        group = end // self.tail_kv.shape[1] * self.tail_kv.shape[1]
        first, kv, score = self.recent
        self.tail_kv[:, :end - group] = kv[:, group - first:end - first]
        self.tail_score[:, :end - group] = score[:, group - first:end - first]


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
    backbone_layers: tuple[int, ...] = ()
    """Layers whose rings a forward writes (the DSpark stages' rings are written by `dspark_observe`)."""

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

    def snapshot(self, start_pos: int, length: int) -> "Snapshot":
        """Save what a call at start_pos … start_pos + length − 1 will overwrite, so that `rollback` can
        drop a suffix of it (rejected speculative drafts, GENERATION-AND-DSPARK.md §3)."""
        W = next(iter(self.window.values())).shape[1]
        if length > W:
            raise CacheError(f"a call of {length} positions cannot be rolled back with a window of {W}")
        slots = torch.arange(start_pos, start_pos + length) % W
        rings = {layer: self.window[layer][:, slots].clone() for layer in self.backbone_layers}
        return Snapshot(start_pos, length, slots, rings, self.published_keys)

    def rollback(self, snap: "Snapshot", keep: int) -> None:
        """Keep the first `keep` positions of the snapshotted call; restore the state of the rest."""
        if not 0 <= keep <= snap.call_length or self.length != snap.start_pos + snap.call_length:
            raise CacheError(f"cannot keep {keep} of the {snap.call_length} positions from {snap.start_pos}: "
                             f"the cache holds 0 … {self.length - 1}")
        undo = snap.slots[keep:]
        for layer, saved in snap.rings.items():
            self.window[layer][:, undo] = saved[:, keep:]
        end = snap.start_pos + keep
        for source in self.sources.values():
            if source.tail_kv is not None:
                source.restore_tail(end)
        self.length = end
        if keep < snap.call_length:
            self.published_keys = snap.published_keys


@dataclass
class Snapshot:
    """What a call will overwrite: the ring slots of its positions (backbone layers) and the stale-key
    owner; pooling tails are rebuilt from the compressor's record of the call."""

    start_pos: int
    call_length: int
    slots: torch.Tensor
    rings: dict[int, torch.Tensor]
    published_keys: int | None


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
                      engram_history=engram_history,
                      backbone_layers=tuple(r.layer_id for r in roles if not r.is_dspark))
