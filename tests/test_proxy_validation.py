"""Requests are checked against their API's own schema before anything else happens.

Every request the pinned real harnesses sent (``tests/fixtures/harness_requests``) is replayed
through a real proxy and must be served; bodies that break the schema (an unknown role, tools
that are not an array, a ``stream`` that is not a boolean, an unknown content-block type, text
that is not valid Unicode, JSON nested without end) get a 400 in the API's own error shape that
names the field, as OpenAI and Anthropic answer them, and never reach the engine. Fields the
schema does not know are ignored and counted.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from harnessrl.common import metrics
from harnessrl.proxy.schema import SchemaError, check
from tests.helpers.proxy import TOKEN, proxy

FIXTURES = Path(__file__).parent / "fixtures" / "harness_requests"
CAPTURED = sorted(FIXTURES.glob("*.json"))
API_OF = {"/v1/chat/completions": "chat", "/v1/messages": "messages", "/v1/responses": "responses"}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": [{"role": "user", "content": "hi"}]}
VALID = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}


def _api(path: str) -> str:
    return API_OF[path.split("?")[0]]


async def _post(url: str, api: str, data: bytes) -> tuple[int, Any]:
    auth = {"x-api-key": TOKEN} if api == "messages" else {"Authorization": f"Bearer {TOKEN}"}
    headers = {"Content-Type": "application/json", **auth}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        raw = await r.read()
        ctype = r.headers.get("Content-Type", "")
    return r.status, json.loads(raw) if ctype.startswith("application/json") else raw


def _error(api: str, status: int, body: Any) -> tuple[str, str | None]:
    """(message, param) of an error in the API's own shape (the shape is asserted)."""
    assert status == 400, body
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"], None
    err = body["error"]
    assert err["type"] == "invalid_request_error" and set(err) >= {"message", "param", "code"}
    return err["message"], err["param"]


@pytest.mark.integration
@pytest.mark.parametrize("fixture", CAPTURED, ids=[p.stem for p in CAPTURED])
async def test_every_captured_harness_request_passes(run_name: str, fixture: Path) -> None:
    """A request a pinned real harness sent is valid and served, byte for byte as sent; only
    fields outside the API's schema (Codex's ``client_metadata``) are reported unknown."""
    captured = json.loads(fixture.read_text())
    api, body = _api(captured["path"]), captured["body"]
    unknown = check(api, body)
    assert unknown == (["client_metadata"] if fixture.name.startswith("codex") else [])
    async with proxy(run_name, ["Done."]) as (_, srv, eng, *_):
        status, reply = await _post(srv.url + captured["path"], api, json.dumps(body).encode())
        assert status == 200, reply
        assert len(eng.requests) == 1


def _with(api: str, **fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(VALID[api]), **fields}


BAD = [
    # (api, body, OpenAI param / Anthropic path, words the message must hold)
    ("chat", _with("chat", messages=[{"role": "wizard", "content": "x"}]),
     "messages[0].role", ["'wizard'", "'assistant'", "'tool'"]),
    ("chat", _with("chat", messages=[{"role": "user", "content": 5}]),
     "messages[0].content", ["string", "array", "integer"]),
    ("chat", _with("chat", tools="x"), "tools", ["array", "string"]),
    ("chat", _with("chat", tool_choice="junk"), "tool_choice", ["'junk'", "'required'"]),
    ("chat", _with("chat", tool_choice={"junk": 1}), "tool_choice.type", ["Missing"]),
    ("chat", _with("chat", stream="yes"), "stream", ["boolean", "string"]),
    ("chat", _with("chat", messages=[{"role": "user", "content": [{"type": "wizard"}]}]),
     "messages[0].content[0].type", ["'wizard'", "'image_url'"]),
    ("messages", _with("messages", messages=[{"role": "wizard", "content": "x"}]),
     "messages.0.role", ["'wizard'", "'user'"]),
    ("messages", _with("messages", messages=[{"role": "user", "content": 5}]),
     "messages.0.content", ["string", "array"]),
    ("messages", _with("messages", tools="x"), "tools", ["array"]),
    ("messages", _with("messages", tool_choice="junk"), "tool_choice", ["object"]),
    ("messages", _with("messages", tool_choice={"type": "junk"}), "tool_choice.type",
     ["'junk'", "'auto'"]),
    ("messages", _with("messages", stream="yes"), "stream", ["boolean"]),
    ("messages",
     _with("messages", messages=[{"role": "user", "content": [{"type": "wizard", "text": "x"}]}]),
     "messages.0.content.0.type", ["'wizard'", "'tool_result'"]),
    ("messages", {"model": "m", "messages": MESSAGES["messages"]}, "max_tokens", ["required"]),
    ("responses", _with("responses", stream="yes"), "stream", ["boolean"]),
    ("responses", _with("responses", input=[{"type": "wizard"}]), "input[0].type",
     ["'wizard'", "'function_call_output'"]),
    ("responses", _with("responses", tools="x"), "tools", ["array"]),
    ("responses", _with("responses", tool_choice="junk"), "tool_choice", ["'junk'", "'auto'"]),
]  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(("api", "body", "field", "words"), BAD)
async def test_schema_violations_are_400_naming_the_field(
    run_name: str, api: str, body: dict[str, Any], field: str, words: list[str]
) -> None:
    """Each answer is a 400 in the API's shape naming the field (OpenAI: ``param`` and the
    message; Anthropic: the message starts with the dotted path) with what was expected; the
    engine never sees the request."""
    async with proxy(run_name, ["x"]) as (_, srv, eng, *_):
        for stream in (False, True):
            data = json.dumps({**body, "stream": stream} if "stream" not in body else body)
            message, param = _error(api, *await _post(srv.url + PATHS[api], api, data.encode()))
            if api == "messages":
                assert message.startswith(f"{field}: "), message
            else:
                assert param == field and f"'{field}'" in message, (param, message)
            for w in words:
                assert w in message, (w, message)
        assert eng.requests == []


@pytest.mark.integration
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_unknown_top_level_fields_are_ignored_and_counted(run_name: str, api: str) -> None:
    """A field outside the schema is served as if absent, and counted per API."""
    counted = ("hrl_proxy_unknown_fields_total", {"api": api})
    before = metrics.sample_value(*counted) or 0
    async with proxy(run_name, ["x", "y"]) as (_, srv, eng, *_):
        body = _with(api, frobnicate={"a": [1]}, x_trace=True)
        status, reply = await _post(srv.url + PATHS[api], api, json.dumps(body).encode())
        assert status == 200, reply
        status, _ = await _post(srv.url + PATHS[api], api, json.dumps(VALID[api]).encode())
        assert status == 200
        assert eng.requests[0]["input_ids"] == eng.requests[1]["input_ids"]
    assert metrics.sample_value(*counted) == before + 2


@pytest.mark.integration
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_lone_surrogate_is_400_naming_the_field(run_name: str, api: str) -> None:
    """Text with an unpaired UTF-16 surrogate (``"\\udcff"``) is not Unicode text and can never
    be tokenised: a 400 naming where it is (it used to be a 500 from the tokenizer)."""
    body = json.dumps(_with(api)).replace('"hi"', '"caf\\udcff"').encode()
    async with proxy(run_name, ["x"]) as (_, srv, eng, *_):
        message, param = _error(api, *await _post(srv.url + PATHS[api], api, body))
        where = {"chat": "messages[0].content", "messages": "messages.0.content"}
        assert where.get(api, "input[0].content") in message and "surrogate" in message
        assert eng.requests == []


TOOL = {"name": "bash", "description": "run"}
NESTED_TOOLS = {
    "chat": lambda schema: [{"type": "function", "function": {**TOOL, "parameters": schema}}],
    "messages": lambda schema: [{**TOOL, "input_schema": schema}],
    "responses": lambda schema: [{"type": "function", **TOOL, "parameters": schema}],
}


@pytest.mark.integration
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
@pytest.mark.parametrize("depth", [100_000, 950])
async def test_deeply_nested_json_is_400(run_name: str, api: str, depth: int) -> None:
    """A tool schema nested 100,000 deep (beyond the JSON parser's recursion) or nearly as deep
    as the interpreter allows (it parses, but rendering it into the prompt recurses too deep):
    a 400, never a RecursionError's 500; the proxy serves on."""
    nested = {"type": "object", "properties": {"x": {"$ref": "#"}}}
    body = _with(api, tools=NESTED_TOOLS[api](nested))
    text = json.dumps(body).replace('{"$ref": "#"}', "[" * depth + "]" * depth)
    async with proxy(run_name, ["x"]) as (_, srv, eng, *_):
        message, _ = _error(api, *await _post(srv.url + PATHS[api], api, text.encode()))
        assert "nested" in message
        status, _ = await _post(srv.url + PATHS[api], api, json.dumps(VALID[api]).encode())
        assert status == 200


@pytest.mark.unit
def test_schema_error_lists_supported_values() -> None:
    """The error of a closed set carries the set (from the schema itself)."""
    with pytest.raises(SchemaError) as e:
        check("chat", {"messages": [{"role": "wizard", "content": "x"}]})
    assert e.value.path == ("messages", 0, "role") and e.value.kind == "value"
    assert e.value.expected == ("assistant", "developer", "function", "system", "tool", "user")
