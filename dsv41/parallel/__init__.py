"""Tensor and expert parallelism on torch.distributed (docs/PARALLEL.md)."""

from .context import ParallelContext, Shard
from .launch import init_parallel, launched_world_size, rank_device, shutdown

__all__ = ["ParallelContext", "Shard", "init_parallel", "launched_world_size", "rank_device", "shutdown"]
