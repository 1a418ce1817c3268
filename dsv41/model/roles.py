"""Layer roles of DeepSeek-V4.1, derived from the config in one place (docs/ARCHITECTURE.md §3).

Who compresses, who indexes, whose compressed cache and whose top-K selection a layer reads, who picks
candidate blocks and who is restricted to them, where Engram sits and which streams feed DSpark: every
module and cache asks this table instead of re-deriving it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

WINDOW, POOLED, TOKEN = "window", "pooled", "token"


@dataclass(frozen=True)
class LayerRole:
    layer_id: int
    ratio: int
    """Compress ratio r: 0 window-only, 1 one compressed position per token, >1 pooled groups of r."""
    is_kv_source: bool
    """Compresses its own KV and owns the index keys (layers 2, 8, 14, 20 in the release)."""
    is_index_source: bool
    """Runs its own indexer (chooses top-K compressed positions)."""
    kv_source: int | None
    """Layer whose compressed KV and index keys this layer reads (itself for a kv source)."""
    index_source: int | None
    """Layer whose top-K selection this layer uses (itself for an index source)."""
    is_candidate_source: bool
    """Picks the candidate blocks later index sources are restricted to (layer 20)."""
    candidate_source: int | None
    """For candidate users (24, 28, 32, 36): the layer whose kept blocks restrict the scores."""
    engram_index: int | None
    """Position in engram_layer_ids when Engram is applied to the stream entering this block."""
    is_dspark: bool
    is_dspark_target: bool
    """The stream entering this block feeds DSpark (mean over streams)."""

    @property
    def kind(self) -> str:
        return WINDOW if self.ratio == 0 else (TOKEN if self.ratio == 1 else POOLED)

    @property
    def has_engram(self) -> bool:
        return self.engram_index is not None

    @property
    def uses_compressed_rope(self) -> bool:
        """r > 0 layers use θ = compress_rope_theta with YaRN for everything (§3, §10)."""
        return self.ratio > 0

    @property
    def description(self) -> str:
        if self.is_dspark:
            return "DSpark window attention"
        if self.ratio == 0:
            return "window only"
        parts = []
        if self.is_kv_source:
            parts.append("kv source")
        if self.is_index_source:
            parts.append("index source" + ("" if self.is_kv_source else f" (keys of layer {self.kv_source})"))
        if self.is_candidate_source:
            parts.append("candidate source")
        if self.candidate_source is not None:
            parts.append(f"candidate user (blocks of layer {self.candidate_source})")
        if not parts:
            parts.append("consumer")
        return " + ".join(parts)


def derive_roles(cfg: ModelConfig) -> tuple[LayerRole, ...]:
    """One role per layer id 0 … n_layers + n_mtp_layers − 1 (DSpark stages last)."""
    roles = []
    for layer in range(cfg.n_all_layers):
        backbone = layer < cfg.n_layers
        ratio = cfg.compress_ratios[layer]
        kv_source = _latest(cfg.kv_source_layers, layer) if backbone and ratio else None
        index_source = _latest(cfg.index_source_layers, layer) if backbone and ratio else None
        is_index = backbone and layer in cfg.index_source_layers
        cand = cfg.candidate_source_layer
        is_cand_user = (cand is not None and is_index and layer > cand and kv_source == cand
                        and layer not in cfg.kv_source_layers)
        engram = cfg.engram_layer_ids.index(layer) if backbone and layer in cfg.engram_layer_ids else None
        roles.append(LayerRole(
            layer_id=layer, ratio=ratio,
            is_kv_source=backbone and layer in cfg.kv_source_layers,
            is_index_source=is_index,
            kv_source=kv_source, index_source=index_source,
            is_candidate_source=backbone and layer == cand,
            candidate_source=cand if is_cand_user else None,
            engram_index=engram,
            is_dspark=not backbone,
            is_dspark_target=backbone and layer in cfg.dspark_target_layer_ids,
        ))
    return tuple(roles)


def _latest(ids: tuple[int, ...], layer: int) -> int | None:
    before = [i for i in ids if i <= layer]
    return before[-1] if before else None
