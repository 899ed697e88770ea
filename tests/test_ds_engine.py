"""DeepSpeed engine on CPU (gloo): steps, accumulation, broadcast state, atomic checkpoints.

DeepSpeed init is slow (the first one on a machine also compiles a shared-memory op), so one
ZeRO-0 engine is shared by the module and each other stage is built once.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from benchmarks._learner_fleet import make_samples, rows_for
from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
from harnessrl.learner.losses import LossConfig, norm_weights, sft_loss
from harnessrl.learner.packing import collate
from harnessrl.learner.policy import load_policy
from tests.helpers.learner import one_torch_thread  # noqa: F401  (autouse)

pytestmark = pytest.mark.slow


def params(engine: LearnerEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.policy.named_parameters()}


@pytest.fixture(scope="module")
def engine0() -> LearnerEngine:
    """ZeRO-0 fp32, PPO config (value head) with a KL reference; tests swap ``loss_cfg``."""
    cfg = DeepSpeedConfig(zero_stage=0, lr=1e-3, micro_batch_rows=2, grad_clip=1.0)
    return LearnerEngine("tiny-1m", cfg, LossConfig(algo="ppo", kl_coef=0.05))


def test_zero0_sft_steps_reduce_loss_and_change_weights(engine0: LearnerEngine) -> None:
    """A few ZeRO-0 steps lower the NLL of a fixed batch; weights move; metrics are sane."""
    engine0.loss_cfg = LossConfig(algo="sft")
    rows = rows_for(make_samples(1))
    before = params(engine0)
    step0 = engine0.global_steps
    losses = [engine0.train_step(rows)["loss/sft"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert engine0.global_steps == step0 + 4
    after = params(engine0)
    assert any(not torch.equal(before[k], after[k]) for k in before if "value_head" not in k)


def test_zero0_grpo_mismatch_metrics(engine0: LearnerEngine) -> None:
    """|dlogp| is 0 and nothing clips when rollout logps are the learner's; clear under mismatch."""
    engine0.loss_cfg = LossConfig(algo="grpo")
    rows = rows_for(make_samples(2))
    for r, lp in zip(rows, engine0.logprobs(rows), strict=True):
        r.rollout_logp = lp.copy()
    m = engine0.train_step(rows)
    assert m["mismatch/abs_dlogp"] == 0.0 and m["is/tis_clip_frac"] == 0.0
    assert m["is/w_p05"] == m["is/w_max"] == 1.0
    assert np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    rng = np.random.default_rng(0)
    for r in rows:  # an injected engine/trainer mismatch
        r.rollout_logp = r.rollout_logp + rng.normal(0, 1.0, len(r.rollout_logp)).astype(np.float32)
    m = engine0.train_step(rows)
    assert m["mismatch/abs_dlogp"] > 0.5 and m["is/tis_clip_frac"] > 0 and m["is/w_max"] == 2.0


def test_zero0_kept_logp_is_pi_old_of_the_next_update(engine0: LearnerEngine) -> None:
    """``train_step(keep_logp=True)`` keeps, per row and over micro-batches, the log-probs of the
    weights before its update (what a no-grad ``logprobs`` pass gives), and a second update on
    the same rows clipped against them matches one clipped against that pass: the learner's
    ``updates_per_batch`` needs no no-grad pass of its own."""
    engine0.loss_cfg = LossConfig(algo="grpo")
    rows = rows_for(make_samples(4), budget=40)
    assert len(rows) >= 3  # more than one micro-batch of 2 rows
    for r, lp in zip(rows, engine0.logprobs(rows), strict=True):
        r.rollout_logp = lp.copy()
    snapshot = copy.deepcopy(engine0.engine.module.state_dict())
    opt = copy.deepcopy(engine0.engine.optimizer.state_dict())
    before = engine0.logprobs(rows)
    m1 = engine0.train_step(rows, keep_logp=True)
    kept = engine0.last_logp
    assert kept is not None and [len(k) for k in kept] == [len(r.target_ids) for r in rows]
    for k, b in zip(kept, before, strict=True):
        np.testing.assert_allclose(k, b, rtol=0, atol=1e-5)
    after = np.concatenate(engine0.logprobs(rows))
    assert np.abs(after - np.concatenate(before)).max() > 1e-4  # the update moved them
    m2 = engine0.train_step(rows, old_logp=kept)
    assert engine0.last_logp is None  # kept only when asked
    # the same two updates with pi_old from the no-grad pass
    engine0.engine.module.load_state_dict(snapshot)
    engine0.engine.optimizer.load_state_dict(opt)
    m1_pass = engine0.train_step(rows)
    m2_pass = engine0.train_step(rows, old_logp=before)
    assert m1["loss/pg"] == pytest.approx(m1_pass["loss/pg"], rel=1e-5, abs=1e-7)
    assert m2["ppo/clip_frac"] > 0 or m2["loss/pg"] != m1["loss/pg"]
    assert m2["loss/pg"] == pytest.approx(m2_pass["loss/pg"], rel=1e-4, abs=1e-6)
    assert m2["ppo/clip_frac"] == pytest.approx(m2_pass["ppo/clip_frac"], abs=1e-9)


def test_zero0_ppo_with_reference_and_sequence_is(engine0: LearnerEngine) -> None:
    """PPO (value head + KL reference) and sequence-level MIS run end to end."""
    engine0.loss_cfg = LossConfig(algo="ppo", kl_coef=0.05, is_level="sequence", is_mode="mis")
    rows = rows_for(make_samples(3))
    m1 = engine0.train_step(rows)
    m2 = engine0.train_step(rows)
    assert m2["loss/value"] < m1["loss/value"]  # the critic fits R
    # the value head trains at value_lr_scale times the schedule's lr, in its own group
    head = {id(p) for p in engine0.policy.value_head.parameters()}
    lrs = {
        any(id(p) in head for p in g["params"]): g["lr"]
        for g in engine0.engine.optimizer.param_groups
    }
    assert lrs[True] == pytest.approx(engine0.cfg.value_lr_scale * lrs[False]) and lrs[False] > 0
    assert m1["loss/kl_ref"] > 0  # earlier tests moved the policy away from the reference
    assert "is/mis_masked_frac" in m2


def test_zero0_ppo_whitens_the_whole_step_however_it_is_split(engine0: LearnerEngine) -> None:
    """PPO's advantages are whitened over the step: with the rollouts' log-probs equal to the
    learner's (IS weight 1, ratio 1) the policy-gradient term is minus the weighted mean of the
    advantages, so 0; without whitening it is ``-mean(R - V)``. One micro-batch (whitened from
    its own forward) and several (whitened after a no-grad pass) give the same step."""
    rows = rows_for(make_samples(4), budget=40)
    for r, lp in zip(rows, engine0.logprobs(rows), strict=True):
        r.rollout_logp = lp.copy()
    lr, micro = engine0.cfg.lr, engine0.cfg.micro_batch_rows
    engine0.cfg.lr = 0.0  # same weights for every step below: compare gradients, not updates
    try:
        engine0.loss_cfg = LossConfig(algo="ppo", adv_norm="none")
        plain = engine0.train_step(rows)
        assert abs(plain["loss/pg"]) > 1e-3
        engine0.loss_cfg = LossConfig(algo="ppo")
        split = engine0.train_step(rows)
        engine0.cfg.micro_batch_rows = len(rows)
        whole = engine0.train_step(rows)
    finally:
        engine0.cfg.lr, engine0.cfg.micro_batch_rows = lr, micro
    assert split["micro_batches"] >= 2 and whole["micro_batches"] == 1
    assert split["loss/pg"] == pytest.approx(0.0, abs=1e-5)
    assert whole["loss/pg"] == pytest.approx(0.0, abs=1e-5)
    assert whole["grad_norm"] == pytest.approx(split["grad_norm"], rel=1e-4)
    assert whole["loss/value"] == pytest.approx(split["loss/value"], rel=1e-5)


def test_zero0_ppo_turn_baseline_is_the_same_however_the_step_is_split(
    engine0: LearnerEngine,
) -> None:
    """``value_baseline = "turn"`` reads V at the state each reply started from: one
    micro-batch (whitened inline) and several (after a no-grad pass) give the same step, and
    with a critic whose values vary along a reply it is a different step from the per-token
    baseline."""
    rows = rows_for(make_samples(4), budget=40)
    for r, lp in zip(rows, engine0.logprobs(rows), strict=True):
        r.rollout_logp = lp.copy()
    assert any((r.baseline_src != r.target_src).any() for r in rows)
    head = engine0.policy.value_head
    saved = [p.detach().clone() for p in head.parameters()]
    lr, micro = engine0.cfg.lr, engine0.cfg.micro_batch_rows
    engine0.cfg.lr = 0.0
    got = {}
    try:
        with torch.no_grad():
            head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
        for baseline in ("token", "turn"):
            for norm in ("none", "whiten"):
                engine0.loss_cfg = LossConfig(algo="ppo", adv_norm=norm, value_baseline=baseline)
                engine0.cfg.micro_batch_rows = micro
                split = engine0.train_step(rows)
                engine0.cfg.micro_batch_rows = len(rows)
                whole = engine0.train_step(rows)
                assert split["micro_batches"] >= 2 and whole["micro_batches"] == 1
                assert whole["grad_norm"] == pytest.approx(split["grad_norm"], rel=1e-4)
                assert whole["loss/pg"] == pytest.approx(split["loss/pg"], rel=1e-4, abs=1e-6)
                got[baseline, norm] = whole
    finally:
        engine0.cfg.lr, engine0.cfg.micro_batch_rows = lr, micro
        with torch.no_grad():
            for p, v in zip(head.parameters(), saved, strict=True):
                p.copy_(v)
    token, turn = got["token", "none"], got["turn", "none"]
    assert abs(turn["loss/pg"] - token["loss/pg"]) > 1e-4
    assert turn["loss/value"] == pytest.approx(token["loss/value"], rel=1e-6)


def test_zero0_micro_batches_accumulate_to_the_full_gradient(engine0: LearnerEngine) -> None:
    """Grad norm over 2-row micro-batches equals a plain single-batch backward of the same loss."""
    engine0.loss_cfg = LossConfig(algo="sft")
    rows = rows_for(make_samples(4), budget=40)
    assert len(rows) >= 3
    plain = copy.deepcopy(engine0.policy)
    plain.zero_grad(set_to_none=True)
    batch = collate(rows)
    nw = torch.from_numpy(norm_weights(batch.sample_index.numpy(), batch.loss_mask.numpy()))
    loss, _ = sft_loss(plain(**batch.model_inputs()).logprobs, batch.loss_mask, nw)
    loss.backward()
    want = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in plain.parameters() if p.grad is not None])
    )
    m = engine0.train_step(rows)
    assert m["micro_batches"] >= 2
    assert m["grad_norm"] == pytest.approx(float(want), rel=1e-4)
    assert m["loss/sft"] == pytest.approx(float(loss.detach()), rel=1e-5)


def test_state_dict_for_broadcast(engine0: LearnerEngine) -> None:
    """HF names, no value head, tied embeddings once, requested dtype, current values."""
    sd = engine0.state_dict_for_broadcast(torch.bfloat16)
    assert "model.embed_tokens.weight" in sd and "lm_head.weight" not in sd
    assert not any("value_head" in k for k in sd)
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in sd.values())
    lm = engine0.policy.lm.state_dict()
    assert torch.equal(sd["model.norm.weight"], lm["model.norm.weight"].to(torch.bfloat16))
    full = engine0.state_dict_for_broadcast(dedupe_tied=False)
    assert "lm_head.weight" in full and full["lm_head.weight"].dtype == torch.float32


def test_checkpoint_round_trip(engine0: LearnerEngine, tmp_path) -> None:
    """Save, step on, load: weights, step counter and client state come back; writes are atomic."""
    engine0.loss_cfg = LossConfig(algo="sft")
    rows = rows_for(make_samples(5))
    engine0.train_step(rows)
    client = {"version": 7, "trained": ["g-0-1", "g-1-1"], "feeder": {"issued": 12}}
    path = engine0.save_checkpoint(tmp_path, client)
    saved, step = params(engine0), engine0.global_steps
    assert (tmp_path / "latest").read_text() == path.name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    engine0.train_step(rows)
    assert any(not torch.equal(saved[k], v) for k, v in params(engine0).items())
    assert engine0.load_checkpoint(tmp_path) == client
    assert engine0.global_steps == step
    restored = params(engine0)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    # keep=2 prunes older checkpoints; an interrupted write (stray tmp dir) is ignored
    for _ in range(2):
        engine0.train_step(rows)
        engine0.save_checkpoint(tmp_path, client, keep=2)
    (tmp_path / ".tmp-step-999999999-1").mkdir()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("step-")]) == 2
    assert engine0.load_checkpoint(tmp_path) == client
    assert LearnerEngine.load_checkpoint(engine0, tmp_path / "missing") is None


def test_zero2_bf16_step(tmp_path) -> None:
    """ZeRO-2 bf16: loss goes down, weights change, grad norm matches an fp32 backward (~bf16)."""
    policy = load_policy("tiny-1m", attn_implementation="sdpa")
    plain = copy.deepcopy(policy)
    cfg = DeepSpeedConfig(
        zero_stage=2, dtype="bfloat16", lr=1e-3, micro_batch_rows=1, grad_clip=0.0
    )
    engine = LearnerEngine(policy, cfg, LossConfig(algo="sft"))
    rows = rows_for(make_samples(6), budget=48)
    batch = collate(rows)
    nw = torch.from_numpy(norm_weights(batch.sample_index.numpy(), batch.loss_mask.numpy()))
    loss, _ = sft_loss(plain(**batch.model_inputs()).logprobs, batch.loss_mask, nw)
    loss.backward()
    want = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()])))
    before = params(engine)
    metrics = [engine.train_step(rows) for _ in range(3)]
    assert metrics[0]["micro_batches"] >= 2
    assert metrics[0]["grad_norm"] == pytest.approx(want, rel=0.05)
    assert metrics[-1]["loss/sft"] < metrics[0]["loss/sft"]
    after = params(engine)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    sd = engine.state_dict_for_broadcast()
    assert sd["model.norm.weight"].dtype == torch.bfloat16


def test_zero3_gathers_full_weights_and_checkpoints(tmp_path) -> None:
    """ZeRO-3: a step runs, the broadcast state is whole, and a checkpoint round-trips."""
    policy = load_policy("tiny-1m", attn_implementation="sdpa")
    shapes = {k: v.shape for k, v in policy.lm.state_dict().items()}
    engine = LearnerEngine(policy, DeepSpeedConfig(zero_stage=3, lr=1e-3), LossConfig(algo="sft"))
    rows = rows_for(make_samples(7))
    m1 = engine.train_step(rows)
    sd = engine.state_dict_for_broadcast(dedupe_tied=False)
    assert {k: v.shape for k, v in sd.items()} == shapes
    engine.save_checkpoint(tmp_path, {"version": 1})
    m2 = engine.train_step(rows)
    assert m2["loss/sft"] < m1["loss/sft"]
    assert engine.load_checkpoint(tmp_path) == {"version": 1}
    back = engine.state_dict_for_broadcast(dedupe_tied=False)
    assert all(torch.equal(sd[k], back[k]) for k in sd)


def test_single_cpu_rank_needs_no_cxx_compiler(tmp_path) -> None:
    """One learner rank on CPU starts where no C++ compiler exists (the learner image): it never
    builds DeepSpeed's shared-memory allreduce op, which only ranks of one machine share."""
    import os
    import subprocess
    import sys

    code = (
        "from harnessrl.learner.ds_engine import init_distributed; init_distributed(); "
        "import torch; print('world', torch.distributed.get_world_size())"
    )
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}  # this process's own
    env.update(CXX=str(tmp_path / "no-c++"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["world", "1"]
    assert not (tmp_path / "ext").exists()  # nothing was compiled


def test_gradient_checkpointing_takes_the_same_step() -> None:
    """``gradient_checkpointing`` recomputes activations in backward: the same loss, the same
    gradients (to float rounding) and the same updated weights as keeping them."""
    rows = rows_for(make_samples(3))
    steps = []
    for checkpointing in (False, True):
        cfg = DeepSpeedConfig(lr=1e-3, gradient_checkpointing=checkpointing)
        eng = LearnerEngine("tiny-1m", cfg, LossConfig(algo="grpo"))
        lm = eng.policy.lm
        on = getattr(lm, "is_activation_checkpointing", None)
        assert (lm.is_gradient_checkpointing if on is None else on) == checkpointing
        eng.record_grads = True
        m = eng.train_step(rows)
        steps.append((m, dict(eng.last_grads), params(eng)))
    (m0, g0, p0), (m1, g1, p1) = steps
    assert m1["loss/total"] == pytest.approx(m0["loss/total"], abs=1e-6)
    assert g0.keys() == g1.keys() and g0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6), k
    for k in p0:
        assert torch.allclose(p0[k], p1[k], atol=1e-6), k
