"""Tool-call parsers: model text -> (reasoning, content, tool calls).

The default parser (``hermes``, alias ``qwen``) reads the format the chat template writes
(``common/models/chat_template.py``)::

    [<think>\\n{reasoning}\\n</think>\\n\\n]{content}[\\n]<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>[\\n<tool_call>...]<|im_end|>

and is the template's exact inverse on canonical output: the reasoning is kept unstripped,
exactly one ``\\n`` before the first ``<tool_call>`` is dropped from the content, and
``arguments`` is passed on as the raw JSON text the model wrote, so that rendering the parsed
message after the generation prompt reproduces the generated text (``render(msgs, gen) + text +
"\\n" == render(msgs + [parsed])``). Output that is not canonical is still parsed as well as it
can be, and never raises: a block whose JSON does not parse stays in the content as text.

A parser is any object with ``parse(text) -> ParsedOutput``; register more in ``PARSERS``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["PARSERS", "HermesParser", "ParsedOutput", "Parser", "ToolCall", "get_parser"]

_CANONICAL_CALL = re.compile(
    r'\A\n\{"name": (?P<name>"(?:[^"\\]|\\.)*"), "arguments": (?P<args>.*)\}\n\Z', re.DOTALL
)


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it."""

    name: str
    arguments: str
    """The arguments as raw JSON text (canonical output: exactly the model's characters)."""

    def as_dict(self, call_id: str = "") -> dict[str, Any]:
        """OpenAI form, as the normalised message format carries it."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedOutput:
    """What the model said, split into its parts."""

    reasoning: str | None
    """Text inside ``<think>…</think>``; ``None`` when there was no think block."""
    content: str
    """Visible text (without tool-call blocks)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    stopped: bool = True
    """Whether the text ended with an end-of-turn token (else it was cut off)."""

    def message(self, call_ids: list[str] | None = None) -> dict[str, Any]:
        """The assistant message in the normalised format (see ``harnessrl.proxy.tito``)."""
        ids = call_ids or [""] * len(self.tool_calls)
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [tc.as_dict(i) for tc, i in zip(self.tool_calls, ids, strict=True)]
        return msg


class Parser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedOutput: ...


class HermesParser:
    """Hermes/Qwen ``<think>`` + ``<tool_call>{json}</tool_call>`` output."""

    name = "hermes"

    def __init__(
        self,
        stop_strings: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>"),
        think: tuple[str, str] = ("<think>", "</think>"),
        call: tuple[str, str] = ("<tool_call>", "</tool_call>"),
    ) -> None:
        self.stop_strings = stop_strings
        self.think_open, self.think_close = think
        self.call_open, self.call_close = call
        self._block = re.compile(
            re.escape(self.call_open) + "(.*?)" + re.escape(self.call_close), re.DOTALL
        )

    def parse(self, text: str) -> ParsedOutput:
        body, stopped = self._cut(text)
        reasoning, rest = self._reasoning(body)
        content, calls = self._tool_calls(rest)
        return ParsedOutput(reasoning, content, calls, stopped)

    def _cut(self, text: str) -> tuple[str, bool]:
        """Text before the first stop string, and whether there was one."""
        cut = min((i for s in self.stop_strings if (i := text.find(s)) >= 0), default=-1)
        return (text, False) if cut < 0 else (text[:cut], True)

    def _reasoning(self, text: str) -> tuple[str | None, str]:
        o, c = self.think_open, self.think_close
        canonical_open, canonical_close = o + "\n", "\n" + c + "\n\n"
        if text.startswith(canonical_open):
            end = text.find(canonical_close, len(canonical_open) - 1)
            if end >= 0:
                return text[len(canonical_open) : end], text[end + len(canonical_close) :]
        if text.startswith(o):
            end = text.find(c)
            if end < 0:  # cut off while thinking
                return _strip1(text[len(o) :]), ""
            return _strip1(text[len(o) : end]), text[end + len(c) :].lstrip("\n")
        end = text.find(c)
        if end >= 0 and o not in text[:end]:  # generation prompt opened the think block
            return _strip1(text[:end]), text[end + len(c) :].lstrip("\n")
        return None, text

    def _tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        before: list[str] = []  # text before the first parsed call
        after: list[str] = []  # non-separator text between/after parsed calls
        pos = 0
        for m in self._block.finditer(text):
            call = _parse_call(m.group(1))
            if call is None:
                continue  # stays in the text around it
            gap = text[pos : m.start()]
            if not calls:
                before.append(gap[:-1] if gap.endswith("\n") else gap)
            elif gap.strip():
                after.append(gap.strip("\n"))
            calls.append(call)
            pos = m.end()
        tail = text[pos:]
        if not calls:
            return text, []
        if tail.strip():
            after.append(tail.strip("\n"))
        content = "".join(before)
        if after:
            content = "\n".join([content, *after]) if content else "\n".join(after)
        return content, calls


def _strip1(s: str) -> str:
    """Drop one leading and one trailing newline (the template's padding of reasoning)."""
    s = s[1:] if s.startswith("\n") else s
    return s[:-1] if s.endswith("\n") else s


def _parse_call(inner: str) -> ToolCall | None:
    """The call inside one ``<tool_call>`` block, or None if it is not one."""
    m = _CANONICAL_CALL.match(inner)
    if m is not None:
        try:
            name = json.loads(m.group("name"))
            json.loads(m.group("args"))
            return ToolCall(name, m.group("args"))
        except ValueError:
            pass
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
            return ToolCall(obj["name"], args)
        except ValueError:
            pass
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


PARSERS: dict[str, type] = {"hermes": HermesParser, "qwen": HermesParser}


def get_parser(name: str = "hermes", **kw: Any) -> Parser:
    """A parser by name (``hermes``/``qwen``)."""
    try:
        return PARSERS[name](**kw)
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None
