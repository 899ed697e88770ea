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


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on uvloop when it is installed, else on the default asyncio loop."""
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
