"""The toy teacher as an engine: prompt parsing, exact rendering, and real rollouts scoring 1.0
through the reference harness, bubblewrap, the proxy and a real nats-server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.actors.config import RolloutSettings
from harnessrl.actors.harnesses.reference_agent import SYSTEM_PROMPT, TOOLS, Workspace
from harnessrl.actors.rollout import RolloutDeps, run_rollout
from harnessrl.common.bus import connect
from harnessrl.common.models import load_tokenizer, render_chat
from harnessrl.common.records import TaskRequest
from harnessrl.common.tasks import load_task
from harnessrl.common.tasks.teacher import teacher_rollout, teacher_step
from harnessrl.proxy.engine.teacher import Teacher, make_teacher_engine, parse_prompt
from tests.helpers.wait import wait_until

TOK = load_tokenizer("tiny-1m")
REPO = Path(__file__).resolve().parents[1]


def conversation(task, tmp_path: Path) -> list[dict]:
    """A full teacher conversation against a copy of the task's workspace (no harness)."""
    ws_dir = tmp_path / "ws"
    shutil.copytree(task.workspace_dir, ws_dir)
    ws = Workspace(str(ws_dir), 10, 8000)

    def execute(name: str, args: dict) -> str:
        return "ok" if name == "finish" else getattr(ws, name)(**args)

    return teacher_rollout(task, execute, system=SYSTEM_PROMPT.format(workspace=ws_dir))


@pytest.mark.unit
@pytest.mark.parametrize("task_id", ["copy_01", "concat_dir_02", "find_word_03"])
def test_every_turn_is_rendered_exactly(task_id: str, tmp_path: Path) -> None:
    """For each prefix of a teacher conversation, prompt + reply + "\\n" is the template's
    rendering of the conversation with the teacher's message appended."""
    task = load_task("toy", task_id)
    msgs = conversation(task, tmp_path)
    teacher = Teacher(TOK, ["toy"])
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render_chat(msgs[:i], tools=TOOLS, add_generation_prompt=True)
        reply = teacher.reply_text(prompt)
        expected = render_chat(msgs[: i + 1], tools=TOOLS)
        assert prompt + reply + "\n" == expected


@pytest.mark.unit
def test_parse_prompt_recovers_the_messages(tmp_path: Path) -> None:
    """The decoded prompt parses back into the conversation (tool ids renamed consistently)."""
    task = load_task("toy", "concat_dir_02")
    msgs = conversation(task, tmp_path)
    prompt = render_chat(msgs, tools=TOOLS, add_generation_prompt=True)
    ids = TOK.encode(prompt, add_special_tokens=False)
    parsed = parse_prompt(TOK.decode(ids, skip_special_tokens=False))
    assert [m["role"] for m in parsed] == [m["role"] for m in msgs]
    assert parsed[1]["content"] == task.instruction
    # the teacher reaches the same decision from the parsed conversation
    assert teacher_step(task, parsed) == teacher_step(task, msgs)


@pytest.mark.unit
def test_unknown_task_gets_finish() -> None:
    """A prompt with no known instruction is answered with the harness's finish, not an
    error; a call that declares no tools (a title request) gets a short plain answer."""
    msgs = [{"role": "user", "content": "Write a poem."}]
    teacher = Teacher(TOK, ["toy"])
    reply = teacher.reply_text(render_chat(msgs, tools=TOOLS, add_generation_prompt=True))
    assert '"name": "finish"' in reply and reply.endswith("<|im_end|>")
    assert teacher.unknown == 1
    reply = teacher.reply_text(render_chat(msgs, add_generation_prompt=True))
    assert reply == "Toy task<|im_end|>"


@pytest.mark.unit
def test_reply_ids_have_zero_logprobs() -> None:
    """The engine callable returns the reply's ids (ending in <|im_end|>) with log-prob 0."""
    task = load_task("toy", "copy_01")
    prompt = render_chat(
        [{"role": "user", "content": task.instruction}], add_generation_prompt=True
    )
    reply = Teacher(TOK, ["toy"])(TOK.encode(prompt, add_special_tokens=False), {})
    assert reply.ids[-1] == TOK.convert_tokens_to_ids("<|im_end|>")
    assert reply.logprobs == [0.0] * len(reply.ids)


# ---------------------------------------------------------------------------------------------
# real rollouts
# ---------------------------------------------------------------------------------------------


TASKS = [
    ("toy", "copy_01"),
    ("toy", "count_word_02"),
    ("toy", "json_nested_03"),
    ("toy", "concat_dir_04"),
    ("toy", "find_word_05"),
    ("toy-eval", "sum_files_eval01"),
]


@pytest.mark.integration
async def test_reference_harness_solves_toy_tasks(nats_url, run_name, bwrap) -> None:
    """Reference harness + proxy + teacher engine solve toy tasks with reward 1.0."""
    eng = await make_teacher_engine(["toy", "toy-eval"], "tiny-1m").start()
    bus = await connect(nats_url, run_name)
    cfg = RolloutSettings(engines=[eng.url], model="tiny-1m", install_harnesses=False)
    try:
        async with RolloutDeps.open(cfg, bus, actor="test", backend=bwrap) as deps:
            for i, (suite, task_id) in enumerate(TASKS):
                req = TaskRequest(
                    group_id=f"g{i}",
                    k=0,
                    group_size=1,
                    issued_version=0,
                    task_id=task_id,
                    suite=suite,
                    harness="reference",
                )
                res = await run_rollout(req, 1, deps)
                assert (res.status, res.reward) == ("ok", 1.0), (task_id, res.error)
                assert res.n_calls >= 3
    finally:
        await bus.close()
        await eng.stop()
    assert eng.fn.unknown == 0


@pytest.mark.integration
def test_teacher_engine_process_with_harnessrl_rollout(tmp_path: Path) -> None:
    """``harnessrl engine --kind teacher`` + ``harnessrl rollout`` score 1.0 end to end."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    from harnessrl.proxy.engine_cmd import spawn_engine

    key = tmp_path / "engine-api-key"  # made by the engine, read by the rollout
    eng, url = spawn_engine(
        ["--kind", "teacher", "--port", "0", "--suites", "toy", "--api-key-file", str(key)]
    )
    try:
        assert url, "teacher engine did not start"
        out = subprocess.run(
            [sys.executable, "-m", "harnessrl.common.cli", "rollout", "--suite", "toy", "--task"]
            + ["reverse_lines_02", "--engine", url, "--model", "tiny-1m", "--json"]
            + ["--engine-api-key-file", str(key)]
            + ["--sandbox-root", str(tmp_path / "sandboxes")],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout)
        assert report["reward"] == 1.0 and report["tree"]["tito_misses"] == 0
        assert report["tree"]["n_leaves"] == 1
    finally:
        eng.terminate()
        eng.wait(20)


@pytest.mark.integration
def test_teacher_kind_ready_line_and_sigterm() -> None:
    """``harnessrl engine --kind teacher`` prints the engine's ready line, answers on it, and
    stops cleanly on SIGTERM, logging how many calls it served."""
    import signal
    import urllib.request

    from harnessrl.proxy.engine_cmd import spawn_engine

    proc, url = spawn_engine(
        ["--kind", "teacher", "--suites", "toy", "--suites", "toy-eval", "--model", "tiny-1m"]
        + ["--host", "127.0.0.1", "--port", "0", "--insecure"]
    )
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        assert url.startswith("http://127.0.0.1:")
        ready = [ln for ln in proc.output_lines if ln.startswith("engine ready")]
        assert "suites toy, toy-eval" in ready[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    # the reader thread drains the pipe
    wait_until(lambda: "engine stopped\n" in proc.output_lines, 10, "the engine's last line")
    assert any(
        "teacher served 0 calls (0 unknown tasks, 0 without a usable tool)" in line
        for line in proc.output_lines
    )
