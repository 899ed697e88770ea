"""Fuzz: malformed requests for every API never get a 5xx, never crash the proxy.

Hypothesis takes a valid request of each API (OpenAI chat completions, Anthropic messages,
OpenAI responses; streaming or not; with a tool round trip in the history) and breaks it: fields
deleted, replaced by values of the wrong type, huge/negative/non-finite numbers, random nested
JSON, extra keys, and what a hostile client sends (lone surrogates, JSON nested 100,000 deep,
integers beyond 64 bits, unknown roles and block types, ``stream: "yes"``; see
``tests.fuzzing``); or sends bytes that are not JSON, JSON that is not an object, wrong content
types and charsets. Every answer must be a 2xx or a 4xx, and a 4xx must be in that API's own
error shape; the server keeps serving afterwards and every admitted call was recorded.

One proxy (with a scripted engine and an in-memory bus) serves the whole module on a real port.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harnessrl.common.bus import connect
from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import CallRecord
from harnessrl.proxy.calls import ModelCaller
from harnessrl.proxy.parsers import HermesParser
from harnessrl.proxy.recorder import Recorder
from harnessrl.proxy.scripted import ScriptedEngine
from harnessrl.proxy.server import ProxyServer
from harnessrl.proxy.sglang import EngineClient
from harnessrl.proxy.tito import ChatRenderer
from tests import fuzzing

pytestmark = pytest.mark.integration

TOKEN, ROLLOUT = "sk-fuzz", "fuzz-0-1"
TOK = load_tokenizer("tiny-1m")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages?beta=true"}
PATHS["responses"] = "/v1/responses"
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}
REPLY = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'

# ---------------------------------------------------------------------------------------------
# valid requests of each API (each with a tool round trip in its history)

CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "List files."}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
    ],
    "tools": [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}],
    "max_tokens": 32,
    "temperature": 0.5,
    "stream_options": {"include_usage": True},
}
MESSAGES = {
    "model": "m",
    "max_tokens": 32,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "ls", "signature": "hrl:x"},
                {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}],
        },
    ],
    "tools": [{"name": "bash", "description": "run", "input_schema": SCHEMA}],
    "thinking": {"type": "adaptive"},
    "metadata": {"user_id": "u"},
}
RESPONSES = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "hrl1:bHM="},
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"command":"ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
    ],
    "tools": [
        {"type": "function", "name": "bash", "parameters": SCHEMA},
        {"type": "namespace", "name": "ns", "tools": [{"name": "t", "parameters": SCHEMA}]},
        {"type": "web_search"},
    ],
    "max_output_tokens": 32,
    "store": False,
    "reasoning": {"effort": "low"},
}
VALID = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}

# ---------------------------------------------------------------------------------------------
# what breaks them

KEYS = st.sampled_from(
    ["role", "content", "type", "text", "stream", "stream_options", "n", "tools", "input",
     "messages", "max_tokens", "tool_calls", "function", "arguments", "name", "system",
     "previous_response_id", "instructions", "tool_use_id", "thinking", "model"]
)  # fmt: skip
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "application/json; charset=latin-1",
        "application/json; charset=no-such-charset",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=xyz",
        "",
    ]
)


@st.composite
def mutated(draw: st.DrawFn, api: str) -> Any:
    """A valid request of ``api`` (streaming or not) with 1-3 things broken."""
    return draw(fuzzing.mutated({**VALID[api], "stream": draw(st.booleans())}, KEYS))


_encode = fuzzing.encode


@st.composite
def raw_payload(draw: st.DrawFn, api: str) -> bytes:
    """Bytes that are not a valid request object at all."""
    kind = draw(st.sampled_from(["bytes", "truncated", "scalar", "latin1", "empty"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "truncated":
        text = _encode(VALID[api])
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "scalar":
        return _encode(draw(fuzzing.JSONISH))
    if kind == "latin1":
        return json.dumps({"model": "é", "messages": "ü"}, ensure_ascii=False).encode("latin-1")
    return b""


def payloads(api: str) -> st.SearchStrategy[bytes]:
    return st.one_of(mutated(api).map(_encode), raw_payload(api))


# ---------------------------------------------------------------------------------------------
# the server under test


class Served:
    """A proxy on a real port, driven from synchronous hypothesis tests through one loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.url = ""

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def start(self) -> None:
        self.bus = await connect("memory://fuzz", "fuzz")
        self.engine = await ScriptedEngine(TOK, default=REPLY).start()
        self.client = EngineClient(self.engine.url)
        self.recorder = await Recorder(self.bus).start()
        caller = ModelCaller(
            self.client, ChatRenderer(TOK), HermesParser(), self.recorder, max_context=4096
        )
        self.server = await ProxyServer(
            caller, {TOKEN: ROLLOUT}, ping_s=0.05, stream_grace_s=0.05
        ).start()
        self.url = self.server.url
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def stop(self) -> None:
        await self.session.close()
        await self.server.stop()
        await self.recorder.close()
        await self.client.close()
        await self.engine.stop()
        await self.bus.close()

    async def post(
        self, api: str, data: bytes, content_type: str = "application/json", auth: bool = True
    ) -> tuple[int, str, bytes]:
        headers = {"Content-Type": content_type} if content_type else {}
        if auth:
            headers["x-api-key" if api == "messages" else "Authorization"] = (
                TOKEN if api == "messages" else f"Bearer {TOKEN}"
            )
        async with self.session.post(self.url + PATHS[api], data=data, headers=headers) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


@pytest.fixture(scope="module")
def served():
    s = Served()
    s.run(s.start())
    yield s
    s.run(s.stop())
    s.loop.close()


# ---------------------------------------------------------------------------------------------
# what every answer must look like


def check_answer(api: str, status: int, ctype: str, body: bytes) -> None:
    assert status < 500, (status, body[:500])
    if status >= 400:
        err = json.loads(body)
        if api == "messages":
            assert err["type"] == "error", err
            assert isinstance(err["error"]["type"], str) and isinstance(
                err["error"]["message"], str
            )
        else:
            assert isinstance(err["error"]["message"], str) and isinstance(
                err["error"]["type"], str
            )
        return
    assert status == 200, status
    if ctype.startswith("text/event-stream"):
        events = _sse(body)
        assert events, body[:500]
        kinds = [e.get("type") for e in events if isinstance(e, dict)]
        if api == "messages":
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        elif api == "responses":
            assert kinds[0] == "response.created", kinds
            assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        else:
            assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
        return
    obj = json.loads(body)
    key = {"chat": "choices", "messages": "content", "responses": "output"}[api]
    assert isinstance(obj[key], list), obj


def _sse(body: bytes) -> list[Any]:
    out = []
    for frame in body.decode().split("\n\n"):
        for line in frame.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_fuzzed_requests_never_get_a_5xx(served: Served, api: str) -> None:
    """Broken bodies, non-JSON bytes, wrong content types: a 2xx or a 4xx in the API's shape."""

    @FUZZ
    @given(data=payloads(api), ctype=CONTENT_TYPES)
    @example(data=b'{"messages": [], "stream_options": "x", "stream": true}', ctype="")
    @example(data=b'{"n": "two"}', ctype="application/json")
    @example(data=b'{"n": Infinity}', ctype="application/json")
    @example(data=_encode(VALID[api]), ctype="application/json; charset=no-such-charset")
    def fuzz(data: bytes, ctype: str) -> None:
        check_answer(api, *served.run(served.post(api, data, ctype)))

    fuzz()


def hostile(api: str) -> list[Any]:
    """The requests a hostile client sends, each with one thing wrong."""
    body = VALID[api]
    key = "input" if api == "responses" else "messages"

    def first(**kw: Any) -> dict[str, Any]:
        return {**body, key: [{**body[key][0], **kw}, *body[key][1:]]}

    return [
        first(role="wizard"),
        first(content=5),
        first(content="caf\udcff"),
        first(content=[{"type": "wizard", "text": "x"}]),
        {**body, "tools": "x"},
        {**body, "tool_choice": "junk"},
        {**body, "tool_choice": {"junk": 1}},
        {**body, "stream": "yes"},
        {**body, "tools": [{"type": "wizard"}]},
        {**body, "metadata": fuzzing.DEEP},
    ]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_hostile_requests_get_a_400(served: Served, api: str) -> None:
    """Each hostile request is a 400 in the API's shape (they were 500s or 200s)."""
    for body in hostile(api):
        status, ctype, raw = served.run(served.post(api, _encode(body)))
        assert status == 400, (str(body)[:200], raw[:300])
        check_answer(api, status, ctype, raw)


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_without_token_every_request_gets_401(served: Served, api: str) -> None:
    """Whatever the body, no token means 401 in the API's shape (and nothing recorded)."""
    before = served.recorder.rollouts.get(ROLLOUT)
    n_before = before.next_seq if before else 0
    for data in (b"garbage", _encode(VALID[api]), b"[]"):
        status, ctype, body = served.run(served.post(api, data, auth=False))
        assert status == 401
        check_answer(api, status, ctype, body)
    after = served.recorder.rollouts.get(ROLLOUT)
    assert (after.next_seq if after else 0) == n_before


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_still_serving_after_the_fuzz(served: Served, api: str, stream: bool) -> None:
    """After all that, valid requests of every API are answered; every admitted call of the
    fuzzing was recorded (seqs dense, the bus acknowledged them all)."""
    status, ctype, body = served.run(served.post(api, _encode({**VALID[api], "stream": stream})))
    assert status == 200, body[:500]
    check_answer(api, status, ctype, body)
    ro = served.recorder.rollouts[ROLLOUT]
    n = served.run(served.recorder.flush(ROLLOUT, timeout=30))
    assert n == ro.next_seq and ro.open == 0


def test_huge_request_is_a_context_error_not_a_crash(served: Served) -> None:
    """A prompt far over the context window: 400 context_length_exceeded / invalid_request."""
    big = "word " * 60_000
    chat = {**CHAT, "messages": [{"role": "user", "content": big}]}
    status, ctype, body = served.run(served.post("chat", _encode(chat)))
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
    msgs = {**MESSAGES, "messages": [{"role": "user", "content": big}], "stream": True}
    status, ctype, body = served.run(served.post("messages", _encode(msgs)))
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_out_of_range_integers_are_still_recorded(served: Served, api: str) -> None:
    """A sampling value msgpack cannot carry (an integer beyond 64 bits) is recorded as text:
    found by the fuzz, it used to make a record that could never be published, which filled the
    record buffer until every later call was refused."""
    body = {**VALID[api], "temperature": 10**40, "top_p": -(2**70)}
    status, ctype, raw = served.run(served.post(api, _encode(body)))
    check_answer(api, status, ctype, raw)
    assert status == 200
    served.run(served.recorder.flush(ROLLOUT, timeout=10))
    records = served.run(served.bus.read_subject(served.bus.subjects.calls(ROLLOUT), CallRecord))
    last = max(records, key=lambda r: r.seq)
    assert last.requested["temperature"] == str(10**40)
