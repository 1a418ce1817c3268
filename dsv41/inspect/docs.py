"""The project's documents (docs/*.md) as pages beside the inspect pages, and links to their sections.

The component pages cite "docs/ARCHITECTURE.md §11.6" and the like. `write_html` renders every document
found in the checkout's docs/ folder to `doc-<name>.html` with one anchor per numbered section ("s11.6"),
per numbered list item ("s9-3"), and per trap or pitfall ("trap-14", "pitfall-2": the items of a section
titled so), so a citation becomes a link that works offline. Where docs/ is not there (an installed wheel
carries only the package), citations stay plain text.

The renderer covers what the documents use: headings, rules, paragraphs, one-level nested lists,
pipe tables, fenced code, `code`, **bold** and links between the documents.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"

# "docs/ARCHITECTURE.md", optionally "§11.3–§11.5" and "trap 14" / "pitfall 2" / "steps 3–6" after it.
_CITATION = re.compile(r"docs/([A-Z][A-Z-]*)\.md(?: §(\d+(?:\.\d+)?)(?:[–-]§?\d+(?:\.\d+)?)?"
                       r"(?:,? (trap|pitfall|item|step)s? (\d+)(?:[–-]\d+)?)?)?")
_HEADING = re.compile(r"(#{1,4}) (?:(\d+(?:\.\d+)*)\.? )?(.*)")
_ITEM = re.compile(r"( *)(?:- |(\d+)\. )(.*)")
_LINK = re.compile(r"\[([^\]]+)\]\(([A-Z][A-Z-]*)\.md\)")


def available() -> dict[str, Path]:
    """Document name ("ARCHITECTURE") → its file, for every docs/*.md of the checkout (none without one)."""
    if not (DOCS_DIR / "ARCHITECTURE.md").is_file():  # not a dsv41 checkout: some other "docs" folder, or none
        return {}
    return {p.stem: p for p in sorted(DOCS_DIR.glob("*.md"))}


def page_name(doc: str) -> str:
    return f"doc-{doc.lower()}.html"


def item_id(word: str | None, section: str, number: str) -> str:
    """The anchor of a numbered item: "trap-14" and "pitfall-2" stand alone, others live in their section."""
    return f"{word}-{number}" if word in ("trap", "pitfall") else f"s{section}-{number}"


def link_citations(text: str, docs) -> str:
    """`text` as HTML, each citation of a present document a link to its page and section."""
    out, last = [], 0
    for m in _CITATION.finditer(text):
        doc, section, word, item = m.groups()
        if doc not in docs:
            continue
        anchor = f"#{item_id(word, section, item)}" if item else f"#s{section}" if section else ""
        out += [escape(text[last:m.start()]), f'<a href="{page_name(doc)}{anchor}">{escape(m.group(0))}</a>']
        last = m.end()
    return "".join(out) + escape(text[last:])


# ---------------------------------------------------------------------------------------- rendering
def _inline(text: str, docs) -> str:
    """Escaped text with `code`, **bold** (which may contain code) and links between the documents."""
    codes: list[str] = []

    def hold(m: re.Match) -> str:
        codes.append(f"<code>{escape(m.group(1))}</code>")
        return f"\0{len(codes) - 1}\0"

    html = escape(re.sub(r"`([^`]*)`", hold, text), quote=False)
    html = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html)
    html = _LINK.sub(lambda m: f'<a href="{page_name(m.group(2))}">{m.group(1)}</a>' if m.group(2) in docs
                     else m.group(1), html)
    return re.sub(r"\0(\d+)\0", lambda m: codes[int(m.group(1))], html)


def _cells(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def _table(lines: list[str], docs) -> str:
    head, body = _cells(lines[0]), [_cells(x) for x in lines[2:]]
    rows = "".join("<tr>" + "".join(f"<td>{_inline(c, docs)}</td>" for c in r) + "</tr>" for r in body)
    return "<table><tr>" + "".join(f"<th>{_inline(c, docs)}</th>" for c in head) + f"</tr>{rows}</table>"


def _text(lines: list[str], docs) -> str:
    """Joined lines; a line starting "Why:" (the reason under a trap) starts a new line."""
    return "".join(("<br>" if line.startswith("Why:") and i else " " if i else "") + _inline(line, docs)
                   for i, line in enumerate(lines))


def _list(lines: list[str], section: str, word: str | None, docs) -> str:
    """Top-level items (with their continuation lines and one level of sub-items)."""
    items: list[tuple[str | None, list[str], list[list[str]]]] = []
    for line in lines:
        m = _ITEM.fullmatch(line)
        if m and not m.group(1):
            items.append((m.group(2), [m.group(3)], []))
        elif m:
            items[-1][2].append([m.group(3)])
        elif items[-1][2]:
            items[-1][2][-1].append(line.strip())
        else:
            items[-1][1].append(line.strip())
    ordered = items[0][0] is not None
    html = []
    for number, text, subs in items:
        anchor = f' id="{item_id(word, section, number)}"' if ordered and section else ""
        sub = "".join(f"<li>{_text(s, docs)}</li>" for s in subs)
        html.append(f"<li{anchor}>{_text(text, docs)}" + (f"<ul>{sub}</ul>" if sub else "") + "</li>")
    tag = "ol" if ordered else "ul"
    start = f' start="{items[0][0]}"' if ordered and items[0][0] != "1" else ""
    return f"<{tag}{start}>{''.join(html)}</{tag}>"


def _is_item(line: str) -> bool:
    m = _ITEM.fullmatch(line)
    return bool(m) and not m.group(1)


def _blocks(text: str):
    """Blank-line separated groups of lines; a fenced code block is one group whatever it contains."""
    block: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            block.append(line)
            if not fenced:
                yield block
                block = []
        elif fenced or line.strip():
            block.append(line)
        elif block:
            yield block
            block = []
    if block:
        yield block


def render(text: str, docs) -> str:
    """A document's Markdown as an HTML body; numbered headings get ids "s<number>"."""
    html, section, word = [], "", None
    for block in _blocks(text):
        if block[0].startswith("```"):
            html.append("<pre><code>" + escape("\n".join(block[1:-1])) + "</code></pre>")
            continue
        i = 0
        while i < len(block):
            line, j = block[i], i + 1
            if set(line.strip()) == {"-"}:
                html.append("<hr>")
            elif m := _HEADING.fullmatch(line):
                level, number, title = m.groups()
                if number:
                    section = number
                    word = next((w for w in ("trap", "pitfall") if w in title.lower()), None)
                anchor = f' id="s{number}"' if number else ""
                label = f"{number}. " if number and "." not in number else f"{number} " if number else ""
                html.append(f"<h{len(level)}{anchor}>{_inline(label + title, docs)}</h{len(level)}>")
            elif line.startswith("|"):
                while j < len(block) and block[j].startswith("|"):
                    j += 1
                html.append(_table(block[i:j], docs))
            elif _is_item(line):
                while j < len(block) and (_is_item(block[j]) or block[j].startswith(" ")):
                    j += 1
                html.append(_list(block[i:j], section, word, docs))
            else:
                while j < len(block) and not (_is_item(block[j]) or block[j].startswith(("|", "#"))):
                    j += 1
                html.append(f"<p>{_text([x.strip() for x in block[i:j]], docs)}</p>")
            i = j
    return "\n".join(html)


def render_pages(docs: dict[str, Path]) -> dict[str, tuple[str, str]]:
    """Page file name → (title, HTML body) for every document."""
    pages = {}
    for name, path in docs.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        title = lines[0].lstrip("#").strip() if lines and lines[0].startswith("# ") else name
        body = "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines)
        pages[page_name(name)] = (f"docs/{name}.md — {title}", render(body, docs))
    return pages
