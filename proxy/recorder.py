"""Call recorder: every model call becomes one CallRecord on
``hrl.<run>.calls.<publisher>.<rollout_id>`` (the publisher: this connection's NATS user, e.g.
the actor's ``actor-NAME``; see ``harnessrl.common.bus.Subjects``).

Flow: ``begin(rollout_id)`` when a request arrives (assigns ``seq`` in arrival order, reserves
buffer room, raises ``RecorderFull`` if there is none) -> the proxy calls the engine ->
``record(ticket, ...)`` builds the CallRecord and queues it -> a background task publishes
queued records in order with msg id ``call:<rollout_id>:<seq>:<salt>`` (``salt``: random per
recorder, so no other publisher can take a record's id first and have it dropped as a
duplicate) -> ``flush(rollout_id)``
returns once the bus acknowledged every record of the rollout.

What must stay true:

* No call is served unrecorded. ``begin`` refuses (-> the proxy answers 503, harnesses retry)
  while ``capacity`` records wait unacknowledged, e.g. because the bus is down; a call that was
  admitted is always recorded, even if the buffer filled meanwhile. Every ticket ends in
  exactly one ``record`` (an error record if the call failed), so seqs are dense.
* Publishing never blocks a reply: ``record`` only queues. Records are published in the order
  they were recorded (pipelined: a retried publish may land after later ones, so consumers
  order a rollout's records by seq and parent, never by stream position).
* A failed publish is retried with the same msg id until it succeeds (JetStream de-duplicates),
  except a record larger than the server accepts, which is counted as lost and makes
  ``flush`` of its rollout raise ``RecordLost``.
* The input is a delta against the recorded call of the same rollout *with a smaller seq*
  whose input+output shares the longest prefix with it (ties: the earliest): ``full_input =
  (input_p + output_p)[:prefix_len] + suffix_ids``; ``input_len`` and ``input_hash`` let the
  assembler verify it. Calls overlap (a harness's background title request may finish after
  the main call that arrived later): a call that arrived later is never a parent, even when it
  was recorded first, because the assembler rebuilds in seq order and rejects any other parent.
* Every record carries its rollout's harness identity (``harness``, ``harness_version``) as
  ``register`` set it; it is kept until ``forget`` drops the rollout's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harnessrl.common import metrics
from harnessrl.common.bus import Bus, BusUnavailable, PayloadTooLarge
from harnessrl.common.records import CallRecord, SamplingParams, ids_hash, pack_f32, pack_ids
from harnessrl.proxy.sglang import GenerateResult

log = logging.getLogger("harnessrl.proxy.recorder")

__all__ = ["RecordLost", "Recorder", "RecorderFull", "Ticket", "longest_prefix"]

M_RECORDS = metrics.counter(
    "hrl_proxy_records_total", "CallRecords by outcome (published, lost)", ("outcome",)
)
M_REFUSED = metrics.counter(
    "hrl_proxy_calls_refused_total", "Calls refused because the record buffer was full"
)
M_BUFFERED = metrics.gauge("hrl_proxy_records_buffered", "CallRecords waiting for the bus")
M_PUBLISH_S = metrics.histogram("hrl_proxy_record_publish_seconds", "Record -> bus ack latency")


class RecorderFull(RuntimeError):
    """No room to record another call (the bus is down or slow): answer 503 with Retry-After."""

    retry_after = 2.0


class RecordLost(RuntimeError):
    """A record of the rollout could not be stored (too large): the rollout is incomplete."""


@dataclass
class Ticket:
    """An admitted call: its identity and when it arrived."""

    rollout_id: str
    seq: int
    t_start: float = field(default_factory=time.time)
    done: bool = False


@dataclass
class _Rollout:
    next_seq: int = 0
    open: int = 0
    recorded: int = 0
    acked: int = 0
    lost: list[str] = field(default_factory=list)
    seqs: dict[int, np.ndarray] = field(default_factory=dict)
    """Recorded calls' input+output ids (what later calls take deltas against)."""
    harness: str = ""
    harness_version: str = ""


def longest_prefix(
    ids: np.ndarray, earlier: dict[int, np.ndarray], hint: int = -1, below: int | None = None
) -> tuple[int, int]:
    """``(parent_seq, prefix_len)``: the sequence sharing the longest prefix with ``ids`` (ties:
    the smallest seq), among those of ``earlier`` with a seq smaller than ``below`` (all when
    None); ``(-1, 0)`` when none shares a token."""
    best_seq, best = -1, 0
    seqs = earlier if below is None else [s for s in earlier if s < below]
    order = sorted(seqs, key=lambda s: (s != hint, -len(earlier[s]), s))
    for s in order:
        seq = earlier[s]
        if len(seq) < best or (len(seq) == best and s > best_seq >= 0):
            continue
        n = min(len(seq), len(ids))
        diff = np.flatnonzero(seq[:n] != ids[:n])
        lcp = int(diff[0]) if len(diff) else n
        if lcp > best or (lcp == best and lcp > 0 and s < best_seq):
            best_seq, best = s, lcp
    return (best_seq, best) if best > 0 else (-1, 0)


def _encodable(value: Any) -> Any:
    """The harness's values as msgpack can carry them: integers outside int64/uint64 (a
    harness may send ``"seed": 1000000000000000000000``) become their decimal text. Without
    this one such request would make an unpublishable record that blocks the buffer."""
    if isinstance(value, dict):
        return {k: _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        return str(value)
    return value


class Recorder:
    """Builds CallRecords and publishes them through a bounded buffer (see module docstring)."""

    def __init__(
        self,
        bus: Bus,
        *,
        capacity: int = 256,
        batch: int = 64,
        retry_delay: float = 0.5,
        publish_timeout: float = 10.0,
    ) -> None:
        self.bus = bus
        self.salt = secrets.token_hex(6)
        """Ends every msg id this recorder uses (see the module docstring)."""
        self.capacity = capacity
        self.publish_timeout = publish_timeout
        self.batch = batch
        self.retry_delay = retry_delay
        self.rollouts: dict[str, _Rollout] = {}
        self._queue: deque[CallRecord] = deque()
        self._unacked = 0
        self._wake = asyncio.Event()
        self._progress = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self.bus_ok = True
        """False while publishing is failing."""

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> Recorder:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._publisher())
        return self

    async def close(self, timeout: float = 10.0) -> None:
        """Publish what is queued (up to ``timeout`` s; not at all when the process is stopping
        and NATS is unreachable: ``Bus.abandoning``), then stop."""
        if not self.bus.abandoning:
            with contextlib.suppress(TimeoutError, RecordLost, BusUnavailable):
                await self.flush(timeout=timeout, wait_open=False)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> Recorder:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- identity ---------------------------------------------------------------------------

    def register(self, rollout_id: str, harness: str = "", harness_version: str = "") -> None:
        """Set the harness identity recorded on every call of ``rollout_id`` from now on (kept
        until ``forget`` drops the rollout's state; registering again replaces it)."""
        ro = self.rollouts.setdefault(rollout_id, _Rollout())
        ro.harness, ro.harness_version = harness, harness_version

    # -- admission --------------------------------------------------------------------------

    def can_accept(self) -> bool:
        """Whether a new call may be admitted (fewer than ``capacity`` records unacknowledged)."""
        return self._unacked < self.capacity

    def begin(self, rollout_id: str) -> Ticket:
        """Admit a call of ``rollout_id``: its seq, in arrival order. Raises ``RecorderFull``."""
        if not self.can_accept():
            M_REFUSED.inc()
            raise RecorderFull(
                f"{self._unacked} call records are waiting for the bus "
                f"({'bus unreachable' if not self.bus_ok else 'bus slow'}); retry later"
            )
        ro = self.rollouts.setdefault(rollout_id, _Rollout())
        ticket = Ticket(rollout_id, ro.next_seq)
        ro.next_seq += 1
        ro.open += 1
        return ticket

    # -- recording --------------------------------------------------------------------------

    def record(
        self,
        ticket: Ticket,
        input_ids: Sequence[int] | np.ndarray = (),
        result: GenerateResult | None = None,
        *,
        status: str = "ok",
        error: str = "",
        api: str = "chat",
        label: str = "main",
        sampling: SamplingParams | None = None,
        requested: dict[str, Any] | None = None,
        tito_hit: bool = False,
        parent_hint: int = -1,
        queue_s: float = 0.0,
        engine_s: float = 0.0,
        headers: dict[str, str] | None = None,
        t_end: float | None = None,
    ) -> CallRecord:
        """Build the call's record and queue it for publishing (never blocks, never refuses).

        ``result`` is the engine's reply (None when the call failed before or at the engine);
        ``parent_hint`` (the TITO anchor) is tried first when looking for the delta's parent.
        The parent is always a call with a smaller seq (see the module docstring).
        """
        if ticket.done:
            raise RuntimeError(f"call {ticket.rollout_id}:{ticket.seq} was already recorded")
        ticket.done = True
        ro = self.rollouts.setdefault(ticket.rollout_id, _Rollout())
        ids = np.asarray(input_ids, dtype=np.int32)
        parent, prefix = longest_prefix(ids, ro.seqs, parent_hint, below=ticket.seq)
        out = np.asarray(result.output_ids if result else [], dtype=np.int32)
        rec = CallRecord(
            rollout_id=ticket.rollout_id,
            seq=ticket.seq,
            api=api,  # type: ignore[arg-type]
            label=label,  # type: ignore[arg-type]
            harness=ro.harness,
            harness_version=ro.harness_version,
            parent_seq=parent,
            prefix_len=prefix,
            suffix_ids=pack_ids(ids[prefix:]),
            input_len=len(ids),
            input_hash=ids_hash(ids),
            output_ids=pack_ids(out),
            output_logprobs=pack_f32(result.logprobs if result else []),
            finish_reason=result.finish_reason if result else "",
            weight_version_start=result.weight_version_start if result else -1,
            weight_version_end=result.weight_version_end if result else -1,
            sampling=sampling or SamplingParams(),
            requested=_encodable(dict(requested or {})),
            status=status,  # type: ignore[arg-type]
            error=error[:4000],
            tito_hit=tito_hit,
            cached_tokens=result.cached_tokens if result else 0,
            engine=result.engine if result else "",
            t_start=ticket.t_start,
            t_end=time.time() if t_end is None else t_end,
            queue_s=queue_s,
            engine_s=engine_s,
            headers=dict(headers or {}),
        )
        if len(ids):
            ro.seqs[ticket.seq] = np.concatenate([ids, out])
        ro.open -= 1
        ro.recorded += 1
        self._queue.append(rec)
        self._unacked += 1
        M_BUFFERED.set(self._unacked)
        self._wake.set()
        return rec

    # -- publishing -------------------------------------------------------------------------

    async def _publisher(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue[i] for i in range(min(self.batch, len(self._queue)))]
            t0 = time.monotonic()
            lost = await self._publish(batch)
            for _ in batch:
                self._queue.popleft()
            await self._acked(batch, lost, time.monotonic() - t0)

    async def _publish(self, batch: list[CallRecord]) -> set[int]:
        """Publish ``batch`` until stored; returns indices of records too large to ever store."""
        delay = self.retry_delay
        calls = self.bus.subjects.calls
        items = [(calls(r.rollout_id), r, f"{r.msg_id()}:{self.salt}") for r in batch]
        while True:
            try:
                # bounded: an attempt stuck in a dead connection is abandoned and retried with
                # the same msg ids (the server de-duplicates whatever did arrive)
                async with asyncio.timeout(self.publish_timeout):  # no task, unlike wait_for
                    await self.bus.publish_many(items)
                self.bus_ok = True
                return set()
            except PayloadTooLarge:
                return await self._publish_one_by_one(items)
            except Exception as e:  # bus down: keep the records, retry with the same ids
                if self.bus_ok:
                    log.warning("publishing call records failed (%r); retrying", e)
                self.bus_ok = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _publish_one_by_one(self, items: list[tuple[str, CallRecord, str]]) -> set[int]:
        lost = set()
        for i, (subject, rec, msg_id) in enumerate(items):
            delay = self.retry_delay
            while True:
                try:
                    await asyncio.wait_for(
                        self.bus.publish(subject, rec, msg_id), self.publish_timeout
                    )
                    break
                except PayloadTooLarge as e:
                    log.error("call record %s is too large to store: %s", msg_id, e)
                    lost.add(i)
                    break
                except Exception as e:
                    self.bus_ok = False
                    log.debug("publish of %s failed (%r); retrying", msg_id, e)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        return lost

    async def _acked(self, batch: list[CallRecord], lost: set[int], seconds: float) -> None:
        for i, rec in enumerate(batch):
            ro = self.rollouts.get(rec.rollout_id)
            if i in lost:
                M_RECORDS.labels(outcome="lost").inc()
                if ro is not None:
                    ro.lost.append(rec.msg_id())
            else:
                M_RECORDS.labels(outcome="published").inc()
                M_PUBLISH_S.observe(seconds)
            if ro is not None:
                ro.acked += 1
        self._unacked -= len(batch)
        M_BUFFERED.set(self._unacked)
        async with self._progress:
            self._progress.notify_all()

    # -- flushing ---------------------------------------------------------------------------

    def _settled(self, rollout_id: str | None, wait_open: bool) -> bool:
        if rollout_id is None:
            return self._unacked == 0 and (
                not wait_open or all(r.open == 0 for r in self.rollouts.values())
            )
        ro = self.rollouts.get(rollout_id)
        return ro is None or (ro.acked == ro.recorded and (not wait_open or ro.open == 0))

    async def flush(
        self, rollout_id: str | None = None, timeout: float | None = None, wait_open: bool = True
    ) -> int:
        """Wait until every record of ``rollout_id`` (default: all) is acknowledged by the bus,
        including calls still in flight unless ``wait_open`` is false. Returns the rollout's
        number of records. Raises ``TimeoutError``, ``RecordLost``, or ``BusUnavailable`` at
        once when the process is stopping and NATS is unreachable (``Bus.abandoned``: nothing
        can be stored any more)."""

        async def settled() -> None:
            async with self._progress:
                await self._progress.wait_for(lambda: self._settled(rollout_id, wait_open))

        if not self._settled(rollout_id, wait_open):
            if self._task is None:
                raise RuntimeError("Recorder.start() was not called: nothing publishes")
            done = asyncio.ensure_future(settled())
            away = asyncio.ensure_future(self.bus.abandoned())
            try:
                await asyncio.wait(
                    {done, away}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for f in (done, away):
                    f.cancel()
            if not self._settled(rollout_id, wait_open):
                if away.done() and not away.cancelled():
                    raise BusUnavailable(
                        f"{self._unacked} call records not stored: NATS is unreachable and "
                        "this process is stopping"
                    )
                raise TimeoutError
        if rollout_id is None:
            return sum(r.acked for r in self.rollouts.values())
        ro = self.rollouts.get(rollout_id) or _Rollout()
        if ro.lost:
            raise RecordLost(f"records of {rollout_id} could not be stored: {', '.join(ro.lost)}")
        return ro.acked

    def forget(self, rollout_id: str) -> None:
        """Drop a finished rollout's state (the ids kept for deltas) once nothing is pending."""
        ro = self.rollouts.get(rollout_id)
        if ro is not None and ro.open == 0 and ro.acked == ro.recorded:
            del self.rollouts[rollout_id]
