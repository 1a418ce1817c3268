"""`dsv41 generate --image`, `dsv41 chat --image` / `/image`, on the random demo in subprocesses; under
torchrun the image span travels with rank 0's forward and two ranks print what one process prints."""

from __future__ import annotations

import subprocess
import sys

import pytest
from dsv41.chat import encode_messages
from dsv41.tokenizer import Tokenizer

from helpers import picture
from test_parallel_cli import FAST, REPO, RUN_TIMEOUT_S, single, stats_lines, torchrun

GREEDY = ("--max-new-tokens", "8", "--temperature", "0", "--ignore-eos")


@pytest.fixture(scope="module")
def env(cli_env):
    return cli_env


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures")
    paths = []
    for seed in range(2):
        paths.append(root / f"p{seed}.png")
        paths[-1].write_bytes(picture(97, 61, seed))
    (root / "broken.png").write_bytes(paths[0].read_bytes()[:50])
    return root


def prompt_tokens(stderr: str) -> int:
    [line] = [x for x in stderr.splitlines() if x.startswith("prompt ")]
    return int(line.split()[1])


def test_generate_with_an_image_counts_its_span_and_depends_on_it(env, pictures, demo_dir):
    one = single(env, "generate", "--image", str(pictures / "p0.png"), "What is this?", *GREEDY)
    other = single(env, "generate", "--image", str(pictures / "p1.png"), "What is this?", *GREEDY)
    assert one.returncode == 0 and other.returncode == 0, one.stderr + other.stderr
    # the image block, then the text: one placeholder in the rendered prompt …
    rendered = encode_messages([{"role": "user", "content": [{"type": "image", "url": "x"},
                                                             {"type": "text", "text": "What is this?"}]}])
    placeholders = Tokenizer.from_dir(demo_dir).encode_prompt(rendered)
    # … which a 97 × 61 picture replaces on the demo by 17 positions (168 × 112 pixels: 12 × 8 patches, 4 × 3 cells)
    assert prompt_tokens(one.stderr) == len(placeholders) - 1 + 17
    assert one.stdout != other.stdout


@pytest.mark.parametrize("args, message", [
    (("--image", "missing.png", "hi"), "--image 0: no such file"),
    (("--image", "broken.png", "hi"), "--image 0: cannot be"),
    (("--image", "p0.png", "one", "two"), "--image goes with one prompt"),
    (("--raw", "--image", "p0.png", "no placeholder"), "0 image placeholder token(s)"),
])
def test_image_mistakes_get_one_line(env, pictures, args, message):
    run = subprocess.run([sys.executable, "-m", "dsv41", "generate", *args], capture_output=True, text=True,
                         env=env, cwd=pictures, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert run.returncode == 2
    lines = [x for x in run.stderr.splitlines() if not x.startswith("dsv41: note")]
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("dsv41: error:")


def test_raw_prompts_place_the_image_at_the_placeholder(env, pictures):
    chat = single(env, "generate", "--raw", "--image", str(pictures / "p0.png"), "Look: <｜deepseek_image｜> here",
                  *GREEDY)
    assert chat.returncode == 0, chat.stderr
    plain = single(env, "generate", "--raw", "Look: <｜deepseek_image｜> here", *GREEDY)
    assert prompt_tokens(chat.stderr) == prompt_tokens(plain.stderr) - 1 + 17


def test_chat_attaches_images_and_reuses_the_turn(env, pictures):
    lines = f"/image {pictures / 'p0.png'}\nWhat is this?\nAnd this?\n"
    run = subprocess.run([sys.executable, "-m", "dsv41", "chat", *GREEDY[:4]], input=lines, capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    stats = [x for x in run.stderr.splitlines() if x.startswith("prompt ")]
    assert "image attached to your next message" in run.stderr and len(stats) == 2
    assert "cached" in stats[1] and "cached" not in stats[0]


def test_generate_with_an_image_under_torchrun(env, tmp_path, pictures):
    args = ("generate", "--image", str(pictures / "p0.png"), "What is this?", *GREEDY, *FAST)
    alone = single(env, *args)
    assert alone.returncode == 0, alone.stderr
    _, outs, errs = torchrun(env, tmp_path, *args)
    assert outs[0] == alone.stdout and stats_lines(errs[0]) == stats_lines(alone.stderr)
