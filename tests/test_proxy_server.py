"""The HTTP front (chat completions, messages, responses), driven by the official OpenAI and
Anthropic SDKs against a scripted engine."""

from __future__ import annotations

import contextlib
import json

import aiohttp
import anthropic
import openai
import pytest

from harnessrl.common.records import CallRecord
from harnessrl.proxy.messages_api import messages_request
from harnessrl.proxy.scripted import Reply
from harnessrl.proxy.server import ProxyServer
from tests.helpers.proxy import MSGS, ROLLOUT, TOK, TOKEN, TOOL_REPLY, TOOLS, proxy


@pytest.mark.integration
async def test_chat_tool_call_then_answer(run_name: str) -> None:
    """A tool call comes back as OpenAI tool_calls; the echoed history is a TITO hit."""
    async with proxy(run_name, [TOOL_REPLY, "Two files."]) as (sdk, _, eng, rec, bus):
        first = await sdk.chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (tc,) = choice.message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("bash", {"command": "ls"})
        assert choice.message.content == "Checking."
        assert first.usage.prompt_tokens == len(eng.requests[0]["input_ids"])
        history = MSGS + [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": "a.py"},
        ]
        second = await sdk.chat.completions.create(model="m", messages=history, tools=TOOLS)
        assert second.choices[0].message.content == "Two files."
        assert second.choices[0].finish_reason == "stop"
        await rec.flush(ROLLOUT)
        records = await bus.read_subject(bus.subjects.calls(ROLLOUT), CallRecord)
    assert [(r.seq, r.api, r.tito_hit, r.parent_seq) for r in records] == [
        (0, "chat", False, -1),
        (1, "chat", True, 0),
    ]


@pytest.mark.integration
async def test_chat_stream_assembles_to_the_same_reply(run_name: str) -> None:
    """Pseudo-streaming: pings while generating, then well-formed chunks and a usage chunk."""
    script = [Reply(text=TOOL_REPLY, delay=0.3)]
    async with proxy(run_name, script) as (sdk, srv, *_):
        stream = await sdk.chat.completions.create(
            model="m",
            messages=MSGS,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, args, names, finish, usage = "", "", [], None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    names.append(tc.function.name)
                    args += tc.function.arguments or ""
                finish = c.finish_reason or finish
    assert (content, names, json.loads(args), finish) == (
        "Checking.",
        ["bash"],
        {"command": "ls"},
        "tool_calls",
    )
    assert usage.completion_tokens > 0


@pytest.mark.integration
async def test_raw_stream_has_pings(run_name: str) -> None:
    """The SSE body carries keep-alive comments before the events and ends with [DONE]."""
    body = {"model": "m", "messages": MSGS, "stream": True}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        proxy(run_name, [Reply(text="hi", delay=0.4)]) as (_, srv, *_),
        aiohttp.ClientSession() as s,
        s.post(srv.url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    assert text.startswith(": ping\n\n") and text.endswith("data: [DONE]\n\n")


@pytest.mark.integration
async def test_wrong_token_is_401_and_unrecorded(run_name: str) -> None:
    """A bad key is refused and nothing reaches the engine or the bus."""
    async with proxy(run_name, ["x"]) as (sdk, srv, eng, rec, bus):
        bad = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="m", messages=MSGS)
        await bad.close()
        assert eng.requests == [] and await bus.stream_count("CALLS") == 0
        assert [m.id for m in (await sdk.models.list()).data] == ["harnessrl"]


@pytest.mark.integration
async def test_context_too_long_is_400_with_code(run_name: str) -> None:
    """Like OpenAI: 400 with code context_length_exceeded (harnesses compact on it)."""
    async with proxy(run_name, ["x"], max_context=16) as (sdk, *_):
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.chat.completions.create(model="m", messages=MSGS, stream=True)
    assert e.value.code == "context_length_exceeded"


@pytest.mark.integration
async def test_engine_down_is_503_with_retry_after(run_name: str) -> None:
    """An engine refusal within the stream grace period is a real 503 + Retry-After."""
    script = [Reply(status=503, error="paused"), Reply(status=503, error="paused")]
    async with proxy(run_name, script) as (sdk, srv, *_):
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                await sdk.chat.completions.create(model="m", messages=MSGS, stream=stream)
            assert e.value.status_code == 503
            assert int(e.value.response.headers["Retry-After"]) >= 1


@pytest.mark.integration
async def test_health_and_unix_socket(run_name: str, tmp_path) -> None:
    """HEAD/GET / answer 200 without a token; the server can listen on a unix socket."""
    async with proxy(run_name, ["x"]) as (_, srv, *_), aiohttp.ClientSession() as s:
        async with s.head(srv.url + "/") as r:
            assert r.status == 200
        sock = str(tmp_path / "proxy.sock")
        async with ProxyServer(srv.caller, {TOKEN: ROLLOUT}, unix_path=sock):
            conn = aiohttp.UnixConnector(path=sock)
            async with aiohttp.ClientSession(connector=conn) as us, us.get("http://x/") as r:
                assert await r.text() == "ok"


@pytest.mark.integration
async def test_malformed_request_is_400(run_name: str) -> None:
    """Missing messages or n>1: 400 in OpenAI's shape, never 5xx."""
    async with proxy(run_name, ["x"]) as (sdk, *_):
        with pytest.raises(openai.BadRequestError, match="messages"):
            await sdk.chat.completions.create(model="m", messages=[])
        with pytest.raises(openai.BadRequestError, match="n=1"):
            await sdk.chat.completions.create(model="m", messages=MSGS, n=2)


@pytest.mark.integration
async def test_json_only_the_standard_library_reads_is_still_served(run_name: str) -> None:
    """Bodies are read by msgspec; what it refuses but ``json`` reads (NaN, a number beyond
    float range, a non-UTF-8 charset) is read the standard library's way and served; what
    neither reads is a 400, and so is a lone surrogate (not Unicode text, see
    test_proxy_validation)."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    good = json.dumps({"model": "m", "messages": MSGS})[:-1]
    bodies = [
        (good + ', "temperature": NaN, "top_p": 1e400}').encode(),
        (good + ', "user": "caf\u00e9"}').encode("latin-1"),
    ]
    async with (
        proxy(run_name, ["a", "b", "c"]) as (_, srv, *_),
        aiohttp.ClientSession() as s,
    ):
        url = srv.url + "/v1/chat/completions"
        latin = {**headers, "Content-Type": "application/json; charset=latin-1"}
        for data, h in zip(bodies, (headers, latin), strict=True):
            async with s.post(url, data=data, headers=h) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["message"]["content"]
        async with s.post(url, data=good.encode() + b', "x": nan}', headers=headers) as r:
            assert r.status == 400
        data = (good + ', "user": "\\ud800"}').encode()
        async with s.post(url, data=data, headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "user"


# ---------------------------------------------------------------------------------------------
# Anthropic messages
# ---------------------------------------------------------------------------------------------

A_TOOLS = [
    {
        "name": "bash",
        "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
A_SYSTEM = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
A_MSGS = [{"role": "user", "content": "List files."}]


@contextlib.asynccontextmanager
async def anthropic_sdk(srv: ProxyServer):
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key=TOKEN, max_retries=0)
    yield client
    await client.close()


@pytest.mark.integration
async def test_messages_tool_use_then_answer(run_name: str) -> None:
    """thinking + text + tool_use blocks; Claude Code's echo (blocks verbatim) is a TITO hit."""
    async with proxy(run_name, [TOOL_REPLY, "Two files."]) as (_, srv, eng, rec, bus):
        async with anthropic_sdk(srv) as sdk:
            first = await sdk.messages.create(
                model="m", max_tokens=300, system=A_SYSTEM, messages=A_MSGS, tools=A_TOOLS
            )
            assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
            assert first.content[0].thinking == "use ls" and first.stop_reason == "tool_use"
            tool_use = first.content[2]
            assert (tool_use.name, tool_use.input) == ("bash", {"command": "ls"})
            assert tool_use.id.startswith("toolu_")
            n_in = len(eng.requests[0]["input_ids"])
            assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) == n_in
            history = A_MSGS + [
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": tool_use.id,
                            "content": [{"type": "text", "text": "a.py"}],
                        },
                        {"type": "text", "text": "<system-reminder>keep going</system-reminder>"},
                    ],
                },
            ]
            second = await sdk.messages.create(
                model="m", max_tokens=300, system=A_SYSTEM, messages=history, tools=A_TOOLS
            )
            assert second.content[0].text == "Two files." and second.stop_reason == "end_turn"
        await rec.flush(ROLLOUT)
        records = await bus.read_subject(bus.subjects.calls(ROLLOUT), CallRecord)
    assert [(r.api, r.tito_hit, r.parent_seq) for r in records] == [
        ("messages", False, -1),
        ("messages", True, 0),
    ]
    assert records[0].sampling.max_new_tokens == 300


@pytest.mark.integration
async def test_messages_stream_matches_non_stream(run_name: str) -> None:
    """The SDK's stream accumulator rebuilds the same message from the pseudo-stream."""
    script = [Reply(text=TOOL_REPLY, delay=0.2), TOOL_REPLY]
    async with proxy(run_name, script) as (_, srv, *_), anthropic_sdk(srv) as sdk:
        kw = {"model": "m", "max_tokens": 300, "messages": A_MSGS, "tools": A_TOOLS}
        async with sdk.messages.stream(**kw) as stream:
            kinds = [ev.type async for ev in stream]
            streamed = await stream.get_final_message()
        plain = await sdk.messages.create(**kw)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"

    def blocks(msg):
        return [b.model_dump(exclude={"id"}) for b in msg.content]

    assert blocks(streamed) == blocks(plain)
    assert streamed.content[0].thinking == "use ls" and streamed.stop_reason == "tool_use"


@pytest.mark.integration
async def test_messages_errors(run_name: str) -> None:
    """Too long -> 400 invalid_request_error 'prompt is too long'; engine down -> 529."""
    script = [Reply(status=503, error="paused")]
    async with proxy(run_name, script, max_context=4096) as (_, srv, *_), anthropic_sdk(srv) as sdk:
        with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
            long = [{"role": "user", "content": "word " * 5000}]
            await sdk.messages.create(model="m", max_tokens=10, messages=long)
        with pytest.raises(anthropic.APIStatusError) as e:
            await sdk.messages.create(model="m", max_tokens=10, messages=A_MSGS, stream=False)
        assert e.value.status_code == 529
        with pytest.raises(anthropic.AuthenticationError):
            bad = anthropic.AsyncAnthropic(base_url=srv.url, api_key="nope", max_retries=0)
            await bad.messages.create(model="m", max_tokens=10, messages=A_MSGS)


@pytest.mark.unit
def test_messages_conversion() -> None:
    """System blocks, system-role messages, tool results then text, deferred/server tools."""
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "redacted_thinking", "data": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"c": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "out"},
                    {"type": "text", "text": "more"},
                ],
            },
            {"role": "system", "content": "late system"},
        ],
        "tools": A_TOOLS
        + [
            {"name": "lazy", "input_schema": {}, "defer_loading": True},
            {"type": "web_search_20250305", "name": "web_search"},
        ],
    }
    req = messages_request(body, "r-0-1", {})
    assert [(m["role"], m["content"]) for m in req.messages] == [
        ("system", "AB"),
        ("user", "hi"),
        ("assistant", ""),
        ("tool", "out"),
        ("user", "more"),
        ("system", "late system"),
    ]
    assert req.messages[2]["reasoning_content"] == "t"
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"c": 1}'}
    assert [t["function"]["name"] for t in req.tools] == ["bash"]
    assert (req.max_tokens, req.api, req.id_prefix) == (10, "messages", "toolu_")


# ---------------------------------------------------------------------------------------------
# OpenAI responses (Codex)
# ---------------------------------------------------------------------------------------------

R_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
R_CALL = (
    "<think>\nrun it\n</think>\n\n<tool_call>\n"
    '{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>'
)


@pytest.mark.integration
async def test_responses_function_call_then_answer(run_name: str) -> None:
    """Codex-style loop: reasoning + function_call out; the echoed items (reasoning with our
    encrypted_content, function_call, function_call_output) are a TITO hit."""
    async with proxy(run_name, [R_CALL, "Done."]) as (sdk, _, eng, rec, bus):
        first = await sdk.responses.create(
            model="m", instructions="Be brief.", input="List files.", tools=R_TOOLS, store=False
        )
        kinds = [item.type for item in first.output]
        assert kinds == ["reasoning", "function_call"] and first.status == "completed"
        call = first.output[1]
        assert (call.name, json.loads(call.arguments)) == ("shell", {"command": "ls"})
        echo = [
            {"role": "user", "content": [{"type": "input_text", "text": "List files."}]},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "a.py"},
        ]
        second = await sdk.responses.create(
            model="m", instructions="Be brief.", input=echo, tools=R_TOOLS, store=False
        )
        assert second.output_text == "Done."
        assert second.usage.input_tokens == len(eng.requests[1]["input_ids"])
        await rec.flush(ROLLOUT)
        records = await bus.read_subject(bus.subjects.calls(ROLLOUT), CallRecord)
    assert [(r.api, r.tito_hit, r.parent_seq) for r in records] == [
        ("responses", False, -1),
        ("responses", True, 0),
    ]


@pytest.mark.integration
async def test_responses_stream_events(run_name: str) -> None:
    """Stream: response.created, output_item.added/done per item, response.completed."""
    async with proxy(run_name, [Reply(text=R_CALL, delay=0.2)]) as (sdk, *_):
        stream = await sdk.responses.create(
            model="m", input="List files.", tools=R_TOOLS, stream=True
        )
        events = [ev async for ev in stream]
    types = [ev.type for ev in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert types.count("response.output_item.done") == 2
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    assert final.usage.output_tokens > 0


@pytest.mark.integration
async def test_responses_namespace_tools_and_errors(run_name: str) -> None:
    """Namespace tools are flattened and calls to them carry their namespace; unsupported
    previous_response_id is a 400."""
    ns_tools = [{"type": "namespace", "name": "fs", "tools": R_TOOLS}, {"type": "web_search"}]
    reply = '<tool_call>\n{"name": "fs.shell", "arguments": {"command": "pwd"}}\n</tool_call>'
    async with proxy(run_name, [reply]) as (sdk, _, eng, *_):
        out = await sdk.responses.create(model="m", input="where?", tools=ns_tools)
        (call,) = out.output
        assert call.model_dump()["namespace"] == "fs" and call.name == "shell"
        prompt = TOK.decode(eng.requests[0]["input_ids"])
        assert '"name": "fs.shell"' in prompt and "web_search" not in prompt
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await sdk.responses.create(model="m", input="x", previous_response_id="resp_1")


@pytest.mark.unit
def test_responses_conversion_groups_assistant_items() -> None:
    """reasoning + message + function_calls form one assistant turn; outputs become tools."""
    from harnessrl.proxy.responses_api import encode_reasoning, responses_request

    body = {
        "instructions": "sys",
        "input": [
            {"type": "message", "role": "developer", "content": "dev"},
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [], "encrypted_content": encode_reasoning("r\n")},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "b", "arguments": '{"x":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "function_call_output", "call_id": "c2", "output": "2"},
        ],
    }
    req = responses_request(body, "r-0-1", {})
    assert [m["role"] for m in req.messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
    ]
    turn = req.messages[3]
    assert (turn["content"], turn["reasoning_content"]) == ("ok", "r\n")
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["a", "b"]


STREAMED = {
    "/v1/chat/completions": ({"messages": MSGS, "tools": TOOLS}, b"data: [DONE]\n\n"),
    "/v1/messages": (
        {"max_tokens": 300, "messages": A_MSGS, "tools": A_TOOLS},
        b'{"type": "message_stop"}\n\n',
    ),
    "/v1/responses": ({"input": "List files.", "tools": R_TOOLS}, b"}\n\n"),
}
"""Path -> (request body, how the stream's last event ends)."""


@pytest.mark.integration
@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("path", list(STREAMED))
async def test_stream_is_sent_in_one_piece_per_stage(run_name: str, path: str, slow: bool):
    """The reply's events are serialised once and sent in one HTTP chunk with the end of the
    stream, not one chunk per event: the whole stream is one chunk when the engine answers
    within the grace, else the opening events, the pings, then one chunk with every event."""
    body, end = STREAMED[path]
    body = {**body, "model": "m", "stream": True}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    # slow: the engine answers well after the grace (0.1 s) and pings (0.05 s); else well
    # within a grace of 60 s
    script, grace = [Reply(text=TOOL_REPLY, delay=0.5 if slow else 0.0)], 0.1 if slow else 60.0
    async with (
        proxy(run_name, script, grace) as (_, srv, *_),
        aiohttp.ClientSession() as s,
        s.post(srv.url + path, json=body, headers=headers) as r,
    ):
        assert r.status == 200
        chunks, part = [], b""
        async for data, end_of_chunk in r.content.iter_chunks():
            part += data
            if end_of_chunk:
                chunks.append(part)
                part = b""
    pings = [c for c in chunks if b"ping" in c and c.count(b"\n\n") == 1]
    events = [c for c in chunks if c not in pings]
    assert b"".join(events).count(b"\n\n") > 4 and events[-1].endswith(end)
    if slow:
        assert pings and len(events) == (1 if path == "/v1/chat/completions" else 2)
    else:
        assert not pings and len(events) == 1
