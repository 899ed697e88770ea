"""Off-policy mechanics, measured in real training steps (the ablation benchmark's loop):
on-policy rollouts show |dlogp| ~ 0 and no TIS clipping; an injected engine/trainer mismatch
shows clearly positive |dlogp| and clipping."""

from __future__ import annotations

import tempfile

import pytest
import torch

from benchmarks.offpolicy_ablation import Run, train
from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def learner_and_ckpt():
    torch.set_num_threads(1)
    learner = LearnerEngine("tiny-1m", DeepSpeedConfig(lr=3e-3, grad_clip=1.0))
    with tempfile.TemporaryDirectory() as d:
        learner.save_checkpoint(d, {})
        yield learner, d


def test_on_policy_has_no_mismatch_and_never_clips(learner_and_ckpt) -> None:
    learner, ckpt = learner_and_ckpt
    learner.load_checkpoint(ckpt)
    res = train(learner, Run("on", 0, "tis", 0.0), steps=2, groups=2, n=4)
    assert res["abs_dlogp"] < 1e-3
    assert res["tis_clip_frac"] == 0.0


def test_injected_mismatch_is_measured_and_clipped(learner_and_ckpt) -> None:
    learner, ckpt = learner_and_ckpt
    learner.load_checkpoint(ckpt)
    res = train(learner, Run("mismatch", 0, "tis", 2.0), steps=2, groups=2, n=4)
    assert res["abs_dlogp"] > 0.05
    assert res["tis_clip_frac"] > 0.0
