"""The engine's record of one request: where it stands in its cache slot, and its stop rules.

The cache slot holds positions 0 … fed − 1, whose tokens are `tokens[:fed]` (the prompt, then every
committed token). `pending` is a sampled token not fed yet: it goes in at position `fed` next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..tokenizer import StreamDecoder
from ..vision.spans import PromptImage, position_keys
from .request import Completion, Request, StopStringFilter, StreamEvent


@dataclass
class Sequence:
    id: int
    request: Request
    generator: torch.Generator
    end_ids: dict[int, str]
    """Token id → finish reason ("eos" or "stop") for ids that end the request."""
    context: int
    decoder: StreamDecoder | None
    speculative: bool
    submitted: float = field(default_factory=time.perf_counter)
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    fed: int = 0
    cached: int = 0
    pending: int | None = None
    produced: int = 0
    token_ids: list[int] = field(default_factory=list)
    filter: StopStringFilter | None = None
    first_token_at: float | None = None
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    completion: Completion | None = None
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)
    """Span rows [L, D] of the prompt's images being prefilled, by span start (dropped once fed)."""

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt)
        self.filter = StopStringFilter(self.request.stop_strings)

    # ---------------------------------------------------------------------------------- where it stands
    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def done(self) -> bool:
        return self.completion is not None

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt_len

    def prompt_chunk(self, default: int) -> int:
        """How many prompt tokens this request may feed in the next step."""
        first = self.request.first_chunk if self.fed == self.cached else None
        return min(self.prompt_len - self.fed, first or self.request.prefill_chunk or default)

    def key(self, n: int | None = None) -> tuple:
        """The prefix key of positions 0 … n − 1 (all tokens by default): token ids, and the image's
        digest inside image spans, whose ids are all the same."""
        tokens = self.tokens if n is None else self.tokens[:n]
        return position_keys(tokens, self.request.images) if self.request.images else tuple(tokens)

    def spans_in(self, first: int, count: int) -> list[PromptImage]:
        """The prompt's image spans that positions first … first + count − 1 reach into."""
        return [s for s in self.request.images if s.start < first + count and first < s.end]

    def room(self) -> int:
        """Positions the slot can still take."""
        return self.context - self.fed

    # ---------------------------------------------------------------------------------- tokens
    def accept(self, token_id: int, logprob: float | None = None,
               top: list[tuple[int, float]] | None = None) -> list[StreamEvent]:
        """Commit a sampled token; returns its event, and the request's final event if it stopped."""
        now = time.perf_counter()
        self.produced += 1
        self.first_token_at = self.first_token_at or now
        self.tokens.append(token_id)
        if token_id in self.end_ids:
            return self.finish(self.end_ids[token_id], token_id)
        self.token_ids.append(token_id)
        shown, stop = self.filter.push(self.decoder.push(token_id) if self.decoder else "")
        events = [StreamEvent(self.id, token_id, shown, logprob=logprob, top_logprobs=top)]
        if stop is not None:
            return events + self.finish("stop", stop)
        if self.produced >= self.request.max_new_tokens:
            return events + self.finish("length")
        if self.prompt_len + self.produced >= self.context:
            return events + self.finish("context")
        self.pending = token_id
        return events

    def finish(self, reason: str, stop: int | str | None = None) -> list[StreamEvent]:
        self.pending = None
        tail = "" if isinstance(stop, str) else self._remaining_text()
        self.completion = self._completion(reason, stop, time.perf_counter())
        return [StreamEvent(self.id, None, tail, self.completion)]

    def _remaining_text(self) -> str:
        # An unfinished character's bytes, then whatever the filter held back (a stop string completed
        # by those bytes still cuts the text: after a match there is nothing left to flush).
        shown, _ = self.filter.push(self.decoder.finish() if self.decoder else "")
        return shown + self.filter.flush()

    def _completion(self, reason: str, stop: int | str | None, now: float) -> Completion:
        first = self.first_token_at
        decode_s = now - first if first is not None else 0.0
        rate = (self.produced - 1) / decode_s if self.produced > 1 and decode_s > 0 else 0.0
        logits = torch.cat(self.prompt_logits) if self.prompt_logits else None
        return Completion(request=self.id, token_ids=list(self.token_ids), text=self.filter.text,
                          finish_reason=reason, stop=stop, prompt_tokens=self.prompt_len, cached_tokens=self.cached,
                          generated_tokens=self.produced, ttft_s=None if first is None else first - self.submitted,
                          tokens_per_s=rate, elapsed_s=now - self.submitted, drafted=self.drafted,
                          accepted=self.accepted, prompt_logits=logits)
