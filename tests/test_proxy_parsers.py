"""Tool-call parser: the exact inverse of the chat template on canonical output, lenient elsewhere."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.common.models import render_chat
from harnessrl.proxy.parsers import HermesParser, ToolCall, get_parser

pytestmark = pytest.mark.unit

P = HermesParser()
USER = [{"role": "user", "content": "go"}]


def roundtrip(msg: dict) -> tuple[str, dict]:
    """The completion text the template implies for ``msg``, and what parsing it gives back."""
    before = render_chat(USER, add_generation_prompt=True)
    after = render_chat(USER + [msg])
    assert after.startswith(before) and after.endswith("<|im_end|>\n")
    text = after[len(before) : -1]  # the engine does not generate the final "\n"
    return text, P.parse(text).message()


def test_plain_text() -> None:
    """A plain answer is all content, no reasoning, no calls."""
    out = P.parse("Hello there.<|im_end|>")
    assert (out.reasoning, out.content, out.tool_calls, out.stopped) == (
        None,
        "Hello there.",
        [],
        True,
    )


def test_reasoning_content_and_two_calls() -> None:
    """Canonical output: reasoning unstripped, one newline before the first call dropped."""
    text = (
        "<think>\n  plan it \n</think>\n\nI'll look.\n<tool_call>\n"
        '{"name": "bash", "arguments": {"command": "ls", "n": 2}}\n</tool_call>\n<tool_call>\n'
        '{"name": "read", "arguments": {}}\n</tool_call><|im_end|>'
    )
    out = P.parse(text)
    assert out.reasoning == "  plan it "
    assert out.content == "I'll look."
    assert out.tool_calls == [
        ToolCall("bash", '{"command": "ls", "n": 2}'),
        ToolCall("read", "{}"),
    ]


def test_arguments_are_passed_on_as_raw_text() -> None:
    """Key order and spacing of the model's arguments survive (the template re-inserts them)."""
    text = '<tool_call>\n{"name": "f", "arguments": {"b":1,  "a": [1,2]}}\n</tool_call><|im_end|>'
    assert P.parse(text).tool_calls == [ToolCall("f", '{"b":1,  "a": [1,2]}')]


def test_unparseable_call_stays_in_content() -> None:
    """Broken JSON is never dropped and never raises: it is content the harness will see."""
    text = 'Try:\n<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call><|im_end|>'
    out = P.parse(text)
    assert out.tool_calls == []
    assert out.content == text.removesuffix("<|im_end|>")


def test_broken_call_before_good_call_stays_in_content() -> None:
    """Only the parseable block becomes a call; the broken one is kept as text."""
    bad = "<tool_call>\nnot json\n</tool_call>"
    good = '<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call>'
    out = P.parse(f"A\n{bad}\n{good}<|im_end|>")
    assert out.tool_calls == [ToolCall("g", '{"x": 1}')]
    assert out.content == f"A\n{bad}"


def test_non_canonical_call_json_is_accepted() -> None:
    """Reordered keys, no newlines, string-encoded arguments: still a call."""
    text = '<tool_call>{"arguments": "{\\"q\\": 1}", "name": "s"}</tool_call>'
    out = P.parse(text)
    assert out.tool_calls == [ToolCall("s", '{"q": 1}')]
    assert out.stopped is False


def test_cut_off_call_is_content() -> None:
    """Output cut by max_new_tokens inside a call: the partial block stays text."""
    text = 'Ok\n<tool_call>\n{"name": "bash", "argu'
    out = P.parse(text)
    assert (out.content, out.tool_calls, out.stopped) == (text, [], False)


def test_unterminated_think() -> None:
    """Cut off while thinking: it is all reasoning."""
    out = P.parse("<think>\nstill going")
    assert (out.reasoning, out.content) == ("still going", "")


def test_think_opened_by_generation_prompt() -> None:
    """Templates that open <think> in the prompt: text before </think> is reasoning."""
    out = P.parse("mulling\n</think>\n\nAnswer<|im_end|>")
    assert (out.reasoning, out.content) == ("mulling", "Answer")


def test_stops_at_endoftext_too() -> None:
    """Either stop token ends the message."""
    assert P.parse("Done<|endoftext|>").content == "Done"


def test_get_parser() -> None:
    """Parsers are found by name; unknown names fail with the known ones listed."""
    assert isinstance(get_parser("qwen"), HermesParser)
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def test_message_format() -> None:
    """The parsed message is in the normalised format, with ids supplied by the API layer."""
    out = P.parse(
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    assert out.message(["call_1"]) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


# ---------------------------------------------------------------------------------------------
# the round trip, over many messages
# ---------------------------------------------------------------------------------------------

_chars = st.sampled_from(list("abcxyz ABC.,:;!?-_/()[]'\"{}\n\t0123456789é中"))
texts = st.lists(_chars, max_size=30).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(texts, json_values, max_size=4).map(
    lambda d: json.dumps(d, ensure_ascii=False)
)
tool_calls = st.lists(
    st.builds(
        lambda n, a: {"type": "function", "function": {"name": n, "arguments": a}},
        st.sampled_from(["bash", "read_file", "edit", "a.b"]),
        arguments,
    ),
    max_size=3,
)


@st.composite
def assistant_messages(draw) -> dict:
    msg: dict = {"role": "assistant", "content": draw(texts)}
    if draw(st.booleans()):
        msg["reasoning_content"] = draw(texts)
    calls = draw(tool_calls)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _meaning(m: dict) -> dict:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
    return {"c": m["content"], "r": m.get("reasoning_content"), "t": calls}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(assistant_messages())
def test_parse_inverts_render(msg: dict) -> None:
    """render(msgs, gen) + text + "\\n" == render(msgs + [parsed]), and parsed == msg."""
    text, parsed = roundtrip(msg)
    assert _meaning(parsed) == _meaning(msg)
    again, _ = roundtrip(parsed)
    assert again == text
