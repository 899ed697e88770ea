"""The process supervisor with fake children: restarts, fatal exits, clean stops, no leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harnessrl.common.procs import group_members, kill_tree, pid_alive, popen_child, wait_group_dead
from harnessrl.common.run.supervisor import ChildFailed, ChildSpec, Supervisor

pytestmark = pytest.mark.integration

PY = sys.executable

# A well-behaved service: starts a grandchild (``sleep``, dying with it), says ready, serves
# until SIGTERM, then exits 0. Prints the grandchild's PID so tests can check it is gone.
SERVICE = textwrap.dedent(
    """
    import signal, sys, time
    from harnessrl.common.procs import popen_child
    g = popen_child(["sleep", "300"])
    print(f"grandchild {g.pid}", flush=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    print("service ready", flush=True)
    while True:
        time.sleep(0.1)
    """
)
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"


def service(name: str, **kw) -> ChildSpec:
    return ChildSpec(name=name, argv=[PY, "-c", SERVICE], ready=r"service ready", **kw)


def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def grandchild_pid(log: Path) -> int:
    for line in log.read_text().splitlines():
        if line.startswith("grandchild "):
            return int(line.split()[1])
    raise AssertionError(f"no grandchild line in {log}")


def poll_until(sup: Supervisor, cond, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = sup.poll()
        if out is not None or cond():
            return out
        time.sleep(0.05)
    raise AssertionError("timed out polling the supervisor")


@pytest.fixture
def sup(tmp_path: Path):
    s = Supervisor(tmp_path / "logs", restart_backoff_s=0.1, max_restarts=3)
    yield s
    s.stop_all(timeout=5)
    assert s.leftovers() == []


def test_restart_on_death(sup: Supervisor) -> None:
    """A child with on_exit=restart that dies is started again, with a new PID."""
    child = sup.start(service("svc", on_exit="restart"), wait_ready=True)
    first = child.pid
    os.kill(first, signal.SIGKILL)
    out = poll_until(sup, lambda: child.starts == 2 and child.alive)
    assert out is None
    assert child.pid != first and not pid_alive(first)
    sup.wait_ready(["svc"], timeout=20)
    assert child.log_path.read_text().count("=== start") == 2


def test_fatal_child_stops_the_run_with_a_clear_message(sup: Supervisor) -> None:
    """on_exit=stop: the outcome names the child, its exit status and its last words."""
    spec = ChildSpec(
        name="learner",
        argv=[PY, "-c", "import sys; print('boom: out of memory', flush=True); sys.exit(3)"],
        on_exit="stop",
    )
    sup.start(spec)
    out = poll_until(sup, lambda: False)
    assert out is not None and out.kind == "fatal" and out.child == "learner"
    assert "learner" in out.message and "exited with status 3" in out.message
    assert "boom: out of memory" in out.message


def test_done_on_success_ends_the_run(sup: Supervisor) -> None:
    """A done_on_success child exiting 0 finishes the run (no restart)."""
    sup.start(ChildSpec(name="learner", argv=[PY, "-c", "pass"], done_on_success=True))
    out = poll_until(sup, lambda: False)
    assert out is not None and out.kind == "done"
    assert sup.children["learner"].starts == 1


def test_too_many_restarts_is_fatal(sup: Supervisor) -> None:
    """A child that keeps dying is given up after max_restarts deaths in the window."""
    spec = ChildSpec(name="crashy", argv=[PY, "-c", "raise SystemExit(1)"], on_exit="restart")
    sup.start(spec)
    out = poll_until(sup, lambda: False, timeout=30)
    assert out is not None and out.kind == "fatal"
    assert "died 4 times" in out.message
    assert sup.children["crashy"].starts == 4


def test_not_ready_child_raises(sup: Supervisor) -> None:
    """A child that exits before its ready line fails the start with its output."""
    spec = ChildSpec(name="engine", argv=[PY, "-c", "print('no model here')"], ready="ready:")
    with pytest.raises(ChildFailed, match="no model here"):
        sup.start(spec, wait_ready=True)


def test_stop_kills_children_that_ignore_sigterm(tmp_path: Path) -> None:
    """stop_all escalates to SIGKILL after the stop timeout."""
    s = Supervisor(tmp_path / "logs")
    child = s.start(
        ChildSpec(name="stubborn", argv=[PY, "-c", STUBBORN], ready="ready", stop_timeout_s=0.5),
        wait_ready=True,
    )
    t0 = time.monotonic()
    s.stop_all()
    assert time.monotonic() - t0 < 10
    assert not pid_alive(child.pid)
    assert child.last_exit == -signal.SIGKILL


def test_stop_all_leaves_no_process(sup: Supervisor) -> None:
    """After stop_all no child and no grandchild is alive."""
    kids = [sup.start(service(f"svc{i}"), wait_ready=True) for i in range(3)]
    grand = [grandchild_pid(k.log_path) for k in kids]
    sup.stop_all()
    for p in [k.pid for k in kids] + grand:
        assert not pid_alive(p), p
    assert all(k.last_exit == 0 for k in kids)


# ---------------------------------------------------------------------------------------------
# the supervisor as a process: SIGTERM and being killed
# ---------------------------------------------------------------------------------------------


def _start_supervisor(tmp_path: Path, n: int = 2) -> tuple[subprocess.Popen, dict[str, int]]:
    spec = {
        "log_dir": str(tmp_path / "logs"),
        "children": [
            {"name": f"svc{i}", "argv": [PY, "-c", SERVICE], "ready": "service ready"}
            for i in range(n)
        ],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.Popen(
        [PY, "-m", "harnessrl.common.run.supervisor", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("supervisor ready:"):
            pids = dict(kv.split("=") for kv in line.split(":", 1)[1].split())
            return proc, {k: int(v) for k, v in pids.items()}
    proc.wait()
    raise AssertionError("supervisor did not start")


def test_sigterm_stops_every_child(tmp_path: Path) -> None:
    """SIGTERM to the supervisor: it stops every child and grandchild, then exits 143."""
    proc, pids = _start_supervisor(tmp_path)
    grand = [grandchild_pid(tmp_path / "logs" / f"{n}.log") for n in pids]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    for p in [*pids.values(), *grand]:
        assert not pid_alive(p), p


def test_killed_supervisor_takes_children_down(tmp_path: Path) -> None:
    """SIGKILL to the supervisor: its children get PDEATHSIG and die (grandchildren too)."""
    proc, pids = _start_supervisor(tmp_path)
    grand = [grandchild_pid(tmp_path / "logs" / f"{n}.log") for n in pids]
    proc.kill()
    proc.wait()
    everyone = [*pids.values(), *grand]
    wait_for(lambda: not any(pid_alive(p) for p in everyone), what="children to die")


def test_wait_group_dead_sees_grandchildren_until_they_are_gone() -> None:
    """A killed group's members are listed until the kernel has ended every one of them."""
    proc = popen_child(["sh", "-c", "sleep 60 & sleep 60 & wait"], new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(group_members(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(group_members(proc.pid)) == 3  # sh and its two sleeps
        assert not wait_group_dead(proc.pid, timeout=0.2)  # alive: it says so, in time
        kill_tree(proc.pid)
        proc.wait()
        assert wait_group_dead(proc.pid, timeout=5.0)
        assert group_members(proc.pid) == []
    finally:
        kill_tree(proc.pid)
