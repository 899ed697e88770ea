"""Call recorder: deltas, ordering, flush semantics, and no unrecorded call when the bus is down."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.common.bus import Bus, MemoryBus, PayloadTooLarge, connect
from harnessrl.common.records import (
    CallRecord,
    RolloutResult,
    SamplingParams,
    ids_hash,
    unpack_f32,
    unpack_ids,
)
from harnessrl.common.tree import assemble_detailed
from harnessrl.proxy.recorder import Recorder, RecorderFull, RecordLost, longest_prefix
from harnessrl.proxy.sglang import GenerateResult
from tests.helpers.wait import until


def result(out: list[int], version: int = 3) -> GenerateResult:
    return GenerateResult(
        output_ids=out,
        logprobs=[-0.25] * len(out),
        finish_reason="stop",
        weight_version_start=version,
        weight_version_end=version,
        cached_tokens=2,
        engine="http://e:1",
    )


def rebuild(records: list[CallRecord]) -> dict[int, list[int]]:
    """What the assembler does: rebuild every full input from the deltas, verifying each."""
    full: dict[int, list[int]] = {}
    for r in records:
        base: list[int] = []
        if r.parent_seq >= 0:
            parent = next(p for p in records if p.seq == r.parent_seq)
            base = (full[parent.seq] + unpack_ids(parent.output_ids).tolist())[: r.prefix_len]
        ids = base + unpack_ids(r.suffix_ids).tolist()
        assert len(ids) == r.input_len and ids_hash(ids) == r.input_hash
        full[r.seq] = ids
    return full


@pytest.fixture
async def bus(run_name: str):
    b = await connect(f"memory://{run_name}", run_name)
    yield b
    await b.close()


@pytest.mark.unit
def test_longest_prefix_prefers_longest_then_earliest() -> None:
    """The parent is the earlier input+output sharing the most tokens; ties go to the earliest."""
    earlier = {0: np.array([1, 2, 3]), 1: np.array([1, 2, 3, 4, 5]), 2: np.array([1, 2, 3, 4, 9])}
    assert longest_prefix(np.array([1, 2, 3, 4, 5, 6]), earlier) == (1, 5)
    assert longest_prefix(np.array([1, 2, 3, 4, 7]), earlier) == (1, 4)
    assert longest_prefix(np.array([1, 2, 3, 4, 7]), earlier, hint=2) == (1, 4)
    assert longest_prefix(np.array([1, 2]), earlier) == (0, 2)
    assert longest_prefix(np.array([8]), earlier) == (-1, 0)
    assert longest_prefix(np.array([], dtype=np.int32), earlier) == (-1, 0)
    assert longest_prefix(np.array([1, 2, 3, 4, 5, 6]), earlier, below=1) == (0, 3)
    assert longest_prefix(np.array([1, 2, 3, 4, 5, 6]), earlier, hint=1, below=1) == (0, 3)
    assert longest_prefix(np.array([1, 2]), earlier, below=0) == (-1, 0)


@pytest.mark.unit
async def test_records_are_deltas_that_rebuild_exactly(bus: Bus) -> None:
    """Each input is stored as a delta against the best earlier call and rebuilds bit-exactly."""
    rid = "g-0-1"
    async with Recorder(bus) as rec:
        t0 = rec.begin(rid)
        rec.record(t0, [1, 2, 3], result([10, 11, 2]), sampling=SamplingParams(temperature=0.7))
        t1 = rec.begin(rid)
        r1 = rec.record(t1, [1, 2, 3, 10, 11, 2, 5, 6], result([12, 2]), tito_hit=True)
        t2 = rec.begin(rid)  # a fork from call 0's input
        r2 = rec.record(t2, [1, 2, 3, 7], result([13, 2]), requested={"temperature": 0})
        t3 = rec.begin(rid)  # an unrelated (compaction restart)
        r3 = rec.record(t3, [9, 9], result([1]))
        assert await rec.flush(rid) == 4
    assert (r1.parent_seq, r1.prefix_len, unpack_ids(r1.suffix_ids).tolist()) == (0, 6, [5, 6])
    assert (r2.parent_seq, r2.prefix_len) == (0, 3)
    assert (r3.parent_seq, r3.prefix_len, r3.input_len) == (-1, 0, 2)
    stored = await bus.read_subject(bus.subjects.calls(rid), CallRecord)
    assert [r.seq for r in stored] == [0, 1, 2, 3]
    full = rebuild(stored)
    assert full[1] == [1, 2, 3, 10, 11, 2, 5, 6] and full[2] == [1, 2, 3, 7]
    first = stored[0]
    assert unpack_f32(first.output_logprobs).tolist() == [-0.25] * 3
    assert (first.weight_version_start, first.cached_tokens, first.engine) == (3, 2, "http://e:1")
    assert first.sampling.temperature == pytest.approx(0.7)
    assert stored[2].requested == {"temperature": 0} and stored[1].tito_hit


@pytest.mark.unit
async def test_msg_id_deduplicates(bus: Bus) -> None:
    """Records carry ``call:<rollout>:<seq>:<salt>`` (the salt random per recorder: no other
    publisher can take the id first): a republish (retry) is stored once."""
    async with Recorder(bus) as rec:
        r = rec.record(rec.begin("g-1-1"), [1], result([2]))
        await rec.flush("g-1-1")
        await bus.publish(bus.subjects.calls("g-1-1"), r, f"{r.msg_id()}:{rec.salt}")
        await bus.publish(bus.subjects.calls("g-1-1"), r, r.msg_id())  # another's guess
    assert r.msg_id() == "call:g-1-1:0" and len(rec.salt) == 12
    assert Recorder(bus).salt != rec.salt
    assert await bus.stream_count("CALLS", bus.subjects.calls("g-1-1")) == 2


@pytest.mark.unit
async def test_seq_is_arrival_order_and_errors_are_recorded(bus: Bus) -> None:
    """Seqs follow arrival, not completion; a failed call still gets its record (dense seqs)."""
    async with Recorder(bus) as rec:
        a, b = rec.begin("g-2-1"), rec.begin("g-2-1")
        rec.record(b, [1, 2], result([3]))
        rec.record(a, [1], None, status="error", error="engine unavailable")
        await rec.flush("g-2-1")
    stored = await bus.read_subject(bus.subjects.calls("g-2-1"), CallRecord)
    assert [(r.seq, r.status) for r in stored] == [(1, "ok"), (0, "error")]
    assert stored[1].error == "engine unavailable" and stored[1].output_ids == b""
    assert stored[1].parent_seq == -1  # call 1 finished first but arrived later: never a parent
    rebuild(sorted(stored, key=lambda r: r.seq))


def rollout_result(rid: str, n_calls: int) -> RolloutResult:
    group, k, attempt = rid.rsplit("-", 2)
    return RolloutResult(
        rollout_id=rid, task_id="t", group_id=group, k=int(k), attempt=int(attempt),
        n_calls=n_calls, reward=1.0,
    )  # fmt: skip


@pytest.mark.unit
async def test_overlapping_calls_assemble_into_a_sample(bus: Bus) -> None:
    """opencode: its background title request (seq 0) finishes after the main call (seq 1)
    that shares its system prompt. The title's delta parent is never the later call, so the
    rollout assembles into a sample (not a ``bad_delta`` tombstone) that keeps the main call."""
    rid = "g-2-2"
    system = [7, 7, 7, 7]
    async with Recorder(bus) as rec:
        title, main = rec.begin(rid), rec.begin(rid)
        r_main = rec.record(main, system + [1, 2], result([3, 4, 2]))
        r_title = rec.record(title, system + [9], result([5, 2]), label="aux")
        nxt = rec.begin(rid)  # the harness continues the main conversation
        r_next = rec.record(nxt, system + [1, 2, 3, 4, 2, 6], result([8, 2]))
        await rec.flush(rid)
    assert (r_title.parent_seq, r_main.parent_seq) == (-1, -1)
    assert (r_next.parent_seq, r_next.prefix_len) == (1, 9)
    stored = await bus.read_subject(bus.subjects.calls(rid), CallRecord)
    done = assemble_detailed(stored, rollout_result(rid, 3))
    assert not done.sample.is_tombstone, done.sample.dropped_reason
    assert done.retained == (1, 2) and done.sample.counters.n_leaves == 1


@st.composite
def overlapping_calls(draw) -> tuple[list[list[int]], list[int], list[int]]:
    """N inputs of one rollout, each extending an earlier one's input+output, a fork of it, or
    a fresh start; their outputs; and the order the calls finish in (arrival order is seq)."""
    n = draw(st.integers(1, 7))
    token = st.integers(3, 40)
    inputs: list[list[int]] = []
    outputs: list[list[int]] = []
    for i in range(n):
        how = draw(st.sampled_from(["fresh", "extend", "fork"])) if i else "fresh"
        if how == "fresh":
            ids = draw(st.lists(token, min_size=1, max_size=6))
        else:
            j = draw(st.integers(0, i - 1))
            base = inputs[j] + (outputs[j] if how == "extend" else [])
            cut = draw(st.integers(1, len(base)))
            ids = base[:cut] + draw(st.lists(token, max_size=4))
        inputs.append(ids)
        outputs.append(draw(st.lists(token, min_size=1, max_size=4)) + [2])
    order = draw(st.permutations(range(n)))
    return inputs, outputs, list(order)


@pytest.mark.unit
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overlapping_calls())
def test_any_completion_order_assembles_exactly(calls) -> None:
    """N calls of one rollout (some sharing prefixes) admitted in seq order and finishing in any
    order: every delta names an earlier call, every full input rebuilds to exactly what was
    sent, and the rollout assembles into a sample (never ``bad_delta``)."""
    inputs, outputs, order = calls
    rid = "g-3-2"
    rec = Recorder(MemoryBus("prop"))  # record() only queues: no publisher needed
    tickets = [rec.begin(rid) for _ in inputs]
    records = [rec.record(tickets[i], inputs[i], result(outputs[i]), label="main") for i in order]
    for r in records:
        assert r.parent_seq < r.seq
    records.sort(key=lambda r: r.seq)
    full = rebuild(records)
    assert [full[i] for i in range(len(inputs))] == inputs
    done = assemble_detailed(records, rollout_result(rid, len(inputs)))
    assert not done.sample.is_tombstone, done.sample.dropped_reason
    assert done.sample.counters.n_calls == len(inputs)


@pytest.mark.unit
async def test_registered_harness_is_on_every_record(bus: Bus) -> None:
    """``register`` sets the harness identity of a rollout's records until ``forget``."""
    async with Recorder(bus) as rec:
        rec.register("g-9-1", "opencode", "0.15.2")
        a = rec.record(rec.begin("g-9-1"), [1], result([2]))
        b = rec.record(rec.begin("g-9-1"), [1, 2, 5], None, status="error", error="down")
        other = rec.record(rec.begin("g-9-2"), [1], result([2]))
        await rec.flush()
        rec.forget("g-9-1")
        assert "g-9-1" not in rec.rollouts  # the identity goes with the rollout's state
    assert [(r.harness, r.harness_version) for r in (a, b)] == [("opencode", "0.15.2")] * 2
    assert (other.harness, other.harness_version) == ("", "")
    stored = await bus.read_subject(bus.subjects.calls("g-9-1"), CallRecord)
    assert [(r.seq, r.harness, r.harness_version) for r in stored] == [
        (0, "opencode", "0.15.2"),
        (1, "opencode", "0.15.2"),
    ]


@pytest.mark.unit
async def test_flush_waits_for_calls_in_flight(bus: Bus) -> None:
    """flush returns only after the rollout's open calls are recorded and acknowledged."""
    async with Recorder(bus) as rec:
        t = rec.begin("g-3-1")

        async def finish_later() -> None:
            await asyncio.sleep(0.2)  # the call ends after flush has started waiting
            rec.record(t, [1], result([2]))

        task = asyncio.create_task(finish_later())
        assert await rec.flush("g-3-1", timeout=5) == 1
        await task
        other = rec.begin("g-4-1")
        with pytest.raises(TimeoutError):
            await rec.flush("g-4-1", timeout=0.1)
        rec.record(other, [1], result([2]))
        assert await rec.flush("g-3-1") == 1  # another rollout's open call does not block it


class _FlakyBus(MemoryBus):
    """A memory bus that can be taken down, and refuses records above a size."""

    def __init__(self, run: str) -> None:
        super().__init__(run)
        self.down = False
        self.max_bytes = 1 << 30

    async def publish_bytes(self, subject, data, msg_id):
        if len(data) > self.max_bytes:
            raise PayloadTooLarge(f"{len(data)} bytes")
        if self.down:
            raise ConnectionError("bus down")
        return await super().publish_bytes(subject, data, msg_id)


@pytest.mark.unit
async def test_bus_down_fills_buffer_then_refuses(run_name: str) -> None:
    """With the bus down, calls are admitted until ``capacity`` records wait; then begin()
    raises RecorderFull (-> 503). When the bus is back everything is stored exactly once."""
    bus = _FlakyBus(run_name)
    await bus.ensure_streams()
    bus.down = True
    async with Recorder(bus, capacity=3, retry_delay=0.01) as rec:
        for _ in range(3):
            assert rec.can_accept()
            rec.record(rec.begin("g-5-1"), [1], result([2]))
        await until(lambda: not rec.bus_ok, 5, "the recorder to find the bus down")
        assert not rec.can_accept()
        with pytest.raises(RecorderFull, match="bus unreachable"):
            rec.begin("g-5-1")
        bus.down = False
        assert await rec.flush("g-5-1", timeout=5) == 3
        assert rec.can_accept() and rec.bus_ok
    assert await bus.stream_count("CALLS") == 3


@pytest.mark.unit
async def test_admitted_call_is_recorded_even_if_buffer_filled(run_name: str) -> None:
    """A call admitted before the buffer filled is recorded anyway (never served unrecorded)."""
    bus = _FlakyBus(run_name)
    await bus.ensure_streams()
    bus.down = True
    async with Recorder(bus, capacity=1, retry_delay=0.01) as rec:
        early = rec.begin("g-6-1")
        rec.record(rec.begin("g-6-1"), [1], result([2]))
        rec.record(early, [1], result([3]))  # over capacity: accepted
        bus.down = False
        assert await rec.flush("g-6-1", timeout=5) == 2


@pytest.mark.unit
async def test_oversized_record_is_lost_and_flush_says_so(run_name: str) -> None:
    """A record the server can never accept does not block the others; flush raises RecordLost."""
    bus = _FlakyBus(run_name)
    await bus.ensure_streams()
    bus.max_bytes = 2000
    async with Recorder(bus, retry_delay=0.01) as rec:
        rec.record(rec.begin("g-7-1"), list(range(5000)), result([2]))
        rec.record(rec.begin("g-7-1"), [1], result([2]))
        with pytest.raises(RecordLost, match="call:g-7-1:0"):
            await rec.flush("g-7-1", timeout=5)
    stored = await bus.read_subject(bus.subjects.calls("g-7-1"), CallRecord)
    assert [r.seq for r in stored] == [1]


@pytest.mark.integration
async def test_real_nats_server_outage(nats_server_fn) -> None:
    """Against a real nats-server that is killed and restarted: the buffer fills and refuses,
    then every admitted record is stored once, in order, and flush returns."""
    srv = nats_server_fn
    bus = await connect(srv.url, "outage", publish_timeout=0.5)
    rid = "g-8-1"
    try:
        async with Recorder(bus, capacity=4, retry_delay=0.05, publish_timeout=1.0) as rec:
            rec.record(rec.begin(rid), [1, 2], result([3, 2]))
            assert await rec.flush(rid, timeout=10) == 1
            srv.kill()
            for i in range(3):
                rec.record(rec.begin(rid), [1, 2, 3, 2, 4 + i], result([5]))
            await until(lambda: not rec.bus_ok, 10, "the recorder to find the bus down")
            assert rec._unacked == 3
            rec.record(rec.begin(rid), [1], result([5]))
            with pytest.raises(RecorderFull):
                rec.begin(rid)
            srv.start()
            assert await rec.flush(rid, timeout=30) == 5
        stored = await bus.read_subject(bus.subjects.calls(rid), CallRecord)
        assert [r.seq for r in stored] == [0, 1, 2, 3, 4]
        rebuild(stored)
    finally:
        await bus.close()
