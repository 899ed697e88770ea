"""Preloaded starts of Python harnesses: the actor's side.

A cold start of mini-swe-agent spends 3.5-4.3 s of CPU importing litellm and its other
libraries before its first model call, every rollout; on a few cores that, not the model, sets
the rollout rate. An adapter that declares a `Preload` (its interpreter, its ``-m`` entry
module, the libraries to import ahead and the environment they are imported with) can instead
be started by a long-lived *preloader* (``_preloader.py``, one per actor process and
declaration) that has imported them once and forks a copy of itself into each rollout's
sandbox (a forked start costs ~0.4 s of CPU).

The launch keeps the sandbox's command chain (uid drop, rlimits, the proxy forwarder and its
status report) as it is; only the harness's argv gets a prefix, the client
(``_preload_client.py``), which hands its argv, environment, cwd and stdio to the preloader
and ends as the harness ends. The harness's code, argv and environment are those of the cold
start, so what it sends the model is the same; a client that finds no preloader, or a request
the preloader does not serve, starts the harness cold. `PreloadPool.take_cpu` gives the
harness's CPU seconds back to the rollout (the sandbox's accounting counts the client only).

Needs the bubblewrap backend in root mode (the preloader joins the sandbox's namespaces);
elsewhere rollouts start cold. ``harness_preload = false`` turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harnessrl.actors.harnesses.base import LaunchSpec

log = logging.getLogger(__name__)

PRELOADER_SRC = Path(__file__).with_name("_preloader.py")
CLIENT_SRC = Path(__file__).with_name("_preload_client.py")
CLIENT_INSIDE = "/run/hrl/preload-client.py"
SOCKET_DIR_INSIDE = "/run/hrl/preload"
"""Where the preloader's folder (holding only its socket) is bound: a folder, so that a
sandbox can start (and its client start cold) even when the socket is gone."""
SOCKET_INSIDE = f"{SOCKET_DIR_INSIDE}/sock"
RUN_ENV = "HRL_PRELOAD_RUN"
"""Names the run in the preloader's CPU report; the client takes it out of the harness's
environment."""
START_TIMEOUT_S = 120.0
RETRY_AFTER_S = 60.0
"""A preloader that failed to start is tried again after this long (rollouts start cold)."""


@dataclass(frozen=True, slots=True)
class Preload:
    """How an adapter's harness can be started preloaded (``LaunchSpec.preload``)."""

    python: Path
    """The harness's interpreter on the host (its venv's ``bin/python``)."""
    entry: str
    """The module the harness runs as ``python -m``: argv must be ``[python, "-m", entry, ...]``."""
    modules: tuple[str, ...]
    """Imported ahead by the preloader: libraries with no per-rollout state at import."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment the modules are imported with (the same in every rollout of the harness,
    e.g. ``LITELLM_LOCAL_MODEL_COST_MAP``)."""
    binds: tuple[tuple[Path, str], ...] = ()
    """Extra read-only binds a preloaded run needs: the install at its host path, where the
    preloader's imported modules (and the ones they import later) are found."""


class Preloader:
    """One preloader process (see ``_preloader.py``)."""

    def __init__(
        self,
        preload: Preload,
        folder: Path,
        min_uid: int,
        *,
        per_uid: int = 2,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.preload, self.folder, self.min_uid = preload, folder, min_uid
        self.per_uid, self.request_timeout_s = per_uid, request_timeout_s
        """Runs served at once for one uid (more: cold starts), and how long a client has to
        send its request: bounds what one sandbox can make the preloader hold."""
        folder.mkdir(mode=0o755)
        os.chmod(folder, 0o755)  # sandbox uids reach the socket through it (bound read-only)
        self.socket_path = folder / "sock"
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = folder.with_name(folder.name + ".log")
        self._report: int | None = None
        self._buf = b""
        self._cpu: dict[str, float] = {}

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start it and wait until it has imported its modules and listens; raises
        `RuntimeError` (with its stderr's tail) when it does not."""
        p = self.preload
        argv = [str(p.python), "-s", "-E", "-B", str(PRELOADER_SRC)]
        r, w = os.pipe()
        argv += ["--socket", str(self.socket_path), "--report-fd", str(w)]
        argv += ["--entry", p.entry, "--min-uid", str(self.min_uid), "--parent", str(os.getpid())]
        argv += ["--per-uid", str(self.per_uid), "--request-timeout", str(self.request_timeout_s)]
        for m in p.modules:
            argv += ["--import", m]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
        env |= dict(p.env)
        self._report = r
        os.set_blocking(r, False)
        with open(self.log_path, "wb") as err:
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=err,
                    env=env,
                    pass_fds=(w,),
                    start_new_session=True,
                )
            except BaseException:
                await self.close()  # closes the report pipe
                raise
            finally:
                os.close(w)
        deadline = time.monotonic() + timeout
        while b"ready\n" not in self._buf:
            self._read()
            if b"ready\n" in self._buf:
                break
            if self.proc.returncode is not None or time.monotonic() > deadline:
                await self.close()
                tail = self.log_path.read_text(errors="replace")[-1500:].strip()
                raise RuntimeError(f"the preloader for {p.entry} did not start: {tail}")
            await asyncio.sleep(0.05)
        self._buf = self._buf.split(b"ready\n", 1)[1]

    def _read(self) -> None:
        if self._report is None:
            return
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while chunk := os.read(self._report, 65536):
                self._buf += chunk

    def _drain(self) -> None:
        self._read()
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            run, _, cpu = line.decode(errors="replace").partition(" ")
            with contextlib.suppress(ValueError):
                self._cpu[run] = float(cpu)
        if len(self._cpu) > 10_000:  # runs whose result was never asked for (failed launches)
            self._cpu.clear()

    def take_cpu(self, run: str) -> float | None:
        """The harness CPU seconds the preloader reported for ``run`` (None: not served)."""
        self._drain()
        return self._cpu.pop(run, None)

    async def close(self) -> None:
        """Stop accepting (runs already started finish with their sandboxes)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._report is not None:
            os.close(self._report)
            self._report = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()


@dataclass
class PreloadPool:
    """The preloaders of one actor process, one per `Preload`, started on first use."""

    folder: Path
    """Where their sockets and logs live (the actor's socket folder)."""
    min_uid: int
    """Lowest uid served (the bwrap backend's first sandbox uid)."""
    client_python: str = "/usr/bin/python3"
    """The interpreter that runs the client inside the sandbox."""
    _live: dict[Preload, Preloader] = field(default_factory=dict)
    _failed: dict[Preload, float] = field(default_factory=dict)
    _locks: dict[Preload, asyncio.Lock] = field(default_factory=dict)

    async def get(self, preload: Preload) -> Preloader | None:
        """The running preloader for ``preload``, started (or restarted) when needed; None
        when it cannot start (the harness then starts cold; tried again later)."""
        p = self._live.get(preload)
        if p is not None and p.alive:
            return p
        lock = self._locks.setdefault(preload, asyncio.Lock())
        async with lock:
            p = self._live.get(preload)
            if p is not None and p.alive:
                return p
            if p is not None:
                log.warning(
                    "the preloader for %s exited (%s); restarting it", preload.entry, p.log_path
                )
                await p.close()
            if time.monotonic() - self._failed.get(preload, -RETRY_AFTER_S) < RETRY_AFTER_S:
                return None
            name = f"preload-{len(self._live)}-{secrets.token_hex(3)}"
            try:
                p = Preloader(preload, self.folder / name, self.min_uid)
                await p.start()
            except (OSError, RuntimeError) as e:
                self._failed[preload] = time.monotonic()
                log.warning("%s; harnesses start cold", e)
                return None
            self._live[preload] = p
            return p

    def wrap(self, spec: LaunchSpec, preloader: Preloader) -> str:
        """Turn ``spec`` (whose ``preload`` ``preloader`` serves) into its preloaded form, in
        place; returns the run's name for `Preloader.take_cpu`."""
        run = secrets.token_hex(8)
        client = [self.client_python, "-I", "-S", CLIENT_INSIDE, SOCKET_INSIDE, "--"]
        spec.argv = [*client, *spec.argv]
        spec.env[RUN_ENV] = run
        spec.ro_binds += [
            (CLIENT_SRC, CLIENT_INSIDE),
            (preloader.folder, SOCKET_DIR_INSIDE),
            *preloader.preload.binds,
        ]
        return run

    async def close(self) -> None:
        for p in list(self._live.values()):
            await p.close()
        self._live.clear()


def supported(backend: object) -> bool:
    """Whether ``backend`` lets a preloader join its sandboxes (bubblewrap as root)."""
    return (
        getattr(backend, "name", "") == "bwrap"
        and getattr(backend, "mode", "") == "root"
        and os.geteuid() == 0
        and sys.platform.startswith("linux")
    )
