"""Constrained decoding: a JSON schema, or a DSML call of the required tools, enforced token by token.

Shapes: V vocab.

The grammars are compiled by `llguidance` (Lark with `%json` sub-grammars for JSON schemas); this
module only writes them and applies the token mask each step (the engine calls `allowed` before
sampling and `advance` after, `dsv41/engine/request.py`):
- `response_format` json_object / json_schema: the content is one JSON value of the schema, written
  compactly (no free whitespace: a random model would otherwise pad forever);
- `tool_choice` required / a named function: a DSML calls block (docs/TOKENIZER-AND-CHAT.md §4.3) of one or
  more invokes of the allowed tools, each with its required parameters, in schema order, string
  parameters as raw text (string="true") and every other one as JSON valid against its schema
  (string="false"). In chat mode the prompt already ends with the block's opener; in thinking mode the
  reasoning comes first, bounded to a budget, then `</think>` and the opener are forced.
Termination: a grammar alone does not stop a model from writing forever inside a string or a number.
Four measures make a constrained answer end well-formed within max_tokens:
1. text the grammar fixes (markup, a forced `</think>`) is written as its canonical tokens, one per
   step (llguidance's fast-forward tokens), not spelled out character by character;
2. bounds where the schema sets none: strings get `maxLength` STRING_CAP, arrays `maxItems` ITEMS_CAP,
   integers the ±2⁵³ range JSON numbers can hold exactly; raw (string="true") tool parameters end
   after RAW_STRING_TOKENS tokens (a raw value may end anywhere and stay valid) and hold no "｜" (the
   DSML marker's character: its text would end the value early, §8.3);
3. the shortest valid answer is measured in tokens (required fields at minimal values, `minimal_instance`);
   a max_tokens below it is refused, and in thinking mode `</think>` is forced after REASONING_SHARE of
   max_tokens, earlier if the answer would have less than twice its shortest length (plus a margin);
4. when the tokens left fall to the shortest answer's length plus CLOSING_MARGIN, or a number has run
   for NUMBER_TOKENS tokens (a JSON number has no length limit), each step prefers, among the allowed
   tokens, the ones that bring the end nearest: EOS; a closing tag under way goes on as one (after
   `<` a `/`, after `</` the `｜DSML｜` token); between values (few tokens allowed) a closing bracket
   (`}`, `]`, `},` …), else a `,`, `</` or `<` (a number ends there); inside free text (a string or a
   raw value: more than FREE_TEXT_SHARE of the vocabulary allowed) the `"`, else `</`, else `<` after
   which the text has ended — tried on a copy of the matcher: what may follow is no longer free text,
   or a closing special token becomes allowed (`</` in a raw value allows `｜DSML｜` next). Where none
   applies (a value must start, a required key must come) the grammar's own choices stand.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import llguidance
import torch

from ..chat.encoding import DSML, THINK_END, render_tool_calls
from ..errors import UserError
from ..tokenizer import Tokenizer

# The closing preference starts when the tokens left fall to the shortest answer's length plus this.
CLOSING_MARGIN = 16
# Thinking mode: the reasoning takes at most this share of max_tokens, and leaves the answer at least
# twice its shortest length plus the margin.
REASONING_SHARE = 0.5
# Raw string parameters are cut to this many tokens (a raw lexeme may end anywhere and stay valid).
RAW_STRING_TOKENS = 32
STRING_CAP, ITEMS_CAP, INTEGER_CAP = 256, 32, 2 ** 53
NUMBER_TOKENS = 8
NUMBER_CHARS = frozenset("0123456789.eE+-")
# Inside free text (a string, a raw value) more than this share of the vocabulary is allowed.
FREE_TEXT_SHARE = 0.25
COMPACT = {"whitespace_flexible": False}


class ConstraintError(UserError):
    """A schema or tool definition llguidance cannot compile, or a max_tokens too small for the answer;
    the message says which, `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class GrammarFactory:
    """The tokenizer as llguidance sees it, and the token groups of the closing preference (built once)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.llg = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_id)
        self.dsml = _special(tokenizer, DSML)
        self.think_end = _special(tokenizer, THINK_END)
        specials = {tokenizer.eos_id, self.dsml, self.think_end}
        self.texts = ["" if t in specials else tokenizer.decode([t]) for t in range(self.vocab_size)]

        def group(keep) -> torch.Tensor:
            return torch.tensor([bool(text) and keep(text.strip(" ")) for text in self.texts], dtype=torch.bool)

        # the token groups of the closing preference (module docstring, measure 4)
        self.quote, self.tag_close = group(lambda t: t == '"'), group(lambda t: t == "</")
        self.angle, self.slash = group(lambda t: t == "<"), group(lambda t: t == "/")
        self.brackets = group(lambda t: set(t) <= set("}],") and bool(set(t) & set("}]")))
        self.comma = group(lambda t: t == ",")
        self.numeric = group(lambda t: set(t) <= NUMBER_CHARS)
        self.closing_specials = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.closing_specials[[self.dsml, self.think_end]] = True
        # the reasoning is free text: no special token but the `</think>` that ends it (§8.5)
        self.reasoning_mask = torch.ones(self.vocab_size, dtype=torch.bool)
        added = tokenizer.backend.get_added_tokens_decoder()
        self.reasoning_mask[[i for i, t in added.items() if t.special and i != self.think_end]] = False

    # ---------------------------------------------------------------------------------- constraints
    def json_constraint(self, schema: dict, *, thinking: bool, max_tokens: int) -> "GrammarConstraint":
        """The content is one JSON value of `schema` (after the reasoning, in thinking mode)."""
        grammar = self._lark(f"%json {json.dumps(_compact(schema))}", opener=False)
        shortest = self._tokens(json.dumps(minimal_instance(schema), separators=(",", ":"), ensure_ascii=False))
        return self._constraint(grammar, max_tokens, thinking, shortest, "response_format")

    def tool_constraint(self, tools: list[dict], *, thinking: bool, max_tokens: int,
                        opener: bool) -> "GrammarConstraint":
        """A calls block of invokes of `tools` (OpenAI function objects: name, parameters); `opener`:
        the answer writes the block's opener (the prompt does not end with it)."""
        rules = [f"invoke_{i}: {self._invoke(tool)}" for i, tool in enumerate(tools)]
        body = " ".join(["(" + " | ".join(f"invoke_{i}" for i in range(len(tools))) + ")+",
                         f'"</" {self._tok(self.dsml)} " calls>"'])
        grammar = self._lark(body, opener=opener, extra=rules)
        shortest = max(self._tokens(render_tool_calls([minimal_call(tool)])) for tool in tools)
        return self._constraint(grammar, max_tokens, thinking, shortest, "tool_choice")

    def _lark(self, body: str, *, opener: bool, extra: list[str] = ()) -> str:
        """The answer's grammar (the reasoning before it is not parsed: `GrammarConstraint.reasoning`)."""
        head = []
        if opener:
            head.append(f'"\\n\\n<" {self._tok(self.dsml)} " calls>\\n"')
        if "raw_string" in body or any("raw_string" in rule for rule in extra):
            extra = [*extra, f"raw_string[max_tokens={RAW_STRING_TOKENS}]: /[^｜]*/"]
        return "\n".join([f"start: {' '.join(head + [body])}", *extra])

    def _invoke(self, tool: dict) -> str:
        name, params = tool["name"], tool.get("parameters") or {}
        properties = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = [f'"<" {self._tok(self.dsml)} {_lit(f" invoke name={json.dumps(name)}>" + chr(10))}']
        for key, schema in properties.items():
            piece = self._parameter(key, schema if isinstance(schema, dict) else {})
            parts.append(piece if key in required else f"({piece})?")
        parts.append(f'"</" {self._tok(self.dsml)} " invoke>\\n"')
        return " ".join(parts)

    def _parameter(self, key: str, schema: dict) -> str:
        if schema.get("type") == "string":
            value = " | ".join(_lit(str(v)) for v in schema["enum"]) if schema.get("enum") else "raw_string"
            string = "true"
        else:
            value, string = f"%json {json.dumps(_compact(schema))}", "false"
        opening = _lit(f" parameter name={json.dumps(key)} string=\"{string}\">")
        return f'"<" {self._tok(self.dsml)} {opening} ({value}) "</" {self._tok(self.dsml)} " parameter>\\n"'

    def _tok(self, token_id: int) -> str:
        return f"<[{token_id}]>"

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _constraint(self, grammar: str, max_tokens: int, thinking: bool, shortest: int,
                    what: str) -> "GrammarConstraint":
        need = shortest + (1 if thinking else 0)
        if max_tokens < need:
            raise ConstraintError(f"max_tokens is {max_tokens}, too few for the {what} answer: its shortest form "
                                  f"takes {need} tokens", "max_tokens")
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        error = llguidance.LLMatcher.validate_grammar(compiled, self.llg)
        if error:
            raise ConstraintError(f"the {what} constraint does not compile: {error}", what)
        room = 2 * shortest + CLOSING_MARGIN
        reasoning = max(0, min(int(max_tokens * REASONING_SHARE), max_tokens - room)) if thinking else 0
        return GrammarConstraint(self, llguidance.LLMatcher(self.llg, compiled, log_level=0), max_tokens,
                                 closing_at=shortest + CLOSING_MARGIN, reasoning_limit=reasoning,
                                 reasoning=thinking)


@dataclass
class GrammarConstraint:
    factory: GrammarFactory
    matcher: llguidance.LLMatcher
    max_tokens: int
    closing_at: int
    """Remaining tokens at which the closing preference starts."""
    reasoning_limit: int
    """Thinking mode: tokens after which `</think>` is forced."""
    reasoning: bool
    """Still inside the reasoning."""
    produced: int = 0
    number_run: int = 0
    tail: str = ""
    """The answer's last two characters."""

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        if self.reasoning:
            if self.produced < self.reasoning_limit:
                return self.factory.reasoning_mask[:vocab_size]
            forced = [self.factory.think_end]
        else:
            forced = self.matcher.compute_ff_tokens()
        if forced:                                   # text the grammar fixes: its canonical tokens
            return _only(torch.zeros(vocab_size, dtype=torch.bool), forced[0])
        mask = _mask(self.matcher, vocab_size)
        if not mask.any():                           # a matcher in error (a bug): end, never sample garbage
            return _only(mask, self.factory.tokenizer.eos_id)
        closing = self.max_tokens - self.produced <= self.closing_at
        if closing or self.number_run >= NUMBER_TOKENS:
            return self._closing(mask) if mask.sum() > 1 else mask
        return mask

    def _closing(self, mask: torch.Tensor) -> torch.Tensor:
        """The allowed tokens that bring the answer's end nearest (module docstring, measure 4)."""
        f, v = self.factory, mask.shape[0]
        if mask[f.tokenizer.eos_id]:
            return _only(mask, f.tokenizer.eos_id)
        if self.tail.endswith("</") and mask[f.dsml]:
            return _only(mask, f.dsml)
        if self.tail.endswith("<") and (mask & f.slash[:v]).any():
            return mask & f.slash[:v]
        if int(mask.sum()) <= FREE_TEXT_SHARE * v:             # between values: close a bracket, or
            for group in (f.brackets, f.comma, f.tag_close, f.angle):      # end this value (a number)
                if (mask & group[:v]).any():
                    return mask & group[:v]
            return mask
        for group in (f.quote, f.tag_close, f.angle):           # in free text: the token that ends it
            picked = torch.zeros_like(mask)
            for token in (mask & group[:v]).nonzero().flatten().tolist():
                picked[token] = self._ends_text(self.matcher, mask, token, f.slash[:v] if group is f.angle else None)
            if picked.any():
                return picked
        return mask

    def _ends_text(self, matcher: llguidance.LLMatcher, mask: torch.Tensor, token: int,
                   follow: torch.Tensor | None) -> bool:
        """Whether free text ends at `token`: what may follow is no longer free text, or a closing special
        token becomes allowed (`</` in a raw value, which could also go on as text); with `follow`,
        whether one of those tokens does so after it (`<` then `/`)."""
        trial = matcher.deep_copy()
        trial.consume_token(token)
        after = _mask(trial, mask.shape[0])
        specials = self.factory.closing_specials[:mask.shape[0]]
        if trial.is_accepting() or int(after.sum()) <= FREE_TEXT_SHARE * mask.shape[0] \
                or bool((after & specials & ~mask).any()):
            return True
        return follow is not None and any(self._ends_text(trial, after, t, None)
                                          for t in (after & follow).nonzero().flatten().tolist())

    def advance(self, token_id: int) -> None:
        self.produced += 1
        if self.reasoning:
            self.reasoning = token_id != self.factory.think_end
            return
        known = token_id < self.factory.vocab_size
        self.tail = (self.tail + (self.factory.texts[token_id] if known else ""))[-2:]
        numeric = known and bool(self.factory.numeric[token_id])
        self.number_run = self.number_run + 1 if numeric else 0
        self.matcher.consume_token(token_id)

    def fork(self) -> "GrammarConstraint":
        return dataclasses.replace(self, matcher=self.matcher.deep_copy())

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()


def _only(mask: torch.Tensor, token: int) -> torch.Tensor:
    one = torch.zeros_like(mask)
    one[token] = True
    return one


def _mask(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """bool [V]: the tokens the matcher allows next."""
    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    mask = ((bits[:, None] >> torch.arange(8)) & 1).flatten().bool()[:vocab_size]
    if mask.shape[0] < vocab_size:
        mask = torch.cat([mask, torch.zeros(vocab_size - mask.shape[0], dtype=torch.bool)])
    return mask


def _special(tokenizer: Tokenizer, text: str) -> int:
    token = tokenizer.backend.token_to_id(text)
    if token is None:
        raise ConstraintError(f"{tokenizer.source} has no token {text!r}, which constrained decoding needs")
    return token


def _compact(schema: dict) -> dict:
    guidance = dict(schema.get("x-guidance") or {}, **COMPACT)
    return {**bounded(schema), "x-guidance": guidance}


def bounded(schema):
    """The schema with the termination bounds of the module docstring added where it sets none."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    kind = schema.get("type")
    if kind == "string" and not {"maxLength", "enum", "const", "pattern", "format"} & set(schema):
        out["maxLength"] = STRING_CAP
    elif kind == "array" and "maxItems" not in schema:
        out["maxItems"] = ITEMS_CAP
    elif kind == "integer":
        out.setdefault("minimum", -INTEGER_CAP)
        out.setdefault("maximum", INTEGER_CAP)
    return out


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)



# ------------------------------------------------------------------------------------ shortest answers
def minimal_instance(schema):
    """A short value valid against `schema` for the common keywords (to size the shortest answer)."""
    if not isinstance(schema, dict):
        return None
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return minimal_instance(schema[key][0])
    if schema.get("allOf"):
        merged = {}
        for part in schema["allOf"]:
            merged.update(part if isinstance(part, dict) else {})
        return minimal_instance(merged)
    kind = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(kind, list):
        kind = kind[0] if kind else None
    if kind == "object":
        properties = schema.get("properties") or {}
        return {k: minimal_instance(properties.get(k, {})) for k in schema.get("required") or []}
    if kind == "array":
        return [minimal_instance(schema.get("items", {})) for _ in range(int(schema.get("minItems", 0)))]
    if kind == "string":
        return "a" * int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        return max(0, int(low) + (1 if "exclusiveMinimum" in schema else 0))
    if kind == "boolean":
        return True
    return None


def minimal_call(tool: dict) -> dict:
    """The shortest call of `tool`: its required parameters at minimal values."""
    params = tool.get("parameters") or {}
    properties = params.get("properties") or {}
    arguments = {k: minimal_instance(properties.get(k, {})) for k in params.get("required") or []}
    return {"type": "function", "function": {"name": tool["name"], "arguments": arguments}}
