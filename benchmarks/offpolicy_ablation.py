"""Off-policy ablation: GRPO on a synthetic task with stale and mismatched rollouts, TIS on/off.

Task: from a short random prompt, sample ``T`` tokens; the reward is the fraction of sampled
tokens in the lower half of the vocabulary (the untrained tiny model scores ~0.5). Rollouts are
sampled in process by an "engine" copy of the policy that lags ``staleness`` versions behind the
learner, optionally with an injected engine/trainer mismatch (Gaussian noise on the engine's
logits: it samples from, and reports log-probs of, a different distribution than the learner
computes). The learner is the real one: ``LearnerEngine`` (DeepSpeed, CPU), tree packing,
decoupled PPO-clip with token-level TIS (``is_mode = tis``, C = 2) or no correction.

Runs (same seed, same starting weights): on-policy; staleness 4 with TIS; staleness 4 without;
injected mismatch with TIS; injected mismatch without. Printed: the reward curve of each run
and a table of the final reward, mean |log pi_old - log pi_rollout| and the TIS clip fraction.
Expected mechanics: |dlogp| ~ 0 and no clipping on-policy; clearly positive |dlogp| and clip
fraction > 0 under staleness or mismatch. The curves are reported as observed.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks._common import parse_args, print_table, target, write_result
from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8
from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
from harnessrl.learner.losses import LossConfig, group_advantages
from harnessrl.learner.packing import PackConfig, pack

VOCAB = 8192
PROMPT, T = 6, 10


@dataclass
class Run:
    name: str
    staleness: int
    is_mode: str
    noise: float


RUNS = [
    Run("on-policy, TIS", 0, "tis", 0.0),
    Run("staleness 4, TIS", 4, "tis", 0.0),
    Run("staleness 4, no IS", 4, "none", 0.0),
    Run("mismatch, TIS", 0, "tis", 1.0),
    Run("mismatch, no IS", 0, "none", 1.0),
]


@torch.no_grad()
def rollouts(engine_lm, prompts: torch.Tensor, noise: float, gen: torch.Generator):
    """Sample ``T`` tokens per prompt; return ids and the engine's log-probs of them."""
    ids = prompts.clone()
    logps = []
    for _ in range(T):  # full recompute: a few tokens, and no cache API to depend on
        logits = engine_lm(input_ids=ids, logits_to_keep=1).logits[:, -1].float()
        if noise:
            logits = logits + noise * torch.randn(logits.shape, generator=gen)
        lp = torch.log_softmax(logits, -1)
        tok = torch.multinomial(lp.exp(), 1, generator=gen)
        logps.append(lp.gather(1, tok)[:, 0])
        ids = torch.cat([ids, tok], 1)
    return ids[:, prompts.shape[1] :], torch.stack(logps, 1)


def samples_of(prompts, outs, logps, rewards, version: int, n: int) -> list[TreeSample]:
    out = []
    for i in range(len(outs)):
        g = f"g{i // n}"
        out.append(
            TreeSample(
                rollout_id=f"{g}-{i % n}-1",
                group_id=g,
                k=i % n,
                group_size=n,
                reward=float(rewards[i]),
                weight_version=version,
                nodes=[
                    TreeNode(parent=-1, token_ids=pack_ids(prompts[i].numpy())),
                    TreeNode(
                        parent=0,
                        token_ids=pack_ids(outs[i].numpy()),
                        logprobs=pack_f32(logps[i].numpy()),
                        loss_mask=pack_u8(np.ones(T)),
                        weight_version=version,
                    ),
                ],
            )
        )
    return out


def train(learner: LearnerEngine, run: Run, steps: int, groups: int, n: int, seed: int = 0):
    """One run from the learner's current weights (the caller resets them between runs)."""
    torch.manual_seed(seed)
    learner.loss_cfg = LossConfig(is_mode=run.is_mode)
    engine_lm = copy.deepcopy(learner.policy.lm).eval()
    history: deque[dict[str, torch.Tensor]] = deque(maxlen=run.staleness + 1)
    gen = torch.Generator().manual_seed(seed)
    curve, dlogp, clip = [], [], []
    for step in range(steps):
        history.append(learner.state_dict_for_broadcast(torch.float32, dedupe_tied=False))
        engine_lm.load_state_dict(history[0])  # the oldest kept: ``staleness`` versions behind
        prompts = torch.randint(3, VOCAB, (groups, PROMPT), generator=gen).repeat_interleave(n, 0)
        outs, logps = rollouts(engine_lm, prompts, run.noise, gen)
        rewards = (outs < VOCAB // 2).float().mean(1).numpy()
        samples = samples_of(prompts, outs, logps, rewards, step - len(history) + 1, n)
        adv, _ = group_advantages([s.group_id for s in samples], [s.reward for s in samples])
        m = learner.train_step(pack(samples, PackConfig(max_tokens=512), advantages=adv).rows)
        curve.append(float(rewards.mean()))
        dlogp.append(m.get("mismatch/abs_dlogp", 0.0))
        clip.append(m.get("is/tis_clip_frac", 0.0))
    tail = max(1, steps // 4)
    return {
        "curve": curve,
        "reward_first": float(np.mean(curve[:tail])),
        "reward_last": float(np.mean(curve[-tail:])),
        "abs_dlogp": float(np.mean(dlogp)),
        "tis_clip_frac": float(np.mean(clip)),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps, groups, n = (5, 4, 4) if args.quick else (30, 8, 8)
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # tiny model on shared cores: more threads only spin-wait
    learner = LearnerEngine("tiny-1m", DeepSpeedConfig(lr=3e-3, grad_clip=1.0))
    results = {}
    with tempfile.TemporaryDirectory() as d:
        learner.save_checkpoint(d, {})  # every run starts from these weights and optimiser
        for r in RUNS:
            learner.load_checkpoint(d)
            results[r.name] = train(learner, r, steps, groups, n)
    print(f"\nreward curves ({steps} steps, {groups} groups x {n} rollouts, T={T}):")
    for name, res in results.items():
        print(f"  {name:20s} " + " ".join(f"{x:.2f}" for x in res["curve"]))
    print_table(
        "off-policy ablation (GRPO, tiny-1m, CPU DeepSpeed)",
        [
            (
                name,
                f"{res['reward_first']:.3f}",
                f"{res['reward_last']:.3f}",
                f"{res['abs_dlogp']:.4f}",
                f"{res['tis_clip_frac']:.4f}",
            )
            for name, res in results.items()
        ],
        ("run", "reward first", "reward last", "|dlogp|", "TIS clip frac"),
    )
    on = results["on-policy, TIS"]
    mis = results["mismatch, TIS"]
    metrics = {name: {k: v for k, v in res.items()} for name, res in results.items()}
    metrics["wall_s"] = time.perf_counter() - t0
    path = write_result(
        "offpolicy_ablation",
        metrics,
        {"on_policy": {k: v for k, v in on.items() if k != "curve"}},
        {
            "on_policy_abs_dlogp_near_zero": target(on["abs_dlogp"], 1e-3, at_least=False),
            "mismatch_abs_dlogp_positive": target(mis["abs_dlogp"], 0.05),
            "mismatch_clips": target(mis["tis_clip_frac"], 1e-4),
            "on_policy_never_clips": target(on["tis_clip_frac"], 0.0, at_least=False),
        },
        ratios={"mismatch_vs_on_policy_dlogp": mis["abs_dlogp"] / max(on["abs_dlogp"], 1e-12)},
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path} ({metrics['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
