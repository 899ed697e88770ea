"""Prometheus metrics: one registry per process, served on ``--metrics-port`` by aiohttp.

Metric objects are module-level singletons created through ``counter``/``gauge``/``histogram``,
which return the existing metric when a name is registered twice (modules imported by several
entry points, tests creating services repeatedly). Every name is in one namespace,
``hrl_<component>_...`` (`NAMESPACE`; the embedded engine's too), so one scrape config, one
dashboard query prefix and one alert rule file cover every process.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_lock = threading.Lock()
_metrics: dict[str, Any] = {}

NAMESPACE = "hrl_"
"""Prefix of every metric name (checked when a metric is created)."""

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def _get(kind: type, name: str, doc: str, labels: tuple[str, ...], **kw: Any) -> Any:
    if not name.startswith(NAMESPACE):
        raise ValueError(f"metric {name!r} is outside the {NAMESPACE}* namespace")
    with _lock:
        m = _metrics.get(name)
        if m is None:
            m = kind(name, doc, labelnames=labels, registry=REGISTRY, **kw)
            _metrics[name] = m
        return m


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return _get(Counter, name, doc, labels)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return _get(Gauge, name, doc, labels)


def histogram(
    name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = LATENCY_BUCKETS
) -> Histogram:
    return _get(Histogram, name, doc, labels, buckets=buckets)


def render(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)


def sample_value(name: str, labels: dict[str, str] | None = None) -> float:
    """Current value of one sample (0.0 when absent); for tests and the dashboard."""
    v = REGISTRY.get_sample_value(name, labels or {})
    return float(v) if v is not None else 0.0


async def metrics_handler(request: Any) -> Any:
    from aiohttp import web

    return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_metrics_server(port: int, host: str = "0.0.0.0") -> tuple[Any, int] | None:
    """Serve ``/metrics`` on ``port`` (0 = free port, -1 = disabled). Returns (runner, port)."""
    if port < 0:
        return None
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
