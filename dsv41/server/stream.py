"""Streaming completion parser: the model's text, in pieces, -> OpenAI-style deltas.

The engine hands over the completion as token texts; `CompletionStream` turns them into reasoning,
content and tool-call deltas as soon as they are certain (docs/TOKENIZER-AND-CHAT.md §8, the [dsv41]
note). On complete, well-formed text (what `parse_completion(strict=True)` accepts) the deltas
add up to `parse_completion` exactly, `arguments` strings included. Elsewhere it departs from that
lenient parser, which hands broken markup back as content: here BOS, EOS, `<think>`, `</think>`
and `｜DSML｜` never reach content or reasoning (§8.5).

When things are released:
- prose (reasoning or content) at once, except a tail that may still grow into a special string
  or a tag with its blank line ("\n", "\n\n<", "<｜DS", "</thi" wait for the next piece);
- `tool_start` when an invoke's head is complete, one `tool_arguments` fragment per completed
  parameter (`{"K": V`, then `, "K": V`, values rebuilt as in parser.py), then `}` and
  `tool_end` at `</｜DSML｜ invoke>`. `index` counts started calls.

Text that is not well-formed:
1. (a) A DSML tag opens a calls block wherever it stands in prose: at offset 0, or without the
   blank line. A blank line right before a tag is the separator, never content.
2. (b) Any DSML tag in prose opens a block, not only the calls opener, so invokes written without
   `<｜DSML｜ calls>` still become calls.
3. (c) A call is complete only at its `</｜DSML｜ invoke>`. `finish()` inside an invoke drops it:
   its `tool_start` and fragments stay unfinished (no `}`, no `tool_end`), it is not in
   `tool_calls`, and the server reports the length finish.
4. (d) Inside a block only invokes that follow §8.3 exactly, head to closer, count. Anything else
   there (bad attribute names, missing quotes, unknown tags, a parameter outside an invoke,
   garbage between invokes) is hidden up to the next DSML tag, where parsing resumes; an invoke
   open when its markup broke is dropped as in (c), and later calls take new indices. Whitespace
   or garbage between invokes, or after the opener, loses nothing.
5. (e) `</｜DSML｜ calls>` ends a block; prose after it is content again, and a later block is
   parsed the same way. A block that never closes hides the rest of the text.
6. (f) A `｜DSML｜` not preceded by `<` or `</` is removed and the prose around it kept; so are
   BOS and `<think>` anywhere in prose, and `</think>` in content. What a removal or a hidden
   block joins is scanned again, so "<" + `<think>` + "think>" cannot spell `<think>`.
7. (g) In thinking mode the text is reasoning up to the first `</think>`; without one it is all
   reasoning and there is no content; a second `</think>` is removed as in (f). Markup inside
   reasoning never makes calls (the official parser keeps it as reasoning): it is hidden up to
   `</｜DSML｜ calls>` (reasoning resumes) or `</think>` (content begins).
8. EOS ends the completion wherever it stands, even inside an argument value (where the official
   parser reads on); what follows it is ignored.
`in_calls` means the prompt wrote the calls opener after any reasoning: the text starts in a block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from ..chat.encoding import (
    BOS,
    CALLS_CLOSE,
    CALLS_SEPARATOR,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    THINK_END,
    THINK_START,
)
from ..chat.parser import argument_json

_TAG_OPEN = "<" + DSML
_TAG_CLOSE = "</" + DSML
_TAG = "tag"  # what `_prose` returns for a tag start; not a special string
# Special strings that never reach prose (§8.5). None contains another, so the earliest complete
# one in a buffer stays the earliest however the buffer grows.
_SPECIALS = (DSML, EOS, BOS, THINK_START, THINK_END)
_BLOCK_MARKS = (_TAG_OPEN, _TAG_CLOSE)
_HIDDEN_MARKS = (CALLS_CLOSE, THINK_END)
# Prose that may still become one of these (or of the specials alone, across a hidden block)
# waits: the proper prefixes of each.
_PROSE_MARKS = _SPECIALS + (
    _TAG_OPEN, _TAG_CLOSE, CALLS_SEPARATOR + _TAG_OPEN, CALLS_SEPARATOR + _TAG_CLOSE,
)


def _prefixes(marks: tuple[str, ...]) -> frozenset[str]:
    return frozenset(mark[:n] for mark in marks for n in range(1, len(mark)))


_PROSE_PREFIXES = _prefixes(_PROSE_MARKS)
_SPECIAL_PREFIXES = _prefixes(_SPECIALS)
_BLOCK_PREFIXES = _prefixes(_BLOCK_MARKS)
_HIDDEN_PREFIXES = _prefixes(_HIDDEN_MARKS)
_EOS_PREFIXES = _prefixes((EOS,))
_LONGEST = max(map(len, _PROSE_MARKS + _HIDDEN_MARKS))
_PARAMETER_HEAD = PARAMETER_OPEN + ' name="'
_FLAG_TAILS = {'" string="true">': "true", '" string="false">': "false"}
# A value runs to the first "/｜DSML｜ parameter", which must open "</｜DSML｜ parameter>\n"
# (§8.3; the lookahead of parser.py's _PARAMETER).
_VALUE_STOP = PARAMETER_CLOSE[1:-1]
_PARAMETER_END = PARAMETER_CLOSE + "\n"


@dataclass(frozen=True)
class Delta:
    kind: str  # "reasoning" | "content" | "tool_start" | "tool_arguments" | "tool_end"
    text: str = ""  # reasoning/content text, or an arguments JSON fragment
    index: int = 0  # tool call index (0, 1, …) for the tool_* kinds
    name: str = ""  # the tool name, for "tool_start"


def _earliest(text: str, marks: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    hits = [(at, mark) for mark in marks if (at := text.find(mark, start)) >= 0]
    return min(hits) if hits else None


def _tail(text: str, prefixes: frozenset[str]) -> int:
    # Length of the longest tail of `text` that is a proper prefix of a mark.
    for at in range(max(0, len(text) - _LONGEST), len(text)):
        if text[at:] in prefixes:
            return len(text) - at
    return 0


def _joinable_tail(text: str, prefixes: frozenset[str]) -> int:
    # Length of the longest tail made of proper prefixes of marks one after another: removing a
    # special string that completes later between two of them joins them (rule 6), so
    # "<｜end▁of▁" + "<｜begin▁of▁sen" must wait as a whole. Every piece starts with "<", "｜" or
    # "\n" and is shorter than _LONGEST, so the scan stops _LONGEST characters before a gap.
    start = len(text)
    reach = {start}
    at = start - 1
    while at >= 0 and at >= start - _LONGEST:
        if text[at] in "<｜\n" and any(
            at + n in reach and text[at:at + n] in prefixes for n in range(1, _LONGEST)
        ):
            reach.add(at)
            start = at
        at -= 1
    return len(text) - start


def _starts(text: str, literal: str) -> bool | None:
    # None while `text` is still a proper prefix of `literal`: not decided yet.
    if text.startswith(literal):
        return True
    return None if literal.startswith(text) else False


def _tag_start(text: str, at: int) -> int | None:
    # The DSML token at `at` opens a tag when "<" or "</" stands right before it.
    if at >= 2 and text.startswith("</", at - 2):
        return at - 2
    return at - 1 if at >= 1 and text[at - 1] == "<" else None


def _invoke_name(rest: str) -> tuple[str, int] | bool | None:
    # `rest` follows "<｜DSML｜ invoke": `\s*name="NAME">\n`, NAME running to the line's end less
    # its `">` (parser.py _INVOKE_HEAD). Returns (NAME, length), False if not a head, None: wait.
    body = len(rest) - len(rest.lstrip())
    if body == len(rest):
        return None
    opened = _starts(rest[body:], 'name="')
    if not opened:
        return opened
    body += len('name="')
    newline = rest.find("\n", body)
    if newline < 0:
        return None
    if newline - 2 < body or not rest.startswith('">', newline - 2):
        return False
    return rest[body:newline - 2], newline + 1


def _parameter_name(text: str, start: int) -> tuple[str, int, int] | bool | None:
    # `text` starts with _PARAMETER_HEAD; a NAME candidate ends at the first `" string="true">` or
    # `" string="false">` from `start` on the head's line. Returns (flag, NAME's end, the value's
    # start), False if there is none, None: wait.
    hit = _earliest(text, tuple(_FLAG_TAILS), start)
    newline = text.find("\n", len(_PARAMETER_HEAD))
    if hit is None:
        return False if newline >= 0 else None
    at, tail = hit
    if 0 <= newline < at:
        return False
    return _FLAG_TAILS[tail], at, at + len(tail)


class CompletionStream:
    def __init__(self, thinking: bool, in_calls: bool = False):
        self._raw = ""  # a tail that may be the start of EOS
        self._buf = ""  # text the current state has not consumed
        self._final = False
        self._kind = "reasoning" if thinking and not in_calls else "content"
        self._held = ""  # prose of `_kind` waiting across a hidden block, to be joined again
        self._state: Callable[[], bool] = (
            self._block if in_calls else self._reasoning if thinking else self._content
        )
        self._out: list[Delta] = []
        self._calls: list[dict] = []
        self._started = 0
        self._index = 0  # the open call's
        self._name = ""
        self._items: dict[str, str] = {}  # its parameters: key -> '"key": value'
        self._name_from = 0  # the open parameter's: where its next NAME candidate may end
        self._candidate: tuple[str, int, int] | None = None  # (flag, NAME's end, value's start)
        self._scanned = 0  # how far the candidate's value is known to hold no stop

    @property
    def tool_calls(self) -> list[dict]:
        return [{"type": c["type"], "function": dict(c["function"])} for c in self._calls]

    def push(self, text: str) -> list[Delta]:
        if self._state == self._done:
            return []
        raw = self._raw + text
        eos = raw.find(EOS)
        if eos >= 0:  # generation ended here (rule 8)
            self._raw = ""
            self._buf += raw[:eos]
            return self.finish()
        keep = _tail(raw, _EOS_PREFIXES)
        self._buf += raw[:len(raw) - keep]
        self._raw = raw[len(raw) - keep:]
        self._run()
        return self._take()

    def finish(self) -> list[Delta]:
        self._buf += self._raw
        self._raw = ""
        self._final = True
        self._run()
        self._end()
        return self._take()

    # --- plumbing ---------------------------------------------------------------------------

    def _run(self) -> None:
        while self._state():
            pass

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind: str, text: str = "", **fields) -> None:
        if kind in ("reasoning", "content"):
            if not text:
                return
            if self._out and self._out[-1].kind == kind:
                text = self._out.pop().text + text
        self._out.append(Delta(kind, text, **fields))

    def _decide(self, text: str, literal: str) -> bool | None:
        decided = _starts(text, literal)
        return False if decided is None and self._final else decided

    def _release(self, text: str, prefixes: frozenset[str]) -> str:
        # Emits `text` but the tail that later prose could still join into a mark.
        keep = _joinable_tail(text, prefixes)
        self._emit(self._kind, text[:len(text) - keep])
        return text[len(text) - keep:]

    def _hidden_tail(self, prefixes: frozenset[str]) -> str:
        # Hidden text is dropped but a tail that may start a mark.
        return "" if self._final else self._buf[len(self._buf) - _tail(self._buf, prefixes):]

    def _resume(self, state: Callable[[], bool]) -> None:
        self._buf = self._held + self._buf
        self._held = ""
        self._state = state

    def _end(self) -> None:
        self._emit(self._kind, self._held)
        self._held = self._buf = ""
        self._state = self._done

    def _done(self) -> bool:
        self._buf = ""
        return False

    # --- prose ------------------------------------------------------------------------------

    def _prose(self) -> str | None:
        # Releases prose up to the first special string and returns it (_TAG for a tag start, the
        # buffer then starting at its "<"); None when the rest must wait for more text.
        buf = self._buf
        hit = _earliest(buf, _SPECIALS)
        if hit is None:
            if self._final:
                self._emit(self._kind, buf)
                self._buf = ""
            else:
                self._buf = self._release(buf, _PROSE_PREFIXES)
            return None
        at, mark = hit
        start = _tag_start(buf, at) if mark == DSML else None
        if start is not None:
            cut = start - 2 if start >= 2 and buf.startswith(CALLS_SEPARATOR, start - 2) else start
            # Only a special string could be spelled across the block (rule 6): the rest goes now.
            self._held = self._release(buf[:cut], _SPECIAL_PREFIXES)
            self._buf = buf[start:]
            return _TAG
        if mark == THINK_END and self._kind == "reasoning":  # nothing can join reasoning now
            self._emit(self._kind, buf[:at])
            self._buf = buf[at + len(mark):]
        else:  # removed (rule 6); the join is scanned again
            self._buf = self._release(buf[:at], _PROSE_PREFIXES) + buf[at + len(mark):]
        return mark

    def _content(self) -> bool:
        mark = self._prose()
        if mark == _TAG:
            self._state = self._block
        return mark is not None

    def _reasoning(self) -> bool:
        mark = self._prose()
        if mark == THINK_END:
            self._kind, self._state = "content", self._content
        elif mark == _TAG:
            self._state = self._hidden
        return mark is not None

    def _hidden(self) -> bool:
        # Markup inside reasoning (rule 7).
        hit = _earliest(self._buf, _HIDDEN_MARKS)
        if hit is None:
            self._buf = self._hidden_tail(_HIDDEN_PREFIXES)
            return False
        at, mark = hit
        self._buf = self._buf[at + len(mark):]
        if mark == THINK_END:
            self._emit(self._kind, self._held)
            self._held, self._kind, self._state = "", "content", self._content
        else:
            self._resume(self._reasoning)
        return True

    # --- calls ------------------------------------------------------------------------------

    def _block(self) -> bool:
        # Between invokes: everything up to the next tag is hidden (rule 4).
        buf = self._buf
        hit = _earliest(buf, _BLOCK_MARKS)
        if hit is None:
            self._buf = self._hidden_tail(_BLOCK_PREFIXES)
            return False
        at, mark = hit
        self._buf = buf = buf[at:]
        invoke, close = self._decide(buf, INVOKE_OPEN), self._decide(buf, CALLS_CLOSE)
        if invoke is None or close is None:
            return False
        if invoke:
            self._state = self._invoke_head
        elif close:
            self._buf = buf[len(CALLS_CLOSE):]
            self._resume(self._content)
        else:
            self._buf = buf[len(mark):]
        return True

    def _invoke_head(self) -> bool:
        head = _invoke_name(self._buf[len(INVOKE_OPEN):])
        if head is None and not self._final:
            return False
        if not head:
            self._buf = self._buf[len(_TAG_OPEN):]
            self._state = self._block
            return True
        name, length = head
        self._buf = self._buf[len(INVOKE_OPEN) + length:]
        self._index, self._name, self._items = self._started, name, {}
        self._started += 1
        self._emit("tool_start", index=self._index, name=name)
        self._state = self._invoke
        return True

    def _invoke(self) -> bool:
        # After the head or a parameter: another parameter or the closer; the encoder writes an
        # empty line for a call without arguments (parser.py _parse_invoke).
        closers = (INVOKE_CLOSE,) if self._items else (INVOKE_CLOSE, "\n" + INVOKE_CLOSE)
        for literal in (_PARAMETER_HEAD, *closers):
            decided = self._decide(self._buf, literal)
            if decided is None:
                return False
            if decided and literal == _PARAMETER_HEAD:
                self._name_from, self._candidate = len(_PARAMETER_HEAD), None
                self._state = self._parameter
                return True
            if decided:
                self._buf = self._buf[len(literal):]
                self._close_call()
                return True
        self._state = self._block  # the invoke is dropped (rules 3, 4)
        return True

    def _parameter(self) -> bool:
        # parser.py's _PARAMETER, backtracking included: NAME is tried up to each flag on the head's
        # line in turn until a value ends in "</｜DSML｜ parameter>\n" (§8.3); the head stays in
        # the buffer until then.
        if self._candidate is None:
            found = _parameter_name(self._buf, self._name_from)
            if found is None and not self._final:
                return False
            if not found:
                self._state = self._block
                return True
            self._candidate, self._scanned = found, found[2]
        flag, name_end, value_start = self._candidate
        value_end = self._value_end()
        if value_end is None:
            return False
        if value_end < 0:
            self._name_from, self._candidate = name_end + 1, None
            return True
        key = self._buf[len(_PARAMETER_HEAD):name_end]
        if key in self._items:  # duplicates are malformed too (§8.3)
            self._state = self._block
            return True
        self._add_parameter(key, self._buf[value_start:value_end], flag)
        self._buf = self._buf[value_end + len(_PARAMETER_END):]
        self._state = self._invoke
        return True

    def _value_end(self) -> int | None:
        # The value runs to the first _VALUE_STOP, which must open _PARAMETER_END; -1 if it does
        # not, None: wait.
        buf = self._buf
        at = buf.find(_VALUE_STOP, self._scanned)
        if at < 0:
            self._scanned = max(self._scanned, len(buf) - len(_VALUE_STOP) + 1)
            return -1 if self._final else None
        closed = self._decide(buf[at - 1:], _PARAMETER_END)
        if closed is None:
            self._scanned = at
            return None
        return at - 1 if closed else -1

    def _add_parameter(self, key: str, value: str, flag: str) -> None:
        item = f"{json.dumps(key, ensure_ascii=False)}: {argument_json(value, flag)}"
        self._emit("tool_arguments", (", " if self._items else "{") + item, index=self._index)
        self._items[key] = item

    def _close_call(self) -> None:
        self._emit("tool_arguments", "}" if self._items else "{}", index=self._index)
        self._emit("tool_end", index=self._index)
        arguments = "{" + ", ".join(self._items.values()) + "}"
        function = {"name": self._name, "arguments": arguments}
        self._calls.append({"type": "function", "function": function})
        self._state = self._block
