"""What a JetStream connection guards its calls with (``harnessrl.common.bus_nats``): outages a stopping
process gives up on, permission violations the server reports asynchronously, and why a
connection attempt was refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections.abc import Callable
from typing import Any

import nats.errors

from harnessrl.common.bus import BusUnavailable, PermissionDenied

log = logging.getLogger("harnessrl.bus")


# ---------------------------------------------------------------------------------------------
# outages: a stopping process never waits for an unreachable server
# ---------------------------------------------------------------------------------------------


class Outage:
    """When a stopping process stops waiting for the server (``Bus.interrupt``).

    ``abandon`` is a future that is done while the process is interrupted *and* the connection
    is down; every waiting call races it and gives up with ``BusUnavailable`` when it fires. A
    reconnection replaces it with a fresh one (calls wait for the server as usual again)."""

    def __init__(self) -> None:
        self.stopping = False
        self.connected = True
        self.closing = False
        """This process closes the connection itself (no outage to report)."""
        self.abandon: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def interrupt(self, connected: bool) -> None:
        self.stopping = True
        self.connected = connected
        self._update()

    async def disconnected(self) -> None:
        self.connected = False
        self._update()

    async def reconnected(self) -> None:
        self.connected = True
        if self.abandon.done():
            self.abandon = asyncio.get_running_loop().create_future()

    def _update(self) -> None:
        if self.stopping and not self.connected and not self.abandon.done():
            if not self.closing:
                log.info("NATS is unreachable and this process is stopping: not waiting for it")
            self.abandon.set_result(None)

    def check(self, what: str) -> None:
        """Raise ``BusUnavailable`` now if waiting is abandoned."""
        if self.abandon.done():
            raise BusUnavailable(f"{what}: NATS is unreachable and this process is stopping")

    async def race(self, coro: Any, what: str) -> Any:
        """Await ``coro`` unless waiting is (or becomes) abandoned."""
        if self.abandon.done():
            coro.close()
            self.check(what)
        abandon = self.abandon
        task = asyncio.ensure_future(coro)
        await asyncio.wait({task, abandon}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise BusUnavailable(f"{what}: NATS is unreachable and this process is stopping")


# ---------------------------------------------------------------------------------------------
# refusals: permission violations and refused connections
# ---------------------------------------------------------------------------------------------


_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"', re.I)


class Denials:
    """Permission violations the server reported on one connection.

    nats-server answers a refused publish (a JetStream API request included) with an
    asynchronous ``-ERR 'Permissions Violation for Publish to "SUBJECT"'`` and drops it, so the
    request itself would only time out (and a publish be retried for ``publish_timeout``).
    `guard` races a call against a violation on the subjects it concerns and raises
    ``PermissionDenied`` at once. The server lower-cases the subject in that message, so
    subjects are compared lower-cased."""

    def __init__(self, user: str = "") -> None:
        self.user = user
        self.waiters: list[tuple[Callable[[str], bool], asyncio.Future[str]]] = []
        self.seen: set[str] = set()
        self.outage: Outage | None = None
        """The connection's outage state: a guarded call is also given up when it abandons."""

    def report(self, text: str) -> bool:
        """Take an error of the connection; True when it was a permission violation."""
        m = _VIOLATION.search(text)
        if m is None:
            return False
        kind, subject = m.group(1).lower(), m.group(2).lower()
        if subject not in self.seen:
            self.seen.add(subject)
            log.warning("nats: permission denied: %s to %s", kind, subject)
        for match, fut in self.waiters:
            if not fut.done() and (kind == "subscription" or match(subject)):
                fut.set_result(f"{kind} to {subject!r}")
        return True

    async def guard(self, match: Callable[[str], bool], coro: Any) -> Any:
        """Await ``coro``, unless a violation on a subject ``match`` accepts comes first (or
        the connection's outage abandons waiting: ``BusUnavailable``); see `wait`."""
        task = asyncio.ensure_future(coro)
        try:
            await self.wait(match, {task}, None)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def wait(
        self, match: Callable[[str], bool], futures: set[asyncio.Future[Any]], timeout: float | None
    ) -> None:
        """Wait up to ``timeout`` s (None: no limit) for all of ``futures`` (as ``asyncio.wait``
        does), unless a violation on a subject ``match`` accepts comes first
        (``PermissionDenied``) or the connection's outage abandons waiting
        (``BusUnavailable``). No task per call: one future is set once the last of
        ``futures`` is done (a publish of one record awaited ~0.3 ms of task scheduling when
        each wait was a task)."""
        left = [f for f in futures if not f.done()]
        if not left:
            return
        loop = asyncio.get_running_loop()
        denied: asyncio.Future[str] = loop.create_future()
        entry = (match, denied)
        all_done: asyncio.Future[None] = loop.create_future()
        count = len(left)

        def one(_: asyncio.Future[Any]) -> None:
            nonlocal count
            count -= 1
            if count == 0 and not all_done.done():
                all_done.set_result(None)

        for f in left:
            f.add_done_callback(one)
        self.waiters.append(entry)
        abandon = self.outage.abandon if self.outage is not None else denied
        try:
            await asyncio.wait(
                {all_done, denied, abandon}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if all_done.done():
                return
            if denied.done():
                raise PermissionDenied(self._message(denied.result()))
            if abandon.done():
                raise BusUnavailable("NATS is unreachable and this process is stopping")
        finally:
            self.waiters.remove(entry)
            for f in left:
                f.remove_done_callback(one)

    async def guard_subject(self, subject: str, coro: Any) -> Any:
        """`guard` for a publish to one subject."""
        low = subject.lower()
        if low in self.seen:
            coro.close()
            raise PermissionDenied(self._message(f"publish to {low!r}"))
        return await self.guard(lambda s: s == low, coro)

    def _message(self, what: str) -> str:
        who = f"NATS user {self.user!r}" if self.user else "this NATS connection"
        return f"the server's permissions refuse {who} {what}"


def refusal(e: Exception, creds: str, ca: str) -> str:
    """Why a connection attempt failed for good (wrong credentials, TLS), or "" for a failure
    that waiting may cure (server not up yet)."""
    text = str(e)
    low = text.lower()
    if isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in low:
        if creds:
            return f"the server refused the credentials in {creds} (authorization violation)"
        return "the server requires credentials (authorization violation): pass --nats-creds FILE"
    if "authentication" in low or "user authentication expired" in low:
        return f"the server refused the credentials in {creds or '(none)'}: {text}"
    if isinstance(e, ssl.SSLCertVerificationError):
        if ca:
            return (
                f"TLS: the CA in {ca} does not verify the server's certificate ({e.verify_message})"
            )
        return (
            "TLS: the server's certificate is not signed by a CA of this system; pass the "
            f"server's CA with --nats-ca FILE ({e.verify_message})"
        )
    if isinstance(e, ssl.SSLError):
        return f"TLS handshake failed: {text}"
    if "no ssl context" in low:
        return "the server requires TLS: use a tls:// URL and pass --nats-ca FILE (its CA)"
    if "secure connection not available" in low or "tls" in low and "required" in low:
        return f"TLS settings do not match the server's: {text}"
    return ""
