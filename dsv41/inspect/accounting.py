"""Parameter figures of a config under the convention of docs/PARAMETERS.md, and the alternatives it names.

Everything is computed from the checkpoint inventory (`released_inventory`), so the parts the model does
not build (DSpark stages, vision, aligner) are covered too. The headline figure is the seed documents'
(docs/PARAMETERS.md §7) "per-instance total": the backbone blocks including their Engram modules, fp4
experts at logical size, scales not counted (docs/PARAMETERS.md §1). Every other figure carries its own
label; none is a silent variant of the headline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from ..checkpoint import released_inventory
from ..checkpoint.spec import TensorSpec
from ..config import ModelConfig
from ..model.roles import LayerRole, derive_roles
from .roles import seed_groups
from .tree import Node, Part, build_tree, counted_parameters

# The loader dequantises wo_a to bf16 (docs/ARCHITECTURE.md §6.2), so the model as built holds no scale for
# it although the checkpoint stores one; docs/PARAMETERS.md's scale figures count the model as built.
DEQUANTISED_AT_LOAD = ("attn.wo_a",)
ADD_ON_KEYS = ("compressor", "indexer")
DSPARK_EXTRA_KEYS = ("main input", "draft head")


def fmt(n: int) -> str:
    return f"{n:,}"


def fmt_delta(n: int) -> str:
    return ("+" if n >= 0 else "−") + fmt(abs(n))


def ranges(ids) -> str:
    """2, 3, 4, 8 → "2–4, 8"."""
    ids, out = sorted(ids), []
    for i, v in enumerate(ids):
        if i == 0 or ids[i - 1] != v - 1:
            out.append([v, v])
        else:
            out[-1][1] = v
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in out)


def layers_text(ids) -> str:
    """"layer 20" or "layers 2, 8, 14"."""
    ids = list(ids)
    return ("layer " if len(ids) == 1 else "layers ") + (ranges(ids) if ids else "none")


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    value: int
    note: str = ""


@dataclass(frozen=True)
class GroupRow:
    """One row of the seed documents' group table (docs/PARAMETERS.md §5)."""

    name: str
    layers: tuple[int, ...]
    engram_layer: int | None
    calculation: str
    parameters: int

    @property
    def where(self) -> str:
        return f"before {self.engram_layer}" if self.engram_layer is not None else ranges(self.layers)


@dataclass(frozen=True)
class LayerRow:
    layer: int
    role: str
    parameters: int
    """The block alone, Engram excluded (docs/PARAMETERS.md §3)."""
    engram: int


@dataclass(frozen=True)
class AddOn:
    """A role-dependent part on top of the base block W (docs/PARAMETERS.md §3)."""

    label: str
    layers: tuple[int, ...]
    calculation: str
    parameters: int


def _short(part: Part) -> str:
    return part.name.rsplit(".", 1)[-1]


class Accounting:
    def __init__(self, cfg: ModelConfig, inventory: Mapping[str, TensorSpec] | None = None):
        self.cfg = cfg
        self.roles: tuple[LayerRole, ...] = derive_roles(cfg)
        self.inventory = inventory if inventory is not None else released_inventory(cfg)
        self.tree = build_tree(self.inventory)

    # ------------------------------------------------------------------------------- nodes
    @property
    def layers(self) -> Node:
        return self.tree.child("layers")

    def block(self, layer: int) -> Node:
        return self.layers.child(f"layers.{layer}")

    def engram(self, layer: int) -> Node | None:
        return self.block(layer).find("Engram")

    def block_parameters(self, layer: int) -> int:
        engram = self.engram(layer)
        return self.block(layer).parameters - (engram.parameters if engram else 0)

    def add_ons(self, layer: int) -> list[Node]:
        return [n for k in ADD_ON_KEYS if (n := self.block(layer).find(k)) is not None]

    def base(self, layer: int) -> int:
        return self.block_parameters(layer) - sum(n.parameters for n in self.add_ons(layer))

    @cached_property
    def base_block(self) -> int | None:
        """W: the block without compressor, indexer and Engram, when every backbone block shares it."""
        bases = {self.base(r.layer_id) for r in self.backbone}
        return bases.pop() if len(bases) == 1 else None

    @property
    def backbone(self) -> tuple[LayerRole, ...]:
        return tuple(r for r in self.roles if not r.is_dspark)

    # ------------------------------------------------------------------------------- tables
    def layer_rows(self) -> list[LayerRow]:
        rows = []
        for r in self.backbone:
            engram = self.engram(r.layer_id)
            rows.append(LayerRow(r.layer_id, r.description, self.block_parameters(r.layer_id),
                                 engram.parameters if engram else 0))
        return rows

    def add_on_rows(self) -> list[AddOn]:
        found: dict[tuple, list] = {}
        for r in self.backbone:
            for node in self.add_ons(r.layer_id):
                key = (node.key, r.ratio if node.key == "compressor" else None, node.signature())
                found.setdefault(key, [node, []])[1].append(r.layer_id)
        rows = []
        for (kind, ratio, _), (node, layers) in found.items():
            names = ", ".join(_short(p) for p in node.parts.values())
            if kind == "compressor":
                label = f"ratio-{ratio} compressor ({names})"
            else:
                owns = any(p.name.endswith(".wk") for p in node.parts.values())
                label = f"indexer {'owning its keys' if owns else 'without keys'} ({names})"
            calc = " + ".join(p.calculation for p in node.parts.values())
            rows.append(AddOn(label, tuple(layers), calc, node.parameters))
        return rows

    def groups(self) -> list[GroupRow]:
        rows = []
        for g in seed_groups(self.roles):
            if g.engram_layer is not None:
                node = self.engram(g.engram_layer)
                calc = " + ".join(f"{c.key} {fmt(c.parameters)}" for c in node.children.values())
                rows.append(GroupRow(g.name, (), g.engram_layer, calc, node.parameters))
            else:
                total = sum(self.block_parameters(layer) for layer in g.layers)
                rows.append(GroupRow(g.name, g.layers, None, self._group_calculation(g.layers), total))
        return rows

    def _units(self, layers: tuple[int, ...]) -> list[list[int]]:
        """A group splits into repeating units, each starting at an index source (docs/PARAMETERS.md §5)."""
        units: list[list[int]] = []
        for layer in layers:
            if not units or self.roles[layer].is_index_source:
                units.append([])
            units[-1].append(layer)
        return units

    def _unit_calculation(self, unit: list[int]) -> str:
        if self.base_block is None:
            return " + ".join(fmt(self.block_parameters(layer)) for layer in unit)
        extra = [fmt(n.parameters) for layer in unit for n in self.add_ons(layer)]
        return " + ".join([f"{len(unit)}W" if len(unit) > 1 else "W"] + extra)

    def _group_calculation(self, layers: tuple[int, ...]) -> str:
        units = self._units(layers)
        calcs = [self._unit_calculation(u) for u in units]
        if len(units) == 1:
            return calcs[0]
        if len(set(calcs)) == 1:
            unit_total = sum(self.block_parameters(layer) for layer in units[0])
            return f"{len(units)} · [{calcs[0]}] = {len(units)} · {fmt(unit_total)}"
        return " + ".join(f"[{c}]" for c in calcs)

    # ------------------------------------------------------------------------------- figures
    @cached_property
    def figures(self) -> dict[str, Figure]:
        out: list[Figure] = []
        out += self._block_figures()
        out += self._alternative_figures()
        out += self._whole_model_figures()
        out += self._other_part_figures()
        return {f.key: f for f in out}

    def value(self, key: str) -> int:
        return self.figures[key].value

    def engram_gates(self) -> dict[int, int]:
        return {layer: self.engram(layer).child("gate").parameters for layer in self.cfg.engram_layer_ids}

    def _block_figures(self) -> list[Figure]:
        n = self.cfg.n_layers
        out = [Figure("blocks", f"{n} backbone blocks incl. Engram — the seed documents' per-instance total",
                      self.layers.parameters, "docs/PARAMETERS.md §1: fp4 experts logical, scales not counted")]
        if self.base_block is not None:
            out.append(Figure("base_block", "W: one block without compressor, indexer or Engram", self.base_block))
        gates = self.engram_gates()
        if gates:
            values = set(gates.values())
            per = values.pop() if len(values) == 1 else None
            if per is not None:
                out.append(Figure("engram_gate", "Engram gate (q_weight + k_weight), per Engram layer", per))
            engram = sum(self.engram(layer).parameters for layer in gates)
            out.append(Figure("engram", f"{len(gates)} Engram modules (tables, wkv, gates)", engram))
            out.append(Figure("blocks_without_engram", f"{n} backbone blocks without Engram",
                              self.layers.parameters - engram))
        return out

    def _alternative_figures(self) -> list[Figure]:
        n, blocks = self.cfg.n_layers, self.layers.parameters
        out = []
        if self.cfg.vision_enabled:
            text_only = self._text_only_blocks()
            out.append(Figure("blocks_text_only", f"{n} blocks incl. Engram, text-only build (routers without bias_vl)",
                              text_only, f"{fmt_delta(text_only - blocks)} against the seed convention"))
        out.append(Figure("blocks_fp4_stored", f"{n} blocks incl. Engram, fp4 experts at stored size (packed bytes)",
                          self.layers.stored, f"{fmt_delta(self.layers.stored - blocks)} against the seed convention"))
        globals_ = sum(self.tree.child(k).parameters for k in ("embed", "head", "norm"))
        out.append(Figure("blocks_embed_head_norm", f"{n} blocks incl. Engram + embed, head and final norm",
                          blocks + globals_, f"{fmt_delta(globals_)} against the seed convention"))
        return out

    def _whole_model_figures(self) -> list[Figure]:
        t, blocks = self.tree, self.layers
        unconverted = self._dequantised_scales(t)
        return [
            Figure("model_logical", "whole model (DSpark, vision and aligner included), fp4 logical, no scales",
                   t.parameters),
            Figure("model_stored", "whole model, stored elements (fp4 packed), no scales", t.stored),
            Figure("model_scales", "scale elements of the model as built (wo_a dequantised at load)",
                   t.scales - unconverted),
            Figure("model_scales_checkpoint", "scale elements stored in the checkpoint (wo_a's included)", t.scales),
            Figure("blocks_scales", f"scale elements of the {self.cfg.n_layers} blocks as built",
                   blocks.scales - self._dequantised_scales(blocks)),
            Figure("blocks_scales_checkpoint", f"scale elements of the {self.cfg.n_layers} blocks in the checkpoint",
                   blocks.scales),
        ]

    def _other_part_figures(self) -> list[Figure]:
        t = self.tree
        out = [Figure(k, label, t.child(k).parameters) for k, label in
               (("embed", "token embedding"), ("head", "output head"), ("norm", "final norm"))]
        if (dspark := t.find("DSpark")) is not None:
            out += self._dspark_figures(dspark)
        for key, label in (("vision", "ViT"), ("aligner", "aligner"), ("image markers", "image span markers")):
            if (node := t.find(key)) is not None:
                out.append(Figure(key.replace(" ", "_"), label, node.parameters))
        return out

    def _dspark_figures(self, dspark: Node) -> list[Figure]:
        stages = list(dspark.children.values())
        extras = [sum(n.parameters for k in DSPARK_EXTRA_KEYS if (n := s.find(k))) for s in stages]
        bases = {s.parameters - e for s, e in zip(stages, extras)}
        out = [Figure("dspark", f"{len(stages)} DSpark stages, fp4 logical", dspark.parameters)]
        if len(bases) == 1:
            experts = self.cfg.dspark_n_routed_experts or self.cfg.n_routed_experts
            out.append(Figure("dspark_stage", f"one DSpark stage without extras ({experts} experts)", bases.pop()))
        out.append(Figure("dspark_extras", "DSpark extras (main_proj, main_norm, draft norm, Markov head, confidence)",
                          sum(extras)))
        return out

    @staticmethod
    def _dequantised_scales(node: Node) -> int:
        return sum(p.scales for _, n in node.walk() for p in n.parts.values() if p.name in DEQUANTISED_AT_LOAD)

    def _text_only_blocks(self) -> int:
        inventory = released_inventory(self.cfg.replace(vision_n_layers=0))
        return sum(counted_parameters(s) for name, s in inventory.items() if name.startswith("layers."))
