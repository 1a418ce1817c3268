"""Loading per rank (docs/PARALLEL.md §1, docs/CHECKPOINT.md §5), in one process: building and loading
run no collective, so a rank's model can be made with its context alone.

Round trip: the parts the ranks of a world load put back together are the one-process model's tensors,
bit for bit (split tensors concatenated on their dim, expert stacks in rank order, Engram rows in rank
order); sizes the config cannot cut are refused before a byte is read, naming the allowed sizes.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint.model_io import load_model
from dsv41.checkpoint.sharding import ShardingError, shard_rule
from dsv41.config import RuntimeConfig
from dsv41.parallel import ParallelContext

RUNTIME = RuntimeConfig(max_seq_len=64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _dim(name: str) -> int | None:
    """The dim the ranks' parts of module tensor `name` are concatenated on (None: replicated)."""
    if ".ffn.experts." in name or ".engram.embed." in name:
        return 0
    rule = shard_rule(name)
    return rule.dim if rule.kind == "split" else None


@pytest.fixture(scope="module")
def whole(demo_dir):
    return load_model(demo_dir, RUNTIME, check_memory=False).state_dict()


@pytest.mark.parametrize("tp, ep", [(2, 2), (4, 4), (2, 4), (4, 1)])
def test_rank_parts_rebuild_the_whole_model(demo_dir, whole, tp, ep):
    world = max(tp, ep)
    parts = [load_model(demo_dir, RUNTIME, check_memory=False,
                        parallel=ParallelContext(rank=r, world_size=world, tp_size=tp, ep_size=ep)).state_dict()
             for r in range(world)]
    assert parts[0].keys() == whole.keys()
    for name, full in whole.items():
        dim = _dim(name)
        size = ep if ".ffn.experts." in name else tp
        if dim is None or size == 1:
            for p in parts:
                assert torch.equal(_bits(p[name]), _bits(full)), name
            continue
        # ranks r and r + size hold the same part: take one rank of each group position
        rebuilt = torch.cat([parts[r][name] for r in range(size)], dim=dim)
        assert rebuilt.shape == full.shape and torch.equal(_bits(rebuilt), _bits(full)), name
        assert parts[0][name].shape[dim] == -(-full.shape[dim] // size), name


def test_the_last_rank_holds_fewer_engram_rows(demo_dir, whole):
    rows = whole["layers.1.engram.embed.weight"].shape[0]
    held = [load_model(demo_dir, RUNTIME, check_memory=False,
                       parallel=ParallelContext(rank=r, world_size=4, tp_size=4, ep_size=4)
                       ).layers[1].engram.embed for r in range(4)]
    assert [t.first for t in held] == [r * -(-rows // 4) for r in range(4)]
    assert sum(t.rows for t in held) == rows


@pytest.mark.parametrize("tp, ep, culprit, allowed", [
    (3, 1, "tensor parallel size 3", "allowed sizes: 1, 2, 4"),
    (8, 1, "tensor parallel size 8", "allowed sizes: 1, 2, 4"),
    (1, 8, "expert parallel size 8", "allowed sizes: 1, 2, 4"),
])
def test_sizes_the_config_cannot_cut_are_refused(demo_dir, tp, ep, culprit, allowed):
    ctx = ParallelContext(rank=0, world_size=max(tp, ep), tp_size=tp, ep_size=ep)
    with pytest.raises(ShardingError) as e:
        load_model(demo_dir, RUNTIME, parallel=ctx, check_memory=False)
    assert culprit in str(e.value) and allowed in str(e.value)


def test_a_context_checks_its_own_sizes():
    with pytest.raises(ValueError, match="tp_size 3 must be positive and divide the world size 4"):
        ParallelContext(rank=0, world_size=4, tp_size=3)
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        ParallelContext(rank=4, world_size=4)


def test_a_rank_part_is_not_saved_as_a_checkpoint(demo_dir, tmp_path):
    from dsv41.checkpoint import CheckpointError
    from dsv41.checkpoint.model_io import save_model

    part = load_model(demo_dir, RUNTIME, check_memory=False,
                      parallel=ParallelContext(rank=1, world_size=2, tp_size=2, ep_size=2))
    with pytest.raises(CheckpointError, match="the part of rank 1 of 2"):
        save_model(part, tmp_path / "out")
    assert not (tmp_path / "out").exists()                     # nothing written
