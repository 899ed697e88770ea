"""A scored token whose behaviour log-prob the engine did not give is marked missing (NaN) from
the engine client to the learner's packing, left out of the loss and counted; it is never
trained as if the engine had sampled it with probability 1 (``log mu = 0``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8
from harnessrl.common.tree import node_arrays
from harnessrl.learner.packing import PackConfig, pack
from harnessrl.proxy.sglang import GenerateResult

pytestmark = pytest.mark.unit


def test_the_client_marks_a_missing_engine_logprob_as_nan() -> None:
    body = {
        "output_ids": [10, 11, 12],
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.5, 10, None], [None, 11, None], [-1.25, 12, None]],
        },
    }
    res = GenerateResult.from_json(body)
    assert res.logprobs[0] == -0.5 and res.logprobs[2] == -1.25
    assert math.isnan(res.logprobs[1])


def test_a_scored_node_without_logprobs_is_missing_not_zero() -> None:
    scored = TreeNode(parent=0, token_ids=pack_ids([5, 6, 7]), loss_mask=pack_u8([1, 0, 1]))
    _, lp, mask = node_arrays(scored)
    assert mask.tolist() == [1, 0, 1]
    assert math.isnan(lp[0]) and lp[1] == 0.0 and math.isnan(lp[2])
    env = TreeNode(parent=-1, token_ids=pack_ids([1, 2]))
    _, lp, mask = node_arrays(env)
    assert lp.tolist() == [0.0, 0.0] and mask.tolist() == [0, 0]


def sample_with_gaps() -> TreeSample:
    """A prompt, a reply whose second token has a NaN log-prob, and a scored node that recorded
    no log-probs at all."""
    return TreeSample(
        rollout_id="g-0-1",
        group_id="g",
        k=0,
        reward=1.0,
        nodes=[
            TreeNode(parent=-1, token_ids=pack_ids([3, 4, 5])),
            TreeNode(
                parent=0,
                token_ids=pack_ids([6, 7, 8, 9]),
                logprobs=pack_f32([-0.1, np.nan, -0.3, -0.4]),
                loss_mask=pack_u8([1, 1, 1, 1]),
            ),
            TreeNode(parent=1, token_ids=pack_ids([10, 11]), loss_mask=pack_u8([1, 1])),
        ],
    )


def test_packing_leaves_missing_logprobs_out_and_counts_them() -> None:
    packing = pack([sample_with_gaps()], PackConfig(max_tokens=64), advantages=[1.0])
    (row,) = packing.rows
    scored = [
        (int(n), int(o), float(lp))
        for n, o, lp, m in zip(
            row.target_node, row.target_offset, row.rollout_logp, row.loss_mask, strict=True
        )
        if m > 0
    ]
    assert [(n, o) for n, o, _ in scored] == [(1, 0), (1, 2), (1, 3)]
    assert all(math.isfinite(lp) for _, _, lp in scored)
    assert packing.stats.missing_logprob_tokens == 3
    assert packing.stats.as_dict()["missing_logprob_tokens"] == 3
    clean = pack([sample_with_gaps()], PackConfig(max_tokens=64, targets="all"))
    assert clean.stats.missing_logprob_tokens == 3


@pytest.mark.unit
def test_sft_keeps_tokens_whose_log_probs_are_missing() -> None:
    """SFT's NLL needs no behaviour log-prob: with ``drop_missing_logprobs=False`` (the learner
    in SFT mode) every scored token stays a target."""
    packing = pack([sample_with_gaps()], PackConfig(max_tokens=64), drop_missing_logprobs=False)
    (row,) = packing.rows
    assert int(row.loss_mask.sum()) == 6 and packing.stats.missing_logprob_tokens == 3
