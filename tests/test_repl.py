"""`dsv41 chat` as people use it (dsv41/repl.py): Ctrl-C during a reply, the prompt's Ctrl-C and Ctrl-D,
readline history, a quiet terminal during replies, and /prompt.

The chat runs in-process on the demo model (random weights, greedy) with fake streams; Ctrl-C is a
KeyboardInterrupt raised while a reply is written out, or a real SIGINT sent to this process. The
terminal behaviour runs on a pseudo-terminal: in-process for the echo and flush of `TerminalGuard`, and
in a child process (pty.fork) for readline, whose `input()` needs stdin and stdout to be a terminal.
"""

from __future__ import annotations

import io
import os
import pty
import select
import signal
import sys
import termios
import time
from pathlib import Path

import pytest

import dsv41
from dsv41.chat import encode_messages
from dsv41.config import RuntimeConfig
from dsv41.engine.engine import Engine, GenerationConfig, generate_all
from dsv41.engine.sampling import SamplingParams
from dsv41.repl import (BROKEN, COMMANDS, DONE, INTERRUPTED, ChatSession, TerminalGuard, assistant_message,
                        chat_turn, input_lines, run_chat, run_command)
from dsv41.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 160
CONFIG = GenerationConfig(max_new_tokens=6, sampling=SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def tok(demo_dir):
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def model(demo_dir):
    return dsv41.load(demo_dir, RuntimeConfig(max_seq_len=CONTEXT, numerics="fast", dtype="float32"))


class Screen(io.StringIO):
    """stdout of the chat. `arm(n, action)`: on the n-th write from now, call `action` (once)."""

    def __init__(self):
        super().__init__()
        self.countdown, self.action, self.writes = None, None, 0

    def arm(self, n: int, action) -> None:
        self.countdown, self.action, self.writes = n, action, 0

    def write(self, text: str) -> int:
        self.writes += 1
        n = super().write(text)
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                self.action()
        return n


def ctrl_c():
    raise KeyboardInterrupt


def engine_is_idle(engine: Engine) -> bool:
    """Nothing waiting or running, and every slot either free or holding a kept sequence."""
    return (not engine.waiting and not engine.running
            and sorted(engine.free + list(engine.prefix.entries)) == list(range(engine.config.n_slots)))


def chat(model, tok, session, lines, out, **kw) -> None:
    """run_chat, with a KeyboardInterrupt that escapes it turned into a failure (not the end of pytest)."""
    try:
        run_chat(model, tok, session, CONFIG, iter(lines), out, **kw)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped run_chat")


def turn(*args) -> str:
    """chat_turn, with an escaping KeyboardInterrupt a failure."""
    try:
        return chat_turn(*args)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped chat_turn")


def fresh_reply(model, tok, history: list[dict], user_text: str) -> dict:
    """The next turn's reply computed here from scratch: encode, one generate_all on a new engine."""
    messages = history + [{"role": "user", "content": user_text}]
    [completion] = generate_all(model, tok, [tok.encode_prompt(encode_messages(messages, "chat"))], CONFIG)
    return assistant_message(completion.text, "chat")


# ------------------------------------------------------------------------------------ Ctrl-C during a reply
def test_ctrl_c_mid_reply_drops_the_turn_and_the_next_turn_is_a_fresh_sessions(model, tok, capsys):
    session, out = ChatSession(), Screen()
    engine = Engine(model, tok, CONFIG.engine(2))
    seen = {}

    def lines():
        yield "hello"
        seen["after first"] = [dict(m) for m in session.history]
        out.arm(2, ctrl_c)                              # the second token of the next reply
        yield "tell me more"
        seen["idle"], seen["last"] = engine_is_idle(engine), session.last
        seen["history"] = [dict(m) for m in session.history]
        seen["text"] = out.getvalue()
        yield "and then?"

    chat(model, tok, session, lines(), out, engine=engine)
    kept = seen["after first"]
    assert len(kept) == 2
    # the interrupted turn left no request in the engine and nothing in the history
    assert seen["idle"] and seen["history"] == kept and seen["last"] is None
    assert "interrupted" in capsys.readouterr().err
    # the reply stopped where it was interrupted: 6 tokens for the first reply, 2 for the second
    first = kept[1]["content"]
    assert seen["text"].startswith(first + "\n") and seen["text"].endswith("\n")
    # the next turn is what a fresh session with the kept history gives, computed independently
    assert session.history[:2] == kept and session.history[2] == {"role": "user", "content": "and then?"}
    assert session.history[3] == fresh_reply(model, tok, kept, "and then?")
    again = ChatSession()
    again.history = [dict(m) for m in kept]
    chat(model, tok, again, ["and then?"], Screen())
    assert again.history == session.history
    assert engine_is_idle(engine) and not engine.running


def test_sigint_mid_reply_is_caught_and_the_handler_restored(model, tok, capsys):
    """A real SIGINT (what Ctrl-C sends) stops the reply at the end of the step it arrived in; the
    process's own SIGINT handler never sees it and is back in place afterwards."""
    received = []

    def outer(signum, frame):
        received.append(signum)

    previous = signal.signal(signal.SIGINT, outer)
    try:
        session, out = ChatSession(), Screen()
        engine = Engine(model, tok, CONFIG.engine(2))
        out.arm(2, lambda: signal.raise_signal(signal.SIGINT))
        chat(model, tok, session, ["hello"], out, engine=engine)
        handler_after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert received == [] and handler_after is outer
    assert session.history == [] and session.last is None and engine_is_idle(engine)
    # stopped after the step of the second token (a token a step): far short of the 6 asked for
    assert 2 <= out.writes - 1 <= 3                     # writes after arming, the newline after the reply
    assert "interrupted" in capsys.readouterr().err


class TwiceInterrupted:
    """The model, but its forward at call `fire_at` raises SIGINT twice (Ctrl-C pressed twice inside a
    step): the turn is cut in the middle of `Engine.step`."""

    def __init__(self, model, engine_calls: int):
        self._model, self.fire_at, self.calls = model, engine_calls, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kw):
        self.calls += 1
        if self.calls == self.fire_at:
            signal.raise_signal(signal.SIGINT)         # deferred to the end of the step …
            signal.raise_signal(signal.SIGINT)         # … but not this one
        return self._model(*args, **kw)


def test_second_ctrl_c_inside_a_step_replaces_the_engine(model, tok):
    twice = TwiceInterrupted(model, engine_calls=10 ** 9)
    session, out = ChatSession(), Screen()
    engine = Engine(twice, tok, CONFIG.engine(2))
    steps = {}

    def second_sigint_in_the_next_forward():
        twice.fire_at = twice.calls + 1

    def lines():
        out.arm(2, second_sigint_in_the_next_forward)
        yield "hello"
        steps["after"] = engine.stats.steps
        yield "and then?"

    # chat_turn says the engine was cut mid-step …
    assert turn(engine, tok, ChatSession(), "hi", CONFIG, out) == DONE
    out.arm(2, second_sigint_in_the_next_forward)
    assert turn(engine, tok, ChatSession(), "hi", CONFIG, out) == BROKEN
    # … and run_chat goes on with a new engine: the old one is not stepped again, the turn is fresh
    engine = Engine(twice, tok, CONFIG.engine(2))
    chat(twice, tok, session, lines(), out, engine=engine)
    assert engine.stats.steps == steps["after"]
    assert session.history == [{"role": "user", "content": "and then?"}, fresh_reply(model, tok, [], "and then?")]


def test_interrupt_between_steps_is_a_clean_cancel(model, tok):
    out = Screen()
    engine = Engine(model, tok, CONFIG.engine(2))
    out.arm(3, ctrl_c)
    assert turn(engine, tok, ChatSession(), "hi", CONFIG, out) == INTERRUPTED
    assert engine_is_idle(engine) and len(engine.free) == 2          # the cancelled slot is not kept


# ------------------------------------------------------------------------------------ /prompt
def test_prompt_command_prints_what_encode_messages_renders(model, tok, capsys):
    session, out = ChatSession(system="be brief"), Screen()
    assert any(command.startswith("/prompt") for command, _ in COMMANDS)
    run_command(session, "/help")
    assert "/prompt" in capsys.readouterr().err
    chat(model, tok, session, ["hello", "/prompt", "/prompt and then?", "and then?"], out)
    messages = [{"role": "system", "content": "be brief"}] + session.history[:2]
    conversation = encode_messages(messages, "chat")
    next_turn = encode_messages(messages + [{"role": "user", "content": "and then?"}], "chat")
    first = session.history[1]["content"]
    assert out.getvalue().startswith(f"{first}\n{conversation}\n{next_turn}\n")
    assert len(session.history) == 4                   # /prompt sends nothing
    # the token count /prompt TEXT reports is the prompt the turn with TEXT then sends
    err = capsys.readouterr().err.splitlines()
    count = [line for line in err if line.endswith(" tokens")]
    [turn] = [line for line in err if line.startswith("prompt ")][1:]
    assert count == [f"{turn.split()[1]} tokens"]
    # thinking mode with an effort renders as the encoder does
    out = Screen()
    run_command(session, "/think on")
    run_command(session, "/effort low")
    run_command(session, "/prompt why?", out)
    expected = encode_messages(messages + session.history[2:] + [{"role": "user", "content": "why?"}],
                               "thinking", reasoning_effort=50)
    assert out.getvalue() == expected + "\n"


# ------------------------------------------------------------------------------------ input from a pipe
def test_piped_lines_have_no_prompt_and_end_at_eof(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\n\n  b \nlast"))
    assert list(input_lines(False)) == ["a", "", "  b ", "last"]
    assert capsys.readouterr().out == ""


def test_chat_from_a_pipe_ends_at_eof(model, tok, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    session = ChatSession()
    chat(model, tok, session, input_lines(False), Screen())
    assert [m["role"] for m in session.history] == ["user", "assistant"]


# ------------------------------------------------------------------------------------ the terminal
def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _drain(fd: int, timeout: float = 0.3) -> bytes:
    data = b""
    while _readable(fd, timeout):
        chunk = os.read(fd, 1024)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def terminal():
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] |= termios.ECHO | termios.ICANON
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    yield master, slave
    os.close(master)
    os.close(slave)


def test_terminal_guard_quiets_echo_and_discards_typed_ahead_input(terminal):
    master, slave = terminal
    before = termios.tcgetattr(slave)
    os.write(master, b"seen\n")                         # without the guard the terminal echoes
    assert b"seen" in _drain(master)
    assert os.read(slave, 100) == b"seen\n"
    with TerminalGuard(slave):
        assert not termios.tcgetattr(slave)[3] & termios.ECHO
        os.write(master, b"typed during the reply\n")
        assert _readable(slave, 2.0)                    # the line reached the terminal's input …
        assert _drain(master) == b""                    # … without being echoed
    assert not _readable(slave, 0.2)                    # and it was discarded at the end
    assert termios.tcgetattr(slave) == before
    with pytest.raises(KeyboardInterrupt):              # restored however the reply ends
        with TerminalGuard(slave):
            raise KeyboardInterrupt
    assert termios.tcgetattr(slave) == before


def test_chat_quiets_the_terminal_during_a_reply_and_restores_it(model, tok, terminal):
    master, slave = terminal
    before = termios.tcgetattr(slave)
    stdin = os.fdopen(os.dup(slave), "r")
    during = {}

    def type_during_the_reply():
        during["echo"] = bool(termios.tcgetattr(slave)[3] & termios.ECHO)
        os.write(master, b"next question\n")
        during["queued"] = _readable(slave, 2.0)
        during["echoed"] = _drain(master)

    for interrupt in (False, True):
        out = Screen()
        out.arm(2, type_during_the_reply if not interrupt else lambda: (type_during_the_reply(), ctrl_c()))
        session = ChatSession()
        try:
            chat(model, tok, session, ["hello"], out, stdin=stdin)
        finally:
            after = termios.tcgetattr(slave)
        assert during == {"echo": False, "queued": True, "echoed": b""}
        assert after == before and not _readable(slave, 0.2)
        assert len(session.history) == (0 if interrupt else 2)
    stdin.close()


# ------------------------------------------------------------------------------------ readline, in a child
DRIVER = r"""
import signal, sys, torch
# Ctrl-C as in a terminal's shell: a runner started in the background (nohup, `&`) passes SIGINT on ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
torch.set_num_threads(1)
import dsv41
from dsv41.config import RuntimeConfig
from dsv41.engine.engine import GenerationConfig
from dsv41.repl import ChatSession, input_lines, run_chat
from dsv41.tokenizer import Tokenizer
path, n = sys.argv[1], int(sys.argv[2])
model = dsv41.load(path, RuntimeConfig(max_seq_len=1024, numerics="fast", dtype="float32"))
config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
run_chat(model, Tokenizer.from_dir(path), ChatSession(), config, input_lines(sys.stdin.isatty()), sys.stdout)
print("CHAT ENDED", flush=True)
"""


class Child:
    """A process on a pseudo-terminal (its controlling terminal: ^C there is SIGINT)."""

    def __init__(self, argv: list[str], env: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                               # the child
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.seen, self.at = b"", 0

    def expect(self, needle: bytes, timeout: float = 60.0) -> bytes:
        """Read until `needle` appears after the last match; → what came before it."""
        deadline = time.monotonic() + timeout
        while needle not in self.seen[self.at:]:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"{needle!r} not seen; the terminal shows:\n{self.seen.decode(errors='replace')}")
        i = self.seen.index(needle, self.at)
        before, self.at = self.seen[self.at:i], i + len(needle)
        return before

    def _read(self, timeout: float) -> bool:
        if not _readable(self.fd, timeout):
            return True
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:                                 # EIO: the child closed the terminal
            return False
        self.seen += chunk
        return bool(chunk)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.1)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        self.kill()
        raise AssertionError(f"the chat did not end; the terminal shows:\n{self.seen.decode(errors='replace')}")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.fixture
def run_child(demo_dir, tmp_path):
    children = []

    def start(tokens: int, cache: Path) -> Child:
        env = dict(os.environ, DSV41_CACHE=str(cache), DSV41_DEMO="random", TERM="dumb", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        child = Child([sys.executable, "-c", DRIVER, str(demo_dir), str(tokens)], env)
        children.append(child)
        return child

    yield start
    for child in children:
        child.kill()


def test_readline_prompt_ctrl_c_ctrl_d_and_history_across_sessions(run_child, tmp_path):
    cache = tmp_path / "cache"
    history = cache / "chat_history"
    # first session: a line dropped with Ctrl-C, a turn with input typed ahead of its reply, then Ctrl-D
    child = run_child(3, cache)
    child.expect(b">>> ")
    child.send(b"dropped")
    child.expect(b"dropped")
    # (a key's echo is written before readline is back waiting: a ^C right then is seen with the next key)
    time.sleep(0.3)
    child.send(b"\x03")                                 # Ctrl-C at the prompt: the line goes, a new prompt
    child.expect(b">>> ")
    child.send(b"hello\rzzz")                           # zzz: typed while the reply is generated
    child.expect(b"finish: length")
    child.expect(b">>> ")
    child.send(b"\x04")                                 # Ctrl-D on an empty line: leave
    assert child.wait() == 0
    shown = child.seen.decode(errors="replace")
    assert "CHAT ENDED" in shown and "Traceback" not in shown and "zzz" not in shown
    assert history.read_text().split() == ["hello"]
    # second session: the history is back (Ctrl-P recalls "hello"); Ctrl-C stops a long reply, not the chat
    child = run_child(2000, cache)
    child.expect(b">>> ")
    child.send(b"\x10")
    child.expect(b"hello")
    child.send(b"\r")
    time.sleep(1.5)                                     # part of the 2000-token reply
    child.send(b"\x03")
    child.expect(b"interrupted")
    child.expect(b">>> ")
    child.send(b"/exit\r")
    assert child.wait() == 0
    shown = child.seen.decode(errors="replace")
    assert "CHAT ENDED" in shown and "Traceback" not in shown and "finish:" not in shown


def test_unusable_history_file_is_ignored(run_child, tmp_path):
    not_a_dir = tmp_path / "a file"
    not_a_dir.write_text("")
    child = run_child(2, not_a_dir)                     # the history would be "a file"/chat_history
    child.expect(b">>> ")
    child.send(b"hi\r")
    child.expect(b"finish:")
    child.expect(b">>> ")
    child.send(b"\x04")
    assert child.wait() == 0
    assert "Traceback" not in child.seen.decode(errors="replace")
