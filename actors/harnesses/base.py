"""The harness adapter contract: how to install a harness, and how to launch it headless.

An adapter turns one rollout's `HarnessContext` (what the harness must do, and where the proxy
is, *as seen from inside the sandbox*) into a `LaunchSpec` (argv, environment, config files,
read-only binds, stdin). It never runs anything itself: the actor owns the sandbox.

How the actor uses an adapter, in order:

1. ``adapter.is_installed(cache_dir)`` / ``await adapter.install(cache_dir)`` on the host;
2. ``spec = adapter.prepare(ctx)`` *before* the sandbox exists, because ``spec.ro_binds`` (the
   install dir) go into the sandbox's ``SandboxSpec.ro_binds``;
3. ``await write_launch_files(sandbox, spec)`` (config files land in the sandbox's private home);
4. ``await sandbox.run(spec.argv, env=spec.env, cwd=spec.cwd, timeout=spec.timeout_s,
   stdin=spec.stdin)`` — `launch` does 3 and 4.

Invariants every adapter keeps:

* ``prepare`` is pure: same context in, same spec out, no I/O beyond looking up the installed
  files under ``ctx.cache_dir``; the rollout's token appears only in ``env`` or ``files``.
* Every path in a `LaunchSpec` (argv, env, files, bind targets) is a path *inside* the sandbox;
  only the first element of each ``ro_binds`` pair is a host path.
* The harness's stdin is never a terminal (``None`` means /dev/null): several harnesses wait on
  stdin otherwise.
* Installs live in ``<cache_dir>/<name>/`` and appear there complete or not at all (built in a
  temporary sibling under a lock, then renamed), so concurrent installers never see half an
  install and a crashed install leaves only a temporary dir that the next install removes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import posixpath
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

Api = Literal["chat", "messages", "responses", "any"]
"""Which model API a harness speaks: OpenAI chat completions, Anthropic messages, OpenAI
Responses, or ``any`` (a user command that may call any of them)."""

MANIFEST = "hrl-install.json"
"""Written last into an install dir; its presence is what "installed" means."""

HARNESS_MOUNT = "/opt/hrl/harnesses"
"""Where install dirs are bound (read-only) inside the sandbox: ``<HARNESS_MOUNT>/<name>``."""


def default_cache_dir() -> Path:
    """``$HRL_HARNESS_CACHE``, else ``$XDG_CACHE_HOME/harnessrl/harnesses`` (~/.cache/…)."""
    env = os.environ.get("HRL_HARNESS_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "harnessrl" / "harnesses"


class HarnessInstallError(RuntimeError):
    """Installing a harness failed (registry unreachable, package missing, build error)."""


class HarnessNotInstalled(RuntimeError):
    """`HarnessAdapter.prepare` needs files that are not installed in the cache dir."""


@dataclass(slots=True)
class HarnessContext:
    """One rollout, as the harness sees it. Paths and URLs are those *inside* the sandbox."""

    instruction: str
    """The task text given to the harness as its prompt."""
    token: str
    """The rollout's API key: the proxy accepts it, and it names the rollout."""
    model: str = "policy"
    """Model name the harness asks for (the proxy serves whatever the run trains)."""
    proxy_url: str = "http://127.0.0.1:18080"
    """Base URL of the proxy inside the sandbox, without ``/v1``."""
    workspace: str = "/workspace"
    """The task's workspace (the harness's cwd)."""
    home: str = "/home/hrl"
    """``$HOME`` inside; config files are written below it."""
    max_turns: int | None = None
    """Most model turns, where the harness supports a limit; ``None``: the harness default."""
    timeout_s: float = 1800.0
    """Wall-clock limit for the whole harness run (enforced by the sandbox)."""
    context_window: int | None = None
    """The engine's real context window in tokens (prompt + reply), told to the harness as its
    model's window, so that it compacts as it would against a real deployment of that size
    (see the table in ``harnessrl.actors.harnesses``); ``None``: the harness's own default."""
    max_output_tokens: int | None = None
    """The run's per-call output limit (its ``max_new_tokens``), told to the harness as its
    model's output limit: what it requests as ``max_tokens`` and reserves from the window for
    a reply; ``None``: the harness's own default (Claude Code's is 32,000 for a model it does
    not know, which against a 32k window makes it compact from its second call on)."""
    cache_dir: Path = field(default_factory=default_cache_dir)
    """Host folder holding installs (``<cache_dir>/<name>``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the harness, applied last (overrides the adapter's)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Adapter-specific options; each adapter documents the keys it reads."""

    @property
    def openai_base_url(self) -> str:
        """``<proxy_url>/v1``: what OpenAI-style clients take as their base URL."""
        return self.proxy_url.rstrip("/") + "/v1"

    def in_home(self, rel: str) -> str:
        """An absolute path inside the sandbox's home."""
        return posixpath.join(self.home, rel)

    def output_limit(self, default: int | None = None) -> int | None:
        """The output limit to tell the harness: ``options["max_output_tokens"]`` when given
        (an explicit per-harness override), else ``max_output_tokens``, else ``default``."""
        value = self.options.get("max_output_tokens", self.max_output_tokens)
        return default if value is None else int(value)

    def compaction_limit(self, output: int | None = None) -> int | None:
        """Where an adapter that sets the compaction threshold itself (Codex, reference) puts
        it: ``W - max(O, W // 4)`` for window ``W`` and output limit ``O``, so the input that
        triggers compaction still leaves room for a full reply *and* the tool results that
        arrive before the harness checks again (both check only after a reply). That is 3/4 of
        the window unless the output limit is larger than a quarter of it; ``None`` without a
        window. ``output`` replaces ``output_limit()`` (an adapter's own option)."""
        if not self.context_window:
            return None
        window = self.context_window
        out = self.output_limit() if output is None else output
        return window - max(out or 0, window // 4)


@dataclass(slots=True)
class LaunchSpec:
    """Everything needed to start one harness run inside a sandbox."""

    argv: list[str]
    """Command line inside the sandbox."""
    env: dict[str, str]
    """Environment of the harness (on top of the sandbox's minimal base)."""
    api: Api
    """The API the harness will call on the proxy."""
    cwd: str = "/workspace"
    """Working directory inside the sandbox (the workspace)."""
    files: dict[str, str] = field(default_factory=dict)
    """Files to write before the run: absolute path inside the sandbox → text content."""
    ro_binds: list[tuple[Path, str]] = field(default_factory=list)
    """``(host_path, inside_path)`` read-only binds the sandbox must be created with."""
    stdin: bytes | None = None
    """Bytes fed to stdin; ``None``: /dev/null."""
    timeout_s: float = 1800.0
    """Wall-clock limit of the run."""
    preload: Any = None
    """``harnessrl.actors.harnesses.preload.Preload``: how the actor may start this Python
    harness from a preloaded interpreter instead (the same argv and env); None: always cold."""

    def redacted(self, token: str) -> dict[str, Any]:
        """A loggable view with ``token`` replaced by ``***``."""

        def r(s: str) -> str:
            return s.replace(token, "***") if token else s

        return {
            "argv": [r(a) for a in self.argv],
            "env": {k: r(v) for k, v in self.env.items()},
            "api": self.api,
            "cwd": self.cwd,
            "files": {p: r(c) for p, c in self.files.items()},
            "ro_binds": [(str(h), i) for h, i in self.ro_binds],
        }


class HarnessAdapter:
    """Base class of adapters. Subclasses set the class attributes and implement `prepare`.

    ``install``/``is_installed`` default to "nothing to install"; npm- and pip-installed
    harnesses use `NpmAdapter` / `PipVenvAdapter` from ``harnessrl.actors.harnesses.install``.
    """

    name: ClassVar[str]
    """Registry name, also the rollout's ``harness`` field and what ``proxy/labels.py`` keys on."""
    api: ClassVar[Api]
    """The API it speaks by default."""
    summary: ClassVar[str] = ""
    """One line for ``harnessrl harness list``."""
    builtin: ClassVar[bool] = True
    """Ships with harnessrl: nothing to install."""
    first_request_tokens: ClassVar[int | None] = None
    """Tokens of the harness's first main request for a one-line task ("Create hello.txt
    containing a greeting."): its system prompt, tool schema and the task, as the proxy renders
    them with the tiny models' chat template and tokenizer. Measured on the request the
    harness sent at `measured_version` (``tests/fixtures/harness_requests``, checked by
    ``tests/test_harness_list.py``); None: not measured. What a policy must read before its
    first token, and what every rollout's prefix tree starts with."""
    measured_version: ClassVar[str] = ""
    """The harness version `first_request_tokens` was measured at ("" for a built-in)."""

    def install_dir(self, cache_dir: Path) -> Path:
        return Path(cache_dir) / self.name

    def mount_dir(self) -> str:
        """Where ``install_dir`` is bound inside the sandbox."""
        return f"{HARNESS_MOUNT}/{self.name}"

    def is_installed(self, cache_dir: Path) -> bool:
        return True

    async def install(
        self, cache_dir: Path, *, version: str | None = None, force: bool = False
    ) -> None:
        """Install into ``install_dir(cache_dir)``; idempotent, safe across processes.

        ``version`` pins the harness's package version; ``force`` reinstalls over an install.
        """
        return None

    def installed_version(self, cache_dir: Path) -> str | None:
        m = read_manifest(self.install_dir(cache_dir))
        return None if m is None else m.get("version")

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        raise NotImplementedError

    def base_env(self, ctx: HarnessContext) -> dict[str, str]:
        """Variables every harness gets: HOME, the task in HRL_* form (with
        ``HRL_CONTEXT_WINDOW``/``HRL_MAX_OUTPUT_TOKENS`` when known), no colours, no pager."""
        env = {
            "HOME": ctx.home,
            "HRL_MODEL": ctx.model,
            "HRL_WORKSPACE": ctx.workspace,
            "HRL_PROXY_URL": ctx.proxy_url,
            "NO_COLOR": "1",
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
        }
        if ctx.max_turns is not None:
            env["HRL_MAX_TURNS"] = str(ctx.max_turns)
        if ctx.context_window:
            env["HRL_CONTEXT_WINDOW"] = str(ctx.context_window)
        if ctx.output_limit() is not None:
            env["HRL_MAX_OUTPUT_TOKENS"] = str(ctx.output_limit())
        return env

    def finish(self, ctx: HarnessContext, spec: LaunchSpec) -> LaunchSpec:
        """Apply what is common to every spec: ``ctx.env`` last, cwd and timeout."""
        spec.env.update(ctx.env)
        spec.cwd = ctx.workspace
        spec.timeout_s = ctx.timeout_s
        return spec


# ---------------------------------------------------------------------------------------------
# Installing: one lock per harness, build in a temporary sibling, rename into place.


def read_manifest(install_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((install_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


async def locked_install(
    cache_dir: Path,
    name: str,
    build: Callable[[Path], Awaitable[dict[str, Any]]],
    *,
    force: bool = False,
) -> Path:
    """Run ``build(tmp_dir)`` and move its result to ``<cache_dir>/<name>`` atomically.

    ``build`` fills an empty temporary dir and returns manifest fields. An ``flock`` on
    ``<cache_dir>/.<name>.lock`` serialises installers of the same harness across processes;
    whoever gets the lock second finds the install done and returns. The final dir appears by
    ``rename`` only once complete (with its manifest), so readers never see a partial install.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / name
    lock_path = cache_dir / f".{name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        await _flock(fd)
        if read_manifest(final) is not None and not force:
            return final
        _remove_stale_temps(cache_dir, name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
        try:
            started = time.monotonic()
            manifest = await build(tmp)
            manifest.setdefault("name", name)
            manifest["install_seconds"] = round(time.monotonic() - started, 2)
            manifest["installed_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; sandboxes run as other uids
            _swap_in(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final
    finally:
        os.close(fd)  # releases the flock


async def _flock(fd: int, poll_s: float = 0.2) -> None:
    """Take an exclusive flock without blocking the loop (and stay cancellable)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            await asyncio.sleep(poll_s)


def _swap_in(tmp: Path, final: Path) -> None:
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def _remove_stale_temps(cache_dir: Path, name: str) -> None:
    """Leftovers of crashed installs (we hold the lock, so nobody else is building)."""
    for p in cache_dir.glob(f".{name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in cache_dir.glob(f".{name}.old-*"):
        shutil.rmtree(p, ignore_errors=True)


async def run_install_step(
    argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 1800.0
) -> str:
    """Run one install command (npm, pip) on the host; raise `HarnessInstallError` on failure."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        tail = text[-3000:]
        raise HarnessInstallError(f"{' '.join(argv)} exited {proc.returncode}:\n{tail}")
    return text


# ---------------------------------------------------------------------------------------------
# Launching inside a sandbox (used by the actor and the tests).


async def write_launch_files(sandbox: Any, spec: LaunchSpec) -> None:
    """Write ``spec.files`` inside the sandbox (its home is not reachable by the file verbs).

    Each file goes through ``sh -c 'mkdir -p …; cat > …'`` with the content on stdin, so it
    works with any backend and the content never appears on a command line.
    """
    script = 'umask 077; mkdir -p "$(dirname "$1")" && cat > "$1"'
    for path, content in spec.files.items():
        res = await sandbox.run(
            ["/bin/sh", "-c", script, "sh", path],
            env={"HOME": spec.env.get("HOME", "/")},
            cwd="/",
            timeout=30,
            stdin=content.encode(),
            proxy=False,
        )
        if not res.ok:
            raise RuntimeError(f"could not write {path} in the sandbox: {res.stderr[-500:]!r}")


async def launch(sandbox: Any, spec: LaunchSpec) -> Any:
    """Write the spec's files, then run the harness; returns the sandbox's ExecResult."""
    await write_launch_files(sandbox, spec)
    return await sandbox.run(
        spec.argv, env=spec.env, cwd=spec.cwd, timeout=spec.timeout_s, stdin=spec.stdin
    )


def host_python() -> str:
    """The interpreter harness scripts run with inside a sandbox that binds only ``/usr``."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    return sys.executable
