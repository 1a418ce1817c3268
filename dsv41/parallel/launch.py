"""Joining a torchrun world: the process groups of a ParallelContext (docs/PARALLEL.md §3).

torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) starts the processes;
`init_parallel` joins them with torch.distributed's env:// rendezvous — gloo for CPU runs, NCCL for
CUDA — and makes the TP and EP groups plus a gloo control group for rank 0's commands. Every rank
must call it with the same sizes. A collective that waits longer than `timeout_s` for a peer fails
on the ranks still alive, so a dead rank is reported instead of hanging the others.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .context import ParallelContext

DEFAULT_TIMEOUT_S = 300.0


def launched_world_size() -> int:
    """The number of processes the launcher started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _groups(world: int, size: int, backend: str, timeout: timedelta):
    """This rank's group among the runs of `size` consecutive ranks (every rank creates every group)."""
    if size == world:
        return dist.group.WORLD
    mine = None
    for base in range(0, world, size):
        group = dist.new_group(list(range(base, base + size)), backend=backend, timeout=timeout)
        if base <= dist.get_rank() < base + size:
            mine = group
    return mine


def init_parallel(tp_size: int | None = None, ep_size: int | None = None, *, device: str = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """The context of this process: one process without a launcher, else its rank in the torchrun world.

    tp_size / ep_size default to the world size (the reference's layout: heads and experts both cut
    over every rank). CUDA ranks compute on cuda:LOCAL_RANK.
    """
    world = launched_world_size()
    tp, ep = tp_size or world, ep_size or world
    if world == 1:
        return ParallelContext(tp_size=tp, ep_size=ep, timeout_s=timeout_s)
    cuda = torch.device(device).type == "cuda"
    backend = "nccl" if cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    ParallelContext(rank=dist.get_rank(), world_size=world, tp_size=tp, ep_size=ep)     # check the sizes first
    tp_group, ep_group = _groups(world, tp, backend, timeout), _groups(world, ep, backend, timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.new_group(timeout=timeout)
    return ParallelContext(rank=dist.get_rank(), world_size=world, tp_size=tp, ep_size=ep, tp_group=tp_group,
                           ep_group=ep_group, control_group=control, timeout_s=timeout_s)


def rank_device(ctx: ParallelContext, requested: str) -> str:
    """The device of this rank: cuda:LOCAL_RANK for "cuda" under a launcher, else what was asked."""
    if ctx.distributed and requested == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return requested


def shutdown() -> None:
    """Leave the world: destroy every process group, then free them now, while the interpreter runs.

    A gloo group's worker threads end only in the group's destructor, not in destroy_process_group. A
    group still held then (a model's shards and a context in a reference cycle, a traceback's frames)
    is freed by the collector during interpreter finalization, where a worker that drops a tensor
    cannot take the GIL and the process aborts ("terminate called without an active exception",
    docs/PARALLEL.md §3). Call it once the rank's own references to its context are gone.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
