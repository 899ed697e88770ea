"""``harnessrl run``'s monitor when a read fails: a queue or an actor's ``/metrics`` that could
not be read is *unknown* — shown as such, and never taken for empty by the drain after the last
step (a monitoring error used to read as an empty queue and could end a drain early).

No processes: the bus is a stand-in whose JetStream queries start failing on demand, the actor's
``/metrics`` a port nobody listens on, and the drain is `Run.drain` itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from harnessrl.common.files import free_port
from harnessrl.common.run.dashboard import Monitor, render, status_line
from harnessrl.common.run.run import Run


class FlakyJetStream:
    """Stream and consumer info of a run (tasks empty; ``pending`` results waiting for the
    assembler); a query raises, as on a NATS timeout, while its ``fail_*`` flag is set."""

    def __init__(self, pending: int = 3) -> None:
        self.pending = pending
        self.fail_streams = self.fail_consumer = False

    async def stream_info(self, name: str) -> SimpleNamespace:
        if self.fail_streams:
            raise TimeoutError("nats: timeout")
        return SimpleNamespace(state=SimpleNamespace(last_seq=4, messages=0))

    async def consumer_info(self, stream: str, durable: str) -> SimpleNamespace:
        if self.fail_consumer:
            raise TimeoutError("nats: timeout")
        return SimpleNamespace(num_pending=self.pending, num_ack_pending=0)


def monitor(tmp_path: Path, js: FlakyJetStream) -> Monitor:
    m = Monitor("r", tmp_path, steps=1)
    m.bus = SimpleNamespace(js=js, subjects=SimpleNamespace(stream=lambda k: f"HRL_r_{k}"))
    return m


def drain_only(m: Monitor, tmp_path: Path, timeout_s: float) -> Run:
    """The parts of a `Run` that ``drain`` uses, without starting processes."""
    run = Run.__new__(Run)
    run.monitor, run.events, run.view, run._stop = m, [], None, asyncio.Event()
    run.cfg = SimpleNamespace(
        drain_timeout_s=timeout_s, scrape_interval_s=3600, rollup_interval_s=3600, plot_interval_s=0
    )
    run.sup = SimpleNamespace(children={}, poll=lambda: None)
    run.plan = SimpleNamespace(last_broadcast=lambda version: None)
    run.paths = SimpleNamespace(supervisor_log=tmp_path / "supervisor.log")
    return run


@pytest.mark.unit
async def test_a_failed_queue_read_shows_unknown_not_empty(tmp_path: Path) -> None:
    """After a good read, failing stream/consumer queries make every queue unknown (``?`` in
    the status line and the panel, left out of the rollup line), not 0 nor the stale value."""
    js = FlakyJetStream()
    m = monitor(tmp_path, js)
    try:
        await m.tick()
        assert m.status().queues == {"tasks": 0, "samples": 0, "results": 3}
        js.fail_streams = js.fail_consumer = True
        await m.tick()
        st = m.status()
    finally:
        await m.close()
    assert st.queues == {"tasks": None, "samples": None, "results": None}
    assert "queues results ? samples ? tasks ?" in status_line(st)
    assert any("TimeoutError" in e for e in st.unread.values()), st.unread
    assert m.rollup(st).queues == {}
    render(st)  # the rich panel draws unknown queues too


@pytest.mark.integration
@pytest.mark.parametrize("failing", ["assembler queue", "actor metrics"])
async def test_drain_never_ends_on_a_read_that_failed(tmp_path: Path, failing: str) -> None:
    """Work may be left, but the assembler's consumer query fails (its results queue is
    unknown), or an actor's /metrics cannot be read (its rollouts in flight are unknown),
    while every other read says empty: the drain waits until its timeout instead of declaring
    the run drained."""
    js = FlakyJetStream()
    m = monitor(tmp_path, js)
    if failing == "assembler queue":
        js.fail_consumer = True
    else:
        js.pending = 0
        m.add_target("actor-0", "actor", f"http://127.0.0.1:{free_port('127.0.0.1')}/metrics")
    run = drain_only(m, tmp_path, timeout_s=2.0)
    try:
        await run.drain()
    finally:
        await m.close()
    assert not any("drained" in e for e in run.events), run.events
    assert "drain timed out" in run.events[-1], run.events


@pytest.mark.unit
async def test_drain_ends_when_every_read_says_empty(tmp_path: Path) -> None:
    """The control: every queue read and empty, every actor read with nothing in flight."""
    m = monitor(tmp_path, FlakyJetStream(pending=0))
    run = drain_only(m, tmp_path, timeout_s=30.0)
    try:
        await run.drain()
    finally:
        await m.close()
    assert "drained" in run.events[-1], run.events
