"""Task environments inside sandboxes: built once per content, cached, mounted read-only.

A task's `TaskEnv` (a ``python`` command, pip packages; ``harnessrl.common.tasks.environments``) is
provided by the sandbox backend, the same way for every command of the sandbox (the harness,
the agent's own commands, the checker):

* **What it is inside:** a Python virtual environment at ``/opt/hrl/env`` (`ENV_INSIDE`) made
  from the sandbox's own ``python3``, read-only, its ``bin/`` first on ``PATH``: ``python3``
  (and ``python`` with ``python_alias``) resolve to it, so the packages are importable from
  ``python3 check.py`` and ``python -m pytest`` alike, and their console scripts (``pytest``)
  are commands. An `empty <TaskEnv.empty>` environment is no build and nothing is mounted.
* **How it is built, in two steps.** (1) `wheelhouse`: ``pip download`` of the requirements
  (binary wheels only, for the target interpreter's version, ABI and platform, probed from
  the target) plus the pip wheel that installs them, on the host, which is the only step that
  needs a package index; cached in ``<cache>/envs/wheels-<hash>``. (2) `install_script` runs
  *inside the target userland* with the wheelhouse mounted at ``/opt/hrl/wheels`` and no
  network: ``python3 -m venv --without-pip /opt/hrl/env``, then pip (run from its wheel)
  installs from the wheelhouse alone; the python alias is kept or removed; the installed
  distributions are recorded in ``/opt/hrl/env/hrl-environment.json``. Being built at the path
  it is used at, nothing needs relocating.
* **Per backend.** bwrap: step 2 runs in a bubblewrap sandbox over the host's ``/usr`` with a
  fresh cache folder bound at ``/opt/hrl/env``; the folder is renamed into place as
  ``<cache>/envs/bwrap-<name>-<hash>/env`` (hash of the environment's content, the target
  interpreter and `LAYOUT`) and bound read-only into each sandbox of the task. docker: step 2
  runs in a container of the sandbox image (network none) and is committed as the derived
  image ``harnessrl-env:<name>-<hash>`` (hash of the content and the base image's id), which
  the task's containers are then created from.
* **Once.** The first use builds; every other waits and reuses: an in-process lock per
  environment, and a file lock (``flock``) per build in the cache folder across processes.
  A failed build raises `EnvBuildError` (a `SandboxError`: the rollout is a
  ``sandbox_error``) and is remembered for `RETRY_AFTER_S`, so a broken definition does not
  hammer the index with every rollout.

Caveat of cross-target downloads: pip evaluates environment markers of dependencies with the
host's interpreter (only wheel compatibility follows the target), so the wheelhouse is built
with the host's Python version on a host whose python3 matches the target's; a dependency a
marker left out fails the offline install loudly, never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from harnessrl.actors.sandbox.base import SandboxError
from harnessrl.common.models.cache import default_cache_dir
from harnessrl.common.tasks.model import TaskEnv

log = logging.getLogger("harnessrl.sandbox.envs")

ENV_INSIDE = "/opt/hrl/env"
"""Where an environment is, inside a sandbox (and where it is built)."""
ENV_BIN = f"{ENV_INSIDE}/bin"
WHEELS_INSIDE = "/opt/hrl/wheels"
"""Where the wheelhouse is mounted while an environment is built."""
ENV_INFO = "hrl-environment.json"
"""File in the environment recording its name, key and installed distributions."""
LAYOUT = 1
"""Bump when the build recipe changes: environments built by an older one are rebuilt."""
PIP_REQUIREMENT = "pip==26.2.1"
"""The pip that installs an environment (run from its wheel inside the target)."""
RETRY_AFTER_S = 60.0
"""How long a failed build is remembered (further sandboxes of it fail at once)."""
DOWNLOAD_TIMEOUT_S = 1800.0
INSTALL_TIMEOUT_S = 1800.0

PROBE_CODE = (
    "import json, platform, sys; c = platform.libc_ver(); print(json.dumps({"
    "'python': '%d.%d' % sys.version_info[:2], 'implementation': sys.implementation.name, "
    "'libc': c[0], 'libc_version': c[1], 'machine': platform.machine()}))"
)
"""Printed by the target's ``python3``: what `Target` is made from."""


class EnvBuildError(SandboxError):
    """A task environment could not be built (the message says which and why)."""


def env_cache_dir(cache_dir: Path | str | None = None) -> Path:
    """``cache_dir``, or ``$HARNESSRL_CACHE/envs`` (default ``~/.cache/harnessrl/envs``)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir() / "envs"


def with_env_path(path: str | None) -> str:
    """``PATH`` with the environment's ``bin`` first."""
    rest = [p for p in (path or "").split(":") if p and p != ENV_BIN]
    return ":".join([ENV_BIN, *rest])


def content_key(*parts: object) -> str:
    """12 hex digits naming a build made from ``parts`` (JSON data) under `LAYOUT`."""
    blob = json.dumps([LAYOUT, *parts], sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=6).hexdigest()


# ---------------------------------------------------------------------------------------------
# the target interpreter
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The interpreter an environment is built for (the sandbox's ``python3``)."""

    python: str
    """``major.minor``."""
    implementation: str
    libc: str
    """``glibc``, or empty/other (musl)."""
    libc_version: str
    machine: str

    @classmethod
    def parse(cls, text: str) -> Target:
        """From `PROBE_CODE`'s output; raises `EnvBuildError`."""
        try:
            d = json.loads(text.strip().splitlines()[-1])
            return cls(**{k: str(d[k]) for k in cls.__dataclass_fields__})
        except (ValueError, IndexError, KeyError, TypeError):
            raise EnvBuildError(
                f"cannot read the sandbox's python3 probe: {text[-300:]!r}"
            ) from None

    def pip_flags(self) -> list[str]:
        """``pip download`` flags selecting wheels that this interpreter can install."""
        if self.implementation != "cpython":
            raise EnvBuildError(f"task environments need CPython, not {self.implementation}")
        nodot = self.python.replace(".", "")
        flags = ["--only-binary=:all:", "--python-version", self.python]
        flags += ["--implementation", "cp", "--abi", f"cp{nodot}", "--abi", "abi3"]
        flags += ["--abi", "none"]
        platforms = [f"linux_{self.machine}"]
        if self.libc == "glibc":
            try:
                minor = int(self.libc_version.split(".")[1])
            except (IndexError, ValueError):
                minor = 17
            platforms += [f"manylinux_2_{m}_{self.machine}" for m in range(minor, 4, -1)]
            legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
            platforms += [f"{v}_{self.machine}" for k, v in legacy.items() if minor >= k]
        else:  # musl: the probe cannot tell its version
            platforms += [f"musllinux_1_{m}_{self.machine}" for m in (2, 1, 0)]
        for p in platforms:
            flags += ["--platform", p]
        return flags


def probe_host_python(python: str = "/usr/bin/python3") -> Target:
    """`Target` of a python3 runnable on this host (bwrap sandboxes run the host's /usr)."""
    try:
        p = subprocess.run(
            [python, "-I", "-c", PROBE_CODE], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvBuildError(f"the sandbox has no usable {python}: {e}") from None
    if p.returncode != 0:
        raise EnvBuildError(f"{python} failed: {p.stderr[-500:]}")
    return Target.parse(p.stdout)


# ---------------------------------------------------------------------------------------------
# locks
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created) for the block; blocks until it is free.

    flock locks belong to the open file, so two holders in one process exclude each other
    just as two processes do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.asynccontextmanager
async def async_file_lock(path: Path):
    """`file_lock` for async code: waits in a thread, never blocks the event loop."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


T = TypeVar("T")


class EnvBuilds:
    """In-process side of "build once": one build at a time per key, results kept, failures
    remembered for ``retry_after_s``."""

    def __init__(self, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.retry_after_s = retry_after_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._done: dict[str, object] = {}
        self._failed: dict[str, tuple[float, EnvBuildError]] = {}

    async def get(
        self,
        key: str,
        build: Callable[[], Awaitable[T]],
        valid: Callable[[T], bool] = lambda _: True,
    ) -> T:
        """The result of ``build()`` for ``key``, running it only if no earlier call did (or
        its result is no longer ``valid``: e.g. the cache was cleaned meanwhile)."""
        done = self._done.get(key)
        if done is not None and valid(done):  # type: ignore[arg-type]
            return done  # type: ignore[return-value]
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            done = self._done.pop(key, None)
            if done is not None and valid(done):  # type: ignore[arg-type]
                self._done[key] = done
                return done  # type: ignore[return-value]
            failed = self._failed.get(key)
            if failed is not None and time.monotonic() - failed[0] < self.retry_after_s:
                raise failed[1]
            try:
                result = await build()
            except EnvBuildError as e:
                self._failed[key] = (time.monotonic(), e)
                raise
            except (OSError, subprocess.SubprocessError) as e:
                err = EnvBuildError(f"{e}")
                self._failed[key] = (time.monotonic(), err)
                raise err from e
            self._failed.pop(key, None)
            self._done[key] = result
            return result


# ---------------------------------------------------------------------------------------------
# step 1: the wheelhouse (host, network)
# ---------------------------------------------------------------------------------------------


def wheelhouse(
    env: TaskEnv,
    target: Target,
    cache_dir: Path,
    *,
    pip_python: str | None = None,
    timeout: float = DOWNLOAD_TIMEOUT_S,
) -> Path:
    """The folder of wheels that installs ``env`` on ``target`` (with ``requirements.txt``),
    downloaded first when not cached. Blocking; raises `EnvBuildError`.

    ``pip_python``: the interpreter whose pip downloads (default: this one); it uses the
    host's pip configuration (index URLs, proxies, certificates)."""
    key = content_key("wheels", sorted(env.pip), PIP_REQUIREMENT, target.__dict__)
    final = cache_dir / f"wheels-{key}"
    if (final / "requirements.txt").is_file():
        return final
    with file_lock(cache_dir / f".wheels-{key}.lock"):
        if (final / "requirements.txt").is_file():
            return final
        remove_leftovers(cache_dir, f".new-wheels-{key}-")
        tmp = Path(tempfile.mkdtemp(prefix=f".new-wheels-{key}-", dir=cache_dir))
        try:
            argv = [pip_python or sys.executable, "-m", "pip", "download", "--dest", str(tmp)]
            argv += ["--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
            argv += [*target.pip_flags(), *env.pip, PIP_REQUIREMENT]
            t0 = time.monotonic()
            try:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise EnvBuildError(f"environment {env.name!r}: pip download: {e}") from None
            if p.returncode != 0:
                raise EnvBuildError(
                    f"environment {env.name!r}: pip download of its packages failed "
                    f"(exit {p.returncode}): {_tail(p.stderr or p.stdout)}"
                )
            (tmp / "requirements.txt").write_text("".join(f"{r}\n" for r in env.pip))
            os.chmod(tmp, 0o755)
            os.rename(tmp, final)
            log.info("environment %s: wheels downloaded in %.1f s", env.name, time.monotonic() - t0)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def remove_leftovers(cache_dir: Path, prefix: str) -> None:
    """Remove ``<prefix>*`` folders of builds that died half-way; call it holding the lock of
    the build they belong to (nobody else can be writing them then)."""
    for p in cache_dir.glob(f"{prefix}*"):
        shutil.rmtree(p, ignore_errors=True)


def _tail(text: str, n: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= n else "…" + text[-n:]


# ---------------------------------------------------------------------------------------------
# step 2: the install (inside the target, offline)
# ---------------------------------------------------------------------------------------------

_FINISH = """\
import json, os, sys
from importlib import metadata
b = os.path.join(sys.prefix, "bin")
links = {n: os.readlink(os.path.join(b, n)) for n in os.listdir(b)
         if os.path.islink(os.path.join(b, n))}
real = os.path.realpath(os.path.join(b, "python3"))
if not @ALIAS@:
    for n, t in links.items():  # python3 -> python -> /usr/bin/python3: unchain, then drop
        if n != "python" and t == "python":
            os.unlink(os.path.join(b, n))
            os.symlink(real, os.path.join(b, n))
    if "python" in links:
        os.unlink(os.path.join(b, "python"))
elif "python" not in links:
    os.symlink(real, os.path.join(b, "python"))
dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())
info = dict(@INFO@, python=sys.version.split()[0], installed=dists)
with open(os.path.join(sys.prefix, "@FILE@"), "w") as f:
    json.dump(info, f, indent=1)
"""


def install_script(env: TaskEnv, key: str) -> str:
    """The ``sh`` script that builds ``env`` at `ENV_INSIDE` inside the target (wheelhouse at
    `WHEELS_INSIDE` when ``env.pip``; no network needed)."""
    info = {"name": env.name, "key": key, "python_alias": env.python_alias, "pip": env.pip}
    finish = (
        _FINISH.replace("@ALIAS@", repr(env.python_alias))
        .replace("@INFO@", repr(info))
        .replace("@FILE@", ENV_INFO)
    )
    lines = ["set -eu", "umask 022", f"python3 -m venv --without-pip {ENV_INSIDE}"]
    if env.pip:
        w = WHEELS_INSIDE
        lines += [
            f"pip=$(ls {w}/pip-*.whl | head -n 1)",
            f'{ENV_BIN}/python3 "$pip/pip" install --no-index --find-links {w} '
            "--no-cache-dir --disable-pip-version-check --no-warn-script-location "
            f"--progress-bar off -r {w}/requirements.txt",
        ]
    lines.append(f"{ENV_BIN}/python3 -I -c {shlex.quote(finish)}")
    return "\n".join(lines) + "\n"


def log_env_build(env: TaskEnv, where: str | Path, seconds: float) -> None:
    log.info("environment %s (%s) built in %.1f s: %s", env.name, env.key(), seconds, where)


BUILD_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PIP_CONFIG_FILE": "/dev/null",
    "PYTHONNOUSERSITE": "1",
}
"""Environment of the install step (nothing of the host's, no pip configuration)."""
