"""The actor as a child process (``harnessrl actor``): its command line, and starting it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

from harnessrl.common import cli

REPO = Path(__file__).resolve().parents[2]


def actor_argv(nats_url: str, run: str, engine: str, root: Path, *extra: str) -> list[str]:
    """``harnessrl actor`` on the tiny model, one rollout at a time, a short ack wait."""
    entry = (
        ["-m", "harnessrl.common.cli", "actor"]
        if cli.COMMANDS["actor"].module
        else ["-m", "harnessrl.actors.actor_cmd"]
    )
    return [
        sys.executable,
        *entry,
        "--nats",
        nats_url,
        "--run",
        run,
        "--engine",
        engine,
        "--model",
        "tiny-1m",
        "--sandbox-root",
        str(root),
        "--no-install-harnesses",
        "--metrics-port",
        "-1",
        "--concurrency",
        "1",
        *extra,
    ]


@contextlib.asynccontextmanager
async def actor_process(argv: list[str], log: Path):
    """The actor as a child process; yields it once it printed ``actor ready``."""
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=err
        )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert b"actor ready" in line, log.read_text()[-3000:]
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def task_consumer(bus: Any, ack_wait: float = 10.0) -> None:
    """Create the task consumer as the learner's feeder does (actors only bind to it)."""
    from harnessrl.learner.config import FeederConfig
    from harnessrl.learner.task_queue import TaskQueue

    await TaskQueue(bus, FeederConfig(task_ack_wait_s=ack_wait)).ensure()
