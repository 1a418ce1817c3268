"""One API request on the engine: its engine requests (one per choice), their events, and the parsed
answer — the part the OpenAI and Anthropic routes share.

Shapes: V vocab, P prompt positions.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from ..engine.request import Completion, Request, StreamEvent, check_prompts
from ..engine.sampling import SamplingParams
from .constrain import ConstraintError, GrammarFactory
from .turns import TurnMemory
from ..errors import ImageError
from ..vision.sources import prompt_images
from .prompts import PromptPlan, RequestError
from .service import EngineService, Subscription
from .stream import CompletionStream, Delta


@dataclass
class Choice:
    """One choice of a response: its subscription, parser and running tallies."""

    index: int
    sub: Subscription
    parser: CompletionStream | None
    """None for raw text completions (no reasoning or tool-call parsing)."""
    think_end: int
    thinking: bool
    text: list[str] = field(default_factory=list)
    reasoning_tokens: int = 0
    in_reasoning: bool = True
    logprobs: list[StreamEvent] = field(default_factory=list)
    deltas: list[Delta] = field(default_factory=list)
    completion: Completion | None = None
    call_ids: dict[int, str] = field(default_factory=dict)

    def call_id(self, index: int, prefix: str = "call_") -> str:
        """The id of the choice's tool call `index` (made on first use: stream and message agree)."""
        return self.call_ids.setdefault(index, f"{prefix}{uuid.uuid4().hex[:24]}")

    def take(self, event: StreamEvent) -> list[Delta]:
        """An engine event → the parser's deltas (and the tallies)."""
        if event.token_id is not None:
            if self.thinking and self.in_reasoning:
                self.reasoning_tokens += 1
                self.in_reasoning = event.token_id != self.think_end
            if event.logprob is not None:
                self.logprobs.append(event)
        if event.completion is not None:
            self.completion = event.completion
        self.text.append(event.text)
        if self.parser is None:
            deltas = [Delta("content", event.text)] if event.text else []
        else:
            deltas = self.parser.push(event.text) if event.text else []
            deltas += self.parser.finish() if event.completion is not None else []
        self.deltas += deltas
        return deltas


@dataclass
class Run:
    """The engine side of one API request."""

    id: str
    choices: list[Choice]
    prompt: list[int]
    memory: TurnMemory | None = None
    """Told prompt + completion ids of each finished choice (the next turn continues them)."""
    remembered: list[int] | None = None
    """The prompt as the memory keeps it: one placeholder per image, not its span (default: `prompt`)."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def done(self) -> bool:
        return all(c.completion is not None for c in self.choices)

    async def events(self):
        """(choice, deltas, event) in arrival order until every choice has finished."""
        queues = {asyncio.ensure_future(c.sub.queue.get()): c for c in self.choices}
        while queues:
            finished, _ = await asyncio.wait(queues, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                choice = queues.pop(task)
                event = task.result()
                if isinstance(event, BaseException):
                    raise RuntimeError(f"the engine failed: {event}") from event
                deltas = choice.take(event)
                if choice.completion is not None and self.memory is not None:
                    self.memory.remember((self.remembered or self.prompt) + choice.completion.token_ids)
                yield choice, deltas, event
                if choice.completion is None:
                    queues[asyncio.ensure_future(choice.sub.queue.get())] = choice

    def cancel(self, service: EngineService) -> None:
        for choice in self.choices:
            if choice.completion is None:
                service.cancel(choice.sub)

    @property
    def usage(self) -> dict:
        completions = [c.completion for c in self.choices if c.completion is not None]
        generated = sum(c.generated_tokens for c in completions)
        cached = completions[0].cached_tokens if completions else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated,
                "total_tokens": self.prompt_tokens + generated,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in self.choices)},
                "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": self.prompt_tokens - cached}


@dataclass
class Generation:
    """Settings shared by the choices of one request."""

    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logits: bool = False
    ignore_eos: bool = False


def start(state, plan: PromptPlan | None, prompt: list[int], gen: Generation, prefix: str) -> Run:
    """Validate and submit one API request (n engine requests) to a ready server (`app.ServerState`)."""
    service, factory, tokenizer = state.service, state.grammars, state.tokenizer
    context = service.engine.context
    placeholders, spans = prompt, ()
    if plan is not None and plan.images:
        try:
            prompt, spans = prompt_images(prompt, plan.images, service.engine.model.cfg, state.image_sources,
                                          tokenizer=tokenizer)
        except ImageError as e:
            raise RequestError(str(e), "messages") from None
    check_prompt(prompt, context, tokenizer.vocab_size)
    max_tokens = gen.max_tokens if gen.max_tokens is not None else context - len(prompt)
    if len(prompt) + max_tokens > context and not (gen.prompt_logits and max_tokens == 0):
        raise RequestError(f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: together "
                           f"{len(prompt) + max_tokens}, more than the context of {context} tokens", "max_tokens")
    if gen.ignore_eos and plan is not None and (plan.forced_tools is not None or plan.json_schema is not None):
        raise RequestError("ignore_eos cannot be combined with response_format or a required tool call: their "
                           "grammar ends the answer with EOS", "ignore_eos")
    think_end = tokenizer.token_to_id("</think>")
    thinking = plan is not None and plan.thinking
    requests = []
    for i in range(gen.n):
        try:
            requests.append(Request(tuple(prompt), max_new_tokens=max_tokens, sampling=gen.sampling,
                                    stop_strings=gen.stop, seed=None if gen.seed is None else gen.seed + i,
                                    constraint=_constraint(factory, plan, max_tokens), logprobs=gen.logprobs,
                                    prompt_logits=gen.prompt_logits, images=spans, ignore_eos=gen.ignore_eos))
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(str(e)) from None
    choices: list[Choice] = []
    try:
        for i, request in enumerate(requests):
            parser = None if plan is None else CompletionStream(thinking, plan.in_calls)
            choices.append(Choice(i, service.submit(request), parser, think_end, thinking))
    except BaseException:
        for choice in choices:                      # all of the request's choices run, or none
            service.cancel(choice.sub)
        raise
    return Run(f"{prefix}{uuid.uuid4().hex[:24]}", choices, list(prompt), state.turns,
               list(placeholders) if spans else None)


def check_prompt(prompt: list[int], context: int, vocab: int) -> None:
    try:
        check_prompts([prompt], context, vocab)
    except ValueError as e:
        raise RequestError(str(e).replace("prompt 0 ", "the prompt "), "messages") from None


def _constraint(factory: GrammarFactory | None, plan: PromptPlan | None, max_tokens: int):
    if plan is None or factory is None or (plan.forced_tools is None and plan.json_schema is None):
        return None
    try:
        if plan.forced_tools is not None:
            return factory.tool_constraint(plan.forced_tools, thinking=plan.thinking, max_tokens=max_tokens,
                                           opener=not plan.in_calls)
        return factory.json_constraint(plan.json_schema, thinking=plan.thinking, max_tokens=max_tokens)
    except ConstraintError as e:
        raise RequestError(str(e), e.param) from None
