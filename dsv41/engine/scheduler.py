"""What each running request feeds in the next forward, within a per-step token budget.

Decoding rows go first (each feeds its pending token, or the token and its drafts when it verifies):
they are latency-critical and cheap. Rows still in their prompt then take prompt chunks in arrival
order, each at most the chunk size, until the budget is spent — so a long prompt is prefilled over
several steps interleaved with the other rows' decoding, and a short one is not held behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Work:
    seq: Sequence
    tokens: list[int]
    """Fed this step at positions seq.fed, seq.fed + 1, …"""
    drafts: int = 0
    """Of which the last `drafts` are speculative drafts to verify (tokens[0] is the pending token)."""

    @property
    def prefill(self) -> bool:
        return self.seq.prefilling


def plan(running: list[Sequence], budget: int, chunk: int, drafts: dict[int, list[int]]) -> list[Work]:
    """The step's work: decode rows first, then prompt chunks while the budget lasts (at least one row)."""
    works = []
    for seq in running:
        if not seq.prefilling:
            extra = drafts.get(seq.id, [])
            works.append(Work(seq, [seq.pending] + extra, len(extra)))
    left = budget - sum(len(w.tokens) for w in works)
    for seq in running:
        if seq.prefilling and (left > 0 or not works):
            n = min(seq.prompt_chunk(chunk), max(left, 1))
            works.append(Work(seq, seq.tokens[seq.fed:seq.fed + n]))
            left -= n
    return works
