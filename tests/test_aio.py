"""``harnessrl.common.aio.run``: processes that start subprocesses all the time (actors) run on the default
asyncio loop, whose subprocesses CPython starts with vfork; the rest run on uvloop."""

from __future__ import annotations

import asyncio
import sys

import pytest

from harnessrl.actors import actor_cmd, eval_cmd, rollout_cmd, tasks_cmd
from harnessrl.common import aio


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


@pytest.mark.parametrize("module", [actor_cmd, eval_cmd, rollout_cmd, tasks_cmd])
def test_every_actor_entry_point_asks_for_the_default_loop(module) -> None:
    """Each command that runs rollouts or sandboxes passes ``subprocesses=True``."""
    import inspect

    src = inspect.getsource(module)
    runs = [line for line in src.splitlines() if "run(" in line and "subprocesses=True" in line]
    assert runs, f"{module.__name__} does not run its loop with subprocesses=True"
