"""Tool calls for chat templates that cannot render tools: a Hermes-style fallback.

Agent harnesses send tools (mini-swe-agent declares ``bash``; Claude Code, Codex, OpenClaw and
opencode declare many), but some chat templates have no tool section: SmolLM2's writes only
``role`` and ``content`` of each message, so the tool definitions, the assistant's tool calls and
the tool results' meaning would silently vanish from the prompt. For such a template (and only
for it: ``ChatRenderer`` probes the template once with :func:`template_renders_tools`) the proxy
rewrites the normalised messages before the template renders them, in the Hermes format the
project's own template and Qwen's use, which the default ``hermes`` parser reads back:

* **Tools** go into the system turn: the first message's content (a ``system`` message) gets
  ``"\\n\\n"`` and the block below appended; without a system message, a system message holding
  only the block is put first (it replaces a default system prompt the template would write)::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {tool 1 as JSON}
      {tool 2 as JSON}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (the last sentence is one line). Each tool is ``json.dumps(tool, ensure_ascii=False)`` of the
  OpenAI form ``{"type": "function", "function": {...}}``.
* **Assistant tool calls** become text after the content: ``{content}\\n<tool_call>\\n{"name":
  "{name}", "arguments": {arguments}}\\n</tool_call>`` (no ``\\n`` before the first block when
  the content is empty; blocks joined by ``\\n``; ``arguments`` inserted verbatim, as sampled).
  So for canonical output, ``render(msgs, gen) + output + turn end == render(msgs + [parsed
  reply])``, the invariant token-in-token-out relies on, holds as with a tool template.
* **Tool results** stay one ``tool`` turn each (Hermes-2-Pro style, so a history ending in a
  tool result stays a prefix of the history with one more), their content wrapped as
  ``<tool_response>\\n{content}\\n</tool_response>``.

Messages the fallback does not touch (users, assistants without tool calls) render exactly as the
template writes them. The rewrite is a pure function of the messages and tools, so renders of a
prefix stay prefixes of renders of the whole, and window rendering (``ChatRenderer.new_part``)
stays exact: the tools block lives in the first message, which every window keeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TOOLS_HEADER", "hermes_messages", "template_renders_tools"]

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_PROBE_NAME = "harnessrl_tool_probe_5e1f"


def template_renders_tools(
    render: Callable[[Sequence[dict[str, Any]], Sequence[dict[str, Any]] | None], str],
) -> bool:
    """Whether a template writes the tools it is given: ``render(messages, tools)`` of a user
    turn with one probe tool names that tool. A template that raises on tools cannot."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": _PROBE_NAME,
                "description": "Probe.",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    try:
        return _PROBE_NAME in render([{"role": "user", "content": "x"}], tools)
    except Exception:
        return False


def _tools_block(tools: Sequence[dict[str, Any]]) -> str:
    return TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER


def _call_text(tc: dict[str, Any]) -> str:
    fn = tc.get("function") or tc
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps({} if args is None else args, ensure_ascii=False)
    name = json.dumps(str(fn.get("name") or ""), ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call>'


def hermes_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The messages with tools, tool calls and tool results written as text (see the module
    docstring); render them with the template and no ``tools``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            content = m.get("content") or ""
            calls = "\n".join(_call_text(tc) for tc in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            m = {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools:
        block = _tools_block(tools)
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
