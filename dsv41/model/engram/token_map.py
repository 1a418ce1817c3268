"""Compressed token map of the Engram hash (docs/ENGRAM-HASHING.md §1).

Every token id maps to a compressed id; tokens whose decoded text normalises to the same key share
one. Ids are handed out in first-appearance order over t = 0, 1, 2, ... Building the released map
decodes 129,280 ids, so it is cached next to the tokenizer, keyed by the tokenizer file's sha256.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import tokenizers
import torch
from tokenizers import Regex, Tokenizer, normalizers

from ...errors import CheckpointError

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"  # a decoded partial UTF-8 byte token contains it (§1 step 2)
SPACE_SENTINEL = "\ue000"  # private-use stand-in that lets a lone space survive Strip (§1 step 3.6)
CACHE_SUFFIX = ".engram_map.npz"
CACHE_FORMAT = 1  # bump when the cached content changes meaning


def key_normalizer() -> normalizers.Normalizer:
    """The §1 step-3 sequence, in its order; whitespace-only tokens all end up as the key " "."""
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(SPACE_SENTINEL, " "),
    ])


def token_keys(tokenizer: Tokenizer) -> list[str]:
    """The §1 key of every token id 0 .. len(tokenizer) - 1 (added tokens included)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    # Backend decode of each id alone: special tokens kept, no clean-up of tokenization spaces.
    texts = tokenizer.decode_batch([[t] for t in range(size)], skip_special_tokens=False)
    norm = key_normalizer()
    keys = []
    for t, text in enumerate(texts):
        if REPLACEMENT_CHAR in text:
            surface = tokenizer.id_to_token(t)
            keys.append(surface if surface is not None else text)
        else:
            keys.append(norm.normalize_str(text) or text)
    return keys


def build_token_map(tokenizer: Tokenizer) -> torch.Tensor:
    """int64 [V]: compressed id of every token id, in first-appearance order of the keys."""
    first_id: dict[str, int] = {}
    ids = [first_id.setdefault(key, len(first_id)) for key in token_keys(tokenizer)]
    return torch.tensor(ids, dtype=torch.int64)


def map_size(token_map: torch.Tensor) -> int:
    """Number of distinct keys (ids are dense from 0, so max + 1)."""
    return int(token_map.max()) + 1 if token_map.numel() else 0


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_path(tokenizer_json: Path) -> Path:
    return tokenizer_json.with_name(tokenizer_json.stem + CACHE_SUFFIX)


def _cache_stamp(sha: str) -> str:
    # The keys depend on the tokenizers library's Unicode tables too (§1: "same normalisation tables").
    return f"v{CACHE_FORMAT}:{sha}:tokenizers-{tokenizers.__version__}"


def _read_cache(path: Path, stamp: str) -> torch.Tensor | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["stamp"]) != stamp:
                return None
            return torch.from_numpy(data["map"].astype(np.int64))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
        if path.exists():
            log.warning("ignoring unreadable Engram token-map cache %s (%s)", path, e)
        return None


def _write_cache(path: Path, stamp: str, token_map: torch.Tensor) -> None:
    # Write to a temporary file and rename, so a concurrent reader never sees half a file.
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError as e:
        log.info("Engram token-map cache not written (%s): %s", path.parent, e)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, stamp=np.array(stamp), map=token_map.numpy().astype(np.int32))
        os.replace(tmp, path)
    except OSError as e:
        log.info("Engram token-map cache not written (%s): %s", path, e)
        Path(tmp).unlink(missing_ok=True)


def load_or_build_token_map(tokenizer_json_path: str | os.PathLike, expected_size: int) -> torch.Tensor:
    """The map for this tokenizer.json, from the cache when it matches the file's sha256, else built
    (and cached when the directory is writable). Its size must equal `expected_size` (§1: 99092)."""
    path = Path(tokenizer_json_path)
    stamp = _cache_stamp(_file_sha256(path))
    cached = cache_path(path)
    token_map = _read_cache(cached, stamp)
    fresh = token_map is None
    if fresh:
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as e:                       # the Rust side raises plain Exceptions
            raise CheckpointError(f"{path}: not a readable tokenizers file ({e})") from None
        token_map = build_token_map(backend)
    size = map_size(token_map)
    if size != expected_size:
        raise CheckpointError(f"Engram compressed token map of {path} has {size} distinct keys; the config's "
                              f"engram_compressed_vocab_size is {expected_size} (docs/ENGRAM-HASHING.md §1)")
    if fresh:
        _write_cache(cached, stamp, token_map)
    return token_map
