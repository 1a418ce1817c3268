"""ModelConfig mirrors the released inference/config.json key for key and rejects malformed configs with a
message naming the key and the rule (docs/ARCHITECTURE.md §2); RuntimeConfig holds the runtime limits."""

import json

import pytest

from dsv41.config import ConfigError, ModelConfig, RuntimeConfig
from dsv41.model.layers import dense_storage, expert_storage

import helpers


@pytest.fixture(scope="module")
def raw():
    return json.loads(helpers.RELEASED_CONFIG.read_text())


def broken(raw, **changes):
    out = dict(raw)
    out.update(changes)
    return out


def expect_error(raw_dict, *fragments):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(raw_dict)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ------------------------------------------------------------------------------------------ loading

def test_released_config_round_trips_every_key(raw):
    cfg = ModelConfig.from_json(helpers.RELEASED_CONFIG)
    out = cfg.to_dict()
    assert set(raw) <= set(out)
    for key, value in raw.items():
        assert out[key] == value, key
        assert type(out[key]) is type(value) or isinstance(value, int) and isinstance(out[key], float), key
    # through JSON and back: the same config
    assert ModelConfig.from_dict(json.loads(json.dumps(out))) == cfg
    # the only key added is the reference default the JSON does not set (§2)
    assert set(out) - set(raw) == {"gate_temp"} and out["gate_temp"] == 1.0


def test_released_values_as_the_spec_tables_state(raw):
    cfg = ModelConfig.from_dict(raw)
    assert cfg.n_all_layers == 43 and len(cfg.compress_ratios) == 43
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert cfg.norm_eps == 1e-20 and cfg.hc_eps == 1e-6
    assert cfg.vision_max_wh_ratio is None
    # derived sizes (§2, [derived])
    assert cfg.n_heads * cfg.head_dim == 32768 and cfg.group_width == 4096
    assert cfg.o_groups * cfg.o_lora_rank == 8192 and cfg.hc_mix_width == 24
    assert cfg.engram_hash_columns == 24
    assert sum(cfg.engram_num_embeddings) == 384006168 + 384016682


def test_from_json_accepts_a_directory(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_json(tmp_path) == ModelConfig.from_dict(raw)


def test_from_json_reports_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_json(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(bad)


# ------------------------------------------------------------------------------------------ malformed

def test_compress_ratios_of_the_wrong_length(raw):
    expect_error(broken(raw, compress_ratios=raw["compress_ratios"][:40]),
                 "compress_ratios", "40 entries", "n_layers + n_mtp_layers", "43")


def test_kv_source_that_does_not_exist(raw):
    expect_error(broken(raw, kv_source_layers=[2, 8, 14, 20, 45]), "kv_source_layers", "45", "does not exist")


def test_kv_source_with_ratio_zero(raw):
    expect_error(broken(raw, kv_source_layers=[1, 2, 8, 14, 20]), "kv_source_layers", "layer 1",
                 "compress ratio is 0")


def test_heads_not_divisible_by_groups(raw):
    expect_error(broken(raw, o_groups=7), "n_heads", "o_groups", "divisible")


def test_unknown_key(raw):
    expect_error(broken(raw, num_nextn_predict_layers=3), "unknown config keys", "num_nextn_predict_layers")


@pytest.mark.parametrize("key,value,rule", [
    ("dim", "5120", "must be an integer"),
    ("dim", 5120.0, "must be an integer"),
    ("n_heads", True, "must be an integer"),
    ("route_scale", "1.5", "must be a number"),
    ("compress_ratios", [0, 0.5], "must be a list of integers"),
    ("kv_source_layers", 2, "must be a list of integers"),
    ("score_func", 1, "must be a string"),
    ("candidate_source_layer", "20", "must be an integer or null"),
])
def test_wrong_type(raw, key, value, rule):
    expect_error(broken(raw, **{key: value}), key, rule)


def test_missing_required_key(raw):
    partial = {k: v for k, v in raw.items() if k != "dim"}
    expect_error(partial, "missing config keys", "dim")


def test_missing_defaulted_key_in_a_released_style_file(raw):
    partial = {k: v for k, v in raw.items() if k != "rope_factor"}
    expect_error(partial, "rope_factor")


def test_candidate_source_must_be_a_kv_source(raw):
    expect_error(broken(raw, candidate_source_layer=24), "candidate_source_layer", "24", "kv_source_layers")


def test_kv_source_must_also_index(raw):
    expect_error(broken(raw, index_source_layers=[8, 14, 20, 24, 28, 32, 36]), "kv_source_layers", "layer 2",
                 "index_source_layers")


def test_consumer_ratio_must_match_its_source(raw):
    ratios = list(raw["compress_ratios"])
    ratios[21] = 2
    expect_error(broken(raw, compress_ratios=ratios), "layer 21", "ratio 2", "layer 20")


def test_dspark_stages_are_window_only(raw):
    ratios = list(raw["compress_ratios"])
    ratios[41] = 1
    expect_error(broken(raw, compress_ratios=ratios), "compress_ratios", "DSpark")


def test_expert_dtype_null_is_accepted(raw):
    cfg = ModelConfig.from_dict(broken(raw, expert_dtype=None))
    assert cfg.expert_dtype is None and cfg.to_dict()["expert_dtype"] is None
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("value,rule", [(4, "must be a string or null"), ("int4", "'fp4', 'fp8', 'bf16' or null")])
def test_expert_dtype_of_the_wrong_type_or_unknown(raw, value, rule):
    expect_error(broken(raw, expert_dtype=value), "expert_dtype", rule)


@pytest.mark.parametrize("dtype,expert_dtype,experts", [
    ("fp8", "fp4", "fp4"), ("fp8", "fp8", "fp8"), ("fp8", "bf16", "fp8"), ("fp8", None, "fp8"),
    ("bf16", "fp4", "fp4"), ("bf16", "fp8", "bf16"), ("bf16", "bf16", "bf16"), ("bf16", None, "bf16"),
])
def test_experts_are_fp4_when_expert_dtype_says_so_else_follow_dtype(dtype, expert_dtype, experts):
    # the reference's reading of the keys (docs/ARCHITECTURE.md §2): only "fp4" makes experts differ from dtype
    cfg = helpers.nonbinding_config(dtype=dtype, expert_dtype=expert_dtype)
    assert expert_storage(cfg) == experts
    assert dense_storage(cfg) == dtype


def test_tiny_test_configs_are_valid():
    for cfg in (helpers.nonbinding_config(), helpers.binding_config(),
                helpers.without_dspark(helpers.nonbinding_config())):
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------------------------------------ runtime

def test_runtime_defaults_are_the_reference_numerics():
    rt = RuntimeConfig()
    assert rt.numerics == "reference" and rt.dtype == "bfloat16" and not rt.stale_index_keys
    assert str(rt.torch_dtype) == "torch.bfloat16"


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(numerics="turbo"), "numerics"),
    (dict(dtype="float16"), "dtype"),
    (dict(numerics="reference", dtype="float32"), "numerics='reference'"),
    (dict(max_seq_len=0), "max_seq_len"),
    (dict(max_batch_size=-1), "max_batch_size"),
])
def test_runtime_errors(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RuntimeConfig(**kwargs)
