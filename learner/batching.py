"""Batching: delivered TreeSamples -> training batches, with every outcome on the ledger.

Each rollout id reaches exactly one *outcome*: ``trained`` (at some version) or dropped with a
reason (``tombstone:<why>``, ``stale``, ``zero_variance``, ``group_too_small``,
``duplicate_attempt``, ``group_closed``, ``eval``, ``low_reward``, ``bad_parts``,
``incomplete_parts``, ``empty``, ``malformed``, ``bad_reward``, and for RL ``greedy_sampling``,
``truncated_sampling``, ``temperature_mismatch``).
The ``Ledger`` records outcomes and holds the deliveries behind them; deliveries are acked only
after a checkpoint holding their outcome is durable (``Ledger.commit``), so a crash redelivers
exactly the rollouts whose outcome was lost, and a redelivered rollout whose outcome *was*
committed is acked without being trained again.

Rules (GRPO, and PPO with ``filter_groups``; plain PPO/SFT batch rollouts in arrival order):

* a group is keyed by ``group_id`` and sized by the samples' ``group_size``; it is *complete*
  when every member ``k`` has ended (a sample, a tombstone, or a sample dropped on arrival);
* tombstoned or dropped members shrink it; fewer than ``min_group_size`` samples left ->
  the group is skipped (``group_too_small``); all rewards equal -> ``zero_variance``;
* staleness ``version - sample.weight_version > max_staleness`` drops a sample (``stale``) on
  arrival and again when its group is about to be trained;
* sampling (RL only: SFT's NLL is of the model's own distribution): a sample drawn greedily
  (temperature 0: no log-probs to correct against) or from a truncated distribution (top_p < 1,
  top_k > 0: SGLang's reported log-probs of those depend on its version and sampling backend,
  and the learner computes the full ``softmax(logits / T)``) is dropped, as is one drawn at a
  temperature other than the learner's ``ds.temperature`` when that is set; a reward that is
  not finite is ``bad_reward``;
* duplicates: the same rollout id again (a redelivery, a re-published part) rides along with
  the first; another attempt of a member that already ended is ``duplicate_attempt``; a
  member of a group already decided is ``group_closed``;
* split samples (``n_parts > 1``) are joined (``harnessrl.common.tree.join_parts``) once every part is in;
  parts that do not make a whole are ``bad_parts``. The wait is bounded: a sample whose parts
  are not all in ``parts_timeout_s`` after its first one arrived (a part lost, or a record that
  merely claims to be part 1 of 1000) is given up: the member ends as ``incomplete_parts`` and
  its parts, and any that arrive later, are handed back for the dead letters
  (``take_dead_letters``) with the reason, instead of being held unacked forever. A part whose
  index is not below its ``n_parts`` is dead-lettered on arrival.

PPO and SFT take any fresh samples in arrival order, ``batch_rollouts`` per step (membership is
still tracked per group, so a second attempt is ignored here too). Eval samples are never
trained: they are reported (``eval_results``) and recorded as ``eval``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from harnessrl.common import metrics
from harnessrl.common.bus import Delivery
from harnessrl.common.records import TreeSample, unpack_ids
from harnessrl.common.tree import join_parts

log = logging.getLogger("harnessrl.learner")

M_DROPPED = metrics.counter(
    "hrl_learner_dropped_total", "Rollouts not trained, by reason", ("reason",)
)
M_DUPLICATES = metrics.counter(
    "hrl_learner_duplicate_deliveries_total",
    "Deliveries of a rollout already pending or decided (redeliveries, re-published samples)",
)
M_PENDING = metrics.gauge("hrl_learner_pending_rollouts", "Rollouts waiting for their group/batch")
M_INCOMPLETE = metrics.counter(
    "hrl_learner_incomplete_samples_total",
    "Split samples given up: not every part arrived within parts_timeout_s (parts dead-lettered)",
)

INCOMPLETE = "incomplete_parts"
"""Ledger reason of a split sample whose parts did not all arrive in time."""

Mode = Literal["grpo", "ppo", "sft"]


# ---------------------------------------------------------------------------------------------
# ledger
# ---------------------------------------------------------------------------------------------


class Ledger:
    """Outcome of every rollout id, the deliveries awaiting a commit, and closed groups.

    Bounded: the newest ``remember`` ids of each kind are kept (and checkpointed).
    """

    def __init__(self, remember: int = 1_000_000) -> None:
        self.remember = remember
        self.trained: OrderedDict[str, int] = OrderedDict()
        self.dropped: OrderedDict[str, str] = OrderedDict()
        self.closed: OrderedDict[str, None] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.n_trained = 0
        self.uncommitted: set[str] = set()
        self.committing: set[str] = set()
        self.held: list[Delivery[Any]] = []
        self._committing_held: list[Delivery[Any]] = []
        M_DROPPED.labels(reason="stale")  # at 0 from the start: the staleness alert's increase()

    def outcome(self, rid: str) -> str | None:
        """``"trained"``, the drop reason, or None."""
        if rid in self.trained:
            return "trained"
        return self.dropped.get(rid)

    def committed(self, rid: str) -> bool:
        """Whether a durable checkpoint holds ``rid``'s outcome."""
        return (
            self.outcome(rid) is not None
            and rid not in self.uncommitted
            and rid not in self.committing
        )

    def drop(self, rid: str, reason: str, deliveries: Iterable[Delivery[Any]] = ()) -> None:
        if self.outcome(rid) is None:
            self.dropped[rid] = reason
            self.counts[reason] += 1
            self.uncommitted.add(rid)
            M_DROPPED.labels(reason=reason).inc()
            _trim(self.dropped, self.remember)
        self.held.extend(deliveries)

    def train(self, rids: Iterable[str], version: int, deliveries: Iterable[Delivery[Any]]) -> None:
        for rid in rids:
            self.trained[rid] = version
            self.uncommitted.add(rid)
            self.n_trained += 1
        _trim(self.trained, self.remember)
        self.held.extend(deliveries)

    def close_group(self, group_id: str) -> None:
        self.closed[group_id] = None
        _trim(self.closed, self.remember)

    def hold(self, deliveries: Iterable[Delivery[Any]]) -> None:
        self.held.extend(deliveries)

    @property
    def dirty(self) -> bool:
        """Whether outcomes exist that no checkpoint holds yet."""
        return bool(self.uncommitted)

    def begin_commit(self) -> dict[str, Any]:
        """Snapshot the state for a checkpoint; outcomes recorded from now on belong to the
        next commit. Follow with ``end_commit`` once the checkpoint is durable (or
        ``abort_commit`` if writing it failed)."""
        self.committing |= self.uncommitted
        self.uncommitted = set()
        self._committing_held += self.held
        self.held = []
        return self.state()

    def end_commit(self) -> list[Delivery[Any]]:
        """The snapshot is durable: return the deliveries that may now be acked."""
        self.committing.clear()
        held, self._committing_held = self._committing_held, []
        return held

    def abort_commit(self) -> None:
        self.uncommitted |= self.committing
        self.committing.clear()
        self.held = self._committing_held + self.held
        self._committing_held = []

    def state(self) -> dict[str, Any]:
        return {
            "trained": dict(self.trained),
            "dropped": dict(self.dropped),
            "closed": list(self.closed),
            "counts": dict(self.counts),
            "n_trained": self.n_trained,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, remember: int = 1_000_000) -> Ledger:
        led = cls(remember)
        if state:
            led.trained = OrderedDict(state.get("trained", {}))
            led.dropped = OrderedDict(state.get("dropped", {}))
            led.closed = OrderedDict.fromkeys(state.get("closed", ()))
            led.counts = Counter(state.get("counts", {}))
            led.n_trained = int(state.get("n_trained", len(led.trained)))
        return led


def _trim(d: OrderedDict[str, Any], n: int) -> None:
    while len(d) > n:
        d.popitem(last=False)


def well_formed(s: TreeSample, vocab_size: int = 0) -> bool:
    """Parents precede children; per-token arrays agree in length; ids are in the vocabulary."""
    for i, n in enumerate(s.nodes):
        if n.parent >= i or n.parent < -1 or len(n.token_ids) % 4:
            return False
        t = len(n.token_ids) // 4
        if (n.logprobs and len(n.logprobs) != 4 * t) or (n.loss_mask and len(n.loss_mask) != t):
            return False
        if t and vocab_size:
            ids = unpack_ids(n.token_ids)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                return False
    return True


# ---------------------------------------------------------------------------------------------
# pending rollouts and groups
# ---------------------------------------------------------------------------------------------


@dataclass
class Item:
    """One rollout's (joined) sample waiting to be trained, with every delivery behind it."""

    sample: TreeSample
    deliveries: list[Delivery[Any]]
    done: bool = False

    @property
    def rid(self) -> str:
        return self.sample.rollout_id


@dataclass
class Group:
    """Members of one group seen so far: ``k -> Item`` or None (ended without a sample)."""

    group_id: str
    size: int
    first_seen: float
    members: dict[int, Item | None] = field(default_factory=dict)
    ready: bool = False
    """In the ready queue."""

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.size

    def items(self) -> list[Item]:
        return [it for it in self.members.values() if it is not None and not it.done]


@dataclass
class Batch:
    """What one optimiser step trains on."""

    samples: list[TreeSample]
    advantages: np.ndarray | None
    """GRPO: one advantage per sample; None for PPO/SFT."""
    groups: int
    items: list[Item] = field(repr=False, default_factory=list)

    @property
    def deliveries(self) -> list[Delivery[Any]]:
        """Every delivery behind the batch (redeliveries during the step included)."""
        return [d for it in self.items for d in it.deliveries]

    @property
    def rollout_ids(self) -> list[str]:
        return [s.rollout_id for s in self.samples]

    def staleness(self, version: int) -> list[int]:
        return [version - s.weight_version for s in self.samples if s.weight_version >= 0]


@dataclass
class BatchRules:
    """The batcher's knobs (from ``LearnerConfig``)."""

    mode: Mode = "grpo"
    batch_groups: int = 4
    batch_rollouts: int = 16
    min_group_size: int = 2
    max_staleness: int = 4
    group_timeout_s: float = 0.0
    sft_min_reward: float = 0.0
    adv_eps: float = 1e-6
    adv_scale_by_std: bool = True
    filter_groups: bool = False
    """PPO: batch whole groups and drop those whose rewards are all equal, as GRPO always does
    (``zero_variance``); ``batch_groups`` groups per step instead of ``batch_rollouts``
    rollouts in arrival order."""
    truncated_reward: float | None = None
    """Cap on the reward of a sample with truncated calls (``LearnerConfig.truncated_reward``)."""
    vocab_size: int = 0
    """Token ids must be below this (0: unchecked); a sample that is not a well-formed tree
    would fail every step it is in, so it is dropped on arrival (``malformed``)."""
    parts_timeout_s: float = 300.0
    """Give up a split sample whose parts are not all in this long after its first part."""
    temperature: float | None = None
    """RL: the temperature samples must have been drawn at (``ds.temperature``); None: any
    (each sample's log-probs are then taken at its own)."""


@dataclass
class Partial:
    """The parts of one split sample received so far."""

    parts: dict[int, TreeSample]
    deliveries: list[Delivery[Any]]
    first_seen: float


class Batcher:
    """Collects deliveries into GRPO groups (or a PPO/SFT queue) and hands out batches.

    ``on_end(group_id, k)`` is called once per member when its outcome is decided (dropped on
    arrival, dropped later, or trained): the feeder frees its capacity then, so rollouts
    waiting here count as in flight. Single-threaded: call everything from the event loop.
    """

    def __init__(
        self,
        rules: BatchRules,
        ledger: Ledger,
        on_end: Callable[[str, int], None] | None = None,
    ) -> None:
        self.rules = rules
        self.ledger = ledger
        self._explained: set[str] = set()
        self.on_end = on_end or (lambda gid, k: None)
        self.parts: dict[str, Partial] = {}
        self.dead: list[tuple[Delivery[Any], str]] = []
        """Deliveries to dead-letter, with the reason (``take_dead_letters``)."""
        self.items: dict[str, Item] = {}
        self.groups: dict[str, Group] = {}
        self.ready_groups: deque[Group] = deque()
        self.queue: deque[Item] = deque()
        self.eval_results: list[TreeSample] = []
        self.lost_members = 0
        self.reward_capped = 0
        """Samples whose reward ``truncated_reward`` lowered."""
        self.version = 0
        """The learner version the last call was made at (staleness reference)."""

    @property
    def grpo(self) -> bool:
        return self.rules.mode == "grpo"

    @property
    def grouped(self) -> bool:
        """Batches are whole groups with reward variance (GRPO, or PPO with
        ``filter_groups``); otherwise rollouts in arrival order."""
        return self.grpo or (self.rules.mode == "ppo" and self.rules.filter_groups)

    # -- arrival ----------------------------------------------------------------------------

    def add(self, d: Delivery[TreeSample], version: int) -> list[Delivery[TreeSample]]:
        """Take one delivery; return deliveries to ack right away (committed outcomes)."""
        s = d.record
        rid = s.rollout_id
        self.version = version
        if s.n_parts > 1 and not 0 <= s.part < s.n_parts:
            self.dead.append((d, f"part index {s.part} is not below n_parts {s.n_parts}"))
            return []
        if self.ledger.outcome(rid) == INCOMPLETE and s.n_parts > 1:
            self.dead.append(
                (d, f"part {s.part} of {s.n_parts} came after the sample was given up")
            )
            return []
        if self.ledger.outcome(rid) is not None:
            M_DUPLICATES.inc()
            if self.ledger.committed(rid):
                return [d]
            self.ledger.hold([d])
            return []
        if rid in self.items:
            M_DUPLICATES.inc()
            self.items[rid].deliveries.append(d)
            return []
        if s.n_parts > 1:
            p = self.parts.get(rid)
            if p is None:
                p = self.parts[rid] = Partial({}, [], time.monotonic())
            p.parts[s.part] = s
            p.deliveries.append(d)
            if len(p.parts) < s.n_parts:
                return []
            del self.parts[rid]
            try:
                s = join_parts(p.parts.values())
            except ValueError:
                self._end_member(s, p.deliveries, "bad_parts")
                return []
            self._admit(s, p.deliveries, version)
        else:
            self._admit(s, [d], version)
        M_PENDING.set(len(self.items))
        return []

    def _admit(self, s: TreeSample, deliveries: list[Delivery[Any]], version: int) -> None:
        gid, k = s.group_id, s.k
        if gid in self.ledger.closed:
            self.ledger.drop(s.rollout_id, "group_closed", deliveries)
            return
        g = self.groups.get(gid)
        if g is not None and k in g.members:
            self.ledger.drop(s.rollout_id, "duplicate_attempt", deliveries)
            return
        reason = self._arrival_reason(s, version)
        if reason == "eval":
            self.eval_results.append(s)
        if reason is None:
            cap = self.rules.truncated_reward
            if cap is not None and s.counters.truncated_calls and s.reward > cap:
                s.reward = cap
                self.reward_capped += 1
            item = Item(s, deliveries)
            self.items[s.rollout_id] = item
            self._group(s).members[k] = item
            if not self.grouped:
                self.queue.append(item)
        else:
            self._end_member(s, deliveries, reason)
        self._check(self.groups.get(gid), version)

    def _arrival_reason(self, s: TreeSample, version: int) -> str | None:
        if s.is_tombstone:
            return f"tombstone:{s.dropped_reason}"
        if s.is_eval:
            return "eval"
        if not s.nodes:
            return "empty"
        if not well_formed(s, self.rules.vocab_size):
            return "malformed"
        if not math.isfinite(s.reward):
            return self._explain("bad_reward", f"{s.rollout_id}: reward {s.reward}")
        why = self._sampling_reason(s)
        if why is not None:
            return why
        if self._stale(s, version):
            return "stale"
        if self.rules.mode == "sft" and s.reward < self.rules.sft_min_reward:
            return "low_reward"
        return None

    def _sampling_reason(self, s: TreeSample) -> str | None:
        """Why an RL sample's behaviour log-probs cannot be matched by the learner's (None: they
        can). SFT trains the model's own distribution whatever the sampling was."""
        sp = s.sampling
        if self.rules.mode == "sft" or sp is None:
            return None
        if sp.temperature <= 0:
            return self._explain("greedy_sampling", f"{s.rollout_id} was sampled greedily")
        if sp.top_p < 1 or sp.top_k > 0:
            return self._explain(
                "truncated_sampling",
                f"{s.rollout_id} was sampled with top_p {sp.top_p}, top_k {sp.top_k}: train "
                "with top_p 1 and top_k -1 (the learner's log-probs are of the whole "
                "distribution)",
            )
        want = self.rules.temperature
        if want is not None and abs(sp.temperature - want) > 1e-6:
            return self._explain(
                "temperature_mismatch",
                f"{s.rollout_id} was sampled at temperature {sp.temperature:g}, the learner "
                f"trains at {want:g} (ds.temperature)",
            )
        return None

    def _explain(self, reason: str, detail: str) -> str:
        """``reason``, logged with ``detail`` the first time it drops a sample."""
        if reason not in self._explained:
            self._explained.add(reason)
            log.warning("dropping samples as %s, e.g. %s", reason, detail)
        return reason

    def _stale(self, s: TreeSample, version: int) -> bool:
        return (
            self.rules.mode != "sft"
            and s.weight_version >= 0
            and version - s.weight_version > self.rules.max_staleness
        )

    def _group(self, s: TreeSample) -> Group:
        g = self.groups.get(s.group_id)
        if g is None:
            g = Group(s.group_id, max(1, s.group_size), time.monotonic())
            self.groups[s.group_id] = g
        return g

    def _end_member(self, s: TreeSample, deliveries: list[Delivery[Any]], reason: str) -> None:
        """Member ``s.k`` ended without a trainable sample."""
        self.ledger.drop(s.rollout_id, reason, deliveries)
        self._group(s).members[s.k] = None
        self.on_end(s.group_id, s.k)

    # -- groups -----------------------------------------------------------------------------

    def _check(self, g: Group | None, version: int) -> None:
        """Move a complete group to the ready queue (or drop it) when batches are groups;
        close decided groups."""
        if g is None or not g.complete:
            return
        if self.grouped and not g.ready and g.items() and self._validate(g, version):
            g.ready = True
            self.ready_groups.append(g)
            return
        self._maybe_close(g)

    def _validate(self, g: Group, version: int) -> bool:
        """Drop stale members, then the whole group if too small or without variance."""
        for it in g.items():
            if self._stale(it.sample, version):
                self._drop_item(it, "stale")
        items = g.items()
        if len(items) < self.rules.min_group_size:
            reason = "group_too_small"
        elif len({it.sample.reward for it in items}) < 2:
            reason = "zero_variance"
        else:
            return True
        for it in items:
            self._drop_item(it, reason)
        return False

    def _drop_item(self, it: Item, reason: str) -> None:
        it.done = True
        self.items.pop(it.rid, None)
        self.ledger.drop(it.rid, reason, it.deliveries)
        self.on_end(it.sample.group_id, it.sample.k)

    def _maybe_close(self, g: Group) -> None:
        if g.complete and not g.items():
            self.groups.pop(g.group_id, None)
            self.ledger.close_group(g.group_id)

    def expire_parts(self, now: float | None = None) -> int:
        """Give up split samples waiting longer than ``parts_timeout_s`` for a part: the member
        ends as ``incomplete_parts`` and its parts go to ``dead``; return how many."""
        now = time.monotonic() if now is None else now
        n = 0
        for rid, p in list(self.parts.items()):
            waited = now - p.first_seen
            if waited <= self.rules.parts_timeout_s:
                continue
            del self.parts[rid]
            first = next(iter(p.parts.values()))
            why = (
                f"incomplete split sample {rid}: parts {sorted(p.parts)} of {first.n_parts} "
                f"after {waited:.0f} s (parts_timeout_s {self.rules.parts_timeout_s:g})"
            )
            self.dead += [(d, why) for d in p.deliveries]
            self._end_member(first, [], INCOMPLETE)
            self._check(self.groups.get(first.group_id), self.version)
            M_INCOMPLETE.inc()
            n += 1
        return n

    def take_dead_letters(self) -> list[tuple[Delivery[Any], str]]:
        """Deliveries to dead-letter (with the reason) since the last call."""
        out, self.dead = self.dead, []
        return out

    def expire(self, now: float | None = None) -> int:
        """Close GRPO groups incomplete for longer than ``group_timeout_s``; return how many."""
        if self.rules.group_timeout_s <= 0:
            return 0
        now = time.monotonic() if now is None else now
        n = 0
        for g in list(self.groups.values()):
            if not g.complete and now - g.first_seen > self.rules.group_timeout_s:
                missing = [k for k in range(g.size) if k not in g.members]
                self.lost_members += len(missing)
                for k in missing:
                    g.members[k] = None
                    self.on_end(g.group_id, k)
                self._check(g, self.version)
                n += 1
        return n

    # -- batches ----------------------------------------------------------------------------

    def take(self, version: int) -> Batch | None:
        """The next batch if one is complete at ``version`` (stale members are dropped first)."""
        self.version = version
        self.expire()
        self.expire_parts()
        if self.grouped:
            return self._take_groups(version)
        return self._take_rollouts(version)

    def _take_groups(self, version: int) -> Batch | None:
        kept: deque[Group] = deque()
        while self.ready_groups:
            g = self.ready_groups.popleft()
            if self._validate(g, version):
                kept.append(g)
            else:
                g.ready = False
                self._maybe_close(g)
        self.ready_groups = kept
        if len(kept) < self.rules.batch_groups:
            return None
        groups = [self.ready_groups.popleft() for _ in range(self.rules.batch_groups)]
        for g in groups:
            g.ready = False
        items = [it for g in groups for it in g.items()]
        # PPO's advantages come from its value head (GAE in the loss), not from the group
        adv = None
        if self.grpo:
            adv = np.concatenate(
                [self._advantages([it.sample.reward for it in g.items()]) for g in groups]
            )
        return self._batch(items, adv, len(groups))

    def _advantages(self, rewards: list[float]) -> np.ndarray:
        from harnessrl.learner.losses import grpo_advantages

        adv, _ = grpo_advantages(
            rewards, eps=self.rules.adv_eps, scale_by_std=self.rules.adv_scale_by_std
        )
        return adv

    def _take_rollouts(self, version: int) -> Batch | None:
        fresh: deque[Item] = deque()
        for it in self.queue:
            if it.done:
                continue
            if self._stale(it.sample, version):
                self._drop_item(it, "stale")
                g = self.groups.get(it.sample.group_id)
                if g is not None:
                    self._maybe_close(g)
            else:
                fresh.append(it)
        self.queue = fresh
        if len(fresh) < self.rules.batch_rollouts:
            return None
        items = [self.queue.popleft() for _ in range(self.rules.batch_rollouts)]
        return self._batch(items, None, len({it.sample.group_id for it in items}))

    def _batch(self, items: list[Item], adv: np.ndarray | None, n_groups: int) -> Batch:
        for it in items:
            it.done = True  # stays in ``items`` until trained: redeliveries join it
        return Batch(
            samples=[it.sample for it in items], advantages=adv, groups=n_groups, items=items
        )

    def trained(self, batch: Batch, version: int) -> None:
        """Record a batch as trained (producing ``version``) and close finished groups."""
        self.ledger.train(batch.rollout_ids, version, batch.deliveries)
        for it in batch.items:
            self.items.pop(it.rid, None)
            self.on_end(it.sample.group_id, it.sample.k)
        M_PENDING.set(len(self.items))
        for gid in {s.group_id for s in batch.samples}:
            g = self.groups.get(gid)
            if g is not None:
                self._maybe_close(g)

    # -- introspection ----------------------------------------------------------------------

    def held(self) -> list[Delivery[Any]]:
        """Every delivery not yet acked (pending or awaiting a commit): keep them alive."""
        out = [d for p in self.parts.values() for d in p.deliveries]
        out += [d for d, _ in self.dead]
        out += [d for it in self.items.values() for d in it.deliveries]
        return out + self.ledger.held + self.ledger._committing_held

    def take_eval_results(self) -> list[TreeSample]:
        out, self.eval_results = self.eval_results, []
        return out

    def stats(self) -> dict[str, int]:
        return {
            "pending_rollouts": len(self.items),
            "open_groups": len(self.groups),
            "ready_groups": len(self.ready_groups),
            "queued": len(self.queue),
            "partial_samples": len(self.parts),
            "lost_members": self.lost_members,
            "reward_capped": self.reward_capped,
        }
