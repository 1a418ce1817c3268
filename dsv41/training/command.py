"""`dsv41 train`: train a small V4.1 model on text files and write it in the released layout.

    dsv41 train --config small.json --data book.txt --out DIR [--steps N …]

The config is an inference/config.json; the keys the tokenizer decides (`vocab_size`,
`engram_compressed_vocab_size`, `engram_num_embeddings`) may be null and are then filled in. The
tokenizer is `--tokenizer FILE`, or a byte-level BPE of `--vocab-size` tokens trained on the data.
DIR receives the checkpoint (config.json, shards, index, tokenizer files), `train/` (state.pt,
history.jsonl, loss.png, report.json) and keeps training from `train/state.pt` with `--resume`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import UserError
from ..model.engram import build_token_map
from ..model.engram.hashing import table_rows
from ..tokenizer import Tokenizer, save_tokenizer, train_bpe
from .data import TokenData, encode_documents, read_texts, unigram_perplexity
from .model import TrainingModel
from .trainer import Trainer, TrainSettings
from .report import export_and_report

TOKENIZER_FILLED = ("vocab_size", "engram_compressed_vocab_size", "engram_num_embeddings")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small V4.1 model on text files (released layout out)",
                       description="Train a DeepSeek-V4.1-architecture model from scratch on UTF-8 text files "
                                   "and write it in the released layout (fp8 / fp4 as the config says, or "
                                   "--keep-bf16). Writes a loss curve, a history and a resumable state under "
                                   "OUT/train/.")
    p.add_argument("--config", required=True, metavar="FILE", help="the model's config.json (tokenizer keys may be null)")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE", help="UTF-8 text files")
    p.add_argument("--out", required=True, metavar="DIR", help="where the checkpoint and train/ go")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="FILE", help="a tokenizer.json to use (default: train a BPE on the data)")
    tok.add_argument("--vocab-size", type=int, default=2048, metavar="N", help="BPE tokens to learn (default 2048)")
    d = TrainSettings()
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence, BOS included")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps, then cosine")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip")
    g.add_argument("--precision", choices=("fp32", "bf16"), default=d.precision)
    g.add_argument("--index-kl-weight", type=float, default=d.index_kl_weight)
    g.add_argument("--dspark-weight", type=float, default=d.dspark_weight, help="0 leaves the DSpark stages untrained")
    g.add_argument("--bias-update-rate", type=float, default=d.bias_update_rate,
                   help="router-bias step per optimizer step (auxiliary-loss-free balancing)")
    g.add_argument("--seed", type=int, default=d.seed)
    e = p.add_argument_group("evaluation and output")
    e.add_argument("--held-out", type=float, default=0.05, help="fraction of the token stream held out (default 0.05)")
    e.add_argument("--eval-every", type=int, default=d.eval_every)
    e.add_argument("--eval-sequences", type=int, default=d.eval_sequences)
    e.add_argument("--save-every", type=int, default=d.save_every)
    e.add_argument("--resume", action="store_true", help="continue from OUT/train/state.pt")
    e.add_argument("--keep-bf16", action="store_true", help="write bf16 weights instead of fp8 / fp4")
    e.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")


def settings_of(args) -> TrainSettings:
    return TrainSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
                         lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                         weight_decay=args.weight_decay, clip=args.clip, precision=args.precision,
                         index_kl_weight=args.index_kl_weight, dspark_weight=args.dspark_weight,
                         bias_update_rate=args.bias_update_rate, eval_every=args.eval_every,
                         eval_sequences=args.eval_sequences, save_every=args.save_every, seed=args.seed)


def config_for(path: str | Path, tokenizer_backend, token_map: torch.Tensor) -> ModelConfig:
    """The config file with the tokenizer's keys filled in (given ones must agree)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--config {path}: not valid JSON ({e})") from None
    filled = dict(raw)
    filled["vocab_size"] = tokenizer_backend.get_vocab_size(with_added_tokens=True)
    filled["engram_compressed_vocab_size"] = int(token_map.max()) + 1
    if raw.get("engram_layer_ids"):
        filled["engram_num_embeddings"] = list(table_rows(len(raw["engram_layer_ids"]), raw["engram_max_ngram_size"],
                                                          raw["engram_n_heads"], raw["engram_vocab_size"]))
    for key in TOKENIZER_FILLED:
        if raw.get(key) is not None and raw[key] != filled.get(key):
            raise UserError(f"--config {path}: {key} is {raw[key]!r}, but the tokenizer gives {filled[key]!r} "
                            f"(leave it null to have it filled in)")
    return ModelConfig.from_dict(filled)


def cmd_train(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = settings_of(args)
    out = Path(args.out)
    texts = read_texts(args.data)
    if args.tokenizer:
        backend = Tokenizer.from_dir(args.tokenizer).backend
    else:
        backend = train_bpe(texts, args.vocab_size)
    tokenizer = Tokenizer(backend, "the training tokenizer")
    token_map = build_token_map(backend)
    cfg = config_for(args.config, backend, token_map)
    data = TokenData.split(encode_documents(tokenizer, texts), tokenizer.bos_id, args.held_out, settings.seq_len)
    staging = out / "train"
    staging.mkdir(parents=True, exist_ok=True)
    save_tokenizer(backend, staging)
    model = TrainingModel.create(cfg, token_map, max_seq_len=settings.seq_len, seed=settings.seed)
    trainer = Trainer(model, data, settings, staging, progress=False if args.no_progress else None)
    if args.resume and not trainer.resume():
        raise UserError(f"--resume: {staging / 'state.pt'} does not exist")
    params = sum(p.numel() for _, p in model.trainable())
    print(f"dsv41: training {params:,} parameters on {data.train.numel():,} tokens "
          f"({data.validation.numel():,} held out), {settings.steps} steps from step {trainer.step}", flush=True)
    trainer.run()
    report = export_and_report(model, trainer, data, out, tokenizer_file=staging / "tokenizer.json",
                               keep_bf16=args.keep_bf16,
                               unigram=unigram_perplexity(data, cfg.vocab_size, settings.seq_len, settings.eval_sequences))
    for line in report["summary"]:
        print(f"dsv41: {line}", flush=True)
    return 0
