"""``harnessrl run CONFIG.toml``: start and watch every process of a training run.

    harnessrl run CONFIG.toml [--nats URL] [--engine URL ...] [--out DIR] [--steps N] [--resume]
                              [--actors N] [--no-dashboard] [--print-config]

The supervisor starts, as separate processes, exactly the commands a user would start by hand
on separate machines (they are written to ``<out>/commands.sh``): an embedded nats-server
(unless ``--nats``), embedded engines (unless ``--engine``) each with a ``weights-sync``
updater, the assembler, the learner (with its feeder) and the actors. Each reads its own table
of the run file (``[engine]``, ``[actor]``, ``[assembler]``, ``[learner]``, ``[weights_sync]``;
``[run]`` is `harnessrl.common.run.config.RunConfig`); the supervisor adds only what it decides itself as
flags (URLs, ports, names, folders, ``--max-steps``; `harnessrl.common.run.plan.Plan` builds the command
lines). It tracks them by PID, restarts or stops on a death (per-role policy), ends the run when
the learner reaches ``steps`` (after draining the rollouts in flight), and stops everything on
Ctrl-C/SIGTERM; a killed supervisor takes its children with it (PDEATHSIG).

Run folder::

    config.toml        the run file as resolved ([run] with every field; fed back by --resume)
    engine.toml        the [engine] table alone (``harnessrl engine --config``)
    resolved/ROLE.toml each process's resolved config (its ``--print-config``)
    commands.sh        the command line of every process
    prometheus/        JOB.RUN.json: every process's /metrics as Prometheus file_sd targets
                       (``deploy/monitoring/prometheus.yml`` reads them from its targets/)
    logs/NAME.log      each process's output (appended across restarts)
    supervisor.log     starts, deaths, restarts, the end
    metrics.jsonl      the learner's lines (copied verbatim) + ``rollup`` and ``summary`` lines
                       (``harnessrl.common.layout``'s typed lines)
    plot.png           reward by version and throughput, redrawn as the run goes
    learner/           the learner's run dir (its own metrics.jsonl, disk-transport weights)
    checkpoints/       learner checkpoints (``--resume`` continues from them)
    weights/ENGINE/    versions received by each engine's updater (restarted engines load them)
    nats/              the embedded nats-server's JetStream store
    auth/              (0700) nats/ROLE.cred and nats/tls/ca.pem of the embedded server, and
                       engine-api-key of the embedded engines (0600 each); every child gets
                       the paths of what its role needs, never a secret on its command line

Exit status: 0 when the learner reached ``steps``, 1 when a process's death stopped the run (the
message names it and shows its last lines), 2 for a bad config, 130/143 after SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from harnessrl.common import tracking
from harnessrl.common.config import ConfigError, add_config_args, toml_text
from harnessrl.common.files import atomic_write_json
from harnessrl.common.layout import SummaryLine
from harnessrl.common.run.config import RunConfig
from harnessrl.common.run.plan import Plan, display_command, first_command, prepare_run_dir, resolve

log = logging.getLogger("harnessrl.run")

CONFIG = None  # parsed here: the positional run file + [run] table + flags
SECTION = "run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_file",
        nargs="?",
        metavar="CONFIG.toml",
        help="run file: [run] plus one table per process; with --resume, defaults to "
        "<out>/config.toml",
    )
    tracking.add_arguments(parser, dest="track__")  # into the learner's [track] table
    add_config_args(parser, RunConfig)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


class Run:
    """One ``harnessrl run``: plan, start, watch, drain, stop, summarise."""

    _ticking: asyncio.Task[None] | None = None
    """The monitor's refresh in progress (run in the background of the supervision)."""

    def __init__(self, cfg: RunConfig, plan: Plan, out: Any = None) -> None:
        from harnessrl.common.run.dashboard import Monitor
        from harnessrl.common.run.supervisor import Supervisor

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
            engine_api_key_file=plan.engine_key_file,
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
        from harnessrl.common.run.dashboard import make_view
        from harnessrl.common.run.supervisor import ChildFailed, Outcome

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.write_commands()
        self.write_scrape_targets()
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
                # the accounting is of the run's end: nothing moves a rollout after it
                await asyncio.to_thread(self.stop_movers)
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

    def write_scrape_targets(self) -> None:
        """``prometheus/JOB.RUN.json`` per Prometheus job (after `write_commands`, which
        assigned every metrics port)."""
        self.paths.prometheus.mkdir(exist_ok=True)
        for job, groups in self.plan.scrape_targets().items():
            atomic_write_json(self.paths.prometheus / f"{job}.{self.cfg.name}.json", groups)

    async def validate(self) -> str | None:
        """Resolve every process's config (its ``--print-config``) before starting anything:
        a typo in any table fails here, naming the field."""
        one: dict[str, Any] = {}
        for phase in self.phases.values():
            for spec in phase:
                if spec.role not in one and spec.role != "nats":
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
            if phase == "nats":
                await self.ensure_streams()
        everyone = [s.name for specs in self.phases.values() for s in specs]
        if not await self.wait_ready(everyone):
            return False
        for name, role, url in self.plan.metrics_targets():
            self.monitor.add_target(name, role, url)
        await self.monitor.connect(
            self.plan.nats_url, creds=self.plan.nats_creds("admin"), ca=self.plan.nats_ca
        )
        self._event("every process is ready")
        return True

    async def ensure_streams(self) -> None:
        """Create the run's streams as the admin before any other process starts (no other
        role may create them; the embedded server already did, with ``--runs``)."""
        from harnessrl.common.bus import BusError, connect
        from harnessrl.common.run.supervisor import ChildFailed

        try:
            bus = await connect(
                self.plan.nats_url,
                self.cfg.name,
                name="harnessrl run (supervisor)",
                creds=self.plan.nats_creds("admin"),
                ca=self.plan.nats_ca,
                replicas=self.cfg.nats_stream_replicas,
            )
        except BusError as e:
            raise ChildFailed(str(e)) from None
        await bus.close()

    async def wait_ready(self, names: list[str]) -> bool:
        from harnessrl.common.run.supervisor import ChildFailed

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
        from harnessrl.common.run.supervisor import Outcome

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
            # in the background: supervising (restarting a dead nats-server above all) never
            # waits for a refresh that waits for that server
            if self._ticking is None or self._ticking.done():
                self._ticking = asyncio.create_task(self._tick())
        if now - last["rollup"] >= self.cfg.rollup_interval_s:
            last["rollup"] = now
            self.monitor.write_line(self.monitor.rollup(self.status()))
        if self.cfg.plot_interval_s and now - last["plot"] >= self.cfg.plot_interval_s:
            last["plot"] = now
            if not self._plotting:
                asyncio.get_running_loop().run_in_executor(None, self.plot)

    async def _tick(self) -> None:
        try:
            await self.monitor.tick()
        except Exception as e:  # the view is a report: it never takes the run down
            log.debug("monitor refresh failed: %r", e)
        self._refresh_view()

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
            idle = self.monitor.drained(st)
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
        unread = ", ".join(sorted(self.status().unread))
        self._event(
            "drain timed out with rollouts still in flight"
            + (f" (could not read: {unread})" if unread else "")
        )

    async def _final_tick(self) -> None:
        if self._ticking is not None:
            self._ticking.cancel()
            with contextlib.suppress(BaseException):
                await self._ticking
        if self.monitor.bus is not None:
            with contextlib.suppress(Exception):
                await self.monitor.tick()
            self.monitor.write_line(self.monitor.rollup(self.status()))
            committed = self.committed()
            ledger = committed.ledger if committed is not None else None
            try:  # while the bus is still up: the summary's accounting
                await self.monitor.audit(ledger=ledger)
            except Exception as e:
                self._event(f"accounting from the streams failed: {e!r}")

    def tiers(self) -> list[list[str]]:
        """Children by stop order: consumers before what they need (the bus last)."""
        names = {
            r: [n for n, c in self.sup.children.items() if c.spec.role == r]
            for r in ("actor", "learner", "assembler", "weights_sync", "engine", "nats")
        }
        return [
            names["actor"],
            names["learner"],
            names["assembler"] + names["weights_sync"],
            names["engine"],
            names["nats"],
        ]

    def stop_movers(self) -> None:
        """Stop what issues, runs, assembles or trains rollouts (actors, learner, assembler,
        updaters; the learner commits), keeping the bus and the engines up for the summary: its
        counts are then the run's final state, also when a death or a signal ended it."""
        for tier in self.tiers()[:3]:
            if tier:
                self.sup.stop(tier)

    def stop_all(self) -> None:
        self.sup.stop_all(self.tiers())

    # -- views and records ------------------------------------------------------------------

    def status(self) -> Any:
        from harnessrl.common.run.dashboard import ChildView

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
        from harnessrl.common.run.plot import plot_run

        self._plotting = True
        try:
            return plot_run(self.paths.run_dir, title=f"harnessrl run {self.cfg.name}")
        except Exception as e:  # a plot must never take a run down
            self._event(f"plot failed: {e!r}")
            return None
        finally:
            self._plotting = False

    def summary(self, outcome: Any, elapsed: float, leftovers: list[int]) -> SummaryLine:
        from harnessrl.common.run.audit import Accounting

        st = self.status()
        acc = self.monitor.accounting
        audited = acc is not None
        acc = acc or Accounting(
            issued=st.issued, exact=False, members_with_result=len(self.monitor.members)
        )
        steps = sorted(st.reward_train.items())
        committed = self.committed()
        # what was assembled: durable counts when the ledger was read, else the counters
        outcomes = acc.outcomes if acc.outcomes is not None else st.outcomes
        return SummaryLine(
            outcome=outcome.kind if outcome else "error",
            time_limited=self.time_limited,
            message=(outcome.message if outcome else "").split("\n", 1)[0],
            elapsed_s=round(elapsed, 1),
            version=committed.version if committed else st.version,
            steps=self.cfg.steps,
            engine_versions=st.engine_versions,
            samples_trained=(
                int(committed.ledger.get("n_trained", 0)) if committed else st.samples_trained
            ),
            issued=acc.issued,
            results=st.results,
            members_with_result=acc.members_with_result,
            samples=int(outcomes.get("sample", 0)),
            tombstones={k: int(v) for k, v in outcomes.items() if k != "sample"},
            assembled=acc.assembled,
            unaccounted=acc.unaccounted if audited else 0,
            pending=acc.pending,
            dead_lettered_tasks=acc.dead_lettered,
            accounting="exact" if acc.exact else ("incomplete" if audited else "unavailable"),
            failures=st.failures,
            dropped=st.dropped,
            reward_first=steps[0][1] if steps else None,
            reward_last=steps[-1][1] if steps else None,
            rewards={k: {str(v): m for v, (m, _) in per.items()} for k, per in st.rewards.items()},
            restarts={c.name: c.restarts for c in st.children if c.restarts},
            leftover_pids=leftovers,
        )

    def committed(self) -> Any:
        """The learner's committed state (``harnessrl.common.layout.LearnerState``; version 0 before its
        first commit): the version a restart resumes from and the engines serve, whatever
        steps were logged after it and rolled back by a crash. None when the learner never
        commits (``checkpoint_every = 0``) or the checkpoint cannot be read."""
        from harnessrl.common.layout import LearnerState, read_learner_state

        if self.plan.sections.get("learner", {}).get("checkpoint_every", 1) == 0:
            return None
        try:
            return read_learner_state(self.paths.checkpoints) or LearnerState()
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._event(f"reading the learner's checkpoint failed: {e!r}")
            return None

    def print_summary(self, s: SummaryLine, plot: Path | None) -> None:
        p = self.out
        status = {"done": "finished", "fatal": "STOPPED", "signal": "interrupted"}.get(
            s.outcome, "failed"
        )
        print(
            f"\nrun {self.cfg.name} {status}: version {s.version}/{s.steps} in {s.elapsed_s:.0f}s",
            file=p,
        )
        if s.outcome == "fatal":
            print(f"  reason: {s.message}", file=p)
        tomb = ", ".join(f"{k} {v}" for k, v in s.tombstones.items()) or "none"
        print(
            f"  samples trained {s.samples_trained}; rollouts issued {s.issued}: "
            f"{s.samples} samples, tombstones {tomb}",
            file=p,
        )
        if s.reward_first is not None and s.reward_last is not None:
            print(
                f"  batch reward {s.reward_first:.3f} (v1) -> {s.reward_last:.3f} (v{s.version})",
                file=p,
            )
        if s.engine_versions:
            ev = ", ".join(f"{k} at v{v}" for k, v in sorted(s.engine_versions.items()))
            print(f"  engines: {ev}", file=p)
        if s.restarts:
            print(f"  restarts: {s.restarts}", file=p)
        if s.accounting == "unavailable":  # nothing was counted: no count to print
            print(
                "  WARNING: rollout accounting unavailable (the streams could not be read at "
                "the end): lost rollouts, if any, were not counted",
                file=p,
            )
        elif s.unaccounted or s.accounting != "exact":
            print(
                f"  WARNING: {s.unaccounted} issued rollouts unaccounted for ({s.pending} "
                f"pending, {s.dead_lettered_tasks} tasks dead-lettered; accounting "
                f"{s.accounting})",
                file=p,
            )
        if s.leftover_pids:
            print(f"  WARNING: processes left running: {s.leftover_pids}", file=p)
        print(f"  run dir {self.paths.run_dir} (logs/, metrics.jsonl, commands.sh)", file=p)
        if plot is not None:
            print(f"  plot {plot}", file=p)
        p.flush()


def main(cfg: None, args: argparse.Namespace) -> int:
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
    from harnessrl.common import aio

    return int(aio.run(Run(run_cfg, Plan(run_cfg, sections, paths)).run()))


if __name__ == "__main__":  # ``python -m harnessrl.common.run.run`` is ``harnessrl run``
    from harnessrl.common.cli import run_module

    run_module("run")
