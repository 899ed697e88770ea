"""The assembler service: every RolloutResult becomes exactly one TreeSample or one tombstone.

Loop (durable pull consumer ``assembler`` on ROLLOUTS, up to ``concurrency`` rollouts at once):

0. the result must come from the actor it was handed to: it arrives on
   ``hrl.<run>.rollouts.<actor>`` (the server lets an actor publish only under its own NATS
   user) and must return the member's ``claim`` (``harnessrl.common.records.member_claim``
   under the run's claim key, which the feeder put in the TaskRequest only that actor was
   delivered). A result that does not, or whose rollout id is not its member's, is *forged*:
   dead-lettered with the reason, counted (``outcome="forged"``), never assembled, and not
   remembered, so the real result of that rollout is still assembled when it comes;
1. a failed rollout (``status != ok``) becomes a ``rollout_<status>`` tombstone at once;
2. otherwise its CallRecords are read from its actor's subject
   (``hrl.<run>.calls.<actor>.<rid>``); a record of that rollout published by anyone else
   (``hrl.<run>.calls.<other>.<rid>``) is forged: dead-lettered with the reason, never
   assembled. While a seq below
   ``n_calls`` is missing, the read is repeated every ``straggler_poll_s`` for up to
   ``straggler_wait_s`` (heartbeats keep the delivery meanwhile), then ``harnessrl.common.tree.assemble``
   runs (in a worker thread: it is CPU work);
3. the sample is published to SAMPLES with msg id ``sample:<rid>`` (``sample:<rid>:<part>`` for
   the parts of one larger than ``max_part_bytes``), and only then the result is acked.

What must stay true:

* **Exactly one outcome per rollout, restart-safe.** Message ids derive from the rollout id and
  assembly is deterministic for a given set of calls, so a redelivered result (a crash between
  publish and ack, a restarted or second assembler, a duplicate result) republishes identical
  messages that JetStream drops as duplicates. Nothing is acked before its sample is stored, so
  killing the service loses nothing. Duplicate results seen recently are acked without work.
  Limits: JetStream de-duplicates within its window (10 min for our streams), and a redelivery
  that finds *more* calls than the first attempt (a straggler that arrived after a
  ``missing_calls`` tombstone was published) still maps to the same id and is dropped, so the
  tombstone stands.
* **Never stuck, nothing dropped silently.** A result that cannot be processed at all (a rollout
  id that is not a subject token) is dead-lettered; so is a message on a rollout's calls subject
  that is not a valid CallRecord (garbage, another record type, fields of the wrong type): it is
  kept on ``hrl.<run>.dead.calls`` with the reason and counted once in
  ``hrl_bus_dead_lettered_total{stream="CALLS",consumer="assembler"}`` however often the
  rollout's calls are re-read (within the de-duplication window), and the rollout is assembled
  from its valid calls (a call the garbage replaced is missing: ``missing_calls``). An
  exception inside ``assemble`` (a bug) still yields an ``assembler_error`` tombstone, so the
  learner's group never waits, and the result is dead-lettered for inspection; bus errors nak
  the result for a retry and the loop goes on.
* **Oversized samples** are split by nodes (see ``harnessrl.common.tree.split_sample``); if the server still
  refuses a part (its ``max_payload`` is below ``max_part_bytes``), nothing of it was stored —
  sizes are checked before any part is sent — and a ``too_large`` tombstone is published instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import sys
import time
from collections import OrderedDict

from harnessrl.common import lifecycle, metrics
from harnessrl.common.bus import Bus, Delivery, PayloadTooLarge, export_dead_letters
from harnessrl.common.records import (
    CallRecord,
    RolloutResult,
    TreeSample,
    check_token,
    member_claim,
    rollout_id,
)
from harnessrl.common.tree import AssembleOptions, assemble, split_sample, tombstone
from harnessrl.learner.config import AssemblerConfig

log = logging.getLogger("harnessrl.assembler")

DURABLE = "assembler"
RETRY_DELAY_S = 2.0

M_CALLS = metrics.counter("hrl_assembler_calls_total", "CallRecords assembled (rate: calls/s)")
M_ROLLOUTS = metrics.counter(
    "hrl_assembler_rollouts_total",
    "Rollouts finished, by outcome: 'sample' or the tombstone's reason",
    ("outcome",),
)
M_DROPPED_CALLS = metrics.counter(
    "hrl_assembler_dropped_calls_total", "Calls left out of samples, by reason", ("reason",)
)
M_BRANCHES = metrics.histogram(
    "hrl_assembler_branches",
    "Retained root-to-leaf branches per sample",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256),
)
M_FORKED = metrics.counter(
    "hrl_assembler_forked_total", "Samples with more than one branch (fork rate = this / samples)"
)
M_UNIQUE = metrics.counter("hrl_assembler_unique_tokens_total", "Tree tokens, each counted once")
M_EXPANDED = metrics.counter(
    "hrl_assembler_expanded_tokens_total", "Tokens if every branch were its own sequence"
)
M_MODEL = metrics.counter("hrl_assembler_model_tokens_total", "Trained (loss mask 1) tokens")
M_TITO = metrics.counter("hrl_assembler_tito_misses_total", "Calls whose input was re-rendered")
M_LAG = metrics.histogram(
    "hrl_assembler_lag_seconds", "From the rollout's end to its sample being stored"
)
M_SECONDS = metrics.histogram(
    "hrl_assembler_assemble_seconds", "Time to assemble one rollout (tree building only)"
)
M_DUPLICATES = metrics.counter(
    "hrl_assembler_duplicate_results_total", "Results acked without work (already done or busy)"
)
M_STRAGGLERS = metrics.counter(
    "hrl_assembler_straggler_waits_total", "Re-reads of a rollout's calls while some were missing"
)
M_SPLIT = metrics.counter("hrl_assembler_split_samples_total", "Samples published in parts")
M_RETRIES = metrics.counter(
    "hrl_assembler_retries_total", "Results nak'ed for a retry after a bus error"
)
M_INFLIGHT = metrics.gauge("hrl_assembler_inflight", "Rollouts being assembled now")
M_FORGED_CALLS = metrics.counter(
    "hrl_assembler_forged_calls_total",
    "Reads of call records published for a rollout by another than its actor (dead-lettered)",
)


class Assembler:
    """Consumes ROLLOUTS, publishes SAMPLES; ``run`` until stopped or cancelled."""

    def __init__(self, bus: Bus, cfg: AssemblerConfig) -> None:
        self.bus = bus
        self.cfg = cfg
        self.opts = AssembleOptions(
            max_branches=cfg.max_branches,
            export_side_calls=cfg.export_side_calls,
            drop_truncated=cfg.drop_truncated,
        )
        self._done: OrderedDict[str, None] = OrderedDict()
        self._busy: set[str] = set()
        export_dead_letters("CALLS", DURABLE)  # read_calls dead-letters as DURABLE

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """The loop: fetch up to the free concurrency, handle each delivery in its own task,
        until ``stop`` (or cancelled: the results in flight are nak'ed)."""
        consumer = await self.bus.consumer(
            "ROLLOUTS", DURABLE, RolloutResult, ack_wait=self.cfg.ack_wait
        )
        await consumer.serve(self._guarded, self.cfg.concurrency, stop=stop)

    async def _guarded(self, d: Delivery[RolloutResult]) -> None:
        try:
            await self.handle(d)
        except asyncio.CancelledError:  # stopping: the next assembler takes it up at once
            with contextlib.suppress(Exception):
                await d.nak()
            raise
        except Exception:  # never lets one rollout end the loop
            log.exception("rollout %s: unexpected failure", d.record.rollout_id)

    # -- one result ------------------------------------------------------------------------

    async def handle(self, d: Delivery[RolloutResult]) -> None:
        """Turn one delivered result into its stored sample or tombstone, then ack it."""
        res = d.record
        rid = res.rollout_id
        try:
            check_token(rid, "rollout_id")
        except ValueError as e:
            M_ROLLOUTS.labels(outcome="dead_letter").inc()
            await d.dead_letter(f"unprocessable RolloutResult: {e}")
            return
        if rid in self._done or rid in self._busy:
            M_DUPLICATES.inc()
            await d.ack()
            return
        try:
            forged = await self.forged(res, d.subject)
        except Exception as e:  # no claim key yet, or the bus: try again later
            M_RETRIES.inc()
            log.warning("rollout %s: cannot check its claim (%r); retrying", rid, e)
            with contextlib.suppress(Exception):
                await d.nak(delay=RETRY_DELAY_S)
            return
        if forged:
            M_ROLLOUTS.labels(outcome="forged").inc()
            log.warning("rollout %s: forged result refused: %s", rid, forged)
            await d.dead_letter(f"forged: {forged}")
            return
        self._busy.add(rid)
        M_INFLIGHT.inc()
        try:
            async with d.keepalive():
                calls = await self.read_calls(res, self.bus.subjects.publisher_of(d.subject))
                sample, bug = await self._assemble(res, calls)
                sample = await self.publish(sample, res)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            M_RETRIES.inc()
            log.warning("rollout %s: %r; retrying in %.0f s", rid, e, RETRY_DELAY_S)
            with contextlib.suppress(Exception):
                await d.nak(delay=RETRY_DELAY_S)
            return
        finally:
            self._busy.discard(rid)
            M_INFLIGHT.dec()
        self._observe(res, sample, len(calls))
        if bug:
            await d.dead_letter(bug)
        else:
            await d.ack()
        self._remember(rid)

    async def forged(self, res: RolloutResult, subject: str) -> str:
        """Why ``res`` (delivered on ``subject``) is not its member's result ("" when it is)."""
        actor = self.bus.subjects.publisher_of(subject)
        try:
            rid = rollout_id(res.group_id, res.k, res.attempt)
        except ValueError as e:
            return f"result from {actor!r} with an unusable identity: {e}"
        if rid != res.rollout_id:
            return f"rollout id {res.rollout_id!r} from {actor!r} is not its member's {rid!r}"
        key = await self.bus.claim_key(wait_s=self.cfg.claim_key_wait_s)
        if not hmac.compare_digest(res.claim, member_claim(key, res.group_id, res.k)):
            return (
                f"{actor!r} published a result for member {res.k} of group {res.group_id} "
                "without its claim: that task was never delivered to it"
            )
        return ""

    async def read_calls(self, res: RolloutResult, actor: str = "") -> list[CallRecord]:
        """The rollout's calls as published by ``actor`` (the result's publisher; default this
        connection's name), waiting up to ``straggler_wait_s`` for seqs below ``n_calls``; any
        other publisher's record of the rollout is dead-lettered as forged."""
        if res.status != "ok":
            return []
        rid = res.rollout_id
        actor = actor or self.bus.subjects.publisher
        subject = self.bus.subjects.calls_any(rid)

        def foreign(subj: str) -> str:
            by = self.bus.subjects.publisher_of(subj)
            if by == actor:
                return ""
            M_FORGED_CALLS.inc()
            return f"forged: a call of rollout {rid} published by {by!r}; {actor!r} ran it"

        deadline = time.monotonic() + self.cfg.straggler_wait_s
        while True:
            calls = await self.bus.read_subject(
                subject, CallRecord, dead_letter_as=DURABLE, reject=foreign
            )
            have = {c.seq for c in calls}
            left = deadline - time.monotonic()
            if all(s in have for s in range(res.n_calls)) or left <= 0:
                return calls
            M_STRAGGLERS.inc()
            await asyncio.sleep(min(self.cfg.straggler_poll_s, left))

    async def _assemble(
        self, res: RolloutResult, calls: list[CallRecord]
    ) -> tuple[TreeSample, str]:
        """(sample, "") or, when assembly itself fails, (tombstone, why) for the dead letter."""
        t0 = time.perf_counter()
        try:
            sample = await asyncio.to_thread(assemble, calls, res, self.opts)
        except Exception as e:
            log.exception("rollout %s: assembly failed", res.rollout_id)
            return tombstone(res, "assembler_error"), f"assembler error: {e!r}"[:2000]
        M_SECONDS.observe(time.perf_counter() - t0)
        return sample, ""

    async def publish(self, sample: TreeSample, res: RolloutResult) -> TreeSample:
        """Store ``sample`` (in parts when large); returns what was stored."""
        subject = self.bus.subjects.samples
        parts = split_sample(sample, self.cfg.max_part_bytes)
        try:
            if len(parts) == 1:
                await self.bus.publish(subject, parts[0])
            else:  # sizes are all checked before any part is sent
                await self.bus.publish_many([(subject, p, p.msg_id()) for p in parts])
                M_SPLIT.inc()
        except PayloadTooLarge as e:
            log.error("rollout %s: %s", res.rollout_id, e)
            sample = tombstone(res, "too_large", sample.counters)
            await self.bus.publish(subject, sample)
        return sample

    # -- bookkeeping -----------------------------------------------------------------------

    def _remember(self, rid: str) -> None:
        if self.cfg.remember <= 0:
            return
        self._done[rid] = None
        while len(self._done) > self.cfg.remember:
            self._done.popitem(last=False)

    def _observe(self, res: RolloutResult, sample: TreeSample, n_read: int) -> None:
        c = sample.counters
        M_CALLS.inc(c.n_calls or n_read)
        M_TITO.inc(c.tito_misses)
        for reason, n in c.dropped.items():
            M_DROPPED_CALLS.labels(reason=reason).inc(n)
        if res.ended_at > 0:
            M_LAG.observe(max(0.0, time.time() - res.ended_at))
        if sample.is_tombstone:
            M_ROLLOUTS.labels(outcome=sample.dropped_reason).inc()
            log.info("rollout %s: tombstone %s", res.rollout_id, sample.dropped_reason)
            return
        M_ROLLOUTS.labels(outcome="sample").inc()
        M_BRANCHES.observe(c.n_leaves)
        if c.n_leaves > 1:
            M_FORKED.inc()
        M_UNIQUE.inc(c.unique_tokens)
        M_EXPANDED.inc(c.expanded_tokens)
        M_MODEL.inc(c.model_tokens)


async def serve(cfg: AssemblerConfig) -> int:
    """The assembler process (``harnessrl assembler``) until SIGTERM or Ctrl-C, which cancels
    the loop at once: the results in flight are nak'ed for the next assembler (nothing is
    acked before its sample is stored) and nothing waits for an unreachable NATS."""

    async def body(proc: lifecycle.Process) -> None:
        if proc.metrics_port:
            print(
                f"assembler: metrics on :{proc.metrics_port}/metrics", file=sys.stderr, flush=True
            )
        await Assembler(proc.bus, cfg).run(proc.stop)

    return await lifecycle.serve(cfg, "assembler", body, grace_s=0)
