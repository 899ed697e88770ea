"""The context window and output limit real harnesses see, and where they compact.

Every harness is told the engine's window ``W`` and the run's ``max_new_tokens`` ``O`` (see the
table in ``harnessrl.actors.harnesses``). Measured here through the real proxy (enforcing ``W``, with
``O`` as the run's limit) and a scripted model:

* Claude Code, whose context grows by ~3k tokens of tool output a turn, asks for
  ``max_tokens = O`` on every request and sends no compaction request while its context is
  under half the window — before the rule it asked for 32,000 and compacted after its second
  call, at 2.1k–4.2k tokens of history — yet does compact once its own threshold
  (``W - min(O, 20000) - 13000``) is passed: the window it was told is the one it uses.
* Codex likewise compacts only near the limit the adapter sets (``W - max(O, W // 4)``).
* Every harness with an output-limit setting sends ``O`` as its request's output limit.

Harnesses install into the harness cache on first use; tests skip, saying why, only when one
cannot be installed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from harnessrl.actors.harnesses import HarnessContext
from harnessrl.common.records import CallRecord
from tests.harness_env import (
    CLAUDE_SUMMARY,
    CODEX_SUMMARY,
    Brain,
    Prompt,
    WriteThenAnswer,
    is_compaction,
    proxy_stack,
    run_harness,
    shell_call,
)

pytestmark = pytest.mark.harness

WINDOW = 32768
OUT = 4096
INSTRUCTION = "Print the numbered ranges, one step at a time."


class GrowingContext(Brain):
    """Each main call runs one shell command printing ``lines`` numbered lines (7–8 tokens a
    line with the tiny tokenizer), so the context grows by ~``7 * lines`` tokens a turn; after
    ``steps`` of them, a final answer. Compaction requests get a summary in the harness's
    form; tool-less calls (titles) a short text."""

    def __init__(self, steps: int, lines: int) -> None:
        super().__init__()
        self.steps, self.lines, self.done = steps, lines, 0

    def decide(self, p: Prompt) -> Any:
        if is_compaction(p):
            summary = CLAUDE_SUMMARY if "<analysis>" in p.last_user else CODEX_SUMMARY
            return summary.format(done=self.done, total=self.steps)
        if not p.tools:
            return "Numbered ranges"
        if self.done < self.steps:
            self.done += 1
            base = self.done * 100_000
            return shell_call(p, f"seq {base} {base + self.lines}", f"step {self.done}")
        return "Done."


async def grow(name: str, nats_url: str, run_name: str, tmp_path: Path, steps: int):
    """Run ``name`` against a proxy enforcing ``WINDOW`` with ``OUT`` as the run's limit."""
    brain = GrowingContext(steps, lines=400)
    async with proxy_stack(
        nats_url, run_name, brain, tmp_path, max_context=WINDOW, max_new_tokens=OUT
    ) as st:
        run = await asyncio.wait_for(
            run_harness(
                name,
                st,
                tmp_path,
                INSTRUCTION,
                context_window=WINDOW,
                max_output_tokens=OUT,
                max_turns=30,
                timeout_s=240,
            ),
            300,
        )
        records = await st.records()
    return run, records, st.server.posts()


def first_compaction(records: list[CallRecord]) -> tuple[list[CallRecord], list[CallRecord]]:
    """(every compaction call, the main calls before the first one), checking the labels the
    proxy gave agree with the compaction prompts the model saw."""
    compactions = [r for r in records if r.label == "compaction"]
    assert compactions, [(r.seq, r.label, r.input_len) for r in records]
    before = [r for r in records if r.label == "main" and r.seq < compactions[0].seq]
    return compactions, before


def shape(records: list[CallRecord]) -> list[tuple[str, int]]:
    return [(r.label, r.input_len) for r in records]


@pytest.mark.integration
async def test_claude_code_compacts_only_past_half_the_window(
    nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """Claude Code asks for the run's output limit and compacts only past half the window."""
    run, records, posts = await grow("claude-code", nats_url, run_name, tmp_path, steps=8)
    assert run.returncode == 0, run.tail()
    assert all(r.status == "ok" for r in records), shape(records)
    assert {p["body"]["max_tokens"] for p in posts} == {OUT}
    compactions, before = first_compaction(records)
    # the context grew well past 20% of the window with no compaction ...
    assert max(r.input_len for r in before) >= WINDOW // 5, shape(records)
    # ... and no compaction request came while the context was under half the window
    assert all(c.input_len >= WINDOW // 2 for c in compactions), shape(records)
    # it compacted near its own threshold for the window it was told, not later
    threshold = WINDOW - min(OUT, 20_000) - 13_000
    assert before[-1].input_len >= threshold - 2000, shape(records)
    assert max(r.input_len for r in records) < WINDOW - OUT, shape(records)


@pytest.mark.integration
async def test_codex_compacts_near_its_limit(nats_url: str, run_name: str, tmp_path: Path) -> None:
    """Codex compacts only once its context nears ``W - max(O, W/4)``, never under half."""
    run, records, posts = await grow("codex", nats_url, run_name, tmp_path, steps=6)
    assert run.returncode == 0, run.tail()
    assert all(r.status == "ok" for r in records), shape(records)
    assert all("max_output_tokens" not in p["body"] for p in posts)  # Codex has no such knob
    limit = HarnessContext("x", "t", context_window=WINDOW, max_output_tokens=OUT)
    limit = limit.compaction_limit()
    assert limit == WINDOW * 3 // 4
    compactions, before = first_compaction(records)
    assert all(c.input_len >= WINDOW // 2 for c in compactions), shape(records)
    assert before[-1].input_len >= limit - 2000, shape(records)
    assert all(r.input_len + OUT <= WINDOW for r in records), shape(records)


# harness -> the request field carrying its output limit
OUTPUT_FIELD = {
    "claude-code": "max_tokens",
    "opencode": "max_tokens",
    "mini-swe-agent": "max_tokens",
    "reference": "max_tokens",
    "openclaw": "max_completion_tokens",
}


INTEGRATION = ("claude-code", "opencode", "mini-swe-agent", "reference")
"""Harnesses that start within a few seconds."""


@pytest.mark.parametrize(
    "name",
    [
        *(pytest.param(h, marks=pytest.mark.integration) for h in INTEGRATION),
        pytest.param("openclaw", marks=pytest.mark.slow),  # ~30 s start
    ],
)
async def test_harness_requests_the_runs_output_limit(
    name: str, nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """Every request a harness makes with tools asks for the run's output limit."""
    out = 777
    async with proxy_stack(
        nats_url, run_name, WriteThenAnswer(), tmp_path, max_context=WINDOW, max_new_tokens=out
    ) as st:
        run = await asyncio.wait_for(
            run_harness(
                name,
                st,
                tmp_path,
                "Create hello.txt containing a greeting.",
                context_window=WINDOW,
                max_output_tokens=out,
                max_turns=4,
                timeout_s=200,
            ),
            280,
        )
    posts = [p for p in st.server.posts() if (p.get("body") or {}).get("tools")]
    assert posts, run.tail()
    assert [p["body"].get(OUTPUT_FIELD[name]) for p in posts] == [out] * len(posts), run.tail()
