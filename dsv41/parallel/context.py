"""The parallel context: which part of the model this process holds, and the groups it reduces over.

Tensor parallelism (TP) cuts query heads, output groups, indexer heads, vocabulary rows and Engram
table rows over a TP group; expert parallelism (EP) gives each rank of an EP group a contiguous range of
every MoE's routed experts (docs/CHECKPOINT.md §5). Every rank runs every token: attention inputs are
replicated, so the compressed caches, index keys and Engram history are whole on each rank (V4.1's KV is
one head-free latent, docs/PARALLEL.md §2).

Ranks are laid out so that rank r is TP rank r mod tp and EP rank r mod ep; a TP group is a run of tp
consecutive ranks, an EP group a run of ep. The reference's layout is tp = ep = world.

The context is an object passed to the constructors (STYLE.md P5). `ParallelContext()` is one process:
every `shard` is None, no collective runs and torch.distributed need not be initialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Shard:
    """This rank's part of one module tensor: `dim` (0 = output rows, 1 = input columns of an [out, in]
    matrix; 0 for vectors and tables) cut into `parts` equal pieces, of which it holds piece `index`;
    `group` is the process group whose ranks hold the other pieces."""

    dim: int
    parts: int
    index: int
    group: Any = None

    def size(self, n: int) -> int:
        if n % self.parts:
            raise ValueError(f"{n} does not split into {self.parts} equal parts")
        return n // self.parts

    def start(self, n: int) -> int:
        return self.index * self.size(n)


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    tp_group: Any = field(default=None, compare=False)
    ep_group: Any = field(default=None, compare=False)
    control_group: Any = field(default=None, compare=False)
    """A CPU (gloo) group over all ranks for rank 0's commands (driver.py), apart from the model's groups."""
    timeout_s: float = 300.0
    """How long a collective may wait for a peer before the rank reports it lost."""

    def __post_init__(self) -> None:
        for name, size in (("tp_size", self.tp_size), ("ep_size", self.ep_size)):
            if size < 1 or self.world_size % size:
                raise ValueError(f"{name} {size} must be positive and divide the world size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def is_driver(self) -> bool:
        """Rank 0 tokenises, schedules, prints and serves; the other ranks follow its steps."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (TP {self.tp_rank}/{self.tp_size}, EP {self.ep_rank}/{self.ep_size})"

    # ------------------------------------------------------------------------------ the split table
    def shard(self, tail: str) -> Shard | None:
        """The TP cut of the module tensor whose path ends in `tail` (a key of the split table,
        checkpoint/sharding.py), or None when this process holds it whole."""
        from ..checkpoint.sharding import SPLIT_TABLE

        if tail not in SPLIT_TABLE:
            raise KeyError(f"{tail!r} is not in the split table")
        if self.tp_size == 1:
            return None
        return Shard(SPLIT_TABLE[tail][0], self.tp_size, self.tp_rank, self.tp_group)

    def local(self, tail: str, n: int) -> int:
        """How many of the n things laid along the cut dim of `tail` this rank holds."""
        shard = self.shard(tail)
        return n if shard is None else shard.size(n)

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        """[lo, hi): the routed experts this rank holds, contiguous, n/ep of them."""
        if n_experts % self.ep_size:
            raise ValueError(f"{n_experts} routed experts do not split over expert parallel size {self.ep_size}")
        part = n_experts // self.ep_size
        return self.ep_rank * part, (self.ep_rank + 1) * part

    def engram_rows(self, rows: int) -> tuple[int, int]:
        """[start, stop) of an Engram table's rows this rank holds: ⌈rows/tp⌉ each, the last rank fewer
        (the reference pads it with zero rows; lookups never reach them, so dsv41 does not hold them)."""
        from ..checkpoint.sharding import engram_rows_per_rank

        per_rank, _ = engram_rows_per_rank(rows, self.tp_size)
        return min(self.tp_rank * per_rank, rows), min((self.tp_rank + 1) * per_rank, rows)

