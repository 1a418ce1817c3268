"""What a request means: its messages, tools and options as a V4.1 prompt (docs/TOKENIZER-AND-CHAT.md §4).

`deepseek-recipe`, DeepSeek's request library, is the reference for the mapping (tests compare the
rendered prompts); dsv41 renders with its own encoder (`dsv41.chat`). The rules:
- thinking is on unless the request says `thinking: {"type": "disabled"}`; the effort aliases are
  low = 50, medium = high = xhigh = 75, max = 100 (default 75);
- tools are listed in the first system message (an empty one is added when there is none), each as
  {name, description ("" when absent), parameters ({} when absent)}; `tool_choice: none` lists none; a
  named function lists only that one; `required` or a named function in chat mode ends the prompt with
  the calls block's opener, so the answer starts inside it (Anthropic's `any` is rendered as `auto`, as
  the reference does, and the call is still enforced);
- `response_format` json_object (which needs the word "json" somewhere in the messages) or json_schema
  adds the schema to the first system message.
Beyond the reference: `required` / a named function in thinking mode (the reference refuses it) and the
`developer` role; the tool call and the JSON are also enforced by constrained decoding (constrain.py).
Sampling settings are taken as given (the reference replaces a thinking-mode temperature of 0.3 or a
top_p of 0.9 by 1.0 / 0.95; dsv41 does not override a client's choice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..chat.encoding import CALLS_OPEN, CALLS_SEPARATOR, encode_messages
from ..errors import UserError
from .schemas import ChatCompletionRequest, ChatMessage, MessagesRequest

EFFORT = {"low": 50, "medium": 75, "high": 75, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = 75
# The opener a required tool call's answer starts from in chat mode (the reference's rendering).
CALLS_PREFIX = CALLS_SEPARATOR + CALLS_OPEN + "\n"


class RequestError(UserError):
    """A request the API refuses: the message, and the field it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class PromptPlan:
    text: str
    """The rendered prompt, the calls opener included when the answer starts inside it."""
    thinking: bool
    in_calls: bool = False
    forced_tools: list[dict] | None = None
    """Function objects a required / named tool choice constrains the answer to."""
    json_schema: dict | None = None
    """The schema a json_object / json_schema response is constrained to."""
    tools: list[dict] = field(default_factory=list)


# ------------------------------------------------------------------------------------ OpenAI chat
def openai_chat_plan(req: ChatCompletionRequest) -> PromptPlan:
    thinking = req.thinking is None or req.thinking.type == "enabled"
    messages = [_openai_message(m, f"messages.{i}") for i, m in enumerate(req.messages)]
    tools = [_function(t.function.name, t.function.description, t.function.parameters) for t in req.tools or []]
    choice = req.tool_choice or "auto"
    forced = None
    if choice == "none":
        tools = []
    elif not isinstance(choice, str):
        tools = [t for t in tools if t["name"] == choice.function.name]
        if not tools:
            raise RequestError(f"tool_choice names the function {choice.function.name!r}, which tools does not "
                               f"define", "tool_choice")
        forced = tools
    elif choice == "required":
        if not tools:
            raise RequestError("tool_choice 'required' needs at least one tool", "tool_choice")
        forced = tools
    schema = _response_schema(req, messages)
    return _plan(messages, thinking, DEFAULT_EFFORT if req.reasoning_effort is None else EFFORT[req.reasoning_effort],
                 tools, forced, schema[0] if schema else None, schema[1] if schema else None)


def _openai_message(m: ChatMessage, where: str) -> dict:
    out: dict[str, Any] = {"role": m.role, "content": _text(m.content, f"{where}.content")}
    if m.role == "assistant":
        if m.reasoning_content is not None:
            out["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            out["tool_calls"] = [{"type": "function", "id": c.id,
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    if m.role == "developer" and not out["content"]:
        raise RequestError("a developer message needs content", f"{where}.content")
    return out


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise RequestError(f"content parts of type {part.type!r} are not supported (images need the vision "
                               f"encoder, which dsv41 does not run yet)", f"{where}.{i}.type")
        texts.append(part.text or "")
    return "\n\n".join(texts)


def _response_schema(req: ChatCompletionRequest, messages: list[dict]) -> tuple[dict, dict] | None:
    """(what the prompt shows, what decoding enforces) for a structured response, else None."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        if not any("json" in (m.get("content") or "").lower() for m in messages):
            raise RequestError("Prompt must contain the word 'json' in some form to use 'response_format' of type "
                               "'json_object'.", "response_format")
        return {"type": "json_object"}, {"type": "object"}
    if fmt.json_schema is None:
        raise RequestError("response_format of type 'json_schema' needs a json_schema with a schema",
                           "response_format.json_schema")
    return fmt.json_schema.schema_, fmt.json_schema.schema_


# ------------------------------------------------------------------------------------ Anthropic
def anthropic_plan(req: MessagesRequest) -> PromptPlan:
    thinking = req.thinking is None or req.thinking.type == "enabled"
    messages = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n\n".join(b.text or "" for b in req.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages += _anthropic_messages(m, f"messages.{i}")
    tools = [_function(t.name, t.description, t.input_schema) for t in req.tools or []]
    choice, forced = req.tool_choice, None
    if choice is not None and choice.type == "none":
        tools = []
    elif choice is not None and choice.type == "tool":
        tools = [t for t in tools if t["name"] == choice.name]
        if not tools:
            raise RequestError(f"tool_choice names the tool {choice.name!r}, which tools does not define",
                               "tool_choice")
        forced = tools
    elif choice is not None and choice.type == "any":
        if not tools:
            raise RequestError("tool_choice 'any' needs at least one tool", "tool_choice")
        forced = tools
    # the reference renders `any` as `auto` (no calls opener); dsv41 keeps that prompt and enforces the call
    opener = choice is None or choice.type != "any"
    return _plan(messages, thinking, DEFAULT_EFFORT, tools, forced, None, None, open_calls=opener)


def _anthropic_messages(m, where: str) -> list[dict]:
    """One Anthropic message → encoder messages (tool results become tool messages, as the encoder
    merges them into the user turn)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        texts, reasoning, calls = [], None, []
        for i, b in enumerate(m.content):
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type in ("thinking", "redacted_thinking"):
                reasoning = (reasoning or "") + (b.thinking or "")
            elif b.type == "tool_use":
                calls.append({"type": "function", "id": b.id,
                              "function": {"name": b.name, "arguments": b.input or {}}})
            else:
                raise RequestError(f"assistant content blocks of type {b.type!r} are not supported",
                                   f"{where}.content.{i}.type")
        out = {"role": "assistant", "content": "".join(texts)}
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if calls:
            out["tool_calls"] = calls
        return [out]
    out, texts = [], []
    for i, b in enumerate(m.content):
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "tool_result":
            content = b.content if isinstance(b.content, str) or b.content is None else \
                "\n\n".join(x.text or "" for x in b.content if x.type == "text")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content or ""})
        else:
            raise RequestError(f"user content blocks of type {b.type!r} are not supported (images need the "
                               f"vision encoder, which dsv41 does not run yet)", f"{where}.content.{i}.type")
    if texts:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


# ------------------------------------------------------------------------------------ shared
def _function(name: str, description: str | None, parameters: dict | None) -> dict:
    return {"name": name, "description": description or "", "parameters": parameters or {}}


def _plan(messages: list[dict], thinking: bool, effort: int, tools: list[dict], forced: list[dict] | None,
          shown_schema: dict | None, enforced_schema: dict | None, open_calls: bool = True) -> PromptPlan:
    if tools or shown_schema is not None:
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        if tools:
            messages[0]["tools"] = [{"type": "function", "function": t} for t in tools]
        if shown_schema is not None:
            messages[0]["response_format"] = shown_schema
    try:
        text = encode_messages(messages, "thinking" if thinking else "chat",
                               reasoning_effort=effort if thinking else None)
    except ValueError as e:
        raise RequestError(str(e), "messages") from None
    in_calls = forced is not None and not thinking and open_calls
    return PromptPlan(text + (CALLS_PREFIX if in_calls else ""), thinking, in_calls, forced, enforced_schema, tools)


def tool_arguments_json(arguments: str) -> dict:
    """Parse a tool call's arguments (a JSON object string)."""
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError("tool-call arguments must be a JSON object")
    return value
