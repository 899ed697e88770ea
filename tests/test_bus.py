"""The bus against a real nats-server (and the in-memory twin for the same contract)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import numpy as np
import pytest

from harnessrl.common import bus as busmod
from harnessrl.common import metrics
from harnessrl.common import records as r
from harnessrl.common.bus import Bus, connect
from harnessrl.common.nats_acks import publish_scattered
from tests.helpers.records import sample_records


@pytest.fixture
def bus(memory_and_nats_bus: Bus) -> Bus:
    """Each test runs on the bus in memory (unit) and on nats-server (integration)."""
    return memory_and_nats_bus


def subject_for(b: Bus, rec: r.Record) -> str:
    s = b.subjects
    return {
        "TaskRequest": s.tasks,
        "CallRecord": s.calls("g-1-2-1"),
        "RolloutResult": s.rollouts,
        "TreeSample": s.samples,
        "WeightsReady": s.weights_ready,
        "WeightChunk": s.weights_data(5),
        "DeadLetter": s.dead("tasks"),
    }[rec.record]


async def test_roundtrip_every_record_type(bus: Bus) -> None:
    """Each record type published on its subject comes back equal through a durable consumer."""
    consumers: dict[tuple[str, str], object] = {}
    for i, rec in enumerate(sample_records()):
        subject = subject_for(bus, rec)
        await bus.publish(subject, rec, f"id-{i}")
        key = (subject, rec.record)
        if key not in consumers:
            kind = bus.subjects.kind_of(subject)
            consumers[key] = await bus.consumer(kind, f"c{i}", type(rec), filter_subject=subject)
        cons = consumers[key]
        got = await cons.fetch(1, timeout=2.0)
        assert [d.record for d in got] == [rec]
        await got[0].ack()


async def test_duplicate_msg_id_stored_once(bus: Bus) -> None:
    task = sample_records()[0]
    first = await bus.publish(bus.subjects.tasks, task)
    second = await bus.publish(bus.subjects.tasks, task)
    assert not first.duplicate and second.duplicate and second.seq == first.seq
    assert await bus.stream_count("TASKS") == 1


@pytest.mark.integration
async def test_unacked_message_redelivered_to_another_consumer(
    nats_url: str, run_name: str
) -> None:
    """A consumer that dies without acking: the message goes to the next one after ack_wait."""
    b1 = await connect(nats_url, run_name)
    await b1.publish(b1.subjects.tasks, sample_records()[0])
    c1 = await b1.consumer("TASKS", "actors", r.TaskRequest, ack_wait=1.0)
    (d1,) = await c1.fetch(1, timeout=2.0)
    assert d1.num_delivered == 1
    await b1.nc.close()  # dies: no ack, no nak
    b2 = await connect(nats_url, run_name)
    c2 = await b2.consumer("TASKS", "actors", r.TaskRequest, ack_wait=1.0)
    got = await c2.fetch(1, timeout=5.0)
    assert len(got) == 1 and got[0].record == d1.record and got[0].num_delivered == 2
    await got[0].ack()
    assert await c2.fetch(1, timeout=1.5) == []  # acked: never again
    await b2.close()


async def test_in_progress_keeps_a_long_message(bus: Bus) -> None:
    await bus.publish(bus.subjects.tasks, sample_records()[0])
    cons = await bus.consumer("TASKS", "actors", r.TaskRequest, ack_wait=1.0)
    (d,) = await cons.fetch(1, timeout=2.0)
    async with d.keepalive(interval=0.3):
        await asyncio.sleep(2.5)  # 2.5 x ack_wait
    assert await cons.fetch(1, timeout=0.5) == []  # never redelivered meanwhile
    await d.ack()


async def test_nak_with_delay_redelivers(bus: Bus) -> None:
    await bus.publish(bus.subjects.tasks, sample_records()[0])
    cons = await bus.consumer("TASKS", "actors", r.TaskRequest, ack_wait=30)
    (d,) = await cons.fetch(1, timeout=2.0)
    await d.nak(delay=0.5)
    assert await cons.fetch(1, timeout=0.2) == []
    (again,) = await cons.fetch(1, timeout=3.0)
    assert again.num_delivered == 2
    await again.ack()


async def test_poison_is_dead_lettered_and_next_good_arrives(bus: Bus) -> None:
    s = bus.subjects
    await bus.publish(s.tasks, b"\x93\x01\x02garbage", "poison-1")
    good = sample_records()[0]
    await bus.publish(s.tasks, good)
    labels = {"stream": "TASKS", "consumer": "actors"}
    before = metrics.sample_value("hrl_bus_dead_lettered_total", labels)
    cons = await bus.consumer("TASKS", "actors", r.TaskRequest)
    got = []
    for _ in range(5):
        got += await cons.fetch(2, timeout=1.0)
        if got:
            break
    assert [d.record for d in got] == [good]
    await got[0].ack()
    assert metrics.sample_value("hrl_bus_dead_lettered_total", labels) == before + 1
    dead = await bus.read_subject(s.dead("TASKS"), r.DeadLetter)
    assert len(dead) == 1 and "undecodable" in dead[0].reason
    assert dead[0].data == b"\x93\x01\x02garbage"
    assert await bus.stream_count("TASKS") == 0  # poison terminated, not left to block


async def test_dead_letter_by_consumer_choice(bus: Bus) -> None:
    await bus.publish(bus.subjects.tasks, sample_records()[0])
    cons = await bus.consumer("TASKS", "actors", r.TaskRequest)
    (d,) = await cons.fetch(1, timeout=2.0)
    await d.dead_letter("task folder missing")
    dead = await bus.read_subject(bus.subjects.dead("TASKS"), r.DeadLetter)
    assert [x.reason for x in dead] == ["task folder missing"]
    assert await cons.fetch(1, timeout=0.5) == []


async def test_read_subject_is_ordered_and_filtered(bus: Bus) -> None:
    s = bus.subjects
    recs = []
    for seq in range(40):
        rid = "a-0-1" if seq % 2 == 0 else "b-0-1"
        rec = r.CallRecord(rollout_id=rid, seq=seq, suffix_ids=r.pack_ids(range(seq)))
        recs.append(rec)
        await bus.publish(s.calls(rid), rec)
    got = await bus.read_subject(s.calls("a-0-1"), r.CallRecord)
    assert got == [x for x in recs if x.rollout_id == "a-0-1"]
    assert await bus.read_subject(s.calls("zzz-0-1"), r.CallRecord) == []


async def test_publish_many_pipelined(bus: Bus) -> None:
    s = bus.subjects
    items = [(s.calls("p-0-1"), r.CallRecord(rollout_id="p-0-1", seq=i), None) for i in range(50)]
    res = await bus.publish_many(items + items[:5])
    assert sum(x.duplicate for x in res) == 5
    assert await bus.stream_count("CALLS", s.calls("p-0-1")) == 50


@pytest.mark.integration
async def test_oversized_record_is_an_error_not_a_drop(nats_url: str, run_name: str) -> None:
    b = await connect(nats_url, run_name)
    big = r.WeightChunk(version=1, index=0, n_chunks=1, data=b"\x01" * (9 * 1024 * 1024))
    with pytest.raises(busmod.PayloadTooLarge):
        await b.publish(b.subjects.weights_data(1), r.encode(big, compress=False), "w")
    await b.close()


@pytest.mark.integration
async def test_streams_created_idempotently(nats_url: str, run_name: str) -> None:
    b1 = await connect(nats_url, run_name)
    b2 = await connect(nats_url, run_name)  # second creator: no error, same streams
    await b2.publish(b2.subjects.rollouts_of(), sample_records()[2])
    assert await b1.stream_count("ROLLOUTS") == 1
    await b1.close()
    await b2.close()


@pytest.mark.integration
async def test_server_killed_and_restarted_loses_no_acked_record(nats_server_fn) -> None:
    """SIGKILL nats-server mid-stream, restart it on the same port and store: every record whose
    publish returned is still there, and the publisher carried on through the outage."""
    srv = nats_server_fn
    b = await connect(srv.url, "crash", publish_timeout=30.0)
    acked: list[int] = []

    async def producer() -> None:
        for i in range(300):
            await b.publish(
                b.subjects.calls(f"r{i % 7}-0-1"), r.CallRecord(rollout_id=f"r{i % 7}-0-1", seq=i)
            )
            acked.append(i)

    task = asyncio.create_task(producer())
    while len(acked) < 100:
        await asyncio.sleep(0.005)
    srv.kill()
    await asyncio.sleep(0.5)
    srv.start()
    await asyncio.wait_for(task, 60)
    assert len(acked) == 300
    assert await b.stream_count("CALLS") == 300  # no loss, and retries made no duplicates
    seen = set()
    for k in range(7):
        seen |= {c.seq for c in await b.read_subject(b.subjects.calls(f"r{k}-0-1"), r.CallRecord)}
    assert seen == set(range(300))
    await b.close()


@pytest.mark.integration
async def test_acked_consumption_survives_restart(nats_server_fn) -> None:
    """Acks that returned are durable: after a crash, only unacked messages come back."""
    srv = nats_server_fn
    b = await connect(srv.url, "crash2")
    for k in range(10):
        await b.publish(
            b.subjects.tasks,
            r.TaskRequest(group_id="g", k=k, group_size=10, issued_version=0, task_id="t"),
        )
    cons = await b.consumer("TASKS", "actors", r.TaskRequest, ack_wait=1.0)
    got = await cons.fetch(6, timeout=2.0)
    for d in got[:4]:
        await d.ack()
    srv.kill()
    srv.start()
    await asyncio.sleep(0.5)
    left = []
    for _ in range(20):
        left += await cons.fetch(10, timeout=1.0)
        if len(left) >= 6:
            break
    assert sorted(d.record.k for d in left) == [4, 5, 6, 7, 8, 9]
    await b.close()


async def test_stored_reads_a_work_queue_without_consuming_it(bus: Bus) -> None:
    """``stored`` lists what a subject holds now (a work queue: what is not consumed yet), in
    order, from a time or up to a sequence, and takes nothing from anyone."""
    s = bus.subjects
    tasks = [
        r.TaskRequest(group_id="g", k=k, group_size=3, issued_version=0, task_id="t")
        for k in range(3)
    ]
    seqs = [(await bus.publish(s.tasks, t)).seq for t in tasks]
    cons = await bus.consumer("TASKS", "actors", r.TaskRequest, ack_wait=30)
    (first,) = await cons.fetch(1, timeout=2.0)
    await first.ack()
    held = await bus.stored(s.tasks)
    assert [(q, r.decode(b, r.TaskRequest).k) for q, b in held] == [(seqs[1], 1), (seqs[2], 2)]
    assert [q for q, _ in await bus.stored(s.tasks, upto=seqs[1])] == [seqs[1]]
    assert [d.record.k for d in await cons.fetch(5, timeout=2.0)] == [1, 2]  # still theirs
    old = sample_records()[2]
    await bus.publish(s.rollouts, old, "old")
    await asyncio.sleep(0.3)
    since = time.time()
    await bus.publish(s.rollouts, old, "new")
    assert len(await bus.stored(s.rollouts)) == 2
    assert len(await bus.stored(s.rollouts, since=since)) == 1


@pytest.mark.integration
async def test_interrupted_bus_never_waits_for_a_dead_server(nats_server_fn) -> None:
    """After ``interrupt`` (a process stopping), a publish to a server that is down fails at
    once with ``BusUnavailable`` (also one already retrying), instead of retrying for
    ``publish_timeout``; while the server is up, and once it is back, nothing changes."""
    srv = nats_server_fn
    b = await connect(srv.url, "stop", publish_timeout=600.0)
    task = r.TaskRequest(group_id="g", k=0, group_size=1, issued_version=0, task_id="t")
    s = b.subjects
    srv.kill()
    retrying = asyncio.create_task(b.publish(s.tasks, task))
    await asyncio.sleep(1.0)
    assert not retrying.done()
    b.interrupt()
    with pytest.raises(busmod.BusUnavailable):
        await asyncio.wait_for(retrying, 10)
    with pytest.raises(busmod.BusUnavailable):
        await asyncio.wait_for(b.publish(s.rollouts, sample_records()[2]), 10)
    assert b.abandoning
    srv.start()
    for _ in range(100):  # reconnected: operations wait for the server as usual again
        if not b.abandoning:
            break
        await asyncio.sleep(0.1)
    assert (await b.publish(s.tasks, task)).seq == 1
    srv.kill()
    await asyncio.wait_for(b.close(), 10)  # nothing to flush to a dead server, no error


async def test_read_subject_batches_in_order(bus: Bus) -> None:
    """``read_subject_batches`` yields a subject's records in stream order, at most ``batch``
    at a time, and ``read_subject`` is their concatenation."""
    s = bus.subjects
    recs = [r.CallRecord(rollout_id="b-0-1", seq=i) for i in range(7)]
    await bus.publish_many([(s.calls("b-0-1"), x, None) for x in recs])
    await bus.publish(s.calls("other-0-1"), r.CallRecord(rollout_id="other-0-1", seq=0))
    batches = [b async for b in bus.read_subject_batches(s.calls("b-0-1"), r.CallRecord, batch=3)]
    assert [len(b) for b in batches] == [3, 3, 1]
    assert (
        [x for b in batches for x in b]
        == recs
        == await bus.read_subject(s.calls("b-0-1"), r.CallRecord)
    )


@pytest.mark.integration
async def test_publish_many_surfaces_a_refused_ack(nats_url: str, run_name: str) -> None:
    """A record JetStream refuses inside a pipelined batch (here: over the stream's maximum
    message size) raises ``BusError`` instead of being reported done; the rest is stored."""
    b = await connect(nats_url, run_name)
    cfg = (await b.js.stream_info(b.subjects.stream("CALLS"))).config  # type: ignore[attr-defined]
    cfg.max_msg_size = 4096
    await b.js.update_stream(cfg)  # type: ignore[attr-defined]
    s = b.subjects
    ok = [(s.calls("p-0-1"), r.CallRecord(rollout_id="p-0-1", seq=i), None) for i in range(20)]
    big = r.CallRecord(rollout_id="p-0-1", seq=99, suffix_ids=np.random.bytes(64 * 1024))
    with pytest.raises(busmod.BusError, match="refused"):
        await b.publish_many([*ok[:10], (s.calls("p-0-1"), big, None), *ok[10:]])
    assert await b.stream_count("CALLS") == 20
    await b.close()


@pytest.mark.integration
async def test_publish_many_through_a_server_restart_loses_nothing(nats_server_fn) -> None:
    """SIGKILL nats-server while a pipelined batch is in flight (its acks are lost) and
    restart it: the batch returns once every record is acked, each stored exactly once."""
    srv = nats_server_fn
    b = await connect(srv.url, "crashmany", publish_timeout=60.0)
    b.ack_timeout = 1.0  # type: ignore[attr-defined]
    s = b.subjects
    items = [
        (s.calls(f"m{i % 5}-0-1"), r.CallRecord(rollout_id=f"m{i % 5}-0-1", seq=i), None)
        for i in range(3000)
    ]
    send, killed, sends = b.acks.send, asyncio.Event(), [0]  # type: ignore[attr-defined]

    async def kill_midway(*a: Any, **kw: Any) -> Any:
        sends[0] += 1
        if sends[0] == 1000:  # a third of the batch sent, acks in flight
            srv.kill()
            killed.set()
        return await send(*a, **kw)

    b.acks.send = kill_midway  # type: ignore[attr-defined]
    task = asyncio.create_task(b.publish_many(items))
    await asyncio.wait_for(killed.wait(), 30)
    assert not task.done()
    await asyncio.sleep(0.5)
    srv.start()
    res = await asyncio.wait_for(task, 90)
    assert len(res) == 3000 and all(x.seq > 0 for x in res)
    assert await b.stream_count("CALLS") == 3000  # nothing lost, nothing twice
    await b.close()


@pytest.mark.integration
async def test_publish_many_bounds_unacked_bytes(nats_url: str, run_name: str) -> None:
    """With ``max_in_flight_bytes`` below one record, every record waits for the previous ack
    before it is sent; all are stored once, in order."""
    b = await connect(nats_url, run_name)
    b.max_in_flight_bytes = 1  # type: ignore[attr-defined]
    s = b.subjects
    recs = [r.CallRecord(rollout_id="w-0-1", seq=i) for i in range(30)]
    res = await b.publish_many([(s.calls("w-0-1"), x, None) for x in recs])
    assert [x.seq for x in res] == list(range(1, 31)) and not any(x.duplicate for x in res)
    assert await b.read_subject(s.calls("w-0-1"), r.CallRecord) == recs
    await b.close()


@pytest.mark.integration
async def test_weight_chunks_go_out_unjoined_and_arrive_as_encoded(
    nats_url: str, run_name: str
) -> None:
    """A weight chunk is published as two buffers (its msgpack head, then its bytes, never
    joined): a plain subscriber receives exactly ``encode``'s bytes with the msg id header,
    also while small records are published concurrently on the same connection (nothing
    interleaves inside a message), and the stream keeps each once."""
    b = await connect(nats_url, run_name)
    s = b.subjects
    nc = await nats.connect(nats_url)
    got: list = []

    async def on_msg(m) -> None:
        got.append(m)

    await nc.subscribe(s.weights_data(7), cb=on_msg)
    await nc.flush()
    sizes = (0, 300, 70_000, 1_000_000, 65_536)
    chunks = [
        r.WeightChunk(version=7, index=i, n_chunks=len(sizes), data=np.random.bytes(n))
        for i, n in enumerate(sizes)
    ]
    small = [(s.calls("c-0-1"), r.CallRecord(rollout_id="c-0-1", seq=i), None) for i in range(300)]
    res, _ = await asyncio.gather(
        b.publish_many([(s.weights_data(7), c, f"w:7:{c.index}") for c in chunks]),
        b.publish_many(small),
    )
    assert not any(x.duplicate for x in res)
    for _ in range(100):
        if len(got) == len(chunks):
            break
        await asyncio.sleep(0.05)
    assert [m.data for m in got] == [r.encode(c) for c in chunks]
    assert [m.headers["Nats-Msg-Id"] for m in got] == [f"w:7:{i}" for i in range(len(sizes))]
    assert await b.read_subject(s.weights_data(7), r.WeightChunk) == chunks
    assert await b.stream_count("CALLS", s.calls("c-0-1")) == 300
    res = await b.publish_many([(s.weights_data(7), chunks[1], "w:7:1")])
    assert res[0].duplicate  # the same msg id again: de-duplicated, as for joined bytes
    await nc.close()
    await b.close()


@pytest.mark.unit
async def test_scattered_publish_without_the_clients_write_path_sends_joined_bytes() -> None:
    """A client without nats-py's private pending list (another version) gets the joined
    bytes through its public ``publish``."""
    sent = []

    class Client:
        async def publish(self, subject, payload, reply="", headers=None):
            sent.append((subject, payload, reply, headers))

    chunk = r.WeightChunk(version=1, index=0, n_chunks=1, data=b"abc" * 1000)
    parts = r.encode_many([chunk])[0]
    await publish_scattered(Client(), "s", parts, "inbox.1", {"Nats-Msg-Id": "x"})
    assert sent == [("s", r.encode(chunk), "inbox.1", {"Nats-Msg-Id": "x"})]


@pytest.mark.integration
async def test_fetch_never_returns_more_than_its_batch(nats_url: str, run_name: str) -> None:
    """Replies to an earlier pull request that arrive after its fetch gave up (a busy machine)
    wait in the client's queue; nats-py's next fetch drains them all, whatever its batch. The
    bus returns at most ``batch`` (an actor never runs more rollouts than its slots) and hands
    the rest out first at the next fetches, each delivered once (no attempt is spent)."""
    import json

    b = await connect(nats_url, run_name)
    try:
        tasks = [
            r.TaskRequest(group_id="g", k=k, group_size=5, issued_version=0, task_id="t")
            for k in range(5)
        ]
        await b.publish_many([(b.subjects.tasks, t, None) for t in tasks])
        consumer = await b.consumer("TASKS", "actors", r.TaskRequest, ack_wait=30.0)
        psub = consumer.psub  # type: ignore[attr-defined]
        late = json.dumps({"batch": 5, "no_wait": True}).encode()
        await b.nc.publish(psub._nms, late, psub._deliver)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while psub._sub._pending_queue.qsize() < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        sizes, got = [], []
        for batch in (2, 2, 10):
            part = await consumer.fetch(batch, timeout=1.0)
            sizes.append(len(part))
            got += part
        assert sizes == [2, 2, 1]
        assert sorted(d.record.k for d in got) == [0, 1, 2, 3, 4]
        assert {d.num_delivered for d in got} == {1}
    finally:
        await b.close()


@pytest.mark.integration
async def test_late_deliveries_are_kept_alive_while_no_fetch_comes(
    nats_url: str, run_name: str
) -> None:
    """Replies to a pull request that arrive after its fetch gave up wait in the client's
    queue. An actor whose slots are all busy does not fetch again for minutes; JetStream then
    redelivers those tasks to another actor after ``ack_wait`` while the first still holds its
    copies, and both run them (the fleet benchmark saw 813 of 1,636 rollouts run twice at 1,040
    in flight). The consumer keeps such late deliveries alive (``in_progress``) between fetches:
    nobody else gets them, and the next fetch hands each out once."""
    import json

    a, b = await connect(nats_url, run_name), await connect(nats_url, run_name)
    try:
        tasks = [
            r.TaskRequest(group_id="g", k=k, group_size=3, issued_version=0, task_id="t")
            for k in range(3)
        ]
        await a.publish_many([(a.subjects.tasks, t, None) for t in tasks])
        busy = await a.consumer("TASKS", "actors", r.TaskRequest, ack_wait=1.0)
        other = await b.consumer("TASKS", "actors", r.TaskRequest, ack_wait=1.0)
        psub = busy.psub  # type: ignore[attr-defined]
        late = json.dumps({"batch": 3, "no_wait": True}).encode()
        await a.nc.publish(psub._nms, late, psub._deliver)  # type: ignore[attr-defined]
        await asyncio.sleep(3.5)  # ack_wait passes three times over without a fetch from `busy`
        stolen = await other.fetch(3, timeout=1.0)
        got = await busy.fetch(3, timeout=1.0)
        assert [d.record.k for d in stolen] == []
        assert sorted(d.record.k for d in got) == [0, 1, 2]
        assert {d.num_delivered for d in got} == {1}
    finally:
        await a.close()
        await b.close()


@pytest.mark.unit
async def test_denials_wait_races_acks_against_a_violation_and_an_outage() -> None:
    """``Denials.wait`` (how ``publish_many`` awaits its acks without a task per call): returns
    once every future is done or the timeout passed; a violation on a matching subject raises
    ``PermissionDenied`` at once, one on another subject does not; an abandoned outage raises
    ``BusUnavailable``; no callback is left on a future that is still pending."""
    from harnessrl.common.nats_guards import Denials, Outage

    loop = asyncio.get_running_loop()
    d = Denials("actor")
    d.outage = Outage()
    futs = {loop.create_future() for _ in range(3)}
    for i, f in enumerate(futs):
        loop.call_later(0.05 * (i + 1), f.set_result, i)
    t0 = time.monotonic()
    await d.wait("hrl.x.tasks".__eq__, futs, 5.0)
    assert all(f.done() for f in futs) and time.monotonic() - t0 < 1.0
    pending = loop.create_future()
    t0 = time.monotonic()
    await d.wait("hrl.x.tasks".__eq__, {pending}, 0.2)  # timed out: returns, nothing raised
    assert not pending.done() and 0.15 < time.monotonic() - t0 < 2.0
    loop.call_later(0.05, d.report, 'Permissions Violation for Publish to "hrl.x.other"')
    loop.call_later(0.1, d.report, 'Permissions Violation for Publish to "HRL.X.TASKS"')
    t0 = time.monotonic()
    with pytest.raises(busmod.PermissionDenied, match="'actor'.*hrl.x.tasks"):
        await d.wait("hrl.x.tasks".__eq__, {pending}, 30.0)
    assert time.monotonic() - t0 < 5.0 and not d.waiters
    loop.call_later(0.05, d.outage.interrupt, False)
    with pytest.raises(busmod.BusUnavailable):
        await d.wait("hrl.x.y".__eq__, {pending}, 30.0)
    assert not pending._callbacks  # every wait took its callback off the pending future


@pytest.mark.integration
async def test_small_publish_many_is_encoded_on_the_loop(nats_url: str, run_name: str) -> None:
    """A ``publish_many`` of a few records (a proxy's call record) is encoded on the loop, not
    in a worker thread (the hop cost more CPU than the encoding); a batch of more, and any
    weight chunk, still go through the thread. Either way every record is stored."""
    b = await connect(nats_url, run_name)
    loop = asyncio.get_running_loop()
    hops: list[int] = []
    real = loop.run_in_executor

    def counting(executor, fn, *args):
        hops.append(len(args[0]))
        return real(executor, fn, *args)

    try:
        loop.run_in_executor = counting  # type: ignore[method-assign]
        s = b.subjects
        few = [(s.calls("e-0-1"), r.CallRecord(rollout_id="e-0-1", seq=i), None) for i in range(3)]
        assert [x.seq for x in await b.publish_many(few)] == [1, 2, 3]
        assert hops == []
        many = [(s.calls("e-0-2"), r.CallRecord(rollout_id="e-0-2", seq=i), None) for i in range(9)]
        await b.publish_many(many)
        assert hops == [8, 1]
        chunk = r.WeightChunk(version=3, index=0, n_chunks=1, data=b"w" * 100)
        await b.publish_many([(s.weights_data(3), chunk, "w:3:0")])
        assert hops == [8, 1, 1]
        assert len(await b.read_subject(s.calls("e-0-1"), r.CallRecord)) == 3
        assert len(await b.read_subject(s.calls("e-0-2"), r.CallRecord)) == 9
    finally:
        del loop.run_in_executor
        await b.close()
