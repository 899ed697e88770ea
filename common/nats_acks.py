"""Pipelined JetStream publish acks on one inbox subscription per connection
(``JetStreamBus.publish_many``)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from typing import Any

import msgspec
import nats.errors

from harnessrl.common.bus import BusError
from harnessrl.common.records import Scattered


class PubAck(msgspec.Struct):
    """JetStream's answer to a publish (``{"stream", "seq", "duplicate"}`` or ``{"error"}``)."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(PubAck)


class Acks:
    """Publishes whose JetStream acks arrive on one inbox subscription of the connection.

    What nats-py's ``publish_async`` does, at a fraction of its cost per record (no semaphore,
    no random token, no done-callback, acks parsed by msgspec): the pipelined publish's floor
    is then the core client's ``publish``. A future resolves to a ``PubAck`` or fails with
    ``BusError`` (an error ack, no responders, an unreadable ack): the caller retries such a
    record with ``publish_bytes`` under the same msg id, which tells a refusal from an outage."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.prefix = ""
        self.futures: dict[str, asyncio.Future[PubAck]] = {}
        self.tokens: dict[asyncio.Future[PubAck], str] = {}
        self.next = 0

    async def send(
        self, subject: str, data: Any, headers: dict[str, str] | None
    ) -> asyncio.Future[PubAck]:
        """Publish ``data`` with a reply inbox; the returned future resolves with its ack."""
        if not self.prefix:
            prefix = f"{self.nc.new_inbox()}."
            await self.nc.subscribe(prefix + "*", cb=self._on_ack)
            self.prefix = prefix
        self.next += 1
        token = str(self.next)
        fut: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self.futures[token] = fut
        self.tokens[fut] = token
        try:
            if isinstance(data, Scattered):
                await publish_scattered(self.nc, subject, data, self.prefix + token, headers)
            else:
                await self.nc.publish(subject, data, reply=self.prefix + token, headers=headers)
        except BaseException:
            self.drop([fut])
            raise
        return fut

    def drop(self, futures: Iterable[asyncio.Future[PubAck]]) -> None:
        """Stop waiting for these acks (a late one is then ignored)."""
        for fut in list(futures):
            self.futures.pop(self.tokens.pop(fut, ""), None)
            fut.cancel()

    async def _on_ack(self, msg: Any) -> None:
        fut = self.futures.pop(msg.subject[len(self.prefix) :], None)
        if fut is None:
            return
        self.tokens.pop(fut, None)
        if fut.done():
            return
        try:
            ack = _ack_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            status = (msg.headers or {}).get("Status", "")
            fut.set_exception(BusError(f"no JetStream ack (status {status!r})"))
            return
        if ack.error is not None:
            fut.set_exception(BusError(f"publish refused: {ack.error}"))
        else:
            fut.set_result(ack)


_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_CLIENT_PARTS = ("_pending", "_pending_data_size", "_max_pending_size", "_flush_queue", "stats")


async def publish_scattered(
    nc: Any, subject: str, data: Scattered, reply: str, headers: dict[str, str] | None
) -> None:
    """``nc.publish`` of ``data``'s joined bytes without joining them: the HPUB line, headers
    and ``data.head`` go out as one small buffer, ``data.body`` as a view of itself (the
    transport writes the pieces with one writev). nats-py joins the line, headers and payload
    into one new bytes (two copies of a 1 MiB weight chunk); this queues the same bytes on the
    client's pending list in one step (no other publish can come between them), through the
    client's private write path. A client without that path gets the joined bytes."""
    if not all(hasattr(nc, a) for a in _CLIENT_PARTS) or not nc.is_connected:
        await nc.publish(subject, data.join(), reply=reply, headers=headers)
        return
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    size = data.nbytes
    if size > nc.max_payload:
        raise nats.errors.MaxPayloadError
    hdr = [b"NATS/1.0\r\n"]
    for k, v in (headers or {}).items():  # as nats-py writes them
        if not _HEADER_KEY.fullmatch(k.strip()):
            raise nats.errors.BadHeaderError(k)
        hdr.append(f"{k.strip()}: {v.strip().translate(_NEWLINES)}\r\n".encode())
    hdr.append(b"\r\n")
    head = b"".join(hdr)
    line = f"HPUB {subject} {reply} {len(head)} {len(head) + size}\r\n".encode()
    parts = (line + head + data.head, data.body, b"\r\n")
    nc._pending.extend(parts)
    nc._pending_data_size += len(parts[0]) + len(data.body) + 2
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += size
    if nc._max_pending_size > 0 and nc._pending_data_size > nc._max_pending_size:
        await nc._flush_pending(force_flush=True)
    elif nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
