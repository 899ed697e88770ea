"""``harnessrl demo``: the whole system on one machine, learning for real, in one command.

    harnessrl demo [--steps N] [--out DIR] [--algo grpo|ppo] [--seed N] [--harness reference ...]
                   [--nats URL] [--engine URL ...] [--from-scratch] [--no-dashboard]

Each phase is an ordinary ``harnessrl run`` / ``harnessrl eval`` child whose run file is written
to ``<out>/`` first (so every phase can be re-run or changed by hand):

1. **RL** (``<out>/rl.toml`` -> ``<out>/rl/``): GRPO (or PPO) from the shipped warm start
   ``tiny-agent`` (``harnessrl pretrain``'s output, ``common/models/tiny-agent``), with the
   embedded engine (or ``--engine`` URLs, loaded with the policy first by
   ``harnessrl weights-sync --load``) serving the policy and a weights-sync updater applying
   every new version;
2. **held-out evaluation** (``<out>/eval.json``): the starting and the RL policy on
   ``toy-eval`` (every task ``eval_n`` times, the same tasks and sampling seeds for both, at
   the training temperature).

``--from-scratch`` puts a **cold-start SFT** phase first (``<out>/sft.toml`` -> ``<out>/sft/``):
the scripted toy teacher serves as the model (``harnessrl engine --kind teacher``), so its
trajectories flow through the same actors, sandboxes, harness, proxy and assembler as any
rollout, and the learner trains a random tiny model on them with ``--sft``; RL then starts
from its weights.

Each training phase ends at its steps or its wall-clock limit (``--rl-minutes``,
``--sft-minutes``), whichever comes first. The demo ends by printing the before/after table,
the RL phase's rollouts/s and the plot's path (``rl/plot.png``, redrawn with the held-out
evaluation's before/after points on it); ``<out>/demo.json`` keeps the numbers and the phase
timings.

What to expect on a 2-core CPU (measured; ``benchmarks/results/demo_learning.json``): the
defaults take 10-13 min (RL 9-12, eval 0.7-1.3). The warm start succeeds on 0.295
of held-out rollouts at temperature 1; GRPO (2 groups of 8 per step, two optimiser steps on
each, lr 2e-4 with cosine decay to 2e-5 over 120 steps, 4.2-4.4 rollouts/s, v120 in 10-11.6
min) raises that by +0.260 / +0.310 / +0.310 over seeds 0 / 1 / 2, PPO (turn baseline, 4
groups of 4 per step, KL 0.1 to the warm start, 280 steps in 9.2-9.9 min at 8.1-8.6
rollouts/s) by +0.330 / +0.280 / +0.325 (+0.240 / +0.290 / +0.240 without the KL). Eval pairs each rollout
of the two policies on the same task and sampling seed (``demo.json``'s ``paired``: rollouts fixed and broken by RL). What
RL corrects is what ``tiny-agent`` was shown wrong: half its teacher trajectories ran a
family's plausible wrong one-liner (``harnessrl pretrain --near-miss``), a family-level mistake
that generalises to held-out tasks once unlearned. What it cannot fix in minutes is copying
names from the instruction: a per-task skill that SFT on 19k conversations only half learned
and a few thousand 1-bit rewards do not move (docs/results.md). From scratch, SFT
inside the live run is slow: held-out reward 0.28 after 40 min (success 1.4 %).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from harnessrl.common import tracking
from harnessrl.common.config import ConfigError, HrlModel, toml_text
from harnessrl.common.layout import (
    SummaryLine,
    line_object,
    read_metrics,
    weights_folder,
    weights_folders,
)
from harnessrl.common.run.plan import typed_tables
from harnessrl.common.tracking import TrackConfig, open_tracker


class DemoConfig(HrlModel):
    """``harnessrl demo``: RL from the shipped warm start (or, ``from_scratch``, cold-start SFT
    first), then held-out evaluation before and after on the toy suite."""

    out: Path | None = None
    """Demo folder; empty: ``runs/demo`` (``runs/demo-2``... when it exists)."""
    steps: int = Field(0, ge=0, le=1_000_000)
    """RL steps (weight versions); the RL phase ends at ``steps`` or after ``rl_minutes``.
    0: the algorithm's measured default (``ALGO_DEFAULTS``: 120 for GRPO, 280 for PPO)."""
    sft_steps: int = Field(0, ge=0, le=1_000_000)
    """SFT steps; 0: fifteen times ``steps`` (at most 400). The SFT phase ends at
    ``sft_steps`` or after ``sft_minutes``, whichever comes first."""
    sft_minutes: float = Field(5.5, ge=0, le=100_000)
    """Wall-clock limit of the SFT phase once its processes are ready (0: none)."""
    rl_minutes: float | None = Field(None, ge=0, le=100_000)
    """Wall-clock limit of the RL phase once its processes are ready (0: none). Unset: 12
    through the reference harness alone; 28 when a real harness is among ``harnesses``, whose
    rollouts are slower (Claude Code: 1.7 rollouts/s here against 6.5 through the reference
    harness, and a third of its GRPO groups all-equal, so 12 minutes reached v48 of 120)."""
    algo: Literal["grpo", "ppo"] = "grpo"
    """RL algorithm."""
    filter_groups: bool = False
    """PPO: train on whole groups and drop those whose rewards are all equal (the learner's
    ``filter_groups``, as GRPO always does)."""
    truncated_reward: float = Field(1.0, ge=0.0, le=1.0)
    """Cap on the trained reward of a rollout with a reply cut off at the token limit (the
    learner's ``truncated_reward``); 1: no cap."""
    drop_truncated: bool = False
    """Do not train on replies cut off at the token limit (the assembler's
    ``drop_truncated``)."""
    bound_values: bool = False
    """PPO: clamp the critic's ``V(t)`` into the reward's range [0, 1] where it enters the
    advantage ``R - V(t)`` (the learner's ``loss.value_bounds``)."""
    value_baseline: Literal["token", "turn"] = "turn"
    """PPO: read the baseline of ``R - V`` at every token (``token``) or once per reply, at the
    state the reply started from (``turn``; the learner's ``loss.value_baseline``)."""
    value_lr_scale: float = Field(10.0, gt=0.0, le=1000.0)
    """PPO: the value head's learning rate as a multiple of ``lr`` (the learner's
    ``ds.value_lr_scale``)."""
    harnesses: list[str] = ["reference"]
    """Harnesses (``--harness``, repeat to mix: one group per task and harness). The teacher
    speaks the reference harness's tools, so SFT data always comes from ``reference``."""
    model: str = ""
    """Policy the RL phase starts from: a shipped warm start or any model folder. Empty: the
    shipped policy that speaks every harness of ``harnesses`` — ``tiny-agent`` (made by
    ``harnessrl pretrain --config deploy/pretrain-tiny-agent.toml``) for the reference
    harness, ``tiny-agent-harness`` (``deploy/pretrain-tiny-agent-harness.toml``) for
    mini-swe-agent and Claude Code (``harnessrl harness list`` shows who speaks what). With
    ``from_scratch`` the model the SFT phase trains instead (a random ``tiny…`` spec)."""
    from_scratch: bool = False
    """Start from random weights: a cold-start SFT phase on live teacher trajectories first
    (``model`` then defaults to ``tiny-1m``); slow on 2 cores, see the module docstring."""
    nats: str = ""
    """An existing NATS server; empty: each phase starts its own (with credentials and TLS
    made in the phase's run folder)."""
    nats_auth_dir: str = ""
    """With ``nats``: the folder of its role credentials (``harnessrl run --nats-auth-dir``)."""
    nats_ca: str = ""
    """With ``nats``: the CA file of its TLS certificate (``harnessrl run --nats-ca``)."""
    engines: list[str] = []
    """Existing engines for the RL phase (``--engine``, repeat; loaded with the SFT weights by
    ``harnessrl weights-sync --load`` first); empty: an embedded engine."""
    engine_api_key_file: str = ""
    """With ``engines``: file holding their API key; empty: none."""
    actors: int = Field(2, ge=1, le=64)
    """Actor processes per phase."""
    concurrency: int = Field(8, ge=1, le=256)
    """Rollouts per actor at once (2 actors x 8 keep the embedded engine's batches full on 2
    cores: 2.3 rollouts/s, against 2.1 with 4 when measured beside other work)."""
    sft_batch: int = Field(8, ge=1, le=4096)
    """Teacher trajectories per SFT step."""
    engine_threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads of the embedded engine (``engine.threads``); 0: torch's default
    (one per core)."""
    learner_threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads of the learner (``learner.threads``); 0: torch's default."""
    sft_lr: float = Field(5e-3, gt=0, le=1.0)
    """SFT learning rate (AdamW)."""
    group_size: int = Field(0, ge=0, le=256)
    """RL rollouts per (task, harness) group, at least 2; 0: the algorithm's measured default
    (``ALGO_DEFAULTS``): 8 for GRPO, whose baseline is the group's mean; 4 for PPO, whose
    critic needs no group, so 16 rollouts a step cover 4 tasks instead of 2."""
    batch_groups: int = Field(0, ge=0, le=1024)
    """RL groups per step; 0: the algorithm's measured default (``ALGO_DEFAULTS``: 2 for GRPO,
    4 for PPO; 16 rollouts a step either way). For GRPO two groups of 8 learn more per minute
    than four: twice the steps in the same rollouts."""
    lr: float = Field(2e-4, gt=0, le=1.0)
    """RL peak learning rate (AdamW, linear warmup over ``lr_warmup_versions``, then cosine).
    Measured on ``tiny-agent`` (GRPO, exact-correctness reward, 8 minutes, the same held-out
    tasks and seeds before and after): 2e-4 raised held-out success 0.292 -> 0.508 (28 paired
    rollouts fixed, 2 broken), 1e-4 0.292 -> 0.425 (18 fixed, 2 broken); with the toy partial
    credit in the reward, 2e-5 moved it 0.300 -> 0.325."""
    lr_warmup_versions: int = Field(3, ge=0, le=1_000_000)
    """RL learning-rate warmup, in versions (the unit of ``steps``)."""
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The RL learning rate decays (cosine) from ``lr`` after warmup to ``lr * lr_min_ratio``
    at the last of ``steps`` (versions, however many optimiser steps each takes); 1 keeps it
    constant."""
    norm: Literal["token", "sequence"] = "sequence"
    """How the RL loss averages tokens (the learner's ``loss.norm``): ``sequence`` gives each
    rollout the same weight, so long failing rollouts (turn after turn of junk) do not outvote
    short successful ones on the tokens they share."""
    updates_per_batch: int = Field(0, ge=0, le=64)
    """Optimiser steps on each RL batch (the learner's ``updates_per_batch``: PPO epochs, with
    the ratio clipped against the batch's pi_old); 0: the measured default of the algorithm,
    2 for GRPO, 1 for PPO. With one, the learner waited for rollouts 60 % of each step; with
    two, GRPO gained +0.280 / +0.230 / +0.300 on seeds 0 / 1 / 2 (against +0.235 / +0.245 /
    +0.255) in the same 12 minutes, though it reached only v92-v107 of its 120 steps; with
    pi_old from the first update's forward (no no-grad pass), +0.260 / +0.310 / +0.310 at
    v120 in 10-11.6 minutes; with the lr schedule counting versions (the cosine over all 120,
    not to its floor at v60), +0.225 / +0.320 / +0.290 in 8.2-9.8 minutes."""
    kl_coef: float | None = Field(None, ge=0.0, le=100.0)
    """Weight of the KL penalty to the starting policy (the learner's ``loss.kl_coef``); unset:
    the algorithm's measured default (``KL_COEF``: 0 for GRPO, 0.1 for PPO)."""
    reward_weights: dict[str, float] = {"written": 0.0}
    """Weight per checker metric in the RL reward, over the tasks' own (the actor's
    ``reward_weights``; ``{}`` keeps the tasks' weights). The default drops the toy suites'
    partial credit for a written output (``written``), so the reward is exact correctness:
    with it, a group's wrong-but-written answers (the demonstrated near misses RL should
    unlearn) outscore its empty ones and get a positive GRPO advantage."""
    max_staleness: int = Field(2, ge=0, le=64)
    """RL: versions a sample may lag behind the learner."""
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    """Sampling temperature of RL and eval rollouts."""
    max_turns: int = Field(4, ge=1, le=1000)
    """Model turns per rollout (the warm start's teacher needs 2: one command, ``finish``; a
    lost policy writes up to ``max_turns`` replies of junk, so this bounds a rollout's cost)."""
    max_new_tokens: int = Field(0, ge=0, le=100_000)
    """Tokens per model call; 0: the model's own limit (``tiny-agent``: 128; its teacher's
    longest reply is 61), else 4096."""
    train_per_family: int = Field(40, ge=1, le=10_000)
    """Training tasks per toy family (20 families), generated once into ``<out>/toy-train``
    (deterministic, none equal to a held-out task; the first 6 are the built-in ``toy``
    suite, which 6 selects). The teacher is deterministic, so more tasks is the only way to
    more distinct SFT trajectories; a tiny model memorises 108 of them instead of learning to
    read."""
    eval_suite: str = "toy-eval"
    """Held-out suite for the before/after table."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of the RL phase (the learner's initialisation and the feeder's task order and
    sampling seeds); the held-out evaluation keeps its own fixed seeds, so before and after
    are scored on the same tasks and seeds."""
    eval_n: int = Field(5, ge=1, le=100)
    """Rollouts per held-out task and policy."""
    eval_limit: int = Field(0, ge=0, le=100_000)
    """Held-out tasks evaluated, spread over the suite's families (0: all)."""
    eval: bool = True
    """Run the before/after evaluation."""
    dashboard: bool = True
    """Live dashboard during the runs (plain status lines when off or not a terminal)."""
    track: TrackConfig = Field(default_factory=TrackConfig)
    """Experiment tracking (``--wandb [PROJECT]``, ``--tensorboard DIR``): each training
    phase's learner logs its metrics, config and eval table (one W&B run per phase, grouped
    under the demo's name; TensorBoard in ``DIR/<phase>``), and the demo logs the held-out
    before/after table (``DIR/eval``)."""

    @model_validator(mode="after")
    def _defaults_from_harnesses(self) -> DemoConfig:
        if not self.model:
            self.model = "tiny-1m" if self.from_scratch else speaker(self.harnesses)
        if self.rl_minutes is None:
            self.rl_minutes = 12.0 if set(self.harnesses) <= {"reference"} else 28.0
        return self

    @field_validator("group_size")
    @classmethod
    def _group_of_two(cls, v: int) -> int:
        if v == 1:
            raise ValueError("a group needs at least 2 rollouts (0: the algorithm's default)")
        return v


CONFIG = DemoConfig
SECTION = "demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tracking.add_arguments(parser)  # --wandb [PROJECT], --tensorboard DIR


def learner_track(cfg: DemoConfig, name: str) -> dict[str, Any]:
    """The ``track`` table of phase ``name``'s learner (``<demo>-<phase>``): the demo's
    tracking, grouped under the demo's name, with a TensorBoard folder per phase."""
    t = cfg.track
    if not t.enabled:
        return {}
    demo, _, phase = name.rpartition("-")
    out = t.model_dump(exclude_defaults=True)
    out["wandb_group"] = t.wandb_group or demo or name
    if t.tensorboard:
        out["tensorboard"] = str(Path(t.tensorboard).resolve() / (phase or name))
    return {"track": out}


# ---------------------------------------------------------------------------------------------
# run files
# ---------------------------------------------------------------------------------------------


def max_new_tokens(cfg: DemoConfig) -> int:
    """``max_new_tokens``, or when 0: the model's own limit (0 passed on), except that a policy
    SFT'd from scratch declares none, so it gets the teacher's 256."""
    return cfg.max_new_tokens or (256 if cfg.from_scratch else 0)


def speaker(harnesses: list[str]) -> str:
    """The first shipped policy taught every harness of ``harnesses`` (its recipe's
    ``harnesses``); ``tiny-agent`` when none is, so a harness no policy speaks still runs and
    the evaluation shows it."""
    from harnessrl.common.models.resolve import shipped_harnesses

    for name, spoken in shipped_harnesses().items():
        if set(harnesses) <= set(spoken):
            return name
    return "tiny-agent"


def scratch_model(cfg: DemoConfig) -> str:
    """The model the from-scratch SFT phase trains (``tiny-1m`` unless ``model`` names one)."""
    return "tiny-1m" if cfg.model == "tiny-agent" else cfg.model


def _actor(cfg: DemoConfig) -> dict[str, Any]:
    return {
        "model": scratch_model(cfg),
        "concurrency": cfg.concurrency,
        "max_turns": cfg.max_turns,
        "max_new_tokens": max_new_tokens(cfg),
        "temperature": cfg.temperature,
        "harness_timeout_s": 240.0,
        "shutdown_grace_s": 2.0,
        "install_harnesses": True,
    }


def _run(cfg: DemoConfig, name: str, steps: int, minutes: float, **kw: Any) -> dict[str, Any]:
    table = {
        "name": name,
        "steps": steps,
        "time_limit_s": minutes * 60,
        "actors": cfg.actors,
        "dashboard": cfg.dashboard,
        "drain_timeout_s": 0.0,
        # a redraw costs the supervisor ~1 s of CPU (matplotlib): every 20 s it was 40 % of the
        # supervisor's CPU, which the engine needs (the final plot is drawn at the end anyway)
        "plot_interval_s": 60.0,
        "stop_timeout_s": 30.0,
        **kw,
    }
    if cfg.nats:
        table["nats"] = cfg.nats
        for key in ("nats_auth_dir", "nats_ca"):
            if getattr(cfg, key):
                table[key] = getattr(cfg, key)
    return table


ALGO_DEFAULTS: dict[str, dict[str, int]] = {
    "grpo": {"steps": 120, "group_size": 8, "batch_groups": 2, "updates_per_batch": 2},
    "ppo": {"steps": 280, "group_size": 4, "batch_groups": 4, "updates_per_batch": 1},
}
"""The RL shape each algorithm trains with where its field is 0, chosen from measured runs
(``benchmarks/results/demo_learning.json``). PPO on groups of 8, 2 a step, 120 steps gained
+0.195 / +0.185 / +0.215 held-out success on seeds 0 / 1 / 2 in ~9.5 min; on groups of 4,
4 a step (twice the distinct tasks per step), 280 steps, +0.240 / +0.290 / +0.240 in
11.7-13.1 min; with the KL of ``KL_COEF`` as well, +0.330 / +0.280 / +0.325 in 9.9-10.6 min."""


def rl_shape(cfg: DemoConfig, field: str) -> int:
    """``cfg.<field>`` (``steps``, ``group_size``, ``batch_groups``, ``updates_per_batch``), or
    the algorithm's measured default (``ALGO_DEFAULTS``) when it is 0."""
    return getattr(cfg, field) or ALGO_DEFAULTS[cfg.algo][field]


KL_COEF: dict[str, float] = {"grpo": 0.0, "ppo": 0.1}
"""The KL weight each algorithm trains with where ``kl_coef`` is unset. PPO without it drifts,
in some runs, into replies of ``<tool_call>`` repeated up to the token limit after the task is
done (the share of rollouts with such a reply went from 0 to ~1.0 within 25-55 steps on seed 0
in three runs, with or without capping their reward or masking those replies); with 0.1 it
stayed near 0 on seeds 0 / 1 / 2 and PPO gained +0.330 / +0.280 / +0.325 held-out success in
9.9-10.6 min (``benchmarks/results/demo_learning.json``). GRPO's group baseline never drifted
so, and keeps none."""


def kl_coef(cfg: DemoConfig) -> float:
    """``cfg.kl_coef``, or the algorithm's measured default (``KL_COEF``) when unset."""
    return KL_COEF[cfg.algo] if cfg.kl_coef is None else cfg.kl_coef


def truncated_reward(cfg: DemoConfig) -> float | None:
    """The learner's ``truncated_reward``: None where the cap is 1 (no cap)."""
    return None if cfg.truncated_reward >= 1.0 else cfg.truncated_reward


def sft_steps(cfg: DemoConfig) -> int:
    return cfg.sft_steps or min(400, 15 * rl_shape(cfg, "steps"))


def train_suite(cfg: DemoConfig, folder: Path) -> str:
    """The training suite of both phases: ``toy``, or a larger one generated into ``folder``."""
    if cfg.train_per_family == 6:
        return "toy"
    from harnessrl.common.tasks.toy import write_train_suite

    write_train_suite(folder / "toy-train", cfg.train_per_family)
    return str(folder / "toy-train")


def sft_run_file(cfg: DemoConfig, name: str, suite: str = "toy") -> dict[str, Any]:
    """Phase 1: teacher engine, SFT learner (SFT ignores staleness, so the teacher needs no
    updater); disk broadcast: the last version's folder is the cold-start policy."""
    return typed_tables(
        {
            "run": _run(
                cfg,
                name,
                sft_steps(cfg),
                cfg.sft_minutes,
                engine_kind="teacher",
                teacher_suites=[suite],
                weights_sync=False,
            ),
            "actor": {**_actor(cfg), "temperature": 1.0},
            "assembler": {},
            "learner": {
                "model": scratch_model(cfg),
                "sft": True,
                "sft_min_reward": 1.0,
                "group_size": 1,
                "min_group_size": 1,
                "batch_groups": cfg.sft_batch,
                "max_staleness": 1,
                "ds": {"lr": cfg.sft_lr},
                "broadcast": {"transport": "disk", "keep_versions": 1},
                "feeder": {"suites": [suite], "harnesses": ["reference"]},
                **learner_track(cfg, name),
            },
            "weights_sync": {},
        }
    )


def rl_run_file(cfg: DemoConfig, name: str, policy: Path, suite: str = "toy") -> dict[str, Any]:
    """Phase 2: the SFT policy in the engine and the learner; GRPO/PPO."""
    steps = rl_shape(cfg, "steps")
    run = _run(cfg, name, steps, cfg.rl_minutes or 0.0)
    if cfg.engines:
        run["engines"] = cfg.engines
        if cfg.engine_api_key_file:
            run["engine_api_key_file"] = cfg.engine_api_key_file
    return typed_tables(
        {
            "run": run,
            "engine": {
                "model": str(policy),
                "max_batch_size": 16,
                "threads": cfg.engine_threads,
            },
            "actor": {**_actor(cfg), "model": str(policy), "reward_weights": cfg.reward_weights},
            "assembler": {"drop_truncated": cfg.drop_truncated},
            "learner": {
                "model": str(policy),
                "algo": cfg.algo,
                "group_size": rl_shape(cfg, "group_size"),
                "min_group_size": 2,
                "batch_groups": rl_shape(cfg, "batch_groups"),
                "filter_groups": cfg.filter_groups and cfg.algo == "ppo",
                "truncated_reward": truncated_reward(cfg),
                "updates_per_batch": rl_shape(cfg, "updates_per_batch"),
                "max_staleness": cfg.max_staleness,
                "threads": cfg.learner_threads,
                "ds": {
                    "lr": cfg.lr,
                    "lr_warmup_versions": cfg.lr_warmup_versions,
                    "lr_decay_versions": steps if cfg.lr_min_ratio < 1 else 0,
                    "lr_min_ratio": cfg.lr_min_ratio,
                    "seed": cfg.seed,
                    **({"value_lr_scale": cfg.value_lr_scale} if cfg.algo == "ppo" else {}),
                },
                "loss": {
                    "norm": cfg.norm,
                    "kl_coef": kl_coef(cfg),
                    **(
                        {"value_bounds": [0.0, 1.0]}
                        if cfg.bound_values and cfg.algo == "ppo"
                        else {}
                    ),
                    **({"value_baseline": cfg.value_baseline} if cfg.algo == "ppo" else {}),
                },
                "broadcast": {"transport": "disk", "keep_versions": 2},
                "feeder": {"suites": [suite], "harnesses": cfg.harnesses, "seed": cfg.seed},
                **learner_track(cfg, name),
            },
            "weights_sync": {},
        }
    )


def final_weights(run_dir: Path, version: int) -> Path:
    """The HF folder the learner broadcast last (disk transport: ``learner/weights/vN``; the
    newest version folder when the run ended before ``version``)."""
    root = run_dir / "learner" / "weights"
    path = weights_folder(root, version)
    if not (path / "model.safetensors").exists():
        found = weights_folders(root)
        if not found:
            raise RuntimeError(f"no weights under {root}")
        path = found[-1][1]
    return path


def load_into_engines(urls: list[str], policy: Path, key_file: str = "") -> None:
    """Make external engines serve ``policy`` as version 0 before the RL phase (one
    ``harnessrl weights-sync --load`` child per engine; ``key_file``: their API key)."""
    from harnessrl.common.run.plan import command_prefix

    for url in urls:
        argv = [*command_prefix(sys.executable, "weights-sync"), "--engine", url]
        if key_file:
            argv += ["--engine-api-key-file", key_file]
        argv += ["--load", str(policy), "--load-version", "0"]
        res = subprocess.run(argv, capture_output=True, text=True)
        if res.returncode != 0:
            why = res.stderr.strip() or res.stdout.strip() or f"exit {res.returncode}"
            raise RuntimeError(f"{url} did not load {policy}: {why}")


# ---------------------------------------------------------------------------------------------
# the demo
# ---------------------------------------------------------------------------------------------


class Demo:
    def __init__(self, cfg: DemoConfig, out: Any = None) -> None:
        self.cfg = cfg
        self.out = out or sys.stdout
        self.dir = demo_dir(cfg)
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None
        self.timings: dict[str, float] = {}
        self.tag = f"demo{int(time.time()) % 100000}"

    def say(self, msg: str) -> None:
        print(f"demo: {msg}", file=self.out, flush=True)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def child_run(self, argv: list[str]) -> int:
        """Run ``python -m harnessrl.common.cli ARGV`` (our terminal) in its own process group: a
        terminal's Ctrl-C reaches the demo alone, which forwards each SIGINT/SIGTERM to the
        child once (``_on_signal``), so ``kill -INT <demo pid>`` stops a phase as Ctrl-C does
        and a Ctrl-C is not delivered twice (a second signal kills a run at once)."""
        from harnessrl.common.procs import popen_child

        self.child = popen_child(
            [sys.executable, "-m", "harnessrl.common.cli", *argv], process_group=0
        )
        return self.child.wait()

    def phase(self, name: str, argv: list[str]) -> None:
        if self.stop_signal is not None:  # signalled between two phases
            raise KeyboardInterrupt
        t0 = time.monotonic()
        rc = self.child_run(argv)
        self.timings[name] = round(time.monotonic() - t0, 1)
        if self.stop_signal is not None:
            raise KeyboardInterrupt
        if rc != 0:
            raise RuntimeError(f"the {name} phase failed (exit {rc}); see {self.dir / name}")

    def write(self, name: str, tables: dict[str, Any]) -> Path:
        path = self.dir / f"{name}.toml"
        path.write_text(toml_text(tables))
        return path

    def run(self) -> int:
        cfg = self.cfg
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.say(f"folder {self.dir}")
        try:
            suite = train_suite(cfg, self.dir)
            n = 3 if cfg.from_scratch else 2
            if cfg.from_scratch:
                n_sft = sft_steps(cfg)
                self.say(
                    f"phase 1/{n}: cold-start SFT on teacher trajectories ({n_sft} steps, {suite})"
                )
                sft_file = self.write("sft", sft_run_file(cfg, f"{self.tag}-sft", suite))
                self.phase("sft", ["run", str(sft_file), "--out", str(self.dir / "sft")])
                sft_policy = final_weights(self.dir / "sft", n_sft)
            else:
                from harnessrl.common.models import resolve_model

                sft_policy = resolve_model(cfg.model)
            if cfg.engines:
                load_into_engines(cfg.engines, sft_policy, cfg.engine_api_key_file)
            steps = rl_shape(cfg, "steps")
            self.say(
                f"phase {n - 1}/{n}: {cfg.algo.upper()} from {sft_policy} ({steps} steps, "
                f"at most {cfg.rl_minutes or 0:g} min)"
            )
            rl_file = self.write("rl", rl_run_file(cfg, f"{self.tag}-rl", sft_policy, suite))
            self.phase("rl", ["run", str(rl_file), "--out", str(self.dir / "rl")])
            try:
                rl_policy: Path | None = final_weights(self.dir / "rl", steps)
            except RuntimeError:
                rl_policy = None
                self.say("the RL phase took no step: every group it saw had equal rewards")
            report = None
            if cfg.eval:
                self.say(
                    f"phase {n}/{n}: held-out evaluation on {cfg.eval_suite}, before and after"
                )
                self.phase("eval", self.eval_argv(sft_policy, rl_policy))
                report = json.loads((self.dir / "eval.json").read_text())
        except KeyboardInterrupt:
            self.say("interrupted")
            return 128 + (self.stop_signal or signal.SIGINT)
        except (RuntimeError, ConfigError, ValueError) as e:
            self.say(str(e))
            return 1
        self.timings["total"] = round(time.monotonic() - t0, 1)
        self.finish(sft_policy, rl_policy, report)
        return 0

    def eval_argv(self, sft: Path, rl: Path | None) -> list[str]:
        c = self.cfg
        argv = ["eval", "--policy", str(sft), "--suite", c.eval_suite]
        if rl is not None:
            argv += ["--policy", str(rl)]
        for h in c.harnesses:
            argv += ["--harness", h]
        argv += ["--n", str(c.eval_n), "--limit", str(c.eval_limit)]
        argv += ["--temperature", str(c.temperature), "--max-turns", str(c.max_turns)]
        argv += ["--max-new-tokens", str(max_new_tokens(c))]
        argv += ["--concurrency", str(c.actors * c.concurrency)]
        argv += ["--out", str(self.dir / "eval.json"), "--log-dir", str(self.dir / "eval-logs")]
        return argv

    def replot(self, rows: list[tuple[str, dict, dict]], version: int) -> None:
        """Redraw the RL phase's plot with the held-out evaluation's points on it."""
        from harnessrl.common.run.plot import plot_run

        try:
            plot_run(
                self.dir / "rl", f"harnessrl run {self.tag}-rl", held_out_points(rows, version)
            )
        except Exception as e:  # a plot never fails the demo
            self.say(f"plot with the held-out points failed: {e!r}")

    def finish(self, sft: Path, rl: Path | None, report: dict[str, Any] | None) -> None:
        cfg = self.cfg
        rows = []
        if report is not None:
            summary = report["summary"]
            for h in cfg.harnesses:
                before = summary.get(str(sft), {}).get(h)
                after = summary.get(str(rl or sft), {}).get(h)
                if before and after:
                    rows.append((h, before, after))
        phases = {p: run_summary(self.dir / p) for p in ("sft", "rl")}
        doc = {
            "folder": str(self.dir),
            "sft_policy": str(sft),
            "rl_policy": str(rl) if rl else None,
            "phases": {k: line_object(ph) if ph else {} for k, ph in phases.items()},
            "algo": cfg.algo,
            "steps": rl_shape(cfg, "steps"),
            "sft_steps": sft_steps(cfg) if cfg.from_scratch else 0,
            "from_scratch": cfg.from_scratch,
            "timings_s": self.timings,
            "rl_rollouts_per_s": rollouts_per_s(phases["rl"]),
            "before_after": {
                h: {
                    "before": b,
                    "after": a,
                    "delta_reward": a["reward"] - b["reward"],
                    "delta_success": a["success"] - b["success"],
                    "paired": paired(report, str(sft), str(rl or sft), h),
                }
                for h, b, a in rows
            },
        }
        (self.dir / "demo.json").write_text(json.dumps(doc, indent=1) + "\n")
        if rows:
            self.replot(rows, phases["rl"].version if phases["rl"] and rl is not None else 0)
        self.track_held_out(doc["before_after"])
        p = self.out
        print("", file=p)
        if report is not None:
            sft_ph, rl_ph = phases["sft"], phases["rl"]
            v_sft = sft_ph.version if sft_ph else "?"
            v_rl = rl_ph.version if rl_ph and rl is not None else 0
            print(
                f"held-out {cfg.eval_suite}: {report['tasks']} tasks x {cfg.eval_n} rollouts",
                file=p,
            )
            print(f"{'harness':<14}{'policy':<28}{'reward':>8}{'success':>9}", file=p)
            for h, b, a in rows:
                after = f"after: {cfg.algo.upper()} v{v_rl}" + ("" if rl else " (no RL step)")
                first = (
                    f"before: cold-start SFT v{v_sft}"
                    if cfg.from_scratch
                    else f"before: {cfg.model}"
                )
                pr = doc["before_after"][h]["paired"]
                name = h
                for label, c in ((first, b), (after, a)):
                    print(f"{name:<14}{label:<28}{c['reward']:>8.3f}{c['success']:>9.3f}", file=p)
                    name = ""
                dr, ds = a["reward"] - b["reward"], a["success"] - b["success"]
                print(f"{'':<14}{'change':<28}{dr:>+8.3f}{ds:>+9.3f}", file=p)
                print(
                    f"{'':<14}same task and seed: {pr['fixed']} rollouts now succeed, "
                    f"{pr['broken']} no longer do ({pr['both']} both, {pr['neither']} neither)",
                    file=p,
                )
        for name, ph in phases.items():
            if ph:
                why = " (time limit)" if ph.time_limited else ""
                dropped = ", ".join(f"{k} {int(v)}" for k, v in ph.dropped.items())
                rate = rollouts_per_s(ph)
                print(
                    f"{name}: v{ph.version}/{ph.steps}{why}, "
                    f"{ph.samples_trained} samples trained"
                    + (f", {rate:.2f} rollouts/s" if rate else "")
                    + (f", dropped: {dropped}" if dropped else ""),
                    file=p,
                )
        t = self.timings
        print(
            "timings: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in t.items()),
            file=p,
        )
        sft_plot = f" (SFT phase: {self.dir / 'sft' / 'plot.png'})" if cfg.from_scratch else ""
        print(f"plot: {self.dir / 'rl' / 'plot.png'}{sft_plot}", file=p)
        folders = "sft/, rl/" if cfg.from_scratch else "rl/"
        print(f"everything: {self.dir} (demo.json, {folders}, eval.json)", file=p)
        p.flush()

    def track_held_out(self, before_after: dict[str, Any]) -> None:
        """The held-out before/after table to the trackers: a W&B run of its own in the demo's
        group, TensorBoard's ``DIR/eval``."""
        t = self.cfg.track
        if not t.enabled or not before_after:
            return
        t = t.model_copy(
            update={
                "wandb_group": t.wandb_group or self.tag,
                "tensorboard": str(Path(t.tensorboard).resolve() / "eval") if t.tensorboard else "",
            }
        )
        rows = [
            [h, d["before"]["reward"], d["after"]["reward"], d["before"]["success"],
             d["after"]["success"], d["paired"]["fixed"], d["paired"]["broken"]]
            for h, d in before_after.items()
        ]  # fmt: skip
        try:
            tracker = open_tracker(
                t, name=f"{self.tag}-eval", config=self.cfg.model_dump(mode="json"), folder=self.dir
            )
            tracker.table("held_out", HELD_OUT_COLUMNS, rows)
            tracker.close()
        except Exception as e:  # the demo's results are in demo.json whatever happens here
            self.say(f"tracking the held-out table failed: {e}")


HELD_OUT_COLUMNS = [
    "harness",
    "reward_before",
    "reward_after",
    "success_before",
    "success_after",
    "fixed",
    "broken",
]


def held_out_points(rows: list[tuple[str, dict, dict]], version: int) -> list[Any]:
    """The before/after evaluation as points of the RL phase's reward plot: the starting
    policy at version 0, the final one at ``version``, per harness."""
    from harnessrl.common.run.plot import HeldOut

    out = []
    for h, b, a in rows:
        out.append(HeldOut(0, b["reward"], int(b["n"]), h, "before"))
        out.append(HeldOut(version, a["reward"], int(a["n"]), h, "after"))
    return out


def paired(report: dict[str, Any], before: str, after: str, harness: str) -> dict[str, int]:
    """Held-out rollouts of ``harness`` paired by (task, k) — the same sampling seed for both
    policies: how many succeed after only (``fixed``), before only (``broken``), both,
    neither. With common random numbers a policy that did not change scores the same, so
    ``fixed - broken`` is the success change and ``fixed + broken`` its noise."""
    runs: dict[str, dict[tuple[str, int], bool]] = {before: {}, after: {}}
    for r in report.get("results", []):
        if r.get("harness") == harness and r.get("policy") in runs:
            runs[r["policy"]][(r["task"], r["k"])] = r.get("reward", 0.0) >= 1.0
    keys = runs[before].keys() & runs[after].keys()
    out = {"fixed": 0, "broken": 0, "both": 0, "neither": 0}
    for key in keys:
        b, a = runs[before][key], runs[after][key]
        out["both" if a and b else "fixed" if a else "broken" if b else "neither"] += 1
    return out


def rollouts_per_s(summary: SummaryLine | None) -> float | None:
    """Rollouts finished per second over a run (every result status)."""
    if summary is None or summary.elapsed_s <= 0:
        return None
    return round(sum(summary.results.values()) / summary.elapsed_s, 3)


def run_summary(run_dir: Path) -> SummaryLine | None:
    """The ``summary`` line a run wrote last (None if none)."""
    found = [ln for ln in read_metrics(run_dir / "metrics.jsonl") if isinstance(ln, SummaryLine)]
    return found[-1] if found else None


def demo_dir(cfg: DemoConfig) -> Path:
    if cfg.out is not None:
        return cfg.out.resolve()
    base = Path("runs") / "demo"
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"demo-{i}")
    return path.resolve()


def main(cfg: DemoConfig, args: argparse.Namespace | None = None) -> int:
    if cfg.out is not None and (cfg.out / "demo.json").exists():
        print(f"harnessrl demo: {cfg.out} already holds a finished demo", file=sys.stderr)
        return 2
    return Demo(cfg).run()


if __name__ == "__main__":  # ``python -m harnessrl.common.run.demo`` is ``harnessrl demo``
    from harnessrl.common.cli import run_module

    run_module("demo")
