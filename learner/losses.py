"""Losses: GRPO and PPO with off-policy correction, SFT, and the advantages they use.

Everything here works on *targets*: flat ``[N]`` tensors, one entry per scored unique token (see
``harnessrl.learner.packing``). A loss is a weighted **sum** over targets, ``sum_t norm_weight[t] * l_t``,
where ``norm_weight`` is fixed for the whole optimiser step by ``norm_weights`` (token-mean:
``1 / N_step``; sequence-mean: ``1 / (S * n_s)``). Summing micro-batch losses therefore gives the
step's loss exactly, however rows were split into micro-batches.

Per token t of a rollout (CleanRL-style, all detached quantities marked ``sg``)::

    ratio   = exp(logp - old_logp)                 # old = the learner's own pre-update logp
    pg      = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    w       = sg(IS weight of pi_old vs pi_rollout)  # TIS / MIS / none, token or sequence level
    l_t     = w * pg + kl_coef * k3 - entropy_coef * H_t   # k3 = e^d - d - 1, d = log ref - logp
    PPO:    + value_coef * 0.5 * (V(t) - G_t)^2

Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"): the clip is
against pi_old, the IS weight corrects pi_old's mismatch with the engine's pi_rollout.

Definitions chosen here:

* **TIS** (token, default): ``w = min(pi_old / pi_rollout, C)``, ``C = is_cap = 2``
  (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
* **MIS**: ``w = pi_old / pi_rollout`` inside the band ``[mis_low, is_cap]`` (``mis_low``
  defaults to ``1 / is_cap``), and ``w = 0`` outside it: a token whose engine and learner
  probabilities disagree by more than a factor ``C`` either way contributes nothing.
* **Sequence level**: the weight of every token of a rollout is the *geometric mean* ratio
  ``exp(mean_t log(pi_old/pi_rollout))`` over the rollout's scored tokens, then truncated (TIS)
  or banded (MIS) like a token weight. (The raw product over a thousand-token agent rollout is
  0 or inf; the length-normalised ratio is the GSPO-style sequence weight.)
* **Sequence** (for ``is_level`` and ``norm="sequence"``) = one rollout, all its segments and
  branches, each unique token once.
* **GRPO** advantage ``(R - mean) / (std + eps)`` with the unbiased std of the group (as in
  DeepSeekMath / TRL); a group whose rewards all agree is *flagged* and gets zeros.
* **PPO**, GAE with gamma = lambda = 1 and the reward at each branch's last token: on a branch
  ``b`` the advantage of token t is ``R_b - V(t)`` (``gae`` is the general recursion). A
  shared-prefix token lies on several branches; its advantage is the **mean over the branches
  through it**, ``mean_b R_b - V(t)``. Every branch of a rollout carries the rollout's reward
  (TreeSample has one reward), so this is ``R - V(t)``, identical on every branch: packed and
  expanded agree exactly and no credit flows across a branch point into a sibling. The value
  target is ``G_t = R``. With ``value_baseline = "turn"`` the ``V`` subtracted is the one of
  the state the token's reply started from (the same for every token of the reply; still a
  function of the past only, so still unbiased). ``adv_norm`` then whitens (the default) or
  scales the step's ``R - V`` (``whiten``: weighted by ``norm_weight``, over every micro-batch
  and rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from harnessrl.learner.config import LossConfig

# ---------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------


def grpo_advantages(
    rewards: Sequence[float], *, eps: float = 1e-6, scale_by_std: bool = True
) -> tuple[np.ndarray, bool]:
    """One group's advantages ``(R - mean) / (std + eps)`` and whether its variance is zero.

    A zero-variance group (including a group of one) returns zeros and ``True``: it carries no
    signal, and the batcher skips and counts it.
    """
    r = np.asarray(rewards, np.float64)
    if len(r) < 2 or np.ptp(r) == 0.0:
        return np.zeros(len(r), np.float32), True
    adv = r - r.mean()
    if scale_by_std:
        adv = adv / (r.std(ddof=1) + eps)
    return adv.astype(np.float32), False


def group_advantages(
    group_ids: Sequence[str], rewards: Sequence[float], cfg: LossConfig | None = None
) -> tuple[np.ndarray, set[str]]:
    """GRPO advantage per sample (grouped by ``group_ids``) and the zero-variance group ids."""
    cfg = cfg or LossConfig()
    out = np.zeros(len(rewards), np.float32)
    flat: set[str] = set()
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    for g, idx in members.items():
        adv, zero = grpo_advantages(
            [rewards[i] for i in idx], eps=cfg.adv_eps, scale_by_std=cfg.adv_scale_by_std
        )
        out[idx] = adv
        if zero:
            flat.add(g)
    return out, flat


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE along one branch (Schulman et al. 2016): ``(advantages, returns)``.

    ``delta_t = r_t + gamma V(t+1) - V(t)`` with ``V(T) = 0``; ``A_t = delta_t + gamma lam
    A_{t+1}``. With gamma = lambda = 1 and only a final reward R this is ``R - V(t)``.
    """
    adv = torch.zeros_like(values)
    running = values.new_zeros(())
    for t in range(len(values) - 1, -1, -1):
        nxt = values[t + 1] if t + 1 < len(values) else values.new_zeros(())
        delta = rewards[t] + gamma * nxt - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, adv + values


def whiten(
    advantage: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-8,
    shift_mean: bool = True,
    reduce: Callable[..., None] | None = None,
) -> torch.Tensor:
    """``(A - mean) / (std + eps)`` (``shift_mean=False``: ``A / (std + eps)``) with the
    weighted mean and (population) std of ``A`` under ``weight`` (0 outside the scored
    tokens). ``reduce`` sums the statistics in place over the ranks of a fleet, so every rank
    normalises with the whole step's. Detached. No weight: ``A`` unchanged."""
    a = advantage.detach().to(torch.float64)
    w = weight.detach().to(torch.float64)
    sums = torch.stack([w.sum(), (w * a).sum(), (w * a * a).sum()])
    if reduce is not None:
        reduce(sums)
    total, first, second = (float(x) for x in sums)
    if total <= 0.0:
        return advantage.detach()
    mean = first / total
    std = max(second / total - mean * mean, 0.0) ** 0.5
    return (((a - mean) if shift_mean else a) / (std + eps)).to(advantage.dtype)


def ppo_advantages(
    returns: torch.Tensor, values: torch.Tensor, bounds: tuple[float, float] | None = None
) -> torch.Tensor:
    """Tree GAE(1, 1): ``mean over branches through t of (R_b - V(t)) = G_t - V(t)``, detached
    (``values`` may be the turn baselines instead: ``baseline_values``); ``bounds`` clamps
    ``V`` first (``LossConfig.value_bounds``)."""
    v = values.detach()
    if bounds is not None:
        v = v.clamp(bounds[0], bounds[1])
    return returns - v


def baseline_values(
    cfg: LossConfig, values: torch.Tensor | None, baselines: torch.Tensor | None
) -> torch.Tensor:
    """The ``V`` that ``R - V`` subtracts under ``cfg.value_baseline``: the value at each token,
    or at the state its turn started from (``PolicyOutput.baselines``)."""
    base = values if cfg.value_baseline == "token" else baselines
    if base is None:
        raise ValueError(f'value_baseline "{cfg.value_baseline}" needs its values (baselines)')
    return base


# ---------------------------------------------------------------------------------------------
# normalisation and importance weights
# ---------------------------------------------------------------------------------------------


def norm_weights(
    sample_index: np.ndarray, loss_mask: np.ndarray, mode: str = "token"
) -> np.ndarray:
    """Per-target weights for the whole step so that ``sum(w * mask * l)`` is the mean loss.

    ``token``: ``1 / (number of scored tokens)``; ``sequence``: ``1 / (S * n_s)`` with ``S``
    rollouts that have scored tokens and ``n_s`` scored tokens of rollout ``s``.
    """
    mask = np.asarray(loss_mask, np.float64)
    total = mask.sum()
    if total == 0:
        return np.zeros(len(mask), np.float32)
    if mode == "token":
        return np.full(len(mask), 1.0 / total, np.float32)
    idx = np.asarray(sample_index)
    per = np.bincount(idx, weights=mask)
    n_seq = int((per > 0).sum())
    w = np.where(per[idx] > 0, 1.0 / (n_seq * np.maximum(per[idx], 1.0)), 0.0)
    return w.astype(np.float32)


def sequence_log_weights(
    log_w: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_index: torch.Tensor,
    *,
    n: int | None = None,
    reduce: Callable[..., None] | None = None,
) -> torch.Tensor:
    """Broadcast each rollout's mean ``log(pi_old/pi_rollout)`` (over scored tokens) to its tokens.

    With data-parallel ranks each holding some of a rollout's tokens, ``n`` is the step's number
    of rollouts and ``reduce`` sums the per-rollout numerators and denominators over the ranks
    in place, so every rank gets the rollout's mean over all its tokens."""
    if n is None:
        n = int(sample_index.max()) + 1 if len(sample_index) else 0
    num = torch.zeros(n, dtype=log_w.dtype, device=log_w.device)
    den = torch.zeros_like(num)
    num.index_add_(0, sample_index, log_w * loss_mask)
    den.index_add_(0, sample_index, loss_mask)
    if reduce is not None:
        reduce(num, den)
    return (num / den.clamp_min(1.0))[sample_index]


def is_weights(log_w: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, kept)`` from ``log(pi_old/pi_rollout)`` (token- or sequence-level, detached).

    ``kept`` is 0 where MIS masked the token. With equal log-probs the weight is exactly 1.
    The band and the cap are applied to ``log_w`` before ``exp``, and a masked token's weight
    is selected as 0, never multiplied: a mismatch beyond float32's ``exp`` range (``log_w``
    over 88.7) gives a finite weight (``inf * 0`` would be NaN and poison the step).
    """
    log_w = log_w.detach()
    ones = torch.ones_like(log_w)
    if cfg.is_mode == "tis":
        return torch.exp(torch.clamp(log_w, max=math.log(cfg.is_cap))), ones
    if cfg.is_mode == "mis":
        lo, hi = cfg.mis_band
        inside = (log_w >= math.log(lo)) & (log_w <= math.log(hi))
        w = torch.where(inside, torch.exp(torch.clamp(log_w, max=math.log(hi))), 0.0)
        return w, inside.to(log_w.dtype)
    return ones, ones


# ---------------------------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------------------------


@dataclass
class LossStats:
    """Detached per-token values and summed loss terms of one micro-batch (see ``summarize``)."""

    terms: dict[str, float] = field(default_factory=dict)
    """Normalised loss terms; micro-batch values add up to the step's."""
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per scored token (mask 1): ``log_w_token``, ``is_w``, ``tis_clipped``, ``mis_masked``,
    ``ppo_clipped``; PPO adds ``value``, ``return`` and ``baseline_error`` (``R - V`` at the
    baseline ``value_baseline`` reads, before normalisation)."""


def policy_loss(
    cfg: LossConfig,
    *,
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    norm_weight: torch.Tensor,
    advantage: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    is_log_w: torch.Tensor | None = None,
    sample_index: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    policy_weight: float = 1.0,
) -> tuple[torch.Tensor, LossStats]:
    """GRPO/PPO loss over targets (see the module docstring for the formula).

    ``old_logp`` defaults to ``logp.detach()`` (one optimiser step per batch: pi_old is the
    current policy). ``is_log_w`` overrides the IS log-weight (the learner precomputes
    sequence-level weights over the whole step); otherwise it is computed here, at
    ``cfg.is_level``, from ``old_logp - rollout_logp`` (sequence level needs ``sample_index``).
    PPO uses ``advantage = returns - V`` when ``advantage`` is None (``V = baselines``, the
    values at the turns' starts, with ``cfg.value_baseline = "turn"``).
    """
    old = logp.detach() if old_logp is None else old_logp
    mask = loss_mask
    if cfg.algo == "ppo" and advantage is None:
        if values is None or returns is None:
            raise ValueError("ppo needs values and returns (or an explicit advantage)")
        advantage = ppo_advantages(
            returns, baseline_values(cfg, values, baselines), cfg.value_bounds
        )
    if advantage is None:
        raise ValueError("an advantage per target is required")
    token_log_w = (old - rollout_logp).detach()
    log_w = is_log_w
    if log_w is None:
        log_w = token_log_w
        if cfg.is_level == "sequence":
            if sample_index is None:
                raise ValueError("sequence-level IS needs sample_index")
            log_w = sequence_log_weights(token_log_w, mask, sample_index)
    w, kept = is_weights(log_w, cfg)

    ratio = torch.exp(logp - old)
    surr = ratio * advantage
    surr_clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * advantage
    pg = -torch.minimum(surr, surr_clipped)
    nw = norm_weight * mask
    pg_loss = (nw * w * pg).sum()
    loss = policy_weight * pg_loss
    terms = {"loss/pg": float(pg_loss.detach())}
    if ref_logp is not None and cfg.kl_coef > 0:
        d = ref_logp - logp
        kl = (nw * (torch.exp(d) - d - 1)).sum()
        loss = loss + policy_weight * cfg.kl_coef * kl
        terms["loss/kl_ref"] = float(kl.detach())
    if entropy is not None:
        ent = (nw * entropy).sum()
        if cfg.entropy_coef > 0:
            loss = loss - policy_weight * cfg.entropy_coef * ent
        terms["entropy"] = float(ent.detach())  # normalised like the loss: the step's mean entropy
    value_tokens: dict[str, torch.Tensor] = {}
    if cfg.algo == "ppo" and values is not None and returns is not None:
        v_loss = (nw * 0.5 * (values - returns) ** 2).sum()
        loss = loss + cfg.value_coef * v_loss
        terms["loss/value"] = float(v_loss.detach())
        terms["value/mean"] = float((nw * values.detach()).sum())
        value_tokens["value"] = values.detach()[mask > 0]
        base = baseline_values(cfg, values, baselines).detach()
        value_tokens["baseline_error"] = (returns - base)[mask > 0]
        value_tokens["return"] = returns[mask > 0]
    terms["loss/total"] = float(loss.detach())

    sel = mask > 0
    stats = LossStats(
        terms=terms,
        tokens={
            "log_w_token": token_log_w[sel],
            "is_w": w.detach()[sel],
            "tis_clipped": (torch.exp(log_w) > cfg.is_cap)[sel].float(),
            "mis_masked": (1 - kept)[sel],
            "ppo_clipped": ((surr_clipped < surr) & (advantage != 0))[sel].float().detach(),
            **value_tokens,
        },
    )
    return loss, stats


def sft_loss(
    logp: torch.Tensor, loss_mask: torch.Tensor, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, LossStats]:
    """Supervised mode: NLL of loss-mask-1 tokens, normalised like the RL losses."""
    loss = -(norm_weight * loss_mask * logp).sum()
    value = float(loss.detach())
    return loss, LossStats(terms={"loss/sft": value, "loss/total": value})


def summarize(stats: Sequence[LossStats]) -> dict[str, float]:
    """Step metrics from micro-batch stats: summed terms, mismatch and IS-weight statistics.

    ``mismatch/abs_dlogp`` is mean ``|log pi_old - log pi_rollout|`` (``max_abs_dlogp`` its
    largest); ``mismatch/kl`` the k3
    estimate of KL(pi_rollout || pi_old) on the rollout's own tokens, ``mean(r - 1 - log r)``.
    PPO: ``value/explained_variance`` is ``1 - Var(R - V) / Var(R)`` over the scored tokens,
    with the ``V`` the advantage subtracts: 1 for a perfect critic, 0 for one no better than a
    constant, negative for one that adds noise to the baseline.
    """
    out: dict[str, float] = {}
    for s in stats:
        for k, v in s.terms.items():
            out[k] = out.get(k, 0.0) + v
    toks: dict[str, torch.Tensor] = {}
    for key in {k for s in stats for k in s.tokens}:
        parts = [s.tokens[key].float().cpu() for s in stats if key in s.tokens]
        toks[key] = torch.cat(parts) if parts else torch.zeros(0)
    lw = toks.get("log_w_token")
    if lw is None or len(lw) == 0:
        return out
    out["tokens"] = float(len(lw))
    out["mismatch/abs_dlogp"] = float(lw.abs().mean())
    out["mismatch/max_abs_dlogp"] = float(lw.abs().max())
    out["mismatch/kl"] = float((torch.exp(lw) - 1 - lw).mean())
    w = toks["is_w"]
    for q in (0.05, 0.5, 0.95):
        out[f"is/w_p{int(q * 100):02d}"] = float(torch.quantile(w, q))
    out["is/w_max"] = float(w.max())
    out["is/tis_clip_frac"] = float(toks["tis_clipped"].mean())
    out["is/mis_masked_frac"] = float(toks["mis_masked"].mean())
    out["ppo/clip_frac"] = float(toks["ppo_clipped"].mean())
    v = toks.get("value")
    if v is not None and len(v):
        for q in (0.05, 0.5, 0.95):
            out[f"value/p{int(q * 100):02d}"] = float(torch.quantile(v, q))
    err, ret = toks.get("baseline_error"), toks.get("return")
    if err is not None and ret is not None and len(ret) > 1 and float(ret.var()) > 0:
        out["value/explained_variance"] = 1.0 - float(err.var()) / float(ret.var())
    return out
