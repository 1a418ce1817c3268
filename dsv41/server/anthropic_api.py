"""The Anthropic route: `/v1/messages`, whole or streamed in Anthropic's event shapes.

A response is a list of content blocks: `thinking` (the reasoning, thinking mode), `text`, then one
`tool_use` per call with its parsed `input`. A stream opens a block when its first delta arrives and
closes it when the kind changes (message_start, content_block_start / _delta / _stop …, message_delta
with the stop reason and output tokens, message_stop). Usage counts `input_tokens` apart from the
prompt tokens reused from a kept sequence (`cache_read_input_tokens`), as Anthropic reports cache reads.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request

from ..engine.sampling import SamplingParams
from .app import ServerState
from .openai_api import collect, event_stream, server, stop_strings
from .prompts import RequestError, anthropic_plan
from .runner import Choice, Generation, Run, start
from .schemas import MessagesRequest
from .stream import Delta

router = APIRouter()

TOOL_ID_PREFIX = "toolu_"


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    c = choice.completion
    if choice.parser.tool_calls and c.finish_reason in ("eos", "stop"):
        return "tool_use", None
    if c.finish_reason == "stop" and isinstance(c.stop, str):
        return "stop_sequence", c.stop
    if c.finish_reason in ("length", "context"):
        return "max_tokens", None
    return "end_turn", None


def usage(run: Run, output_tokens: int | None = None) -> dict:
    u = run.usage
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens":
            u["completion_tokens"] if output_tokens is None else output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_input(arguments: str) -> dict:
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"value": value}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state = server(request).require(body.model)
    try:
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    except ValueError as e:
        raise RequestError(str(e)) from None
    plan = anthropic_plan(body)
    gen = Generation(max_tokens=body.max_tokens, sampling=sampling, stop=stop_strings(body.stop_sequences))
    run = start(state, plan, state.encode_prompt(plan.text), gen, "msg_")
    if body.stream:
        return event_stream(message_events(run, state), state)
    await collect(run, request, state)
    [choice] = run.choices
    reason, sequence = stop_reason(choice)
    return {**message_head(run, state), "content": content_blocks(choice), "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(run)}


def message_head(run: Run, state: ServerState) -> dict:
    return {"id": run.id, "type": "message", "role": "assistant", "model": state.config.model_name}


def content_blocks(choice: Choice) -> list[dict]:
    reasoning = "".join(d.text for d in choice.deltas if d.kind == "reasoning")
    text = "".join(d.text for d in choice.deltas if d.kind == "content")
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if choice.thinking else []
    if text or not (blocks or choice.parser.tool_calls):         # never an empty content list
        blocks.append({"type": "text", "text": text})
    for i, call in enumerate(choice.parser.tool_calls):
        blocks.append({"type": "tool_use", "id": choice.call_id(i, TOOL_ID_PREFIX), "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    return blocks


class BlockStream:
    """Deltas → Anthropic content-block events, one open block at a time."""

    def __init__(self, choice: Choice):
        self.choice = choice
        self.index = -1
        self.open: str | None = None                   # "thinking" | "text" | "tool_use"

    def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"index": self.index, "delta": delta}

    def push(self, d: Delta) -> list[tuple[str, dict]]:
        events = []
        if d.kind == "reasoning":
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": d.text}))
        elif d.kind == "content":
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": d.text}))
        elif d.kind == "tool_start":
            events += self._start("tool_use", {"type": "tool_use", "id": self.choice.call_id(d.index, TOOL_ID_PREFIX),
                                               "name": d.name, "input": {}})
        elif d.kind == "tool_arguments" and self.open == "tool_use":
            events.append(self._delta({"type": "input_json_delta", "partial_json": d.text}))
        elif d.kind == "tool_end":
            events += self.close()
        return events


async def message_events(run: Run, state: ServerState):
    def sse(kind: str, data: dict) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **data})}

    [choice] = run.choices
    blocks = BlockStream(choice)
    try:
        yield sse("message_start", {"message": {**message_head(run, state), "content": [], "stop_reason": None,
                                                "stop_sequence": None, "usage": usage(run, 0)}})
        yield sse("ping", {})
        try:
            async for _, deltas, _ in run.events():
                for d in deltas:
                    for kind, data in blocks.push(d):
                        yield sse(kind, data)
        except RuntimeError as e:
            yield sse("error", {"error": {"type": "api_error", "message": str(e)}})
            return
        if blocks.index < 0:                                        # never an empty content list
            for kind, data in blocks.push(Delta("content", "")):
                yield sse(kind, data)
        for kind, data in blocks.close():
            yield sse(kind, data)
        reason, sequence = stop_reason(choice)
        yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": usage(run)["output_tokens"]}})
        yield sse("message_stop", {})
    finally:
        if not run.done:
            run.cancel(state.service)
