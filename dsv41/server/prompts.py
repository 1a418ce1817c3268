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
  adds the schema to the first system message;
- images (OpenAI `image_url` parts in user and tool messages, Anthropic `image` blocks, also inside tool
  results) become the encoder's image blocks; `PromptPlan.images` lists their records in prompt order.
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
    images: list[dict] = field(default_factory=list)
    """The prompt's image records in prompt order, one per image placeholder (vision/sources.py reads them)."""


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
    out: dict[str, Any] = {"role": m.role, "content": _content(m.role, m.content, f"{where}.content")}
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


IMAGE_ROLES = ("user", "tool")


def _content(role: str, content, where: str) -> str | list[dict]:
    """A message's content: its text, or (with images) text and image blocks for the encoder."""
    if content is None or isinstance(content, str):
        return content or ""
    blocks = []
    for i, part in enumerate(content):
        if part.type == "text":
            blocks.append({"type": "text", "text": part.text or ""})
        elif part.type == "image_url" and role in IMAGE_ROLES:
            url = part.image_url if isinstance(part.image_url, str) else getattr(part.image_url, "url", None)
            if not url:
                raise RequestError("an image_url part needs image_url.url", f"{where}.{i}.image_url")
            blocks.append({"type": "image_url", "image_url": {"url": url}})
        elif part.type == "image_url":
            raise RequestError(f"{role} messages cannot carry images (user and tool messages can)", f"{where}.{i}.type")
        else:
            raise RequestError(f"content parts of type {part.type!r} are not supported (text and image_url are)",
                               f"{where}.{i}.type")
    return _text_or_blocks(blocks)


def _text_or_blocks(blocks: list[dict]) -> str | list[dict]:
    """Text blocks alone become one text (joined as the encoder joins them); with an image, the blocks."""
    if all(b["type"] == "text" for b in blocks):
        return "\n\n".join(b["text"] for b in blocks)
    return blocks


def _message_text(m: dict) -> str:
    content = m.get("content")
    if isinstance(content, list):
        return "\n\n".join(b.get("text") or "" for b in content if b.get("type") == "text")
    return content or ""


def _response_schema(req: ChatCompletionRequest, messages: list[dict]) -> tuple[dict, dict] | None:
    """(what the prompt shows, what decoding enforces) for a structured response, else None."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        if not any("json" in _message_text(m).lower() for m in messages):
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
    out, blocks = [], []
    for i, b in enumerate(m.content):
        if b.type == "text":
            blocks.append({"type": "text", "text": b.text or ""})
        elif b.type == "image":
            blocks.append(_anthropic_image(b, f"{where}.content.{i}"))
        elif b.type == "tool_result":
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": _tool_result_content(b.content, f"{where}.content.{i}.content")})
        else:
            raise RequestError(f"user content blocks of type {b.type!r} are not supported (text, image and "
                               f"tool_result are)", f"{where}.content.{i}.type")
    if blocks:
        out.append({"role": "user", "content": _text_or_blocks(blocks)})
    return out


def _anthropic_image(b, where: str) -> dict:
    source = b.source
    if not isinstance(source, dict) or not (source.get("data") or source.get("url")):
        raise RequestError("an image block needs a source with base64 data or a url", f"{where}.source")
    return {"type": "image", "source": source}


def _tool_result_content(content, where: str) -> str | list[dict]:
    """A tool result's text, or its text and image blocks (images in tool results reach the prompt too)."""
    if content is None or isinstance(content, str):
        return content or ""
    blocks = []
    for i, x in enumerate(content):
        if x.type == "image":
            blocks.append(_anthropic_image(x, f"{where}.{i}"))
        elif x.type == "text":
            blocks.append({"type": "text", "text": x.text or ""})
    return _text_or_blocks(blocks)


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
        text, media = encode_messages(messages, "thinking" if thinking else "chat",
                                      reasoning_effort=effort if thinking else None, return_multi_modal_data=True)
    except ValueError as e:
        raise RequestError(str(e), "messages") from None
    in_calls = forced is not None and not thinking and open_calls
    return PromptPlan(text + (CALLS_PREFIX if in_calls else ""), thinking, in_calls, forced, enforced_schema, tools,
                      media["images"])


def tool_arguments_json(arguments: str) -> dict:
    """Parse a tool call's arguments (a JSON object string)."""
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError("tool-call arguments must be a JSON object")
    return value
