"""The learner service end to end on CPU DeepSpeed.

* In process, with its feeder and fake actors answering TaskRequests with synthetic samples:
  versions advance, admission control holds, weights are broadcast, metrics.jsonl is written,
  and a resumed learner continues the version counter and the group ids.
* As a subprocess (``python -m harnessrl.learner.learner_cmd``) on a real nats-server: the test publishes
  its own numbered samples and keeps a ledger, SIGKILLs the learner mid-run, restarts it with
  ``--resume``, and checks that the version continues and every ledger sample was trained
  exactly once or dropped with the expected reason.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from harnessrl.common.bus import Bus, connect
from harnessrl.common.layout import StartLine, StepLine, effective_steps, read_metrics
from harnessrl.common.records import TaskRequest, WeightsReady
from harnessrl.learner.checkpoint import Checkpointer
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.service import Learner
from harnessrl.proxy.weights_sync import WeightUpdater
from tests.helpers.learner import grpo_group, publish, start_learner, synthetic_sample
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------
# in process, with the feeder
# ------------------------------------------------------------------------------------------


async def fake_actors(bus: Bus, learner: Learner, seen: list[TaskRequest], outstanding: list):
    """Answer every TaskRequest with a synthetic sample made at the learner's version."""
    consumer = await bus.consumer("TASKS", "actors", TaskRequest, ack_wait=30)
    while True:
        for d in await consumer.fetch(16, timeout=0.2):
            t = d.record
            seen.append(t)
            outstanding.append(len(seen) - len(outstanding))
            reward = float((hash((t.group_id, t.k)) % 3) / 2)
            s = synthetic_sample(
                t.group_id,
                t.k,
                reward=reward,
                group_size=t.group_size,
                weight_version=learner.version,
            )
            s.counters.truncated_calls = int(t.k == 0)  # one member of each group: a cut-off reply
            await bus.publish(bus.subjects.samples, s)
            await d.ack()


def in_process_config(tmp_path: Path, **kw) -> LearnerConfig:
    base = {
        "model": "tiny-1m",
        "run": "t",
        "run_dir": str(tmp_path / "run"),
        "metrics_port": -1,
        "group_size": 2,
        "min_group_size": 2,
        "batch_groups": 2,
        "max_staleness": 1,
        "checkpoint_every": 2,
        "pack": {"max_tokens": 128},
        "ds": {"lr": 1e-4},
    }
    return LearnerConfig.model_validate({**base, **kw})


async def test_in_process_feeder_learner_broadcast_and_resume(tmp_path: Path) -> None:
    bus = await connect(f"memory://{uuid.uuid4().hex}", "t")
    cfg = in_process_config(tmp_path, max_steps=3)
    learner = Learner(cfg, bus)
    seen: list[TaskRequest] = []
    issued_minus_done: list[int] = []
    actors = asyncio.create_task(fake_actors(bus, learner, seen, issued_minus_done))
    try:
        assert await asyncio.wait_for(learner.run(), 240) == 0
        assert learner.version == 3
        capacity = (cfg.max_staleness + 1) * cfg.batch_rollouts
        lines = read_metrics(tmp_path / "run" / "metrics.jsonl")
        steps = [m for m in lines if isinstance(m, StepLine)]
        assert [m.version for m in steps] == [1, 2, 3]
        assert all(m.in_flight <= capacity for m in steps)
        assert all(int(k) <= cfg.max_staleness for m in steps for k in m.staleness)
        assert all(m.metrics["tokens_computed"] > 0 for m in steps)
        assert all(m.metrics["rollouts/truncated_frac"] == 0.5 for m in steps)
        ready = await bus.read_subject(bus.subjects.weights_ready, WeightsReady)
        assert [r.version for r in ready] == [1, 2, 3]
        assert {t.task_id for t in seen} and all(not t.is_eval for t in seen)
        state = Checkpointer(tmp_path / "run" / "checkpoints").read()
        assert state is not None and state.version == 3  # the final commit at exit
        epoch = state.feeder["epoch"]
        # resume: the counter and the group ids continue
        cfg2 = in_process_config(tmp_path, max_steps=1, resume=True)
        learner2 = Learner(cfg2, bus, engine=learner.engine)
        actors.cancel()
        actors = asyncio.create_task(fake_actors(bus, learner2, seen, issued_minus_done))
        n_before = len(seen)
        assert await asyncio.wait_for(learner2.run(), 240) == 0
        assert learner2.version == 4 and learner2.feeder.epoch == epoch
        new_ids = {t.group_id for t in seen[n_before:]}
        counters = sorted(int(g.split("_")[1]) for g in new_ids)
        assert counters and counters[0] == state.feeder["next_group"]
    finally:
        actors.cancel()
        await bus.close()


async def test_engines_only_get_committed_versions(tmp_path: Path, monkeypatch) -> None:
    """A learner dying after a step but before its checkpoint never broadcast that step: after
    ``--resume`` no engine serves weights the learner no longer has, and each version number
    names one set of weights (one digest), however often it is announced."""
    save, commits = Checkpointer.save, []

    def dies_at_second_commit(self, engine, state):
        if commits:
            raise RuntimeError("killed while writing the checkpoint")
        commits.append(state.version)
        return save(self, engine, state)

    monkeypatch.setattr(Checkpointer, "save", dies_at_second_commit)
    bus = await connect(f"memory://{uuid.uuid4().hex}", "t")
    learner = Learner(in_process_config(tmp_path, max_steps=3, checkpoint_every=1), bus)
    actors = asyncio.create_task(fake_actors(bus, learner, [], []))
    try:
        with pytest.raises(RuntimeError, match="killed while writing"):
            await asyncio.wait_for(learner.run(), 240)
        monkeypatch.undo()
        committed = Checkpointer(tmp_path / "run" / "checkpoints").read().version
        ready = await bus.read_subject(bus.subjects.weights_ready, WeightsReady)
        assert committed == 1 and max(r.version for r in ready) <= committed
        # resumed from version 1: it announces version 1 again, then trains on
        cfg2 = in_process_config(tmp_path, max_steps=1, resume=True)
        learner2 = Learner(cfg2, bus, engine=learner.engine)
        actors.cancel()
        actors = asyncio.create_task(fake_actors(bus, learner2, [], []))
        assert await asyncio.wait_for(learner2.run(), 240) == 0
        ready = await bus.read_subject(bus.subjects.weights_ready, WeightsReady)
        digests: dict[int, set[str]] = {}
        for r in ready:
            digests.setdefault(r.version, set()).add(r.digest)
        assert sorted(digests) == [1, 2] and all(len(d) == 1 for d in digests.values()), digests
    finally:
        actors.cancel()
        await bus.close()


async def test_a_committed_version_whose_broadcast_failed_is_resent_on_resume(
    tmp_path: Path, monkeypatch
) -> None:
    """Version 3 is committed but its broadcast fails (a learner crashing mid-broadcast): the
    engine stays at version 2 while a restart resumes from 3. The resumed learner re-sends
    version 3 before it trains, so the engine ends on the learner's version."""
    from harnessrl.learner.weights import StreamPublisher

    real = StreamPublisher.publish

    async def cut_short_at_3(self, version: int, step: int, state: dict):
        if version == 3:
            raise ConnectionError("the learner died mid-broadcast")
        return await real(self, version, step, state)

    monkeypatch.setattr(StreamPublisher, "publish", cut_short_at_3)
    bus = await connect(f"memory://{uuid.uuid4().hex}", "t")
    applied: list[int] = []

    async def apply(path: str, version: int) -> None:
        applied.append(version)

    engine = WeightUpdater(bus, apply, tmp_path / "sync", durable="engine", read_retries=0)

    async def catch_up() -> None:
        while await engine.poll(timeout=0.2) is not None:
            pass

    learner = Learner(in_process_config(tmp_path, max_steps=3, checkpoint_every=1), bus)
    actors = asyncio.create_task(fake_actors(bus, learner, [], []))
    try:
        assert await asyncio.wait_for(learner.run(), 240) == 0
        actors.cancel()
        await catch_up()
        assert Checkpointer(tmp_path / "run" / "checkpoints").read().version == 3
        assert applied[-1] == 2  # the engine keeps the last version that was broadcast
        monkeypatch.undo()
        resumed = Learner(in_process_config(tmp_path, resume=True), bus, engine=learner.engine)
        await resumed.setup()  # what a restarted learner does before its first step
        await resumed.publisher.close()
        await catch_up()
        assert applied[-1] == 3 and resumed.version == 3
    finally:
        actors.cancel()
        await bus.close()


class _Untrained:
    """What a learner reads of its engine when it takes no step (``Learner.setup``)."""

    text = SimpleNamespace(vocab_size=512)
    config = SimpleNamespace(get_text_config=lambda: _Untrained.text, to_json_string=lambda: "{}")
    policy = SimpleNamespace(lm=SimpleNamespace(config=config))


async def test_stopped_learner_hands_back_what_it_holds(tmp_path: Path) -> None:
    """A learner stopped while it holds a sample of an incomplete group nak's it: the next
    learner gets it at once instead of after ``ack_wait``."""
    from harnessrl.common.records import TreeSample

    bus = await connect(f"memory://{uuid.uuid4().hex}", "t")
    cfg = in_process_config(tmp_path, feeder={"enabled": False}, broadcast={"transport": "none"})
    half = synthetic_sample("half", 0, group_size=2)
    await bus.publish(bus.subjects.samples, half)
    learner = Learner(cfg, bus, engine=_Untrained())
    run = asyncio.create_task(learner.run())
    try:
        deadline = time.monotonic() + 60
        while not (hasattr(learner, "batcher") and learner.batcher.held()):
            assert time.monotonic() < deadline and not run.done(), "never held the sample"
            await asyncio.sleep(0.05)
    finally:
        learner.stop()
        assert await asyncio.wait_for(run, 60) == 0
    consumer = await bus.consumer("SAMPLES", "learner", TreeSample, ack_wait=cfg.ack_wait)
    got = await consumer.fetch(1, timeout=1.0)
    assert [(d.record.rollout_id, d.num_delivered) for d in got] == [(half.rollout_id, 2)]
    await bus.close()


async def test_updates_per_batch_steps_each_batch_k_times(tmp_path: Path) -> None:
    """``updates_per_batch = 3``: three optimiser steps per weight version, clipped against the
    batch's pi_old (at a large lr the later updates move the ratio off 1 and the clip bites)."""
    bus = await connect(f"memory://{uuid.uuid4().hex}", "t")
    cfg = in_process_config(tmp_path, max_steps=2, updates_per_batch=3, ds={"lr": 0.05})
    learner = Learner(cfg, bus)
    actors = asyncio.create_task(fake_actors(bus, learner, [], []))
    try:
        assert await asyncio.wait_for(learner.run(), 240) == 0
        assert learner.version == 2 and learner.engine.global_steps == 6
        steps = [
            m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if isinstance(m, StepLine)
        ]
        assert [m.metrics["updates"] for m in steps] == [3.0, 3.0]
        assert max(m.metrics["ppo/clip_frac"] for m in steps) > 0
    finally:
        actors.cancel()
        await bus.close()


async def test_incomplete_split_sample_is_dead_lettered_not_held(tmp_path: Path) -> None:
    """A sample claiming to be part 1 of 1000 is dead-lettered with its reason once
    ``parts_timeout_s`` passed in the running learner, instead of being held unacked forever."""
    import msgspec

    from harnessrl.common import metrics
    from harnessrl.common.records import DeadLetter

    bus = await connect(f"memory://{uuid.uuid4().hex}", "t")
    cfg = in_process_config(tmp_path, parts_timeout_s=1, ack_wait=1, feeder={"enabled": False})
    forged = msgspec.structs.replace(synthetic_sample("gp", 0, group_size=2), part=1, n_parts=1000)
    await bus.publish(bus.subjects.samples, forged)
    before = metrics.sample_value("hrl_learner_incomplete_samples_total")
    learner = Learner(cfg, bus)
    run = asyncio.create_task(learner.run())
    try:
        letters: list[DeadLetter] = []
        deadline = time.monotonic() + 240
        while not letters and not run.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            letters = await bus.read_subject(bus.subjects.dead("SAMPLES"), DeadLetter)
        assert len(letters) == 1 and "parts [1] of 1000" in letters[0].reason, letters
        assert await bus.stream_count("SAMPLES") == 0  # terminated: not held, not redelivered
        assert metrics.sample_value("hrl_learner_incomplete_samples_total") == before + 1
        assert learner.batcher.ledger.outcome(forged.rollout_id) == "incomplete_parts"
    finally:
        learner.stop()
        await asyncio.wait_for(run, 120)
        await bus.close()


# ------------------------------------------------------------------------------------------
# subprocess, SIGKILL, --resume
# ------------------------------------------------------------------------------------------


async def test_sigkill_and_resume_trains_every_sample_once(
    nats_url: str, run_name: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = Checkpointer(run_dir / "checkpoints")
    bus = await connect(nats_url, run_name)
    expected_drop: dict[str, str] = {}
    ledger: list[str] = []

    def add(samples: list, drop: str = "") -> list:
        for s in samples:
            ledger.append(s.rollout_id)
            if drop:
                expected_drop[s.rollout_id] = drop
        return samples

    # wave 1: 8 trainable groups (group i generated at version i), a zero-variance group, a
    # group of 3 tombstones + 1 sample, a second attempt of a member, and a re-published sample
    wave1: list = []
    for i in range(8):
        wave1 += add(grpo_group(f"ok{i}", [0, 1, 0.5, 0.25], i))
    wave1 += add(grpo_group("flat", [1, 1, 1, 1], 0), "zero_variance")
    small = grpo_group("small", [0, 1, 0, 1], 0)
    for k in range(3):
        small[k] = synthetic_sample("small", k, group_size=4, tombstone="rollout_timeout")
        add([small[k]], "tombstone:rollout_timeout")
    wave1 += small + add([small[3]], "group_too_small")
    wave1 += add(
        [synthetic_sample("ok0", 2, reward=1, attempt=2, weight_version=0)], "duplicate_attempt"
    )
    await publish(bus, wave1)
    await bus.publish(bus.subjects.samples, wave1[5], "sample:again")  # same rollout id twice

    try:
        proc = start_learner(nats_url, run_name, run_dir)
        version_at = lambda: ckpt.read().version if ckpt.exists() else 0  # noqa: E731
        wait_until(lambda: version_at() >= 3, 150, "version 3", proc=proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        killed_at = version_at()
        assert killed_at < 8, "the learner finished before it could be killed mid-run"

        # wave 2: two more groups, and a group that is stale by the time it arrives
        wave2 = add(grpo_group("late0", [0, 1, 1, 0], 8)) + add(
            grpo_group("late1", [1, 0, 1, 0], 9)
        )
        wave2 += add(grpo_group("stale", [0, 1, 0, 1], 0), "stale")
        await publish(bus, wave2)

        proc = start_learner(nats_url, run_name, run_dir, "--resume")

        def all_decided() -> bool:
            st = ckpt.read() if ckpt.exists() else None
            if st is None:
                return False
            done = set(st.ledger["trained"]) | set(st.ledger["dropped"])
            return done >= set(ledger)

        wait_until(all_decided, 150, "every ledger sample decided", proc=proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

    state = ckpt.read()
    trained, dropped = state.ledger["trained"], state.ledger["dropped"]
    assert set(trained).isdisjoint(dropped)
    assert set(trained) | set(dropped) == set(ledger)
    assert {rid: dropped[rid] for rid in expected_drop} == expected_drop
    assert set(trained) == set(ledger) - set(expected_drop)
    # the version continued across the kill, and every trained sample appears in exactly one
    # surviving step, the one whose version the ledger recorded
    lines = read_metrics(run_dir / "metrics.jsonl")
    starts = [m for m in lines if isinstance(m, StartLine)]
    assert [s.resumed for s in starts] == [False, True] and starts[1].version == killed_at
    steps = effective_steps(lines)
    assert [s.version for s in steps] == list(range(1, len(steps) + 1))
    assert state.version == len(steps) == 10
    first_after = next(m for m in lines[lines.index(starts[1]) :] if isinstance(m, StepLine))
    assert first_after.version == killed_at + 1
    seen = [rid for s in steps for rid in s.rollouts]
    assert sorted(seen) == sorted(trained)
    assert all(trained[rid] == s.version for s in steps for rid in s.rollouts)
    # everything was acknowledged: nothing is left for a next learner
    assert await bus.stream_count("SAMPLES") == 0
    # a fresh updater receives the newest broadcast version intact (no chunks of lost steps)
    applied: list[int] = []

    async def apply(path: str, version: int) -> None:
        applied.append(version)

    upd = WeightUpdater(bus, apply, tmp_path / "sync", durable="check", read_retries=0)
    assert await upd.poll(timeout=5.0) == state.version and applied == [state.version]
    await bus.close()


def test_filter_groups_is_refused_for_groups_of_one(tmp_path: Path) -> None:
    """``filter_groups`` on groups of 1 would drop every PPO sample: a config error naming it."""
    with pytest.raises(ValueError, match="filter_groups needs group_size > 1"):
        in_process_config(tmp_path, algo="ppo", group_size=1, min_group_size=1, filter_groups=True)
    cfg = in_process_config(tmp_path, algo="ppo", filter_groups=True)
    assert cfg.filter_groups and cfg.loss.algo == "ppo"


def test_a_taken_rendezvous_port_is_retried_with_another(monkeypatch) -> None:
    """``EADDRINUSE`` while the engine joins its process group (the free port was taken
    meanwhile): up to 3 attempts, each without the stale ``MASTER_PORT``; any other failure,
    or a third refusal, is raised."""
    from harnessrl.learner import ds_engine, service

    made: list[str | None] = []

    def engine(fail: int, why: str = "EADDRINUSE"):
        def make(*args):
            made.append(os.environ.get("MASTER_PORT"))
            os.environ["MASTER_PORT"] = "1"  # what the failed attempt left behind
            if len(made) <= fail:
                raise RuntimeError(f"bind: {why}")
            return "engine"

        return make

    import torch.distributed as dist

    cfg = in_process_config(Path("."))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # as in a fresh process
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(ds_engine, "LearnerEngine", engine(fail=2))
    assert service.build_engine(cfg) == "engine" and made == [None, None, None]
    for fail, why in ((3, "EADDRINUSE"), (1, "out of memory")):
        made.clear()
        monkeypatch.setattr(ds_engine, "LearnerEngine", engine(fail, why))
        with pytest.raises(RuntimeError, match=why):
            service.build_engine(cfg)
        assert len(made) == min(fail, 3)
