"""The feeder: admission control, restart-stable group ids, mix-harness groups, eval rounds;
a resumed feeder never runs a member twice, even after a nats-server restart (real server)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from harnessrl.common.bus import Bus, connect
from harnessrl.common.natsd import NatsServer
from harnessrl.common.records import RolloutResult, TaskRequest
from harnessrl.learner.config import FeederConfig
from harnessrl.learner.feeder import Feeder


@pytest.fixture
async def bus() -> Bus:
    b = await connect(f"memory://{uuid.uuid4().hex}", "t")
    yield b
    await b.close()


def feeder(bus: Bus, state=None, **cfg) -> Feeder:
    return Feeder(
        bus,
        FeederConfig(**cfg),
        group_size=4,
        batch_rollouts=8,
        max_staleness=1,
        state=state,
    )


async def tasks(bus: Bus) -> list[TaskRequest]:
    return await bus.read_subject(bus.subjects.tasks, TaskRequest)


@pytest.mark.unit
async def test_admission_control_caps_rollouts_in_flight(bus: Bus) -> None:
    """In flight <= (max_staleness + 1) * batch; only an ended member frees capacity."""
    f = feeder(bus)
    assert f.capacity == 16
    assert await f.top_up(0) == 4
    assert await f.top_up(0) == 0
    reqs = await tasks(bus)
    assert len(reqs) == 16 and f.in_flight == 16
    assert {r.msg_id() for r in reqs} == {f"task:{r.group_id}:{r.k}" for r in reqs}
    gid = reqs[0].group_id
    for k in range(3):
        f.on_ended(gid, k)
    f.on_ended(gid, 0)  # idempotent
    assert f.in_flight == 13 and await f.top_up(1) == 0
    f.on_ended(gid, 3)
    assert await f.top_up(1) == 1
    new = (await tasks(bus))[16:]
    assert [r.k for r in new] == [0, 1, 2, 3] and {r.issued_version for r in new} == {1}
    assert all(r.group_size == 4 and r.task_hash for r in new)


@pytest.mark.unit
async def test_group_ids_stable_across_restart(bus: Bus) -> None:
    """A feeder restored from a checkpoint re-issues later groups with the same ids and
    contents (their members, still stored, are not published again), and continues the
    counter."""
    f = feeder(bus)
    await f.top_up(0)
    saved = f.state()  # the checkpoint: 4 groups issued
    for r in await tasks(bus):  # the groups end; more are issued after the checkpoint
        f.on_ended(r.group_id, r.k)
    await f.top_up(1)
    before = await tasks(bus)
    assert len(before) == 32
    ended_early = before[16]  # a member of group 4 ends before the restart re-issues it
    g = feeder(bus, state=saved)
    assert g.epoch == f.epoch and g.next_group == 4
    g.on_ended(ended_early.group_id, ended_early.k)
    for r in before[:16]:
        g.on_ended(r.group_id, r.k)
    assert await g.top_up(1) == 4
    after = await tasks(bus)
    assert len(after) == 32  # re-issued groups were de-duplicated by msg id
    assert [(r.group_id, r.task_id, r.harness) for r in after] == [
        (r.group_id, r.task_id, r.harness) for r in before
    ]
    assert g.in_flight == 15  # the early ending was applied at re-issue
    assert g.state()["next_group"] == 8


@pytest.mark.integration
async def test_resume_after_a_server_restart_runs_no_member_twice(tmp_path: Path) -> None:
    """The nats-server restarts with the learner (``harnessrl run --resume``), losing its msg-id
    de-duplication window: the resumed feeder re-issues a group issued after its checkpoint
    without the member that already ran (its result is stored) and without the one still
    queued (stored longer than the window), instead of running them again."""
    server = NatsServer(tmp_path / "nats").start()
    run = "t" + uuid.uuid4().hex[:8]
    cfg = FeederConfig()
    opts = dict(group_size=2, batch_rollouts=2, max_staleness=1)  # capacity: 2 groups
    try:
        bus = await connect(server.url, run, duplicate_window=1.0)
        a = Feeder(bus, cfg, **opts)
        await a.top_up(0)  # groups 0 and 1
        saved = a.state()  # the checkpoint the learner resumes from
        actors = await bus.consumer("TASKS", "actors", TaskRequest, ack_wait=30)

        async def run_one() -> TaskRequest:  # an actor: result first, then the ack
            (d,) = await actors.fetch(1, timeout=5)
            t = d.record
            res = RolloutResult(
                rollout_id=f"{t.group_id}-{t.k}-1", task_id=t.task_id, group_id=t.group_id, k=t.k
            )
            await bus.publish(bus.subjects.rollouts_of(), res)
            await d.ack()
            return t

        done = [await run_one() for _ in range(4)]
        for t in done[:2]:  # group 0 trained: room for group 2
            a.on_ended(t.group_id, t.k)
        assert await a.top_up(1) == 1
        ran = await run_one()  # group 2's first member runs, its second stays queued
        assert ran.group_id == f"{a.epoch}_2" and await bus.stream_count("TASKS") == 1
        await bus.close()

        server.stop()  # the learner crashes; --resume restarts the server too
        await asyncio.sleep(1.2)  # the queued task is now older than the window
        server.start()
        bus = await connect(server.url, run, duplicate_window=1.0)
        b = Feeder(bus, cfg, **opts, state=saved)
        for t in done[:2]:  # group 0's samples are redelivered and trained again
            b.on_ended(t.group_id, t.k)
        assert await b.top_up(1) == 1  # group 2 again: it is in flight, nothing published
        assert await bus.stream_count("TASKS") == 1  # only the one still queued
        assert b.in_flight == 4 and b.next_group == 3
        await bus.close()
    finally:
        server.stop()


@pytest.mark.unit
async def test_fresh_lineage_gets_fresh_ids(bus: Bus) -> None:
    a, b = feeder(bus), feeder(bus)
    await a.top_up(0)
    await b.top_up(0)
    assert a.epoch != b.epoch and len(await tasks(bus)) == 32


@pytest.mark.unit
async def test_mix_harness_issues_one_group_per_harness(bus: Bus) -> None:
    f = feeder(bus, harnesses=["reference", "command"], harness_cmd="echo hi", shuffle=False)
    await f.top_up(0)
    reqs = await tasks(bus)
    groups = {r.group_id: (r.task_id, r.harness, r.harness_cmd) for r in reqs}
    assert list(groups.values())[:2] == [
        (reqs[0].task_id, "reference", ""),
        (reqs[0].task_id, "command", "echo hi"),
    ]
    assert len(groups) == 4


@pytest.mark.unit
async def test_eval_rounds_every_k_versions_outside_admission(bus: Bus) -> None:
    f = feeder(bus, eval_suite="toy-eval", eval_every=2)
    await f.top_up(0)
    reqs = await tasks(bus)
    evals = [r for r in reqs if r.is_eval]
    assert len(evals) == len(f.eval_pairs) > 0 and {r.suite for r in evals} == {"toy-eval"}
    assert f.in_flight == 16  # eval rollouts do not take training capacity
    await f.top_up(1)
    assert len([r for r in await tasks(bus) if r.is_eval]) == len(evals)
    await f.top_up(2)
    assert len([r for r in await tasks(bus) if r.is_eval]) == 2 * len(evals)


@pytest.mark.unit
async def test_unknown_suite_is_an_error(bus: Bus) -> None:
    with pytest.raises(Exception, match="unknown suite"):
        feeder(bus, suites=["no-such-suite"])


@pytest.mark.unit
async def test_disabled_feeder_issues_nothing(bus: Bus) -> None:
    f = feeder(bus, enabled=False)
    assert await f.top_up(0) == 0 and await tasks(bus) == []
    f.on_ended("someone_else_1", 0)  # samples of groups it never issued are fine


@pytest.mark.unit
async def test_suite_given_as_a_folder_is_sent_as_its_path(bus: Bus, tmp_path) -> None:
    """Tasks of a suite folder carry only the folder's base name; actors are told the path,
    and resolve every issued task with it (a name alone was 'task not found' for all)."""
    import shutil

    from harnessrl.common.tasks import load_task
    from harnessrl.common.tasks.registry import suite_dir

    folder = tmp_path / "my-suite"
    shutil.copytree(suite_dir("toy"), folder)
    f = feeder(bus, suites=[str(folder)], eval_suite="toy-eval", eval_every=1)
    await f.top_up(0)
    reqs = await tasks(bus)
    train = [r for r in reqs if not r.is_eval]
    assert train and {r.suite for r in train} == {str(folder.resolve())}
    assert {r.suite for r in reqs if r.is_eval} == {"toy-eval"}  # a known name stays a name
    for r in reqs:
        assert load_task(r.suite, r.task_id).task_hash == r.task_hash
