"""JetStream implementation of ``common.bus.Bus`` (nats-py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from common.bus import (
    M_DUPLICATES,
    M_PUBLISH_RETRIES,
    M_PUBLISHED,
    STREAMS,
    Bus,
    BusError,
    Consumer,
    PayloadTooLarge,
    PubResult,
    R,
)
from common.records import Record, RecordDecodeError, decode, encode_many

log = logging.getLogger("harnessrl.bus")

_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
    OSError,
)


class JetStreamBus(Bus):
    """``Bus`` over a real nats-server with JetStream."""

    def __init__(self, nc: Any, run: str, *, publish_timeout: float, duplicate_window: float):
        super().__init__(run)
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        self.publish_timeout = publish_timeout
        self.duplicate_window = duplicate_window

    @classmethod
    async def connect(
        cls,
        url: str,
        run: str,
        *,
        name: str = "harnessrl",
        publish_timeout: float = 120.0,
        duplicate_window: float = 600.0,
        connect_timeout: float = 10.0,
    ) -> JetStreamBus:
        """Connect with unlimited reconnects (a restarted server is rejoined transparently).

        ``publish_timeout`` bounds how long one publish keeps retrying through an outage.
        """

        async def on_err(e: Exception) -> None:
            log.debug("nats: %s", e)

        try:
            nc = await nats.connect(
                url,
                name=name,
                connect_timeout=connect_timeout,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                error_cb=on_err,
                pending_size=256 * 1024 * 1024,
            )
        except Exception as e:
            raise BusError(f"cannot connect to NATS at {url}: {e}") from None
        return cls(nc, run, publish_timeout=publish_timeout, duplicate_window=duplicate_window)

    # -- streams --------------------------------------------------------------------------

    def _stream_config(self, kind: str) -> api.StreamConfig:
        spec = STREAMS[kind]
        return api.StreamConfig(
            name=self.subjects.stream(kind),
            subjects=[t.format(run=self.run) for t in spec.subjects],
            retention=api.RetentionPolicy.WORK_QUEUE
            if spec.work_queue
            else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=spec.max_age_s or None,
            max_msgs_per_subject=spec.max_msgs_per_subject,
            duplicate_window=self.duplicate_window,
            discard=api.DiscardPolicy.OLD,
        )

    async def ensure_streams(self, kinds: Iterable[str] | None = None) -> None:
        for kind in kinds or STREAMS:
            cfg = self._stream_config(kind)
            for attempt in range(20):
                try:
                    try:
                        await self.js.add_stream(cfg)
                    except nats.js.errors.BadRequestError as e:
                        # exists with another config (e.g. max_age changed): update it
                        if getattr(e, "err_code", None) == 10058:
                            await self.js.update_stream(cfg)
                        else:
                            raise
                    break
                except _TRANSIENT as e:
                    if attempt == 19:
                        raise BusError(f"cannot create stream {cfg.name}: {e}") from None
                    await asyncio.sleep(0.25)

    # -- publish --------------------------------------------------------------------------

    def _headers(self, msg_id: str | None) -> dict[str, str] | None:
        return {"Nats-Msg-Id": msg_id} if msg_id else None

    def _check_size(self, subject: str, data: bytes) -> None:
        limit = self.nc.max_payload
        if limit and len(data) + 256 > limit:
            raise PayloadTooLarge(
                f"record of {len(data)} bytes on {subject} exceeds the server's max_payload "
                f"({limit} bytes); split it or raise max_payload"
            )

    async def publish_bytes(self, subject: str, data: bytes, msg_id: str | None) -> PubResult:
        self._check_size(subject, data)
        deadline = time.monotonic() + self.publish_timeout
        delay = 0.05
        while True:
            try:
                ack = await self.js.publish(
                    subject, data, timeout=5.0, headers=self._headers(msg_id)
                )
                return PubResult(ack.seq, bool(ack.duplicate))
            except nats.js.errors.APIError as e:
                if getattr(e, "code", None) == 503:  # JetStream temporarily unavailable
                    err: Exception = e
                else:
                    raise BusError(f"publish to {subject} refused: {e}") from None
            except _TRANSIENT as e:
                err = e
            if time.monotonic() > deadline:
                raise BusError(f"publish to {subject} failed for {self.publish_timeout}s: {err!r}")
            M_PUBLISH_RETRIES.labels(stream=self.subjects.kind_of(subject)).inc()
            log.debug("publish to %s retrying after %r", subject, err)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def publish_many(self, items):  # type: ignore[override]
        """Pipelined publish: records are encoded/compressed in a worker thread one chunk ahead
        while the previous chunk is published with ``publish_async``; failed acks fall back to
        ``publish`` with the same msg id (never a duplicate)."""
        items = list(items)
        loop = asyncio.get_running_loop()
        chunk = 64

        def prep(part: list) -> list[tuple[str, bytes, str | None]]:
            recs = [rec for _, rec, _ in part]
            datas = encode_many(recs)
            out = []
            for (subject, rec, msg_id), data in zip(part, datas, strict=True):
                if msg_id is None and isinstance(rec, Record):
                    msg_id = rec.msg_id()
                out.append((subject, data, msg_id))
            return out

        parts = [items[i : i + chunk] for i in range(0, len(items), chunk)]
        pending = loop.run_in_executor(None, prep, parts[0]) if parts else None
        sent: list[tuple[tuple[str, bytes, str | None], Any]] = []
        for i in range(len(parts)):
            prepared = await pending  # type: ignore[misc]
            if i + 1 < len(parts):
                pending = loop.run_in_executor(None, prep, parts[i + 1])
            for subject, data, _ in prepared:
                self._check_size(subject, data)
            for item in prepared:
                subject, data, msg_id = item
                try:
                    fut = await self.js.publish_async(subject, data, headers=self._headers(msg_id))
                except _TRANSIENT + (nats.js.errors.TooManyStalledMsgsError,):
                    fut = None
                sent.append((item, fut))
        return await self._collect(sent)

    async def _collect(
        self, sent: list[tuple[tuple[str, bytes, str | None], Any]]
    ) -> list[PubResult]:
        out: list[PubResult] = []
        for (subject, data, msg_id), fut in sent:
            res = None
            if fut is not None:
                try:
                    if not fut.done():
                        await asyncio.wait_for(asyncio.shield(fut), 10.0)
                    ack = fut.result()
                    res = PubResult(ack.seq, bool(ack.duplicate))
                except Exception:
                    res = None
            if res is None:  # retry synchronously with the same id: never a duplicate
                res = await self.publish_bytes(subject, data, msg_id)
            kind = self.subjects.kind_of(subject)
            (M_DUPLICATES if res.duplicate else M_PUBLISHED).labels(stream=kind).inc()
            out.append(res)
        return out

    # -- consume --------------------------------------------------------------------------

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
        stream = self.subjects.stream(kind)
        subject = filter_subject or STREAMS[kind].subjects[0].format(run=self.run)
        cfg = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
            deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=subject,
        )
        try:
            await self.js.add_consumer(stream, cfg)
        except nats.js.errors.BadRequestError as e:
            try:  # exists with other settings: bind to it as it is
                await self.js.consumer_info(stream, durable)
            except nats.js.errors.NotFoundError:
                raise BusError(f"cannot create consumer {durable} on {stream}: {e}") from None
        psub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        return _NatsConsumer(self, kind, durable, record_type, ack_wait, psub)

    async def read_subject(self, subject: str, record_type: type[R]) -> list[R]:
        kind = self.subjects.kind_of(subject)
        stream = self.subjects.stream(kind)
        cfg = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=subject,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        psub = await self.js.pull_subscribe(subject, durable=None, stream=stream, config=cfg)
        out: list[R] = []
        try:
            info = await psub.consumer_info()
            remaining = info.num_pending or 0
            while remaining > 0:
                try:
                    msgs = await psub.fetch(min(remaining, 256), timeout=5.0)
                except nats.errors.TimeoutError:
                    break
                for m in msgs:
                    remaining = m.metadata.num_pending
                    try:
                        out.append(decode(m.data, record_type))
                    except RecordDecodeError as e:
                        log.warning("skipping undecodable message on %s: %s", subject, e)
                if not msgs:
                    break
        finally:
            try:
                await self.js.delete_consumer(stream, info.name)  # type: ignore[possibly-undefined]
            except Exception:
                pass
            await psub.unsubscribe()
        return out

    async def purge(self, kind: str, subject: str | None = None) -> None:
        await self.js.purge_stream(self.subjects.stream(kind), subject=subject)

    async def stream_count(self, kind: str, subject: str | None = None) -> int:
        info = await self.js.stream_info(self.subjects.stream(kind), subjects_filter=subject)
        if subject is None:
            return info.state.messages
        return sum((info.state.subjects or {}).values())

    async def close(self) -> None:
        # flush (publishes reach the server) then close; drain() would wait up to its 30 s
        # timeout on idle pull subscriptions
        if not self.nc.is_closed:
            try:
                await self.nc.flush(timeout=5)
            except Exception as e:
                log.debug("flush before close failed: %r", e)
            await self.nc.close()


class _NatsConsumer(Consumer[R]):
    def __init__(self, bus, kind, durable, record_type, ack_wait, psub) -> None:
        super().__init__(bus, kind, durable, record_type, ack_wait)
        self.psub = psub

    async def _fetch_raw(self, batch: int, timeout: float) -> list[Any]:
        try:
            return await self.psub.fetch(batch, timeout=timeout)
        except nats.errors.TimeoutError:
            return []
        except _TRANSIENT as e:
            log.debug("fetch failed (%r); will retry", e)
            await asyncio.sleep(min(timeout, 0.25))
            return []

    def _meta(self, raw: Any) -> tuple[str, int, int, int]:
        md = raw.metadata
        return raw.subject, md.sequence.stream, md.num_delivered, md.num_pending

    def _raw_data(self, raw: Any) -> bytes:
        return raw.data

    async def _ack_raw(self, raw: Any) -> None:
        # ack_sync waits for the server: an ack we report done is not lost on a crash
        await raw.ack_sync(timeout=5.0)

    async def _nak_raw(self, raw: Any, delay: float | None) -> None:
        await raw.nak(delay=delay)

    async def _term_raw(self, raw: Any) -> None:
        await raw.term()

    async def _in_progress_raw(self, raw: Any) -> None:
        await raw.in_progress()

    async def pending(self) -> int:
        info = await self.psub.consumer_info()
        return int(info.num_pending or 0)
