"""Batched, streaming text generation over token ids (STYLE.md P10: the engine knows no chat format).

Shapes: B batch rows, T positions in a call, D dim, V vocab, L buffer length.

The schedule follows the reference loop (GENERATION-AND-DSPARK.md §1.2) with dsv41's additions: all
rows share one position, the common prompt prefix is prefilled in chunks, then every step feeds one
position for all rows. A row still inside its prompt is fed its own prompt token (teacher forcing); a
row past its prompt gets a sampled token. Each row stops on its own — EOS, a stop id, a stop string,
its token budget, or the cache's context — and the loop ends when every row has stopped.

Token accounting: the EOS or stop id that ends a row is counted in `generated_tokens` but is not part of
`token_ids` or `text` (the reference cuts completions before EOS). A stop string is cut from `text`
while the tokens that spelled it stay in `token_ids`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, sample
from ..tokenizer import StreamDecoder, Tokenizer

FINISH_REASONS = ("eos", "stop", "length", "context")
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class GenerationConfig:
    """Settings shared by every row of one `generate` call."""

    max_new_tokens: int = 200
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_context: int | None = None
    """Positions the cache holds (prompt + completion); None: the model's RuntimeConfig.max_seq_len."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks that need a fixed token count)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be positive, got {self.max_context}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")


@dataclass
class Completion:
    row: int
    token_ids: list[int]
    text: str
    finish_reason: str
    """One of FINISH_REASONS."""
    stop: int | str | None
    """The stop id or stop string that ended the row (EOS for "eos"), else None."""
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None
    """From the start of the call to this row's first sampled token (prefill included)."""
    tokens_per_s: float
    """Decode rate after the first token: (generated − 1) / (finish − first token); 0 below 2 tokens."""
    elapsed_s: float

    def summary(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1e3:.0f} ms"
        return (f"prompt {self.prompt_tokens} tokens, generated {self.generated_tokens} tokens, TTFT {ttft}, "
                f"{self.tokens_per_s:.1f} tok/s, finish: {self.finish_reason}")


@dataclass
class StreamEvent:
    """One sampled token of one row, or (with `completion` set) the end of that row.

    Concatenating `text` over a row's events gives `completion.text`.
    """

    row: int
    token_id: int | None
    text: str
    completion: Completion | None = None


# ------------------------------------------------------------------------------------ stop strings
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


# ------------------------------------------------------------------------------------ per-row bookkeeping
@dataclass
class _Row:
    index: int
    prompt_len: int
    max_new_tokens: int
    context: int
    end_ids: dict[int, str]
    """Token id → finish reason ("eos" or "stop") for ids that end the row."""
    decoder: StreamDecoder
    filter: StopStringFilter
    start: float
    token_ids: list[int] = field(default_factory=list)
    produced: int = 0
    first_token_at: float | None = None
    done: bool = False

    def accept(self, token_id: int, now: float) -> list[StreamEvent]:
        """Record a sampled token; returns its event, and the row's final event if it stopped."""
        self.produced += 1
        if self.first_token_at is None:
            self.first_token_at = now
        if token_id in self.end_ids:
            return self.finish(self.end_ids[token_id], now, token_id)
        self.token_ids.append(token_id)
        shown, stop = self.filter.push(self.decoder.push(token_id))
        events = [StreamEvent(self.index, token_id, shown)]
        if stop is not None:
            return events + self.finish("stop", now, stop)
        if self.produced >= self.max_new_tokens:
            return events + self.finish("length", now)
        if self.prompt_len + self.produced >= self.context:
            return events + self.finish("context", now)
        return events

    def finish(self, reason: str, now: float, stop: int | str | None = None) -> list[StreamEvent]:
        self.done = True
        tail = "" if isinstance(stop, str) else self._remaining_text()
        return [StreamEvent(self.index, None, tail, self._completion(reason, stop, now))]

    def _remaining_text(self) -> str:
        # An unfinished character's bytes, then whatever the filter held back (a stop string completed
        # by those bytes still cuts the text: after a match there is nothing left to flush).
        shown, _ = self.filter.push(self.decoder.finish())
        return shown + self.filter.flush()

    def _completion(self, reason: str, stop: int | str | None, now: float) -> Completion:
        first = self.first_token_at
        decode_s = now - first if first is not None else 0.0
        rate = (self.produced - 1) / decode_s if self.produced > 1 and decode_s > 0 else 0.0
        return Completion(row=self.index, token_ids=list(self.token_ids), text=self.filter.text,
                          finish_reason=reason, stop=stop, prompt_tokens=self.prompt_len,
                          generated_tokens=self.produced, ttft_s=None if first is None else first - self.start,
                          tokens_per_s=rate, elapsed_s=now - self.start)


@dataclass
class _Batch:
    tokens: torch.Tensor
    """[B, L] long: prompts, then sampled tokens; L = the furthest position any row may reach."""
    rows: list[_Row]
    vocab_limit: int

    @property
    def all_done(self) -> bool:
        return all(r.done for r in self.rows)

    @property
    def min_prompt_len(self) -> int:
        return min(r.prompt_len for r in self.rows)

    def rows_to_sample(self, pos: int) -> list[int]:
        """Rows whose token at `pos` is sampled: past their prompt and not stopped."""
        return [r.index for r in self.rows if not r.done and pos >= r.prompt_len]


def check_prompts(prompts: list[list[int]], context: int, vocab: int, what: str = "prompt") -> None:
    """Every prompt non-empty, in the vocabulary and within the context — checked before any model call."""
    if not prompts:
        raise ValueError(f"no {what}s given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"{what} {i} is empty (it needs at least one token, e.g. BOS)")
        if len(prompt) > context:
            raise ValueError(f"{what} {i} has {len(prompt)} tokens, more than the context of {context} tokens")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab})")


def _end_ids(tokenizer: Tokenizer, config: GenerationConfig) -> dict[int, str]:
    ends = {t: "stop" for t in config.stop_token_ids}
    if not config.ignore_eos:
        ends[tokenizer.eos_id] = "eos"
    return ends


def _new_batch(prompts: list[list[int]], config: GenerationConfig, context: int, tokenizer: Tokenizer,
               device: torch.device, start: float) -> _Batch:
    ends = _end_ids(tokenizer, config)
    rows = [_Row(i, len(p), config.max_new_tokens, context, ends, tokenizer.stream(),
                 StopStringFilter(config.stop_strings), start) for i, p in enumerate(prompts)]
    length = max(min(len(p) + config.max_new_tokens, context) for p in prompts)
    tokens = torch.zeros(len(prompts), length, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    return _Batch(tokens.to(device), rows, tokenizer.vocab_size)


# ------------------------------------------------------------------------------------ model calls
@torch.no_grad()
def prefill(model, cache, ids_BT: torch.Tensor, chunk: int) -> torch.Tensor:
    """Run positions 0 … T − 1 in chunks of `chunk`; → hidden [B, D] of the last position."""
    hidden_BTD = None
    for start in range(0, ids_BT.shape[1], chunk):
        hidden_BTD = model(ids_BT[:, start:start + chunk], start, cache).hidden
    return hidden_BTD[:, -1]


@torch.no_grad()
def decode_step(model, cache, ids_B: torch.Tensor, pos: int) -> torch.Tensor:
    """Feed one token per row at position `pos`; → hidden [B, D]."""
    return model(ids_B[:, None], pos, cache).hidden[:, -1]


@torch.no_grad()
def next_token_logits(model, hidden_BD: torch.Tensor, rows: list[int], vocab_limit: int) -> torch.Tensor:
    """fp32 logits [len(rows), V] for the rows that sample; ids the tokenizer cannot decode are masked."""
    logits_RV = model.logits(hidden_BD[rows]).float()
    if vocab_limit < logits_RV.shape[-1]:
        # A head wider than the tokenizer (a padded vocabulary) must not emit undecodable ids.
        logits_RV[:, vocab_limit:] = float("-inf")
    return logits_RV


def _sample_rows(model, batch: _Batch, hidden_BD: torch.Tensor, pos: int, config: GenerationConfig,
                 generator: torch.Generator) -> list[int] | None:
    """Sample the token at `pos` for every row past its prompt; write them into the buffer."""
    rows = batch.rows_to_sample(pos)
    if not rows:
        return None
    logits_RV = next_token_logits(model, hidden_BD, rows, batch.vocab_limit)
    history = batch.tokens[rows, :pos] if config.sampling.repetition_penalty != 1.0 else None
    ids_R = sample(logits_RV, config.sampling, generator, history)
    batch.tokens[rows, pos] = ids_R.to(batch.tokens.device)
    return rows


def _advance(model, batch: _Batch, hidden_BD: torch.Tensor, pos: int, config: GenerationConfig,
             generator: torch.Generator) -> list[StreamEvent]:
    """Decide position `pos` for every row (prompt token or sample) and apply the stop rules."""
    rows = _sample_rows(model, batch, hidden_BD, pos, config, generator)
    if rows is None:
        return []
    now = time.perf_counter()
    sampled = batch.tokens[rows, pos].tolist()
    return [event for r, t in zip(rows, sampled) for event in batch.rows[r].accept(t, now)]


def _finish_full_rows(batch: _Batch, context: int, now: float) -> list[StreamEvent]:
    """Rows whose prompt already fills the context end before the first call."""
    return [e for r in batch.rows if r.prompt_len >= context for e in r.finish("context", now)]


# ------------------------------------------------------------------------------------ the loop
def generate(model, tokenizer: Tokenizer, prompts: list[list[int]],
             config: GenerationConfig | None = None) -> Iterator[StreamEvent]:
    """Stream tokens for a batch of prompts (token ids); one final event per row carries its Completion."""
    config = config or GenerationConfig()
    context = config.max_context or model.runtime.max_seq_len
    check_prompts(prompts, context, tokenizer.vocab_size)
    return _run(model, tokenizer, prompts, config, context)


def _run(model, tokenizer, prompts, config, context) -> Iterator[StreamEvent]:
    start = time.perf_counter()
    batch = _new_batch(prompts, config, context, tokenizer, model.device, start)
    yield from _finish_full_rows(batch, context, start)
    if batch.all_done:
        return
    generator = torch.Generator(device=model.device).manual_seed(config.seed)
    cache = model.new_cache(len(prompts), context)
    pos = batch.min_prompt_len
    hidden_BD = prefill(model, cache, batch.tokens[:, :pos], config.prefill_chunk)
    while True:
        yield from _advance(model, batch, hidden_BD, pos, config, generator)
        if batch.all_done:
            return
        hidden_BD = decode_step(model, cache, batch.tokens[:, pos], pos)
        pos += 1


def generate_all(model, tokenizer: Tokenizer, prompts: list[list[int]], config: GenerationConfig | None = None,
                 on_event: Callable[[StreamEvent], None] | None = None) -> list[Completion]:
    """Run `generate` to the end, handing every event to `on_event`; completions in prompt order."""
    done = []
    for event in generate(model, tokenizer, prompts, config):
        if on_event is not None:
            on_event(event)
        if event.completion is not None:
            done.append(event.completion)
    return sorted(done, key=lambda c: c.row)
