"""The Anthropic Messages API of `dsv41 serve`, through the official `anthropic` client: content blocks
(thinking, text, tool_use), streaming events folded by the client's own accumulator, tool round trips,
stop sequences and usage, against the engine run on the reference library's prompt."""

from __future__ import annotations

import anthropic
import pytest

from dsv41.chat import parse_completion
from dsv41.engine.engine import Engine, EngineConfig
from dsv41.engine.request import Request
from dsv41.engine.sampling import SamplingParams

from test_server_openai import strip_specials

recipe = pytest.importorskip("deepseek_recipe")

HELLO = [{"role": "user", "content": "Hello, who are you?"}]
WEATHER = {"name": "get_weather", "description": "Current weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}
OFF = {"type": "disabled"}
# this SDK version no longer sends sampling fields; the server takes them from the body
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)


def reference_ids(tokenizer, body: dict) -> list[int]:
    converted = recipe.MessagesRequest(dict(body, model="DeepSeek-V4.1-Flash")).convert(recipe.ConversionOptions())
    return tokenizer.encode_prompt(recipe.DeepseekV41Encoding().render_conversation(converted.conversation).prompt)


@pytest.mark.parametrize("thinking", [True, False])
def test_a_greedy_message_is_the_engines_completion_of_the_reference_prompt(client, server_model, thinking):
    model, tokenizer = server_model
    body = dict(max_tokens=24, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1024} if thinking else OFF)
    ids = reference_ids(tokenizer, body)
    engine = Engine(model, tokenizer, EngineConfig(n_slots=1, max_context=512))
    engine.submit(Request(tuple(ids), max_new_tokens=24, sampling=SamplingParams(temperature=0.0)))
    [expected] = [e.completion for e in engine.run() if e.completion is not None]
    parsed = parse_completion(expected.text, "thinking" if thinking else "chat")
    reply = client.messages.create(model="demo", extra_body=GREEDY, **body)
    content = strip_specials(parsed["content"] or "")
    kinds = [b.type for b in reply.content]
    assert kinds == (["thinking"] if thinking else []) + (["text"] if content or not thinking else [])
    if thinking:
        assert reply.content[0].thinking == strip_specials(parsed["reasoning_content"] or "")
    assert "".join(b.text for b in reply.content if b.type == "text") == content
    # the engine's own reason: the random demo may write EOS before the 24th token
    assert reply.stop_reason == {"length": "max_tokens", "eos": "end_turn"}[expected.finish_reason]
    assert reply.usage.output_tokens == expected.generated_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(ids)


def test_a_stream_folds_into_the_whole_message(client):
    kwargs = dict(model="demo", max_tokens=30, messages=HELLO, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        folded = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in folded.content] == [b.model_dump() for b in whole.content]
    assert folded.stop_reason == whole.stop_reason and folded.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_use_round_trip(client):
    """tool_choice any, chat mode: the reply is a tool_use block whose input fits the schema; streamed,
    the client's accumulator rebuilds the same input from the input_json_delta fragments; sent back with
    a tool_result, the next turn continues the kept sequence."""
    kwargs = dict(model="demo", max_tokens=150, tools=[WEATHER], tool_choice={"type": "any"}, thinking=OFF)
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    reply = client.messages.create(messages=messages, extra_body=GREEDY, **kwargs)
    assert reply.stop_reason == "tool_use"
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input["city"], str) and isinstance(use.input["days"], int)
    with client.messages.stream(messages=messages, extra_body=GREEDY, **kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "warm"}]}]
    follow = client.messages.create(messages=messages, model="demo", max_tokens=3, tools=[WEATHER], thinking=OFF)
    assert follow.usage.cache_read_input_tokens == reply.usage.input_tokens + reply.usage.output_tokens - 1


def test_a_stop_sequence_is_reported(client):
    kwargs = dict(model="demo", max_tokens=40, messages=HELLO, extra_body=GREEDY, thinking=OFF)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[8:11]
    reply = client.messages.create(**kwargs, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[:text.index(stop)]


def test_a_malformed_message_is_an_invalid_request_error(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="demo", max_tokens=0, messages=HELLO)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
