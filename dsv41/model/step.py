"""Per-step metadata: which cache rows a forward feeds, and at which positions (STYLE.md P4).

Shapes: N tokens in the call, packed row after row (row 0's tokens, then row 1's, …, each in position
order); B rows in the call, each a slot of the cache pool.

A forward runs any mix of rows: one row prefilling a chunk of 512 positions, others decoding one token,
others verifying a draft of 6, each at its own position. Position-wise work (projections, norms, MoE,
hyper-connections, Engram) runs on the N packed tokens as one sequence; attention, the compressor, the
indexer and the cache look up each token's row and position here. Nothing is padded, so a batch costs
what its tokens cost.

The tensors live on the model's device; the same numbers are kept as host tuples, which decide shapes
(how many compressed rows a call reads) and validate calls without a device synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UserError


class CacheError(UserError):
    """A call that does not fit the cache it was given (too long, unknown slot, out of order)."""


@dataclass(frozen=True, eq=False)
class Step:
    slots: tuple[int, ...]
    """Cache slot of each call row."""
    starts: tuple[int, ...]
    """First position of each row in this call: its cache length before the call (or 0: a restart)."""
    counts: tuple[int, ...]
    """Tokens of each row in this call (≥ 1)."""
    device: torch.device = torch.device("cpu")
    reference_layout: bool = False
    """List attention windows as the reference does (numerics.py BLAS kernels; docs/NUMERICS.md N3)."""
    stale_index_keys: bool = False
    """Reproduce the reference's stale index-key slot (docs/ARCHITECTURE.md §17 trap 15)."""
    row: torch.Tensor = field(init=False)
    """int64 [N]: the call row (0 … B − 1) of each token."""
    positions: torch.Tensor = field(init=False)
    """int64 [N]: the absolute position of each token."""
    token_slot: torch.Tensor = field(init=False)
    """int64 [N]: the cache slot of each token."""
    token_rank: torch.Tensor = field(init=False)
    """int64 [N]: each token's index within its row (position − the row's start)."""
    offsets: tuple[int, ...] = field(init=False)
    """Index of each row's first token in the packed call."""
    slot_index: torch.Tensor = field(init=False)
    """int64 [B]: `slots` as a tensor (indexing the cache's per-slot rows)."""

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.starts) == len(self.counts)) or not self.slots:
            raise CacheError(f"a step needs one slot, start and count per row, got {self.slots}, {self.starts}, "
                             f"{self.counts}")
        if len(set(self.slots)) != len(self.slots):
            raise CacheError(f"a cache slot may appear once per step, got slots {self.slots}")
        if min(self.counts) < 1 or min(self.starts) < 0:
            raise CacheError(f"every row needs at least one token at a position ≥ 0, got starts {self.starts} "
                             f"and counts {self.counts}")
        offsets, total = [], 0
        for c in self.counts:
            offsets.append(total)
            total += c
        # the per-token numbers are made on the host and sent in one tensor: one operation instead of
        # ten, and no data-dependent shape (repeat_interleave) for a compiler to trace
        row = [r for r, c in enumerate(self.counts) for _ in range(c)]
        rank = [t for c in self.counts for t in range(c)]
        # the rows' slots ride in the same copy (one host-to-device transfer on an accelerator, not two)
        n = len(row)
        table = torch.tensor(row + [self.starts[r] + t for r, t in zip(row, rank)] + rank + [self.slots[r] for r in row]
                             + list(self.slots), dtype=torch.int64, device=self.device)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "row", table[:n])
        object.__setattr__(self, "positions", table[n:2 * n])
        object.__setattr__(self, "token_rank", table[2 * n:3 * n])
        object.__setattr__(self, "token_slot", table[3 * n:4 * n])
        object.__setattr__(self, "slot_index", table[4 * n:])

    @classmethod
    def uniform(cls, batch: int, start_pos: int, length: int, **kwargs) -> "Step":
        """Rows 0 … batch − 1 of the cache, each feeding `length` tokens from `start_pos`."""
        return cls(tuple(range(batch)), (start_pos,) * batch, (length,) * batch, **kwargs)

    # ---------------------------------------------------------------------------------- sizes
    @property
    def n_rows(self) -> int:
        return len(self.slots)

    @property
    def n_tokens(self) -> int:
        return sum(self.counts)

    @property
    def ends(self) -> tuple[int, ...]:
        """One past each row's last position in this call: the row's cache length after it."""
        return tuple(s + c for s, c in zip(self.starts, self.counts))

    @property
    def is_uniform(self) -> bool:
        """Every row at the same positions (the reference's only batch shape)."""
        return len(set(self.starts)) == 1 and len(set(self.counts)) == 1

    def compressed_rows(self, ratio: int) -> int:
        """Compressed positions a call of a ratio-r layer reads: the most any of its rows has after it."""
        return max(end // ratio for end in self.ends)

    def visible(self, ratio: int) -> torch.Tensor:
        """int64 [N]: compressed positions each token sees, ⌊(p + 1) / r⌋ (§11.5, trap 9)."""
        return (self.positions + 1) // ratio

    def tokens_of(self, r: int) -> slice:
        """The packed tokens of call row r."""
        return slice(self.offsets[r], self.offsets[r] + self.counts[r])

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, …] of a uniform step → [B, T, …]."""
        return x.unflatten(0, (self.n_rows, self.counts[0]))


@dataclass
class Handoff:
    """What index and candidate sources hand to later layers within one forward (§11.6, §12). The
    reference keeps this in one process-wide object; here it lives and dies with the forward."""

    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    window_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    rope_phases: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def step_phases(self, rotary, step: Step) -> torch.Tensor:
        """`rotary`'s phases at the step's positions, computed once per forward for every layer with the
        same table (and reused by its query, key and output rotations)."""
        if rotary.table_key not in self.rope_phases:
            self.rope_phases[rotary.table_key] = rotary.phases(step.positions)
        return self.rope_phases[rotary.table_key]

    def publish_selection(self, index_source: int, rows: torch.Tensor) -> None:
        """[N, k] compressed positions per token (−1: none), from the index source `index_source`."""
        self.selections[index_source] = rows

    def selection_for(self, role) -> torch.Tensor:
        """The selection of the layer's index source (itself, or the most recent one before it)."""
        return self.selections[role.index_source]

    def publish_candidates(self, candidate_source: int, mask: torch.Tensor) -> None:
        """[N, C] kept-block mask of the candidate source."""
        self.candidates[candidate_source] = mask

    def candidates_for(self, role) -> torch.Tensor:
        return self.candidates[role.candidate_source]
