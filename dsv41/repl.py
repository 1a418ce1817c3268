"""The interactive chat behind `dsv41 chat` (docs/GENERATION-AND-DSPARK.md §1.3, interactive mode).

Each user line is appended to the history and the whole conversation is re-encoded with
`encode_messages`; the reply is parsed with the lenient parser (the engine cuts EOS, so the strict
parser would reject every reply: docs/TOKENIZER-AND-CHAT.md §9 pitfall 1) and appended as an assistant
message. Lines come from stdin, so a pipe drives it as well as a terminal; command feedback and stats
go to stderr, the model's text to stdout.

The conversation runs on one engine, which keeps the finished turn in its cache slot: when the next
prompt's text starts with the previous prompt and the reply (chat mode; thinking mode drops old
reasoning, so it does not), the next prompt's ids are the previous ones, the reply's ids and the new
text's, and the engine continues the kept slot instead of prefilling the conversation again.

Living in it:

- Ctrl-C during a reply stops the reply; the chat goes on. The interrupted turn is dropped whole: the
  history stays as it was before the user's message (the partial reply stays on the screen only, and
  the message is in the line history, Up / Ctrl-P recalls it). Keeping the partial reply instead would
  render it closed by an end-of-sentence the model never produced. The request is cancelled in the
  engine (`Engine.cancel`: finish "cancelled", its slot reset and freed, not kept), and with it the
  previous turn's kept slot when the request was continuing it; so `ChatSession.last` is cleared and
  the next prompt is encoded from its text, as a fresh session with the same history would encode it
  (a cold prefill once, then reuse as before). The first Ctrl-C is deferred to the end of the engine
  step in progress (a signal handler sets a flag), so a step is never cut in half; a second Ctrl-C
  before that stops at once, and then the engine, which may have been cut anywhere, is replaced by a
  new one. This holds with piped stdin too; Ctrl-C outside a reply then ends the chat, as before.
- At the prompt (stdin a terminal), Ctrl-C clears the line and prompts again; Ctrl-D (EOF) leaves (exit
  status 0). Lines are edited with `readline`, whose history is kept across sessions in
  `chat_history` under the cache root ($DSV41_CACHE, else $XDG_CACHE_HOME/dsv41, else ~/.cache/dsv41);
  a history file that cannot be read or written is ignored. Tab completes /commands.
- While a reply streams to a terminal, echo is off, and what was typed meanwhile is discarded when it
  ends (`TerminalGuard`); the terminal's settings are restored however the reply ends.
- Piped stdin is read line by line as before: no readline, no prompt, no terminal handling.
- `/image PATH` (and `dsv41 chat --image PATH`) attaches an image to the next message: the message's
  content becomes the image blocks, then its text. The images stay in the history; each turn reads and
  plans them again, and the engine's prefix reuse keeps the ViT from encoding them again.
- `/prompt [TEXT]` writes to stdout (the stream the replies go to) the exact text `encode_messages`
  renders — with TEXT, the prompt the next turn would be encoded from if TEXT were the message; without
  it, the conversation so far (system prompt and history) — followed by one newline; its token count
  goes to stderr.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

try:
    import termios
except ImportError:                                  # not a POSIX system: no terminal handling
    termios = None

from .chat import encode_messages, parse_completion, resolve_reasoning_effort
from .engine.engine import Engine, GenerationConfig
from .engine.request import Completion, StreamEvent, check_prompts
from .tokenizer import Tokenizer
from .vision.sources import ImageSources, prompt_images

PROMPT = ">>> "
HISTORY_FILE = "chat_history"
HISTORY_LENGTH = 1000

COMMANDS = (
    ("/exit", "leave"),
    ("/clear", "forget the conversation (the system prompt stays)"),
    ("/system TEXT", "set the system prompt (empty: remove it)"),
    ("/think on|off", "thinking mode"),
    ("/effort N|low|high|max", "reasoning effort in thinking mode"),
    ("/image PATH", "attach an image to the next message"),
    ("/prompt [TEXT]", "print the encoded prompt (stdout): the conversation, or the next turn's with TEXT"),
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
    def __init__(self, system: str | None = None, thinking: bool = False, effort: int | str | None = None,
                 images: list[str] | None = None):
        self.system = system
        self.images = list(images or [])
        """Image files attached to the next message."""
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

    def messages(self, user_text: str | None) -> list[dict]:
        """System prompt, history and (unless None) the new user message, as `encode_messages` takes them."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        user = [] if user_text is None else [self.user_message(user_text)]
        return system + self.history + user

    def user_message(self, text: str) -> dict:
        if not self.images:
            return {"role": "user", "content": text}
        images = [{"type": "image", "url": path} for path in self.images]
        return {"role": "user", "content": images + [{"type": "text", "text": text}]}

    def encoded(self, user_text: str | None) -> str:
        """The rendered text of the conversation followed by `user_text` (None: the conversation alone)."""
        return encode_messages(self.messages(user_text), self.mode, reasoning_effort=self.effort)

    def encoded_with_images(self, user_text: str) -> tuple[str, list[dict]]:
        """The rendered text and the image records of the conversation followed by `user_text`."""
        text, media = encode_messages(self.messages(user_text), self.mode, reasoning_effort=self.effort,
                                      return_multi_modal_data=True)
        return text, media["images"]


# ------------------------------------------------------------------------------------ commands
def _clear(session: ChatSession, arg: str) -> str:
    session.history.clear()
    session.last = None
    session.images.clear()
    return "conversation cleared"


def _attach_image(session: ChatSession, arg: str) -> str:
    if not arg:
        return "usage: /image PATH"
    path = Path(arg).expanduser()
    if not path.is_file():
        return f"no such file: {path}"
    session.images.append(str(path))
    return f"image attached to your next message ({len(session.images)} so far)"


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


_HANDLERS = {"/clear": _clear, "/system": _set_system, "/think": _set_think, "/effort": _set_effort,
             "/image": _attach_image, "/help": _help}


def show_prompt(session: ChatSession, arg: str, out: TextIO, tokenizer: Tokenizer | None = None) -> None:
    """/prompt [TEXT]: the exact rendered text on `out` (one newline after it), its token count on stderr."""
    text = session.encoded(arg or None)
    out.write(text + "\n")
    out.flush()
    if tokenizer is not None:
        n = len(session.prompt_ids(tokenizer, text) if arg else tokenizer.encode_prompt(text))
        _note(f"{n} tokens" + ("" if arg else " (the conversation so far; /prompt TEXT: the next turn's prompt)"))


def run_command(session: ChatSession, line: str, out: TextIO | None = None, tokenizer: Tokenizer | None = None) -> bool:
    """Apply a /command and report on stderr (/prompt prints to `out`, default stdout); False means leave."""
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name == "/prompt":
        show_prompt(session, arg.strip(), out or sys.stdout, tokenizer)
        return True
    handler = _HANDLERS.get(name)
    _note(handler(session, arg.strip()) if handler else f"unknown command {name}; /help lists the commands")
    return True


# ------------------------------------------------------------------------------------ the terminal
def terminal_fd(stream) -> int | None:
    """The file descriptor of `stream` when it is a terminal we can set (else None: a pipe, a file, a test)."""
    if termios is None or stream is None:
        return None
    try:
        fd = stream.fileno()
        return fd if os.isatty(fd) else None
    except (AttributeError, OSError, ValueError):        # io.UnsupportedOperation is an OSError
        return None


class TerminalGuard:
    """While a reply streams: the terminal `fd` does not echo what is typed; on leaving (however the reply
    ended), input typed meanwhile is discarded and the settings are restored. No-op for fd None."""

    def __init__(self, fd: int | None):
        self.fd = fd
        self.saved: list | None = None

    def __enter__(self) -> "TerminalGuard":
        if self.fd is None or termios is None:
            return self
        try:
            self.saved = termios.tcgetattr(self.fd)
            quiet = termios.tcgetattr(self.fd)
            quiet[3] &= ~(termios.ECHO | termios.ECHONL)
            termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        except (termios.error, OSError):
            self.saved = None
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            return
        try:
            termios.tcflush(self.fd, termios.TCIFLUSH)
        except (termios.error, OSError):
            pass
        try:
            termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)
        except (termios.error, OSError):
            pass
        self.saved = None


class DeferredInterrupt:
    """SIGINT while a reply is generated: the first one only sets `pending` (the caller stops at its next
    safe point), a second one raises KeyboardInterrupt at once; after `disarm`, further ones are ignored.
    The previous handler comes back on leaving. Off the main thread (no signal handling there) a no-op."""

    def __init__(self):
        self.pending = False
        self.armed = True
        self.previous = None
        self.installed = False

    def _handler(self, signum, frame) -> None:
        if not self.armed:
            return
        if self.pending:
            self.armed = False
            raise KeyboardInterrupt
        self.pending = True

    def disarm(self) -> None:
        self.armed = False

    def __enter__(self) -> "DeferredInterrupt":
        try:
            self.previous = signal.signal(signal.SIGINT, self._handler)
            self.installed = True
        except ValueError:                                # not the main thread
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            previous = self.previous if self.previous is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, previous)
            self.installed = False


# ------------------------------------------------------------------------------------ turns
DONE, FAILED, INTERRUPTED, BROKEN = "done", "failed", "interrupted", "broken"
"""How a turn ended: a reply added to the history; not run (an error, reported); stopped by Ctrl-C between
engine steps (the request cancelled, the engine sound); stopped inside a step (the engine must be replaced)."""


def assistant_message(text: str, mode: str) -> dict:
    reply = parse_completion(text, mode, strict=False)
    message = {"role": "assistant", "content": reply["content"]}
    if reply["reasoning_content"]:
        message["reasoning_content"] = reply["reasoning_content"]
    if reply["tool_calls"]:
        message["tool_calls"] = reply["tool_calls"]
    return message


def chat_turn(engine: Engine, tokenizer: Tokenizer, session: ChatSession, user_text: str,
              config: GenerationConfig, out: TextIO, terminal: int | None = None) -> str:
    """Generate one reply, streaming it to `out`; the history grows only when the turn completes.

    Ctrl-C (a KeyboardInterrupt, whether from SIGINT or from writing to `out`) cancels the request and
    leaves the history as it was. `terminal`: the fd of the terminal stdin is (echo off meanwhile).
    → DONE, FAILED, INTERRUPTED or BROKEN (the engine was cut mid-step: the caller replaces it)."""
    try:
        text, records = session.encoded_with_images(user_text)
        prompt = session.prompt_ids(tokenizer, text)
        expanded, spans = prompt_images(prompt, records, engine.model.cfg, ImageSources(local_files=True),
                                        tokenizer=tokenizer)
        check_prompts([expanded], engine.context, tokenizer.vocab_size)
        rid = engine.submit(config.request(expanded, spans))
    except ValueError as e:                          # an unreadable image, or no longer fits the context
        _note(f"dsv41: error: {e} (/clear starts over)")
        return FAILED
    show = echo_to(out)
    completion, stepping, outcome = None, False, DONE
    with DeferredInterrupt() as interrupt, TerminalGuard(terminal):
        try:
            while completion is None:
                stepping = True
                events = engine.step()
                stepping = False
                for event in events:
                    if event.request == rid:
                        show(event)
                        completion = event.completion or completion
                if interrupt.pending and completion is None:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            interrupt.disarm()
            outcome = BROKEN if stepping else INTERRUPTED
            try:
                engine.cancel(rid)
            except Exception:                        # cut mid-step: the engine is replaced anyway
                outcome = BROKEN
    out.write("\n")
    out.flush()
    if outcome != DONE:
        session.last = None                          # the slot the turn continued is gone (cancelled)
        _note("interrupted: the reply is not kept, the conversation is as it was before your message")
        return outcome
    session.history += [session.user_message(user_text), assistant_message(completion.text, session.mode)]
    session.images.clear()
    session.remember(tokenizer, text, prompt, completion)
    _note(completion.summary())
    return DONE


# ------------------------------------------------------------------------------------ input
def history_path() -> Path:
    from .demo import cache_root
    return cache_root() / HISTORY_FILE


def _setup_readline(path: Path | None):
    """Import readline (line editing for input()), load the history and complete /commands; → the module."""
    try:
        import readline
    except ImportError:
        return None
    readline.set_history_length(HISTORY_LENGTH)
    if path is not None:
        try:
            readline.read_history_file(str(path))
        except (OSError, ValueError):
            pass
    names = sorted({command.split()[0] for command, _ in COMMANDS} | {"/quit"})

    def complete(prefix: str, state: int) -> str | None:
        hits = [n for n in names if n.startswith(prefix)] if readline.get_line_buffer().startswith("/") else []
        return hits[state] if state < len(hits) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" \t\n")
    readline.parse_and_bind("tab: complete")
    return readline


def _save_history(readline, path: Path | None) -> None:
    if readline is None or path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(str(path))
    except (OSError, ValueError):
        pass


_DEFAULT = object()


def input_lines(interactive: bool, history: Path | str | None = _DEFAULT) -> Iterator[str]:
    """The user's lines. Interactive (stdin a terminal): `input` with readline and a prompt; Ctrl-C clears
    the line, Ctrl-D ends; `history` (default: history_path(); None: none kept) is loaded, and saved after
    every line. Otherwise lines are read from stdin as they come, without a prompt, until EOF."""
    if not interactive:
        while True:
            line = sys.stdin.readline()
            if line == "":
                return
            yield line.rstrip("\n")
    path = history_path() if history is _DEFAULT else (None if history is None else Path(history))
    readline = _setup_readline(path)
    while True:
        try:
            line = input(PROMPT)
        except KeyboardInterrupt:                    # like a shell: the line is dropped, a new prompt
            print(flush=True)
            continue
        except EOFError:
            print(flush=True)                        # the shell's prompt starts on its own line
            return
        _save_history(readline, path)
        yield line


def run_chat(model, tokenizer: Tokenizer, session: ChatSession, config: GenerationConfig,
             lines: Iterator[str], out: TextIO, *, stdin=None, engine: Engine | None = None) -> None:
    """Run the chat over `lines` until they end or /exit. `stdin`: the stream the lines come from (default
    sys.stdin), whose terminal, if it is one, is quiet during replies. `engine`: one to run on (its slots
    hold the kept turn), else a new one."""
    # two slots: the turn being generated, and the last one kept for reuse
    def new_engine() -> Engine:
        return Engine(model, tokenizer, config.engine(2))

    terminal = terminal_fd(sys.stdin if stdin is None else stdin)
    engine = engine or new_engine()
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if not run_command(session, text, out, tokenizer):
                return
            continue
        if chat_turn(engine, tokenizer, session, text, config, out, terminal) == BROKEN:
            engine = None                            # free its cache before the new one is made
            engine = new_engine()
