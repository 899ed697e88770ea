"""The actor service: TaskRequests on a real nats-server in, one RolloutResult per task out.

In-process for the main path; as a subprocess (``python -m harnessrl.actors.actor_cmd``, or ``harnessrl
actor`` once registered) for what needs a real process: SIGKILL mid-rollout (the task comes
back as attempt 2 of the same member) and SIGTERM (graceful shutdown leaves no sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import pytest

from harnessrl.actors.config import ActorConfig
from harnessrl.actors.rollout import SOCKET_ROOT, RolloutDeps
from harnessrl.actors.service import DURABLE, ActorService
from harnessrl.common import metrics
from harnessrl.common.bus import Bus, connect
from harnessrl.common.config import undocumented_fields
from harnessrl.common.records import DeadLetter, RolloutResult, TaskRequest
from harnessrl.proxy.scripted import Reply, ScriptedEngine
from tests.helpers.actor import actor_argv, actor_process, task_consumer
from tests.helpers.rollout import SOLVE, TOK, request, toy_solver
from tests.helpers.wait import until

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
async def bus(nats_url: str, run_name: str):
    """The run's bus, with the task consumer its learner would create (``ack_wait`` 3 s)."""
    b = await connect(nats_url, run_name)
    await task_consumer(b, ack_wait=3)
    yield b
    await b.close()


def actor_config(nats_url: str, run: str, engine: str, root: Path, **kw) -> ActorConfig:
    base = dict(
        nats=nats_url,
        run=run,
        engines=[engine],
        model="tiny-1m",
        sandbox_root=root,
        install_harnesses=False,
        metrics_port=-1,
    )
    return ActorConfig(**(base | kw))


async def results(bus: Bus, n: int, timeout: float = 60.0) -> list[RolloutResult]:
    """Wait until ``n`` RolloutResults are stored; return them (failing after ``timeout``)."""

    async def stored() -> list[RolloutResult] | None:
        got = await bus.read_subject(bus.subjects.rollouts, RolloutResult)
        return got if len(got) >= n else None

    return await until(stored, timeout, f"{n} results")


@contextlib.asynccontextmanager
async def in_process_actor(cfg: ActorConfig, bus: Bus, name: str = "inproc"):
    """An ActorService running in this event loop; stopped (gracefully) on exit."""
    async with RolloutDeps.open(cfg, bus, actor=name) as deps:
        service = ActorService(cfg, bus, deps)
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        try:
            yield service
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)


async def tasks_left(bus: Bus, n: int) -> bool:
    """Whether ``n`` tasks are left in the queue (acked ones are removed)."""
    return await bus.stream_count("TASKS") == n


def sandboxes(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if not p.name.startswith(".")] if root.exists() else []


@pytest.mark.integration
async def test_service_end_to_end(bus: Bus, nats_url, run_name, sandbox_root: Path):
    """Four tasks, two slots: one result per task, good tasks acked, the unknown task
    published as a failed result and dead-lettered; nothing left in the queue."""
    acks = lambda: metrics.sample_value("hrl_actor_tasks_total", {"outcome": "acked"})  # noqa: E731
    acked = acks()
    reqs = [
        request(cmd=SOLVE, group_id="ga", k=0, group_size=2, meta={"tag": "x"}),
        request(cmd="true", group_id="ga", k=1, group_size=2),
        request("reference", group_id="gb"),
        request(cmd="true", group_id="gc", task_id="no_such_task"),
    ]
    for r in reqs:
        await bus.publish(bus.subjects.tasks, r)
    async with ScriptedEngine(TOK, toy_solver()) as eng:
        cfg = actor_config(
            nats_url, run_name, eng.url, sandbox_root, concurrency=2, expose_solution=True
        )
        async with in_process_actor(cfg, bus) as service:
            got = {r.rollout_id: r for r in await results(bus, 4)}
            await until(lambda: service.done == 4, what="every task done")
            await until(lambda: acks() - acked == 3, what="the three good tasks acked")
    assert set(got) == {"ga-0-1", "ga-1-1", "gb-0-1", "gc-0-1"}
    assert (got["ga-0-1"].status, got["ga-0-1"].reward, got["ga-0-1"].meta) == (
        "ok",
        1.0,
        {"tag": "x"},
    )
    assert got["ga-1-1"].status == "ok" and got["ga-1-1"].reward < 1.0
    assert (got["gb-0-1"].status, got["gb-0-1"].reward, got["gb-0-1"].n_calls) == ("ok", 1.0, 2)
    assert got["gc-0-1"].status == "harness_error" and "no_such_task" in got["gc-0-1"].error
    assert all(r.actor == "inproc" and r.group_size in (1, 2) for r in got.values())
    assert await bus.stream_count("TASKS") == 0
    dead = await bus.read_subject(bus.subjects.dead("TASKS"), DeadLetter)
    assert len(dead) == 1 and "no_such_task" in dead[0].reason
    assert sandboxes(sandbox_root) == []


# ---------------------------------------------------------------------------------------------
# as a process


@pytest.mark.integration
async def test_killed_actor_task_becomes_attempt_two(
    bus: Bus, nats_url, run_name, sandbox_root: Path, tmp_path: Path
):
    """SIGKILL mid-rollout: the task is redelivered and rolled out again as attempt 2 of the
    same member; the next actor sweeps the dead one's sandbox and socket folder."""
    async with ScriptedEngine(TOK, toy_solver(hang_attempt=1)) as eng:
        argv = actor_argv(nats_url, run_name, eng.url, sandbox_root)
        async with actor_process(argv, tmp_path / "actor.log") as proc:
            await bus.publish(bus.subjects.tasks, request("reference", group_id="gk"))
            await until(lambda: len(eng.requests) == 1, what="the first model call")
            assert len(sandboxes(sandbox_root)) == 1
            proc.kill()
            await proc.wait()
        cfg = actor_config(nats_url, run_name, eng.url, sandbox_root)
        async with in_process_actor(cfg, bus):
            assert sandboxes(sandbox_root) == []  # swept at start
            assert not list(SOCKET_ROOT.glob(f"{proc.pid}-*"))
            (res,) = await results(bus, 1)
            await until(lambda: tasks_left(bus, 0), what="the task acked")
    assert (res.rollout_id, res.attempt, res.k, res.status, res.reward) == (
        "gk-0-2",
        2,
        0,
        "ok",
        1.0,
    )
    assert await bus.stream_count("TASKS") == 0
    assert len(await bus.read_subject(bus.subjects.rollouts, RolloutResult)) == 1


@pytest.mark.integration
async def test_sigterm_shutdown_cleans_up_and_requeues(
    bus: Bus, nats_url, run_name, sandbox_root: Path, tmp_path: Path
):
    """SIGTERM with a rollout in flight: after the grace period it is killed, its sandbox
    destroyed, its task nak'ed (it comes back as the next delivery), and the actor exits 0."""
    async with ScriptedEngine(TOK, toy_solver(hang_attempt=1)) as eng:
        argv = actor_argv(nats_url, run_name, eng.url, sandbox_root, "--shutdown-grace-s", "0.5")
        async with actor_process(argv, tmp_path / "actor.log") as proc:
            await bus.publish(bus.subjects.tasks, request("reference", group_id="gt"))
            await until(lambda: len(eng.requests) == 1, what="the first model call")
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 30)
        assert rc == 0, (tmp_path / "actor.log").read_text()[-3000:]
    assert sandboxes(sandbox_root) == []
    assert not list(SOCKET_ROOT.glob(f"{proc.pid}-*"))
    assert await bus.read_subject(bus.subjects.rollouts, RolloutResult) == []
    consumer = await bus.consumer("TASKS", DURABLE, TaskRequest, ack_wait=3)
    (d,) = await consumer.fetch(1, timeout=5)
    assert (d.record.group_id, d.num_delivered) == ("gt", 2)
    await d.term()


@pytest.mark.integration
async def test_second_sigterm_cuts_the_grace_period_short(
    bus: Bus, nats_url, run_name, sandbox_root: Path, tmp_path: Path
):
    """A parent going away signals twice (its own stop, then its death): the second SIGTERM
    ends the grace period at once instead of waiting it out against an engine and NATS that
    may be gone; the rollout is killed and its task requeued as with an expired grace."""
    async with ScriptedEngine(TOK, toy_solver(hang_attempt=1)) as eng:
        argv = actor_argv(nats_url, run_name, eng.url, sandbox_root, "--shutdown-grace-s", "120")
        async with actor_process(argv, tmp_path / "actor.log") as proc:
            await bus.publish(bus.subjects.tasks, request("reference", group_id="gh"))
            await until(lambda: len(eng.requests) == 1, what="the first model call")
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(1.0)  # a window for a wrong exit to happen in
            assert proc.returncode is None  # the first signal waits for the rollout
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 30)
            took = time.monotonic() - t0
        assert rc == 0, (tmp_path / "actor.log").read_text()[-3000:]
    assert took < 20, took
    assert sandboxes(sandbox_root) == []
    consumer = await bus.consumer("TASKS", DURABLE, TaskRequest, ack_wait=3)
    (d,) = await consumer.fetch(1, timeout=5)
    assert (d.record.group_id, d.num_delivered) == ("gh", 2)
    await d.term()


@pytest.mark.unit
def test_config_fields_documented_and_engine_flag():
    """Every actor config field is documented; ``--engine`` repeats into ``engines``."""
    import argparse

    from harnessrl.common.config import add_config_args, config_from_args

    assert undocumented_fields(ActorConfig) == []
    parser = argparse.ArgumentParser()
    add_config_args(parser, ActorConfig)
    args = parser.parse_args(["--engine", "http://a:1", "--engine", "http://b:2", "--run", "r"])
    cfg = config_from_args(ActorConfig, args)
    assert cfg.engines == ["http://a:1", "http://b:2"]
    with pytest.raises(Exception, match="ack_wait_s"):  # the learner's now: it owns the consumer
        ActorConfig(ack_wait_s=5)


@pytest.mark.integration
async def test_engine_error_is_published_and_acked(bus: Bus, nats_url, run_name, sandbox_root):
    """A rollout the engine failed is published as an engine_error with its reason and acked
    (it is this attempt's outcome, not a bad request): no dead letter, no retry."""
    await bus.publish(bus.subjects.tasks, request("reference", group_id="ge"))
    fail = lambda ids, body: Reply(status=500)  # noqa: E731
    async with ScriptedEngine(TOK, fail) as eng:
        opts = {"reference": {"retries": 0}}
        cfg = actor_config(nats_url, run_name, eng.url, sandbox_root, harness_options=opts)
        async with in_process_actor(cfg, bus):
            (res,) = await results(bus, 1)
            await until(lambda: tasks_left(bus, 0), what="the task acked")
    assert (res.rollout_id, res.status, res.reason, res.n_calls) == (
        "ge-0-1",
        "engine_error",
        "engine_failed",
        1,
    )
    assert await bus.stream_count("TASKS") == 0
    assert await bus.read_subject(bus.subjects.dead("TASKS"), DeadLetter) == []


@pytest.mark.integration
async def test_given_up_task_has_a_reason(bus: Bus, nats_url, run_name, sandbox_root):
    """A task delivered more than max_attempts times ends as a harness_error result with
    reason given_up, and is dead-lettered."""
    await bus.publish(bus.subjects.tasks, request(cmd="true", group_id="gg"))
    consumer = await bus.consumer("TASKS", DURABLE, TaskRequest, ack_wait=3)
    (d,) = await consumer.fetch(1, timeout=5)
    await d.nak()  # as if an actor had died on it
    before = metrics.sample_value("hrl_actor_failures_total", {"reason": "given_up"}) or 0
    cfg = actor_config(nats_url, run_name, "http://127.0.0.1:9", sandbox_root, max_attempts=1)
    async with in_process_actor(cfg, bus):
        (res,) = await results(bus, 1)
        dead = await until(
            lambda: bus.read_subject(bus.subjects.dead("TASKS"), DeadLetter), what="a dead letter"
        )
    assert (res.rollout_id, res.status, res.reason) == ("gg-0-2", "harness_error", "given_up")
    assert len(dead) == 1 and "given up" in dead[0].reason
    assert metrics.sample_value("hrl_actor_failures_total", {"reason": "given_up"}) == before + 1


@pytest.mark.integration
async def test_fetches_at_most_fetch_batch_tasks(
    bus: Bus, nats_url, run_name, sandbox_root: Path, monkeypatch
):
    """With every slot free the actor still takes at most ``fetch_batch`` tasks per fetch (a
    task's ack_wait runs from its delivery: a batch of hundreds would wait on its own starts),
    and runs them all."""
    asked: list[int] = []
    real = ActorService.consumer

    async def spying(self):
        c = await real(self)
        fetch = c.fetch

        async def fetch_spy(batch: int = 1, timeout: float = 1.0):
            asked.append(batch)
            return await fetch(batch, timeout)

        c.fetch = fetch_spy
        return c

    monkeypatch.setattr(ActorService, "consumer", spying)
    reqs = [request(cmd="true", group_id="gf", k=k, group_size=6) for k in range(6)]
    await bus.publish_many([(bus.subjects.tasks, r, None) for r in reqs])
    async with ScriptedEngine(TOK, toy_solver()) as eng:
        cfg = actor_config(nats_url, run_name, eng.url, sandbox_root, concurrency=8, fetch_batch=2)
        async with in_process_actor(cfg, bus):
            got = await results(bus, 6)
    assert sorted(r.k for r in got) == list(range(6))
    assert asked and max(asked) == 2
