"""Config of the processes that run rollouts: ``harnessrl actor`` and ``harnessrl rollout``.

Plain pydantic models (no heavy imports): ``--help`` builds its flags from them. The fields
that shape one rollout (engines, sampling, sandbox, harness, scoring) live in `RolloutSettings`
and are shared by both commands, so a rollout run by hand behaves exactly like one run by an
actor with the same settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from harnessrl.actors.verifier import JudgeConfig
from harnessrl.common.config import NatsClientSettings, ServiceConfig, nats_urls
from harnessrl.common.records import check_token
from harnessrl.common.tasks.model import non_negative_weights
from harnessrl.proxy.proxy_config import ProxySettings

HARNESS_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789-_"


class RolloutSettings(ProxySettings):
    """How one rollout runs: engines and sampling (the proxy's settings), sandbox, harness,
    timeouts and scoring."""

    context_window: int = Field(0, ge=0, le=10_000_000)
    """Context size told to harnesses that take one (their compaction threshold follows);
    0 uses ``max_context`` when known."""
    record_buffer: int = Field(1024, ge=1, le=1_000_000)
    """CallRecords (all rollouts of the process) that may wait for the bus before new calls
    are answered 503 (harnesses retry)."""
    flush_timeout_s: float = Field(120.0, gt=0, le=3600)
    """How long a finished rollout waits for the bus to store its CallRecords; past it the
    rollout fails (the task is retried) instead of publishing a result with calls missing."""
    engine_health_interval_s: float = Field(2.0, gt=0, le=3600)
    """Seconds between engine health checks."""
    engine_grace_s: float = Field(30.0, gt=0, le=86_400)
    """How long a harness runs on while no engine is in rotation (all failed their health
    checks or refused calls) before it is stopped and its rollout ends as ``engine_error``:
    reported in seconds, not at the harness's own timeout."""
    sandbox: Literal["bwrap", "docker"] = "bwrap"
    """Sandbox backend: bubblewrap (no daemon) or docker."""
    sandbox_root: Path | None = None
    """Host folder for sandbox state; empty uses the backend's default under the temp dir.
    Leftovers of dead actors under it are swept at start."""
    docker_image: str = ""
    """Image of docker sandboxes; empty uses the backend's default (built offline)."""
    sandbox_memory_mb: int = Field(8192, ge=64, le=4_194_304)
    """Memory limit per sandbox process, MiB."""
    sandbox_max_processes: int = Field(1024, ge=8, le=1_000_000)
    """Processes + threads a sandbox may run."""
    sandbox_disk_mb: int = Field(1024, ge=0, le=16_777_216)
    """Disk quota per sandbox, MiB: the total its commands may hold across every writable
    mount (workspace, home, ``/tmp``, ``/dev/shm``; no single file beyond it either). Past it
    the sandbox is stopped within a second and the rollout is the harness's failure: scored 0,
    not verified (``actors/sandbox/quota.py``). The built-in tasks' workspaces and the real
    harnesses' state are a few MiB; 0: no limit."""
    sandbox_pool: int = Field(2, ge=0, le=256)
    """Blank sandboxes kept ready (bwrap: folders, lock, uid; docker: started containers of
    the shape the last rollout asked for), each serving exactly one rollout, and sandboxes
    removed in the background, so a rollout waits for neither; 0: each rollout makes and
    removes its own."""
    task_environments: bool = True
    """Give each sandbox its task's environment (a ``python`` command, pip packages; built once
    per content and cached, see ``actors/sandbox/envs.py``); off: every task runs in the base
    userland, and a checker that needs a missing module ends as ``verifier_environment``."""
    env_cache_dir: Path | None = None
    """Folder where task environments are built (bwrap: one venv per environment; docker: the
    wheels, the images live on the engine); empty: ``$HARNESSRL_CACHE/envs`` or
    ``~/.cache/harnessrl/envs``. The first build of an environment downloads its packages
    (needs the package index); later ones, in any process, reuse it."""
    proxy_port: int = Field(18080, ge=1, le=65535)
    """Loopback port inside the sandbox where the harness reaches its proxy."""
    harness_cache_dir: Path | None = None
    """Folder of installed harnesses; empty: ``$HRL_HARNESS_CACHE`` or
    ``~/.cache/harnessrl/harnesses``."""
    install_harnesses: bool = True
    """Install a harness that is missing from the cache on first use (needs its registry);
    off: such rollouts end as ``harness_error``."""
    harness_preload: bool = True
    """Start a Python harness that declares a preloaded start (mini-swe-agent) by forking an
    interpreter that has imported its libraries once, instead of a fresh interpreter per
    rollout (~10x less CPU per start; same argv, environment and sandbox). Needs the bwrap
    backend running as root; elsewhere, or off, every start is cold."""
    harness_timeout_s: float = Field(0.0, ge=0, le=86_400)
    """Wall-clock limit of a harness run when the TaskRequest gives none; 0 uses the task's
    own (``agent_timeout_s``)."""
    timeout_scoring: Literal["discard", "score"] = "discard"
    """A harness killed at its timeout: ``discard`` (status ``timeout``, a tombstone) or
    ``score`` (verify the workspace it left, status from the verifier)."""
    max_turns: int = Field(0, ge=0, le=100_000)
    """Most model turns, for harnesses that take a limit; 0 keeps the harness default."""
    harness_options: dict[str, dict[str, Any]] = {}
    """Adapter options by harness name (JSON), e.g. ``{"reference": {"max_tokens": 512}}``;
    each adapter's docstring lists the keys it reads."""
    harness_env: dict[str, str] = {}
    """Extra environment for every harness (applied last)."""
    expose_solution: bool = False
    """``command`` harness only: bind the task's reference solution read-only at
    ``/opt/hrl/solution`` and name it in ``$HRL_SOLUTION``. For testing tasks; never train so."""
    reward_weights: dict[str, float] = {}
    """Weight per checker metric in the reward, over the task's own ``[score] weights`` (a
    metric named here takes this weight, the others keep theirs): ``{written = 0}`` trains the
    toy suites on exact correctness alone, without their partial credit for a written output.
    Success (reward 1.0) is unchanged by it."""
    judge: dict[str, Any] = {}
    """Rubric judge for tasks with rubric rules, as the fields of ``harnessrl.actors.verifier.JudgeConfig``
    (JSON / a TOML table: ``url``, ``model``, ``api_key``, ...); empty scores code checkers
    alone."""

    @field_validator("judge")
    @classmethod
    def _judge(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v:
            JudgeConfig.model_validate(v)
        return v

    @property
    def judge_config(self) -> JudgeConfig | None:
        return JudgeConfig.model_validate(self.judge) if self.judge else None

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        return non_negative_weights(v)

    @field_validator("harness_options")
    @classmethod
    def _option_tables(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in v:
            if not name or any(c not in HARNESS_NAME_CHARS for c in name):
                raise ValueError(f"harness name {name!r} is not a harness name")
        return v


class ActorConfig(RolloutSettings, ServiceConfig):
    """``harnessrl actor``: pull TaskRequests, run each in a fresh sandbox, publish results."""

    name: str = ""
    """Actor instance name (in results, logs and sandbox owners); empty: ``<host>-<pid>``."""
    concurrency: int = Field(4, ge=1, le=4096)
    """Rollouts run at once."""
    heartbeat_s: float = Field(0.0, ge=0, le=86_400)
    """Seconds between ``in_progress`` heartbeats of a running task; 0: a third of the task
    consumer's ``ack_wait`` (set by the learner: ``[learner.feeder] task_ack_wait_s``)."""
    fetch_batch: int = Field(16, ge=1, le=4096)
    """Most tasks taken from the queue per fetch (fewer when fewer slots are free). A task's
    ``ack_wait`` runs from its delivery, its heartbeats only from its rollout's start:
    taking hundreds at once (an actor with every slot free) leaves the last of them waiting
    while the first ones start their sandboxes, past ``ack_wait`` on a busy machine, and
    JetStream then hands them to another actor as well (both run them). Small batches start
    each task before the next batch is fetched."""
    max_attempts: int = Field(5, ge=1, le=1000)
    """Deliveries of one task before it is given up: its member then ends as a failed result
    (``harness_error``) and the task is dead-lettered."""
    shutdown_grace_s: float = Field(30.0, ge=0, le=86_400)
    """On SIGTERM, how long in-flight rollouts may finish (0: as long as they take; a second
    SIGTERM ends the wait at once, and so does NATS being unreachable, since no result could
    be published); the rest are killed and their tasks nak'ed (another actor retries them as
    a new attempt)."""
    keep_workspace_dir: Path | None = None
    """Copy each rollout's final workspace to ``<dir>/<rollout_id>`` (debugging; costs disk)."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_token(v, "actor name") if v else v


class RolloutConfig(RolloutSettings, NatsClientSettings):
    """``harnessrl rollout``: one rollout by hand, with the actor's settings (with ``nats``, the
    admin credential: it publishes calls and reads them back)."""

    nats: str = ""
    """NATS server URL; empty starts an embedded nats-server in a temp dir for this command."""
    run: str = "rollout"
    """Run name the CallRecords are published under (the result itself is not published)."""
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    """Logging level (logs go to stderr; the report to stdout)."""

    @field_validator("run")
    @classmethod
    def _run_token(cls, v: str) -> str:
        return check_token(v, "run")

    @field_validator("nats")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        if v:
            nats_urls(v)  # one URL or a cluster's comma-separated list; empty: embedded server
        return v
