"""The /metrics endpoint serves the bus counters in Prometheus text format."""

from __future__ import annotations

import importlib

import aiohttp
import pytest

from harnessrl.common import metrics
from harnessrl.common import records as r
from harnessrl.common.bus import connect


@pytest.mark.integration
async def test_metrics_endpoint_exports_bus_counters(nats_url: str, run_name: str) -> None:
    started = await metrics.start_metrics_server(0, host="127.0.0.1")
    assert started is not None
    runner, port = started
    bus = await connect(nats_url, run_name)
    task = r.TaskRequest(group_id="m", k=0, group_size=1, issued_version=0, task_id="t")
    before = metrics.sample_value("hrl_bus_published_total", {"stream": "TASKS"})
    await bus.publish(bus.subjects.tasks, task)
    await bus.publish(bus.subjects.tasks, task)  # duplicate: counted separately
    cons = await bus.consumer("TASKS", "actors", r.TaskRequest)
    (d,) = await cons.fetch(1, timeout=2)
    await d.ack()
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    assert metrics.sample_value("hrl_bus_published_total", {"stream": "TASKS"}) == before + 1
    for name in (
        "hrl_bus_published_total",
        "hrl_bus_duplicates_total",
        "hrl_bus_consumed_total",
        "hrl_bus_acked_total",
        "hrl_bus_consumer_lag",
    ):
        assert name in text
    await bus.close()
    await runner.cleanup()


@pytest.mark.unit
async def test_metrics_disabled_with_minus_one() -> None:
    assert await metrics.start_metrics_server(-1) is None


@pytest.mark.unit
def test_every_metric_is_in_one_namespace() -> None:
    """A metric outside ``hrl_*`` is refused when created; the engine's (once
    ``harnessrl_engine_*``) are inside it like every other process's."""
    for mod in (
        "harnessrl.proxy.engine.cache",
        "harnessrl.proxy.engine.scheduler",
    ):  # register their metrics
        importlib.import_module(mod)

    with pytest.raises(ValueError, match="outside the hrl_"):
        metrics.counter("harnessrl_engine_x_total", "x")
    names = [n for n in metrics._metrics if n.startswith("hrl_engine_")]
    assert "hrl_engine_generated_tokens_total" in names
    assert all(n.startswith(metrics.NAMESPACE) for n in metrics._metrics)
