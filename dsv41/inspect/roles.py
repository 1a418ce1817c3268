"""The layer-role table (docs/ARCHITECTURE.md §3) and the seed documents' block groups (docs/PARAMETERS.md §5),
for `dsv41 inspect`.

The roles themselves are derived in `dsv41.model.roles`; this module only presents them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.roles import POOLED, TOKEN, WINDOW, LayerRole


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
    """One row of the seed document's grouping (docs/PARAMETERS.md §5): same-kind blocks, or an Engram module."""

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
