"""Learner correctness on the real DeepSpeed engine (CPU, gloo): what a step must never do
(take a non-finite update), and which quantities it fixes for the updates of one batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from benchmarks._learner_fleet import make_samples, rows_for
from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
from harnessrl.learner.losses import LossConfig
from harnessrl.learner.policy import load_policy
from tests.helpers.learner import one_torch_thread  # noqa: F401  (autouse)

pytestmark = pytest.mark.slow


def params(engine: LearnerEngine) -> dict[str, torch.Tensor]:
    """The whole LM's weights (gathered under ZeRO-3, where parameters are partitioned)."""
    sd = engine.state_dict_for_broadcast(torch.float32, dedupe_tied=False)
    return {k: v.clone() for k, v in sd.items()}


def optimiser_state(engine: LearnerEngine) -> list[torch.Tensor]:
    """Every tensor of the optimiser's state, flattened (Adam's moments, whatever the stage)."""
    sd = engine.engine.optimizer.state_dict()
    out: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x.detach().float().clone().flatten())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(sd)
    return out


STAGES = [
    pytest.param(0, "float32", id="zero0-fp32"),
    pytest.param(0, "bfloat16", id="zero0-bf16"),
    pytest.param(2, "float32", id="zero2-fp32"),
    pytest.param(3, "float32", id="zero3-fp32"),
]


@pytest.mark.parametrize(("stage", "dtype"), STAGES)
def test_a_nonfinite_loss_never_reaches_the_optimiser(stage: int, dtype: str) -> None:
    """One sample with a NaN advantage makes its micro-batch's loss NaN: the step is skipped on
    every path (weights and Adam state unchanged, counted, the sample named) and the next clean
    step trains as usual."""
    policy = load_policy("tiny-1m", attn_implementation="sdpa")
    cfg = DeepSpeedConfig(zero_stage=stage, dtype=dtype, lr=1e-3, micro_batch_rows=1)
    engine = LearnerEngine(policy, cfg, LossConfig(algo="grpo"))
    rows = rows_for(make_samples(3), budget=40)
    assert len(rows) >= 2
    engine.train_step(rows)  # Adam state exists from here on
    before, opt_before, steps = params(engine), optimiser_state(engine), engine.global_steps
    bad = copy.deepcopy(rows)
    target = int(bad[-1].sample_index[bad[-1].loss_mask > 0][0])
    bad[-1].advantage = bad[-1].advantage.copy()
    bad[-1].advantage[bad[-1].sample_index == target] = np.nan
    m = engine.train_step(bad)
    assert m["skipped"] == 1.0
    assert target in engine.last_nonfinite
    after = params(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt_after = optimiser_state(engine)
    assert len(opt_after) == len(opt_before)
    assert all(torch.equal(a, b) for a, b in zip(opt_before, opt_after, strict=True))
    assert engine.global_steps == steps + 1
    m = engine.train_step(rows)
    assert m["skipped"] == 0.0 and engine.last_nonfinite == []
    assert np.isfinite(m["loss/total"])
    moved = params(engine)
    assert any(not torch.equal(after[k], moved[k]) for k in after)
    assert all(torch.isfinite(v).all() for v in moved.values())


# ------------------------------------------------------------------------------------------
# the learner service (in process, on a memory bus): what it hands the engine each update
# ------------------------------------------------------------------------------------------


def group(gid: str, n: int = 4, *, seed: int = 0, temperature: float | None = None) -> list:
    """One GRPO group of ``n`` samples over tiny-1m's vocabulary, rewards 0/1 alternating."""
    import msgspec

    from harnessrl.common.records import SamplingParams

    out = []
    for s in make_samples(seed, n):
        s = msgspec.structs.replace(
            s, rollout_id=f"{gid}-{s.k}-1", group_id=gid, group_size=n, weight_version=0
        )
        if temperature is not None:
            s.sampling = SamplingParams(temperature=temperature)
        out.append(s)
    return out


async def run_learner(tmp_path, samples: list, spy=None, **cfg):
    """A learner with its feeder off, fed ``samples`` (published first), run to ``max_steps``;
    ``spy(learner, real_train_step)`` may wrap the engine's ``train_step``."""
    import asyncio
    import uuid

    from harnessrl.common.bus import connect
    from harnessrl.learner.config import LearnerConfig
    from harnessrl.learner.service import Learner

    base = {
        "model": "tiny-1m",
        "run": "t",
        "run_dir": str(tmp_path / "run"),
        "metrics_port": -1,
        "min_group_size": 2,
        "batch_groups": 1,
        "max_staleness": 100,
        "checkpoint_every": 0,
        "feeder": {"enabled": False},
        "pack": {"max_tokens": 256},
    }
    bus = await connect(f"memory://{uuid.uuid4().hex}", "t")
    try:
        await bus.publish_many([(bus.subjects.samples, s, s.msg_id()) for s in samples])
        learner = Learner(LearnerConfig.model_validate({**base, **cfg}), bus)
        if spy is not None:  # wrap the engine the learner builds at its start
            build = learner.build_engine

            def build_and_spy():
                engine = build()
                engine.train_step = spy(learner, engine.train_step)
                return engine

            learner.build_engine = build_and_spy
        assert await asyncio.wait_for(learner.run(), 600) == 0
        return learner
    finally:
        await bus.close()


def step_lines(tmp_path) -> list:
    from harnessrl.common.layout import StepLine, read_metrics

    return [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if isinstance(m, StepLine)]


@pytest.mark.parametrize("k", [1, 2, 4])
async def test_the_lr_schedule_counts_versions(tmp_path, k: int) -> None:
    """With 1, 2 or 4 optimiser steps per batch the cosine over ``lr_decay_versions`` = the run's
    versions reaches its floor at the last version, and every update of a version takes that
    version's lr (the schedule used to count optimiser steps: with 2 per batch it reached the
    floor half-way through the run)."""
    lrs: list[tuple[int, float]] = []

    def spy(learner, real):
        def train_step(rows, *a, **kw):
            m = real(rows, *a, **kw)
            lrs.append((learner.version, m["lr"]))
            return m

        return train_step

    samples = [s for g in range(4) for s in group(f"g{g}", seed=g)]
    ds = {"lr": 1e-3, "lr_decay_versions": 4, "lr_min_ratio": 0.1}
    await run_learner(tmp_path, samples, spy, max_steps=4, updates_per_batch=k, ds=ds)
    by_version: dict[int, list[float]] = {}
    for v, lr in lrs:
        by_version.setdefault(v, []).append(lr)
    assert sorted(by_version) == [0, 1, 2, 3] and all(len(x) == k for x in by_version.values())
    assert all(len(set(x)) == 1 for x in by_version.values())  # one lr per version
    first, *_, last = (by_version[v][0] for v in range(4))
    assert first == pytest.approx(1e-3) and last == pytest.approx(1e-4)
    assert by_version[1][0] > by_version[2][0] > last
    assert [line.metrics["lr"] for line in step_lines(tmp_path)][-1] == pytest.approx(1e-4)


async def test_a_skipped_step_is_counted_and_the_run_goes_on(tmp_path, caplog) -> None:
    """A batch whose loss is not finite (here: one sample's advantage made NaN on its way to the
    engine) is skipped, logged with its rollout, counted, and the next versions train."""

    def spy(learner, real):
        def train_step(rows, *a, **kw):
            if learner.version == 1:
                rows = copy.deepcopy(rows)
                rows[0].advantage = rows[0].advantage.copy()
                rows[0].advantage[rows[0].sample_index == rows[0].sample_index[0]] = np.nan
            return real(rows, *a, **kw)

        return train_step

    samples = [s for g in range(3) for s in group(f"g{g}", seed=g)]
    with caplog.at_level("WARNING", logger="harnessrl.learner"):
        learner = await run_learner(tmp_path, samples, spy, max_steps=3, ds={"lr": 1e-3})
    assert learner.version == 3
    lines = step_lines(tmp_path)
    assert [line.metrics["skipped"] for line in lines] == [0.0, 1.0, 0.0]
    assert [line.metrics["learner/nonfinite_steps_total"] for line in lines] == [0.0, 1.0, 1.0]
    skipped = [r.getMessage() for r in caplog.records if "steps skipped" in r.getMessage()]
    assert len(skipped) == 1 and "version 2" in skipped[0] and "g1-" in skipped[0]


async def test_later_updates_use_the_batchs_first_pi_old_and_advantages(tmp_path) -> None:
    """PPO, three updates per batch: updates 2 and 3 both take pi_old and the advantages of the
    first update (the log-probs and whitened ``R - V`` of the weights before any update on the
    batch), not those of the update before them, nor the critic re-read as it moves."""
    from harnessrl.learner.losses import norm_weights, ppo_advantages, whiten

    calls: list[dict] = []

    def spy(learner, real):
        def train_step(rows, old_logp=None, *, keep_logp=False, version=None, old_adv=None):
            eng = learner.engine
            seen = {"old_logp": old_logp, "old_adv": old_adv, "keep": keep_logp}
            if old_logp is None:  # the weights before the batch's first update
                logps, values = eng._no_grad_pass(rows)
                r = np.concatenate([row.returns for row in rows])
                mask = np.concatenate([row.loss_mask for row in rows])
                adv = ppo_advantages(torch.from_numpy(r), torch.from_numpy(np.concatenate(values)))
                idx = np.concatenate([row.sample_index for row in rows])
                w = norm_weights(idx, mask, eng.loss_cfg.norm) * mask
                seen["pass_logp"] = np.concatenate(logps)
                seen["pass_adv"] = whiten(adv, torch.from_numpy(w)).numpy()
            m = real(rows, old_logp, keep_logp=keep_logp, version=version, old_adv=old_adv)
            seen["kept_logp"], seen["kept_adv"] = eng.last_logp, eng.last_adv
            calls.append(seen)
            return m

        return train_step

    samples = group("g0")
    learner = await run_learner(
        tmp_path,
        samples,
        spy,
        algo="ppo",
        max_steps=1,
        updates_per_batch=3,
        loss={"value_baseline": "token"},  # V per token: the no-grad pass above reads the same
        ds={"lr": 0.02, "value_lr_scale": 50.0},
    )
    first, second, third = calls
    assert first["keep"] and first["old_logp"] is None and first["old_adv"] is None
    np.testing.assert_allclose(np.concatenate(first["kept_logp"]), first["pass_logp"], atol=1e-5)
    np.testing.assert_allclose(np.concatenate(first["kept_adv"]), first["pass_adv"], atol=1e-4)
    for later in (second, third):
        assert later["old_logp"] is first["kept_logp"] and later["old_adv"] is first["kept_adv"]
    # and the engine trains on the advantages it is given: all zero, no policy gradient
    rows = rows_for(samples, budget=256)
    zeros = [np.zeros(len(r.target_ids), np.float32) for r in rows]
    m = learner.engine.train_step(rows, learner.engine.logprobs(rows), old_adv=zeros)
    assert m["loss/pg"] == 0.0


async def test_the_learner_takes_log_probs_at_the_sampled_temperature(tmp_path) -> None:
    """Samples drawn at temperature 0.6, whose behaviour log-probs are exactly the learner's own
    weights' at 0.6 (an engine in step with the learner): the learner, with no temperature of
    its own set, takes its log-probs at the recorded 0.6 and sees no mismatch (it used its own
    temperature, 1, and compared softmax(z) with softmax(z / 0.6))."""
    from harnessrl.common.records import pack_f32, unpack_f32
    from harnessrl.learner.packing import PackConfig, collate, pack

    policy = load_policy("tiny-1m", attn_implementation="sdpa", temperature=0.6)
    samples = group("g0", temperature=0.6)
    for s in samples:
        (row,) = pack([s], PackConfig(max_tokens=256, share_prefixes=False)).rows
        with torch.no_grad():
            lp = policy(**collate([row]).model_inputs()).logprobs.numpy()
        per_node = {i: unpack_f32(n.logprobs).copy() for i, n in enumerate(s.nodes)}
        for n, o, v, m in zip(row.target_node, row.target_offset, lp, row.loss_mask, strict=True):
            if m > 0:
                per_node[int(n)][int(o)] = v
        for i, n in enumerate(s.nodes):
            if n.logprobs:
                n.logprobs = pack_f32(per_node[i])
    await run_learner(tmp_path, samples, max_steps=1, ds={"lr": 1e-4})
    (line,) = step_lines(tmp_path)
    assert line.metrics["tokens"] > 10
    assert line.metrics["mismatch/abs_dlogp"] < 1e-4, line.metrics["mismatch/abs_dlogp"]


def test_per_token_corruption_of_behaviour_log_probs_changes_the_step() -> None:
    """Under the default TIS, behaviour log-probs are not decoration: corrupting them per token
    (zero-mean noise, so no constant offset Adam would scale away) changes the update and shows
    in the mismatch metrics, while a constant offset does not change the update direction
    (a learner that ignored them would take the same step either way)."""
    cfg = DeepSpeedConfig(zero_stage=0, lr=1e-3, micro_batch_rows=4, grad_clip=0.0)
    engine = LearnerEngine("tiny-1m", cfg, LossConfig(algo="grpo"))
    rows = rows_for(make_samples(5), budget=256)
    own = engine.logprobs(rows)
    snapshot = copy.deepcopy(engine.engine.module.state_dict())
    opt = copy.deepcopy(engine.engine.optimizer.state_dict())
    rng = np.random.default_rng(0)

    def step(rollout: list[np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        engine.engine.module.load_state_dict(snapshot)
        engine.engine.optimizer.load_state_dict(opt)
        batch = copy.deepcopy(rows)
        for r, lp in zip(batch, rollout, strict=True):
            r.rollout_logp = lp.astype(np.float32)
        m = engine.train_step(batch)
        return params(engine), m

    clean, m_clean = step(own)
    noisy, m_noisy = step([lp + rng.normal(0, 0.7, len(lp)) for lp in own])
    shifted, _ = step([lp - 0.2 for lp in own])  # w = e^0.2 on every token: a rescaled step
    assert m_clean["mismatch/abs_dlogp"] == 0.0 and m_noisy["mismatch/abs_dlogp"] > 0.3
    assert m_noisy["is/tis_clip_frac"] > 0
    moved = max(float((clean[k] - noisy[k]).abs().max()) for k in clean)
    assert moved > 1e-5, moved
    # Adam normalises a uniform rescale away: the offset alone barely moves the update
    offset = max(float((clean[k] - shifted[k]).abs().max()) for k in clean)
    assert offset < moved / 10, (offset, moved)
