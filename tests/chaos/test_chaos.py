"""The chaos suite: components SIGKILLed inside full ``harnessrl run``s, each run then audited
from its streams and the learner's ledger.

A case is the end-to-end run of ``tests/test_run_e2e.py`` (embedded nats-server, the tiny-model
engine with its weights-sync updater, an actor running the reference harness in bubblewrap, the
assembler, the DeepSpeed PPO learner) in which, as the learner reaches given versions, a
component's whole process group is SIGKILLed (a machine dying: the harness, its sandboxes and
proxies with it). The supervisor's restart policy brings it back; a learner whose policy is
``stop`` ends the run, which is then continued with ``--resume``. Once a run has ended, its
JetStream store is served again and audited (`audit`), independently of the run's own
accounting:

* every issued rollout (TaskRequest; member ``(group_id, k)``) is in exactly one place: trained
  or dropped with a reason (the committed ledger), dead-lettered with a reason, or pending (its
  task, an unassembled result or a sample still stored): ``issued = trained + dropped +
  dead-lettered + pending``, none lost;
* no member trained twice (two attempts, or one id twice), and the step lines of the final
  lineage name exactly the ledger's trained rollouts at their versions;
* the engine ends on the committed version;
* nothing the run started is left (every child's process group is empty, no sandbox);
* the run summary's counts equal the audit's.

``pytest -s`` shows each case's ledger summary and time. The CI core is
``test_components_killed_in_turn_then_resumed``: every component once in one run, the learner's
death stopping it, then ``--resume`` with the learner killed and restarted. The matrix of one
component per run is marked ``chaos_matrix`` and deselected by default (``pytest -m
chaos_matrix tests/chaos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harnessrl.common.bus import connect
from harnessrl.common.layout import (
    LearnerState,
    StepLine,
    SummaryLine,
    effective_steps,
    read_learner_state,
    read_metrics,
)
from harnessrl.common.natsd import NatsServer
from harnessrl.common.procs import group_members, pid_alive, popen_child
from harnessrl.common.records import DeadLetter, RolloutResult, TreeSample, decode
from harnessrl.common.run.audit import Member, member_of
from tests.helpers.runs import RUN_FILE

# ``-m chaos`` selects the whole suite (the core test and the matrix). The core test runs in
# the default test command (CI); the matrix is deselected there (pyproject addopts). The core
# test's final audit once came out "incomplete" (2 unaccounted) under load: the monitor's
# follower had not read every result within the audit's catch-up; the audit now reads what it
# missed itself (`harnessrl.common.run.audit.audit`).
pytestmark = pytest.mark.chaos

REPO = Path(__file__).resolve().parents[2]
RUN_WALL_S = 1500.0
"""A run (its kills included) that has not ended by then is stopped and fails the case."""


def run_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "harnessrl.common.cli", "run", *args]


# ---------------------------------------------------------------------------------------------
# driving a run
# ---------------------------------------------------------------------------------------------


@dataclass
class Chaos:
    """One ``harnessrl run`` in ``out`` whose children are SIGKILLed at given versions."""

    out: Path
    kills: dict[int, str]
    """Learner version reached -> name of the child (``actor-0``, ``nats``...) to SIGKILL."""
    killed: list[tuple[int, str, int]] = field(default_factory=list)
    """(version, child, pid) of every kill done."""

    def __post_init__(self) -> None:
        logs = (self.out / "supervisor.log", self.out / "logs" / "nats.log")
        self.offsets = [len(p.read_text()) if p.exists() else 0 for p in logs]
        """Where this `Chaos` began reading each log (a resumed run appends to them)."""

    def starts(self) -> list[tuple[float, str, int]]:
        """(Unix time, child, PID) of each start logged in ``supervisor.log`` since this
        `Chaos` began, and of each nats-server its launcher started (``logs/nats.log``)."""
        out = []
        log = self.out / "supervisor.log"
        text = log.read_text()[self.offsets[0] :] if log.exists() else ""
        for stamp, name, pid in re.findall(r"(\S+ \S+) started (\S+) \(pid (\d+)\)", text):
            out.append((unix_time(stamp), name, int(pid)))
        nats_log = self.out / "logs" / "nats.log"
        text = nats_log.read_text()[self.offsets[1] :] if nats_log.exists() else ""
        for block in text.split("=== start ")[1:]:  # one per start of the launcher
            stamp, found = block[:19], re.search(r"\bpid (\d+)\)", block)
            if found:
                out.append((unix_time(stamp), "nats-server", int(found[1])))
        return out

    def child_pids(self) -> dict[str, list[int]]:
        """Every PID each child had since this `Chaos` began, in start order."""
        out: dict[str, list[int]] = {}
        for _, name, pid in self.starts():
            out.setdefault(name, []).append(pid)
        return out

    def version(self) -> int:
        """The highest version the learner has logged a step for."""
        path = self.out / "learner" / "metrics.jsonl"
        steps = [m.version for m in read_metrics(path) if isinstance(m, StepLine)]
        return max(steps, default=0)

    def drive(self, argv: list[str], log: Path) -> int:
        """Run ``argv`` (a ``harnessrl run``) to its end, doing the kills on the way; its exit
        status."""
        with open(log, "ab") as f:
            proc = popen_child(argv, new_session=True, cwd=REPO, stdout=f, stderr=f)
        deadline = time.monotonic() + RUN_WALL_S
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"run not ended after {RUN_WALL_S:.0f}s: {log}")
                due = [v for v in sorted(self.kills) if v <= self.version()]
                for v in due:
                    self.kill(v, self.kills.pop(v))
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(90)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        assert group_members(proc.pid) == [], "harnessrl run left its own group behind"
        return proc.returncode

    def kill(self, version: int, name: str) -> None:
        pid = self.child_pids()[name][-1]
        assert pid_alive(pid), f"{name} (pid {pid}) is not running at version {version}"
        os.killpg(pid, signal.SIGKILL)
        self.killed.append((version, name, pid))

    def leftovers(self) -> list[str]:
        """Processes of the run still alive: its children and everything in their groups
        (each child leads its own), the nats-servers its launcher started. A live PID whose
        process did not start when the log says is another process that reused the number."""
        left = []
        for t, name, pid in self.starts():
            if abs(started_at(pid) - t) > 5:
                continue  # gone, or the number now names another process
            if pid_alive(pid):
                left.append(f"{name} pid {pid}")
            if members := group_members(pid):
                left.append(f"{name} group {pid}: {members}")
        return left


def unix_time(stamp: str) -> float:
    """A log line's local ``%Y-%m-%d %H:%M:%S`` as Unix time."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))


def started_at(pid: int) -> float:
    """Unix time at which process ``pid`` started (infinity when there is none)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        stat = Path("/proc/stat").read_text().split()
        btime = int(stat[stat.index("btime") + 1])
    except (OSError, IndexError, ValueError):
        return float("inf")
    return btime + ticks / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# the audit
# ---------------------------------------------------------------------------------------------


def member_of_rid(rid: str) -> Member:
    """``<group_id>-<k>-<attempt>`` -> ``(group_id, k)``."""
    gid, k, _attempt = rid.rsplit("-", 2)
    return gid, int(k)


@dataclass
class Audit:
    """Where every issued rollout of a run is, from its streams and its committed ledger."""

    issued: int = 0
    """TaskRequests ever stored on TASKS (its last sequence)."""
    members: set[Member] = field(default_factory=set)
    """Distinct members found anywhere (a task, a result, a dead letter)."""
    where: dict[Member, str] = field(default_factory=dict)
    """Member -> ``trained``, ``dropped:<reason>``, ``dead:<reason>``, ``pending:<stage>`` or
    ``lost``."""
    trained_twice: list[Member] = field(default_factory=list)
    ledger_version: int = 0
    ledger_trained: dict[str, int] = field(default_factory=dict)
    n_trained: int = 0
    pending_tasks: int = 0
    dead_tasks: int = 0
    """Dead-lettered TaskRequests whose member has no result (the summary's count)."""
    result_members: int = 0
    assembled: int = 0
    """Distinct rollouts the assembler turned into a sample or tombstone (ledger + stored +
    dead-lettered samples)."""

    def counts(self) -> Counter[str]:
        return Counter(w.split(":", 1)[0] for w in self.where.values())

    def table(self) -> str:
        c = self.counts()
        reasons = Counter(w for w in self.where.values() if ":" in w)
        lines = [
            f"issued {self.issued} = trained {c['trained']} + dropped {c['dropped']} + "
            f"dead-lettered {c['dead']} + pending {c['pending']} (lost {c['lost']}; "
            f"{len(self.members)} distinct members)",
            f"ledger: version {self.ledger_version}, {self.n_trained} trained rollouts, "
            f"trained twice {len(self.trained_twice)}",
        ]
        lines += [f"  {k}: {v}" for k, v in sorted(reasons.items())]
        return "\n".join(lines)


async def audit(out: Path, run: str) -> Audit:
    """Serve the run's JetStream store again (the run stopped its server) and place every
    issued rollout. Read in flow order (tasks, results, samples), then the ledger: a rollout
    that moved meanwhile is seen twice, never missed (nothing moves here: the run has ended)."""
    a = Audit()
    server = NatsServer(out / "nats").start()
    try:
        bus = await connect(server.url, run)
        try:
            a.issued = int((await bus.js.stream_info(bus.subjects.stream("TASKS"))).state.last_seq)
            tasks = {member_of(d) for _, d in await bus.stored(bus.subjects.tasks)}
            results = [
                (s, decode(d, RolloutResult)) for s, d in await bus.stored(bus.subjects.rollouts)
            ]
            ci = await bus.js.consumer_info(bus.subjects.stream("ROLLOUTS"), "assembler")
            floor = int(ci.ack_floor.stream_seq)
            acked_above = int(ci.delivered.stream_seq) - floor - int(ci.num_ack_pending)
            assert acked_above >= 0
            samples = [decode(d, TreeSample) for _, d in await bus.stored(bus.subjects.samples)]
            dead: dict[str, list[DeadLetter]] = {}
            for kind in ("TASKS", "ROLLOUTS", "SAMPLES"):
                dead[kind] = await bus.read_subject(bus.subjects.dead(kind), DeadLetter)
        finally:
            await bus.close()
    finally:
        server.stop()
    # none: the learner died before its first commit (a restart begins at version 0)
    state = read_learner_state(out / "checkpoints") or LearnerState()
    a.ledger_version = state.version
    trained: dict[str, int] = dict(state.ledger.get("trained", {}))
    dropped: dict[str, str] = dict(state.ledger.get("dropped", {}))
    a.ledger_trained, a.n_trained = trained, int(state.ledger.get("n_trained", 0))

    result_members = {(r.group_id, r.k) for _, r in results}
    a.result_members = len(result_members)
    unassembled = (
        {(r.group_id, r.k) for s, r in results if s > floor} if acked_above == 0 else set()
    )
    stored_samples = {(s.group_id, s.k) for s in samples}
    dead_tasks = {member_of(dl.data): dl.reason for dl in dead["TASKS"]}
    dead_results = {}
    for dl in dead["ROLLOUTS"]:
        with contextlib.suppress(Exception):
            r = decode(dl.data, RolloutResult)
            dead_results[r.group_id, r.k] = dl.reason
    dead_samples = {}
    for dl in dead["SAMPLES"]:
        with contextlib.suppress(Exception):
            s = decode(dl.data, TreeSample)
            dead_samples[s.group_id, s.k] = dl.reason
    a.dead_tasks = sum(1 for m in dead_tasks if m is None or m not in result_members)
    a.members = {m for m in (tasks | result_members | set(dead_tasks)) if m is not None}

    by_member: dict[Member, list[str]] = {}
    for rid in trained:
        by_member.setdefault(member_of_rid(rid), []).append(rid)
    a.trained_twice = [m for m, rids in by_member.items() if len(rids) > 1]
    drop_of = {member_of_rid(rid): why for rid, why in dropped.items()}
    dead_sample_ids = set()
    for dl in dead["SAMPLES"]:
        with contextlib.suppress(Exception):
            dead_sample_ids.add(decode(dl.data, TreeSample).rollout_id)
    a.assembled = len(
        set(trained) | set(dropped) | {s.rollout_id for s in samples} | dead_sample_ids
    )
    for m in a.members:
        if m in by_member:
            a.where[m] = "trained"
        elif m in drop_of:
            a.where[m] = f"dropped:{drop_of[m]}"
        elif m in tasks:
            a.where[m] = "pending:task"
        elif m in stored_samples:
            a.where[m] = "pending:sample"
        elif m in unassembled:
            a.where[m] = "pending:result"
        elif m in dead_samples or m in dead_results or m in dead_tasks:
            why = dead_samples.get(m) or dead_results.get(m) or dead_tasks.get(m)
            a.where[m] = f"dead:{why}"
        else:
            a.where[m] = "lost"
    a.pending_tasks = len(tasks)
    return a


def lineage(out: Path, committed: int) -> dict[str, int]:
    """Rollout id -> version of every step of the final lineage (``learner/metrics.jsonl``):
    steps logged above the committed version are rolled back (by the next start, if any)."""
    steps = effective_steps(read_metrics(out / "learner" / "metrics.jsonl"))
    return {rid: s.version for s in steps if s.version <= committed for rid in s.rollouts}


def summary_of(out: Path) -> SummaryLine:
    (s, *_) = [
        m for m in reversed(read_metrics(out / "metrics.jsonl")) if isinstance(m, SummaryLine)
    ]
    return s


def check(out: Path, run: str, chaos: Chaos, *, what: str) -> Audit:
    """The audit's invariants for a run that has ended (see the module docstring)."""
    a = asyncio.run(audit(out, run))
    s = summary_of(out)
    print(f"\n== chaos {what}: killed {chaos.killed}\n{a.table()}")
    print(
        f"summary: outcome {s.outcome}, version {s.version}, engines {s.engine_versions}, "
        f"issued {s.issued}, pending {s.pending}, unaccounted {s.unaccounted} "
        f"({s.accounting}), samples {s.samples}, tombstones {s.tombstones}, "
        f"trained {s.samples_trained}, restarts {s.restarts}"
    )
    c = a.counts()
    assert c["lost"] == 0, {m: w for m, w in a.where.items() if w == "lost"}
    assert len(a.members) == a.issued, "a member issued twice, or a task lost without a trace"
    assert a.issued == c["trained"] + c["dropped"] + c["dead"] + c["pending"]
    assert a.trained_twice == [] and a.n_trained == len(a.ledger_trained)
    assert lineage(out, a.ledger_version) == a.ledger_trained, "step lines and the ledger disagree"
    # the engine serves the committed weights (never newer ones; after a drain, exactly them)
    if s.outcome == "done":
        assert s.engine_versions == {"engine-0": str(a.ledger_version)}, s
    else:  # stopped by a death: the last broadcast may not have been applied
        assert 0 <= int(s.engine_versions["engine-0"]) <= a.ledger_version, s
    # nothing left running
    assert chaos.leftovers() == [] and s.leftover_pids == []
    sandboxes = out.parent / "sandboxes"
    assert not sandboxes.exists() or list(sandboxes.iterdir()) == []
    # the summary's counts are the audit's
    assert (s.version, s.issued, s.pending) == (a.ledger_version, a.issued, a.pending_tasks), s
    assert (s.unaccounted, s.accounting) == (0, "exact"), s
    assert s.members_with_result == a.result_members, s
    assert s.dead_lettered_tasks == a.dead_tasks, s
    assert s.samples_trained == a.n_trained, s
    assert s.samples + sum(s.tombstones.values()) == a.assembled, s
    return a


# ---------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------


CHAOS_FLAGS = [
    "--nats-insecure",  # the audit serves the store again without the run's credentials
    "--restart-backoff-s",
    "0.5",
]


def setup_run(tmp_path: Path, steps: int) -> tuple[Path, Path]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    sandboxes = tmp_path / "sandboxes"
    run_file = tmp_path / "run.toml"
    run_file.write_text(RUN_FILE.format(steps=steps, sandboxes=sandboxes))
    return run_file, tmp_path / "run"


def timed(what: str, t0: float) -> None:
    print(f"== chaos {what}: {time.monotonic() - t0:.0f}s")


IN_TURN = {
    1: "actor-0",
    2: "assembler",
    3: "engine-0",
    4: "weights-sync-0",
    5: "nats",
    6: "learner",
}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_components_killed_in_turn_then_resumed(tmp_path: Path) -> None:
    """Every component SIGKILLed once, one step apart: actor, assembler, engine, weight
    updater, nats-server (each restarted by the supervisor), then the learner under its
    default policy, which stops the run (exit 1). ``--resume`` continues it with the learner's
    policy ``restart``, and the learner is SIGKILLed again. Audited after each run."""
    t0 = time.monotonic()
    run_file, out = setup_run(tmp_path, steps=8)
    chaos = Chaos(out, dict(IN_TURN))
    argv = run_argv(str(run_file), "--out", str(out), "--actors", "1", *CHAOS_FLAGS)
    rc = chaos.drive([*argv, "--on-exit.nats", "restart"], tmp_path / "run.log")
    assert rc == 1, (tmp_path / "run.log").read_text()[-4000:]
    assert [n for _, n, _ in chaos.killed] == list(IN_TURN.values())
    s = summary_of(out)
    assert s.outcome == "fatal" and s.message.startswith("learner"), s
    first = check(out, "e2e", chaos, what="in turn, the run stopped by the learner's death")
    timed("in turn", t0)

    t1 = time.monotonic()
    chaos = Chaos(out, {7: "learner"})
    argv = run_argv("--out", str(out), "--resume", "--on-exit.learner", "restart")
    rc = chaos.drive(argv, tmp_path / "run.log")
    assert rc == 0, (tmp_path / "run.log").read_text()[-4000:]
    second = check(out, "e2e", chaos, what="resumed, the learner killed and restarted")
    assert summary_of(out).restarts == {"learner": 1}
    assert second.ledger_version == 8 and second.issued >= first.issued
    assert set(first.ledger_trained.items()) <= set(second.ledger_trained.items())
    timed("resumed", t1)


@pytest.mark.slow
@pytest.mark.chaos_matrix  # deselected by default (pyproject addopts): -m chaos_matrix
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "victim", ["actor-0", "assembler", "engine-0", "weights-sync-0", "nats", "learner"]
)
def test_one_component_killed(tmp_path: Path, victim: str) -> None:
    """One component SIGKILLed after the first step, restarted by the supervisor: the run
    finishes and the audit holds."""
    t0 = time.monotonic()
    run_file, out = setup_run(tmp_path, steps=3)
    chaos = Chaos(out, {1: victim})
    argv = run_argv(str(run_file), "--out", str(out), "--actors", "1", *CHAOS_FLAGS)
    argv += ["--on-exit.nats", "restart", "--on-exit.learner", "restart"]
    rc = chaos.drive(argv, tmp_path / "run.log")
    assert rc == 0, (tmp_path / "run.log").read_text()[-4000:]
    check(out, "e2e", chaos, what=victim)
    timed(victim, t0)
