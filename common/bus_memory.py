"""The in-memory twin of the JetStream bus (``memory://`` URLs: unit tests, one process), with
JetStream's semantics for what the project uses: publish with msg-id de-duplication, durable
pull consumers with explicit acks, redelivery after ``ack_wait``, work queues, pausing,
``max_ack_pending``. See ``harnessrl.common.bus`` for the contract."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from harnessrl.common.bus import (
    STREAMS,
    Bus,
    BusError,
    Consumer,
    ConsumerState,
    PubResult,
    R,
    StreamSpec,
    subject_matches,
)

# ---------------------------------------------------------------------------------------------
# in-memory implementation (unit tests; same semantics as JetStream for what we use)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Msg:
    seq: int
    subject: str
    data: bytes
    msg_id: str | None
    ts: float = field(default_factory=time.time)


@dataclass
class _Pending:
    msg: _Msg
    deadline: float
    num_delivered: int


class _MemStream:
    def __init__(self, name: str, spec: StreamSpec, subjects: list[str]) -> None:
        self.name, self.spec, self.subjects = name, spec, subjects
        self.msgs: dict[int, _Msg] = {}
        self.ids: dict[str, int] = {}
        self.last_seq = 0
        self.consumers: dict[str, _MemConsumerState] = {}


@dataclass
class _MemConsumerState:
    filter: str
    ack_wait: float
    max_deliver: int
    max_ack_pending: int = 10_000
    paused: bool = False
    """Delivers nothing while set (JetStream's consumer pause)."""
    waiting: int = 0
    """Fetches waiting for messages now."""
    delivered: int = 0
    next_seq: int = 1
    pending: dict[int, _Pending] = field(default_factory=dict)
    deliveries: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)


class MemoryBroker:
    """Shared in-process state standing in for a nats-server (several MemoryBus clients)."""

    _named: dict[str, MemoryBroker] = {}

    def __init__(self) -> None:
        self.streams: dict[str, _MemStream] = {}
        self.changed = asyncio.Event()

    @classmethod
    def named(cls, url: str) -> MemoryBroker:
        return cls._named.setdefault(url, cls())

    def stream_for(self, subject: str) -> _MemStream:
        for st in self.streams.values():
            if any(subject_matches(p, subject) for p in st.subjects):
                return st
        raise BusError(f"no stream for subject {subject!r}")

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class MemoryBus(Bus):
    """In-memory ``Bus`` with JetStream's semantics for publish/consume/ack/redelivery/dedup."""

    def __init__(self, run: str, broker: MemoryBroker | None = None) -> None:
        super().__init__(run)
        self.broker = broker or MemoryBroker()

    async def ensure_streams(self, kinds: Iterable[str] | None = None) -> None:
        for kind in kinds or STREAMS:
            spec = STREAMS[kind]
            name = self.subjects.stream(kind)
            if name not in self.broker.streams:
                subs = [t.format(run=self.run) for t in spec.subjects]
                self.broker.streams[name] = _MemStream(name, spec, subs)

    async def publish_bytes(self, subject: str, data: bytes, msg_id: str | None) -> PubResult:
        st = self.broker.stream_for(subject)
        if msg_id is not None and msg_id in st.ids:
            return PubResult(st.ids[msg_id], duplicate=True)
        st.last_seq += 1
        st.msgs[st.last_seq] = _Msg(st.last_seq, subject, bytes(data), msg_id)
        if msg_id is not None:
            st.ids[msg_id] = st.last_seq
        self.broker.notify()
        return PubResult(st.last_seq)

    async def ensure_consumer(
        self,
        kind: str,
        durable: str,
        *,
        filter_subject: str | None = None,
        ack_wait: float = 30.0,
        max_deliver: int = -1,
        max_ack_pending: int = 10_000,
    ) -> list[str]:
        st = self.broker.streams[self.subjects.stream(kind)]
        want = dict(
            filter=filter_subject or st.subjects[0],
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
        )
        state = st.consumers.get(durable)
        if state is None:
            st.consumers[durable] = _MemConsumerState(**want)  # type: ignore[arg-type]
            return ["created"]
        changed = [k for k, v in want.items() if getattr(state, k) != v]
        for k in changed:
            setattr(state, k, want[k])
        return changed

    async def consumer_state(self, kind: str, durable: str) -> ConsumerState | None:
        st = self.broker.streams[self.subjects.stream(kind)]
        c = st.consumers.get(durable)
        if c is None:
            return None
        return ConsumerState(
            filter_subject=c.filter,
            ack_wait=c.ack_wait,
            max_ack_pending=c.max_ack_pending,
            pending=_mem_pending(st, c),
            ack_pending=sum(1 for seq in c.pending if seq in st.msgs),
            waiting=c.waiting,
            delivered=c.delivered,
            paused=c.paused,
        )

    async def _bind(
        self, kind: str, durable: str, record_type: type[R], ack_wait: float
    ) -> Consumer[R]:
        st = self.broker.streams[self.subjects.stream(kind)]
        state = st.consumers[durable]
        return _MemConsumer(self, kind, durable, record_type, state.ack_wait, st, state)

    async def read_subject_batches(
        self,
        subject: str,
        record_type: type[R],
        *,
        dead_letter_as: str | None = None,
        batch: int = 256,
        reject: Callable[[str], str] | None = None,
    ) -> AsyncIterator[list[R]]:
        st = self.broker.stream_for(subject)
        out: list[R] = []
        for seq in sorted(st.msgs):
            m = st.msgs.get(seq)
            if m is not None and subject_matches(subject, m.subject):
                rec = await self._read_one(
                    m.subject, seq, m.data, record_type, dead_letter_as, reject
                )
                if rec is not None:
                    out.append(rec)
            if len(out) >= batch:
                yield out
                out = []
        if out:
            yield out

    async def stored(
        self,
        subject: str,
        *,
        since: float | None = None,
        first: int = 1,
        upto: int | None = None,
    ) -> list[tuple[int, bytes]]:
        st = self.broker.stream_for(subject)
        return [
            (seq, m.data)
            for seq, m in sorted(st.msgs.items())
            if subject_matches(subject, m.subject)
            and (since is None or m.ts >= since)
            and seq >= first
            and (upto is None or seq <= upto)
        ]

    async def purge(self, kind: str, subject: str | None = None) -> None:
        st = self.broker.streams[self.subjects.stream(kind)]
        for seq in [
            s for s, m in st.msgs.items() if subject is None or subject_matches(subject, m.subject)
        ]:
            del st.msgs[seq]

    async def stream_count(self, kind: str, subject: str | None = None) -> int:
        st = self.broker.streams[self.subjects.stream(kind)]
        return sum(
            1 for m in st.msgs.values() if subject is None or subject_matches(subject, m.subject)
        )

    async def close(self) -> None:
        return None


def _mem_pending(st: _MemStream, c: _MemConsumerState) -> int:
    """Messages of ``st`` consumer ``c`` has not delivered yet."""
    return sum(
        1 for s, m in st.msgs.items() if s >= c.next_seq and subject_matches(c.filter, m.subject)
    )


class _MemConsumer(Consumer[R]):
    def __init__(self, bus, kind, durable, record_type, ack_wait, stream, state) -> None:
        super().__init__(bus, kind, durable, record_type, ack_wait)
        self.st: _MemStream = stream
        self.state: _MemConsumerState = state

    def _take(self, batch: int) -> list[_Pending]:
        now = time.monotonic()
        out: list[_Pending] = []
        if self.state.paused:
            return out
        for p in sorted(self.state.pending.values(), key=lambda p: p.msg.seq):
            if len(out) >= batch:
                break
            if p.deadline <= now and p.msg.seq in self.st.msgs:
                if 0 < self.state.max_deliver <= p.num_delivered:
                    continue
                p.num_delivered += 1
                p.deadline = now + self.state.ack_wait
                out.append(p)
        while (
            len(out) < batch
            and self.state.next_seq <= self.st.last_seq
            and len(self.state.pending) < self.state.max_ack_pending
        ):
            seq = self.state.next_seq
            self.state.next_seq += 1
            m = self.st.msgs.get(seq)
            if m is None or not subject_matches(self.state.filter, m.subject):
                continue
            p = _Pending(m, now + self.state.ack_wait, 1)
            self.state.pending[seq] = p
            out.append(p)
        self.state.delivered += len(out)
        return out

    async def _fetch_raw(self, batch: int, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        self.state.waiting += 1
        try:
            while True:
                got = self._take(batch)
                if got:
                    await asyncio.sleep(0)  # always yield, like a network round trip would
                    return got
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                waiter = self.bus.broker.changed  # type: ignore[attr-defined]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.wait(), min(remaining, 0.05))
        finally:
            self.state.waiting -= 1

    def _meta(self, raw: _Pending) -> tuple[str, int, int, int]:
        return raw.msg.subject, raw.msg.seq, raw.num_delivered, _mem_pending(self.st, self.state)

    def _raw_data(self, raw: _Pending) -> bytes:
        return raw.msg.data

    def _finish(self, raw: _Pending) -> None:
        self.state.pending.pop(raw.msg.seq, None)
        if self.st.spec.work_queue:
            self.st.msgs.pop(raw.msg.seq, None)

    async def _ack_raw(self, raw: _Pending) -> None:
        self._finish(raw)

    async def _term_raw(self, raw: _Pending) -> None:
        self._finish(raw)

    async def _nak_raw(self, raw: _Pending, delay: float | None) -> None:
        if raw.msg.seq in self.state.pending:
            raw.deadline = time.monotonic() + (delay or 0.0)
            self.bus.broker.notify()  # type: ignore[attr-defined]

    async def _in_progress_raw(self, raw: _Pending) -> None:
        if raw.msg.seq in self.state.pending:
            raw.deadline = time.monotonic() + self.state.ack_wait

    async def pending(self) -> int:
        return self._meta(_Pending(_Msg(0, "", b"", None), 0, 0))[3]
