"""Compressed token map (docs/ENGRAM-HASHING.md §1) on small tokenizers built here, with hand-computed maps."""

import os

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models

from dsv41.model.engram import build_token_map, key_normalizer, load_or_build_token_map
from dsv41.model.engram import token_map as tm

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]


def byte_alphabet() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes stand for themselves, the rest shift to 256+."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


ALPHABET = byte_alphabet()


def surface(data: bytes) -> str:
    return "".join(ALPHABET[b] for b in data)


# (vocabulary entry as UTF-8 bytes, expected compressed id); ids follow list order after the specials.
CASES = [
    (b"Hello", 3),
    (b" hello", 3),  # lower-cased and stripped: same key "hello"
    (b"HELLO", 3),
    (b"\n", 4),  # whitespace-only tokens all share the key " " (sentinel rule)
    (b" ", 4),
    (b"\t\t", 4),
    ("é".encode(), 5),  # accents stripped after NFD
    (b"e", 5),
    (b"\xc3", 6),  # partial UTF-8: decodes to U+FFFD, keyed by its raw surface "Ã"
    (b"\xa9", 7),  # another partial byte, a different surface "©"
    ("\u0301".encode(), 8),  # a lone combining accent normalises to "": keyed by its text
    ("ﬁ".encode(), 9),  # NFKC ligature -> "fi"
    (b"Fi", 9),
    (b" \r\n ", 4),
    (b"A b", 10),
    (b" a  b\t", 10),  # whitespace runs collapse, ends stripped
    ("É".encode(), 5),
    ("\u00a0".encode(), 4),  # NBSP becomes a plain space under NFKC, then the sentinel rule
    ("\u3000".encode(), 4),  # ideographic space likewise
    (b"\xe2\x80", 11),  # an incomplete 3-byte sequence
    ("\ufffd".encode(), 12),  # a genuine U+FFFD also goes by its surface "ï¿½"
]
ADDED = ("<think>", 13)
EXPECTED = [0, 1, 2] + [c for _, c in CASES] + [ADDED[1]]


def make_tokenizer() -> Tokenizer:
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for data, _ in CASES:
        vocab[surface(data)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.add_tokens([ADDED[0]])
    return tok


def test_normalizer_keys():
    norm = key_normalizer()
    assert norm.normalize_str(" Hello ") == "hello"
    assert norm.normalize_str("\t\t") == " "
    assert norm.normalize_str(" ") == " "
    assert norm.normalize_str("  x  ") == "x"
    assert norm.normalize_str("Crème") == "creme"
    assert norm.normalize_str("\u0301") == ""
    assert norm.normalize_str("<｜▁pad▁｜>") == "<|▁pad▁|>"  # NFKC folds the full-width bar


def test_byte_level_map_by_hand():
    tok = make_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == len(EXPECTED)
    got = build_token_map(tok)
    assert got.dtype == torch.int64
    assert got.tolist() == EXPECTED
    assert tm.map_size(got) == 14


def test_word_level_map_by_hand():
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "Cat": 3, "cat": 4, "DOG": 5, "\n\n": 6, "ﬁx": 7, "fix": 8}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.add_special_tokens([AddedToken(s, special=True) for s in ("<s>", "</s>", "<pad>")])
    assert build_token_map(tok).tolist() == [0, 1, 2, 3, 3, 4, 5, 6, 6]


def save(tok: Tokenizer, directory) -> str:
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return path


def test_cache_written_reused_and_rebuilt_when_stale(tmp_path, monkeypatch):
    path = save(make_tokenizer(), tmp_path)
    first = load_or_build_token_map(path, 14)
    assert first.tolist() == EXPECTED
    cache = tm.cache_path(tmp_path / "tokenizer.json")
    assert cache.exists()

    def no_build(_):
        raise AssertionError("the cache should have been used")
    monkeypatch.setattr(tm, "build_token_map", no_build)
    assert load_or_build_token_map(path, 14).tolist() == EXPECTED
    monkeypatch.undo()

    # A different tokenizer.json (one more token) makes the cache stale.
    tok = make_tokenizer()
    tok.add_tokens(["Cat"])
    save(tok, tmp_path)
    assert load_or_build_token_map(path, 15).tolist() == EXPECTED + [14]
    assert load_or_build_token_map(path, 15).tolist() == EXPECTED + [14]


def test_corrupt_cache_is_rebuilt(tmp_path):
    path = save(make_tokenizer(), tmp_path)
    tm.cache_path(tmp_path / "tokenizer.json").write_bytes(b"not a zip file")
    assert load_or_build_token_map(path, 14).tolist() == EXPECTED
    assert load_or_build_token_map(path, 14).tolist() == EXPECTED  # and rewritten


def test_unwritable_cache_directory_still_works(tmp_path, monkeypatch):
    path = save(make_tokenizer(), tmp_path)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tm.tempfile, "mkstemp", refuse)
    assert load_or_build_token_map(path, 14).tolist() == EXPECTED
    assert not tm.cache_path(tmp_path / "tokenizer.json").exists()


def test_failed_rename_leaves_no_temporary(tmp_path):
    path = save(make_tokenizer(), tmp_path)
    tm.cache_path(tmp_path / "tokenizer.json").mkdir()  # os.replace onto a directory fails
    assert load_or_build_token_map(path, 14).tolist() == EXPECTED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.engram_map.npz", "tokenizer.json"]


def test_size_mismatch_names_both_numbers(tmp_path):
    path = save(make_tokenizer(), tmp_path)
    with pytest.raises(ValueError, match=r"14 distinct keys.*99092"):
        load_or_build_token_map(path, 99092)
