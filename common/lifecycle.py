"""One process lifecycle for every long-running service (actor, assembler, learner, proxy,
weights-sync): connect to the bus, serve ``/metrics``, turn SIGTERM/SIGINT into a stop, run the
service's body, drain it, close. An entry point parses its config and makes one call::

    async def body(proc: Process) -> int:       # the service itself
        await Assembler(proc.bus, cfg).run(proc.stop)
        return 0

    return aio.run(lifecycle.serve(cfg, "assembler", body, grace_s=0))

What must stay true:

* **A first signal asks, a second insists.** The first SIGTERM or SIGINT (or the caller's
  ``stop`` being set) sets ``Process.stop``, runs the ``on_stop`` callbacks and interrupts the
  bus (``Bus.interrupt``: from then on nothing waits for an unreachable NATS, while a
  reachable one works as before). Another signal sets ``Process.hurry``.
* **Drain with a grace.** With ``grace_s`` the body gets that long after the stop to return
  by itself, and is then cancelled (it cleans up in its ``finally``: in-flight work is nak'ed
  for another process). The grace ends at once on a second signal, and when the bus is
  `Bus.abandoned` (stopping while NATS is unreachable: what is in flight could never publish
  its outcome, so waiting for it only delays the exit). ``grace_s=0`` cancels at the stop;
  ``math.inf`` waits for the body unless hurried or abandoned. Without a grace (None) the
  body alone decides how long it takes (the learner finishes and commits its step). A body
  cancelled by the drain has stopped cleanly: the exit status is 0.
* **Closing never raises and never waits for a server that is away.** The metrics server and
  the bus (when ``serve`` connected it) are closed whatever the body did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from harnessrl.common import metrics
from harnessrl.common.bus import Bus
from harnessrl.common.config import ServiceConfig

log = logging.getLogger("harnessrl.lifecycle")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Process:
    """What `serve` hands a service's body."""

    name: str
    bus: Bus
    stop: asyncio.Event
    """Set by the first signal (or the caller): stop taking work, finish, return."""
    hurry: asyncio.Event
    """Set by a second signal: the grace is over (a parent that is going away)."""
    metrics_port: int | None = None
    """Port the ``/metrics`` endpoint serves on (None: disabled)."""
    stop_callbacks: list[Callable[[], None]] = field(default_factory=list)

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` at the stop (at once if it already happened)."""
        if self.stop.is_set():
            callback()
        else:
            self.stop_callbacks.append(callback)

    def request_stop(self) -> None:
        """The first signal: stop, callbacks, bus interrupted; a later one: hurry."""
        if self.stop.is_set():
            self.hurry.set()
            return
        self.stop.set()
        callbacks, self.stop_callbacks = self.stop_callbacks, []
        for cb in callbacks:
            cb()
        self.bus.interrupt()


async def serve(
    cfg: ServiceConfig,
    name: str,
    body: Callable[[Process], Awaitable[int | None]],
    *,
    grace_s: float | None = None,
    stop: asyncio.Event | None = None,
    bus: Bus | None = None,
) -> int:
    """Run ``body`` as the process ``name`` (how the NATS server lists the connection) until it
    returns, with the lifecycle of the module docstring; returns its exit status. ``stop``: an
    event of the caller's that stops the process as a signal does. ``bus``: use this bus
    instead of connecting one (it is not closed)."""
    from harnessrl.common.bus import connect_service

    own_bus = bus is None
    if bus is None:
        bus = await connect_service(cfg, name)
    proc = Process(name, bus, asyncio.Event(), asyncio.Event())
    loop = asyncio.get_running_loop()
    installed = _install_signals(loop, proc.request_stop)
    served = None
    task: asyncio.Task[int | None] | None = None
    try:
        served = await metrics.start_metrics_server(cfg.metrics_port)
        if served:
            proc.metrics_port = served[1]  # the body names it in its ready line
        task = asyncio.create_task(body(proc))
        await _until_stopped(task, proc, stop)
        await _drain(task, proc, grace_s)
        return int(task.result() or 0) if not task.cancelled() else 0
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if task is not None and not task.done():  # serve itself was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if served:
            await served[0].cleanup()
        if own_bus:
            await bus.close()


def _install_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[], None]) -> list[int]:
    """SIGTERM and SIGINT call ``handler`` (where the loop can take signals: the main thread)."""
    done = []
    for sig in SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, handler)
            done.append(sig)
    return done


async def _until_stopped(
    task: asyncio.Task[int | None], proc: Process, stop: asyncio.Event | None
) -> None:
    """Wait for the body to end or a stop (a signal, or the caller's ``stop``)."""
    waits = {asyncio.ensure_future(proc.stop.wait())}
    if stop is not None:
        waits.add(asyncio.ensure_future(stop.wait()))
    try:
        done, _ = await asyncio.wait({task, *waits}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if not task.done() and not proc.stop.is_set():
        proc.request_stop()  # the caller's stop


async def _drain(task: asyncio.Task[int | None], proc: Process, grace_s: float | None) -> None:
    """Give the stopping body ``grace_s`` to return (see the module docstring), then cancel it."""
    if task.done():
        return
    if grace_s is not None:
        if grace_s > 0:
            say = "as long as it takes" if math.isinf(grace_s) else f"up to {grace_s:g} s"
            log.info("%s stopping: %s to finish (signal again to cut it short)", proc.name, say)
        hurry = asyncio.ensure_future(proc.hurry.wait())
        away = asyncio.ensure_future(proc.bus.abandoned())
        timeout = None if math.isinf(grace_s) else grace_s
        await asyncio.wait(
            {task, hurry, away}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        hurry.cancel()
        away.cancel()
        if not task.done():
            if grace_s > 0:
                log.info("%s: %s; cancelling what is left", proc.name, _why(proc))
            task.cancel()
    await asyncio.wait({task})


def _why(proc: Process) -> str:
    if proc.hurry.is_set():
        return "a second signal"
    if proc.bus.abandoning:
        return "NATS is unreachable, so nothing in flight can publish its result"
    return "the grace period is over"
