"""The actor service: TaskRequests in, scored RolloutResults out, up to ``concurrency`` at once.

Loop (durable pull consumer ``actors`` on the TASKS work queue, shared by every actor of the
run; the learner's feeder creates it with the run's settings and an actor only binds to it, so
one that starts first waits for it): fetch as many tasks as there are free slots; run each through
``harnessrl.actors.rollout.run_rollout`` while a heartbeat (``in_progress``) keeps its message from being
redelivered; publish the RolloutResult (msg id ``rollout:<id>``), and only then ack the task.

What must stay true:

* **A rollout belongs to the actor that ran it.** Its calls and its result are published under
  this actor's NATS user (``hrl.<run>.calls.<actor>.<rid>``, ``hrl.<run>.rollouts.<actor>``;
  the server refuses an actor any other), and the result returns the task's ``claim``, which
  only an actor handed the task knows: the assembler assembles a result only from its own
  publisher's calls, and refuses one whose claim is wrong.
* **Every issued member ends as exactly one result per attempt, and some attempt ends.** The
  rollout is named ``<group_id>-<k>-<attempt>`` with attempt = the message's delivery count, so
  a task redelivered after a crash or a nak is a new attempt of the same member, never an extra
  member. Nothing is acked before its result is stored; a result that could not be produced
  (the bus could not store the calls) naks the task for a retry.
* **Failures are results, not silence.** Every rollout outcome is published, failed statuses
  included (the assembler turns them into tombstones, so the learner's group never waits), and
  the task is acked: an ``engine_error`` (the engines failed the rollout) or a
  ``sandbox_error`` is this attempt's outcome, not a reason to run the member again. A request
  that can never run anywhere — unknown task, suite or harness, a task that changed under it
  (``task_hash``), a ``command`` task without a command — is published as a ``harness_error``
  result *and then* dead-lettered (kept with the reason, never retried). A task delivered more
  than ``max_attempts`` times (actors keep dying on it) ends the same way, with reason
  ``given_up``. Only a request whose identity is unusable (a ``group_id`` that is not a subject token)
  cannot have a result: it is dead-lettered alone. An undecodable message is dead-lettered by
  the bus itself.
* **Graceful shutdown** (``stop`` set, e.g. SIGTERM): no new tasks are fetched (any fetched
  meanwhile are nak'ed at once); in-flight rollouts get ``shutdown_grace_s`` to finish; the
  rest are cancelled, which kills their sandboxes, and their tasks are nak'ed so another actor
  retries them. The bus is interrupted (``Bus.interrupt``): with NATS down nothing waits for
  it, the grace included (no result could be published; the unacked tasks are redelivered
  once it is back). Whatever a killed actor leaves
  behind (sandboxes, sockets) is swept by the next actor that starts on the same machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import get_args

from harnessrl.actors.config import ActorConfig
from harnessrl.actors.rollout import (
    M_FAILURES,
    M_ROLLOUTS,
    RolloutDeps,
    RolloutReport,
    default_actor_name,
    run_rollout,
)
from harnessrl.actors.sandbox import SandboxBackend
from harnessrl.common import lifecycle, metrics
from harnessrl.common.bus import TASK_CONSUMER, Bus, Consumer, Delivery
from harnessrl.common.records import RolloutResult, RolloutStatus, TaskRequest, rollout_id

log = logging.getLogger("harnessrl.actor")

DURABLE = TASK_CONSUMER
"""Durable consumer name on the TASKS stream, shared by all actors of a run."""
RETRY_DELAY_S = 5.0
"""Delay of the redelivery of a task whose rollout failed for a retryable reason."""
FETCH_TIMEOUT_S = 1.0
GIVEN_UP = "given_up"
"""Reason of the result of a task delivered more than ``max_attempts`` times."""

M_INFLIGHT = metrics.gauge("hrl_actor_rollouts_inflight", "Rollouts running now")
M_TASKS = metrics.counter(
    "hrl_actor_tasks_total",
    "Task messages by outcome: acked, nacked (retry), dead_lettered",
    ("outcome",),
)


class ActorService:
    """Consumes TASKS, publishes ROLLOUTS; ``run(stop)`` until ``stop`` is set."""

    def __init__(self, cfg: ActorConfig, bus: Bus, deps: RolloutDeps) -> None:
        self.cfg = cfg
        self.bus = bus
        self.deps = deps
        """Running rollouts by rollout id."""
        self.done = 0
        """Results published by this service."""
        self.heartbeat_s = cfg.heartbeat_s or 10.0 / 3
        """Seconds between a running task's heartbeats (set from the consumer's ack_wait)."""
        # Every status and task outcome is exported at 0 from the start, so the first failure
        # is an increase for Prometheus (the failing-rollouts alert, the dashboards' rates).
        for status in get_args(RolloutStatus):
            M_ROLLOUTS.labels(status=status)
        for outcome in ("acked", "nacked", "dead_lettered"):
            M_TASKS.labels(outcome=outcome)

    async def consumer(self) -> Consumer[TaskRequest]:
        """Bind to the run's task consumer (waiting for the learner to create it), and pace the
        heartbeats from the ``ack_wait`` it was given."""
        consumer = await self.bus.bind_consumer(
            "TASKS", DURABLE, TaskRequest, owner="the learner (its task feeder)"
        )
        self.heartbeat_s = self.cfg.heartbeat_s or consumer.ack_wait / 3
        if self.heartbeat_s >= consumer.ack_wait:
            log.warning(
                "heartbeat_s %g is not shorter than the task consumer's ack_wait %g: "
                "using a third of it",
                self.cfg.heartbeat_s,
                consumer.ack_wait,
            )
            self.heartbeat_s = consumer.ack_wait / 3
        return consumer

    async def run(self, stop: asyncio.Event) -> None:
        """Bind to the task consumer (it may wait for the learner to make it), then fetch and
        run tasks until ``stop`` is set, and return once the rollouts in flight are done;
        cancelled, it cancels them (their tasks are nak'ed). The grace a stopping process
        gives them is ``serve``'s."""
        stopping = asyncio.ensure_future(stop.wait())
        binding = asyncio.ensure_future(self.consumer())
        try:
            await asyncio.wait({binding, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not binding.done():  # stopped (or cancelled) before the consumer existed
                binding.cancel()
                await asyncio.gather(binding, return_exceptions=True)  # its outcome is moot
        if binding.cancelled() or (stop.is_set() and binding.exception() is not None):
            return  # stopped before the consumer was bound (with NATS away, binding fails)
        consumer = binding.result()  # raises what binding failed with
        await consumer.serve(
            self.handle,
            self.cfg.concurrency,
            batch=self.cfg.fetch_batch,
            stop=stop,
            timeout=FETCH_TIMEOUT_S,
        )

    # -- one task ----------------------------------------------------------------------------

    async def handle(self, d: Delivery[TaskRequest]) -> None:
        """Run one delivered task to a published result, then ack (or nak / dead-letter) it."""
        req, attempt = d.record, d.num_delivered
        try:
            rid = rollout_id(req.group_id, req.k, attempt)
        except ValueError as e:
            await self._dead_letter(d, f"unusable TaskRequest identity: {e}")
            return
        if attempt > self.cfg.max_attempts:
            await self._give_up(d, rid)
            return
        M_INFLIGHT.inc()
        report = RolloutReport()
        try:
            async with d.keepalive(self.heartbeat_s):
                res = await run_rollout(
                    req, attempt, self.deps, keep_workspace=self._keep(rid), report=report
                )
                await self.bus.publish(self.bus.subjects.rollouts_of(), res)
        except asyncio.CancelledError:
            log.info("rollout %s abandoned (shutdown); its task goes back to the queue", rid)
            await self._nak(d, delay=None)
            raise
        except Exception as e:
            log.warning("rollout %s failed before its result (%r); retrying the task", rid, e)
            await self._nak(d, delay=RETRY_DELAY_S)
            return
        finally:
            M_INFLIGHT.dec()
        self.done += 1
        self._log(res, report)
        # the result is stored: settle the task even if we are cancelled meanwhile
        if report.bad_request:
            await asyncio.shield(self._dead_letter(d, report.bad_request))
        else:
            await asyncio.shield(self._ack(d))

    def _keep(self, rid: str):
        root = self.cfg.keep_workspace_dir
        return None if root is None else root / rid

    async def _give_up(self, d: Delivery[TaskRequest], rid: str) -> None:
        """Too many deliveries: publish a failed result for the member and dead-letter it."""
        req = d.record
        why = f"given up after {d.num_delivered - 1} deliveries without a result"
        now = time.time()
        res = RolloutResult(
            rollout_id=rid,
            task_id=req.task_id,
            suite=req.suite,
            harness=req.harness,
            group_id=req.group_id,
            k=req.k,
            attempt=d.num_delivered,
            group_size=req.group_size,
            issued_version=req.issued_version,
            is_eval=req.is_eval,
            status="harness_error",
            reason=GIVEN_UP,
            error=why,
            actor=self.deps.actor,
            started_at=now,
            ended_at=now,
            meta=dict(req.meta),
            claim=req.claim,
        )
        try:
            await self.bus.publish(self.bus.subjects.rollouts_of(), res)
        except Exception as e:
            log.warning("rollout %s: publishing its give-up result failed: %r", rid, e)
            await self._nak(d, delay=RETRY_DELAY_S)
            return
        M_ROLLOUTS.labels(status=res.status).inc()
        M_FAILURES.labels(reason=GIVEN_UP).inc()
        await self._dead_letter(d, why)

    # -- acknowledgements (best effort: a lost ack means a redelivery, i.e. another attempt) --

    async def _ack(self, d: Delivery[TaskRequest]) -> None:
        try:
            await d.ack()
            M_TASKS.labels(outcome="acked").inc()
        except Exception as e:
            log.warning("ack of task seq %d failed: %r", d.seq, e)

    async def _nak(self, d: Delivery[TaskRequest], delay: float | None) -> None:
        with contextlib.suppress(Exception):
            await d.nak(delay=delay)
            M_TASKS.labels(outcome="nacked").inc()

    async def _dead_letter(self, d: Delivery[TaskRequest], why: str) -> None:
        try:
            await d.dead_letter(why)
            M_TASKS.labels(outcome="dead_lettered").inc()
        except Exception as e:
            log.warning("dead-lettering task seq %d failed: %r", d.seq, e)

    @staticmethod
    def _log(res: RolloutResult, report: RolloutReport) -> None:
        total = res.durations.get("total", 0.0)
        if res.status == "ok":
            log.info(
                "rollout %s %s/%s [%s]: reward %.3f, %d calls, %.1f s",
                res.rollout_id,
                res.suite,
                res.task_id,
                res.harness,
                res.reward,
                res.n_calls,
                total,
            )
            return
        log.warning(
            "rollout %s %s/%s [%s]: %s (%s): %s, %d calls, %.1f s%s",
            res.rollout_id,
            res.suite,
            res.task_id,
            res.harness,
            res.status,
            res.reason,
            res.error[:500],
            res.n_calls,
            total,
            "".join(
                f"; harness {name}: {text[-800:]}"
                for name, text in (
                    ("stderr", report.harness_stderr),
                    ("stdout", report.harness_stdout),
                )
                if text
            ),
        )


async def serve(
    cfg: ActorConfig, stop: asyncio.Event | None = None, *, backend: SandboxBackend | None = None
) -> int:
    """The actor process (``harnessrl actor``) until ``stop``, SIGTERM or SIGINT, with the
    graceful shutdown of the module docstring (the grace is ``shutdown_grace_s``; a second
    signal ends it). ``backend``: a sandbox backend to use instead of the configured one
    (``benchmarks/fleet.py`` passes its no-op backend)."""
    from harnessrl.common.procs import raise_open_files_limit

    raise_open_files_limit()  # a few descriptors per rollout in flight: see its docstring
    name = cfg.name or default_actor_name()

    async def body(proc: lifecycle.Process) -> None:
        proc.bus.publish_as(name)  # an open server knows no user name: publish under the actor's
        async with RolloutDeps.open(cfg, proc.bus, actor=name, backend=backend) as deps:
            service = ActorService(cfg, proc.bus, deps)
            port = f", metrics on :{proc.metrics_port}" if proc.metrics_port else ""
            print(f"actor ready: {name} (run {cfg.run}, {cfg.concurrency} slots{port})", flush=True)
            try:
                await service.run(proc.stop)
            finally:
                log.info("actor %s stopped after %d rollouts", name, service.done)

    grace = cfg.shutdown_grace_s or math.inf
    return await lifecycle.serve(cfg, f"actor {name}", body, grace_s=grace, stop=stop)
