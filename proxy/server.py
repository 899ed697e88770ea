"""The proxy's HTTP front: what a harness talks to (DESIGN §4).

Routes: ``HEAD/GET /`` (health), ``GET /v1/models``, ``POST /v1/chat/completions`` (OpenAI chat),
``POST /v1/messages`` (Anthropic, also with ``?beta=true``) and ``POST /v1/responses`` (OpenAI
Responses, Codex), each streaming and not. Every call goes through ``proxy.calls.ModelCaller``; this module only
converts between the API's shapes and the normalised call, authenticates, and streams.

What must stay true:

* A request without a valid token gets 401 and is recorded nowhere. A token names its rollout.
* Errors come in the API's own shape with the right status: 400 for what can never succeed
  (malformed, context too long), 503 + ``Retry-After`` for what may succeed later. Admission
  and context errors are known before any engine work, so they always get a real status.
* Pseudo-streaming: the model's output is parsed once, complete, and then sent as well-formed
  events. While the engine works the stream is kept alive with SSE comments; the response
  headers are held back for ``stream_grace_s`` so that a fast failure (engine down) still gets
  a real HTTP status the harness retries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from proxy.calls import (
    BadRequest,
    CallError,
    CallReply,
    CallRequest,
    ContextTooLong,
    ModelCaller,
    PendingCall,
)
from proxy.messages_api import (
    message_events,
    message_response,
    message_start,
    messages_error,
    messages_request,
    new_message_id,
)
from proxy.responses_api import (
    failed_event,
    new_response_id,
    response_created,
    response_events,
    response_object,
    responses_request,
)
from proxy.tito import normalize_messages

log = logging.getLogger("harnessrl.proxy.server")

__all__ = ["ProxyServer", "chat_request"]

_REQUESTED_KEYS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "tool_choice",
    "reasoning_effort",
)


# ---------------------------------------------------------------------------------------------
# OpenAI chat completions: request -> call, reply -> response
# ---------------------------------------------------------------------------------------------


def chat_request(body: Any, rollout_id: str, headers: Mapping[str, str]) -> CallRequest:
    """An OpenAI ``/chat/completions`` body as a ``CallRequest`` (``BadRequest`` if invalid)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    if int(body.get("n") or 1) != 1:
        raise BadRequest("only n=1 is supported")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'")
        role = {"developer": "system", "function": "tool"}.get(m["role"], m["role"])
        msgs.append({**m, "role": role})
    tools = []
    for t in body.get("tools") or []:
        if isinstance(t, dict) and t.get("type", "function") == "function" and "function" in t:
            tools.append({"type": "function", "function": t["function"]})
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest("'max_tokens' must be a positive integer")
    return CallRequest(
        rollout_id=rollout_id,
        messages=normalize_messages(msgs),
        tools=tools or None,
        api="chat",
        headers=dict(headers),
        max_tokens=max_tokens,
        requested={k: body[k] for k in _REQUESTED_KEYS if k in body},
        id_prefix="call_",
    )


def _chat_message(reply: CallReply) -> dict[str, Any]:
    msg = reply.message
    out: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
    if msg.get("tool_calls"):
        out["tool_calls"] = msg["tool_calls"]
        out["content"] = msg["content"] or None
    if msg.get("reasoning_content") is not None:
        out["reasoning_content"] = msg["reasoning_content"]
    return out


def _usage(reply: CallReply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def chat_response(reply: CallReply, model: str, cid: str) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _chat_message(reply),
                "finish_reason": reply.finish,
                "logprobs": None,
            }
        ],
        "usage": _usage(reply),
    }


def chat_chunks(
    reply: CallReply, model: str, cid: str, include_usage: bool
) -> list[dict[str, Any]]:
    """The complete reply as ``chat.completion.chunk`` events."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    msg = reply.message
    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("reasoning_content"):
        out.append(chunk({"reasoning_content": msg["reasoning_content"]}))
    if msg["content"]:
        out.append(chunk({"content": msg["content"]}))
    for i, tc in enumerate(msg.get("tool_calls", [])):
        out.append(chunk({"tool_calls": [{"index": i, **tc}]}))
    out.append(chunk({}, reply.finish))
    if include_usage:
        out.append({**chunk({}), "choices": [], "usage": _usage(reply)})
    return out


def openai_error(e: CallError) -> web.Response:
    kind = "invalid_request_error" if e.status == 400 else "server_error"
    code = "context_length_exceeded" if isinstance(e, ContextTooLong) else None
    headers = {}
    if e.retry_after:
        headers["Retry-After"] = str(max(1, round(e.retry_after)))
    body = {"error": {"message": e.message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=e.status, headers=headers)


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------


class ProxyServer:
    """aiohttp server in front of a ``ModelCaller``.

    ``tokens`` maps each accepted API key (``Authorization: Bearer`` or ``x-api-key``) to the
    rollout its calls belong to.
    """

    def __init__(
        self,
        caller: ModelCaller,
        tokens: Mapping[str, str],
        *,
        model_name: str = "harnessrl",
        host: str = "127.0.0.1",
        port: int = 0,
        ping_s: float = 5.0,
        stream_grace_s: float = 2.0,
        unix_path: str = "",
    ) -> None:
        self.caller = caller
        self.unix_path = unix_path
        """Listen on this unix socket instead of TCP (mounted into a sandbox)."""
        self.tokens = dict(tokens)
        self.model_name = model_name
        self.host, self.port = host, port
        self.ping_s = ping_s
        self.stream_grace_s = stream_grace_s
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_get("/", self._health)  # HEAD too
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/responses", self._responses)
        return app

    async def start(self) -> ProxyServer:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        if self.unix_path:
            await web.UnixSite(self._runner, self.unix_path).start()
            return self
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ProxyServer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # -- helpers ----------------------------------------------------------------------------

    def _rollout(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        token = token or request.headers.get("x-api-key", "")
        return self.tokens.get(token)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        if self._rollout(request) is None:
            return _unauthorized()
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "harnessrl"}
        return web.json_response({"object": "list", "data": [model]})

    # -- chat completions -------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        rollout = self._rollout(request)
        if rollout is None:
            return _unauthorized()
        try:
            body = await request.json()
        except (ValueError, LookupError):  # not JSON, or in an unknown charset
            return openai_error(BadRequest("request body is not valid JSON"))
        model = str(body.get("model") or self.model_name) if isinstance(body, dict) else ""
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            pending = self.caller.admit(_convert(chat_request, body, rollout, request.headers))
        except CallError as e:
            return openai_error(e)
        if not body.get("stream"):
            try:
                reply = await self.caller.run(pending)
            except CallError as e:
                return openai_error(e)
            return web.json_response(chat_response(reply, model, cid))
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return await self._pseudo_stream(
            request,
            pending,
            lambda reply: chat_chunks(reply, model, cid, include_usage),
            openai_error,
        )

    async def _pseudo_stream(
        self,
        request: web.Request,
        pending: PendingCall,
        events: Callable[[CallReply], list[dict[str, Any]]],
        error: Callable[[CallError], web.Response],
        *,
        sse: Callable[[dict[str, Any]], bytes] = lambda ev: _sse(ev),
        opening: list[dict[str, Any]] = (),  # type: ignore[assignment]
        ping: bytes = b": ping\n\n",
        done: bytes = b"data: [DONE]\n\n",
        failed: Callable[[CallError], dict[str, Any]] | None = None,
    ) -> web.StreamResponse:
        """Run the call; stream its complete reply as SSE events (see the module docstring)."""
        task = asyncio.ensure_future(self.caller.run(pending))
        await asyncio.wait({task}, timeout=self.stream_grace_s)
        if task.done() and isinstance(task.exception(), CallError):
            return error(task.exception())  # type: ignore[arg-type]
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await resp.prepare(request)
            for ev in opening:
                await resp.write(sse(ev))
            while not task.done():
                await asyncio.wait({task}, timeout=self.ping_s)
                if not task.done():
                    await resp.write(ping)
            try:
                reply = task.result()
            except CallError as e:  # too late for a status: the API's error event
                ev = failed(e) if failed else json.loads(error(e).body)  # type: ignore[arg-type]
                await resp.write(sse(ev))
            else:
                for ev in events(reply):
                    await resp.write(sse(ev))
                if done:
                    await resp.write(done)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            task.cancel()  # the harness went away: abort the engine call, record it aborted
            with contextlib.suppress(BaseException):
                await task
            raise
        return resp

    # -- Anthropic messages -----------------------------------------------------------------

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        rollout = self._rollout(request)
        if rollout is None:
            body = {
                "type": "error",
                "error": {"type": "authentication_error", "message": "invalid x-api-key"},
            }
            return web.json_response(body, status=401)
        try:
            body = await request.json()
        except (ValueError, LookupError):  # not JSON, or in an unknown charset
            return messages_error(BadRequest("request body is not valid JSON"))
        model = str(body.get("model") or self.model_name) if isinstance(body, dict) else ""
        mid = new_message_id()
        try:
            pending = self.caller.admit(_convert(messages_request, body, rollout, request.headers))
        except CallError as e:
            return messages_error(e)
        if not body.get("stream"):
            try:
                reply = await self.caller.run(pending)
            except CallError as e:
                return messages_error(e)
            return web.json_response(message_response(reply, model, mid))
        return await self._pseudo_stream(
            request,
            pending,
            message_events,
            messages_error,
            sse=_named_sse,
            opening=[message_start(model, mid, len(pending.input_ids))],
            ping=_named_sse({"type": "ping"}),
            done=b"",
        )

    # -- OpenAI responses -------------------------------------------------------------------

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        rollout = self._rollout(request)
        if rollout is None:
            return _unauthorized()
        try:
            body = await request.json()
        except (ValueError, LookupError):  # not JSON, or in an unknown charset
            return openai_error(BadRequest("request body is not valid JSON"))
        model = str(body.get("model") or self.model_name) if isinstance(body, dict) else ""
        rid = new_response_id()
        try:
            pending = self.caller.admit(_convert(responses_request, body, rollout, request.headers))
        except CallError as e:
            return openai_error(e)
        if not body.get("stream"):
            try:
                reply = await self.caller.run(pending)
            except CallError as e:
                return openai_error(e)
            return web.json_response(response_object(reply, model, rid))
        return await self._pseudo_stream(
            request,
            pending,
            lambda reply: response_events(reply, model, rid),
            openai_error,
            sse=_named_sse,
            opening=[response_created(model, rid)],
            done=b"",
            failed=lambda e: failed_event(e.message, model, rid),
        )


def _convert(
    convert: Callable[[Any, str, Mapping[str, str]], CallRequest],
    body: Any,
    rollout: str,
    headers: Mapping[str, str],
) -> CallRequest:
    """``convert(body, ...)``, with any failure on a malformed body (a field of the wrong type
    deep inside) answered as ``BadRequest``: it can never succeed, so never a 500."""
    try:
        return convert(body, rollout, headers)
    except CallError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        raise BadRequest(f"malformed request: {type(e).__name__}: {e}") from None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _named_sse(obj: dict[str, Any]) -> bytes:
    """Anthropic's SSE framing: ``event: <type>`` then the data line."""
    kind = str(obj.get("type", "message"))
    return f"event: {kind}\n".encode() + _sse(obj)


def _unauthorized() -> web.Response:
    body = {"error": {"message": "invalid API key", "type": "authentication_error", "code": 401}}
    return web.json_response(body, status=401)
