"""Images over the HTTP APIs, through the official clients, on the random demo's vision tower:

- an OpenAI `image_url` part (a data URL) and an Anthropic image block (base64) give the engine's own
  greedy completion of the same prompt with the image's span, and usage counts the span;
- a follow-up turn that repeats the conversation continues the kept sequence (cached tokens), and the
  image is not encoded again;
- local files only under `--image-dir`; network URLs, bad base64, non-images and oversized images are a
  400 that names the problem.
"""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from dsv41.chat import encode_messages
from dsv41.engine.engine import Engine, EngineConfig
from dsv41.engine.request import Request
from dsv41.engine.sampling import SamplingParams
from dsv41.vision import ImageSources, prompt_images

from helpers import picture
from test_server_openai import strip_specials


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    (root / "inside.png").write_bytes(picture(seed=3))
    return root


@pytest.fixture(scope="module")
def local_server(start_server, files):
    return start_server(image_dir=files / "")


def engine_completion(server_model, messages: list[dict], max_tokens: int) -> tuple[list[int], str]:
    """(prompt ids with the span, greedy completion text) from the engine directly, chat mode."""
    model, tokenizer = server_model
    text, media = encode_messages(messages, "chat", return_multi_modal_data=True)
    ids, spans = prompt_images(tokenizer.encode_prompt(text), media["images"], model.cfg, ImageSources())
    engine = Engine(model, tokenizer, EngineConfig(n_slots=1, max_context=512))
    engine.submit(Request(tuple(ids), max_new_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                          images=spans))
    [done] = [e.completion for e in engine.run() if e.completion is not None]
    return ids, done.text


def user_with_image(url: str, text: str = "Describe it.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


def test_an_openai_image_url_part_gives_the_engines_completion(client, server_model):
    messages = user_with_image(data_url(picture()))
    ids, expected = engine_completion(server_model, messages, 12)
    reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"thinking": {"type": "disabled"}})
    assert reply.usage.prompt_tokens == len(ids)
    assert (reply.choices[0].message.content or "") == strip_specials(expected)


def test_an_anthropic_image_block_gives_the_engines_completion(live, server_model):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
    data = picture(seed=1)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    ids, expected = engine_completion(server_model, [{"role": "user", "content": [
        {"type": "image", "source": source}, {"type": "text", "text": "Describe it."}]}], 12)
    reply = client.messages.create(model="demo", max_tokens=12, thinking={"type": "disabled"},
                                   messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                                                          {"type": "text", "text": "Describe it."}]}],
                                   extra_body={"temperature": 0})
    assert reply.usage.input_tokens == len(ids)
    text = "".join(b.text for b in reply.content if b.type == "text")
    assert text == strip_specials(expected)


def test_a_follow_up_turn_reuses_the_image_prefix(client, live, monkeypatch):
    model = live.engine.model
    encoded = []
    original = model.encode_image
    monkeypatch.setattr(model, "encode_image", lambda image: encoded.append(image.digest) or original(image))
    messages = user_with_image(data_url(picture(seed=2)), "First question.")
    off = {"thinking": {"type": "disabled"}}
    first = client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0, extra_body=off)
    live.wait_idle()
    follow = messages + [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="demo", messages=follow, max_tokens=6, temperature=0, extra_body=off)
    assert len(encoded) == 1
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_local_files_only_under_the_image_directory(local_server, client, files, tmp_path):
    inside = openai.OpenAI(base_url=local_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = inside.chat.completions.create(model="demo", messages=user_with_image(str(files / "inside.png")),
                                           max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens > 20
    outside = tmp_path / "outside.png"
    outside.write_bytes(picture())
    with pytest.raises(openai.BadRequestError, match="outside the image directory"):
        inside.chat.completions.create(model="demo", messages=user_with_image(str(outside)), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="local files are not accepted"):
        client.chat.completions.create(model="demo", messages=user_with_image(str(files / "inside.png")), max_tokens=2)


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png," + "abc", "must be base64"),
    (data_url(b"this is not a picture at all"), "not an image"),
    (data_url(picture()[:60]), "cannot be"),
])
def test_bad_images_are_a_400_that_names_them(client, url, message):
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        client.chat.completions.create(model="demo", messages=user_with_image(url), max_tokens=2)
    assert "image 0" in str(caught.value)


def test_images_only_in_user_and_tool_messages(client):
    messages = [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(picture())}}]},
                {"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="system messages cannot carry images"):
        client.chat.completions.create(model="demo", messages=messages, max_tokens=2)
