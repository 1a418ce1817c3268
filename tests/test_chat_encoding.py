"""Prompt encoder against the official fixtures and the rules of docs/TOKENIZER-AND-CHAT.md §4-§6.

Expected prompts are written out by hand from the spec, never produced by the encoder.
"""

import copy
import json
import re

import pytest

from dsv41.chat import encode_messages

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYS = "<｜System｜>"
USR = "<｜User｜>"
AST = "<｜Assistant｜>"
IMG = "<｜deepseek_image｜>"


def effort(n):
    return (
        f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the "
        "reasoning)\n\n"
    )


# ---------------------------------------------------------------------------------------------
# §6 official fixtures (recorded from the official encoding.py, sha256 502bdaec…)
# ---------------------------------------------------------------------------------------------

def test_fixture_chat():
    prompt = encode_messages([{"role": "user", "content": "Hello"}], thinking_mode="chat")
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"


def test_fixture_thinking():
    prompt = encode_messages(
        [{"role": "user", "content": "Explain the fix."}],
        thinking_mode="thinking",
        reasoning_effort="low",
    )
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 50 (range 1-100, the higher the "
        "value, the more thorough the reasoning)\n\n<｜User｜>Explain the fix.<｜Assistant｜><think>"
    )


def test_fixture_tool():
    messages = [
        {"role": "user", "content": "lookup value"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function",
                 "function": {"name": "lookup", "arguments": "{\"query\":\"value\"}"}}
            ],
        },
    ]
    assert encode_messages(messages, thinking_mode="chat") == (
        "<｜begin▁of▁sentence｜><｜User｜>lookup value<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n"
        "<｜DSML｜ invoke name=\"lookup\">\n<｜DSML｜ parameter name=\"query\" string=\"true\">value"
        "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
    )


def test_fixture_structured_image():
    url = "/tmp/image.png"
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "inspect"},
        {"type": "image_url", "image_url": {"url": url}},
    ]}]
    prompt, media = encode_messages(messages, thinking_mode="chat", return_multi_modal_data=True)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>inspect\n\n<｜deepseek_image｜><｜Assistant｜></think>"
    assert media == {"images": [{"type": "image", "url": url}]}


def test_fixture_literal_image_marker():
    expected = (
        "Message content contains image special token '<｜deepseek_image｜>'. "
        "Images should be provided as image content blocks."
    )
    with pytest.raises(ValueError) as info:
        encode_messages([{"role": "user", "content": f"look {IMG} here"}], thinking_mode="chat")
    assert str(info.value) == expected


# ---------------------------------------------------------------------------------------------
# §6 derived multi-turn examples
# ---------------------------------------------------------------------------------------------

MULTI_TURN = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
    {"role": "user", "content": "2+2?"},
]


def test_derived_multi_turn_thinking():
    assert encode_messages(MULTI_TURN, thinking_mode="thinking") == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the "
        "value, the more thorough the reasoning)\n\nYou are helpful.<｜User｜>Hi<｜Assistant｜>"
        "</think>Hello!<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>"
    )


def test_derived_multi_turn_chat():
    assert encode_messages(MULTI_TURN, thinking_mode="chat") == (
        "<｜begin▁of▁sentence｜><｜System｜>You are helpful.<｜User｜>Hi<｜Assistant｜></think>"
        "Hello!<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>"
    )


def test_keep_thinking_when_drop_is_off():
    prompt = encode_messages(MULTI_TURN, thinking_mode="thinking", drop_thinking=False)
    assert prompt == (
        BOS + SYS + effort(75) + "You are helpful." + USR + "Hi" + AST + "<think>"
        + "greet</think>Hello!" + EOS + USR + "2+2?" + AST + "<think>"
    )


def test_last_assistant_turn_keeps_its_reasoning():
    # The turn after the last user message is rendered with its reasoning (i > u).
    messages = MULTI_TURN[:3]
    prompt = encode_messages(messages, thinking_mode="thinking", reasoning_effort=100)
    assert prompt == (
        BOS + SYS + effort(100) + "You are helpful." + USR + "Hi" + AST + "<think>"
        + "greet</think>Hello!" + EOS
    )


def test_input_messages_are_not_mutated():
    messages = copy.deepcopy(MULTI_TURN) + [{"role": "tool", "tool_call_id": "x", "content": "r"}]
    before = copy.deepcopy(messages)
    encode_messages(messages, thinking_mode="thinking")
    assert messages == before


# ---------------------------------------------------------------------------------------------
# §4.2 reasoning effort
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, budget",
    [("low", 50), ("high", 75), ("max", 100), (None, 75), (1, 1), (42, 42), (100, 100)],
)
def test_effort_values(value, budget):
    prompt = encode_messages([{"role": "user", "content": "q"}], thinking_mode="thinking",
                             reasoning_effort=value)
    assert prompt == BOS + SYS + effort(budget) + USR + "q" + AST + "<think>"


@pytest.mark.parametrize("bad", [0, 101, -5, "medium", "xhigh", "none", "75", True, 1.5, "HIGH"])
def test_effort_rejects_other_values(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        encode_messages([{"role": "user", "content": "q"}], thinking_mode="thinking",
                        reasoning_effort=bad)


def test_effort_is_not_rendered_in_chat_mode():
    prompt = encode_messages([{"role": "user", "content": "q"}], thinking_mode="chat",
                             reasoning_effort=100)
    assert prompt == BOS + USR + "q" + AST + "</think>"


def test_effort_only_at_index_zero():
    prompt = encode_messages(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "c"}],
        thinking_mode="thinking", reasoning_effort=10,
    )
    assert prompt.count("Reasoning Effort") == 1
    assert prompt.startswith(BOS + SYS + effort(10) + USR + "a")


def test_invalid_thinking_mode():
    with pytest.raises(ValueError, match="thinking_mode"):
        encode_messages([{"role": "user", "content": "q"}], thinking_mode="think")


# ---------------------------------------------------------------------------------------------
# §4.3 roles
# ---------------------------------------------------------------------------------------------

def test_mid_conversation_system_message():
    messages = [
        {"role": "system", "content": "s0"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "system", "content": "s1"},
    ]
    prompt = encode_messages(messages, thinking_mode="thinking", reasoning_effort=88)
    assert prompt == (
        BOS + SYS + effort(88) + "s0" + USR + "q1" + AST + "</think>a1" + EOS
        + SYS + "s1" + AST + "<think>"
    )


def test_empty_system_message_keeps_its_token():
    prompt = encode_messages([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}],
                             thinking_mode="chat")
    assert prompt == BOS + SYS + USR + "hi" + AST + "</think>"


def test_developer_message():
    prompt = encode_messages([{"role": "developer", "content": "dev says"}], thinking_mode="chat")
    assert prompt == BOS + USR + "dev says" + AST + "</think>"


def test_developer_needs_content():
    with pytest.raises(ValueError, match="developer"):
        encode_messages([{"role": "developer", "content": ""}], thinking_mode="chat")


def test_developer_before_last_user_is_dropped_in_thinking_mode():
    messages = [
        {"role": "developer", "content": "old rules"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    thinking = encode_messages(messages, thinking_mode="thinking", reasoning_effort=60)
    assert thinking == (
        BOS + SYS + effort(60) + USR + "q1" + AST + "</think>a1" + EOS + USR + "q2" + AST + "<think>"
    )
    chat = encode_messages(messages, thinking_mode="chat")
    assert chat.startswith(BOS + USR + "old rules" + USR + "q1" + AST + "</think>a1" + EOS)


def test_latest_reminder():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "latest_reminder", "content": "today is Monday"},
    ]
    prompt = encode_messages(messages, thinking_mode="chat")
    # A following latest_reminder does not suppress the user's cue (§4.4).
    assert prompt == BOS + USR + "q" + AST + "</think>" + "<｜latest_reminder｜>today is Monday"


def test_unknown_role_is_rejected():
    with pytest.raises(ValueError, match="bogus"):
        encode_messages([{"role": "bogus", "content": "x"}], thinking_mode="chat")


def test_wo_eos_continues_a_partial_assistant_turn():
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "partial ans", "reasoning_content": "hmm",
                 "wo_eos": True}]
    assert encode_messages(messages, thinking_mode="thinking", reasoning_effort=5) == (
        BOS + SYS + effort(5) + USR + "q" + AST + "<think>hmm</think>partial ans"
    )


def test_no_bos_when_disabled_or_with_context():
    user = [{"role": "user", "content": "q"}]
    assert encode_messages(user, add_default_bos_token=False) == USR + "q" + AST + "</think>"
    context = [{"role": "user", "content": "q"}]
    turn = [{"role": "assistant", "content": "a"}]
    assert encode_messages(turn, thinking_mode="chat", context=context) == "a" + EOS


# ---------------------------------------------------------------------------------------------
# §4.3 DSML tool calls
# ---------------------------------------------------------------------------------------------

def _call(name, arguments, call_id=None):
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id:
        call["id"] = call_id
    return call


def test_tool_call_parameter_types_and_whitespace():
    args = {"city": "Zürich", "days": 3, "ratio": 0.5, "metric": True, "tags": ["a", "b"],
            "opts": {"x": None}}
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "Let me check.",
                 "tool_calls": [_call("weather", args), _call("noop", "{}")]}]
    expected_calls = (
        "\n\n<｜DSML｜ calls>\n"
        "<｜DSML｜ invoke name=\"weather\">\n"
        "<｜DSML｜ parameter name=\"city\" string=\"true\">Zürich</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"days\" string=\"false\">3</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"ratio\" string=\"false\">0.5</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"metric\" string=\"false\">true</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"tags\" string=\"false\">[\"a\", \"b\"]</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"opts\" string=\"false\">{\"x\": null}</｜DSML｜ parameter>\n"
        "</｜DSML｜ invoke>\n"
        "<｜DSML｜ invoke name=\"noop\">\n\n</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>"
    )
    prompt = encode_messages(messages, thinking_mode="chat")
    assert prompt == BOS + USR + "q" + AST + "</think>Let me check." + expected_calls + EOS


def test_tool_call_arguments_string_or_object_agree():
    as_text = [{"role": "assistant", "content": "", "tool_calls": [_call("f", '{"a": [1, 2]}')]}]
    as_dict = [{"role": "assistant", "content": "", "tool_calls": [_call("f", {"a": [1, 2]})]}]
    assert encode_messages(as_text) == encode_messages(as_dict)


def test_string_parameters_are_not_escaped():
    messages = [{"role": "assistant", "content": "",
                 "tool_calls": [_call("sh", {"cmd": 'echo "<b>" && ls\n'})]}]
    assert '<｜DSML｜ parameter name="cmd" string="true">echo "<b>" && ls\n</｜DSML｜ parameter>' \
        in encode_messages(messages)


def test_non_object_arguments_are_rejected():
    messages = [{"role": "assistant", "content": "", "tool_calls": [_call("f", '"scalar"')]}]
    with pytest.raises(ValueError, match="JSON object"):
        encode_messages(messages)


# ---------------------------------------------------------------------------------------------
# §4.1.2-3 tool messages merged into user turns and re-ordered
# ---------------------------------------------------------------------------------------------

def test_tool_results_merge_and_follow_call_order():
    messages = [
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "",
         "tool_calls": [_call("weather", {"c": "x"}, "call_a"), _call("time", {}, "call_b")]},
        {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "user", "content": "thanks"},
    ]
    prompt = encode_messages(messages, thinking_mode="chat")
    turn = USR + "<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>\n\nthanks"
    assert prompt.endswith(EOS + turn + AST + "</think>")
    assert prompt.count(USR) == 2


def test_tool_result_list_content():
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [_call("f", {}, "1")]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "1", "content": [
            {"type": "text", "text": "line one"}, {"type": "audio", "data": "…"},
            {"type": "text", "text": "line two"}]}]},
    ]
    prompt = encode_messages(messages, thinking_mode="chat")
    assert prompt.endswith(
        USR + "<tool_result>line one\n\n[Unsupported audio]\n\nline two</tool_result>"
        + AST + "</think>"
    )


def test_consecutive_user_messages_merge():
    messages = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    assert encode_messages(messages) == BOS + USR + "one\n\ntwo" + AST + "</think>"


def test_user_after_task_message_is_not_merged():
    messages = [{"role": "user", "content": "one", "task": "query"},
                {"role": "user", "content": "two"}]
    # The first turn has a following non-assistant message, so no cue or task token there.
    assert encode_messages(messages) == BOS + USR + "one" + USR + "two" + AST + "</think>"


def test_tool_message_with_no_preceding_user_starts_a_user_turn():
    messages = [{"role": "assistant", "content": "", "tool_calls": [_call("f", {}, "1")]},
                {"role": "tool", "tool_call_id": "1", "content": "done"}]
    assert encode_messages(messages, add_default_bos_token=False) == (
        "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
        + EOS + USR + "<tool_result>done</tool_result>" + AST + "</think>"
    )


def test_tools_disable_reasoning_dropping():
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    messages = [
        {"role": "system", "content": "sys", "tools": [tool]},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "", "reasoning_content": "plan",
         "tool_calls": [_call("f", {}, "1")]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
    ]
    prompt = encode_messages(messages, thinking_mode="thinking")
    assert USR + "q1" + AST + "<think>plan</think>\n\n<｜DSML｜ calls>" in prompt
    assert prompt.endswith(USR + "<tool_result>ok</tool_result>" + AST + "<think>")


# ---------------------------------------------------------------------------------------------
# §5 tools block and response format
# ---------------------------------------------------------------------------------------------

TOOLS_TEXT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

SCHEMAS

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

WEATHER = {"name": "get_weather", "description": "Wetter für eine Stadt",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
NOOP = {"name": "noop", "description": "", "parameters": {}}


def test_tools_block_on_system_message():
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": NOOP}]
    schemas = (
        '{"name": "get_weather", "description": "Wetter für eine Stadt", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
        '{"name": "noop", "description": "", "parameters": {}}'
    )
    messages = [{"role": "system", "content": "Be brief.", "tools": tools},
                {"role": "user", "content": "q"}]
    prompt = encode_messages(messages, thinking_mode="chat")
    assert prompt == (
        BOS + SYS + "Be brief.\n\n" + TOOLS_TEXT.replace("SCHEMAS", schemas) + USR + "q" + AST
        + "</think>"
    )


def test_response_format_on_system_message():
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    messages = [{"role": "system", "content": "S", "response_format": schema},
                {"role": "user", "content": "q"}]
    expected_text = (
        "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}'
    )
    assert encode_messages(messages) == BOS + SYS + expected_text + USR + "q" + AST + "</think>"


def test_developer_with_tools_and_response_format():
    tools = [{"type": "function", "function": NOOP}]
    messages = [{"role": "developer", "content": "D", "tools": tools,
                 "response_format": {"type": "json_object"}}]
    schemas = '{"name": "noop", "description": "", "parameters": {}}'
    assert encode_messages(messages) == (
        BOS + USR + "D\n\n" + TOOLS_TEXT.replace("SCHEMAS", schemas)
        + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + '{"type": "json_object"}' + AST + "</think>"
    )


# ---------------------------------------------------------------------------------------------
# §4.4 tasks
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, think", [("chat", "</think>"), ("thinking", "<think>")])
def test_action_task(mode, think):
    prompt = encode_messages([{"role": "user", "content": "act", "task": "action"}],
                             thinking_mode=mode, reasoning_effort=30)
    assert prompt.endswith(USR + "act" + AST + think + "<｜action｜>")


@pytest.mark.parametrize("task, token", [("query", "<｜query｜>"), ("authority", "<｜authority｜>"),
                                         ("domain", "<｜domain｜>"), ("title", "<｜title｜>"),
                                         ("read_url", "<｜read_url｜>")])
def test_other_tasks_write_only_their_token(task, token):
    prompt = encode_messages([{"role": "user", "content": "x", "task": task}])
    assert prompt == BOS + USR + "x" + token


def test_invalid_task():
    with pytest.raises(ValueError, match="task"):
        encode_messages([{"role": "user", "content": "x", "task": "poem"}])


def test_answer_to_a_task_has_no_reasoning():
    messages = [{"role": "user", "content": "x", "task": "query"},
                {"role": "assistant", "content": "q?", "reasoning_content": "hidden"}]
    prompt = encode_messages(messages, thinking_mode="thinking", reasoning_effort=1)
    assert prompt == BOS + SYS + effort(1) + USR + "x<｜query｜>q?" + EOS


# ---------------------------------------------------------------------------------------------
# §4.1.1 images
# ---------------------------------------------------------------------------------------------

def test_image_blocks_are_collected_in_order():
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a.png"}},
        {"type": "text", "text": "compare with"},
        {"type": "image_url", "image_url": "b.png"},
        {"type": "image", "data": "BASE64"},
    ]}]
    prompt, media = encode_messages(messages, return_multi_modal_data=True)
    assert prompt == BOS + USR + f"{IMG}\n\ncompare with\n\n{IMG}\n\n{IMG}" + AST + "</think>"
    assert media == {"images": [{"type": "image", "url": "a.png"},
                                {"type": "image", "url": "b.png"},
                                {"type": "image", "data": "BASE64"}]}


def test_text_only_prompt_has_no_images():
    prompt, media = encode_messages([{"role": "user", "content": "hi"}],
                                    return_multi_modal_data=True)
    assert media == {"images": []}
    assert isinstance(encode_messages([{"role": "user", "content": "hi"}]), str)


def test_image_without_source_is_rejected():
    with pytest.raises(ValueError, match="image"):
        encode_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_literal_marker_in_text_block_or_reasoning_is_rejected():
    with pytest.raises(ValueError, match="image"):
        encode_messages([{"role": "user", "content": [{"type": "text", "text": IMG}]}])
    with pytest.raises(ValueError, match="reasoning_content"):
        encode_messages([{"role": "assistant", "content": "a", "reasoning_content": IMG}])


def test_images_in_tool_results_follow_prompt_order():
    # Results are re-ordered to the call order and their images move with them; a result whose
    # id matches no call sorts as position 0 (stable), so "x" lands between the two calls.
    messages = [
        {"role": "assistant", "content": "",
         "tool_calls": [_call("shot", {}, "first"), _call("shot", {}, "second")]},
        {"role": "tool", "tool_call_id": "second",
         "content": [{"type": "image_url", "image_url": {"url": "2.png"}}]},
        {"role": "tool", "tool_call_id": "first",
         "content": [{"type": "text", "text": "one"},
                     {"type": "image_url", "image_url": {"url": "1.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [
            {"type": "text", "text": "three"}, {"type": "image", "url": "3.png"}]}]},
    ]
    prompt, media = encode_messages(messages, return_multi_modal_data=True)
    assert prompt.endswith(
        USR + f"<tool_result>one\n\n{IMG}</tool_result>\n\n<tool_result>three\n\n{IMG}"
        f"</tool_result>\n\n<tool_result>{IMG}</tool_result>" + AST + "</think>"
    )
    assert [img["url"] for img in media["images"]] == ["1.png", "3.png", "2.png"]


def test_tool_call_arguments_survive_json_round_trip():
    args = {"q": "naïve ☃", "n": [1, {"k": False}]}
    messages = [{"role": "assistant", "content": "", "tool_calls": [_call("f", json.dumps(args))]}]
    prompt = encode_messages(messages, add_default_bos_token=False)
    assert '<｜DSML｜ parameter name="q" string="true">naïve ☃</｜DSML｜ parameter>' in prompt
    assert '<｜DSML｜ parameter name="n" string="false">[1, {"k": false}]</｜DSML｜ parameter>' in prompt


def test_images_of_dropped_messages_are_not_collected():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "see"},
                                          {"type": "image_url", "image_url": "old.png"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": "new.png"}]},
    ]
    prompt, media = encode_messages(messages, thinking_mode="thinking", reasoning_effort=20,
                                    return_multi_modal_data=True)
    assert prompt == BOS + SYS + effort(20) + USR + IMG + AST + "<think>"
    assert media == {"images": [{"type": "image", "url": "new.png"}]}
    _, chat_media = encode_messages(messages, return_multi_modal_data=True)
    assert [img["url"] for img in chat_media["images"]] == ["old.png", "new.png"]


def test_context_renders_only_the_new_messages():
    context = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    ]
    new = [{"role": "user", "content": "q2"}]
    assert encode_messages(new, thinking_mode="thinking", context=context) == \
        USR + "q2" + AST + "<think>"
    assert encode_messages(new, thinking_mode="chat", context=context) == \
        USR + "q2" + AST + "</think>"
