"""The shared task consumer ``actors`` against a real nats-server with role credentials: only
the side that owns the TASKS stream (the learner's feeder, or the admin) creates or changes
it; an actor credential can only fetch, ack and read it, so it cannot hijack it (the hostile
probe: the consumer's own config sent back with another filter, or ``max_ack_pending: 1``);
an actor that starts before it exists waits for it; a consumer that stops delivering while
tasks wait is reported within seconds (metric, alert rule, status line)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from harnessrl.common import records as r
from harnessrl.common.bus import TASK_CONSUMER, PermissionDenied
from harnessrl.common.natsd import NatsServer
from tests.helpers.records import sample_records
from tests.helpers.secure_nats import actor_creds, as_role

pytestmark = pytest.mark.integration


def task(i: int) -> r.TaskRequest:
    t = sample_records()[0]
    return r.TaskRequest(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "group_id": f"g{i}"})


async def owner_creates_consumer(srv: NatsServer, run: str, **kw) -> None:
    """The learner's feeder creates the task consumer with the run's settings."""
    from harnessrl.learner.config import FeederConfig
    from harnessrl.learner.task_queue import TaskQueue

    learner = await as_role(srv, "learner", run)
    try:
        await TaskQueue(learner, FeederConfig(**kw)).ensure()
    finally:
        await learner.close()


async def test_an_actor_credential_cannot_hijack_the_task_consumer(
    secure_server: NatsServer,
    run: str,
) -> None:
    """The hostile probe: an actor publishes the consumer's own config back to each consumer
    creation subject with the filter changed, then with ``max_ack_pending: 1``, then tries to
    delete it. Every attempt is refused at once; the consumer keeps the owner's settings and
    still serves that actor."""
    await owner_creates_consumer(secure_server, run, task_ack_wait_s=7, task_max_ack_pending=500)
    actor = await as_role(secure_server, actor_creds(0), run)
    stream = actor.subjects.stream("TASKS")
    try:
        info = await actor._api(stream, actor.js.consumer_info(stream, TASK_CONSUMER))
        assert info.config.max_ack_pending == 500 and info.config.ack_wait == 7
        own = info.config.as_dict()
        hijacks = [
            {**own, "filter_subject": f"hrl.{run}.nothing"},
            {**own, "max_ack_pending": 1},
        ]
        api = "$JS.API.CONSUMER"
        subjects = [
            f"{api}.DURABLE.CREATE.{stream}.{TASK_CONSUMER}",
            f"{api}.CREATE.{stream}.{TASK_CONSUMER}",
            f"{api}.CREATE.{stream}.{TASK_CONSUMER}.hrl.{run}.nothing",
        ]
        for cfg in hijacks:
            for subject in subjects:
                body = json.dumps({"stream_name": stream, "config": cfg}).encode()
                t0 = time.monotonic()
                with pytest.raises(PermissionDenied):
                    await actor._api(stream, actor.nc.request(subject, body, timeout=5))
                assert time.monotonic() - t0 < 5, subject
        with pytest.raises(PermissionDenied):
            await actor._api(stream, actor.js.delete_consumer(stream, TASK_CONSUMER))
        # the actor's side of it still works: bind, fetch, ack
        learner = await as_role(secure_server, "learner", run)
        await learner.publish(learner.subjects.tasks, task(1))
        await learner.close()
        consumer = await actor.bind_consumer("TASKS", TASK_CONSUMER, r.TaskRequest)
        assert consumer.ack_wait == 7
        [d] = await consumer.fetch(1, timeout=5)
        await d.ack()
    finally:
        await actor.close()
    admin = await as_role(secure_server, "admin", run)
    try:
        info = await admin.js.consumer_info(stream, TASK_CONSUMER)
        assert info.config.filter_subject == f"hrl.{run}.tasks"
        assert info.config.max_ack_pending == 500
    finally:
        await admin.close()


async def test_an_actor_that_starts_first_waits_for_its_consumer(
    nats_url: str, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An actor binding before the learner made the consumer waits (one clear log line naming
    who creates it), then binds to it as made, with the owner's ``ack_wait``."""
    from harnessrl.common.bus import connect
    from harnessrl.learner.config import FeederConfig
    from harnessrl.learner.task_queue import TaskQueue

    actor = await connect(nats_url, run_name)
    learner = await connect(nats_url, run_name)
    try:
        with caplog.at_level(logging.INFO, logger="harnessrl.bus"):
            binding = asyncio.create_task(
                actor.bind_consumer("TASKS", TASK_CONSUMER, r.TaskRequest, owner="the learner")
            )
            await asyncio.sleep(1.5)
            assert not binding.done()
            assert await actor.consumer_state("TASKS", TASK_CONSUMER) is None  # not made by it
            waits = [m for m in caplog.messages if "waiting for the learner to create it" in m]
            assert len(waits) == 1, caplog.messages
            await TaskQueue(learner, FeederConfig(task_ack_wait_s=4)).ensure()
            consumer = await asyncio.wait_for(binding, 10)
        assert consumer.ack_wait == 4
        await learner.publish(learner.subjects.tasks, task(2))
        [d] = await consumer.fetch(1, timeout=5)
        await d.ack()
        with pytest.raises(Exception, match="did not appear"):
            await actor.bind_consumer("TASKS", "nobody", r.TaskRequest, poll_s=0.1, wait_s=0.5)
    finally:
        await actor.close()
        await learner.close()


async def test_a_stalled_task_consumer_is_reported(
    nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """Tasks wait while an actor asks for them: a consumer stopped by other means than an
    actor (paused by an admin, its filter changed by an admin, deleted) counts as stalled
    from the first check, ``hrl_task_queue_stalled_seconds`` grows past the alert's threshold
    (the ``harnessrl run`` monitor, scraping the learner's ``/metrics``, then says so on its
    status line), and drops to 0 once it delivers again. Actors that are all busy (nobody
    asking) are not a stall."""
    from harnessrl.common import metrics
    from harnessrl.common.bus import TASK_STALL_ALERT_S, connect
    from harnessrl.learner.config import FeederConfig
    from harnessrl.learner.task_queue import TaskQueue

    bus = await connect(nats_url, run_name)
    stream = bus.subjects.stream("TASKS")
    queue = TaskQueue(bus, FeederConfig())
    await queue.ensure()
    consumer = await bus.bind_consumer("TASKS", TASK_CONSUMER, r.TaskRequest)
    asking = asyncio.Event()
    got: list = []
    room = [0]

    async def actor() -> None:  # asks while ``asking`` is set and it has room for a task
        while True:
            await asking.wait()
            if len(got) >= room[0]:
                await asyncio.sleep(0.05)
                continue
            got.extend(await consumer.fetch(1, timeout=1.0))

    def stalled() -> float:
        return metrics.sample_value("hrl_task_queue_stalled_seconds") or 0.0

    runner = asyncio.create_task(actor())
    try:
        for i in range(4):
            await bus.publish(bus.subjects.tasks, task(10 + i))
        # nobody asks (every slot busy): tasks wait, nothing is delivered, no stall
        assert await queue.check(now=0) == 0 and await queue.check(now=100) == 0
        room[0] = 1
        asking.set()
        await wait(lambda: len(got) == 1)
        assert await queue.check(now=101) == 0  # it delivered
        # an admin pauses it while the actor asks
        until = "2099-01-01T00:00:00Z"
        await bus.js.pause_consumer(stream, TASK_CONSUMER, until)
        room[0] = 2
        await asyncio.sleep(1.5)
        assert await queue.check(now=200) == 0  # the stall begins now
        assert await queue.check(now=200 + TASK_STALL_ALERT_S + 5) == TASK_STALL_ALERT_S + 5
        assert stalled() == TASK_STALL_ALERT_S + 5
        line = await status_line_of_learner(tmp_path)
        assert f"TASK QUEUE STALLED {TASK_STALL_ALERT_S + 5:.0f}s: 3 tasks wait" in line, line
        await bus.js.resume_consumer(stream, TASK_CONSUMER)
        await wait(lambda: len(got) == 2)
        assert await queue.check(now=300) == 0 and stalled() == 0
        assert "STALLED" not in await status_line_of_learner(tmp_path)
        # an admin sends the hijacker's config: another filter
        await bus.ensure_consumer("TASKS", TASK_CONSUMER, filter_subject=f"hrl.{run_name}.none")
        room[0] = 3
        await asyncio.sleep(1.5)
        await queue.check(now=400)
        assert await queue.check(now=430) == 30
        await queue.ensure()  # the learner sets its settings back (at its start)
        await wait(lambda: len(got) == 3)
        assert await queue.check(now=431) == 0
        # gone
        await bus.js.delete_consumer(stream, TASK_CONSUMER)
        await queue.check(now=500)
        assert await queue.check(now=525) == 25
    finally:
        runner.cancel()
        await bus.close()


async def status_line_of_learner(tmp_path: Path) -> str:
    """The ``harnessrl run`` status line of a monitor scraping this process as the learner."""
    from harnessrl.common import metrics
    from harnessrl.common.run.dashboard import Monitor, status_line

    runner, port = await metrics.start_metrics_server(0, "127.0.0.1")  # type: ignore[misc]
    m = Monitor("r", tmp_path, steps=1)
    m.add_target("learner", "learner", f"http://127.0.0.1:{port}/metrics")
    try:
        await m.tick()
        return status_line(m.status())
    finally:
        await m.close()
        await runner.cleanup()


async def wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_the_stall_alert_fires_within_a_minute(
    nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """End to end, in real time: a real Prometheus with deploy/monitoring's config and rules
    scrapes this process as the run's learner, whose task queue checks every second; an admin
    pauses the task consumer while an actor asks for tasks; ``HrlTaskQueueStalled`` fires for
    the run within a minute of the stall, and resolves once the consumer delivers again."""
    import json as _json
    import shutil

    from harnessrl.common import metrics
    from harnessrl.common.bus import connect
    from harnessrl.learner.config import FeederConfig
    from harnessrl.learner.task_queue import TaskQueue
    from tests.helpers.prometheus import Prometheus, prometheus_config

    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    bus = await connect(nats_url, run_name)
    stream = bus.subjects.stream("TASKS")
    queue = TaskQueue(bus, FeederConfig(task_check_s=1.0))
    await queue.ensure()
    consumer = await bus.bind_consumer("TASKS", TASK_CONSUMER, r.TaskRequest)
    got: list = []

    async def actor() -> None:  # always asking, one task at a time
        while True:
            got.extend(await consumer.fetch(1, timeout=1.0))

    runner, port = await metrics.start_metrics_server(0, "127.0.0.1")  # type: ignore[misc]
    targets = tmp_path / "targets"
    targets.mkdir()
    labels = {"run": run_name, "process": "learner"}
    (targets / "hrl-learner.json").write_text(
        _json.dumps([{"targets": [f"127.0.0.1:{port}"], "labels": labels}])
    )
    prom = Prometheus(prometheus_config(tmp_path, targets), tmp_path / "tsdb", tmp_path / "p.log")
    tasks = [asyncio.create_task(actor()), asyncio.create_task(queue.watch())]

    def firing() -> bool:
        alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
        return any(
            a["labels"]["alertname"] == "HrlTaskQueueStalled"
            and a["labels"].get("run") == run_name
            and a["state"] == "firing"
            for a in alerts
        )

    try:
        await bus.js.pause_consumer(stream, TASK_CONSUMER, "2099-01-01T00:00:00Z")
        t0 = time.monotonic()
        for i in range(3):
            await bus.publish(bus.subjects.tasks, task(30 + i))
        while not firing():
            assert time.monotonic() - t0 < 60, "HrlTaskQueueStalled did not fire within 60 s"
            await asyncio.sleep(1.0)
        fired_after = time.monotonic() - t0
        assert fired_after >= 15 and got == [], fired_after  # no false alarm before the stall
        await bus.js.resume_consumer(stream, TASK_CONSUMER)
        deadline = time.monotonic() + 60
        while firing():
            assert time.monotonic() < deadline, "the alert did not resolve"
            await asyncio.sleep(1.0)
        assert got  # delivering again
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        prom.stop()
        await runner.cleanup()
        await bus.close()
