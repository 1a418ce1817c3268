"""A small config end to end: inventory -> random checkpoint on disk -> CheckpointDir -> TP slices."""


import pytest
import torch

from dsv41.checkpoint import (SPLIT, CheckpointDir, CheckpointError, allowed_world_sizes, rank_slice,
                              released_inventory, routed_expert_count, save_checkpoint, shard_rule, torch_dtype)
from dsv41.config import RELEASED_CONFIG, ModelConfig

CONFIG = RELEASED_CONFIG


def small_config() -> ModelConfig:
    """4 layers (window, pooled KV source, token KV source + candidate source, re-indexing), Engram before
    layer 1, two DSpark stages, a 2-block ViT; head_dim 48 and wo_a's 96 inputs exercise ⌈·/32⌉ scales."""
    return ModelConfig.from_json(CONFIG).replace(
        vocab_size=512, dim=64, moe_inter_dim=32, n_layers=4, n_mtp_layers=2, n_heads=4, head_dim=48,
        rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, n_routed_experts=8, n_activated_experts=2,
        compress_ratios=(0, 2, 1, 1, 0, 0), kv_source_layers=(1, 2), index_source_layers=(1, 2, 3),
        candidate_source_layer=2, index_n_heads=4, index_head_dim=16, index_topk=8, candidate_topk_blocks=4,
        candidate_block_size=2, engram_layer_ids=(1,), engram_num_embeddings=(1001,), engram_n_heads=2,
        engram_head_dim=32, engram_max_ngram_size=3, dspark_target_layer_ids=(2, 3), dspark_markov_rank=16,
        dspark_n_routed_experts=4, dspark_n_activated_experts=2, dspark_noise_token_id=7, vision_n_layers=2,
        vision_dim=32, vision_n_heads=2, vision_inter_dim=48, vision_patch_size=2, vision_downsample_ratio=2,
        image_token_id=500)


def ceil32(n):
    return -(-n // 32)


def random_tensor(spec, seed):
    itemsize = torch.empty((), dtype=torch_dtype(spec.dtype)).element_size()
    raw = torch.randint(0, 256, (spec.numel * itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    return raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)


@pytest.fixture(scope="module")
def cfg():
    return small_config()


@pytest.fixture(scope="module")
def inv(cfg):
    return released_inventory(cfg)


@pytest.fixture(scope="module")
def written(tmp_path_factory, inv):
    tensors = {name: random_tensor(spec, seed) for seed, (name, spec) in enumerate(inv.items())}
    directory = tmp_path_factory.mktemp("small")
    save_checkpoint(directory, tensors, max_shard_bytes=64 * 1024)
    return directory, tensors


def test_small_inventory_count(cfg, inv):
    per_block = 30  # non-expert names of every block, bias_vl included (vision build)
    backbone = 4 * (per_block + 6 * 8) + (2 + 1) + 2 + (3 + 2) * 2 + 3 + 6  # compressors, indexers, Engram
    dspark = 2 * (per_block + 6 * 4) + 3 + 4
    vision = 3 + 4 + 3 + 8 * 2
    assert len(inv) == 3 + backbone + dspark + vision


def test_small_scale_shapes_use_ceil(inv):
    assert inv["layers.0.attn.wkv.weight"].shape == (48, 64)
    assert inv["layers.0.attn.wkv.scale"].shape == (ceil32(48), ceil32(64)) == (2, 2)
    assert inv["layers.0.attn.wo_a.scale"].shape == (ceil32(2 * 32), ceil32(4 * 48 // 2)) == (2, 3)
    assert inv["layers.1.engram.wkv.scale"].shape == (ceil32(5 * 64), ceil32(2 * 2 * 32))
    assert inv["layers.1.engram.embed.scale"].shape == (1001, 1)
    assert inv["layers.3.ffn.experts.7.w2.weight"].shape == (64, 16)
    assert inv["mtp.0.main_proj.weight"].shape == (64, 2 * 64)
    assert inv["mtp.1.confidence_head.proj.weight"].shape == (1, 64 + 16)


def test_small_roles(inv):
    assert "layers.1.attn.compressor.wgate.weight" in inv and "layers.2.attn.compressor.wgate.weight" not in inv
    assert "layers.2.attn.indexer.wk.weight" in inv and "layers.3.attn.indexer.wk.weight" not in inv
    assert "layers.3.attn.indexer.weights_proj.weight" in inv and "layers.0.attn.indexer.wq_b.weight" not in inv
    assert "mtp.1.markov_head.embed.weight" in inv and "mtp.0.markov_head.embed.weight" not in inv


def test_small_checkpoint_round_trip(written, inv):
    directory, tensors = written
    ckpt = CheckpointDir(directory)
    ckpt.validate_against(inv)
    assert len({ckpt.file_of(n) for n in ckpt.names()}) > 3
    for name, t in tensors.items():
        got = ckpt.tensor(name)
        assert got.dtype == t.dtype and torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_small_checkpoint_missing_tensor_is_reported(tmp_path, written, cfg, inv):
    _, tensors = written
    partial = {n: t for n, t in tensors.items() if n != "layers.2.attn.indexer.wk.weight"}
    save_checkpoint(tmp_path, partial, max_shard_bytes=1 << 20)
    with pytest.raises(CheckpointError, match=r"(?s)1 missing.*layers\.2\.attn\.indexer\.wk\.weight"):
        CheckpointDir(tmp_path).validate_against(inv)


def test_small_world_sizes(cfg):
    assert allowed_world_sizes(cfg, range(1, 9)) == [1, 2]  # 2 output groups, 4 DSpark experts, ...


def test_tp2_slices_read_from_disk_tile_every_tensor(written, cfg, inv):
    directory, tensors = written
    ckpt = CheckpointDir(directory)
    ws = 2
    for name, spec in inv.items():
        parts = [rank_slice(name, spec.shape, r, ws, n_experts=routed_expert_count(name, cfg)) for r in range(ws)]
        if parts[0] is None:
            continue
        if parts[0].dim is None:  # experts: the ranks' ranges partition the expert indices
            assert [(p.start, p.stop) for p in parts] == [(0, routed_expert_count(name, cfg) // 2),
                                                          (routed_expert_count(name, cfg) // 2,
                                                           routed_expert_count(name, cfg))]
            continue
        pieces = [ckpt.tensor(name, slice_dim=p.dim, start=p.start, stop=p.stop) for p in parts]
        whole = torch.cat([x.view(torch.uint8) for x in pieces], dim=parts[0].dim)
        assert torch.equal(whole, tensors[name].view(torch.uint8)), name
        held = [p.stop - p.start + p.pad for p in parts]
        assert held[0] == held[1], name
    # The odd-sized Engram table: ⌈1001/2⌉ = 501 rows each, the last rank pads one.
    last = rank_slice("layers.1.engram.embed.weight", (1001, 32), 1, 2)
    assert (last.start, last.stop, last.pad) == (501, 1001, 1)
    assert sum(shard_rule(n).kind == SPLIT for n in inv) == 6 * 7 + 3 * 3 + 4
