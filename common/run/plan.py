"""The plan of a ``harnessrl run``: its run file resolved, its folder, and the command line of
every process it starts (``Plan``); ``harnessrl.common.run.run`` starts and watches them.

Each child reads its own table of the run file (``[engine]``, ``[actor]``, ``[assembler]``,
``[learner]``, ``[weights_sync]``; ``[run]`` is `harnessrl.common.run.config.RunConfig`); the plan adds only
what the supervisor decides itself as flags (URLs, ports, names, folders, ``--max-steps``).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harnessrl.common.config import ConfigError, load_config, overrides_from_args, toml_text
from harnessrl.common.files import atomic_write, free_port, write_secret
from harnessrl.common.layout import checkpoint_version, latest_weights
from harnessrl.common.run.config import RunConfig

SECTIONS = ("engine", "actor", "assembler", "learner", "weights_sync")
"""Tables of a run file read by the child processes themselves."""

READY = {
    "nats": r"nats-server ready: ",
    "engine": r"^engine ready: ",
    "weights_sync": r"weights-sync: .* at version",
    "assembler": r"assembler: metrics on",
    "learner": r"learner (started|resumed) at version",
    "actor": r"^actor ready: ",
}

SCRAPE_JOBS = {
    "engine": "hrl-engine",
    "weights_sync": "hrl-weights-sync",
    "assembler": "hrl-assembler",
    "learner": "hrl-learner",
    "actor": "hrl-actor",
}
"""Prometheus job of each role's processes: ``deploy/monitoring/prometheus.yml`` scrapes the
targets listed in ``targets/JOB*.json`` as job JOB (its alert rules and dashboards use these
names)."""


# ---------------------------------------------------------------------------------------------
# resolving the run file
# ---------------------------------------------------------------------------------------------


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k == "on_exit":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolve(args: argparse.Namespace) -> tuple[RunConfig, dict[str, Any]]:
    """(RunConfig, the run file's tables): defaults < [run] table < flags."""
    overrides = overrides_from_args(args)
    path = args.run_file or getattr(args, "config", None)
    if not path and overrides.get("resume"):
        base = RunConfig.model_validate(
            {k: v for k, v in overrides.items() if k in ("name", "out")}
        )
        candidate = base.run_dir() / "config.toml"
        if candidate.exists():
            path = str(candidate)
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"run file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"run file {path} is not valid TOML: {e}") from None
    loose = [k for k, v in raw.items() if not isinstance(v, dict)]
    if loose:
        raise ConfigError(
            f"run file {path}: top-level keys {loose} belong in a table ([run] for the "
            "supervisor's own settings)"
        )
    unknown = [k for k in raw if k != "run" and k not in SECTIONS]
    if unknown:
        raise ConfigError(
            f"run file {path}: unknown tables {unknown} (expected [run] and {list(SECTIONS)})"
        )
    cfg = load_config(RunConfig, None, {**_flatten(raw.get("run", {})), **overrides})
    sections = tie_sampling({s: raw.get(s, {}) for s in SECTIONS}, path or "the run")
    sections["learner"] = _with_tracking(sections["learner"], args, Paths(cfg.run_dir()))
    typed_tables(sections)  # before anything is created: a typo leaves no run folder behind
    return cfg, sections


def tie_sampling(sections: dict[str, dict[str, Any]], where: str) -> dict[str, dict[str, Any]]:
    """One source of truth for how a run samples: ``[actor] temperature`` (the proxy samples
    every call at it and records it) becomes the learner's ``[learner.ds] temperature`` (which
    then refuses samples drawn at another); a learner temperature set to something else, and
    RL from greedy or truncated sampling (``top_p`` < 1, ``top_k`` > 0: the learner cannot
    compute the log-probs of a truncated distribution), are refused here, before anything
    starts. SFT trains the model's own distribution and is left alone."""
    actor, learner = sections["actor"], sections["learner"]
    if not isinstance(actor, dict) or not isinstance(learner, dict):
        return sections
    if learner.get("sft") or learner.get("algo") == "sft":
        return sections
    temp = actor.get("temperature", 1.0)
    top_p, top_k = actor.get("top_p", 1.0), actor.get("top_k", -1)
    if not isinstance(temp, int | float) or isinstance(temp, bool):
        return sections  # the actor's own validation names the bad field
    if temp <= 0:
        raise ConfigError(
            f"{where}: [actor] temperature = {temp}: RL needs sampled rollouts (greedy "
            "decoding has no behaviour log-probs to train against); use a temperature > 0"
        )
    if (isinstance(top_p, int | float) and top_p < 1) or (isinstance(top_k, int) and top_k > 0):
        raise ConfigError(
            f"{where}: [actor] top_p = {top_p}, top_k = {top_k}: RL samples the whole "
            "distribution (the learner's log-probs are of softmax(logits / temperature), "
            "which a truncated distribution's are not); keep top_p = 1 and top_k = -1"
        )
    ds = learner.get("ds", {})
    if not isinstance(ds, dict):
        return sections
    mine = ds.get("temperature")
    if mine is not None and mine != temp:
        raise ConfigError(
            f"{where}: [learner.ds] temperature = {mine} but [actor] temperature = {temp}: "
            "the learner must take log-probs at the temperature the rollouts were sampled at "
            "(leave [learner.ds] temperature unset: it follows the actor's)"
        )
    return {**sections, "learner": {**learner, "ds": {**ds, "temperature": temp}}}


def _with_tracking(learner: dict[str, Any], args: argparse.Namespace, paths: Paths) -> dict:
    """The learner's table with ``--wandb`` / ``--tensorboard`` in its ``track`` table; when
    tracking is on, the learner also logs the run file (``track.config_file``)."""
    if not isinstance(learner, dict):
        return learner  # the learner's own validation names it
    track = dict(learner.get("track", {}))
    if (project := getattr(args, "track__wandb", None)) is not None:
        track["wandb"] = project
    if tb := getattr(args, "track__tensorboard", None):
        track["tensorboard"] = str(Path(tb).resolve())
    if not (track.get("wandb") or track.get("tensorboard")):
        return learner
    track.setdefault("config_file", str(paths.config))
    return {**learner, "track": track}


def typed_tables(tables: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each table of a run file validated by the config model of the process that reads it
    (``[run]``: `RunConfig`; the others by command name through the CLI face), so a wrong key
    or value fails here naming the table and the field; returns the fields as set (what the
    TOML file holds)."""
    from harnessrl.common.cli import command_config

    out: dict[str, dict[str, Any]] = {}
    for name, table in tables.items():
        model = RunConfig if name == "run" else command_config(name.replace("_", "-"))
        try:
            cfg = load_config(model, None, table)  # model_validate; errors name the field
        except ConfigError as e:
            raise ConfigError(f"[{name}] {e}") from None
        out[name] = cfg.model_dump(mode="json", exclude_unset=True)
    return out


# ---------------------------------------------------------------------------------------------
# the plan: which processes, with which command lines
# ---------------------------------------------------------------------------------------------


def command_prefix(py: str, cmd: str) -> list[str]:
    """``python -m harnessrl.common.cli CMD``: a child's command line as a user would start it."""
    return [py, "-m", "harnessrl.common.cli", cmd]


def ranks_prefix(py: str, ranks: int) -> list[str]:
    """``torchrun`` starting ``ranks`` processes of the command after it on this machine (no
    restarts of its own: a rank's death ends them all and the supervisor's policy decides)."""
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


def display_command(argv: list[str]) -> str:
    """A command line as a user would type it (``harnessrl CMD ...``)."""
    if len(argv) >= 3 and argv[1:3] == ["-m", "torch.distributed.run"]:
        return shlex.join(["torchrun", *argv[3:]])
    if len(argv) >= 3 and argv[1:3] == ["-m", "harnessrl.common.cli"]:
        return shlex.join(["harnessrl", *argv[3:]])
    if len(argv) >= 3 and argv[1] == "-m":
        return shlex.join(["python", *argv[1:]])
    return shlex.join(argv)


class Paths:
    """Where everything of a run lives (the run folder of ``harnessrl.common.run.run``'s docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir).resolve()
        r = self.run_dir
        self.config = r / "config.toml"
        self.engine_config = r / "engine.toml"
        self.resolved = r / "resolved"
        self.commands = r / "commands.sh"
        self.logs = r / "logs"
        self.supervisor_log = r / "supervisor.log"
        self.metrics = r / "metrics.jsonl"
        self.learner = r / "learner"
        self.checkpoints = r / "checkpoints"
        self.weights = r / "weights"
        self.nats = r / "nats"
        self.prometheus = r / "prometheus"
        self.auth = r / "auth"
        self.nats_auth = self.auth / "nats"
        self.engine_key = self.auth / "engine-api-key"


@dataclass
class Plan:
    """The processes of one run and their command lines."""

    cfg: RunConfig
    sections: dict[str, dict[str, Any]]
    paths: Paths
    py: str = ""
    nats_url: str = ""
    engines: dict[str, str] = field(default_factory=dict)
    """Engine name -> URL (embedded or external)."""
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.cfg
        self.py = c.python or sys.executable
        scheme = "tls" if self.nats_auth_dir and c.nats_tls else "nats"
        near = "127.0.0.1" if c.host in ("0.0.0.0", "::") else c.host  # what the cert names
        self.nats_url = c.nats or f"{scheme}://{near}:{free_port(c.host)}"
        if c.engines:
            self.engines = {f"engine-{i}": u for i, u in enumerate(c.engines)}
        else:
            self.engines = {
                f"engine-{i}": f"http://{c.host}:{free_port(c.host)}" for i in range(c.num_engines)
            }

    @property
    def embedded_nats(self) -> bool:
        return not self.cfg.nats

    @property
    def embedded_engines(self) -> bool:
        return not self.cfg.engines

    # -- trust: NATS credentials and the engines' API key (file paths only) ---------------

    @property
    def nats_auth_dir(self) -> Path | None:
        """Folder of the role credentials (None: connect without)."""
        if self.embedded_nats:
            return None if self.cfg.nats_insecure else self.paths.nats_auth
        return Path(self.cfg.nats_auth_dir).resolve() if self.cfg.nats_auth_dir else None

    def nats_creds(self, role: str) -> str:
        """Credential file of ``role``, or of actor ``actor-<i>`` (each actor has its own:
        ``actors/actor-<i>.cred``); "" without credentials."""
        d = self.nats_auth_dir
        if d is None:
            return ""
        if role.startswith("actor-"):
            return str(d / "actors" / f"{role}.cred")
        return str(d / f"{role}.cred")

    @property
    def nats_ca(self) -> str:
        """CA file of the server's TLS certificate ("" for none)."""
        c, d = self.cfg, self.nats_auth_dir
        if not self.embedded_nats and c.nats_ca:
            return str(Path(c.nats_ca).resolve())
        ca = d / "tls" / "ca.pem" if d is not None else None
        if self.embedded_nats:
            return str(ca) if ca is not None and c.nats_tls else ""
        return str(ca) if ca is not None and ca.exists() else ""

    def nats_flags(self, role: str) -> list[str]:
        """``--nats-creds`` / ``--nats-ca`` of a process of ``role``."""
        out = []
        if creds := self.nats_creds(role):
            out += ["--nats-creds", creds]
        if self.nats_ca:
            out += ["--nats-ca", self.nats_ca]
        return out

    @property
    def engine_key_file(self) -> str:
        """File of the engines' API key ("" for none)."""
        if self.cfg.engine_api_key_file:
            return str(Path(self.cfg.engine_api_key_file).resolve())
        return str(self.paths.engine_key) if self.embedded_engines else ""

    def engine_key_flags(self, flag: str = "--engine-api-key-file") -> list[str]:
        key = self.engine_key_file
        return [flag, key] if key else []

    @property
    def with_weights_sync(self) -> bool:
        return self.cfg.weights_sync

    def last_broadcast(self, version: int) -> int | None:
        """The version the engines should end at (None: no updater, no broadcast)."""
        bcast = self.sections["learner"].get("broadcast", {})
        if not self.with_weights_sync or bcast.get("transport") in ("none", "distributed"):
            return None
        every = int(bcast.get("every", 1))
        return version // every * every

    def port(self, name: str) -> int:
        if name not in self.metrics_ports:
            self.metrics_ports[name] = free_port(self.cfg.host)
        return self.metrics_ports[name]

    def service_flags(self, name: str) -> list[str]:
        return [
            "--config",
            str(self.paths.config),
            "--nats",
            self.nats_url,
            *self.nats_flags(name if name.startswith("actor-") else _role(name)),
            "--run",
            self.cfg.name,
            "--metrics-port",
            str(self.port(name)),
        ]

    # -- command lines ----------------------------------------------------------------------

    def nats_argv(self) -> list[str]:
        port = self.nats_url.rsplit(":", 1)[1]
        argv = [*command_prefix(self.py, "nats")] + [
            "--host",
            self.cfg.host,
            "--port",
            port,
            "--store-dir",
            str(self.paths.nats),
            "--runs",
            self.cfg.name,
        ]
        if self.cfg.nats_insecure:
            return [*argv, "--insecure"]
        argv += ["--auth-dir", str(self.paths.nats_auth), "--actors", str(self.cfg.actors)]
        return argv if self.cfg.nats_tls else [*argv, "--no-tls"]

    def engine_argv(self, name: str, restart: bool = False) -> list[str]:
        url = self.engines[name]
        port = url.rsplit(":", 1)[1]
        if self.cfg.engine_kind == "teacher":
            argv = [*command_prefix(self.py, "engine"), "--kind", "teacher"]
            for s in self.cfg.teacher_suites:
                argv += ["--suites", s]
            argv += ["--model", str(self.sections["actor"].get("model", "tiny"))]
            argv += self.engine_key_flags("--api-key-file")
            return [*argv, "--host", self.cfg.host, "--port", port]
        argv = [*command_prefix(self.py, "engine"), "--config", str(self.paths.engine_config)]
        argv += self.engine_key_flags("--api-key-file")
        argv += ["--host", self.cfg.host, "--port", port]
        if restart or self.cfg.resume:
            argv += self._restart_weights(name)
        return argv

    def _restart_weights(self, name: str) -> list[str]:
        """Flags that make a (re)started engine serve the newest version its updater received,
        never one newer than the learner's checkpoint (steps after it are rolled back)."""
        found = latest_weights(
            self.paths.weights / name, checkpoint_version(self.paths.checkpoints)
        )
        if found is None:
            return []
        folder, version = found
        from harnessrl.common.models import resolve_model

        eng = self.sections["engine"]
        tok = eng.get("tokenizer") or str(resolve_model(str(eng.get("model", "tiny"))))
        return ["--model", str(folder), "--tokenizer", tok, "--weight-version", str(version)]

    def weights_sync_argv(self, engine: str) -> list[str]:
        name = f"weights-sync-{engine.split('-', 1)[1]}"
        return [
            *command_prefix(self.py, "weights-sync"),
            *self.service_flags(name),
            "--engine",
            self.engines[engine],
            "--name",
            f"{self.cfg.name}-{engine}",
            "--work-dir",
            str(self.paths.weights / engine),
            *self.engine_key_flags(),
        ]

    def assembler_argv(self) -> list[str]:
        return [*command_prefix(self.py, "assembler"), *self.service_flags("assembler")]

    def learner_argv(self) -> list[str]:
        done = checkpoint_version(self.paths.checkpoints)
        remaining = max(1, self.cfg.steps - (done or 0))
        argv = [*command_prefix(self.py, "learner"), *self.service_flags("learner")]
        if self.cfg.learner_ranks > 1:  # torchrun ... -m -- harnessrl.common.cli learner ...
            argv = [*ranks_prefix(self.py, self.cfg.learner_ranks), "--max-restarts", "0"]
            # ``--``: torchrun's own parser would take ``--run`` for a prefix of ``--run-path``
            argv += ["-m", "--", "harnessrl.common.cli", "learner", *self.service_flags("learner")]
        argv += ["--run-dir", str(self.paths.learner)]
        argv += ["--checkpoint-dir", str(self.paths.checkpoints), "--max-steps", str(remaining)]
        argv += self.engine_key_flags("--broadcast.engine-api-key-file")
        if done is not None:
            argv.append("--resume")
        return argv

    def actor_argv(self, i: int) -> list[str]:
        name = f"actor-{i}"
        argv = [*command_prefix(self.py, "actor"), *self.service_flags(name)]
        for url in self.engines.values():
            argv += ["--engine", url]
        return [*argv, *self.engine_key_flags(), "--name", f"{self.cfg.name}-a{i}"]

    # -- children ---------------------------------------------------------------------------

    def specs(self) -> dict[str, list[Any]]:
        """Child specs by start phase: ``nats``, ``core`` (engines, updaters, assembler,
        learner), ``actors``."""
        from harnessrl.common.run.supervisor import ChildSpec

        c, pol = self.cfg, self.cfg.on_exit
        env = {"PYTHONUNBUFFERED": "1"}
        common = dict(ready_timeout_s=c.startup_timeout_s, stop_timeout_s=c.stop_timeout_s, env=env)
        phases: dict[str, list[Any]] = {"nats": [], "core": [], "actors": []}
        if self.embedded_nats:
            phases["nats"].append(
                ChildSpec("nats", self.nats_argv(), "nats", pol.nats, ready=READY["nats"], **common)
            )
        if self.embedded_engines:
            ready = READY["engine"]
            for name in self.engines:
                argv = _restarting(lambda n=name, r=False: self.engine_argv(n, r))
                phases["core"].append(
                    ChildSpec(name, argv, "engine", pol.engine, ready=ready, **common)
                )
        if self.with_weights_sync:
            for name in self.engines:
                phases["core"].append(
                    ChildSpec(
                        f"weights-sync-{name.split('-', 1)[1]}",
                        self.weights_sync_argv(name),
                        "weights_sync",
                        pol.weights_sync,
                        ready=READY["weights_sync"],
                        **common,
                    )
                )
        phases["core"].append(
            ChildSpec(
                "assembler",
                self.assembler_argv(),
                "assembler",
                pol.assembler,
                ready=READY["assembler"],
                **common,
            )
        )
        # torchrun forwards SIGTERM to the ranks and waits this long before SIGKILL
        grace = str(max(1, int(c.stop_timeout_s) - 5))
        phases["core"].append(
            ChildSpec(
                "learner",
                self.learner_argv,
                "learner",
                pol.learner,
                done_on_success=True,
                ready=READY["learner"],
                **{**common, "env": {**env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": grace}},
            )
        )
        for i in range(c.actors):
            phases["actors"].append(
                ChildSpec(
                    f"actor-{i}",
                    self.actor_argv(i),
                    "actor",
                    pol.actor,
                    ready=READY["actor"],
                    **common,
                )
            )
        return phases

    def metrics_targets(self) -> list[tuple[str, str, str]]:
        """(name, role, /metrics URL) of every process the supervisor scrapes."""
        out = [
            (n, _role(n), f"http://127.0.0.1:{p}/metrics") for n, p in self.metrics_ports.items()
        ]
        if self.embedded_engines and self.cfg.engine_kind == "embedded":
            out += [(n, "engine", u + "/metrics") for n, u in self.engines.items()]
        return out

    def scrape_targets(self) -> dict[str, list[dict[str, Any]]]:
        """Prometheus file_sd target groups of `metrics_targets`, by job (`SCRAPE_JOBS`); each
        target is labelled with the run and the process name."""
        out: dict[str, list[dict[str, Any]]] = {}
        for name, role, url in self.metrics_targets():
            labels = {"run": self.cfg.name, "process": name}
            out.setdefault(SCRAPE_JOBS[role], []).append(
                {"targets": [urlsplit(url).netloc], "labels": labels}
            )
        return out


def _role(name: str) -> str:
    if name.startswith("weights-sync"):
        return "weights_sync"
    return name.split("-", 1)[0]


class _restarting:
    """An argv callable that knows whether this is a restart (engines reload saved weights)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self) -> list[str]:
        self.calls += 1
        return self.fn(r=self.calls > 1)


def first_command(spec: Any) -> list[str]:
    """A child's command line at its first start (without counting as a start)."""
    return spec.argv.fn(r=False) if isinstance(spec.argv, _restarting) else spec.command()


def prepare_run_dir(cfg: RunConfig, sections: dict[str, dict[str, Any]]) -> Paths:
    paths = Paths(cfg.run_dir())
    if paths.config.exists() and not cfg.resume:
        raise ConfigError(
            f"{paths.run_dir} already holds a run: pass --resume to continue it, or choose "
            "another --out"
        )
    if cfg.resume and checkpoint_version(paths.checkpoints) is None and paths.config.exists():
        print(f"harnessrl run: no checkpoint in {paths.checkpoints}; starting from the beginning")
    for d in (paths.run_dir, paths.logs, paths.resolved, paths.learner, paths.weights):
        d.mkdir(parents=True, exist_ok=True)
    paths.auth.mkdir(mode=0o700, exist_ok=True)
    if not cfg.engines and not cfg.engine_api_key_file and not paths.engine_key.exists():
        write_secret(paths.engine_key, secrets.token_urlsafe(32))
    run_table = json.loads(cfg.model_dump_json())
    atomic_write(paths.config, toml_text({"run": run_table, **sections}))
    atomic_write(paths.engine_config, toml_text(sections["engine"]))
    return paths
