"""The decode trace that reference comparisons look at: a prefill, then single-token decode steps with
DSpark drafts, the only incremental mode the public reference has (tools/reference_parity.py,
tests/test_golden.py).

Shapes: T positions, V vocab, Bs draft rows.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def decode_trace(model, ids: torch.Tensor, prefill: int, images=None) -> dict[str, list[torch.Tensor]]:
    """ids [1, T]: prefill positions 0 … prefill − 1, then decode one position at a time.

    `images` (vision/spans.py `SpanRows`): the image spans of the prefill, which must hold them all.

    → "logits" ([1, V] of the last position of every call), and with DSpark stages after every decode
    step "draft_ids" [1, Bs + 1], "draft_logits" [1, Bs, V] and "confidence" [1, Bs] (greedy drafts after
    the step's greedy token).
    """
    cache = model.new_cache(1, model.runtime.max_seq_len)
    out = model(ids[:, :prefill], 0, cache, images=images)
    seen = {"logits": [model.logits(out.hidden[:, -1])], "draft_ids": [], "draft_logits": [], "confidence": []}
    if model.cfg.dspark_enabled:
        model.dspark_observe(out.dspark_hidden, 0, cache)
    for p in range(prefill, ids.shape[1]):
        out = model(ids[:, p:p + 1], p, cache)
        logits = model.logits(out.hidden[:, -1])
        seen["logits"].append(logits)
        if model.cfg.dspark_enabled:
            model.dspark_observe(out.dspark_hidden, p, cache)
            d = model.dspark_draft(logits.argmax(-1), p, cache)
            seen["draft_ids"].append(d.ids)
            seen["draft_logits"].append(d.logits)
            seen["confidence"].append(d.confidence)
    return seen
