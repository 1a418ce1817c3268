"""The released checkpoint: its inventory, reading, writing and tensor-parallel slicing (docs/CHECKPOINT.md)."""

from .inventory import BLOCK, dspark_experts, inventory_bytes, released_inventory, routed_expert_count
from .progress import byte_progress
from .safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointDir, CheckpointError, ShardHeader, read_header
from .sharding import (ENGRAM_ROWS, EXPERT, REPLICATE, SPLIT, SPLIT_TABLE, RankSlice, ShardingError, ShardRule,
                       allowed_world_sizes, check_parallel_sizes, check_world_size, engram_rows_per_rank, expert_index, rank_slice,
                       shard_rule)
from .spec import DTYPES, TensorSpec, dtype_name, torch_dtype
from .writer import DEFAULT_MAX_SHARD_BYTES, save_checkpoint, shard_file_name

__all__ = [
    "BLOCK", "dspark_experts", "inventory_bytes", "released_inventory", "routed_expert_count",
    "byte_progress",
    "INDEX_NAME", "SINGLE_NAME", "CheckpointDir", "CheckpointError", "ShardHeader", "read_header",
    "ENGRAM_ROWS", "EXPERT", "REPLICATE", "SPLIT", "SPLIT_TABLE", "RankSlice", "ShardingError", "ShardRule",
    "allowed_world_sizes", "check_parallel_sizes", "check_world_size", "engram_rows_per_rank", "expert_index", "rank_slice", "shard_rule",
    "DTYPES", "TensorSpec", "dtype_name", "torch_dtype",
    "DEFAULT_MAX_SHARD_BYTES", "save_checkpoint", "shard_file_name",
]
