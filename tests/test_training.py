"""Training: the loop learns, resumes bit for bit, balances experts, and writes checkpoints the loader reads.

A tiny V4.1 model (the demo's layer roles at dim 64, 6 blocks) on a few sentences; the demo's
tokenizer. Expectations are independent of the code under test: the schedule's formula, exact
equality of resumed and uninterrupted states, the perplexity the normal loader's inference forward
gives for the written checkpoint, the memorised text itself.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dsv41.cli import main
from dsv41.config import ModelConfig
from dsv41.demo import demo_config_dict, train_tokenizer
from dsv41.model.engram import build_token_map
from dsv41.tokenizer import Tokenizer, save_tokenizer
from dsv41.training.data import TokenData, encode_documents, unigram_perplexity
from dsv41.training.model import TrainingModel
from dsv41.training.objective import evaluate
from dsv41.training.report import checkpoint_perplexity
from dsv41.training.trainer import Trainer, TrainingError, TrainSettings

SENTENCES = ("The quick brown fox jumps over the lazy dog. Hello, world! How are you today? "
             "I am fine, thank you. Paris is the capital of France. ")


def tiny_config(vocab_size: int, compressed: int) -> ModelConfig:
    d = demo_config_dict(vocab_size, compressed)
    d.update(dim=64, moe_inter_dim=32, n_layers=6, n_heads=4, head_dim=32, rope_head_dim=16, q_lora_rank=32,
             o_groups=2, o_lora_rank=16, compress_ratios=[0, 0, 2, 1, 1, 0, 0, 0], kv_source_layers=[2, 3],
             index_source_layers=[2, 3, 4], candidate_source_layer=3, index_topk=8, window_size=8,
             dspark_target_layer_ids=[3, 4, 5], engram_layer_ids=[1, 3], index_n_heads=2, index_head_dim=32,
             dspark_markov_rank=16)
    return ModelConfig.from_dict(d)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    backend = train_tokenizer()
    tokenizer = Tokenizer(backend)
    token_map = build_token_map(backend)
    cfg = tiny_config(backend.get_vocab_size(), int(token_map.max()) + 1)
    stream = encode_documents(tokenizer, [SENTENCES * 6])
    data = TokenData.split(stream, tokenizer.bos_id, 0.2, 24)
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(backend, folder)
    return cfg, token_map, data, folder


def settings(**kw) -> TrainSettings:
    base = dict(steps=4, batch_size=4, seq_len=24, lr=3e-3, warmup=2, eval_every=2, save_every=2, eval_sequences=4)
    return TrainSettings(**{**base, **kw})


def test_learning_rate_is_warmup_then_cosine():
    s = TrainSettings(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert [s.learning_rate(i) for i in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert s.learning_rate(10) == pytest.approx(1.0)
    assert s.learning_rate(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.learning_rate(110) == pytest.approx(0.1)


def test_tiny_model_overfits_a_few_sentences(setup):
    cfg, token_map, data, _ = setup
    model = TrainingModel.create(cfg, token_map, max_seq_len=24, seed=1)
    train = TokenData(data.train, data.train, data.bos_id)          # evaluate on what it trains on
    trainer = Trainer(model, train, settings(steps=60, warmup=5, lr=1e-2, eval_every=60, save_every=1000),
                      "/nonexistent", progress=False)
    before = trainer.evaluate()["lm"]
    for _ in range(60):
        figures = trainer.train_step()
    after = trainer.evaluate()
    assert before > 5.0 and after["lm"] < 0.5, (before, after["lm"])
    assert figures["draft"] < figures["lm"] + 4.0        # the draft stages learn too
    # the memorised text comes back through the inference forward
    t = model.transformer
    seq = train.evaluation(24, 1)
    out = t(seq, 0, t.new_cache(1, 24))
    assert (t.logits(out.hidden[:, :-1]).argmax(-1) == seq[:, 1:]).float().mean() > 0.9


def test_resume_continues_bit_for_bit(setup, tmp_path):
    cfg, token_map, data, _ = setup
    s = settings(steps=4, save_every=2)
    straight = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=2), data, s, tmp_path / "a",
                       progress=False)
    straight.run()
    first = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=2), data, s, tmp_path / "b",
                    progress=False)
    first.run(until=2)                                   # stops and saves after step 2
    resumed = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=99), data, s, tmp_path / "b",
                      progress=False)
    assert resumed.resume() and resumed.step == 2
    resumed.run()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["lm"] for h in straight.history] == [h["lm"] for h in resumed.history]
    # and the state on disk is the same: the run left loss.png and the history beside it
    assert (tmp_path / "a" / "loss.png").stat().st_size > 1000
    assert len((tmp_path / "a" / "history.jsonl").read_text().splitlines()) == 4


def test_mutation_resume_without_the_optimizer_state_diverges(setup, tmp_path):
    cfg, token_map, data, _ = setup
    s = settings(steps=4)
    straight = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=2), data, s, tmp_path / "a", progress=False)
    straight.run()
    resumed = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=2), data, s, tmp_path / "b", progress=False)
    for _ in range(2):
        resumed.train_step()
    resumed.optimizer = type(resumed.optimizer)(resumed.optimizer.param_groups)    # Adam moments lost
    resumed.run()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_other_settings(setup, tmp_path):
    cfg, token_map, data, _ = setup
    Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24), data, settings(steps=2), tmp_path, progress=False).run()
    other = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24), data, settings(steps=2, lr=1e-4), tmp_path,
                    progress=False)
    with pytest.raises(TrainingError, match="other settings \\(lr\\)"):
        other.resume()


def test_expert_bias_moves_against_the_load(setup):
    cfg, token_map, _, _ = setup
    model = TrainingModel.create(cfg, token_map, max_seq_len=24)
    moe = model.transformer.layers[0].ffn
    counts = torch.tensor([10, 0, 5, 5, 4, 6, 2, 8])
    model.balance_experts([(moe, counts), (moe, counts)], 0.01)      # two micro-batches: summed, then signed
    assert moe.gate.bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0, 0.01, -0.01, 0.01, -0.01])
    assert not moe.gate.bias.requires_grad


@pytest.mark.parametrize("keep_bf16", [False, True], ids=["fp8-fp4", "bf16"])
def test_export_loads_through_the_loader_and_scores_the_same(setup, tmp_path, keep_bf16):
    cfg, token_map, data, folder = setup
    model = TrainingModel.create(cfg, token_map, max_seq_len=24, seed=4)
    Trainer(model, data, settings(steps=3), tmp_path / "train", progress=False).run()
    model.export(tmp_path / "ckpt", tokenizer=folder / "tokenizer.json", keep_bf16=keep_bf16)
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (written["dtype"], written["expert_dtype"]) == (("bf16", None) if keep_bf16 else ("fp8", "fp4"))
    sequences = data.evaluation(24)
    # the same stored weights read back into trainable form: the training forward and the inference
    # forward of the loaded checkpoint agree on the perplexity
    reloaded = TrainingModel.from_checkpoint(tmp_path / "ckpt", max_seq_len=24)
    trained = evaluate(reloaded, sequences, 4)["perplexity"]
    assert checkpoint_perplexity(tmp_path / "ckpt", sequences) == pytest.approx(trained, rel=1e-5)
    if keep_bf16:                 # bf16 rounding barely moves it; fp4 experts of a 3-step model do (≈10% per weight)
        assert evaluate(model, sequences, 4)["perplexity"] == pytest.approx(trained, rel=0.01)


def test_unigram_baseline_is_the_frequency_perplexity():
    data = TokenData(torch.tensor([5, 5, 5, 6]), torch.tensor([5, 6, 5, 6, 5]), bos_id=0)
    # add-one counts over a vocabulary of 8: p(5) = 4/12, p(6) = 2/12; targets 5, 6, 5, 6 (one window of 4)
    expect = math.exp(-(2 * math.log(4 / 12) + 2 * math.log(2 / 12)) / 4)
    assert unigram_perplexity(data, 8, 5) == pytest.approx(expect)


def test_cli_trains_and_writes_the_released_layout(tmp_path, capsys):
    text = tmp_path / "book.txt"
    text.write_text(SENTENCES * 40)
    backend = train_tokenizer()
    config = tmp_path / "small.json"
    raw = tiny_config(768, int(build_token_map(backend).max()) + 1).to_dict()
    raw.update(vocab_size=None, engram_compressed_vocab_size=None, engram_num_embeddings=None)
    config.write_text(json.dumps(raw))
    code = main(["train", "--config", str(config), "--data", str(text), "--out", str(tmp_path / "out"),
                 "--vocab-size", "300", "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--eval-every", "2",
                 "--eval-sequences", "2", "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "held-out perplexity" in out.out and "unigram baseline" in out.out
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "train/loss.png", "train/state.pt", "train/report.json", "train/history.jsonl"):
        assert (tmp_path / "out" / name).is_file(), name
    report = json.loads((tmp_path / "out" / "train" / "report.json").read_text())
    assert report["steps"] == 2 and report["checkpoint_perplexity_fast"] > 1
    assert main(["score", "--checkpoint", str(tmp_path / "out"), "hello"]) == 0


@pytest.mark.parametrize("change, message", [
    (lambda cfg, data: (cfg, [str(data) + ".missing"]), "no such file"),
    (lambda cfg, data: (cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "vocab_size": 5})) and cfg, [str(data)]),
     "vocab_size is 5, but the tokenizer gives"),
    (lambda cfg, data: (cfg.write_text("{") and cfg, [str(data)]), "not valid JSON"),
])
def test_cli_bad_input_is_one_clear_error(tmp_path, capsys, change, message):
    text = tmp_path / "book.txt"
    text.write_text(SENTENCES * 10)
    config = tmp_path / "small.json"
    raw = tiny_config(768, 2).to_dict()
    raw.update(vocab_size=None, engram_compressed_vocab_size=None, engram_num_embeddings=None)
    config.write_text(json.dumps(raw))
    cfg, data = change(config, text)
    code = main(["train", "--config", str(cfg), "--data", *data, "--out", str(tmp_path / "out"), "--steps", "1",
                 "--vocab-size", "300", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_accumulating_a_batch_twice_is_that_batch_once(setup, monkeypatch):
    # (loss/2 + loss/2) has the gradient of loss exactly: the step lands on the same parameters
    cfg, token_map, data, _ = setup
    batch = data.batch(0, 0, 0, 4, 24)
    monkeypatch.setattr(TokenData, "batch", lambda self, *a: batch)
    # (no draft term: each micro-batch drafts at its own anchor offset)
    one = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=6), data, settings(dspark_weight=0.0),
                  "/nonexistent", progress=False)
    two = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=6), data,
                  settings(grad_accum=2, dspark_weight=0.0), "/nonexistent", progress=False)
    for trainer in (one, two):
        trainer.train_step()
    a, b = one.model.state_dict(), two.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_autocast_trains_like_fp32(setup):
    cfg, token_map, data, _ = setup
    losses = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(TrainingModel.create(cfg, token_map, max_seq_len=24, seed=7), data,
                          settings(steps=6, precision=precision), "/nonexistent", progress=False)
        losses[precision] = [trainer.train_step()["lm"] for _ in range(6)]
        assert all(p.dtype == torch.float32 for _, p in trainer.model.trainable())       # fp32 masters
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.5
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.03)
