"""Rollouts against a scripted engine: the tiny model's tokenizer, the toy copy task, a scripted
engine function that solves it through the reference harness, and the shared rollout parts
(`rollout_env`)."""

from __future__ import annotations

import contextlib
import json

from harnessrl.actors.config import RolloutSettings
from harnessrl.actors.rollout import RolloutDeps
from harnessrl.common.bus import connect
from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import TaskRequest, parse_rollout_id
from harnessrl.common.tasks import load_task
from harnessrl.proxy.scripted import Reply, ScriptedEngine

TOK = load_tokenizer("tiny-1m")
TASK = load_task("toy", "copy_01")
SOLVE = 'python3 "$HRL_SOLUTION"'


def tool_call(name: str, **arguments: str) -> str:
    """Model text of one Hermes tool call (what the tiny model would have to generate)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def toy_solver(task=TASK, hang_attempt: int | None = None):
    """A scripted engine function solving a copy task through the reference harness: first
    write the answer, then (once a tool result is in the prompt) finish. Calls of attempt
    ``hang_attempt`` hang instead (until the engine is stopped)."""
    src = (task.workspace_dir / task.metadata["toy"]["input"]).read_text()
    out = task.metadata["toy"]["output"]

    def reply(input_ids: list[int], body: dict) -> Reply:
        rid = str(body.get("rid", "")).rsplit("-", 2)[0]  # "<rollout id>-<seq>-<random>"
        if hang_attempt is not None and parse_rollout_id(rid)[2] == hang_attempt:
            return Reply(text="never", delay=120)
        if "<tool_response>" not in TOK.decode(input_ids):
            return Reply(text=tool_call("write_file", path=out, content=src))
        return Reply(text=tool_call("finish", summary="copied"))

    return reply


def request(harness: str = "command", cmd: str = "", **kw) -> TaskRequest:
    """A request for the toy copy task (``kw`` overrides its fields)."""
    fields = dict(group_id="g1", k=0, group_size=1, issued_version=0, task_id="copy_01")
    fields |= {"suite": "toy", "harness": harness, "harness_cmd": cmd} | kw
    return TaskRequest(**fields)


@contextlib.asynccontextmanager
async def rollout_env(nats_url: str, run: str, backend, script=(), **settings):
    """(deps, engine, bus) for rollouts against a scripted engine."""
    async with ScriptedEngine(TOK, script) as eng:
        bus = await connect(nats_url, run)
        cfg = RolloutSettings(
            engines=[eng.url], model="tiny-1m", install_harnesses=False, **settings
        )
        try:
            async with RolloutDeps.open(cfg, bus, actor="test", backend=backend) as deps:
                yield deps, eng, bus
        finally:
            await bus.close()
