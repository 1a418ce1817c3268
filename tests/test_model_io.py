"""Loading and saving whole models in the released layout (docs/CHECKPOINT.md; issue: load as shipped).

Expectations: load(save(model)) is bit-identical; `fast` numerics hold exactly the dequantised stored
values; every way a directory can be wrong gives one error naming the culprit, before a model exists.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dsv41.model import formats
from dsv41.checkpoint import CheckpointDir, CheckpointError, save_checkpoint
from dsv41.checkpoint.model_io import load_model, save_model, stored_tensors
from dsv41.config import RuntimeConfig

from helpers import MAX_SEQ, binding_config, build, token_ids, without_dspark


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build(without_dspark(binding_config()), "reference")
    directory = tmp_path_factory.mktemp("ckpt")
    save_model(model, directory, max_shard_bytes=150_000)
    return model, directory


def _logits(model, ids):
    return model.logits(model(ids, 0, model.new_cache(ids.shape[0], MAX_SEQ)).hidden)


def test_round_trip_is_bit_identical(saved):
    model, directory = saved
    assert len(list(directory.glob("model-*.safetensors"))) > 1          # really sharded
    loaded = load_model(directory, RuntimeConfig(max_seq_len=MAX_SEQ))
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(_bits(a[name]), _bits(b[name])), name
    ids = token_ids(2, 12)
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))


def test_saved_names_and_formats_follow_the_released_layout(saved):
    model, directory = saved
    ckpt = CheckpointDir(directory)
    assert ckpt.spec("layers.0.attn.wq_a.weight").dtype == "F8_E4M3"
    assert ckpt.spec("layers.0.attn.wq_a.scale").dtype == "F8_E8M0"
    assert ckpt.spec("layers.0.attn.wo_a.weight").dtype == "F8_E4M3"          # held bf16, stored fp8
    assert ckpt.spec("layers.2.attn.compressor.wkv.weight").dtype == "BF16"   # held fp32, stored bf16
    assert ckpt.spec("layers.3.ffn.experts.1.w2.weight").dtype == "I8"        # one tensor per expert
    assert ckpt.spec("layers.3.ffn.experts.1.w2.weight").shape == (64, 16)
    assert ckpt.spec("head.weight").dtype == "BF16"
    stacked = model.layers[3].ffn.experts.w2.weight[1]
    assert torch.equal(ckpt.tensor("layers.3.ffn.experts.1.w2.weight"), stacked)


def test_fast_numerics_hold_the_dequantised_stored_values(saved):
    _, directory = saved
    fast = load_model(directory, RuntimeConfig(max_seq_len=MAX_SEQ, numerics="fast", dtype="float32"))
    ckpt = CheckpointDir(directory)
    wq_a = formats.dequantize_fp8_weight(ckpt.tensor("layers.0.attn.wq_a.weight"), ckpt.tensor("layers.0.attn.wq_a.scale"))
    assert fast.layers[0].attn.wq_a.scale is None
    assert torch.equal(fast.layers[0].attn.wq_a.weight, wq_a)
    expert = formats.dequantize_fp4_weight(ckpt.tensor("layers.2.ffn.experts.3.w1.weight"),
                                           ckpt.tensor("layers.2.ffn.experts.3.w1.scale"))
    assert torch.equal(fast.layers[2].ffn.experts.w1.weight[3], expert)


def _rewrite(src, dst, edit):
    """Copy a checkpoint with its tensors passed through `edit(dict) -> dict`."""
    ckpt = CheckpointDir(src)
    tensors = edit({n: ckpt.tensor(n).clone() for n in ckpt.names()})
    save_checkpoint(dst, tensors, max_shard_bytes=150_000)
    shutil.copyfile(src / "config.json", dst / "config.json")
    return dst


def test_missing_unexpected_and_misshaped_tensors_are_listed(saved, tmp_path):
    _, directory = saved

    def edit(t):
        del t["layers.1.attn.wq_b.weight"]
        t["layers.1.attn.bogus"] = torch.zeros(3)
        t["layers.2.attn.attn_sink"] = torch.zeros(5)
        return t

    with pytest.raises(CheckpointError) as err:
        load_model(_rewrite(directory, tmp_path / "bad", edit))
    text = str(err.value)
    assert "layers.1.attn.wq_b.weight" in text and "layers.1.attn.bogus" in text
    assert "layers.2.attn.attn_sink" in text and "1 missing" in text and "1 unexpected" in text


def test_truncated_shard_names_the_file(saved, tmp_path):
    _, directory = saved
    copy = tmp_path / "trunc"
    shutil.copytree(directory, copy)
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(copy)


def test_index_naming_a_missing_shard_names_the_file(saved, tmp_path):
    _, directory = saved
    copy = tmp_path / "partial"
    shutil.copytree(directory, copy)
    victim = sorted(copy.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(copy)


def test_malformed_config_is_a_clear_error(saved, tmp_path):
    _, directory = saved
    copy = tmp_path / "cfg"
    shutil.copytree(directory, copy)
    raw = json.loads((copy / "config.json").read_text())
    raw["compress_ratios"] = raw["compress_ratios"][:-1]
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="compress_ratios"):
        load_model(copy)


def test_every_stored_tensor_comes_from_the_model(saved):
    model, directory = saved
    names = [n for n, _ in stored_tensors(model, model.cfg)]
    assert names == CheckpointDir(directory).names()


def test_engram_tables_can_stay_memory_mapped(demo_dir):
    in_memory = load_model(demo_dir, RuntimeConfig(max_seq_len=MAX_SEQ))
    on_disk = load_model(demo_dir, RuntimeConfig(max_seq_len=MAX_SEQ), engram_on_disk=True)
    table = on_disk.layers[1].engram.embed
    assert not table.movable                                   # stays put when the model moves
    ids = token_ids(1, 10, vocab=in_memory.cfg.vocab_size)
    assert torch.equal(_logits(in_memory, ids), _logits(on_disk, ids))
