"""Token-in-token-out: prompts extend the ids the engine sampled, and equal a full render when
nobody re-serialised anything. Each seam of proxy/tito.py's docstring has its own test."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from harnessrl.common import metrics
from harnessrl.common.models import CHAT_TEMPLATE, load_tokenizer
from harnessrl.proxy import tito
from harnessrl.proxy.parsers import HermesParser
from harnessrl.proxy.tito import ChatRenderer, Tito, TitoSession, canonical_json, normalize_messages

pytestmark = pytest.mark.unit

TOK = load_tokenizer("tiny-1m")
R = ChatRenderer(TOK)
P = HermesParser()
IM_END, EOT = 2, 0
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
START = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List files."},
]


QWEN3ISH = CHAT_TEMPLATE.replace(
    "{%- for message in messages %}",
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}",
    1,
).replace(
    "{%- if reasoning is not none %}",
    "{%- if reasoning is not none and loop.index0 > ns.last_user %}",
)
"""The built-in template, dropping reasoning before the last user message like Qwen3's."""


def _counting_tool_results(marker: str = "") -> str:
    """The built-in template, numbering tool results across the whole conversation (every
    one when ``marker`` is empty, else only once a tool result containing ``marker`` was seen):
    how a turn renders depends on turns far before it."""
    counted = "true" if not marker else "false"
    template = CHAT_TEMPLATE.replace(
        "{%- for message in messages %}",
        f"{{%- set ns = namespace(k=0, on={counted}) %}}{{%- for message in messages %}}",
        1,
    ).replace(
        "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}",
        "{%- set ns.k = ns.k + 1 %}{{- '\\n<tool_response>' }}"
        "{%- if ns.on %}{{- ' #' + ns.k|string }}{%- endif %}"
        "{{- '\\n' + content + '\\n</tool_response>' }}"
        + (
            f"{{%- if '{marker}' in content %}}{{%- set ns.on = true %}}{{%- endif %}}"
            if marker
            else ""
        ),
    )
    assert template.count("ns.k + 1") == 1
    return template


def enc(text: str) -> list[int]:
    return R.encode(text)


def full_ids(msgs: list[dict], tools=TOOLS) -> list[int]:
    return enc(R.render(msgs, tools, True))


def canonical_output(input_ids: list[int], msgs: list[dict], reply: dict, tools=TOOLS):
    """The ids a model trained on full renders samples for ``reply`` (ending in <|im_end|>), or
    None when the full render does not extend ``input_ids`` (a BPE merge at the prompt end)."""
    ids = enc(R.render(msgs + [reply], tools, False))
    if ids[: len(input_ids)] != input_ids:
        return None
    tail = ids[len(input_ids) :]
    assert tail[-2:] == [IM_END, *enc("\n")]
    return tail[:-1]


def call(session: TitoSession, seq: int, msgs: list[dict], output: list[int], tools=TOOLS):
    """One proxy call: prepare, 'sample' ``output``, parse it, commit. Returns (prompt, reply)."""
    prompt = session.prepare(msgs, tools)
    reply = P.parse(R.decode(output)).message()
    session.commit(seq, prompt, output, reply)
    return prompt, reply


def bash_call(command: str, content: str = "") -> dict:
    args = json.dumps({"command": command})
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "bash", "arguments": args}}
        ],
    }


def out_text(text: str) -> list[int]:
    """Output ids for a completion text written canonically plus <|im_end|>."""
    return enc(text) + [IM_END]


# ---------------------------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------------------------


def test_first_call_is_a_full_render() -> None:
    """The first call of a rollout renders in full and is neither a hit nor a miss."""
    s = TitoSession(R)
    p = s.prepare(START, TOOLS)
    assert p.input_ids == full_ids(START)
    assert (p.kind, p.anchor_seq) == ("first", -1)


def test_first_is_per_track() -> None:
    """A title (aux) request that succeeded first does not make the first main call a miss;
    a second, unrelated main call is one."""
    s = TitoSession(R)
    title = [{"role": "system", "content": "Generate a title."}, {"role": "user", "content": "x"}]
    t = s.prepare(title, None, track="aux")
    assert t.kind == "first"
    s.commit(0, t, R.encode("Title<|im_end|>"))
    main = s.prepare(START, TOOLS)
    assert main.kind == "first"
    s.commit(1, main, R.encode("ok<|im_end|>"))
    other = [{"role": "user", "content": "something else entirely"}]
    assert s.prepare(other, TOOLS).kind == "miss"


def test_echoed_history_extends_input_and_output() -> None:
    """Call 1's ids are call 0's input + output + "\\n" + the new turn + generation prompt."""
    s = TitoSession(R)
    out = out_text('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')
    p0, reply = call(s, 0, START, out)
    msgs = START + [reply, {"role": "tool", "content": "a.py"}]
    p1 = s.prepare(msgs, TOOLS)
    assert (p1.kind, p1.anchor_seq, p1.anchor_kind) == ("hit", 0, "reply")
    assert p1.input_ids[: len(p0.input_ids) + len(out)] == p0.input_ids + out
    assert p1.input_ids == full_ids(msgs)


def test_hazard_im_end_without_newline_is_spliced_exactly() -> None:
    """The engine stops on <|im_end|>; exactly the template's "\\n" follows it, nothing else."""
    s = TitoSession(R)
    out = out_text("Two files.")
    p0, reply = call(s, 0, START, out)
    msgs = START + [reply, {"role": "user", "content": "Thanks"}]
    p1 = s.prepare(msgs, TOOLS)
    n = len(p0.input_ids) + len(out)
    assert p1.input_ids[n - 1 : n + 2] == [IM_END, *enc("\n"), 1]  # <|im_end|> \n <|im_start|>


def test_hazard_output_cut_by_length_is_closed_like_the_template() -> None:
    """No stop token: the template's whole turn end (<|im_end|>\\n) is spliced after the ids."""
    s = TitoSession(R)
    out = enc("I will now list the fi")  # max_new_tokens reached mid-word
    p0, reply = call(s, 0, START, out)
    assert reply["content"] == "I will now list the fi"
    msgs = START + [reply, {"role": "user", "content": "go on"}]
    p1 = s.prepare(msgs, TOOLS)
    n = len(p0.input_ids) + len(out)
    assert p1.input_ids[:n] == p0.input_ids + out
    assert p1.input_ids[n : n + 2] == [IM_END, *enc("\n")]


def test_hazard_other_stop_token_is_kept_then_turn_end() -> None:
    """Stopped on <|endoftext|> (a stop id the template does not write): the sampled token is
    kept (never altered or dropped) and the template's whole turn end (<|im_end|>\\n) follows,
    so the next input extends input+output; only that token differs from a full render."""
    s = TitoSession(R)
    out = enc("Done.") + [EOT]
    p0, reply = call(s, 0, START, out)
    assert reply["content"] == "Done."
    msgs = START + [reply, {"role": "user", "content": "ok"}]
    p1 = s.prepare(msgs, TOOLS)
    n = len(p0.input_ids) + len(out)
    assert p1.hit and not p1.false_fork and p1.reused == n
    assert p1.input_ids[:n] == p0.input_ids + out
    assert p1.input_ids[n : n + 2] == [IM_END, *enc("\n")]
    assert p1.input_ids[: n - 1] + p1.input_ids[n:] == full_ids(msgs)


@pytest.mark.parametrize("end", ["im_end", "endoftext", "length"])
def test_every_turn_end_extends_input_and_output(end: str) -> None:
    """Over a few turns ending each way, every call's ids start with the previous call's
    input + output exactly, followed by exactly what the template writes to close the turn."""
    s = TitoSession(R)
    msgs, prev = list(START), None
    for seq in range(4):
        p = s.prepare(msgs, TOOLS)
        if prev is not None:
            head, closing = prev
            assert p.hit and not p.false_fork and p.input_ids[: len(head)] == head
            assert p.input_ids[len(head) : len(head) + len(closing)] == closing
        text = enc(f"Answer number {seq}.")
        out = {"im_end": text + [IM_END], "endoftext": text + [EOT], "length": text}[end]
        reply = P.parse(R.decode(out)).message()
        s.commit(seq, p, out, reply)
        prev = (p.input_ids + out, enc("\n") if end == "im_end" else [IM_END, *enc("\n")])
        msgs = msgs + [reply, {"role": "user", "content": f"go on {seq}"}]
    assert s.counts == {"first": 1, "hit": 3, "miss": 0} and s.false_forks == 0


def test_hazard_consecutive_tool_results_form_one_turn() -> None:
    """Two results render as ONE user turn: a request ending in the first is not a prefix of one
    with both; TITO falls back to the reply anchor and still equals the full render."""
    s = TitoSession(R)
    two = (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>'
    )
    _, reply = call(s, 0, START, out_text(two))
    partial = START + [reply, {"role": "tool", "content": "a.py"}]
    p1 = s.prepare(partial, TOOLS)  # a harness that sent the first result alone, then failed
    s.commit(1, p1)  # no reply: only its request is remembered
    both = partial + [{"role": "tool", "content": "/work"}]
    p2 = s.prepare(both, TOOLS)
    assert (p2.kind, p2.anchor_seq, p2.anchor_kind) == ("hit", 0, "reply")
    assert p2.input_ids == full_ids(both)
    assert "</tool_response>\n<tool_response>" in R.decode(p2.input_ids)


def test_hazard_bpe_merge_keeps_the_sampled_ids() -> None:
    """The model sampled a tokenization BPE would not produce: TITO keeps the sampled ids and
    encodes the new part on its own (a full render would re-merge them)."""
    s = TitoSession(R)
    word = "Hello"
    out = [t for ch in word for t in enc(ch)] + [IM_END]  # one id per character
    assert out[:-1] != enc(word)
    p0, reply = call(s, 0, START, out)
    msgs = START + [reply, {"role": "user", "content": "again"}]
    p1 = s.prepare(msgs, TOOLS)
    assert p1.input_ids[: len(p0.input_ids) + len(out)] == p0.input_ids + out
    assert p1.input_ids != full_ids(msgs)
    rest = R.render(msgs, TOOLS, True)[len(R.render(msgs[:3], TOOLS, False)) :]
    assert p1.input_ids == p0.input_ids + out + enc("\n" + rest)


def test_hazard_prompt_boundary_merge() -> None:
    """Content starting with a newline: BPE of a full render merges it with the prompt's "\\n";
    TITO keeps the sampled split."""
    s = TitoSession(R)
    out = enc("\nIndented answer") + [IM_END]
    p0, reply = call(s, 0, START, out)
    msgs = START + [reply, {"role": "user", "content": "ok"}]
    p1 = s.prepare(msgs, TOOLS)
    assert p1.input_ids[: len(p0.input_ids) + len(out)] == p0.input_ids + out


def test_reserialised_tool_call_still_matches() -> None:
    """Harness rewrote the call: new id, reordered keys, other spacing, arguments as a dict."""
    s = TitoSession(R)
    out = out_text(
        'Let me check.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls", "cwd": "/w"}}'
        "\n</tool_call>"
    )
    p0, _ = call(s, 0, START, out)
    echo = {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {
                "id": "callabc",
                "type": "function",
                "function": {"name": "bash", "arguments": {"cwd": "/w", "command": "ls"}},
            }
        ],
    }
    msgs = normalize_messages(
        START + [echo, {"role": "tool", "tool_call_id": "callabc", "content": "x"}]
    )
    p1 = s.prepare(msgs, TOOLS)
    assert p1.hit and p1.input_ids[: p1.reused] == p0.input_ids + out
    msgs[2]["tool_calls"][0]["function"]["arguments"] = '{ "cwd" : "/w",\n "command":"ls" }'
    assert s.prepare(msgs, TOOLS).input_ids == p1.input_ids


def test_harness_dropping_reasoning_still_matches() -> None:
    """Chat-completions harnesses do not send reasoning back: the sampled reasoning stays."""
    s = TitoSession(R)
    out = out_text("<think>\nsecret plan\n</think>\n\nSure.")
    p0, reply = call(s, 0, START, out)
    assert reply["reasoning_content"] == "secret plan"
    msgs = START + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "and?"}]
    p1 = s.prepare(msgs, TOOLS)
    assert p1.hit and "secret plan" in R.decode(p1.input_ids)


def test_changed_reasoning_or_content_is_a_miss() -> None:
    """A history that says something else than what was sampled is a fork: full render, counted."""
    s = TitoSession(R)
    _, reply = call(s, 0, START, out_text("<think>\nA\n</think>\n\nSure."))
    other = dict(reply, reasoning_content="B")
    p1 = s.prepare(START + [other, {"role": "user", "content": "x"}], TOOLS)
    assert p1.kind == "miss" and p1.input_ids == full_ids(
        START + [other, {"role": "user", "content": "x"}]
    )
    s.commit(1, p1)
    edited = dict(reply, content="Sure!")
    p2 = s.prepare(START + [edited, {"role": "user", "content": "x"}], TOOLS)
    assert p2.kind == "miss" and not p2.false_fork  # a real fork: the meaning changed
    s.commit(2, p2)
    assert s.counts == {"first": 1, "miss": 2, "hit": 0} and s.false_forks == 0


def test_prepare_counts_nothing_failed_calls_leave_no_trace() -> None:
    """Only committed (successful) calls count: prompts prepared for calls that then failed
    (engine down, error) are neither misses nor anchors, and when every earlier call failed
    the next one is still the rollout's first."""
    s = TitoSession(R)
    before = metrics.sample_value("hrl_proxy_tito_total", {"result": "miss"})
    assert s.prepare(START, TOOLS).kind == "first"  # failed: never committed
    p = s.prepare(START, TOOLS)  # the harness retries
    assert p.kind == "first" and s.counts == {"first": 0, "miss": 0, "hit": 0}
    out = out_text("Hi.")
    reply = P.parse(R.decode(out)).message()
    s.commit(1, p, out, reply)
    msgs = START + [reply, {"role": "user", "content": "x"}]
    for _ in range(3):  # three failed attempts of the next call
        assert s.prepare(msgs, TOOLS).kind == "hit"
    assert s.counts == {"first": 1, "miss": 0, "hit": 0} and len(s.anchors) == 2
    assert metrics.sample_value("hrl_proxy_tito_total", {"result": "miss"}) == before


def test_hit_is_never_a_false_fork() -> None:
    """Call 1 re-rendered call 0's reply (the harness changed its reasoning): a real fork.
    Call 2 sends call 0's reply again without reasoning; the longest anchor is call 1's request,
    whose ids do not extend call 0's input+output: a false fork, counted, never a hit."""
    s = TitoSession(R)
    forks = metrics.sample_value("hrl_proxy_false_forks_total")
    out = out_text("<think>\nA\n</think>\n\nSure.")
    p0, reply = call(s, 0, START, out)
    edited = START + [dict(reply, reasoning_content="B"), {"role": "user", "content": "x"}]
    p1 = s.prepare(edited, TOOLS)
    assert p1.kind == "miss" and not p1.false_fork
    s.commit(1, p1)
    dropped = START + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "x"}]
    p2 = s.prepare(dropped, TOOLS)
    assert (p2.anchor_seq, p2.anchor_kind) == (1, "request")
    assert p2.input_ids[: len(p0.input_ids) + len(out)] != p0.input_ids + out
    assert p2.false_fork and p2.kind == "miss" and not p2.hit
    s.commit(2, p2)
    assert s.false_forks == 1 and s.counts["miss"] == 2
    assert metrics.sample_value("hrl_proxy_false_forks_total") == forks + 1


def test_changed_tools_is_a_miss() -> None:
    """Tools are part of the prompt: another tool set cannot reuse the ids."""
    s = TitoSession(R)
    _, reply = call(s, 0, START, out_text("Hi."))
    msgs = START + [reply, {"role": "user", "content": "x"}]
    assert s.prepare(msgs, TOOLS + [{"type": "function", "function": {"name": "y"}}]).kind == "miss"
    reordered = [{"function": TOOLS[0]["function"], "type": "function"}]
    assert s.prepare(msgs, reordered).kind == "hit"


def test_retry_of_same_request_reuses_its_input() -> None:
    """A harness retry (after a 503) gets the very same ids, so the tree sees one prefix."""
    s = TitoSession(R)
    _, reply = call(s, 0, START, out_text("Hi."))
    msgs = START + [reply, {"role": "user", "content": "x"}]
    p1 = s.prepare(msgs, TOOLS)
    s.commit(1, p1)  # answered without a reply the harness kept: it sends the request again
    p2 = s.prepare(msgs, TOOLS)
    assert (p2.anchor_seq, p2.anchor_kind, p2.input_ids) == (1, "request", p1.input_ids)


def test_earliest_started_longest_match_wins() -> None:
    """Two calls with the same request and the same reply: the earlier one is the anchor."""
    s = TitoSession(R)
    out = out_text("Same.")
    call(s, 0, START, out)
    _, reply = call(s, 1, START, out)
    p = s.prepare(START + [reply, {"role": "user", "content": "x"}], TOOLS)
    assert (p.anchor_seq, p.anchor_kind) == (0, "reply")


def test_fork_from_an_earlier_turn() -> None:
    """A branch from turn 1 (e.g. a sub-agent resumed from history) extends call 0, not call 1."""
    s = TitoSession(R)
    _, r0 = call(s, 0, START, out_text("One."))
    m1 = START + [r0, {"role": "user", "content": "next"}]
    _, r1 = call(s, 1, m1, out_text("Two."))
    fork = START + [r0, {"role": "user", "content": "other"}]
    p = s.prepare(fork, TOOLS)
    assert (p.kind, p.anchor_seq) == ("hit", 0) and p.input_ids == full_ids(fork)


def test_hazard_template_that_drops_earlier_reasoning() -> None:
    """Qwen3-style templates drop <think> before the last user query: the new part is still
    found (reasoning blanked on both sides) and the sampled reasoning stays in the ids."""
    r = ChatRenderer(TOK, template=QWEN3ISH)
    s = TitoSession(r)
    out = r.encode("<think>\nhidden\n</think>\n\nAnswer.") + [IM_END]
    p0 = s.prepare(START, None)
    reply = P.parse(r.decode(out)).message()
    s.commit(0, p0, out, reply)
    msgs = START + [reply, {"role": "user", "content": "more"}]
    assert "hidden" not in r.render(msgs, None, True)  # the template drops it...
    p1 = s.prepare(msgs, None)
    assert p1.hit and p1.input_ids[: p1.reused] == p0.input_ids + out  # ...TITO keeps it
    assert r.decode(p1.input_ids).endswith(
        "Answer.<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sessions_are_per_rollout() -> None:
    """Tito keeps one session per rollout id; another rollout never reuses its ids."""
    tito = Tito(R)
    a, b = tito.session("r-0-1"), tito.session("r-1-1")
    call(a, 0, START, out_text("Hi."))
    assert b.prepare(START, TOOLS).kind == "first"
    assert tito.session("r-0-1") is a
    tito.drop("r-0-1")
    assert tito.session("r-0-1") is not a


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(max_size=40),
            st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n\n", "  ", "é😀"]),
        ),
        max_size=12,
    )
)
def test_renderer_encode_equals_the_tokenizers_own_encode(parts: list[str]) -> None:
    """The renderer's fast path (no offsets) gives the tokenizer's own ids, special tokens
    included, and so does its fallback for a tokenizer without one."""
    text = "".join(parts)
    want = list(TOK.encode(text, add_special_tokens=False))
    assert R._fast is not None and R.encode(text) == want
    slow = ChatRenderer(TOK)
    slow._fast = None
    assert slow.encode(text) == want


@given(
    st.lists(
        st.one_of(
            st.text(max_size=40),
            st.sampled_from(["<|im_start|>", "<|im_end|>", " " * 300, "=" * 200, "é😀", "\n\n"]),
            st.sampled_from(list(TOK.get_vocab())),
        ),
        max_size=30,
    )
)
def test_at_least_is_a_lower_bound_on_the_ids(parts: list[str]) -> None:
    """``at_least(text)`` never exceeds the ids ``text`` encodes to, long runs of spaces,
    special tokens and the longest vocabulary entries included (the bound by which a prompt
    certain to overflow the context is refused unencoded)."""
    text = "".join(parts)
    assert R.max_token_chars >= len("<|endoftext|>")
    assert R.at_least(text) <= len(R.encode(text))


def test_prompt_certain_to_overflow_is_refused_unencoded(monkeypatch) -> None:
    """With ``max_ids``, a text whose length alone makes the prompt too long raises
    `PromptTooLong` and is never encoded; one that fits is encoded as before."""
    s = TitoSession(R)
    fits = s.prepare(START, TOOLS, max_ids=4096)
    assert fits.ids.tolist() == R.encode(R.render(START, TOOLS, gen=True))
    encoded: list[int] = []
    monkeypatch.setattr(R, "encode", lambda text: encoded.append(len(text)) or [])
    huge = [*START, {"role": "user", "content": "x" * 5_000_000}]
    with pytest.raises(tito.PromptTooLong) as e:
        s.prepare(huge, TOOLS, max_ids=4096)
    assert e.value.at_least >= 4096 and encoded == []


def test_canonical_json() -> None:
    """Key order and whitespace do not matter; invalid JSON compares as stripped text."""
    assert canonical_json('{"b": 1, "a": [1, 2]}') == canonical_json('{"a":[1,2],\n"b":1}')
    assert canonical_json(" not json ") == "not json"


def test_normalize_messages() -> None:
    """Parts concatenate, None is "", dict arguments become the template's JSON text."""
    msgs = normalize_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, "b"]},
            {
                "role": "assistant",
                "content": None,
                "reasoning": "r",
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": {"x": "é"}}}],
            },
            {"role": "tool", "tool_call_id": "1", "content": "ok"},
        ]
    )
    assert msgs == [
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r",
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": "é"}'},
                }
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "1"},
    ]


# ---------------------------------------------------------------------------------------------
# invariants over random conversations
# ---------------------------------------------------------------------------------------------

_chars = st.sampled_from(list("abcdefxyz ABC.,:;!?-_/()[]'\"{}\n\t0123456789é中"))
texts = st.lists(_chars, max_size=24).map("".join)
words = st.lists(st.sampled_from(["ls", "cat a.py", "echo hi", "pytest -q", "", "x y"]), min_size=1)
args = st.dictionaries(
    st.sampled_from(["command", "path", "n", "flag"]), texts | st.integers(), max_size=3
)


@st.composite
def replies(draw, text: st.SearchStrategy[str] = texts) -> dict:
    msg: dict = {"role": "assistant", "content": draw(text)}
    if draw(st.booleans()):
        msg["reasoning_content"] = draw(text)
    n = draw(st.integers(0, 3))
    if n:
        msg["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "arguments": json.dumps(draw(args), ensure_ascii=False),
                },
            }
            for _ in range(n)
        ]
    return msg


@st.composite
def conversations(
    draw, text: st.SearchStrategy[str] = texts
) -> tuple[list[dict], list | None, list[tuple[dict, list[dict]]]]:
    """Random agent conversations; ``text``: the strategy of every message text."""
    start = [{"role": "user", "content": draw(text)}]
    if draw(st.booleans()):
        start.insert(0, {"role": "system", "content": draw(text)})
    tools = draw(st.sampled_from([None, TOOLS]))
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        reply = draw(replies(text))
        new = [{"role": "tool", "content": draw(text)} for _ in reply.get("tool_calls", [])]
        if not new or draw(st.booleans()):  # Claude Code adds user text after tool results
            new.append({"role": "user", "content": draw(text)})
        steps.append((reply, new))
    return start, tools, steps


def _rewrite(msg: dict, rnd: random.Random) -> dict:
    """How harnesses re-serialise a reply: new ids, reordered keys, spacing, dropped reasoning."""
    out = {"role": "assistant", "content": msg["content"] or None}
    if "reasoning_content" in msg and rnd.random() < 0.5:
        out["reasoning_content"] = msg["reasoning_content"]
    calls = []
    for i, tc in enumerate(msg.get("tool_calls", [])):
        a = json.loads(tc["function"]["arguments"])
        a = dict(reversed(list(a.items())))
        raw = json.dumps(a, indent=rnd.choice([None, 1]), separators=rnd.choice([None, (",", ":")]))
        calls.append(
            {
                "id": f"call{rnd.randint(0, 999)}_{i}",
                "function": {"name": "bash", "arguments": raw if rnd.random() < 0.5 else a},
            }
        )
    if calls:
        out["tool_calls"] = calls
    return out


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(conversations())
def test_invariant_echo_unchanged_equals_full_render(conv) -> None:
    """Over random conversations: when the harness echoes history unchanged, TITO ids == the
    ids of a full render, and every call after the first is a hit."""
    start, tools, steps = conv
    s = TitoSession(R)
    msgs = list(start)
    for seq, (intended, new) in enumerate(steps):
        p = s.prepare(msgs, tools)
        assert p.input_ids == full_ids(msgs, tools)
        assert p.kind == ("first" if seq == 0 else "hit")
        out = canonical_output(p.input_ids, msgs, intended, tools)
        assume(out is not None)
        reply = P.parse(R.decode(out)).message()
        s.commit(seq, p, out, reply)
        msgs = msgs + [reply] + new
    assert s.prepare(msgs, tools).input_ids == full_ids(msgs, tools)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(conversations(), st.integers(0, 2**32 - 1))
def test_invariant_reserialised_history_extends_sampled_ids(conv, seed: int) -> None:
    """When the harness re-serialises its history, each call still extends the previous call's
    input+output exactly, and the new part is the template's rendering of the new messages."""
    rnd = random.Random(seed)
    start, tools, steps = conv
    s = TitoSession(R)
    msgs = normalize_messages(start)
    prev = None
    for seq, (intended, new) in enumerate(steps):
        p = s.prepare(msgs, tools)
        if prev is not None:
            p_in, p_out, n_before = prev
            assert p.kind == "hit" and p.anchor_seq == seq - 1
            assert p.input_ids[: len(p_in) + len(p_out)] == p_in + p_out
            rest = R.render(msgs, tools, True)[len(R.render(msgs[: n_before + 1], tools, False)) :]
            assert p.input_ids == p_in + p_out + enc("\n" + rest)
        out = canonical_output(full_ids(msgs, tools), msgs, intended, tools)
        assume(out is not None)
        reply = P.parse(R.decode(out)).message()
        s.commit(seq, p, out, reply)
        prev = (p.input_ids, out, len(msgs))
        msgs = normalize_messages(msgs[:] + [_rewrite(reply, rnd)] + new)


@pytest.mark.parametrize("n_turns", [60])
def test_long_rollout_stays_exact(n_turns: int) -> None:
    """A long agent loop (tool call, result, repeat): every call is a hit equal to a full render."""
    s = TitoSession(R)
    msgs = list(START)
    for seq in range(n_turns):
        p = s.prepare(msgs, TOOLS)
        if seq:
            assert p.hit and p.anchor_seq == seq - 1
        intended = bash_call(f"cat file_{seq}.py", content=f"Step {seq}.")
        out = canonical_output(p.input_ids, msgs, intended)
        reply = P.parse(R.decode(out)).message()
        s.commit(seq, p, out, reply)
        msgs = msgs + [reply, {"role": "tool", "content": f"print({seq})\n" * 3}]
    assert s.prepare(msgs, TOOLS).input_ids == full_ids(msgs)


# ---------------------------------------------------------------------------------------------
# a call's work follows what it adds: window rendering, hashing only what is new
# ---------------------------------------------------------------------------------------------


def agent_loop(
    s: TitoSession, turns: int, r: ChatRenderer = R, results: list[str] | None = None
) -> list[dict]:
    """``turns`` calls of a tool-calling agent loop (each echoing the history unchanged, each
    prompt checked equal to a full render); returns the messages of the next call."""
    msgs = list(START)
    for seq in range(turns):
        p = s.prepare(msgs, TOOLS)
        assert p.input_ids == r.encode(r.render(msgs, TOOLS, True))
        assert p.kind == ("hit" if seq else "first")
        out = enc(f'<tool_call>\n{{"name": "bash", "arguments": {{"n": {seq}}}}}\n</tool_call>')
        reply = P.parse(R.decode(out + [IM_END])).message([f"call_{seq}"])
        s.commit(seq, p, out + [IM_END], reply)
        result = results[seq] if results else f"out {seq}\n" * 3
        tool = {"role": "tool", "tool_call_id": f"call_{seq}", "content": result}
        msgs = msgs + [reply, tool]
    return msgs


def test_hit_renders_and_hashes_only_around_the_new_messages(monkeypatch) -> None:
    """Deep in a conversation a hit renders a window (first message, last user message, last
    earlier message) and the new messages, never the whole conversation, and hashes only the
    messages it had not seen; its ids still equal a full render."""
    r = ChatRenderer(TOK, verify_first=0)
    s = TitoSession(r)
    msgs = agent_loop(s, 30, r)
    rendered, hashed = [], []
    render, key = r.render, tito._visible_key
    monkeypatch.setattr(r, "render", lambda m, t, gen: rendered.append(len(m)) or render(m, t, gen))
    monkeypatch.setattr(tito, "_visible_key", lambda m: hashed.append(m) or key(m))
    p = s.prepare(msgs, TOOLS)
    monkeypatch.undo()
    assert p.hit and p.input_ids == full_ids(msgs) and len(msgs) == 62
    assert rendered and max(rendered) <= 4  # window (3) + the new tool result
    assert hashed == [msgs[-1]]  # the echoed reply is the one committed: only the result is new


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(conversations(), st.integers(0, 2**32 - 1), st.sampled_from([CHAT_TEMPLATE, QWEN3ISH]))
def test_window_render_equals_whole_conversation_render(conv, seed: int, template: str) -> None:
    """Over random conversations, echoed or re-serialised, with forks from earlier turns, and
    with a template that drops earlier reasoning: a session rendering windows builds exactly the
    prompts of one rendering whole conversations (ids, kind, anchor)."""
    rnd = random.Random(seed)
    start, tools, steps = conv
    window = ChatRenderer(TOK, template=template, verify_first=0)
    whole = ChatRenderer(TOK, template=template, incremental=False)
    assert window.windowed()
    sessions = (TitoSession(window), TitoSession(whole))
    msgs = normalize_messages(start)
    for seq, (intended, new) in enumerate(steps):
        fork = msgs[: rnd.randrange(1, len(msgs) + 1)] + [{"role": "user", "content": "fork"}]
        for m in (msgs, fork):
            a, b = (s.prepare(m, tools) for s in sessions)
            assert a.input_ids == b.input_ids
            assert (a.kind, a.anchor_seq, a.anchor_kind, a.reused, a.false_fork) == (
                b.kind, b.anchor_seq, b.anchor_kind, b.reused, b.false_fork,
            )  # fmt: skip
        out = canonical_output(full_ids(msgs, tools), msgs, intended, tools)
        assume(out is not None)
        reply = P.parse(R.decode(out)).message()
        for s, p in zip(sessions, (a, b), strict=True):
            s.commit(seq, p, out, reply)
        echoed = _rewrite(reply, rnd) if rnd.random() < 0.5 else reply
        msgs = normalize_messages(msgs[:] + [echoed] + new)
    assert window.incremental and sessions[0].counts == sessions[1].counts


def test_template_failing_the_probe_renders_whole_conversations() -> None:
    """A template numbering tool results across the conversation renders a turn from turns
    outside any window: it fails the probe, so TITO renders whole conversations and stays
    equal to a full render (a window would not be)."""
    numbered = _counting_tool_results()
    r = ChatRenderer(TOK, template=numbered)
    assert not r.windowed()
    agent_loop(TitoSession(r), 6, r)
    forced = TitoSession(ChatRenderer(TOK, template=numbered, incremental=True, verify_first=0))
    with pytest.raises(AssertionError):
        agent_loop(forced, 6, r)


def test_window_that_differs_on_real_traffic_is_caught() -> None:
    """A template that passes the probe but not on this conversation (tool results numbered
    once a marker was seen, far back): the first window renders are checked against the full
    render, the difference is caught and counted, the full render is used (the prompts stay
    exact), and the renderer renders whole conversations from then on."""
    template = _counting_tool_results("MAGIC")
    results = ["MAGIC", "two", "three"]
    r = ChatRenderer(TOK, template=template)
    assert r.windowed()
    before = metrics.sample_value("hrl_proxy_tito_window_mismatches_total") or 0
    agent_loop(TitoSession(r), 3, r, results)
    assert not r.incremental
    assert metrics.sample_value("hrl_proxy_tito_window_mismatches_total") == before + 1
    unchecked = ChatRenderer(TOK, template=template, verify_first=0)
    with pytest.raises(AssertionError):
        agent_loop(TitoSession(unchecked), 3, r, results)
