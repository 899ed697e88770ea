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

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
