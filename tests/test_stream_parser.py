"""Streaming completion parser (dsv41/server/stream.py): on well-formed completions rendered by
the encoder, the deltas add up to `parse_completion` for every split; text is released early; and
on truncated or corrupted markup no special string reaches content or reasoning, completed calls
carry JSON objects, and the result does not depend on the split (docs/TOKENIZER-AND-CHAT.md §8)."""

import json
import random
import re

import pytest

from dsv41.chat import encode_messages, parse_completion
from dsv41.chat.encoding import (
    BOS,
    CALLS_CLOSE,
    CALLS_OPEN,
    DSML,
    EOS,
    INVOKE_CLOSE,
    THINK_END,
    THINK_START,
    render_tool_calls,
)
from dsv41.server.stream import CompletionStream, Delta

USER = {"role": "user", "content": "question"}
OPENER = f"\n\n{CALLS_OPEN}\n"  # what a prompt for a forced call already ends with
FORBIDDEN = (DSML, BOS, EOS, THINK_START, THINK_END)
RNG_SEED = 41


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CALLS = [
    _call("search", {"query": "naïve ☃ \"quoted\" <b>bold</b>", "limit": 3, "exact": False}),
    _call("write_file", {"path": "/tmp/a<b>.txt", "text": "line 1\nline 2 < 3\n\n  indented\n",
                         "mode": None}),
    _call("noop", {}),
    _call("plot", {"points": [[1, 2.5], [-3, 1e-7]], "style": {"color": "红色", "dash": [2, 1]},
                   "title": "x</y"}),
    # Values are raw (pitfall 7): markup-looking text inside one is data, not markup.
    _call("echo", {"text": "a <think> b </think> <｜DSML｜ invoke name=\"x\">\n", "n": "42"}),
]

# (reasoning, content, calls); chat mode drops the reasoning.
MESSAGES = [
    ("", "Just text.", []),
    ("The capital of France…\nsee <b> and a ｜ bar", "Paris.\nA < B\n\nnew paragraph </thin", []),
    ("plan: call it", "", CALLS[:1]),
    ("two calls", "Checking both.", CALLS[:3]),
    ("", "Ends with a newline\n", CALLS[3:5]),
    ("", "", CALLS[2:3]),
]


def _message(reasoning, content, calls, mode):
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    if mode == "thinking":
        message["reasoning_content"] = reasoning
    return message


def _rendered(message, mode):
    # The completion the model would produce for `message`: its rendering after a user turn.
    return encode_messages([message], thinking_mode=mode, context=[USER])


def _cases():
    # (id, text, thinking, in_calls): complete and truncated (no EOS) completions in both modes,
    # and the forced-call form (text after the opener) where a message has calls and no content.
    cases = []
    for number, (reasoning, content, calls) in enumerate(MESSAGES):
        for mode in ("chat", "thinking"):
            text = _rendered(_message(reasoning, content, calls, mode), mode)
            thinking = mode == "thinking"
            cases.append((f"{number}-{mode}", text, thinking, False))
            cases.append((f"{number}-{mode}-no-eos", text[:-len(EOS)], thinking, False))
        if calls and not content:
            tail = _rendered(_message("", "", calls, "chat"), "chat")[len(OPENER):]
            for thinking in (False, True):
                cases.append((f"{number}-in-calls-{thinking}", tail, thinking, True))
    return cases


CASES = _cases()
CASE_IDS = [case[0] for case in CASES]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _feed(pieces, thinking, in_calls=False):
    stream = CompletionStream(thinking, in_calls)
    deltas = [delta for piece in pieces for delta in stream.push(piece)] + stream.finish()
    return deltas, stream


def _summary(deltas):
    # (reasoning, content, [(name, arguments, ended)] per started call), checking delta order:
    # a call's fragments and end follow its start and come before the next call starts.
    text = {"reasoning": "", "content": ""}
    calls = {}
    for delta in deltas:
        if delta.kind in text:
            assert delta.text, delta
            text[delta.kind] += delta.text
        elif delta.kind == "tool_start":
            assert delta.index == len(calls)
            calls[delta.index] = [delta.name, "", False]
        else:
            assert delta.kind in ("tool_arguments", "tool_end"), delta
            assert calls and delta.index == len(calls) - 1 and not calls[delta.index][2]
            calls[delta.index][1] += delta.text
            calls[delta.index][2] = delta.kind == "tool_end"
    return text["reasoning"], text["content"], [tuple(call) for call in calls.values()]


def _completed(summary):
    return [(name, arguments) for name, arguments, ended in summary[2] if ended]


def _official(text, thinking, in_calls, strict=False):
    if in_calls:
        return parse_completion(OPENER + text, "chat", strict=strict)
    return parse_completion(text, "thinking" if thinking else "chat", strict=strict)


def _as_pairs(tool_calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


def _assert_matches_official(deltas, stream, text, thinking, in_calls):
    parsed = _official(text, thinking, in_calls)
    summary = _summary(deltas)
    assert summary[0] == parsed["reasoning_content"]
    assert summary[1] == parsed["content"]
    assert _completed(summary) == _as_pairs(parsed["tool_calls"])
    assert all(ended for _, _, ended in summary[2])
    assert stream.tool_calls == parsed["tool_calls"]


def _random_pieces(text, rng, most=8):
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, most))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _normal(deltas):
    # Deltas with neighbouring reasoning/content pieces joined: what a split may change.
    joined = []
    for delta in deltas:
        if joined and delta.kind in ("reasoning", "content") and joined[-1].kind == delta.kind:
            delta = Delta(delta.kind, joined.pop().text + delta.text)
        joined.append(delta)
    return joined


def _result(text, thinking=False, in_calls=False, by_char=True):
    # (reasoning, content, completed calls, names of calls started but never ended), the same
    # whole and one character at a time.
    deltas, stream = _feed([text], thinking, in_calls)
    if by_char:
        assert _normal(_feed(list(text), thinking, in_calls)[0]) == _normal(deltas)
    summary = _summary(deltas)
    assert _as_pairs(stream.tool_calls) == _completed(summary)
    unfinished = [name for name, _, ended in summary[2] if not ended]
    return summary[0], summary[1], _completed(summary), unfinished


# ---------------------------------------------------------------------------------------------
# 1. well-formed text: every split adds up to parse_completion
# ---------------------------------------------------------------------------------------------

def test_cases_are_well_formed_and_rendered_by_render_tool_calls():
    for _, text, thinking, in_calls in CASES:
        _official(text, thinking, in_calls, strict=True)
    reasoning, content, calls = MESSAGES[3]
    expected = reasoning + THINK_END + content + render_tool_calls(calls) + EOS
    assert _rendered(_message(reasoning, content, calls, "thinking"), "thinking") == expected


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_split_matches_parse_completion(case):
    _, text, thinking, in_calls = case
    rng = random.Random(RNG_SEED)
    splits = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    splits += [_random_pieces(text, rng, most=40) for _ in range(10)] + [list(text)]
    for pieces in splits:
        deltas, stream = _feed(pieces, thinking, in_calls)
        _assert_matches_official(deltas, stream, text, thinking, in_calls)


def test_parameter_name_backtracks_like_the_official_regex():
    # A closer not followed by its newline fails NAME = "a"; the official regex then tries the
    # next flag on the line, so the name swallows the broken parameter (found by the fuzz test).
    text = (
        OPENER + '<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="false">1'
        '</｜DSML｜ parameter>｜DSML｜ parameter name="b" string="true">x</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS
    )
    parsed = parse_completion(text, "chat", strict=True)
    assert _result(text) == ("", "", _as_pairs(parsed["tool_calls"]), [])
    assert json.loads(parsed["tool_calls"][0]["function"]["arguments"]) == {
        'a" string="false">1</｜DSML｜ parameter>｜DSML｜ parameter name="b': "x"}


def test_arguments_string_is_the_official_one():
    # §8.4: keys and string values quoted, string="false" values verbatim, joined by ", ";
    # a string="false" value that is not JSON becomes a string, as parser.py does.
    text = (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">value</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">2</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="obj" string="false">{"a":[1,2]}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="bad" string="false">not json</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS
    )
    expected = '{"query": "value", "limit": 2, "obj": {"a":[1,2]}, "bad": "not json"}'
    assert _result(text) == ("", "", [("lookup", expected)], [])
    assert _as_pairs(parse_completion(text, "chat")["tool_calls"]) == [("lookup", expected)]


# ---------------------------------------------------------------------------------------------
# 2. early release
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, released", [
    ("abc", "abc"), ("abc\n", "abc"), ("abc\n\n<", "abc"), ("a<b", "a<b"), ("a <｜DS", "a "),
    ("a ｜", "a "), ("x </thi", "x "), ("x<｜end▁of", "x"), ("x\n\n</", "x"), ("x\ny", "x\ny"),
    ("x\n\nyz", "x\n\nyz"), ("1 < 2 and 3 > 2", "1 < 2 and 3 > 2"),
])
def test_prose_waits_only_for_a_tail_that_may_become_markup(text, released):
    for thinking, kind in ((False, "content"), (True, "reasoning")):
        deltas = CompletionStream(thinking).push(text)
        assert "".join(d.text for d in deltas if d.kind == kind) == released
        assert all(d.kind == kind for d in deltas)


def test_reasoning_then_content_as_they_come():
    stream = CompletionStream(thinking=True)
    assert stream.push("I think") == [Delta("reasoning", "I think")]
    assert stream.push(" so</th") == [Delta("reasoning", " so")]
    assert stream.push("ink>Yes") == [Delta("content", "Yes")]
    assert stream.finish() == []


def test_tool_call_deltas_line_by_line():
    text = "Ok" + render_tool_calls([_call("f", {"a": "x", "b": 2})]) + EOS
    stream = CompletionStream(thinking=False)
    got = [stream.push(line) for line in text.splitlines(keepends=True)] + [stream.finish()]
    assert got == [
        [Delta("content", "Ok")],  # "Ok\n": the newline may open the separator
        [],  # "\n"
        [],  # the opener
        [Delta("tool_start", index=0, name="f")],  # the name before any argument
        [Delta("tool_arguments", '{"a": "x"', index=0)],
        [Delta("tool_arguments", ', "b": 2', index=0)],
        [Delta("tool_arguments", "}", index=0), Delta("tool_end", index=0)],
        [],  # the closer and EOS
        [],
    ]
    assert stream.tool_calls == [_call("f", '{"a": "x", "b": 2}')]


def test_text_after_eos_is_ignored():
    stream = CompletionStream(thinking=False)
    assert stream.push("done<｜end▁of") == [Delta("content", "done")]
    assert stream.push("▁sentence｜>more") == []
    assert stream.push("and more") == [] and stream.finish() == []


# ---------------------------------------------------------------------------------------------
# 3. the rules for text that is not well-formed (module docstring, rules 1-8)
# ---------------------------------------------------------------------------------------------

BLOCK_F = render_tool_calls([_call("f", {"a": "x"})])
BLOCK_G = render_tool_calls([_call("g", {})])
F, G = ("f", '{"a": "x"}'), ("g", "{}")
INVOKE_F = BLOCK_F[len(OPENER):-len("\n" + CALLS_CLOSE)] + "\n"
INVOKE_G = BLOCK_G[len(OPENER):-len("\n" + CALLS_CLOSE)] + "\n"


def test_a_block_without_the_blank_line():
    assert _result(BLOCK_F.lstrip("\n") + EOS) == ("", "", [F], [])
    assert _result("Sure." + BLOCK_F.lstrip("\n") + EOS) == ("", "Sure.", [F], [])
    assert _result("Sure.\n" + BLOCK_F.lstrip("\n") + EOS) == ("", "Sure.\n", [F], [])


def test_b_invokes_without_the_opener():
    assert _result("Sure.\n\n" + INVOKE_F + CALLS_CLOSE + EOS) == ("", "Sure.", [F], [])
    assert _result("Sure.\n\n" + INVOKE_F + INVOKE_G + EOS) == ("", "Sure.", [F, G], [])


def test_c_truncated_calls_complete_only_at_their_closer():
    text = "Sure." + render_tool_calls([CALLS[0], CALLS[1]]) + EOS
    full = _as_pairs(parse_completion(text, "chat", strict=True)["tool_calls"])
    closer_ends = [m.end() for m in re.finditer(re.escape(INVOKE_CLOSE), text)]
    for cut in range(len(text) + 1):
        _, content, calls, unfinished = _result(text[:cut], by_char=False)
        done = sum(end <= cut for end in closer_ends)
        assert calls == full[:done], cut
        assert len(unfinished) <= 1
        # A tail that has not become a tag is text (as in parse_completion), then the tag hides
        # it; so is a part of EOS.
        tagged = len("Sure.\n\n<" + DSML) <= cut <= len(text) - len(EOS)
        assert content == ("Sure." if tagged else text[:cut]) or cut > len(text) - len(EOS)


MALFORMED = {
    # name: (block, completed calls, started but dropped); " After." follows the block
    "bad attribute name": (BLOCK_F.replace('invoke name=', 'invoke nam='), [], []),
    "missing quotes": (BLOCK_F.replace('name="f"', "name=f"), [], []),
    "bad string flag": (BLOCK_F.replace('string="true"', 'string="yes"'), [], ["f"]),
    "unknown tag in an invoke": (
        BLOCK_F.replace('f">\n', 'f">\n<｜DSML｜ note>hi</｜DSML｜ note>\n'), [], ["f"]),
    "parameter outside an invoke": (
        OPENER + '<｜DSML｜ parameter name="a" string="true">x</｜DSML｜ parameter>\n' + CALLS_CLOSE,
        [], []),
    "garbage between invokes": (OPENER + INVOKE_F + "junk\n" + INVOKE_G + CALLS_CLOSE, [F, G], []),
    "duplicate parameter": (
        BLOCK_F.replace("parameter>\n", 'parameter>\n<｜DSML｜ parameter name="a" string="true">'
                        "y</｜DSML｜ parameter>\n"), [], ["f"]),
    "missing invoke closer": (
        OPENER + INVOKE_F.replace(INVOKE_CLOSE + "\n", "") + INVOKE_G + CALLS_CLOSE, [G], ["f"]),
    "missing newline after a parameter": (
        BLOCK_F.replace("parameter>\n", "parameter>"), [], ["f"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_d_malformed_markup_is_hidden(case):
    block, calls, dropped = MALFORMED[case]
    assert _result("Sure." + block + " After." + EOS) == ("", "Sure. After.", calls, dropped)


def test_d_a_block_that_never_closes_hides_the_rest():
    unspaced = BLOCK_F.replace("｜DSML｜ ", "｜DSML｜")  # V4-style tags (pitfall 6)
    assert _result("Sure." + unspaced + " After." + EOS) == ("", "Sure.", [], [])
    assert _result("Sure." + BLOCK_F[:-len(CALLS_CLOSE)] + " After.") == ("", "Sure.", [F], [])


def test_d_a_dropped_call_keeps_its_index():
    text = "Sure." + OPENER + INVOKE_F.replace("</", "<", 1) + INVOKE_G + CALLS_CLOSE
    deltas, stream = _feed([text], thinking=False)
    assert [d for d in deltas if d.kind == "tool_start"] == [
        Delta("tool_start", index=0, name="f"), Delta("tool_start", index=1, name="g")]
    assert stream.tool_calls == [_call("g", "{}")]


def test_d_markup_in_prose_hides_the_rest_until_a_block_closer():
    tag = '<｜DSML｜ parameter name="a" string="true">x</｜DSML｜ parameter>\n'
    assert _result("Sure. " + tag + "More." + EOS) == ("", "Sure. ", [], [])
    assert _result("Sure. " + tag + CALLS_CLOSE + "More." + EOS) == ("", "Sure. More.", [], [])
    assert _result("A" + CALLS_CLOSE + "B") == ("", "AB", [], [])


def test_e_prose_between_blocks():
    text = "A" + BLOCK_F + "Then prose." + BLOCK_G + " end" + EOS
    assert _result(text) == ("", "AThen prose. end", [F, G], [])
    assert _result(BLOCK_F + "\nAfter" + EOS) == ("", "\nAfter", [F], [])


@pytest.mark.parametrize("text, content", [
    ("a ｜DSML｜ b", "a  b"),
    ("x <think> y", "x  y"),
    (f"x {BOS}y", "x y"),
    ("a </think> b", "a  b"),
    ("<<think>think>", ""),  # the join spells <think> again: removed too
    ("｜DS｜DSML｜ML｜ after", " after"),
    ("</thi<think>nk>!", "!"),
    ("<｜end▁of<think>▁sentence｜>after", "after"),  # an EOS spelled by a join is no EOS
    ("keep ｜DSML｜ calls> this", "keep  calls> this"),
])
def test_f_stray_special_strings_are_removed(text, content):
    assert _result(text + EOS) == ("", content, [], [])


def test_g_reasoning():
    assert _result("still thinking", thinking=True) == ("still thinking", "", [], [])
    assert _result("r</think>a</think>b" + EOS, thinking=True) == ("r", "ab", [], [])
    assert _result("r</th<think>ink>c", thinking=True) == ("r", "c", [], [])
    # Markup in reasoning never makes a call; it is hidden to its block closer or </think>.
    assert _result("plan" + BLOCK_F + " more</think>answer", thinking=True) == (
        "plan more", "answer", [], [])
    assert _result("plan\n\n" + INVOKE_F + "</think>answer" + BLOCK_G, thinking=True) == (
        "plan", "answer", [G], [])


def test_in_calls_starts_inside_a_block_in_both_modes():
    for thinking in (False, True):
        assert _result(INVOKE_F + CALLS_CLOSE + EOS, thinking, in_calls=True) == ("", "", [F], [])
        truncated = INVOKE_F[:-len(INVOKE_CLOSE + "\n")] + "</｜DSML｜ inv"
        assert _result(truncated, thinking, in_calls=True) == ("", "", [], ["f"])


def test_eos_inside_a_value_ends_the_completion():
    # parse_completion reads on through an EOS inside a value; a stream cannot: the engine stops.
    text = BLOCK_F.replace(">x<", ">x" + EOS + "y<") + EOS
    assert _result(text) == ("", "", [], ["f"])
    official = parse_completion(text, "chat", strict=True)["tool_calls"]
    assert _as_pairs(official) == [("f", '{"a": "x' + EOS + 'y"}')]


# ---------------------------------------------------------------------------------------------
# 4. fuzz: truncations and corruptions of real renderings
# ---------------------------------------------------------------------------------------------

INSERTS = ['"', "<", ">", "/", "\n", " ", "=", "｜", "\n\n", DSML, "<" + DSML, "</" + DSML,
           THINK_START, THINK_END, BOS, EOS, " string=\"true\">", INVOKE_CLOSE, CALLS_CLOSE, "é"]


def _corrupt(text, rng):
    # One to three edits, mostly near tag punctuation.
    marks = [i for i, ch in enumerate(text) if ch in '<>"=\n｜/']
    for _ in range(rng.randint(1, 3)):
        at = rng.choice(marks) + rng.randint(-2, 2) if marks and rng.random() < 0.7 else None
        at = min(max(at if at is not None else rng.randrange(len(text) + 1), 0), len(text))
        edit = rng.choice(("delete", "insert", "duplicate"))
        if edit == "delete":
            text = text[:at] + text[at + rng.randint(1, 3):]
        elif edit == "insert":
            text = text[:at] + rng.choice(INSERTS) + text[at:]
        else:
            text = text[:at] + text[at:at + rng.randint(1, 12)] + text[at:]
    return text


def _well_formed(text, thinking, in_calls):
    # The official parser accepts it strictly, and EOS, if any, is its last token.
    if EOS in text[:-len(EOS)]:
        return False
    try:
        _official(text, thinking, in_calls, strict=True)
    except ValueError:
        return False
    return True


def _check(text, thinking, in_calls, rng, splits=2):
    deltas, stream = _feed([text], thinking, in_calls)
    for most in (8, 30)[:splits]:
        pieces = _random_pieces(text, rng, most)
        assert _normal(_feed(pieces, thinking, in_calls)[0]) == _normal(deltas), pieces
    summary = _summary(deltas)
    texts = [d.text for d in deltas if d.kind in ("reasoning", "content")]
    for visible in [summary[0], summary[1], *texts]:
        assert not any(token in visible for token in FORBIDDEN), (text, visible)
    for _, arguments in _completed(summary):
        assert isinstance(json.loads(arguments), dict)
    if _well_formed(text, thinking, in_calls):
        _assert_matches_official(deltas, stream, text, thinking, in_calls)
    return summary


CALL_CASES = [case for case in CASES if "calls" in case[1] or case[3]]
# Truncations of a complete text cover those of its no-EOS twin.
COMPLETE_CALL_CASES = [case for case in CALL_CASES if case[1].endswith(EOS)]


@pytest.mark.parametrize("case", COMPLETE_CALL_CASES, ids=[c[0] for c in COMPLETE_CALL_CASES])
def test_fuzz_truncations(case):
    # A truncated completion holds the calls whose closer it reaches (rule 3).
    _, text, thinking, in_calls = case
    rng = random.Random(RNG_SEED)
    calls = _as_pairs(_official(text, thinking, in_calls, strict=True)["tool_calls"])
    closer_ends = [m.end() for m in re.finditer(re.escape(INVOKE_CLOSE), text)]
    for cut in range(len(text) + 1):
        summary = _check(text[:cut], thinking, in_calls, rng, splits=1)
        assert _completed(summary) == calls[:sum(end <= cut for end in closer_ends)]


@pytest.mark.parametrize("case", CALL_CASES, ids=[case[0] for case in CALL_CASES])
def test_fuzz_corruptions(case):
    _, text, thinking, in_calls = case
    rng = random.Random(RNG_SEED)
    for _ in range(150):
        _check(_corrupt(text, rng), thinking, in_calls, rng)


def _fragments(strings):
    # Both parts of every split of each string.
    return [part for s in strings for n in range(1, len(s)) for part in (s[:n], s[n:])]


def test_fuzz_special_string_fragments():
    # Prose made of special strings, tags and their pieces: removals and hidden blocks join what
    # is around them, and no join may spell a special string in content or reasoning (rule 6).
    strings = [BOS, EOS, DSML, THINK_START, THINK_END, "<" + DSML, CALLS_CLOSE]
    atoms = strings + _fragments(strings) + ["<", "</", "｜", "\n", "\n\n", " calls>\n", "a"]
    rng = random.Random(RNG_SEED)
    for _ in range(800):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 12)))
        for thinking in (False, True):
            _check(text, thinking, False, rng)
