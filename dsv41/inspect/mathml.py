"""A small LaTeX-subset → MathML translator for the formulas of the component pages.

Browsers render MathML natively, so the HTML pages need no script and no network. The subset is what
components.py uses: letters, numbers, operators, ^ and _ (with primes), braces, \\frac, \\sqrt,
\\operatorname / \\mathrm / \\text, Greek letters, big operators with limits (\\sum, \\max, …), fences
(\\left, \\big, \\lvert, \\lfloor, …) and spacing. Anything else raises MathMLError, so an unsupported
formula fails in the tests instead of rendering wrongly.
"""

from __future__ import annotations

import re
from html import escape


class MathMLError(ValueError):
    pass


_GREEK = {name: chr(code) for name, code in (
    ("alpha", 0x3B1), ("beta", 0x3B2), ("gamma", 0x3B3), ("delta", 0x3B4), ("epsilon", 0x3F5),
    ("varepsilon", 0x3B5), ("eta", 0x3B7), ("theta", 0x3B8), ("lambda", 0x3BB), ("mu", 0x3BC),
    ("pi", 0x3C0), ("rho", 0x3C1), ("sigma", 0x3C3), ("tau", 0x3C4), ("phi", 0x3D5), ("omega", 0x3C9),
    ("Sigma", 0x3A3), ("Phi", 0x3A6), ("Omega", 0x3A9),
)}
_OPERATORS = {
    "cdot": "·", "odot": "⊙", "times": "×", "le": "≤", "ge": "≥", "leq": "≤", "geq": "≥", "in": "∈",
    "to": "→", "leftarrow": "←", "mapsto": "↦", "neq": "≠", "approx": "≈", "pm": "±", "mid": "∣",
    "lvert": "|", "rvert": "|", "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈", "rceil": "⌉",
    "langle": "⟨", "rangle": "⟩", "{": "{", "}": "}", "ldots": "…", "dots": "…", "cdots": "⋯",
}
_IDENTIFIERS = {"infty": "∞", "top": "⊤", "ell": "ℓ", "_": "_"}
_LIMIT_OPERATORS = {"sum": "∑", "prod": "∏"}
_NAMED_FUNCTIONS = ("max", "min", "exp", "log", "ln", "sin", "cos", "argmax")
_SPACES = {",": "0.1667em", ";": "0.2778em", ":": "0.2222em", " ": "0.3333em", "quad": "1em", "qquad": "2em",
           "!": "0em"}
_SIZES = ("left", "right", "big", "Big", "bigg", "Bigg", "bigl", "bigr", "Bigl", "Bigr")
_TEXT_COMMANDS = ("operatorname", "mathrm", "text")

_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|[0-9]+(?:\.[0-9]+)?|[A-Za-z]|\s+|.")


def _keep_edge_spaces(text: str) -> str:
    """Leading and trailing spaces of a text as no-break spaces (U+00A0).

    MathML renderers strip whitespace at the edges of a token element, so `\\text{ or }` between two
    numbers would render as "160000or10000"; no-break spaces are characters, not whitespace, and stay.
    """
    core = text.strip()
    if not core:
        return "\u00a0" * len(text)
    start = text.index(core)
    return "\u00a0" * start + core + "\u00a0" * (len(text) - start - len(core))


class _Parser:
    def __init__(self, latex: str):
        self.latex = latex
        self.tokens = _TOKEN.findall(latex)  # whitespace kept for \\text, skipped everywhere else
        self.i = 0

    def error(self, why: str) -> MathMLError:
        return MathMLError(f"{why} in {self.latex!r}")

    def peek(self) -> str | None:
        while self.i < len(self.tokens) and self.tokens[self.i].isspace():
            self.i += 1
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise self.error("unexpected end of formula")
        self.i += 1
        return tok

    def expect(self, tok: str) -> None:
        if self.take() != tok:
            raise self.error(f"expected {tok!r}")

    # -------------------------------------------------------------------------- grammar
    def row(self, stop: str | None = None) -> str:
        items = []
        while self.peek() is not None and self.peek() != stop:
            if self.peek() == "}":
                raise self.error("unbalanced '}'")
            items.append(self.scripted())
        return "".join(items)

    def group(self) -> str:
        """A braced group or a single atom, as used for arguments and scripts."""
        if self.peek() == "{":
            self.take()
            inner = self.row("}")
            self.expect("}")
            return f"<mrow>{inner}</mrow>"
        return self.atom()

    def raw_text(self) -> str:
        self.expect("{")
        start, depth = self.i, 1
        while depth:
            if self.i >= len(self.tokens):
                raise self.error("unterminated text argument")
            depth += {"{": 1, "}": -1}.get(self.tokens[self.i], 0)
            self.i += 1
        words = "".join(self.tokens[start:self.i - 1]).replace("\\_", "_").replace("\\,", " ")
        return escape(_keep_edge_spaces(words))

    def scripted(self) -> str:
        limits = self.peek() in ("\\" + k for k in _LIMIT_OPERATORS) or self.peek() in (
            "\\" + k for k in _NAMED_FUNCTIONS)
        base = self.atom()
        sub = sup = None
        while self.peek() in ("_", "^", "'"):
            tok = self.take()
            if tok == "'":
                sup = (sup or "") + "<mo>′</mo>"
            elif tok == "_":
                sub = self.group()
            else:
                sup = (sup or "") + self.group()
        if sub is None and sup is None:
            return base
        under, over = ("munder", "mover") if limits else ("msub", "msup")
        if sub is not None and sup is not None:
            tag = "munderover" if limits else "msubsup"
            return f"<{tag}>{base}{sub}<mrow>{sup}</mrow></{tag}>"
        if sub is not None:
            return f"<{under}>{base}{sub}</{under}>"
        return f"<{over}>{base}<mrow>{sup}</mrow></{over}>"

    def atom(self) -> str:
        tok = self.take()
        if tok == "{":
            self.i -= 1
            return self.group()
        if tok.startswith("\\"):
            return self.command(tok[1:])
        if tok[0].isdigit():
            return f"<mn>{tok}</mn>"
        if tok.isalpha():
            return f"<mi>{tok}</mi>"
        if tok in "^_":
            raise self.error(f"script {tok!r} without a base")
        return f"<mo>{escape(tok)}</mo>"

    def command(self, name: str) -> str:
        if name == "frac":
            return f"<mfrac>{self.group()}{self.group()}</mfrac>"
        if name == "sqrt":
            return f"<msqrt>{self.group()}</msqrt>"
        if name in _TEXT_COMMANDS:
            tag = "mtext" if name == "text" else "mi"
            variant = "" if name == "text" else ' mathvariant="normal"'
            return f"<{tag}{variant}>{self.raw_text()}</{tag}>"
        if name in _SIZES:
            return self.atom() if name in ("left", "right") else ""
        if name in _GREEK:
            return f"<mi>{_GREEK[name]}</mi>"
        if name in _OPERATORS:
            return f"<mo>{escape(_OPERATORS[name])}</mo>"
        if name in _IDENTIFIERS:
            return f"<mi>{_IDENTIFIERS[name]}</mi>"
        if name in _LIMIT_OPERATORS:
            return f'<mo largeop="true" movablelimits="true">{_LIMIT_OPERATORS[name]}</mo>'
        if name in _NAMED_FUNCTIONS:
            return f'<mi mathvariant="normal">{name}</mi>'
        if name in _SPACES:
            return f'<mspace width="{_SPACES[name]}"/>'
        raise self.error(f"unsupported command \\{name}")


def to_mathml(latex: str, *, display: bool = True) -> str:
    """A <math> element rendering `latex`, carrying the source as its TeX annotation."""
    parser = _Parser(latex)
    body = parser.row()
    if parser.peek() is not None:
        raise parser.error("unbalanced '}'")
    mode = "block" if display else "inline"
    return (f'<math xmlns="http://www.w3.org/1998/Math/MathML" display="{mode}"><semantics><mrow>{body}</mrow>'
            f'<annotation encoding="application/x-tex">{escape(latex)}</annotation></semantics></math>')
