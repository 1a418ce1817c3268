"""Browsable pages for a Report: index.html plus one page per component kind.

Plain HTML with an inline style sheet; formulas are MathML (rendered natively by browsers) with the
LaTeX source beside them, so the pages need no script and no network access when viewed. The documents
the pages cite (docs/*.md, see docs.py) are rendered beside them, and each citation links to its section.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from . import docs
from .accounting import fmt, ranges
from .components import ComponentKind
from .mathml import to_mathml
from .report import CONVENTION, Report, Table
from .tree import Node

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 76rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.45; }
table { border-collapse: collapse; margin: .8rem 0 1.2rem; }
th, td { border-bottom: 1px solid #ddd; padding: .25rem .7rem; text-align: left; vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.total td { font-weight: 600; border-top: 2px solid #999; }
code, pre { background: #f5f5f5; }
pre { padding: .5rem; overflow-x: auto; }
.note { color: #555; font-size: .92em; }
.formula { margin: .8rem 0 1.2rem; }
nav a { margin: 0 .3rem; }
details > ul { margin-top: .2rem; }
ul.tree { list-style: none; padding-left: 1.2rem; }
:target { background: #fff6d5; }
"""


def _e(text) -> str:
    return escape(str(text))


# The page one level up in the breadcrumb ("40 layers › Engram › Gate per stream", as the seed pages read,
# docs/PARAMETERS.md §7).
_PARENT = {"engram_gate": "engram", "router": "moe", "expert": "moe", "candidate": "indexer",
           "sparse_attention": "attention", "compressor": "attention", "indexer": "attention", "block": "stack",
           "attention": "block", "moe": "block", "hyper_connections": "block", "norm": "block", "engram": "stack",
           "stack": "model", "embedding": "model", "head": "model", "dspark_stage": "model", "vision": "model",
           "aligner": "model"}


def _crumbs(report: Report, key: str) -> str:
    chain = []
    while key in _PARENT:
        key = _PARENT[key]
        chain.insert(0, f'<a href="{key}.html">{_e(report.components[key].title)}</a>')
    return " › ".join(['<a href="index.html">index</a>'] + chain)


def _page(title: str, body: str, crumbs: str = '<a href="index.html">index</a>') -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f'<style>{_STYLE}</style></head><body>\n<nav>{crumbs}</nav>\n'
            f"<h1>{_e(title)}</h1>\n{body}\n</body></html>\n")


def _table(headers: tuple[str, ...], rows, total: tuple | None = None, numeric: bool = True) -> str:
    """With `numeric`, the last column holds numbers (right-aligned)."""
    def cells(row, tag="td"):
        last = len(row) - 1 if numeric else -1
        return "".join(f'<{tag}{" class=num" if i == last else ""}>{_e(c)}</{tag}>' for i, c in enumerate(row))
    body = "".join(f"<tr>{cells(r)}</tr>" for r in rows)
    foot = f'<tr class="total">{cells(total)}</tr>' if total else ""
    return f"<table><tr>{cells(headers, 'th')}</tr>{body}{foot}</table>"


def _instances(t: Table) -> str:
    if len(t.instances) <= 4:
        return ", ".join(t.instances)
    return f"{', '.join(t.instances[:3])}, … {t.instances[-1]} ({len(t.instances)} instances)"


def _parameter_section(report: Report, kind: ComponentKind) -> str:
    tables = report.tables(kind.key)
    if not tables:
        return "<h2>Parameters</h2><p>No parameters of its own.</p>"
    total = report.kind_total(kind.key)
    count = sum(len(t.instances) for t in tables)
    if len(tables) == 1:
        lead = f"<strong>{fmt(tables[0].total)}</strong> parameters owned by this component"
        lead += f" per instance; {count} instances, {fmt(total)} in all." if count > 1 else "."
    else:
        lead = f"<strong>{fmt(total)}</strong> parameters across {count} instances of {len(tables)} layouts."
    out = [f"<h2>Parameters</h2><p>{lead}</p>"]
    for t in tables:
        out.append(f"<h3>Exact per-instance accounting — {_e(_instances(t))}</h3>")
        rows = [(r.component, r.calculation, fmt(r.parameters)) for r in t.rows]
        out.append(_table(("Component", "Calculation", "Parameters"), rows, ("Per-instance total", "", fmt(t.total))))
        if len(t.instances) > 4:
            out.append(f"<details><summary>all {len(t.instances)} instances</summary><p>"
                       f"{_e(', '.join(t.instances))}</p></details>")
    out.append(f'<p class="note">{docs.link_citations(CONVENTION, docs.available())}</p>')
    return "\n".join(out)


def _where_section(report: Report, kind: ComponentKind) -> str:
    items = [f"<li><code>{_e(loc.path)}</code> lines {loc.first_line}–{loc.last_line} · <code>{_e(loc.name)}</code></li>"
             for loc in report.code[kind.key]]
    built = sorted({report.modules[n.prefix] for _, n in report.instances(kind.key) if n.prefix in report.modules})
    if built:
        items.append(f"<li>built by <code>dsv41.model</code> as {', '.join(f'<code>{_e(b)}</code>' for b in built)}</li>")
    if not kind.built:
        items.append("<li>not built by <code>dsv41.model</code>: its tensors and figures come from the checkpoint "
                     "layout (<code>dsv41/checkpoint/inventory.py</code>)</li>")
    spec = docs.link_citations(kind.spec, docs.available())
    return f"<h2>Where it lives in dsv41</h2><ul>{''.join(items)}</ul><p class=note>Specification: {spec}</p>"


def _kind_page(report: Report, kind: ComponentKind) -> str:
    parts = [f"<p>{_e(kind.description)}</p>"]
    if not kind.present:
        parts.append("<p><strong>Not present in this configuration.</strong></p>")
    parts.append("<h2>Formulas</h2>")
    for f in kind.formulas:
        parts.append(f'<div class="formula"><h3>{_e(f.label)}</h3>{to_mathml(f.latex)}'
                     f"<pre><code>{_e(f.latex)}</code></pre></div>")
    rows = [(p.role, p.name, "[" + ", ".join(p.dims) + "]") for p in kind.ports]
    parts.append("<h2>Shapes</h2>" + _table(("", "Tensor", "Shape"), rows, numeric=False))
    parts.append("<h2>Layer roles</h2><ul>" + "".join(f"<li>{_e(r)}</li>" for r in kind.roles) + "</ul>")
    parts.append(_parameter_section(report, kind))
    parts.append(_where_section(report, kind))
    return _page(kind.title, "\n".join(parts), _crumbs(report, kind.key))


# ---------------------------------------------------------------------------------------- index
def _tree_html(report: Report, path: tuple[Node, ...], depth: int = 0) -> str:
    node = path[-1]
    kind = report.components.get(node.kind) if node.kind else None
    name = f'<a href="{node.kind}.html">{_e(node.key)}</a>' if kind else _e(node.key)
    summary = f"{name} — {fmt(node.parameters)}" + (f' <span class="note">{_e(kind.title)}</span>' if kind else "")
    items = [_tree_html(report, path + (c,), depth + 1) for c in node.children.values()]
    items += [f"<li><code>{_e(p.name)}</code> {_e(p.storage)} — {_e(p.calculation)} = {fmt(p.parameters)}</li>"
              for p in node.parts.values()]
    opened = " open" if depth < 2 else ""
    return f'<li><details{opened}><summary>{summary}</summary><ul class="tree">{"".join(items)}</ul></details></li>'


def _index_page(report: Report) -> str:
    acc = report.accounting
    out = [f"<p>Configuration: <code>{_e(report.source)}</code></p>"
           f"<p>{docs.link_citations(CONVENTION, docs.available())}</p>"]
    out.append("<ul>" + "".join(f"<li>{_e(label)}: <strong>{fmt(v)}</strong></li>" for label, v in report.headline())
               + "</ul>")
    groups = [(g.name, g.where, g.calculation, fmt(g.parameters)) for g in acc.groups()]
    out.append(f'<h2><a href="stack.html">{report.cfg.n_layers} layers</a>: exact per-instance accounting</h2>')
    out.append(_table(("Component", "Layers", "Calculation", "Parameters"), groups,
                      ("Per-instance total", "", "", fmt(acc.layers.parameters))))
    if acc.base_block is not None:
        out.append(f"<p>W = {fmt(acc.base_block)}: one block without compressor, indexer or Engram.</p>")
    kinds = [(k.title, report.presence(k.key), fmt(report.kind_total(k.key))) for k in report.components.values()]
    links = "".join(f'<a href="{k.key}.html">{_e(k.title)}</a> ' for k in report.components.values() if k.present)
    out.append(f"<h2>Components</h2><nav>{links}</nav>"
               + _table(("Component", "In this configuration", "Parameters in all"), kinds))
    figures = [(f.label, f.note, fmt(f.value)) for f in acc.figures.values()]
    out.append("<h2>Figures under other, explicitly labelled conventions</h2>"
               + _table(("Quantity", "Note", "Parameters"), figures))
    layers = [(str(r.layer), r.role, fmt(r.engram) if r.engram else "", fmt(r.parameters)) for r in acc.layer_rows()]
    out.append("<h2>Per-layer block totals (Engram excluded)</h2>"
               + _table(("Layer", "Role", "Engram before it", "Block"), layers))
    add_ons = [(a.label, ranges(a.layers), a.calculation, fmt(a.parameters)) for a in acc.add_on_rows()]
    out.append("<h2>Add-ons by role</h2>" + _table(("Add-on", "Layers", "Calculation", "Parameters"), add_ons))
    out.append(f'<h2>Component tree</h2><ul class="tree">{_tree_html(report, (report.tree,))}</ul>')
    documents = docs.available()
    if documents:
        items = "".join(f'<li><a href="{docs.page_name(n)}">docs/{_e(n)}.md</a></li>' for n in documents)
        out.append(f"<h2>Documents</h2><p>The explanations these pages cite, from the project's docs/ folder."
                   f"</p><ul>{items}</ul>")
    return _page("DeepSeek-V4.1 — parameters and components", "\n".join(out))


def write_html(report: Report, directory: str | Path) -> list[Path]:
    """Write index.html, <kind>.html for every kind present in the config and doc-<name>.html for every
    document of docs/; returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pages = {"index.html": _index_page(report)}
    pages.update({f"{k.key}.html": _kind_page(report, k) for k in report.components.values() if k.present})
    for name, (title, body) in docs.render_pages(docs.available()).items():
        pages[name] = _page(title, body)
    written = []
    for name, text in pages.items():
        (directory / name).write_text(text, encoding="utf-8")
        written.append(directory / name)
    return written
