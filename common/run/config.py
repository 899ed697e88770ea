"""``harnessrl run``'s own config: the ``[run]`` table of a run TOML file.

A run file holds one table per process, each read by that process itself (its ``SECTION``)::

    [run]            # this model: which processes, how many, restart policies, budget
    [engine]         # harnessrl engine   (harnessrl.proxy.config.EngineConfig)
    [actor]          # harnessrl actor    (harnessrl.actors.config.ActorConfig)
    [assembler]      # harnessrl assembler
    [learner]        # harnessrl learner  (harnessrl.learner.config.LearnerConfig, with [learner.feeder]...)
    [weights_sync]   # harnessrl weights-sync

The supervisor passes the file to every child with ``--config`` and adds only what it decides
itself as flags (NATS URL, run name, engine URLs, ports, names, folders, ``--max-steps``), so
each child's command line in ``commands.sh`` is exactly what a user would type by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from harnessrl.common.config import HrlModel, check_replicas, nats_urls
from harnessrl.common.records import check_token

OnExit = Literal["restart", "stop", "ignore"]

ROLES = ("nats", "engine", "weights_sync", "assembler", "learner", "actor")
"""Process roles, in start order."""


class OnExitPolicy(HrlModel):
    """What the supervisor does when a process of each role exits unexpectedly."""

    nats: OnExit = "stop"
    """The embedded nats-server (its file store keeps acked data, but every process reconnects:
    stopping is the safe default)."""
    engine: OnExit = "restart"
    """Embedded engines (restarted with the newest weights their updater received)."""
    weights_sync: OnExit = "restart"
    """Weight updaters (one per engine)."""
    assembler: OnExit = "restart"
    """The assembler (unacked results are redelivered to the new one)."""
    learner: OnExit = "stop"
    """The learner; ``restart`` continues from its last checkpoint (``--resume``)."""
    actor: OnExit = "restart"
    """Actors (their unfinished tasks are redelivered as new attempts)."""


class RunConfig(HrlModel):
    """``harnessrl run``: start and watch every process of a training run on this machine."""

    name: str = "run"
    """Run name: namespaces every subject and stream (``hrl.<name>.…``)."""
    out: Path | None = None
    """Run folder (config, logs, metrics.jsonl, checkpoints, plot); empty: ``runs/<name>``."""
    steps: int = Field(20, ge=1, le=100_000_000)
    """Learner optimiser steps (weight versions) after which the run ends."""
    time_limit_s: float = Field(0.0, ge=0, le=365 * 86_400)
    """End the run (as if ``steps`` were reached) after this many seconds counted from the
    moment every process is ready; 0: no limit. The learner finishes its current step and
    commits a checkpoint, so ``--resume`` can continue it."""
    resume: bool = False
    """Continue the run in ``out`` (the learner resumes from its checkpoint; the remaining
    steps are ``steps`` minus its version)."""
    nats: str = ""
    """URL of an existing NATS server, or the comma-separated URLs of a cluster's nodes; empty
    starts an embedded nats-server in ``<out>/nats``."""
    nats_insecure: bool = False
    """The embedded nats-server without credentials or TLS (``harnessrl nats --insecure``): any
    process that reaches its port may publish samples and weights or delete streams."""
    nats_tls: bool = True
    """The embedded nats-server serves TLS (a CA and certificate made in ``<out>/auth/nats``)."""
    nats_auth_dir: str = ""
    """With an existing ``nats``: the folder of its credentials as ``harnessrl nats`` writes
    them (``<role>.cred`` per role; the supervisor uses ``admin.cred``, each process its own
    role's file); empty: connect without credentials. The embedded server's are made in
    ``<out>/auth/nats``."""
    nats_ca: str = ""
    """With an existing ``nats``: CA file of its TLS certificate; empty: ``tls/ca.pem`` of
    ``nats_auth_dir`` when it exists (else plain TCP, or system CAs for a ``tls://`` URL)."""
    nats_stream_replicas: int = 1
    """Copies of each of the run's streams (1, 3 or 5), each on another node of the NATS
    cluster that ``nats`` lists (comma-separated node URLs): 3 keeps every acknowledged record
    through the loss of one node. The supervisor creates the streams with it (admin
    credential); existing streams with fewer are raised to it. The embedded server is a single
    node: more than 1 needs ``nats``."""
    engines: list[str] = []
    """URLs of existing engines (SGLang or ``harnessrl engine``; ``--engine URL``, repeat for
    several); empty starts ``num_engines`` embedded engines."""
    num_engines: int = Field(1, ge=1, le=64)
    """Embedded engines to start (when ``engines`` is empty)."""
    engine_api_key_file: str = ""
    """File holding the engines' API key (sent by actors, updaters, the learner and the
    supervisor as ``Authorization: Bearer KEY``): with ``engines``, theirs (empty: none);
    with embedded engines, empty makes one in ``<out>/auth/engine-api-key`` (0600)."""
    engine_kind: Literal["embedded", "teacher"] = "embedded"
    """What the embedded engines are: ``harnessrl engine`` (the ``[engine]`` table), or the
    scripted toy teacher (``harnessrl engine --kind teacher``; cold-start SFT data)."""
    teacher_suites: list[str] = ["toy", "toy-eval"]
    """``engine_kind = "teacher"``: suites whose tasks the teacher recognises."""
    weights_sync: bool = True
    """Start a ``harnessrl weights-sync`` per engine that applies the learner's broadcast
    versions (off for external engines updated another way). A teacher engine only takes the
    version number, so its samples are never counted as stale."""
    learner_ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel ranks of the learner (``--learner-ranks``), started on this machine with
    ``torchrun --standalone --nproc-per-node N`` (DeepSpeed ZeRO ``[learner.ds] zero_stage``;
    on CPU each rank uses gloo). Rank 0 consumes samples, commits and broadcasts; the others
    take part in each step. A rank's death stops the whole learner (the ``on_exit.learner``
    policy applies to it, ``restart`` resuming from the last commit)."""
    actors: int = Field(2, ge=0, le=1024)
    """Actor processes (each runs ``[actor] concurrency`` rollouts at once)."""
    on_exit: OnExitPolicy = Field(default_factory=OnExitPolicy)
    """Per-role policy for a process that exits unexpectedly."""
    max_restarts: int = Field(5, ge=0, le=10_000)
    """A process that dies more than this many times within ``restart_window_s`` stops the
    run."""
    restart_window_s: float = Field(300.0, gt=0, le=86_400)
    """Window over which deaths are counted for ``max_restarts``."""
    restart_backoff_s: float = Field(1.0, ge=0, le=600)
    """Delay before the first restart of a process; doubles with each death in the window (at
    most 30 s)."""
    startup_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """How long a process may take to report ready at start (engines build the tiny model on
    first use)."""
    stop_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Seconds between SIGTERM and SIGKILL when stopping a process (actors finish in-flight
    rollouts for their ``shutdown_grace_s``, the learner commits a checkpoint)."""
    drain_timeout_s: float = Field(60.0, ge=0, le=86_400)
    """After the learner's last step, keep actors and assembler running until every issued
    rollout ended as a sample or a tombstone, for at most this long (0: stop at once)."""
    scrape_interval_s: float = Field(2.0, gt=0, le=3600)
    """Seconds between reads of the processes' ``/metrics``, engines' weight versions and
    stream depths."""
    rollup_interval_s: float = Field(10.0, gt=0, le=86_400)
    """Seconds between the supervisor's ``rollup`` lines in ``metrics.jsonl``."""
    plot_interval_s: float = Field(30.0, ge=0, le=86_400)
    """Seconds between redraws of ``plot.png`` (0: only at the end)."""
    dashboard: bool = True
    """Live terminal dashboard (rich); off, or when stdout is not a terminal, a plain status
    line every ``status_interval_s``."""
    status_interval_s: float = Field(15.0, gt=0, le=86_400)
    """Seconds between plain status lines (no dashboard)."""
    host: str = "127.0.0.1"
    """Address the embedded nats-server and engines listen on (reachable by every process)."""
    python: str = ""
    """Python interpreter for the child processes; empty: the one running ``harnessrl run``."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_token(v, "run name")

    @field_validator("nats")
    @classmethod
    def _nats(cls, v: str) -> str:
        if v:
            nats_urls(v)  # one URL or a cluster's comma-separated list; empty: embedded server
        return v

    @field_validator("nats_stream_replicas")
    @classmethod
    def _replicas(cls, v: int) -> int:
        return check_replicas(v)

    @model_validator(mode="after")
    def _replicas_need_a_cluster(self) -> RunConfig:
        if self.nats_stream_replicas > 1 and not self.nats:
            raise ValueError(
                f"nats_stream_replicas = {self.nats_stream_replicas} needs an existing NATS "
                "cluster (nats = its nodes' URLs): the embedded nats-server is a single node"
            )
        return self

    @field_validator("engines")
    @classmethod
    def _engines(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        return v

    def run_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / self.name
