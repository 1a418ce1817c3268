"""The interactive chat behind `dsv41 chat` (GENERATION-AND-DSPARK.md §1.3, interactive mode).

Each user line is appended to the history and the whole conversation is re-encoded with
`encode_messages`; the reply is parsed with the lenient parser (the engine cuts EOS, so the strict
parser would reject every reply: TOKENIZER-AND-CHAT.md §9 pitfall 1) and appended as an assistant
message. Lines come from stdin, so a pipe drives it as well as a terminal; command feedback and stats
go to stderr, the model's text to stdout.

The conversation runs on one engine, which keeps the finished turn in its cache slot: when the next
prompt's text starts with the previous prompt and the reply (chat mode; thinking mode drops old
reasoning, so it does not), the next prompt's ids are the previous ones, the reply's ids and the new
text's, and the engine continues the kept slot instead of prefilling the conversation again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from .chat import encode_messages, parse_completion, resolve_reasoning_effort
from .engine.engine import Engine, GenerationConfig, generate_all
from .engine.request import Completion, StreamEvent
from .tokenizer import Tokenizer

COMMANDS = (
    ("/exit", "leave"),
    ("/clear", "forget the conversation (the system prompt stays)"),
    ("/system TEXT", "set the system prompt (empty: remove it)"),
    ("/think on|off", "thinking mode"),
    ("/effort N|low|high|max", "reasoning effort in thinking mode"),
    ("/help", "this list"),
)


def parse_effort(value: str | None) -> int | str | None:
    """A command-line effort: an integer when it looks like one, else an alias for the encoder to check."""
    if value is None:
        return None
    return int(value) if value.strip().lstrip("-").isdigit() else value


def echo_to(out: TextIO) -> Callable[[StreamEvent], None]:
    """An `on_event` callback that writes each text delta as it arrives."""
    def write(event: StreamEvent) -> None:
        if event.text:
            out.write(event.text)
            out.flush()
    return write


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ChatSession:
    def __init__(self, system: str | None = None, thinking: bool = False, effort: int | str | None = None):
        self.system = system
        self.thinking = thinking
        self.effort = None if effort is None else resolve_reasoning_effort(effort)
        self.history: list[dict] = []
        self.last: tuple[str, list[int]] | None = None
        """(text, ids) of the last turn's prompt followed by its reply, as the engine's slot holds it."""

    def prompt_ids(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """The ids of a rendered prompt, extending the last turn's ids where the text extends them."""
        if self.last is not None and text.startswith(self.last[0]):
            return self.last[1] + tokenizer.encode(text[len(self.last[0]):])
        return tokenizer.encode_prompt(text)

    def remember(self, tokenizer: Tokenizer, text: str, prompt: list[int], completion: Completion) -> None:
        reply = completion.token_ids
        self.last = (text + tokenizer.decode(reply), prompt + reply)

    @property
    def mode(self) -> str:
        return "thinking" if self.thinking else "chat"

    def messages(self, user_text: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history + [{"role": "user", "content": user_text}]


# ------------------------------------------------------------------------------------ commands
def _clear(session: ChatSession, arg: str) -> str:
    session.history.clear()
    session.last = None
    return "conversation cleared"


def _set_system(session: ChatSession, arg: str) -> str:
    session.system = arg or None
    return "system prompt set" if arg else "system prompt removed"


def _set_think(session: ChatSession, arg: str) -> str:
    if arg not in ("on", "off"):
        return "usage: /think on|off"
    session.thinking = arg == "on"
    return f"thinking mode {arg}"


def _set_effort(session: ChatSession, arg: str) -> str:
    try:
        session.effort = resolve_reasoning_effort(parse_effort(arg) if arg else None)
    except ValueError as e:
        return str(e)
    return f"reasoning effort {session.effort}" + ("" if session.thinking else " (used in thinking mode: /think on)")


def _help(session: ChatSession, arg: str) -> str:
    return "\n".join(f"  {command:<24}{what}" for command, what in COMMANDS)


_HANDLERS = {"/clear": _clear, "/system": _set_system, "/think": _set_think, "/effort": _set_effort, "/help": _help}


def run_command(session: ChatSession, line: str) -> bool:
    """Apply a /command and report on stderr; False means leave the chat."""
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    handler = _HANDLERS.get(name)
    _note(handler(session, arg.strip()) if handler else f"unknown command {name}; /help lists the commands")
    return True


# ------------------------------------------------------------------------------------ turns
def assistant_message(text: str, mode: str) -> dict:
    reply = parse_completion(text, mode, strict=False)
    message = {"role": "assistant", "content": reply["content"]}
    if reply["reasoning_content"]:
        message["reasoning_content"] = reply["reasoning_content"]
    if reply["tool_calls"]:
        message["tool_calls"] = reply["tool_calls"]
    return message


def chat_turn(engine: Engine, tokenizer: Tokenizer, session: ChatSession, user_text: str,
              config: GenerationConfig, out: TextIO) -> None:
    """Generate one reply, streaming it to `out`; the history grows only when the turn succeeds."""
    messages = session.messages(user_text)
    text = encode_messages(messages, session.mode, reasoning_effort=session.effort)
    prompt = session.prompt_ids(tokenizer, text)
    try:
        [completion] = generate_all(engine.model, tokenizer, [prompt], config, echo_to(out), engine=engine)
    except ValueError as e:                          # the conversation no longer fits the context
        _note(f"dsv41: error: {e} (/clear starts over)")
        return
    out.write("\n")
    out.flush()
    session.history += [messages[-1], assistant_message(completion.text, session.mode)]
    session.remember(tokenizer, text, prompt, completion)
    _note(completion.summary())


def input_lines(interactive: bool) -> Iterator[str]:
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and line == "":
            return
        yield line.rstrip("\n")


def run_chat(model, tokenizer: Tokenizer, session: ChatSession, config: GenerationConfig,
             lines: Iterator[str], out: TextIO) -> None:
    # two slots: the turn being generated, and the last one kept for reuse
    engine = Engine(model, tokenizer, config.engine(2))
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if not run_command(session, text):
                return
            continue
        chat_turn(engine, tokenizer, session, text, config, out)
