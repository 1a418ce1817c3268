"""The checkpoint's tokenizer (`tokenizer.json`, byte-level BPE) and an incremental detokenizer.

docs/TOKENIZER-AND-CHAT.md §1–§2: the release loads `tokenizer.json` with the Hugging Face `tokenizers`
library, adds no BOS or EOS (`add_bos = false`), and matches added-token strings literally in text. The
prompt encoder writes the BOS string itself, so text is always encoded without special tokens; a
tokenizer that added its own BOS would produce the double BOS of pitfall 2.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _Backend

from .chat import encoding
from .chat.encoding import BOS, EOS
from .errors import UserError

TOKENIZER_FILE = "tokenizer.json"
# What byte-level decoding yields for a UTF-8 sequence cut short: a streamed piece ending in it is held
# back until the next token completes the character.
REPLACEMENT_CHAR = "\ufffd"


# The vocabulary is filled up to a multiple of this with reserved placeholder tokens, as DeepSeek's
# tokenizers are, so that it cuts into 1, 2, 4 or 8 tensor-parallel parts (docs/CHECKPOINT.md §5).
VOCAB_MULTIPLE = 64
# Prompt-format special tokens (docs/TOKENIZER-AND-CHAT.md §1.1); BOS, EOS and pad take ids 0, 1, 2 as released.
SPECIAL_TOKENS = [
    encoding.BOS, encoding.EOS, "<｜▁pad▁｜>", encoding.SYSTEM, encoding.USER, encoding.ASSISTANT,
    encoding.LATEST_REMINDER, encoding.THINK_START, encoding.THINK_END, encoding.DSML, encoding.IMAGE_PLACEHOLDER,
    "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
]
# Pre-tokenizer splits of the released tokenizer (docs/TOKENIZER-AND-CHAT.md §1), then byte level.
PRETOKENIZER_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)


def train_bpe(texts, vocab_size: int) -> _Backend:
    """A byte-level BPE of at most `vocab_size` learned tokens, trained with `tokenizers` on an iterable of
    texts, with the release's pre-tokenizer splits and special tokens; the vocabulary is then padded with
    placeholder tokens to a multiple of VOCAB_MULTIPLE."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    tokenizer = _Backend(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRETOKENIZER_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([f"<｜place▁holder▁no▁{i}｜>" for i in range(-size % VOCAB_MULTIPLE)])
    return tokenizer


def save_tokenizer(backend: _Backend, directory: str | Path) -> None:
    """tokenizer.json and a tokenizer_config.json that adds no BOS / EOS, as the release ships them (§1)."""
    import json

    directory = Path(directory)
    backend.save(str(directory / TOKENIZER_FILE))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
         "model_max_length": 4096}, ensure_ascii=False, indent=2) + "\n")


class TokenizerError(UserError):
    """A tokenizer file that is missing or lacks a token dsv41 needs; the message names the file."""


class Tokenizer:
    """Text ↔ token ids, with no special tokens added (the encoder writes them as text)."""

    def __init__(self, backend: _Backend, source: str = "tokenizer"):
        self.backend = backend
        self.source = source
        self.bos_id = self._required_id(BOS)
        self.eos_id = self._required_id(EOS)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` from a checkpoint directory (or the path of the file itself)."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"{file}: no tokenizer file (a checkpoint directory needs {TOKENIZER_FILE})")
        try:
            backend = _Backend.from_file(str(file))
        except Exception as e:                       # the Rust side raises plain Exceptions
            raise TokenizerError(f"{file}: not a readable tokenizers file ({e})") from None
        return cls(backend, str(file))

    def _required_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{self.source}: has no token {token!r}")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Ids 0 … vocab_size − 1 decode; added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode_prompt(self, text: str) -> list[int]:
        """Encode an encoder-rendered prompt and check it starts with exactly one BOS (§2)."""
        return self.check_prompt_ids(self.encode(text))

    def check_prompt_ids(self, ids: list[int]) -> list[int]:
        """Chat prompt ids must start with exactly one BOS (§2); → ids."""
        if not ids or ids[0] != self.bos_id:
            raise TokenizerError("a chat prompt must start with the BOS token")
        if len(ids) > 1 and ids[1] == self.bos_id:
            raise TokenizerError("the prompt starts with two BOS tokens (docs/TOKENIZER-AND-CHAT.md §9 pitfall 2)")
        return ids

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Text deltas for ids arriving one at a time, never splitting a UTF-8 character.

    Only a short window of ids is decoded per token: the ids since the last emitted boundary, plus the
    ids of the piece emitted before it (so the decoder sees the same neighbourhood the full text has).
    For byte-level BPE the concatenated deltas equal `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._window_start = 0       # first id of the decode window
        self._emitted_end = 0        # ids before this index have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending(self) -> tuple[str, str]:
        window = self.ids[self._window_start:]
        emitted = self._decode(window[: self._emitted_end - self._window_start])
        return emitted, self._decode(window)

    def push(self, token_id: int) -> str:
        """The new text this id completes ('' while it ends inside a character)."""
        self.ids.append(token_id)
        emitted, full = self._pending()
        if len(full) <= len(emitted) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self._window_start, self._emitted_end = self._emitted_end, len(self.ids)
        return full[len(emitted):]

    def finish(self) -> str:
        """Whatever is still held back (an unfinished character decodes to U+FFFD)."""
        emitted, full = self._pending()
        self._window_start = self._emitted_end = len(self.ids)
        return full[len(emitted):]
