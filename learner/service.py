"""The learner service: feeder -> samples -> batches -> DeepSpeed steps -> broadcast -> checkpoint.

The loop (``Learner.run``), one optimiser step per turn::

    feeder.top_up(version)                 # TaskRequests under admission control
    batch = next_batch()                   # samples pumped from the bus by a background task
    metrics = train(batch)                 # pack trees, engine.train_step (worker thread)
    version += 1; batcher.trained(batch)   # outcomes on the ledger
    log_step(metrics)                      # Prometheus + one line of <run_dir>/metrics.jsonl
    checkpoint()                           # every ``checkpoint_every`` steps and before a
                                           # broadcast; then acks
    broadcast(version)                     # every ``broadcast.every`` steps

**Exactly once.** A sample's delivery is acked only after a checkpoint holding its outcome
(trained at version v, or dropped with a reason) is durable. A crash before that redelivers it,
and the restarted learner, loaded from the checkpoint that does not hold it, decides it again;
a crash after it (before the ack) redelivers a rollout the restored ledger already holds, which
is acked without training. While held, deliveries are kept alive with ``in_progress``
heartbeats. ``metrics.jsonl`` gets a ``start`` line on every (re)start; step lines written
before a restart whose version is above the resumed version describe steps that were rolled
back (their samples were trained again after the restart).

**A version names one set of weights.** A version is broadcast only once a checkpoint holds it
(a broadcast step is a commit point, whatever ``checkpoint_every`` says), so engines only ever
serve weights a restarted learner resumes from: a crash can roll back steps that no engine has
seen, never one that rollouts were generated with, and a resumed learner never publishes a
version number again with other weights. (With ``checkpoint_every = 0`` nothing is committed
and nothing resumes: versions are broadcast right after their step.)

**Fleet** (N ranks under torchrun/deepspeed, ``harnessrl.learner.fleet``): this service runs on rank 0
alone; the other ranks run ``follow`` and take part in every step, broadcast gather and
checkpoint save that rank 0's engine starts. A rank that dies makes rank 0's next engine call
raise (while idle, within a ping interval), so the loop fails without committing.

**Stopping** (SIGTERM, ``stop()``): the current step finishes, is committed, and the process
exits. The bus is interrupted (``Bus.interrupt``), so when NATS is down nothing waits for it:
the checkpoint is written locally, acks and the broadcast are given up (the samples are
redelivered and acked as committed, the version re-broadcast at the next start), and deliveries
held for incomplete groups are nak'ed so a restarted learner gets them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import Counter
from typing import Any

from harnessrl.common import lifecycle, metrics
from harnessrl.common.bus import Bus, BusUnavailable, Consumer
from harnessrl.common.layout import (
    CommitLine,
    MetricsLine,
    StartLine,
    StepLine,
    encode_line,
)
from harnessrl.common.records import TreeSample
from harnessrl.common.tracking import NO_TRACKER, Tracker, open_tracker
from harnessrl.learner.batching import Batch, Batcher, BatchRules, Ledger
from harnessrl.learner.checkpoint import Checkpointer, LearnerState
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.feeder import Feeder
from harnessrl.learner.fleet import FleetBroken
from harnessrl.learner.task_queue import TaskQueue

log = logging.getLogger("harnessrl.learner")

DURABLE = "learner"
IDLE_COMMIT_S = 1.0
"""Waiting this long for data with uncommitted drops (and no unsaved step) commits them."""

M_VERSION = metrics.gauge("hrl_learner_version", "Current policy version")
M_STEP_S = metrics.histogram("hrl_learner_step_seconds", "Optimiser step (pack + fwd/bwd + step)")
M_TOKENS_S = metrics.gauge(
    "hrl_learner_tokens_per_second", "Tokens computed per second (last step)"
)
M_IDLE = metrics.gauge("hrl_learner_idle_fraction", "Fraction of wall time spent waiting for data")
M_STALENESS = metrics.histogram(
    "hrl_learner_staleness_versions",
    "Versions between a trained sample's oldest tokens and the step",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
)
M_TRAINED = metrics.counter("hrl_learner_trained_rollouts_total", "Rollouts trained on")
M_LOSS = metrics.gauge(
    "hrl_learner_step_metric", "Loss terms and mismatch stats of the last step", ("name",)
)
M_EVAL = metrics.gauge(
    "hrl_learner_eval_reward", "Mean eval reward (last round)", ("suite", "harness")
)
M_CHECKPOINT_S = metrics.histogram("hrl_learner_checkpoint_seconds", "Commit duration", ("kind",))
M_NONFINITE = metrics.counter(
    "hrl_learner_nonfinite_steps_total",
    "Optimiser steps skipped because a loss or the gradient norm was NaN or inf",
)


class Learner:
    """One learner process; ``run`` until ``stop()`` or ``max_steps``."""

    def __init__(self, cfg: LearnerConfig, bus: Bus, engine: Any = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.engine = engine
        self.run_dir = cfg.run_path()
        self.ckpt = Checkpointer(cfg.checkpoint_path(), cfg.keep_checkpoints)
        self.state = LearnerState()
        self.version = 0
        self.unsaved_steps = 0
        self.stopping = asyncio.Event()
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._arrived = asyncio.Event()
        self._t_start = time.monotonic()
        self._idle_s = 0.0
        self._totals: Counter[str] = Counter()
        self.tracker: Tracker = NO_TRACKER
        self.feeder: Feeder
        self.task_queue: TaskQueue
        self.batcher: Batcher
        self.publisher: Any = None
        self.consumer: Consumer[TreeSample]

    # -- setup ------------------------------------------------------------------------------

    def build_engine(self) -> Any:
        return build_engine(self.cfg)

    async def setup(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.ckpt.exists() and not cfg.resume and cfg.checkpoint_every > 0:
            raise RuntimeError(
                f"{self.ckpt.root} already holds a checkpoint: pass --resume to continue it, or "
                "choose another --checkpoint-dir"
            )
        if self.engine is None:
            self.engine = self.build_engine()
        restored = self.ckpt.load(self.engine) if cfg.resume else None
        if restored is not None:
            self.state = restored
            self.version = restored.version
            self._totals.update(restored.totals)
        ledger = Ledger.from_state(self.state.ledger, cfg.remember)
        self.feeder = Feeder(
            self.bus,
            cfg.feeder,
            group_size=cfg.group_size,
            batch_rollouts=cfg.batch_rollouts,
            max_staleness=cfg.max_staleness,
            state=self.state.feeder or None,
        )
        self.task_queue = TaskQueue(self.bus, cfg.feeder)
        await self.task_queue.ensure()  # before any task: actors wait for it
        self.batcher = Batcher(self._rules(), ledger, on_end=self.feeder.on_ended)
        self.publisher = self._publisher()
        if self.publisher is not None and hasattr(self.publisher, "restore"):
            self.publisher.restore(self.state.broadcast)
        self.consumer = await self.bus.consumer(
            "SAMPLES",
            DURABLE,
            TreeSample,
            ack_wait=cfg.ack_wait,
            max_ack_pending=cfg.max_ack_pending,
        )
        M_VERSION.set(self.version)
        self.tracker = open_tracker(
            cfg.track, name=cfg.run, config=cfg.model_dump(mode="json"), folder=self.run_dir
        )
        self._log_line(
            StartLine(
                resumed=restored is not None,
                version=self.version,
                algo=cfg.loss.algo,
                epoch=self.feeder.epoch,
            )
        )
        log.info(
            "learner %s at version %d (%s, model %s)",
            "resumed" if restored else "started",
            self.version,
            cfg.loss.algo,
            cfg.model,
        )
        if restored is not None and self.version > 0:
            if hasattr(self.publisher, "purge"):  # a broadcast of it cut short by the crash
                await self.publisher.purge([self.version])
            await self.broadcast()  # engines restarted meanwhile may lag behind

    def _rules(self) -> BatchRules:
        c = self.cfg
        return BatchRules(
            mode=c.loss.algo,
            batch_groups=c.batch_groups,
            batch_rollouts=c.batch_rollouts,
            min_group_size=c.min_group_size,
            max_staleness=c.max_staleness,
            group_timeout_s=c.group_timeout_s,
            parts_timeout_s=c.parts_timeout_s,
            sft_min_reward=c.sft_min_reward,
            adv_eps=c.loss.adv_eps,
            adv_scale_by_std=c.loss.adv_scale_by_std,
            filter_groups=c.filter_groups,
            truncated_reward=c.truncated_reward,
            temperature=c.ds.temperature,
            vocab_size=int(self.engine.policy.lm.config.get_text_config().vocab_size),
        )

    def _publisher(self) -> Any:
        from harnessrl.common.models import resolve_model
        from harnessrl.learner.weights import make_publisher

        lm = self.engine.policy.lm
        return make_publisher(
            self.cfg.broadcast,
            self.bus,
            model_dir=resolve_model(self.cfg.model),
            config_json=lm.config.to_json_string(),
            dtype=self._broadcast_dtype(),
            default_disk_dir=self.run_dir / "weights",
        )

    def _broadcast_dtype(self) -> str:
        d = self.cfg.broadcast.dtype
        return self.cfg.ds.dtype if d == "auto" else d

    # -- the loop ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the current step, commit, and return from ``run`` (never waiting for an
        unreachable NATS: ``Bus.interrupt``)."""
        self.stopping.set()
        self._arrived.set()
        self.bus.interrupt()

    async def run(self) -> int:
        await self.setup()
        self._tasks = [
            asyncio.create_task(self._pump()),
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self.task_queue.watch()),
        ]
        clean = False
        try:
            await self._loop()
            clean = True
        finally:
            self._closing = True  # a cancellation lost inside a fetch still ends the loops
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            try:
                if clean:  # after a failure, the uncommitted work is simply redone on restart
                    try:
                        await self._final_commit()
                    finally:
                        await self._release_held()
            finally:
                self.tracker.close()
                if self.publisher is not None:
                    await self.publisher.close()
                if hasattr(
                    self.engine, "close"
                ):  # release the other ranks (harnessrl.learner.fleet)
                    await asyncio.to_thread(self.engine.close)
        return 0

    async def _loop(self) -> None:
        steps = 0
        while not self.stopping.is_set():
            if self.cfg.max_steps and steps >= self.cfg.max_steps:
                break
            await self._top_up()
            t_wait = time.monotonic()
            batch = await self._next_batch()
            if batch is None:
                break
            wait_s = time.monotonic() - t_wait
            self._idle_s += wait_s
            t0 = time.monotonic()
            m = await asyncio.to_thread(self._train, batch)
            self.version += 1
            steps += 1
            self.unsaved_steps += 1
            staleness = batch.staleness(self.version - 1)
            self.batcher.trained(batch, self.version)
            bcast = self.publisher is not None and self.version % self.cfg.broadcast.every == 0
            # the step line goes to metrics.jsonl *before* the checkpoint that makes the step
            # durable: a crash in between leaves a line that the next ``start`` line rolls back
            # (``effective_steps``), never a durable step without its line
            every = self.cfg.checkpoint_every
            will_commit = every == 0 or self.unsaved_steps >= every or bcast
            self._after_step(batch, m, staleness, wait_s, time.monotonic() - t0, will_commit)
            # a version reaches the engines only once committed (see the module docstring)
            ckpt_s = await self._maybe_commit(force=bcast)
            bcast_s = await self.broadcast() if bcast else None
            if ckpt_s:
                self._log_line(
                    CommitLine(version=self.version, checkpoint_s=ckpt_s, broadcast_s=bcast_s)
                )

    async def _next_batch(self) -> Batch | None:
        """Wait for a complete batch (None when stopping); commit drops while idle."""
        idle_since = time.monotonic()
        while True:
            batch = self.batcher.take(self.version)
            if batch is not None:
                return batch
            if self.stopping.is_set():
                return None
            for t in self._tasks:  # a background loop that died is a bug: surface it
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), 0.5)
            if time.monotonic() - idle_since > IDLE_COMMIT_S and self._can_commit_state():
                await self._commit_state()
            await self._top_up()
            if hasattr(self.engine, "keepalive"):  # other learner ranks: see learner.fleet
                await asyncio.to_thread(self.engine.keepalive)

    async def _pump(self) -> None:
        """Fetch samples into the batcher; ack redeliveries whose outcome is committed."""
        while not self._closing:
            try:
                got = await self.consumer.fetch(self.cfg.fetch_batch, timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the bus reconnects by itself
                log.warning("fetching samples failed: %r", e)
                await asyncio.sleep(1.0)
                continue
            if not got:
                continue
            await asyncio.sleep(0)  # an in-memory bus answers without yielding
            ack_now = []
            for d in got:
                ack_now += self.batcher.add(d, self.version)
            await self._ack(ack_now)
            self._arrived.set()
            await self._top_up()

    async def _top_up(self) -> None:
        """Let the feeder issue what admission control allows (nothing once stopping)."""
        if self.stopping.is_set():
            return
        try:
            await self.feeder.top_up(self.version)
        except BusUnavailable as e:  # stopping while NATS is down: nothing to issue to
            log.info("not issuing tasks: %s", e)

    async def _heartbeat(self) -> None:
        """Keep every held delivery from being redelivered while it waits; dead-letter what the
        batcher gave up on."""
        every = max(0.5, self.cfg.ack_wait / 3)
        while not self._closing:
            await asyncio.sleep(every)
            await self._dead_letter()
            for d in self.batcher.held():
                try:
                    await d.in_progress()
                except Exception as e:  # best effort; a redelivery is handled anyway
                    log.debug("in_progress failed: %r", e)

    async def _dead_letter(self) -> None:
        """Dead-letter the deliveries the batcher gave up (parts of an incomplete split sample,
        with the reason); one that fails stays held and is retried on the next beat."""
        for d, why in self.batcher.take_dead_letters():
            try:
                await d.dead_letter(why)
            except Exception as e:
                log.warning("dead-lettering sample seq %d failed (%r); will retry", d.seq, e)
                self.batcher.dead.append((d, why))

    async def _ack(self, deliveries: list[Any]) -> None:
        for i, d in enumerate(deliveries):
            try:
                await d.ack()
            except BusUnavailable:  # stopping with NATS down: redelivered, acked as committed
                log.info("NATS unreachable: %d samples left unacked", len(deliveries) - i)
                return
            except Exception as e:  # unacked: redelivered later and acked as committed
                log.warning("ack failed: %r", e)

    async def _release_held(self) -> None:
        """At exit: nak every delivery still held (members of incomplete groups, outcomes a
        failed commit could not make durable), so the next learner gets them at once instead
        of after ``ack_wait``."""
        held = self.batcher.held() if hasattr(self, "batcher") else []
        for d in held:
            if self.bus.abandoning:
                log.info("NATS unreachable: %d held samples redelivered after ack_wait", len(held))
                return
            with contextlib.suppress(Exception):
                await d.nak()

    # -- training ---------------------------------------------------------------------------

    def _train(self, batch: Batch) -> dict[str, float]:
        """Pack and step (worker thread: touches only the engine and the batch)."""
        from harnessrl.learner.packing import pack

        packing = pack(
            batch.samples,
            self.cfg.pack,
            advantages=batch.advantages,
            temperatures=[self._temperature(s) for s in batch.samples],
            drop_missing_logprobs=self.cfg.loss.algo != "sft",  # SFT's NLL needs none
        )
        k = self.cfg.updates_per_batch
        old = old_adv = None
        t0 = time.perf_counter()
        skipped, nonfinite = 0.0, set()
        for i in range(k):
            # pi_old of the later steps: the first step's own forward (the weights before any
            # update on this batch), not a no-grad pass of its own (the demo's GRPO, K2: busy
            # 4.42 -> 3.45 s per step); PPO's advantages are fixed by that step too
            keep = i == 0 and k > 1
            m = self.engine.train_step(
                packing.rows, old_logp=old, keep_logp=keep, version=self.version, old_adv=old_adv
            )
            skipped += m.get("skipped", 0.0)
            nonfinite.update(getattr(self.engine, "last_nonfinite", ()))
            if keep:
                old, old_adv = self.engine.last_logp, self.engine.last_adv
        if k > 1:
            m.update({"updates": float(k), "step_time_s": time.perf_counter() - t0})
        m["skipped"] = skipped
        if skipped:
            log.warning(
                "version %d: %d of %d optimiser steps skipped (a loss or gradient norm was not "
                "finite; weights unchanged by them); rollouts with a non-finite loss: %s",
                self.version + 1,
                skipped,
                k,
                ", ".join(batch.samples[i].rollout_id for i in sorted(nonfinite)) or "none",
            )
        m.update({f"pack/{k}": float(v) for k, v in packing.stats.as_dict().items()})
        return m

    def _temperature(self, s: TreeSample) -> float:
        """The temperature a sample's log-probs are taken at: RL, the one it was sampled with
        (recorded by the proxy; the batcher refused any other than ``ds.temperature``); SFT,
        and samples that recorded none, ``ds.temperature`` (default 1)."""
        own = self.cfg.ds.temperature if self.cfg.ds.temperature is not None else 1.0
        if self.cfg.loss.algo == "sft" or s.sampling is None:
            return own
        return s.sampling.temperature

    async def broadcast(self) -> float:
        """Publish the current weights as ``self.version``; returns seconds (0 if disabled)."""
        if self.publisher is None:
            return 0.0
        import torch

        t0 = time.monotonic()
        dtype = getattr(torch, self._broadcast_dtype())
        state = await asyncio.to_thread(self.engine.state_dict_for_broadcast, dtype)
        try:
            await self.publisher.publish(self.version, self.engine.global_steps, state)
        except Exception as e:  # engines catch up with the next version
            log.error("broadcast of version %d failed: %r", self.version, e)
            self._totals["broadcast_failures"] += 1
        return time.monotonic() - t0

    # -- commits ----------------------------------------------------------------------------

    def _snapshot(self) -> LearnerState:
        st = self.state
        st.version = self.version
        st.ledger = self.batcher.ledger.begin_commit()
        st.feeder = self.feeder.state()
        st.broadcast = self.publisher.state() if self.publisher is not None else {}
        self._totals["wall_s"] += time.monotonic() - self._t_start
        self._t_start = time.monotonic()
        st.totals = dict(self._totals)
        return st

    async def _maybe_commit(self, force: bool = False) -> float:
        """Commit when ``checkpoint_every`` steps are unsaved (or ``force``: a broadcast
        follows); seconds it took (0: none)."""
        every = self.cfg.checkpoint_every
        if every == 0:  # no checkpoints: outcomes are final once recorded
            self.batcher.ledger.begin_commit()
            await self._ack(self.batcher.ledger.end_commit())
            return 0.0
        if self.unsaved_steps < every and not force:
            return 0.0
        return await self._commit_full()

    async def _commit_full(self) -> float:
        t0 = time.monotonic()
        st = self._snapshot()
        try:
            self.state = await asyncio.to_thread(self.ckpt.save, self.engine, st)
        except Exception:
            self.batcher.ledger.abort_commit()
            raise
        self.unsaved_steps = 0
        await self._ack(self.batcher.ledger.end_commit())
        dt = time.monotonic() - t0
        M_CHECKPOINT_S.labels(kind="full").observe(dt)
        return dt

    def _can_commit_state(self) -> bool:
        return (
            self.cfg.checkpoint_every > 0
            and self.unsaved_steps == 0
            and self.batcher.ledger.dirty
            and self.ckpt.exists()
        )

    async def _commit_state(self) -> None:
        """State-only commit (no step since the last full one): drops become durable."""
        t0 = time.monotonic()
        st = self._snapshot()
        try:
            self.state = await asyncio.to_thread(self.ckpt.save_state, st)
        except Exception:
            self.batcher.ledger.abort_commit()
            raise
        await self._ack(self.batcher.ledger.end_commit())
        self._log_line(CommitLine(version=self.version, dropped=self._dropped()))
        M_CHECKPOINT_S.labels(kind="state").observe(time.monotonic() - t0)

    async def _final_commit(self) -> None:
        if self.cfg.checkpoint_every == 0 or not hasattr(self, "batcher"):
            return
        try:
            if self.unsaved_steps > 0:
                await self._commit_full()
            elif self.batcher.ledger.dirty and self.ckpt.exists():
                await self._commit_state()
            elif self.batcher.ledger.dirty:
                await self._commit_full()  # nothing saved yet: write the first checkpoint
        except FleetBroken:
            raise  # a rank is gone: nothing was committed, exit with an error
        except Exception:
            log.exception("final checkpoint failed")

    # -- reporting --------------------------------------------------------------------------

    def _dropped(self) -> dict[str, int]:
        return dict(self.batcher.ledger.counts)

    def _after_step(
        self,
        batch: Batch,
        m: dict[str, float],
        staleness: list[int],
        wait_s: float,
        busy_s: float,
        will_commit: bool,
    ) -> None:
        if batch.samples:  # replies cut off at the token limit: the junk-until-the-limit signal
            cut = sum(s.counters.truncated_calls > 0 for s in batch.samples)
            m["rollouts/truncated_frac"] = cut / len(batch.samples)
        wall = self._totals["wall_s"] + time.monotonic() - self._t_start
        self._totals["idle_s"] += wait_s
        self._totals["samples"] += len(batch.samples)
        self._totals["tokens"] += m.get("tokens_computed", 0.0)
        if m.get("skipped"):
            M_NONFINITE.inc(m["skipped"])
            self._totals["nonfinite_steps"] += int(m["skipped"])
        m["learner/nonfinite_steps_total"] = float(self._totals["nonfinite_steps"])
        idle_frac = self._totals["idle_s"] / wall if wall > 0 else 0.0
        M_VERSION.set(self.version)
        M_STEP_S.observe(m.get("step_time_s", busy_s))
        M_TOKENS_S.set(m.get("tokens_per_s", 0.0))
        M_IDLE.set(idle_frac)
        M_TRAINED.inc(len(batch.samples))
        for s in staleness:
            M_STALENESS.observe(s)
        for k, v in m.items():
            M_LOSS.labels(name=k).set(v)
        evals = self._eval_summary()
        rewards = [s.reward for s in batch.samples]
        line = StepLine(
            version=self.version,
            step=int(m.get("step", self.version)),
            samples=len(batch.samples),
            groups=batch.groups,
            reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
            wait_s=wait_s,
            busy_s=busy_s,
            step_time_s=m.get("step_time_s", 0.0),
            tokens_per_s=m.get("tokens_per_s", 0.0),
            idle_frac=idle_frac,
            committed=will_commit,
            staleness={str(k): v for k, v in sorted(Counter(staleness).items())},
            dropped=self._dropped(),
            in_flight=self.feeder.in_flight,
            batcher=self.batcher.stats(),
            metrics=m,
            rollouts=batch.rollout_ids,
            eval=evals or None,
        )
        self._log_line(line)
        log.info(
            "version %d: %d samples, loss %.4g, %.0f tok/s, wait %.2fs, idle %.0f%%",
            self.version,
            len(batch.samples),
            m.get("loss/total", m.get("loss/sft", float("nan"))),
            m.get("tokens_per_s", 0.0),
            wait_s,
            100 * idle_frac,
        )

    def _eval_summary(self) -> dict[str, dict[str, float]]:
        by: dict[tuple[str, str], list[float]] = {}
        for s in self.batcher.take_eval_results():
            by.setdefault((s.suite, s.harness), []).append(s.reward)
        out = {}
        for (suite, harness), rs in by.items():
            mean = sum(rs) / len(rs)
            M_EVAL.labels(suite=suite, harness=harness).set(mean)
            out[f"{suite}/{harness}"] = {"mean": mean, "n": len(rs)}
        return out

    def _log_line(self, line: MetricsLine) -> None:
        line.time = time.time()
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(encode_line(line) + "\n")
        self.tracker.line(line)


def build_engine(cfg: LearnerConfig) -> Any:
    """The ``LearnerEngine`` of ``cfg`` (on every rank of a fleet)."""
    import os

    import torch
    import torch.distributed as dist
    from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

    from harnessrl.learner.ds_engine import LearnerEngine

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)

    def port_taken(e: BaseException) -> bool:
        # the rendezvous port was picked free and taken by someone else before use
        return isinstance(e, RuntimeError) and "EADDRINUSE" in str(e) and not dist.is_initialized()

    def another_port(state: RetryCallState) -> None:
        log.warning("rendezvous port taken (%s); retrying with another", state.outcome.exception())
        if os.environ.get("WORLD_SIZE", "1") == "1":
            os.environ.pop("MASTER_PORT", None)

    retrying = Retrying(
        stop=stop_after_attempt(3),
        retry=retry_if_exception(port_taken),
        before_sleep=another_port,
        reraise=True,
    )
    return retrying(LearnerEngine, cfg.model, cfg.ds, cfg.loss)


def follow(cfg: LearnerConfig) -> int:
    """A learner rank other than 0: no bus, no metrics server; build the engine and do rank 0's
    part-commands until it stops (``harnessrl.learner.fleet``). SIGTERM and SIGINT are left to rank 0,
    which finishes its step and commits with every rank; if rank 0 dies, the next collective
    fails and this rank exits non-zero."""
    import signal

    from harnessrl.learner.fleet import world

    rank, size = world()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: log.info("rank %d: stopping is rank 0's decision", rank))
    engine = build_engine(cfg)
    log.info("learner rank %d of %d following rank 0", rank, size)
    engine.follow()
    log.info("learner rank %d of %d: stopped by rank 0", rank, size)
    return 0


async def serve(cfg: LearnerConfig, bus: Bus | None = None) -> int:
    """The learner process on rank 0: connect, serve ``/metrics``, run the learner until a
    signal (which finishes the step and commits: see the module docstring) or ``max_steps``.
    ``bus``: use this one instead of connecting."""

    async def body(proc: lifecycle.Process) -> int:
        if proc.metrics_port:
            log.info("metrics on :%d/metrics", proc.metrics_port)
        learner = Learner(cfg, proc.bus)
        proc.on_stop(learner.stop)
        return await learner.run()

    return await lifecycle.serve(cfg, "learner", body, bus=bus)


def main(cfg: LearnerConfig) -> int:
    """``harnessrl learner``: rank 0 serves, the other ranks of a fleet follow it; a learner
    that cannot start prints one line and exits 2."""
    from harnessrl.common import aio
    from harnessrl.learner.fleet import world

    rank, size = world()
    if size > 1:
        from harnessrl.common.procs import die_with_parent

        die_with_parent()  # a rank never outlives its launcher
    aio.setup_logging(cfg.log_level, "learner" if rank == 0 else f"learner-rank{rank}")
    try:
        return follow(cfg) if rank > 0 else aio.run(serve(cfg))
    except RuntimeError as e:
        print(f"harnessrl learner: {e}", file=sys.stderr)
        return 2
