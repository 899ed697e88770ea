"""Call labels: ``main``, ``subagent``, ``compaction`` or ``aux`` (docs/harnesses.md).

Labels decide what the assembler trains on: only ``main`` calls build the main tree by default.
Rules look at what every harness sends anyway (headers, the normalised messages and tools) and
are checked in order; the first that matches wins, unknown is ``main``:

1. headers — Claude Code's ``x-claude-code-agent-id`` and Codex's ``x-openai-subagent`` mark
   sub-agents (Codex's value ``compact`` marks its compaction requests);
2. compaction prompts — Claude Code's instruction asking for ``<analysis>`` and ``<summary>``
   blocks, Codex's "You are performing a CONTEXT CHECKPOINT COMPACTION";
3. compaction by system prompt — requests without tools whose *system* prompt makes the model
   a summariser of the context (opencode's "You are a context summarization agent", OpenClaw's
   "... context summarization assistant");
4. auxiliary calls — requests without tools whose *system* prompt asks for a title (opencode's
   and Claude Code's session titles) or matches other configured patterns.

A harness adapter can pass its own ``LabelRules`` (more headers, more patterns).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_RULES", "LabelRules", "kept_headers", "label_call"]


@dataclass(frozen=True)
class LabelRules:
    """What marks a call as something other than ``main``."""

    subagent_headers: tuple[str, ...] = ("x-claude-code-agent-id", "x-openai-subagent")
    """Headers (lower case) whose presence marks a sub-agent call."""
    compaction_header_values: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"x-openai-subagent": ("compact",)}
    )
    """Header values that mark a compaction rather than a sub-agent."""
    compaction_markers: tuple[tuple[str, ...], ...] = (
        ("<analysis>", "<summary>"),
        ("You are performing a CONTEXT CHECKPOINT COMPACTION",),
    )
    """Each tuple: strings that together, in the last user turn, mark a compaction request."""
    compaction_system_patterns: tuple[str, ...] = (r"\bcontext summarization (agent|assistant)\b",)
    """Regexes (case-insensitive) over the system text of a tool-less request that mark a
    compaction (harnesses that summarise with a dedicated system prompt)."""
    aux_patterns: tuple[str, ...] = (r"\btitle\b",)
    """Regexes (case-insensitive) over the system text of a tool-less request. Never the user
    text: a task may well mention a title, and harnesses without tools (mini-swe-agent) exist."""
    kept_headers: tuple[str, ...] = (
        "x-claude-code-agent-id",
        "x-claude-code-session-id",
        "x-openai-subagent",
        "x-codex-parent-thread-id",
    )
    """Headers copied into the CallRecord (for the assembler and for debugging)."""


DEFAULT_RULES = LabelRules()


def _last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return str(m.get("content") or "")
    return ""


def label_call(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    headers: Mapping[str, str],
    rules: LabelRules = DEFAULT_RULES,
) -> tuple[str, str]:
    """``(label, reason)`` for a call with normalised ``messages`` (see ``harnessrl.proxy.tito``)."""
    low = {k.lower(): v for k, v in headers.items()}
    for h in rules.subagent_headers:
        if h in low:
            value = low[h].strip().lower()
            if value in rules.compaction_header_values.get(h, ()):
                return "compaction", f"header {h}: {value}"
            return "subagent", f"header {h}"
    last = _last_user_text(messages)
    for markers in rules.compaction_markers:
        if all(s in last for s in markers):
            return "compaction", f"prompt contains {' + '.join(markers)}"
    if not tools:
        texts = [str(m.get("content") or "") for m in messages if m.get("role") == "system"]
        for pattern in rules.compaction_system_patterns:
            if any(re.search(pattern, t, re.IGNORECASE) for t in texts):
                return "compaction", f"tool-less request matching {pattern!r}"
        for pattern in rules.aux_patterns:
            if any(re.search(pattern, t, re.IGNORECASE) for t in texts):
                return "aux", f"tool-less request matching {pattern!r}"
    return "main", ""


def kept_headers(headers: Mapping[str, str], rules: LabelRules = DEFAULT_RULES) -> dict[str, str]:
    """The labelling headers of a request, lower-cased, for ``CallRecord.headers``."""
    low = {k.lower(): v for k, v in headers.items()}
    return {h: low[h] for h in rules.kept_headers if h in low}
