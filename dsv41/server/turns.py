"""Prompt tokens that continue an earlier turn: the token ids the model produced, not a re-tokenisation.

A client sends a conversation back as text (the assistant's reasoning, content and tool calls); the
server renders it into one prompt string again. Tokenising that string afresh need not give the ids the
model sampled (a byte-level BPE has many spellings of one text, and a model does not always pick the
canonical one), and the engine's prefix reuse continues a kept sequence only when the new prompt starts
with every one of its ids (prefix.py). So the server remembers, for the last few finished requests,
prompt + completion ids and their text; a new prompt whose text starts with one of those texts is
encoded as those ids followed by the rest of the text, tokenised. The model then sees the ids it wrote
(as `dsv41 chat` does, repl.py), and the engine finds the kept slot. Ids whose text is not valid
UTF-8 decode to U+FFFD, which the client sends back as it got it: the match is on that text, and the
ids put in are the ones the model wrote.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable


class TurnMemory:
    """The (text, ids) of recent finished requests, least recently used first out."""

    def __init__(self, decode: Callable[[list[int]], str], capacity: int = 64):
        self.decode, self.capacity = decode, capacity
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, ids: list[int] | tuple[int, ...]) -> None:
        text = self.decode(list(ids))
        with self._lock:
            self._entries[text] = tuple(ids)
            self._entries.move_to_end(text)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> tuple[list[int], int]:
        """`text` as ids: the longest remembered text it starts with, as its ids, then the rest
        tokenised; → (ids, how many came from memory)."""
        with self._lock:
            best = max((t for t in self._entries if text.startswith(t)), key=len, default=None)
            if best is not None:
                self._entries.move_to_end(best)
                kept = list(self._entries[best])
        if best is None:
            return encode(text), 0
        return kept + (encode(text[len(best):]) if len(text) > len(best) else []), len(kept)
