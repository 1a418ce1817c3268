"""The training objective: next-token loss, the indexer's KL term, the DSpark draft and confidence losses.

Shapes: B sequences of T tokens, V vocab, A DSpark anchors of Bs rows.

Each term trains its own parameters (docs/TRAINING.md §2): the language-model loss the backbone, the KL
term the indexers (their inputs are detached), the draft losses the DSpark stages (the backbone's
streams, embedding and head are detached there). So the weights only set how the three share the
clipped gradient norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .forward import anchors, backbone, dspark


@dataclass
class Losses:
    total: torch.Tensor
    lm: torch.Tensor
    """Mean next-token cross-entropy (nats) of the backbone."""
    index_kl: torch.Tensor
    draft: torch.Tensor
    """Mean cross-entropy of the DSpark draft rows (0 without DSpark)."""
    confidence: torch.Tensor
    draft_accuracy: torch.Tensor
    """Fraction of draft rows whose argmax is the true token (teacher-forced chain)."""
    loads: list

    def figures(self) -> dict[str, float]:
        return {k: float(getattr(self, k).detach()) for k in ("total", "lm", "index_kl", "draft", "confidence", "draft_accuracy")}


def compute_losses(model, ids: torch.Tensor, *, index_kl_weight: float = 1.0, dspark_weight: float = 1.0,
                   anchor_offset: int = 0) -> Losses:
    """All terms for a batch ids [B, T] of sequences from position 0 (`model`: a TrainingModel)."""
    transformer = model.transformer
    out = backbone(transformer, model.engram_tables, ids)
    logits = transformer.logits(out.hidden[:, :-1])                                      # [B, T − 1, V]
    lm = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    zero = lm.new_zeros(())
    total = lm + index_kl_weight * out.index_kl
    draft = confidence = accuracy = zero
    loads = list(out.loads)
    cfg = transformer.cfg
    positions = anchors(ids.shape[1], cfg.dspark_block_size, anchor_offset) if cfg.dspark_enabled else None
    if cfg.dspark_enabled and dspark_weight > 0 and positions.numel():
        d = dspark(transformer, ids, out.dspark_hidden, positions, loads)
        draft = F.cross_entropy(d.logits.flatten(0, 1), d.targets.flatten())
        correct = (d.logits.detach().argmax(-1) == d.targets).to(d.confidence.dtype)
        confidence = F.binary_cross_entropy_with_logits(d.confidence, correct)
        accuracy = correct.mean()
        total = total + dspark_weight * (draft + confidence)
    return Losses(total, lm, out.index_kl, draft, confidence, accuracy, loads)


@torch.no_grad()
def evaluate(model, sequences: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Held-out figures over sequences [M, T]: next-token loss and perplexity, draft loss and accuracy."""
    sums: dict[str, float] = {}
    count = 0
    for i in range(0, sequences.shape[0], batch_size):
        batch = sequences[i:i + batch_size]
        figures = compute_losses(model, batch).figures()
        for k, v in figures.items():
            sums[k] = sums.get(k, 0.0) + v * batch.shape[0]
        count += batch.shape[0]
    means = {k: v / count for k, v in sums.items()}
    means["perplexity"] = float(torch.tensor(means["lm"]).exp())
    return means
