"""Learning regression: the real learner code must *learn*, from stale samples, and must fail
when its advantage sign or its importance weights are broken.

The loop is the production path minus the network: the embedded engine (``harnessrl.proxy.engine``'s
scheduler, in-process) samples at temperature 1 with log-probs; samples become TreeSamples
(prompt node + model node carrying the engine's log-probs); GRPO advantages per group
(``harnessrl.learner.losses.group_advantages``); ``harnessrl.learner.packing.pack``; ``LearnerEngine.train_step``
(DeepSpeed, ZeRO-0, token-level TIS); the new weights go back into the engine with
``Engine.apply_weights``, **two versions late**, so every trained sample is >= 2 versions stale.

The task is small enough to learn in seconds: one prompt, one sampled token, reward 1 if it is
in a fixed set of "good" tokens holding ~12 % of the random model's probability. Success =
share of good tokens among 256 fresh samples from the engine at the learner's latest weights.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
import torch

from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8

pytestmark = pytest.mark.slow

MODEL = "tiny-1m"
PROMPT = "<|im_start|>user\nSay one word.<|im_end|>\n<|im_start|>assistant\n"
GROUP, GROUPS, STEPS, LAG = 8, 4, 24, 2


@pytest.fixture(scope="module")
def engine() -> Any:
    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import Engine

    eng = Engine(EngineConfig(model=MODEL, max_batch_size=64, threads=1))
    eng.load()
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def setup(engine: Any) -> dict[str, Any]:
    """The prompt ids, the initial weights and the good-token set (~12 % of the mass)."""
    from harnessrl.common.models import load_tokenizer

    ids = list(load_tokenizer(MODEL).encode(PROMPT, add_special_tokens=False))
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    probs = torch.softmax(logits, -1).numpy()
    order = np.argsort(-probs)
    # tokens from the middle of the distribution, so no single one dominates at the start
    good, mass = [], 0.0
    for t in order[50:]:
        good.append(int(t))
        mass += float(probs[t])
        if mass >= 0.12:
            break
    init = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return {"ids": ids, "good": frozenset(good), "init": init}


def sample(engine: Any, ids: list[int], n: int, tag: str) -> list[tuple[int, float, str]]:
    """``n`` one-token samples: (token, engine log-prob, engine weight version)."""
    from harnessrl.proxy.engine.requests import SamplingParams
    from harnessrl.proxy.engine.scheduler import Request

    params = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True)
    futs = [
        engine.submit(Request(f"{tag}-{i}", list(ids), params, return_logprob=True))
        for i in range(n)
    ]
    out = []
    for f in futs:
        req = f.result(timeout=60)
        out.append((req.output[0], req.logprobs[0], req.version_end or req.version_start or ""))
    return out


def success(engine: Any, s: dict[str, Any], tag: str, n: int = 256) -> float:
    return float(np.mean([t in s["good"] for t, _, _ in sample(engine, s["ids"], n, tag)]))


def push(engine: Any, learner: Any, version: int) -> None:
    state = learner.state_dict_for_broadcast()
    engine.apply_weights(list(state.items()), str(version)).result(timeout=60)


def train(
    engine: Any,
    s: dict[str, Any],
    *,
    flip: bool = False,
    break_is: bool = False,
    is_mode: str = "tis",
) -> tuple[float, float, list[int]]:
    """RL from the initial weights; returns (success before, success after, staleness of
    every trained sample)."""
    from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
    from harnessrl.learner.losses import LossConfig, group_advantages
    from harnessrl.learner.packing import pack

    engine.apply_weights(list(s["init"].items()), "0").result(timeout=60)
    before = success(engine, s, "before")
    # the learner loads the same folder the engine started from: identical initial weights
    learner = LearnerEngine(
        MODEL, DeepSpeedConfig(lr=2e-2, seed=0), LossConfig(algo="grpo", is_mode=is_mode)
    )
    pending: deque[int] = deque()  # versions trained but not yet in the engine
    staleness: list[int] = []
    prompt = pack_ids(s["ids"])
    for step in range(STEPS):
        samples, rewards, groups = [], [], []
        for g in range(GROUPS):
            for k, (tok, lp, ver) in enumerate(sample(engine, s["ids"], GROUP, f"s{step}g{g}")):
                staleness.append(step - int(ver))
                if break_is:
                    lp += 8.0  # the engine "said" a far likelier token: w = e^-8
                node = TreeNode(
                    parent=0,
                    token_ids=pack_ids([tok]),
                    logprobs=pack_f32([lp]),
                    loss_mask=pack_u8([1]),
                    weight_version=int(ver),
                )
                gid = f"{step}-{g}"
                samples.append(
                    TreeSample(
                        rollout_id=f"{gid}-{k}",
                        group_id=gid,
                        k=k,
                        reward=float(tok in s["good"]),
                        nodes=[TreeNode(parent=-1, token_ids=prompt), node],
                    )
                )
                rewards.append(samples[-1].reward)
                groups.append(gid)
        adv, _ = group_advantages(groups, rewards)
        if flip:
            adv = -adv
        learner.train_step(pack(samples, advantages=adv).rows)
        pending.append(step + 1)
        while pending and pending[0] <= step + 1 - LAG:  # the engine runs LAG versions behind
            push(engine, learner, pending.popleft())
    push(engine, learner, STEPS)
    after = success(engine, s, "after")
    print(
        f"learning: {is_mode} flip={flip} break_is={break_is} success {before:.3f} -> {after:.3f}"
    )
    return before, after, staleness


@pytest.mark.parametrize("is_mode", ["tis", "mis"])
def test_grpo_learns_from_stale_samples(engine: Any, setup: dict[str, Any], is_mode: str) -> None:
    before, after, staleness = train(engine, setup, is_mode=is_mode)
    assert before <= 0.3, before
    assert after >= 0.8, (before, after)
    assert min(staleness[GROUP * GROUPS * LAG :]) >= LAG  # every sample after the first LAG steps


def test_flipped_advantage_sign_unlearns(engine: Any, setup: dict[str, Any]) -> None:
    before, after, _ = train(engine, setup, flip=True)
    assert after < 0.8 and after <= before + 0.05, (before, after)


def test_broken_importance_weights_stop_learning(engine: Any, setup: dict[str, Any]) -> None:
    """Rollout log-probs 8 nats off make every ratio pi_old / pi_rollout e^-8: masked IS drops
    every token outside its band, so nothing is learned — the learner provably weighs tokens
    by the engine's log-probs. (Under TIS the same corruption only scales the whole loss by
    e^-8, which Adam's update does not see; the mis variant above shows masking is no
    obstacle with honest log-probs.)"""
    before, after, _ = train(engine, setup, break_is=True, is_mode="mis")
    assert after < 0.5 and abs(after - before) < 0.15, (before, after)
