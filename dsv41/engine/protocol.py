"""The interface the engine calls: what a model (or a mock in tests) must provide (STYLE.md P10).

Shapes: B rows of a step, N tokens of the step, V vocab, D dim, Dt DSpark conditioning width.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ModelInterface(Protocol):
    cfg: Any
    """The model config: `vocab_size`, `dspark_enabled`, `dspark_block_size`."""
    runtime: Any
    """The runtime config: `max_seq_len`."""

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, n_slots: int, max_seq_len: int) -> Any:
        """A pool of cache slots with `check`, `snapshot`, `rollback(snapshot, keep)` and `reset(slot)`."""

    def step(self, slots, starts, counts) -> Any:
        """Metadata of a call: row b feeds counts[b] tokens of slot slots[b] from position starts[b]
        (`n_tokens`, `n_rows`, `offsets`)."""

    def __call__(self, ids: torch.Tensor, step: Any, cache: Any, *, images: Any = None) -> Any:
        """ids [N] → an output with `hidden` [N, D] and `dspark_hidden` [N, Dt] or None; `images`: the
        call's image-span rows (vision/spans.py `SpanRows`) or None."""

    def encode_image(self, image: Any) -> torch.Tensor:
        """One image (vision/processor.py `ImageInput`) → its span rows [L, D]."""

    def logits(self, hidden: torch.Tensor, rows=None) -> torch.Tensor:
        """[M, D] → fp32 [M, V]; with `rows` (indices into a forward's `hidden` [N, D]), only those rows.
        The engine passes a forward's output whole with the rows it wants, so a model whose activations
        live elsewhere (parallel/driver.py) needs to send only the row numbers."""

    def dspark_observe(self, dspark_hidden: torch.Tensor, step: Any, cache: Any, *, rows=None) -> None: ...

    def dspark_draft(self, token: torch.Tensor, last_pos, cache: Any, choose=None, *, slots=None) -> Any:
        """token [B] → a draft with `ids` [B, k + 1] (the token, then k drafts)."""
