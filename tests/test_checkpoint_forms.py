"""Every storage form of the config goes through save → load → forward (docs/ARCHITECTURE.md §2, §6.2;
docs/CHECKPOINT.md §2), and a stored weight in a form its module cannot take is refused, never cast.

Forms: `dtype` ("fp8", "bf16") stores the dense Linears, Engram's wkv included; routed experts are fp4
when `expert_dtype` is "fp4" and otherwise follow `dtype` (the reference's reading of the key). The
expected form of every stored Linear is written out below from that rule, not taken from the inventory.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models

from dsv41.model import formats
from dsv41.checkpoint import CheckpointDir, CheckpointError, save_checkpoint
from dsv41.checkpoint.model_io import load_into, load_model, save_model, stored_tensors, to_module_format
from dsv41.config import RuntimeConfig
from dsv41.model.engram import build_token_map
from dsv41.model.engram.hashing import table_rows
from dsv41.model import Transformer

import helpers

FORMS = [(dtype, expert) for dtype in ("fp8", "bf16") for expert in ("fp4", "fp8", "bf16", None)]
RUNTIMES = {"reference": RuntimeConfig(max_seq_len=helpers.MAX_SEQ, numerics="reference", dtype="bfloat16"),
            "fast": RuntimeConfig(max_seq_len=helpers.MAX_SEQ, numerics="fast", dtype="float32")}
VOCAB = 256
# One Engram layer before layer 1 with small tables (hash vocab 101, 2 heads, 2- and 3-grams).
ENGRAM = dict(engram_layer_ids=(1,), engram_vocab_size=101, engram_num_embeddings=table_rows(1, 3, 2, 101),
              engram_max_ngram_size=3, engram_pad_id=2, engram_compressed_vocab_size=VOCAB, engram_n_heads=2,
              engram_head_dim=32)

# Linears whose storage is fixed whatever the config says (docs/CHECKPOINT.md §3.3: compressor, indexer
# weights_proj / wk, router, DSpark confidence head are bf16; the Engram table is fp8 rows).
ALWAYS_BF16 = re.compile(r"\.(compressor\.w\w+|indexer\.weights_proj|indexer\.wk|ffn\.gate|confidence_head\.proj)$")
ALWAYS_FP8 = re.compile(r"\.engram\.embed$")
DENSE = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]|engram\.wkv|main_proj)$")
EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]$")


def expected_form(path: str, dtype: str, expert_dtype: str | None) -> str | None:
    """The reference's rule; None for tensors that are not Linears (norms, embeddings, bare parameters)."""
    dense = "fp8" if dtype == "fp8" else "bf16"
    if EXPERT.search(path):
        return "fp4" if expert_dtype == "fp4" else dense
    if ALWAYS_BF16.search(path):
        return "bf16"
    if ALWAYS_FP8.search(path):
        return "fp8"
    return dense if DENSE.search(path) else None


def stored_form(ckpt: CheckpointDir, path: str) -> str:
    weight, scale = ckpt.spec(f"{path}.weight"), f"{path}.scale"
    if scale not in ckpt:
        return {"BF16": "bf16", "F32": "f32"}.get(weight.dtype, f"{weight.dtype} without a scale")
    assert ckpt.spec(scale).dtype == "F8_E8M0", scale
    return {"I8": "fp4", "F8_E4M3": "fp8"}.get(weight.dtype, f"{weight.dtype} with a scale")


def form_config(dtype: str, expert_dtype: str | None):
    """The tiny nonbinding model (every layer role, two DSpark stages) with 2 experts and Engram."""
    return helpers.nonbinding_config(dtype=dtype, expert_dtype=expert_dtype, n_routed_experts=2,
                                     n_activated_experts=2, dspark_n_routed_experts=2,
                                     dspark_n_activated_experts=2, **ENGRAM)


def stored_values(ckpt: CheckpointDir, name: str) -> torch.Tensor:
    """The values a stored tensor stands for: a quantised weight with its scale, anything else its bits.

    Re-quantising may pick a smaller power-of-two scale than the one the values were first stored
    with (the block's largest value rounded down), so codes and scales may differ where values do not.
    """
    spec, scale = ckpt.spec(name), name[: -len("weight")] + "scale"
    if ".engram.embed." in name:                      # held as stored in every numerics: same bits
        return _bits(ckpt.tensor(name))
    if name.endswith(".scale") and name[: -len("scale")] + "weight" in ckpt:
        return torch.empty(0)
    if spec.dtype == "I8":
        return formats.dequantize_fp4_weight(ckpt.tensor(name), ckpt.tensor(scale))
    if spec.dtype == "F8_E4M3":
        return formats.dequantize_fp8_weight(ckpt.tensor(name), ckpt.tensor(scale))
    return _bits(ckpt.tensor(name))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(_bits(sa[name]), _bits(sb[name])), name


def logits(model, ids):
    return model.logits(model(ids, 0, model.new_cache(ids.shape[0], helpers.MAX_SEQ)).hidden)


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A word-level tokenizer of VOCAB distinct tokens: its Engram token map is the identity."""
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer_json):
    """(random reference-numerics model, its saved directory) per form, made on first use."""
    token_map = build_token_map(Tokenizer.from_file(str(tokenizer_json)))
    made = {}

    def get(dtype, expert_dtype):
        if (dtype, expert_dtype) not in made:
            model = helpers.build(form_config(dtype, expert_dtype), "reference")
            model.set_token_map(token_map)
            directory = tmp_path_factory.mktemp(f"{dtype}-{expert_dtype}")
            made[dtype, expert_dtype] = model, save_model(model, directory, tokenizer=tokenizer_json,
                                                          max_shard_bytes=200_000)
        return made[dtype, expert_dtype]
    return get


# ---------------------------------------------------------------------------------------- every form
@pytest.mark.parametrize("dtype,expert_dtype", FORMS)
def test_saved_tensors_have_the_storage_the_rule_implies(saved, dtype, expert_dtype):
    _, directory = saved(dtype, expert_dtype)
    ckpt = CheckpointDir(directory)
    names = set(ckpt.names())
    for name in names:
        if name.endswith(".scale"):                           # every scale belongs to a weight
            assert name[: -len("scale")] + "weight" in names, name
    paths = {n[: -len(".weight")] for n in names if n.endswith(".weight")}
    checked = set()
    for path in paths:
        want = expected_form(path, dtype, expert_dtype)
        if want is None:
            assert f"{path}.scale" not in names and ckpt.spec(f"{path}.weight").dtype in ("BF16", "F32"), path
            continue
        assert stored_form(ckpt, path) == want, (path, want)
        checked.add(path)
    # each family of the rule was really met, DSpark and Engram included
    for path in ("layers.1.engram.wkv", "layers.1.engram.embed", "layers.3.ffn.experts.1.w1",
                 "mtp.1.ffn.experts.1.w2", "mtp.0.main_proj", "layers.0.ffn.shared_experts.w2",
                 "layers.6.attn.indexer.wq_b", "layers.2.attn.compressor.wgate"):
        assert path in checked, path


@pytest.mark.parametrize("numerics", ["reference", "fast"])
@pytest.mark.parametrize("dtype,expert_dtype", FORMS)
def test_save_load_forward_is_bit_identical(saved, tmp_path, dtype, expert_dtype, numerics):
    model, directory = saved(dtype, expert_dtype)
    if numerics == "fast":
        # The fast model comes from the checkpoint, so saving it again must store the same values.
        model = load_model(directory, RUNTIMES["fast"])
        directory = save_model(model, tmp_path / "again", tokenizer=directory / "tokenizer.json",
                               max_shard_bytes=200_000)
        first, again = CheckpointDir(saved(dtype, expert_dtype)[1]), CheckpointDir(directory)
        assert first.names() == again.names()
        for name in first.names():
            assert torch.equal(stored_values(first, name), stored_values(again, name)), name
    loaded = load_model(directory, RUNTIMES[numerics])
    assert_same_state(model, loaded)
    ids = helpers.token_ids(1, 6, VOCAB)
    expected = logits(model, ids)
    assert torch.isfinite(expected).all()
    assert torch.equal(logits(loaded, ids), expected)


# ---------------------------------------------------------------------------------------- refusals
def _rewrite(src, dst, edit):
    """A copy of a saved model whose tensors went through `edit(dict) -> dict` (shards and index rewritten)."""
    ckpt = CheckpointDir(src)
    save_checkpoint(dst, edit({n: ckpt.tensor(n).clone() for n in ckpt.names()}), max_shard_bytes=200_000)
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(src / name, dst / name)
    return dst


def _load_into_meta(directory, model_form, numerics="reference"):
    """Run the loader's own checks (no inventory validation first) on a model of `model_form`."""
    model = Transformer(form_config(*model_form), RUNTIMES[numerics], device="meta")
    with pytest.raises(CheckpointError) as err:
        load_into(model, CheckpointDir(directory))
    assert all(t.is_meta for t in model.state_dict().values())       # refused before reading anything
    return str(err.value)


@pytest.fixture()
def fp8_fp4(saved):
    return saved("fp8", "fp4")[1]


def test_missing_scale_is_named_by_validation_and_by_the_loader(fp8_fp4, tmp_path):
    def edit(t):
        del t["layers.0.attn.wq_a.scale"], t["layers.3.ffn.experts.1.w1.scale"]
        return t

    directory = _rewrite(fp8_fp4, tmp_path / "noscale", edit)
    with pytest.raises(CheckpointError, match=r"(?s)2 missing.*layers\.0\.attn\.wq_a\.scale"):
        load_model(directory)
    for numerics in ("reference", "fast"):                  # fast would dequantise: still needs the scale
        text = _load_into_meta(directory, ("fp8", "fp4"), numerics)
        assert "layers.0.attn.wq_a.weight is F8_E4M3 but its scale layers.0.attn.wq_a.scale is missing" in text
        assert "layers.3.ffn.experts.1.w1.weight is I8 but its scale layers.3.ffn.experts.1.w1.scale is missing" in text


def test_weight_of_the_wrong_dtype_is_named_by_validation_and_by_the_loader(fp8_fp4, tmp_path):
    def edit(t):
        w = t["layers.0.attn.wq_a.weight"]
        t["layers.0.attn.wq_a.weight"] = formats.dequantize_fp8_weight(w, t.pop("layers.0.attn.wq_a.scale")).bfloat16()
        t["layers.0.attn.wq_b.weight"] = t["layers.0.attn.wq_b.weight"].float().bfloat16()   # scale kept
        return t

    directory = _rewrite(fp8_fp4, tmp_path / "retyped", edit)
    with pytest.raises(CheckpointError) as err:
        load_model(directory)
    assert "layers.0.attn.wq_a.weight is BF16, expected F8_E4M3" in str(err.value)
    assert "layers.0.attn.wq_b.weight is BF16, expected F8_E4M3" in str(err.value)
    text = _load_into_meta(directory, ("fp8", "fp4"))
    assert ("layers.0.attn.wq_a.weight is BF16 without a scale; the model holds it quantised as "
            "torch.float8_e4m3fn + scale") in text
    assert "layers.0.attn.wq_b.weight is BF16, not quantised, but has a scale layers.0.attn.wq_b.scale" in text


@pytest.mark.parametrize("stored,held,fragment", [
    # a bf16 checkpoint into fp8 modules: once the "Cannot copy out of meta tensor" crash
    (("bf16", "bf16"), ("fp8", "fp4"), "layers.0.attn.wq_a.weight is BF16 without a scale; the model holds it "
                                       "quantised as torch.float8_e4m3fn + scale"),
    (("fp8", "fp8"), ("fp8", "fp4"), "layers.0.ffn.experts.0.w1.weight is F8_E4M3; the model holds it "
                                     "quantised as torch.int8 + scale"),
], ids=["bf16-into-fp8", "fp8-experts-into-fp4"])
def test_checkpoint_of_another_form_is_refused_not_cast(saved, stored, held, fragment):
    assert fragment in _load_into_meta(saved(*stored)[1], held)


def test_conversion_never_casts_code_values():
    e4m3 = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs its scale"):
        to_module_format(e4m3, None, torch.empty(4, 4))
    with pytest.raises(ValueError, match="cannot become a quantised"):
        to_module_format(torch.zeros(4, 4, dtype=torch.bfloat16), None, e4m3)
    assert to_module_format(torch.ones(2, dtype=torch.bfloat16), None, torch.empty(2)).dtype == torch.float32


def test_saving_a_model_whose_form_the_layout_does_not_name_is_refused(saved):
    model, _ = saved("fp8", "fp4")
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight: the model holds it quantised"):
        list(stored_tensors(model, form_config("bf16", "fp4")))
