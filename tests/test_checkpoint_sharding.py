"""The tensor-parallel table against docs/CHECKPOINT.md §5."""


import pytest

from dsv41.checkpoint import (ENGRAM_ROWS, EXPERT, REPLICATE, SPLIT, ShardingError, allowed_world_sizes,
                              check_world_size, engram_rows_per_rank, rank_slice,
                              routed_expert_count, shard_rule)
from dsv41.config import RELEASED_CONFIG

CONFIG = RELEASED_CONFIG


@pytest.fixture
def cfg(released_cfg):
    return released_cfg


@pytest.fixture
def inv(released_inv):
    return released_inv


@pytest.mark.parametrize("name, dim", [
    ("embed.weight", 0), ("head.weight", 0),
    ("mtp.2.markov_head.embed.weight", 0), ("mtp.2.markov_head.head.weight", 0),
    ("layers.3.attn.wq_b.weight", 0), ("layers.3.attn.wq_b.scale", 0),
    ("layers.24.attn.indexer.wq_b.weight", 0), ("layers.24.attn.indexer.wq_b.scale", 0),
    ("layers.3.attn.wo_a.weight", 0), ("layers.3.attn.wo_a.scale", 0),
    ("layers.3.attn.wo_b.weight", 1), ("layers.3.attn.wo_b.scale", 1),
    ("layers.3.attn.attn_sink", 0), ("mtp.1.attn.attn_sink", 0),
    ("layers.24.attn.indexer.weights_proj.weight", 0),
])
def test_split_rows_of_the_table(name, dim):
    rule = shard_rule(name)
    assert (rule.kind, rule.dim) == (SPLIT, dim)


@pytest.mark.parametrize("name", [
    "layers.3.attn.wq_a.weight", "layers.3.attn.wq_a.scale", "layers.3.attn.wkv.weight", "layers.3.attn.q_norm.weight",
    "layers.3.attn.kv_norm.weight", "layers.3.attn_norm.weight", "norm.weight",
    "layers.2.attn.compressor.wkv.weight", "layers.2.attn.compressor.wgate.weight",
    "layers.2.attn.compressor.norm.weight",
    "layers.2.attn.indexer.wk.weight", "layers.2.attn.indexer.k_norm.weight",
    "layers.3.ffn.gate.weight", "layers.3.ffn.gate.bias", "layers.3.ffn.gate.bias_vl",
    "layers.3.ffn.shared_experts.w1.weight", "layers.3.ffn.shared_experts.w2.scale",
    "layers.3.hc_attn_fn", "layers.3.hc_ffn_base", "layers.3.hc_attn_scale",
    "layers.1.engram.wkv.weight", "layers.1.engram.wkv.scale", "layers.1.engram.q_weight", "layers.14.engram.k_weight",
    "vision.blocks.0.attn.wo.weight", "vision.patch_embed.proj.weight", "aligner.w1.weight", "image_start",
    "mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.confidence_head.proj.weight",
])
def test_replicated_names(name):
    assert shard_rule(name).kind == REPLICATE


def test_experts_and_engram_tables():
    assert shard_rule("layers.5.ffn.experts.17.w2.scale").kind == EXPERT
    assert shard_rule("mtp.0.ffn.experts.0.w1.weight").kind == EXPERT
    assert shard_rule("layers.14.engram.embed.weight") == shard_rule("layers.1.engram.embed.scale")
    assert shard_rule("layers.14.engram.embed.weight").kind == ENGRAM_ROWS


def test_split_tensor_count(inv):
    # 43 blocks × (wq_b, wo_a, wo_b weight + scale, attn_sink) + 8 indexers × 3 + 4 vocab tensors.
    assert sum(shard_rule(n).kind == SPLIT for n in inv) == 43 * 7 + 8 * 3 + 4


def test_expert_ownership(cfg):
    backbone, dspark = "layers.7.ffn.experts.50.w1.weight", "mtp.1.ffn.experts.20.w1.weight"
    assert routed_expert_count(backbone, cfg) == 384 and routed_expert_count(dspark, cfg) == 128
    assert tuple(rank_slice(backbone, (2304, 2560), 1, 8, n_experts=384)) == (None, 48, 96, 0)
    assert tuple(rank_slice(dspark, (2304, 2560), 1, 8, n_experts=128)) == (None, 16, 32, 0)
    with pytest.raises(ValueError, match="n_experts"):
        rank_slice(backbone, (2304, 2560), 0, 2)


def test_split_slices_tile_the_dim():
    shape = (5120, 8192)
    parts = [rank_slice("layers.0.attn.wo_b.weight", shape, r, 4) for r in range(4)]
    assert [(p.dim, p.start, p.stop) for p in parts] == [(1, r * 2048, (r + 1) * 2048) for r in range(4)]
    assert rank_slice("layers.0.attn.wq_a.weight", (1280, 5120), 3, 4) is None


# docs/CHECKPOINT.md §5: rows per rank and padding of the two Engram tables.
ENGRAM_TABLE = [
    (1, 384_006_168, 0, 384_016_682, 0),
    (2, 192_003_084, 0, 192_008_341, 0),
    (4, 96_001_542, 0, 96_004_171, 2),
    (8, 48_000_771, 0, 48_002_086, 6),
]


@pytest.mark.parametrize("ws, l1_rows, l1_pad, l14_rows, l14_pad", ENGRAM_TABLE)
def test_engram_padding_table(inv, ws, l1_rows, l1_pad, l14_rows, l14_pad):
    for layer, rows, pad in ((1, l1_rows, l1_pad), (14, l14_rows, l14_pad)):
        shape = inv[f"layers.{layer}.engram.embed.weight"].shape
        assert engram_rows_per_rank(shape[0], ws) == (rows, pad)
        last = rank_slice(f"layers.{layer}.engram.embed.scale", shape, ws - 1, ws)
        assert (last.dim, last.start, last.stop - last.start + last.pad, last.pad) == (0, (ws - 1) * rows, rows, pad)
        assert rank_slice(f"layers.{layer}.engram.embed.weight", shape, 0, ws).pad == 0


def test_release_world_sizes(cfg):
    assert allowed_world_sizes(cfg, range(1, 33)) == [1, 2, 4, 8]


def test_world_size_3_names_the_vocab(cfg, inv):
    with pytest.raises(ShardingError, match=r"embed\.weight dim 0 \(129280\).*world size 3"):
        check_world_size(cfg, 3, inv)
    with pytest.raises(ShardingError, match=r"embed\.weight dim 0"):
        rank_slice("embed.weight", (129280, 5120), 0, 3)


def test_world_size_16_names_the_output_groups(cfg, inv):
    # Every split dim divides by 16, but the 8 output groups of wo_a / wo_b cannot be cut in half.
    with pytest.raises(ShardingError, match=r"attn\.wo_a\.weight dim 0 .*o_groups = 8.*16"):
        check_world_size(cfg, 16, inv)


def test_bad_rank():
    with pytest.raises(ShardingError):
        rank_slice("embed.weight", (8, 4), 2, 2)
