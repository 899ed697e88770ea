"""The task queue's owner: the shared task consumer, made and watched by the learner's feeder.

Every actor of a run pulls its tasks from one durable consumer of the TASKS stream
(``harnessrl.common.bus.TASK_CONSUMER``). Its settings decide how the whole fleet is fed (the
``filter_subject``, ``ack_wait``: how soon a dead actor's tasks run again, ``max_ack_pending``:
how many tasks may be out at once), so it belongs to the side that owns the stream: the feeder
creates it at start with ``FeederConfig``'s settings (setting back any that differ), and actors
may only bind to it, fetch, ack and read its info (the server's permissions refuse them the
rest: ``harnessrl.common.natsauth``).

`TaskQueue.check` also watches that it delivers. The queue is **stalled** when tasks wait
(stored in the stream and not with any actor) while the consumer delivers nothing between two
checks and either actors are asking for work (pull requests waiting), or the consumer does not
see the waiting tasks at all (its filter no longer covers them), or it is paused, or it is
gone. Actors that are all busy (nobody asking) are not a stall. How long it has been stalled is
``hrl_task_queue_stalled_seconds`` (0 when it is not): the ``HrlTaskQueueStalled`` alert and the
``harnessrl run`` status line read it, so a run that sits with tasks queued and 0 rollouts/s is
reported within a minute whatever stopped the consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from harnessrl.common import metrics
from harnessrl.common.bus import TASK_CONSUMER, TASK_STALL_ALERT_S, Bus, ConsumerState
from harnessrl.learner.config import FeederConfig

log = logging.getLogger("harnessrl.feeder")

M_STALLED = metrics.gauge(
    "hrl_task_queue_stalled_seconds",
    "Seconds the task consumer has delivered nothing while tasks waited and actors asked for "
    "them (or it could not deliver them: filter changed, paused, gone); 0 when it delivers",
)
M_WAITING = metrics.gauge(
    "hrl_task_queue_waiting", "Tasks stored on the TASKS stream and not with any actor"
)


class TaskQueue:
    """Creates the task consumer with the run's settings and reports when it stalls."""

    def __init__(self, bus: Bus, cfg: FeederConfig) -> None:
        self.bus = bus
        self.cfg = cfg
        self.stalled_since: float | None = None
        """Monotonic time the current stall began (None: not stalled)."""
        self._delivered: int | None = None
        self._why = ""
        M_STALLED.set(0)

    async def ensure(self) -> None:
        """Create the consumer, or set back the settings that differ from the run's."""
        changed = await self.bus.ensure_consumer(
            "TASKS",
            TASK_CONSUMER,
            filter_subject=self.bus.subjects.tasks,
            ack_wait=self.cfg.task_ack_wait_s,
            max_ack_pending=self.cfg.task_max_ack_pending,
        )
        stream = self.bus.subjects.stream("TASKS")
        if changed == ["created"]:
            log.info("created the task consumer %r on %s", TASK_CONSUMER, stream)
        elif changed:
            log.warning(
                "task consumer %r on %s had other settings (%s): set back to the run's",
                TASK_CONSUMER,
                stream,
                ", ".join(changed),
            )

    async def check(self, now: float | None = None) -> float:
        """One check (see the module docstring); returns the seconds stalled (0: not)."""
        now = time.monotonic() if now is None else now
        state = await self.bus.consumer_state("TASKS", TASK_CONSUMER)
        stored = await self.bus.stream_count("TASKS")
        waiting = max(0, stored - (state.ack_pending if state is not None else 0))
        M_WAITING.set(waiting)
        why = self._starving(state, waiting)
        self._delivered = state.delivered if state is not None else None
        if not why:
            if self.stalled_since is not None:
                log.info("task consumer delivers again")
            self.stalled_since, self._why = None, ""
            M_STALLED.set(0)
            return 0.0
        if self.stalled_since is None:
            self.stalled_since = now
        stalled = now - self.stalled_since
        if stalled >= TASK_STALL_ALERT_S and why != self._why:
            self._why = why
            log.error(
                "task queue stalled for %.0f s: %d tasks wait and the consumer %r delivers "
                "nothing (%s)",
                stalled,
                waiting,
                TASK_CONSUMER,
                why,
            )
        M_STALLED.set(stalled)
        return stalled

    def _starving(self, state: ConsumerState | None, waiting: int) -> str:
        """Why the consumer is not feeding waiting tasks ("" when it is, or need not)."""
        if waiting <= 0:
            return ""
        if state is None:
            return "the consumer does not exist"
        if state.paused:
            return "the consumer is paused"
        if self._delivered is not None and state.delivered != self._delivered:
            return ""  # it delivered since the last check
        if state.pending < waiting:
            return f"it sees {state.pending} of them; its filter is {state.filter_subject!r}"
        if state.waiting > 0 and self._delivered is not None:
            full = state.ack_pending >= state.max_ack_pending
            return (
                f"max_ack_pending {state.max_ack_pending} reached"
                if full
                else "actors are asking for tasks"
            )
        return ""

    async def watch(self) -> None:
        """`check` every ``task_check_s`` until cancelled (a failed check is logged, the next
        one tries again)."""
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("checking the task consumer failed: %r", e)
            await asyncio.sleep(self.cfg.task_check_s)
