"""Waiting for a condition instead of sleeping a fixed time before an assertion."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _failed(what: str, timeout: float, proc: Any, last: Any) -> AssertionError:
    if proc is not None and _exited(proc):
        return AssertionError(f"the process exited ({proc.returncode}) before {what}")
    return AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


def _exited(proc: Any) -> bool:
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is not None
    return proc.returncode is not None  # asyncio.subprocess.Process


def wait_until(
    cond: Callable[[], T],
    timeout: float = 30.0,
    what: str = "the condition",
    *,
    interval: float = 0.05,
    proc: Any = None,
) -> T:
    """Call ``cond`` until it returns something true and return that; `AssertionError` after
    ``timeout`` seconds, or at once when ``proc`` (a process the condition depends on) exits."""
    deadline = time.monotonic() + timeout
    while True:
        last = cond()
        if last:
            return last
        if (proc is not None and _exited(proc)) or time.monotonic() > deadline:
            raise _failed(what, timeout, proc, last)
        time.sleep(interval)


async def until(
    cond: Callable[[], T | Awaitable[T]],
    timeout: float = 30.0,
    what: str = "the condition",
    *,
    interval: float = 0.05,
    proc: Any = None,
) -> T:
    """`wait_until` inside an event loop: ``cond`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        last = cond()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last  # type: ignore[return-value]
        if (proc is not None and _exited(proc)) or time.monotonic() > deadline:
            raise _failed(what, timeout, proc, last)
        await asyncio.sleep(interval)
