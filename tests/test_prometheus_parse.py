"""The supervisor's Prometheus text parser agrees with ``prometheus_client``'s on what our
processes serve (any label value, histograms, special floats) and falls back to it on text it
cannot read itself."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from harnessrl.common.run import dashboard
from harnessrl.common.run.dashboard import _parse_prometheus_slow, parse_prometheus

pytestmark = pytest.mark.unit


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


def exposition(values: list[str], gauge: float) -> str:
    reg = CollectorRegistry()
    c = Counter("hrl_x_total", "x", ("harness", "reason"), registry=reg)
    g = Gauge("hrl_g", "g", registry=reg)
    h = Histogram("hrl_h_seconds", "h", ("kind",), registry=reg, buckets=(0.1, 1.0))
    for i, v in enumerate(values):
        c.labels(harness=v, reason=str(i)).inc(i + 0.5)
        h.labels(kind=v).observe(i / 3)
    g.set(gauge)
    return generate_latest(reg).decode()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(max_size=12), max_size=4, unique=True),
    st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**12), 10**12)),
)
def test_agrees_with_prometheus_client(values: list[str], gauge: float) -> None:
    """Label values with quotes, backslashes, newlines, ``=``, braces and commas; NaN, +-Inf."""
    text = exposition(values, float(gauge))
    assert same(parse_prometheus(text), _parse_prometheus_slow(text))


def test_reads_escaped_labels_itself(monkeypatch) -> None:
    """The fast path (not the fallback) unescapes ``\\"``, ``\\\\`` and ``\\n``."""
    text = exposition(['a"b\\c\nd=}{,'], 2.0)
    monkeypatch.setattr(dashboard, "_parse_prometheus_slow", None)  # a fallback would fail
    got = parse_prometheus(text)
    key = ("hrl_x_total", (("harness", 'a"b\\c\nd=}{,'), ("reason", "0")))
    assert got[key] == 0.5 and got[("hrl_g", ())] == 2.0


def test_unreadable_text_falls_back_to_prometheus_client(monkeypatch) -> None:
    calls = []

    def slow(text: str) -> dict:
        calls.append(text)
        return {("fallback", ()): 1.0}

    monkeypatch.setattr(dashboard, "_parse_prometheus_slow", slow)
    assert parse_prometheus('hrl_a{x="1",y=2} 3\n') == {("fallback", ()): 1.0}  # unquoted value
    assert parse_prometheus("hrl_b not-a-number\n") == {("fallback", ()): 1.0}
    assert len(calls) == 2
    assert parse_prometheus("# HELP hrl_c c\nhrl_c 4.5\n") == {("hrl_c", ()): 4.5}
    assert len(calls) == 2
