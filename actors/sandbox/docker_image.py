"""The local Docker side of the ``docker`` sandbox backend: a minimal image built offline, and a
private ``dockerd`` for tests and benchmarks.

    python -m harnessrl.actors.sandbox.docker_image [--docker-host URL] [--image NAME] [--method M]

**Image.** No registry is reachable, so the image is imported (``docker import``) from a root
filesystem tarball built here and cached in ``<cache>/docker/rootfs-<key>.tar`` (cache =
``$HARNESSRL_CACHE`` or ``~/.cache/harnessrl``; key = method, suite, packages, layout), built
once per machine, atomically (temp file + rename). Two ways to build it:

* ``debootstrap`` (default): ``debootstrap --variant=minbase --include=<PACKAGES> bookworm``
  from a Debian mirror (the only network it needs), then docs, man pages, locales and apt lists
  are dropped. A clean Debian userland independent of the host: ~3 min, ~215 MB (kept
  uncompressed: gzip cost minutes of CPU on a loaded machine and saved only disk). The
  deploy images (``deploy/images/build.py``) are built on the same rootfs, so a machine (CI)
  bootstraps Debian once for both.
* ``host``: the files of the host's own installed Debian packages (``dpkg-query -L``) of the
  dependency closure of ``python3 bash coreutils …``. Seconds and no mirror, but the image is
  whatever the host has installed (versions, local edits), and it needs a dpkg-based host.

``auto`` tries debootstrap and falls back to host. The image must provide ``python3`` (the proxy
forwarder), ``sh`` and coreutils; the backend supplies users, binds and limits.

**Task environment images.** `ensure_env_image` derives ``harnessrl-env:<name>-<hash>`` from
the sandbox image for one task environment (see ``envs.py``): a build container of the base
image (network none, no capabilities) installs the environment at ``/opt/hrl/env`` from the
wheelhouse mounted read-only, and is committed. Once per content and engine: a file lock in
the cache folder keeps concurrent first uses on this host from building twice.

**Private dockerd.** `PrivateDockerd` runs ``dockerd`` with its own data root, exec root, pid
file and unix socket under one directory, without iptables or a bridge (sandboxes use
``--network none``); it is a child tracked by PID (it gets SIGTERM if this process dies) and is
stopped by PID. Needs root and ``apt-get install docker.io``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from harnessrl.actors.sandbox.envs import (
    BUILD_ENV,
    INSTALL_TIMEOUT_S,
    PROBE_CODE,
    WHEELS_INSIDE,
    EnvBuildError,
    Target,
    async_file_lock,
    install_script,
    log_env_build,
    wheelhouse,
)
from harnessrl.common.models import default_cache_dir
from harnessrl.common.procs import popen_child
from harnessrl.common.tasks.model import TaskEnv

DEFAULT_IMAGE = "harnessrl-sandbox:latest"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "bubblewrap", "nodejs", "ca-certificates", "openssl", "procps")
"""What the rootfs installs besides the minimal base: sandboxes need ``python3`` (the proxy
forwarder); the rest is what the deploy images add (bubblewrap sandboxes and Node harnesses in
the actor image, openssl for the NATS certificates), on the same cached rootfs."""
#: extra packages of the ``host`` method (debootstrap's minbase has them already)
HOST_BASE_PACKAGES = ("base-files", "bash", "coreutils", "dash", "util-linux", "findutils")
HOST_BASE_PACKAGES += ("grep", "sed", "tar", "gzip", "procps")
LAYOUT = 1  # bump when the rootfs recipe changes: old caches are then ignored
TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale")
TRIM += ("var/cache/apt", "var/lib/apt/lists", "var/log", "var/cache/debconf")
_ROOT_DIRS = ("dev", "proc", "sys", "tmp", "run", "home", "root", "etc", "var/tmp", "mnt")


class ImageError(RuntimeError):
    """The sandbox image could not be built or imported."""


def image_cache_dir(cache_dir: Path | str | None = None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir() / "docker"


# ---------------------------------------------------------------------- root filesystem


def rootfs_tarball(
    cache_dir: Path | str | None = None,
    *,
    method: str = "auto",
    suite: str = DEFAULT_SUITE,
    mirror: str | None = None,
    packages: tuple[str, ...] = PACKAGES,
) -> Path:
    """The cached rootfs tarball (uncompressed), built first when missing. Blocking."""
    methods = ("debootstrap", "host") if method == "auto" else (method,)
    if any(m not in ("debootstrap", "host") for m in methods):
        raise ValueError(f"unknown rootfs method {method!r}")
    cache = image_cache_dir(cache_dir)
    paths = {m: cache / _tarball_name(m, suite, packages) for m in methods}
    for m in methods:  # a cached one of either kind first
        if paths[m].is_file():
            return paths[m]
    errors = []
    for m in methods:
        try:
            return _build_rootfs(paths[m], m, suite, mirror, packages)
        except ImageError as e:
            errors.append(f"{m}: {e}")
    raise ImageError("cannot build the sandbox rootfs here:\n  " + "\n  ".join(errors))


def _tarball_name(method: str, suite: str, packages: tuple[str, ...]) -> str:
    key = hashlib.blake2b(f"{LAYOUT} {method} {suite} {packages}".encode(), digest_size=6)
    return f"rootfs-{method}-{suite}-{key.hexdigest()}.tar"


def _build_rootfs(
    final: Path, method: str, suite: str, mirror: str | None, packages: tuple[str, ...]
) -> Path:
    cache = final.parent
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=cache) as tmp:
        rootfs = Path(tmp) / "rootfs"
        if method == "debootstrap":
            _debootstrap(rootfs, suite, mirror or DEFAULT_MIRROR, packages)
        else:
            _from_host_packages(rootfs, (*HOST_BASE_PACKAGES, *packages))
        for d in _ROOT_DIRS:
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        os.chmod(rootfs / "tmp", 0o1777)
        part = Path(tmp) / "rootfs.tar"
        _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(part), "."], "tar")
        os.rename(part, final)
    return final


def _run(argv: list[str], what: str, timeout: float = 1800) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageError(f"{what}: {e}") from e
    if p.returncode != 0:
        raise ImageError(f"{what} exited {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    return p.stdout


def _debootstrap(rootfs: Path, suite: str, mirror: str, packages: tuple[str, ...]) -> None:
    exe = shutil.which("debootstrap")
    if exe is None:
        raise ImageError("debootstrap not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise ImageError("debootstrap needs root")
    argv = [exe, "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs)]
    _run([*argv, mirror], "debootstrap")
    for rel in TRIM:
        p = rootfs / rel
        if p.is_dir():
            shutil.rmtree(p)
            p.mkdir()


def _from_host_packages(rootfs: Path, packages: tuple[str, ...]) -> None:
    """Copy the files of ``packages`` and their installed dependencies from the host."""
    if shutil.which("dpkg-query") is None:
        raise ImageError("the host method needs a dpkg-based host (dpkg-query)")
    rootfs.mkdir()
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged /usr, as the host
        if (Path("/") / name).is_symlink():
            (rootfs / name).symlink_to(os.readlink(Path("/") / name))
    for pkg in sorted(_closure(packages)):
        for line in _run(["dpkg-query", "-L", pkg], "dpkg-query").splitlines():
            src = Path(line.strip())
            if not src.is_absolute() or src.is_dir() or not os.path.lexists(src):
                continue
            if any(str(src).startswith(f"/{t}") for t in TRIM):
                continue
            rel = Path(os.path.realpath(src.parent)).relative_to("/") / src.name
            (rootfs / rel.parent).mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, rootfs / rel, follow_symlinks=False)
    for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf"):
        src = Path("/etc") / name
        with contextlib.suppress(OSError):
            if src.is_dir():
                shutil.copytree(src, rootfs / "etc" / name, dirs_exist_ok=True)
            elif src.exists():
                shutil.copy2(src, rootfs / "etc" / name)


def _closure(packages: tuple[str, ...]) -> set[str]:
    """Installed packages needed by ``packages`` (Pre-Depends + Depends; of alternatives and
    virtual names, the first that is installed or provided)."""
    fmt = "${Package}\t${db:Status-Abbrev}\t${Provides}\t${Pre-Depends}, ${Depends}\n"
    deps: dict[str, list[list[str]]] = {}
    provider: dict[str, str] = {}
    for line in _run(["dpkg-query", "-W", f"-f={fmt}"], "dpkg-query").splitlines():
        name, status, provides, depends = (line.split("\t") + ["", "", ""])[:4]
        if not status.startswith("ii"):
            continue
        name = name.split(":")[0]
        deps[name] = [_names(d) for d in depends.split(",") if d.strip()]
        for virtual in _names(provides.replace(",", "|")):
            provider.setdefault(virtual, name)
    seen: set[str] = set()
    todo = list(packages)
    while todo:
        pkg = todo.pop()
        if pkg in seen or pkg not in deps:
            continue
        seen.add(pkg)
        for alts in deps[pkg]:
            found = [a if a in deps else provider.get(a) for a in alts]
            todo.extend(next(([f] for f in found if f), []))
    return seen


def _names(field: str) -> list[str]:
    """Package names of one ``a (>= 1) | b:any`` dependency (versions, arch qualifiers gone)."""
    return [n for a in field.split("|") if (n := re.sub(r"\(.*?\)|:\w+", "", a).strip())]


# ---------------------------------------------------------------------- image


async def ensure_image(
    docker_url: str | None = None,
    image: str = DEFAULT_IMAGE,
    *,
    cache_dir: Path | str | None = None,
    method: str = "auto",
    rebuild: bool = False,
) -> dict:
    """Make sure ``image`` exists on the engine; import it from the cached rootfs otherwise.

    Returns ``{"image", "id", "size_bytes", "built_s", "imported_s", "tarball"}`` (the times
    are 0 when nothing had to be done).
    """
    import aiodocker

    async with aiodocker.Docker(url=docker_url) as docker:
        if not rebuild:
            with contextlib.suppress(aiodocker.DockerError):
                info = await docker.images.inspect(image)
                return _image_summary(image, info, 0.0, 0.0, None)
        t0 = time.monotonic()
        tar = await asyncio.to_thread(rootfs_tarball, cache_dir, method=method)
        t1 = time.monotonic()
        await import_rootfs(docker, tar, image)
        info = await docker.images.inspect(image)
        return _image_summary(image, info, t1 - t0, time.monotonic() - t1, tar)


def _image_summary(image, info, built_s, imported_s, tar) -> dict:
    return {
        "image": image,
        "id": info["Id"],
        "size_bytes": info.get("Size"),
        "built_s": round(built_s, 2),
        "imported_s": round(imported_s, 2),
        "tarball": str(tar) if tar else None,
    }


async def import_rootfs(docker, tarball: Path, image: str) -> None:
    """``docker import`` of a rootfs tarball as ``image`` (streamed from the file)."""
    repo, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    params = {"fromSrc": "-", "repo": repo, "tag": tag or "latest"}
    params["changes"] = "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

    async def chunks():
        with open(tarball, "rb") as f:
            while chunk := await asyncio.to_thread(f.read, 1 << 20):
                yield chunk

    headers = {"Content-Type": "application/x-tar"}
    # aiodocker's import_image is `docker load` (an image archive), not `docker import`
    async with docker._query(
        "images/create", "POST", params=params, data=chunks(), headers=headers, timeout=None
    ) as resp:
        body = await resp.text()
    for line in body.splitlines():
        with contextlib.suppress(ValueError):
            if "error" in (msg := json.loads(line)):
                raise ImageError(f"docker import failed: {msg['error']}")


# ---------------------------------------------------------------------- task environment images

ENV_IMAGE_REPO = "harnessrl-env"
"""Repository of the derived images of task environments (tag ``<name>-<hash>``)."""


async def ensure_env_image(
    docker, base_image: str, env: TaskEnv, key: str, cache_dir: Path, labels: dict[str, str]
) -> tuple[str, bool]:
    """``(image, built)``: the derived image of ``env`` over ``base_image`` (``key`` names the
    pair), built first when the engine lacks it. ``labels`` mark the build containers (so a
    backend's sweep removes those of dead builders). Raises `EnvBuildError`."""
    import aiodocker

    tag = f"{env.name}-{key}"
    image = f"{ENV_IMAGE_REPO}:{tag}"
    if await _has_image(docker, image):
        return image, False
    async with async_file_lock(cache_dir / f".docker-{key}.lock"):
        if await _has_image(docker, image):
            return image, False
        t0 = time.monotonic()
        probe = ["python3", "-I", "-c", PROBE_CODE]
        rc, out, _ = await _build_container(docker, base_image, probe, [], labels)
        if rc != 0:
            raise EnvBuildError(f"the sandbox image's python3 failed (exit {rc}): {out[-500:]}")
        target = Target.parse(out)
        mounts = []
        if env.pip:
            wheels = await asyncio.to_thread(wheelhouse, env, target, cache_dir)
            mounts.append((wheels, WHEELS_INSIDE))
        cmd = ["/bin/sh", "-c", install_script(env, key)]
        rc, out, container = await _build_container(
            docker, base_image, cmd, mounts, labels, keep=True
        )
        try:
            if rc != 0:
                raise EnvBuildError(
                    f"environment {env.name!r}: install failed (exit {rc}): {out[-1500:]}"
                )
            await container.commit(
                repository=ENV_IMAGE_REPO,
                tag=tag,
                message=f"harnessrl task environment {env.name} ({env.key()})",
                changes=[f"LABEL harnessrl.env={env.name} harnessrl.env_key={key}"],
                pause=False,
            )
        except (aiodocker.DockerError, aiohttp.ClientError) as e:
            raise EnvBuildError(f"environment {env.name!r}: docker commit: {e}") from e
        finally:
            await asyncio.shield(_remove(container))
        log_env_build(env, image, time.monotonic() - t0)
    return image, True


async def _has_image(docker, image: str) -> bool:
    import aiodocker

    try:
        await docker.images.inspect(image)
    except aiodocker.DockerError as e:
        if e.status == 404:
            return False
        raise EnvBuildError(f"image {image}: {e}") from e
    return True


async def _remove(container) -> None:
    import aiodocker

    with contextlib.suppress(aiodocker.DockerError, aiohttp.ClientError):
        await container.delete(force=True, v=True)


async def _build_container(
    docker,
    image: str,
    cmd: list[str],
    mounts: list[tuple[Path, str]],
    labels: dict[str, str],
    *,
    keep: bool = False,
):
    """Run ``cmd`` as root in a container of ``image`` (network none, no capabilities, the
    ``mounts`` read-only, a tmpfs /tmp): ``(exit status, output, container)``; the container
    is removed unless ``keep`` (then the caller removes it)."""
    import aiodocker

    config = {
        "Image": image,
        "Cmd": cmd,
        "User": "0:0",
        "Env": [f"{k}={v}" for k, v in BUILD_ENV.items()],
        "WorkingDir": "/tmp",
        "Labels": labels,
        "HostConfig": {
            "NetworkMode": "none",
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges"],
            "Tmpfs": {"/tmp": "rw,exec,nosuid,nodev,mode=1777"},
            "Mounts": [
                {"Type": "bind", "Source": str(h), "Target": i, "ReadOnly": True} for h, i in mounts
            ],
        },
    }
    name = f"hrl-envbuild-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        container = await docker.containers.create(config, name=name)
    except (aiodocker.DockerError, aiohttp.ClientError) as e:
        raise EnvBuildError(f"cannot create an environment build container: {e}") from e
    try:
        await container.start()
        try:
            res = await container.wait(timeout=INSTALL_TIMEOUT_S)
        except TimeoutError:
            raise EnvBuildError(f"environment build timed out ({INSTALL_TIMEOUT_S:g} s)") from None
        out = "".join(await container.log(stdout=True, stderr=True))
    except (aiodocker.DockerError, aiohttp.ClientError) as e:
        await asyncio.shield(_remove(container))
        raise EnvBuildError(f"environment build container: {e}") from e
    except BaseException:
        await asyncio.shield(_remove(container))
        raise
    if not keep:
        await asyncio.shield(_remove(container))
    return int(res.get("StatusCode", -1)), out, container


# ---------------------------------------------------------------------- private dockerd


class DockerdError(RuntimeError):
    """dockerd could not be found or did not become ready."""


class PrivateDockerd:
    """One ``dockerd`` of our own under ``root`` (data, exec root, socket, pid file, log)."""

    def __init__(self, root: Path | str, *, dockerd: str | None = None) -> None:
        self.root = Path(root).resolve()
        self.dockerd = dockerd or shutil.which("dockerd") or "/usr/sbin/dockerd"
        self.socket = self.root / "docker.sock"
        self.log_path = self.root / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 60.0) -> PrivateDockerd:
        """Start dockerd and wait until it answers ``/_ping``."""
        if self.proc and self.proc.poll() is None:
            return self
        if not os.access(self.dockerd, os.X_OK):
            raise DockerdError("dockerd not installed (apt-get install docker.io)")
        if os.geteuid() != 0:
            raise DockerdError("a private dockerd needs root")
        self.root.mkdir(parents=True, exist_ok=True)
        exec_root = self.root / "x"  # short: containerd's socket path lives below it
        argv = [self.dockerd, f"--data-root={self.root / 'data'}", f"--exec-root={exec_root}"]
        argv += [f"--pidfile={self.root / 'dockerd.pid'}", f"--host={self.url}"]
        argv += ["--iptables=false", "--ip6tables=false", "--ip-masq=false", "--bridge=none"]
        argv += ["--log-level=warn", "--storage-driver=overlay2"]
        with open(self.log_path, "ab") as log:
            self.proc = popen_child(argv, new_session=True, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise DockerdError(f"dockerd exited: {self.log_tail()}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise DockerdError(f"dockerd not ready after {timeout}s: {self.log_tail()}")

    def ping(self) -> bool:
        conn = _UnixHTTPConnection(str(self.socket), timeout=2)
        try:
            conn.request("GET", "/_ping")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0, *, remove: bool = False) -> None:
        """SIGTERM (dockerd stops its containers and its containerd), SIGKILL the group after
        ``timeout``. ``remove``: then delete ``root`` (images included), after detaching what
        dockerd left mounted below it (unless something there cannot be unmounted)."""
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if remove:
            self._unmount_below()
            if not self._mounts_below():
                shutil.rmtree(self.root, ignore_errors=True)

    def _unmount_below(self) -> None:
        """Detach what the stopped dockerd left mounted below ``root`` (it keeps the host's
        network namespace bound at ``<exec-root>/netns/default`` once a ``--network host``
        container ran), deepest first; never anything outside ``root``."""
        if self.proc is not None:
            return
        for point in sorted(self._mounts_below(), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)

    def _mounts_below(self) -> list[str]:
        top = str(self.root) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        return [m for m in points if (m + "/").startswith(top)]

    def __enter__(self) -> PrivateDockerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


# ---------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="build/import the docker sandbox image, offline"
    )
    p.add_argument("--docker-host", default=None, help="engine URL (default: $DOCKER_HOST)")
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--method", default="auto", choices=("auto", "debootstrap", "host"))
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--rebuild", action="store_true", help="re-import even if the image exists")
    p.add_argument("--rootfs-only", action="store_true", help="only build the cached tarball")
    args = p.parse_args(argv)
    if args.rootfs_only:
        t0 = time.monotonic()
        tar = rootfs_tarball(args.cache_dir, method=args.method)
        size = tar.stat().st_size
        print(json.dumps({"tarball": str(tar), "bytes": size, "s": time.monotonic() - t0}))
        return
    res = asyncio.run(
        ensure_image(
            args.docker_host,
            args.image,
            cache_dir=args.cache_dir,
            method=args.method,
            rebuild=args.rebuild,
        )
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
