"""The shipped trained demo (dsv41/demo_model/): it learned the language, it speaks it, and stays put.

- Its held-out perplexity, through the normal loader's inference forward, beats a unigram model of the
  training text on the same tokenizer by a wide margin (measured when it was trained: see
  docs/TRAINING.md §7).
- The README's first command prints words of the training text's vocabulary; the random-weight demo,
  run the same way, does not (the check can fail).
- Greedy continuations of fixed prompts are the recorded ones (reference numerics, invariant kernels:
  the same bits on any CPU).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv41
from dsv41.chat import encode_messages
from dsv41.config import RuntimeConfig
from dsv41.demo import TRAINED_DEMO
from dsv41.engine.engine import GenerationConfig, generate_all
from dsv41.engine.sampling import SamplingParams
from dsv41.tokenizer import Tokenizer
from dsv41.training.data import TokenData
from dsv41.training.report import checkpoint_perplexity

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "tinyshakespeare.txt"
SEQ_LEN = 128
# the training stream's last 5% (32,495 tokens) was held out: the end of the plain text
HELD_OUT_TOKENS = 30_000
SEQUENCES = 32
GOLDEN_PROMPTS = {"chat": "Hello, who are you?", "raw": "First Citizen:\n"}
# recorded from the shipped demo: "I am a man of your honour." and
# "I'll not, my lord; and, I'll tell you.\n\nKING RICHARD III:\nI'll not, my lord"
GOLDEN = {
    "chat": [57, 512, 276, 496, 323, 379, 736, 30],
    "raw": [57, 497, 365, 28, 335, 491, 43, 321, 28, 318, 497, 730, 314, 339, 635, 983, 1352, 304, 57, 497, 365, 28, 335,
            491],
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TRAINED_DEMO)


@pytest.fixture(scope="module")
def vocabulary() -> set[str]:
    return set(re.findall(r"[a-z']+", TEXT.read_text(encoding="utf-8").lower()))


def test_held_out_perplexity_beats_unigram_by_far(tokenizer):
    ids = torch.tensor(tokenizer.encode(TEXT.read_text(encoding="utf-8")))
    train, held = ids[:-HELD_OUT_TOKENS], ids[-HELD_OUT_TOKENS:]
    data = TokenData(train, held, tokenizer.bos_id)
    sequences = data.evaluation(SEQ_LEN, SEQUENCES)
    model_ppl = checkpoint_perplexity(TRAINED_DEMO, sequences)
    counts = torch.bincount(train, minlength=tokenizer.vocab_size).double() + 1
    unigram = float(torch.exp(-(counts / counts.sum()).log()[sequences[:, 1:]].mean()))
    assert model_ppl < unigram / 4, (model_ppl, unigram)


def english_share(text: str, vocabulary: set[str]) -> float:
    words = re.findall(r"[a-z']+", text.lower())
    return sum(w in vocabulary for w in words) / max(1, len(words))


def run_first_command(env: dict) -> str:
    run = subprocess.run([sys.executable, "-m", "dsv41", "generate", "Hello, who are you?", "--max-new-tokens", "48"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_first_command_speaks_english_and_the_random_demo_does_not(cli_env, vocabulary):
    trained = run_first_command({k: v for k, v in cli_env.items() if k != "DSV41_DEMO"})
    random = run_first_command(cli_env)
    assert len(re.findall(r"[a-z']+", trained.lower())) >= 5, trained
    assert english_share(trained, vocabulary) >= 0.9, trained
    assert english_share(random, vocabulary) < 0.6, random


@pytest.mark.parametrize("kind, prompt", list(GOLDEN_PROMPTS.items()))
def test_greedy_continuation_is_the_recorded_one(tokenizer, kind, prompt):
    model = dsv41.load(TRAINED_DEMO, RuntimeConfig(max_seq_len=512))
    if kind == "chat":
        ids = tokenizer.encode_prompt(encode_messages([{"role": "user", "content": prompt}]))
    else:
        ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    config = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0))
    [done] = generate_all(model, tokenizer, [ids], config)
    assert done.token_ids == GOLDEN[kind], (done.token_ids, done.text)


def test_the_training_data_is_the_documented_file():
    """data/README.md's size and checksum are those of the shipped text (the demo's provenance)."""
    import hashlib

    text = (REPO / "data" / "tinyshakespeare.txt").read_bytes()
    readme = (REPO / "data" / "README.md").read_text()
    assert hashlib.sha256(text).hexdigest() in readme
    assert f"{len(text.decode('utf-8')):,} characters" in readme
