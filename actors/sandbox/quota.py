"""A sandbox's disk quota: the bytes it holds across all its writable mounts, at most
``Limits.disk_bytes``.

Mechanism: a **watchdog** in the actor. Where a sandbox's writable mounts are host folders
(bwrap: ``workspace``, ``home``, ``tmp`` and ``/dev/shm``, all in its state dir; docker: the
workspace and home binds), nothing in the kernel bounds their total: bubblewrap 0.8 cannot size
a tmpfs, and a size-limited filesystem per sandbox (a loop-mounted ext4 image, a project quota)
needs root, loop devices or an xfs host, which the shipped k8s pod (non-root, its own user
namespace) and most containers do not have. So while any command of the sandbox runs,
`DiskWatch` sums the allocated bytes of those folders (``st_blocks``: a sparse file counts what
it holds; hard links once), plus what `DiskWatch.extra` reports (docker: its ``/tmp`` and
``/dev/shm`` tmpfs, read with ``statvfs`` through the container's init; the ``/tmp`` tmpfs is
also sized at most the quota), every ``interval`` seconds (0.5), stretched to twenty times
the last walk's time: the watchdog costs at most 5 % of a core whatever the tree (measured by
``benchmarks/disk_quota.py``: ~0.2 % with a task-sized workspace, ~5 % with 20,000 files). A
walk of a few ms is made on the event loop, longer ones in a worker thread.

Past the limit it calls ``on_exceeded`` once: the backend kills every process of the sandbox,
and the command's `ExecResult.disk_exceeded` says how many bytes it held; a command that wrote
past the limit faster than one interval and ended is caught by a last measurement when it
ends. The sandbox is gone within a second of crossing the limit (for trees up to ~20,000
files; beyond, within the stretched interval); what it wrote meanwhile is bounded by its write
speed over that time, and no single file grows past the limit (RLIMIT_FSIZE is capped at it).
The rollout then counts as the harness's failure: scored 0, never verified
(``actors/rollout.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("harnessrl.sandbox")

INTERVAL_S = 0.5
"""Seconds between two measurements (at least; see the module docstring)."""
INLINE_S = 0.002
"""A walk that took less than this is done on the event loop next time (handing a tiny walk
to a worker thread costs more than the walk)."""


def disk_usage(paths: list[Path]) -> int:
    """Allocated bytes of every file and folder below ``paths`` (symlinks not followed, a
    hard-linked file once); files that vanish meanwhile are skipped."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(p) for p in paths]
    while stack:
        top = stack.pop()
        try:
            it = os.scandir(top)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return total


def tmpfs_used(path: str) -> int:
    """Bytes used on the filesystem at ``path`` (0 when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class DiskWatch:
    """Measures a sandbox's writable folders while its commands run (see the module
    docstring); ``exceeded`` is the bytes it held once it went over ``limit`` (0 until then)."""

    def __init__(
        self,
        paths: list[Path],
        limit: int,
        on_exceeded: Callable[[], None],
        *,
        extra: Callable[[], int] | None = None,
        interval: float = INTERVAL_S,
    ) -> None:
        self.paths, self.limit, self.on_exceeded = paths, limit, on_exceeded
        self.extra = extra
        self.interval = interval
        self.exceeded = 0
        self.walks = 0
        """Measurements made (all commands together)."""
        self._last_s = 1.0
        """How long the last measurement took (wall)."""
        self.cpu_s = 0.0
        """Thread CPU seconds spent measuring."""
        self._users = 0
        self._task: asyncio.Task[None] | None = None

    def used(self) -> int:
        t0 = time.thread_time()
        try:
            return disk_usage(self.paths) + (self.extra() if self.extra is not None else 0)
        finally:
            self.cpu_s += time.thread_time() - t0
            self.walks += 1

    @contextlib.asynccontextmanager
    async def watching(self):
        """Measure while the body (one command) runs; overlapping commands share one watch."""
        self._users += 1
        if self._task is None and not self.exceeded:
            self._task = asyncio.create_task(self._watch())
        try:
            yield self
        finally:
            self._users -= 1
            if self._users == 0 and self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
                self._task = None
                if not self.exceeded:  # a writer faster than one interval: look once more
                    await self._check(await self._measure())

    async def _measure(self) -> int:
        t0 = time.monotonic()
        if self._last_s < INLINE_S:
            used = self.used()
        else:
            used = await asyncio.to_thread(self.used)
        self._last_s = time.monotonic() - t0
        return used

    async def _watch(self) -> None:
        while True:
            if await self._check(await self._measure()):
                return
            await asyncio.sleep(max(self.interval, 20 * self._last_s))

    async def _check(self, used: int) -> bool:
        """Whether ``used`` is over the limit (then: stop the sandbox, once)."""
        if used <= self.limit:
            return False
        self.exceeded = used
        log.warning(
            "sandbox over its disk quota: %d bytes held, limit %d: stopping it", used, self.limit
        )
        self.on_exceeded()
        return True
