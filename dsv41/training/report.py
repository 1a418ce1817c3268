"""After training: write the released layout, load it back through the normal loader, and measure it.

The held-out perplexity is measured three ways on the same sequences: the trained fp32 model (training
forward), the written checkpoint loaded in `fast` numerics (its weights dequantised: the change is the
quantisation error), and in `reference` numerics (activations quantised as the release runs). Both
checkpoint figures use the inference forward with a fresh cache, the path `dsv41 score` takes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.model_io import load_model
from ..config import RuntimeConfig
from .data import TokenData
from .objective import evaluate

REFERENCE_SEQUENCES = 8


@torch.no_grad()
def checkpoint_perplexity(path: str | Path, sequences: torch.Tensor, *, numerics: str = "fast",
                          batch_size: int = 16) -> float:
    """exp(mean next-token loss) of sequences [M, T] through the loaded checkpoint's inference forward."""
    T = sequences.shape[1]
    dtype = "float32" if numerics == "fast" else "bfloat16"
    model = load_model(path, RuntimeConfig(max_seq_len=T, dtype=dtype, numerics=numerics), check_memory=False,
                       progress=False)
    total, count = 0.0, 0
    for i in range(0, sequences.shape[0], batch_size):
        ids = sequences[i:i + batch_size]
        out = model(ids, 0, model.new_cache(ids.shape[0], T))
        logits = model.logits(out.hidden[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        count += ids[:, 1:].numel()
    return math.exp(total / count)


def export_and_report(model, trainer, data: TokenData, out: Path, *, tokenizer_file: Path, keep_bf16: bool,
                      unigram: float) -> dict:
    s = trainer.settings
    sequences = data.evaluation(s.seq_len, s.eval_sequences)
    trained = evaluate(model, sequences, s.batch_size)
    model.export(out, tokenizer=tokenizer_file, keep_bf16=keep_bf16)
    fast = checkpoint_perplexity(out, sequences)
    reference = checkpoint_perplexity(out, sequences[:REFERENCE_SEQUENCES], numerics="reference")
    trained_subset = evaluate(model, sequences[:REFERENCE_SEQUENCES], s.batch_size)["perplexity"]
    history = trainer.history
    rates = [h["tokens_per_s"] for h in history if "tokens_per_s" in h]
    report = {
        "steps": trainer.step, "held_out_sequences": int(sequences.shape[0]), "seq_len": s.seq_len,
        "unigram_perplexity": unigram, "trained_perplexity": trained["perplexity"],
        "checkpoint_perplexity_fast": fast, "checkpoint_perplexity_reference": reference,
        "trained_perplexity_reference_subset": trained_subset,
        "draft_accuracy": trained["draft_accuracy"], "tokens_per_s": rates[-1] if rates else None,
        "stored": "bf16" if keep_bf16 else f"{model.cfg.dtype} dense / {model.cfg.expert_dtype} experts",
    }
    report["summary"] = [
        f"held-out perplexity {trained['perplexity']:.2f} (trained fp32) vs {unigram:.2f} (unigram baseline)",
        f"written as {report['stored']}: perplexity {fast:.2f} loaded in fast numerics "
        f"({100 * (fast / trained['perplexity'] - 1):+.2f}% from quantisation), {reference:.2f} in reference numerics "
        f"on {min(REFERENCE_SEQUENCES, sequences.shape[0])} sequences (trained: {trained_subset:.2f})",
        f"DSpark draft rows right (teacher-forced): {100 * trained['draft_accuracy']:.1f}%",
        f"checkpoint in {out}; loss curve {out / 'train' / 'loss.png'}",
    ]
    (out / "train" / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
