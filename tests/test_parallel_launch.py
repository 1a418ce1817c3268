"""Leaving a world: `shutdown` ends gloo's worker threads while the interpreter still runs.

A gloo group's threads end only in its destructor. When a reference cycle holds the group (a model's
shards and its context), nothing frees it before interpreter finalization, and a worker dropping a
tensor there aborts the process ("terminate called without an active exception", docs/PARALLEL.md §3).
The check runs in a fresh process (a world of one rank on an in-memory store) and counts the
process's OS threads before joining, while holding the group, and after `shutdown`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available()
                                or not os.path.isdir("/proc/self/task"),
                                reason="needs torch.distributed with gloo and /proc's thread list")

SCRIPT = textwrap.dedent("""
    import os

    import torch
    import torch.distributed as dist

    from dsv41.parallel import shutdown


    def threads():
        return len(os.listdir("/proc/self/task"))


    class Shard:                        # holds its group and, through a cycle, itself
        def __init__(self, group):
            self.group, self.me = group, self


    before = threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shard = Shard(dist.new_group())
    dist.broadcast(torch.ones(3), 0, group=shard.group)
    del shard
    held = threads()
    shutdown()
    print(before, held, threads(), dist.is_initialized())
""")


def test_shutdown_ends_the_groups_threads_even_when_a_cycle_held_them():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    before, held, after, initialized = run.stdout.split()
    assert int(held) > int(before), "joining a gloo world starts worker threads"
    assert int(after) == int(before), f"threads: {before} before the world, {held} in it, {after} after shutdown"
    assert initialized == "False"
