"""The component tree of the released layout: every inventory tensor placed under the part it belongs to.

model → embed / layers → layers.L → Engram (table, wkv, gate) / attention (q path, kv, output, sink) /
compressor / indexer / MoE (router, routed experts, shared expert) / hyper-connections / norms; norm;
head; DSpark → mtp.S (the same block parts plus its input and draft-head extras); image markers; vision;
aligner. Nodes carry the checkpoint prefix they cover and a component kind (the page that describes them,
see components.py); leaves hold Parts, one per tensor or per family of identical expert tensors.

Each tensor is counted three ways (docs/PARAMETERS.md §1): `parameters` (the convention: fp4 at logical size,
scales not counted), `stored` (elements as stored, scales not counted) and `scales` (scale elements).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..checkpoint.spec import TensorSpec
from ..errors import CheckpointError

# Packed e2m1 holds two values per I8 byte (docs/ARCHITECTURE.md §6.1): an fp4 expert [out, in/2] stands for
# out·in parameters (docs/PARAMETERS.md §1).
FP4_VALUES_PER_BYTE = 2
FP4_STORAGE = "I8"
# Quantisation scales are ue8m0 tensors named `….scale` (docs/CHECKPOINT.md §2); `hc_*_scale` are fp32 and
# are parameters.
SCALE_DTYPE = "F8_E8M0"


def is_scale(spec: TensorSpec) -> bool:
    return spec.dtype == SCALE_DTYPE and spec.name.endswith(".scale")


def counted_parameters(spec: TensorSpec) -> int:
    """The docs/PARAMETERS.md §1 convention for one tensor."""
    if is_scale(spec):
        return 0
    return spec.numel * FP4_VALUES_PER_BYTE if spec.dtype == FP4_STORAGE else spec.numel


@dataclass
class Part:
    """One stored tensor, or `count` identical ones (the routed experts of one projection)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    count: int = 0
    parameters: int = 0
    stored: int = 0
    scales: int = 0

    @property
    def logical_shape(self) -> tuple[int, ...]:
        if self.dtype == FP4_STORAGE:
            return self.shape[:-1] + (self.shape[-1] * FP4_VALUES_PER_BYTE,)
        return self.shape

    @property
    def calculation(self) -> str:
        factors = ([self.count] if self.count > 1 else []) + list(self.logical_shape)
        return " · ".join(str(f) for f in factors)

    @property
    def storage(self) -> str:
        shape = f"[{', '.join(map(str, self.shape))}]"
        note = " packed fp4" if self.dtype == FP4_STORAGE else ""
        return f"{self.dtype}{note} {shape}" + (f" × {self.count}" if self.count > 1 else "")


@dataclass
class Node:
    key: str
    kind: str | None = None
    prefix: str | None = None
    parts: dict[str, Part] = field(default_factory=dict)
    children: dict[str, "Node"] = field(default_factory=dict)
    parameters: int = 0
    stored: int = 0
    scales: int = 0

    def child(self, key: str) -> "Node":
        return self.children[key]

    def find(self, *keys: str) -> "Node | None":
        node = self
        for key in keys:
            node = node.children.get(key)
            if node is None:
                return None
        return node

    def walk(self, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], "Node"]]:
        here = path + (self.key,)
        yield here, self
        for c in self.children.values():
            yield from c.walk(here)

    def signature(self) -> tuple:
        """Equal for two nodes with the same tensors (relative names, formats, shapes) in the same places."""
        parts = tuple((p.name, p.dtype, p.shape, p.count) for p in self.parts.values())
        return parts, tuple((k, c.signature()) for k, c in self.children.items())


# ------------------------------------------------------------------------------------ placement rules
# A segment is (key, kind, prefix suffix). The prefix suffix is the checkpoint sub-path the node covers
# (None for groupings the checkpoint does not name, such as the query path).
Segment = tuple[str, "str | None", "str | None"]
_ATTN: Segment = ("attention", "attention", "attn")
_MOE: Segment = ("MoE", "moe", "ffn")
_ENGRAM: Segment = ("Engram", "engram", "engram")
_DRAFT: Segment = ("draft head", None, None)

# Inside a backbone block or a DSpark stage (docs/ARCHITECTURE.md §5, §15; docs/CHECKPOINT.md §3).
_BLOCK_RULES: tuple[tuple[re.Pattern, tuple[Segment, ...]], ...] = tuple((re.compile(p), segs) for p, segs in (
    (r"engram\.embed\.", (_ENGRAM, ("table", None, "engram.embed"))),
    (r"engram\.wkv\.", (_ENGRAM, ("wkv", None, "engram.wkv"))),
    (r"engram\.[qk]_weight$", (_ENGRAM, ("gate", "engram_gate", None))),
    (r"attn\.(wq_a|q_norm|wq_b)\.", (_ATTN, ("q path", None, None))),
    (r"attn\.(wkv|kv_norm)\.", (_ATTN, ("kv", None, None))),
    (r"attn\.(wo_a|wo_b)\.", (_ATTN, ("output", None, None))),
    (r"attn\.attn_sink$", (_ATTN, ("sink", "sparse_attention", None))),
    (r"attn\.compressor\.", (("compressor", "compressor", "attn.compressor"),)),
    (r"attn\.indexer\.", (("indexer", "indexer", "attn.indexer"),)),
    (r"ffn\.gate\.", (_MOE, ("router", "router", "ffn.gate"))),
    (r"ffn\.experts\.", (_MOE, ("routed experts", "expert", "ffn.experts"))),
    (r"ffn\.shared_experts\.", (_MOE, ("shared expert", "expert", "ffn.shared_experts"))),
    (r"hc_", (("hyper-connections", "hyper_connections", None),)),
    (r"(attn_norm|ffn_norm)\.", (("norms", "norm", None),)),
    (r"main_(proj|norm)\.", (("main input", None, None),)),
    (r"norm\.", (_DRAFT,)),
    (r"(markov_head|confidence_head)\.", (_DRAFT,)),
))

_VISION_RULES: tuple[tuple[re.Pattern, tuple[Segment, ...]], ...] = tuple((re.compile(p), segs) for p, segs in (
    (r"attn\.", (("attention", None, "attn"),)),
    (r"mlp\.", (("MLP", None, "mlp"),)),
    (r"norm[12]\.", (("norms", None, None),)),
))

_TOP_LEVEL = {
    "embed": ("embed", "embedding", "embed"),
    "norm": ("norm", "norm", "norm"),
    "head": ("head", "head", "head"),
    "image_start": ("image markers", "embedding", None),
    "image_end": ("image markers", "embedding", None),
    "image_newline": ("image markers", "embedding", None),
    "aligner": ("aligner", "aligner", "aligner"),
}
_VISION: Segment = ("vision", "vision", "vision")

# Display order; anything else keeps inventory order after these.
_TOP_ORDER = ("embed", "layers", "norm", "head", "DSpark", "image markers", "vision", "aligner")
_BLOCK_ORDER = ("Engram", "attention", "compressor", "indexer", "MoE", "hyper-connections", "norms",
                "main input", "draft head")

_EXPERT = re.compile(r"^(?P<pre>.*ffn\.experts)\.\d+\.(?P<proj>.+)$")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _prefixed(base: str, segs: tuple[Segment, ...]) -> list[Segment]:
    return [(k, kind, f"{base}.{p}" if p else None) for k, kind, p in segs]


def _match(rules, rest: str, name: str) -> tuple[Segment, ...]:
    for pattern, segs in rules:
        if pattern.match(rest):
            return segs
    raise CheckpointError(f"{name}: no component of the inventory layout holds this tensor")


def place(name: str) -> tuple[list[Segment], str]:
    """(path of segments from the root, part name relative to its block) for one tensor name."""
    m = re.match(r"^(layers|mtp)\.(\d+)\.(.+)$", name)
    if m:
        block = f"{m[1]}.{m[2]}"
        top = [("layers", "stack", "layers"), (block, "block", block)] if m[1] == "layers" else \
              [("DSpark", None, "mtp"), (block, "dspark_stage", block)]
        return top + _prefixed(block, _match(_BLOCK_RULES, m[3], name)), m[3]
    m = re.match(r"^vision\.blocks\.(\d+)\.(.+)$", name)
    if m:
        block = f"vision.blocks.{m[1]}"
        return [_VISION, (block, None, block)] + _prefixed(block, _match(_VISION_RULES, m[2], name)), m[2]
    if name.startswith("vision.patch_embed."):
        return [_VISION, ("patch embedding", None, "vision.patch_embed")], name[len("vision."):]
    if name.startswith("vision.norm."):
        return [_VISION, ("final norm", None, "vision.norm")], name[len("vision."):]
    head = name.split(".", 1)[0]
    if head in _TOP_LEVEL:
        return [_TOP_LEVEL[head]], name
    raise CheckpointError(f"{name}: no component of the inventory layout holds this tensor")


def _part_name(relative: str) -> str:
    """Weights and scales share one part; experts fold into one part per projection."""
    stem = relative[: -len(".weight")] if relative.endswith(".weight") else relative
    stem = stem[: -len(".scale")] if relative.endswith(".scale") else stem
    m = _EXPERT.match(stem)
    return f"{m['pre']}.*.{m['proj']}" if m else stem


def _leaf(root: Node, name: str) -> tuple[Node, str]:
    """The node holding tensor `name` (created on first use) and the part name it belongs to."""
    segments, relative = place(name)
    node = root
    for key, kind, prefix in segments:
        if key not in node.children:
            node.children[key] = Node(key, kind, prefix)
        node = node.children[key]
    return node, _part_name(relative)


def _count(node: Node, name: str, spec: TensorSpec) -> None:
    if is_scale(spec):
        node.parts[name].scales += spec.numel
        return
    part = node.parts.setdefault(name, Part(name, spec.dtype, spec.shape))
    if (part.dtype, part.shape) != (spec.dtype, spec.shape):
        raise CheckpointError(f"{spec.name}: {spec.describe()} differs from the other tensors of {name}")
    part.count += 1
    part.parameters += counted_parameters(spec)
    part.stored += spec.numel


def _ordered(children: dict[str, Node], order: tuple[str, ...]) -> dict[str, Node]:
    first = [k for k in order if k in children]
    return {k: children[k] for k in first + [k for k in children if k not in first]}


def _finish(node: Node, depth: int = 0) -> Node:
    for c in node.children.values():
        _finish(c, depth + 1)
    if node.kind in ("block", "dspark_stage"):
        node.children = _ordered(node.children, _BLOCK_ORDER)
    elif depth == 0:
        node.children = _ordered(node.children, _TOP_ORDER)
    members = list(node.parts.values()) + list(node.children.values())
    node.parameters = sum(m.parameters for m in members)
    node.stored = sum(m.stored for m in members)
    node.scales = sum(m.scales for m in members)
    return node


def build_tree(inventory: Mapping[str, TensorSpec]) -> Node:
    root = Node("model", "model", None)
    # The routed experts are 96% of the released inventory's names; place each projection family once.
    placed: dict[str, tuple[Node, str]] = {}
    for spec in inventory.values():
        family = _EXPERT_INDEX.sub(".experts.*.", spec.name)
        if family not in placed:
            placed[family] = _leaf(root, spec.name)
        _count(*placed[family], spec)
    return _finish(root)
