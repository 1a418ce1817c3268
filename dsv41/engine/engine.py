"""The continuous-batching engine: requests join and leave a running batch, each row at its own position.

Shapes: B rows of a step (cache slots), N tokens of the step, V vocab, k drafts per speculative cycle.

`Engine.submit` queues a request and returns its id; every `Engine.step` admits waiting requests to
free cache slots (continuing a kept sequence when the prompt extends one, prefix.py), plans one forward
within the token budget (scheduler.py) — prompt chunks of some rows beside the decode steps and
speculative verify passes of others — runs it, samples each row with its own generator, and retires
finished rows at once. `generate` drives the engine over a list of prompts. The engine talks to the
model only through `ModelInterface` (protocol.py) and knows no chat format (STYLE.md P10).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..tokenizer import Tokenizer
from .prefix import PrefixCache
from .protocol import ModelInterface
from .request import Completion, Request, StreamEvent, TokenConstraint, check_prompts
from .sampling import SamplingParams, probabilities, sample
from .scheduler import Work, plan
from .sequence import Sequence
from .speculative import accept_drafts
from ..errors import InputError
from ..vision.spans import SpanRows, call_rows, check_spans

DEFAULT_TOKEN_BUDGET = 512
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 4
    """Sequences in the cache at once (running and kept)."""
    max_context: int | None = None
    """Positions per slot (prompt + completion); None: the model's RuntimeConfig.max_seq_len."""
    token_budget: int = DEFAULT_TOKEN_BUDGET
    """Tokens per forward: decode rows first, then prompt chunks."""
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    speculative: bool = False
    """Draft with the DSpark stages and verify (requests may override)."""
    prefix_cache: int | None = None
    """Finished sequences kept for reuse (None: as many as there are idle slots; 0: none)."""
    seed: int = 0
    """Seeds the generators of requests that bring none (request id added)."""
    image_cache: int | None = None
    """Encoded images kept by digest for other requests (None: as many as there are slots; 0: none)."""

    def __post_init__(self) -> None:
        for name in ("n_slots", "token_budget", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_context is not None and self.max_context < 1:
            raise InputError(f"max_context must be positive, got {self.max_context}")


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    """Tokens fed to the model (prompt chunks, decode and verify rows)."""
    generated: int = 0
    prefix_hits: int = 0
    cached_tokens: int = 0
    images_encoded: int = 0
    step_seconds: list[float] = field(default_factory=list)


class Engine:
    def __init__(self, model: ModelInterface, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        self.context = self.config.max_context or model.runtime.max_seq_len
        self.cache = model.new_cache(self.config.n_slots, self.context)
        keep = self.config.prefix_cache
        self.prefix = PrefixCache(self.config.n_slots if keep is None else keep)
        self.free = list(range(self.config.n_slots))
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}
        self.stats = EngineStats()
        keep_images = self.config.image_cache
        self.images = ImageCache(self.config.n_slots if keep_images is None else keep_images)
        self._next_id = 0
        self.vocab_limit = tokenizer.vocab_size if tokenizer is not None else model.cfg.vocab_size
        self.observes = model.cfg.dspark_enabled and self.config.speculative

    # ---------------------------------------------------------------------------------- requests
    def submit(self, request: Request) -> int:
        """Queue a request; → its id (events and the completion carry it)."""
        check_prompts([list(request.prompt)], self.context, self.model.cfg.vocab_size)
        if request.images:
            cfg = self.model.cfg
            check_spans(request.prompt, request.images, cfg.image_token_id if cfg.vision_enabled else None)
        speculative = self.config.speculative if request.speculative is None else request.speculative
        if speculative and not self.observes:
            raise InputError("speculative decoding needs DSpark stages and an engine built with speculative=True")
        if speculative and request.sampling.repetition_penalty != 1.0:
            raise InputError("speculative decoding does not support a repetition penalty")
        biased = [t for t, _ in request.sampling.logit_bias if t >= self.vocab_limit]
        if biased:                                 # here, not in a step that samples other rows too
            raise InputError(f"logit_bias names token {biased[0]}; the vocabulary has {self.vocab_limit} tokens")
        rid, self._next_id = self._next_id, self._next_id + 1
        seed = request.seed if request.seed is not None else self.config.seed + rid
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        decoder = (self.tokenizer.stream(skip_special_tokens=request.skip_special_tokens)
                   if self.tokenizer is not None else None)
        seq = Sequence(rid, request, generator, self._end_ids(request), self.context, decoder, speculative)
        self.waiting.append(seq)
        return rid

    def cancel(self, rid: int) -> list[StreamEvent]:
        """End a request now (finish reason "cancelled"); its slot is freed."""
        for seq in self.waiting + list(self.running.values()):
            if seq.id == rid and not seq.done:
                events = seq.finish("cancelled")
                self.waiting = [s for s in self.waiting if s.id != rid]
                self._retire(seq, keep=False)
                return events
        return []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def _end_ids(self, request: Request) -> dict[int, str]:
        ends = {t: "stop" for t in request.stop_token_ids}
        if not request.ignore_eos and self.tokenizer is not None:
            ends[self.tokenizer.eos_id] = "eos"
        return ends

    # ---------------------------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """Admit, run one forward over every running row, sample, retire; → the events it produced."""
        t0 = time.perf_counter()
        events = self._admit()
        running = sorted(self.running.values(), key=lambda s: s.id)
        if not running:
            return events
        drafts, draft_probs = self._draft([s for s in running if self._drafts_now(s)])
        works = plan(running, self.config.token_budget, self.config.prefill_chunk, drafts)
        step = self.model.step([w.seq.slot for w in works], [w.seq.fed for w in works],
                               [len(w.tokens) for w in works])
        ids = torch.tensor([t for w in works for t in w.tokens])        # on the host: checked there (no sync)
        snap = self.cache.snapshot(step) if any(w.drafts for w in works) else None
        images = self._span_rows(works, step)
        out = self.model(ids, step, self.cache) if images is None else self.model(ids, step, self.cache, images=images)
        logits = self._logits(out.hidden, works, step)
        keep = []
        for work, rows in zip(works, logits):
            kept, produced = self._finish_work(work, rows, draft_probs.get(work.seq.id))
            keep.append(kept)
            events += produced
        if snap is not None:
            self.cache.rollback(snap, keep)
        for work, kept in zip(works, keep):
            work.seq.fed += kept
            for start in [a for a, rows in work.seq.encoded.items() if a + rows.shape[0] <= work.seq.fed]:
                del work.seq.encoded[start]                      # the span is in the cache now
        if self.observes:
            self._observe(out.dspark_hidden, step, keep)
        for seq in running:
            if seq.done:
                self._retire(seq, keep=True)
        self.stats.steps += 1
        self.stats.tokens += step.n_tokens
        self.stats.step_seconds.append(time.perf_counter() - t0)
        return events

    def run(self) -> Iterator[StreamEvent]:
        """Step until every request has finished, yielding events as they come."""
        while self.has_work:
            yield from self.step()

    # ---------------------------------------------------------------------------------- admission
    def _admit(self) -> list[StreamEvent]:
        events = []
        while self.waiting:
            seq = self.waiting[0]
            if seq.prompt_len >= self.context and not seq.request.prompt_logits:
                self.waiting.pop(0)
                events += seq.finish("context")                  # no position left to generate into
                continue
            # prompt logits are wanted for every position, so a request for them computes them all
            hit = None if seq.request.prompt_logits else self.prefix.match(seq.key())
            if hit is not None:
                seq.slot, seq.fed = hit
                seq.cached = seq.fed
                self.stats.prefix_hits += 1
                self.stats.cached_tokens += seq.fed
            else:
                if not self.free:
                    self._evict()
                if not self.free:
                    break
                seq.slot = self.free.pop(0)
            self.waiting.pop(0)
            self.running[seq.slot] = seq
        return events

    def _evict(self) -> None:
        """Give the least recently kept sequence's slot back to the free list."""
        slot = self.prefix.evict()
        if slot is not None:
            self.cache.reset(slot)
            self.free.append(slot)

    def _retire(self, seq: Sequence, keep: bool) -> None:
        if seq.slot is None or self.running.get(seq.slot) is not seq:
            return
        del self.running[seq.slot]
        freed = self.prefix.keep(seq.slot, seq.key(seq.fed)) if keep else [seq.slot]
        for slot in freed:
            self.cache.reset(slot)
            self.free.append(slot)
        self.stats.generated += seq.produced

    # ---------------------------------------------------------------------------------- images
    def _span_rows(self, works: list[Work], step) -> SpanRows | None:
        """The image-span rows of the step's prompt chunks. An image is encoded when its span is first
        fed and held by its request until the span is in the cache (a span already there — a reused
        prefix — is never encoded); the engine keeps recent encodings by digest for other requests."""
        pieces = []
        for r, work in enumerate(works):
            seq = work.seq
            if not work.prefill or not seq.request.images:
                continue
            spans = seq.spans_in(seq.fed, len(work.tokens))
            for span in spans:
                if span.start not in seq.encoded:
                    seq.encoded[span.start] = self._encoded(span.image)
            pieces.append((step.offsets[r], seq.fed, len(work.tokens), [(s, seq.encoded[s.start]) for s in spans]))
        return call_rows(pieces, step.n_tokens, self.model.device) if pieces else None

    def _encoded(self, image) -> torch.Tensor:
        rows = self.images.get(image.digest)
        if rows is None:
            rows = self.model.encode_image(image)
            self.stats.images_encoded += 1
            self.images.put(image.digest, rows)
        return rows

    # ---------------------------------------------------------------------------------- sampling
    def _logits(self, hidden: torch.Tensor, works: list[Work], step) -> list[torch.Tensor | None]:
        """Per work: fp32 logits [n, V] of the rows it needs (none while a prompt is still incomplete)."""
        picks, spans = [], []
        for r, work in enumerate(works):
            first, n = step.offsets[r], len(work.tokens)
            if work.prefill and work.seq.request.prompt_logits:
                want = range(first, first + n)
            elif work.prefill:
                want = range(first + n - 1, first + n) if work.seq.fed + n == work.seq.prompt_len else range(0)
            else:
                want = range(first, first + n)
            spans.append((len(picks), len(want)))
            picks += list(want)
        if not picks:
            return [None] * len(works)
        logits = self.model.logits(hidden, rows=picks).float()
        if self.vocab_limit < logits.shape[-1]:
            # a head wider than the tokenizer (a padded vocabulary) must not emit undecodable ids
            logits[:, self.vocab_limit:] = float("-inf")
        return [logits[a:a + n] if n else None for a, n in spans]

    def _finish_work(self, work: Work, logits, draft_probs) -> tuple[int, list[StreamEvent]]:
        """Apply a row's logits: store prompt logits, sample, verify drafts; → (positions kept, events)."""
        seq, n = work.seq, len(work.tokens)
        if work.prefill:
            if seq.request.prompt_logits and logits is not None:
                seq.prompt_logits.append(logits.cpu())
            if seq.fed + n < seq.prompt_len:
                return n, []
            if seq.request.max_new_tokens == 0:
                return n, seq.finish("length")
            return n, seq.accept(*self._sample(seq, logits[-1:]))
        if not work.drafts:
            return 1, seq.accept(*self._sample(seq, logits))
        return self._verify(seq, work, logits, draft_probs)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, float | None, list | None]:
        """Sample a row [1, V] (masked by the request's constraint) → (token, its logprob, top logprobs)."""
        params, constraint = seq.request.sampling, seq.request.constraint
        history = [seq.tokens] if params.repetition_penalty != 1.0 else None
        masked = logits if constraint is None else constrained(logits, constraint)
        token = int(sample(masked, params, seq.generator, history)[0])
        if constraint is not None:
            constraint.advance(token)
        return (token, *self._logprobs(seq, logits[0], token))

    def _logprobs(self, seq: Sequence, logits: torch.Tensor, token: int) -> tuple[float | None, list | None]:
        n = seq.request.logprobs
        if n is None:
            return None, None
        logp = torch.log_softmax(logits[:self.vocab_limit].float(), dim=-1)
        top = logp.topk(n) if n else None
        return float(logp[token]), (None if top is None else list(zip(top.indices.tolist(), top.values.tolist())))

    # ---------------------------------------------------------------------------------- speculation
    def _drafts_now(self, seq: Sequence) -> bool:
        k = self.model.cfg.dspark_block_size
        return (seq.speculative and not seq.prefilling and seq.pending is not None and seq.room() > k
                and seq.request.max_new_tokens - seq.produced > 1)

    def _draft(self, seqs: list[Sequence]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """One batched DSpark draft for the rows that verify this step: {id: drafts}, {id: p_d [k, V]}."""
        if not seqs:
            return {}, {}
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]

        # a constrained row drafts under its constraint too (a copy walks along the drafts): forced
        # markup is then drafted right; the proposal is still what p_d says, so the rule stays lossless
        forks = [None if s.request.constraint is None else s.request.constraint.fork() for s in seqs]

        def choose(row_logits: torch.Tensor) -> torch.Tensor:
            picked = []
            for b, seq in enumerate(seqs):
                row = row_logits[b:b + 1] if forks[b] is None else constrained(row_logits[b:b + 1], forks[b])
                p = probabilities(row, seq.request.sampling)
                probs[b].append(p[0])
                greedy = seq.request.sampling.greedy
                picked.append(p.argmax(-1) if greedy else torch.multinomial(p, 1, generator=seq.generator)[:, 0])
                if forks[b] is not None:
                    forks[b].advance(int(picked[-1]))
            return torch.cat(picked)

        tokens = torch.tensor([s.pending for s in seqs], device=self.model.device)
        d = self.model.dspark_draft(tokens, [s.fed - 1 for s in seqs], self.cache, choose,
                                    slots=[s.slot for s in seqs])
        drafts = {s.id: d.ids[b, 1:].tolist() for b, s in enumerate(seqs)}
        return drafts, {s.id: torch.stack(probs[b]) for b, s in enumerate(seqs)}

    def _verify(self, seq: Sequence, work: Work, logits: torch.Tensor, draft_probs: torch.Tensor):
        constraint = seq.request.constraint
        target = logits if constraint is None else constrained_along(logits, constraint, work.tokens[1:])
        p_target = probabilities(target, seq.request.sampling)                       # [k + 1, V]
        drafts = torch.tensor(work.tokens[1:])
        accepted, following = accept_drafts(p_target, draft_probs, drafts, seq.generator)
        seq.drafted += work.drafts
        seq.accepted += accepted
        events = []
        for i, token in enumerate(work.tokens[1:1 + accepted] + [following]):
            if constraint is not None:
                constraint.advance(token)
            events += seq.accept(token, *self._logprobs(seq, logits[i], token))
            if seq.done:
                break
        return 1 + accepted, events

    def _observe(self, dspark_hidden: torch.Tensor, step, keep: list[int]) -> None:
        """Feed the DSpark rings the main rows of every kept position (all rows: a kept sequence's rings
        are then complete for a later speculative request that continues it)."""
        picks = [step.offsets[r] + i for r, k in enumerate(keep) for i in range(k)]
        kept = self.model.step(step.slots, step.starts, keep)
        self.model.dspark_observe(dspark_hidden, kept, self.cache, rows=picks)


class ImageCache:
    """Encoded images [L, D] by digest, least recently used out first: a picture sent again (the `n`
    choices of one API request, a retried request) is not encoded again. At most `capacity` kept."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, digest: str) -> torch.Tensor | None:
        rows = self.entries.get(digest)
        if rows is not None:
            self.entries.move_to_end(digest)
        return rows

    def put(self, digest: str, rows: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        self.entries[digest] = rows
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


# ------------------------------------------------------------------------------------ constraints
def constrained(logits: torch.Tensor, constraint: TokenConstraint) -> torch.Tensor:
    """One row [1, V] with the tokens the constraint forbids now at −inf."""
    allowed = constraint.allowed(logits.shape[-1])
    return logits if allowed is None else logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def constrained_along(logits: torch.Tensor, constraint: TokenConstraint, drafts: list[int]) -> torch.Tensor:
    """Verify rows [k + 1, V]: row i masked as the constraint stands after drafts[:i] (a copy walks
    them). Past a draft the constraint forbids, rows stay as they are: that draft is rejected (its
    target probability is 0), so the rows after it are never used."""
    fork, rows = constraint.fork(), []
    for i in range(logits.shape[0]):
        rows.append(constrained(logits[i:i + 1], fork))
        if i == len(drafts) or not torch.isfinite(rows[-1][0, drafts[i]]):
            break
        fork.advance(drafts[i])
    return torch.cat(rows + [logits[len(rows):]])


# ------------------------------------------------------------------------------------ batch helpers
@dataclass(frozen=True)
class GenerationConfig:
    """Settings shared by every prompt of one `generate` call."""

    max_new_tokens: int = 200
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    """Every request's own seed: a prompt's tokens are the same alone or beside others."""
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_context: int | None = None
    """Positions per sequence (prompt + completion); None: the model's RuntimeConfig.max_seq_len."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks that need a fixed token count)."""
    speculative: bool = False
    token_budget: int = DEFAULT_TOKEN_BUDGET
    skip_special_tokens: bool = False
    """Leave special tokens out of the text of every request (Request.skip_special_tokens)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")
        if self.max_context is not None and self.max_context < 1:
            raise InputError(f"max_context must be positive, got {self.max_context}")
        if any(not s for s in self.stop_strings):
            raise InputError("stop strings must not be empty")

    def request(self, prompt: list[int], images=()) -> Request:
        return Request(prompt=tuple(prompt), max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                       stop_token_ids=self.stop_token_ids, stop_strings=self.stop_strings, seed=self.seed,
                       ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens, images=images)

    def engine(self, n_slots: int) -> EngineConfig:
        return EngineConfig(n_slots=n_slots, max_context=self.max_context, token_budget=self.token_budget,
                            prefill_chunk=self.prefill_chunk, speculative=self.speculative)


def generate(model: ModelInterface, tokenizer: Tokenizer, prompts: list[list[int]],
             config: GenerationConfig | None = None, *, engine: Engine | None = None,
             images=None) -> Iterator[StreamEvent]:
    """Stream tokens for prompts (token ids), all in one batch; a new engine numbers them 0, 1, … in
    prompt order. With `engine`, run on it (its kept sequences can be continued; ids continue).
    `images`: per prompt, its image spans (vision/sources.py `prompt_images`)."""
    config = config or GenerationConfig()
    engine = engine or Engine(model, tokenizer, config.engine(len(prompts)))
    check_prompts(prompts, engine.context, tokenizer.vocab_size)            # before any work is done
    images = images or [()] * len(prompts)
    if len(images) != len(prompts):
        raise InputError(f"{len(images)} image lists for {len(prompts)} prompts")
    for p, spans in zip(prompts, images):
        engine.submit(config.request(p, spans))
    return engine.run()


def generate_all(model: ModelInterface, tokenizer: Tokenizer, prompts: list[list[int]],
                 config: GenerationConfig | None = None, on_event: Callable[[StreamEvent], None] | None = None,
                 *, engine: Engine | None = None, images=None) -> list[Completion]:
    """Run `generate` to the end, handing every event to `on_event`; completions in prompt order."""
    done = []
    for event in generate(model, tokenizer, prompts, config, engine=engine, images=images):
        if on_event is not None:
            on_event(event)
        if event.completion is not None:
            done.append(event.completion)
    return sorted(done, key=lambda c: c.request)
