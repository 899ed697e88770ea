"""Sandbox test helpers: a usable bubblewrap backend or a skip, host processes by marker."""

from __future__ import annotations

import os
import random
import textwrap
from pathlib import Path

import pytest

from harnessrl.actors.sandbox.bwrap import BwrapBackend
from tests.helpers.wait import until


async def bwrap_or_skip(root: Path, **kwargs) -> BwrapBackend:
    """A bubblewrap backend with its state under ``root`` (``kwargs``: see `BwrapBackend`);
    skips the test where bwrap cannot run (the probe says why)."""
    be = BwrapBackend(root, **kwargs)
    reason = await be.probe()
    if reason is not None:
        pytest.skip(f"bubblewrap not usable here: {reason}")
    return be


def procs_with(marker: str) -> list[int]:
    """Host pids whose environment or command line contains ``marker``."""
    found, needle = [], marker.encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        for f in ("environ", "cmdline"):
            try:
                if needle in Path(f"/proc/{d}/{f}").read_bytes():
                    found.append(int(d))
                    break
            except OSError:
                pass
    return found


def uid_of(pid: int | str) -> int | None:
    """The real uid host process ``pid`` runs as (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


async def no_survivors(marker: str, within: float = 3.0) -> bool:
    """Whether every host process carrying ``marker`` is gone within ``within`` seconds."""
    try:
        await until(lambda: not procs_with(marker), within, f"no process with {marker}")
    except AssertionError:
        return False
    return True


def py(code: str) -> list[str]:
    """argv running ``code`` with the sandbox's python3."""
    return ["python3", "-c", textwrap.dedent(code)]


def sleep_marker() -> str:
    """A ``sleep`` argument no other test (nor another checkout's run) uses: processes that
    run it are found by their command line even with their environment cleared."""
    return f"{900 + random.random() * 99:.6f}"
