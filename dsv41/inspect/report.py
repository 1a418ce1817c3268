"""The inspection report of one config, rendered as text or as a JSON-ready dict (HTML: html.py).

A Report joins the accounting (numbers and the component tree), the component descriptions and where
each component lives in dsv41. Its tables use the seed documents' columns (docs/PARAMETERS.md §7),
"Component | Calculation | Parameters"; identical instances of a component (forty attention blocks, say)
share one table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..model.roles import derive_roles
from .roles import roles_table
from ..config import ModelConfig
from .accounting import Accounting, fmt, layers_text, ranges
from .components import ComponentKind
from .locations import CodeLocation
from .tree import Node

CONVENTION = ("Derived from the checkpoint layout of this configuration: fp4 routed experts at their logical size "
              "(two values per stored byte), every other tensor at its element count, quantisation scales not "
              "counted (docs/PARAMETERS.md §1). The per-instance total of the block stack leaves out the "
              "embedding, the head and the final norm, the vision encoder and aligner and the DSpark stages; "
              "each is reported under its own label.")
HEADLINE_KEYS = ("blocks", "engram_gate")


@dataclass(frozen=True)
class Row:
    component: str
    calculation: str
    parameters: int
    storage: str = ""


@dataclass(frozen=True)
class Table:
    """One parameter table: the rows of an instance, and every instance that has exactly these rows."""

    instances: tuple[str, ...]
    rows: tuple[Row, ...]
    total: int


def _row_calculation(node: Node) -> str:
    if node.children:
        values = [fmt(c.parameters) for c in node.children.values()] + [fmt(p.parameters) for p in node.parts.values()]
        return " + ".join(values) if len(values) <= 4 else f"across its {len(values)} parts"
    parts = list(node.parts.values())
    return " + ".join(p.calculation for p in parts) if len(parts) <= 3 else f"{len(parts)} tensors"


def node_rows(node: Node) -> tuple[Row, ...]:
    rows = [Row(c.key, _row_calculation(c), c.parameters) for c in node.children.values()]
    rows += [Row(p.name, p.calculation, p.parameters, p.storage) for p in node.parts.values()]
    return tuple(rows)


def _label(path: tuple[Node, ...]) -> str:
    """The nearest checkpoint prefix, then the grouping keys below it: "layers.1.engram › gate"."""
    for i in range(len(path) - 1, -1, -1):
        if path[i].prefix:
            return " › ".join([path[i].prefix] + [n.key for n in path[i + 1:]])
    return " › ".join(n.key for n in path[1:]) or path[0].key


def _paths(node: Node, above: tuple[Node, ...] = ()):
    here = above + (node,)
    yield here
    for c in node.children.values():
        yield from _paths(c, here)


@dataclass
class Report:
    source: str
    cfg: ModelConfig
    accounting: Accounting
    components: dict[str, ComponentKind]
    code: dict[str, tuple[CodeLocation, ...]]
    modules: dict[str, str]
    """Checkpoint prefix → "module:Class" of what the meta-device model builds there."""

    @property
    def tree(self) -> Node:
        return self.accounting.tree

    def instances(self, kind: str) -> list[tuple[str, Node]]:
        return [(_label(p), p[-1]) for p in _paths(self.tree) if p[-1].kind == kind]

    def tables(self, kind: str) -> list[Table]:
        if kind == "stack":
            rows = tuple(Row(f"{g.name} ({g.where})", g.calculation, g.parameters) for g in self.accounting.groups())
            return [Table(("layers",), rows, self.accounting.layers.parameters)]
        grouped: dict[tuple[Row, ...], tuple[list[str], int]] = {}
        for label, node in self.instances(kind):
            labels, _ = grouped.setdefault(node_rows(node), ([], node.parameters))
            labels.append(label)
        return [Table(tuple(labels), rows, total) for rows, (labels, total) in grouped.items()]

    def kind_total(self, kind: str) -> int:
        return sum(node.parameters for _, node in self.instances(kind))

    def presence(self, key: str) -> str:
        """"no", or "yes" and where the component sits in this configuration ("yes — layers 2, 8, 14, 20").

        Where comes from the component's instances in the tree; a part without parameters of its own (the
        candidate stage) names its first role line instead.
        """
        kind = self.components[key]
        if not kind.present:
            return "no"
        found = {"layers": set(), "mtp": set()}
        for label, _ in self.instances(key):
            if m := re.match(r"(layers|mtp)\.(\d+)\b", label):
                found[m.group(1)].add(int(m.group(2)))
        where = [layers_text(found["layers"])] if found["layers"] else []
        where += [f"mtp.{ranges(found['mtp'])}"] if found["mtp"] else []
        if not where and not self.instances(key) and kind.roles:
            where = [kind.roles[0]]
        return "yes — " + "; ".join(where) if where else "yes"

    def headline(self) -> list[tuple[str, int]]:
        figs = self.accounting.figures
        return [(figs[k].label, figs[k].value) for k in HEADLINE_KEYS if k in figs]


# ---------------------------------------------------------------------------------------- text
_NAME_WIDTH, _DETAIL_WIDTH, _NUMBER_WIDTH = 44, 40, 18


def _line(name: str, detail: str, value: int | None) -> str:
    left = name.ljust(_NAME_WIDTH) + " " + detail
    number = fmt(value) if value is not None else ""
    return (left.ljust(_NAME_WIDTH + _DETAIL_WIDTH) + number.rjust(_NUMBER_WIDTH)).rstrip()


def _node_detail(report: Report, node: Node) -> str:
    acc = report.accounting
    if node.kind == "block":
        layer = int(node.key.split(".")[1])
        role = acc.roles[layer].description
        engram = acc.engram(layer)
        return role + (f"; block {fmt(acc.block_parameters(layer))} + Engram" if engram else "")
    if node.key == "layers":
        return f"{acc.cfg.n_layers} blocks incl. Engram (seed total)"
    if node.kind in report.components and node.kind not in ("block", "model"):
        return report.components[node.kind].title
    return ""


def _tree_lines(report: Report) -> list[str]:
    lines: list[str] = []
    shown: dict[tuple, str] = {}

    def visit(path: tuple[Node, ...], indent: str, branch: str) -> None:
        node = path[-1]
        signature, label = node.signature(), _label(path)
        if len(path) > 2 and signature in shown:
            detail = _node_detail(report, node) if node.kind == "block" else ""
            lines.append(_line(indent + branch + node.key, (detail + " — " if detail else "") + f"as {shown[signature]}",
                               node.parameters))
            return
        shown.setdefault(signature, label)
        lines.append(_line(indent + branch + node.key, _node_detail(report, node), node.parameters))
        below = indent + ("" if not branch else ("│  " if branch == "├─ " else "   "))
        items = [("node", c) for c in node.children.values()] + [("part", p) for p in node.parts.values()]
        for i, (what, item) in enumerate(items):
            twig = "└─ " if i == len(items) - 1 else "├─ "
            if what == "node":
                visit(path + (item,), below, twig)
            else:
                lines.append(_line(below + twig + item.name, item.storage, item.parameters))

    visit((report.tree,), "", "")
    return lines


def _table_lines(rows, headers: tuple[str, ...]) -> list[str]:
    cells = [headers] + [tuple(r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    def fmt_row(row):
        return "  ".join(c.rjust(w) if i == len(row) - 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return [fmt_row(cells[0]), "  ".join("-" * w for w in widths)] + [fmt_row(r) for r in cells[1:]]


def _component_lines(report: Report) -> list[str]:
    lines = []
    absent = [k.title for k in report.components.values() if not k.present]
    for kind in report.components.values():
        if not kind.present:
            continue
        total = report.kind_total(kind.key)
        lines.append(f"{kind.title}" + (f" — {fmt(total)} parameters in all" if total else ""))
        for port in kind.ports:
            if port.role != "inside":
                lines.append(f"    {port.role + ':':5s}{port.render()}")
        where = "; ".join(str(loc) for loc in report.code[kind.key][:2])
        lines.append(f"    where: {where}" + ("" if kind.built else " (not built by dsv41.model)"))
    if absent:
        lines.append(f"Not in this configuration: {', '.join(absent)}")
    return lines


def _group_lines(report: Report) -> list[str]:
    acc = report.accounting
    rows = [(g.name, g.where, g.calculation, fmt(g.parameters)) for g in acc.groups()]
    rows.append(("Per-instance total", "", "", fmt(acc.layers.parameters)))
    lines = _table_lines(rows, ("Component", "Layers", "Calculation", "Parameters"))
    if acc.base_block is not None:
        lines.append(f"W = {fmt(acc.base_block)}: one block without compressor, indexer or Engram.")
    return lines


def _figure_lines(report: Report) -> list[str]:
    figs = report.accounting.figures.values()
    return _table_lines([(f.label, f.note, fmt(f.value)) for f in figs], ("Quantity (labelled convention)", "Note",
                                                                          "Parameters"))


def _layer_lines(report: Report) -> list[str]:
    acc = report.accounting
    by_value: dict[int, list[int]] = {}
    for r in acc.layer_rows():
        by_value.setdefault(r.parameters, []).append(r.layer)
    lines = [f"{fmt(v).rjust(_NUMBER_WIDTH)}  {layers_text(ids)}" for v, ids in by_value.items()]
    lines += [f"{fmt(a.parameters).rjust(_NUMBER_WIDTH)}  {a.label}, {layers_text(a.layers)} — {a.calculation}"
              for a in acc.add_on_rows()]
    return lines


def render_text(report: Report) -> str:
    acc, cfg = report.accounting, report.cfg
    out = [f"dsv41 inspect — {report.source}", CONVENTION, ""]
    out += [f"{label}: {fmt(value)}" for label, value in report.headline()]
    out += ["", "Component tree (parameters; a subtree equal to one shown earlier is not repeated)"]
    out += _tree_lines(report)
    out += ["", "Components (shapes and where they live)"] + _component_lines(report)
    out += ["", "Layer roles (docs/ARCHITECTURE.md §3, derived by dsv41/model/roles.py)"]
    out += roles_table(derive_roles(cfg)).splitlines()
    out += ["", f"The {cfg.n_layers} layers, per instance (the seed documents' groups, docs/PARAMETERS.md §5)"]
    out += _group_lines(report)
    gates = acc.engram_gates()
    if gates:
        gate = acc.figures.get("engram_gate")
        value = fmt(gate.value) if gate else ", ".join(f"{fmt(v)} (layer {k})" for k, v in gates.items())
        out += ["", f"Engram gate per stream (q_weight + k_weight, {cfg.hc_mult} × {cfg.dim:,} each), per Engram "
                    f"layer: {value}"]
    out += ["", "Per-layer block totals (Engram excluded) and role add-ons"] + _layer_lines(report)
    out += ["", "Figures under other, explicitly labelled conventions"] + _figure_lines(report)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------- JSON
def _node_dict(report: Report, path: tuple[Node, ...]) -> dict:
    node = path[-1]
    return {
        "name": node.key, "label": _label(path), "kind": node.kind, "prefix": node.prefix,
        "module": report.modules.get(node.prefix) if node.prefix else None,
        "parameters": node.parameters, "stored_elements": node.stored, "scale_elements": node.scales,
        "tensors": [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "count": p.count,
                     "calculation": p.calculation, "parameters": p.parameters, "stored_elements": p.stored,
                     "scale_elements": p.scales} for p in node.parts.values()],
        "children": [_node_dict(report, path + (c,)) for c in node.children.values()],
    }


def _kind_dict(report: Report, kind: ComponentKind) -> dict:
    return {
        "title": kind.title, "present": kind.present, "in_this_configuration": report.presence(kind.key),
        "built_by_model": kind.built,
        "description": kind.description, "spec": kind.spec,
        "formulas": [{"label": f.label, "latex": f.latex} for f in kind.formulas],
        "shapes": [{"role": p.role, "name": p.name, "dims": list(p.dims), "text": p.render()} for p in kind.ports],
        "roles": list(kind.roles),
        "code": [{"ref": loc.ref, "path": loc.path, "first_line": loc.first_line, "last_line": loc.last_line}
                 for loc in report.code[kind.key]],
        "parameters": report.kind_total(kind.key),
        "tables": [{"instances": list(t.instances), "total": t.total,
                    "rows": [{"component": r.component, "calculation": r.calculation, "parameters": r.parameters}
                             for r in t.rows]} for t in report.tables(kind.key)],
    }


def to_dict(report: Report) -> dict:
    acc = report.accounting
    return {
        "source": report.source,
        "convention": CONVENTION,
        "figures": {f.key: {"label": f.label, "value": f.value, "note": f.note} for f in acc.figures.values()},
        "groups": [{"name": g.name, "layers": list(g.layers), "engram_layer": g.engram_layer,
                    "calculation": g.calculation, "parameters": g.parameters} for g in acc.groups()],
        "per_instance_total": acc.layers.parameters,
        "engram_gate": {str(k): v for k, v in acc.engram_gates().items()},
        "layers": [{"layer": r.layer, "role": r.role, "parameters": r.parameters, "engram": r.engram}
                   for r in acc.layer_rows()],
        "add_ons": [{"label": a.label, "layers": list(a.layers), "calculation": a.calculation,
                     "parameters": a.parameters} for a in acc.add_on_rows()],
        "tree": _node_dict(report, (report.tree,)),
        "components": {k: _kind_dict(report, kind) for k, kind in report.components.items()},
    }
