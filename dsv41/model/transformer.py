"""The DeepSeek-V4.1 transformer: embed → S streams → 40 blocks (Engram before 1 and 14) → collapse.

Shapes: B rows of the call, T positions per row (uniform calls), N packed tokens of the call (step.py),
S streams (hc_mult), D dim, V vocab, E Engram layers, Nc Engram hash columns,
Dt = D · len(dspark_target_layer_ids) DSpark conditioning width.

`Transformer.forward` runs the blocks for the tokens of a `Step` — any mix of rows, each at its own
positions in its own cache slot — and returns hidden states; `Transformer.logits` projects the positions
a caller asks for (STYLE.md P4). Prefill, chunked prefill, decode and multi-token verification are the
same call with different metadata. The blocks see the call as one packed sequence [1, N, …].
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from . import hyper
from .block import Block
from .dspark import Draft, DraftStep, DSparkStage, draft, observe
from .engram import EngramHistory, EngramLayout, NgramHasher
from .cache import CacheError, ModelCache, create_cache
from ..config import ModelConfig, RuntimeConfig
from .layers import Embedding, Head, RMSNorm
from .roles import derive_roles
from .step import Handoff, Step
from ..errors import CheckpointError, ImageError, InputError
from ..parallel.context import ParallelContext
from ..vision.encoder import Aligner, ViT
from ..vision.processor import ImageInput
from ..vision.spans import SpanRows, span_rows


@dataclass
class ModelOutput:
    hidden: torch.Tensor
    """[N, D] (a Step call) or [B, T, D] (a uniform call): the collapsed stream before the final norm
    (feed to `Transformer.logits`)."""
    dspark_hidden: torch.Tensor | None
    """[N, Dt] or [B, T, Dt]: means over streams of the streams entering the DSpark target layers (trap 19)."""


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig | None = None, *, device=None,
                 token_map: torch.Tensor | None = None, parallel: ParallelContext | None = None):
        super().__init__()
        self.cfg = cfg
        self.runtime = runtime or RuntimeConfig()
        self.parallel = parallel = parallel or ParallelContext()
        self.roles = derive_roles(cfg)
        dtype, numerics = self.runtime.torch_dtype, self.runtime.numerics_policy
        self.numerics = numerics
        kw = dict(numerics=numerics, device=device, dtype=dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.dim, device=device, dtype=torch.bfloat16,
                               shard=parallel.shard("embed"))
        blocks = dict(kw, indexer_budget_bytes=self.runtime.indexer_budget_bytes, parallel=parallel)
        self.layers = nn.ModuleList(Block(cfg, r, **blocks) for r in self.roles[:cfg.n_layers])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=numerics, device=device)
        self.head = Head(cfg.vocab_size, cfg.dim, numerics=numerics, device=device, shard=parallel.shard("head"),
                         dtype=numerics.head_dtype(dtype))
        if cfg.dspark_enabled:
            # DSpark stages, stored under mtp.* (docs/ARCHITECTURE.md §15); embedding and head are tied
            self.mtp = nn.ModuleList(DSparkStage(cfg, r, **blocks) for r in self.roles[cfg.n_layers:])
        if cfg.vision_enabled:
            # the vision encoder (§16), under its checkpoint names; it runs in bf16 whatever the numerics
            self.vision = ViT(cfg, device)
            self.aligner = Aligner(cfg, device)
            for marker in ("image_start", "image_end", "image_newline"):
                self.register_parameter(marker, nn.Parameter(torch.empty(cfg.dim, device=device, dtype=torch.bfloat16),
                                                             requires_grad=False))
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
            raise CheckpointError(f"the compressed token map covers {token_map.shape[0]} token ids; the model's "
                                  f"vocab_size is {self.cfg.vocab_size}")
        self.hasher = NgramHasher(self.engram_layout, token_map)

    def new_cache(self, n_slots: int, max_seq_len: int | None = None) -> ModelCache:
        """Fresh per-sequence state: a pool of `n_slots` slots of up to `max_seq_len` positions each."""
        max_seq_len = self.runtime.max_seq_len if max_seq_len is None else max_seq_len
        if not isinstance(n_slots, int) or n_slots < 1:
            raise InputError(f"new_cache: n_slots must be a positive int, got {n_slots!r}")
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= self.runtime.max_seq_len:
            # the rotary tables and the ratio caches are sized for the runtime's context
            raise InputError(f"new_cache: max_seq_len must be in 1 … {self.runtime.max_seq_len} (the runtime's "
                             f"max_seq_len), got {max_seq_len!r}")
        history = None
        if self.cfg.engram_layer_ids:
            history = EngramHistory.create(n_slots, max_seq_len, device=self.device)
        return create_cache(self.cfg, self.roles, n_slots, max_seq_len, device=self.device, dtype=self.dtype,
                            engram_history=history)

    def step(self, slots, starts, counts) -> Step:
        """The metadata of a call: row b feeds counts[b] tokens of slot slots[b] from position starts[b]."""
        return Step(tuple(slots), tuple(starts), tuple(counts), device=self.device,
                    reference_layout=not self.numerics.invariant, stale_index_keys=self.runtime.stale_index_keys)

    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """The span rows of one image [L, D] (bf16): its delimiters and the aligner's rows in reading order."""
        if not self.cfg.vision_enabled:
            raise ImageError("this model has no vision encoder (vision_n_layers is 0); it cannot take images")
        plan = image.plan
        want = (plan.n_patches, 3 * self.cfg.vision_patch_size ** 2)
        if tuple(image.patches.shape) != want:
            raise ImageError(f"image patches are {tuple(image.patches.shape)}; its plan needs {want}")
        with torch.no_grad():
            features = self.vision(image.patches.to(self.device, torch.bfloat16), plan.n_vit_h, plan.n_vit_w)
            cells = self.aligner(features, plan.n_vit_h, plan.n_vit_w)
        return span_rows(image, cells, self.image_start, self.image_end, self.image_newline)

    def forward(self, ids: torch.Tensor, step: Step | int, cache: ModelCache, *,
                token_types: torch.Tensor | None = None, images: SpanRows | None = None) -> ModelOutput:
        """Run the tokens of a step and update the cache.

        - `ids` [N] packed with a `Step` (from `Transformer.step`): the engine's call; outputs are [N, …].
        - `ids` [B, T] with an int start position: every slot of the cache (B of them) at the same
          positions start_pos … start_pos + T − 1; outputs are [B, T, …].

        token_types (shaped like ids): −1 text, ≥ 0 image-span positions (bias_vl routing, no Engram).
        images: the image-span positions of the call (vision/spans.py), indexing its tokens in packed
        (row-major) order; their embeddings are replaced by the span rows and their types set.
        """
        if not isinstance(cache, ModelCache):
            raise InputError(f"forward needs the cache from model.new_cache(...), got {type(cache).__name__}")
        if not isinstance(ids, torch.Tensor):
            raise InputError(f"token ids must be a tensor, got {type(ids).__name__}")
        if isinstance(step, Step):
            return self._forward(ids, step, cache, token_types, images)
        if not isinstance(step, int) or isinstance(step, bool):
            raise InputError(f"forward's step is a Step (model.step(...)) or an int start position, got {step!r}")
        if ids.dim() != 2:
            raise InputError(f"token ids with a start position must be [B, T]; got shape {tuple(ids.shape)} "
                             f"(packed [N] ids need a Step)")
        B, T = ids.shape
        if B != cache.n_slots:
            raise CacheError(f"batch of {B} rows given to a cache of {cache.n_slots} slots (a [B, T] call feeds "
                             f"every slot; pass a Step to feed some)")
        out = self._forward(ids.flatten(), self.step(range(B), (step,) * B, (T,) * B), cache,
                            None if token_types is None else token_types.flatten(), images)
        unpack = lambda t: None if t is None else t.unflatten(0, (B, T))
        return ModelOutput(hidden=unpack(out.hidden), dspark_hidden=unpack(out.dspark_hidden))

    def _forward(self, ids: torch.Tensor, step: Step, cache: ModelCache, token_types,
                 images: SpanRows | None = None) -> ModelOutput:
        if ids.shape != (step.n_tokens,):
            raise InputError(f"the step covers {step.n_tokens} tokens; ids has shape {tuple(ids.shape)}")
        if images is not None:
            self._check_images(images, step.n_tokens)
            token_types = images.types if token_types is None else token_types
        cache.begin(step)
        ids = self._checked_ids(ids)
        image_mask = None if token_types is None else (token_types >= 0)[None]
        text_mask = None if image_mask is None else ~image_mask
        engram_rows = self._gather_engram_rows(ids, step, cache, text_mask)
        # the stream in the compute dtype from the start (bf16 table values are exact in fp32), so that
        # fast float32 does not round layer 0's attention input to bf16
        x = self.embed(ids[None])
        if images is not None:
            x[0, images.index] = images.rows.to(x.dtype)
        # the S copies of the stream as one copy of an expanded view (torch's repeat costs ~3x as much a step)
        x = x.to(self.dtype).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()    # [1, N, S, D]
        pre = hyper.identity_pre(1, step.n_tokens, self.cfg.hc_mult, device=ids.device)
        handoff, targets = Handoff(), []
        for block in self.layers:
            if block.engram is not None:
                x = block.engram(x, engram_rows[block.role.engram_index].result(), text_mask)
            if block.role.is_dspark_target:
                targets.append(x.float().mean(dim=2).to(x.dtype))
            x, pre = block(x, pre, step, handoff, cache, image_mask)
        cache.advance(step)
        hidden = hyper.collapse(x, pre, self.numerics)[0]
        return ModelOutput(hidden=hidden, dspark_hidden=torch.cat(targets, dim=-1)[0] if targets else None)

    def dspark_observe(self, dspark_hidden: torch.Tensor, step: Step | int, cache: ModelCache, *,
                       rows=None) -> None:
        """Feed the DSpark rings the main rows of a step's tokens (`ModelOutput.dspark_hidden` [N, Dt]), or
        of every slot from an int start position ([B, T, Dt]); `rows`: the rows of an [N, Dt] output that
        are the step's tokens (all when None)."""
        self._need_dspark()
        if rows is not None:
            dspark_hidden = dspark_hidden[torch.as_tensor(rows, dtype=torch.long, device=dspark_hidden.device)]
        if not isinstance(step, Step):
            B, T = dspark_hidden.shape[:2]
            step, dspark_hidden = self.step(range(B), (step,) * B, (T,) * B), dspark_hidden.flatten(0, 1)
        observe(self.mtp, dspark_hidden, step, cache)

    def dspark_draft(self, token: torch.Tensor, last_pos, cache: ModelCache, choose=None, *,
                     slots=None) -> Draft:
        """Draft dspark_block_size tokens after `token` [B] (the token of position last_pos + 1).

        `last_pos`: an int for every row, or one per row; `slots`: the cache slots of the rows (default
        0 … B − 1). The rings must hold the main rows up to last_pos (`dspark_observe`); `choose` maps a
        row of logits [B, V] to token ids (greedy by default).
        """
        self._need_dspark()
        B = token.shape[0]
        slots = tuple(range(B)) if slots is None else tuple(slots)
        last = (last_pos,) * B if isinstance(last_pos, int) else tuple(last_pos)
        return draft(self.mtp, self.embed, self.head, self.cfg, token, DraftStep(slots, last), cache, choose,
                     dtype=self.dtype)

    def _need_dspark(self) -> None:
        if not self.cfg.dspark_enabled:
            raise InputError("this model has no DSpark stages (n_mtp_layers / dspark_block_size are 0)")

    def logits(self, hidden: torch.Tensor, rows=None) -> torch.Tensor:
        """fp32 logits [..., V] of the hidden states given, or of `rows` of an [N, D] output ([len(rows), V])."""
        if rows is not None:
            hidden = hidden[torch.as_tensor(rows, dtype=torch.long, device=hidden.device)]
        return self.head(self.norm(hidden))

    def _check_images(self, images: SpanRows, n_tokens: int) -> None:
        if not self.cfg.vision_enabled:
            raise ImageError("this model has no vision encoder (vision_n_layers is 0); it cannot take images")
        n = images.index.numel()
        if images.rows.shape != (n, self.cfg.dim) or images.types.shape != (n_tokens,):
            raise ImageError(f"image rows {tuple(images.rows.shape)} and types {tuple(images.types.shape)} do not fit "
                             f"{n} span positions of dim {self.cfg.dim} in a call of {n_tokens} tokens")
        if n and (int(images.index.min()) < 0 or int(images.index.max()) >= n_tokens):
            raise ImageError(f"image span positions must index the call's {n_tokens} tokens")

    def _checked_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids checked against the vocabulary, on the model's device. Ids given on the host (the engine's)
        are checked there and then copied: an accelerator model's step waits on no device value. Ids
        given on the device are checked there, which waits for the device once."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise InputError(f"token ids must be an integer tensor, got {ids.dtype}")
        if ids.numel():
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= self.cfg.vocab_size:
                raise InputError(f"token ids must lie in [0, {self.cfg.vocab_size}), got min {low} max {high}")
        return ids.to(self.device, non_blocking=True)

    def _gather_engram_rows(self, ids, step: Step, cache, text_mask) -> list[Future]:
        """Issue every Engram layer's row gather before the blocks run (hash ids depend only on tokens).

        A table held away from the compute path (memory-mapped, or in host memory for an accelerator
        model) is read on a background thread, overlapping the page faults and copies with the blocks
        before the Engram layer; a resident table is gathered at once.
        """
        if not self.cfg.engram_layer_ids:
            return []
        if self.hasher is None:
            raise InputError("this model has Engram layers but no compressed token map: build it with "
                             "token_map=… or call set_token_map (docs/ENGRAM-HASHING.md §1)")
        mask = None if text_mask is None else text_mask[0]
        hash_ids = self.hasher.hash_step(ids, step, cache.engram_history, mask)[None]   # [1, N, E, Nc]
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
