"""Every mistake a user can make on the command line or through the Python API: one line naming the culprit.

Each CLI case runs `cli.main` in-process and asserts exit status 2, exactly one line on stderr, the
culprit named in it, no traceback, and (where something would be written) nothing half-done. One
subprocess test covers what only a real process shows (a closed pipe).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import dsv41
from dsv41 import cli
from dsv41.checkpoint.safetensors_io import INDEX_NAME
from dsv41.config import RuntimeConfig
from dsv41.errors import CheckpointError, InputError, UserError
from dsv41.tokenizer import Tokenizer


@pytest.fixture
def demo_env(demo_dir, monkeypatch):
    monkeypatch.setenv("DSV41_CACHE", str(demo_dir.parent))
    monkeypatch.setenv("DSV41_DEMO", "random")
    monkeypatch.delenv("DSV41_DEBUG", raising=False)
    return demo_dir


def one_line(capsys, *fragments: str, lines: int = 1) -> str:
    """The error's lines (notes such as the demo's are not errors); asserts there are `lines` of them."""
    err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True) if ": note: " not in line)
    assert err.count("\n") == lines and err.endswith("\n") and "error" in err.splitlines()[0], err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def fails(argv: list[str], capsys, *fragments: str, status: int = 2, lines: int = 1) -> str:
    try:
        got = cli.main(argv)
    except SystemExit as e:                                     # argparse's own exit
        got = e.code
    assert got == status
    return one_line(capsys, *fragments, lines=lines)


# ---------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("device, fragment", [("bogus", "'bogus' is not a device"), ("meta", "meta holds no data"),
                                              ("cuda:7" if torch.cuda.is_available() else "cuda", "cuda")])
def test_bad_devices(demo_env, capsys, device, fragment):
    fails(["generate", "hi", "--device", device], capsys, f"--device", fragment)


# ---------------------------------------------------------------------------------------- text sources
def test_invalid_utf8_argument(demo_env, capsys):
    fails(["generate", "ok", "bad \udcff byte"], capsys, "prompt 2 is not valid UTF-8")


def test_invalid_utf8_on_stdin(demo_env, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n")))
    fails(["generate"], capsys, "stdin is not valid UTF-8", "0xe9", "offset 3")


def test_invalid_utf8_in_a_file(demo_env, capsys, tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"hello\n\n\xff\xfe")
    fails(["generate", "--file", str(bad)], capsys, f"{bad} is not valid UTF-8")
    fails(["score", "caf\udce9"], capsys, "text 1 is not valid UTF-8")


@pytest.mark.parametrize("argv, fragment", [
    (["generate", ""], "prompt 1 is empty"),
    (["generate", "fine", "  \n\t"], "prompt 2 is empty"),
    (["score", ""], "text 1 is empty"),
    (["generate", "hi", "--seed", str(10 ** 24)], "outside 0 … 2^63 − 1"),
    (["generate", "hi", "--seed", "many"], "'many' is not an integer"),
    (["generate", "hi", "--effort", "high"], "--effort sets the reasoning effort of thinking mode; add --thinking"),
    (["generate", "hi", "--stop-id", "999999"], "--stop-id 999999 is not a token id"),
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens must be at least 1, got 0"),
    (["generate", "hi", "--max-context", "0"], "--max-context: 0 is not at least 1"),
    (["serve", "--max-batch", "-3"], "--max-batch: -3 is not at least 1"),
    (["check", ".", "--max-context", "x"], "--max-context: 'x' is not an integer"),
])
def test_each_bad_argument_is_one_line(demo_env, capsys, argv, fragment):
    fails(argv, capsys, fragment)


def test_dump_logits_into_a_missing_directory_fails_before_the_run(demo_env, capsys, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "score", lambda *a, **k: ran.append(1))
    fails(["score", "hello", "--dump-logits", str(tmp_path / "nowhere" / "logits.npy")], capsys, "--dump-logits",
          "does not exist")
    assert ran == []


def test_checkpoint_that_is_a_file_or_not_a_checkpoint(demo_env, capsys, tmp_path):
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"\0" * 16)
    fails(["generate", "hi", "--checkpoint", str(file)], capsys, "is a file; give the checkpoint's directory")
    fails(["generate", "hi", "--checkpoint", str(tmp_path)], capsys, "is not a checkpoint directory: it has no "
                                                                      "config.json")


def test_layout_errors_name_the_offenders(demo_env, capsys, tmp_path):
    """A partial copy: the index lacks twelve tensors; the error names them, a few and then a count, on a
    second line (the first says what is wrong, the second which tensors)."""
    copy = tmp_path / "demo"
    shutil.copytree(demo_env, copy)
    index = json.loads((copy / INDEX_NAME).read_text())
    dropped = sorted(index["weight_map"])[:12]
    for name in dropped:
        del index["weight_map"][name]
    (copy / INDEX_NAME).write_text(json.dumps(index))
    err = fails(["generate", "hi", "--checkpoint", str(copy)], capsys, "12 missing", "(7 more)", lines=2)
    listed = err.splitlines()[1].strip()
    assert listed.startswith("missing (12): ")
    shown = listed.removeprefix("missing (12): ").removesuffix(", … (7 more)").split(", ")
    assert len(shown) == 5 and set(shown) <= set(dropped)
    before = (copy / INDEX_NAME).read_text()
    assert json.loads(before)["weight_map"] == index["weight_map"]          # nothing was touched


def test_many_line_errors_are_cut_with_a_count():
    message = "\n".join(f"line {i}" for i in range(20))
    shown = cli.one_error(CheckpointError(message)).splitlines()
    assert shown[: cli.SHOWN_LINES] == [f"line {i}" for i in range(cli.SHOWN_LINES)]
    assert shown[-1] == f"… and {20 - cli.SHOWN_LINES} more lines"


def test_a_bug_says_it_is_a_bug_and_debug_shows_the_traceback(demo_env, capsys, monkeypatch):
    def broken(args):
        raise ValueError("an internal invariant")                 # a ValueError is not a user error
    monkeypatch.setitem(cli._COMMANDS, "generate", broken)
    fails(["generate", "hi"], capsys, "internal error (a bug in dsv41", "ValueError: an internal invariant",
          "--debug", status=cli.EXIT_BUG)
    with pytest.raises(ValueError):
        cli.main(["--debug", "generate", "hi"])


def test_user_errors_are_their_own_types():
    assert not issubclass(ValueError, UserError) and ValueError not in cli.USER_ERRORS
    assert issubclass(InputError, UserError) and issubclass(CheckpointError, UserError)


def test_closed_pipe_is_quiet(demo_dir):
    env = dict(os.environ, DSV41_CACHE=str(demo_dir.parent), DSV41_DEMO="random", OMP_NUM_THREADS="1")
    env.pop("DSV41_DEBUG", None)
    proc = subprocess.Popen(f"{sys.executable} -m dsv41 generate hi --max-new-tokens 40 --ignore-eos "
                            "--numerics fast | head -c 1", shell=True, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=300)
    assert "Broken pipe" not in err and "Traceback" not in err and "error" not in err


# ---------------------------------------------------------------------------------------- Python API
@pytest.fixture(scope="module")
def demo_model(demo_dir):
    return dsv41.load(demo_dir, RuntimeConfig(max_seq_len=64, numerics="fast"))


def test_api_bad_ids_and_caches(demo_model):
    cache = demo_model.new_cache(1, 32)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(InputError, match="cache"):
        demo_model.forward(ids, 0, None)
    with pytest.raises(InputError, match="\\[B, T\\]"):
        demo_model.forward(ids[None], 0, cache)
    with pytest.raises(InputError, match="integer tensor"):
        demo_model.forward(ids.float(), 0, cache)
    with pytest.raises(InputError, match="max_seq_len must be in 1 … 64"):
        demo_model.new_cache(1, -1)
    with pytest.raises(InputError, match="max_seq_len must be in 1 … 64"):
        demo_model.new_cache(1, 65)                               # larger than the runtime's context
    with pytest.raises(InputError, match="n_slots"):
        demo_model.new_cache(0)


def test_api_corrupt_tokenizer_names_the_file(demo_dir, tmp_path):
    from dsv41.model.engram import load_or_build_token_map
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match=str(bad)):
        load_or_build_token_map(bad, 100)
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
