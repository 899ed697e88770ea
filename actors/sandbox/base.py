"""The sandbox contract: one sandbox per rollout, a few async verbs, two backends.

The contract is deliberately small: create from a `SandboxSpec`, `run` commands, move files in
and out, `destroy`. Everything a rollout needs (the harness run, copying hidden reward files in
after the harness exited, the verifier run, copying the final workspace out) is made of these.

Invariants every backend keeps:

* The workspace is the only host state a sandbox can write; nothing else of the host is
  writable, and nothing of the host that is not explicitly bound (read-only) is readable.
* The sandbox has no network except its own loopback; the only way out is the proxy forwarder
  (``127.0.0.1:<proxy_port>`` inside relays to the ``proxy_socket`` unix socket on the host).
* ``run`` never outlives its wall-clock limit: on timeout the command and every process it
  started are killed, and ``run`` returns with ``timed_out=True``.
* Host-side file verbs (`read_file`, `write_file`, `copy_in`, `copy_out`) never follow a
  symlink planted inside the workspace, so a sandbox cannot trick the host into reading or
  writing outside it.
* `destroy` is idempotent and leaves nothing behind; `SandboxBackend.sweep` removes what dead
  owners left behind.
* A spec's ``environment`` is present, read-only at ``/opt/hrl/env``, for every command of the
  sandbox, whoever set ``PATH`` (its ``bin`` is put first).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import os
import posixpath
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from harnessrl.actors.sandbox.quota import DiskWatch
from harnessrl.common.procs import kill_tree
from harnessrl.common.tasks.model import TaskEnv

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

DEFAULT_OUTPUT_CAP = 4 * MiB
DEFAULT_PROXY_PORT = 18080
MAX_READ_BYTES = 256 * MiB
"""Largest workspace file `SandboxBase.read_file` returns by default."""
PATH_INSIDE = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""``$PATH`` of commands inside a sandbox unless they set their own."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (setup, isolation, bookkeeping) — not the command inside it.

    A rollout whose sandbox raised this is discarded (``status = sandbox_error``).
    """


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of one `Sandbox.run`."""

    returncode: int
    """Exit status; 128+N when the command died of signal N; -9 when `run` killed it."""
    stdout: bytes
    """At most ``Limits.output_cap_bytes`` bytes; the rest is read and dropped."""
    stderr: bytes
    timed_out: bool
    """The wall-clock limit ran out and the whole process tree was killed."""
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    killed: str = ""
    """Non-empty when the sandbox was killed from outside while the command ran (not by `run`'s
    own timeout, not by the command itself): the OOM killer, an operator, the infrastructure.
    Says what was killed; the command's outcome then says nothing about the command."""
    cpu_s: float | None = None
    """CPU seconds (user + system) of the command and of the processes it waited for, as its
    launcher inside the sandbox measured them (bwrap runs with a proxy); None: not measured.
    Independent of how busy the machine is, unlike ``duration_s``."""
    disk_exceeded: int = 0
    """Bytes the sandbox held when it went over ``Limits.disk_bytes`` and was stopped (the
    command killed with it); 0: it did not."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# -- the forwarder's status report (``_forwarder.py --status-fd``) ---------------------------


@dataclass(frozen=True, slots=True)
class LauncherStatus:
    """The forwarder's report of how the command ended: ``exit N`` / ``signal N``, ``cpu S``."""

    kind: str
    n: int
    cpu_s: float | None = None


def read_status(fd: int | None) -> LauncherStatus | None:
    """The forwarder's status line from the status pipe (None: no pipe, or nothing written)."""
    if fd is None:
        return None
    try:
        os.set_blocking(fd, False)
        words = os.read(fd, 128).decode().split()
        cpu = float(words[3]) if len(words) >= 4 and words[2] == "cpu" else None
        return LauncherStatus(words[0], int(words[1]), cpu)
    except (OSError, ValueError, UnicodeDecodeError, IndexError):
        return None


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def killed_from_outside(rc: int, status: LauncherStatus | None, forwarded: bool) -> str:
    """Why a command that ``run`` did not kill was killed from outside the sandbox ("" when it
    ended on its own). ``rc``: the sandbox process's return code (negative: died of a signal);
    ``status``: what the forwarder reported (`read_status`); ``forwarded``: a forwarder ran.
    What tells, in order:

    * the sandbox process (bwrap) itself died of a signal: only something outside sends it
      one (an operator, the infrastructure, the OOM killer);
    * the forwarder (the command's parent inside) reported that the command died of SIGKILL:
      nothing in the sandbox's own limits sends SIGKILL (RLIMIT_DATA fails allocations,
      RLIMIT_FSIZE sends SIGXFSZ), the kernel's OOM killer and kills from outside do;
    * the forwarder was started but reported nothing and the sandbox ended with a signal
      status (128+N): the forwarder or the sandbox's init was killed before the command ended
      (init cannot be signalled from inside its pid namespace).

    A command that exits with any status by itself, 137 included, or dies of another signal
    (a crash: SIGSEGV, SIGABRT...), reports that, and is not "killed". A SIGKILL sent from
    inside the sandbox to the harness's top process (a tool running ``kill -9`` on it) is
    judged killed too: such a rollout is tombstoned, never trained, which is the safe side.
    """
    if rc < 0:
        return f"the sandbox process was killed by {_signame(-rc)}"
    if status is not None:
        if status.kind == "signal" and status.n == signal.SIGKILL:
            return "the command was killed by SIGKILL (the OOM killer or a kill from outside)"
        return ""
    if forwarded and rc > 128:
        return (
            f"the sandbox's init or launcher died of {_signame(rc - 128)} before the command ended"
        )
    return ""


@dataclass(slots=True)
class Limits:
    """Resource limits of a sandbox. ``None`` means "inherit the host's limit"."""

    memory_bytes: int | None = 8 * GiB
    """Per process: RLIMIT_DATA for bwrap (heap + private writable mappings; reserved but
    untouched address space does not count, so Node/Go/Bun runtimes still start)."""
    max_processes: int | None = 1024
    """Processes + threads (RLIMIT_NPROC, or pids limit for Docker)."""
    max_file_size: int | None = 4 * GiB
    """Largest file a process may write (RLIMIT_FSIZE; SIGXFSZ beyond); at most
    ``disk_bytes`` when that is set."""
    disk_bytes: int | None = None
    """Bytes the sandbox may hold across all its writable mounts (workspace, home, ``/tmp``,
    ``/dev/shm``); beyond, it is stopped (`ExecResult.disk_exceeded`; see ``quota.py``).
    None: no limit."""

    def file_size_limit(self) -> int | None:
        """RLIMIT_FSIZE to set: ``max_file_size``, no more than ``disk_bytes``."""
        sizes = [v for v in (self.max_file_size, self.disk_bytes) if v is not None]
        return min(sizes) if sizes else None

    max_open_files: int | None = None
    """RLIMIT_NOFILE."""
    wall_clock_s: float = 3600.0
    """Default timeout of `Sandbox.run` when the call gives none."""
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP
    """Bytes of stdout and of stderr kept by `Sandbox.run` (each)."""


@dataclass(slots=True)
class SandboxSpec:
    """What a rollout asks of its sandbox. Paths named "host" are on the actor's machine."""

    workspace_src: Path | None = None
    """Host directory copied (never bound) into the fresh workspace; ``None``: start empty.
    It must not contain the task's hidden reward files."""
    workdir: str = "/workspace"
    """Mount point of the workspace inside the sandbox (e.g. a task's input_mount_dir such as
    ``/root/.openclaw/workspace``); the default cwd of `Sandbox.run`."""
    home: str = "/home/hrl"
    """``$HOME`` inside; backed by a private per-sandbox directory (the host's home is never
    visible). ``workdir`` may lie below it."""
    proxy_socket: Path | None = None
    """Host unix socket of this rollout's proxy; ``None``: no forwarder, no way out at all."""
    proxy_port: int = DEFAULT_PROXY_PORT
    """Loopback port inside the sandbox where the forwarder listens (``$HRL_PROXY_URL``)."""
    ro_binds: list[tuple[Path, str]] = field(default_factory=list)
    """Extra read-only binds ``(host_path, inside_path)``, e.g. a harness install dir."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every command (on top of a minimal base; the host's is never inherited)."""
    limits: Limits = field(default_factory=Limits)
    owner: str = "hrl"
    """Who owns the sandbox (e.g. the actor's name); part of the host state dir's name."""
    hostname: str = "hrl-sandbox"
    environment: TaskEnv | None = None
    """The task's environment (a ``python`` command, pip packages): built once per content by
    the backend, read-only at ``/opt/hrl/env`` inside, its ``bin`` first on every command's
    ``PATH`` (see ``actors/sandbox/envs.py``); None or empty: the base userland only. A build
    that fails makes `SandboxBackend.create` raise `SandboxError`."""

    def __post_init__(self) -> None:
        self.workdir = _inside_abs(self.workdir, "workdir")
        self.home = _inside_abs(self.home, "home")
        self.owner = re.sub(r"[^A-Za-z0-9_.-]", "_", self.owner)[:48] or "hrl"
        if not 0 < self.proxy_port < 65536:
            raise ValueError(f"proxy_port out of range: {self.proxy_port}")
        self.ro_binds = [(Path(h), _inside_abs(i, "ro_binds")) for h, i in self.ro_binds]
        for k, v in self.env.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise ValueError(f"bad environment variable {k!r}")


def _inside_abs(path: str, what: str) -> str:
    p = posixpath.normpath(path)
    if not p.startswith("/") or p == "/" or p.startswith("//"):
        raise ValueError(f"{what} must be an absolute path below /: {path!r}")
    return p


def workspace_relpath(workdir: str, path: str) -> str:
    """``path`` (relative to ``workdir`` or absolute inside it) as a normalised relative path.

    Raises `SandboxError` for anything that points outside the workspace.
    """
    if posixpath.isabs(path):
        p = posixpath.normpath(path)
        if p == workdir:
            return "."
        if not p.startswith(workdir.rstrip("/") + "/"):
            raise SandboxError(f"path outside the workspace: {path!r}")
        return posixpath.relpath(p, workdir)
    rel = posixpath.normpath(path)
    if rel == ".." or rel.startswith("../"):
        raise SandboxError(f"path outside the workspace: {path!r}")
    return rel


@runtime_checkable
class Sandbox(Protocol):
    """One isolated workspace + process environment for one rollout."""

    workdir: str
    """Path of the workspace inside the sandbox."""

    async def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        proxy: bool = True,
    ) -> ExecResult:
        """Run ``argv`` inside (cwd defaults to `workdir`, timeout to ``limits.wall_clock_s``).

        Every process the command starts dies when it exits or times out. stdin is /dev/null
        unless given. A failure of the sandbox itself raises `SandboxError`. ``proxy=False``:
        the command cannot reach the proxy (no ``$HRL_PROXY_URL``, nothing listening on the
        proxy port) and starts no forwarder — for everything but the harness (the verifier,
        file operations), which needs no model API.
        """
        ...

    async def read_file(self, path: str) -> bytes:
        """A regular file of the workspace (relative to `workdir`, or absolute inside it).

        Raises FileNotFoundError when it is missing, `SandboxError` for anything that is not a
        regular file reached without symlinks.
        """
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a workspace file (parent directories are created)."""
        ...

    async def copy_in(self, host_src: Path, dest: str) -> None:
        """Copy a host file or directory tree to ``dest`` in the workspace (merging dirs)."""
        ...

    async def copy_out(self, dest_host: Path) -> None:
        """Copy the whole workspace to a new (or empty) host directory; symlinks stay links,
        special files are skipped."""
        ...

    async def destroy(self) -> None:
        """Kill everything still running and remove all host state. Idempotent."""
        ...

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, *exc: object) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """Makes sandboxes of one kind (``bwrap``, ``docker``)."""

    name: str

    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A fresh sandbox; raises `SandboxError` when it cannot be made."""
        ...

    async def sweep(self) -> int:
        """Remove sandboxes whose owner process is dead (and kill what they left running).

        Returns how many were removed. Safe to call while live owners use the same state root.
        """
        ...

    async def close(self) -> None:
        """Destroy every sandbox this backend created and is still alive."""
        ...


class SandboxBase:
    """What every backend's sandbox shares: the base environment of its commands, the
    host-side file verbs on the workspace folder, and ``async with`` destroying it on exit.

    A subclass sets ``spec``, ``workdir``, ``workspace_host`` (the workspace's host folder),
    ``_owner`` (``(uid, gid)`` that files written from the host get, or None: the actor's) and
    ``_destroyed``, and implements ``run`` and ``destroy``.
    """

    spec: SandboxSpec
    workdir: str
    workspace_host: Path
    _owner: tuple[int, int] | None
    _destroyed: bool

    def base_env(self, *, proxy: bool = True) -> dict[str, str]:
        """The environment every command starts from (``spec.env`` over a minimal base; the
        host's is never inherited); ``$HRL_PROXY_URL`` when the sandbox has a proxy and the
        command may use it (``proxy``)."""
        spec = self.spec
        env = {
            "PATH": PATH_INSIDE,
            "HOME": spec.home,
            "USER": "hrl",
            "LOGNAME": "hrl",
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "TERM": "dumb",
            "HOSTNAME": spec.hostname,
        }
        if spec.proxy_socket is not None and proxy:
            env["HRL_PROXY_URL"] = f"http://127.0.0.1:{spec.proxy_port}"
        return env | spec.env

    def _check_alive(self) -> None:
        if self._destroyed:
            raise SandboxError("sandbox destroyed")

    # -- the disk quota (``quota.py``): a backend gives its writable host folders and a way
    # -- to stop everything, and runs each command inside ``self._disk_watched()``

    _disk: DiskWatch | None = None

    def disk_paths(self) -> list[Path]:
        """Host folders of the sandbox's writable mounts (the disk quota's)."""
        return [self.workspace_host]

    def disk_extra(self) -> int:
        """Bytes the sandbox holds outside `disk_paths` (docker: its ``/tmp`` tmpfs)."""
        return 0

    def _over_quota(self) -> None:
        """Stop every process of the sandbox (it went over its disk quota): by default the
        process tree of each command running (``_procs``: bwrap's, whose pid namespace then
        takes the rest)."""
        for proc in list(getattr(self, "_procs", ())):
            kill_tree(proc.pid)

    def _disk_watched(self) -> Any:
        """Context of one command: the disk quota's watchdog runs while it does."""
        limit = self.spec.limits.disk_bytes
        if limit is None:
            return contextlib.nullcontext()
        if self._disk is None:
            self._disk = DiskWatch(
                self.disk_paths(), limit, self._over_quota, extra=self.disk_extra
            )
        return self._disk.watching()

    def _quota_checked(self, res: ExecResult) -> ExecResult:
        """``res`` of a command the quota may have stopped: then it says so, and the stop is
        the sandbox's own doing, not a death from outside."""
        if self._disk is not None and self._disk.exceeded:
            return dataclasses.replace(res, disk_exceeded=self._disk.exceeded, killed="")
        return res

    @property
    def disk_watch(self) -> DiskWatch | None:
        """The quota's watchdog (None until a command ran with a quota)."""
        return self._disk

    async def read_file(self, path: str, *, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """See `Sandbox.read_file` (``max_bytes``: larger files raise `SandboxError`)."""
        self._check_alive()
        rel = workspace_relpath(self.workdir, path)
        return await self._fs("read_file", self.workspace_host, rel, max_bytes)

    async def write_file(self, path: str, data: bytes) -> None:
        """See `Sandbox.write_file`."""
        self._check_alive()
        rel = workspace_relpath(self.workdir, path)
        await self._fs("write_file", self.workspace_host, rel, data, self._owner)

    async def copy_in(self, host_src: Path, dest: str) -> None:
        """See `Sandbox.copy_in`."""
        self._check_alive()
        rel = workspace_relpath(self.workdir, dest)
        await self._fs("copy_in", Path(host_src), self.workspace_host, rel, self._owner)

    async def copy_out(self, dest_host: Path) -> None:
        """See `Sandbox.copy_out`."""
        self._check_alive()
        await self._fs("copy_out", self.workspace_host, Path(dest_host))

    @staticmethod
    async def _fs(name: str, *args):
        """``_fs.<name>(*args)`` in a thread; OS errors other than a missing file become
        `SandboxError`."""
        from harnessrl.actors.sandbox import _fs  # imports this module

        try:
            return await asyncio.to_thread(getattr(_fs, name), *args)
        except (SandboxError, FileNotFoundError):
            raise
        except OSError as e:
            raise SandboxError(f"{name}: {e}") from e

    async def destroy(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()


class SandboxPool:
    """Sandboxes made ahead and removed behind, so a rollout waits for neither.

    A backend hands over two functions, plain (run in a thread) or coroutine functions:
    ``make()`` builds one *blank* sandbox (what does not depend on the rollout: bwrap's
    folders, lock and uid; docker's started container of the last spec's shape) and
    ``discard(blank)`` removes one with everything it holds. The pool keeps up to ``size``
    blanks ready; `take` returns one at once (None when empty: the caller makes its own) and
    starts a refill in the background. The backend gives a taken blank the rollout's spec.
    `remove_later` runs ``discard`` on a destroyed sandbox's state in the background.

    A blank is used once: a sandbox is never reset and handed out again, so nothing of one
    rollout can reach the next. ``size`` 0 turns all of it off (`take` always None).
    Background work counts: the benchmark measures CPU per sandbox with refills included.
    """

    def __init__(self, make, discard, size: int = 0) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0: {size}")
        self.size = size
        """Blanks kept ready (0: no pool)."""
        self.made = 0
        """Blanks made by the background refill (for tests and benchmarks)."""
        self._make, self._discard = make, discard
        self._ready: list = []
        self._refill: asyncio.Task | None = None
        self._removals: set[asyncio.Task] = set()
        self._closed = False
        self.error: str = ""
        """Why the last refill failed ("" when it did not); `take` then returns None and the
        backend's own create reports the error where it belongs."""

    def __len__(self) -> int:
        return len(self._ready)

    def take(self):
        """A ready blank (None when there is none), and a refill started."""
        blank = self._ready.pop() if self._ready else None
        self.refill()
        return blank

    def refill(self) -> None:
        """Start filling up to `size` in the background (no-op when full or running)."""
        if self._closed or not self.size or len(self._ready) >= self.size:
            return
        if self._refill is None or self._refill.done():
            self._refill = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        while not self._closed and len(self._ready) < self.size:
            try:
                blank = await self._call(self._make)
            except Exception as e:  # the next create makes its own and raises there
                self.error = f"{type(e).__name__}: {e}"
                return
            if self._closed or len(self._ready) >= self.size:  # closed or shrunk meanwhile
                await self._call(self._discard, blank)
                return
            self._ready.append(blank)
            self.made += 1
        self.error = ""

    async def wait_full(self) -> None:
        """Until the running refill (if any) has finished (tests, benchmarks)."""
        if self._refill is not None:
            await asyncio.shield(self._refill)

    def remove_later(self, state) -> None:
        """``discard(state)`` in the background; `close` waits for it."""
        task = asyncio.get_running_loop().create_task(self._call(self._discard, state))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def drain(self) -> None:
        """Until every background removal started so far has finished."""
        while self._removals:
            await asyncio.gather(*list(self._removals), return_exceptions=True)

    async def close(self) -> None:
        """Stop refilling, remove the ready blanks, wait for background removals. The pool
        can be used again afterwards (a backend restarted by ``start``)."""
        self._closed = True
        if self._refill is not None:
            with contextlib.suppress(Exception):
                await self._refill
            self._refill = None
        ready, self._ready = self._ready, []
        for blank in ready:
            await self._call(self._discard, blank)
        await self.drain()
        self._closed = False

    def clear(self) -> None:
        """Remove the ready blanks in the background (they no longer fit what is asked)."""
        ready, self._ready = self._ready, []
        for blank in ready:
            self.remove_later(blank)

    @staticmethod
    async def _call(fn, *args):
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)
