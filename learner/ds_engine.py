"""The optimiser: a ``Policy`` and a torch AdamW wrapped in a DeepSpeed engine.

One ``train_step(rows)`` is one optimiser step over every packed row it is given: rows go
through forward/backward in micro-batches of ``micro_batch_rows`` and their gradients
accumulate (DeepSpeed's accumulation boundary is set by hand on the last micro-batch, so a step
may hold any number of micro-batches). Loss normalisation weights are computed for the whole step
first, so the accumulated gradient is the gradient of the step's loss however rows were split.

With N data-parallel ranks (``harnessrl.learner.fleet``) rank 0 computes those weights over the whole
step, splits the rows over the ranks (each row to exactly one rank) and every rank back-props
N times its share of the step's loss: DeepSpeed's mean of the ranks' gradients is then exactly
the gradient of the step's loss, as on one rank. Sequence-level IS weights are summed over the
ranks (a rollout's rows may sit on two ranks). ``logprobs``, the broadcast gather (ZeRO-3) and
checkpoint save/load run on every rank the same way; rank 0 alone commits.

Processes: single process on CPU uses gloo (``DS_ACCELERATOR=cpu``; DeepSpeed's shared-memory
allreduce op is skipped for one rank, so no C++ compiler is needed; several CPU ranks compile it
on their machine's first ``init_distributed``, ~35-70 s, cached in
``~/.cache/torch_extensions``); on GPU NCCL, one process per GPU under a launcher that sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (torchrun, deepspeed). Missing rendezvous variables are filled for a single
process (free port on loopback). deepspeed is imported lazily: importing this module is cheap.

Checkpoints are atomic: DeepSpeed state and ``client_state.json`` are written under
``<root>/.tmp-<tag>``, renamed to ``<root>/<tag>``, and only then is ``<root>/latest`` replaced
(temp file + ``os.replace``). A crash at any point leaves the previous ``latest`` loadable.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harnessrl.common.files import atomic_write, free_port
from harnessrl.learner.config import DeepSpeedConfig
from harnessrl.learner.fleet import Fleet, shard_rows
from harnessrl.learner.losses import (
    LossConfig,
    LossStats,
    baseline_values,
    norm_weights,
    policy_loss,
    ppo_advantages,
    sequence_log_weights,
    sft_loss,
    summarize,
    whiten,
)
from harnessrl.learner.packing import PackedRow, collate
from harnessrl.learner.policy import Policy, load_policy


def lr_at(cfg: DeepSpeedConfig, version: int) -> float:
    """Learning rate of the optimiser steps that make version ``version + 1`` (``version``:
    versions made before, 0-based): linear warmup, then cosine decay to the floor at version
    ``lr_decay_versions``."""
    warm, decay = cfg.lr_warmup_versions, cfg.lr_decay_versions
    if version < warm:
        return cfg.lr * (version + 1) / (warm + 1)
    if decay <= warm:
        return cfg.lr
    span = decay - 1 - warm  # the versions after warmup, the last one at the floor
    t = 1.0 if span <= 0 else min(1.0, (version - warm) / span)
    floor = cfg.lr * cfg.lr_min_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed for DeepSpeed once (gloo on CPU, NCCL on CUDA); its
    collectives give up after ``timeout_s``."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks an accelerator
    if torch.distributed.is_initialized():
        return
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    if cuda:  # pragma: no cover - GPU only
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    import deepspeed
    import deepspeed.ops

    if not cuda and os.environ["WORLD_SIZE"] == "1":
        # a lone rank exchanges nothing: never build DeepSpeed's shared-memory allreduce op
        # (a C++ toolchain, which the learner image lacks, and 35-70 s on a fresh machine)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(
        dist_backend="nccl" if cuda else "gloo",
        verbose=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def ds_config(cfg: DeepSpeedConfig) -> dict[str, Any]:
    """The DeepSpeed JSON config for ``cfg`` (accumulation is driven by ``train_step``)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _checkpoint_activations(lm: Any) -> None:
    """``transformers``' per-layer activation checkpointing, non-reentrant (renamed from
    ``gradient_checkpointing_enable`` in 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class LearnerEngine:
    """A Policy under DeepSpeed: ``train_step``, ``logprobs``, broadcast state, checkpoints."""

    def __init__(
        self,
        model: str | Policy,
        config: DeepSpeedConfig | None = None,
        loss: LossConfig | None = None,
    ):
        self.cfg = config or DeepSpeedConfig()
        self.loss_cfg = loss or LossConfig()
        init_distributed(self.cfg.rank_timeout_s)
        import deepspeed

        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
        attn = self.cfg.attn_implementation
        if attn == "auto":
            attn = "flex_attention" if cuda else "tree_sdpa"
        self.flex = attn == "flex_attention"
        torch.manual_seed(self.cfg.seed)
        if isinstance(model, Policy):
            policy = model
        else:
            policy = load_policy(
                model,
                device=self.device,
                attn_implementation=attn,
                temperature=self.cfg.temperature or 1.0,
                value_head=self.loss_cfg.algo == "ppo",
            )
        policy.entropy_grad = self.loss_cfg.entropy_coef > 0
        if self.cfg.gradient_checkpointing:
            _checkpoint_activations(policy.lm)
        self.reference: Policy | None = None
        if self.loss_cfg.kl_coef > 0:
            self.reference = _frozen_copy(policy)
        head = list(policy.value_head.parameters()) if policy.value_head is not None else []
        ids = {id(p) for p in head}
        groups = [{"params": [p for p in policy.parameters() if id(p) not in ids], "lr_scale": 1.0}]
        if head:
            groups.append({"params": head, "lr_scale": self.cfg.value_lr_scale})
        opt = torch.optim.AdamW(
            groups,
            lr=self.cfg.lr,
            betas=self.cfg.betas,
            eps=self.cfg.adam_eps,
            weight_decay=self.cfg.weight_decay,
        )
        self.engine, *_ = deepspeed.initialize(
            model=policy, optimizer=opt, config=ds_config(self.cfg)
        )
        self.dtype = torch.bfloat16 if self.cfg.dtype == "bfloat16" else torch.float32
        if self.reference is not None:
            self.reference.to(self.device, self.dtype)
        self.fleet: Fleet | None = None
        if torch.distributed.get_world_size() > 1:
            self.fleet = Fleet(self.cfg.rank_timeout_s)
        self.last_split: list[np.ndarray] = []
        """Scored tokens per sample that each rank trained in the last step (rank 0)."""
        self.last_logp: list[np.ndarray] | None = None
        """Per-row log-probs of the last step's forward (``train_step(keep_logp=True)``)."""
        self.last_adv: list[np.ndarray] | None = None
        """PPO: per-row advantages the last step used (``train_step(keep_logp=True)``)."""
        self.last_nonfinite: list[int] = []
        """Sample indices (into the step's samples) whose micro-batches had a NaN or inf loss in
        the last step (rank 0, every rank's); such a step is skipped (``train_step``)."""
        self.record_grads = False
        """Debug (set on every rank): keep the last step's full gradient in ``last_grads``
        on rank 0 (a gather of every gradient under ZeRO-3)."""
        self.last_grads: dict[str, torch.Tensor] = {}

    @property
    def policy(self) -> Policy:
        return self.engine.module

    @property
    def global_steps(self) -> int:
        """Optimiser steps taken (restored by ``load_checkpoint``)."""
        return int(self.engine.global_steps)

    # ------------------------------------------------------------------ micro-batches

    def _batches(self, rows: Sequence[PackedRow]) -> list[list[int]]:
        n = self.cfg.micro_batch_rows
        return [list(range(i, min(i + n, len(rows)))) for i in range(0, len(rows), n)]

    def _collate(self, rows: Sequence[PackedRow]) -> Any:
        return collate(rows, device=self.device, dtype=self.dtype, flex=self.flex)

    # ------------------------------------------------------------------ the fleet

    @property
    def world(self) -> int:
        """Data-parallel ranks (1 without a fleet)."""
        return self.fleet.world if self.fleet is not None else 1

    def _on_all(self, op: str, args: list[tuple[Any, ...]]) -> list[Any]:
        """Run ``_op_<op>`` with ``args[r]`` on every rank r; each rank's result."""
        if self.fleet is None:
            return [self._run(op, *args[0])]
        return self.fleet.call(op, args, self._run)

    def _run(self, op: str, *args: Any) -> Any:
        return getattr(self, f"_op_{op}")(*args)

    def follow(self) -> None:
        """Ranks > 0: do rank 0's part-commands until it stops (see ``harnessrl.learner.fleet``)."""
        if self.fleet is None or self.fleet.rank == 0:
            raise RuntimeError("follow() is for learner ranks other than 0")
        self.fleet.serve(self._run)

    def keepalive(self) -> None:
        """Rank 0 while waiting for data: keep idle followers from timing out, notice a dead
        one (raises ``FleetBroken``)."""
        if self.fleet is not None:
            self.fleet.keepalive(self._run)

    def close(self) -> None:
        """Rank 0 at exit: let the other ranks return from ``follow``."""
        if self.fleet is not None and self.fleet.rank == 0:
            self.fleet.stop()

    def _op_ping(self) -> None:
        return None

    def _shards(self, rows: list[PackedRow], *per_row: Sequence[Any] | None) -> list[tuple]:
        """Each rank's ``(rows, n_real, *per_row slices)``; ranks short of rows get padding
        rows (loss mask 0, so they add nothing) so that every rank runs as many micro-batches."""
        parts = shard_rows(len(rows), self.world)
        width = max(len(p) for p in parts)
        out = []
        for idx in parts:
            pad = width - len(idx)
            mine = [rows[i] for i in idx] + [_padding_row(rows[0])] * pad
            extra = []
            for values in per_row:
                if values is None:
                    extra.append(None)
                    continue
                fill = [np.zeros(len(rows[0].target_ids), np.asarray(values[0]).dtype)] * pad
                extra.append([values[i] for i in idx] + fill)
            out.append((mine, len(idx), *extra))
        return out

    # ------------------------------------------------------------------ training

    @torch.no_grad()
    def logprobs(self, rows: Sequence[PackedRow]) -> list[np.ndarray]:
        """Per-row target log-probs of the current weights (no grad): pi_old, or a check."""
        rows = list(rows)
        if self.fleet is None:
            return self._op_logprobs(rows, len(rows))
        parts = self._on_all("logprobs", self._shards(rows))
        return [lp for part in parts for lp in part]

    @torch.no_grad()
    def _op_logprobs(self, rows: list[PackedRow], n_real: int) -> list[np.ndarray]:
        return self._no_grad_pass(rows)[0][:n_real]

    @torch.no_grad()
    def _no_grad_pass(
        self, rows: list[PackedRow]
    ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Per-row target log-probs and the ``V`` that PPO's ``R - V`` subtracts (at each token
        or at its turn's start, ``loss.value_baseline``; None without a value head) of the
        current weights, over every row given (padding included)."""
        logps: list[np.ndarray] = []
        values: list[np.ndarray] | None = [] if self.policy.value_head is not None else None
        for idx in self._batches(rows):
            chunk = [rows[i] for i in idx]
            out = self.engine(**self._collate(chunk).model_inputs())
            logps.extend(_per_row(chunk, out.logprobs))
            if values is not None:
                values.extend(
                    _per_row(chunk, baseline_values(self.loss_cfg, out.values, out.baselines))
                )
        return logps, values

    def train_step(
        self,
        rows: Sequence[PackedRow],
        old_logp: Sequence[np.ndarray] | None = None,
        *,
        keep_logp: bool = False,
        version: int | None = None,
        old_adv: Sequence[np.ndarray] | None = None,
    ) -> dict[str, float]:
        """One optimiser step over ``rows``; returns loss terms, mismatch and IS metrics.

        ``old_logp`` (per row, from ``logprobs`` before earlier updates on the same data) is
        pi_old; by default it is the current policy (one step per batch), except that
        sequence-level IS weights need it for the whole step first, so a no-grad pass runs.
        ``keep_logp``: keep the per-row log-probs of this step's forward (the weights before
        its update) in ``last_logp``: pi_old for further steps on the same rows, without a
        no-grad pass of their own; PPO also keeps the advantages it used (``R - V`` of the
        critic before the update, normalised over the step) in ``last_adv``, which further
        steps on the same rows take as ``old_adv``: a batch's advantages are fixed by its
        first update, as its pi_old is, not re-read from the critic as it moves. ``version``: versions made before this step's (the lr
        schedule and the critic warmup count versions); default ``global_steps``, one
        optimiser step per version.
        With a fleet, rank 0 calls this with the whole step; the rows are split over the ranks.

        A NaN or inf loss or gradient norm never reaches the optimiser: the step is skipped on
        every rank (``skipped`` is 1 in the metrics, the weights and the optimiser state stay
        as they were, the step still counts in ``global_steps`` as DeepSpeed counts a skipped
        one) and ``last_nonfinite`` names the samples whose micro-batches had such a loss.
        """
        t0 = time.perf_counter()
        rows = list(rows)
        if not rows:
            raise ValueError("train_step needs at least one row")
        mask = np.concatenate([r.loss_mask for r in rows])
        index = np.concatenate([r.sample_index for r in rows])
        splits = np.cumsum([len(r.target_ids) for r in rows])[:-1]
        nw_rows = np.split(norm_weights(index, mask, self.loss_cfg.norm), splits)
        n_samples = int(index.max()) + 1 if len(index) else 0
        shards = self._shards(rows, nw_rows, old_logp, old_adv)
        at = self.global_steps if version is None else version
        parts = self._on_all("train", [(*s, n_samples, keep_logp, at) for s in shards])
        self.last_split = [p["scored"] for p in parts]
        self.last_nonfinite = sorted({i for p in parts for i in p["nonfinite"]})
        self.last_logp = [lp for p in parts for lp in p["logp"]] if keep_logp else None
        keep_adv = keep_logp and self.loss_cfg.algo == "ppo"
        self.last_adv = [a for p in parts for a in p["adv"]] if keep_adv else None
        stats = [st for p in parts for st in p["stats"]]
        m0 = parts[0]
        dt = time.perf_counter() - t0
        tokens = sum(p["tokens"] for p in parts)
        metrics = summarize(stats)
        metrics.update(
            {
                "grad_norm": m0["grad_norm"],
                "step": float(self.global_steps),
                "step_time_s": dt,
                "tokens_computed": float(tokens),
                "tokens_per_s": tokens / dt,
                "micro_batches": float(sum(p["micro"] for p in parts)),
                "policy_weight": m0["policy_weight"],
                "lr": m0["lr"],
                "skipped": 0.0 if m0["applied"] else 1.0,
            }
        )
        if self.fleet is not None:
            metrics["ranks"] = float(self.world)
        return metrics

    def _op_train(
        self,
        rows: list[PackedRow],
        n_real: int,
        nw_rows: list[np.ndarray],
        old_logp: list[np.ndarray] | None,
        old_adv: list[np.ndarray] | None,
        n_samples: int,
        keep_logp: bool = False,
        version: int = 0,
    ) -> dict[str, Any]:
        """This rank's part of a step: forward/backward over its rows, then the (collective)
        optimiser step. ``nw_rows`` are normalised over the whole step, on every rank;
        ``keep_logp``: return the real rows' forward log-probs too (``train_step``)."""
        cfg = self.loss_cfg
        mask = np.concatenate([r.loss_mask for r in rows])
        index = np.concatenate([r.sample_index for r in rows])
        splits = np.cumsum([len(r.target_ids) for r in rows])[:-1]
        seq_is = cfg.algo != "sft" and cfg.is_level == "sequence" and cfg.is_mode != "none"
        micro = self._batches(rows)
        reduce = self.fleet.all_reduce_sum if self.fleet is not None else None
        # PPO's whitened advantages need the whole step's values before the first backward: one
        # micro-batch on one rank takes them from its own forward, anything else from a
        # no-grad pass first (the same weights, so the same values).
        whiten_ppo = cfg.algo == "ppo" and cfg.adv_norm != "none"
        shift = cfg.adv_norm == "whiten"
        whiten_ppo = whiten_ppo and old_adv is None  # given: fixed by the batch's first update
        whiten_inline = whiten_ppo and len(micro) == 1 and self.fleet is None
        adv_rows: list[Any] = [None] * len(rows)
        if (seq_is and old_logp is None) or (whiten_ppo and not whiten_inline):
            logps, values = self._no_grad_pass(rows)
            if old_logp is None and seq_is:
                old_logp = logps
            if whiten_ppo and not whiten_inline:
                if values is None:
                    raise RuntimeError("PPO needs the policy's value head")
                adv = ppo_advantages(
                    torch.from_numpy(np.concatenate([r.returns for r in rows])),
                    torch.from_numpy(np.concatenate(values)),
                    cfg.value_bounds,
                )
                weight = np.concatenate(nw_rows) * mask
                white = whiten(adv, torch.from_numpy(weight), shift_mean=shift, reduce=reduce)
                adv_rows = np.split(white.numpy(), splits)
        is_rows: list[Any] = [None] * len(rows)
        if seq_is:
            log_w = torch.from_numpy(
                np.concatenate(old_logp) - np.concatenate([r.rollout_logp for r in rows])
            )
            seq = sequence_log_weights(
                log_w,
                torch.from_numpy(mask),
                torch.from_numpy(index),
                n=n_samples,
                reduce=reduce,
            )
            is_rows = np.split(seq.numpy(), splits)
        policy_weight = 0.0 if version < cfg.critic_warmup_versions else 1.0
        # DeepSpeed averages the ranks' gradients; each rank holds its share of the step's sum
        scale = float(self.world)

        stats: list[LossStats] = []
        kept: list[np.ndarray] = []  # in micro-batch order, which is row order
        kept_adv: list[np.ndarray] = []
        nonfinite: set[int] = set()  # samples of micro-batches whose loss was NaN or inf
        for k, idx in enumerate(micro):
            chunk = [rows[i] for i in idx]
            batch = self._collate(chunk)

            def cat(parts: Sequence[Any], idx: list[int] = idx) -> torch.Tensor | None:
                if parts[idx[0]] is None:
                    return None
                return torch.from_numpy(np.concatenate([parts[i] for i in idx])).to(self.device)

            self.engine.set_gradient_accumulation_boundary(k == len(micro) - 1)
            out = self.engine(**batch.model_inputs())
            if keep_logp:
                kept.extend(_per_row(chunk, out.logprobs))
            nw = cat(nw_rows)
            if cfg.algo == "sft":
                loss, st = sft_loss(out.logprobs, batch.loss_mask, nw)
            else:
                if cfg.algo != "ppo":
                    advantage = batch.advantage
                elif old_adv is not None:  # fixed by the batch's first update
                    advantage = cat(old_adv)
                elif whiten_ppo and not whiten_inline:
                    advantage = cat(adv_rows)
                else:  # R - V of this forward's critic (the weights before the update)
                    advantage = ppo_advantages(
                        batch.returns,
                        baseline_values(cfg, out.values, out.baselines),
                        cfg.value_bounds,
                    )
                    if whiten_inline:
                        advantage = whiten(advantage, nw * batch.loss_mask, shift_mean=shift)
                if keep_logp and cfg.algo == "ppo":
                    kept_adv.extend(_per_row(chunk, advantage))
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self.reference(**batch.model_inputs()).logprobs
                loss, st = policy_loss(
                    cfg,
                    logp=out.logprobs,
                    old_logp=cat(old_logp) if old_logp is not None else None,
                    rollout_logp=batch.rollout_logp,
                    loss_mask=batch.loss_mask,
                    norm_weight=nw,
                    advantage=advantage,
                    entropy=out.entropy,
                    values=out.values,
                    returns=batch.returns,
                    ref_logp=ref,
                    is_log_w=cat(is_rows),
                    sample_index=batch.sample_index,
                    baselines=out.baselines,
                    policy_weight=policy_weight,
                )
            if not torch.isfinite(loss.detach()):
                scored = batch.sample_index[batch.loss_mask > 0]
                nonfinite.update(int(i) for i in torch.unique(scored))
                loss = _poisoned(out)
            self.engine.backward(loss * scale if scale != 1.0 else loss, scale_wrt_gas=False)
            if idx[0] < n_real:
                stats.append(st)
        before = self._grad_norm_before_step()
        if self.record_grads:
            self._record_grads()
        lr = lr_at(self.cfg, version)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        if hasattr(self.engine.optimizer, "overflow"):
            # DeepSpeed's ZeRO and bf16 optimizers skip a step whose gradient norm is not finite
            # (on every rank: the norm is the whole step's) and clear its gradients
            self.engine.step()
            applied = self.engine.was_step_applied()
        elif math.isfinite(before):
            self.engine.step()
            applied = True
        else:
            # a plain torch optimizer (fp32, ZeRO-0) checks nothing: skip here; the gradients
            # were all-reduced in backward, so every rank sees the same norm and skips too
            self.engine.zero_grad()
            self.engine.global_steps += 1  # counted as DeepSpeed counts a skipped step
            self.engine.skipped_steps += 1
            applied = False
        gn = self.engine.get_global_grad_norm()  # None where DeepSpeed keeps no norm (ZeRO-0)
        real = rows[:n_real]
        scored = np.bincount(
            np.concatenate([r.sample_index for r in real]) if real else np.zeros(0, np.int64),
            weights=np.concatenate([r.loss_mask for r in real]) if real else None,
            minlength=n_samples,
        )
        return {
            "stats": stats,
            "grad_norm": float(gn) if gn is not None else before,
            "micro": len(micro),
            "tokens": sum(r.n_tokens for r in real),
            "scored": scored,
            "logp": kept[:n_real],
            "adv": kept_adv[:n_real],
            "policy_weight": policy_weight,
            "lr": lr,
            "applied": applied,
            "nonfinite": sorted(nonfinite),
        }

    def _record_grads(self) -> None:
        from deepspeed.utils import safe_get_full_grad

        grads = {n: safe_get_full_grad(p) for n, p in self.policy.named_parameters()}
        if self.fleet is None or self.fleet.rank == 0:
            self.last_grads = {
                n: g.detach().float().cpu().clone() for n, g in grads.items() if g is not None
            }

    def _grad_norm_before_step(self) -> float:
        """Pre-clip norm of the whole grads ZeRO-0 keeps on the params (NaN for other stages)."""
        if self.cfg.zero_stage > 0:
            return float("nan")
        grads = [p.grad.float() for p in self.policy.parameters() if p.grad is not None]
        return (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )

    # ------------------------------------------------------------------ weights

    def state_dict_for_broadcast(
        self, dtype: torch.dtype | None = None, *, dedupe_tied: bool = True
    ) -> dict[str, torch.Tensor]:
        """Full LM weights on CPU under Hugging Face names (no value head), gathered from
        ZeRO-3 shards when needed (every rank enters the gather; rank 0 gets the weights).
        ``dedupe_tied`` drops names that share storage with an earlier one (tied embeddings:
        the receiver ties them again)."""
        if self.fleet is not None and self.cfg.zero_stage == 3:
            return self._on_all("gather", [(dtype, dedupe_tied)] * self.world)[0]
        return self._op_gather(dtype, dedupe_tied)

    def _op_gather(self, dtype: torch.dtype | None, dedupe_tied: bool) -> Any:
        import deepspeed

        lm = self.policy.lm
        params = list(lm.parameters())
        keep = self.fleet is None or self.fleet.rank == 0
        with deepspeed.zero.GatheredParameters(
            params, modifier_rank=None, enabled=self.cfg.zero_stage == 3
        ):
            if not keep:
                return None
            out: dict[str, torch.Tensor] = {}
            seen: set[int] = set()
            for name, t in lm.state_dict(keep_vars=True).items():
                ptr = t.data_ptr()
                if dedupe_tied and ptr in seen:
                    continue
                seen.add(ptr)
                out[name] = t.detach().to("cpu", dtype or t.dtype, copy=True)
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, root: str | Path, client_state: dict[str, Any], *, keep: int = 2
    ) -> Path:
        """Atomically write DeepSpeed state + ``client_state`` (JSON-able) as a new checkpoint
        under ``root`` and point ``root/latest`` at it; keep the newest ``keep`` checkpoints.
        With a fleet every rank writes its shards into the same folder (which must be shared
        by all ranks) and fsyncs them before rank 0 commits."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        tag = f"step-{self.global_steps:09d}"
        final, tmp = root / tag, root / f".tmp-{tag}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self._on_all("save", [(str(tmp),)] * self.world)  # returns once every rank's is durable
        meta = {"tag": tag, "global_steps": self.global_steps, "client_state": client_state}
        (tmp / "client_state.json").write_text(json.dumps(meta))
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step: the newer write wins
            shutil.rmtree(final)
        os.rename(tmp, final)
        atomic_write(root / "latest", tag, fsync=True)
        tags = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
        for old in tags[:-keep] if keep > 0 else []:
            if old != tag:
                shutil.rmtree(root / old, ignore_errors=True)
        return final

    def _op_save(self, tmp: str) -> None:
        self.engine.save_checkpoint(tmp, tag="ds", save_latest=False)
        _fsync_tree(Path(tmp))

    def load_checkpoint(self, root: str | Path) -> dict[str, Any] | None:
        """Restore the checkpoint ``root/latest`` names (weights, optimiser, step counter) and
        return its client state; None when there is none. Every rank loads its shards."""
        root = Path(root)
        latest = root / "latest"
        if not latest.exists():
            return None
        path = root / latest.read_text().strip()
        loaded = self._on_all("load", [(str(path),)] * self.world)
        if not all(loaded):
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
        return json.loads((path / "client_state.json").read_text())["client_state"]

    def _op_load(self, path: str) -> bool:
        load_path, _ = self.engine.load_checkpoint(path, tag="ds")
        return load_path is not None


def _per_row(rows: Sequence[PackedRow], t: torch.Tensor) -> list[np.ndarray]:
    """A packed batch's per-target tensor (detached, fp32 numpy) split into its rows."""
    splits = np.cumsum([len(r.target_ids) for r in rows])[:-1]
    return np.split(t.detach().float().cpu().numpy(), splits)


def _poisoned(out: Any) -> torch.Tensor:
    """A loss whose gradient is NaN everywhere the policy's is, for a micro-batch whose loss was
    not finite: backward still runs (DeepSpeed's micro-batch bookkeeping stays whole), and every
    optimiser path then sees a non-finite gradient norm and skips the step on every rank."""
    return out.logprobs.sum() * float("nan")


def _padding_row(row: PackedRow) -> PackedRow:
    """A copy of ``row`` that trains nothing (loss mask 0): keeps a rank in step."""
    return dataclasses.replace(row, loss_mask=np.zeros_like(row.loss_mask))


def _frozen_copy(policy: Policy) -> Policy:
    import copy

    ref = copy.deepcopy(policy)
    ref.value_head = None
    ref.requires_grad_(False)
    ref.eval()
    return ref


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
