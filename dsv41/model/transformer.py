"""The DeepSeek-V4.1 transformer: embed → S streams → 40 blocks (Engram before 1 and 14) → collapse.

Shapes: B batch, T positions in the call, S streams (hc_mult), D dim, V vocab, N Engram hash columns,
Dt = D · len(dspark_target_layer_ids) DSpark conditioning width.

`Transformer.forward` runs the blocks for token ids at absolute positions start_pos … start_pos + T − 1
against a `ModelCache` and returns hidden states; `Transformer.logits` projects the positions a caller
asks for (STYLE.md P4). Prefill, chunked prefill, decode and multi-token verification are the same call
with different metadata.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from . import hyper
from .attention import ForwardState
from .block import Block
from .dspark import Draft, DSparkStage, draft, observe
from .engram import EngramHistory, EngramLayout, NgramHasher
from .cache import ModelCache, create_cache
from ..config import ModelConfig, RuntimeConfig
from .layers import Embedding, Head, RMSNorm
from .roles import derive_roles


@dataclass
class ModelOutput:
    hidden: torch.Tensor
    """[B, T, D] the collapsed stream before the final norm (feed to `Transformer.logits`)."""
    dspark_hidden: torch.Tensor | None
    """[B, T, Dt] means over streams of the streams entering the DSpark target layers (trap 19)."""


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig | None = None, *, device=None,
                 token_map: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.runtime = runtime or RuntimeConfig()
        self.roles = derive_roles(cfg)
        dtype, numerics = self.runtime.torch_dtype, self.runtime.numerics_policy
        self.numerics = numerics
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.dim, device=device, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(Block(cfg, r, **kw) for r in self.roles[:cfg.n_layers])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.head = Head(cfg.vocab_size, cfg.dim, numerics=numerics, device=device)
        if cfg.dspark_enabled:
            # DSpark stages, stored under mtp.* (ARCHITECTURE.md §15); embedding and head are tied
            self.mtp = nn.ModuleList(DSparkStage(cfg, r, **kw) for r in self.roles[cfg.n_layers:])
        self.hasher = None
        self._engram_pool: ThreadPoolExecutor | None = None             # this model's own, made on first use
        if cfg.engram_layer_ids:
            self.engram_layout = EngramLayout.from_config(cfg)
            if token_map is not None:
                self.set_token_map(token_map)

    @property
    def dtype(self) -> torch.dtype:
        return self.runtime.torch_dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """Attach the tokenizer's compressed token map that feeds the Engram hash (ENGRAM-HASHING §1)."""
        if token_map.shape != (self.cfg.vocab_size,):
            raise ValueError(f"the compressed token map covers {token_map.shape[0]} token ids; the model's "
                             f"vocab_size is {self.cfg.vocab_size}")
        self.hasher = NgramHasher(self.engram_layout, token_map)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> ModelCache:
        """Fresh per-sequence state for `batch_size` rows of up to `max_seq_len` positions."""
        max_seq_len = max_seq_len or self.runtime.max_seq_len
        history = None
        if self.cfg.engram_layer_ids:
            history = EngramHistory.create(batch_size, max_seq_len, device=self.device)
        return create_cache(self.cfg, self.roles, batch_size, max_seq_len, device=self.device, dtype=self.dtype,
                            engram_history=history)

    def forward(self, ids: torch.Tensor, start_pos: int, cache: ModelCache, *,
                token_types: torch.Tensor | None = None) -> ModelOutput:
        """ids [B, T] at positions start_pos … start_pos + T − 1 → hidden states; updates `cache`.

        token_types [B, T]: −1 text, ≥ 0 image-span positions (bias_vl routing, no Engram).
        """
        B, T = ids.shape
        cache.check_call(start_pos, T, B)
        self._check_ids(ids)
        image_mask = None if token_types is None else token_types >= 0
        text_mask = None if image_mask is None else ~image_mask
        engram_rows = self._gather_engram_rows(ids, start_pos, cache, text_mask)
        step = ForwardState(start_pos=start_pos, length=T,
                            positions=torch.arange(start_pos, start_pos + T, device=ids.device),
                            reference_layout=not self.numerics.invariant,
                            stale_index_keys=self.runtime.stale_index_keys)
        # the stream in the compute dtype from the start (bf16 table values are exact in fp32), so that
        # fast float32 does not round layer 0's attention input to bf16
        x = self.embed(ids).to(self.dtype).unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)   # [B, T, S, D]
        pre = hyper.identity_pre(B, T, self.cfg.hc_mult, device=ids.device)
        targets = []
        for block in self.layers:
            if block.engram is not None:
                x = block.engram(x, engram_rows[block.role.engram_index].result(), text_mask)
            if block.role.is_dspark_target:
                targets.append(x.float().mean(dim=2).to(x.dtype))
            x, pre = block(x, pre, step, cache, image_mask)
        cache.length = start_pos + T
        hidden = hyper.collapse(x, pre)
        return ModelOutput(hidden=hidden, dspark_hidden=torch.cat(targets, dim=-1) if targets else None)

    def dspark_observe(self, dspark_hidden: torch.Tensor, start_pos: int, cache: ModelCache) -> None:
        """Feed the DSpark rings the main rows of positions start_pos … (ModelOutput.dspark_hidden)."""
        self._need_dspark()
        observe(self.mtp, dspark_hidden, start_pos, cache)

    def dspark_draft(self, token: torch.Tensor, last_pos: int, cache: ModelCache, choose=None) -> Draft:
        """Draft dspark_block_size tokens after `token` [B] (the token of position last_pos + 1).

        The rings must hold the main rows up to last_pos (`dspark_observe`); `choose` maps a row of
        logits [B, V] to token ids (greedy by default).
        """
        self._need_dspark()
        return draft(self.mtp, self.embed, self.head, self.cfg, token, last_pos, cache, choose, dtype=self.dtype)

    def _need_dspark(self) -> None:
        if not self.cfg.dspark_enabled:
            raise RuntimeError("this model has no DSpark stages (n_mtp_layers / dspark_block_size are 0)")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V] of the hidden states given (slice the positions you need first)."""
        return self.head(self.norm(hidden))

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"token ids must be an integer tensor, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}), got min {int(ids.min())} "
                             f"max {int(ids.max())}")

    def _gather_engram_rows(self, ids, start_pos, cache, text_mask) -> list[Future]:
        """Issue every Engram layer's row gather before the blocks run (hash ids depend only on tokens).

        A table held away from the compute path (memory-mapped, or in host memory for an accelerator
        model) is read on a background thread, overlapping the page faults and copies with the blocks
        before the Engram layer; a resident table is gathered at once.
        """
        if not self.cfg.engram_layer_ids:
            return []
        if self.hasher is None:
            raise RuntimeError("this model has Engram layers but no compressed token map: build it with "
                               "token_map=… or call set_token_map (ENGRAM-HASHING.md §1)")
        hash_ids = self.hasher(ids, start_pos, cache.engram_history, text_mask)       # [B, T, nE, N]
        engrams = {b.role.engram_index: b.engram for b in self.layers if b.engram is not None}
        futures = []
        for e in range(len(engrams)):
            engram, column = engrams[e], hash_ids[:, :, e]
            if engram.embed.movable and engram.embed.weight.device == ids.device:
                done = Future()
                done.set_result(engram.gather(column, ids.device))
                futures.append(done)
            else:
                futures.append(self._gather_pool().submit(engram.gather, column, ids.device))
        return futures

    def _gather_pool(self) -> ThreadPoolExecutor:
        if self._engram_pool is None:
            self._engram_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-engram")
        return self._engram_pool
