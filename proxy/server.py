"""The proxy's HTTP front: what a harness talks to (docs/design.md, "The proxy").

Routes: ``HEAD/GET /`` (health), ``GET /v1/models``, ``POST /v1/chat/completions`` (OpenAI chat),
``POST /v1/messages`` (Anthropic, also with ``?beta=true``) and ``POST /v1/responses`` (OpenAI
Responses, Codex), each streaming and not. Every call goes through ``harnessrl.proxy.calls.ModelCaller``;
this module only authenticates, converts between the API's shapes and the normalised call, and
streams. The three model APIs share one handler (``ProxyServer._serve``: auth -> parse -> call
-> reply or stream -> errors) driven by a small descriptor per API (``Api``: ``CHAT``,
``MESSAGES``, ``RESPONSES``), which names that API's parse, reply, stream and error-shape
functions (OpenAI chat's below, the others' in ``harnessrl.proxy.messages_api`` and
``harnessrl.proxy.responses_api``).

What must stay true:

* A request without a valid token gets 401 and is recorded nowhere. A token names its rollout.
* Errors come in the API's own shape with the right status: 400 for what can never succeed
  (malformed, context too long), 503 + ``Retry-After`` for what may succeed later. Admission
  and context errors are known before any engine work, so they always get a real status.
* Bad input is never a 5xx. A body is checked against its API's schema
  (``harnessrl.proxy.schema``) before it is converted: a violation is a 400 naming the field;
  fields outside the schema are ignored and counted (``hrl_proxy_unknown_fields_total``).
  Text that is not Unicode (a lone surrogate) and JSON nested beyond what the parser or the
  template can recurse into are 400s too.
* A body over ``max_body_bytes`` (sized from the context window, see
  ``harnessrl.proxy.proxy_config.request_bytes_limit``) is a 413 before it is read: by its
  ``Content-Length``, or as soon as a chunked body passes the limit. One harness cannot make
  the proxy parse and tokenise megabytes that can never fit the context.
* A client that hangs up (mid-body, while the engine works, mid-stream) is one info line and
  ``hrl_proxy_client_hangups_total``, never a traceback; its engine call is aborted when it
  was streaming.
* Pseudo-streaming: the model's output is parsed once, complete, and then sent as well-formed
  events. While the engine works the stream is kept alive with SSE comments; the response
  headers are held back for ``stream_grace_s`` so that a fast failure (engine down) still gets
  a real HTTP status the harness retries on. The events are serialised once and written
  together with the end of the stream (with the headers and opening events too when the engine
  answered within the grace): one send per stage, not one per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from harnessrl.common import metrics
from harnessrl.proxy.calls import (
    BadRequest,
    CallError,
    CallReply,
    CallRequest,
    ModelCaller,
    PendingCall,
    TooLarge,
)
from harnessrl.proxy.messages_api import (
    message_events,
    message_response,
    message_start,
    messages_error,
    messages_request,
    new_message_id,
)
from harnessrl.proxy.proxy_config import request_bytes_limit
from harnessrl.proxy.responses_api import (
    failed_event,
    new_response_id,
    response_created,
    response_events,
    response_object,
    responses_request,
)
from harnessrl.proxy.schema import SchemaError, check, openai_param
from harnessrl.proxy.tito import normalize_messages

log = logging.getLogger("harnessrl.proxy.server")

M_UNKNOWN_FIELDS = metrics.counter(
    "hrl_proxy_unknown_fields_total",
    "Top-level request fields outside the API's schema (ignored), by API",
    ("api",),
)
M_HANGUPS = metrics.counter(
    "hrl_proxy_client_hangups_total",
    "Requests whose client hung up before the answer was sent, by API",
    ("api",),
)
_HANGUP = (ConnectionError, aiohttp.ClientPayloadError)
"""What reading a request or writing its answer raises when the client went away."""
OFFLOAD_BYTES = 256 << 10
"""Requests at least this large are parsed, labelled and tokenised in a worker thread
(``ModelCaller.admit_offloaded``): tokenising releases the GIL, and the rest gives it up at
least every switch interval, so the other rollouts of the process are served meanwhile.
Below it, the thread's hops cost more than they save."""
LINGER_S = 1.0
"""How long the body of a request answered without reading it (401, 413) is still read and
discarded after the answer, so that a client still sending gets the answer rather than a
connection reset (aiohttp's default is 10 s; a loopback or unix-socket upload takes
milliseconds, and the proxy's own stop waits for it)."""
_LOGGED_UNKNOWN: set[str] = set()
"""Unknown field names already logged (once each, at most `_MAX_LOGGED_UNKNOWN`)."""
_MAX_LOGGED_UNKNOWN = 256

__all__ = ["CHAT", "MESSAGES", "RESPONSES", "Api", "ProxyServer", "chat_request"]

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


_ROLES = {"developer": "system", "function": "tool"}
"""OpenAI chat roles that the normalised format names otherwise."""

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
        role = _ROLES.get(m["role"])
        msgs.append({**m, "role": role} if role else m)  # normalize_messages copies anyway
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
    bad = isinstance(e, BadRequest)
    kind = "invalid_request_error" if bad else "server_error"
    param, code = (e.param, e.code) if isinstance(e, BadRequest) else (None, None)
    headers = {}
    if e.retry_after:
        headers["Retry-After"] = str(max(1, round(e.retry_after)))
    body = {"error": {"message": e.message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=e.status, headers=headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _named_sse(obj: dict[str, Any]) -> bytes:
    """Anthropic's SSE framing: ``event: <type>`` then the data line."""
    kind = str(obj.get("type", "message"))
    return f"event: {kind}\n".encode() + _sse(obj)


def _unauthorized() -> web.Response:
    body = {"error": {"message": "invalid API key", "type": "authentication_error", "code": 401}}
    return web.json_response(body, status=401)


# ---------------------------------------------------------------------------------------------
# the three APIs, as descriptors of one handler
# ---------------------------------------------------------------------------------------------


def _no_events(model: str, rid: str, pending: PendingCall) -> list[dict[str, Any]]:
    return []


@dataclass(frozen=True)
class Api:
    """What differs between the model APIs; ``ProxyServer`` runs one skeleton for all of them:
    authenticate -> parse the JSON body -> ``convert`` -> admit (errors: ``error``) -> run ->
    ``response``, or when the body asks to stream: ``opening`` events, pings, then ``events``
    (a failure once the stream started: ``failed``, else ``error``'s body, as one event)."""

    name: str
    """The API's name (``chat``, ``messages``, ``responses``): its schema in
    ``harnessrl.proxy.schema`` and its metric label."""
    convert: Callable[[Any, str, Mapping[str, str]], CallRequest]
    """``(body, rollout_id, headers) -> CallRequest`` of a body that matches the schema;
    raises ``BadRequest`` when invalid."""
    error: Callable[[CallError], web.Response]
    """A ``CallError`` as a response in the API's error shape (and status)."""
    unauthorized: Callable[[], web.Response]
    """The 401 response in the API's error shape."""
    new_id: Callable[[], str]
    """A fresh id of the reply (``chatcmpl-…``, ``msg_…``, ``resp_…``)."""
    response: Callable[[CallReply, str, str], dict[str, Any]]
    """``(reply, model, id) ->`` the non-streaming body."""
    events: Callable[[CallReply, str, str, dict[str, Any]], list[dict[str, Any]]]
    """``(reply, model, id, request body) ->`` the stream's events after the opening ones."""
    opening: Callable[[str, str, PendingCall], list[dict[str, Any]]] = _no_events
    """``(model, id, call) ->`` events sent as soon as the stream starts."""
    sse: Callable[[dict[str, Any]], bytes] = _sse
    """One event as SSE bytes."""
    ping: bytes = b": ping\n\n"
    """Keep-alive sent while the engine works."""
    done: bytes = b"data: [DONE]\n\n"
    """Sent after the last event of a successful stream (``b""``: nothing)."""
    failed: Callable[[CallError, str, str], dict[str, Any]] | None = None
    """``(error, model, id) ->`` the event of a failure after the stream started; None: the
    body of ``error(e)``."""

    def schema_error(self, e: SchemaError) -> BadRequest:
        """A schema violation, worded as this API words it."""
        if self.name == "messages":
            return BadRequest(e.anthropic_message())
        return BadRequest(e.openai_message(), param=openai_param(e.path) or None, code=e.code)


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _anthropic_unauthorized() -> web.Response:
    body = {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid x-api-key"},
    }
    return web.json_response(body, status=401)


CHAT = Api(
    name="chat",
    convert=chat_request,
    error=openai_error,
    unauthorized=_unauthorized,
    new_id=lambda: f"chatcmpl-{uuid.uuid4().hex}",
    response=chat_response,
    events=lambda reply, model, cid, body: chat_chunks(reply, model, cid, _include_usage(body)),
)
"""OpenAI ``/v1/chat/completions``."""

MESSAGES = Api(
    name="messages",
    convert=messages_request,
    error=messages_error,
    unauthorized=_anthropic_unauthorized,
    new_id=new_message_id,
    response=message_response,
    events=lambda reply, model, mid, body: message_events(reply),
    opening=lambda model, mid, pending: [message_start(model, mid, len(pending.ids))],
    sse=_named_sse,
    ping=_named_sse({"type": "ping"}),
    done=b"",
)
"""Anthropic ``/v1/messages``."""

RESPONSES = Api(
    name="responses",
    convert=responses_request,
    error=openai_error,
    unauthorized=_unauthorized,
    new_id=new_response_id,
    response=response_object,
    events=lambda reply, model, rid, body: response_events(reply, model, rid),
    opening=lambda model, rid, pending: [response_created(model, rid)],
    sse=_named_sse,
    done=b"",
    failed=lambda e, model, rid: failed_event(e.message, model, rid),
)
"""OpenAI ``/v1/responses``."""


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
        max_body_bytes: int = 0,
    ) -> None:
        self.caller = caller
        self.max_body_bytes = max_body_bytes or request_bytes_limit(caller.max_context)
        """Largest request body read (413 above it); 0: sized from the caller's context."""
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
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_get("/", self._health)  # HEAD too
        app.router.add_get("/v1/models", self._models)
        for path, api in (
            ("/v1/chat/completions", CHAT),
            ("/chat/completions", CHAT),
            ("/v1/messages", MESSAGES),
            ("/v1/responses", RESPONSES),
            ("/responses", RESPONSES),
        ):
            app.router.add_post(path, self._handler(api))
        return app

    async def start(self) -> ProxyServer:
        self._runner = web.AppRunner(self.app(), access_log=None, lingering_time=LINGER_S)
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

    # -- the model APIs ---------------------------------------------------------------------

    def _handler(self, api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, api)

        return handle

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        """One model call through ``api``: auth -> read -> check -> admit -> reply or stream
        (a client that hangs up on the way is one info line, see `_hung_up`)."""
        rollout = self._rollout(request)
        if rollout is None:
            return api.unauthorized()
        try:
            resp = await self._call(request, api, rollout)
        except _HANGUP as e:
            self._hung_up(api, rollout, repr(e))
            return web.Response(status=499)  # nobody reads it
        if request.transport is None or request.transport.is_closing():
            self._hung_up(api, rollout, "before the answer was sent")
        return resp

    async def _call(self, request: web.Request, api: Api, rollout: str) -> web.StreamResponse:
        try:
            raw = await self._body(request)
            args = (api, raw, request.charset, rollout, request.headers)
            if len(raw) >= OFFLOAD_BYTES:  # parse and tokenise in a worker thread
                body, req = await asyncio.to_thread(_request, *args)
                pending = await self.caller.admit_offloaded(req)
            else:
                body, req = _request(*args)
                pending = self.caller.admit(req)
        except RecursionError:  # a free-form field (a tool schema) too deep to render
            return api.error(_TOO_DEEP)
        except CallError as e:
            return api.error(e)
        model = str(body.get("model") or self.model_name)
        rid = api.new_id()
        if not body.get("stream"):
            try:
                reply = await self.caller.run(pending)
            except CallError as e:
                return api.error(e)
            return web.json_response(api.response(reply, model, rid))
        return await self._pseudo_stream(request, pending, api, model, rid, body)

    async def _body(self, request: web.Request) -> bytes:
        """The body, read only while it stays under ``max_body_bytes`` (`TooLarge`)."""
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise TooLarge(_too_large(request.content_length, limit))
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body, past the limit
            raise TooLarge(_too_large(None, limit)) from None

    def _hung_up(self, api: Api, rollout: str, how: str) -> None:
        M_HANGUPS.labels(api=api.name).inc()
        log.info("rollout %s: the client hung up on a %s call (%s)", rollout, api.name, how)

    async def _pseudo_stream(
        self,
        request: web.Request,
        pending: PendingCall,
        api: Api,
        model: str,
        rid: str,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        """Run the call; stream its complete reply as SSE events (see the module docstring)."""
        task = asyncio.ensure_future(self.caller.run(pending))
        await asyncio.wait({task}, timeout=self.stream_grace_s)
        if task.done() and isinstance(task.exception(), CallError):
            return api.error(task.exception())  # type: ignore[arg-type]
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await resp.prepare(request)
            head = b"".join(api.sse(ev) for ev in api.opening(model, rid, pending))
            if not task.done():  # the opening events now, then pings while the engine works
                if head:
                    await resp.write(head)
                head = b""
            while not task.done():
                await asyncio.wait({task}, timeout=self.ping_s)
                if not task.done():
                    await resp.write(api.ping)
            try:
                reply = task.result()
            except CallError as e:  # too late for a status: the API's error event
                if api.failed is not None:
                    ev = api.failed(e, model, rid)
                else:
                    ev = json.loads(api.error(e).body)  # type: ignore[arg-type]
                tail = api.sse(ev)
            else:
                events = api.events(reply, model, rid, body)
                tail = b"".join(api.sse(ev) for ev in events) + api.done
            # the rest in one write with the end of the stream (one send, not one per event)
            await resp.write_eof(head + tail)
        except (ConnectionResetError, asyncio.CancelledError):
            task.cancel()  # the harness went away: abort the engine call, record it aborted
            with contextlib.suppress(BaseException):
                await task
            raise
        return resp


_decode_json = msgspec.json.Decoder().decode
_TOO_DEEP = BadRequest("the request is nested too deeply", code="invalid_value")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_large(size: int | None, limit: int) -> str:
    what = f"request body of {size} bytes is" if size is not None else "request body is"
    return (
        f"{what} over this proxy's limit of {limit} bytes (sized from the model's context "
        "window: a larger request could never fit it)"
    )


def _request(
    api: Api, raw: bytes, charset: str | None, rollout: str, headers: Mapping[str, str]
) -> tuple[Any, CallRequest]:
    """The JSON body and the call it asks for (touches no shared state: may run in a worker
    thread)."""
    body = _json_body(raw, charset)
    return body, _convert(api, body, rollout, headers)


def _json_body(raw: bytes, charset: str | None) -> Any:
    """The JSON body, as ``request.json()`` reads it. A UTF-8 body (every harness's) is
    decoded by msgspec, several times faster than the standard library on a long
    conversation; what msgspec refuses and the standard library accepts (``NaN``, numbers
    beyond float range) goes the standard library's way. ``BadRequest`` for what is not JSON,
    is nested too deeply to parse, or holds a lone surrogate (not Unicode text)."""
    if (charset or "utf-8").lower() in ("utf-8", "utf8"):
        try:
            return _decode_json(raw)
        except RecursionError:
            raise _TOO_DEEP from None
        except msgspec.DecodeError:
            pass
    try:
        body = json.loads(raw.decode(charset or "utf-8"))
    except RecursionError:
        raise _TOO_DEEP from None
    except (ValueError, LookupError):  # not JSON, or in an unknown charset
        raise BadRequest("request body is not valid JSON") from None
    _check_unicode(body)
    return body


def _check_unicode(body: Any) -> None:
    """Raise ``BadRequest`` naming a string (or key) that holds a lone surrogate."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):
                    _lone_surrogate(path, k)
                stack.append(((*path, k), x))
        elif isinstance(v, list):
            stack.extend(((*path, i), x) for i, x in enumerate(v))
        elif isinstance(v, str) and _SURROGATE.search(v):
            _lone_surrogate(path, v)


def _lone_surrogate(path: tuple[str | int, ...], text: str) -> None:
    param = openai_param(path)
    where = f"'{param}' ({'.'.join(map(str, path))})" if path else "the body"
    char = _SURROGATE.search(text)[0]  # type: ignore[index]
    raise BadRequest(
        f"{where} holds a lone surrogate {char!r}: not valid Unicode text",
        param=param or None,
        code="invalid_value",
    )


def _convert(api: Api, body: Any, rollout: str, headers: Mapping[str, str]) -> CallRequest:
    """``api.convert(body, ...)`` of a body checked against the API's schema (a violation is a
    ``BadRequest`` naming the field; unknown top-level fields are counted), with any failure
    left on a malformed body answered as ``BadRequest``: it can never succeed, so never a
    500."""
    try:
        unknown = check(api.name, body)
    except SchemaError as e:
        raise api.schema_error(e) from None
    if unknown:
        M_UNKNOWN_FIELDS.labels(api=api.name).inc(len(unknown))
        _log_unknown(api.name, unknown)
    try:
        return api.convert(body, rollout, headers)
    except CallError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        raise BadRequest(f"malformed request: {type(e).__name__}: {e}") from None


def _log_unknown(api: str, names: list[str]) -> None:
    new = [n for n in names if f"{api}:{n}" not in _LOGGED_UNKNOWN]
    if new and len(_LOGGED_UNKNOWN) < _MAX_LOGGED_UNKNOWN:
        _LOGGED_UNKNOWN.update(f"{api}:{n}" for n in new)
        log.info("%s requests carry fields outside the API's schema (ignored): %s", api, new)
