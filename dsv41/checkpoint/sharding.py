"""Tensor-parallel slicing of the released checkpoint: which part of each tensor a rank loads (docs/CHECKPOINT.md §5).

The TP degree is a load-time choice [dsv41]: every rank reads the original files and keeps its slice.
Four kinds of tensor:
    split        one dim cut into `world_size` equal parts (heads, output groups, vocab rows)
    expert       routed experts are kept whole; rank i owns experts [i·n/ws, (i+1)·n/ws)
    engram_rows  Engram table rows cut into ⌈rows/ws⌉ per rank, the last rank zero-padded
    replicate    everything else: every rank loads the whole tensor
A `.scale` is cut exactly like its `.weight`: same rule, same dim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from ..config import ModelConfig
from ..errors import UserError
from .inventory import BLOCK, released_inventory, routed_expert_count
from .spec import TensorSpec

SPLIT, REPLICATE, EXPERT, ENGRAM_ROWS = "split", "replicate", "expert", "engram_rows"


class ShardingError(UserError):
    """A world size the checkpoint cannot be cut into; the message names the tensor and dim."""


@dataclass(frozen=True)
class ShardRule:
    dim: int | None
    kind: str
    unit: str | None = None
    """Config field counting the things laid along `dim` (heads, groups, rows); they must not be cut."""


# The split table (docs/CHECKPOINT.md §5). Keyed by the module path's tail, i.e. the name without its
# .weight / .scale suffix; the longest matching tail wins, so `indexer.wq_b` is not `attn.wq_b`.
#   tail                     dim  what is split (config count)
SPLIT_TABLE: dict[str, tuple[int, str]] = {
    "embed":                 (0, "vocab_size"),     # top-level embed and mtp.S.markov_head.embed
    "head":                  (0, "vocab_size"),     # top-level head and mtp.S.markov_head.head
    "attn.wq_b":             (0, "n_heads"),        # query heads
    "attn.attn_sink":        (0, "n_heads"),
    "attn.wo_a":             (0, "o_groups"),       # output groups
    "attn.wo_b":             (1, "o_groups"),       # row-parallel: input columns, all-reduce after
    "indexer.wq_b":          (0, "index_n_heads"),  # indexer heads
    "indexer.weights_proj":  (0, "index_n_heads"),
}

_PARAM_SUFFIXES = (".weight", ".scale")
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")
_ENGRAM_TABLE = re.compile(r"\.engram\.embed\.(weight|scale)$")


def _module_path(name: str) -> str:
    for suffix in _PARAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _split_entry(path: str) -> tuple[int, str] | None:
    parts = path.split(".")
    for n in range(len(parts), 0, -1):  # longest tail first
        entry = SPLIT_TABLE.get(".".join(parts[-n:]))
        if entry is not None:
            return entry
    return None


def shard_rule(name: str) -> ShardRule:
    if _ENGRAM_TABLE.search(name):  # before the table: its module tail is `embed` too
        return ShardRule(0, ENGRAM_ROWS)
    if _EXPERT.search(name):
        return ShardRule(None, EXPERT)
    entry = _split_entry(_module_path(name))
    if entry is None:
        return ShardRule(None, REPLICATE)
    return ShardRule(entry[0], SPLIT, entry[1])


def expert_index(name: str) -> int | None:
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


class RankSlice(NamedTuple):
    """Rows/columns [start, stop) of `dim`; for experts `dim` is None and the range is expert indices.

    `pad` counts zero rows (scale rows: 1.0) the rank appends so every rank holds the same number of
    Engram rows.
    """

    dim: int | None
    start: int
    stop: int
    pad: int = 0


def _check_world_size(world_size: int, rank: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank} is not in a world of size {world_size}")


def _even_part(name: str, what: str, size: int, rank: int, world_size: int) -> tuple[int, int]:
    if size % world_size:
        raise ShardingError(f"cannot split {name} {what} ({size}) over world size {world_size}: "
                            f"{size} is not divisible by {world_size} (docs/CHECKPOINT.md §5)")
    part = size // world_size
    return rank * part, (rank + 1) * part


def engram_rows_per_rank(rows: int, world_size: int) -> tuple[int, int]:
    """(rows each rank holds, zero rows the last rank adds): ⌈rows/ws⌉ and ⌈rows/ws⌉·ws − rows."""
    per_rank = -(-rows // world_size)
    return per_rank, per_rank * world_size - rows


def rank_slice(name: str, shape: tuple[int, ...], rank: int, world_size: int, *,
               n_experts: int | None = None) -> RankSlice | None:
    """The part of tensor `name` rank `rank` loads; None means the whole tensor (replicated).

    Expert tensors need `n_experts` (the MoE's expert count, see `routed_expert_count`); the result is
    the rank's expert range, and the tensor is loaded whole iff its expert index falls inside it.
    """
    _check_world_size(world_size, rank)
    rule = shard_rule(name)
    if rule.kind == REPLICATE:
        return None
    if rule.kind == EXPERT:
        if n_experts is None:
            raise ValueError(f"{name} is a routed-expert tensor: pass n_experts")
        return RankSlice(None, *_even_part(name, "experts", n_experts, rank, world_size))
    size = shape[rule.dim]
    if rule.kind == ENGRAM_ROWS:
        per_rank, _ = engram_rows_per_rank(size, world_size)
        start, stop = min(rank * per_rank, size), min((rank + 1) * per_rank, size)
        return RankSlice(0, start, stop, per_rank - (stop - start))
    return RankSlice(rule.dim, *_even_part(name, f"dim {rule.dim}", size, rank, world_size))


# ---------------------------------------------------------------------------------------- world size
@dataclass(frozen=True)
class _Cuts:
    """What a world size must divide: each split tensor (with its rule and whether it has block scales)
    and each distinct routed-expert count (with one tensor to name in errors)."""

    splits: tuple[tuple[TensorSpec, ShardRule, bool], ...]
    experts: dict[int, str]

    @classmethod
    def of(cls, cfg: ModelConfig, inventory: dict[str, TensorSpec]) -> "_Cuts":
        splits, experts = [], {}
        for spec in inventory.values():
            rule = shard_rule(spec.name)
            if rule.kind == SPLIT:
                blocked = spec.name.endswith(".weight") and _module_path(spec.name) + ".scale" in inventory
                splits.append((spec, rule, blocked))
            elif rule.kind == EXPERT:
                experts.setdefault(routed_expert_count(spec.name, cfg), spec.name)
        return cls(tuple(splits), experts)

    def check(self, cfg: ModelConfig, world_size: int, ep_size: int | None = None) -> None:
        """Tensor parallelism over `world_size` ranks, routed experts over `ep_size` (default the same)."""
        ep_size = world_size if ep_size is None else ep_size
        if world_size < 1 or ep_size < 1:
            raise ShardingError(f"parallel sizes must be positive, got {world_size} and {ep_size}")
        for spec, rule, blocked in self.splits:
            _check_split(spec, rule, blocked, cfg, world_size)
        for n, name in self.experts.items():
            _even_part(name, "routed experts", n, 0, ep_size)


def _check_split(spec: TensorSpec, rule: ShardRule, blocked: bool, cfg: ModelConfig, world_size: int) -> None:
    _even_part(spec.name, f"dim {rule.dim}", spec.shape[rule.dim], 0, world_size)
    units = getattr(cfg, rule.unit)
    if units % world_size:
        raise ShardingError(f"cannot split {spec.name} dim {rule.dim} over world size {world_size}: it holds "
                            f"{rule.unit} = {units} units, which do not divide by {world_size} (docs/CHECKPOINT.md §5)")
    part = spec.shape[rule.dim] // world_size
    if blocked and world_size > 1 and part % BLOCK:
        # 32×32 block scales are cut with their weight, so each rank's part must be whole blocks.
        raise ShardingError(f"cannot split {spec.name} dim {rule.dim} over world size {world_size}: each rank "
                            f"would get {part}, not a multiple of the {BLOCK}-wide scale blocks")


def check_world_size(cfg: ModelConfig, world_size: int, inventory: dict[str, TensorSpec] | None = None) -> None:
    """Raise ShardingError naming the first tensor and dim that `world_size` cannot cut."""
    _Cuts.of(cfg, released_inventory(cfg) if inventory is None else inventory).check(cfg, world_size)


def allowed_world_sizes(cfg: ModelConfig, candidates=range(1, 65), *, axis: str = "both") -> list[int]:
    """Sizes in `candidates` the checkpoint can be cut into: for tensor and expert parallelism together
    ("both", the reference's layout), tensor parallelism alone ("tp") or the routed experts alone ("ep")."""
    cuts = _Cuts.of(cfg, released_inventory(cfg))
    ok = []
    for ws in candidates:
        tp, ep = {"both": (ws, ws), "tp": (ws, 1), "ep": (1, ws)}[axis]
        try:
            cuts.check(cfg, tp, ep)
        except ShardingError:
            continue
        ok.append(ws)
    return ok


def check_parallel_sizes(cfg: ModelConfig, tp_size: int, ep_size: int) -> None:
    """Refuse tensor/expert parallel sizes the checkpoint cannot be cut into, listing the sizes it can."""
    cuts = _Cuts.of(cfg, released_inventory(cfg))
    try:
        cuts.check(cfg, tp_size, 1)
    except ShardingError as e:
        raise ShardingError(f"tensor parallel size {tp_size}: {e}; allowed sizes: "
                            f"{', '.join(map(str, allowed_world_sizes(cfg, axis='tp')))}") from None
    try:
        cuts.check(cfg, 1, ep_size)
    except ShardingError as e:
        raise ShardingError(f"expert parallel size {ep_size}: {e}; allowed sizes: "
                            f"{', '.join(map(str, allowed_world_sizes(cfg, axis='ep')))}") from None
