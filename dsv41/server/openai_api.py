"""The OpenAI routes: `/v1/chat/completions` and `/v1/completions`, streamed (SSE) or whole.

Response shapes follow the OpenAI API with DeepSeek's additions: `reasoning_content` on the message and
in stream deltas, and `prompt_cache_hit_tokens` / `prompt_cache_miss_tokens` beside the standard
`prompt_tokens_details.cached_tokens` in `usage`. A client that goes away cancels its request, streamed
(the event generator is cancelled) or not (the handler polls the connection), so its slot frees at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from ..engine.sampling import SamplingParams
from .app import ServerState
from .prompts import RequestError, openai_chat_plan
from .runner import Choice, Generation, Run, start
from .schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from .stream import Delta

router = APIRouter()

# How often a non-streaming handler checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
MAX_STOP_STRINGS = 16
# Keep-alive comments on quiet streams (a long prefill), so proxies do not time the connection out.
PING_S = 15


def server(request: Request) -> ServerState:
    return request.app.state.dsv41


def event_stream(events, state: ServerState) -> EventSourceResponse:
    """An SSE response; at shutdown a running stream gets the drain time to finish (not cut at once)."""
    return EventSourceResponse(events, ping=PING_S, shutdown_grace_period=state.config.drain_timeout_s)


def logit_bias_of(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isdigit() and int(key) < vocab):
            raise RequestError(f"logit_bias keys are token ids below the vocabulary of {vocab}; got {key!r}",
                               "logit_bias")
        if not -100 <= value <= 100:
            raise RequestError(f"logit_bias values are in [-100, 100]; token {key} has {value}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def sampling_of(body, vocab: int) -> SamplingParams:
    bias = logit_bias_of(body.logit_bias, vocab)
    try:
        return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              min_p=body.min_p, repetition_penalty=body.repetition_penalty, logit_bias=bias)
    except ValueError as e:
        raise RequestError(str(e)) from None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if any(not s for s in stops):
        raise RequestError("stop strings must not be empty", "stop")
    return tuple(stops)


async def collect(run: Run, request: Request, state: ServerState) -> None:
    """Consume a run's events to the end, cancelling it if the client disconnects meanwhile."""
    async def drain():
        async for _ in run.events():
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return None
    finally:
        if not run.done:
            run.cancel(state.service)


def finish_reason(choice: Choice) -> str:
    reason = choice.completion.finish_reason
    if choice.parser is not None and choice.parser.tool_calls and reason in ("eos", "stop"):
        return "tool_calls"
    return "length" if reason in ("length", "context") else "stop"


def token_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, events) -> dict:
    content = []
    for e in events:
        entry = token_entry(tokenizer, e.token_id, e.logprob)
        entry["top_logprobs"] = [token_entry(tokenizer, t, lp) for t, lp in e.top_logprobs or []]
        content.append(entry)
    return {"content": content}


# ------------------------------------------------------------------------------------ chat
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = server(request).require(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    plan = openai_chat_plan(body)
    prompt = state.encode_prompt(plan.text)
    gen = Generation(max_tokens=body.max_completion_tokens or body.max_tokens,
                     sampling=sampling_of(body, state.tokenizer.vocab_size),
                     stop=stop_strings(body.stop), seed=body.seed, n=body.n, ignore_eos=body.ignore_eos,
                     logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    run = start(state, plan, prompt, gen, "chatcmpl-")
    head = {"id": run.id, "created": int(time.time()), "model": state.config.model_name}
    if body.stream:
        return event_stream(chat_stream(run, state, head, body.stream_options or StreamOptions()), state)
    await collect(run, request, state)
    choices = [chat_choice(c, state, body.logprobs) for c in run.choices if c.completion is not None]
    return {**head, "object": "chat.completion", "choices": choices, "usage": run.usage}


def chat_choice(choice: Choice, state: ServerState, logprobs: bool) -> dict:
    parts: dict[str, list[str]] = {"reasoning": [], "content": []}
    for delta in choice.deltas:
        if delta.kind in parts:
            parts[delta.kind].append(delta.text)
    calls = [{"id": choice.call_id(i), **call} for i, call in enumerate(choice.parser.tool_calls)]
    content = "".join(parts["content"])
    message = {"role": "assistant", "content": content if content or not calls else None}
    if choice.thinking:
        message["reasoning_content"] = "".join(parts["reasoning"])
    if calls:
        message["tool_calls"] = calls
    return {"index": choice.index, "message": message, "finish_reason": finish_reason(choice),
            "logprobs": chat_logprobs(state.tokenizer, choice.logprobs) if logprobs else None}


def chat_delta(choice: Choice, delta: Delta) -> dict | None:
    if delta.kind == "reasoning":
        return {"reasoning_content": delta.text}
    if delta.kind == "content":
        return {"content": delta.text}
    if delta.kind == "tool_start":
        return {"tool_calls": [{"index": delta.index, "id": choice.call_id(delta.index), "type": "function",
                                "function": {"name": delta.name, "arguments": ""}}]}
    if delta.kind == "tool_arguments":
        return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.text}}]}
    return None


async def chat_stream(run: Run, state: ServerState, head: dict, options: StreamOptions):
    def chunk(choices: list[dict], **extra) -> dict:
        return {"data": json.dumps({**head, "object": "chat.completion.chunk", "choices": choices, **extra})}

    tokenizer = state.tokenizer
    try:
        for choice in run.choices:
            yield chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        async for choice, deltas, event in run.events():
            logprobs = chat_logprobs(tokenizer, [event]) if event.logprob is not None else None
            for delta in deltas:
                body = chat_delta(choice, delta)
                if body is not None:
                    yield chunk([{"index": choice.index, "delta": body, "logprobs": logprobs, "finish_reason": None}])
                    logprobs = None
            if logprobs is not None:                       # a token whose text the parser still holds
                yield chunk([{"index": choice.index, "delta": {}, "logprobs": logprobs, "finish_reason": None}])
            if event.completion is not None:
                yield chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                              "finish_reason": finish_reason(choice)}])
        if options.include_usage:
            yield chunk([], usage=run.usage)
        yield {"data": "[DONE]"}
    except RuntimeError as e:                              # the engine failed: say so in the stream
        yield {"data": json.dumps({"error": {"message": str(e), "type": "server_error", "param": None,
                                             "code": None}})}
    finally:
        if not run.done:                                   # the client went away mid-stream
            run.cancel(state.service)


# ------------------------------------------------------------------------------------ completions
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = server(request).require(body.model)
    prompts = completion_prompts(body, state)
    scoring = body.echo and body.logprobs is not None
    if scoring and body.stream:
        raise RequestError("echo with logprobs (prompt log-probabilities) is answered whole; send stream: false",
                           "stream")
    gen = Generation(max_tokens=body.max_tokens, sampling=sampling_of(body, state.tokenizer.vocab_size),
                     stop=stop_strings(body.stop), seed=body.seed, n=body.n, logprobs=body.logprobs,
                     prompt_logits=scoring, ignore_eos=body.ignore_eos)
    runs: list[Run | None] = []
    try:
        for ids, _ in prompts:
            runs.append(None if body.max_tokens == 0 and not scoring else start(state, None, ids, gen, "cmpl-"))
    except BaseException:
        for run in runs:
            if run is not None:
                run.cancel(state.service)
        raise
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": state.config.model_name}
    if body.stream:
        return event_stream(completion_stream(runs, prompts, state, head, body), state)
    for run in runs:
        if run is not None:
            await collect(run, request, state)
    choices = []
    for p, (run, (ids, text)) in enumerate(zip(runs, prompts)):
        for j in range(body.n):
            choice = None if run is None else run.choices[j]
            choices.append(completion_choice(p * body.n + j, choice, ids, text, body, state))
    return {**head, "object": "text_completion", "choices": choices, "usage": completions_usage(runs, prompts)}


def completion_prompts(body: CompletionRequest, state: ServerState) -> list[tuple[list[int], str]]:
    """(ids, the text echo shows) per prompt; text prompts get BOS first, as `dsv41 score` does."""
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise RequestError("prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in raw):
        raw = [raw]
    tokenizer, out = state.tokenizer, []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            if not p:
                raise RequestError(f"prompt {i} is empty", "prompt")
            ids = tokenizer.encode(p)
            out.append(([tokenizer.bos_id] + ids if ids[:1] != [tokenizer.bos_id] else ids, p))
        else:
            if not p:
                raise RequestError(f"prompt {i} is an empty token list", "prompt")
            bad = [t for t in p if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise RequestError(f"prompt {i} holds {bad[0]}, not a token id in [0, {tokenizer.vocab_size})",
                                   "prompt")
            out.append((list(p), tokenizer.decode(p)))
    return out


def prompt_logprobs(choice: Choice, ids: list[int], state: ServerState, top: int) -> list:
    """(token id, logprob or None, top alternatives) per prompt token: the first has none."""
    logp = choice.completion.prompt_logits.log_softmax(-1)
    rows = [(ids[0], None, None)]
    for t in range(1, len(ids)):
        best = logp[t - 1].topk(top) if top else None
        alts = None if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
        rows.append((ids[t], float(logp[t - 1, ids[t]]), alts))
    return rows


def legacy_logprobs(rows, state: ServerState, offset: int) -> dict:
    """The completions API's logprobs object for (token id, logprob, top) rows."""
    decode = state.tokenizer.decode
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, top in rows:
        text = decode([token])
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else {decode([t]): lp for t, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def completion_choice(index: int, choice: Choice | None, ids: list[int], text: str, body: CompletionRequest,
                      state: ServerState) -> dict:
    generated = "" if choice is None else "".join(choice.text)
    rows = []
    if body.echo and body.logprobs is not None and choice is not None:
        rows = prompt_logprobs(choice, ids, state, body.logprobs)
        if ids[0] == state.tokenizer.bos_id and not text.startswith(state.tokenizer.decode([ids[0]])):
            rows = rows[1:]                              # the BOS the server put first is not echoed
    if body.logprobs is not None and choice is not None:
        rows += [(e.token_id, e.logprob, e.top_logprobs) for e in choice.logprobs]
    shown = (text if body.echo else "") + generated
    reason = "length" if choice is None else finish_reason(choice)
    return {"index": index, "text": shown, "finish_reason": reason,
            "logprobs": legacy_logprobs(rows, state, 0) if body.logprobs is not None else None}


def completions_usage(runs: list[Run | None], prompts) -> dict:
    prompt = sum(len(ids) for ids, _ in prompts)
    generated = sum(c.completion.generated_tokens for r in runs if r is not None for c in r.choices
                    if c.completion is not None)
    cached = sum(r.usage["prompt_tokens_details"]["cached_tokens"] for r in runs if r is not None)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def completion_stream(runs, prompts, state: ServerState, head: dict, body: CompletionRequest):
    def chunk(choices: list[dict], **extra) -> dict:
        return {"data": json.dumps({**head, "object": "text_completion", "choices": choices, **extra})}

    try:
        for p, (run, (ids, text)) in enumerate(zip(runs, prompts)):
            if body.echo:
                for j in range(body.n):
                    yield chunk([{"index": p * body.n + j, "text": text, "logprobs": None, "finish_reason": None}])
            if run is None:
                for j in range(body.n):
                    yield chunk([{"index": p * body.n + j, "text": "", "logprobs": None, "finish_reason": "length"}])
                continue
            async for choice, deltas, event in run.events():
                index = p * body.n + choice.index
                piece = "".join(d.text for d in deltas)
                logprobs = None
                if body.logprobs is not None and event.logprob is not None:
                    logprobs = legacy_logprobs([(event.token_id, event.logprob, event.top_logprobs)], state, 0)
                if piece or logprobs is not None:
                    yield chunk([{"index": index, "text": piece, "logprobs": logprobs, "finish_reason": None}])
                if event.completion is not None:
                    yield chunk([{"index": index, "text": "", "logprobs": None,
                                  "finish_reason": finish_reason(choice)}])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=completions_usage(runs, prompts))
        yield {"data": "[DONE]"}
    finally:
        for run in runs:
            if run is not None and not run.done:
                run.cancel(state.service)
