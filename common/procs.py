"""Child processes: started so they die with their parent, stopped by PID, never by name."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


def die_with_parent() -> None:
    """Have Linux send this process SIGTERM when its parent dies. For a launcher's ranks:
    torchrun starts each in a session of its own, out of reach of a process-group kill of the
    launcher, so a SIGKILLed launcher would otherwise leave its ranks running."""
    _die_with_parent()


def popen_child(argv: list[str], *, new_session: bool = False, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` whose child gets SIGTERM if this process dies (Linux PDEATHSIG).

    With ``new_session`` the child leads its own process group, so ``kill_tree`` can end it and
    everything it started.
    """
    return subprocess.Popen(
        argv, preexec_fn=_die_with_parent, start_new_session=new_session, **kwargs
    )


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process group led by ``pid`` (started with ``new_session=True``)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(stat.parent.name))
    return out


def wait_group_dead(pgid: int, timeout: float = 5.0) -> bool:
    """Wait until no live process is left in group ``pgid`` (a SIGKILL is delivered
    asynchronously: a loaded machine can still show the group for a moment). True when empty."""
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit; returns (soft, hard).

    An actor holds a few descriptors per rollout in flight (its proxy's socket and connections,
    the sandbox's pipes and locks): ``benchmarks/fleet.py`` measured 1,034 in one actor running
    260 rollouts, past the 1,024 soft limit many systems start services with (systemd's
    default), where the next rollout would fail with EMFILE. The hard limit is the real bound.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            return soft, hard
        soft = want
    return soft, hard
