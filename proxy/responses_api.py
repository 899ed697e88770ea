"""OpenAI Responses ``/v1/responses`` (Codex): input items -> normalised call, reply -> output.

Conversion rules (the same history always converts the same way, which TITO relies on):

* ``instructions`` becomes the system message; ``message`` items with role ``developer`` or
  ``system`` become system messages, ``user`` user messages (``input_text`` parts joined).
* A run of ``reasoning``, assistant ``message`` and ``function_call`` items is ONE assistant
  turn (reasoning from our own ``encrypted_content`` when it is ours, else the summary text).
* ``function_call_output`` items become ``tool`` messages.
* Tools: ``function`` tools as they are; ``namespace`` tools flattened to ``<ns>.<name>`` (a call
  to one goes back out with ``namespace`` and its own name); hosted tools (``web_search``…) are
  left out.
* ``previous_response_id`` is refused (400): the proxy stores nothing server-side, the harness
  must send the whole input (Codex does with ``store: false``).

Replies: a ``reasoning`` item (summary + ``encrypted_content`` carrying the exact reasoning,
marked as ours), a ``message`` item, ``function_call`` items; ``status`` ``incomplete`` when
the output was cut by ``max_output_tokens``. Streaming sends ``response.created``, then per item
``response.output_item.added``/``.done``, then ``response.completed`` with usage.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping
from typing import Any

from harnessrl.proxy.calls import BadRequest, CallReply, CallRequest
from harnessrl.proxy.tito import normalize_messages

__all__ = [
    "decode_reasoning",
    "encode_reasoning",
    "failed_event",
    "new_response_id",
    "response_created",
    "response_events",
    "response_object",
    "responses_request",
]

_REQUESTED_KEYS = ("temperature", "top_p", "max_output_tokens", "reasoning", "tool_choice")
_OURS = "hrl1:"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        str(p.get("text") or "")
        for p in content
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
    )


def encode_reasoning(reasoning: str) -> str:
    return _OURS + base64.b64encode(reasoning.encode()).decode()


def decode_reasoning(item: dict[str, Any]) -> str | None:
    """The exact reasoning of one of our reasoning items, else its summary text (None: empty)."""
    enc = item.get("encrypted_content")
    if isinstance(enc, str) and enc.startswith(_OURS):
        try:
            return base64.b64decode(enc[len(_OURS) :]).decode()
        except ValueError:
            pass
    parts = [str(s.get("text") or "") for s in item.get("summary") or [] if isinstance(s, dict)]
    return "\n".join(parts) if parts else None


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        if t.get("type") == "function" and t.get("name"):
            out.append(_function(t, t["name"]))
        elif t.get("type") == "namespace":
            for sub in t.get("tools") or []:
                if isinstance(sub, dict) and sub.get("name"):
                    out.append(_function(sub, f"{t.get('name')}.{sub['name']}"))
    return out


def _function(t: dict[str, Any], name: str) -> dict[str, Any]:
    fn = {"name": name, "description": t.get("description", "")}
    fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def responses_request(body: Any, rollout_id: str, headers: Mapping[str, str]) -> CallRequest:
    """A Responses API body as a ``CallRequest`` (``BadRequest`` if invalid)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if body.get("previous_response_id"):
        raise BadRequest("previous_response_id is not supported: send the whole input")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a non-empty string or array")
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": str(body["instructions"])})
    turn: dict[str, Any] | None = None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object")
        kind = item.get("type") or ("message" if "role" in item else "")
        role = item.get("role")
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                msgs.append(turn)
            _add_to_turn(turn, kind, item)
            continue
        turn = None
        if kind == "message":
            mapped = "system" if role in ("developer", "system") else "user"
            msgs.append({"role": mapped, "content": _text(item.get("content"))})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output)
            msgs.append({"role": "tool", "tool_call_id": str(item.get("call_id")), "content": text})
        # other items (web_search_call, images...) carry nothing a text model can see
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest("'max_output_tokens' must be a positive integer")
    tools = _tools(body.get("tools"))
    return CallRequest(
        rollout_id=rollout_id,
        messages=normalize_messages(msgs),
        tools=tools or None,
        api="responses",
        headers=dict(headers),
        max_tokens=max_tokens,
        requested={k: body[k] for k in _REQUESTED_KEYS if k in body},
        id_prefix="call_",
    )


def _add_to_turn(turn: dict[str, Any], kind: str, item: dict[str, Any]) -> None:
    if kind == "reasoning":
        r = decode_reasoning(item)
        if r is not None:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + r
    elif kind == "message":
        turn["content"] += _text(item.get("content"))
    else:
        name = str(item.get("name") or "")
        if item.get("namespace"):
            name = f"{item['namespace']}.{name}"
        call = {"id": str(item.get("call_id") or ""), "type": "function"}
        call["function"] = {"name": name, "arguments": item.get("arguments") or "{}"}
        turn.setdefault("tool_calls", []).append(call)


def _output(reply: CallReply) -> list[dict[str, Any]]:
    msg = reply.message
    out: list[dict[str, Any]] = []
    if msg.get("reasoning_content") is not None:
        r = msg["reasoning_content"]
        out.append(
            {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex[:24]}",
                "summary": [{"type": "summary_text", "text": r}] if r else [],
                "encrypted_content": encode_reasoning(r),
            }
        )
    if msg["content"] or not msg.get("tool_calls"):
        out.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex[:24]}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": msg["content"], "annotations": []}],
            }
        )
    for tc in msg.get("tool_calls", []):
        name = tc["function"]["name"]
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex[:24]}",
            "call_id": tc["id"],
            "name": name,
            "arguments": tc["function"]["arguments"],
            "status": "completed",
        }
        if "." in name:
            item["namespace"], item["name"] = name.rsplit(".", 1)
        out.append(item)
    return out


def _usage(reply: CallReply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": reply.cached_tokens},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _shell(rid: str, model: str, status: str) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def response_object(reply: CallReply, model: str, rid: str) -> dict[str, Any]:
    cut = reply.finish == "length"
    resp = _shell(rid, model, "incomplete" if cut else "completed")
    resp["output"] = _output(reply)
    resp["usage"] = _usage(reply)
    if cut:
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    return resp


def response_created(model: str, rid: str) -> dict[str, Any]:
    return {
        "type": "response.created",
        "sequence_number": 0,
        "response": _shell(rid, model, "in_progress"),
    }


def response_events(reply: CallReply, model: str, rid: str) -> list[dict[str, Any]]:
    """The complete reply as the events after ``response.created``."""
    resp = response_object(reply, model, rid)
    events: list[dict[str, Any]] = []
    for i, item in enumerate(resp["output"]):
        events.append({"type": "response.output_item.added", "output_index": i, "item": item})
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    final = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
    events.append({"type": final, "response": resp})
    for n, ev in enumerate(events, start=1):
        ev["sequence_number"] = n
    return events


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def failed_event(message: str, model: str, rid: str, code: str = "server_error") -> dict[str, Any]:
    resp = _shell(rid, model, "failed")
    resp["error"] = {"code": code, "message": message}
    return {"type": "response.failed", "response": resp}
