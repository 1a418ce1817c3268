"""Layer roles of DeepSeek-V4.1, derived from the config in one place (ARCHITECTURE.md §3).

Who compresses, who indexes, whose compressed cache and whose top-K selection a layer reads, who picks
candidate blocks and who is restricted to them, where Engram sits and which streams feed DSpark: every
module and cache asks this table instead of re-deriving it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

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


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}–{v}")
            start = None
    return ", ".join(out)


def roles_table(roles: tuple[LayerRole, ...]) -> str:
    """The §3 table: consecutive layers with the same role merge into one row."""
    rows: list[tuple[list[int], tuple]] = []
    for r in roles:
        key = (r.ratio, r.description, r.kv_source if not r.is_kv_source else "own",
               r.index_source if not r.is_index_source else "own", r.has_engram, r.is_dspark_target)
        if rows and rows[-1][1] == key and rows[-1][0][-1] == r.layer_id - 1:
            rows[-1][0].append(r.layer_id)
        else:
            rows.append(([r.layer_id], key))
    header = ("layers", "r", "role", "compressed KV from", "top-K from", "engram", "DSpark target", "RoPE")
    lines = [header]
    for ids, (ratio, desc, kv, idx, engram, target) in rows:
        lines.append((_ranges(ids), str(ratio), desc, "–" if kv is None else str(kv), "–" if idx is None else str(idx),
                      "before block" if engram else "", "input" if target else "",
                      "compress θ + YaRN" if ratio else "base θ"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


@dataclass(frozen=True)
class SeedGroup:
    """One row of the seed document's grouping: a run of same-kind blocks, or an Engram module."""

    name: str
    layers: tuple[int, ...]
    engram_layer: int | None = None


def seed_groups(roles: tuple[LayerRole, ...]) -> tuple[SeedGroup, ...]:
    """Window layers, pooled groups, token group, re-indexing group, with Engram rows where Engram sits.

    Consecutive blocks of one kind form a row; an Engram module breaks the run (that is why the seed lists
    window layers 0 and 1 separately and pooled layers 2–13 apart from 14–19).
    """
    groups: list[SeedGroup] = []
    reindexing = False
    for r in roles:
        if r.is_dspark:
            break
        if r.has_engram:
            groups.append(SeedGroup("Engram", (), engram_layer=r.layer_id))
        if r.is_index_source and not r.is_kv_source:
            reindexing = True
        name = {WINDOW: "Window layer", POOLED: "Pooled group", TOKEN: "Token group"}[r.kind]
        if reindexing and r.ratio:
            name = "Re-indexing group"
        last = groups[-1] if groups else None
        if last is not None and last.name == name and name != "Window layer" and last.engram_layer is None:
            groups[-1] = SeedGroup(name, last.layers + (r.layer_id,))
        else:
            groups.append(SeedGroup(name, (r.layer_id,)))
    return tuple(groups)
