"""Process supervisor: start children by command line, track them by PID, restart or stop.

``harnessrl run`` uses it to start every process of a run (nats-server, engines, weight
updaters, assembler, learner, actors) exactly as a user would start them by hand; tests use it
with fake commands. The contract:

* **Children are ours alone.** Each child is started with ``harnessrl.common.procs.popen_child`` in its
  own session (process group), so it gets SIGTERM if the supervisor dies (Linux PDEATHSIG) and
  ``kill_tree`` reaches everything it started. Children are always spawned from the thread that
  created the supervisor: PDEATHSIG fires when the *spawning thread* exits.
* **Nothing is left behind.** ``stop_all`` stops children in reverse start order (consumers
  before the bus they need): SIGTERM to the child, up to its ``stop_timeout_s`` to exit, then
  SIGKILL to its whole process group; the group is SIGKILLed after a clean exit too, so a
  grandchild that ignored its parent's death cannot survive.
* **A death is handled by the child's policy** (``ChildSpec.on_exit``): ``restart`` (with
  exponential backoff; more than ``max_restarts`` deaths within ``restart_window_s`` make it
  fatal), ``stop`` (the run ends with a message naming the child, its exit status and the tail
  of its log), or ``ignore``. A child marked ``done_on_success`` that exits 0 ends the run as
  finished (the learner reaching its steps).

Each child's stdout and stderr go to ``<log_dir>/<name>.log`` (appended across restarts, each
start preceded by a ``=== start`` header line with the PID and the command). Readiness is a
regular expression matched against the lines the child writes after its start.

Also runnable for ad-hoc supervision and tests::

    python -m harnessrl.common.run.supervisor SPEC.json

where SPEC.json is ``{"log_dir": DIR, "children": [{"name", "argv", "on_exit", "ready",
"done_on_success", "stop_timeout_s"}...], "max_restarts": N, "restart_backoff_s": S}``; it
prints ``supervisor ready: name=pid ...`` once every child is started (and ready), and exits
when the run ends (0 done, 1 fatal, 128+signal after SIGINT/SIGTERM).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from harnessrl.common.procs import kill_tree, pid_alive, popen_child, wait_group_dead

OnExit = Literal["restart", "stop", "ignore"]


@dataclass
class ChildSpec:
    """How to run one child process."""

    name: str
    """Unique name; also the log file's name (``<name>.log``)."""
    argv: list[str] | Callable[[], list[str]]
    """Command line; a callable is evaluated at every (re)start (e.g. to add ``--resume``)."""
    role: str = ""
    """Role (``nats``, ``engine``, ``actor``...), for display and per-role policies."""
    on_exit: OnExit = "restart"
    """What an unexpected exit does: restart it, stop the run, or ignore it."""
    done_on_success: bool = False
    """Exit status 0 means the run is finished (no restart, no error)."""
    ready: str | None = None
    """Regex matched against the child's output lines; the child is ready when one matches
    (None: ready as soon as it started)."""
    ready_timeout_s: float = 300.0
    """``start(wait_ready=True)`` gives up after this long."""
    stop_timeout_s: float = 30.0
    """Seconds between SIGTERM and SIGKILL when stopping it."""
    env: dict[str, str] | None = None
    """Extra environment variables (added to the supervisor's own)."""
    cwd: str | None = None
    """Working directory (default: the supervisor's)."""

    def command(self) -> list[str]:
        return list(self.argv() if callable(self.argv) else self.argv)


@dataclass
class Child:
    """A child's live state."""

    spec: ChildSpec
    log_path: Path
    proc: subprocess.Popen | None = None
    argv: list[str] = field(default_factory=list)
    starts: int = 0
    started_at: float = 0.0
    ready: bool = False
    ready_match: re.Match | None = None
    last_exit: int | None = None
    deaths: deque = field(default_factory=deque)
    restart_at: float | None = None
    stopped: bool = False
    """Deliberately stopped (or dead and not to be restarted)."""
    _offset: int = 0
    _partial: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def state(self) -> str:
        if self.alive:
            return "ready" if self.ready else "starting"
        if self.restart_at is not None:
            return "restarting"
        if self.last_exit == 0 and self.spec.done_on_success:
            return "done"
        return "stopped" if self.stopped else "exited"

    def new_lines(self) -> list[str]:
        """Complete lines appended to the log since the last call (this incarnation only)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        self._offset += len(data)
        text = self._partial + data.decode(errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        return lines

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-n:])


class ChildFailed(RuntimeError):
    """A child could not start, or died in a way that ends the run."""


@dataclass
class Outcome:
    """Why supervision ended."""

    kind: Literal["done", "fatal", "signal"]
    message: str
    child: str = ""


def format_command(argv: list[str]) -> str:
    return shlex.join(argv)


class Supervisor:
    """Starts, watches, restarts and stops child processes (see the module docstring)."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        max_restarts: int = 5,
        restart_window_s: float = 300.0,
        restart_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restart_backoff_s = restart_backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_event = on_event or (lambda msg: None)
        self.children: dict[str, Child] = {}
        self.order: list[str] = []
        self.events: deque[tuple[float, str]] = deque(maxlen=200)
        self._thread = threading.get_ident()

    # -- starting ---------------------------------------------------------------------------

    def add(self, spec: ChildSpec) -> Child:
        if spec.name in self.children:
            raise ValueError(f"child {spec.name!r} already exists")
        child = Child(spec, self.log_dir / f"{spec.name}.log")
        self.children[spec.name] = child
        self.order.append(spec.name)
        return child

    def start(self, spec: ChildSpec | str, *, wait_ready: bool = False) -> Child:
        """Start (or restart) a child; with ``wait_ready`` block until its ready line."""
        child = self.children.get(spec) if isinstance(spec, str) else self.children.get(spec.name)
        if child is None:
            assert isinstance(spec, ChildSpec)
            child = self.add(spec)
        self._spawn(child)
        if wait_ready:
            self.wait_ready([child.name])
        return child

    def _spawn(self, child: Child) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError("children must be spawned from the supervisor's thread (PDEATHSIG)")
        spec = child.spec
        child.argv = spec.command()
        child.restart_at = None
        child.stopped = False
        child.ready = spec.ready is None
        child.ready_match = None
        env = {**os.environ, **(spec.env or {})}
        with open(child.log_path, "ab") as log:
            child._offset = log.tell()
            child._partial = ""
            header = f"=== start {time.strftime('%Y-%m-%d %H:%M:%S')}: {format_command(child.argv)}"
            log.write((header + "\n").encode())
            log.flush()
            child._offset = log.tell()
            child.proc = popen_child(
                child.argv,
                new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.cwd,
            )
        child.starts += 1
        child.started_at = time.monotonic()
        self._event(f"started {child.name} (pid {child.pid})")

    def check_ready(self, child: Child) -> bool:
        """Scan the child's new output for its ready line."""
        if child.ready or child.spec.ready is None:
            return child.ready
        pattern = re.compile(child.spec.ready)
        for line in child.new_lines():
            m = pattern.search(line)
            if m:
                child.ready, child.ready_match = True, m
                self._event(f"{child.name} ready")
                break
        return child.ready

    def wait_ready(self, names: list[str], timeout: float | None = None) -> None:
        """Block until every named child is ready; raise ``ChildFailed`` if one exits first or
        the timeout (default: the largest of their ``ready_timeout_s``) passes."""
        kids = [self.children[n] for n in names]
        limit = timeout if timeout is not None else max(k.spec.ready_timeout_s for k in kids)
        deadline = time.monotonic() + limit
        while True:
            pending = [k for k in kids if not self.check_ready(k)]
            if not pending:
                return
            for k in pending:
                if not k.alive:
                    self.check_ready(k)  # the ready line may be its last words
                    if k.ready:
                        continue
                    rc = k.proc.returncode if k.proc is not None else None
                    raise ChildFailed(self.death_message(k, rc, "before it was ready"))
            if time.monotonic() > deadline:
                names_ = ", ".join(k.name for k in pending)
                tails = "\n".join(f"--- {k.name} ({k.log_path}):\n{k.log_tail()}" for k in pending)
                raise ChildFailed(f"not ready after {limit:.0f}s: {names_}\n{tails}")
            time.sleep(0.05)

    # -- watching ---------------------------------------------------------------------------

    def poll(self) -> Outcome | None:
        """Handle exits and due restarts; return an Outcome when the run must end."""
        now = time.monotonic()
        for name in list(self.order):
            child = self.children[name]
            if child.proc is None or child.stopped:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._spawn(child)
                continue
            self.check_ready(child)
            rc = child.proc.poll()
            if rc is None:
                continue
            child.last_exit = rc
            kill_tree(child.proc.pid)  # nothing it started may outlive it
            outcome = self._on_death(child, rc, now)
            if outcome is not None:
                return outcome
        return None

    def _on_death(self, child: Child, rc: int, now: float) -> Outcome | None:
        spec = child.spec
        if rc == 0 and spec.done_on_success:
            child.stopped = True
            self._event(f"{child.name} finished")
            return Outcome("done", f"{child.name} finished", child.name)
        if spec.on_exit == "ignore":
            child.stopped = True
            self._event(self.death_message(child, rc, "(ignored)", tail=False))
            return None
        if spec.on_exit == "stop":
            child.stopped = True
            return Outcome("fatal", self.death_message(child, rc, "; stopping the run"), child.name)
        child.deaths.append(now)
        while child.deaths and now - child.deaths[0] > self.restart_window_s:
            child.deaths.popleft()
        if len(child.deaths) > self.max_restarts:
            child.stopped = True
            why = (
                f"; it died {len(child.deaths)} times in {self.restart_window_s:.0f}s "
                f"(max_restarts {self.max_restarts}), stopping the run"
            )
            return Outcome("fatal", self.death_message(child, rc, why), child.name)
        # a restart schedule, not a retry loop (no tenacity): the supervision loop that calls
        # this keeps watching every other child while this one waits for its restart
        delay = min(self.restart_backoff_s * 2 ** (len(child.deaths) - 1), self.max_backoff_s)
        child.restart_at = now + delay
        self._event(self.death_message(child, rc, f"; restarting in {delay:.1f}s", tail=False))
        return None

    def death_message(self, child: Child, rc: int | None, what: str, tail: bool = True) -> str:
        if rc is not None and rc < 0:
            try:
                status = f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                status = f"was killed by signal {-rc}"
        else:
            status = f"exited with status {rc}"
        msg = f"{child.name} (pid {child.pid}) {status} {what}".replace(" ;", ";")
        if tail:
            msg += f"\nlast lines of {child.log_path}:\n{child.log_tail()}"
        return msg

    # -- stopping ---------------------------------------------------------------------------

    def stop(self, names: list[str] | None = None, timeout: float | None = None) -> None:
        """Stop the named children (default: all, in reverse start order) together: SIGTERM,
        wait up to each one's ``stop_timeout_s`` (or ``timeout``), SIGKILL their groups."""
        kids = [self.children[n] for n in (names or list(reversed(self.order)))]
        for k in kids:
            k.stopped = True
            k.restart_at = None
            if k.alive:
                try:
                    k.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                except ProcessLookupError:
                    pass
        for k in kids:
            if k.proc is None:
                continue
            limit = k.spec.stop_timeout_s if timeout is None else timeout
            try:
                k.proc.wait(limit)
            except subprocess.TimeoutExpired:
                self._event(f"{k.name} (pid {k.pid}) ignored SIGTERM for {limit:.0f}s: SIGKILL")
            kill_tree(k.proc.pid)
            k.proc.wait()
            wait_group_dead(k.proc.pid)  # what the child started dies with it, not after us
            k.last_exit = k.proc.returncode

    def stop_all(self, tiers: list[list[str]] | None = None, timeout: float | None = None) -> None:
        """Stop everything; ``tiers`` (lists of names) are stopped one after the other, then
        whatever is left, in reverse start order."""
        done: set[str] = set()
        for tier in tiers or []:
            names = [n for n in tier if n in self.children and n not in done]
            if names:
                self.stop(names, timeout)
                done.update(names)
        rest = [n for n in reversed(self.order) if n not in done]
        for n in rest:  # one at a time: later children may need earlier ones to shut down
            self.stop([n], timeout)

    def kill_all(self) -> None:
        """SIGKILL every child's process group now (a second Ctrl-C)."""
        for c in self.children.values():
            c.stopped = True
            c.restart_at = None
            if c.proc is not None and c.proc.poll() is None:
                kill_tree(c.proc.pid)

    # -- inspection -------------------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """PIDs of the children alive now."""
        return {n: c.pid for n, c in self.children.items() if c.alive and c.pid is not None}

    def all_pids(self) -> list[int]:
        """Every PID any child ever had (for leftover checks)."""
        return [c.pid for c in self.children.values() if c.pid is not None]

    def leftovers(self) -> list[int]:
        return [p for p in self.all_pids() if pid_alive(p)]

    def _event(self, msg: str) -> None:
        self.events.append((time.time(), msg))
        self.on_event(msg)


# ---------------------------------------------------------------------------------------------
# ``python -m harnessrl.common.run.supervisor SPEC.json``
# ---------------------------------------------------------------------------------------------


def _run_spec(path: str) -> int:
    spec = json.loads(Path(path).read_text())
    stop_sig: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_sig.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sup = Supervisor(
        spec["log_dir"],
        max_restarts=int(spec.get("max_restarts", 5)),
        restart_backoff_s=float(spec.get("restart_backoff_s", 0.2)),
        on_event=lambda m: print(f"supervisor: {m}", flush=True),
    )
    outcome: Outcome | None = None
    try:
        for c in spec["children"]:
            sup.start(
                ChildSpec(
                    name=c["name"],
                    argv=c["argv"],
                    on_exit=c.get("on_exit", "restart"),
                    ready=c.get("ready"),
                    done_on_success=bool(c.get("done_on_success", False)),
                    stop_timeout_s=float(c.get("stop_timeout_s", 10.0)),
                ),
                wait_ready=True,
            )
        pids = " ".join(f"{n}={p}" for n, p in sup.pids().items())
        print(f"supervisor ready: {pids}", flush=True)
        while not stop_sig and outcome is None:
            outcome = sup.poll()
            time.sleep(0.05)
    except ChildFailed as e:
        outcome = Outcome("fatal", str(e))
    finally:
        sup.stop_all()
    if stop_sig:
        print(f"supervisor: stopped by signal {stop_sig[0]}", flush=True)
        return 128 + stop_sig[0]
    assert outcome is not None
    print(f"supervisor: {outcome.kind}: {outcome.message}", flush=True)
    return 0 if outcome.kind == "done" else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m harnessrl.common.run.supervisor SPEC.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(_run_spec(sys.argv[1]))
