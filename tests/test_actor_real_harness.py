"""Real harnesses end to end through the actor's rollout pipeline (``run_rollout``): Claude Code
and Codex in bubblewrap sandboxes, each with its own proxy on a unix socket, the scripted engine
as the model; the verifier scores the final workspace and the CallRecords are on the bus."""

from __future__ import annotations

from typing import Any

import pytest

from harnessrl.common.records import CallRecord
from harnessrl.common.tree import assemble
from tests.harness_env import Brain, Prompt, ensure_installed, write_call
from tests.helpers.rollout import TASK, request, rollout_env

pytestmark = [pytest.mark.harness, pytest.mark.integration]


class SolveCopy(Brain):
    """Writes the toy task's answer with the harness's own file/shell tool, then answers."""

    def __init__(self) -> None:
        super().__init__()
        self.src = (TASK.workspace_dir / TASK.metadata["toy"]["input"]).read_text()
        self.out = TASK.metadata["toy"]["output"]

    def decide(self, p: Prompt) -> Any:
        if not p.tools:
            return "Copy a file"  # title / auxiliary calls
        if p.n_tool_results == 0:
            return write_call(p, path=self.out, text=self.src)
        return "Done."


@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_real_harness_rollout_through_the_actor(harness, nats_url, run_name, bwrap):
    cache = await ensure_installed(harness)
    brain = SolveCopy()
    async with rollout_env(
        nats_url,
        run_name,
        bwrap,
        script=brain,
        harness_cache_dir=cache,
        max_new_tokens=512,
        max_context=32768,
    ) as (deps, _eng, bus):
        res = await run_rollout_for(harness, deps)
        calls = await bus.read_subject(bus.subjects.calls(res.rollout_id), CallRecord)
    assert res.status == "ok", (res.error, brain.log[-1:] if brain.log else None)
    assert res.reward == 1.0, res.metrics
    main = sorted((c for c in calls if c.label == "main"), key=lambda c: c.seq)
    assert len(main) >= 2 and res.n_calls == len(calls)
    sample = assemble(calls, res)
    assert not sample.is_tombstone and sample.counters.n_leaves >= 1


async def run_rollout_for(harness: str, deps):
    from harnessrl.actors.rollout import run_rollout

    return await run_rollout(request(harness, group_id="greal", k=0, timeout_s=240.0), 1, deps)
