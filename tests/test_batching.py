"""Batching: groups, tombstones, minimum size, zero variance, staleness, de-duplication, parts,
and the ledger's commit protocol (deliveries acked only after a commit).

Deliveries are real: samples go through the in-memory bus (JetStream's semantics) and back.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from harnessrl.common.bus import Bus, Delivery, connect
from harnessrl.common.records import TreeSample, pack_f32, pack_ids, pack_u8
from harnessrl.common.tree import expand, split_sample
from harnessrl.learner.batching import Batcher, BatchRules, Ledger
from harnessrl.learner.losses import grpo_advantages
from tests.helpers.learner import VOCAB, synthetic_sample

pytestmark = pytest.mark.unit


@pytest.fixture
async def bus() -> Bus:
    b = await connect(f"memory://{uuid.uuid4().hex}", "t")
    yield b
    await b.close()


class Harness:
    """A batcher wired to a bus: publish samples, deliver them, record ends."""

    def __init__(self, bus: Bus, **rules) -> None:
        self.bus = bus
        self.ledger = Ledger()
        self.ends: list[tuple[str, int]] = []
        self.batcher = Batcher(
            BatchRules(**rules), self.ledger, on_end=lambda g, k: self.ends.append((g, k))
        )
        self.consumer = None
        self.acked_now: list[Delivery] = []

    async def deliver(self, samples: list[TreeSample], version: int = 0, dup: bool = False):
        subject = self.bus.subjects.samples
        for i, s in enumerate(samples):
            msg_id = f"{s.msg_id()}#{uuid.uuid4().hex}" if dup else None
            await self.bus.publish(subject, s, msg_id or f"{s.msg_id()}@{i}")
        if self.consumer is None:
            self.consumer = await self.bus.consumer("SAMPLES", "learner", TreeSample, ack_wait=60)
        got = await self.consumer.fetch(len(samples), timeout=1.0)
        for d in got:
            self.acked_now += self.batcher.add(d, version)
        return got


def group(gid: str, rewards: list[float], **kw) -> list[TreeSample]:
    return [
        synthetic_sample(gid, k, reward=r, group_size=len(rewards), **kw)
        for k, r in enumerate(rewards)
    ]


async def test_grpo_group_complete_only_when_every_member_ended(bus: Bus) -> None:
    """Groups become trainable when all members are in; advantages are per group."""
    h = Harness(bus, batch_groups=2)
    a, b = group("ga", [0, 1, 1, 0]), group("gb", [0.2, 0.4, 0.6, 0.8])
    await h.deliver(a[:3] + b)
    assert h.batcher.take(0) is None  # ga misses member 3
    await h.deliver(a[3:])
    batch = h.batcher.take(0)
    assert batch is not None and batch.groups == 2 and len(batch.samples) == 8
    by = {s.rollout_id: adv for s, adv in zip(batch.samples, batch.advantages, strict=True)}
    exp_a, _ = grpo_advantages([0, 1, 1, 0])
    assert [by[f"ga-{k}-1"] for k in range(4)] == pytest.approx(list(exp_a))
    assert h.ends == []  # buffered samples still hold feeder capacity
    h.batcher.trained(batch, 1)
    assert sorted(h.ends) == sorted([("ga", k) for k in range(4)] + [("gb", k) for k in range(4)])
    assert set(h.ledger.trained) == {s.rollout_id for s in a + b}
    assert {"ga", "gb"} <= set(h.ledger.closed)


async def test_tombstones_shrink_groups_and_min_size_skips(bus: Bus) -> None:
    """Tombstoned members shrink a group; below min_group_size the group is skipped, counted."""
    h = Harness(bus, batch_groups=1, min_group_size=2)
    g1 = group("g1", [0, 1, 1, 0])
    g1[3] = synthetic_sample("g1", 3, group_size=4, tombstone="rollout_timeout")
    g2 = [synthetic_sample("g2", k, group_size=4, tombstone="sandbox") for k in range(3)]
    g2.append(synthetic_sample("g2", 3, reward=1.0, group_size=4))
    await h.deliver(g1 + g2)
    batch = h.batcher.take(0)
    assert batch is not None and [s.rollout_id for s in batch.samples] == [
        "g1-0-1",
        "g1-1-1",
        "g1-2-1",
    ]
    assert h.batcher.take(0) is None
    assert h.ledger.dropped["g1-3-1"] == "tombstone:rollout_timeout"
    assert h.ledger.dropped["g2-3-1"] == "group_too_small"
    assert h.ledger.counts["tombstone:sandbox"] == 3
    assert "g2" in h.ledger.closed


async def test_zero_variance_groups_skipped(bus: Bus) -> None:
    h = Harness(bus, batch_groups=1)
    await h.deliver(group("flat", [1, 1, 1, 1]))
    assert h.batcher.take(0) is None
    assert h.ledger.counts["zero_variance"] == 4 and "flat" in h.ledger.closed


async def test_truncated_reward_caps_rollouts_with_cut_off_replies(bus: Bus) -> None:
    """With ``truncated_reward`` a rollout with a reply cut off at the token limit trains at
    most that reward: a group whose only successes were truncated has no variance left, and the
    advantages see the capped rewards. Without it the verifier's reward stands."""
    flat = group("flat", [1, 1, 0, 0])
    for s in flat[:2]:
        s.counters.truncated_calls = 1
    mixed = group("mixed", [1, 1, 0, 0])
    mixed[0].counters.truncated_calls = 3
    h = Harness(bus, batch_groups=1, truncated_reward=0.0)
    await h.deliver(flat + mixed)
    assert h.ledger.counts["zero_variance"] == 4
    batch = h.batcher.take(0)
    assert batch is not None and [s.reward for s in batch.samples] == [0, 1, 0, 0]
    exp, _ = grpo_advantages([0, 1, 0, 0])
    assert list(batch.advantages) == pytest.approx(list(exp))
    assert h.batcher.stats()["reward_capped"] == 3
    kept = Harness(bus, batch_groups=1)
    again = group("flat2", [1, 1, 0, 0])
    again[0].counters.truncated_calls = 1
    await kept.deliver(again)
    batch = kept.batcher.take(0)
    assert batch is not None and [s.reward for s in batch.samples] == [1, 1, 0, 0]


async def test_staleness_dropped_on_arrival_and_before_training(bus: Bus) -> None:
    """A sample more than max_staleness behind is dropped when it arrives and when its group
    is about to be trained."""
    h = Harness(bus, batch_groups=1, max_staleness=2, min_group_size=2)
    old = group("old", [0, 1, 0, 1], weight_version=0)
    await h.deliver(old, version=3)
    assert h.ledger.counts["stale"] == 4
    waits = group("waits", [0, 1, 0, 1], weight_version=1)
    await h.deliver(waits, version=3)
    assert h.batcher.take(4) is None  # 4 - 1 > 2: the whole ready group went stale
    assert h.ledger.counts["stale"] == 8
    fresh = group("fresh", [0, 1, 0, 1], weight_version=2)
    await h.deliver(fresh, version=3)
    batch = h.batcher.take(4)
    assert batch is not None and batch.staleness(4) == [2, 2, 2, 2]


async def test_duplicates_attempts_and_closed_groups(bus: Bus) -> None:
    """Same rollout id again rides along; another attempt of a member is ignored; a member of
    a decided group is ignored; a committed outcome is acked at once."""
    h = Harness(bus, batch_groups=1)
    g = group("gd", [0, 1, 0, 1])
    await h.deliver(g[:2])
    await h.deliver(g[:1], dup=True)  # the same rollout re-published
    await h.deliver([synthetic_sample("gd", 1, reward=1, attempt=2)])
    assert h.ledger.dropped["gd-1-2"] == "duplicate_attempt"
    assert len(h.batcher.items["gd-0-1"].deliveries) == 2
    await h.deliver(g[2:])
    batch = h.batcher.take(0)
    assert batch is not None and len(batch.samples) == 4
    assert len(batch.deliveries) == 5
    h.batcher.trained(batch, 1)
    assert h.ends.count(("gd", 1)) == 1
    await h.deliver([synthetic_sample("gd", 2, reward=0, attempt=3)])
    assert h.ledger.dropped["gd-2-3"] == "group_closed"
    # not yet committed: a redelivery is held, not acked
    await h.deliver(g[:1], dup=True)
    assert h.acked_now == []
    h.ledger.begin_commit()
    await h.deliver(g[:1], dup=True)  # during the commit: still held
    assert h.acked_now == []
    held = h.ledger.end_commit()
    assert len(held) == 5 + 1 + 1 + 1  # batch + dup attempt + closed + held redelivery
    assert len(h.ledger.held) == 1  # the one that arrived during the commit waits for the next
    await h.deliver(g[:1], dup=True)
    assert len(h.acked_now) == 1  # committed: acked right away


async def test_ack_only_after_commit_removes_from_work_queue(bus: Bus) -> None:
    """Nothing leaves the SAMPLES work queue before its outcome is committed."""
    h = Harness(bus, batch_groups=1)
    await h.deliver(group("gq", [0, 1, 1, 0]))
    batch = h.batcher.take(0)
    h.batcher.trained(batch, 1)
    assert await bus.stream_count("SAMPLES") == 4
    h.ledger.begin_commit()
    for d in h.ledger.end_commit():
        await d.ack()
    assert await bus.stream_count("SAMPLES") == 0


async def test_split_samples_are_joined(bus: Bus) -> None:
    h = Harness(bus, batch_groups=1, mode="ppo", batch_rollouts=1)
    big = synthetic_sample("gs", 0, reward=1, group_size=1, tokens=3000, seed=1)
    parts = split_sample(big, 8 * 1024)
    assert len(parts) > 1
    await h.deliver(list(reversed(parts)))
    batch = h.batcher.take(0)
    assert batch is not None and len(batch.samples) == 1
    joined = batch.samples[0]
    assert joined.n_parts == 1
    got, exp = expand(joined), expand(big)
    assert len(got) == len(exp)
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(got, exp, strict=True))
    assert len(batch.deliveries) == len(parts)


async def test_ppo_takes_any_fresh_samples(bus: Bus) -> None:
    """PPO: no groups needed, zero variance is fine; stale and tombstones still dropped."""
    h = Harness(bus, mode="ppo", batch_rollouts=3, max_staleness=1)
    samples = [synthetic_sample(f"p{i}", 0, reward=1.0, group_size=1) for i in range(4)]
    samples.append(synthetic_sample("p9", 0, group_size=1, tombstone="harness_error"))
    samples.append(synthetic_sample("p8", 0, group_size=1, weight_version=-1))
    await h.deliver(samples, version=1)
    batch = h.batcher.take(1)
    assert batch is not None and batch.advantages is None
    assert [s.rollout_id for s in batch.samples] == ["p0-0-1", "p1-0-1", "p2-0-1"]
    assert h.batcher.take(3) is None  # p3 (v0) and p8 (unknown version: kept) -> p3 stale
    assert h.ledger.dropped["p3-0-1"] == "stale" and "p8-0-1" not in h.ledger.dropped


async def test_ppo_filter_groups_trains_whole_groups_with_variance(bus: Bus) -> None:
    """PPO with ``filter_groups``: batches are whole groups, an all-equal group is dropped as
    ``zero_variance``, and the advantages are left to the value head (None)."""
    h = Harness(bus, mode="ppo", batch_groups=2, batch_rollouts=8, filter_groups=True)
    flat, a, b = group("flat", [0, 0, 0, 0]), group("ga", [0, 1, 0, 0]), group("gb", [1, 1, 0, 1])
    await h.deliver(flat + a + b[:3])
    assert h.batcher.take(0) is None  # gb incomplete; flat never counts towards a batch
    assert h.ledger.counts["zero_variance"] == 4 and "flat" in h.ledger.closed
    assert sorted(h.ends) == [("flat", k) for k in range(4)]
    await h.deliver(b[3:])
    batch = h.batcher.take(0)
    assert batch is not None and batch.advantages is None and batch.groups == 2
    assert sorted(s.rollout_id for s in batch.samples) == sorted(s.rollout_id for s in a + b)
    # without the filter the same deliveries are 8 rollouts in arrival order, flat ones first
    h2 = Harness(bus, mode="ppo", batch_groups=2, batch_rollouts=8)
    h2.consumer = h.consumer
    await h2.deliver(group("flat2", [0, 0, 0, 0]) + group("gc", [0, 1, 0, 0]))
    batch2 = h2.batcher.take(0)
    assert batch2 is not None and [s.group_id for s in batch2.samples][:4] == ["flat2"] * 4


async def test_eval_samples_reported_never_trained(bus: Bus) -> None:
    h = Harness(bus, batch_groups=1)
    await h.deliver([synthetic_sample("ev", 0, reward=0.5, group_size=1, is_eval=True)])
    assert h.batcher.take(0) is None
    assert [s.reward for s in h.batcher.take_eval_results()] == [0.5]
    assert h.ledger.dropped["ev-0-1"] == "eval"


async def test_group_timeout_closes_incomplete_group(bus: Bus) -> None:
    h = Harness(bus, batch_groups=1, group_timeout_s=0.01)
    await h.deliver(group("gt", [0, 1, 1, 0])[:3])
    import time

    h.batcher.expire(time.monotonic() + 1)
    batch = h.batcher.take(0)
    assert batch is not None and len(batch.samples) == 3 and h.batcher.lost_members == 1


async def test_malformed_samples_dropped_on_arrival(bus: Bus) -> None:
    """A tree that would fail every step (ids outside the vocabulary, bad parents) is dropped."""
    h = Harness(bus, mode="ppo", batch_rollouts=1, vocab_size=VOCAB)
    bad = synthetic_sample("m", 0, group_size=1)
    bad.nodes[1].token_ids = pack_ids([VOCAB + 5, 3])
    bad.nodes[1].logprobs = pack_f32([0, 0])
    bad.nodes[1].loss_mask = pack_u8([1, 1])
    orphan = synthetic_sample("o", 0, group_size=1)
    orphan.nodes[0].parent = 3
    await h.deliver([bad, orphan])
    assert h.ledger.dropped == {"m-0-1": "malformed", "o-0-1": "malformed"}


async def test_sft_drops_low_reward_and_ignores_staleness(bus: Bus) -> None:
    h = Harness(bus, mode="sft", batch_rollouts=1, sft_min_reward=0.5, max_staleness=0)
    await h.deliver(
        [
            synthetic_sample("lo", 0, reward=0.2, group_size=1),
            synthetic_sample("hi", 0, reward=1.0, group_size=1, weight_version=0),
        ],
        version=9,
    )
    batch = h.batcher.take(9)
    assert batch is not None and batch.rollout_ids == ["hi-0-1"]
    assert h.ledger.dropped == {"lo-0-1": "low_reward"}


async def test_incomplete_split_samples_are_given_up_after_parts_timeout(bus: Bus) -> None:
    """A record claiming to be part 1 of 1000, and a split sample whose last part never came,
    are held (and kept alive) only until ``parts_timeout_s``: then each member ends as
    ``incomplete_parts`` and every part is handed out for the dead letters with the reason; a
    part arriving later, or one whose index is beyond its ``n_parts``, is dead-lettered too."""
    import time

    import msgspec

    from harnessrl.common.records import DeadLetter

    h = Harness(bus, mode="ppo", batch_rollouts=1, parts_timeout_s=5)
    big = synthetic_sample("gi", 0, reward=1, group_size=1, tokens=3000, seed=1)
    parts = split_sample(big, 8 * 1024)
    assert len(parts) > 2
    forged = msgspec.structs.replace(synthetic_sample("gf", 0, group_size=1), part=1, n_parts=1000)
    beyond = msgspec.structs.replace(synthetic_sample("gb", 0, group_size=1), part=3, n_parts=3)
    await h.deliver([*parts[:-1], forged, beyond])
    out_of_range = h.batcher.take_dead_letters()
    assert [why for _, why in out_of_range] == ["part index 3 is not below n_parts 3"]
    assert h.batcher.take(0) is None  # nothing whole yet
    assert h.batcher.expire_parts(time.monotonic() + 1) == 0  # within the bound: still waiting
    assert len(h.batcher.held()) == len(parts)  # the waiting parts are kept alive meanwhile
    assert h.batcher.expire_parts(time.monotonic() + 10) == 2
    dead = h.batcher.take_dead_letters()
    assert len(dead) == len(parts)  # len(parts) - 1 real parts + the forged one
    assert all(why.startswith("incomplete split sample") for _, why in dead)
    assert any("parts [1] of 1000" in why for _, why in dead)
    assert h.ledger.dropped == {"gi-0-1": "incomplete_parts", "gf-0-1": "incomplete_parts"}
    assert sorted(h.ends) == [("gf", 0), ("gi", 0)] and h.batcher.parts == {}
    await h.deliver(parts[-1:])  # the missing part, too late
    late = h.batcher.take_dead_letters()
    n = len(parts)
    assert [why for _, why in late] == [f"part {n - 1} of {n} came after the sample was given up"]
    assert h.batcher.take(0) is None
    for d, why in out_of_range + dead + late:
        await d.dead_letter(why)
    assert await bus.stream_count("SAMPLES") == 0  # nothing left held on the work queue
    letters = await bus.read_subject(bus.subjects.dead("SAMPLES"), DeadLetter)
    assert len(letters) == len(parts) + 2
