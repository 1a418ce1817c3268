"""DeepSeek-V4.1 prompt encoder: chat messages -> prompt text.

Rules follow docs/TOKENIZER-AND-CHAT.md §3-§5 (the official `encoding/encoding.py` is the authority;
§6 fixtures pin it). The engine never sees this module: it only receives token ids (STYLE.md P10).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

Message = dict[str, Any]


class ChatFormatError(InputError):
    """A conversation the V4.1 prompt format cannot express (the message names the message or block)."""


# --- special strings (spec §1.1, §3): full-width bar U+FF5C and U+2581, as in tokenizer.json ---
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"

# --- DSML tool-call tags of V4.1: exactly one space after the DSML token (spec §4.3, pitfall 6) ---
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f"<{DSML} invoke"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAMETER_OPEN = f"<{DSML} parameter"
PARAMETER_CLOSE = f"</{DSML} parameter>"
# Separator between an assistant's content and its calls block (spec §4.3).
CALLS_SEPARATOR = "\n\n"
# Parts of one user turn, text blocks of one message, and system extras are joined with this.
PART_SEPARATOR = "\n\n"

# --- templates (spec §3) ---
EFFORT_PREFIX = (
    "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# Tools block (spec §5; identical, byte for byte, in every port checked: see the report).
TOOLS_BLOCK = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

# Task tokens written instead of (or, for "action", after) the assistant cue (spec §3, §4.4).
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Official aliases (spec §4.2). The SGLang / vLLM ports use 25/50/75/100 with an extra "xhigh";
# dsv41 follows the official encoder and the DeepSeek API.
REASONING_EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
REASONING_EFFORT_RANGE = (1, 100)

THINKING_MODES = ("chat", "thinking")

# Roles that survive before the last user-like message when old reasoning is dropped (spec §4.1.4).
ROLES_KEPT_BEFORE_LAST_USER = frozenset(
    {"user", "system", "tool", "latest_reminder", "direct_search_results"}
)

LITERAL_IMAGE_TOKEN_ERROR = (
    f"Message content contains image special token '{IMAGE_PLACEHOLDER}'. "
    "Images should be provided as image content blocks."
)


def to_json(value: Any) -> str:
    # Non-ASCII kept, default separators ", " and ": " (spec §3).
    return json.dumps(value, ensure_ascii=False)


def resolve_reasoning_effort(effort: int | str | None) -> int:
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    low, high = REASONING_EFFORT_RANGE
    if type(effort) is int and low <= effort <= high:  # bool is not a budget
        return effort
    if isinstance(effort, str) and effort in REASONING_EFFORT_ALIASES:
        return REASONING_EFFORT_ALIASES[effort]
    raise ChatFormatError(
                          f"reasoning_effort must be an integer in {low}..{high} or one of "
                          f"{sorted(REASONING_EFFORT_ALIASES)}; got {effort!r}"
    )


# ------------------------------------------------------------------------------------------------
# Preprocessing step 1: images (spec §4.1.1)
# ------------------------------------------------------------------------------------------------

def _image_record(block: dict) -> dict:
    record: dict[str, Any] = {"type": "image"}
    if block.get("type") == "image_url":
        image_url = block.get("image_url")
        record["url"] = image_url if isinstance(image_url, str) else (image_url or {}).get("url", "")
    else:
        record.update({key: block[key] for key in ("source", "url", "data") if key in block})
    if not any(record.get(key) for key in ("source", "url", "data")):
        raise ChatFormatError(f"image content block has no source, url or data: {block!r}")
    return record


def _prepare_block(block: Any) -> dict:
    if not isinstance(block, dict):
        raise ChatFormatError(f"content blocks must be objects; got {block!r}")
    kind = block.get("type")
    if kind in ("image", "image_url"):
        # The record rides on its placeholder so images can be listed in final prompt order.
        return {"type": "text", "text": IMAGE_PLACEHOLDER, "image": _image_record(block)}
    if kind == "tool_result" and isinstance(block.get("content"), list):
        return {**block, "content": [_prepare_block(inner) for inner in block["content"]]}
    if kind == "text" and IMAGE_PLACEHOLDER in (block.get("text") or ""):
        raise ChatFormatError(
                              f"text content block contains the image special token '{IMAGE_PLACEHOLDER}'; "
                              "send images as image content blocks"
        )
    return block


def _reject_literal_image_token(message: Message) -> None:
    content = message.get("content")
    if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
        raise ChatFormatError(LITERAL_IMAGE_TOKEN_ERROR)
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and IMAGE_PLACEHOLDER in reasoning:
        raise ChatFormatError(
                              f"reasoning_content contains the image special token '{IMAGE_PLACEHOLDER}'"
        )


def _joined_text(blocks: list[dict]) -> str:
    return PART_SEPARATOR.join(b.get("text") or "" for b in blocks if b.get("type") == "text")


def _prepare_message(message: Message) -> Message:
    msg = copy.deepcopy(message)
    _reject_literal_image_token(msg)
    if isinstance(msg.get("content"), list) and "content_blocks" not in msg:
        msg["content_blocks"] = msg.pop("content")
    if msg.get("content_blocks"):
        msg["content_blocks"] = [_prepare_block(b) for b in msg["content_blocks"]]
        if not isinstance(msg.get("content"), str):
            msg["content"] = _joined_text(msg["content_blocks"])
    return msg


# ------------------------------------------------------------------------------------------------
# Preprocessing steps 2-4: tool messages, result order, old reasoning (spec §4.1.2-§4.1.4)
# ------------------------------------------------------------------------------------------------

def _tool_result_block(tool_message: Message) -> dict:
    block = {
        "type": "tool_result",
        "tool_use_id": tool_message.get("tool_call_id", ""),
        "content": tool_message.get("content", ""),
    }
    images = [b["image"] for b in tool_message.get("content_blocks") or [] if "image" in b]
    if images:
        block["images"] = images
    return block


def _append_tool(merged: list[Message], tool_message: Message) -> None:
    block = _tool_result_block(tool_message)
    if merged and merged[-1].get("role") == "user":
        merged[-1]["content_blocks"].append(block)
    else:
        merged.append({"role": "user", "content_blocks": [block]})


def _append_user(merged: list[Message], user_message: Message) -> None:
    blocks = user_message.get("content_blocks")
    if blocks is None:
        blocks = [{"type": "text", "text": user_message.get("content", "")}]
    previous = merged[-1] if merged else None
    if previous is not None and previous.get("role") == "user" and previous.get("task") is None:
        previous["content_blocks"].extend(blocks)
    else:
        user_message["content_blocks"] = blocks
        merged.append(user_message)


def merge_tool_messages(messages: list[Message]) -> list[Message]:
    merged: list[Message] = []
    for msg in messages:
        role = msg.get("role")
        if role == "tool":
            _append_tool(merged, msg)
        elif role == "user":
            _append_user(merged, msg)
        else:
            merged.append(msg)
    return merged


def _call_positions(tool_calls: list[dict]) -> dict[str, int]:
    positions = {}
    for index, call in enumerate(tool_calls):
        call_id = call.get("id") or call.get("function", {}).get("id", "")
        if call_id:
            positions[call_id] = index
    return positions


def _sort_results(message: Message, positions: dict[str, int]) -> None:
    blocks = message["content_blocks"]
    results = [b for b in blocks if b.get("type") == "tool_result"]
    if len(results) < 2 or not positions:
        return
    ordered = iter(sorted(results, key=lambda b: positions.get(b.get("tool_use_id", ""), 0)))
    message["content_blocks"] = [
        next(ordered) if b.get("type") == "tool_result" else b for b in blocks
    ]


def sort_tool_results(messages: list[Message]) -> list[Message]:
    # Results follow the ids of the latest assistant message that made calls (spec §4.1.3).
    positions: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            positions = _call_positions(msg["tool_calls"])
        elif msg.get("role") == "user" and msg.get("content_blocks"):
            _sort_results(msg, positions)
    return messages


def last_user_index(messages: list[Message]) -> int:
    # "User-like": user, developer, or a system message after the first position (spec §4.1.4).
    for index in range(len(messages) - 1, -1, -1):
        if _is_user_like(index, messages[index]):
            return index
    return -1


def _is_user_like(index: int, message: Message) -> bool:
    role = message.get("role")
    return role in ("user", "developer") or (role == "system" and index > 0)


def _slimmed(message: Message) -> Message | None:
    role = message.get("role")
    if role in ROLES_KEPT_BEFORE_LAST_USER:
        return message
    if role == "assistant":
        return {k: v for k, v in message.items() if k != "reasoning_content"}
    return None


def _drop_old_thinking(messages: list[Message], n_context: int) -> tuple[list[Message], int]:
    # Returns the kept messages and how many of them came from the context.
    last_user = last_user_index(messages)
    kept: list[Message] = []
    kept_context = 0
    for index, msg in enumerate(messages):
        msg = _slimmed(msg) if index < last_user else msg
        if msg is not None:
            kept.append(msg)
            kept_context += index < n_context
    return kept, kept_context


# ------------------------------------------------------------------------------------------------
# Rendering (spec §4.3, §4.4, §5)
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _PromptRules:
    thinking: bool
    drop_thinking: bool  # effective value: off when any message carries tools
    effort: int
    last_user: int


def render_tools(tools: list[dict]) -> str:
    schemas = "\n".join(to_json(tool["function"]) for tool in tools)
    return TOOLS_BLOCK.replace("{schemas}", schemas)


def _extras(message: Message) -> str:
    text = ""
    if message.get("tools"):
        text += PART_SEPARATOR + render_tools(message["tools"])
    if message.get("response_format"):
        schema = to_json(message["response_format"])
        text += PART_SEPARATOR + RESPONSE_FORMAT.replace("{schema}", schema)
    return text


def _render_system(index: int, messages: list[Message], rules: _PromptRules) -> str:
    message = messages[index]
    token = SYSTEM if index > 0 else ""  # at index 0 the prefix already wrote it
    return token + (message.get("content") or "") + _extras(message)


def _render_developer(index: int, messages: list[Message], rules: _PromptRules) -> str:
    message = messages[index]
    if not message.get("content"):
        raise ChatFormatError(f"developer message at index {index} must have non-empty content")
    return USER + message["content"] + _extras(message)


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):
        return PART_SEPARATOR.join(
            (b.get("text") or "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
            for b in content
        )
    return "" if content is None else str(content)


def _render_block(block: dict) -> str:
    kind = block.get("type")
    if kind == "text":
        return block.get("text") or ""
    if kind == "tool_result":
        return TOOL_RESULT_OPEN + _tool_result_text(block.get("content")) + TOOL_RESULT_CLOSE
    return f"[Unsupported {kind}]"


def _render_user(index: int, messages: list[Message], rules: _PromptRules) -> str:
    message = messages[index]
    blocks = message.get("content_blocks")
    if blocks:
        return USER + PART_SEPARATOR.join(_render_block(b) for b in blocks)
    return USER + (message.get("content") or "")


def _render_latest_reminder(index: int, messages: list[Message], rules: _PromptRules) -> str:
    return LATEST_REMINDER + (messages[index].get("content") or "")


def _call_arguments(raw: Any, name: str) -> dict:
    arguments = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"arguments of tool call {name!r} must be a JSON object; got {raw!r}")
    return arguments


def render_parameter(key: str, value: Any) -> str:
    # Strings are written raw (no escaping, spec pitfall 7); everything else as JSON.
    if isinstance(value, str):
        return f'{PARAMETER_OPEN} name="{key}" string="true">{value}{PARAMETER_CLOSE}'
    return f'{PARAMETER_OPEN} name="{key}" string="false">{to_json(value)}{PARAMETER_CLOSE}'


def render_invoke(tool_call: dict) -> str:
    function = tool_call["function"]
    name = function["name"]
    arguments = _call_arguments(function.get("arguments"), name)
    parameters = "\n".join(render_parameter(k, v) for k, v in arguments.items())
    return f'{INVOKE_OPEN} name="{name}">\n{parameters}\n{INVOKE_CLOSE}'


def render_tool_calls(tool_calls: list[dict] | None) -> str:
    if not tool_calls:
        return ""
    invokes = "\n".join(render_invoke(call) for call in tool_calls)
    return f"{CALLS_SEPARATOR}{CALLS_OPEN}\n{invokes}\n{CALLS_CLOSE}"


def _reasoning_part(index: int, messages: list[Message], rules: _PromptRules) -> str:
    # Reasoning is shown only in thinking mode, never right after a task message, and (when
    # dropping) only for turns after the last user-like message (spec §4.3).
    follows_task = index > 0 and messages[index - 1].get("task") is not None
    if not rules.thinking or follows_task:
        return ""
    if rules.drop_thinking and index <= rules.last_user:
        return ""
    return (messages[index].get("reasoning_content") or "") + THINK_END


def _render_assistant(index: int, messages: list[Message], rules: _PromptRules) -> str:
    message = messages[index]
    text = _reasoning_part(index, messages, rules)
    text += (message.get("content") or "") + render_tool_calls(message.get("tool_calls"))
    return text if message.get("wo_eos") else text + EOS


_ROLE_RENDERERS = {
    "system": _render_system,
    "developer": _render_developer,
    "user": _render_user,
    "latest_reminder": _render_latest_reminder,
    "assistant": _render_assistant,
}


def _leading_prefix(index: int, message: Message, rules: _PromptRules) -> str:
    # Message 0 opens with SYSTEM when it hosts the effort prefix or is a system message (§4.2).
    if index != 0:
        return ""
    effort = EFFORT_PREFIX.format(budget=rules.effort) if rules.thinking else ""
    token = SYSTEM if effort or message.get("role") == "system" else ""
    return token + effort


def _task_cue(task: str, rules: _PromptRules) -> str:
    if task not in TASK_TOKENS:
        raise ChatFormatError(f"unknown task {task!r}; expected one of {sorted(TASK_TOKENS)}")
    if task != "action":
        return TASK_TOKENS[task]
    return ASSISTANT + (THINK_START if rules.thinking else THINK_END) + TASK_TOKENS[task]


def _generation_cue(index: int, messages: list[Message], rules: _PromptRules) -> str:
    following = messages[index + 1] if index + 1 < len(messages) else None
    if following is not None and following.get("role") not in ("assistant", "latest_reminder"):
        return ""
    message = messages[index]
    if message.get("task") is not None:
        return _task_cue(message["task"], rules)
    if not _is_user_like(index, message):
        return ""
    thinks = rules.thinking and (not rules.drop_thinking or index >= rules.last_user)
    return ASSISTANT + (THINK_START if thinks else THINK_END)


def _render_message(index: int, messages: list[Message], rules: _PromptRules) -> str:
    message = messages[index]
    renderer = _ROLE_RENDERERS.get(message.get("role"))
    if renderer is None:
        raise ChatFormatError(f"unsupported role {message.get('role')!r} at message {index}")
    return (
        _leading_prefix(index, message, rules)
        + renderer(index, messages, rules)
        + _generation_cue(index, messages, rules)
    )


# ------------------------------------------------------------------------------------------------
# Images in prompt order
# ------------------------------------------------------------------------------------------------

def _block_images(block: dict) -> list[dict]:
    if "image" in block:
        return [block["image"]]
    if block.get("type") != "tool_result":
        return []
    if "images" in block:
        return list(block["images"])
    content = block.get("content")
    return [img for inner in content for img in _block_images(inner)] if isinstance(content, list) else []


def _message_images(message: Message) -> list[dict]:
    blocks = message.get("content_blocks") or []
    if message.get("role") == "user":
        return [img for block in blocks for img in _block_images(block)]
    # Other roles render their joined text blocks only.
    return [b["image"] for b in blocks if b.get("type") == "text" and "image" in b]


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------

def _preprocess(messages: list[Message]) -> list[Message]:
    return merge_tool_messages([_prepare_message(m) for m in messages])


def encode_messages(
    messages: list[Message],
    thinking_mode: str = "chat",
    context: list[Message] | None = None,
    drop_thinking: bool = True,
    add_default_bos_token: bool = True,
    reasoning_effort: int | str | None = None,
    return_multi_modal_data: bool = False,
) -> str | tuple[str, dict]:
    if thinking_mode not in THINKING_MODES:
        raise ChatFormatError(f"thinking_mode must be one of {THINKING_MODES}; got {thinking_mode!r}")
    effort = resolve_reasoning_effort(reasoning_effort)  # checked in chat mode too, as the ports do
    context_messages = _preprocess(context or [])
    # Context and new messages are merged separately but ordered together: a result in the new
    # turn follows the calls of an assistant message that may sit in the context.
    full = sort_tool_results(context_messages + _preprocess(messages))
    n_context = len(context_messages)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in full)
    if thinking and drop:
        full, n_context = _drop_old_thinking(full, n_context)
    rules = _PromptRules(thinking, drop, effort, last_user_index(full))
    prompt = BOS if add_default_bos_token and not context else ""
    prompt += "".join(_render_message(i, full, rules) for i in range(n_context, len(full)))
    if not return_multi_modal_data:
        return prompt
    return prompt, {"images": [img for m in full[n_context:] for img in _message_images(m)]}
