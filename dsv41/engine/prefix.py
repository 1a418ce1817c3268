"""Prefix reuse: finished sequences kept in their cache slots, continued by a prompt that extends one.

A slot's state can only be continued from its exact end: the window ring holds the last W positions
and a ratio-2 source's pooling tail the open group, so a sequence cannot be cut back to an earlier
length (docs/ARCHITECTURE.md §11.2–§11.3). A new prompt reuses a kept sequence when it starts with all of
its tokens and is longer (the multi-turn chat case: previous prompt + completion + the new turn);
any other prompt — one that shares only part of a kept sequence, or equals it — gets a cold prefill.

Sequences are compared by position keys (`Sequence.key`): the token id, or inside an image span, whose
positions all carry the image token, the image's digest and the offset — so a prompt continues a kept
sequence only if it holds the same images at the same places.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    """Kept sequences by slot, least recently kept first; at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def keep(self, slot: int, tokens: tuple) -> list[int]:
        """Keep the sequence in `slot` (positions 0 … len(tokens) − 1, by key); → slots evicted to make room."""
        if self.capacity <= 0 or not tokens:
            return [slot]
        self.entries[slot] = tuple(tokens)
        evicted = []
        while len(self.entries) > self.capacity:
            evicted.append(self.entries.popitem(last=False)[0])
        return evicted

    def match(self, prompt: tuple) -> tuple[int, int] | None:
        """(slot, kept length) of the longest kept sequence the prompt extends, taken out of the cache."""
        best = None
        for slot, tokens in self.entries.items():
            n = len(tokens)
            if n < len(prompt) and prompt[:n] == tokens and (best is None or n > best[1]):
                best = (slot, n)
        if best is not None:
            del self.entries[best[0]]
        return best

    def evict(self) -> int | None:
        """Free the least recently kept slot (None when nothing is kept)."""
        return self.entries.popitem(last=False)[0] if self.entries else None
