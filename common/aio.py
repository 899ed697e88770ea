"""Event loop and logging setup shared by every entry point."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any


class StartupError(RuntimeError):
    """A process cannot start for a reason its user must fix (credentials the server refuses,
    an unreadable key file): ``harnessrl`` prints it as one line naming the command, without a
    traceback, and exits 1."""


def run(coro: Coroutine[Any, Any, Any], *, subprocesses: bool = False) -> Any:
    """Run ``coro`` on uvloop when it is installed, else on the default asyncio loop.

    ``subprocesses``: the process starts subprocesses all the time (an actor starts a sandbox,
    a harness and a verifier for every rollout), so it runs on the default asyncio loop, whose
    subprocesses CPython starts with ``vfork``; libuv (uvloop) forks, copying the page tables
    of a process that has torch and transformers loaded: 12-15 ms of system CPU and 30-40 ms
    with the loop blocked per subprocess, against 0.3 ms and 3-4 ms (measured here; an
    80-rollout eval spent 12.0 s of system CPU on uvloop, 6.0 s on the default loop)."""
    if subprocesses:
        return asyncio.run(coro)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
        return asyncio.run(coro)
    return uvloop.run(coro)


def setup_logging(level: str = "info", name: str = "") -> None:
    """Plain, grep-friendly log lines on stderr."""
    fmt = "%(asctime)s %(levelname).1s " + (f"[{name}] " if name else "") + "%(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)
    for noisy in ("nats", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
