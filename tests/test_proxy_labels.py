"""Call labels from headers and prompts; unknown is main."""

from __future__ import annotations

import pytest

from harnessrl.proxy.labels import LabelRules, kept_headers, label_call

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "bash"}}]
TASK = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]


def test_unknown_is_main() -> None:
    """A plain agent call is main."""
    assert label_call(TASK, TOOLS, {}) == ("main", "")


def test_subagent_headers() -> None:
    """Claude Code's and Codex's sub-agent headers, in any case."""
    assert label_call(TASK, TOOLS, {"X-Claude-Code-Agent-Id": "a1"})[0] == "subagent"
    assert label_call(TASK, TOOLS, {"x-openai-subagent": "review"})[0] == "subagent"
    assert label_call(TASK, TOOLS, {"x-openai-subagent": "compact"})[0] == "compaction"


def test_compaction_prompts() -> None:
    """Claude Code asks for <analysis> and <summary>; Codex says CONTEXT CHECKPOINT COMPACTION."""
    claude = TASK + [
        {"role": "assistant", "content": "done"},
        {
            "role": "user",
            "content": "Your task is to create a detailed summary of the conversation so far. "
            "Wrap your analysis in <analysis> tags ... then the summary in <summary> tags.",
        },
    ]
    assert label_call(claude, TOOLS, {})[0] == "compaction"
    codex = TASK + [
        {"role": "user", "content": "You are performing a CONTEXT CHECKPOINT COMPACTION. ..."}
    ]
    assert label_call(codex, None, {})[0] == "compaction"
    mention = TASK + [{"role": "assistant", "content": "<summary> in old turn"}]
    assert label_call(mention, TOOLS, {})[0] == "main"  # only the last user turn counts


def test_title_generation_is_aux() -> None:
    """A tool-less request whose system prompt asks for a title; a task mentioning titles is not."""
    title = [
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
        {"role": "user", "content": "Fix the failing test"},
    ]
    assert label_call(title, None, {})[0] == "aux"
    assert label_call(title, TOOLS, {})[0] == "main"
    no_tools_task = [{"role": "user", "content": "Change the page title to Home"}]
    assert label_call(no_tools_task, None, {})[0] == "main"  # mini-swe-agent has no tools


def test_custom_rules_and_kept_headers() -> None:
    """Adapters add their own rules; labelling headers are kept for the record."""
    rules = LabelRules(subagent_headers=("x-my-agent",), aux_patterns=(r"quota",))
    assert label_call(TASK, TOOLS, {"x-my-agent": "1"}, rules)[0] == "subagent"
    assert label_call([{"role": "system", "content": "quota check"}], None, {}, rules)[0] == "aux"
    headers = {"X-Claude-Code-Session-Id": "s", "Authorization": "Bearer t"}
    assert kept_headers(headers) == {"x-claude-code-session-id": "s"}


def test_summariser_system_prompts_are_compaction() -> None:
    """opencode's and OpenClaw's compaction requests: tool-less, a summariser system prompt."""
    for system in (
        "You are a context summarization agent. Summarize the conversation ...",
        "You are a helpful context summarization assistant.",
    ):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "..."}]
        assert label_call(msgs, None, {})[0] == "compaction"
        assert label_call(msgs, TOOLS, {})[0] == "main"  # with tools: an agent turn
