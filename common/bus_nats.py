"""JetStream implementation of ``harnessrl.common.bus.Bus`` (nats-py)."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import datetime
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from harnessrl.common.bus import (
    M_DUPLICATES,
    M_PUBLISH_RETRIES,
    M_PUBLISHED,
    STREAMS,
    Bus,
    BusConnectError,
    BusError,
    Consumer,
    ConsumerState,
    PayloadTooLarge,
    PermissionDenied,
    PubResult,
    R,
)
from harnessrl.common.nats_acks import Acks
from harnessrl.common.nats_guards import Denials, Outage, refusal
from harnessrl.common.records import (
    Record,
    Scattered,
    encode_many,
    wire_size,
)

log = logging.getLogger("harnessrl.bus")


class _QuietTLSClose(logging.Filter):
    """asyncio warns on every TLS connection nats-py closes ("returning true from
    eof_received() has no effect when using ssl"): harmless, and noise in every log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_QuietTLSClose())

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

    def __init__(
        self,
        nc: Any,
        run: str,
        *,
        publish_timeout: float,
        duplicate_window: float,
        denials: Denials | None = None,
        stream_wait_s: float = 60.0,
        replicas: int = 1,
        outage: Outage | None = None,
    ):
        user = str(nc.options.get("user") or "")
        super().__init__(run, user or "local")
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        self.publish_timeout = publish_timeout
        self.duplicate_window = duplicate_window
        self.denials = denials or Denials()
        self.stream_wait_s = stream_wait_s
        self.replicas = replicas
        self.outage = outage or Outage()
        self.denials.outage = self.outage
        self.acks = Acks(nc)
        self._keepers: set[asyncio.Task[None]] = set()
        """Each durable consumer's `_NatsConsumer._keep_late_alive`, cancelled on close."""

    def interrupt(self) -> None:
        super().interrupt()
        self.outage.interrupt(connected=self.nc.is_connected)

    @property
    def abandoning(self) -> bool:
        return self.outage.abandon.done()

    async def abandoned(self) -> None:
        while not self.abandoning:  # a reconnection replaces the future with a fresh one
            await asyncio.wait({self.outage.abandon})

    @classmethod
    async def connect(
        cls,
        url: str,
        run: str,
        *,
        name: str = "harnessrl",
        creds: str = "",
        ca: str = "",
        publish_timeout: float = 120.0,
        duplicate_window: float = 600.0,
        connect_timeout: float = 10.0,
        stream_wait_s: float = 60.0,
        replicas: int = 1,
    ) -> JetStreamBus:
        """Connect with unlimited reconnects (a restarted server is rejoined transparently).

        ``url`` is one server or a comma-separated list (the nodes of a cluster: the client
        connects to one and fails over to the others). ``creds`` / ``ca`` are file paths
        (``harnessrl.common.natsauth.client_options``). A server that is not up yet is waited for; one
        that refuses the credentials or the TLS handshake fails the connect at once with a
        ``BusConnectError`` naming ``name`` and ``url``. ``publish_timeout`` bounds how long one
        publish keeps retrying through an outage. ``replicas``: see `ensure_streams`.
        """
        from nats.aio.client import Client

        from harnessrl.common.config import nats_urls
        from harnessrl.common.files import SecretFileError
        from harnessrl.common.natsauth import client_options

        try:
            servers = nats_urls(url)
            opts = client_options(creds, ca, servers[0])
        except (SecretFileError, ValueError) as e:
            raise BusConnectError(f"{name}: cannot connect to NATS at {url}: {e}") from None
        denials = Denials(str(opts.get("user", "")))
        outage = Outage()
        refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def on_err(e: Exception) -> None:
            text = str(e)
            if denials.report(text):
                return
            why = refusal(e, creds, ca)
            if why and not refused.done():
                refused.set_result(why)
            log.debug("nats: %s", text)

        nc = Client()
        attempt = asyncio.ensure_future(
            nc.connect(
                servers,
                name=name,
                connect_timeout=connect_timeout,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                error_cb=on_err,
                disconnected_cb=outage.disconnected,
                reconnected_cb=outage.reconnected,
                pending_size=256 * 1024 * 1024,
                **opts,
            )
        )
        try:
            await asyncio.wait({attempt, refused}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            attempt.cancel()
            raise
        if not attempt.done() or attempt.exception() is not None:
            attempt.cancel()
            with contextlib.suppress(BaseException):
                await attempt
            with contextlib.suppress(Exception):
                await nc.close()
            why = refused.result() if refused.done() else repr(attempt.exception())
            raise BusConnectError(f"{name}: cannot connect to NATS at {url}: {why}")
        return cls(
            nc,
            run,
            publish_timeout=publish_timeout,
            duplicate_window=duplicate_window,
            denials=denials,
            stream_wait_s=stream_wait_s,
            replicas=replicas,
            outage=outage,
        )

    @property
    def user(self) -> str:
        """The NATS user this connection authenticated as ("" without user/password)."""
        return str(self.nc.options.get("user") or "")

    @property
    def authenticated(self) -> bool:
        return bool(self.user)

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
            num_replicas=self.replicas,
        )

    async def ensure_streams(self, kinds: Iterable[str] | None = None) -> None:
        """Create each stream, or update one whose settings differ; a credential that may not
        manage streams (every role but admin) waits up to ``stream_wait_s`` for the stream to
        exist instead, and uses it as it is.

        ``replicas`` (set at connect; 1, 3 or 5) is the least number of cluster nodes that keep
        each stream: a stream is created with it, an existing one with fewer is raised to it,
        and one with more keeps them (lowering is the operator's deliberate act, never a side
        effect of a process started with the default). JetStream that cannot serve yet (a
        cluster without a majority of its nodes up, or too few nodes up to place the replicas)
        is waited for up to ``stream_wait_s``; a single server asked for more than one replica
        is refused at once, with a ``BusError`` that says so."""
        for kind in kinds or STREAMS:
            cfg = self._stream_config(kind)
            deadline = time.monotonic() + self.stream_wait_s
            while True:
                try:
                    await self._ensure_stream(cfg)
                    break
                except (*_TRANSIENT, nats.js.errors.APIError) as e:
                    why = self._unplaced(cfg, e)
                    if time.monotonic() > deadline:
                        raise BusError(f"cannot create stream {cfg.name}: {why}") from None
                    await asyncio.sleep(0.25)

    def _unplaced(self, cfg: api.StreamConfig, e: Exception) -> str:
        """Why creating ``cfg`` failed, when waiting may cure it; raises otherwise."""
        code, n = getattr(e, "err_code", None), cfg.num_replicas
        if code == _JS_NOT_CLUSTERED:
            raise BusError(
                f"stream {cfg.name}: {n} replicas need a JetStream cluster, and the server at "
                f"{self._where()} is a single server: set the stream replicas to 1, or start "
                "the nodes as a cluster "
                "(harnessrl nats --cluster-name NAME --cluster-port PORT --routes HOST:PORT ...)"
            ) from None
        if code == _JS_NO_PEERS:
            return (
                f"{n} replicas need {n} JetStream servers up in the cluster, and the server "
                "finds no suitable peers for them: start the cluster's other nodes, or set the "
                "stream replicas to at most the number of nodes"
            )
        if isinstance(e, nats.js.errors.APIError) and getattr(e, "code", None) != 503:
            raise e
        return f"JetStream is not available yet ({e!r})"

    def _where(self) -> str:
        u = self.nc.connected_url
        return f"{u.hostname}:{u.port}" if u is not None else "?"

    async def _ensure_stream(self, cfg: api.StreamConfig) -> None:
        info = await self._stream_info(cfg.name)
        if info is not None:
            cfg.num_replicas = max(cfg.num_replicas or 1, info.config.num_replicas or 1)
            if _same_stream(info.config, cfg):
                return
        try:
            await self._api(cfg.name, self._create_or_update(cfg, exists=info is not None))
        except PermissionDenied:
            if info is None:
                await self._await_stream(cfg.name)
            else:
                msg = "stream %s differs from these settings; user %r may not update it: as it is"
                log.info(msg, cfg.name, self.user)

    async def _stream_info(self, name: str) -> Any:
        try:
            return await self._api(name, self.js.stream_info(name))
        except nats.js.errors.NotFoundError:
            return None

    async def _create_or_update(self, cfg: api.StreamConfig, exists: bool) -> None:
        if exists:
            await self.js.update_stream(cfg)
            return
        try:
            await self.js.add_stream(cfg)
        except nats.js.errors.BadRequestError as e:
            if getattr(e, "err_code", None) != 10058:  # 10058: exists with another config
                raise
            await self._ensure_stream(cfg)  # made meanwhile by another process: compare again

    async def _await_stream(self, name: str) -> None:
        deadline = time.monotonic() + self.stream_wait_s
        log.info("stream %s does not exist yet; waiting for an admin to create it", name)
        while await self._stream_info(name) is None:
            if time.monotonic() > deadline:
                raise BusError(
                    f"stream {name} does not exist and NATS user {self.user!r} may not create it: "
                    f"start the server with `harnessrl nats --runs {self.run}` (it creates the "
                    "run's streams) or create them with the admin credentials"
                )
            await asyncio.sleep(0.5)

    async def _api(self, stream: str, coro: Any) -> Any:
        """A JetStream API call about ``stream``, failing fast with ``PermissionDenied`` when the
        server refuses it (a refused request otherwise only times out)."""
        token = "." + stream.lower()
        return await self.denials.guard(
            lambda s: s.startswith("$js.api.") and (token + "." in s or s.endswith(token)), coro
        )

    # -- publish --------------------------------------------------------------------------

    def _headers(self, msg_id: str | None) -> dict[str, str] | None:
        return {"Nats-Msg-Id": msg_id} if msg_id else None

    def _check_size(self, subject: str, data: bytes | Scattered) -> None:
        limit, size = self.nc.max_payload, wire_size(data)
        if limit and size + 256 > limit:
            raise PayloadTooLarge(
                f"record of {size} bytes on {subject} exceeds the server's max_payload "
                f"({limit} bytes); split it or raise max_payload"
            )

    async def publish_bytes(
        self, subject: str, data: bytes | Scattered, msg_id: str | None
    ) -> PubResult:
        self._check_size(subject, data)
        data = data.join() if isinstance(data, Scattered) else data
        deadline = time.monotonic() + self.publish_timeout
        delay = 0.05
        while True:
            self.outage.check(f"publish to {subject}")
            try:
                ack = await self.denials.guard_subject(
                    subject,
                    self.js.publish(subject, data, timeout=5.0, headers=self._headers(msg_id)),
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

    max_in_flight_bytes: int = 64 << 20
    """``publish_many``: payload bytes published but not yet acked, at most (the oldest ack is
    awaited before more is sent), so a large batch (a weight version) never buffers whole."""
    ack_timeout: float = 10.0
    """``publish_many``: how long an ack may take before that record is re-published
    synchronously with the same msg id (a de-duplicated retry, never a duplicate)."""
    _BATCH = 64  # records encoded per worker-thread call
    _AHEAD = 3
    """``publish_many``: batches handed to the worker threads before the first is sent, and kept
    that many ahead. With one, the thread that encodes (its msgpack part holding the GIL
    against the sending loop) set the pace: 20k records/s against 22k with three (raw nats-py,
    given the bytes: 32k; ``benchmarks/bus_throughput.py``)."""

    async def publish_many(self, items):  # type: ignore[override]
        """Pipelined publish at the raw client's cost per record: records are encoded (and
        zstd-framed) in worker threads ``_AHEAD`` batches ahead while a batch is sent (a
        call of a few small records on the loop: `_prepare_soon`), each with its ack inbox
        (`harnessrl.common.nats_acks.Acks`); at most ``max_in_flight_bytes`` are unacked at a time.
        Acks are awaited together, raced once per call against a permission violation or an
        abandoned outage. A record is reported done only once JetStream acked it: a missing or
        failed ack is retried with ``publish_bytes`` under the same msg id (never a duplicate),
        which raises ``BusError`` on a refusal; ``PermissionDenied`` and ``PayloadTooLarge``
        are raised as they are."""
        items = list(items)
        if not items:
            return []
        first = min(8, self._BATCH)  # a small first batch: sending starts early
        parts = [items[:first]] + [
            items[i : i + self._BATCH] for i in range(first, len(items), self._BATCH)
        ]
        ahead = collections.deque(
            self._prepare_soon(part, len(parts) == 1) for part in parts[: self._AHEAD]
        )
        sent: list[tuple[tuple[str, Any, str | None], Any]] = []
        window: collections.deque[tuple[Any, int]] = collections.deque()
        in_flight = 0
        for i in range(len(parts)):
            prepared = await ahead.popleft()
            if i + self._AHEAD < len(parts):
                ahead.append(self._prepare_soon(parts[i + self._AHEAD], False))
            self.outage.check("publish")
            for item in prepared:
                while window and in_flight > self.max_in_flight_bytes:
                    fut, size = window.popleft()
                    in_flight -= size
                    if (
                        not fut.done()
                        and not (await asyncio.wait({fut}, timeout=self.ack_timeout))[0]
                    ):
                        window.clear()  # acks stalled (an outage): collected, retried below
                        in_flight = 0
                subject, data, msg_id = item
                try:
                    fut = await self.acks.send(subject, data, self._headers(msg_id))
                except _TRANSIENT:
                    fut = None
                else:
                    size = wire_size(data)
                    window.append((fut, size))
                    in_flight += size
                sent.append((item, fut))
        return await self._collect(sent)

    _INLINE = 8
    """``publish_many``: a call of at most this many records, none of them a buffer to scatter
    (a weight chunk), is encoded on the loop: the worker thread's hop costs ~70 us of CPU,
    more than encoding a call record (a proxy publishes one per model call)."""

    def _prepare_soon(self, part: list, whole: bool) -> asyncio.Future[Any]:
        """`_prepare` of ``part``: in a worker thread, or on the loop (a done future) when it
        is the whole of a small call (see ``_INLINE``)."""
        loop = asyncio.get_running_loop()
        if (
            not whole
            or len(part) > self._INLINE
            or any(getattr(rec, "SCATTER", None) for _, rec, _ in part)
        ):
            return loop.run_in_executor(None, self._prepare, part)
        fut = loop.create_future()
        try:
            fut.set_result(self._prepare(part))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def _prepare(self, part: list) -> list[tuple[str, Any, str | None]]:
        """Encode one batch (worker thread: zstd releases the GIL) and check sizes."""
        datas = encode_many([rec for _, rec, _ in part])
        out = []
        for (subject, rec, msg_id), data in zip(part, datas, strict=True):
            if msg_id is None and isinstance(rec, Record):
                msg_id = rec.msg_id()
            self._check_size(subject, data)
            out.append((subject, data, msg_id))
        return out

    async def _collect(
        self, sent: list[tuple[tuple[str, Any, str | None], Any]]
    ) -> list[PubResult]:
        """The acks of ``sent``, in order; retries what has none (see `publish_many`)."""
        waiting = {f for _, f in sent if f is not None and not f.done()}
        if waiting:
            subjects = {s.lower() for (s, _, _), _ in sent}
            if subjects & self.denials.seen:
                raise PermissionDenied(
                    self.denials._message(f"publish to {min(subjects & self.denials.seen)!r}")
                )
            try:
                await self.denials.wait(subjects.__contains__, waiting, self.ack_timeout)
            finally:
                self.acks.drop(f for f in waiting if not f.done())
        out: list[PubResult] = []
        counts: collections.Counter[tuple[str, bool]] = collections.Counter()
        for (subject, data, msg_id), fut in sent:
            if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
                ack = fut.result()
                res = PubResult(ack.seq, bool(ack.duplicate))
            else:  # no ack, or an error ack: retry synchronously with the same id
                res = await self.publish_bytes(subject, data, msg_id)
            counts[subject, res.duplicate] += 1
            out.append(res)
        for (subject, dup), n in counts.items():
            kind = self.subjects.kind_of(subject)
            (M_DUPLICATES if dup else M_PUBLISHED).labels(stream=kind).inc(n)
        return out

    # -- consume --------------------------------------------------------------------------

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
        before = await self.consumer_state(kind, durable)
        try:  # DURABLE.CREATE: creates it, or updates the settings JetStream lets change
            await self._api(stream, self.js.add_consumer(stream, cfg))
        except nats.js.errors.BadRequestError as e:
            if before is None:
                raise BusError(f"cannot create consumer {durable} on {stream}: {e}") from None
            log.info("consumer %s on %s keeps its settings (%s)", durable, stream, e.description)
            return []
        if before is None:
            return ["created"]
        want = {
            "filter_subject": subject,
            "ack_wait": float(ack_wait),
            "max_ack_pending": max_ack_pending,
        }
        return [k for k, v in want.items() if getattr(before, k) != v]

    async def consumer_state(self, kind: str, durable: str) -> ConsumerState | None:
        stream = self.subjects.stream(kind)
        try:
            info = await self._api(stream, self.js.consumer_info(stream, durable))
        except nats.js.errors.NotFoundError:
            return None
        c = info.config
        return ConsumerState(
            filter_subject=c.filter_subject or "",
            ack_wait=float(c.ack_wait or 30.0),
            max_ack_pending=int(c.max_ack_pending or 0),
            pending=int(info.num_pending or 0),
            ack_pending=int(info.num_ack_pending or 0),
            waiting=int(info.num_waiting or 0),
            delivered=int(info.delivered.consumer_seq if info.delivered else 0),
            paused=bool(info.paused),
        )

    async def _bind(
        self, kind: str, durable: str, record_type: type[R], ack_wait: float
    ) -> Consumer[R]:
        stream = self.subjects.stream(kind)
        psub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        consumer = _NatsConsumer(self, kind, durable, record_type, ack_wait, psub)
        self._keepers.add(consumer._keeper)
        consumer._keeper.add_done_callback(self._keepers.discard)
        return consumer

    async def read_subject_batches(
        self,
        subject: str,
        record_type: type[R],
        *,
        dead_letter_as: str | None = None,
        batch: int = 256,
        reject: Callable[[str], str] | None = None,
    ) -> AsyncIterator[list[R]]:
        kind = self.subjects.kind_of(subject)
        stream = self.subjects.stream(kind)
        cfg = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=subject,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        psub = await self._api(
            stream, self.js.pull_subscribe(subject, durable=None, stream=stream, config=cfg)
        )
        try:
            info = await psub.consumer_info()
            remaining = info.num_pending or 0
            while remaining > 0:
                try:
                    msgs = await psub.fetch(min(remaining, batch), timeout=5.0)
                except nats.errors.TimeoutError:
                    break
                out: list[R] = []
                for m in msgs:
                    remaining = m.metadata.num_pending
                    seq = m.metadata.sequence.stream
                    rec = await self._read_one(
                        m.subject, seq, m.data, record_type, dead_letter_as, reject
                    )
                    if rec is not None:
                        out.append(rec)
                if not msgs:
                    break
                yield out
        finally:
            try:
                await self.js.delete_consumer(stream, info.name)  # type: ignore[possibly-undefined]
            except Exception:
                pass
            await psub.unsubscribe()

    async def stored(
        self, subject: str, *, since: float | None = None, first: int = 1, upto: int | None = None
    ) -> list[tuple[int, bytes]]:
        stream = self.subjects.stream(self.subjects.kind_of(subject))
        req: dict[str, Any] = {"seq": max(1, first), "next_by_subj": subject}
        if since is not None:  # the first message stored at or after ``since``
            at = datetime.datetime.fromtimestamp(since, datetime.UTC)
            req = {"start_time": at.isoformat().replace("+00:00", "Z"), "next_by_subj": subject}
        out: list[tuple[int, bytes]] = []
        while (m := await self._msg_get(stream, req)) is not None:
            seq = int(m["seq"])
            if upto is not None and seq > upto:
                break
            if seq >= first:
                out.append((seq, base64.b64decode(m.get("data") or "")))
            req = {"seq": seq + 1, "next_by_subj": subject}
        return out

    async def _msg_get(self, stream: str, req: dict[str, Any]) -> dict[str, Any] | None:
        """One ``STREAM.MSG.GET`` (None: no such message)."""
        api_subject = f"$JS.API.STREAM.MSG.GET.{stream}"
        call = self.nc.request(api_subject, json.dumps(req).encode(), timeout=10.0)
        resp = json.loads((await self._api(stream, call)).data)
        err = resp.get("error")
        if err:
            if err.get("code") == 404:
                return None
            raise BusError(f"reading {stream}: {err.get('description', err)}")
        return resp["message"]

    async def purge(self, kind: str, subject: str | None = None) -> None:
        stream = self.subjects.stream(kind)
        await self._api(stream, self.js.purge_stream(stream, subject=subject))

    async def stream_count(self, kind: str, subject: str | None = None) -> int:
        stream = self.subjects.stream(kind)
        info = await self._api(stream, self.js.stream_info(stream, subjects_filter=subject))
        if subject is None:
            return info.state.messages
        return sum((info.state.subjects or {}).values())

    async def close(self) -> None:
        # flush (publishes reach the server) then close; drain() would wait up to its 30 s
        # timeout on idle pull subscriptions. Nothing can be flushed to a server that is away.
        for task in list(self._keepers):
            task.cancel()
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            try:
                await self.nc.flush(timeout=5)
            except Exception as e:
                log.debug("flush before close failed: %r", e)
        self.outage.closing = True
        if not self.nc.is_connected:
            # What nats-py buffered since the server left (heartbeats, acks) can never be sent,
            # and its close writes it to the transport of the lost connection: on TLS one
            # already closed, which raises AttributeError ('_write_appdata' of None).
            self.nc._pending, self.nc._pending_data_size = [], 0
        try:
            await self.nc.close()
        except (RuntimeError, OSError) as e:  # the lost transport refusing a write (RuntimeError
            # on uvloop) or its reconnect's reset re-raised (OSError on the default asyncio
            # loop, which actors run on)
            log.debug("closing a connection whose server is away: %r", e)


class _NatsConsumer(Consumer[R]):
    def __init__(self, bus, kind, durable, record_type, ack_wait, psub) -> None:
        super().__init__(bus, kind, durable, record_type, ack_wait)
        self.psub = psub
        self._held: list[Any] = []
        """Deliveries beyond an earlier fetch's batch, handed out first (see `_at_most`)."""
        self._fetching = 0
        """Fetches running now (nats-py owns its queue meanwhile)."""
        self._keeper = asyncio.get_running_loop().create_task(self._keep_late_alive())

    async def _fetch_raw(self, batch: int, timeout: float) -> list[Any]:
        self._collect_late()
        if self._held:  # deliveries that came late to an earlier fetch go first
            got, self._held = self._held[:batch], self._held[batch:]
            await self._keep_alive(self._held)
            return got
        self._fetching += 1
        try:
            got = await self.psub.fetch(batch, timeout=timeout)
        except nats.errors.TimeoutError:
            return []
        except (*_TRANSIENT, nats.js.errors.ServiceUnavailableError) as e:
            # 503: the consumer has no leader right now (a cluster node died and its Raft group
            # is electing another); it answers again once one is elected
            log.debug("fetch failed (%r); will retry", e)
            await asyncio.sleep(min(timeout, 0.25))
            return []
        finally:
            self._fetching -= 1
        return await self._at_most(got, batch)

    def _collect_late(self) -> None:
        """Move deliveries waiting in nats-py's queue (replies to a pull request that came
        after its fetch gave up) into `_held`; status messages meant for old requests are
        dropped. Nothing is taken while a fetch runs: the queue is then nats-py's."""
        sub = getattr(self.psub, "_sub", None)
        queue = getattr(sub, "_pending_queue", None)
        if self._fetching or queue is None:
            return
        while not queue.empty():
            msg = queue.get_nowait()
            queue.task_done()
            sub._pending_size -= len(msg.data)  # type: ignore[union-attr]
            if not JetStreamContext.is_status_msg(msg):
                self._held.append(msg)

    async def _keep_late_alive(self) -> None:
        """Between fetches, keep late deliveries alive (`_collect_late`, then ``in_progress``
        every third of ``ack_wait``). A consumer whose owner does not fetch for minutes (an
        actor with every slot busy) would otherwise let them lapse: JetStream redelivers them
        elsewhere while this process still holds its copies, and both run them."""
        every = max(0.2, self.ack_wait / 3)
        while not self.bus.nc.is_closed:
            await asyncio.sleep(every)
            try:
                self._collect_late()
                if not self._fetching:
                    await self._keep_alive(self._held)
            except Exception as e:  # best effort, like every heartbeat
                log.debug("keeping late deliveries alive failed: %r", e)

    async def _at_most(self, got: list[Any], batch: int) -> list[Any]:
        """The first ``batch`` of ``got``; the rest is held for the next fetch.

        Replies to a pull request that arrive after its fetch gave up (a busy machine, a slow
        link) wait in the subscription's queue, and nats-py's next fetch returns all of them
        whatever its batch: an actor would run more rollouts than its slots. They are this
        consumer's deliveries all the same, so they are kept (alive: ``in_progress`` now and
        at every fetch until handed out) rather than released, which would count a delivery
        against the task's attempts each time a busy machine is late again.
        """
        self._held.extend(got[batch:])
        await self._keep_alive(got[batch:])
        return got[:batch]

    async def _keep_alive(self, raws: list[Any]) -> None:
        for raw in raws:
            try:
                await raw.in_progress()
            except Exception as e:  # redelivered after ack_wait at worst
                log.debug("in_progress of a held delivery failed: %r", e)

    def _meta(self, raw: Any) -> tuple[str, int, int, int]:
        md = raw.metadata
        return raw.subject, md.sequence.stream, md.num_delivered, md.num_pending

    def _raw_data(self, raw: Any) -> bytes:
        return raw.data

    async def _ack_raw(self, raw: Any) -> None:
        # ack_sync waits for the server: an ack we report done is not lost on a crash
        await self.bus.outage.race(raw.ack_sync(timeout=5.0), "ack")

    async def _nak_raw(self, raw: Any, delay: float | None) -> None:
        await raw.nak(delay=delay)

    async def _term_raw(self, raw: Any) -> None:
        await raw.term()

    async def _in_progress_raw(self, raw: Any) -> None:
        await raw.in_progress()

    async def pending(self) -> int:
        info = await self.psub.consumer_info()
        return int(info.num_pending or 0)


# JetStream API error codes (nats-server's errors.json)
_JS_NO_PEERS = 10005  # "no suitable peers for placement"
_JS_NOT_CLUSTERED = 10074  # "replicas > 1 not supported in non-clustered mode"

_COMPARED = (
    "num_replicas",
    "subjects",
    "retention",
    "storage",
    "max_age",
    "max_msgs_per_subject",
    "duplicate_window",
    "discard",
)


def _same_stream(have: api.StreamConfig, want: api.StreamConfig) -> bool:
    """Whether a stream already has the settings this version would give it."""
    a, b = have.as_dict(), want.as_dict()

    def norm(k: str, v: Any) -> Any:
        if k == "subjects":
            return sorted(v or [])
        if hasattr(v, "value"):
            return v.value
        if k == "num_replicas":
            return v or 1
        return v or 0 if k == "max_age" else v

    return all(norm(k, a.get(k)) == norm(k, b.get(k)) for k in _COMPARED)
