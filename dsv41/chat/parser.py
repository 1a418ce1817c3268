"""Completion parser: generated text -> assistant message (docs/TOKENIZER-AND-CHAT.md §8).

On well-formed text the result equals the official parser's, including the `arguments` string.
Unlike it, truncated output (no EOS, no `</think>`) is accepted, and malformed DSML is either
returned as plain content (default) or raised as `CompletionParseError` (`strict=True`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .encoding import (
    BOS,
    CALLS_CLOSE,
    DSML,
    EOS,
    INVOKE_CLOSE,
    THINK_END,
    THINK_START,
    THINKING_MODES,
)
from ..errors import InputError, UserError

# The official parser cuts content at this prefix (no closing ">"), then expects ">\n" (§8.2).
CALLS_START = f"\n\n<{DSML} calls"
_BLOCK_HEAD = CALLS_START + ">\n"
_INVOKE_HEAD = re.compile(rf'<{DSML} invoke\s*name="([^\n]*?)">\n')
# A value runs to the first "</｜DSML｜ parameter>" and may not contain "/｜DSML｜ parameter" (§8.3).
_PARAMETER = re.compile(
    rf'<{DSML} parameter name="([^\n]*?)" string="(true|false)">'
    rf"((?:(?!/{DSML} parameter).)*?)</{DSML} parameter>\n",
    re.DOTALL,
)
# Special strings that may not appear in content or reasoning (§8.5).
_FORBIDDEN_IN_TEXT = (BOS, EOS, THINK_START, THINK_END, DSML)


class CompletionParseError(UserError):
    pass


class _Malformed(Exception):
    pass


def argument_json(value: str, is_string: str) -> str:
    # string="true" values are JSON strings; string="false" values are inserted verbatim like
    # the official parser, unless they are not JSON, in which case they become strings.
    if is_string == "true":
        return json.dumps(value, ensure_ascii=False)
    try:
        json.loads(value)
    except ValueError:
        return json.dumps(value, ensure_ascii=False)
    return value


def _arguments(parameters: dict[str, tuple[str, str]]) -> str:
    items = (
        f"{json.dumps(key, ensure_ascii=False)}: {argument_json(value, flag)}"
        for key, (value, flag) in parameters.items()
    )
    return "{" + ", ".join(items) + "}"


def _parse_parameters(text: str, pos: int, tool: str) -> tuple[dict[str, tuple[str, str]], int]:
    parameters: dict[str, tuple[str, str]] = {}
    while match := _PARAMETER.match(text, pos):
        key, flag, value = match.groups()
        if key in parameters:
            raise _Malformed(f"duplicate parameter name {key!r} in call to {tool!r}")
        parameters[key] = (value, flag)
        pos = match.end()
    return parameters, pos


def _parse_invoke(text: str, pos: int) -> tuple[dict, int]:
    head = _INVOKE_HEAD.match(text, pos)
    if head is None:
        raise _Malformed(f"expected an invoke tag or {CALLS_CLOSE!r} at offset {pos}")
    name = head.group(1)
    parameters, pos = _parse_parameters(text, head.end(), name)
    if not parameters and text.startswith("\n" + INVOKE_CLOSE, pos):
        pos += 1  # the encoder writes an empty parameter line for a call without arguments
    if not text.startswith(INVOKE_CLOSE + "\n", pos):
        raise _Malformed(f"expected a parameter or the end of call {name!r} at offset {pos}")
    call = {"type": "function", "function": {"name": name, "arguments": _arguments(parameters)}}
    return call, pos + len(INVOKE_CLOSE) + 1


def _parse_calls_block(text: str) -> tuple[list[dict], int]:
    # `text` starts with CALLS_START; returns the calls and the offset just past CALLS_CLOSE.
    if not text.startswith(_BLOCK_HEAD):
        raise _Malformed(f"tool-call block must open with {_BLOCK_HEAD!r}")
    pos, calls = len(_BLOCK_HEAD), []
    while not text.startswith(CALLS_CLOSE, pos):
        call, pos = _parse_invoke(text, pos)
        calls.append(call)
    return calls, pos + len(CALLS_CLOSE)


def _fail(strict: bool, message: str) -> None:
    if strict:
        raise CompletionParseError(message)


def _split_reasoning(text: str, thinking: bool, strict: bool) -> tuple[str, str]:
    if not thinking:
        return "", text
    end = text.find(THINK_END)
    if end < 0:  # truncated inside the reasoning: everything up to EOS is reasoning
        eos = text.find(EOS)
        cut = len(text) if eos < 0 else eos
        return text[:cut], text[cut:]
    calls = text.find(CALLS_START, 0, end)
    if calls >= 0:
        _fail(strict, f"tool-call block at offset {calls} starts before {THINK_END!r}")
    return text[:end], text[end + len(THINK_END):]


def _after_eos(rest: str, strict: bool) -> None:
    if rest:
        _fail(strict, f"unexpected text after the end-of-sentence token: {rest[:40]!r}")


def _split_tail(tail: str, strict: bool) -> str:
    # Text between the calls block and EOS; the official parser allows none.
    eos = tail.find(EOS)
    before = tail if eos < 0 else tail[:eos]
    if eos >= 0:
        _after_eos(tail[eos + len(EOS):], strict)
    if before:
        _fail(strict, f"unexpected text after the tool-call block: {before[:40]!r}")
    return before


def _split_calls(block: str, strict: bool) -> tuple[list[dict], str]:
    # Returns (calls, text to append to content).
    try:
        calls, end = _parse_calls_block(block)
    except _Malformed as error:
        _fail(strict, f"malformed tool-call block: {error}")
        eos = block.find(EOS)
        if eos >= 0:
            _after_eos(block[eos + len(EOS):], strict)
        return [], block if eos < 0 else block[:eos]
    return calls, _split_tail(block[end:], strict)


def _split_content(rest: str, strict: bool) -> tuple[str, list[dict]]:
    eos, calls = rest.find(EOS), rest.find(CALLS_START)
    if calls >= 0 and (eos < 0 or calls < eos):
        tool_calls, extra = _split_calls(rest[calls:], strict)
        return rest[:calls] + extra, tool_calls
    if eos < 0:  # truncated: no EOS yet
        return rest, []
    _after_eos(rest[eos + len(EOS):], strict)
    return rest[:eos], []


def _check_special_strings(reasoning: str, content: str) -> None:
    for token in _FORBIDDEN_IN_TEXT:
        if token in reasoning or token in content:
            raise CompletionParseError(f"special string {token!r} inside content or reasoning")


def parse_completion(text: str, thinking_mode: str, strict: bool = False) -> dict[str, Any]:
    if thinking_mode not in THINKING_MODES:
        raise InputError(f"thinking_mode must be one of {THINKING_MODES}; got {thinking_mode!r}")
    reasoning, rest = _split_reasoning(text, thinking_mode == "thinking", strict)
    content, tool_calls = _split_content(rest, strict)
    if strict:
        _check_special_strings(reasoning, content)
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": tool_calls,
    }
