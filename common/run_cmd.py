"""``harnessrl run CONFIG.toml``: start and watch every process of a training run.

    harnessrl run CONFIG.toml [--nats URL] [--engine URL ...] [--out DIR] [--steps N] [--resume]
                              [--actors N] [--no-dashboard] [--print-config]

The supervisor starts, as separate processes, exactly the commands a user would start by hand
on separate machines (they are written to ``<out>/commands.sh``): an embedded nats-server
(unless ``--nats``), embedded engines (unless ``--engine``) each with a ``weights-sync``
updater, the assembler, the learner (with its feeder) and the actors. Each reads its own table
of the run file (``[engine]``, ``[actor]``, ``[assembler]``, ``[learner]``, ``[weights_sync]``;
``[run]`` is `common.run_config.RunConfig`); the supervisor adds only what it decides itself as
flags (URLs, ports, names, folders, ``--max-steps``). It tracks them by PID, restarts or stops
on a death (per-role policy), ends the run when the learner reaches ``steps`` (after draining
the rollouts in flight), and stops everything on Ctrl-C/SIGTERM; a killed supervisor takes its
children with it (PDEATHSIG).

Run folder::

    config.toml        the run file as resolved ([run] with every field; fed back by --resume)
    engine.toml        the [engine] table alone (``harnessrl engine --config``)
    resolved/ROLE.toml each process's resolved config (its ``--print-config``)
    commands.sh        the command line of every process
    logs/NAME.log      each process's output (appended across restarts)
    supervisor.log     starts, deaths, restarts, the end
    metrics.jsonl      the learner's lines (copied verbatim) + ``rollup`` and ``summary`` lines
    plot.png           reward by version and throughput, redrawn as the run goes
    learner/           the learner's run dir (its own metrics.jsonl, disk-transport weights)
    checkpoints/       learner checkpoints (``--resume`` continues from them)
    weights/ENGINE/    versions received by each engine's updater (restarted engines load them)
    nats/              the embedded nats-server's JetStream store

Exit status: 0 when the learner reached ``steps``, 1 when a process's death stopped the run (the
message names it and shows its last lines), 2 for a bad config, 130/143 after SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import (
    ConfigError,
    add_config_args,
    load_config,
    overrides_from_args,
)
from common.run_config import RunConfig

CONFIG = None  # parsed here: the positional run file + [run] table + flags
SECTION = "run"

SECTIONS = ("engine", "actor", "assembler", "learner", "weights_sync")
"""Tables of a run file read by the child processes themselves."""

READY = {
    "nats": r"nats-server ready: ",
    "engine": r"^engine ready: ",
    "teacher": r"^teacher engine ready: ",
    "weights_sync": r"weights-sync: .* at version",
    "assembler": r"assembler: metrics on",
    "learner": r"learner (started|resumed) at version",
    "actor": r"^actor ready: ",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_file",
        nargs="?",
        metavar="CONFIG.toml",
        help="run file: [run] plus one table per process; with --resume, defaults to "
        "<out>/config.toml",
    )
    parser.add_argument(
        "--engine",
        dest="cfg__engines",
        action="append",
        metavar="URL",
        help="existing engine URL (SGLang native API); repeat for several (same as --engines)",
    )
    add_config_args(parser, RunConfig)


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
    return cfg, {s: raw.get(s, {}) for s in SECTIONS}


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """TOML for ``{table: {key: value}}`` (nested dicts become sub-tables)."""
    out: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + " }"
        return json.dumps(str(v))

    def key(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)

    def table(name: str, d: dict[str, Any]) -> None:
        out.append(f"[{name}]")
        subs = []
        for k, v in d.items():
            if v is None:
                continue
            if isinstance(v, dict):
                subs.append((k, v))
            else:
                out.append(f"{key(k)} = {value(v)}")
        out.append("")
        for k, v in subs:
            table(f"{name}.{key(k)}", v)

    for name, d in tables.items():
        table(name, d)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# the plan: which processes, with which command lines
# ---------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def command_prefix(py: str, cmd: str) -> list[str]:
    """``python -m common.cli CMD``: a child's command line as a user would start it."""
    return [py, "-m", "common.cli", cmd]


def display_command(argv: list[str]) -> str:
    """A command line as a user would type it (``harnessrl CMD ...``)."""
    if len(argv) >= 3 and argv[1:3] == ["-m", "common.cli"]:
        return shlex.join(["harnessrl", *argv[3:]])
    if len(argv) >= 3 and argv[1] == "-m":
        return shlex.join(["python", *argv[1:]])
    return shlex.join(argv)


def checkpoint_version(ckpt_dir: Path) -> int | None:
    """The version of the learner's latest checkpoint (None without one); reads JSON only."""
    latest = ckpt_dir / "latest"
    if not latest.exists():
        return None
    tag = latest.read_text().strip()
    version = 0
    with contextlib.suppress(OSError, ValueError, KeyError):
        meta = json.loads((ckpt_dir / tag / "client_state.json").read_text())
        version = int(meta["client_state"].get("version", 0))
    with contextlib.suppress(OSError, ValueError):
        st = json.loads((ckpt_dir / "learner-state.json").read_text())
        if st.get("ds_tag") == tag:
            version = max(version, int(st.get("version", 0)))
    return version


def latest_weights(work_dir: Path, max_version: int | None) -> tuple[Path, int] | None:
    """The newest complete version folder an updater wrote (``v000000012``) not above
    ``max_version``."""
    best = None
    for p in work_dir.glob("v*"):
        m = re.fullmatch(r"v(\d+)", p.name)
        if not m or not (p / "model.safetensors").exists() or not (p / "config.json").exists():
            continue
        v = int(m.group(1))
        if (max_version is None or v <= max_version) and (best is None or v > best[1]):
            best = (p, v)
    return best


class Paths:
    """Where everything of a run lives (see the module docstring)."""

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
        self.nats_url = c.nats or f"nats://{c.host}:{free_port(c.host)}"
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
            "--run",
            self.cfg.name,
            "--metrics-port",
            str(self.port(name)),
        ]

    # -- command lines ----------------------------------------------------------------------

    def nats_argv(self) -> list[str]:
        port = self.nats_url.rsplit(":", 1)[1]
        return [*command_prefix(self.py, "nats")] + [
            "--host",
            self.cfg.host,
            "--port",
            port,
            "--store-dir",
            str(self.paths.nats),
        ]

    def engine_argv(self, name: str, restart: bool = False) -> list[str]:
        url = self.engines[name]
        port = url.rsplit(":", 1)[1]
        if self.cfg.engine_kind == "teacher":
            argv = [self.py, "-m", "proxy.teacher_engine", "--host", self.cfg.host, "--port", port]
            for s in self.cfg.teacher_suites:
                argv += ["--suite", s]
            return [*argv, "--tokenizer", str(self.sections["actor"].get("model", "tiny"))]
        argv = [*command_prefix(self.py, "engine"), "--config", str(self.paths.engine_config)]
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
        from common.models import resolve_model

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
        ]

    def assembler_argv(self) -> list[str]:
        return [*command_prefix(self.py, "assembler"), *self.service_flags("assembler")]

    def learner_argv(self) -> list[str]:
        done = checkpoint_version(self.paths.checkpoints)
        remaining = max(1, self.cfg.steps - (done or 0))
        argv = [*command_prefix(self.py, "learner"), *self.service_flags("learner")]
        argv += ["--run-dir", str(self.paths.learner)]
        argv += ["--checkpoint-dir", str(self.paths.checkpoints), "--max-steps", str(remaining)]
        if done is not None:
            argv.append("--resume")
        return argv

    def actor_argv(self, i: int) -> list[str]:
        name = f"actor-{i}"
        argv = [*command_prefix(self.py, "actor"), *self.service_flags(name)]
        for url in self.engines.values():
            argv += ["--engine", url]
        return [*argv, "--name", f"{self.cfg.name}-a{i}"]

    # -- children ---------------------------------------------------------------------------

    def specs(self) -> dict[str, list[Any]]:
        """Child specs by start phase: ``nats``, ``core`` (engines, updaters, assembler,
        learner), ``actors``."""
        from common.supervisor import ChildSpec

        c, pol = self.cfg, self.cfg.on_exit
        env = {"PYTHONUNBUFFERED": "1"}
        common = dict(ready_timeout_s=c.startup_timeout_s, stop_timeout_s=c.stop_timeout_s, env=env)
        phases: dict[str, list[Any]] = {"nats": [], "core": [], "actors": []}
        if self.embedded_nats:
            phases["nats"].append(
                ChildSpec("nats", self.nats_argv(), "nats", pol.nats, ready=READY["nats"], **common)
            )
        if self.embedded_engines:
            ready = READY["teacher" if c.engine_kind == "teacher" else "engine"]
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
        phases["core"].append(
            ChildSpec(
                "learner",
                self.learner_argv,
                "learner",
                pol.learner,
                done_on_success=True,
                ready=READY["learner"],
                **common,
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


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


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
    run_table = json.loads(cfg.model_dump_json())
    _write_atomic(paths.config, toml_text({"run": run_table, **sections}))
    _write_atomic(paths.engine_config, toml_text({"engine": sections["engine"]}).split("\n", 1)[1])
    return paths


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Run:
    """One ``harnessrl run``: plan, start, watch, drain, stop, summarise."""

    def __init__(self, cfg: RunConfig, plan: Plan, out: Any = None) -> None:
        from common.dashboard import Monitor
        from common.supervisor import Supervisor

        self.cfg = cfg
        self.plan = plan
        self.paths = plan.paths
        self.out = out or sys.stdout
        self.stop_signal: int | None = None
        self._stop = asyncio.Event()
        self.view: Any = None
        self.events: list[str] = []
        self.sup = Supervisor(
            self.paths.logs,
            max_restarts=cfg.max_restarts,
            restart_window_s=cfg.restart_window_s,
            restart_backoff_s=cfg.restart_backoff_s,
            on_event=self._event,
        )
        self.monitor = Monitor(
            cfg.name,
            self.paths.run_dir,
            steps=cfg.steps,
            learner_metrics=self.paths.learner / "metrics.jsonl",
            engines=plan.engines,
        )
        self._plotting = False
        self.time_limited = False
        self._early: Any = None
        self.phases = plan.specs()

    def _event(self, msg: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.events = [*self.events[-199:], f"{stamp} {msg}"]
        with open(self.paths.supervisor_log, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d')} {stamp} {msg}\n")
        if self.view is not None:
            self.view.event(msg)

    def _on_signal(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self._event(
                f"received {signal.Signals(signum).name}: stopping the run (signal again to kill at once)"
            )
        elif self._stop.is_set():
            self._event(f"received {signal.Signals(signum).name} again: killing every process")
            self.sup.kill_all()
        self._stop.set()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> int:
        from common.dashboard import make_view
        from common.supervisor import ChildFailed, Outcome

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.write_commands()
        outcome: Outcome | None = None
        t0 = time.monotonic()
        try:
            bad = await self.validate()
            if bad:
                print(f"harnessrl run: {bad}", file=sys.stderr)
                return 2
            self.monitor.resume_copy()
            self._event(f"run {self.cfg.name} in {self.paths.run_dir}")
            with make_view(self.cfg.dashboard, self.cfg.status_interval_s) as view:
                self.view = view
                try:
                    started = await self.start_all()
                    if started:
                        outcome = await self.watch()
                        if outcome.kind == "done" and self.sup.children["learner"].alive:
                            await asyncio.to_thread(self.sup.stop, ["learner"])  # time limit
                        if outcome.kind == "done" and self.cfg.drain_timeout_s > 0:
                            await self.drain()
                except ChildFailed as e:
                    outcome = Outcome("fatal", str(e))
                await self._final_tick()
                self.view = None
        finally:
            await asyncio.to_thread(self.stop_all)
            await self.monitor.close()
        leftovers = self.sup.leftovers()
        summary = self.summary(outcome, time.monotonic() - t0, leftovers)
        self.monitor.write_line(summary)
        plot = await asyncio.to_thread(self.plot)
        self.print_summary(summary, plot)
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0 if outcome is not None and outcome.kind == "done" else 1

    def write_commands(self) -> None:
        lines = [
            "#!/bin/sh",
            f"# The processes `harnessrl run` starts for run {self.cfg.name!r}, in start order.",
            "# Each can run on its own machine, pointed at the same NATS URL and run name.",
        ]
        for phase in self.phases.values():
            for spec in phase:
                lines += [f"# {spec.name}", display_command(first_command(spec))]
        self.paths.commands.write_text("\n".join(lines) + "\n")

    async def validate(self) -> str | None:
        """Resolve every process's config (its ``--print-config``) before starting anything:
        a typo in any table fails here, naming the field."""
        one: dict[str, Any] = {}
        for phase in self.phases.values():
            for spec in phase:
                if spec.role not in one and spec.role != "nats":
                    if spec.role == "engine" and self.cfg.engine_kind == "teacher":
                        continue
                    one[spec.role] = spec

        async def check(role: str, spec: Any) -> str | None:
            argv = first_command(spec)
            proc = await asyncio.create_subprocess_exec(
                *argv,
                "--print-config",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
            if proc.returncode != 0:
                return f"[{role}] {err.decode(errors='replace').strip() or out.decode()[-500:]}"
            (self.paths.resolved / f"{role}.toml").write_bytes(out)
            return None

        errors = await asyncio.gather(*(check(r, s) for r, s in one.items()))
        bad = [e for e in errors if e]
        return "invalid config:\n" + "\n".join(bad) if bad else None

    async def start_all(self) -> bool:
        """Start the phases in order, each waiting for what the next needs; False when a
        signal interrupted the start."""
        for phase, specs in self.phases.items():
            if self._stop.is_set():
                return False
            for spec in specs:
                self.sup.start(spec)
            if phase == "core":  # actors need the engines; the rest may still be starting
                need = [s.name for s in specs if s.role == "engine"]
            else:
                need = [s.name for s in specs]
            if not await self.wait_ready(need):
                return False
        everyone = [s.name for specs in self.phases.values() for s in specs]
        if not await self.wait_ready(everyone):
            return False
        for name, role, url in self.plan.metrics_targets():
            self.monitor.add_target(name, role, url)
        await self.monitor.connect(self.plan.nats_url)
        self._event("every process is ready")
        return True

    async def wait_ready(self, names: list[str]) -> bool:
        from common.supervisor import ChildFailed

        deadline = time.monotonic() + self.cfg.startup_timeout_s
        kids = [self.sup.children[n] for n in names]
        while not self._stop.is_set():
            pending = [k for k in kids if not self.sup.check_ready(k)]
            if not pending:
                return True
            outcome = self.sup.poll()  # applies the policy of a child that died (restarts)
            if outcome is not None and outcome.kind == "done":
                self._early = outcome  # the learner finished before the rest was ready
            elif outcome is not None:
                raise ChildFailed(outcome.message)
            for k in pending:
                if k.stopped and not self.sup.check_ready(k):
                    rc = k.proc.returncode if k.proc is not None else None
                    raise ChildFailed(self.sup.death_message(k, rc, "before it was ready"))
            if time.monotonic() > deadline:
                raise ChildFailed(
                    f"not ready after {self.cfg.startup_timeout_s:.0f}s: "
                    + ", ".join(f"{k.name} (see {k.log_path})" for k in pending)
                )
            self._refresh_view()
            await asyncio.sleep(0.2)
        return False

    async def watch(self) -> Any:
        """Poll children, refresh metrics and views until the learner is done, a child's death
        is fatal, or a signal arrives."""
        from common.supervisor import Outcome

        last = {"scrape": 0.0, "rollup": time.monotonic(), "plot": time.monotonic()}
        t_ready = time.monotonic()
        if self._early is not None:
            return self._early
        while not self._stop.is_set():
            limit = self.cfg.time_limit_s
            if limit and time.monotonic() - t_ready > limit:
                self.time_limited = True
                self._event(f"time limit of {limit:.0f}s reached: ending the run")
                return Outcome("done", f"time limit of {limit:.0f}s reached")
            outcome = self.sup.poll()
            if outcome is not None:
                if outcome.kind == "fatal":
                    self._event(outcome.message.split("\n", 1)[0])
                return outcome
            await self._periodic(last)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.25)
        return Outcome("signal", f"stopped by {signal.Signals(self.stop_signal or 2).name}")

    async def _periodic(self, last: dict[str, float]) -> None:
        now = time.monotonic()
        if now - last["scrape"] >= self.cfg.scrape_interval_s:
            last["scrape"] = now
            await self.monitor.tick()
            self._refresh_view()
        if now - last["rollup"] >= self.cfg.rollup_interval_s:
            last["rollup"] = now
            self.monitor.write_line(self.monitor.rollup(self.status()))
        if self.cfg.plot_interval_s and now - last["plot"] >= self.cfg.plot_interval_s:
            last["plot"] = now
            if not self._plotting:
                asyncio.get_running_loop().run_in_executor(None, self.plot)

    async def drain(self) -> None:
        """After the last step: let actors and assembler finish every issued rollout, and the
        updaters bring every engine to the final version."""
        self._event(
            f"learner done; draining rollouts in flight (at most {self.cfg.drain_timeout_s:.0f}s)"
        )
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        quiet = 0
        last = {"scrape": 0.0, "rollup": time.monotonic(), "plot": time.monotonic()}
        while time.monotonic() < deadline and not self._stop.is_set():
            self.sup.poll()
            await self.monitor.tick()
            st = self.status()
            idle = st.queues.get("tasks", 1) == 0 and st.in_flight == 0
            idle = idle and self.monitor.assembler_pending == 0
            final = self.plan.last_broadcast(st.version)
            if final is not None:  # and the engines serve the final weights
                idle = idle and all(v == str(final) for v in st.engine_versions.values())
            quiet = quiet + 1 if idle else 0
            if quiet >= 2:  # two scrapes in a row: nothing in flight anywhere
                self._event("drained: every issued rollout ended")
                return
            self._refresh_view()
            await self._periodic(last)
            await asyncio.sleep(1.0)
        self._event("drain timed out with rollouts still in flight")

    async def _final_tick(self) -> None:
        if self.monitor.bus is not None:
            with contextlib.suppress(Exception):
                await self.monitor.tick()
            self.monitor.write_line(self.monitor.rollup(self.status()))

    def stop_all(self) -> None:
        names = {
            r: [n for n, c in self.sup.children.items() if c.spec.role == r]
            for r in ("actor", "learner", "assembler", "weights_sync", "engine", "nats")
        }
        tiers = [
            names["actor"],
            names["learner"],
            names["assembler"] + names["weights_sync"],
            names["engine"],
            names["nats"],
        ]
        self.sup.stop_all(tiers)

    # -- views and records ------------------------------------------------------------------

    def status(self) -> Any:
        from common.dashboard import ChildView

        kids = [
            ChildView(
                c.name, c.spec.role, c.pid if c.alive else None, c.state, max(0, c.starts - 1)
            )
            for c in self.sup.children.values()
        ]
        return self.monitor.status(kids, self.events[-5:])

    def _refresh_view(self) -> None:
        if self.view is not None:
            self.view.update(self.status())

    def plot(self) -> Path | None:
        from common.plot import plot_run

        self._plotting = True
        try:
            return plot_run(self.paths.run_dir, title=f"harnessrl run {self.cfg.name}")
        except Exception as e:  # a plot must never take a run down
            self._event(f"plot failed: {e!r}")
            return None
        finally:
            self._plotting = False

    def summary(self, outcome: Any, elapsed: float, leftovers: list[int]) -> dict[str, Any]:
        st = self.status()
        assembled = int(sum(st.outcomes.values()))
        steps = sorted(st.reward_train.items())
        return {
            "event": "summary",
            "outcome": outcome.kind if outcome else "error",
            "time_limited": self.time_limited,
            "message": (outcome.message if outcome else "").split("\n", 1)[0],
            "elapsed_s": round(elapsed, 1),
            "version": st.version,
            "steps": self.cfg.steps,
            "engine_versions": st.engine_versions,
            "samples_trained": st.samples_trained,
            "issued": st.issued,
            "results": st.results,
            "members_with_result": len(self.monitor.members),
            "samples": int(st.outcomes.get("sample", 0)),
            "tombstones": {k: int(v) for k, v in st.tombstones.items()},
            "assembled": assembled,
            "unaccounted": st.issued - assembled,
            "failures": st.failures,
            "dropped": st.dropped,
            "reward_first": steps[0][1] if steps else None,
            "reward_last": steps[-1][1] if steps else None,
            "rewards": {
                k: {str(v): m for v, (m, _) in per.items()} for k, per in st.rewards.items()
            },
            "restarts": {c.name: c.restarts for c in st.children if c.restarts},
            "leftover_pids": leftovers,
        }

    def print_summary(self, s: dict[str, Any], plot: Path | None) -> None:
        p = self.out
        status = {"done": "finished", "fatal": "STOPPED", "signal": "interrupted"}.get(
            s["outcome"], "failed"
        )
        print(
            f"\nrun {self.cfg.name} {status}: version {s['version']}/{s['steps']} "
            f"in {s['elapsed_s']:.0f}s",
            file=p,
        )
        if s["outcome"] == "fatal":
            print(f"  reason: {s['message']}", file=p)
        tomb = ", ".join(f"{k} {v}" for k, v in s["tombstones"].items()) or "none"
        print(
            f"  samples trained {s['samples_trained']}; rollouts issued {s['issued']}: "
            f"{s['samples']} samples, tombstones {tomb}",
            file=p,
        )
        if s["reward_first"] is not None:
            print(
                f"  batch reward {s['reward_first']:.3f} (v1) -> {s['reward_last']:.3f} "
                f"(v{s['version']})",
                file=p,
            )
        if s["engine_versions"]:
            ev = ", ".join(f"{k} at v{v}" for k, v in sorted(s["engine_versions"].items()))
            print(f"  engines: {ev}", file=p)
        if s["restarts"]:
            print(f"  restarts: {s['restarts']}", file=p)
        if s["leftover_pids"]:
            print(f"  WARNING: processes left running: {s['leftover_pids']}", file=p)
        print(f"  run dir {self.paths.run_dir} (logs/, metrics.jsonl, commands.sh)", file=p)
        if plot is not None:
            print(f"  plot {plot}", file=p)
        p.flush()


def main(cfg: Any, args: argparse.Namespace) -> int:
    try:
        run_cfg, sections = resolve(args)
    except ConfigError as e:
        print(f"harnessrl run: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(toml_text({"run": json.loads(run_cfg.model_dump_json()), **sections}))
        return 0
    try:
        paths = prepare_run_dir(run_cfg, sections)
    except ConfigError as e:
        print(f"harnessrl run: {e}", file=sys.stderr)
        return 2
    from common import aio

    return int(aio.run(Run(run_cfg, Plan(run_cfg, sections, paths)).run()))


def run_subprocess(argv: list[str], **kw: Any) -> subprocess.Popen:
    """Start ``harnessrl run ARGV`` as a child (tests, demo, benchmarks)."""
    from common.procs import popen_child

    return popen_child([sys.executable, "-m", "common.cli", "run", *argv], **kw)


if __name__ == "__main__":  # ``python -m common.run_cmd`` is ``harnessrl run``
    from common.cli import run_module

    run_module("run")
