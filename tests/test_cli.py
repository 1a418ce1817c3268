"""The `dsv41` command, run as `python -m dsv41` in a subprocess against the demo model.

Every subprocess shares one DSV41_CACHE (the session's demo, created once in-process first) and runs
with one intra-op thread (see conftest.py). Argument-parsing checks (`--help`, bad files) run
in-process through `cli.main`, which is the same code without the interpreter start-up.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dsv41
from dsv41 import cli
from dsv41.chat import encode_messages
from dsv41.config import RELEASED_CONFIG, RuntimeConfig
from dsv41.demo import DEMO_NAME
from dsv41.engine.engine import GenerationConfig, generate_all
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.score import score
from dsv41.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
SPEC_CONFIG = RELEASED_CONFIG
STATS = re.compile(r"prompt (\d+) tokens(?: \((\d+) cached\))?, generated (\d+) tokens, TTFT \d+ ms, [\d.]+ tok/s, "
                   r"(?:accepted \d+/\d+ drafts, )?finish: (eos|stop|length|context)")


@pytest.fixture
def in_process_env(demo_dir, monkeypatch):
    monkeypatch.setenv("DSV41_CACHE", str(demo_dir.parent))
    monkeypatch.setenv("DSV41_DEMO", "random")


def dsv41_cmd(env, *args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv41", *args], input=stdin if stdin is not None else "",
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def run_cli(argv: list[str], capsys, monkeypatch, stdin: str = "") -> tuple[int, str, str]:
    """`dsv41 ARGV` in this process, stdin fed from `stdin`: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    capsys.readouterr()
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def stats(stderr: str) -> list[tuple[int, int, str]]:
    return [(int(a), int(b), r) for a, _, b, r in STATS.findall(stderr)]


def cached(stderr: str) -> list[int]:
    return [int(c or 0) for _, c, _, _ in STATS.findall(stderr)]


# ------------------------------------------------------------------------------------ generate
def test_generate_prompt_argument_matches_the_engine(cli_env, demo_dir):
    run = dsv41_cmd(cli_env, "generate", "Hello, who are you?", "--max-new-tokens", "5", "--temperature", "0")
    assert run.returncode == 0, run.stderr
    assert "its text is not language" in run.stderr
    [(prompt_tokens, generated, _)] = stats(run.stderr)
    # the same request in-process: chat-encoded, greedy
    tok = Tokenizer.from_dir(demo_dir)
    model = dsv41.load(demo_dir, RuntimeConfig(max_seq_len=cli.DEFAULT_MAX_CONTEXT))
    prompt = tok.encode_prompt(encode_messages([{"role": "user", "content": "Hello, who are you?"}], "chat"))
    [c] = generate_all(model, tok, [prompt], GenerationConfig(max_new_tokens=5, sampling=SamplingParams(0.0),
                                                              skip_special_tokens=True))
    assert run.stdout == c.text + "\n"
    assert (prompt_tokens, generated) == (len(prompt), c.generated_tokens)


def test_generate_from_stdin_raw(in_process_env, capsys, monkeypatch):
    status, _, err = run_cli(["generate", "--raw", "--max-new-tokens", "3"], capsys, monkeypatch,
                             stdin="The quick brown fox\n")
    assert status == 0, err
    [(prompt_tokens, generated, _)] = stats(err)
    assert 0 < generated <= 3 and prompt_tokens == 4               # The, quick, brown, fox


def test_no_huge_pages_loads_plain_allocations_with_the_same_text(in_process_env, capsys, monkeypatch):
    runtimes = []

    def loading(path, runtime, **kw):
        runtimes.append(runtime)
        return dsv41.load(path, runtime, **kw)

    monkeypatch.setattr(cli, "load", loading)
    argv = ["generate", "--raw", "The quick brown fox", "--max-new-tokens", "4", "--temperature", "0", "--ignore-eos"]
    packed = run_cli(argv, capsys, monkeypatch)
    plain = run_cli(argv + ["--no-huge-pages"], capsys, monkeypatch)
    assert packed[0] == plain[0] == 0, plain[2]
    assert [r.huge_pages for r in runtimes] == [True, False]
    assert packed[1] == plain[1] and packed[1].strip()


def test_generate_several_prompts_prints_headers(in_process_env, capsys, monkeypatch):
    status, out, err = run_cli(["generate", "--raw", "one", "two words", "--max-new-tokens", "2", "--stop", "zz"],
                               capsys, monkeypatch)
    assert status == 0, err
    assert "=== completion 0 ===" in out and "=== completion 1 ===" in out
    assert len(stats(err)) == 2


def test_demo_default_length_is_short_and_a_checkpoint_gets_the_reference_default(in_process_env, demo_dir, capsys,
                                                                                  monkeypatch):
    status, _, err = run_cli(["generate", "hi", "--ignore-eos", "--numerics", "fast"], capsys, monkeypatch)
    assert status == 0, err
    assert [g for _, g, _ in stats(err)] == [cli.DEMO_MAX_NEW_TOKENS]
    seen = []
    monkeypatch.setattr(cli, "generate_all", lambda m, t, p, config, *rest, **kw: seen.append(config.max_new_tokens) or [])
    for argv in (["--checkpoint", str(demo_dir)], ["--max-new-tokens", "7"]):
        status, _, err = run_cli(["generate", "hi", "--numerics", "fast", *argv], capsys, monkeypatch)
        assert status == 0, err
    assert seen == [cli.DEFAULT_MAX_NEW_TOKENS, 7]


def test_special_tokens_are_hidden_unless_asked(in_process_env, capsys, monkeypatch):
    seen = []
    real = cli.generate_all
    monkeypatch.setattr(cli, "generate_all", lambda m, t, p, config, *rest, **kw: seen.append(config.skip_special_tokens)
                        or real(m, t, p, config, *rest))
    for flag in ((), ("--show-special",)):
        status, _, err = run_cli(["generate", "hi", "--max-new-tokens", "1", "--numerics", "fast", *flag], capsys,
                                 monkeypatch)
        assert status == 0, err
    assert seen == [True, False]


class _Only:
    """A constraint that allows one token: forces the engine to emit it."""

    def __init__(self, token: int):
        self.token = token

    def allowed(self, vocab_size: int) -> torch.Tensor:
        return torch.arange(vocab_size) == self.token

    def advance(self, token_id: int) -> None:
        pass

    def fork(self) -> "_Only":
        return self


def test_the_engine_leaves_special_tokens_out_of_the_text_when_asked(demo_dir):
    from dsv41.engine.engine import Engine, EngineConfig
    from dsv41.engine.request import Request
    tok = Tokenizer.from_dir(demo_dir)
    think = tok.token_to_id("<think>")
    model = dsv41.load(demo_dir, RuntimeConfig(max_seq_len=64, numerics="fast"))
    texts = {}
    for skip in (False, True):
        engine = Engine(model, tok, EngineConfig(n_slots=1, prefix_cache=0))
        engine.submit(Request((0, 5), max_new_tokens=3, ignore_eos=True, constraint=_Only(think),
                              skip_special_tokens=skip))
        done = [e.completion for e in engine.run() if getattr(e, "completion", None) is not None]
        assert done[0].token_ids == [think] * 3
        texts[skip] = done[0].text
    assert texts == {False: "<think>" * 3, True: ""}


# ------------------------------------------------------------------------------------ score
def test_score_text(in_process_env, capsys, monkeypatch):
    status, out, err = run_cli(["score", "Hello world", "The quick brown fox"], capsys, monkeypatch)
    assert status == 0, err
    rows = [line.split("\t") for line in out.splitlines() if line and not line.startswith(("#", "perp"))]
    values = [float(r[3]) for r in rows if r[3] != "-"]
    assert len(values) == len(rows) - 2 and all(v <= 0 for v in values)
    perplexities = [float(line.split("\t")[1]) for line in out.splitlines() if line.startswith("perplexity")]
    assert len(perplexities) == 2 and all(p > 1 for p in perplexities)


def test_score_ids_and_dump_logits(in_process_env, demo_dir, tmp_path, capsys, monkeypatch):
    seqs = [[0, 366, 637, 685, 576], [0, 56, 615]]
    ids_file, npz = tmp_path / "ids.json", tmp_path / "logits.npz"
    ids_file.write_text(json.dumps(seqs))
    status, out, err = run_cli(["score", "--ids", str(ids_file), "--dump-logits", str(npz), "--prefill", "2"], capsys,
                               monkeypatch)
    assert status == 0, err
    data = np.load(npz)
    logits = data["logits"]
    assert logits.shape == (2, 5, 768) and logits.dtype == np.float32
    assert data["lengths"].tolist() == [5, 3]
    # entry t = next-token logits after token t: the same computation in-process (prefill 2, then
    # decode; how decode and prefill agree is tested in test_generate.py)
    model = dsv41.load(demo_dir, RuntimeConfig(max_seq_len=cli.DEFAULT_MAX_CONTEXT))
    expect = score(model, seqs, prefill=2).logits.numpy()
    for i, n in enumerate([5, 3]):
        np.testing.assert_allclose(logits[i, :n], expect[i, :n], atol=1e-3)
    # the printed log-probs are the log-softmax of the dumped logits
    logp = torch.log_softmax(torch.from_numpy(logits), -1)
    printed = [float(line.split("\t")[3]) for line in out.splitlines()
               if line[:1].isdigit() and not line.endswith("\t-")]
    direct = [float(logp[i, t, seq[t + 1]]) for i, seq in enumerate(seqs) for t in range(len(seq) - 1)]
    np.testing.assert_allclose(printed, direct, atol=1e-5)


def test_score_bad_ids_file_is_one_clean_line(in_process_env, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for content, message in ((json.dumps([[0, 5], [100000]]), "sequence 1 holds 100000"),
                             ("[[0, 5]", "not valid JSON"), (json.dumps([0, 5]), "list of non-empty token-id lists")):
        bad.write_text(content)
        assert cli.main(["score", "--ids", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("dsv41: error: ") and message in err


# ------------------------------------------------------------------------------------ chat
def test_chat_through_stdin(in_process_env, capsys, monkeypatch):
    status, _, err = run_cli(["chat", "--max-new-tokens", "3"], capsys, monkeypatch, stdin="hello\n/think on\nhi\n/exit\n")
    assert status == 0, err
    assert "thinking mode on" in err
    turns = stats(err)
    assert len(turns) == 2
    # the second prompt re-encodes the first exchange, so it is longer than the first
    assert turns[1][0] > turns[0][0]


def test_chat_turns_continue_the_kept_conversation(in_process_env, capsys, monkeypatch):
    """In chat mode each turn's prompt extends the last prompt and reply: the engine reuses those
    positions (thinking mode drops old reasoning, so there it cannot)."""
    status, _, err = run_cli(["chat", "--max-new-tokens", "4", "--temperature", "0"], capsys, monkeypatch,
                             stdin="hello\nand then?\nthanks\n/exit\n")
    assert status == 0, err
    turns, reused = stats(err), cached(err)
    assert len(turns) == 3 and reused[0] == 0
    for i in (1, 2):                                      # all of the previous prompt, and the fed reply
        assert turns[i - 1][0] + turns[i - 1][1] - 1 <= reused[i] < turns[i][0]


# ------------------------------------------------------------------------------------ inspect, help, errors
def test_inspect_on_the_released_config(capsys, monkeypatch):
    status, out, err = run_cli(["inspect", str(SPEC_CONFIG)], capsys, monkeypatch)
    assert status == 0, err
    assert "747,170,852,464" in out


@pytest.mark.parametrize("command", ["generate", "chat", "score", "inspect"])
def test_help_for_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dsv41 {command}")
    if command != "inspect":
        for option in ("--checkpoint", "--numerics", "--kernels", "--device", "--dtype", "--max-context"):
            assert option in out


def test_top_level_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("generate", "chat", "score", "inspect"))


def test_missing_checkpoint_dir_is_one_clean_line(in_process_env, tmp_path, capsys, monkeypatch):
    status, _, err = run_cli(["generate", "hi", "--checkpoint", str(tmp_path / "nowhere")], capsys, monkeypatch)
    assert status == 2
    assert err.strip() == f"dsv41: error: checkpoint directory not found: {tmp_path / 'nowhere'}"


def test_prompt_too_long_is_one_clean_line(in_process_env, capsys):
    assert cli.main(["generate", "hello", "--max-context", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"dsv41: error: prompt 0 has \d+ tokens, more than the context of 3 tokens", err[-1])
    assert not any("Traceback" in line for line in err)


def test_bad_config_is_one_clean_line(in_process_env, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    (tmp_path / "tokenizer.json").write_text((Path(os.environ["DSV41_CACHE"]) / DEMO_NAME / "tokenizer.json")
                                             .read_text(encoding="utf-8"), encoding="utf-8")
    assert cli.main(["generate", "hi", "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv41: error: ") and "missing config keys" in err and "\n" not in err


def test_chat_session_commands_and_history(demo_dir, capsys):
    import io

    from dsv41.repl import ChatSession, run_chat

    tok = Tokenizer.from_dir(demo_dir)
    model = dsv41.load(demo_dir, RuntimeConfig(max_seq_len=64, numerics="fast", dtype="float32"))
    session = ChatSession()
    config = GenerationConfig(max_new_tokens=2, sampling=SamplingParams(0.0))
    out = io.StringIO()
    run_chat(model, tok, session, config, iter(["hello", "/think on", "/effort low", "/system be brief"]), out)
    assert (session.thinking, session.effort, session.system) == (True, 50, "be brief")
    assert [m["role"] for m in session.history] == ["user", "assistant"]
    assert session.history[0]["content"] == "hello"
    # a turn that no longer fits the context is reported and leaves the history as it was
    run_chat(model, tok, session, GenerationConfig(max_context=8), iter(["a longer question"]), out)
    assert len(session.history) == 2 and "/clear starts over" in capsys.readouterr().err
    run_chat(model, tok, session, config, iter(["/clear", "/exit", "never read"]), out)
    assert session.history == []


def test_generate_speculative_equals_plain_greedy_and_prints_acceptance(cli_env):
    args = ("generate", "--raw", "--temperature", "0", "--ignore-eos", "--max-new-tokens", "12", "Hi", "The quick")
    plain, spec = dsv41_cmd(cli_env, *args), dsv41_cmd(cli_env, args[0], "--speculative", *args[1:])
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert len(re.findall(r"accepted \d+/\d+ drafts", spec.stderr)) == 2
