"""Per-sequence state: a pool of cache slots the engine owns, passed to every forward (STYLE.md P3).

Shapes: S slots, W window, Dh head dim, Di index head dim, r compress ratio, L max context; B rows and
N packed tokens of a call (step.py).

| state                | owner                         | shape                  | docs/                   |
|----------------------|-------------------------------|------------------------|-------------------------|
| window ring          | every layer, DSpark included  | [S, W, Dh]             | ARCHITECTURE.md §11.2   |
| compressed KV        | kv sources                    | [S, L / r, Dh]         | ARCHITECTURE.md §11.4   |
| index keys           | kv sources                    | [S, L / r, Di]         | ARCHITECTURE.md §11.6   |
| compressor tail      | r > 1 kv sources              | [S, r, Dh] × 2, fp32   | ARCHITECTURE.md §11.3   |
| Engram hash history  | the model                     | [S, L]                 | ENGRAM-HASHING.md §4    |

Position p of a slot lives in ring slot p mod W; compressed row j stands for positions j·r … j·r + r − 1.
Each slot holds one sequence at its own length; the cache's layout is written only by the methods here
(ring write, publish, tail carry), which layers call with the step's rows. A slot is freed by resetting
it: nothing else needs clearing, because every position is written before any query can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from .roles import LayerRole
from .step import CacheError, Step

__all__ = ["CacheError", "ModelCache", "Snapshot", "SourceState", "create_cache"]


@dataclass
class SourceState:
    """What a kv source carries between calls: its compressed rows, index keys and pooling tail."""

    kv: torch.Tensor
    index_keys: torch.Tensor
    tail_kv: torch.Tensor | None
    tail_score: torch.Tensor | None
    recent: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Per slot: (first position, kv, score) of the positions the last call pooled or carried, so a
    rollback can rebuild the tail."""

    @property
    def ratio(self) -> int:
        return 1 if self.tail_kv is None else self.tail_kv.shape[1]

    def rows(self, slots: tuple[int, ...], count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv [B, count, Dh], index keys [B, count, Di]): compressed rows 0 … count − 1 of each slot."""
        index = list(slots)
        return self.kv[index, :count], self.index_keys[index, :count]

    def publish_rows(self, slots: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, keys: torch.Tensor) -> None:
        """Compressed row rows[i] of slot slots[i] for every i: kv [G, Dh], index keys [G, Di]."""
        self.kv[slots, rows] = kv.to(self.kv.dtype)
        self.index_keys[slots, rows] = keys.to(self.index_keys.dtype)

    def tail(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (kv, score) [n, Dh] of the open group's first n positions."""
        return self.tail_kv[slot, :n], self.tail_score[slot, :n]

    def carry(self, slot: int, first: int, kv: torch.Tensor, score: torch.Tensor, end: int) -> None:
        """Record the positions first … end − 1 a call saw (kv, score [end − first, Dh]) and keep the
        open group at `end` as the tail."""
        self.recent[slot] = (first, kv, score)
        self.restore_tail(slot, end)

    def append_tails(self, slots: tuple[int, ...], slot_index: torch.Tensor, starts: tuple[int, ...],
                     kv: torch.Tensor, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new position per row (a decode step): kv, score [B, Dh] at position starts[b] of slot
        slots[b] (slot_index: the same slots as a tensor) → each row's open group [B, r, Dh] with it
        (entries past it are stale). `carry` of the rows, as two indexed writes and two reads instead of
        ~8 operations a row; the groups read back are each row's `recent` record for a rollback."""
        r = self.ratio
        lead = [s % r for s in starts]
        at = torch.tensor(lead, device=kv.device)
        self.tail_kv[slot_index, at] = kv
        self.tail_score[slot_index, at] = score
        groups_kv, groups_score = self.tail_kv[slot_index], self.tail_score[slot_index]
        for slot, start, n, g_kv, g_score in zip(slots, starts, lead, groups_kv.unbind(0), groups_score.unbind(0)):
            self.recent[slot] = (start - n, g_kv, g_score)
        return groups_kv, groups_score

    def restore_tail(self, slot: int, end: int) -> None:
        """Make the tail hold the open group at `end` (positions ⌊end/r⌋·r … end − 1), which the last
        call saw: it started at or after that group's first position."""
        group = end // self.ratio * self.ratio
        first, kv, score = self.recent[slot]
        self.tail_kv[slot, :end - group] = kv[group - first:end - first]
        self.tail_score[slot, :end - group] = score[group - first:end - first]


@dataclass
class ModelCache:
    """All per-sequence state of a pool of slots, each at its own length."""

    n_slots: int
    max_seq_len: int
    window: dict[int, torch.Tensor]
    sources: dict[int, SourceState]
    engram_history: object | None = None
    backbone_layers: tuple[int, ...] = ()
    """Layers whose rings a forward writes (the DSpark stages' rings are written by `dspark_observe`)."""
    lengths: list[int] = field(default_factory=list)
    """Per slot: positions 0 … length − 1 have been written."""
    published_keys: list[int | None] = field(default_factory=list)
    """Per slot: the kv source that published index keys last (read only in stale-key mode, trap 15)."""
    ring_writes: tuple | None = field(default=None, repr=False)
    """(step, W, targets) of the last `write_window`: every layer of a call writes the same ring slots."""

    def __post_init__(self) -> None:
        self.lengths = self.lengths or [0] * self.n_slots
        self.published_keys = self.published_keys or [None] * self.n_slots

    @property
    def batch_size(self) -> int:
        return self.n_slots

    @property
    def length(self) -> int:
        """The length every slot shares (caches driven with one start position for all rows)."""
        if len(set(self.lengths)) != 1:
            raise CacheError(f"the slots are at different lengths {self.lengths}; read cache.lengths")
        return self.lengths[0]

    # ---------------------------------------------------------------------------------- calls
    def check(self, step: Step) -> None:
        for slot, start, end in zip(step.slots, step.starts, step.ends):
            if not 0 <= slot < self.n_slots:
                raise CacheError(f"slot {slot} does not exist: the cache has {self.n_slots} slots")
            held = self.lengths[slot]
            if start > held:
                raise CacheError(f"start_pos {start} leaves a gap: slot {slot} holds positions 0 … {held - 1}")
            if 0 < start < held:
                # the window ring and the pooling tail already hold later positions in the slots this call
                # would read; continuing at the slot's length or restarting at 0 is exact
                raise CacheError(f"start_pos {start} rewinds slot {slot}, which holds positions 0 … {held - 1}: "
                                 f"continue at {held} or restart at 0")
            if end > self.max_seq_len:
                raise CacheError(f"positions {start} … {end - 1} exceed the cache's context of "
                                 f"{self.max_seq_len} tokens")

    def begin(self, step: Step) -> None:
        """Validate a call and forget what restarted slots held."""
        self.check(step)
        for slot, start in zip(step.slots, step.starts):
            if start == 0:
                self.reset(slot)

    def advance(self, step: Step) -> None:
        for slot, end in zip(step.slots, step.ends):
            self.lengths[slot] = end

    def reset(self, slot: int | None = None) -> None:
        """Free one slot (or all): its next call starts at position 0."""
        for s in range(self.n_slots) if slot is None else (slot,):
            self.lengths[s] = 0
            self.published_keys[s] = None
            for source in self.sources.values():
                source.recent.pop(s, None)

    # ---------------------------------------------------------------------------------- the window ring
    def read_window(self, layer: int, step: Step) -> torch.Tensor:
        """[B·W, Dh]: the rings of the call's rows, row after row (a view where the slots are a run)."""
        ring, first = self.window[layer], step.slots[0]
        if step.slots == tuple(range(first, first + step.n_rows)):
            return ring[first:first + step.n_rows].flatten(0, 1)
        return ring[list(step.slots)].flatten(0, 1)

    def write_window(self, layer: int, kv: torch.Tensor, step: Step) -> None:
        """After attending: the last min(count, W) positions of each row go to slots p mod W (kv [N, Dh])."""
        ring = self.window[layer]
        slots, ring_slots, keep = self._ring_targets(step, ring.shape[1])
        ring[slots, ring_slots] = (kv if keep is None else kv[keep]).to(ring.dtype)

    def _ring_targets(self, step: Step, W: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(slot, ring slot) of each position a call keeps, and which it keeps (None: all of them),
        computed once per call for all its layers (~10 operations a layer otherwise)."""
        if self.ring_writes is not None and self.ring_writes[0] is step and self.ring_writes[1] == W:
            return self.ring_writes[2]
        if max(step.counts) <= W:
            targets = (step.token_slot, step.positions % W, None)
        else:
            counts = torch.tensor(step.counts, device=step.positions.device)[step.row]
            keep = step.token_rank >= counts - W
            targets = (step.token_slot[keep], step.positions[keep] % W, keep)
        self.ring_writes = (step, W, targets)
        return targets

    # ---------------------------------------------------------------------------------- rollback
    def snapshot(self, step: Step) -> "Snapshot":
        """Save what a call will overwrite, so that `rollback` can drop a suffix of each row (rejected
        speculative drafts, docs/GENERATION-AND-DSPARK.md §3)."""
        W = next(iter(self.window.values())).shape[1]
        if max(step.counts) > W:
            raise CacheError(f"a call of {max(step.counts)} positions cannot be rolled back with a window of {W}")
        slots, ring = step.token_slot.cpu(), (step.positions % W).cpu()
        rings = {layer: self.window[layer][slots, ring].clone() for layer in self.backbone_layers}
        return Snapshot(step, slots, ring, step.token_rank.cpu(), rings, list(self.published_keys))

    def rollback(self, snap: "Snapshot", keep: list[int]) -> None:
        """Keep the first keep[r] positions of each row of the snapshotted call; restore the rest."""
        step = snap.step
        for slot, start, count, k in zip(step.slots, step.starts, step.counts, keep):
            if not 0 <= k <= count or self.lengths[slot] != start + count:
                raise CacheError(f"cannot keep {k} of the {count} positions from {start} in slot {slot}: it "
                                 f"holds 0 … {self.lengths[slot] - 1}")
        kept = torch.tensor(keep)[step.row.cpu()]
        undo = snap.ranks >= kept
        for layer, saved in snap.rings.items():
            self.window[layer][snap.slots[undo], snap.ring_slots[undo]] = saved[undo]
        for slot, start, count, k in zip(step.slots, step.starts, step.counts, keep):
            end = start + k
            for source in self.sources.values():
                if source.tail_kv is not None and slot in source.recent:
                    source.restore_tail(slot, end)
            self.lengths[slot] = end
            if k < count:
                self.published_keys[slot] = snap.published_keys[slot]


@dataclass
class Snapshot:
    """What a call will overwrite: the ring entries of its positions (backbone layers) and the stale-key
    owners; pooling tails are rebuilt from the compressor's record of the call."""

    step: Step
    slots: torch.Tensor
    ring_slots: torch.Tensor
    ranks: torch.Tensor
    rings: dict[int, torch.Tensor]
    published_keys: list[int | None]


def create_cache(cfg: ModelConfig, roles: tuple[LayerRole, ...], n_slots: int, max_seq_len: int, *,
                 device=None, dtype: torch.dtype = torch.bfloat16, engram_history=None) -> ModelCache:
    """Allocate every layer's state for `n_slots` sequences of up to `max_seq_len` positions."""
    if n_slots <= 0 or max_seq_len <= 0:
        raise CacheError(f"the slot count and max_seq_len must be positive, got {n_slots} and {max_seq_len}")
    window = {r.layer_id: torch.zeros(n_slots, cfg.window_size, cfg.head_dim, device=device, dtype=dtype)
              for r in roles}
    sources = {}
    for r in roles:
        if not r.is_kv_source:
            continue
        rows = max_seq_len // r.ratio
        tail = (torch.zeros(n_slots, r.ratio, cfg.head_dim, device=device, dtype=torch.float32)
                if r.ratio > 1 else None)
        sources[r.layer_id] = SourceState(
            kv=torch.zeros(n_slots, rows, cfg.head_dim, device=device, dtype=dtype),
            index_keys=torch.zeros(n_slots, rows, cfg.index_head_dim, device=device, dtype=dtype),
            tail_kv=tail, tail_score=None if tail is None else torch.full_like(tail, float("-inf")),
        )
    return ModelCache(n_slots=n_slots, max_seq_len=max_seq_len, window=window, sources=sources,
                      engram_history=engram_history,
                      backbone_layers=tuple(r.layer_id for r in roles if not r.is_dspark))
