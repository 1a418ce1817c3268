"""The OpenAI API of `dsv41 serve`, through the official `openai` client against a real server on
loopback (tests/serving.py), on the demo model.

Expectations are independent of the server code: the engine run directly on the prompt DeepSeek's
request library renders (test_server_prompts.py shows the server renders the same), the completion
parser on its text, `dsv41 score` for log-probabilities, and the server's own earlier answers for
repeatability (seeds, streaming vs whole, alone vs beside other requests).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re

import httpx2
import openai
import pytest

from dsv41.chat import parse_completion
from dsv41.chat.encoding import BOS, DSML, EOS, THINK_END, THINK_START
from dsv41.cli import main as cli_main
from dsv41.engine.engine import Engine, EngineConfig
from dsv41.engine.request import Request
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.score import score

recipe = pytest.importorskip("deepseek_recipe")

OFF = {"thinking": {"type": "disabled"}}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference_ids(tokenizer, messages, thinking: bool) -> list[int]:
    body = {"model": "DeepSeek-V4.1-Flash", "messages": messages,
            "thinking": {"type": "enabled" if thinking else "disabled"}}
    converted = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    return tokenizer.encode_prompt(recipe.DeepseekV41Encoding().render_conversation(converted.conversation).prompt)


def engine_greedy(server_model, prompt: list[int], max_tokens: int):
    model, tokenizer = server_model
    engine = Engine(model, tokenizer, EngineConfig(n_slots=1, max_context=512))
    engine.submit(Request(tuple(prompt), max_new_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)))
    [done] = [e.completion for e in engine.run() if e.completion is not None]
    return done


def strip_specials(text: str) -> str:
    for special in (BOS, EOS, THINK_START, THINK_END, DSML):
        text = text.replace(special, "")
    return text


def message_of(response) -> tuple[str | None, str | None]:
    m = response.choices[0].message
    return getattr(m, "reasoning_content", None), m.content


# ------------------------------------------------------------------------------------ answers
@pytest.mark.parametrize("thinking", [True, False])
def test_a_greedy_chat_completion_is_the_engines_completion_of_the_reference_prompt(client, server_model, thinking):
    """Prompt tokens, the generated text split by the completion parser into reasoning and content, and
    the usage figures: each equals what the engine gives for the reference library's prompt."""
    ids = reference_ids(server_model[1], HELLO, thinking)
    expected = engine_greedy(server_model, ids, 24)
    parsed = parse_completion(expected.text, "thinking" if thinking else "chat")
    # the random model writes special tokens into prose, where the official parser keeps them and the
    # server drops them (special strings never reach a client's text: dsv41/server/stream.py rule f)
    parsed = {k: strip_specials(parsed.get(k) or "") for k in ("reasoning_content", "content")}
    r = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=24, temperature=0,
                                       extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}})
    reasoning, content = message_of(r)
    assert (reasoning or "", content or "") == (parsed["reasoning_content"], parsed["content"])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == expected.generated_tokens
    assert r.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    details = r.usage.completion_tokens_details.reasoning_tokens
    if thinking and "</think>" not in expected.text:          # every token is reasoning but a final EOS
        assert details == expected.generated_tokens - (expected.finish_reason == "eos")
    assert (details > 0) == thinking


def test_a_stream_adds_up_to_the_whole_answer_and_ends_with_usage(client):
    kwargs = dict(model="demo", messages=HELLO, max_tokens=30, seed=7, temperature=1.0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == tuple(x or "" for x in message_of(whole))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 30


def test_a_seed_repeats_its_answer_alone_and_beside_other_requests(client):
    def ask(seed, max_tokens=20):
        return message_of(client.chat.completions.create(model="demo", messages=HELLO, max_tokens=max_tokens,
                                                         seed=seed, temperature=1.0, top_p=0.9, **{"extra_body": OFF}))

    alone = ask(11)
    assert ask(11) == alone and ask(12) != alone
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        beside = [pool.submit(ask, s, m) for s, m in ((11, 20), (5, 40), (6, 33), (11, 20))]
        results = [f.result() for f in beside]
    assert results[0] == results[3] == alone


def test_n_choices_are_seeded_one_after_another(client):
    kwargs = dict(model="demo", messages=HELLO, max_tokens=12, temperature=1.0, extra_body=OFF)
    both = client.chat.completions.create(**kwargs, n=2, seed=40)
    assert [c.index for c in both.choices] == [0, 1]
    second = client.chat.completions.create(**kwargs, seed=41)
    assert both.choices[1].message.content == second.choices[0].message.content
    assert both.choices[0].message.content != both.choices[1].message.content
    assert both.usage.completion_tokens == 24


def test_a_stop_string_cuts_the_content_before_it(client):
    kwargs = dict(model="demo", messages=HELLO, max_tokens=40, temperature=0, extra_body=OFF)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = full[10:13]
    cut = client.chat.completions.create(**kwargs, stop=[stop, "\x00never"]).choices[0]
    assert cut.message.content == full[:full.index(stop)] and cut.finish_reason == "stop"


def test_logprobs_are_the_models_log_probabilities_of_the_sampled_tokens(client, server_model):
    """Each token's logprob equals the teacher-forced log-probability (`dsv41.engine.score`) of the
    prompt plus the generated ids; the top alternatives are sorted and start with the greedy choice."""
    model, tokenizer = server_model
    ids = reference_ids(tokenizer, HELLO, False)
    expected = engine_greedy(server_model, ids, 8)
    r = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=OFF)
    entries = r.choices[0].logprobs.content
    forced = score(model, [ids + expected.token_ids], max_context=512).token_logprobs[0]
    assert len(entries) == len(expected.token_ids) == 8
    for t, (entry, token) in enumerate(zip(entries, expected.token_ids)):
        assert entry.token == tokenizer.decode([token])
        assert math.isclose(entry.logprob, float(forced[len(ids) - 1 + t]), abs_tol=1e-5)
        tops = [x.logprob for x in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and math.isclose(tops[0], entry.logprob)


def test_echo_logprobs_equal_dsv41_score(client, demo_dir, capsys):
    text = "The quick brown fox jumps over the lazy dog."
    r = client.completions.create(model="demo", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == text and "".join(choice.logprobs.tokens) == text
    assert cli_main(["score", "--checkpoint", str(demo_dir), "--max-context", "512", "--numerics", "fast",
                     "--kernels", "invariant", text]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines() if re.match(r"\d+\t", line)]
    assert rows[0][3] == "-"                                   # BOS, which the server put first
    reference = [float(row[3]) for row in rows[1:]]
    assert len(reference) == len(choice.logprobs.token_logprobs)
    for ours, theirs in zip(choice.logprobs.token_logprobs, reference):
        assert abs(ours - theirs) <= 1e-6 + 5e-7
    # the legacy format keys alternatives by text: two ids that decode alike ("\ufffd") share a key
    for top, logprob in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) >= logprob


def test_logit_bias_moves_the_engines_choice_and_ignore_eos_runs_past_eos(client, server_model):
    """A +100 bias on EOS ends the answer at its first token; with `ignore_eos` the same answer runs to
    max_tokens. A -100 bias on greedy's first token gives the engine's greedy answer with that token
    banned (the engine run directly, `SamplingParams.logit_bias`)."""
    model, tokenizer = server_model
    eos = {str(tokenizer.eos_id): 100}
    kwargs = dict(model="demo", messages=HELLO, max_tokens=6, temperature=1.0, seed=3)
    ended = client.chat.completions.create(**kwargs, logit_bias=eos, extra_body=OFF)
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)
    on = client.chat.completions.create(**kwargs, logit_bias=eos, extra_body={**OFF, "ignore_eos": True})
    assert (on.choices[0].finish_reason, on.usage.completion_tokens) == ("length", 6)

    ids = [tokenizer.bos_id] + tokenizer.encode("Once upon a time")
    first = engine_greedy(server_model, ids, 1).token_ids[0]
    engine = Engine(model, tokenizer, EngineConfig(n_slots=1, max_context=512))
    engine.submit(Request(tuple(ids), max_new_tokens=4, sampling=SamplingParams(0.0, logit_bias=((first, -100.0),))))
    [banned] = [e.completion for e in engine.run() if e.completion is not None]
    r = client.completions.create(model="demo", prompt=ids, max_tokens=4, temperature=0,
                                  logit_bias={str(first): -100})
    assert banned.token_ids[0] != first and r.choices[0].text == banned.text


def test_raw_completions_continue_the_prompt_ids(client, server_model):
    """Token-id prompts go in as given; text prompts get BOS first; several prompts give one choice
    each (n per prompt), indexed prompt by prompt."""
    _, tokenizer = server_model
    ids = [tokenizer.bos_id] + tokenizer.encode("Once upon a time")
    expected = engine_greedy(server_model, ids, 6)
    by_ids = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == expected.text and by_ids.usage.prompt_tokens == len(ids)
    r = client.completions.create(model="demo", prompt=["Once upon a time", "Hi"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == expected.text != r.choices[2].text
    assert r.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hi")) + 1


# ------------------------------------------------------------------------------------ tools and turns
def test_a_required_tool_call_round_trip_reuses_the_first_turns_positions(client):
    """tool_choice required: the answer is a call with JSON arguments valid for the schema; sent back
    with the tool's result, the next turn continues the kept sequence (usage reports the cached
    tokens: every position of turn one but the last sampled token, EOS, which was never fed)."""
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    first = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=150, seed=3, extra_body=OFF)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["city"], str) and isinstance(args["days"], int)
    assert call.id.startswith("call_")
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], max_tokens=5,
                                            seed=4, extra_body=OFF)
    first_positions = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == first_positions
    assert second.usage.prompt_cache_hit_tokens == first_positions


def test_a_streamed_tool_call_sends_id_and_name_then_argument_fragments(client):
    kwargs = dict(model="demo", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=150, seed=9,
                  extra_body=OFF)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    calls = [tc for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
             for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:]) and len(calls) >= 3
    assert "".join(tc.function.arguments for tc in calls) == whole.function.arguments


def test_reasoning_passed_back_with_a_tool_result_is_kept_and_reused(client):
    """Thinking mode: a forced call after the reasoning; turn two sends reasoning_content back with the
    call and its result (the reasoning stays in the prompt before the last user message), so the
    prompt continues turn one exactly."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=290, seed=5)
    m = first.choices[0].message
    assert m.reasoning_content and m.tool_calls and first.choices[0].finish_reason == "tool_calls"
    messages += [{"role": "assistant", "content": m.content or "", "reasoning_content": m.reasoning_content,
                  "tool_calls": [c.model_dump() for c in m.tool_calls]},
                 {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "cold"}]
    second = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], max_tokens=4, seed=6)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + \
        first.usage.completion_tokens - 1


def test_a_chat_turn_continues_the_previous_turn(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    first = client.chat.completions.create(model="demo", messages=messages, max_tokens=20, seed=1, extra_body=OFF)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="demo", messages=messages, max_tokens=3, seed=2, extra_body=OFF)
    # a length finish: the last sampled token was never fed, so one position fewer is kept
    assert first.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + \
        first.usage.completion_tokens - 1


# ------------------------------------------------------------------------------------ cancellation
def test_closing_a_stream_cancels_the_request_and_frees_its_slot(client, live):
    before = finished(live, "cancelled")
    with client.chat.completions.create(model="demo", messages=HELLO, max_tokens=400, stream=True) as stream:
        for _, _ in zip(range(3), stream):
            pass
    assert live.wait_idle(), "the request kept running after its client left"
    assert finished(live, "cancelled") == before + 1


def test_a_client_that_stops_waiting_cancels_its_request(live):
    before = finished(live, "cancelled")
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(live.url + "/v1/chat/completions", timeout=1.0,
                    json={"model": "demo", "messages": HELLO, "max_tokens": 400})
    assert live.wait_idle(), "the request kept running after its client left"
    assert finished(live, "cancelled") == before + 1


def finished(live, reason: str) -> float:
    return live.state.metrics.requests_finished.labels(reason)._value.get()


# ------------------------------------------------------------------------------------ operation
def test_models_health_and_metrics(client, live):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert httpx2.get(live.url + "/health").json() == {"status": "ok", "model": "demo"}

    def tokens() -> float:
        text = httpx2.get(live.url + "/metrics").text
        return float(re.search(r"^dsv41_generation_tokens_total (\S+)$", text, re.M).group(1))

    before = tokens()
    r = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=7, extra_body=OFF)
    assert tokens() - before == r.usage.completion_tokens
    text = httpx2.get(live.url + "/metrics").text
    for name in ("dsv41_requests_finished_total", "dsv41_time_to_first_token_seconds_bucket",
                 "dsv41_inter_token_latency_seconds_bucket", "dsv41_queue_depth", "dsv41_running_rows",
                 "dsv41_cache_slots_in_use", "dsv41_prefix_cache_hits", "dsv41_http_requests_total"):
        assert name in text
