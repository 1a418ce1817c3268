"""The released inventory against the figures and tables of docs/CHECKPOINT.md §3–§4."""


import pytest

from dsv41.checkpoint import inventory_bytes, released_inventory
from dsv41.config import RELEASED_CONFIG

CONFIG = RELEASED_CONFIG


@pytest.fixture
def cfg(released_cfg):
    return released_cfg


@pytest.fixture
def inv(released_inv):
    return released_inv


def _bytes(inv, predicate):
    return sum(s.nbytes for s in inv.values() if predicate(s.name))


def test_release_count_and_total_bytes(inv):
    # docs/CHECKPOINT.md §1 / §3.5: weight_map size and metadata.total_size of the released index.
    assert len(inv) == 96_085
    assert inventory_bytes(inv) == 510_286_023_000


def test_family_counts_follow_section_3_5(inv):
    names = list(inv)
    vision = [n for n in names if n.startswith("vision.")]
    layers = [n for n in names if n.startswith("layers.")]
    mtp = [n for n in names if n.startswith("mtp.")]
    assert len(vision) == 259
    assert len(names) - len(vision) - len(layers) - len(mtp) == 10  # globals incl. aligner and image_*
    assert len([n for n in layers if ".compressor." in n]) == 11
    assert len([n for n in layers if ".indexer." in n]) == 32
    assert len([n for n in layers if ".engram." in n]) == 12
    assert len(layers) == 40 * 2_334 + 11 + 32 + 12
    assert len(mtp) == 3 * (30 + 128 * 6) + 3 + 4 == 2_401


def test_family_bytes_follow_section_4(inv):
    is_expert = lambda n: ".ffn.experts." in n  # noqa: E731
    assert _bytes(inv, lambda n: n.startswith("layers.") and is_expert(n)) == 288_777_830_400
    assert _bytes(inv, lambda n: n.startswith("layers.2.ffn.experts.")) == 7_219_445_760
    assert _bytes(inv, lambda n: n.startswith("layers.5.ffn.experts.17.")) == 18_800_640
    assert _bytes(inv, lambda n: ".engram.embed." in n) == 202_758_032_400
    assert _bytes(inv, lambda n: ".engram." in n and ".engram.embed." not in n) == 315_043_840
    # Layer 0 has only the 30 shared non-expert tensors.
    assert _bytes(inv, lambda n: n.startswith("layers.0.") and not is_expert(n)) == 170_055_128
    assert _bytes(inv, lambda n: n.startswith("mtp.")) == 7_932_874_632
    assert _bytes(inv, lambda n: n.startswith("vision.")) == 823_685_120
    assert _bytes(inv, lambda n: n.startswith("aligner.")) == 146_821_120
    assert _bytes(inv, lambda n: n.startswith("layers.") and ".indexer." in n) == 45_130_752
    assert _bytes(inv, lambda n: ".compressor." in n) == 36_704_256
    assert _bytes(inv, lambda n: n == "norm.weight" or n.startswith("image_")) == 40_960


@pytest.mark.parametrize("name, dtype, shape", [
    ("embed.weight", "BF16", (129280, 5120)),
    ("image_newline", "BF16", (5120,)),
    ("aligner.w1.weight", "BF16", (5120, 9216)),
    ("vision.patch_embed.proj.weight", "BF16", (1024, 588)),
    ("vision.blocks.31.mlp.w1.weight", "BF16", (5632, 1024)),
    ("vision.blocks.0.mlp.w2.weight", "BF16", (1024, 2816)),
    ("layers.0.attn.wq_b.weight", "F8_E4M3", (32768, 1280)),
    ("layers.0.attn.wq_b.scale", "F8_E8M0", (1024, 40)),
    ("layers.39.attn.wo_a.scale", "F8_E8M0", (256, 128)),
    ("layers.7.attn.attn_sink", "F32", (64,)),
    ("layers.7.hc_ffn_fn", "F32", (24, 20480)),
    ("layers.7.hc_ffn_scale", "F32", (3,)),
    ("layers.7.ffn.gate.bias_vl", "F32", (384,)),
    ("layers.7.ffn.shared_experts.w2.scale", "F8_E8M0", (160, 72)),
    ("layers.2.ffn.experts.7.w2.weight", "I8", (5120, 1152)),
    ("layers.2.ffn.experts.383.w1.weight", "I8", (2304, 2560)),
    ("layers.2.ffn.experts.7.w1.scale", "F8_E8M0", (2304, 160)),
    ("layers.14.attn.compressor.wgate.weight", "BF16", (512, 5120)),
    ("layers.20.attn.compressor.wkv.weight", "BF16", (512, 5120)),
    ("layers.20.attn.indexer.wk.weight", "BF16", (128, 512)),
    ("layers.36.attn.indexer.wq_b.scale", "F8_E8M0", (128, 40)),
    ("layers.36.attn.indexer.weights_proj.weight", "BF16", (32, 5120)),
    ("layers.1.engram.embed.weight", "F8_E4M3", (384006168, 256)),
    ("layers.14.engram.embed.weight", "F8_E4M3", (384016682, 256)),
    ("layers.14.engram.embed.scale", "F8_E8M0", (384016682, 8)),
    ("layers.14.engram.wkv.weight", "F8_E4M3", (25600, 6144)),
    ("layers.14.engram.wkv.scale", "F8_E8M0", (800, 192)),
    ("layers.1.engram.q_weight", "BF16", (4, 5120)),
    ("mtp.1.ffn.gate.weight", "BF16", (128, 5120)),
    ("mtp.1.ffn.experts.127.w3.weight", "I8", (2304, 2560)),
    ("mtp.0.main_proj.weight", "F8_E4M3", (5120, 15360)),
    ("mtp.0.main_proj.scale", "F8_E8M0", (160, 480)),
    ("mtp.2.markov_head.head.weight", "BF16", (129280, 256)),
    ("mtp.2.confidence_head.proj.weight", "BF16", (1, 5376)),
])
def test_release_shapes_from_spec_tables(inv, name, dtype, shape):
    assert inv[name].dtype == dtype and inv[name].shape == shape


@pytest.mark.parametrize("name", [
    "layers.24.attn.indexer.wk.weight",        # index source without its own keys
    "layers.24.attn.indexer.k_norm.weight",
    "layers.24.attn.compressor.wkv.weight",     # not a KV source
    "layers.20.attn.compressor.wgate.weight",   # ratio 1: no gate
    "layers.0.attn.indexer.wq_b.weight",        # window layer
    "layers.2.engram.embed.weight",
    "layers.2.ffn.experts.384.w1.weight",
    "mtp.0.ffn.experts.128.w1.weight",
    "mtp.0.attn.compressor.wkv.weight",
    "mtp.1.main_proj.weight",                   # stage-0 only
    "mtp.0.markov_head.embed.weight",           # last stage only
    "mtp.0.embed.weight",                       # tied to the backbone
    "mtp.2.head.weight",
])
def test_release_absent_names(inv, name):
    assert name not in inv


def test_text_only_build_drops_vision_and_bias_vl(cfg, inv):
    text = released_inventory(cfg.replace(vision_n_layers=0))
    assert not any(n.startswith(("vision.", "aligner.", "image_")) for n in text)
    assert "layers.0.ffn.gate.bias_vl" not in text and "mtp.0.ffn.gate.bias_vl" not in text
    # 259 vision + 4 aligner + 3 image vectors + one bias_vl per MoE (40 backbone + 3 DSpark).
    assert len(inv) - len(text) == 259 + 4 + 3 + 43


def test_no_dspark_stages_when_disabled(cfg):
    assert not any(n.startswith("mtp.") for n in released_inventory(cfg.replace(dspark_block_size=0)))


def test_storage_dtypes_follow_config(cfg):
    bf16 = released_inventory(cfg.replace(dtype="bf16", expert_dtype="bf16"))
    assert bf16["layers.0.attn.wq_a.weight"].dtype == "BF16" and "layers.0.attn.wq_a.scale" not in bf16
    assert bf16["layers.0.ffn.experts.0.w2.weight"].shape == (5120, 2304)
    assert "layers.0.ffn.experts.0.w2.scale" not in bf16
    assert bf16["layers.1.engram.embed.weight"].dtype == "F8_E4M3"  # the table is always fp8 rows
    fp8 = released_inventory(cfg.replace(expert_dtype="fp8"))
    assert fp8["layers.0.ffn.experts.0.w2.weight"].dtype == "F8_E4M3"
    assert fp8["layers.0.ffn.experts.0.w2.scale"].shape == (5120 // 32, 2304 // 32)
