"""The task feeder: turns task suites into TaskRequests, never more than staleness allows.

A *group* is ``group_size`` rollouts of one (task, harness); with several harnesses every task
gets one group per harness (mix-harness training). Groups are numbered: training group ``c`` is
``<epoch>_<c>`` and eval round ``r``'s ``i``-th group is ``<epoch>_e<r>x<i>``, where ``epoch`` is
a random token drawn when a learner lineage starts fresh and kept in its checkpoints. Member
``k`` of a group is published with msg id ``task:<group_id>:<k>``.

What must stay true:

* **Admission control** (AReaL-style): the members of training groups that are issued but not
  yet *ended* never exceed ``(max_staleness + 1) * batch_rollouts``. A member ends when the
  learner has decided its outcome: a tombstone or a dropped sample on arrival, or a sample once
  trained (or dropped while waiting for its group). Samples buffered in the learner thus still
  hold capacity, so the buffer cannot outgrow the staleness bound: a rollout issued at version
  v is consumed by a step at most ``max_staleness`` versions later (when rollouts are
  consumed in issue order).
* **Restart-stable identity.** What group ``c`` contains is a pure function of ``(seed, c)`` (a
  seeded permutation per pass over the pairs), and the counter and epoch are checkpointed. A
  learner restarted from a checkpoint re-issues the groups it had issued after that checkpoint
  with the same ids and contents.
* **A resumed feeder never runs a member twice.** Before its first issue it looks up which
  members of those groups already exist: a TaskRequest still stored on TASKS (queued, or
  running on an actor) or a RolloutResult on ROLLOUTS stored since the checkpoint (it ran;
  its sample or tombstone is on its way). Re-issuing such a group publishes only its other
  members; the found ones stay in flight and end like any other. JetStream's msg-id
  de-duplication cannot be relied on for this: its window lives in the server's memory, a
  restarted nats-server (``harnessrl run --resume`` always restarts the embedded one) rebuilds
  it only from messages still stored, and a work queue no longer stores consumed tasks. (Were
  a member run twice anyway, its second attempt is only ignored by the batcher.)
* **Every member carries its claim** (``harnessrl.common.records.member_claim`` under the run's
  claim key, which the feeder makes once per run on the KEYS stream): only the actor the task
  is delivered to sees it, and the assembler refuses a result that does not return it.
* **Endings are idempotent** and may arrive before the (re-)issue of their group after a
  restart; such early endings are remembered and applied when the group is issued, so capacity
  never leaks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from harnessrl.common import metrics
from harnessrl.common.bus import Bus, PermissionDenied
from harnessrl.common.records import (
    RecordDecodeError,
    RolloutResult,
    TaskRequest,
    decode,
    member_claim,
)
from harnessrl.common.tasks import Task, list_tasks
from harnessrl.common.tasks.registry import list_suites, suite_dir
from harnessrl.learner.config import FeederConfig

log = logging.getLogger("harnessrl.feeder")

M_ISSUED = metrics.counter(
    "hrl_feeder_issued_total", "TaskRequests published, by kind (train|eval)", ("kind",)
)
M_INFLIGHT = metrics.gauge("hrl_feeder_in_flight", "Training rollouts issued and not yet ended")
M_CAPACITY = metrics.gauge("hrl_feeder_capacity", "Admission limit on training rollouts in flight")
M_EXISTING = metrics.counter(
    "hrl_feeder_reissue_skipped_total",
    "Members of groups re-issued after a restart not published again: they already existed",
)

RECOVER_MARGIN_S = 120.0
"""Results stored this long before the checkpoint's snapshot are read too (clock skew between
the learner and the NATS server)."""


@dataclass
class GroupState:
    """One issued group and which of its members have ended."""

    group_id: str
    task_id: str
    suite: str
    harness: str
    size: int
    issued_version: int
    is_eval: bool = False
    ended: set[int] = field(default_factory=set)

    @property
    def open(self) -> int:
        return self.size - len(self.ended)

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["ended"] = sorted(self.ended)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GroupState:
        return cls(**{**d, "ended": set(d.get("ended", ()))})


def new_epoch() -> str:
    """A fresh lineage token (hex, a subject token)."""
    return secrets.token_hex(4)


class Feeder:
    """Issues groups under admission control; ``on_ended`` frees capacity."""

    def __init__(
        self,
        bus: Bus,
        cfg: FeederConfig,
        *,
        group_size: int,
        batch_rollouts: int,
        max_staleness: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.bus = bus
        self.cfg = cfg
        self.group_size = group_size
        self.capacity = (max_staleness + 1) * batch_rollouts
        self._wire: dict[tuple[str, str], str] = {}
        self.pairs = self._pairs(cfg.suites, "train") if cfg.enabled else []
        self.eval_pairs = (
            self._pairs([cfg.eval_suite], "eval") if cfg.enabled and cfg.eval_suite else []
        )
        if cfg.enabled and not self.pairs:
            raise ValueError(f"no training tasks in suites {cfg.suites}")
        self.epoch = new_epoch()
        self.next_group = 0
        self.next_eval_round = 0
        self.last_eval_version: int | None = None
        self.groups: dict[str, GroupState] = {}
        self.early: dict[str, set[int]] = {}
        self.existing: dict[str, set[int]] = {}
        """Members of groups beyond the counters that exist already (found after a restart):
        their group's re-issue does not publish them again."""
        self._recover_since: float | None = None
        self._recovering = False
        self._orders: dict[int, list[int]] = {}
        self._lock = asyncio.Lock()  # top_up awaits publishes: one issuer at a time
        if state:
            self.restore(state)
        M_CAPACITY.set(self.capacity)

    # -- tasks ------------------------------------------------------------------------------

    def _pairs(self, suites: list[str], split: str) -> list[tuple[Task, str]]:
        """(task, harness) pairs of ``suites``, sorted; eval suites without an ``eval`` split
        contribute all their tasks."""
        tasks: list[Task] = []
        for suite in suites:
            listed = list_tasks(suite)
            chosen = [t for t in listed if t.split == split]
            tasks += chosen if chosen or split == "train" else listed
            # what actors are told: the name of a known suite, else the folder's absolute path
            # (a folder's tasks carry only its base name, which actors cannot look up)
            wire = suite if suite in list_suites() else str(suite_dir(suite))
            self._wire.update({(t.suite, t.id): wire for t in listed})
        tasks.sort(key=lambda t: (t.suite, t.id))
        return [(t, h) for t in tasks for h in self.cfg.harnesses]

    def pair_of(self, counter: int) -> tuple[Task, str]:
        """The (task, harness) of training group ``counter``: a pure function of it."""
        n = len(self.pairs)
        cycle, i = divmod(counter, n)
        order = self._orders.get(cycle)
        if order is None:
            order = list(range(n))
            if self.cfg.shuffle:
                random.Random(f"{self.cfg.seed}:{cycle}").shuffle(order)
            self._orders = {cycle: order}  # one pass at a time is all the feeder visits
        return self.pairs[order[i]]

    # -- admission --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Training members issued and not ended."""
        return sum(g.open for g in self.groups.values() if not g.is_eval)

    def has_room(self) -> bool:
        return self.cfg.enabled and self.in_flight + self.group_size <= self.capacity

    async def top_up(self, version: int) -> int:
        """Issue groups while there is room (and an eval round when due); return groups issued."""
        async with self._lock:
            return await self._top_up(version)

    async def _top_up(self, version: int) -> int:
        if self._recovering:
            try:
                await self._recover()
            except PermissionDenied as e:  # a server started with older permissions
                why = "restart `harnessrl nats` to update them; re-issued groups may rerun members"
                log.error("cannot look up the members that exist already (%s): %s", e, why)
                self._recovering = False
            except Exception as e:  # the bus reconnects by itself: try again next time
                log.warning("cannot look up the members that exist already yet: %r", e)
                return 0
        issued = 0
        if self.cfg.enabled and self._eval_due(version):
            issued += await self._issue_eval_round(version)
        while self.has_room():
            gid = f"{self.epoch}_{self.next_group}"
            task, harness = self.pair_of(self.next_group)
            await self._issue(gid, task, harness, self.group_size, version, is_eval=False)
            self.next_group += 1
            issued += 1
        M_INFLIGHT.set(self.in_flight)
        return issued

    def _eval_due(self, version: int) -> bool:
        if not self.eval_pairs or self.cfg.eval_every <= 0:
            return False
        if self.last_eval_version is None:
            return True
        return version >= self.last_eval_version + self.cfg.eval_every

    async def _issue_eval_round(self, version: int) -> int:
        r = self.next_eval_round
        for i, (task, harness) in enumerate(self.eval_pairs):
            gid = f"{self.epoch}_e{r}x{i}"
            await self._issue(gid, task, harness, self.cfg.eval_group_size, version, is_eval=True)
        self.next_eval_round += 1
        self.last_eval_version = version
        log.info("issued eval round %d at version %d (%d groups)", r, version, len(self.eval_pairs))
        return len(self.eval_pairs)

    async def _issue(
        self, gid: str, task: Task, harness: str, size: int, version: int, *, is_eval: bool
    ) -> None:
        """Publish every member of one group (idempotent by msg id) and track it."""
        subject = self.bus.subjects.tasks
        key = await self.bus.claim_key(create=True)  # made once per run; cached by the bus
        reqs = [
            TaskRequest(
                group_id=gid,
                k=k,
                group_size=size,
                issued_version=version,
                task_id=task.id,
                suite=self._wire.get((task.suite, task.id), task.suite),
                harness=harness,
                harness_cmd=self.cfg.harness_cmd if harness == "command" else "",
                task_hash=task.task_hash,
                timeout_s=self.cfg.task_timeout_s,
                is_eval=is_eval,
                seed=random.Random(f"{self.cfg.seed}:{gid}:{k}").randrange(2**31),
                created_at=time.time(),
                claim=member_claim(key, gid, k),
            )
            for k in range(size)
        ]
        exist = self.existing.get(gid, set())
        await self.bus.publish_many([(subject, r, r.msg_id()) for r in reqs if r.k not in exist])
        if exist:
            log.info(
                "re-issued group %s without members %s: they exist already", gid, sorted(exist)
            )
            M_EXISTING.inc(len(exist))
            del self.existing[gid]
        g = GroupState(gid, task.id, task.suite, harness, size, version, is_eval)
        g.ended |= self.early.pop(gid, set())
        if g.open > 0:
            self.groups[gid] = g
        M_ISSUED.labels(kind="eval" if is_eval else "train").inc(size)

    def on_ended(self, group_id: str, k: int) -> None:
        """Member ``k`` of ``group_id`` ended (trained, tombstone or dropped); idempotent."""
        g = self.groups.get(group_id)
        if g is not None:
            g.ended.add(k)
            if g.open <= 0:
                del self.groups[group_id]
        elif self._issued_later(group_id):
            self.early.setdefault(group_id, set()).add(k)
        M_INFLIGHT.set(self.in_flight)

    def _issued_later(self, group_id: str) -> bool:
        """Whether ``group_id`` is ours but beyond the restored counters (issued after the
        checkpoint we restarted from, so it will be re-issued)."""
        epoch, _, rest = group_id.partition("_")
        if epoch != self.epoch or not rest:
            return False
        if rest.startswith("e"):
            r = rest[1:].partition("x")[0]
            return r.isdigit() and int(r) >= self.next_eval_round
        return rest.isdigit() and int(rest) >= self.next_group

    async def _recover(self) -> None:
        """After a restart from a checkpoint: find the members of the groups issued after it
        that exist already (see the module docstring)."""
        found = self.existing
        for _, data in await self.bus.stored(self.bus.subjects.tasks):
            self._found(found, data, TaskRequest)
        since = self._recover_since
        results = await self.bus.stored(
            self.bus.subjects.rollouts, since=None if since is None else since - RECOVER_MARGIN_S
        )
        for _, data in results:
            self._found(found, data, RolloutResult)
        self._recovering = False
        if found:
            n = sum(len(ks) for ks in found.values())
            log.info("resumed: %d members of %d groups to re-issue exist already", n, len(found))

    def _found(self, found: dict[str, set[int]], data: bytes, kind: type) -> None:
        try:
            rec = decode(data, kind)
        except RecordDecodeError:  # not ours to judge: its consumer dead-letters it
            return
        if self._issued_later(rec.group_id):
            found.setdefault(rec.group_id, set()).add(rec.k)

    # -- state ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints."""
        return {
            "epoch": self.epoch,
            "next_group": self.next_group,
            "next_eval_round": self.next_eval_round,
            "last_eval_version": self.last_eval_version,
            "groups": [g.to_json() for g in self.groups.values()],
            "early": {gid: sorted(ks) for gid, ks in self.early.items()},
            "existing": {gid: sorted(ks) for gid, ks in self.existing.items()},
            # members not looked up yet (NATS away since the restart) were issued after the
            # snapshot we restarted from: the next restart must look from there too
            "saved_at": self._recover_since if self._recovering else time.time(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.next_group = int(state["next_group"])
        self.next_eval_round = int(state.get("next_eval_round", 0))
        self.last_eval_version = state.get("last_eval_version")
        self.groups = {g["group_id"]: GroupState.from_json(g) for g in state.get("groups", ())}
        self.early = {gid: set(ks) for gid, ks in state.get("early", {}).items()}
        self.existing = {gid: set(ks) for gid, ks in state.get("existing", {}).items()}
        self._recover_since = state.get("saved_at")
        self._recovering = self.cfg.enabled
