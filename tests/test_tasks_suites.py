"""The built-in suites: reference solutions score 1.0 in real sandboxes, doing nothing scores
below 1, the workspace and toy suites pass checker lint, and the scripted teacher solves every toy
task when its tool calls are executed."""

from __future__ import annotations

import asyncio
import filecmp
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from aiohttp import web

from harnessrl.actors.lint import backend_factory, lint_tasks
from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.bwrap import BwrapBackend
from harnessrl.actors.verifier import run_solution, verify
from harnessrl.common.tasks import BUILTIN_SUITES, Task, list_tasks
from harnessrl.common.tasks.teacher import TOOLS, teacher_rollout, teacher_step
from harnessrl.common.tasks.toy import FAMILIES, write_suites

TOY = list_tasks("toy") + list_tasks("toy-eval")
JOBS = 4


async def solved_and_untouched(backend: BwrapBackend, task: Task) -> tuple:
    spec = SandboxSpec(workspace_src=task.workspace_dir, workdir=task.mount)
    async with await backend.create(spec) as sb:
        untouched = await verify(task, sb)
        await run_solution(task, sb)
        solved = await verify(task, sb)
    return solved, untouched


@pytest.mark.integration
async def test_toy_reference_solutions(backend: BwrapBackend):
    """Every toy task: its reference solution scores 1.0, the untouched workspace below 1."""
    sem = asyncio.Semaphore(JOBS)

    async def one(t: Task):
        async with sem:
            return t, *await solved_and_untouched(backend, t)

    for t, solved, untouched in await asyncio.gather(*(one(t) for t in TOY)):
        assert solved.status == "ok" and solved.reward == 1.0, (t.name, solved)
        assert untouched.status == "ok" and untouched.reward < 1.0, (t.name, untouched)


@pytest.mark.integration
async def test_workspace_suite_passes_lint(backend: BwrapBackend):
    """Every workspace task: solution 1.0, every failing probe (untouched, outputs empty, of
    the wrong type, truncated) below 0.25, every metric flips under a mutation of the
    solution's outputs, and its checker never crashes on the untouched workspace."""
    reports = await lint_tasks(list_tasks("workspace"), backend_factory(backend), jobs=JOBS)
    bad = {r.task: [str(p) for p in r.problems] for r in reports if not r.ok}
    assert not bad
    assert all(r.untouched_reward is not None and r.untouched_reward < 0.25 for r in reports)
    assert all(r.mutations >= 3 and all(r.flips.values()) for r in reports)
    # the in-place edit that once scored 0.4 untouched (2 of 5 checks passed)
    (cfg,) = [r for r in reports if r.task == "workspace/config_port_update"]
    assert cfg.untouched_reward == 0.0 and cfg.score("solution") == 1.0


@pytest.mark.integration
async def test_toy_checker_passes_lint(backend: BwrapBackend):
    """The shared toy checker passes lint on one task of every family."""
    by_family = {t.metadata["toy"]["family"]: t for t in list_tasks("toy-eval")}
    assert len(by_family) == len(FAMILIES)
    reports = await lint_tasks(list(by_family.values()), backend_factory(backend), jobs=JOBS)
    assert not {r.task: [str(p) for p in r.problems] for r in reports if not r.ok}


@pytest.mark.unit
def test_workspace_suite_shape():
    """At least 20 realistic tasks over several categories, each with checker, rubric, solution."""
    tasks = list_tasks("workspace")
    assert len(tasks) >= 20
    assert len({t.category for t in tasks}) >= 5
    for t in tasks:
        assert t.checker == "test_py" and t.rubric and t.solution is not None, t.name
        assert not (t.workspace_dir / "reward").exists()


@pytest.mark.unit
def test_toy_generator_matches_shipped(tmp_path: Path):
    """The shipped toy folders are exactly what the generator writes (regenerate after edits)."""
    write_suites(tmp_path)
    for suite in ("toy", "toy-eval"):
        a, b = tmp_path / suite, BUILTIN_SUITES / suite
        mine = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        shipped = sorted(
            p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
        assert mine == shipped, suite
        _, mismatch, errors = filecmp.cmpfiles(a, b, [str(p) for p in mine], shallow=False)
        assert not mismatch and not errors, mismatch[:5]


# ---------------------------------------------------------------------- the scripted teacher


def executor(ws: Path):
    """The reference harness's tools over a host directory (what the harness would do)."""

    def run(name: str, args: dict) -> str:
        if name == "read_file":
            return (ws / args["path"]).read_text()
        if name == "list_dir":
            d = ws / args["path"]
            return "\n".join(sorted(p.name + ("/" if p.is_dir() else "") for p in d.iterdir()))
        if name == "write_file":
            (ws / args["path"]).write_text(args["content"])
            return f"wrote {len(args['content'])} bytes to {args['path']}"
        if name == "finish":
            return "ok"
        raise AssertionError(f"unexpected tool {name}")

    return run


def norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


@pytest.mark.unit
@pytest.mark.parametrize("task", TOY, ids=[t.id for t in TOY])
def test_teacher_solves_toy_task(task: Task, tmp_path: Path):
    """Executing the teacher's tool calls solves the task in a few well-formed steps."""
    ws = tmp_path / "ws"
    shutil.copytree(task.workspace_dir, ws)
    messages = teacher_rollout(task, executor(ws))
    expected = json.loads((task.reward_dir / "expected.json").read_text())
    out = ws / expected["output"]
    assert out.is_file() and norm(out.read_text()) == norm(expected["expected"])
    turns = [m for m in messages if m["role"] == "assistant"]
    assert (2 if task.metadata["toy"]["family"] == "write_word" else 3) <= len(turns) <= 8
    assert turns[-1]["tool_calls"][0]["function"]["name"] == "finish"
    names = {t["function"]["name"] for t in TOOLS}
    for m in turns:
        (call,) = m["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] in names
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    # a pure function of the conversation: the same history gives the same next step
    assert teacher_step(task, messages[:3]) == teacher_step(task, messages[:3]) == messages[3]


@pytest.mark.unit
def test_teacher_tolerates_harness_variations(tmp_path: Path):
    """Content parts, a JSON list_dir result and interleaved user messages do not confuse it."""
    task = next(t for t in TOY if t.metadata["toy"]["family"] == "json_collect")
    ws = tmp_path / "ws"
    shutil.copytree(task.workspace_dir, ws)
    base = executor(ws)

    def run(name: str, args: dict):
        if name == "list_dir":
            return json.dumps(sorted(os.listdir(ws / args["path"])))
        text = base(name, args)
        return [{"type": "text", "text": text}] if name == "read_file" else text

    messages = [{"role": "user", "content": task.instruction}]
    for _ in range(10):
        msg = teacher_step(task, messages)
        messages.append(msg)
        (call,) = msg["tool_calls"]
        fn = call["function"]
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": run(fn["name"], json.loads(fn["arguments"])),
            }
        )
        messages.append({"role": "user", "content": "(keep going)"})
        if fn["name"] == "finish":
            break
    expected = json.loads((task.reward_dir / "expected.json").read_text())
    assert (ws / expected["output"]).read_text() == expected["expected"]
    assert teacher_step(task, messages)["content"] == "The task is done."


@pytest.fixture
async def teacher_server():
    """An OpenAI chat endpoint whose every reply is `teacher_step` on the request's history."""
    state: dict = {"task": None, "calls": 0}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        state["calls"] += 1
        msg = teacher_step(state["task"], body["messages"])
        reason = "tool_calls" if msg.get("tool_calls") else "stop"
        choice = {"index": 0, "message": msg, "finish_reason": reason}
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        return web.json_response(
            {"id": "x", "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield state, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    await runner.cleanup()


@pytest.mark.integration
@pytest.mark.parametrize("family", ["upper_word", "number_lines", "find_word"])
async def test_teacher_drives_the_reference_agent(teacher_server, tmp_path: Path, family: str):
    """Served to the real reference agent, the teacher's turns solve the task (levels 1-3)."""
    state, url = teacher_server
    task = next(t for t in TOY if t.metadata["toy"]["family"] == family)
    state["task"] = task
    ws = tmp_path / "ws"
    shutil.copytree(task.workspace_dir, ws)
    agent = Path(__file__).resolve().parents[1] / "actors" / "harnesses" / "reference_agent.py"
    if not agent.is_file():
        pytest.skip("reference agent not present")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(agent),
        task.instruction,
        "--workspace",
        str(ws),
        "--base-url",
        url,
        "--api-key",
        "k",
        "--retries",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert json.loads(out.decode().strip().splitlines()[-1])["status"] == "finished"
    expected = json.loads((task.reward_dir / "expected.json").read_text())
    assert (ws / expected["output"]).read_text() == expected["expected"]
    assert 3 <= state["calls"] <= 8
