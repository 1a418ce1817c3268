"""Constrained decoding without a model: random walks that pick uniformly among the tokens the
constraint allows (the worst sampler: it never wants to stop) end in a complete, valid answer within
max_tokens, for JSON schemas and DSML tool calls, in chat and thinking mode. Mutation: without the
closing preference the same walks run out of tokens mid-value."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dsv41.chat import parse_completion
from dsv41.chat.encoding import CALLS_OPEN, CALLS_SEPARATOR, EOS
from dsv41.server.constrain import ConstraintError, GrammarConstraint, GrammarFactory, minimal_instance
from dsv41.tokenizer import Tokenizer

from test_server_constrained import ORDER, PERSON, POINT, TOOLS

SCHEMAS = {"person": PERSON, "order": ORDER, "point": POINT, "object": {"type": "object"},
           "list": {"type": "array", "items": {"type": "number"}, "minItems": 2},
           "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
               "b": {"type": "array", "items": {"type": "string", "maxLength": 400}}}, "required": ["b"]}},
               "required": ["a"]}}


@pytest.fixture(scope="module")
def factory(demo_dir):
    return GrammarFactory(Tokenizer.from_dir(demo_dir))


def walk(factory, constraint, max_tokens: int, generator) -> tuple[str, bool]:
    """Sample uniformly among the allowed tokens → (text, ended with EOS)."""
    tokens = []
    for _ in range(max_tokens):
        allowed = constraint.allowed(factory.vocab_size).nonzero().flatten()
        token = int(allowed[torch.randint(len(allowed), (1,), generator=generator)])
        constraint.advance(token)
        if token == factory.tokenizer.eos_id:
            return factory.tokenizer.decode(tokens), True
        tokens.append(token)
    return factory.tokenizer.decode(tokens), False


def json_failures(factory, walks: int, budgets=(60, 120, 250)) -> list[str]:
    g, failures = torch.Generator().manual_seed(0), []
    for name, schema in SCHEMAS.items():
        for thinking in (False, True):
            for i in range(walks):
                budget = budgets[i % len(budgets)]
                text, ended = walk(factory, factory.json_constraint(schema, thinking=thinking, max_tokens=budget),
                                   budget, g)
                try:
                    assert ended, "no EOS"
                    jsonschema.validate(json.loads(text.split("</think>", 1)[1] if thinking else text), schema)
                except (AssertionError, ValueError, IndexError, jsonschema.ValidationError) as e:
                    failures.append(f"{name} thinking={thinking} budget={budget}: {e}")
    return failures


def test_random_walks_under_a_json_schema_end_valid_within_the_budget(factory):
    assert json_failures(factory, walks=6) == []


def test_random_walks_under_a_tool_choice_end_in_a_valid_call(factory):
    g, failures = torch.Generator().manual_seed(1), []
    functions = [t["function"] for t in TOOLS]
    schemas = {f["name"]: f["parameters"] for f in functions}
    for thinking in (False, True):
        for i, budget in enumerate((130, 200, 400) * 4):
            tools = functions[i % 3:] or functions
            constraint = factory.tool_constraint(tools, thinking=thinking, max_tokens=budget, opener=thinking)
            text, ended = walk(factory, constraint, budget, g)
            opener = "" if thinking else CALLS_SEPARATOR + CALLS_OPEN + "\n"
            try:
                assert ended, "no EOS"
                calls = parse_completion(opener + text + EOS, "thinking" if thinking else "chat",
                                         strict=True)["tool_calls"]
                assert calls and all(c["function"]["name"] in {t["name"] for t in tools} for c in calls)
                for c in calls:
                    jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                failures.append(f"thinking={thinking} budget={budget}: {e}: {text[-120:]!r}")
    assert failures == []


def test_without_the_closing_preference_walks_run_out_of_tokens(factory, monkeypatch):
    monkeypatch.setattr(GrammarConstraint, "_closing", lambda self, mask: mask)
    assert len(json_failures(factory, walks=2)) >= 6


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_the_shortest_answer_is_valid(name):
    jsonschema.validate(minimal_instance(SCHEMAS[name]), SCHEMAS[name])


def test_a_budget_below_the_shortest_answer_is_refused_naming_max_tokens(factory):
    with pytest.raises(ConstraintError, match="too few") as e:
        factory.tool_constraint([t["function"] for t in TOOLS], thinking=False, max_tokens=20, opener=False)
    assert e.value.param == "max_tokens"
    with pytest.raises(ConstraintError, match="does not compile") as e:
        factory.json_constraint({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]},
                                thinking=False, max_tokens=50)
    assert e.value.param == "response_format"
