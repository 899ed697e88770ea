"""The message bus: a small interface over NATS JetStream, and an in-memory twin for unit tests.

Contract (both implementations):

* ``publish(subject, record, msg_id)`` stores a record at most once per ``msg_id`` (JetStream's
  ``Nats-Msg-Id`` de-duplication); transient failures (disconnect, timeout) are retried with the
  *same* id, so a retry never duplicates. A record larger than the server's ``max_payload`` is an
  error (callers split such records), never a silent drop.
* ``publish_many`` gives the same guarantees for a batch, pipelined: nothing waits for one
  record's ack before the next is sent, and it returns only once every record is acked (or
  raises; a record is never reported done unacked).
* ``consumer(kind, durable, record_type)`` gives a durable pull consumer with explicit acks,
  creating it (or updating its settings) first; ``ensure_consumer`` only creates or updates
  it, ``bind_consumer`` only binds to one that exists, waiting for its owner to create it (a
  shared consumer, like the actors' ``TASK_CONSUMER``, is created by the side that owns its
  stream, so no user of it can change its settings), and ``consumer_state`` reads what it
  holds. ``fetch`` returns decoded ``Delivery`` objects. A payload that does not decode (a *poison*
  message) is written to ``hrl.<run>.dead.<kind>`` with the reason, terminated, counted, and never
  returned, so it cannot block the consumer.
* A delivery that is neither acked nor kept alive (``in_progress``) within ``ack_wait`` is
  redelivered, possibly to another consumer instance: consumers must be idempotent.
* ``read_subject`` returns every message currently stored on one subject, in order (the
  assembler's per-rollout read of CallRecords); ``read_subject_batches`` yields them batch by
  batch as they arrive (the weight updater hashes a version while reading it). A reader that
  owns the subject's data passes ``dead_letter_as`` (its name): an undecodable message is then
  dead-lettered like a poison delivery (once per message and reader, however often it is read)
  and left out.
* ``stored(subject)`` lists the messages a subject holds now, one by one without a consumer
  (a work queue's unconsumed ones included), optionally from a time: what a resumed feeder and
  the run's accounting read.
* ``interrupt()`` (a process that is stopping): from then on an operation that would wait for
  an unreachable server (a publish retried through an outage, an ack, a flush) fails at once
  with ``BusUnavailable`` instead; while the server is reachable nothing changes. What was not
  acked is simply redelivered once the server is back, so a stopping process never waits out an
  outage.
* ``Bus.dead_letter`` is the one way anything is given up on: the message is kept on
  ``hrl.<run>.dead.<kind>`` as a ``DeadLetter`` with the reason (msg id
  ``dead:<kind>:<consumer>:<stream seq>``) and counted in ``hrl_bus_dead_lettered_total``
  (only when newly stored, so a message given up twice counts once).

Streams (``HRL_<run>_<KIND>``) are created idempotently by whoever comes first and may (the
admin, or anyone on an open server); each durable consumer by its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from harnessrl.common import metrics
from harnessrl.common.aio import StartupError
from harnessrl.common.records import (
    DeadLetter,
    Record,
    RecordDecodeError,
    check_token,
    decode,
    encode,
)

if TYPE_CHECKING:
    from harnessrl.common.config import ServiceConfig

log = logging.getLogger("harnessrl.bus")

R = TypeVar("R", bound=Record)

# ---------------------------------------------------------------------------------------------
# subjects and streams
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamSpec:
    """How one stream kind is laid out."""

    kind: str
    subjects: tuple[str, ...]  # templates with {run}
    work_queue: bool
    max_age_s: float = 0.0  # 0 = unlimited
    max_msgs_per_subject: int = -1


STREAMS: dict[str, StreamSpec] = {
    s.kind: s
    for s in (
        StreamSpec("TASKS", ("hrl.{run}.tasks",), work_queue=True),
        StreamSpec("CALLS", ("hrl.{run}.calls.>",), work_queue=False, max_age_s=24 * 3600),
        StreamSpec("ROLLOUTS", ("hrl.{run}.rollouts.*",), work_queue=False, max_age_s=7 * 86400),
        StreamSpec("SAMPLES", ("hrl.{run}.samples",), work_queue=True),
        StreamSpec("WEIGHTS", ("hrl.{run}.weights.>",), work_queue=False, max_age_s=86400),
        StreamSpec("DEAD", ("hrl.{run}.dead.>",), work_queue=False, max_age_s=30 * 86400),
        StreamSpec("KEYS", ("hrl.{run}.keys.*",), work_queue=False),
    )
}


TASK_CONSUMER = "actors"
"""Durable consumer of the TASKS stream shared by every actor of a run. The learner's feeder
creates it with the run's settings (``harnessrl.learner.task_queue``); actors only bind to it,
fetch and ack."""

TASK_STALL_ALERT_S = 20.0
"""Seconds the task consumer may go without delivering while tasks wait and actors ask for
them before it counts as stalled (the ``HrlTaskQueueStalled`` alert, the run's status line)."""


@dataclass
class ConsumerState:
    """What a durable consumer holds now, and its settings (``Bus.consumer_state``)."""

    filter_subject: str
    ack_wait: float
    max_ack_pending: int
    pending: int
    """Messages it has not delivered yet (of those its filter sees)."""
    ack_pending: int
    """Messages delivered and not acked yet (waiting for a redelivery included)."""
    waiting: int
    """Pull requests waiting for messages (consumers asking for work)."""
    delivered: int
    """Consumer sequence of its last delivery (grows with every delivery)."""
    paused: bool = False


class Subjects:
    """Subject names of one run, as seen by one publisher.

    A rollout's calls and its result carry the name of the process that published them:
    ``hrl.<run>.calls.<publisher>.<rollout_id>`` and ``hrl.<run>.rollouts.<publisher>``, where
    the publisher is the connection's NATS user (``actor-NAME`` for an actor; with
    credentials the server lets each user publish only under its own name) or, on an open
    server, the process's own name. ``publisher`` is that name for this connection."""

    def __init__(self, run: str, publisher: str = "local") -> None:
        self.run = check_token(run, "run")
        self.publisher = check_token(publisher, "publisher")
        p = f"hrl.{run}"
        self.tasks = f"{p}.tasks"
        self.rollouts = f"{p}.rollouts.*"
        """Every publisher's results (consumers and readers; publish on `rollouts_of`)."""
        self.samples = f"{p}.samples"
        self.weights_ready = f"{p}.weights.ready"
        self.all_calls = f"{p}.calls.>"
        self.claim_key = f"{p}.keys.claims"
        """The run's claim key (`Bus.claim_key`)."""

    def rollouts_of(self, publisher: str | None = None) -> str:
        """Where ``publisher`` (default: this connection) publishes its results."""
        return f"hrl.{self.run}.rollouts.{check_token(publisher or self.publisher, 'publisher')}"

    def calls(self, rollout_id: str, publisher: str | None = None) -> str:
        """Where ``publisher`` (default: this connection) publishes ``rollout_id``'s calls."""
        by = check_token(publisher or self.publisher, "publisher")
        return f"hrl.{self.run}.calls.{by}.{check_token(rollout_id, 'rollout_id')}"

    def calls_any(self, rollout_id: str) -> str:
        """Every publisher's calls of ``rollout_id``."""
        return f"hrl.{self.run}.calls.*.{check_token(rollout_id, 'rollout_id')}"

    @staticmethod
    def publisher_of(subject: str) -> str:
        """Who published on a calls or rollouts subject (its fourth token)."""
        parts = subject.split(".")
        return parts[3] if len(parts) > 3 else ""

    def weights_data(self, version: int) -> str:
        return f"hrl.{self.run}.weights.data.{int(version)}"

    def dead(self, kind: str) -> str:
        return f"hrl.{self.run}.dead.{kind.lower()}"

    def stream(self, kind: str) -> str:
        return f"HRL_{self.run}_{kind}"

    _KIND_BY_TOKEN = {
        "tasks": "TASKS",
        "calls": "CALLS",
        "rollouts": "ROLLOUTS",
        "samples": "SAMPLES",
        "weights": "WEIGHTS",
        "dead": "DEAD",
        "keys": "KEYS",
    }

    def kind_of(self, subject: str) -> str:
        parts = subject.split(".", 3)
        if len(parts) >= 3 and parts[0] == "hrl" and parts[1] == self.run:
            kind = self._KIND_BY_TOKEN.get(parts[2])
            if kind and any(
                subject_matches(t.format(run=self.run), subject) for t in STREAMS[kind].subjects
            ):
                return kind
        for spec in STREAMS.values():
            for tmpl in spec.subjects:
                if subject_matches(tmpl.format(run=self.run), subject):
                    return spec.kind
        raise BusError(f"subject {subject!r} belongs to no stream of run {self.run!r}")


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` one token, ``>`` one or more trailing tokens."""
    pt, st = pattern.split("."), subject.split(".")
    for i, tok in enumerate(pt):
        if tok == ">":
            return len(st) > i
        if i >= len(st) or (tok != "*" and tok != st[i]):
            return False
    return len(pt) == len(st)


# ---------------------------------------------------------------------------------------------
# errors and metrics
# ---------------------------------------------------------------------------------------------


class BusError(RuntimeError):
    """A bus operation failed permanently (not retried further)."""


class BusUnavailable(BusError):
    """The server is unreachable and the process is stopping (``Bus.interrupt``): the operation
    was given up instead of waiting for the server to come back."""


class PayloadTooLarge(BusError):
    """A record exceeds the server's max_payload: the caller must split it."""


class PermissionDenied(BusError):
    """The server's permissions refuse this credential the publish or JetStream call (see
    ``harnessrl.common.natsauth`` for what each role may do)."""


class BusConnectError(BusError, StartupError):
    """The server refused this process (credentials, TLS) or its credential files cannot be
    read: a one-line error naming the process and the URL, never retried."""


M_PUBLISHED = metrics.counter("hrl_bus_published_total", "Records published", ("stream",))
M_DUPLICATES = metrics.counter(
    "hrl_bus_duplicates_total", "Publishes the server de-duplicated by msg id", ("stream",)
)
M_PUBLISH_RETRIES = metrics.counter(
    "hrl_bus_publish_retries_total", "Publish attempts retried after a transient error", ("stream",)
)
M_CONSUMED = metrics.counter(
    "hrl_bus_consumed_total", "Records delivered to a consumer", ("stream", "consumer")
)
M_ACKED = metrics.counter("hrl_bus_acked_total", "Records acked", ("stream", "consumer"))
M_NAKED = metrics.counter("hrl_bus_naked_total", "Records nak'ed", ("stream", "consumer"))
M_REDELIVERED = metrics.counter(
    "hrl_bus_redelivered_total", "Deliveries with delivery count > 1", ("stream", "consumer")
)
M_DEAD = metrics.counter(
    "hrl_bus_dead_lettered_total", "Messages dead-lettered", ("stream", "consumer")
)
M_LAG = metrics.gauge(
    "hrl_bus_consumer_lag", "Messages pending for a consumer", ("stream", "consumer")
)


def export_dead_letters(kind: str, consumer: str) -> None:
    """Export ``consumer``'s dead-letter count on stream ``kind`` at 0 before its first dead
    letter: Prometheus' ``increase()`` (the dead-letter alert, the dashboards' rates) sees a
    series that is born at 1 as flat, so a first dead letter would go unnoticed."""
    M_DEAD.labels(stream=kind, consumer=consumer)


# ---------------------------------------------------------------------------------------------
# interface
# ---------------------------------------------------------------------------------------------


@dataclass
class PubResult:
    """Outcome of one publish."""

    seq: int
    duplicate: bool = False


@dataclass
class Delivery(Generic[R]):
    """One delivered record with its acknowledgement verbs."""

    record: R
    subject: str
    seq: int
    num_delivered: int
    _raw: Any = field(repr=False)
    _consumer: Consumer[R] = field(repr=False)

    async def ack(self) -> None:
        await self._consumer._ack(self)

    async def nak(self, delay: float | None = None) -> None:
        await self._consumer._nak(self, delay)

    async def term(self) -> None:
        await self._consumer._term(self)

    async def in_progress(self) -> None:
        await self._consumer._in_progress(self)

    async def dead_letter(self, reason: str) -> None:
        """Give up on this record: keep it on the dead-letter subject with ``reason``, term it."""
        await self._consumer._dead_letter(self._raw_data(), self.subject, self.seq, reason)
        await self.term()

    def _raw_data(self) -> bytes:
        return self._consumer._raw_data(self._raw)

    @contextlib.asynccontextmanager
    async def keepalive(self, interval: float | None = None) -> AsyncIterator[None]:
        """Send ``in_progress`` now and every ``interval`` seconds while the body runs (long
        work). The first beat is immediate: ``ack_wait`` has run since the delivery, not
        since the work began."""
        every = interval or max(0.5, self._consumer.ack_wait / 3)

        async def beat() -> None:
            while True:
                try:
                    await self.in_progress()
                except Exception as e:  # the body's outcome decides; heartbeats are best effort
                    log.warning("in_progress heartbeat failed: %s", e)
                await asyncio.sleep(every)

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Consumer(ABC, Generic[R]):
    """A durable pull consumer of one record type."""

    def __init__(self, bus: Bus, kind: str, durable: str, record_type: type[R], ack_wait: float):
        self.bus = bus
        self.kind = kind
        self.durable = durable
        self.record_type = record_type
        self.ack_wait = ack_wait
        self._labels = {"stream": kind, "consumer": durable}
        # Exported at 0 from the start: the first nak, redelivery or dead letter is then an
        # increase for Prometheus (alerts and dashboard rates; see `export_dead_letters`).
        for m in (M_CONSUMED, M_ACKED, M_NAKED, M_REDELIVERED, M_DEAD):
            m.labels(**self._labels)

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Delivery[R]]:
        """Up to ``batch`` decoded deliveries, waiting at most ``timeout`` s for the first one."""
        out: list[Delivery[R]] = []
        for raw in await self._fetch_raw(batch, timeout):
            subject, seq, ndel, pending = self._meta(raw)
            M_CONSUMED.labels(**self._labels).inc()
            M_LAG.labels(**self._labels).set(pending)
            if ndel > 1:
                M_REDELIVERED.labels(**self._labels).inc()
            data = self._raw_data(raw)
            try:
                record = decode(data, self.record_type)
            except RecordDecodeError as e:
                await self._dead_letter(data, subject, seq, f"undecodable: {e}")
                await self._term_raw(raw)
                continue
            out.append(Delivery(record, subject, seq, ndel, raw, self))
        return out

    async def serve(
        self,
        handle: Callable[[Delivery[R]], Awaitable[None]],
        slots: int,
        *,
        batch: int | None = None,
        stop: asyncio.Event | None = None,
        timeout: float = 1.0,
    ) -> None:
        """Run ``handle`` on every delivery, up to ``slots`` at once, each in its own task: a
        fetch asks for the free slots (at most ``batch``). Once ``stop`` is set nothing more is
        fetched (a delivery that arrives with the stop is nak'ed for another consumer) and
        this returns when the running handlers are done; cancelled, it cancels them and waits
        for them. A failed fetch is logged and retried a second later (the bus reconnects by
        itself). ``handle`` settles its delivery and should not raise."""
        stop = stop or asyncio.Event()
        stopping = asyncio.ensure_future(stop.wait())
        running: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                running = {t for t in running if not t.done()}
                room = slots - len(running)
                if room <= 0:
                    await asyncio.wait({*running, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    got = await self.fetch(min(room, batch or room), timeout=timeout)
                except Exception as e:
                    log.warning("fetching from %s failed: %r", self.kind, e)
                    await asyncio.wait({stopping}, timeout=1.0)
                    continue
                for d in got:
                    if stop.is_set():
                        with contextlib.suppress(Exception):
                            await d.nak()
                    else:
                        running.add(asyncio.create_task(handle(d)))
            await asyncio.gather(*running, return_exceptions=True)
        finally:
            stopping.cancel()
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _dead_letter(self, data: bytes, subject: str, seq: int, reason: str) -> None:
        await self.bus.dead_letter(self.kind, self.durable, subject, seq, data, reason)

    async def _ack(self, d: Delivery[R]) -> None:
        await self._ack_raw(d._raw)
        M_ACKED.labels(**self._labels).inc()

    async def _nak(self, d: Delivery[R], delay: float | None) -> None:
        await self._nak_raw(d._raw, delay)
        M_NAKED.labels(**self._labels).inc()

    async def _term(self, d: Delivery[R]) -> None:
        await self._term_raw(d._raw)

    async def _in_progress(self, d: Delivery[R]) -> None:
        await self._in_progress_raw(d._raw)

    # implementation hooks
    @abstractmethod
    async def _fetch_raw(self, batch: int, timeout: float) -> list[Any]: ...
    @abstractmethod
    def _meta(self, raw: Any) -> tuple[str, int, int, int]: ...
    @abstractmethod
    def _raw_data(self, raw: Any) -> bytes: ...
    @abstractmethod
    async def _ack_raw(self, raw: Any) -> None: ...
    @abstractmethod
    async def _nak_raw(self, raw: Any, delay: float | None) -> None: ...
    @abstractmethod
    async def _term_raw(self, raw: Any) -> None: ...
    @abstractmethod
    async def _in_progress_raw(self, raw: Any) -> None: ...
    @abstractmethod
    async def pending(self) -> int:
        """Messages not yet delivered to this consumer (its lag)."""


class Bus(ABC):
    """Publish records and consume them through durable consumers, for one run."""

    def __init__(self, run: str, publisher: str = "local") -> None:
        self.run = run
        self.subjects = Subjects(run, publisher)
        self.interrupted = False
        """``interrupt`` was called."""
        self._claim_key: bytes | None = None

    @property
    def authenticated(self) -> bool:
        """Whether the server knows this connection by a user name (then `Subjects.publisher`
        is that name and the server enforces it)."""
        return False

    def publish_as(self, name: str) -> None:
        """On a connection the server knows no name for (an open server, the in-memory bus),
        publish calls and results under ``name`` (a subject token); with credentials the
        connection's user name stays."""
        if not self.authenticated:
            self.subjects.publisher = check_token(name, "publisher")

    async def claim_key(self, *, create: bool = False, wait_s: float = 60.0) -> bytes:
        """The run's claim key (``harnessrl.common.records.member_claim``): the first message on
        ``subjects.claim_key`` (stream KEYS). The learner makes it (``create``: 32 random
        bytes, once; two at once agree on the first one stored); the assembler waits up to
        ``wait_s`` for it (then ``BusError``). Actors cannot read it."""
        if self._claim_key is not None:
            return self._claim_key
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            got = await self.stored(self.subjects.claim_key)
            if got:
                self._claim_key = got[0][1]
                return self._claim_key
            if create:
                await self.publish(self.subjects.claim_key, os.urandom(32), "claim-key")
                continue
            if time.monotonic() > deadline:
                raise BusError(
                    f"run {self.run} has no claim key after {wait_s:g} s: the learner makes it "
                    "when it starts"
                )
            if not waiting:
                waiting = True
                log.info("run %s has no claim key yet: waiting for the learner", self.run)
            await asyncio.sleep(0.5)

    def interrupt(self) -> None:
        """The process is stopping: from now on give up at once (``BusUnavailable``) on what
        would wait for an unreachable server; while it is reachable, operations run as before."""
        self.interrupted = True

    @property
    def abandoning(self) -> bool:
        """Interrupted while the server is unreachable: operations fail at once now."""
        return False

    async def abandoned(self) -> None:
        """Return once the bus is `abandoning`: from then on nothing can be published (never,
        for a bus whose server cannot be away)."""
        await asyncio.Event().wait()

    @abstractmethod
    async def ensure_streams(self, kinds: Iterable[str] | None = None) -> None:
        """Create the run's streams if missing (idempotent)."""

    @abstractmethod
    async def publish_bytes(self, subject: str, data: bytes, msg_id: str | None) -> PubResult: ...

    async def publish(
        self, subject: str, record: Record | bytes, msg_id: str | None = None
    ) -> PubResult:
        """Publish one record (or pre-encoded bytes) with de-duplication key ``msg_id``."""
        if isinstance(record, Record):
            if msg_id is None and hasattr(record, "msg_id"):
                msg_id = record.msg_id()
            data = encode(record)
        else:
            data = record
        res = await self.publish_bytes(subject, data, msg_id)
        kind = self.subjects.kind_of(subject)
        (M_DUPLICATES if res.duplicate else M_PUBLISHED).labels(stream=kind).inc()
        return res

    async def publish_many(
        self, items: Iterable[tuple[str, Record | bytes, str | None]]
    ) -> list[PubResult]:
        """Publish several records with pipelined acknowledgements (same guarantees)."""
        return [await self.publish(s, r, m) for s, r, m in items]

    async def consumer(
        self,
        kind: str,
        durable: str,
        record_type: type[R],
        *,
        filter_subject: str | None = None,
        ack_wait: float = 30.0,
        max_deliver: int = -1,
        max_ack_pending: int = 10_000,
    ) -> Consumer[R]:
        """Bind (creating or updating it first: `ensure_consumer`) a durable pull consumer on
        the run's ``kind`` stream."""
        await self.ensure_consumer(
            kind,
            durable,
            filter_subject=filter_subject,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
        )
        state = await self.consumer_state(kind, durable)
        return await self._bind(kind, durable, record_type, state.ack_wait if state else ack_wait)

    @abstractmethod
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
        """Create durable pull consumer ``durable`` on the run's ``kind`` stream (filter: the
        stream's first subject by default), or update an existing one to these settings;
        returns the settings that were changed (``["created"]`` for a new one). Settings the
        server cannot change on an existing consumer are left as they are (logged)."""

    @abstractmethod
    async def consumer_state(self, kind: str, durable: str) -> ConsumerState | None:
        """What consumer ``durable`` of stream ``kind`` holds now; None when it does not
        exist."""

    @abstractmethod
    async def _bind(
        self, kind: str, durable: str, record_type: type[R], ack_wait: float
    ) -> Consumer[R]: ...

    async def bind_consumer(
        self,
        kind: str,
        durable: str,
        record_type: type[R],
        *,
        owner: str = "its owner",
        poll_s: float = 1.0,
        wait_s: float | None = None,
    ) -> Consumer[R]:
        """Bind to consumer ``durable`` as it is, never creating or changing it: one that does
        not exist yet is waited for (one log line, naming ``owner``, who creates it; then a
        reminder every minute), up to ``wait_s`` (None: as long as it takes; then
        ``BusError``). The consumer's ``ack_wait`` is the one the owner set."""
        t0 = last = time.monotonic()
        state = await self.consumer_state(kind, durable)
        if state is None:
            log.info(
                "consumer %r of stream %s does not exist yet: waiting for %s to create it",
                durable,
                self.subjects.stream(kind),
                owner,
            )
        while state is None:
            now = time.monotonic()
            if wait_s is not None and now - t0 > wait_s:
                raise BusError(
                    f"consumer {durable!r} of stream {self.subjects.stream(kind)} did not appear "
                    f"within {wait_s:g} s: {owner} creates it"
                )
            if now - last >= 60:
                last = now
                log.info(
                    "still waiting for consumer %r of stream %s (%.0f s): %s creates it",
                    durable,
                    self.subjects.stream(kind),
                    now - t0,
                    owner,
                )
            await asyncio.sleep(poll_s)
            state = await self.consumer_state(kind, durable)
        return await self._bind(kind, durable, record_type, state.ack_wait)

    async def dead_letter(
        self, kind: str, consumer: str, subject: str, seq: int, data: bytes, reason: str
    ) -> bool:
        """Keep message ``seq`` of stream ``kind`` (on ``subject``, payload ``data``) on the
        dead-letter subject with ``reason``, as given up by ``consumer``; count it. Idempotent
        per (kind, consumer, seq): returns whether it was newly stored (and counted)."""
        dl = DeadLetter(
            stream=self.subjects.stream(kind),
            subject=subject,
            seq=seq,
            consumer=consumer,
            reason=reason[:2000],
            data=bytes(data[: 256 * 1024]),
            at=time.time(),
        )
        res = await self.publish(self.subjects.dead(kind), dl, f"dead:{kind}:{consumer}:{seq}")
        if res.duplicate:
            return False
        M_DEAD.labels(stream=kind, consumer=consumer).inc()
        log.warning("dead-lettered %s seq=%d on %s: %s", kind, seq, subject, reason)
        return True

    async def _undecodable(
        self, subject: str, seq: int, data: bytes, err: Exception | str, reader: str | None
    ) -> None:
        """``read_subject``'s handling of a message that does not decode (``err``: the decode
        error) or that its reader refuses (``err``: the reason)."""
        why = err if isinstance(err, str) else f"undecodable: {err}"
        if reader is None or self.subjects.kind_of(subject) == "DEAD":
            log.warning("skipping message seq=%d on %s: %s", seq, subject, why)
            return
        await self.dead_letter(self.subjects.kind_of(subject), reader, subject, seq, data, why)

    async def _read_one(
        self,
        subject: str,
        seq: int,
        data: bytes,
        record_type: type[R],
        reader: str | None,
        reject: Callable[[str], str] | None,
    ) -> R | None:
        """One message of ``read_subject``: its record, or None when it was left out."""
        why = reject(subject) if reject is not None else ""
        if why:
            await self._undecodable(subject, seq, data, why, reader)
            return None
        try:
            return decode(data, record_type)
        except RecordDecodeError as e:
            await self._undecodable(subject, seq, data, e, reader)
            return None

    async def read_subject(
        self,
        subject: str,
        record_type: type[R],
        *,
        dead_letter_as: str | None = None,
        reject: Callable[[str], str] | None = None,
    ) -> list[R]:
        """Every record currently stored on ``subject`` (wildcards allowed), in stream order.
        An undecodable message is left out: dead-lettered as given up by ``dead_letter_as`` when
        set (the reader that owns the data), else only logged (read-only tools). So is one
        whose own subject ``reject`` gives a reason for (non-empty), with that reason."""
        out: list[R] = []
        async with contextlib.aclosing(
            self.read_subject_batches(
                subject, record_type, dead_letter_as=dead_letter_as, reject=reject
            )
        ) as batches:
            async for batch in batches:
                out.extend(batch)
        return out

    @abstractmethod
    def read_subject_batches(
        self,
        subject: str,
        record_type: type[R],
        *,
        dead_letter_as: str | None = None,
        batch: int = 256,
        reject: Callable[[str], str] | None = None,
    ) -> AsyncIterator[list[R]]:
        """`read_subject` as it arrives, at most ``batch`` records at a time (a reader that
        works on the first records while the rest are still on their way: the weight
        updater hashes a version while reading it). Close it (``contextlib.aclosing``) when
        leaving early."""

    @abstractmethod
    async def stored(
        self,
        subject: str,
        *,
        since: float | None = None,
        first: int = 1,
        upto: int | None = None,
    ) -> list[tuple[int, bytes]]:
        """``(stream sequence, payload)`` of every message stored on ``subject`` now (on a work
        queue: those not consumed yet), oldest first; only those stored at or after the Unix
        time ``since``, from sequence ``first`` and, with ``upto``, up to that sequence. Read
        message by message without a consumer, so it works on work queues and needs only read
        access to the stream."""

    @abstractmethod
    async def purge(self, kind: str, subject: str | None = None) -> None:
        """Remove stored messages of a stream (optionally only one subject)."""

    @abstractmethod
    async def stream_count(self, kind: str, subject: str | None = None) -> int:
        """Messages stored in a stream (optionally on one subject)."""

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def connect(url: str, run: str, *, create_streams: bool = True, **kw: Any) -> Bus:
    """Connect to a bus: ``memory://`` for the in-process twin, otherwise a NATS URL (``kw``:
    ``JetStreamBus.connect``'s options, e.g. ``name``, ``creds``, ``ca``)."""
    if url.startswith("memory://"):
        from harnessrl.common.bus_memory import MemoryBroker, MemoryBus

        bus: Bus = MemoryBus(run, MemoryBroker.named(url))
    else:
        from harnessrl.common.bus_nats import JetStreamBus

        bus = await JetStreamBus.connect(url, run, **kw)
    if create_streams:
        await bus.ensure_streams()
    return bus


async def connect_service(cfg: ServiceConfig, name: str, *, create_streams: bool = True) -> Bus:
    """`connect` with a service config's NATS fields (``nats``, ``run``, ``nats_creds``,
    ``nats_ca``: ``harnessrl.common.config.NatsClientSettings``); ``name`` names the process in the
    server's connection list and in a refused connection's error."""
    return await connect(
        cfg.nats,
        cfg.run,
        create_streams=create_streams,
        name=name,
        creds=cfg.nats_creds,
        ca=cfg.nats_ca,
    )


def __getattr__(name: str) -> Any:
    """``MemoryBus`` and ``MemoryBroker`` live in ``harnessrl.common.bus_memory``."""
    if name in ("MemoryBus", "MemoryBroker"):
        from harnessrl.common import bus_memory

        return getattr(bus_memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
