"""Losses: advantages, importance weights, normalisation and metrics on known inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8
from harnessrl.common.tree import expand as branches
from harnessrl.learner.losses import (
    LossConfig,
    gae,
    group_advantages,
    grpo_advantages,
    is_weights,
    norm_weights,
    policy_loss,
    ppo_advantages,
    sequence_log_weights,
    sft_loss,
    summarize,
    whiten,
)
from harnessrl.learner.packing import PackConfig, collate, pack
from harnessrl.learner.policy import load_policy
from tests.helpers.learner import one_torch_thread  # noqa: F401  (autouse)

pytestmark = pytest.mark.unit


def test_grpo_advantages_known_group() -> None:
    """(R - mean) / (std + eps), unbiased std, shared by the whole rollout."""
    adv, flat = grpo_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert not flat
    np.testing.assert_allclose(adv, [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rtol=1e-6)
    adv, _ = grpo_advantages([0.2, 0.4, 0.9], scale_by_std=False)
    np.testing.assert_allclose(adv, [-0.3, -0.1, 0.4], atol=1e-6)


def test_grpo_zero_variance_groups_are_flagged() -> None:
    adv, flat = grpo_advantages([0.7, 0.7, 0.7])
    assert flat and not adv.any()
    adv, flat = group_advantages(["a", "b", "a", "b", "c"], [1.0, 0.5, 0.0, 0.5, 1.0])
    assert flat == {"b", "c"}  # a group of one has no variance either
    assert adv[0] > 0 > adv[2] and adv[1] == adv[3] == adv[4] == 0


def test_gae_gamma_lambda_one_is_return_minus_value() -> None:
    """GAE(1, 1) with only a final reward R equals R - V(t) at every token of a branch."""
    v = torch.tensor([0.3, -0.2, 0.9, 0.1, 0.5])
    r = torch.zeros(5)
    r[-1] = 0.8
    adv, ret = gae(r, v)
    torch.testing.assert_close(adv, 0.8 - v)
    torch.testing.assert_close(ret, torch.full((5,), 0.8))
    adv_discounted, _ = gae(r, v, gamma=0.9, lam=0.5)
    assert not torch.allclose(adv_discounted, 0.8 - v)  # the recursion is real


def _shared_prefix_samples(rng: np.random.Generator) -> list[TreeSample]:
    """Two rollouts of one task with opposite rewards: the same prompt and the same first reply
    (model tokens in both), then a tool result and replies of their own, one with a branch."""
    prompt, reply = rng.integers(3, 100, 5), rng.integers(3, 100, 4)

    def model(parent: int, ids) -> TreeNode:
        ids = np.asarray(ids)
        return TreeNode(
            parent=parent,
            token_ids=pack_ids(ids),
            logprobs=pack_f32(np.full(len(ids), -1.0)),
            loss_mask=pack_u8(np.ones(len(ids))),
        )

    out = []
    for k, reward in enumerate((1.0, 0.0)):
        nodes = [TreeNode(parent=-1, token_ids=pack_ids(prompt)), model(0, reply)]
        nodes.append(TreeNode(parent=1, token_ids=pack_ids(rng.integers(3, 100, 3))))
        nodes.append(model(2, rng.integers(3, 100, 3)))
        if k == 0:  # a retry from the tool result: a second branch
            nodes.append(model(2, rng.integers(3, 100, 2)))
        out.append(TreeSample(rollout_id=f"p-{k}-1", group_id="p", k=k, reward=reward, nodes=nodes))
    return out


def test_ppo_tree_advantage_is_mean_over_branches() -> None:
    """PPO on packed trees equals per-branch GAE averaged over the branches through a token,
    per sample, when samples share a prefix that is a model reply in both (computed once,
    trained for each with its own return): ``ppo_advantages`` and the gradient ``policy_loss``
    gives each target match the branch-expanded computation with ``gae``."""
    rng = np.random.default_rng(0)
    samples = _shared_prefix_samples(rng)
    values: dict[tuple[int, ...], float] = {}  # V of a state: the same state, the same value

    def value(path: np.ndarray) -> float:
        return values.setdefault(tuple(path.tolist()), float(rng.normal()))

    expected: dict[tuple[int, int, int], list[float]] = {}
    state: dict[tuple[int, int, int], float] = {}
    for s, sample in enumerate(samples):
        for br in branches(sample):
            scored = [t for t in range(1, len(br.token_ids)) if br.loss_mask[t]]
            v = torch.tensor([value(br.token_ids[:t]) for t in scored])
            r = torch.zeros(len(scored))
            r[-1] = sample.reward
            adv, _ = gae(r, v)
            for t, a, vt in zip(scored, adv.tolist(), v.tolist(), strict=True):
                key = (s, int(br.node_of[t]), int(br.offset_of[t]))
                expected.setdefault(key, []).append(a)
                state[key] = vt
    packing = pack(samples, PackConfig(share_prefixes=True))
    assert packing.stats.shared_tokens > 0
    (row,) = packing.rows
    keys = [
        (int(s), int(n), int(o))
        for s, n, o in zip(row.sample_index, row.target_node, row.target_offset, strict=True)
    ]
    assert sorted(keys) == sorted(expected)  # every scored token once per sample
    returns = torch.from_numpy(row.returns)
    v = torch.tensor([state[k] for k in keys])
    adv = ppo_advantages(returns, v)
    want = torch.tensor([float(np.mean(expected[k])) for k in keys])
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
    assert {float(a) for k, a in zip(keys, adv, strict=True) if k[:2] == (1, 1)} != {
        float(a) for k, a in zip(keys, adv, strict=True) if k[:2] == (0, 1)
    }  # the shared reply: each sample's own return
    logp = torch.zeros(len(keys), requires_grad=True)
    nw = torch.full((len(keys),), 1.0 / len(keys))
    loss, _ = policy_loss(
        LossConfig(algo="ppo", value_baseline="token"),
        logp=logp,
        rollout_logp=torch.zeros(len(keys)),
        loss_mask=torch.ones(len(keys)),
        norm_weight=nw,
        values=v,
        returns=returns,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -nw * want, rtol=0, atol=1e-7)


def test_tis_weights_truncated_at_cap() -> None:
    log_w = torch.log(torch.tensor([0.1, 0.5, 1.0, 1.9, 2.0, 3.0, 50.0]))
    w, kept = is_weights(log_w, LossConfig(is_mode="tis", is_cap=2.0))
    torch.testing.assert_close(w, torch.tensor([0.1, 0.5, 1.0, 1.9, 2.0, 2.0, 2.0]))
    assert kept.all()
    w, _ = is_weights(log_w, LossConfig(is_mode="tis", is_cap=3.0))
    assert float(w.max()) == pytest.approx(3.0)


def test_mis_masks_outside_band() -> None:
    """MIS keeps raw weights in [1/C, C] and zeroes the rest; mis_low overrides the low edge."""
    ratio = torch.tensor([0.3, 0.5, 0.8, 1.0, 2.0, 2.5])
    w, kept = is_weights(torch.log(ratio), LossConfig(is_mode="mis", is_cap=2.0))
    torch.testing.assert_close(kept, torch.tensor([0.0, 1, 1, 1, 1, 0]))
    torch.testing.assert_close(w, torch.tensor([0.0, 0.5, 0.8, 1.0, 2.0, 0.0]))
    _, kept = is_weights(torch.log(ratio), LossConfig(is_mode="mis", is_cap=2.0, mis_low=0.9))
    torch.testing.assert_close(kept, torch.tensor([0.0, 0, 0, 1, 1, 0]))


def test_sequence_level_weights_are_geometric_means() -> None:
    log_w = torch.tensor([0.2, 0.4, -1.0, 5.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    idx = torch.tensor([0, 0, 1, 1, 1])
    seq = sequence_log_weights(log_w, mask, idx)
    torch.testing.assert_close(seq, torch.tensor([0.3, 0.3, -0.5, -0.5, -0.5]))
    cfg = LossConfig(is_level="sequence", is_mode="mis", is_cap=1.5)
    loss_inputs = dict(
        logp=torch.zeros(5, requires_grad=True),
        old_logp=log_w,
        rollout_logp=torch.zeros(5),
        loss_mask=mask,
        norm_weight=torch.full((5,), 0.25),
        advantage=torch.ones(5),
        sample_index=idx,
    )
    _, stats = policy_loss(cfg, **loss_inputs)
    # rollout 0: exp(0.3) inside [2/3, 1.5] -> kept; rollout 1: exp(-0.5) < 2/3 -> masked
    torch.testing.assert_close(
        stats.tokens["is_w"], torch.tensor([math.exp(0.3), math.exp(0.3), 0.0, 0.0])
    )


def test_is_weight_is_exactly_one_when_rollout_matches_learner() -> None:
    """Rollout log-probs taken from the learner's own forward give w == 1 exactly, no clipping."""
    policy = load_policy("tiny-1m", attn_implementation="sdpa", temperature=0.8)
    rng = np.random.default_rng(0)
    nodes = [TreeNode(parent=-1, token_ids=pack_ids(rng.integers(3, 8000, 6)))]
    for n in (5, 7):
        nodes.append(
            TreeNode(
                parent=0,
                token_ids=pack_ids(rng.integers(3, 8000, n)),
                logprobs=pack_f32(np.zeros(n)),
                loss_mask=pack_u8(np.ones(n)),
            )
        )
    sample = TreeSample(rollout_id="e-0-1", group_id="e", k=0, nodes=nodes)
    batch = collate(pack([sample], advantages=[1.0]).rows)
    with torch.no_grad():
        learner_logp = policy(**batch.model_inputs()).logprobs
    out = policy(**batch.model_inputs())
    for mode in ("tis", "mis"):
        for level in ("token", "sequence"):
            cfg = LossConfig(is_mode=mode, is_level=level)
            _, stats = policy_loss(
                cfg,
                logp=out.logprobs,
                rollout_logp=learner_logp.clone(),
                loss_mask=batch.loss_mask,
                norm_weight=torch.full((batch.n_targets,), 1.0 / batch.n_targets),
                advantage=batch.advantage,
                sample_index=batch.sample_index,
            )
            assert torch.equal(stats.tokens["is_w"], torch.ones(batch.n_targets))
            m = summarize([stats])
            assert m["mismatch/abs_dlogp"] == 0.0 and m["is/tis_clip_frac"] == 0.0
            assert m["ppo/clip_frac"] == 0.0 and m["is/mis_masked_frac"] == 0.0


def test_ppo_clip_and_metrics() -> None:
    """Ratios beyond the clip stop the gradient and count in clip_frac; quantiles are reported."""
    logp = torch.log(torch.tensor([1.5, 1.0, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, is_mode="none")
    loss, stats = policy_loss(
        cfg,
        logp=logp,
        old_logp=torch.zeros(4),
        rollout_logp=torch.log(torch.tensor([1.0, 3.0, 1.0, 1.0])),
        loss_mask=torch.ones(4),
        norm_weight=torch.full((4,), 0.25),
        advantage=adv,
    )
    loss.backward()
    # token 0: ratio 1.5 > 1.2 with A>0 -> clipped; token 2: 0.5 < 0.8 with A<0 -> clipped
    torch.testing.assert_close(stats.tokens["ppo_clipped"], torch.tensor([1.0, 0, 1, 0]))
    assert logp.grad[0] == 0 and logp.grad[2] == 0 and logp.grad[1] != 0
    m = summarize([stats, stats])
    assert m["ppo/clip_frac"] == 0.5
    assert m["mismatch/abs_dlogp"] == pytest.approx(math.log(3.0) / 4)
    assert m["loss/pg"] == pytest.approx(2 * stats.terms["loss/pg"])  # terms add up


def test_ppo_value_bounds_clamp_the_baseline_not_the_value_loss() -> None:
    """``value_bounds`` clamps V where it enters ``R - V``: a value below the lowest reward no
    longer gives a failing token a positive advantage; the value loss still sees the raw head,
    and the step reports the values' quantiles."""
    values = torch.tensor([-0.5, 0.2, 1.4, 0.5], requires_grad=True)
    returns = torch.tensor([0.0, 0.0, 1.0, 1.0])
    common = dict(
        logp=torch.zeros(4, requires_grad=True),
        rollout_logp=torch.zeros(4),
        loss_mask=torch.ones(4),
        norm_weight=torch.full((4,), 0.25),
        values=values,
        returns=returns,
    )
    raw = LossConfig(algo="ppo", is_mode="none", adv_norm="none", value_baseline="token")
    bounded = raw.model_copy(update={"value_bounds": (0.0, 1.0)})
    _, st_raw = policy_loss(raw, **common)
    _, st = policy_loss(bounded, **common)
    # pg = -A per token at ratio 1: raw A = [0.5, -0.2, -0.4, 0.5]; bounded [0, -0.2, 0, 0.5]
    assert st_raw.terms["loss/pg"] == pytest.approx(-0.25 * (0.5 - 0.2 - 0.4 + 0.5))
    assert st.terms["loss/pg"] == pytest.approx(-0.25 * (0.0 - 0.2 + 0.0 + 0.5))
    assert st.terms["loss/value"] == pytest.approx(st_raw.terms["loss/value"])
    m = summarize([st])
    assert m["value/p05"] < 0 < m["value/p50"] and m["value/p95"] > 1
    assert st.terms["value/mean"] == pytest.approx(0.25 * (-0.5 + 0.2 + 1.4 + 0.5))


def test_ppo_turn_baseline_subtracts_the_value_where_the_turn_started() -> None:
    """``value_baseline = "turn"``: every token of a reply gets ``R - V(state before the
    reply)`` (the policy's ``baselines``), however the critic's values move inside it;
    ``token`` keeps ``R - V(t)``. The value loss is the same either way, and without the
    baselines the loss refuses."""
    values = torch.tensor([0.5, 0.1, 0.0, 0.3, 0.9])
    common = dict(
        rollout_logp=torch.zeros(5),
        loss_mask=torch.ones(5),
        norm_weight=torch.full((5,), 0.2),
        values=values,
        returns=torch.zeros(5),
        baselines=torch.tensor([0.4, 0.4, 0.4, 0.2, 0.2]),  # two replies: tokens 0-2 and 3-4
    )
    out = {}
    for baseline in ("token", "turn"):
        cfg = LossConfig(algo="ppo", is_mode="none", adv_norm="none", value_baseline=baseline)
        logp = torch.zeros(5, requires_grad=True)
        loss, st = policy_loss(cfg, logp=logp, **common)
        loss.backward()  # values carry no grad: only the policy term reaches logp
        out[baseline] = (logp.grad, st.terms["loss/value"])
    # pg = -A * ratio at ratio 1, so d loss / d logp = -0.2 A = 0.2 V(baseline) with R = 0
    torch.testing.assert_close(out["token"][0], 0.2 * values)
    torch.testing.assert_close(out["turn"][0], 0.2 * common["baselines"])
    assert out["turn"][1] == pytest.approx(out["token"][1])
    cfg = LossConfig(algo="ppo", value_baseline="turn")
    with pytest.raises(ValueError, match="baselines"):
        policy_loss(cfg, logp=torch.zeros(5), **{**common, "baselines": None})


def test_ppo_explained_variance_of_the_baseline() -> None:
    """``value/explained_variance`` judges the V the advantage subtracts: 1 when it is the
    return, 0 for a constant, negative when it adds noise; the turn baseline is what counts
    under ``value_baseline = "turn"``, not the per-token values."""
    returns = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])

    def ev(values: torch.Tensor, baseline: str = "token", baselines=None) -> float:
        cfg = LossConfig(algo="ppo", is_mode="none", adv_norm="none", value_baseline=baseline)
        _, st = policy_loss(
            cfg,
            logp=torch.zeros(6),
            rollout_logp=torch.zeros(6),
            loss_mask=torch.ones(6),
            norm_weight=torch.full((6,), 1 / 6),
            values=values,
            returns=returns,
            baselines=baselines,
        )
        return summarize([st])["value/explained_variance"]

    assert ev(returns.clone()) == pytest.approx(1.0)
    assert ev(torch.full((6,), 0.3)) == pytest.approx(0.0, abs=1e-6)
    assert ev(torch.tensor([1.0, 0.9, 0.0, 0.1, 1.0, 0.0])) < -1.0
    assert ev(torch.full((6,), 0.3), "turn", returns.clone()) == pytest.approx(1.0)


def test_norm_weights_token_and_sequence() -> None:
    idx = np.array([0, 0, 0, 1, 2, 2])
    mask = np.array([1, 1, 0, 1, 1, 1], np.float32)
    np.testing.assert_allclose(norm_weights(idx, mask, "token"), np.full(6, 0.2))
    w = norm_weights(idx, mask, "sequence")
    np.testing.assert_allclose(w, [1 / 6, 1 / 6, 1 / 6, 1 / 3, 1 / 6, 1 / 6], rtol=1e-6)
    assert float((w * mask).sum()) == pytest.approx(1.0)


def test_sft_loss_is_masked_nll() -> None:
    logp = torch.log(torch.tensor([0.5, 0.25, 0.1]))
    loss, _ = sft_loss(logp, torch.tensor([1.0, 1.0, 0.0]), torch.full((3,), 0.5))
    assert float(loss) == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)


def test_grpo_step_moves_toward_rewarded_tokens() -> None:
    """GRPO steps raise sum(A * logp): rewarded tokens up relative to unrewarded (no DS)."""
    policy = load_policy("tiny-1m", attn_implementation="sdpa")
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 8000, 6)
    samples = []
    for k, reward in enumerate([1.0, 0.0]):
        out_ids = rng.integers(3, 8000, 5)
        nodes = [
            TreeNode(parent=-1, token_ids=pack_ids(prompt)),
            TreeNode(
                parent=0,
                token_ids=pack_ids(out_ids),
                logprobs=pack_f32(np.full(5, -9.0)),
                loss_mask=pack_u8(np.ones(5)),
            ),
        ]
        samples.append(
            TreeSample(rollout_id=f"r-{k}-1", group_id="r", k=k, reward=reward, nodes=nodes)
        )
    adv, _ = group_advantages(["r", "r"], [s.reward for s in samples])
    batch = collate(pack(samples, PackConfig(), advantages=adv).rows)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    nw = torch.from_numpy(norm_weights(batch.sample_index.numpy(), batch.loss_mask.numpy()))
    first = None
    for _ in range(3):
        out = policy(**batch.model_inputs())
        loss, _ = policy_loss(
            LossConfig(),
            logp=out.logprobs,
            rollout_logp=batch.rollout_logp,
            loss_mask=batch.loss_mask,
            norm_weight=nw,
            advantage=batch.advantage,
        )
        first = out.logprobs.detach() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = policy(**batch.model_inputs()).logprobs.detach()
    gain = float((batch.advantage * (last - first)).sum())
    assert gain > 0
    assert (last - first)[batch.sample_index == 0].mean() > (last - first)[
        batch.sample_index == 1
    ].mean()


def test_whiten_uses_the_weighted_moments_of_the_scored_tokens() -> None:
    """Weighted mean 0 and std 1 over weight > 0; zero-weight entries neither count nor break."""
    adv = torch.tensor([0.9, 0.2, -0.4, 5.0, 0.7])
    w = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4])
    out = whiten(adv, w)
    mean = float((w * out).sum() / w.sum())
    var = float((w * (out - mean) ** 2).sum() / w.sum())
    assert mean == pytest.approx(0.0, abs=1e-6) and var == pytest.approx(1.0, rel=1e-5)
    m = float((w * adv).sum())
    s = float((w * (adv - m) ** 2).sum()) ** 0.5
    torch.testing.assert_close(out, (adv - m) / s)
    assert torch.equal(whiten(adv, torch.zeros(5)), adv)  # nothing scored: unchanged


def test_whiten_with_reduce_matches_the_whole_step() -> None:
    """Two ranks each holding half the tokens, their statistics summed by ``reduce``, whiten
    exactly as one rank holding all of them."""
    rng = np.random.default_rng(3)
    adv = torch.from_numpy(rng.normal(0.3, 0.4, 20).astype(np.float32))
    w = torch.from_numpy(rng.uniform(0, 1, 20).astype(np.float32))
    whole = whiten(adv, w)

    def other_half(lo: int, hi: int):
        def reduce(sums: torch.Tensor) -> None:
            a, ww = adv[lo:hi].double(), w[lo:hi].double()
            sums += torch.stack([ww.sum(), (ww * a).sum(), (ww * a * a).sum()])

        return reduce

    left = whiten(adv[:10], w[:10], reduce=other_half(10, 20))
    right = whiten(adv[10:], w[10:], reduce=other_half(0, 10))
    torch.testing.assert_close(torch.cat([left, right]), whole)


def test_mis_weights_stay_finite_for_any_mismatch() -> None:
    """A token whose engine and learner log-probs differ by more than float32's exp range is
    masked like any other out-of-band token: ``inf * 0`` used to make its weight (and the
    step's loss) NaN."""
    log_w = torch.tensor([0.0, 100.0, -1.0, -200.0, float("inf"), 0.5])
    w, kept = is_weights(log_w, LossConfig(is_mode="mis", is_cap=2.0))
    assert torch.isfinite(w).all()
    torch.testing.assert_close(kept, torch.tensor([1.0, 0, 0, 0, 0, 1]))
    torch.testing.assert_close(w, torch.tensor([1.0, 0, 0, 0, 0, math.exp(0.5)]))
    w, _ = is_weights(log_w, LossConfig(is_mode="tis", is_cap=2.0))
    torch.testing.assert_close(w, torch.tensor([1.0, 2, math.exp(-1), 0, 2, math.exp(0.5)]))
    logp = torch.zeros(6, requires_grad=True)  # pi_old = the current policy; the engine's differ
    loss, stats = policy_loss(
        LossConfig(is_mode="mis"),
        logp=logp,
        rollout_logp=-log_w.clamp(-300, 300),
        loss_mask=torch.ones(6),
        norm_weight=torch.full((6,), 1 / 6),
        advantage=torch.ones(6),
    )
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(logp.grad).all()
    assert summarize([stats])["is/mis_masked_frac"] == pytest.approx(4 / 6)
