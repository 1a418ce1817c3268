"""The `dsv41` command: generate, chat, score, serve and inspect (docs/GENERATION-AND-DSPARK.md §1.3 is the
baseline).

Chat formatting lives here and in `dsv41.chat`; the engine (`dsv41.engine`) sees token ids only.
Errors a user can cause (`dsv41.errors.UserError`: a missing checkpoint, a bad config, a prompt longer
than the context, a bad ids file, an argument out of range, a device this machine lacks) and file
errors end with `dsv41: error: …` (one line; a layout error lists its first offenders) and exit status
2, before anything is half-done where they can be known in advance. Anything else is a bug and says so
(exit status 1). `--debug` or DSV41_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import __version__, load
from .chat import encode_messages
from .config import ModelConfig, RuntimeConfig
from .demo import default_checkpoint
from .engine.engine import GenerationConfig, generate_all
from .engine.request import check_prompts
from .repl import ChatSession, echo_to, input_lines, parse_effort, run_chat
from .engine.sampling import SamplingParams
from .engine.score import score
from .errors import RankLostError, UserError
from .parallel.driver import Driver, await_load, follow, peer_failure
from .parallel.launch import DEFAULT_TIMEOUT_S, init_parallel, launched_world_size, rank_device, shutdown
from .tokenizer import Tokenizer
from .training import command as training_command
from .vision.sources import ImageSources, prompt_images

EXIT_USAGE = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130
# A user error prints its first lines (a layout error lists the offending tensors), then a count.
SHOWN_LINES = 8
SEED_RANGE = (0, 2 ** 63 - 1)
# The reference's seed and max_new_tokens defaults (docs/GENERATION-AND-DSPARK.md §1.3).
DEFAULT_SEED = 33377335
DEFAULT_MAX_NEW_TOKENS = 200
DEMO_MAX_NEW_TOKENS = 32
# Model card recommendation (docs/TOKENIZER-AND-CHAT.md §9, last paragraph).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_CONTEXT = 4096


class CliError(UserError):
    """A mistake in the command line or its inputs."""


# ------------------------------------------------------------------------------------ argument parser
def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--checkpoint", metavar="DIR",
                   help="released-layout checkpoint directory (default: the built-in trained demo; DSV41_DEMO=random: the "
                        "random-weight one)")
    g.add_argument("--numerics", choices=("reference", "fast"), default="reference",
                   help="reference: the release's fp8/fp4 numerics; fast: dequantised weights (default: reference)")
    g.add_argument("--kernels", choices=("invariant", "blas"), default=None,
                   help="invariant: exact-sum matmuls, so a position gives the same bits however calls are "
                        "shaped (speculative greedy = greedy, batch = solo); blas: the BLAS at each call's "
                        "shape, faster, results move in the last bit with it (default: invariant with "
                        "--numerics reference, blas with fast)")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="activation dtype; float32 needs --numerics fast (default: bfloat16)")
    g.add_argument("--stored-experts", action="store_true",
                   help="with --numerics fast on the CPU: keep fp4 routed experts in their stored bytes (a quarter "
                        "of the memory), decoded inside the expert kernels; the same results")
    g.add_argument("--engram-on-disk", action="store_true",
                   help="keep the Engram tables memory-mapped: only looked-up rows are ever read")
    g.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="on the CPU, give each weight its own allocation instead of one buffer on 2 MB pages "
                        "(those decode faster; their first touch can cost more on some virtual machines)")
    g.add_argument("--max-context", type=count, default=DEFAULT_MAX_CONTEXT, metavar="N",
                   help=f"positions the cache holds, prompt plus completion (default: {DEFAULT_MAX_CONTEXT})")
    g.add_argument("--show-plan", action="store_true",
                   help="print the load plan (bytes per device by component) before loading")
    g.add_argument("--skip-memory-check", action="store_true",
                   help="load even when the plan exceeds the memory available (swap, overcommit)")
    _add_parallel_options(p)


def _add_parallel_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel (under torchrun --nproc-per-node N)")
    g.add_argument("--tp", type=count, default=None, metavar="N",
                   help="tensor-parallel size: heads and vocabulary cut over N ranks (default: the world size)")
    g.add_argument("--ep", type=count, default=None, metavar="N",
                   help="expert-parallel size: routed experts cut over N ranks (default: the world size)")
    g.add_argument("--rank-timeout", type=seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"how long a rank waits for another before reporting it lost (default: "
                        f"{DEFAULT_TIMEOUT_S:g})")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"(default: {DEFAULT_MAX_NEW_TOKENS}; {DEMO_MAX_NEW_TOKENS} on the built-in demo models)")
    g.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"0 = greedy (default: {DEFAULT_TEMPERATURE})")
    g.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help=f"(default: {DEFAULT_TOP_P})")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="(default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default: 1)")
    g.add_argument("--seed", type=seed_value, default=DEFAULT_SEED,
                   help=f"sampling seed, 0 … 2^63 − 1 (default: {DEFAULT_SEED})")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def count(text: str) -> int:
    """argparse type of a size (--max-context, --max-batch, --max-queue): an integer of at least 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def seconds(text: str) -> float:
    """argparse type of a duration (--rank-timeout): a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def seed_value(text: str) -> int:
    """argparse type of --seed: an integer a torch.Generator takes."""
    value = _integer(text)
    if not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{value} is outside 0 … 2^63 − 1")
    return value


def _add_chat_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat format")
    g.add_argument("--thinking", action="store_true", help="thinking mode (the model reasons inside <think>)")
    g.add_argument("--effort", metavar="E", help="reasoning effort in thinking mode: 1-100, low, high or max")
    g.add_argument("--system", metavar="TEXT", help="system prompt")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete prompts, streaming the tokens",
                       description="Complete one or more prompts. With one prompt the text streams to stdout; "
                                   "with several, each completion is printed under a header. A stats line "
                                   "per prompt goes to stderr.")
    p.add_argument("prompt", nargs="*", help="prompt text (several: one batch); default: --file or stdin")
    p.add_argument("--file", metavar="F", help="prompts from a file: blank-line separated text, or a .json list "
                                               "of strings / message lists / {\"messages\": [...]} cases")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="raw", action="store_false",
                      help="encode each prompt as one user message (default)")
    mode.add_argument("--raw", dest="raw", action="store_true", help="send the text as is, without chat encoding")
    p.set_defaults(raw=False)
    p.add_argument("--stop", action="append", default=[], metavar="S", help="stop string (repeatable)")
    p.add_argument("--stop-id", action="append", default=[], type=int, metavar="ID", help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past EOS (fixed-length runs, benchmarks)")
    p.add_argument("--show-special", action="store_true",
                   help="print special tokens (<｜end▁of▁sentence｜>, </think>, …) as text; hidden by default")
    p.add_argument("--speculative", action="store_true",
                   help="draft with the DSpark stages and verify each row's drafts in the same forward "
                        "(lossless); prints the acceptance figures")
    _add_image_option(p, "put the image before the prompt's text (repeatable, in order); with --raw, the "
                         "prompt holds one <｜deepseek_image｜> per image")
    _add_chat_options(p)
    _add_model_options(p)
    _add_sampling_options(p)


def _add_image_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--image", action="append", default=[], metavar="PATH", help=help)


def _chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat (reads lines from stdin)",
                       description="Interactive chat. Each line is a user message; the history is re-encoded "
                                   "every turn. Commands: /exit, /clear, /system TEXT, /think on|off, "
                                   "/effort N|low|high|max, /image PATH, /prompt [TEXT], /help.")
    _add_image_option(p, "attach the image to the first message (repeatable); /image PATH attaches one to the next")
    _add_chat_options(p)
    _add_model_options(p)
    _add_sampling_options(p)


def _score_parser(sub) -> None:
    p = sub.add_parser("score", help="teacher-forced log-probabilities and perplexity",
                       description="Print, per sequence, each token's log-probability given the tokens "
                                   "before it (position, id, text, logprob; tab separated) and the perplexity.")
    p.add_argument("text", nargs="*", help="texts to score (one batch); default: --ids or stdin")
    p.add_argument("--ids", metavar="FILE.json", help="a JSON list of token-id lists, scored as one batch")
    p.add_argument("--dump-logits", metavar="FILE.npz",
                   help="write logits float32 [sequences, tokens, vocab] (entry t: after token t; "
                        "0 past a sequence's end), lengths and ids")
    p.add_argument("--prefill", type=int, metavar="N",
                   help="run the first N tokens as one prefill and the rest one decode step at a time")
    p.add_argument("--no-bos", action="store_true", help="do not put BOS before each text")
    _add_model_options(p)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server on the engine",
                       description="Serve /v1/chat/completions, /v1/completions and /v1/messages (streamed or "
                                   "whole), /v1/models, /health and /metrics. The port opens at once; /health "
                                   "answers 503 until the model has loaded.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    g.add_argument("--api-key", metavar="KEY", default=os.environ.get("DSV41_API_KEY"),
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY); default: $DSV41_API_KEY, "
                        "else none")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="the model name requests must give (default: the checkpoint directory's name, "
                        "dsv41-demo for the demo)")
    g.add_argument("--max-batch", type=count, default=8, metavar="N",
                   help="requests decoded together: cache slots (default: 8)")
    g.add_argument("--max-queue", type=count, default=64, metavar="N",
                   help="requests waiting for a slot before new ones get 429 (default: 64)")
    g.add_argument("--speculative", action="store_true",
                   help="DSpark speculative decoding for every request (lossless; needs DSpark stages)")
    g.add_argument("--seed", type=int, help="sampling seed of requests without one (default: random per start)")
    g.add_argument("--image-dir", metavar="DIR", type=Path,
                   help="requests may name local image files under DIR (default: images only as data URLs or "
                        "base64; never fetched from the network)")
    _add_model_options(p)


def _inspect_parser(sub) -> None:
    p = sub.add_parser("inspect", help="explain a model config component by component",
                       description="Explain a config.json (or a checkpoint directory) component by component.")
    p.add_argument("config", metavar="CONFIG_OR_DIR", help="a config.json or a directory holding one")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--html", metavar="DIR", help="also write an HTML report into DIR")


def _check_parser(sub) -> None:
    p = sub.add_parser("check", help="validate a checkpoint directory without loading it; print its load plans",
                       description="Validate a released-layout directory from its headers alone (names, dtypes, "
                                   "shapes, shard sizes, the index's total_size, the tokenizer against the "
                                   "config) and print the bytes per rank for world sizes 1, 2, 4 and 8 in both "
                                   "numerics. Reads no tensor data. Exit status 2 when anything is wrong.")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--max-context", type=count, default=DEFAULT_MAX_CONTEXT, metavar="N",
                   help=f"context the plans are made for (default: {DEFAULT_MAX_CONTEXT})")
    p.add_argument("--max-batch", type=count, default=1, metavar="N", help="sequences the plans hold (default: 1)")


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsv41", description="DeepSeek-V4.1 in PyTorch.")
    parser.add_argument("--version", action="version", version=f"dsv41 {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also DSV41_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_generate_parser, _chat_parser, _score_parser, _serve_parser, _check_parser, _inspect_parser,
                training_command.add_parser):
        add(sub)
    return parser


# ------------------------------------------------------------------------------------ loading
def _note(message: str) -> None:
    print(f"dsv41: {message}", file=sys.stderr, flush=True)


def checkpoint_dir(args) -> Path:
    if args.checkpoint is None:
        path, note = default_checkpoint()
        _note(f"note: {note}")
        return path
    path = Path(args.checkpoint)
    if path.is_file():
        raise CliError(f"--checkpoint {path} is a file; give the checkpoint's directory")
    if not path.is_dir():
        raise CliError(f"checkpoint directory not found: {path}")
    if not (path / "config.json").is_file():
        raise CliError(f"{path} is not a checkpoint directory: it has no config.json")
    return path


def _device(args) -> str:
    """The --device, checked: a torch device this machine has, which can hold data."""
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CliError(f"--device {name!r} is not a device (cpu, cuda, cuda:N or mps)") from None
    if device.type == "meta":
        raise CliError("--device meta holds no data, so nothing can run on it (dsv41 inspect explains a model "
                       "without weights)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device {name}: no CUDA device is available here (torch.cuda.is_available() is "
                           f"False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise CliError(f"--device {name}: MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise CliError(f"--device {name}: dsv41 runs on cpu, cuda or mps")
    return str(device)


def load_model(path: Path, args, batch_size: int, parallel=None):
    """The model of a command; with a parallel context, this rank's part (only rank 0 shows the plan and
    the progress)."""
    device = _device(args) if parallel is None else rank_device(parallel, _device(args))
    runtime = RuntimeConfig(max_batch_size=batch_size, max_seq_len=args.max_context, device=device,
                            dtype=args.dtype, numerics=args.numerics, kernels=args.kernels,
                            stored_experts=args.stored_experts, huge_pages=args.huge_pages)
    driver = parallel is None or parallel.is_driver
    show = (lambda plan: _note("\n".join(plan.lines()))) if args.show_plan and driver else None
    extra = {} if parallel is None else {"parallel": parallel, "progress": None if driver else False}
    return load(path, runtime, device=device, engram_on_disk=args.engram_on_disk,
                check_memory=not args.skip_memory_check, on_plan=show, **extra)


def local_models(args):
    """How a command loads its model in one process: models(path, batch_size) → the model."""
    return lambda path, batch_size: load_model(path, args, batch_size)


def _check_speculative(args, model) -> None:
    if args.speculative and not model.cfg.dspark_enabled:
        raise CliError("--speculative needs a checkpoint with DSpark stages (n_mtp_layers > 0)")


def generation_config(args, stop_strings=(), stop_ids=()):
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repetition_penalty=args.repetition_penalty)
    length = args.max_new_tokens
    if length is None:
        length = DEMO_MAX_NEW_TOKENS if args.checkpoint is None else DEFAULT_MAX_NEW_TOKENS
    return GenerationConfig(max_new_tokens=length, sampling=sampling, seed=args.seed,
                            stop_strings=tuple(stop_strings), stop_token_ids=tuple(stop_ids),
                            max_context=args.max_context, ignore_eos=getattr(args, "ignore_eos", False),
                            speculative=getattr(args, "speculative", False),
                            skip_special_tokens=not getattr(args, "show_special", True))


# ------------------------------------------------------------------------------------ generate
def _split_blank_lines(text: str) -> list[str]:
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def _json_case(item, where: str):
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("messages"), list):
        return item["messages"]
    if isinstance(item, list) and all(isinstance(m, dict) for m in item):
        return item
    raise CliError(f"{where}: each case must be a string, a message list or {{\"messages\": [...]}}")


def decoded(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"{source} is not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start})") from None


def read_text_file(path: str) -> str:
    try:
        return decoded(Path(path).read_bytes(), path)
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from None


def read_stdin() -> str:
    buffer = getattr(sys.stdin, "buffer", None)
    return (decoded(buffer.read(), "stdin") if buffer is not None else sys.stdin.read()).rstrip("\n")


def checked_arguments(texts: list[str], what: str) -> list[str]:
    """Command-line texts: valid UTF-8 (Python keeps undecodable bytes as surrogates) and not blank."""
    for i, text in enumerate(texts, start=1):
        if any("\udc80" <= c <= "\udcff" for c in text):
            raise CliError(f"{what} {i} is not valid UTF-8")
        if not text.strip():
            raise CliError(f"{what} {i} is empty")
    return texts


def read_prompt_file(path: str) -> list:
    file = Path(path)
    text = read_text_file(path)
    if file.suffix != ".json":
        return _split_blank_lines(text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"{path}: not valid JSON ({e})") from None
    one_case = isinstance(data, dict) or (isinstance(data, list) and data
                                          and all(isinstance(m, dict) and "role" in m for m in data))
    cases = [data] if one_case else data
    if not isinstance(cases, list) or not cases:
        raise CliError(f"{path}: expected a non-empty list of cases")
    return [_json_case(item, f"{path}, case {i}") for i, item in enumerate(cases)]


def prompt_cases(args) -> list:
    """Prompt texts (or message lists) from the arguments, --file, or stdin."""
    if args.prompt and args.file:
        raise CliError("give prompts as arguments or with --file, not both")
    if args.prompt:
        return checked_arguments(list(args.prompt), "prompt")
    if args.file:
        cases = read_prompt_file(args.file)
    elif sys.stdin.isatty():
        raise CliError("no prompt: give PROMPT arguments, --file F, or pipe text on stdin")
    else:
        cases = [read_stdin()]
    if not cases or any(isinstance(c, str) and not c.strip() for c in cases):
        raise CliError("empty prompt")
    return cases


def chat_messages(case, system: str | None) -> list[dict]:
    messages = [{"role": "user", "content": case}] if isinstance(case, str) else list(case)
    if system and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def image_blocks(paths: list[str]) -> list[dict]:
    """`--image` files as chat image blocks (read when the prompt is built)."""
    return [{"type": "image", "url": str(Path(p))} for p in paths]


def with_images(case, paths: list[str]):
    """A text prompt with `--image` files: one user message, the images first, then the text."""
    if not paths:
        return case
    if not isinstance(case, str):
        raise CliError("--image goes with a text prompt, not a message list (put image blocks in the messages)")
    return [{"role": "user", "content": image_blocks(paths) + [{"type": "text", "text": case}]}]


def encode_case(tokenizer, case, args) -> tuple[list[int], list[dict]]:
    """A prompt's ids (one placeholder per image) and its image records in prompt order."""
    if args.raw:
        if not isinstance(case, str):
            raise CliError("--raw takes text prompts, not message lists")
        return tokenizer.encode(case), image_blocks(args.image)
    text, media = encode_messages(chat_messages(with_images(case, args.image), args.system),
                                  "thinking" if args.thinking else "chat",
                                  reasoning_effort=parse_effort(args.effort), return_multi_modal_data=True)
    return tokenizer.encode_prompt(text), media["images"]


def prompt_with_images(ids: list[int], records: list[dict], path: Path, tokenizer, where: str = "image"):
    """ids with image spans (the images read and planned before the model loads); → (ids, spans)."""
    if not records:
        return ids, ()
    cfg = ModelConfig.from_json(path)
    return prompt_images(ids, records, cfg, ImageSources(local_files=True), where, tokenizer)


def cmd_generate(args, models=None) -> int:
    models = models or local_models(args)
    if args.effort is not None and not args.thinking:
        raise CliError("--effort sets the reasoning effort of thinking mode; add --thinking")
    cases = prompt_cases(args)
    path = checkpoint_dir(args)
    tokenizer = Tokenizer.from_dir(path)
    bad = [t for t in args.stop_id if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise CliError(f"--stop-id {bad[0]} is not a token id of this tokenizer (0 … {tokenizer.vocab_size - 1})")
    if args.image and len(cases) != 1:
        raise CliError(f"--image goes with one prompt; {len(cases)} were given")
    encoded = [encode_case(tokenizer, c, args) for c in cases]
    expanded = [prompt_with_images(ids, records, path, tokenizer, "--image") for ids, records in encoded]
    prompts, images = [ids for ids, _ in expanded], [spans for _, spans in expanded]
    config = generation_config(args, args.stop, args.stop_id)
    check_prompts(prompts, args.max_context, tokenizer.vocab_size)     # before the (slow) load
    model = models(path, len(prompts))
    _check_speculative(args, model)
    single = len(prompts) == 1
    completions = generate_all(model, tokenizer, prompts, config, echo_to(sys.stdout) if single else None,
                               images=images)
    if single:
        print(flush=True)
    for c in completions:
        if not single:
            print(f"=== completion {c.request} ===\n{c.text}", flush=True)
        label = "" if single else f"[completion {c.request}] "
        print(label + c.summary(), file=sys.stderr, flush=True)
    return 0


# ------------------------------------------------------------------------------------ chat
def cmd_chat(args, models=None) -> int:
    models = models or local_models(args)
    path = checkpoint_dir(args)
    tokenizer = Tokenizer.from_dir(path)
    session = ChatSession(args.system, args.thinking, parse_effort(args.effort), images=args.image)
    config = generation_config(args)
    model = models(path, 1)
    interactive = sys.stdin.isatty()
    if interactive:
        _note("chat: /help lists the commands, /exit leaves")
    run_chat(model, tokenizer, session, config, input_lines(interactive), sys.stdout)
    return 0


# ------------------------------------------------------------------------------------ score
def read_ids_file(path: str, vocab: int) -> list[list[int]]:
    try:
        data = json.loads(read_text_file(path))
    except json.JSONDecodeError as e:
        raise CliError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, list) or not data or not all(isinstance(s, list) and s for s in data):
        raise CliError(f"{path}: expected a JSON list of non-empty token-id lists, e.g. [[0, 17, 5], [0, 9]]")
    for i, seq in enumerate(data):
        bad = [t for t in seq if type(t) is not int or not 0 <= t < vocab]
        if bad:
            raise CliError(f"{path}: sequence {i} holds {bad[0]!r}, not a token id in [0, {vocab})")
    return data


def score_sequences(args, tokenizer) -> list[list[int]]:
    if args.ids and args.text:
        raise CliError("give texts or --ids, not both")
    if args.ids:
        return read_ids_file(args.ids, tokenizer.vocab_size)
    texts = checked_arguments(list(args.text), "text")
    if not texts:
        if sys.stdin.isatty():
            raise CliError("nothing to score: give TEXT arguments, --ids FILE.json, or pipe text on stdin")
        texts = checked_arguments([read_stdin()], "stdin text")
    sequences = []
    for text in texts:
        ids = tokenizer.encode(text)
        if not args.no_bos and ids[:1] != [tokenizer.bos_id]:
            ids = [tokenizer.bos_id] + ids
        if not ids:
            raise CliError("empty text (and --no-bos): nothing to score")
        sequences.append(ids)
    return sequences


def _printable(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def print_scores(result, sequences, tokenizer) -> None:
    for i, seq in enumerate(sequences):
        print(f"# sequence {i}: {len(seq)} tokens")
        logprobs = result.token_logprobs[i].tolist()
        for pos, token in enumerate(seq):
            value = "-" if pos == 0 else f"{logprobs[pos - 1]:.6f}"
            print(f"{pos}\t{token}\t{_printable(tokenizer.decode([token]))}\t{value}")
        print(f"perplexity\t{result.perplexity[i]:.6g}", flush=True)


def dump_logits(path: str, result, sequences) -> None:
    ids = np.full((len(sequences), max(result.lengths)), -1, dtype=np.int64)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = seq
    try:
        np.savez(path, logits=result.logits.numpy().astype(np.float32), lengths=np.array(result.lengths), ids=ids)
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror or e}") from None


def cmd_score(args, models=None) -> int:
    models = models or local_models(args)
    if args.dump_logits and not Path(args.dump_logits).resolve().parent.is_dir():
        raise CliError(f"--dump-logits {args.dump_logits}: the directory {Path(args.dump_logits).parent} does not "
                       f"exist")
    path = checkpoint_dir(args)
    tokenizer = Tokenizer.from_dir(path)
    sequences = score_sequences(args, tokenizer)
    check_prompts(sequences, args.max_context, tokenizer.vocab_size, what="sequence")   # before the load
    model = models(path, len(sequences))
    result = score(model, sequences, args.prefill, max_context=args.max_context)
    print_scores(result, sequences, tokenizer)
    if args.dump_logits:
        dump_logits(args.dump_logits, result, sequences)
    return 0


# ------------------------------------------------------------------------------------ serve
def cmd_serve(args, models=None) -> int:
    models = models or local_models(args)
    import uvicorn

    from .server.app import ServerConfig, ServerState, create_app

    path = checkpoint_dir(args)
    name = args.served_model_name or ("dsv41-demo" if args.checkpoint is None else path.resolve().name)
    config = ServerConfig(model_name=name, api_key=args.api_key, max_batch=args.max_batch,
                          max_context=args.max_context, speculative=args.speculative, max_queue=args.max_queue,
                          seed=args.seed, image_dir=args.image_dir)
    if args.image_dir is not None and not args.image_dir.is_dir():
        raise CliError(f"--image-dir {args.image_dir}: not a directory")
    Tokenizer.from_dir(path)                                  # a broken checkpoint fails here, not later

    def load_all():
        tokenizer = Tokenizer.from_dir(path)
        model = models(path, args.max_batch)
        _check_speculative(args, model)
        return model, tokenizer

    app = create_app(ServerState(config, load_all))
    _note(f"serving {name!r} at http://{args.host}:{args.port} (OpenAI: /v1/chat/completions, /v1/completions; "
          f"Anthropic: /v1/messages); loading the model")
    # on Ctrl-C / SIGTERM: stop accepting, let running requests finish (up to the drain timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=int(config.drain_timeout_s))
    return 0


# ------------------------------------------------------------------------------------ check
def cmd_check(args) -> int:
    from .checkpoint.check import check_directory, render

    report = check_directory(Path(args.directory), context=args.max_context, batch=args.max_batch)
    sys.stdout.write(render(report))
    return 0 if report.ok else EXIT_USAGE


# ------------------------------------------------------------------------------------ inspect
def cmd_inspect(args, rest: list[str]) -> int:
    try:
        from . import inspect as inspect_package
    except ImportError as e:
        raise CliError(f"dsv41 inspect is not available in this installation ({e})") from None
    entry = getattr(inspect_package, "main", None)
    if entry is None:
        raise CliError("dsv41 inspect is not available in this installation (dsv41.inspect has no main)")
    return entry(rest) or 0


# ------------------------------------------------------------------------------------ parallel runs
@dataclass(frozen=True)
class LoadOrder:
    """What rank 0 tells the other ranks to load: the directory it resolved (after preparing the demo,
    so no two ranks write it) and the batch the load plan is made for."""

    path: str
    batch_size: int


def run_parallel(args) -> int:
    """generate / chat / score / serve as one rank of the world torchrun started."""
    world = launched_world_size()
    check_parallel_flags(args, world)
    try:
        return as_rank(args, world)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)     # their locals hold the context: free it with the groups
        raise
    finally:
        shutdown()


def as_rank(args, world: int) -> int:
    """The rank's work; the context lives in this frame only, so that `shutdown` can free its groups."""
    ctx = join_world(args, world)
    try:
        return drive(args, ctx) if ctx.is_driver else follow_driver(args, ctx)
    except RankLostError as e:
        # a process group with a lost peer cannot be torn down (gloo's threads abort the process at
        # exit): report and leave at once
        exit_lost(e)


def check_parallel_flags(args, world: int) -> None:
    for flag, size in (("--tp", args.tp), ("--ep", args.ep)):
        if size is None:
            continue
        if world == 1 and size > 1:
            raise CliError(f"{flag} {size} needs a parallel launch (torchrun --nproc-per-node {size} -m dsv41 …); "
                           f"this is one process")
        if world % size:
            raise CliError(f"{flag} {size} does not divide the {world} ranks torchrun started")


def join_world(args, world: int):
    """This rank's ParallelContext; ranks that do not all arrive within --rank-timeout are an error."""
    try:
        return init_parallel(args.tp, args.ep, device=_device(args), timeout_s=args.rank_timeout)
    except Exception as e:
        if not peer_failure(e):
            raise
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise RankLostError(f"rank {os.environ.get('RANK', '?')}: the {world} ranks did not all join at {where} "
                            f"within {args.rank_timeout:g} s") from None


def drive(args, ctx) -> int:
    """Rank 0: the command itself, on a model whose every call the other ranks make too. SIGTERM
    unwinds it like Ctrl-C (uvicorn re-raises it once a server has drained), so that the other ranks
    are told to stop instead of finding rank 0 gone."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with Driver(ctx, on_lost=exit_lost) as driver:
            def models(path: Path, batch_size: int):
                return driver.load(LoadOrder(str(path), batch_size),
                                   lambda: load_model(path, args, batch_size, ctx))

            return _COMMANDS[args.command](args, models)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def exit_lost(error: RankLostError) -> None:
    """A lost peer ends rank 0 at once, whichever thread finds it: a chat waiting for a line or an idle
    server would otherwise never notice."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"dsv41: error: {one_error(error)}", file=sys.stderr, flush=True)
    os._exit(EXIT_USAGE)


def follow_driver(args, ctx) -> int:
    """Any other rank: load when rank 0 says, then make rank 0's model calls until it stops. It prints
    nothing; its errors name the rank. Ctrl-C and SIGTERM (torchrun passes them to every rank) are rank
    0's to handle: it finishes (a server drains) and tells the others to stop, and if it dies instead
    they see it gone."""
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)
    try:
        order = await_load(ctx)
        if order is not None:
            follow(load_model(Path(order.path), args, order.batch_size, ctx), ctx)
    except RankLostError:
        raise
    except USER_ERRORS as e:
        raise CliError(f"rank {ctx.rank}: {one_error(e)}") from e
    return 0


# ------------------------------------------------------------------------------------ entry point
_COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "score": cmd_score, "serve": cmd_serve, "check": cmd_check,
             "train": training_command.cmd_train}
PARALLEL_COMMANDS = frozenset({"generate", "chat", "score", "serve"})


# What a user can get wrong (dsv41.errors), and the files and devices around it.
USER_ERRORS = (UserError, OSError)


def one_error(e: BaseException) -> str:
    lines = str(e).splitlines() or [type(e).__name__]
    if len(lines) > SHOWN_LINES:
        lines = lines[:SHOWN_LINES] + [f"… and {len(lines) - SHOWN_LINES} more lines"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    debug = args.debug or bool(os.environ.get("DSV41_DEBUG"))
    try:
        if hasattr(args, "device"):
            _device(args)                              # before anything is created or read
        if args.command == "inspect":
            return cmd_inspect(args, argv[argv.index("inspect") + 1:])
        if args.command in PARALLEL_COMMANDS:
            if launched_world_size() > 1:
                return run_parallel(args)
            check_parallel_flags(args, 1)
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:                            # `dsv41 … | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"dsv41: error: {one_error(e)}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception as e:                             # not the user's doing: a bug, and said to be one
        if debug:
            raise
        print(f"dsv41: internal error (a bug in dsv41; please report it with the command that caused it): "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} — run with --debug for the "
              f"traceback", file=sys.stderr, flush=True)
        return EXIT_BUG
