"""``harnessrl.common.aio.run``: processes that start subprocesses all the time (actors, rollouts,
eval, task lint) run on the default asyncio loop, whose subprocesses CPython starts with vfork; the
rest run on uvloop.

The commands are run in this process for real, up to the first subprocess they start through
asyncio (a sandbox), which notes the loop it is started from and stops the command there."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.common import aio, cli
from harnessrl.proxy.scripted import ScriptedEngine
from tests.helpers.rollout import TOK

pytestmark = pytest.mark.integration


async def _loop_and_spawn() -> tuple[str, int]:
    loop = type(asyncio.get_running_loop()).__module__
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "print(6 * 7)", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return loop, int(out)


def test_subprocess_heavy_processes_run_on_the_default_loop() -> None:
    loop, out = aio.run(_loop_and_spawn(), subprocesses=True)
    assert out == 42 and not loop.startswith("uvloop"), loop


def test_other_processes_run_on_uvloop() -> None:
    pytest.importorskip("uvloop")
    loop, out = aio.run(_loop_and_spawn())
    assert out == 42 and loop.startswith("uvloop"), loop


class FirstSubprocess(BaseException):  # not an Exception: no command's handler swallows it
    """Raised in place of a command's first asyncio subprocess."""


@pytest.fixture
def spawn_loops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The module of the event loop each asyncio subprocess would have started from; the first
    raises `FirstSubprocess` instead of starting. (Request it after fixtures that start
    subprocesses themselves.)"""
    loops: list[str] = []

    async def first(*args, **kwargs):
        loops.append(type(asyncio.get_running_loop()).__module__)
        raise FirstSubprocess(args[0])

    monkeypatch.setattr(asyncio, "create_subprocess_exec", first)
    monkeypatch.setattr(asyncio, "create_subprocess_shell", first)
    return loops


@contextlib.contextmanager
def engine_in_a_thread() -> Iterator[str]:
    """A scripted engine serving on its own loop in a thread (the command owns this thread's)."""
    ready, box = threading.Event(), {}

    async def serve() -> None:
        async with ScriptedEngine(TOK, ()) as eng:
            box["url"], box["loop"], box["stop"] = (
                eng.url,
                asyncio.get_running_loop(),
                asyncio.Event(),
            )
            ready.set()
            await box["stop"].wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the scripted engine did not start"
    try:
        yield box["url"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(30)


def run_command(argv: list[str]) -> None:
    with pytest.raises(FirstSubprocess):
        cli.main(argv)


def test_actor_starts_its_subprocesses_from_the_default_loop(
    nats_url: str, run_name: str, sandbox_root: Path, spawn_loops: list[str]
) -> None:
    """``harnessrl actor``: its sandboxes start from the default loop."""
    run_command(
        ["actor", "--nats", nats_url, "--run", run_name, "--engine", "http://127.0.0.1:9"]
        + ["--model", "tiny-1m", "--sandbox-root", str(sandbox_root), "--metrics-port", "-1"]
        + ["--no-install-harnesses"]
    )
    assert spawn_loops[:1] == ["asyncio.unix_events"], spawn_loops


def test_rollout_starts_its_subprocesses_from_the_default_loop(
    sandbox_root: Path, spawn_loops: list[str]
) -> None:
    """``harnessrl rollout``: its sandbox starts from the default loop (its engine check before
    runs on uvloop: no subprocess there)."""
    with engine_in_a_thread() as url:
        run_command(
            [
                "rollout",
                "--suite",
                "toy",
                "--task",
                "copy_01",
                "--engine",
                url,
                "--model",
                "tiny-1m",
            ]
            + ["--sandbox-root", str(sandbox_root), "--no-install-harnesses"]
        )
    assert spawn_loops[:1] == ["asyncio.unix_events"], spawn_loops


def test_task_lint_starts_its_subprocesses_from_the_default_loop(spawn_loops: list[str]) -> None:
    """``harnessrl tasks lint``: its sandboxes start from the default loop."""
    run_command(["tasks", "lint", "toy/copy_01"])
    assert spawn_loops[:1] == ["asyncio.unix_events"], spawn_loops


def test_eval_starts_its_subprocesses_from_the_default_loop(
    sandbox_root: Path, tmp_path: Path, spawn_loops: list[str]
) -> None:
    """``harnessrl eval``: its sandboxes start from the default loop (its engines, started by
    the supervisor before, are the scripted teacher's)."""
    run_command(
        ["eval", "--policy", "teacher", "--suite", "toy", "--limit", "1", "--n", "1"]
        + ["--sandbox-root", str(sandbox_root), "--log-dir", str(tmp_path / "logs")]
    )
    assert spawn_loops[:1] == ["asyncio.unix_events"], spawn_loops
