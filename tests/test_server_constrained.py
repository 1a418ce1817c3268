"""Guaranteed structure and lossless speculation, through the API on the random demo model.

- 100 seeded requests at temperature 1 (json_schema, json_object, tool_choice required and named, in
  chat and thinking mode) all come back complete: the JSON parses and validates against its schema
  (`jsonschema`), each tool call names an allowed tool and its arguments validate against that tool's
  parameters. A random model is the hard case: left alone it never closes a string.
- With DSpark speculation on, greedy answers equal those with it off, tool calls and JSON included
  (constrained rows draft and verify under their constraint, dsv41/engine/engine.py). Mutation: verify
  rows without the constraint's masks, and the answers change.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import jsonschema
import openai
import pytest

import dsv41.engine.engine as engine_module

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": ["string", "null"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}},
    "total": {"type": "number"}, "gift": {"type": "boolean"}},
    "required": ["id", "status", "items"]}
POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                          "label": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         "required": ["x", "y", "label"]}
SCHEMAS = [PERSON, ORDER, POINT]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
        "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 4}, "flag": {"type": "boolean"}},
        "required": ["labels", "flag"]}}},
]
OFF = {"thinking": {"type": "disabled"}}


def request_case(i: int) -> tuple[dict, str, object]:
    """The i-th request (kind cycling, details drawn from seed i) → (kwargs, kind, what to validate)."""
    rng = random.Random(i)
    kind = ["json_schema", "json_object", "required", "named", "json_schema"][i % 5]
    thinking = i % 2 == 1
    kwargs = dict(model="demo", seed=i, temperature=1.0, max_tokens=rng.choice([60, 90, 140]),
                  messages=[{"role": "user", "content": f"Request {i}: answer in json."}])
    if not thinking:
        kwargs["extra_body"] = OFF
    if kind == "json_schema":
        schema = rng.choice(SCHEMAS)
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        return kwargs, kind, schema
    if kind == "json_object":
        kwargs["response_format"] = {"type": "json_object"}
        return kwargs, kind, {"type": "object"}
    tools = rng.sample(TOOLS, 2)
    kwargs.update(tools=tools, max_tokens=kwargs["max_tokens"] + 90 + (90 if thinking else 0))
    kwargs["tool_choice"] = "required" if kind == "required" else \
        {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    return kwargs, kind, tools if kind == "required" else tools[:1]


def check_answer(response, kind: str, expected) -> None:
    choice = response.choices[0]
    if kind in ("json_schema", "json_object"):
        jsonschema.validate(json.loads(choice.message.content), expected)
        assert choice.finish_reason == "stop"
        return
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in expected}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_hundred_seeded_constrained_requests_all_parse_and_validate(start_server):
    server = start_server(max_batch=16, max_queue=128)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    cases = [request_case(i) for i in range(100)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda case: client.chat.completions.create(**case[0]), cases))
    failures = []
    for i, ((_, kind, expected), response) in enumerate(zip(cases, responses)):
        try:
            check_answer(response, kind, expected)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"request {i} ({kind}): {type(e).__name__}: {str(e)[:200]}")
    assert not failures, "\n".join(failures)
    assert {kind for _, kind, _ in cases} == {"json_schema", "json_object", "required", "named"}


SPECULATION_CASES = {
    "chat": dict(messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=40, extra_body=OFF),
    "thinking": dict(messages=[{"role": "user", "content": "Why is the sky blue?"}], max_tokens=40),
    "logit bias": dict(messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=24, extra_body=OFF,
                       logit_bias={str(t): 6 for t in range(300, 340)}),
    "tool call": dict(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS[:2], tool_choice="required",
                      max_tokens=200, extra_body=OFF),
    "tool call after reasoning": dict(messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS[1:],
                                      tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=260),
    "json": dict(messages=[{"role": "user", "content": "Order as json"}], max_tokens=140, extra_body=OFF,
                 response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}),
}


def greedy_answers(url: str) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    answers = {}
    for name, kwargs in SPECULATION_CASES.items():
        m = client.chat.completions.create(model="demo", temperature=0, **kwargs).choices[0].message
        answers[name] = (getattr(m, "reasoning_content", None), m.content,
                         [(c.function.name, c.function.arguments) for c in m.tool_calls or []])
    return answers


def accepted_drafts(server) -> float:
    return server.state.metrics.accepted_tokens._value.get()


@pytest.fixture(scope="module")
def plain(live):
    return greedy_answers(live.url)


def test_speculation_never_changes_a_greedy_answer_tool_calls_and_json_included(plain, live_speculative):
    before = accepted_drafts(live_speculative)
    speculative = greedy_answers(live_speculative.url)
    assert speculative == plain
    assert plain["tool call"][2] and plain["tool call after reasoning"][2] and json.loads(plain["json"][1])
    assert not plain["chat"][1].startswith(plain["logit bias"][1])          # the bias did move the answer
    assert accepted_drafts(live_speculative) > before            # the drafts did get accepted


def test_verifying_without_the_constraint_changes_the_answers(plain, live_speculative, monkeypatch):
    """The mutation check: verify rows unmasked (only the draft masked) and a speculative constrained
    answer departs from the plain one."""
    monkeypatch.setattr(engine_module, "constrained_along", lambda logits, constraint, drafts: logits)
    broken = greedy_answers(live_speculative.url)
    assert any(broken[k] != plain[k] for k in ("tool call", "tool call after reasoning", "json"))
