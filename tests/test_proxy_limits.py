"""What one harness can make the proxy do: bodies over the limit, and clients that hang up.

The proxy runs inside the actor beside every other rollout of that actor, so a harness must not
be able to stall it: a body over the limit (sized from the context window) is refused with a
413 before it is read, whether it announces its size or is chunked; a client that hangs up is
one info line and a counter, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
import pytest

from harnessrl.common import metrics
from harnessrl.common.records import CallRecord
from harnessrl.proxy.proxy_config import ProxySettings, request_bytes_limit
from harnessrl.proxy.scripted import Reply
from harnessrl.proxy.server import LINGER_S, OFFLOAD_BYTES
from tests.helpers.proxy import MSGS, ROLLOUT, TOKEN, R, proxy

MB = 1 << 20
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}


def _head(api: str, port: int, extra: str) -> bytes:
    auth = f"x-api-key: {TOKEN}" if api == "messages" else f"Authorization: Bearer {TOKEN}"
    return (
        f"POST {PATHS[api]} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, json.loads(await reader.readexactly(length))


@pytest.mark.unit
def test_request_limit_is_sized_from_the_context() -> None:
    """32 bytes per token of context + 4 MiB; configured, the configured value; no context
    known, 64 MiB."""
    assert request_bytes_limit(4096) == 32 * 4096 + 4 * MB
    assert request_bytes_limit(131072) == 8 * MB
    assert request_bytes_limit(0) == 64 * MB
    assert ProxySettings(max_request_bytes=123).request_limit(4096) == 123
    assert ProxySettings().request_limit(4096) == request_bytes_limit(4096)


@pytest.mark.integration
@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_announced_body_over_the_limit_is_413_before_it_is_read(
    run_name: str, api: str, caplog
) -> None:
    """A 50 MB Content-Length gets a 413 in the API's shape at once: the body is never sent."""
    async with proxy(run_name, ["x"], max_context=4096) as (_, srv, eng, *_):
        assert srv.max_body_bytes == request_bytes_limit(4096)
        reader, writer = await asyncio.open_connection(srv.host, srv.port)
        t0 = time.monotonic()
        writer.write(_head(api, srv.port, f"Content-Length: {50 * MB}\r\n"))
        status, body = await asyncio.wait_for(_response(reader), 10)
        took = time.monotonic() - t0
        writer.close()
        await writer.wait_closed()
    assert status == 413 and took < 5, (status, took)
    if api == "messages":
        assert body["error"]["type"] == "request_too_large"
    else:
        assert body["error"]["type"] == "invalid_request_error"
    assert "limit" in json.dumps(body) and eng.requests == []
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


@pytest.mark.integration
async def test_chunked_body_is_refused_once_it_passes_the_limit(run_name: str, caplog) -> None:
    """A chunked body (no Content-Length) is read only until it passes the limit, then 413:
    the client is told long before it has sent its 50 MB; what it still sends is discarded
    for at most ``LINGER_S`` (the proxy stops as quickly)."""
    chunk = b"x" * (256 << 10)
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    async with proxy(run_name, ["x"], max_context=4096) as (_, srv, eng, *_):
        reader, writer = await asyncio.open_connection(srv.host, srv.port)
        writer.write(_head("chat", srv.port, "Transfer-Encoding: chunked\r\n"))
        answer = asyncio.ensure_future(_response(reader))
        sent = 0
        with pytest.raises(ConnectionError):  # the proxy closes once it answered
            while not answer.done() and sent < 50 * MB:
                writer.write(frame)
                await writer.drain()
                sent += len(chunk)
            raise ConnectionResetError("answered")
        status, body = await asyncio.wait_for(answer, 10)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        t0 = time.monotonic()
    assert time.monotonic() - t0 < LINGER_S + 2  # the proxy's stop
    assert status == 413 and "limit" in body["error"]["message"]
    assert sent < srv.max_body_bytes + 8 * MB, sent
    assert eng.requests == []
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


@pytest.mark.integration
async def test_hangups_are_one_info_line_each(run_name: str, caplog) -> None:
    """200 clients hanging up mid-body, and clients hanging up while the engine works (streaming
    or not): one info line each and ``hrl_proxy_client_hangups_total``, no traceback, nothing
    at warning; the proxy serves on, and a streamed call that lost its client is recorded
    aborted."""
    caplog.set_level(logging.INFO)
    counted = ("hrl_proxy_client_hangups_total", {"api": "chat"})
    before = metrics.sample_value(*counted) or 0
    body = json.dumps({"model": "m", "messages": MSGS}).encode()
    slow = [Reply(text="slow", delay=1.0)] * 4 + ["fine"]
    async with proxy(run_name, slow, grace=0.05) as (sdk, srv, eng, rec, bus):

        async def mid_body() -> None:
            _, writer = await asyncio.open_connection(srv.host, srv.port)
            writer.write(_head("chat", srv.port, f"Content-Length: {len(body)}\r\n"))
            writer.write(body[: len(body) // 2])
            await writer.drain()
            writer.transport.abort()

        async def while_generating(stream: bool) -> None:
            data = json.dumps({"model": "m", "messages": MSGS, "stream": stream}).encode()
            _, writer = await asyncio.open_connection(srv.host, srv.port)
            writer.write(_head("chat", srv.port, f"Content-Length: {len(data)}\r\n") + data)
            await writer.drain()
            await asyncio.sleep(0.4)
            writer.transport.abort()

        await asyncio.gather(*(mid_body() for _ in range(200)))
        await asyncio.gather(*(while_generating(s) for s in (True, True, False, False)))
        deadline = time.monotonic() + 20
        while metrics.sample_value(*counted) < before + 204 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        reply = await sdk.chat.completions.create(model="m", messages=MSGS)
        assert reply.choices[0].message.content == "fine"
        await rec.flush(ROLLOUT)
        records = await bus.read_subject(bus.subjects.calls(ROLLOUT), CallRecord)
    assert sorted(r.status for r in records) == ["aborted", "aborted", "ok", "ok", "ok"]
    assert metrics.sample_value(*counted) == before + 204
    lines = [r for r in caplog.records if "hung up" in r.getMessage()]
    assert len(lines) == 204 and all(r.levelno == logging.INFO for r in lines)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


@pytest.mark.integration
async def test_a_large_prompt_is_tokenised_off_the_event_loop(run_name: str) -> None:
    """A request over ``OFFLOAD_BYTES`` builds its prompt in a worker thread: while ~1 MB of
    text is tokenised (seconds here), the proxy's event loop keeps answering (another client's
    health checks every 10 ms), and the call is answered as it would be on the loop."""
    text = "lorem ipsum dolor sit amet " * 40_000
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    assert len(body) > OFFLOAD_BYTES
    async with proxy(run_name, ["done"], max_context=4_000_000) as (sdk, srv, eng, *_):
        async with aiohttp.ClientSession() as http:
            call = asyncio.ensure_future(
                http.post(
                    srv.url + PATHS["chat"],
                    data=body,
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
            )
            pings = 0
            while not call.done():
                async with http.get(srv.url + "/") as r:
                    pings += r.status == 200
                await asyncio.sleep(0.01)
            async with call.result() as r:
                assert r.status == 200, await r.text()
        want = R.encode(R.render([{"role": "user", "content": text}], None, gen=True))
        assert eng.requests[0]["input_ids"] == want
    assert pings >= 10, pings
