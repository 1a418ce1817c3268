"""The prompts the server renders equal DeepSeek's own request library's (`deepseek-recipe`, the
reference for what a request means: docs/TOKENIZER-AND-CHAT.md §4) for a corpus of OpenAI and Anthropic
requests: tools, tool_choice, response_format, thinking on/off, effort, multi-turn with reasoning and
tool results. Requests the reference refuses are listed apart with dsv41's answer."""

from __future__ import annotations

import copy
import json

import pytest

from dsv41.server.prompts import RequestError, anthropic_plan, openai_chat_plan
from dsv41.server.schemas import ChatCompletionRequest, MessagesRequest

recipe = pytest.importorskip("deepseek_recipe")

MODEL = "DeepSeek-V4.1-Flash"                 # the recipe resolves the prompt format from the name
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer", "minimum": 1}}}}}
BARE = {"type": "function", "function": {"name": "now"}}
HI = [{"role": "user", "content": "Hello"}]
OFF = {"type": "disabled"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURN = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "reasoning_content": "I should look it up.", "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}

OPENAI = {
    "plain": dict(messages=HI),
    "chat mode": dict(messages=HI, thinking=OFF),
    "effort low": dict(messages=HI, reasoning_effort="low"),
    "effort medium": dict(messages=HI, reasoning_effort="medium"),
    "effort high": dict(messages=HI, reasoning_effort="high"),
    "effort xhigh": dict(messages=HI, reasoning_effort="xhigh"),
    "effort max": dict(messages=HI, reasoning_effort="max", thinking={"type": "enabled"}),
    "system": dict(messages=[{"role": "system", "content": "Be brief."}] + HI),
    "content parts": dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                                 {"type": "text", "text": "lo"}]}]),
    "tools auto": dict(messages=[{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Paris?"}],
                       tools=[WEATHER, SEARCH], thinking=OFF),
    "tools thinking": dict(messages=HI, tools=[WEATHER, SEARCH, BARE]),
    "tool_choice none": dict(messages=HI, tools=[WEATHER], tool_choice="none", thinking=OFF),
    "tool_choice required": dict(messages=HI, tools=[WEATHER, SEARCH], tool_choice="required", thinking=OFF),
    "tool_choice named": dict(messages=HI, tools=[WEATHER, SEARCH], thinking=OFF,
                              tool_choice={"type": "function", "function": {"name": "search"}}),
    "json_object": dict(messages=[{"role": "user", "content": "Give me json"}], thinking=OFF,
                        response_format={"type": "json_object"}),
    "json_schema": dict(messages=HI, thinking=OFF, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}),
    "json_schema thinking": dict(messages=HI, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}),
    "multi-turn chat": dict(thinking=OFF, messages=[{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": "Hello!"},
                                                    {"role": "user", "content": "2+2?"}]),
    "multi-turn thinking": dict(messages=[{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                                          {"role": "user", "content": "2+2?"}]),
    "tool result chat": dict(messages=TOOL_TURN, tools=[WEATHER], thinking=OFF),
    "tool result thinking": dict(messages=TOOL_TURN, tools=[WEATHER]),
    "two tool results": dict(tools=[WEATHER], messages=[
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "two calls", "tool_calls": [
            CALL, {"id": "call_2", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]),
}

ANTHROPIC_TOOL = {"name": "get_weather", "description": "Current weather",
                  "input_schema": WEATHER["function"]["parameters"]}
ANTHROPIC = {
    "plain": dict(messages=HI),
    "system string": dict(system="Be brief.", messages=HI),
    "system blocks": dict(system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}], messages=HI),
    "thinking off": dict(messages=HI, thinking=OFF),
    "thinking on": dict(messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}),
    "content blocks": dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]),
    "tools": dict(messages=HI, tools=[ANTHROPIC_TOOL], thinking=OFF),
    "tool_choice any": dict(messages=HI, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}, thinking=OFF),
    "tool_choice tool": dict(messages=HI, tools=[ANTHROPIC_TOOL], thinking=OFF,
                             tool_choice={"type": "tool", "name": "get_weather"}),
    "tool_choice none": dict(messages=HI, tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"}),
    "tool round trip": dict(tools=[ANTHROPIC_TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "look it up", "signature": ""},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]}]),
    "multi-turn": dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                 {"role": "user", "content": "2+2?"}], thinking=OFF),
}


def reference_prompt(kind: str, body: dict) -> str:
    cls = recipe.ChatCompletionRequest if kind == "openai" else recipe.MessagesRequest
    converted = cls(copy.deepcopy(body)).convert(recipe.ConversionOptions())
    return recipe.DeepseekV41Encoding().render_conversation(converted.conversation).prompt


@pytest.mark.parametrize("case", list(OPENAI))
def test_openai_requests_render_as_the_reference_renders_them(case):
    body = dict(OPENAI[case], model=MODEL)
    ours = openai_chat_plan(ChatCompletionRequest.model_validate(copy.deepcopy(body))).text
    assert ours == reference_prompt("openai", body)


@pytest.mark.parametrize("case", list(ANTHROPIC))
def test_anthropic_requests_render_as_the_reference_renders_them(case):
    body = dict(ANTHROPIC[case], model=MODEL, max_tokens=64)
    ours = anthropic_plan(MessagesRequest.model_validate(copy.deepcopy(body))).text
    assert ours == reference_prompt("anthropic", body)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_a_forced_tool_in_thinking_mode_goes_beyond_the_reference_with_its_auto_prompt(choice):
    """The reference refuses a required / named tool choice in thinking mode; dsv41 renders the prompt
    the reference gives with `auto` and the allowed tools (the call is enforced after the reasoning by
    constrained decoding, test_server_constrained.py)."""
    body = dict(messages=HI, tools=[WEATHER, SEARCH], tool_choice=choice, model=MODEL)
    with pytest.raises(recipe.ConversionError, match="Thinking mode does not support"):
        reference_prompt("openai", body)
    plan = openai_chat_plan(ChatCompletionRequest.model_validate(copy.deepcopy(body)))
    allowed = [WEATHER, SEARCH] if choice == "required" else [SEARCH]
    assert plan.text == reference_prompt("openai", dict(body, tools=allowed, tool_choice="auto"))
    assert plan.thinking and not plan.in_calls and [t["name"] for t in plan.forced_tools] == \
        [t["function"]["name"] for t in allowed]


@pytest.mark.parametrize("body, param", [
    (dict(messages=HI, tool_choice="required"), "tool_choice"),
    (dict(messages=HI, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(messages=HI, response_format={"type": "json_object"}), "response_format"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "text": None}]}]), "messages.0.content.0.image_url"),
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio", "text": None}]}]), "messages.0.content.0.type"),
])
def test_requests_that_mean_nothing_are_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as e:
        openai_chat_plan(ChatCompletionRequest.model_validate(dict(body, model=MODEL)))
    assert e.value.param == param
