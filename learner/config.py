"""Config models of the learner-side processes (every field documented and bounded)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from harnessrl.common.config import HrlModel, ServiceConfig


class AssemblerConfig(ServiceConfig):
    """``harnessrl assembler``: RolloutResults + CallRecords -> TreeSamples."""

    max_branches: int = Field(64, ge=1, le=100_000)
    """Discard a rollout whose retained leaves (root-to-leaf branches) exceed this."""
    straggler_wait_s: float = Field(10.0, ge=0, le=600)
    """How long to keep re-reading a rollout's calls while fewer than ``n_calls`` are present,
    before giving up with a ``missing_calls`` tombstone."""
    straggler_poll_s: float = Field(0.25, gt=0, le=10)
    """Interval between re-reads while waiting for straggler calls."""
    export_side_calls: bool = False
    """Keep ``subagent``/``compaction``/``aux`` calls as extra roots of the sample (trained on,
    with the rollout's reward) instead of dropping them."""
    drop_truncated: bool = False
    """Do not train on replies cut off at the token limit (dropped as ``truncated``; where the
    harness continued from one, its tokens are the next call's context, loss mask 0). A policy
    that writes junk until the limit after doing the task right would otherwise have the junk
    trained up with the rest of the successful rollout. Measured in the demo (PPO,
    ``tiny-agent``, seed 0): the share of rollouts with a cut-off reply still rose 0 -> 0.98
    within 50 steps; a KL to the starting policy (``loss.kl_coef`` 0.1) held it at 0."""
    ack_wait: float = Field(10.0, ge=1, le=3600)
    """Seconds a RolloutResult may stay unacknowledged (heartbeats every third of it extend it
    while working) before JetStream redelivers it, e.g. to a restarted assembler: the delay
    before the work of a killed assembler is taken up again."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Rollouts assembled at the same time (mostly waiting on the bus)."""
    max_part_bytes: int = Field(6 * 1024 * 1024, ge=16 * 1024, le=64 * 1024 * 1024)
    """A sample whose encoding exceeds this is split into parts (``sample:<rid>:<part>``);
    keep it below the nats-server ``max_payload``."""
    remember: int = Field(100_000, ge=0, le=10_000_000)
    """Recently finished rollout ids kept in memory so a duplicate result is acked at once
    (after a restart, JetStream's msg-id de-duplication still prevents duplicate samples)."""
    claim_key_wait_s: float = Field(60.0, gt=0, le=86_400)
    """How long a result waits for the run's claim key (made by the learner when it starts)
    before it is retried later; results are checked against it (forged ones refused)."""


# ---------------------------------------------------------------------------------------------
# learner (``harnessrl learner``) and updater (``harnessrl weights-sync``)
# ---------------------------------------------------------------------------------------------


class FeederConfig(HrlModel):
    """Which tasks the learner's feeder issues, and how."""

    enabled: bool = True
    """Issue TaskRequests. Off: someone else publishes the work (an external feeder, a test
    publishing samples; each task's ``claim`` must then be ``member_claim`` under the run's
    claim key, or the assembler refuses its result); groups are then formed from the samples'
    own ``group_size``."""
    suites: list[str] = ["toy"]
    """Training suites (names or directories); their ``split == "train"`` tasks are issued."""
    harnesses: list[str] = ["reference"]
    """Harness adapters; with several, every task gets one group per harness (mix-harness)."""
    harness_cmd: str = ""
    """Command line for the ``command`` harness (empty otherwise)."""
    task_timeout_s: float = Field(0.0, ge=0, le=86_400)
    """Wall-clock limit of a rollout's harness; 0 keeps each task's own limit."""
    shuffle: bool = True
    """Visit (task, harness) pairs in a seeded random order per pass (else sorted order)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of the visiting order and of each TaskRequest's ``seed``."""
    eval_suite: str = ""
    """Held-out suite issued every ``eval_every`` versions (``is_eval``: scored, never trained)."""
    eval_every: int = Field(0, ge=0, le=1_000_000)
    """Issue an eval round every this many versions (0: never)."""
    eval_group_size: int = Field(1, ge=1, le=1024)
    """Rollouts per (eval task, harness)."""
    task_ack_wait_s: float = Field(10.0, ge=1, le=86_400)
    """The task consumer's ``ack_wait`` (the feeder creates the consumer every actor of the run
    shares, and sets it back to these settings at start): seconds a task may go without a
    heartbeat before JetStream redelivers it to another actor, i.e. the delay before the tasks
    of a killed actor run again. Running tasks are kept alive by the actors' heartbeats (every
    third of it), so a rollout may take far longer."""
    task_max_ack_pending: int = Field(10_000, ge=1, le=1_000_000)
    """Most tasks handed to actors and not yet acked, over the whole run."""
    task_check_s: float = Field(5.0, gt=0, le=3600)
    """Seconds between checks that the task consumer delivers while tasks wait
    (``hrl_task_queue_stalled_seconds``)."""


class BroadcastConfig(HrlModel):
    """How new weights reach the inference engines (docs/design.md, "Versions and staleness")."""

    transport: Literal["stream", "disk", "distributed", "none"] = "stream"
    """``stream``: <= 1 MiB WeightChunk records on the WEIGHTS stream (updaters apply them);
    ``disk``: an HF folder under ``disk_dir`` (shared path); ``distributed``: SGLang's
    ``init_weights_update_group`` + bucketed ``update_weights_from_distributed`` to ``engines``;
    ``none``: no broadcast."""
    every: int = Field(1, ge=1, le=1_000_000)
    """Broadcast after every this many optimiser steps."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the transferred tensors; ``auto`` = the training dtype."""
    chunk_bytes: int = Field(1024 * 1024 - 4096, ge=4096, le=64 * 1024 * 1024)
    """``stream``: data bytes per WeightChunk (the record stays under nats' default 1 MiB)."""
    keep_versions: int = Field(2, ge=1, le=1000)
    """``stream``/``disk``: versions kept; older data subjects are purged, older folders removed."""
    disk_dir: str = ""
    """``disk``: folder for version folders (must be readable by the engines); empty:
    ``<run_dir>/weights``."""
    engines: list[str] = []
    """``distributed``: engine URLs (``http://host:port``) that join the update group."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """``distributed``: collective backend (gloo against the embedded engine, nccl on GPUs)."""
    master_address: str = "127.0.0.1"
    """``distributed``: address of this learner as the engines reach it (rank 0)."""
    bucket_mb: int = Field(256, ge=1, le=65_536)
    """``distributed``: tensors are announced and broadcast in buckets of about this size."""
    pause: bool = True
    """``distributed``: pause generation (``in_place``) around a multi-bucket update, so no step
    mixes old and new buckets."""
    timeout_s: float = Field(300.0, gt=0, le=86_400)
    """``distributed``: timeout of joining the group and of each broadcast."""
    engine_api_key_file: str = ""
    """``distributed``: file holding the engines' API key (``Authorization: Bearer KEY``);
    empty: none."""


def _learner_config() -> type:
    """Build ``LearnerConfig``. Its loss/engine/packing sections are the numerical core's own
    models, whose modules import torch; building it on first use keeps ``harnessrl.learner.config`` (and
    so ``harnessrl assembler``) free of torch."""
    from harnessrl.learner.ds_engine import DeepSpeedConfig
    from harnessrl.learner.losses import LossConfig
    from harnessrl.learner.packing import PackConfig

    class LearnerConfig(ServiceConfig):
        """``harnessrl learner``: TreeSamples -> GRPO/PPO/SFT steps on DeepSpeed -> new weights."""

        model: str = "tiny-agent"
        """Model folder (any Hugging Face causal LM), ``tiny-agent`` (the shipped warm start)
        or a random tiny spec (``tiny``, ``tiny-1m``...)."""
        algo: Literal["grpo", "ppo"] = "grpo"
        """``grpo``: groups of ``group_size`` rollouts per (task, harness), group-normalised
        advantage; ``ppo``: value head + per-branch GAE, any samples."""
        sft: bool = False
        """Supervised mode: NLL of model tokens (loss mask 1), same packing and engine; rewards only
        filter (``sft_min_reward``)."""
        sft_min_reward: float = Field(0.0, ge=0.0, le=1.0)
        """SFT: samples with a lower reward are dropped (reason ``low_reward``)."""
        group_size: int = Field(4, ge=1, le=1024)
        """GRPO's n: rollouts issued per (task, harness) group."""
        min_group_size: int = Field(2, ge=1, le=1024)
        """GRPO: a group left with fewer samples (tombstones, stale members) is skipped and counted."""
        batch_groups: int = Field(4, ge=1, le=100_000)
        """Groups per optimiser step (PPO/SFT: ``batch_groups * group_size`` samples per step)."""
        truncated_reward: float | None = Field(None, ge=0.0, le=1.0)
        """Cap on the reward trained on for a rollout any of whose model calls ran into the
        token limit (``TreeCounters.truncated_calls``; DAPO's overlong punishment, per
        rollout). None: the verifier's reward, whatever the replies. A policy can
        learn to write its answer and then fill every later reply with junk up to the limit:
        the verifier, which scores only the workspace, still pays 1, and those replies are
        trained up with the rest. With 0, a cut-off reply fails the rollout. The batcher
        applies it on arrival; ``reward_mean`` and the advantages see the capped reward.
        Measured in the demo (PPO, ``tiny-agent``, seed 0): with 0 the share of rollouts with
        a cut-off reply still rose 0 -> 1.0 within 25 steps and the reward fell to 0, faster
        than without the cap; a KL to the starting policy (``loss.kl_coef`` 0.1) held it at 0."""
        filter_groups: bool = False
        """PPO: train on whole groups and drop those whose rewards are all equal (DAPO's
        dynamic sampling; GRPO always does, its advantages there are 0). A critic that cannot
        yet tell tasks apart gives every member of an all-fail group the same negative
        advantage, a push away from whatever the policy did that moves it towards junk; with
        the filter, PPO learns only where the policy's own samples disagree. Needs
        ``group_size`` > 1."""
        updates_per_batch: int = Field(1, ge=1, le=64)
        """Optimiser steps on each batch (PPO's epochs, DeepSeekMath GRPO's mu). The first
        step's own forward fixes pi_old (the weights before any update on the batch) and, for
        PPO, the advantages (``R - V`` of the critic before the first update, normalised over
        the batch); every later step clips its ratio against that pi_old (``loss.clip_low`` /
        ``clip_high``) and uses those advantages. One weight version per batch however many
        (the lr schedule counts versions). More than 1 gets more out of each rollout where
        rollouts are the scarce resource and the learner waits for them."""
        max_staleness: int = Field(4, ge=0, le=1000)
        """Samples more than this many versions behind are dropped; the feeder keeps at most
        ``(max_staleness + 1) * batch`` rollouts in flight (AReaL-style admission control)."""
        group_timeout_s: float = Field(0.0, ge=0, le=7 * 86_400)
        """GRPO: close a group still incomplete this long after its first sample (missing members
        count as lost); 0 waits forever (every rollout ends as a sample or a tombstone)."""
        parts_timeout_s: float = Field(300.0, gt=0, le=7 * 86_400)
        """A sample split into parts (``n_parts > 1``) whose parts are not all in this long
        after its first part arrived is given up: its parts are dead-lettered with the reason
        and the rollout is dropped as ``incomplete_parts`` (counted in
        ``hrl_learner_incomplete_samples_total``), so a lost part or a record claiming to be
        part 1 of 1000 is never held unacknowledged forever. The assembler publishes all parts
        of a sample at once, so they normally arrive within seconds of each other."""
        max_steps: int = Field(0, ge=0, le=100_000_000)
        """Stop after this many optimiser steps in this process (0: run until stopped)."""
        run_dir: str = ""
        """Run folder (``metrics.jsonl``, default checkpoints and disk weights); empty:
        ``./runs/<run>``."""
        checkpoint_dir: str = ""
        """Checkpoint folder; empty: ``<run_dir>/checkpoints``."""
        checkpoint_every: int = Field(1, ge=0, le=1_000_000)
        """Checkpoint every this many steps. Samples are acknowledged only once a checkpoint holds
        their outcome, so a crash retrains nothing and loses nothing; 0 never checkpoints and acks
        samples right after their step (no resume)."""
        keep_checkpoints: int = Field(2, ge=1, le=1000)
        """Checkpoints kept on disk."""
        resume: bool = False
        """Continue from the latest checkpoint (version counter, optimiser, trained ids, feeder)."""
        ack_wait: float = Field(10.0, ge=1, le=3600)
        """Seconds before JetStream redelivers an unacknowledged sample (held samples are kept
        alive with heartbeats every third of it): the delay before a restarted learner gets
        back the samples a killed one held (a stopped one nak's them at exit)."""
        fetch_batch: int = Field(64, ge=1, le=10_000)
        """Samples fetched from the bus per request."""
        max_ack_pending: int = Field(20_000, ge=16, le=1_000_000)
        """Samples the learner may hold unacknowledged (grouping + awaiting a checkpoint)."""
        threads: int = Field(0, ge=0, le=1024)
        """torch intra-op threads; 0 keeps torch's default (one per core). On shared cores
        fewer threads can be much faster (OpenMP workers spin-wait for each other)."""
        remember: int = Field(1_000_000, ge=1000, le=100_000_000)
        """Trained / dropped rollout ids kept (in memory and checkpoints) to recognise redeliveries."""
        pack: PackConfig = Field(default_factory=PackConfig)
        """Tree packing (``pack.max_tokens`` = token budget per row)."""
        loss: LossConfig = Field(default_factory=LossConfig)
        """Loss options; ``loss.algo`` follows ``algo``/``sft``."""
        ds: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
        """DeepSpeed engine and optimiser (ZeRO stage, dtype, lr, micro-batch rows; a step
        accumulates gradients over all its rows)."""
        feeder: FeederConfig = Field(default_factory=FeederConfig)
        """Task feeder."""
        broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
        """Weight broadcast."""

        @model_validator(mode="after")
        def _derive(self) -> LearnerConfig:
            algo = "sft" if self.sft else self.algo
            if "algo" in self.loss.model_fields_set and self.loss.algo != algo:
                raise ValueError(f"loss.algo={self.loss.algo!r} contradicts algo/sft ({algo!r})")
            self.loss.algo = algo
            if self.min_group_size > self.group_size:
                raise ValueError("min_group_size must not exceed group_size")
            if self.filter_groups and algo == "ppo" and self.group_size < 2:
                raise ValueError("filter_groups needs group_size > 1 (a group of 1 never varies)")
            return self

        @property
        def batch_rollouts(self) -> int:
            """Rollouts per optimiser step."""
            return self.batch_groups * self.group_size

        def run_path(self) -> Path:
            return Path(self.run_dir) if self.run_dir else Path("runs") / self.run

        def checkpoint_path(self) -> Path:
            return (
                Path(self.checkpoint_dir)
                if self.checkpoint_dir
                else self.run_path() / "checkpoints"
            )

    return LearnerConfig


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name == "LearnerConfig":
        if name not in _LAZY:
            _LAZY[name] = _learner_config()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
