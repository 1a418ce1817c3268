"""Completion parser (docs/TOKENIZER-AND-CHAT.md §8): round trips through the encoder, official
behaviour on well-formed text, and the lenient / strict handling of everything else."""

import json

import pytest

from dsv41.chat import CompletionParseError, encode_messages, parse_completion

EOS = "<｜end▁of▁sentence｜>"
USER = {"role": "user", "content": "question"}


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _rendered(message, mode):
    # The completion the model would have produced for `message`: its rendering after a user turn.
    return encode_messages([message], thinking_mode=mode, context=[USER])


def _assert_same_message(parsed, message):
    assert parsed["role"] == "assistant"
    assert parsed["content"] == message.get("content", "")
    assert parsed["reasoning_content"] == message.get("reasoning_content", "")
    expected = message.get("tool_calls", [])
    assert len(parsed["tool_calls"]) == len(expected)
    for got, want in zip(parsed["tool_calls"], expected):
        assert got["type"] == "function"
        assert got["function"]["name"] == want["function"]["name"]
        want_args = want["function"]["arguments"]
        want_args = json.loads(want_args) if isinstance(want_args, str) else want_args
        assert json.loads(got["function"]["arguments"]) == want_args


ROUND_TRIP_MESSAGES = [
    {"role": "assistant", "content": "Just text.", "reasoning_content": ""},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital of France…"},
    {"role": "assistant", "content": "", "reasoning_content": "  spaced  \n",
     "tool_calls": [_call("lookup", {"query": "value", "limit": 2})]},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "two calls",
     "tool_calls": [
         _call("search", {"q": "naïve ☃ \"quoted\" <b>", "n": 1.5, "strict": False,
                          "filters": {"lang": ["de", "fr"], "since": None},
                          "ids": [1, 2, 3], "flag": True}),
         _call("noop", {}),
         _call("echo", '{"text": "multi\\nline"}'),
     ]},
]


@pytest.mark.parametrize("mode", ["thinking", "chat"])
@pytest.mark.parametrize("index", range(len(ROUND_TRIP_MESSAGES)))
def test_round_trip(mode, index):
    message = dict(ROUND_TRIP_MESSAGES[index])
    if mode == "chat":
        message["reasoning_content"] = ""  # chat mode renders no reasoning
    text = _rendered(message, mode)
    for strict in (False, True):
        parsed = parse_completion(text, mode, strict=strict)
        _assert_same_message(parsed, message)
        # ... and encoding the parsed message reproduces the completion byte for byte.
        assert _rendered(parsed, mode) == text


def test_rendering_is_the_tail_of_the_full_prompt():
    message = ROUND_TRIP_MESSAGES[3]
    full = encode_messages([USER, message], thinking_mode="thinking")
    cue = encode_messages([USER], thinking_mode="thinking")
    assert full == cue + _rendered(message, "thinking")


def test_official_arguments_string():
    # §8.4: keys and string values JSON-quoted, string="false" values verbatim, joined by ", ".
    text = (
        "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"lookup\">\n"
        "<｜DSML｜ parameter name=\"query\" string=\"true\">value</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"limit\" string=\"false\">2</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"obj\" string=\"false\">{\"a\":[1,2]}</｜DSML｜ parameter>\n"
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS
    )
    parsed = parse_completion(text, "chat", strict=True)
    assert parsed == {
        "role": "assistant", "content": "", "reasoning_content": "",
        "tool_calls": [{"type": "function", "function": {
            "name": "lookup", "arguments": '{"query": "value", "limit": 2, "obj": {"a":[1,2]}}'}}],
    }


def test_content_without_tool_calls():
    parsed = parse_completion("r</think>Just an answer." + EOS, "thinking", strict=True)
    assert parsed == {"role": "assistant", "content": "Just an answer.",
                      "reasoning_content": "r", "tool_calls": []}


def test_typed_arguments():
    text = (
        "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n"
        "<｜DSML｜ parameter name=\"s\" string=\"true\">42</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"n\" string=\"false\">42</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"b\" string=\"false\">true</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"bad\" string=\"false\">not json</｜DSML｜ parameter>\n"
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS
    )
    args = json.loads(parse_completion(text, "chat")["tool_calls"][0]["function"]["arguments"])
    assert args == {"s": "42", "n": 42, "b": True, "bad": "not json"}


# ---------------------------------------------------------------------------------------------
# Truncated output is tolerated (pitfall 1)
# ---------------------------------------------------------------------------------------------

def test_missing_eos():
    assert parse_completion("r</think>partial answ", "thinking", strict=True)["content"] == \
        "partial answ"
    assert parse_completion("partial", "chat")["content"] == "partial"


def test_missing_think_end_means_everything_is_reasoning():
    parsed = parse_completion("still thinking about", "thinking", strict=True)
    assert parsed == {"role": "assistant", "content": "", "reasoning_content": "still thinking about",
                      "tool_calls": []}
    ended = parse_completion("thought then stopped" + EOS, "thinking", strict=True)
    assert ended["reasoning_content"] == "thought then stopped" and ended["content"] == ""


def test_calls_block_without_eos_is_accepted():
    message = {"role": "assistant", "content": "", "tool_calls": [_call("f", {"a": 1})]}
    text = _rendered(message, "chat")[: -len(EOS)]
    _assert_same_message(parse_completion(text, "chat", strict=True), message)


# ---------------------------------------------------------------------------------------------
# Malformed DSML: plain content by default, CompletionParseError when strict
# ---------------------------------------------------------------------------------------------

GOOD_BLOCK = (
    "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n"
    "<｜DSML｜ parameter name=\"a\" string=\"true\">x</｜DSML｜ parameter>\n"
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)

MALFORMED_BLOCKS = {
    "no newline after opener": GOOD_BLOCK.replace("calls>\n<", "calls><", 1),
    "unspaced V4 tags": GOOD_BLOCK.replace("｜DSML｜ ", "｜DSML｜"),
    "bad string flag": GOOD_BLOCK.replace('string="true"', 'string="yes"'),
    "missing invoke close": GOOD_BLOCK.replace("</｜DSML｜ invoke>\n", ""),
    "junk between invokes": GOOD_BLOCK.replace("</｜DSML｜ invoke>\n", "</｜DSML｜ invoke>\njunk"),
    "truncated mid parameter": GOOD_BLOCK[: GOOD_BLOCK.index("x</")],
    "truncated before close": GOOD_BLOCK[: -len("</｜DSML｜ calls>")],
    "duplicate parameter": GOOD_BLOCK.replace(
        "</｜DSML｜ parameter>\n",
        "</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"a\" string=\"true\">y</｜DSML｜ parameter>\n",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_BLOCKS))
def test_malformed_block_is_content_by_default(case):
    block = MALFORMED_BLOCKS[case]
    parsed = parse_completion("Sure." + block + EOS, "chat")
    assert parsed["tool_calls"] == []
    assert parsed["content"] == "Sure." + block


@pytest.mark.parametrize("case", sorted(MALFORMED_BLOCKS))
def test_malformed_block_raises_when_strict(case):
    with pytest.raises(CompletionParseError):
        parse_completion("Sure." + MALFORMED_BLOCKS[case] + EOS, "chat", strict=True)


def test_duplicate_parameter_message():
    with pytest.raises(CompletionParseError, match="duplicate parameter name 'a'"):
        parse_completion(MALFORMED_BLOCKS["duplicate parameter"], "chat", strict=True)


def test_parse_error_is_a_value_error():
    assert issubclass(CompletionParseError, ValueError)


def test_text_after_calls_block():
    text = GOOD_BLOCK + "trailing words" + EOS
    parsed = parse_completion(text, "chat")
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["f"]
    assert parsed["content"] == "trailing words"
    with pytest.raises(CompletionParseError, match="after the tool-call block"):
        parse_completion(text, "chat", strict=True)


def test_text_after_eos():
    assert parse_completion("done" + EOS + "more", "chat")["content"] == "done"
    with pytest.raises(CompletionParseError, match="after the end-of-sentence"):
        parse_completion("done" + EOS + "more", "chat", strict=True)


def test_special_strings_in_content_only_fail_when_strict():
    text = "a <think> b" + EOS
    assert parse_completion(text, "chat")["content"] == "a <think> b"
    with pytest.raises(CompletionParseError, match="<think>"):
        parse_completion(text, "chat", strict=True)


def test_calls_before_think_end():
    text = "plan" + GOOD_BLOCK + "</think>answer" + EOS
    assert parse_completion(text, "thinking")["reasoning_content"] == "plan" + GOOD_BLOCK
    with pytest.raises(CompletionParseError):
        parse_completion(text, "thinking", strict=True)


def test_invalid_mode():
    with pytest.raises(ValueError, match="thinking_mode"):
        parse_completion("x", "reasoning")
