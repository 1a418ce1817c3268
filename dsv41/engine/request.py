"""What a caller asks the engine for, and what it gets back (STYLE.md P10: token ids, no chat format).

Shapes: V vocab, P prompt positions.

Token accounting: the EOS or stop id that ends a request is counted in `generated_tokens` but is not
part of `token_ids` or `text` (the reference cuts completions before EOS). A stop string is cut from
`text` while the tokens that spelled it stay in `token_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .sampling import SamplingParams
from ..errors import InputError
from ..vision.spans import PromptImage

FINISH_REASONS = ("eos", "stop", "length", "context", "cancelled")


class TokenConstraint(Protocol):
    """Restricts a request's next token (constrained decoding, e.g. a JSON schema or a tool call)."""

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        """bool [V]: the tokens the next step may sample (None: any)."""

    def advance(self, token_id: int) -> None:
        """The token sampled at this step."""

    def fork(self) -> "TokenConstraint":
        """An independent copy in the same state (speculation walks a copy along the drafts)."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int = 200
    """0 with `prompt_logits`: score the prompt, generate nothing."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    """The request's own generator seed: with one, its tokens are the same alone or beside others."""
    ignore_eos: bool = False
    prompt_logits: bool = False
    """Keep the fp32 logits [P, V] of every prompt position (teacher-forced scoring)."""
    speculative: bool | None = None
    """Draft with DSpark and verify; None: the engine's setting."""
    prefill_chunk: int | None = None
    """At most this many prompt tokens per step (None: the engine's chunk)."""
    first_chunk: int | None = None
    """The first step's prompt tokens (`dsv41 score --prefill N`: N at once, then `prefill_chunk`)."""
    constraint: TokenConstraint | None = field(default=None, compare=False)
    """Masks each step's logits before sampling (and each draft and verified position when speculating)."""
    logprobs: int | None = None
    """Report each sampled token's log-probability and this many alternatives (None: off)."""
    skip_special_tokens: bool = False
    """Leave special tokens out of the text (the ids keep them); stop strings then see the shown text."""
    images: tuple[PromptImage, ...] = field(default=(), compare=False)
    """The prompt's image spans (vision/spans.py `expand_images`), in order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "images", tuple(self.images))
        if not self.prompt:
            raise InputError("the prompt is empty (it needs at least one token, e.g. BOS)")
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and not self.prompt_logits):
            raise InputError(f"max_new_tokens must be at least 1 (0 only to score the prompt), got "
                             f"{self.max_new_tokens}")
        for name in ("prefill_chunk", "first_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{name} must be at least 1, got {value}")
        if any(not s for s in self.stop_strings):
            raise InputError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"logprobs must be in 0 … 20, got {self.logprobs}")
        if self.speculative and self.sampling.repetition_penalty != 1.0:
            # each verified row would need its own history (prompt + the drafts before it)
            raise InputError("speculative decoding does not support a repetition penalty")


@dataclass
class Completion:
    request: int
    token_ids: list[int]
    text: str
    finish_reason: str
    """One of FINISH_REASONS."""
    stop: int | str | None
    """The stop id or stop string that ended the request (EOS for "eos"), else None."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt positions reused from a kept sequence instead of computed (prefix reuse)."""
    generated_tokens: int
    ttft_s: float | None
    """From submission to the first sampled token (queueing and prefill included)."""
    tokens_per_s: float
    """Decode rate after the first token: (generated − 1) / (finish − first token); 0 below 2 tokens."""
    elapsed_s: float
    drafted: int = 0
    accepted: int = 0
    """Speculative decoding: drafts proposed and accepted."""
    prompt_logits: torch.Tensor | None = None
    """fp32 [P, V] with `Request.prompt_logits`: entry t is the next-token logits after prompt token t."""

    def summary(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1e3:.0f} ms"
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        spec = f", accepted {self.accepted}/{self.drafted} drafts" if self.drafted else ""
        return (f"prompt {self.prompt_tokens} tokens{cached}, generated {self.generated_tokens} tokens, TTFT "
                f"{ttft}, {self.tokens_per_s:.1f} tok/s{spec}, finish: {self.finish_reason}")


@dataclass
class StreamEvent:
    """One sampled token of a request, or (with `completion` set) the end of that request.

    Concatenating `text` over a request's events gives `completion.text`.
    """

    request: int
    token_id: int | None
    text: str
    completion: Completion | None = None
    logprob: float | None = None
    """With `Request.logprobs`: log p(token) under the model (before sampling transforms)."""
    top_logprobs: list[tuple[int, float]] | None = None
    """With `Request.logprobs` = n > 0: the n most likely (token id, log p), most likely first."""


class StopStringFilter:
    """Holds back text that could be the start of a stop string; cuts the text at the first match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> tuple[str, str | None]:
        """→ (text safe to show now, the stop string matched or None)."""
        before = len(self.text)
        self.text += delta
        hit = self._first_match(before)
        if hit is not None:
            at, stop = hit
            self.text = self.text[:at]
            return self._release(at), stop
        return self._release(len(self.text) - self._held()), None

    def flush(self) -> str:
        return self._release(len(self.text))

    def _first_match(self, before: int) -> tuple[int, str] | None:
        hits = []
        for stop in self.stops:
            # a new match must end inside the new delta
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                hits.append((at, stop))
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out


def check_prompts(prompts: list[list[int]], context: int, vocab: int, what: str = "prompt") -> None:
    """Every prompt non-empty, in the vocabulary and within the context — checked before any model call."""
    if not prompts:
        raise InputError(f"no {what}s given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InputError(f"{what} {i} is empty (it needs at least one token, e.g. BOS)")
        if len(prompt) > context:
            raise InputError(f"{what} {i} has {len(prompt)} tokens, more than the context of {context} tokens")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InputError(f"{what} {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab})")
