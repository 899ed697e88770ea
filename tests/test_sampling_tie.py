"""One source of truth for the temperature a rollout was sampled at: the proxy records it in
every CallRecord, the assembler carries it (refusing a rollout whose calls disagree), the
learner takes each sample's log-probs at it (refusing samples it cannot match), and a run ties
the learner's setting to the actor's before anything starts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harnessrl.common import records as r
from harnessrl.common.config import ConfigError
from harnessrl.common.run.plan import tie_sampling
from harnessrl.common.tree import assemble
from harnessrl.learner.batching import Batcher, BatchRules, Ledger
from harnessrl.learner.packing import PackConfig, collate, pack
from harnessrl.learner.policy import load_policy

pytestmark = pytest.mark.unit

RID = "g-0-1"


def calls(*sampling: r.SamplingParams) -> list[r.CallRecord]:
    """A chain of calls, each extending the last one's input and output by a turn."""
    out, inp = [], [1, 2, 3]
    for seq, sp in enumerate(sampling):
        reply = [10 + seq, 11 + seq]
        out.append(
            r.CallRecord(
                rollout_id=RID,
                seq=seq,
                suffix_ids=r.pack_ids(inp),
                input_len=len(inp),
                input_hash=r.ids_hash(inp),
                output_ids=r.pack_ids(reply),
                output_logprobs=r.pack_f32([-0.5, -0.25]),
                finish_reason="stop",
                weight_version_start=0,
                weight_version_end=0,
                sampling=sp,
            )
        )
        inp = inp + reply + [5, 6]
    return out


def result(n_calls: int) -> r.RolloutResult:
    return r.RolloutResult(
        rollout_id=RID, task_id="t", group_id="g", k=0, attempt=1, n_calls=n_calls, reward=1.0
    )


def test_the_assembler_carries_the_calls_sampling() -> None:
    sp = r.SamplingParams(temperature=0.7, max_new_tokens=64)
    s = assemble(calls(sp, sp, r.SamplingParams(temperature=0.7, max_new_tokens=32)), result(3))
    assert not s.is_tombstone
    assert s.sampling is not None and (s.sampling.temperature, s.sampling.top_p) == (0.7, 1.0)
    back = r.decode(r.encode(s), r.TreeSample)
    assert back.sampling == s.sampling


def test_a_rollout_sampled_two_ways_is_refused() -> None:
    s = assemble(calls(r.SamplingParams(temperature=0.7), r.SamplingParams()), result(2))
    assert s.is_tombstone and s.dropped_reason == "mixed_sampling"


def sample(temperature: float | None, top_p: float = 1.0, reward: float = 0.0) -> r.TreeSample:
    sp = None if temperature is None else r.SamplingParams(temperature=temperature, top_p=top_p)
    return r.TreeSample(
        rollout_id=RID,
        group_id="g",
        k=0,
        group_size=1,
        reward=reward,
        sampling=sp,
        nodes=[
            r.TreeNode(parent=-1, token_ids=r.pack_ids([3, 4])),
            r.TreeNode(
                parent=0,
                token_ids=r.pack_ids([5, 6]),
                logprobs=r.pack_f32([-1.0, -1.0]),
                loss_mask=r.pack_u8([1, 1]),
            ),
        ],
    )


@pytest.mark.parametrize(
    ("mode", "want", "s", "reason"),
    [
        ("ppo", None, sample(0.7), None),
        ("ppo", 0.7, sample(0.7), None),
        ("ppo", 1.0, sample(0.7), "temperature_mismatch"),
        ("ppo", None, sample(0.0), "greedy_sampling"),
        ("ppo", None, sample(1.0, top_p=0.9), "truncated_sampling"),
        ("ppo", 1.0, sample(None), None),  # recorded nowhere: taken at the learner's
        ("sft", 1.0, sample(0.7, top_p=0.9), None),  # SFT: the model's own distribution
        ("ppo", None, sample(1.0, reward=math.nan), "bad_reward"),
    ],
)
def test_the_batcher_refuses_samples_it_cannot_match(mode, want, s, reason) -> None:
    ledger = Ledger()
    batcher = Batcher(BatchRules(mode=mode, batch_rollouts=1, temperature=want), ledger)
    batcher.add(SimpleNamespace(record=s), 0)  # type: ignore[arg-type]
    if reason is None:
        assert not ledger.counts and batcher.take(0) is not None
    else:
        assert dict(ledger.counts) == {reason: 1} and batcher.take(0) is None


def test_each_target_takes_its_samples_temperature() -> None:
    """Packed with per-sample temperatures, every target's log-prob equals the policy's at the
    temperature its sample was drawn at (one forward, two temperatures)."""
    rng = np.random.default_rng(0)

    def chain(k: int) -> r.TreeSample:
        return r.TreeSample(
            rollout_id=f"g-{k}-1",
            group_id="g",
            k=k,
            nodes=[
                r.TreeNode(parent=-1, token_ids=r.pack_ids(rng.integers(3, 8000, 5))),
                r.TreeNode(
                    parent=0,
                    token_ids=r.pack_ids(rng.integers(3, 8000, 6)),
                    logprobs=r.pack_f32(np.full(6, -1.0)),
                    loss_mask=r.pack_u8(np.ones(6)),
                ),
            ],
        )

    samples = [chain(0), chain(1)]
    policy = load_policy("tiny-1m", attn_implementation="sdpa")
    with torch.no_grad():
        for p in policy.parameters():  # sharper than the init, so temperatures differ visibly
            p.normal_(0.0, 0.08)
    mixed = collate(pack(samples, PackConfig(share_prefixes=False), temperatures=[0.5, 1.7]).rows)
    with torch.no_grad():
        got = policy(**mixed.model_inputs()).logprobs
        for k, temp in enumerate((0.5, 1.7)):
            alone = collate(pack([samples[k]], PackConfig()).rows)
            policy.temperature = temp
            want = policy(**alone.model_inputs()).logprobs
            torch.testing.assert_close(got[mixed.sample_index == k], want, rtol=0, atol=1e-5)
    policy.temperature = 1.0
    unset = collate(pack(samples, PackConfig(share_prefixes=False)).rows)  # the policy's own
    with torch.no_grad():
        plain = policy(**unset.model_inputs()).logprobs
    assert (got - plain).abs().max() > 0.01  # the temperatures changed the log-probs


def tables(actor: dict, learner: dict) -> dict[str, dict]:
    return {"engine": {}, "actor": actor, "assembler": {}, "learner": learner, "weights_sync": {}}


def test_a_run_ties_the_learners_temperature_to_the_actors() -> None:
    tied = tie_sampling(tables({"temperature": 0.8}, {"ds": {"lr": 1e-4}}), "run.toml")
    assert tied["learner"]["ds"] == {"lr": 1e-4, "temperature": 0.8}
    assert tie_sampling(tables({}, {}), "run.toml")["learner"]["ds"] == {"temperature": 1.0}
    same = tables({"temperature": 0.8}, {"ds": {"temperature": 0.8}})
    assert tie_sampling(same, "run.toml")["learner"]["ds"]["temperature"] == 0.8
    sft = tables({"temperature": 0.0, "top_p": 0.5}, {"sft": True})
    assert tie_sampling(sft, "run.toml") == sft


@pytest.mark.parametrize(
    ("actor", "learner", "needle"),
    [
        ({"temperature": 0.8}, {"ds": {"temperature": 1.0}}, "[learner.ds] temperature = 1.0"),
        ({"temperature": 0.0}, {}, "[actor] temperature = 0.0"),
        ({"top_p": 0.95}, {}, "top_p = 0.95"),
        ({"top_k": 40}, {"algo": "ppo"}, "top_k = 40"),
    ],
)
def test_a_run_refuses_sampling_the_learner_cannot_match(actor, learner, needle) -> None:
    with pytest.raises(ConfigError) as e:
        tie_sampling(tables(actor, learner), "run.toml")
    assert needle in str(e.value) and str(e.value).startswith("run.toml: ")
