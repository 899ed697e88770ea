"""Test tiers: every test carries exactly one of the markers ``unit``, ``integration``, ``slow``.

- ``unit``: runs in this process alone. It starts no subprocess (nor ``os.fork``), no server
  (in-process aiohttp or asyncio servers included), no sandbox and no harness, and opens no
  TCP or unix socket (neither binds nor connects): a torch.distributed process group counts
  as a server. ``pytest -m unit`` is the quick loop (a few minutes at most on two cores).
- ``integration``: anything else that takes under ~20 s alone: real nats-server, HTTP servers,
  sandboxes, CLI subprocesses, harnesses, DeepSpeed on gloo.
- ``slow``: takes more than ~20 s alone (learning runs, multi-rank training, cold harness
  starts), whatever it starts.

Collection fails on a test with no tier or more than one. The ``unit`` tier is enforced while
each unit test sets up and runs: starting a process, or binding or connecting a socket from
Python, raises `TierViolation` (what C code opens by itself, such as gloo's store once a
process group exists, is not seen; ``pytest -m unit`` alone starts from none). Under
``pytest -n N`` the ``slow`` tests run on one worker, one after another
(tests/helpers/slow_group.py).

``pytest --tiers-report=FILE [paths]`` runs the tests without the guard and writes, for each
test, what it did (processes, sockets) and how long it took, with the tier that measures
(JSON lines; a table of the tests whose declared tier differs is printed at the end).
"""

from __future__ import annotations

import _posixsubprocess
import json
import os
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

TIERS = ("unit", "integration", "slow")
SLOW_S = 20.0
WHERE = "pyproject.toml [tool.pytest.ini_options] markers; tests/helpers/tiers.py"


class TierViolation(RuntimeError):
    """A ``unit`` test started a process or used a socket."""


@dataclass
class _Watch:
    """What the test being watched did; ``enforce``: raise at the first thing a unit test may
    not do, else only note it."""

    enforce: bool
    nodeid: str
    used: set[str] = field(default_factory=set)
    others: set[int] = field(default_factory=set)
    """Threads already running when the watch began (another test's leftovers): not watched."""


_current: _Watch | None = None
_lock = threading.Lock()


def _check(key: str, what: str) -> None:
    watch = _current
    if watch is None or threading.get_ident() in watch.others:
        return
    with _lock:
        watch.used.add(key)
    if watch.enforce:
        raise TierViolation(
            f"{watch.nodeid} is marked unit but {what}: a unit test starts no process, server, "
            f"sandbox or harness and opens no socket. Mark it pytest.mark.integration "
            f"(or slow if it takes more than ~{SLOW_S:.0f} s); the tiers: {WHERE}"
        )


def _guarded(owner: Any, name: str, key: str, what: str) -> tuple[Any, str, Any, Any]:
    real = getattr(owner, name)

    def guard(*args: Any, **kwargs: Any) -> Any:
        _check(key, what)
        return real(*args, **kwargs)

    return owner, name, real, guard


def _patches() -> list[tuple[Any, str, Any, Any]]:
    # Popen covers subprocess.* and asyncio's subprocesses; fork_exec multiprocessing's spawn
    # and forkserver; os.fork its fork method and hand-written forks.
    out = [
        _guarded(subprocess.Popen, "_execute_child", "process", "started a subprocess"),
        _guarded(_posixsubprocess, "fork_exec", "process", "started a subprocess"),
    ]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            out.append(_guarded(os, name, "process", f"started a process (os.{name})"))
    out.append(_guarded(socket.socket, "bind", "bind", "bound a socket (a server)"))
    for name in ("connect", "connect_ex"):
        out.append(_guarded(socket.socket, name, "connect", "connected a socket"))
    return out


@contextmanager
def watching(nodeid: str, *, enforce: bool) -> Iterator[_Watch]:
    """Watch (and with ``enforce``, refuse) processes and sockets while the body runs."""
    global _current
    watch, saved, patches = _Watch(enforce, nodeid), _current, _patches()
    main = threading.main_thread()
    watch.others = {t.ident for t in threading.enumerate() if t is not main and t.ident}
    for owner, name, _real, guard in patches:
        setattr(owner, name, guard)
    _current = watch
    try:
        yield watch
    finally:
        _current = saved
        for owner, name, real, _guard in reversed(patches):
            setattr(owner, name, real)


def tiers_of(item: pytest.Item) -> list[str]:
    return sorted({m.name for m in item.iter_markers() if m.name in TIERS})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tiers-report",
        metavar="FILE",
        help="run without the unit guard; write each test's processes, sockets, time and "
        "measured tier to FILE (JSON lines) and list the tests whose tier differs (without "
        "-n: the times are meant alone)",
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `pytest -m unit` checks every test too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = [(item, tiers_of(item)) for item in items if len(tiers_of(item)) != 1]
    if not bad or config.getoption("--tiers-report"):
        return
    lines = [
        f"  {item.nodeid}: "
        + (f"marked {' and '.join(found)}: keep one" if found else "no tier marker")
        for item, found in bad
    ]
    raise pytest.UsageError(
        f"{len(bad)} test(s) without exactly one tier marker:\n"
        + "\n".join(lines)
        + "\nAdd exactly one of @pytest.mark.unit (no process, server, sandbox, harness or "
        "socket), @pytest.mark.integration (any of those, under ~20 s), @pytest.mark.slow "
        "(over ~20 s): on the test, or `pytestmark = pytest.mark.<tier>` at the top of a module "
        f"whose tests are all one tier. `pytest --tiers-report=FILE <test>` measures which. "
        f"Tiers defined in {WHERE}."
    )


_audit: dict[str, dict[str, Any]] = {}


def _cpu() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@contextmanager
def _phase(item: pytest.Item) -> Iterator[None]:
    """One phase of a test: watched (report), guarded (unit) or left alone."""
    if not item.config.getoption("--tiers-report"):
        if "unit" not in tiers_of(item):
            yield
            return
        with watching(item.nodeid, enforce=True):
            yield
        return
    rec = _audit.setdefault(item.nodeid, {"used": set(), "cpu_s": 0.0, "wall_s": 0.0})
    cpu0, wall0 = _cpu(), time.perf_counter()
    try:
        with watching(item.nodeid, enforce=False) as watch:
            yield
    finally:
        rec["used"] |= watch.used
        rec["cpu_s"] += _cpu() - cpu0
        rec["wall_s"] += time.perf_counter() - wall0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    with _phase(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with _phase(item):
        return (yield)


def measured_tier(rec: dict[str, Any]) -> str:
    if rec["wall_s"] > SLOW_S:
        return "slow"
    return "integration" if rec["used"] else "unit"


def pytest_runtest_teardown(item: pytest.Item) -> None:
    rec = _audit.get(item.nodeid)
    path = item.config.getoption("--tiers-report")
    if rec is None or not path:
        return
    line = {
        "nodeid": item.nodeid,
        "declared": tiers_of(item),
        "measured": measured_tier(rec),
        "wall_s": round(rec["wall_s"], 3),
        "cpu_s": round(rec["cpu_s"], 3),
        "used": sorted(rec["used"]),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    rec["line"] = line


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not config.getoption("--tiers-report"):
        return
    lines = [r["line"] for r in _audit.values() if "line" in r]
    if not lines:
        return
    off = [ln for ln in lines if ln["declared"] != [ln["measured"]]]
    terminalreporter.section(f"tiers: {len(off)} of {len(lines)} tests measure another tier")
    for ln in off:
        declared = "+".join(ln["declared"]) or "none"
        terminalreporter.write_line(
            f"{ln['measured']:<12} (declared {declared}) {ln['wall_s']:7.2f} s "
            f"{','.join(ln['used']) or '-'}  {ln['nodeid']}"
        )
