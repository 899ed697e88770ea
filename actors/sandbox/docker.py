"""Docker sandboxes: one container per sandbox, one ``docker exec`` per command (aiodocker).

Design:

* **State on the host, processes in a container.** As with bwrap, a sandbox is a host state
  dir ``<root>/<owner>-<pid>-<id>/`` holding ``workspace/``, ``home/``, generated
  ``etc/passwd`` + ``etc/group`` and ``lock`` (flock held by the owner for the sandbox's life;
  JSON: owner pid, container name). The container ``hrl-<state dir name>`` is created from the
  image (`docker_image`, configurable) with ``--network none``, a read-only root, cap-drop ALL,
  no-new-privileges, a pids limit, a memory cgroup limit (swap off), a cpu quota, rlimits
  (fsize, nofile, core=0), a private tmpfs ``/tmp``, ``docker-init`` (tini) as PID 1 reaping
  orphans, and binds: the workspace (read-write) at ``spec.workdir``, the private home at
  ``spec.home``, passwd/group, ``spec.ro_binds`` read-only. Labels ``harnessrl.owner``,
  ``harnessrl.pid`` (+ the pid's start time and the boot id) let `DockerBackend.sweep` find
  containers whose actor died.
* **Two users.** The container's own processes (tini, the forwarder) run as ``proxy_uid``;
  every command runs as ``uid``. Commands therefore cannot signal the forwarder, and "every
  process of this run" is exactly "every process of ``uid`` in the container's cgroup".
* **Proxy forwarder:** with ``--network none`` the container's loopback is one network
  namespace shared by all its commands, so one forwarder per sandbox suffices: the container's
  main process is ``_forwarder.py PORT /run/hrl/proxy.sock -- sleep infinity`` (the image's
  python3), listening on ``127.0.0.1:<proxy_port>`` before `create` returns. ``/run/hrl`` is
  the sandbox's ``run`` folder (read-only inside): the forwarder, and the host socket
  hard-linked as ``proxy.sock`` when the sandbox is handed out (the socket is handed to
  ``proxy_uid`` unless world-writable; where it lies on another filesystem it is bound at
  ``proxy.sock.mnt`` instead, at create); a missing one leaves the forwarder closing every
  connection at once. A run with ``proxy=False`` first has the forwarder stop listening and
  drop its connections (SIGUSR1; the next proxy run has it listen again, SIGUSR2), waiting
  for it on ``/proc/PID/net/tcp``.
* **Warm pool** (``pool_size`` > 0, `base.SandboxPool`): containers started ahead for the
  *shape* of the last spec asked for (`_shape`: image, mounts, limits, hostname, proxy port:
  all the container's config depends on); `create` hands one out after copying the
  workspace in and linking the socket, and `destroy` removes it in the background. A spec of
  another shape starts its own container and re-points the pool. Each serves one sandbox.
  Where the socket cannot be linked (another filesystem) the pool turns itself off (warned).
* **Killing trees.** docker has no "kill this exec" call, and a pid namespace per exec needs
  privileges the container has not. So runs of one sandbox are serialized, and after every run
  (exit, timeout, failure) the backend SIGKILLs, from the host, every process of ``uid`` in
  the container's cgroup (``cgroup.procs``), in rounds until none is left (freezing the
  container if a fork bomb outpaces it). Daemons that ``setsid`` or clear their environment
  cannot leave the cgroup, so none survives. Exit is observed as the end of the exec's output;
  a command whose background children keep its stdout open returns after dockerd's 2 s grace
  for exec output, when those children are killed.
* **Task environment:** a spec's ``environment`` is built once per content and base image
  into the derived image ``harnessrl-env:<name>-<hash>`` (a build container of the sandbox
  image, network none, installs the venv at ``/opt/hrl/env`` from a wheelhouse downloaded on
  the host and mounted read-only, then is committed; see ``envs.py``); the task's containers
  are created from it and every command gets ``/opt/hrl/env/bin`` first on ``PATH``. The
  image stays on the engine; the wheelhouse stays in ``env_cache_dir``, so a new engine
  re-derives it offline.
* **Memory** is a real cgroup limit for the whole sandbox: beyond it the kernel's OOM killer
  kills the largest process (exit status 137), unlike bwrap's per-process RLIMIT_DATA.

Requirements: a docker engine on this host (bind sources are host paths; ``/proc`` and the
cgroup filesystem of its containers must be visible here: the backend reads them to kill
trees and to see the forwarder listen), ``docker-init`` (tini; part of docker packages), root
or a user allowed to chown files to ``uid`` (the workspace's owner inside).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path

import aiohttp

try:
    import aiodocker
except ImportError:  # optional: `DockerBackend.probe` says what is missing
    aiodocker = None

from harnessrl.actors.sandbox import _fs
from harnessrl.actors.sandbox._docker_host import (
    _EMPTY,
    _boot_id,
    _cgroup_procs,
    _dying,
    _etc_files,
    _exec_failure,
    _feed,
    _forwarder_pid,
    _kill_uid_round,
    _listening,
    _oom_kills,
    _proc_status,
    _pump,
)
from harnessrl.actors.sandbox._fs import _starttime, _try_lock
from harnessrl.actors.sandbox.base import (
    PATH_INSIDE,
    ExecResult,
    SandboxBase,
    SandboxError,
    SandboxPool,
    SandboxSpec,
)
from harnessrl.actors.sandbox.docker_image import DEFAULT_IMAGE, ensure_env_image
from harnessrl.actors.sandbox.envs import EnvBuilds, content_key, with_env_path
from harnessrl.actors.sandbox.envs import env_cache_dir as default_env_cache
from harnessrl.actors.sandbox.quota import tmpfs_used
from harnessrl.common.tasks.model import TaskEnv

DEFAULT_ROOT = Path(tempfile.gettempdir()) / "harnessrl-docker-sandboxes"
RUN_DIR = "/run/hrl"
PROXY_SOCK_INSIDE = f"{RUN_DIR}/proxy.sock"
FORWARDER_INSIDE = f"{RUN_DIR}/forwarder.py"
FORWARDER_SRC = Path(__file__).with_name("_forwarder.py")
LABEL = "harnessrl.sandbox"
EXIT_GRACE_S = 5.0
"""How long a run waits for output to end after its processes were killed."""

log = logging.getLogger("harnessrl.sandbox.docker")


def _shape(spec: SandboxSpec, image: str | None) -> tuple:
    """What a sandbox's container depends on (`DockerBackend.container_config`): sandboxes
    of one shape differ only in their workspace's files and proxy socket, which a pooled
    container takes when it is handed out."""
    return (
        image,
        spec.workdir,
        spec.home,
        spec.hostname,
        spec.limits,
        tuple(spec.ro_binds),
        spec.proxy_socket is not None,
        spec.proxy_port,
    )


class DockerBackend:
    """Creates `DockerSandbox`es (containers) on the engine at ``docker_url``.

    ``docker_url``: e.g. ``unix:///var/run/docker.sock`` (default: ``$DOCKER_HOST``, then the
    usual socket). ``image``: needs python3, sh, coreutils (`docker_image.ensure_image`).
    ``uid``/``proxy_uid``: host uids of the commands and of the forwarder (no user namespace:
    pick uids no host account uses). ``cpus``: cpu quota per sandbox (None: unlimited).
    ``tmp_bytes``: size of the tmpfs ``/tmp`` (charged to the memory limit; default: that
    limit). ``env_cache_dir``: where task environments' wheels are kept (default
    ``$HARNESSRL_CACHE/envs`` or ``~/.cache/harnessrl/envs``; the images are on the engine).
    ``pool_size``: started containers kept ready for the next sandbox of the same shape as
    the last one asked for (`SandboxPool`; each serves one sandbox), and sandboxes removed
    in the background; 0: each `create` starts its own container and `destroy` waits for
    its removal.
    """

    name = "docker"

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        docker_url: str | None = None,
        image: str = DEFAULT_IMAGE,
        uid: int = 2_100_000_000,
        proxy_uid: int = 2_100_000_001,
        cpus: float | None = 1.0,
        tmp_bytes: int | None = None,
        sweep_on_start: bool = True,
        env_cache_dir: Path | str | None = None,
        pool_size: int = 0,
    ) -> None:
        self.root = Path(root) if root is not None else DEFAULT_ROOT
        self.docker_url = docker_url
        self.image = image
        self.uid, self.proxy_uid = uid, proxy_uid
        self.cpus = cpus
        self.tmp_bytes = tmp_bytes
        self.sweep_on_start = sweep_on_start
        self.env_cache_dir = default_env_cache(env_cache_dir)
        self.env_builds = 0
        """Task environment images this backend built (not found on the engine)."""
        self._envs = EnvBuilds()
        self.docker = None
        self._started = False
        self._start_lock = asyncio.Lock()
        self._live: set[DockerSandbox] = set()
        self.pool = SandboxPool(self._make_blank, DockerSandbox._remove, pool_size)
        self._shape: tuple | None = None
        """What the pool's blanks are made for: `_shape` of the last spec `create` was asked
        for, with its spec and image (``(shape, spec, image)``)."""

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> DockerBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect, check the engine and the image, then sweep dead owners. Idempotent."""
        async with self._start_lock:
            if self._started:
                return
            reason = await self.probe()
            if reason is not None:
                await self.close()
                raise SandboxError(f"docker is not usable here: {reason}")
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._started = True
        if self.sweep_on_start:
            await self.sweep()

    async def probe(self) -> str | None:
        """None when sandboxes can be made here, else why not (for skips and errors)."""
        if aiodocker is None:
            return "aiodocker not installed (pip install aiodocker)"
        if self.docker is None:
            try:
                self.docker = aiodocker.Docker(url=self.docker_url)
            except (ValueError, OSError) as e:
                return f"no docker engine: {e}"
        try:
            await self.docker.version()
        except Exception as e:  # aiodocker raises DockerError, aiohttp errors, OSError
            return f"docker engine unreachable at {self.docker.docker_host}: {e}"
        try:
            await self.docker.images.inspect(self.image)
        except aiodocker.DockerError:
            return (
                f"image {self.image} missing (python -m harnessrl.actors.sandbox.docker_image "
                f"--image {self.image})"
            )
        return None

    async def close(self) -> None:
        """Destroy every sandbox of this backend that is still alive; disconnect."""
        for sb in list(self._live):
            await sb.destroy()
        await self.pool.close()
        self._shape = None
        if self.docker is not None:
            await self.docker.close()
            self.docker = None
        self._started = False

    # ------------------------------------------------------------------ create

    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        await self.start()
        image = await self.environment(spec.environment)
        if self.pool.size:
            shape = self._want(spec, image)
            if (blank := self.pool.take()) is not None:
                if blank.shape == shape and await self._adopt(blank, spec):
                    return blank
                self.pool.remove_later(blank)  # made for the shape before, or unusable
                if blank.bind_socket:
                    self._unpool(spec)
        sb = await self._new_sandbox(spec, image)
        try:
            await self._attach(sb, spec)
            await sb._start_container()
        except BaseException:
            await sb.destroy()
            raise
        self._live.add(sb)
        return sb

    async def warm(self, spec: SandboxSpec) -> None:
        """Have the pool make containers for sandboxes like ``spec`` now (`create` does so
        with each spec of a new shape; the first sandbox then starts its own)."""
        await self.start()
        if self.pool.size:
            self._want(spec, await self.environment(spec.environment))

    def _want(self, spec: SandboxSpec, image: str | None) -> tuple:
        """Point the pool at ``spec``'s shape (dropping the blanks of another) and refill."""
        shape = _shape(spec, image)
        if self._shape is None or self._shape[0] != shape:
            self._shape = (shape, spec, image)
            self.pool.clear()
        self.pool.refill()
        return shape

    async def _new_sandbox(self, spec: SandboxSpec, image: str | None) -> DockerSandbox:
        """A sandbox's state dir (locked) and its object; the container is not made yet."""
        name = f"{spec.owner}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            state, lock_fd = await asyncio.to_thread(self._make_state, spec, name)
        except SandboxError:
            raise
        except OSError as e:
            raise SandboxError(f"cannot create sandbox state: {e}") from e
        sb = DockerSandbox(self, spec, state, lock_fd, f"hrl-{name}", image)
        sb.shape = _shape(spec, image)
        return sb

    async def _attach(self, sb: DockerSandbox, spec: SandboxSpec) -> bool:
        """Give ``sb`` (not started yet, or a blank) ``spec``'s workspace and proxy socket; a
        blank only when the socket can be linked into its ``run`` folder (else False)."""
        sb.spec = spec
        try:
            linked = await asyncio.to_thread(self._attach_sync, sb.state_dir, spec)
        except SandboxError:
            raise
        except OSError as e:
            raise SandboxError(f"cannot create sandbox state: {e}") from e
        sb.bind_socket = linked is False
        return linked is not False

    def _attach_sync(self, state: Path, spec: SandboxSpec) -> bool | None:
        """Copy the workspace in, link the socket: True linked, False it could not be, None
        there is no socket to link."""
        if spec.workspace_src is not None:
            if not spec.workspace_src.is_dir():
                raise SandboxError(f"workspace_src is not a directory: {spec.workspace_src}")
            _fs.copy_in(spec.workspace_src, state / "workspace", ".", (self.uid, self.uid))
        sock = spec.proxy_socket
        if sock is None or not sock.exists():
            return None  # missing: the forwarder closes every connection at once
        if not sock.stat().st_mode & 0o002:
            os.chown(sock, self.proxy_uid, -1)  # connect() needs write permission
        try:
            os.link(sock, state / "run" / "proxy.sock")
        except OSError:  # another filesystem: bound at create (a blank cannot take it)
            return False
        return True

    def _unpool(self, spec: SandboxSpec) -> None:
        """Turn the pool off: the socket cannot be linked, so every blank would be removed."""
        log.warning(
            "docker sandbox pool off: the proxy socket %s and %s are on different filesystems "
            "(a started container cannot be given the socket); put both on one to pool",
            *(spec.proxy_socket, self.root),
        )
        self.pool.size = 0
        self.pool.clear()

    async def _adopt(self, blank: DockerSandbox, spec: SandboxSpec) -> bool:
        """Hand ``blank`` (a started container of ``spec``'s shape) to ``spec``."""
        try:
            if not await self._attach(blank, spec):
                return False
        except SandboxError:
            return False
        self._live.add(blank)
        return True

    async def _make_blank(self) -> DockerSandbox:
        """A started container of the shape last asked for, with an empty workspace."""
        assert self._shape is not None
        _, spec, image = self._shape
        sb = await self._new_sandbox(dataclasses.replace(spec, workspace_src=None), image)
        try:
            await sb._start_container()
        except BaseException:
            await sb._remove()
            raise
        return sb

    # ------------------------------------------------------------------ task environments

    async def environment(self, env: TaskEnv | None) -> str | None:
        """The derived image of ``env`` over `image`, built first when the engine lacks it
        (once per content, across processes sharing the cache folder too); None for no or an
        empty environment. Raises `EnvBuildError`."""
        if env is None or env.empty:
            return None
        await self.start()
        try:
            base = await self.docker.images.inspect(self.image)
        except (aiodocker.DockerError, aiohttp.ClientError) as e:
            raise SandboxError(f"image {self.image}: {e}") from e
        key = content_key("docker", env.key(), base["Id"])
        # not memoised: one image inspect per create notices an image removed meanwhile
        return await self._envs.get(key, lambda: self._env_image(env, key), valid=lambda _: False)

    async def _env_image(self, env: TaskEnv, key: str) -> str:
        labels = {
            LABEL: "docker",
            "harnessrl.owner": "env-build",
            "harnessrl.pid": str(os.getpid()),
            "harnessrl.start": _starttime(os.getpid()) or "",
            "harnessrl.boot": _boot_id(),
        }
        image, built = await ensure_env_image(
            self.docker, self.image, env, key, self.env_cache_dir, labels
        )
        self.env_builds += built
        return image

    def _make_state(self, spec: SandboxSpec, name: str) -> tuple[Path, int]:
        tmp_dir = self.root / f".new-{name}"
        tmp_dir.mkdir(mode=0o700)
        lock_fd = _try_lock(tmp_dir / "lock")
        try:
            assert lock_fd is not None
            info = {"owner": spec.owner, "pid": os.getpid(), "start": _starttime(os.getpid())}
            info["container"] = f"hrl-{name}"
            os.write(lock_fd, json.dumps(info).encode())
            self._populate(tmp_dir, spec)
            state = self.root / name
            os.rename(tmp_dir, state)  # only now visible to sweep, already locked
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            _fs.rmtree(tmp_dir)
            raise
        return state, lock_fd

    def _populate(self, state: Path, spec: SandboxSpec) -> None:
        owner = (self.uid, self.uid)
        for sub, mode in (("workspace", 0o755), ("home", 0o700)):
            d = state / sub
            d.mkdir()
            os.chmod(d, mode)
            os.chown(d, *owner)
        rel = spec.workdir.removeprefix(spec.home + "/")
        if rel != spec.workdir:  # workdir lies below home: its mount point must exist there
            _fs.make_dirs(state / "home", rel, owner)
        if self._needs_root_dir(spec):  # read-only: the mount points below must exist now
            (state / "root").mkdir()
            os.chmod(state / "root", 0o755)
            for inside in (spec.workdir, spec.home):
                if inside.startswith("/root/"):
                    _fs.make_dirs(state / "root", inside.removeprefix("/root/"), None)
        (state / "etc").mkdir()
        for fname, text in _etc_files(spec, self.uid, self.proxy_uid).items():
            (state / "etc" / fname).write_text(text)
        if spec.proxy_socket is not None:  # /run/hrl inside: the forwarder, then the socket
            (state / "run").mkdir()
            os.chmod(state / "run", 0o755)
            shutil.copyfile(FORWARDER_SRC, state / "run" / "forwarder.py")
            (state / "run" / "proxy.sock.mnt").touch()  # where a socket not linked is bound

    def container_config(
        self,
        spec: SandboxSpec,
        state: Path,
        name: str,
        image: str | None = None,
        bind_socket: bool = False,
    ) -> dict:
        """The ``containers/create`` body of one sandbox (``image``: instead of `image`, e.g.
        a task environment's derived image). It depends on ``spec``'s shape (`_shape`), not
        on its workspace or socket, so a pooled container serves any spec of that shape:
        ``state/run`` is ``/run/hrl`` inside, where the proxy socket is hard-linked as
        ``proxy.sock``; ``bind_socket``: it could not be (another filesystem), so the socket
        itself is bound at ``proxy.sock.mnt`` and the forwarder connects there."""
        lim = spec.limits
        mounts = [
            (state / "workspace", spec.workdir, False),
            (state / "home", spec.home, False),
            (state / "etc" / "passwd", "/etc/passwd", True),
            (state / "etc" / "group", "/etc/group", True),
            *((host, inside, True) for host, inside in spec.ro_binds),
        ]
        if self._needs_root_dir(spec):
            mounts.append((state / "root", "/root", True))
        cmd = ["sleep", "infinity"]
        if spec.proxy_socket is not None:
            mounts.append((state / "run", RUN_DIR, True))
            sock_inside = PROXY_SOCK_INSIDE
            if bind_socket:
                sock_inside += ".mnt"
                mounts.append((spec.proxy_socket, sock_inside, True))
            cmd = ["python3", "-I", "-S", "-B", FORWARDER_INSIDE, str(spec.proxy_port)]
            cmd += [sock_inside, "--", "sleep", "infinity"]
        ulimits = [("core", 0), ("fsize", lim.file_size_limit()), ("nofile", lim.max_open_files)]
        tmp_opts = "rw,exec,nosuid,nodev,mode=1777"
        sizes = [v for v in (self.tmp_bytes or lim.memory_bytes, lim.disk_bytes) if v]
        if tmp_size := min(sizes, default=0):  # the disk quota bounds /tmp too
            tmp_opts += f",size={tmp_size}"
        host = {
            "NetworkMode": "none",
            "ReadonlyRootfs": True,
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges"],
            "Init": True,
            "IpcMode": "private",
            "PidsLimit": lim.max_processes or -1,
            "Ulimits": [{"Name": k, "Soft": v, "Hard": v} for k, v in ulimits if v is not None],
            "Mounts": [
                {"Type": "bind", "Source": str(h), "Target": i, "ReadOnly": ro}
                for h, i, ro in mounts
            ],
            "Tmpfs": {"/tmp": tmp_opts},
            "LogConfig": {"Type": "none"},
            "RestartPolicy": {"Name": "no"},
        }
        if lim.memory_bytes is not None:
            host |= {"Memory": lim.memory_bytes, "MemorySwap": lim.memory_bytes}
        if self.cpus is not None:
            host["NanoCpus"] = int(self.cpus * 1e9)
        labels = {
            LABEL: "docker",
            "harnessrl.owner": spec.owner,
            "harnessrl.pid": str(os.getpid()),
            "harnessrl.start": _starttime(os.getpid()) or "",
            "harnessrl.boot": _boot_id(),
            "harnessrl.state": str(state),
        }
        return {
            "Image": image or self.image,
            "Cmd": cmd,
            "User": f"{self.proxy_uid}:{self.proxy_uid}",
            "Env": [f"PATH={PATH_INSIDE}", "LANG=C.UTF-8"],
            "Hostname": spec.hostname,
            "WorkingDir": "/",
            "Labels": labels,
            "HostConfig": host,
        }

    @staticmethod
    def _needs_root_dir(spec: SandboxSpec) -> bool:
        """Whether ``/root`` must be replaced by an empty traversable dir: the workspace or
        home lies below it (but home is not it). The image's ``/root`` is mode 0700, so the
        user could not reach e.g. ClawGym's ``/root/.openclaw/workspace`` by its absolute
        path (bwrap sandboxes make such parents 0755 too). A tmpfs will not do: runc gives a
        tmpfs the mode of the directory it covers."""
        below = any(p.startswith("/root/") for p in (spec.workdir, spec.home))
        return below and spec.home != "/root"

    # ------------------------------------------------------------------ sweep

    async def sweep(self) -> int:
        """Remove containers and state dirs of owners that are gone; returns how many sandboxes.

        A container's owner is alive when its labelled pid runs with the labelled start time on
        this boot; a state dir's owner is alive while it holds the dir's flock.
        """
        await self.start()
        removed: set[str] = set()
        flt = json.dumps({"label": [f"{LABEL}=docker"]})
        for c in await self.docker.containers.list(all=True, filters=flt):
            labels = c["Labels"] or {}
            if self._owner_alive(labels):
                continue
            await self._remove_container(c.id)
            state = labels.get("harnessrl.state")
            if state and Path(state).is_dir():
                await asyncio.to_thread(self._remove_state, Path(state))
            removed.add(Path(state).name if state else c.id)
        for state in await asyncio.to_thread(self._dead_state_dirs):
            info = {}
            with contextlib.suppress(OSError, ValueError):
                info = json.loads((state / "lock").read_text() or "{}")
            if info.get("container"):
                await self._remove_container(info["container"])
            await asyncio.to_thread(self._remove_state, state)
            removed.add(state.name)
        return len(removed)

    @staticmethod
    def _owner_alive(labels: dict[str, str]) -> bool:
        if labels.get("harnessrl.boot") != _boot_id():
            return False
        try:
            pid = int(labels.get("harnessrl.pid", ""))
        except ValueError:
            return False
        return _starttime(pid) == labels.get("harnessrl.start")

    def _dead_state_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        out = []
        for entry in os.scandir(self.root):
            path = Path(entry.path)
            if entry.name.startswith(".new-"):
                # a create() that died half-way; a live one finishes within seconds (and may
                # rename its folder while we look)
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > 300:
                        _fs.rmtree(path)
                continue
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                lock = path / "lock"
                fd = _try_lock(lock) if lock.exists() else -1
                if fd is not None:
                    out.append(path)
                    if fd >= 0:
                        os.close(fd)
        return out

    @staticmethod
    def _remove_state(state: Path) -> None:
        """rmtree ``state`` unless a live owner holds its lock."""
        lock = state / "lock"
        fd = _try_lock(lock) if lock.exists() else -1
        if fd is None:
            return
        try:
            _fs.rmtree(state)
        finally:
            if fd >= 0:
                os.close(fd)

    async def _remove_container(self, ref: str) -> None:
        try:
            await self.docker.containers.container(ref).delete(force=True, v=True)
        except aiodocker.DockerError as e:
            if e.status != 404:
                raise SandboxError(f"cannot remove container {ref}: {e}") from e


class DockerSandbox(SandboxBase):
    """One rollout's container; see the module docstring. Made by `DockerBackend.create`."""

    def __init__(
        self,
        backend: DockerBackend,
        spec: SandboxSpec,
        state_dir: Path,
        lock_fd: int,
        name: str,
        env_image: str | None = None,
    ) -> None:
        self.backend, self.spec, self.state_dir, self.name = backend, spec, state_dir, name
        self.env_image = env_image
        """The task environment's derived image the container runs; None: the base image."""
        self.workdir = spec.workdir
        self.workspace_host = state_dir / "workspace"
        self.uid = backend.uid
        self._owner = (backend.uid, backend.uid)
        self._lock_fd: int | None = lock_fd
        self._container = None
        self._init_pid: int | None = None
        self._procs_file: Path | None = None
        self._run_lock = asyncio.Lock()
        self._destroyed = False
        self._destroy_lock = asyncio.Lock()
        self._proxy_open = True
        """Whether the container's forwarder listens (a ``proxy=False`` run closes it)."""
        self.shape: tuple = ()
        """`_shape` of the spec the container was made for (a pooled blank's)."""
        self.bind_socket = False
        """The proxy socket is bound into the container (it could not be linked)."""

    def __repr__(self) -> str:
        return f"<DockerSandbox {self.name}>"

    @property
    def sid(self) -> str:
        """The sandbox's id: the last part of its state dir's (and container's) name."""
        return self.state_dir.name.rsplit("-", 1)[1]

    async def _proxy_listening(self, want: bool) -> None:
        """Make the container's forwarder listen (``want``) or not, and wait until it does:
        it serves every command of the container, so a ``proxy=False`` run closes it first
        (SIGUSR1: stop listening, drop every connection; SIGUSR2: listen again)."""
        if self.spec.proxy_socket is None or self._proxy_open == want:
            return
        assert self._init_pid is not None
        pid = await asyncio.to_thread(_forwarder_pid, self._init_pid, self.backend.proxy_uid)
        if pid is None:
            raise self._failure("the container's proxy forwarder is gone")
        os.kill(pid, signal.SIGUSR2 if want else signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while _listening(self._init_pid, self.spec.proxy_port) != want:
            if time.monotonic() > deadline:
                raise self._failure(f"the proxy forwarder did not {'re' if want else 'un'}listen")
            await asyncio.sleep(0.002)
        self._proxy_open = want

    async def _start_container(self) -> None:
        be, spec = self.backend, self.spec
        try:
            config = be.container_config(
                spec, self.state_dir, self.name, self.env_image, self.bind_socket
            )
            self._container = await be.docker.containers.create(config, name=self.name)
            await self._container.start()
            info = await self._container.show()
        except (aiodocker.DockerError, aiohttp.ClientError, OSError) as e:
            raise SandboxError(f"cannot start container: {e}") from e
        self._init_pid = info["State"]["Pid"]
        self._procs_file = await asyncio.to_thread(_cgroup_procs, self._init_pid)
        if self._procs_file is None:
            raise SandboxError(
                "cannot see the container's cgroup from here: the docker backend needs the "
                "engine on this host, sharing /proc and /sys/fs/cgroup"
            )
        if spec.proxy_socket is not None:
            deadline = time.monotonic() + 15
            while not _listening(self._init_pid, spec.proxy_port):
                if time.monotonic() > deadline or _proc_status(str(self._init_pid)) is None:
                    raise SandboxError("proxy forwarder did not start in the container")
                await asyncio.sleep(0.01)

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
        """See `Sandbox.run`. Runs of one sandbox take turns (the kill after each run takes
        every process of the sandbox's user)."""
        self._check_alive()
        if not argv:
            raise ValueError("empty argv")
        limit = self.spec.limits.wall_clock_s if timeout is None else timeout
        async with self._run_lock:
            self._check_alive()
            t0 = time.monotonic()
            try:
                await self._proxy_listening(proxy)
                async with self._disk_watched():
                    res = await self._run_locked(argv, env, cwd, limit, stdin, t0, proxy)
                return self._quota_checked(res)
            finally:
                await self._kill_user_procs()

    async def _run_locked(self, argv, env, cwd, limit, stdin, t0, proxy) -> ExecResult:
        full_env = self.base_env(proxy=proxy) | (env or {})
        if self.env_image is not None:
            full_env["PATH"] = with_env_path(full_env.get("PATH"))
        user = f"{self.uid}:{self.uid}"
        ooms = await asyncio.to_thread(_oom_kills, self._init_pid)
        try:
            ex = await self._container.exec(
                argv,
                stdin=stdin is not None,
                user=user,
                environment=full_env,
                workdir=cwd or self.workdir,
            )
        except (aiodocker.DockerError, aiohttp.ClientError) as e:
            raise self._failure(f"docker exec: {e}") from e
        cap = self.spec.limits.output_cap_bytes
        timed_out = False
        try:
            async with ex.start(detach=False) as stream:
                pump = asyncio.ensure_future(_pump(stream, cap))
                feeder = asyncio.ensure_future(_feed(stream, stdin)) if stdin is not None else None
                try:
                    timed_out = not await self._wait_exit(ex, pump, t0 + limit)
                finally:
                    if timed_out or self._destroyed:
                        await self._kill_user_procs()
                    if feeder is not None:
                        feeder.cancel()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(pump), EXIT_GRACE_S)
                    pump.cancel()
                out, err = pump.result() if pump.done() and not pump.cancelled() else _EMPTY
                info = await self._exec_info(ex)
        except (aiodocker.DockerError, aiohttp.ClientError, OSError) as e:
            if self._destroyed:
                return ExecResult(-signal.SIGKILL, b"", b"", False, time.monotonic() - t0)
            raise self._failure(f"docker exec: {e}") from e
        return self._result(info, out, err, timed_out, t0, ooms)

    def disk_paths(self) -> list[Path]:
        return [self.workspace_host, self.state_dir / "home"]

    def disk_extra(self) -> int:  # its tmpfs /tmp and /dev/shm, seen through its init
        root = f"/proc/{self._init_pid}/root"
        return tmpfs_used(f"{root}/tmp") + tmpfs_used(f"{root}/dev/shm") if self._init_pid else 0

    def _over_quota(self) -> None:
        self._quota_kill = asyncio.ensure_future(self._kill_user_procs())

    async def _wait_exit(self, ex, pump: asyncio.Future, deadline: float) -> bool:
        """Wait until the exec's process exited (its output ended and docker says so);
        False when ``deadline`` came first."""
        try:
            await asyncio.wait_for(asyncio.shield(pump), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        while not self._destroyed:  # output closed early (e.g. ``exec >&-``): poll the exec
            if not (await ex.inspect()).get("Running"):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _exec_info(self, ex) -> dict:
        """The exec's final state (docker records the exit shortly after the output ends)."""
        for _ in range(200):
            info = await ex.inspect()
            if not info.get("Running") or self._destroyed:
                return info
            await asyncio.sleep(0.025)
        return info

    def _result(
        self, info: dict, out, err, timed_out: bool, t0: float, ooms: int = -1
    ) -> ExecResult:
        (out, out_trunc), (err, err_trunc) = out, err
        code = info.get("ExitCode")
        if timed_out and code not in (None, 128 + signal.SIGKILL):
            # it had exited in time; only its background children held the output open
            timed_out = False
        if timed_out or self._destroyed or code is None:
            code = -signal.SIGKILL
        elif info.get("Pid") == 0 and code in (126, 127):  # docker could not start it
            mapped = _exec_failure(out)
            if mapped is None:
                raise self._failure(f"cannot start command: {out.decode(errors='replace')}")
            code, out, err = mapped, b"", out.strip() + b"\n"
        killed = ""
        if not (timed_out or self._destroyed) and code == 128 + signal.SIGKILL:
            killed = self._killed(ooms)
        return ExecResult(
            returncode=code,
            killed=killed,
            stdout=out,
            stderr=err,
            timed_out=timed_out,
            duration_s=time.monotonic() - t0,
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
        )

    def _killed(self, ooms_before: int) -> str:
        """Why a command that died of SIGKILL (exit 137, which ``exit 137`` also gives) was
        killed from outside, when that is certain: the container's OOM killer fired meanwhile
        (its memory limit is for the whole sandbox), or the container is gone."""
        now = _oom_kills(self._init_pid)
        if ooms_before >= 0 and now > ooms_before:
            return f"the container's OOM killer fired ({now - ooms_before} kills) at its limit"
        if _dying(self._init_pid):  # its init died (or is dying): the whole container did
            return "the container was stopped from outside"
        return ""

    def _failure(self, msg: str) -> SandboxError:
        return SandboxError(f"{self.name}: {msg}")

    async def _kill_user_procs(self) -> None:
        """SIGKILL every process of the sandbox's user in the container, until none is left."""
        procs = self._procs_file
        if procs is None:
            return
        try:
            for i in range(50):
                if not _kill_uid_round(procs, self.uid):
                    return
                await asyncio.sleep(0.002 * min(i, 10))
            await self._kill_frozen()
            for _ in range(200):
                if not _kill_uid_round(procs, self.uid):
                    return
                await asyncio.sleep(0.01)
        except OSError:  # the container (and its cgroup) is gone: nothing left to kill
            if not procs.exists():
                return
            raise
        raise self._failure("processes survive SIGKILL")

    # ------------------------------------------------------------------ files

    async def _kill_frozen(self) -> None:
        """A fork bomb outpaces the rounds: freeze the container, signal every process of the
        user once (frozen, none can fork), thaw (they die with SIGKILL pending)."""
        await self._container.pause()
        try:
            _kill_uid_round(self._procs_file, self.uid)
        finally:
            await self._container.unpause()

    # ------------------------------------------------------------------ destroy

    async def destroy(self) -> None:
        """Remove the container and the state dir: in the background (`SandboxPool`) with a
        pool, else before returning. Either way nothing can run in it any more."""
        async with self._destroy_lock:
            if self._destroyed:
                return
            self._destroyed = True
            self.backend._live.discard(self)
            if self.backend.pool.size:
                self.backend.pool.remove_later(self)
                return
            await self._remove()

    async def _remove(self) -> None:
        try:
            await self.backend._remove_container(self.name)
        finally:
            await asyncio.to_thread(_fs.rmtree, self.state_dir)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
