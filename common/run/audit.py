"""Where every issued rollout is, read from the streams alone: the run summary's accounting.

Each TaskRequest stored on ``TASKS`` (its last sequence = rollouts issued) is, at any moment,
in exactly one of these places (an actor publishes a rollout's result *before* it acks or
dead-letters the task, and the work queue keeps a task until then):

* **pending** — still stored on ``TASKS``: queued, or running on an actor (its members are read
  message by message, so one whose result is out but whose ack is not yet is counted once);
* **with a result** — settled after its member's RolloutResult was stored on ``ROLLOUTS``
  (members are ``(group_id, k)``: a redelivered task's second attempt is the same member);
* **dead-lettered without a result** — on ``hrl.<run>.dead.tasks`` (poison, unusable identity);
* otherwise it is **unaccounted** for: a task settled without a result anywhere, i.e. lost.

What the assembler made of the results (``outcomes``: samples, tombstones by reason) is counted
per rollout id from the learner's committed ledger (a tombstone is dropped there as
``tombstone:<reason>``; everything else it holds was a sample), the samples still stored on
``SAMPLES`` and the results dead-lettered by the assembler, never from the assembler's counters
(a redelivered result is assembled again by a restarted assembler, increments since the last
scrape die with a killed one, and a resumed supervisor never saw the first part of the run).

Everything comes from durable state (streams and the assembler's durable consumer), never from
a process's counters, which reset when it restarts and which a restarted supervisor never saw:
restarts of actors, the assembler, the learner or ``harnessrl run`` itself cannot make a
rollout look lost. The results are the monitor's (an ordered consumer from the stream's start);
`audit` waits a while for it to read the stream to the end, then reads what it has not yet
itself, message by message (``exact`` says whether every stored result was read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harnessrl.common.records import (
    DeadLetter,
    RecordDecodeError,
    RolloutResult,
    TaskRequest,
    TreeSample,
    decode,
)

log = logging.getLogger("harnessrl.run")

Member = tuple[str, int]
"""``(group_id, k)``: one issued rollout, whatever its attempts."""


@dataclass
class Accounting:
    """The run's rollouts by where they are (see the module docstring)."""

    issued: int = 0
    """TaskRequests ever stored on TASKS (its last sequence)."""
    pending: int = 0
    """TaskRequests still stored: queued, or running on an actor."""
    with_result: int = 0
    """Settled TaskRequests whose member has a RolloutResult."""
    members_with_result: int = 0
    """Members with a RolloutResult stored, settled or not (the follower's and those read
    here when it lagged)."""
    dead_lettered: int = 0
    """TaskRequests dead-lettered without a result for their member."""
    assembled: int = 0
    """RolloutResults the assembler has settled (acked or dead-lettered), from its durable
    consumer: each became a sample, a tombstone or a dead letter."""
    exact: bool = True
    """Whether every stored result was read before counting (else ``unaccounted`` may be
    too high)."""
    outcomes: dict[str, int] | None = None
    """Assembled rollouts by outcome (``sample``, a tombstone's reason, ``dead_letter``), each
    rollout id once (see the module docstring); None when no ledger was given."""

    @property
    def unaccounted(self) -> int:
        """Issued rollouts found in none of the places above (lost)."""
        return self.issued - self.pending - self.with_result - self.dead_lettered


def _member(data: bytes | None, record_type: Any) -> Member | None:
    try:
        r = decode(data or b"", record_type)
    except RecordDecodeError:
        return None
    return r.group_id, r.k


def result_member_of(data: bytes | None) -> Member | None:
    """The member a stored RolloutResult payload names (None: it does not decode)."""
    return _member(data, RolloutResult)


def member_of(data: bytes | None) -> Member | None:
    """The member a stored TaskRequest payload names (None: it does not decode)."""
    return _member(data, TaskRequest)


async def audit(
    bus: Any,
    members: set[Member],
    results_read: Callable[[], int],
    *,
    catch_up_s: float = 10.0,
    ledger: dict[str, Any] | None = None,
) -> Accounting:
    """Count where every issued rollout is. ``members``: members with a RolloutResult, from
    the monitor's reading of ROLLOUTS; ``results_read()``: the last stream sequence it read;
    ``ledger``: the learner's committed ledger (``LearnerState.ledger``), for ``outcomes``.
    Reads are ordered so that nothing settled meanwhile is missed: TASKS first, then ROLLOUTS
    (a result is stored before its task is settled), then the dead letters."""
    js, subj = bus.js, bus.subjects
    acc = Accounting()
    tasks = await js.stream_info(subj.stream("TASKS"))
    acc.issued = int(tasks.state.last_seq)
    # the tasks still stored, one by one (few: admission control)
    still = await bus.stored(subj.tasks, upto=acc.issued)
    acc.pending = len(still)
    pending: set[Member | None] = {member_of(data) for _, data in still}
    rollouts = await js.stream_info(subj.stream("ROLLOUTS"))
    last_result = int(rollouts.state.last_seq)
    deadline = time.monotonic() + catch_up_s
    while results_read() < last_result and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    results = set(members)
    read = results_read()
    if read < last_result:  # the monitor's follower is behind (a loaded machine, a restarted
        # server): read the rest of the results here, message by message
        try:
            for _, data in await bus.stored(subj.rollouts, first=read + 1, upto=last_result):
                if (m := result_member_of(data)) is not None:
                    results.add(m)
            read = last_result
        except Exception as e:
            log.warning("accounting: reading results %d-%d failed: %r", read + 1, last_result, e)
    acc.exact = read >= last_result
    if not acc.exact:
        log.warning(
            "accounting: read results up to %d of %d; unaccounted may be too high",
            read,
            last_result,
        )
    acc.with_result = len(results - pending)
    acc.members_with_result = len(results)
    dead: dict[int, Member | None] = {}
    for dl in await bus.read_subject(subj.dead("TASKS"), DeadLetter):
        if dl.stream == subj.stream("TASKS"):
            dead[dl.seq] = member_of(dl.data)
    acc.dead_lettered = sum(1 for m in dead.values() if m is None or m not in results)
    with contextlib.suppress(Exception):  # no assembler consumer yet: nothing assembled
        ci = await js.consumer_info(subj.stream("ROLLOUTS"), "assembler")
        acc.assembled = int(ci.delivered.stream_seq) - int(ci.num_ack_pending)
    if ledger is not None:
        acc.outcomes = await assembled_outcomes(bus, ledger)
    return acc


async def assembled_outcomes(bus: Any, ledger: dict[str, Any]) -> dict[str, int]:
    """Assembled rollouts by outcome, each rollout id once (see the module docstring). The
    SAMPLES stream is read before the ledger's copy is trusted: a sample trained but not yet
    committed is still stored (acks follow commits), so none is missed."""
    subj = bus.subjects
    kinds: dict[str, str] = {}
    for _, data in await bus.stored(subj.samples):
        try:
            s = decode(data, TreeSample)
        except RecordDecodeError:
            continue  # the learner dead-letters it; not an assembled rollout we can name
        kinds[s.rollout_id] = s.dropped_reason if s.is_tombstone else "sample"
    for rid in ledger.get("trained", {}):
        kinds[rid] = "sample"
    for rid, why in ledger.get("dropped", {}).items():
        kinds[rid] = why.removeprefix("tombstone:") if why.startswith("tombstone:") else "sample"
    out = Counter(kinds.values())
    for dl in await bus.read_subject(subj.dead("ROLLOUTS"), DeadLetter):
        if dl.stream == subj.stream("ROLLOUTS"):
            out["dead_letter"] += 1
    return dict(out)
