"""The assembler service against the in-memory bus and a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harnessrl.common import metrics
from harnessrl.common import records as r
from harnessrl.common.bus import Bus, connect
from harnessrl.common.config import undocumented_fields
from harnessrl.common.tree import assemble, expand, join_parts, split_sample
from harnessrl.learner import assembler as assembler_mod
from harnessrl.learner.assembler import Assembler
from harnessrl.learner.config import AssemblerConfig
from tests.helpers.trees import Spec, make_calls, result_for
from tests.helpers.wait import until

ROOT = Path(__file__).resolve().parents[1]

CHAIN = [
    Spec([1, 2, 3], [4, 5], wv=2),
    Spec([1, 2, 3, 4, 5, 6], [7, 8], wv=3),
    Spec([1, 2, 3, 4, 5, 6, 7, 8, 9], [10], wv=3),
]


@pytest.fixture
def bus(memory_and_nats_bus: Bus) -> Bus:
    """Each test runs on the bus in memory (unit) and on nats-server (integration)."""
    return memory_and_nats_bus


REDELIVERED = "hrl_bus_redelivered_total"
ASSEMBLER_LABELS = {"stream": "ROLLOUTS", "consumer": "assembler"}


def config(bus: Bus, **kw) -> AssemblerConfig:
    base = dict(run=bus.run, straggler_wait_s=3.0, straggler_poll_s=0.05, ack_wait=5.0)
    return AssemblerConfig(**{**base, **kw})


@contextlib.asynccontextmanager
async def running(bus: Bus, **kw):
    task = asyncio.create_task(Assembler(bus, config(bus, **kw)).run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def publish_calls(bus: Bus, calls: list[r.CallRecord]) -> None:
    for c in calls:
        await bus.publish(bus.subjects.calls(c.rollout_id), c)


async def publish_result(bus: Bus, res: r.RolloutResult, msg_id: str | None = None) -> None:
    """Publish ``res`` as the actor handed its member does: under this connection's name, with
    the member's claim (the run's claim key made as the learner makes it)."""
    res.claim = r.member_claim(await bus.claim_key(create=True), res.group_id, res.k)
    await bus.publish(bus.subjects.rollouts_of(), res, msg_id)


async def publish_rollout(
    bus: Bus, rid: str, specs: list[Spec] = CHAIN, hold: int = 0, **kw
) -> tuple[list[r.CallRecord], r.RolloutResult]:
    """Publish a rollout's calls (all but the last ``hold``) and its result."""
    calls = make_calls(specs, rid=rid)
    res = result_for(len(calls), rid=rid, ended_at=time.time(), **kw)
    await publish_calls(bus, calls[: len(calls) - hold])
    await publish_result(bus, res)
    return calls, res


async def drain_samples(bus: Bus, want: int, timeout: float = 15.0) -> list[r.TreeSample]:
    """Consume SAMPLES as the learner would until ``want`` arrived, then check nothing else does."""
    cons = await bus.consumer("SAMPLES", "learner", r.TreeSample)
    got: list[r.TreeSample] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for d in await cons.fetch(64, timeout=0.3):
            got.append(d.record)
            await d.ack()
    for d in await cons.fetch(64, timeout=0.5):  # nothing more may follow
        got.append(d.record)
        await d.ack()
    return got


async def samples_stored(bus: Bus, n: int) -> bool:
    return await bus.stream_count("SAMPLES") >= n


def by_rid(samples: list[r.TreeSample]) -> dict[str, r.TreeSample]:
    out = {s.rollout_id: s for s in samples}
    assert len(out) == len(samples), "a rollout produced more than one sample"
    return out


# ---------------------------------------------------------------------------------------------


async def test_results_become_samples_and_tombstones(bus: Bus) -> None:
    """An ok rollout -> its tree; a failed one and a corrupt one -> tombstones with reasons."""
    calls, ok = await publish_rollout(bus, "ga-0-1")
    await publish_rollout(bus, "ga-1-1", status="timeout")
    bad = make_calls(CHAIN, rid="ga-2-1")
    bad[1].input_hash = bytes(16)
    await publish_calls(bus, bad)
    await publish_result(bus, result_for(3, rid="ga-2-1"))
    before = metrics.sample_value("hrl_assembler_rollouts_total", {"outcome": "sample"})
    async with running(bus):
        got = by_rid(await drain_samples(bus, 3))
    assert r.encode(got["ga-0-1"]) == r.encode(assemble(calls, ok))
    assert got["ga-0-1"].counters.n_leaves == 1 and got["ga-0-1"].weight_version == 2
    assert got["ga-1-1"].dropped_reason == "rollout_timeout"
    assert got["ga-2-1"].dropped_reason == "bad_delta"
    assert metrics.sample_value("hrl_assembler_rollouts_total", {"outcome": "sample"}) >= before + 1


async def test_straggler_calls_are_waited_for(bus: Bus) -> None:
    """A call published after its result is still included; one that never comes -> tombstone."""
    calls, _ = await publish_rollout(bus, "gs-0-1", hold=1)
    await publish_rollout(bus, "gs-1-1", hold=1)
    rereads = lambda: metrics.sample_value("hrl_assembler_straggler_waits_total") or 0  # noqa: E731
    before = rereads()
    async with running(bus, straggler_wait_s=1.5):
        await until(lambda: rereads() > before, 10, "the assembler waiting for missing calls")
        await publish_calls(bus, calls[-1:])
        got = by_rid(await drain_samples(bus, 2))
    assert got["gs-0-1"].counters.n_calls == 3 and not got["gs-0-1"].is_tombstone
    assert got["gs-1-1"].dropped_reason == "missing_calls"


async def test_duplicate_result_yields_one_sample(bus: Bus) -> None:
    _, res = await publish_rollout(bus, "gd-0-1")
    await publish_result(bus, res)  # same msg id: dropped by the bus
    await publish_result(bus, res, "rollout:gd-0-1:again")  # stored twice
    async with running(bus):
        got = await drain_samples(bus, 1)
        await asyncio.sleep(0.5)  # a window for a second sample to appear in
        got += await drain_samples(bus, 0, timeout=0.5)
    assert [s.rollout_id for s in got] == ["gd-0-1"]


async def test_restart_mid_stream_exactly_one_outcome_each(bus: Bus, run_name: str) -> None:
    """Cancel the service while rollouts are in flight, start a new one: every rollout ends as
    exactly one sample or tombstone (redelivery + msg-id de-duplication)."""
    held = {}
    n = 12
    for i in range(n):
        status = "harness_error" if i % 5 == 4 else "ok"
        calls, _ = await publish_rollout(bus, f"gr-{i}-1", hold=i % 2, status=status)
        held[i] = calls[-1:] if i % 2 else []
    cfg = dict(ack_wait=1.0, concurrency=3, straggler_wait_s=4.0)
    redelivered = metrics.sample_value(REDELIVERED, ASSEMBLER_LABELS)
    first = asyncio.create_task(Assembler(bus, config(bus, **cfg)).run())
    await until(lambda: samples_stored(bus, 2), 10, "two samples")
    first.cancel()  # mid-stream: odd rollouts are still waiting for their straggler
    with contextlib.suppress(asyncio.CancelledError):
        await first
    for calls in held.values():
        await publish_calls(bus, calls)
    url = f"memory://{run_name}" if bus.__class__.__name__ == "MemoryBus" else None
    second_bus = await connect(url or bus.nc.servers[0].geturl(), run_name)  # type: ignore[attr-defined]
    try:
        async with running(second_bus, **cfg):
            got = by_rid(await drain_samples(bus, n, timeout=20))
    finally:
        await second_bus.close()
    assert sorted(got) == sorted(f"gr-{i}-1" for i in range(n))
    assert metrics.sample_value(REDELIVERED, ASSEMBLER_LABELS) > redelivered
    for i in range(n):
        s = got[f"gr-{i}-1"]
        if i % 5 == 4:
            assert s.dropped_reason == "rollout_harness_error"
        else:
            assert not s.is_tombstone and s.counters.n_calls == 3


class CrashBeforeAck(Assembler):
    """Dies after storing the sample but before acking (the ack is lost)."""

    async def handle(self, d) -> None:
        async def lost() -> None:
            return None

        d.ack = lost  # type: ignore[method-assign]
        await super().handle(d)


async def test_crash_between_publish_and_ack_no_duplicate(bus: Bus) -> None:
    await publish_rollout(bus, "gk-0-1")
    cfg = config(bus, ack_wait=1.0)
    redelivered = metrics.sample_value(REDELIVERED, ASSEMBLER_LABELS)
    dups = metrics.sample_value("hrl_bus_duplicates_total", {"stream": "SAMPLES"})
    first = asyncio.create_task(CrashBeforeAck(bus, cfg).run())
    await until(lambda: samples_stored(bus, 1), 10, "the sample stored")
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    async with running(bus, ack_wait=1.0):
        await until(
            lambda: metrics.sample_value("hrl_bus_duplicates_total", {"stream": "SAMPLES"}) > dups,
            10,
            "the unacked result republished",
        )
        assert metrics.sample_value(REDELIVERED, ASSEMBLER_LABELS) > redelivered
        got = await drain_samples(bus, 1)
    assert [s.rollout_id for s in got] == ["gk-0-1"]


async def test_poison_results_are_dead_lettered(bus: Bus) -> None:
    """Garbage and an unusable rollout id go to the dead letters; the next result still works."""
    s = bus.subjects
    await bus.publish(s.rollouts_of(), b"\x93garbage", "poison-1")
    await bus.publish(
        s.rollouts_of(),
        result_for(1, rid="gp-0-1").__class__(
            rollout_id="not.a.token", task_id="t", group_id="gp", k=0
        ),
    )
    await publish_rollout(bus, "gp-1-1")
    async with running(bus):
        got = await drain_samples(bus, 1)

        async def two_dead() -> list[r.DeadLetter] | None:
            dead = await bus.read_subject(s.dead("ROLLOUTS"), r.DeadLetter)
            return dead if len(dead) >= 2 else None

        dead = await until(two_dead, 5, "two dead letters")
    assert [x.rollout_id for x in got] == ["gp-1-1"]
    reasons = sorted(d.reason for d in dead)
    assert len(reasons) == 2
    assert reasons[0].startswith("undecodable") and "unprocessable" in reasons[1]


async def test_large_sample_is_split_into_parts(bus: Bus) -> None:
    rng = np.random.default_rng(1)
    ctx = rng.integers(0, 60_000, 4000).tolist()
    specs = []
    for i in range(5):
        out = rng.integers(0, 60_000, 3000).tolist()
        specs.append(Spec(ctx, out, wv=i))
        ctx = ctx + out + rng.integers(0, 60_000, 2000).tolist()
    calls, res = await publish_rollout(bus, "gl-0-1", specs)
    want = assemble(calls, res)
    n = len(split_sample(want, 64 * 1024))
    async with running(bus, max_part_bytes=64 * 1024):
        got = await drain_samples(bus, n)
    assert n > 3 and len(got) == n and all(p.n_parts == n for p in got)
    assert sorted(p.msg_id() for p in got) == sorted(f"sample:gl-0-1:{i}" for i in range(n))
    whole = join_parts(got)
    for w, g in zip(expand(want), expand(whole), strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(w, g, strict=True))


@pytest.mark.unit
async def test_assembly_bug_gives_tombstone_and_dead_letter(monkeypatch) -> None:
    """An exception inside assemble never stalls the group: tombstone + dead letter."""
    b = await connect("memory://bug", "bug")

    def boom(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(assembler_mod, "assemble", boom)
    await publish_rollout(b, "gb-0-1")
    async with running(b):
        got = await drain_samples(b, 1)
    assert [s.dropped_reason for s in got] == ["assembler_error"]
    dead = await b.read_subject(b.subjects.dead("ROLLOUTS"), r.DeadLetter)
    assert len(dead) == 1 and "boom" in dead[0].reason


@pytest.mark.unit
def test_config_documented() -> None:
    assert undocumented_fields(AssemblerConfig) == []


@pytest.mark.integration
async def test_command_runs_and_stops_on_sigterm(nats_url: str, run_name: str) -> None:
    """The real entry point as a subprocess: assembles, then exits 0 on SIGTERM."""
    b = await connect(nats_url, run_name)
    await publish_rollout(b, "gc-0-1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harnessrl.learner.assembler_cmd",
            "--nats",
            nats_url,
            "--run",
            run_name,
            "--metrics-port",
            "-1",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
    )
    try:
        got = await drain_samples(b, 1, timeout=20)
        assert [s.rollout_id for s in got] == ["gc-0-1"] and not got[0].is_tombstone
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        await b.close()
    assert proc.returncode == 0, err.decode()[-2000:]


async def test_infrastructure_statuses_become_tombstones(bus: Bus) -> None:
    """Every infrastructure status (``engine_error`` included) is a ``rollout_<status>``
    tombstone, however complete its calls: an infrastructure failure is never trained."""
    statuses = {f"gi-{i}-1": s for i, s in enumerate(sorted(r.INFRA_STATUSES))}
    assert "engine_error" in statuses.values()
    for rid, status in statuses.items():
        await publish_rollout(bus, rid, status=status, reason=f"{status}_reason")
    async with running(bus):
        got = by_rid(await drain_samples(bus, len(statuses)))
    assert {rid: s.dropped_reason for rid, s in got.items()} == {
        rid: f"rollout_{status}" for rid, status in statuses.items()
    }
    assert all(s.is_tombstone and not s.nodes for s in got.values())


async def test_garbage_calls_are_dead_lettered_and_counted_once(bus: Bus) -> None:
    """Garbage on a rollout's calls subject (not msgpack, another record type, a CallRecord
    whose fields have the wrong types) is dead-lettered with its reason and counted once per
    message, however often the subject is re-read while stragglers are awaited; the valid
    calls still make the sample."""
    import msgspec

    s = bus.subjects
    wrong_type = msgspec.msgpack.encode(
        {"record": "CallRecord", "schema_version": 1, "rollout_id": "x", "seq": "three"}
    )
    junk = [b"\x93not a record", r.encode(result_for(0, rid="gx-9-1")), wrong_type]
    # gw-0-1: every call present -> a sample; gw-1-1: one call never comes -> the subject is
    # re-read every straggler poll until the wait ends (a missing_calls tombstone)
    for rid, extra in (("gw-0-1", 0), ("gw-1-1", 1)):
        calls = make_calls(CHAIN, rid=rid)
        await publish_calls(bus, calls)
        for i, g in enumerate(junk):
            await bus.publish(s.calls(rid), g, f"junk:{rid}:{i}")
        await publish_result(bus, result_for(len(calls) + extra, rid=rid, ended_at=time.time()))
    labels = {"stream": "CALLS", "consumer": "assembler"}
    before = metrics.sample_value("hrl_bus_dead_lettered_total", labels)
    waits = metrics.sample_value("hrl_assembler_straggler_waits_total")
    async with running(bus, straggler_wait_s=1.0, straggler_poll_s=0.05):
        got = by_rid(await drain_samples(bus, 2))
    assert not got["gw-0-1"].is_tombstone and got["gw-0-1"].counters.n_calls == len(CHAIN)
    assert got["gw-1-1"].dropped_reason == "missing_calls"
    assert metrics.sample_value("hrl_assembler_straggler_waits_total") - waits >= 5  # re-read
    dead = await bus.read_subject(s.dead("CALLS"), r.DeadLetter)
    assert len(dead) == 6 and {d.consumer for d in dead} == {"assembler"}
    assert {d.subject for d in dead} == {s.calls("gw-0-1"), s.calls("gw-1-1")}
    assert sorted(d.data for d in dead) == sorted(junk * 2)
    assert all(d.reason.startswith("undecodable") for d in dead)
    assert any("expected a CallRecord" in d.reason for d in dead)
    assert any("invalid CallRecord" in d.reason for d in dead)
    assert metrics.sample_value("hrl_bus_dead_lettered_total", labels) == before + 6
