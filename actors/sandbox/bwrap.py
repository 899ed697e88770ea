"""Bubblewrap sandboxes: the embedded default backend (no daemon, ~ms per command).

Design (the simplest one that is correct):

* **State on the host, processes per command.** A sandbox is a host state dir
  ``<root>/<owner>-<pid>-<id>/`` holding ``workspace/``, ``home/``, ``tmp/``, generated
  ``etc/`` files (passwd, group, hosts, hostname) and ``lock`` (flock held by the owner for the
  sandbox's life; JSON: owner pid, uid). Every `BwrapSandbox.run` is a fresh ``bwrap`` with the
  same binds: state persists only through those dirs, and no daemon needs minding; what the
  actor keeps beside ``workspace/`` (hidden reward files) stays unseen.
* **What is visible inside:** read-only ``/usr`` (+ the ``/bin``, ``/lib*`` links), a curated
  read-only ``/etc`` (an allowlist copied once per host into a cache: no shadow, sudoers, ssh
  keys…; passwd/group/hosts/hostname are per sandbox, under ``/run/hrl/etc``), a fresh
  ``/proc`` and ``/dev``, the sandbox's own ``/tmp``, ``/dev/shm`` and ``$HOME`` (folders of
  its state), the workspace (read-write) at ``spec.workdir``, and
  ``spec.ro_binds``. The root is a read-only tmpfs: nothing else exists, in particular not
  the host's ``/root``, ``/home``, ``/tmp`` or the state dir's other files.
* **Namespaces:** pid, net (loopback only), ipc, uts (hostname), cgroup; ``--die-with-parent``
  and ``--new-session``. The pid namespace is what makes "kill the whole tree" exact: when the
  command exits, or bwrap is killed on timeout, the namespace's init dies and the kernel kills
  every process left in it — double-forked daemons included.
* **Who runs inside.** As root (the usual actor), bwrap runs privileged *without* a user
  namespace, and ``setpriv`` drops to a per-sandbox host uid (allocated from ``uid_base`` with
  flock'ed lock files) with every capability gone and no_new_privs. A user namespace owned by
  root would leave the processes host uid 0, and the kernel exempts uid 0 from RLIMIT_NPROC;
  with a uid of its own, the sandbox's process limit holds for the whole sandbox and its files
  are nobody else's. As non-root, bwrap uses a user namespace (uid 1000 inside, mapped to the
  actor's uid); RLIMIT_NPROC is then counted per user namespace, i.e. per `run`.
* **Limits:** ``prlimit`` sets RLIMIT_NPROC / DATA / FSIZE / NOFILE / CORE=0 inside, after the
  uid drop (the compiled forwarder sets them itself: one exec less); the wall clock: ``killpg``
  of bwrap's session, the pid namespace the rest; disk (workspace, home, tmp, shm): ``quota.py``.
* **Task environment:** a spec's ``environment`` is built once per content into
  ``<env_cache_dir>/bwrap-<name>-<hash>/env`` (a venv over the host's ``python3``, made
  inside a bwrap with the folder bound where sandboxes see it; see ``envs.py``), bound
  read-only at ``/opt/hrl/env`` and put first on each command's ``PATH``.
* **Proxy forwarder:** when ``spec.proxy_socket`` is set, the host socket is bound at
  ``/run/hrl/proxy.sock`` and the command is wrapped in the forwarder, which listens on
  ``127.0.0.1:<proxy_port>`` in the command's own network namespace before starting it and
  relays each connection to the unix socket. The forwarder is ``_forwarder.c``, compiled once
  per host and source (``cc -O2``, cached under ``forwarder_cache_dir``): it starts in about a
  millisecond, where ``_forwarder.py`` (host python, stdlib only; the fallback where no C
  compiler works, or ``forwarder="python"``) costs a Python start-up on every run. A run with
  ``proxy=False`` (the verifier, file operations) and every run of a sandbox without a proxy
  socket start no forwarder and see no socket: their own network namespace has nothing
  listening, so the model's API is out of their reach.
* **Warm pool** (``pool_size`` > 0, `base.SandboxPool`): blank state dirs (lock, uid, empty
  folders) are made ahead in the background as ``.new-<pid>-<id>``; `create` takes one, adds the
  spec's parts (etc files, mount points, the workspace copy) and renames it. A blank serves one
  sandbox only. `destroy` renames the state to ``.dead-<name>`` and removes it in the
  background, holding its lock and uid until it is gone; sweep removes a dead pool's blanks.
* **Killed from outside** (`ExecResult.killed`, see ``base.killed_from_outside``): bwrap's
  status cannot tell ``exit 137`` from SIGKILL, so the forwarder reports how the command ended
  (``exit N`` / ``signal N``) on a pipe passed to each run.

Needs: ``bubblewrap`` and ``util-linux`` (setpriv, prlimit); a C compiler (``cc``) or python3 for
the forwarder.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harnessrl.actors.sandbox import _fs
from harnessrl.actors.sandbox._bwrap_host import (
    _below,
    _Blank,
    _etc_files,
    _kill_uid,
    _no_private_keys,
    _read_capped,
    _setup_failed,
    _write_lock_info,
    build_forwarder,
)
from harnessrl.actors.sandbox._fs import _pid_alive, _try_lock
from harnessrl.actors.sandbox.base import (
    PATH_INSIDE,
    ExecResult,
    SandboxBase,
    SandboxError,
    SandboxPool,
    SandboxSpec,
    killed_from_outside,
    read_status,
)
from harnessrl.actors.sandbox.envs import (
    BUILD_ENV,
    ENV_INFO,
    ENV_INSIDE,
    INSTALL_TIMEOUT_S,
    WHEELS_INSIDE,
    EnvBuildError,
    EnvBuilds,
    Target,
    content_key,
    file_lock,
    install_script,
    log_env_build,
    probe_host_python,
    remove_leftovers,
    wheelhouse,
    with_env_path,
)
from harnessrl.actors.sandbox.envs import env_cache_dir as default_env_cache
from harnessrl.common.procs import kill_tree
from harnessrl.common.tasks.model import TaskEnv

DEFAULT_ROOT = Path(tempfile.gettempdir()) / "harnessrl-sandboxes"
DEFAULT_UID_LOCKS = Path(tempfile.gettempdir()) / "harnessrl-sandbox-uids"
USERNS_UID = 1000
RUN_DIR = "/run/hrl"
PROXY_SOCK_INSIDE = f"{RUN_DIR}/proxy.sock"
FORWARDER_INSIDE = f"{RUN_DIR}/forwarder.py"
FORWARDER_BIN_INSIDE = f"{RUN_DIR}/forwarder"
ETC_INSIDE = f"{RUN_DIR}/etc"
FORWARDER_SRC = Path(__file__).with_name("_forwarder.py")
FORWARDERS = ("auto", "c", "python")
"""``BwrapBackend(forwarder=...)``: the compiled one when it builds (auto), it or an error (c),
or always the Python one (python)."""

#: /etc entries bound read-only when present. Everything else of /etc stays invisible
#: (shadow, sudoers, ssh host keys, app secrets); passwd, group, hosts, hostname, nsswitch.conf
#: and resolv.conf are generated per sandbox.
ETC_ALLOW = (
    "alternatives",
    "bash.bashrc",
    "ca-certificates",
    "ca-certificates.conf",
    "crypto-policies",
    "debian_version",
    "gai.conf",
    "gitconfig",
    "host.conf",
    "inputrc",
    "issue",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "locale.conf",
    "localtime",
    "lsb-release",
    "magic",
    "magic.mime",
    "mime.types",
    "os-release",
    "perl",
    "pki",
    "profile",
    "profile.d",
    "protocols",
    "python3",
    f"python3.{sys.version_info.minor}",
    "services",
    "shells",
    "ssl",
    "terminfo",
    "timezone",
)
log = logging.getLogger("harnessrl.sandbox.bwrap")
_ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class BwrapBackend:
    """Creates `BwrapSandbox`es under ``root``; sweeps dead owners' leftovers on start.

    ``mode``: ``"auto"`` (``"root"`` when running as root, else ``"userns"``), ``"root"`` or
    ``"userns"`` — see the module docstring. ``python``: interpreter for the forwarder
    (default ``/usr/bin/python3`` when present, else this interpreter with its prefix bound).
    ``env_cache_dir``: where task environments are built (default ``$HARNESSRL_CACHE/envs``
    or ``~/.cache/harnessrl/envs``); ``env_python``: the sandboxes' ``python3`` they are
    built over. ``pool_size``: blank sandboxes kept ready, see `SandboxPool`. ``forwarder``:
    see `FORWARDERS` (``forwarder_kind`` says which one runs after `start`);
    ``forwarder_cache_dir``: where the compiled one is kept (default a folder per user in the
    temp dir).
    """

    name = "bwrap"

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        mode: str = "auto",
        bwrap: str | None = None,
        python: str | None = None,
        uid_base: int = 2_000_000_000,
        uid_count: int = 65536,
        uid_lock_dir: Path | str | None = None,
        etc_allow: tuple[str, ...] = ETC_ALLOW,
        etc_cache_dir: Path | str | None = None,
        sweep_on_start: bool = True,
        env_cache_dir: Path | str | None = None,
        env_python: str = "/usr/bin/python3",
        pool_size: int = 0,
        forwarder: str = "auto",
        forwarder_cache_dir: Path | str | None = None,
    ) -> None:
        if forwarder not in FORWARDERS:
            raise ValueError(f"forwarder must be one of {FORWARDERS}: {forwarder!r}")
        self.forwarder = forwarder
        self.forwarder_kind = "python" if forwarder == "python" else ""
        """The forwarder runs use: ``c`` or ``python`` (decided by `start`)."""
        self.forwarder_cache_dir = (
            Path(forwarder_cache_dir)
            if forwarder_cache_dir is not None
            else Path(tempfile.gettempdir()) / f"harnessrl-forwarder-{os.geteuid()}"
        )
        self._forwarder_bin: Path | None = None
        self.root = Path(root) if root is not None else DEFAULT_ROOT
        if mode == "auto":
            mode = "root" if os.geteuid() == 0 else "userns"
        if mode not in ("root", "userns"):
            raise ValueError(f"unknown bwrap mode {mode!r}")
        self.mode = mode
        self._bwrap = bwrap or shutil.which("bwrap") or "/usr/bin/bwrap"
        self._python, self._python_bind = self._pick_python(python)
        self.uid_base, self.uid_count = uid_base, uid_count
        self.uid_lock_dir = Path(uid_lock_dir) if uid_lock_dir is not None else DEFAULT_UID_LOCKS
        self.etc_allow = etc_allow
        self.etc_cache_dir = (
            Path(etc_cache_dir)
            if etc_cache_dir is not None
            else Path(tempfile.gettempdir()) / f"harnessrl-etc-{os.geteuid()}"
        )
        self.sweep_on_start = sweep_on_start
        self.env_cache_dir = default_env_cache(env_cache_dir)
        self.env_python = env_python
        self.env_builds = 0
        """Task environments this backend built (not found ready in the cache)."""
        self._envs = EnvBuilds()
        self._env_target: Target | None = None
        self._tools: dict[str, str] = {}
        self._version: tuple[int, ...] = (0,)
        self._started = False
        self._start_lock = asyncio.Lock()
        self._live: set[BwrapSandbox] = set()
        self._etc: Path | None = None
        self.pool = SandboxPool(self._blank_sync, self._discard_blank, pool_size)
        """Blank sandboxes made ahead, and sandboxes being removed in the background."""

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> BwrapBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Check bwrap works here, then sweep dead owners' leftovers. Idempotent."""
        async with self._start_lock:
            if self._started:
                return
            reason = await self.probe()
            if reason is not None:
                raise SandboxError(f"bubblewrap is not usable here: {reason}")
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            if self.mode == "root":
                self.uid_lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._etc = await asyncio.to_thread(self._shared_etc)
            await self._pick_forwarder()
            self._started = True
        if self.sweep_on_start:
            await self.sweep()
        self.pool.refill()

    async def _pick_forwarder(self) -> None:
        if self.forwarder == "python":
            self.forwarder_kind = "python"
            return
        try:
            self._forwarder_bin = await asyncio.to_thread(build_forwarder, self.forwarder_cache_dir)
            self.forwarder_kind = "c"
        except SandboxError as e:
            if self.forwarder == "c":
                raise
            log.warning("sandbox forwarder: %s; using the Python one (slower to start)", e)
            self.forwarder_kind = "python"

    async def probe(self) -> str | None:
        """None when sandboxes can run here, else why not (for skips and error messages)."""
        if not os.path.exists(self._bwrap):
            return "bwrap not installed (apt-get install bubblewrap)"
        for tool in ("prlimit", *(("setpriv",) if self.mode == "root" else ())):
            path = shutil.which(tool, path=PATH_INSIDE)
            if path is None:
                return f"{tool} not found (apt-get install util-linux)"
            self._tools[tool] = path
        proc = await asyncio.create_subprocess_exec(
            self._bwrap, "--version", stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        if m := re.search(rb"(\d+)\.(\d+)\.(\d+)", out):
            self._version = tuple(int(x) for x in m.groups())
        argv = [self._bwrap, *self._ns_args(), *self._system_binds(), "--", "/usr/bin/true"]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            return err.decode(errors="replace").strip() or f"bwrap exited {proc.returncode}"
        return None

    async def close(self) -> None:
        """Destroy this backend's live sandboxes and the pool's blanks; wait for removals."""
        for sb in list(self._live):
            await sb.destroy()
        await self.pool.close()

    def _shared_etc(self) -> Path:
        """The curated read-only /etc shared by sandboxes (one mount instead of forty).

        Copies of the ``etc_allow`` entries the host has (unreadable parts skipped; never
        ``ssl/private``), nsswitch/resolv.conf of our own, and symlinks into ``/run/hrl/etc``
        for the per-sandbox files. Built once per day and content of the host's entries (a few
        hundred files, slow on some disks) into ``etc_cache_dir/<hash>``, atomically; copies
        get fresh mtimes so /tmp cleaners do not eat a cache in use; week-old ones are pruned.
        """
        day = time.strftime("%Y%m%d", time.gmtime())
        h = hashlib.blake2b(f"layout 2 {day} {self.etc_allow}".encode(), digest_size=8)
        for name in self.etc_allow:
            for d, _, files in os.walk(Path("/etc") / name):
                for n in (d, *(os.path.join(d, f) for f in files)):
                    with contextlib.suppress(OSError):
                        st = os.lstat(n)
                        h.update(f"{n}:{st.st_mtime_ns}:{st.st_size}\n".encode())
            with contextlib.suppress(OSError):
                st = os.lstat(Path("/etc") / name)
                h.update(f"{name}:{st.st_mtime_ns}:{st.st_size}\n".encode())
        final = self.etc_cache_dir / h.hexdigest()
        if final.is_dir():
            return final
        self.etc_cache_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        for old in self.etc_cache_dir.iterdir():
            with contextlib.suppress(OSError):
                if time.time() - old.lstat().st_mtime > 7 * 86400:
                    _fs.rmtree(old)
        tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=self.etc_cache_dir))
        os.chmod(tmp, 0o755)
        for name in self.etc_allow:
            src = Path("/etc") / name
            with contextlib.suppress(OSError, shutil.Error):
                if src.is_symlink() or src.is_file():
                    shutil.copy(src, tmp / name, follow_symlinks=False)
                elif src.is_dir():
                    shutil.copytree(
                        src,
                        tmp / name,
                        symlinks=True,
                        ignore=_no_private_keys,
                        copy_function=shutil.copy,
                    )
        for fname in _etc_files(SandboxSpec(), 0):  # per sandbox: one bind at /run/hrl/etc
            (tmp / fname).unlink(missing_ok=True)
            (tmp / fname).symlink_to(f"{ETC_INSIDE}/{fname}")
        (tmp / "nsswitch.conf").write_text(
            "passwd: files\ngroup: files\nshadow: files\nhosts: files\n"
            "networks: files\nprotocols: files\nservices: files\n"
        )
        (tmp / "resolv.conf").write_text("# harnessrl sandbox: no network, no DNS\n")
        try:
            os.rename(tmp, final)
        except OSError:  # someone else built it meanwhile
            _fs.rmtree(tmp)
        return final

    # ------------------------------------------------------------------ create

    async def create(self, spec: SandboxSpec) -> BwrapSandbox:
        await self.start()
        env_dir = await self.environment(spec.environment)
        try:
            blank = self.pool.take()
            if blank is None:
                return await asyncio.to_thread(self._create_sync, spec, env_dir)
            return await asyncio.to_thread(self._adopt_sync, blank, spec, env_dir)
        except SandboxError:
            raise
        except OSError as e:
            raise SandboxError(f"cannot create sandbox: {e}") from e

    # ------------------------------------------------------------------ task environments

    async def environment(self, env: TaskEnv | None) -> Path | None:
        """The host folder of ``env``, built first when missing (once per content, across
        processes too); None for no or an empty environment. Raises `EnvBuildError`."""
        if env is None or env.empty:
            return None
        await self.start()
        return await self._envs.get(
            env.key(),
            lambda: asyncio.to_thread(self._env_sync, env),
            valid=lambda d: (d / ENV_INFO).is_file(),
        )

    def _env_sync(self, env: TaskEnv) -> Path:
        if self._env_target is None:
            self._env_target = probe_host_python(self.env_python)
        target = self._env_target
        python = os.path.realpath(self.env_python)
        key = content_key("bwrap", env.key(), target.__dict__, python)
        final = self.env_cache_dir / f"bwrap-{env.name}-{key}"
        if (final / "env" / ENV_INFO).is_file():
            return final / "env"
        self.env_cache_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(self.env_cache_dir / f".bwrap-{key}.lock"):
            if (final / "env" / ENV_INFO).is_file():
                return final / "env"
            t0 = time.monotonic()
            remove_leftovers(self.env_cache_dir, f".new-bwrap-{key}-")
            wheels = wheelhouse(env, target, self.env_cache_dir) if env.pip else None
            tmp = Path(tempfile.mkdtemp(prefix=f".new-bwrap-{key}-", dir=self.env_cache_dir))
            try:
                os.chmod(tmp, 0o755)
                (tmp / "env").mkdir(mode=0o755)
                argv = self._env_build_argv(tmp / "env", wheels, install_script(env, key))
                try:
                    p = subprocess.run(
                        argv,
                        env=BUILD_ENV,
                        stdin=subprocess.DEVNULL,
                        capture_output=True,
                        text=True,
                        timeout=INSTALL_TIMEOUT_S,
                    )
                except subprocess.TimeoutExpired:
                    raise EnvBuildError(
                        f"environment {env.name!r}: install timed out ({INSTALL_TIMEOUT_S:g} s)"
                    ) from None
                if p.returncode != 0 or not (tmp / "env" / ENV_INFO).is_file():
                    out = (p.stderr.strip() or p.stdout.strip())[-1500:]
                    raise EnvBuildError(
                        f"environment {env.name!r}: install failed (exit {p.returncode}): {out}"
                    )
                if final.exists():  # an incomplete leftover (complete ones are never replaced)
                    _fs.rmtree(final)
                os.rename(tmp, final)
            finally:
                if tmp.exists():
                    _fs.rmtree(tmp)
            self.env_builds += 1
            took = time.monotonic() - t0
            log_env_build(env, final / "env", took)
        return final / "env"

    def _env_build_argv(self, env_dir: Path, wheels: Path | None, script: str) -> list[str]:
        """bwrap running ``script`` over the host's /usr with ``env_dir`` at `ENV_INSIDE` and
        ``wheels`` at `WHEELS_INSIDE`: no network, no uid drop (the files are the actor's),
        no capabilities."""
        if self.mode == "root":
            ns = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
            ns += ["--unshare-cgroup-try", "--cap-drop", "ALL", "--die-with-parent"]
            ns += ["--new-session"]
        else:
            ns = self._ns_args()
        assert self._etc is not None
        args = [self._bwrap, *ns, *self._system_binds(), "--ro-bind", str(self._etc), "/etc"]
        args += ["--tmpfs", "/tmp", "--dir", posixpath.dirname(ENV_INSIDE)]
        args += ["--bind", str(env_dir), ENV_INSIDE]
        if wheels is not None:
            args += ["--ro-bind", str(wheels), WHEELS_INSIDE]
        return [*args, "--chdir", "/tmp", "--", "/bin/sh", "-c", script]

    # ------------------------------------------------------------------ create (sync part)

    def _create_sync(self, spec: SandboxSpec, env_dir: Path | None = None) -> BwrapSandbox:
        return self._adopt_sync(self._blank_sync(), spec, env_dir)

    def _blank_sync(self) -> _Blank:
        """A sandbox's state made before its spec is known: ``.new-<pid>-<id>/`` with its lock
        held (so sweep leaves it alone), a uid of its own (root mode) and the empty
        ``workspace``, ``home``, ``tmp`` and ``etc`` dirs."""
        sid = secrets.token_hex(4)
        tmp_dir = self.root / f".new-{os.getpid()}-{sid}"
        tmp_dir.mkdir(mode=0o700)
        lock_fd = _try_lock(tmp_dir / "lock")
        uid_fd, uid = None, USERNS_UID
        try:
            assert lock_fd is not None
            if self.mode == "root":
                uid_fd, uid = self._alloc_uid()
            _write_lock_info(lock_fd, "(blank)", sid, uid, self.mode)
            owner = (uid, uid) if self.mode == "root" else None
            subs = (("workspace", 0o755), ("home", 0o700), ("tmp", 0o1777), ("shm", 0o1777))
            for sub, mode in subs:
                d = tmp_dir / sub
                d.mkdir()
                os.chmod(d, mode)
                if owner:
                    os.chown(d, *owner)
            (tmp_dir / "etc").mkdir()
        except BaseException:
            for fd in (lock_fd, uid_fd):
                if fd is not None:
                    os.close(fd)
            _fs.rmtree(tmp_dir)
            raise
        return _Blank(tmp_dir, sid, uid, lock_fd, uid_fd)

    def _discard_blank(self, blank: _Blank) -> None:
        _fs.rmtree(blank.path)
        blank.close()

    def _adopt_sync(
        self, blank: _Blank, spec: SandboxSpec, env_dir: Path | None = None
    ) -> BwrapSandbox:
        """Give a blank state ``spec``'s parts (etc files, mount points, the workspace copy)
        and its final name ``<owner>-<pid>-<id>``; on failure the blank is removed."""
        name = f"{spec.owner}-{os.getpid()}-{blank.sid}"
        try:
            _write_lock_info(blank.lock_fd, spec.owner, blank.sid, blank.uid, self.mode)
            self._populate(blank.path, spec, blank.uid)
            state = self.root / name
            os.rename(blank.path, state)  # visible to sweep under its name, still locked
        except BaseException:
            self._discard_blank(blank)
            raise
        sb = BwrapSandbox(self, spec, state, blank.uid, blank.lock_fd, blank.uid_fd, env_dir)
        self._live.add(sb)
        return sb

    def _alloc_uid(self) -> tuple[int, int]:
        for i in range(self.uid_count):  # lowest free first: lock files stay few
            uid = self.uid_base + i
            fd = _try_lock(self.uid_lock_dir / str(uid))
            if fd is not None:
                return fd, uid
        raise SandboxError("no free sandbox uid")

    def _populate(self, state: Path, spec: SandboxSpec, uid: int) -> None:
        """The spec's parts of a blank state (see `_blank_sync`)."""
        owner = (uid, uid) if self.mode == "root" else None
        for inside, host in ((spec.home, "home"), ("/tmp", "tmp")):
            rel = spec.workdir.removeprefix(inside + "/")
            if rel != spec.workdir:  # workdir lies below home or /tmp: pre-make its mount point
                _fs.make_dirs(state / host, rel, owner)
        if spec.workspace_src is not None:
            if not spec.workspace_src.is_dir():
                raise SandboxError(f"workspace_src is not a directory: {spec.workspace_src}")
            _fs.copy_in(spec.workspace_src, state / "workspace", ".", owner)
        for fname, text in _etc_files(spec, uid).items():
            (state / "etc" / fname).write_text(text)

    # ------------------------------------------------------------------ sweep

    async def sweep(self) -> int:
        return await asyncio.to_thread(self._sweep_sync)

    def _sweep_sync(self) -> int:
        removed = 0
        for entry in os.scandir(self.root) if self.root.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):  # moved meanwhile by its own process
                removed += self._sweep_entry(entry)
        return removed

    def _sweep_entry(self, entry: os.DirEntry) -> int:
        """Remove one entry of the root if its owner is gone (1), else leave it (0)."""
        path = Path(entry.path)  # (a blank's pool holds its lock while alive)
        if entry.name.startswith(".new-"):
            # a blank, or a create() half-way: ``.new-<pid>-<id>``, locked right after the mkdir
            young = time.time() - entry.stat(follow_symlinks=False).st_mtime <= 5
            if young and _pid_alive(entry.name.split("-")[1]):
                return 0
        elif entry.name.startswith(".") and not entry.name.startswith(".dead-"):
            return 0
        if not entry.is_dir(follow_symlinks=False):
            return 0
        lock = path / "lock"
        fd = _try_lock(lock) if lock.exists() else -1
        if fd is None:
            return 0  # owner alive (flock held)
        try:
            if not path.exists():  # its owner removed it meanwhile
                return 0
            self._kill_leftovers(path / "lock")
            _fs.rmtree(path)
            return 1
        finally:
            if fd >= 0:
                os.close(fd)

    def _kill_leftovers(self, lock: Path) -> None:
        """Kill whatever still runs as a dead root-mode sandbox's own uid.

        Normally nothing: bwrap dies with its owner (``--die-with-parent``) and the pid
        namespace with bwrap. The uid's lock died with the owner too, so by now another
        sandbox (of any actor sharing the lock dir) may hold that uid: the kill runs only while
        this sweep holds the uid's lock itself, so it can hit nothing but the dead sandbox's
        leftovers. (Without it, an actor restarted after a SIGKILL killed a live sandbox of
        another actor that had been given the freed uid: ``sandbox_killed``.)
        """
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(lock.read_text() or "{}")
            uid = info.get("uid")
            if info.get("mode") != "root" or not isinstance(uid, int):
                return
            held = _try_lock(self.uid_lock_dir / str(uid))
            if held is None:
                log.info("sweep: uid %d of %s belongs to a live sandbox now", uid, lock.parent)
                return
            try:
                for _ in range(50):  # a fork bomb may still be forking: repeat until empty
                    if not _kill_uid(uid):
                        break
            finally:
                os.close(held)

    # ------------------------------------------------------------------ argv

    def _pick_python(self, python: str | None) -> tuple[str, str | None]:
        if python:
            return python, None
        if os.access("/usr/bin/python3", os.X_OK):
            return "/usr/bin/python3", None
        exe, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
        return exe, (None if prefix.startswith("/usr/") else prefix)

    def _ns_args(self) -> list[str]:
        common = ["--die-with-parent", "--new-session"]
        if self.mode == "root":
            caps = ["--cap-drop", "ALL"]
            # kept only until setpriv drops them all: uid change, and --chdir into the
            # sandbox uid's 0700 dirs
            for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH"):
                caps += ["--cap-add", cap]
            return [
                "--unshare-pid",
                "--unshare-net",
                "--unshare-ipc",
                "--unshare-uts",
                "--unshare-cgroup-try",
                *caps,
                *common,
            ]
        extra = ["--disable-userns"] if self._version >= (0, 8, 0) else []
        ids = ["--uid", str(USERNS_UID), "--gid", str(USERNS_UID)]
        return ["--unshare-all", "--unshare-user", *ids, *extra, *common]

    @staticmethod
    def _system_binds() -> list[str]:
        args = ["--ro-bind", "/usr", "/usr"]
        for name in _ROOT_LINKS:
            p = Path("/") / name
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                args += ["--ro-bind", str(p), str(p)]
        return args + ["--proc", "/proc", "--dev", "/dev"]

    def _etc_binds(self, state: Path) -> list[str]:
        assert self._etc is not None
        args = ["--ro-bind", str(self._etc), "/etc", "--dir", RUN_DIR]
        return args + ["--ro-bind", str(state / "etc"), ETC_INSIDE]

    def sandbox_prefix(
        self, spec: SandboxSpec, state: Path, env_dir: Path | None = None
    ) -> list[str]:
        """The bwrap options shared by every command of one sandbox (``env_dir``: the task
        environment's host folder, bound at ``/opt/hrl/env``)."""
        args = [self._bwrap, *self._ns_args(), "--hostname", spec.hostname]
        args += [*self._system_binds(), "--bind", str(state / "shm"), "/dev/shm"]
        args += self._etc_binds(state)
        binds = [
            ("--bind", state / "tmp", "/tmp"),
            ("--bind", state / "home", spec.home),
            ("--bind", state / "workspace", spec.workdir),
            *(("--ro-bind", host, inside) for host, inside in spec.ro_binds),
        ]
        if env_dir is not None:
            binds.append(("--ro-bind", env_dir, ENV_INSIDE))
        if spec.proxy_socket is not None and self._forwarder_bin is not None:
            binds.append(("--ro-bind", self._forwarder_bin, FORWARDER_BIN_INSIDE))
        elif spec.proxy_socket is not None:
            binds.append(("--ro-bind", FORWARDER_SRC, FORWARDER_INSIDE))
            if self._python_bind:
                binds.append(("--ro-bind", self._python_bind, self._python_bind))
        mounted = ["/usr", "/etc", "/proc", "/dev"]
        for flag, host, inside in binds:
            # bwrap makes missing parents 0700 (unusable after the uid drop): make them 0755,
            # except inside another bind, where the host dir must not gain root-owned dirs
            parent = posixpath.dirname(inside)
            if parent != "/" and not any(_below(parent, m) for m in mounted):
                args += ["--dir", parent]
            args += [flag, str(host), inside]
            mounted.append(inside)
        return args

    def command_chain(
        self, spec: SandboxSpec, uid: int, status_fd: int | None = None, *, proxy: bool = True
    ) -> list[str]:
        """What runs inside before the user's argv: uid drop, rlimits, forwarder (when the
        spec has a proxy socket and ``proxy``; it reports how the command ended on
        ``status_fd``, an inherited pipe, when given)."""
        chain: list[str] = []
        if self.mode == "root":
            chain += [self._tools["setpriv"], f"--reuid={uid}", f"--regid={uid}"]
            chain += ["--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
        lim = spec.limits
        rl = [("nproc", lim.max_processes), ("data", lim.memory_bytes)]
        rl += [("fsize", lim.file_size_limit()), ("nofile", lim.max_open_files), ("core", 0)]
        rl = [(k, v) for k, v in rl if v is not None]
        forwarder = spec.proxy_socket is not None and proxy
        if forwarder and self._forwarder_bin is not None:  # it sets the limits itself
            chain += [FORWARDER_BIN_INSIDE, str(spec.proxy_port), PROXY_SOCK_INSIDE]
            chain += ["--status-fd", str(status_fd)] if status_fd is not None else []
            return [*chain, *(a for k, v in rl for a in ("--rlimit", f"{k}={v}")), "--"]
        chain += [self._tools["prlimit"], *(f"--{k}={v}:{v}" for k, v in rl), "--"]
        if forwarder:
            chain += [self._python, "-I", "-S", "-B", FORWARDER_INSIDE]
            chain += [str(spec.proxy_port), PROXY_SOCK_INSIDE]
            chain += ["--status-fd", str(status_fd), "--"] if status_fd is not None else ["--"]
        return chain


class BwrapSandbox(SandboxBase):
    """One rollout's sandbox; see the module docstring. Made by `BwrapBackend.create`."""

    def __init__(
        self,
        backend: BwrapBackend,
        spec: SandboxSpec,
        state_dir: Path,
        uid: int,
        lock_fd: int,
        uid_fd: int | None,
        env_dir: Path | None = None,
    ) -> None:
        self.backend, self.spec, self.state_dir, self.uid = backend, spec, state_dir, uid
        self.env_dir = env_dir
        """Host folder of the task environment bound at ``/opt/hrl/env``; None: none."""
        self.workdir = spec.workdir
        self.workspace_host = state_dir / "workspace"
        self._lock_fd, self._uid_fd = lock_fd, uid_fd
        self._owner = (uid, uid) if backend.mode == "root" else None
        self._prefix = backend.sandbox_prefix(spec, state_dir, env_dir)
        self._procs: set[asyncio.subprocess.Process] = set()
        self._destroyed = False
        self._destroy_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<BwrapSandbox {self.state_dir.name} uid={self.uid}>"

    # ------------------------------------------------------------------ run

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
        if self._destroyed:
            raise SandboxError("sandbox destroyed")
        if not argv:
            raise ValueError("empty argv")
        limit = self.spec.limits.wall_clock_s if timeout is None else timeout
        proxy = proxy and self.spec.proxy_socket is not None
        full_env = self.base_env(proxy=proxy) | (env or {})
        if self.env_dir is not None:
            full_env["PATH"] = with_env_path(full_env.get("PATH"))
        status_r, status_w = os.pipe() if proxy else (None, None)
        chain = self.backend.command_chain(self.spec, self.uid, status_w, proxy=proxy)
        argv_full = [*self._prefix, *self._per_run_args(cwd, proxy), "--", *chain, *argv]
        t0, pipe = time.monotonic(), asyncio.subprocess.PIPE
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv_full,
                    stdin=pipe if stdin is not None else asyncio.subprocess.DEVNULL,
                    stdout=pipe,
                    stderr=pipe,
                    env=full_env,
                    start_new_session=True,
                    pass_fds=() if status_w is None else (status_w,),
                )
            except OSError as e:
                raise SandboxError(f"cannot start bwrap: {e}") from e
            finally:
                if status_w is not None:
                    os.close(status_w)
            async with self._disk_watched():  # (its end looks once more: then check)
                res = await self._supervise(proc, stdin, limit, t0, status_r)
            return self._quota_checked(res)
        finally:
            if status_r is not None:
                os.close(status_r)

    def disk_paths(self) -> list[Path]:
        return [self.state_dir / d for d in ("workspace", "home", "tmp", "shm")]

    def _per_run_args(self, cwd: str | None, proxy: bool = True) -> list[str]:
        args = ["--chdir", cwd or self.workdir]
        sock = self.spec.proxy_socket
        if proxy and sock is not None and sock.exists():
            st = sock.stat()
            if self._owner is not None and st.st_uid != self.uid and not st.st_mode & 0o002:
                # connect() needs write permission on the inode: hand this rollout's socket to
                # the sandbox's uid (a socket shared by sandboxes must be mode 0666 instead)
                os.chown(sock, self.uid, -1)
            args += ["--ro-bind", str(sock), PROXY_SOCK_INSIDE]
        return [*args, "--remount-ro", "/"]

    async def _supervise(self, proc, stdin, limit, t0, status_fd: int | None) -> ExecResult:
        cap = self.spec.limits.output_cap_bytes
        self._procs.add(proc)
        readers = [
            asyncio.ensure_future(_read_capped(proc.stdout, cap)),
            asyncio.ensure_future(_read_capped(proc.stderr, cap)),
        ]
        feeder = asyncio.ensure_future(self._feed(proc, stdin)) if stdin is not None else None
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), limit)
            except TimeoutError:
                timed_out = True
        finally:
            if proc.returncode is None:
                kill_tree(proc.pid)  # bwrap's group; the pid namespace takes the rest down
                await proc.wait()
            self._procs.discard(proc)
            if feeder is not None:
                feeder.cancel()
            done, pending = await asyncio.wait(readers, timeout=5.0)
            for r in pending:
                r.cancel()
        (out, out_trunc), (err, err_trunc) = (
            r.result() if r in done else (b"", True) for r in readers
        )
        if not timed_out and _setup_failed(proc.returncode, err):
            raise SandboxError(f"sandbox setup failed: {err.decode(errors='replace').strip()}")
        gone = timed_out or self._destroyed  # killed by ``run`` itself, not from outside
        status = read_status(status_fd)
        killed = "" if gone else killed_from_outside(proc.returncode, status, status_fd is not None)
        return ExecResult(
            returncode=proc.returncode,
            killed=killed,
            cpu_s=status.cpu_s if status is not None else None,
            stdout=out,
            stderr=err,
            timed_out=timed_out,
            duration_s=time.monotonic() - t0,
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
        )

    @staticmethod
    async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(data)
            await proc.stdin.drain()
            proc.stdin.close()

    # ------------------------------------------------------------------ destroy

    async def destroy(self) -> None:
        async with self._destroy_lock:
            if self._destroyed:
                return
            self._destroyed = True
            for proc in list(self._procs):
                kill_tree(proc.pid)
            for proc in list(self._procs):
                with contextlib.suppress(ProcessLookupError):
                    await proc.wait()
            self.backend._live.discard(self)
            if self.backend.pool.size:
                # nothing runs any more (each run's pid namespace died with it): rename now,
                # remove in the background; the locks (and the uid) are held until it is gone
                dead = self.state_dir.with_name(f".dead-{self.state_dir.name}")
                os.rename(self.state_dir, dead)
                self.backend.pool.remove_later(_Blank(dead, "", self.uid, *self._fds()))
                return
            await asyncio.to_thread(_fs.rmtree, self.state_dir)
            for fd in self._fds():
                if fd is not None:
                    os.close(fd)

    def _fds(self) -> tuple[int, int | None]:
        return self._lock_fd, self._uid_fd
