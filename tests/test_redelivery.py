"""Redelivery after a death takes seconds: every consumer's default ``ack_wait`` is short and
heartbeats keep long work alive.

A real actor process (``harnessrl actor``, default settings) holds a rollout that outlives its
``ack_wait`` without losing the task, and once SIGKILLed its task comes back (attempt 2) within
that ``ack_wait``. The latency itself, against the old one-minute default, is measured by
``benchmarks/redelivery.py``.
"""

from __future__ import annotations

import pytest

from harnessrl.actors.config import ActorConfig
from harnessrl.actors.service import DURABLE
from harnessrl.common.bus import Bus, connect
from harnessrl.common.records import TaskRequest
from harnessrl.learner.config import AssemblerConfig, FeederConfig, LearnerConfig
from harnessrl.proxy.config import WeightSyncConfig
from harnessrl.proxy.scripted import ScriptedEngine
from tests.helpers.actor import actor_argv, actor_process, task_consumer
from tests.helpers.rollout import TOK, request, toy_solver
from tests.helpers.wait import until

REDELIVERY_S = 15.0
"""The most a consumer's work may wait for redelivery after its process died."""


@pytest.fixture
async def bus(nats_url: str, run_name: str):
    """The run's bus with the task consumer as the learner creates it by default."""
    b = await connect(nats_url, run_name)
    await task_consumer(b, FeederConfig().task_ack_wait_s)
    yield b
    await b.close()


@pytest.mark.unit
def test_every_consumer_is_redelivered_within_seconds() -> None:
    """Actors (TASKS: the consumer the learner's feeder makes), the assembler (ROLLOUTS), the
    learner (SAMPLES) and weight updaters (WEIGHTS) all default to an ``ack_wait`` of seconds,
    with heartbeats at most a third of it (a minute of idle learner after any death was the
    default before)."""
    waits = {
        "actor": FeederConfig().task_ack_wait_s,
        "assembler": AssemblerConfig().ack_wait,
        "learner": LearnerConfig().ack_wait,
        "weights_sync": WeightSyncConfig().ack_wait,
    }
    assert all(w <= REDELIVERY_S for w in waits.values()), waits
    assert ActorConfig().heartbeat_s == 0  # 0: a third of the consumer's ack_wait


@pytest.mark.integration
async def test_running_task_is_kept_and_a_killed_actors_task_comes_back(
    bus: Bus, nats_url, run_name, sandbox_root, tmp_path
) -> None:
    """Default settings: a rollout outliving ``ack_wait`` keeps its task (heartbeats); SIGKILL
    the actor and the task is redelivered as attempt 2 within ``ack_wait``."""
    argv = actor_argv(nats_url, run_name, "ENGINE", sandbox_root)
    async with ScriptedEngine(TOK, toy_solver(hang_attempt=1)) as eng:
        argv[argv.index("ENGINE")] = eng.url
        async with actor_process(argv, tmp_path / "actor.log") as proc:
            await bus.publish(bus.subjects.tasks, request("reference", group_id="gr"))
            await until(lambda: len(eng.requests) == 1, what="the first model call")
            info = await bus.js.consumer_info(bus.subjects.stream("TASKS"), DURABLE)
            ack_wait = info.config.ack_wait
            assert ack_wait == FeederConfig().task_ack_wait_s
            other = await bus.bind_consumer("TASKS", DURABLE, TaskRequest)
            assert await other.fetch(1, timeout=ack_wait + 2) == []  # alive: kept
            proc.kill()
            await proc.wait()
            got = await other.fetch(1, timeout=ack_wait + 2)
    assert [(d.record.group_id, d.num_delivered) for d in got] == [("gr", 2)]
    await got[0].term()
