"""Anthropic ``/v1/messages``: request -> normalised call, reply -> message or SSE events.

Conversion rules (what TITO relies on: the same history always converts the same way):

* ``system`` (a string or text blocks, joined with ``\\n``) and ``role: "system"`` messages
  become system messages; ``cache_control`` and other block annotations are ignored.
* A user message's ``tool_result`` blocks become ``tool`` messages (in order), its text blocks
  one user message after them; images and documents are dropped (text models).
* An assistant message's ``thinking`` blocks become ``reasoning_content``, ``text`` blocks the
  content, ``tool_use`` blocks tool calls (``input`` as JSON text); ``redacted_thinking`` is
  dropped.
* Tools ``{name, description, input_schema}`` become OpenAI function tools; server tools
  (``type`` other than ``custom``) and tools with ``defer_loading`` are left out.

Replies: thinking block (with an opaque ``hrl:`` signature), text block, ``tool_use`` blocks;
``stop_reason`` ``tool_use`` | ``end_turn`` | ``max_tokens``; usage reports the real prompt size
(``input_tokens`` + ``cache_read_input_tokens``), never more.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from harnessrl.proxy.calls import BadRequest, CallError, CallReply, CallRequest
from harnessrl.proxy.tito import normalize_messages

__all__ = ["message_events", "message_response", "messages_error", "messages_request"]

_REQUESTED_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop_sequences",
    "thinking",
    "tool_choice",
)
_STOP = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}


def _blocks(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, dict):
        return [content]
    return [b if isinstance(b, dict) else {"type": "text", "text": str(b)} for b in content]


def _text(blocks: list[dict[str, Any]]) -> str:
    return "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")


def _user(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for b in blocks:
        if b.get("type") == "tool_result":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(b.get("tool_use_id") or ""),
                    "content": _text(_blocks(b.get("content"))),
                }
            )
    if any(b.get("type") == "text" for b in blocks) or not out:
        out.append({"role": "user", "content": _text(blocks)})
    return out


def _assistant(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": _text(blocks)}
    thinking = [str(b.get("thinking") or "") for b in blocks if b.get("type") == "thinking"]
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    calls = [
        {
            "id": str(b.get("id") or ""),
            "type": "function",
            "function": {
                "name": str(b.get("name") or ""),
                "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False),
            },
        }
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    if calls:
        msg["tool_calls"] = calls
    return msg


def messages_request(body: Any, rollout_id: str, headers: Mapping[str, str]) -> CallRequest:
    """An Anthropic ``/v1/messages`` body as a ``CallRequest`` (``BadRequest`` if invalid)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty array")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("max_tokens: must be a positive integer")
    msgs: list[dict[str, Any]] = []
    system = _text(_blocks(body.get("system")))
    if system:
        msgs.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"messages.{i}: role must be user, assistant or system")
        blocks = _blocks(m.get("content"))
        if m["role"] == "assistant":
            msgs.append(_assistant(blocks))
        elif m["role"] == "system":
            msgs.append({"role": "system", "content": _text(blocks)})
        else:
            msgs.extend(_user(blocks))
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object"},
            },
        }
        for t in body.get("tools") or []
        if isinstance(t, dict)
        and t.get("type", "custom") == "custom"
        and t.get("name")
        and not t.get("defer_loading")
    ]
    return CallRequest(
        rollout_id=rollout_id,
        messages=normalize_messages(msgs),
        tools=tools or None,
        api="messages",
        headers=dict(headers),
        max_tokens=max_tokens,
        requested={k: body[k] for k in _REQUESTED_KEYS if k in body},
        id_prefix="toolu_",
    )


def signature(reasoning: str) -> str:
    """Opaque signature of a thinking block (lets the proxy recognise its own reasoning)."""
    return "hrl:" + hashlib.blake2b(reasoning.encode(), digest_size=12).hexdigest()


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def _content(reply: CallReply) -> list[dict[str, Any]]:
    msg = reply.message
    out: list[dict[str, Any]] = []
    if msg.get("reasoning_content") is not None:
        r = msg["reasoning_content"]
        out.append({"type": "thinking", "thinking": r, "signature": signature(r)})
    if msg["content"] or not msg.get("tool_calls"):
        out.append({"type": "text", "text": msg["content"]})
    for tc in msg.get("tool_calls", []):
        fn = tc["function"]
        out.append(
            {
                "type": "tool_use",
                "id": tc["id"],
                "name": fn["name"],
                "input": _input(fn["arguments"]),
            }
        )
    return out


def _usage(reply: CallReply) -> dict[str, int]:
    return {
        "input_tokens": reply.prompt_tokens - reply.cached_tokens,
        "cache_read_input_tokens": reply.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": reply.completion_tokens,
    }


def message_response(reply: CallReply, model: str, mid: str) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content(reply),
        "stop_reason": _STOP[reply.finish],
        "stop_sequence": None,
        "usage": _usage(reply),
    }


def message_start(model: str, mid: str, prompt_tokens: int) -> dict[str, Any]:
    return {
        "type": "message_start",
        "message": {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        },
    }


def message_events(reply: CallReply) -> list[dict[str, Any]]:
    """The complete reply as the events after ``message_start``."""
    out: list[dict[str, Any]] = []
    for i, block in enumerate(_content(reply)):
        kind = block["type"]
        if kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "text":
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        else:
            start = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        out.append({"type": "content_block_start", "index": i, "content_block": start})
        out.extend({"type": "content_block_delta", "index": i, "delta": d} for d in deltas)
        out.append({"type": "content_block_stop", "index": i})
    out.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": _STOP[reply.finish], "stop_sequence": None},
            "usage": _usage(reply),
        }
    )
    out.append({"type": "message_stop"})
    return out


def messages_error(e: CallError) -> web.Response:
    """Anthropic's error shape: 400 invalid_request_error, 413 request_too_large, 529
    overloaded_error, 5xx api_error."""
    if e.status == 400:
        status, kind = 400, "invalid_request_error"
    elif e.status == 413:
        status, kind = 413, "request_too_large"
    elif e.status == 503:
        status, kind = 529, "overloaded_error"
    else:
        status, kind = e.status, "api_error"
    headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after else {}
    body = {"type": "error", "error": {"type": kind, "message": e.message}}
    return web.json_response(body, status=status, headers=headers)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"
