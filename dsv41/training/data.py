"""Training text: files → one token stream → deterministic batches of windows; held-out windows for evaluation.

Shapes: B sequences per batch, T tokens per sequence (BOS + T − 1 text tokens).

Documents are encoded without special tokens and joined with EOS, as a model sees a finished text end.
The last `held_out` fraction of the stream is the validation split, kept whole and never sampled for
training. Every training sequence starts with BOS, as every prompt does at inference, followed by a
window of the stream at an offset drawn from a generator seeded by (seed, step, micro-batch): a batch
depends only on those three numbers, which is what makes a resumed run continue bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError


class DataError(UserError):
    """Training text that cannot be used; the message names the file."""


def read_texts(paths) -> list[str]:
    """The UTF-8 text of each file."""
    texts = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"--data {path}: no such file")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"--data {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not any(t.strip() for t in texts):
        raise DataError("the training data is empty")
    return texts


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """int64 [n]: the documents' tokens, each followed by EOS."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.int64)


@dataclass(frozen=True)
class TokenData:
    train: torch.Tensor
    """int64 [n_train] the training stream."""
    validation: torch.Tensor
    """int64 [n_val] the held-out stream."""
    bos_id: int

    @classmethod
    def split(cls, stream: torch.Tensor, bos_id: int, held_out: float, seq_len: int) -> "TokenData":
        n_val = int(stream.numel() * held_out)
        train = stream[:stream.numel() - n_val]
        if train.numel() < seq_len:
            raise DataError(f"the training split has {train.numel()} tokens, fewer than one sequence of {seq_len}")
        if held_out > 0 and n_val < seq_len:
            raise DataError(f"the held-out split has {n_val} tokens, fewer than one sequence of {seq_len}: "
                            f"give more text or a larger held-out fraction")
        return cls(train, stream[stream.numel() - n_val:], bos_id)

    def batch(self, seed: int, step: int, micro: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """[B, T] training sequences: BOS, then T − 1 stream tokens from a random offset."""
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + micro)
        starts = torch.randint(0, self.train.numel() - (seq_len - 1) + 1, (batch_size,), generator=gen)
        return self._sequences(self.train, starts, seq_len)

    def evaluation(self, seq_len: int, limit: int | None = None) -> torch.Tensor:
        """[M, T] consecutive non-overlapping held-out sequences (at most `limit`)."""
        width = seq_len - 1
        count = self.validation.numel() // width
        if limit is not None:
            count = min(count, limit)
        return self._sequences(self.validation, torch.arange(count) * width, seq_len)

    def _sequences(self, stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
        windows = stream[starts.unsqueeze(1) + torch.arange(seq_len - 1)]
        return torch.cat([torch.full((starts.numel(), 1), self.bos_id, dtype=torch.int64), windows], dim=1)


def unigram_perplexity(data: TokenData, vocab_size: int, seq_len: int, limit: int | None = None) -> float:
    """The perplexity of the training split's token frequencies (add-one smoothed) on the same held-out
    targets a model is evaluated on: the baseline a trained model must beat."""
    counts = torch.bincount(data.train, minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    targets = data.evaluation(seq_len, limit)[:, 1:]
    return float(torch.exp(-logp[targets].mean()))
