"""Reproduce the shipped trained demo (dsv41/demo_model/): about 15 minutes on a 2-core CPU.

    python tools/train_demo.py [--out DIR] [--steps N]

Data: data/tinyshakespeare.txt (public domain; see data/README.md), plus the same plays' speeches
rendered as chats in the release's prompt format — each speech a user turn, the next speech the
assistant's reply — so that the default chat-encoded prompt of `dsv41 generate` is in distribution.
The chats come from the first 85% of the text only: the held-out split (the last 5% of the token
stream) is the end of the plain text, which no chat contains.

The text model is trained; `--ship` then gives it the demo's vision tower with random weights
(`dsv41.demo.attach_vision_tower`, seed 0): the image path runs end to end, but vision is untrained.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.chat import encode_messages  # noqa: E402
from dsv41.cli import main  # noqa: E402
from dsv41.demo import attach_vision_tower  # noqa: E402

TEXT = ROOT / "data" / "tinyshakespeare.txt"
CONFIG = ROOT / "dsv41" / "configs" / "demo-trained.json"
SHIPPED = ROOT / "dsv41" / "demo_model"
CHAT_SHARE = 0.85
TURNS_PER_CHAT = 2
# 600 steps of 16 × 128 tokens (about two passes over the data): the held-out loss bottoms out there; a
# 2000-step run at this rate measured 108.9 at step 400 and 135.4 at step 800 (the model memorises)
SETTINGS = ["--vocab-size", "2048", "--steps", "600", "--batch-size", "16", "--seq-len", "128", "--lr", "3e-3",
            "--warmup", "50", "--eval-every", "100", "--save-every", "100", "--eval-sequences", "64", "--seed", "0"]


def speeches(text: str) -> list[str]:
    """The plays' speeches: blank-line separated blocks, each 'Speaker:' then its lines."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) >= 2 and lines[0].endswith(":"):
            out.append("\n".join(lines[1:]).strip())
    return out


def dialogues(text: str) -> str:
    """Consecutive speeches as chats of TURNS_PER_CHAT exchanges (speech → reply), one after another."""
    parts = speeches(text)
    chats = []
    step = 2 * TURNS_PER_CHAT
    for i in range(0, len(parts) - step + 1, step):
        messages = []
        for k in range(TURNS_PER_CHAT):
            messages += [{"role": "user", "content": parts[i + 2 * k]},
                         {"role": "assistant", "content": parts[i + 2 * k + 1]}]
        chats.append(encode_messages(messages))
    return "".join(chats)


def run(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "build" / "demo-train"), help="training directory")
    p.add_argument("--steps", default=None, help="override the step count (a shorter trial run)")
    p.add_argument("--ship", action="store_true", help="copy the result into dsv41/demo_model/")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = TEXT.read_text(encoding="utf-8")
    chats = out / "shakespeare-chats.txt"
    chats.write_text(dialogues(text[:int(len(text) * CHAT_SHARE)]), encoding="utf-8")
    settings = list(SETTINGS)
    if args.steps:
        settings[settings.index("--steps") + 1] = args.steps
    code = main(["train", "--config", str(CONFIG), "--data", str(chats), str(TEXT), "--out", str(out), *settings])
    if code or not args.ship:
        return code
    if SHIPPED.exists():
        shutil.rmtree(SHIPPED)
    shutil.copytree(out, SHIPPED, ignore=shutil.ignore_patterns("state.pt", "shakespeare-chats.txt", "*.partial"))
    attach_vision_tower(SHIPPED, seed=0)
    return 0


if __name__ == "__main__":
    sys.exit(run())
