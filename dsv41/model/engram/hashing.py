"""Engram n-gram hash: bucket layout, multipliers, per-sequence history and the vectorised hash.

Shapes: B batch, T positions in the call, E Engram layers, K look-backs (= max n-gram size),
N hash columns per layer ((max_ngram - 1) · heads, column c = (n - 2) · heads + h), P history length.

Everything here follows docs/ENGRAM-HASHING.md §2-§4. All id arithmetic is int64: products reach ~9.2e18
and table row ids ~3.8e8 (docs/ARCHITECTURE.md §17 traps 21 and 24).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ...config import ConfigError
from ..step import CacheError

DEAD = -1  # history marker of an image-span position (§4)
INT64_MAX = (1 << 63) - 1
RNG_SEED_STRIDE = 10007  # default_rng(10007 · layer_id) draws the multipliers (§3)

# §3: verified multipliers, keyed by (compressed vocab size, layer id), one per look-back k = 0..3.
# Kept as Python ints: NumPy does not promise a stable generator stream across versions.
VERIFIED_MULTIPLIERS: dict[tuple[int, int], tuple[int, ...]] = {
    (99092, 1): (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (99092, 14): (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}

# Deterministic Miller-Rabin witnesses: exact for every n < 3.3e24, far beyond any table size.
_MR_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_unused_prime(after: int, used: set[int]) -> int:
    candidate = after + 1
    while candidate in used or not is_prime(candidate):
        candidate += 1
    return candidate


def derive_multipliers(layer_id: int, compressed_vocab_size: int, count: int = 4) -> tuple[int, ...]:
    """§3 derivation: odd 2v + 1 with v drawn by NumPy's default_rng(10007 · layer) in [0, bound)."""
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    rng = np.random.default_rng(RNG_SEED_STRIDE * layer_id)
    draws = rng.integers(0, bound, size=(count,), dtype=np.int64)
    return tuple(2 * int(v) + 1 for v in draws)


def multipliers_for(layer_id: int, compressed_vocab_size: int, count: int) -> tuple[int, ...]:
    verified = VERIFIED_MULTIPLIERS.get((compressed_vocab_size, layer_id))
    if verified is not None and count == len(verified):
        return verified
    return derive_multipliers(layer_id, compressed_vocab_size, count)


@dataclass(frozen=True)
class EngramLayout:
    """Hash-table layout of every Engram layer; per-layer tuples are indexed by column c."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int  # K look-backs; orders n = 2..K
    n_heads: int
    compressed_vocab_size: int
    pad_id: int  # raw token id of the pad; the hash uses its compressed id (§4)
    primes: tuple[tuple[int, ...], ...]  # [E][N] bucket modulus of each column
    offsets: tuple[tuple[int, ...], ...]  # [E][N] first table row of each column
    num_embeddings: tuple[int, ...]  # [E] table rows = sum of the layer's primes
    multipliers: tuple[tuple[int, ...], ...]  # [E][K] odd int64 multipliers

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_columns(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @classmethod
    def from_config(cls, cfg) -> "EngramLayout":
        layer_ids = tuple(cfg.engram_layer_ids)
        if not layer_ids:
            raise ConfigError("the config has no Engram layers (engram_layer_ids is empty)")
        K, heads, V = cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_compressed_vocab_size
        primes = _search_primes(len(layer_ids), K - 1, heads, cfg.engram_vocab_size)
        rows = tuple(sum(p) for p in primes)
        if rows != tuple(cfg.engram_num_embeddings):
            raise ConfigError(f"Engram prime layout gives table rows {list(rows)} but the config's "
                              f"engram_num_embeddings is {list(cfg.engram_num_embeddings)} "
                              "(docs/ENGRAM-HASHING.md §2)")
        offsets = tuple(tuple(int(o) for o in np.cumsum((0,) + p[:-1], dtype=np.int64)) for p in primes)
        mults = tuple(multipliers_for(layer, V, K) for layer in layer_ids)
        _check_no_overflow(V, mults)
        return cls(layer_ids, K, heads, V, cfg.engram_pad_id, primes, offsets, rows, mults)

    def tensors(self, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(primes [E, N], offsets [E, N], multipliers [E, K]) as int64 tensors."""
        def as_tensor(v):
            return torch.tensor(v, dtype=torch.int64, device=device)
        return as_tensor(self.primes), as_tensor(self.offsets), as_tensor(self.multipliers)


def table_rows(n_layers: int, max_ngram_size: int, heads: int, vocab_size: int) -> tuple[int, ...]:
    """Rows of each Engram layer's table, the sum of its primes: what `engram_num_embeddings` holds."""
    return tuple(sum(p) for p in _search_primes(n_layers, max_ngram_size - 1, heads, vocab_size))


def _search_primes(n_layers: int, n_orders: int, heads: int, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    # §2: one used-set shared by every layer and order; each order restarts at engram_vocab_size − 1.
    used: set[int] = set()
    layers = []
    for _ in range(n_layers):
        columns = []
        for _ in range(n_orders):
            current = vocab_size - 1
            for _ in range(heads):
                current = _next_unused_prime(current, used)
                used.add(current)
                columns.append(current)
        layers.append(tuple(columns))
    return tuple(layers)


def _check_no_overflow(compressed_vocab_size: int, multipliers) -> None:
    # §3: the largest id times the largest multiplier must stay below 2^63.
    worst = (compressed_vocab_size - 1) * max(max(m) for m in multipliers)
    if worst > INT64_MAX:
        raise ConfigError(f"Engram hash products reach {worst}, beyond int64 "
                          f"(compressed vocab {compressed_vocab_size})")


# ---------------------------------------------------------------- per-sequence state ------------


@dataclass
class EngramHistory:
    """Compressed id of every absolute position of each sequence, DEAD for image positions (§4).

    Owned by the engine's per-sequence cache (docs/ARCHITECTURE.md §12); never needs resetting between
    prompts or rolling back after rejected drafts, because position p only reads H[p-3..p] and those
    are written before they are read.
    """

    ids: torch.Tensor  # int64 [B, P]

    @classmethod
    def create(cls, batch: int, max_seq_len: int, device=None) -> "EngramHistory":
        return cls(torch.full((batch, max_seq_len), DEAD, dtype=torch.int64, device=device))

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.ids.shape[1]

    def rows(self, start: int, count: int) -> "EngramHistory":
        """A view on rows start..start+count-1 that shares storage (writes land in this history)."""
        return EngramHistory(self.ids.narrow(0, start, count))

    def reset_rows(self, index) -> None:
        self.ids[index] = DEAD

    def copy_rows(self, dst_index, src: "EngramHistory", src_index) -> None:
        """Copy whole rows (e.g. fork a sequence for speculative or beam use)."""
        self.ids[dst_index] = src.ids[src_index].to(self.ids.device)


# ---------------------------------------------------------------- the hash ----------------------


def lookback_tokens(history: EngramHistory, slots: torch.Tensor, positions: torch.Tensor, pad: int,
                    K: int) -> torch.Tensor:
    """§4 step 2: tok[i, k] for token i of slot slots[i] at positions[i] (any shape); pad once a
    look-back latches blocked."""
    src_pos = positions.unsqueeze(-1) - torch.arange(K, device=positions.device)  # [..., K]
    src = history.ids[slots.unsqueeze(-1), src_pos.clamp_min(0)]
    bad = (src_pos < 0) | (src == DEAD)
    # Latch: blocked_k = OR over j <= k of bad_j; a running max over k of the 0/1 flag.
    blocked = bad.to(torch.uint8).cummax(dim=-1).values.bool()
    return src.masked_fill(blocked, pad)


def hash_compressed(layout: EngramLayout, compressed: torch.Tensor, start_pos: int, history: EngramHistory,
                    pad: int, text_mask: torch.Tensor | None = None,
                    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Compressed ids [B, T] of rows 0 … B − 1 at positions start_pos … → row ids int64 [B, T, E, N]."""
    B, T = compressed.shape
    _check_call(history, B, start_pos, T)
    device = history.ids.device
    slots = torch.arange(B, device=device).unsqueeze(1).expand(B, T)
    positions = torch.arange(start_pos, start_pos + T, device=device).expand(B, T)
    return hash_tokens(layout, compressed, slots, positions, history, pad, text_mask, tables)


def hash_tokens(layout: EngramLayout, compressed: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                history: EngramHistory, pad: int, text_mask: torch.Tensor | None = None,
                tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Compressed ids of tokens at (slot, position) (all three the same shape [...]) → row ids int64
    [..., E, N] (§4); writes the ids into each slot's history first, so a token's look-back reads the
    earlier tokens of its own call too."""
    primes, offsets, mults = tables if tables is not None else layout.tensors(history.ids.device)
    c = compressed.to(device=history.ids.device, dtype=torch.int64)
    if text_mask is not None:
        c = c.masked_fill(~text_mask.to(device=c.device, dtype=torch.bool), DEAD)
    history.ids[slots, positions] = c  # §4 step 1
    K, heads = layout.max_ngram_size, layout.n_heads
    tok = lookback_tokens(history, slots, positions, pad, K)  # [..., K]
    prod = tok.unsqueeze(-2) * mults  # [..., E, K]; < 2^63 (checked by the layout)
    rolling = [prod[..., 0]]
    for k in range(1, K):  # R_n = R_{n-1} XOR prod_{n-1}: K - 1 orders, no 1-gram (§4 step 4)
        rolling.append(rolling[-1] ^ prod[..., k])
    R = torch.stack(rolling[1:], dim=-1)  # [..., E, K-1], order n = index + 2
    # Column c = (n-2)·heads + h: each order's hash against its `heads` primes. All operands are
    # non-negative, so % is the plain remainder (§4 step 5).
    buckets = R[..., None] % primes.view(-1, K - 1, heads)  # [..., E, K-1, heads]
    return buckets.flatten(-2) + offsets  # [..., E, N]


def _check_call(history: EngramHistory, B: int, start_pos: int, T: int) -> None:
    if B > history.batch:
        raise CacheError(f"Engram hash called with batch {B} but the history has {history.batch} rows")
    if start_pos < 0 or start_pos + T > history.max_seq_len:
        raise CacheError(f"Engram hash positions {start_pos}..{start_pos + T - 1} exceed the history length "
                         f"{history.max_seq_len}")


class NgramHasher(nn.Module):
    """Token ids -> Engram row ids for every Engram layer. Holds only immutable tables; the history
    comes from the caller's per-sequence cache."""

    def __init__(self, layout: EngramLayout, token_map: torch.Tensor):
        super().__init__()
        if token_map.ndim != 1:
            raise ConfigError(f"token map must be 1-D, got shape {tuple(token_map.shape)}")
        size = int(token_map.max()) + 1 if token_map.numel() else 0
        if size != layout.compressed_vocab_size:
            raise ConfigError(f"token map has {size} compressed ids; engram_compressed_vocab_size is "
                              f"{layout.compressed_vocab_size}")
        self.layout = layout
        self.pad = int(token_map[layout.pad_id])  # §4: pad = map[engram_pad_id]
        primes, offsets, mults = layout.tensors()
        self.register_buffer("token_map", token_map.to(torch.int64), persistent=False)
        self.register_buffer("primes", primes, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.register_buffer("multipliers", mults, persistent=False)

    def forward(self, token_ids: torch.Tensor, start_pos: int, history: EngramHistory,
                text_mask: torch.Tensor | None = None) -> torch.Tensor:
        compressed = self.token_map[token_ids.to(self.token_map.device)]
        return self.hash_compressed(compressed, start_pos, history, text_mask)

    def hash_compressed(self, compressed: torch.Tensor, start_pos: int, history: EngramHistory,
                        text_mask: torch.Tensor | None = None) -> torch.Tensor:
        return hash_compressed(self.layout, compressed, start_pos, history, self.pad, text_mask, self._tables(history))

    def hash_step(self, token_ids: torch.Tensor, step, history: EngramHistory,
                  text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The packed tokens [N] of a Step (each row in its own slot, at its own positions) → [N, E, Nc]."""
        if step.n_rows > 0 and max(step.ends) > history.max_seq_len:
            raise CacheError(f"Engram hash positions up to {max(step.ends) - 1} exceed the history length "
                             f"{history.max_seq_len}")
        compressed = self.token_map[token_ids.to(self.token_map.device)]
        device = history.ids.device
        return hash_tokens(self.layout, compressed, step.token_slot.to(device), step.positions.to(device), history,
                           self.pad, text_mask, self._tables(history))

    def _tables(self, history: EngramHistory):
        return tuple(t.to(history.ids.device) for t in (self.primes, self.offsets, self.multipliers))
