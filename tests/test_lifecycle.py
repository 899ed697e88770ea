"""``harnessrl.common.lifecycle.serve`` (one process lifecycle for every service) and
``Consumer.serve`` (one fetch-up-to-free-slots loop), in process: signals are sent to this
process while ``serve`` holds SIGTERM/SIGINT, the bus is the in-memory twin or a real
nats-server."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import aiohttp
import pytest

from harnessrl.common import lifecycle
from harnessrl.common.bus import Bus, Delivery, MemoryBus, connect
from harnessrl.common.config import ServiceConfig
from harnessrl.common.records import TaskRequest

CFG = ServiceConfig(metrics_port=-1)


def kill_self(sig: int = signal.SIGTERM) -> None:
    os.kill(os.getpid(), sig)


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.unit
async def test_a_signal_stops_the_body_which_returns_its_status() -> None:
    """SIGTERM sets ``stop``, runs the ``on_stop`` callbacks and interrupts the bus; the body's
    return value is the exit status."""
    bus = MemoryBus("lc")
    called: list[str] = []

    async def body(proc: lifecycle.Process) -> int:
        proc.on_stop(lambda: called.append("cb"))
        asyncio.get_running_loop().call_soon(kill_self)
        await proc.stop.wait()
        return 3

    assert await lifecycle.serve(CFG, "t", body, bus=bus) == 3
    assert called == ["cb"] and bus.interrupted


@pytest.mark.unit
async def test_sigint_stops_too_and_the_handlers_are_removed_after() -> None:
    """Ctrl-C is a stop like SIGTERM; once ``serve`` returns SIGINT is Python's again."""

    async def body(proc: lifecycle.Process) -> None:
        asyncio.get_running_loop().call_soon(kill_self, signal.SIGINT)
        await proc.stop.wait()

    assert await lifecycle.serve(CFG, "t", body, bus=MemoryBus("lc")) == 0
    with pytest.raises(KeyboardInterrupt):
        kill_self(signal.SIGINT)
        await asyncio.sleep(0.1)


@pytest.mark.unit
async def test_a_body_that_outlives_its_grace_is_cancelled_and_exits_0() -> None:
    """After ``grace_s`` the body is cancelled (its ``finally`` runs) and the stop is clean."""
    cleaned = asyncio.Event()
    stop = asyncio.Event()

    async def body(proc: lifecycle.Process) -> int:
        try:
            await asyncio.Event().wait()  # ignores the stop
        finally:
            cleaned.set()
        return 1

    asyncio.get_running_loop().call_later(0.05, stop.set)
    t0 = time.monotonic()
    assert await lifecycle.serve(CFG, "t", body, grace_s=0.3, stop=stop, bus=MemoryBus("x")) == 0
    assert cleaned.is_set() and 0.3 <= time.monotonic() - t0 < 5


@pytest.mark.unit
async def test_a_second_signal_ends_an_unlimited_grace() -> None:
    """``grace_s=inf`` waits for the body until a second signal, which cancels it."""
    seen = []

    async def body(proc: lifecycle.Process) -> None:
        kill_self()
        await proc.stop.wait()
        seen.append("stopped")
        await asyncio.sleep(0.2)
        assert not proc.hurry.is_set()
        kill_self()
        await asyncio.Event().wait()

    t0 = time.monotonic()
    assert await lifecycle.serve(CFG, "t", body, grace_s=math.inf, bus=MemoryBus("x")) == 0
    assert seen == ["stopped"] and time.monotonic() - t0 < 5


@pytest.mark.unit
async def test_without_a_grace_the_body_decides_how_long_it_takes() -> None:
    """``grace_s=None`` (the learner finishing its step): a second signal cancels nothing."""

    async def body(proc: lifecycle.Process) -> int:
        kill_self()
        await proc.stop.wait()
        kill_self()
        await asyncio.sleep(0.5)  # "the step"
        return 7

    assert await lifecycle.serve(CFG, "t", body, bus=MemoryBus("x")) == 7


@pytest.mark.unit
async def test_grace_zero_cancels_at_the_stop() -> None:
    """``grace_s=0`` (the assembler: in-flight work is nak'ed for the next process)."""
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)

    async def body(proc: lifecycle.Process) -> int:
        await asyncio.Event().wait()
        return 1

    t0 = time.monotonic()
    assert await lifecycle.serve(CFG, "t", body, grace_s=0, stop=stop, bus=MemoryBus("x")) == 0
    assert time.monotonic() - t0 < 2


@pytest.mark.integration
async def test_a_failing_body_raises_and_everything_is_closed(nats_url: str) -> None:
    """A body's exception reaches the caller; the metrics server and the bus ``serve``
    connected are closed anyway."""
    cfg = ServiceConfig(nats=nats_url, run="lc" + str(os.getpid()), metrics_port=0)
    seen: dict = {}

    async def body(proc: lifecycle.Process) -> None:
        seen["bus"], seen["port"] = proc.bus, proc.metrics_port
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{proc.metrics_port}/metrics") as r,
        ):
            seen["status"] = r.status
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await lifecycle.serve(cfg, "t", body)
    assert seen["status"] == 200 and seen["bus"].nc.is_closed
    with pytest.raises(aiohttp.ClientConnectionError):
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{seen['port']}/metrics"),
        ):
            pass


@pytest.mark.integration
async def test_the_grace_ends_when_nats_is_unreachable(nats_server_fn, run_name: str) -> None:
    """Stopping while NATS is away: nothing in flight could publish, so an unlimited grace
    ends at once (the body is cancelled) and the bus closes cleanly."""
    bus = await connect(nats_server_fn.url, run_name)
    nats_server_fn.kill()
    await wait_until(lambda: not bus.nc.is_connected)  # type: ignore[attr-defined]
    stop = asyncio.Event()
    cancelled = []

    async def body(proc: lifecycle.Process) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(proc.bus.abandoning)
            raise

    asyncio.get_running_loop().call_later(0.05, stop.set)
    t0 = time.monotonic()
    await lifecycle.serve(CFG, "t", body, grace_s=math.inf, stop=stop, bus=bus)
    assert cancelled == [True] and time.monotonic() - t0 < 5
    await bus.close()


@pytest.mark.integration
async def test_a_given_bus_is_left_open(nats_url: str, run_name: str) -> None:
    """``bus=``: the caller's bus is the caller's to close."""
    bus = await connect(nats_url, run_name)

    async def body(proc: lifecycle.Process) -> None:
        assert proc.bus is bus

    await lifecycle.serve(CFG, "t", body, bus=bus)
    assert bus.nc.is_connected  # type: ignore[attr-defined]
    await bus.publish(bus.subjects.tasks, task(0))
    await bus.close()


# ---------------------------------------------------------------------------------------------
# Consumer.serve


def task(k: int) -> TaskRequest:
    return TaskRequest(
        task_id="t", suite="s", harness="h", group_id="g", k=k, group_size=64, issued_version=0
    )


async def queued(n: int) -> Bus:
    bus = MemoryBus("lc")
    await bus.ensure_streams()
    await bus.publish_many([(bus.subjects.tasks, task(k), None) for k in range(n)])
    return bus


@pytest.mark.unit
async def test_consumer_serve_fills_free_slots_and_caps_each_fetch() -> None:
    """Never more than ``slots`` handlers at once, never more than ``batch`` per fetch, every
    delivery handled once."""
    bus = await queued(20)
    consumer = await bus.consumer("TASKS", "a", TaskRequest, ack_wait=30)
    asked: list[int] = []
    fetch = consumer.fetch

    async def spy(batch: int = 1, timeout: float = 1.0):
        asked.append(batch)
        return await fetch(batch, timeout)

    consumer.fetch = spy  # type: ignore[method-assign]
    running, peak, done = 0, 0, []
    stop = asyncio.Event()

    async def handle(d: Delivery[TaskRequest]) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        done.append(d.record.k)
        await d.ack()
        if len(done) == 20:
            stop.set()

    await asyncio.wait_for(consumer.serve(handle, 4, batch=3, stop=stop, timeout=0.05), 20)
    assert sorted(done) == list(range(20))
    assert peak == 4 and max(asked) == 3


@pytest.mark.unit
async def test_consumer_serve_stops_after_its_handlers_and_naks_late_deliveries() -> None:
    """At ``stop`` the running handlers finish; a delivery that came with the stop is nak'ed
    (another consumer gets it at once), not handled."""
    bus = await queued(3)
    consumer = await bus.consumer("TASKS", "a", TaskRequest, ack_wait=30)
    stop = asyncio.Event()
    fetch = consumer.fetch
    finished: list[int] = []

    async def stop_during_fetch(batch: int = 1, timeout: float = 1.0):
        got = await fetch(batch, timeout)
        if any(d.record.k == 2 for d in got):
            stop.set()
        return got

    consumer.fetch = stop_during_fetch  # type: ignore[method-assign]

    async def handle(d: Delivery[TaskRequest]) -> None:
        await asyncio.sleep(0.2)
        finished.append(d.record.k)
        await d.ack()

    await asyncio.wait_for(consumer.serve(handle, 2, batch=1, stop=stop, timeout=0.05), 10)
    assert sorted(finished) == [0, 1]
    (again,) = await fetch(5, 0.05)
    assert (again.record.k, again.num_delivered) == (2, 2)


@pytest.mark.unit
async def test_cancelling_consumer_serve_cancels_its_handlers() -> None:
    """Cancelled (a process out of grace), it cancels every running handler and waits."""
    bus = await queued(2)
    consumer = await bus.consumer("TASKS", "a", TaskRequest, ack_wait=30)
    started: list[int] = []
    cancelled: list[int] = []

    async def handle(d: Delivery[TaskRequest]) -> None:
        started.append(d.record.k)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(d.record.k)
            raise

    serving = asyncio.create_task(consumer.serve(handle, 4, timeout=0.05))
    await wait_until(lambda: len(started) == 2)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert sorted(cancelled) == [0, 1]
