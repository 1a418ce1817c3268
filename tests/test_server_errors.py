"""Bad requests and hard times get one clear error, in the shape of the API asked, with the right status:
400 naming the field, 404 for an unknown model, 400 for a prompt longer than the context (both numbers),
413 for a body over the limit, 429 when the queue is full, 503 while loading or after a failed load,
401 without the key. The official clients raise their own error classes for each."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx2
import openai
import pytest

HELLO = [{"role": "user", "content": "Hello"}]


def post(live, path: str, body, **kwargs):
    return httpx2.post(live.url + path, json=body, timeout=30, **kwargs)


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("body, param, words", [
    ({"model": "demo"}, "messages", "Field required"),
    ({"model": "demo", "messages": []}, "messages", "at least 1"),
    ({"model": "demo", "messages": HELLO, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"model": "demo", "messages": HELLO, "n": 0}, "n", "greater than or equal to 1"),
    ({"model": "demo", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "Input should be"),
    ({"model": "demo", "messages": HELLO, "stop": [""]}, "stop", "must not be empty"),
    ({"model": "demo", "messages": HELLO, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"model": "demo", "messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
    ({"model": "demo", "messages": HELLO, "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "needs a json_schema"),
    ({"model": "demo", "messages": HELLO, "response_format": {"type": "json_object"}}, "response_format", "json"),
    ({"model": "demo", "messages": HELLO, "logit_bias": {"1": 101}}, "logit_bias", "token 1 has 101"),
    ({"model": "demo", "messages": HELLO, "logit_bias": {"-3": 1}}, "logit_bias", "got '-3'"),
    ({"model": "demo", "messages": HELLO, "logit_bias": {"99999999": 1}}, "logit_bias", "below the vocabulary"),
    ({"model": "demo", "messages": HELLO, "ignore_eos": True, "response_format": {"type": "json_schema",
      "json_schema": {"name": "x", "schema": {"type": "object"}}}}, "ignore_eos", "grammar ends the answer"),
])
def test_a_malformed_or_meaningless_chat_request_is_a_400_naming_the_field(live, body, param, words):
    error = openai_error(post(live, "/v1/chat/completions", body), 400)
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_is_a_400(live):
    r = httpx2.post(live.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                    headers={"content-type": "application/json"})
    assert "JSON" in openai_error(r, 400)["message"]


def test_an_unknown_model_is_a_404_in_each_apis_shape(live):
    error = openai_error(post(live, "/v1/chat/completions", {"model": "gpt-9", "messages": HELLO}), 404)
    assert "'gpt-9'" in error["message"] and "'demo'" in error["message"] and error["param"] == "model"
    r = post(live, "/v1/messages", {"model": "claude-9", "max_tokens": 5, "messages": HELLO})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error" and "'claude-9'" in r.json()["error"]["message"]
    client = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-9", max_tokens=5, messages=HELLO)


def test_a_prompt_longer_than_the_context_is_a_400_with_both_numbers(live):
    context = live.state.config.max_context
    long = [{"role": "user", "content": "word " * context}]
    message = openai_error(post(live, "/v1/chat/completions", {"model": "demo", "messages": long}), 400)["message"]
    assert "tokens" in message and str(context) in message
    n = int(message.split("the prompt has ")[1].split(" ")[0])
    assert n > context
    message = openai_error(post(live, "/v1/chat/completions", {"model": "demo", "messages": HELLO,
                                                               "max_tokens": context}), 400)["message"]
    assert f"max_tokens is {context}" in message and str(context) in message
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="word " * context, max_tokens=1)


def test_a_body_over_the_limit_is_a_413(live):
    limit = live.state.config.max_body_bytes
    big = {"model": "demo", "messages": [{"role": "user", "content": "x" * (limit + 10)}]}
    error = openai_error(post(live, "/v1/chat/completions", big), 413)
    assert str(limit) in error["message"]
    r = post(live, "/v1/messages", {"model": "demo", "max_tokens": 5, "messages": big["messages"]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_a_body_without_a_length_is_a_411(live):
    r = httpx2.post(live.url + "/v1/chat/completions", content=iter([b'{"model": "demo", ', b'"messages": []}']),
                    headers={"content-type": "application/json"}, timeout=10)
    assert "Content-Length" in openai_error(r, 411)["message"]


def test_an_unknown_path_is_a_404_in_the_openai_shape(live):
    assert openai_error(httpx2.get(live.url + "/v1/nothing"), 404)["message"] == "Not Found"


def test_a_full_queue_is_a_429_and_frees_up_again(start_server):
    """One slot, one waiting place: a third request is refused with 429 until the others are gone."""
    server = start_server(max_batch=1, max_queue=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kwargs = dict(model="demo", messages=HELLO, max_tokens=300, stream=True)
    running = client.chat.completions.create(**kwargs)
    next(iter(running))
    waiting = client.chat.completions.create(**kwargs)
    deadline = time.monotonic() + 10
    while server.engine.queue_depth < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError, match="already waiting"):
        client.chat.completions.create(model="demo", messages=HELLO, max_tokens=5)
    running.close()
    waiting.close()
    assert server.wait_idle()
    assert client.chat.completions.create(model="demo", messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_requests_get_503_while_the_model_loads_and_after_a_failed_load(start_server, server_model):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return server_model

    server = start_server(load=slow_load, wait_ready=False)
    r = httpx2.get(server.url + "/health")
    assert r.status_code == 503 and r.json() == {"status": "loading"}
    assert "loading" in openai_error(post(server, "/v1/chat/completions", {"model": "demo", "messages": HELLO}),
                                     503)["message"]
    release.set()
    deadline = time.monotonic() + 30
    while httpx2.get(server.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    answer = post(server, "/v1/chat/completions", {"model": "demo", "messages": HELLO, "max_tokens": 1})
    assert answer.status_code == 200

    def broken_load():
        raise FileNotFoundError("no model.safetensors.index.json in /nowhere")

    failed = start_server(load=broken_load, wait_ready=False)
    deadline = time.monotonic() + 10
    while failed.state.load_error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    health = httpx2.get(failed.url + "/health")
    assert health.status_code == 503 and "/nowhere" in health.json()["error"]
    r = post(failed, "/v1/messages", {"model": "demo", "max_tokens": 5, "messages": HELLO})
    assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "overloaded_error"


def test_with_an_api_key_requests_without_it_are_a_401(start_server):
    server = start_server(api_key="sekret")
    assert httpx2.get(server.url + "/health").status_code == 200          # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="demo", max_tokens=2, messages=HELLO)
    assert [m.id for m in openai.OpenAI(base_url=server.url + "/v1", api_key="sekret").models.list().data] == ["demo"]
    reply = anthropic.Anthropic(base_url=server.url, api_key="sekret").messages.create(
        model="demo", max_tokens=2, messages=HELLO, thinking={"type": "disabled"})
    assert reply.usage.output_tokens == 2
