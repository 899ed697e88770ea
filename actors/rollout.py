"""One rollout, start to finish: the single pipeline ``harnessrl actor`` and ``harnessrl rollout``
share.

``await run_rollout(req, attempt, deps) -> RolloutResult``::

    load task -> adapter.prepare (token, proxy URL inside, model name) -> proxy on a unix socket
    -> sandbox (workspace copied in at the task's mount, the socket, the harness binds)
    -> harness under its wall-clock limit -> [keep workspace] -> proxy stopped, records flushed
    -> verifier (hidden reward files copied in only now) -> sandbox destroyed -> result

What must stay true:

* **Every CallRecord of the rollout is stored before the result exists.** The proxy is stopped
  (its in-flight engine calls aborted) once the harness is dead, and ``Recorder.flush`` must
  succeed; if the bus cannot store the records in ``flush_timeout_s`` this raises instead of
  returning a result, so the caller retries the task rather than publish a result whose calls
  are missing. ``n_calls`` is the number of records of the rollout (with a record the server
  refused as too large counted, so the assembler sees the gap and tombstones it).
* **Nothing outlives the rollout**, whatever happens, cancellation included: the sandbox is
  destroyed (every process in it killed), the proxy's socket closed and removed, the rollout's
  TITO state, recorder state and engine outcome dropped.
* **One status per outcome** (``RolloutResult.status``, the taxonomy of
  ``harnessrl.common.records.RolloutStatus``: ``ok`` is scored, every other status is an infrastructure
  outcome, tombstoned and never trained). Every failed status comes with a ``reason`` (the
  label of ``hrl_actor_failures_total``) and the cause in ``error``:

  - ``ok``: the verifier scored the final workspace (a harness that exits non-zero *after*
    calling the model is the model's failure and is scored like any other run); a harness
    that filled the sandbox past its disk quota (``sandbox_disk_mb``) is stopped and scored 0
    without verifying, its ``error`` saying so (counted as failure reason ``disk_quota``);
  - ``timeout`` (reason ``timeout``): the harness outlived its limit and was killed (with
    ``timeout_scoring = "score"`` the workspace is verified anyway and the status is the
    verifier's);
  - ``sandbox_error`` (``sandbox_create``, ``sandbox_run``, ``sandbox_verify``,
    ``sandbox_killed``): the sandbox failed (create — including a task environment that cannot
    be built —, run, file copy, during verification too), or it was killed from outside while
    the harness ran (``sandbox_killed``: the OOM killer, an operator, the infrastructure — the
    backend's `ExecResult.killed`, e.g. bwrap or the sandbox's init killed by a signal, or the
    harness killed by SIGKILL): the harness's exit status then says nothing about the model,
    so the rollout is never scored, whatever calls it made;
  - ``harness_error``: the harness could not run — unknown or missing task
    (``task_not_found``), unknown harness (``unknown_harness``), task changed under the request
    (``task_changed``), ``command`` without a command (``no_command``), not installed
    (``not_installed``), install failure (``install_failed``), launch spec or files not made
    (``prepare_failed``, ``launch_files``), exit 126/127 (not executable / not found) or a
    non-zero exit before any model call (``harness_exit``). When the *request* itself can never
    run anywhere (unknown task, suite or harness, changed task, no command)
    `RolloutReport.bad_request` says why, so the actor dead-letters the task after publishing
    the failed result;
  - ``verifier_error`` (``verifier``, ``verifier_timeout``, ``verifier_killed``,
    ``verifier_environment``, ``verifier_bug``): the verifier produced no score for reasons
    not the workspace's (see ``harnessrl.actors.verifier``). A checker that crashes or exits non-zero
    on the workspace is not one: the rollout is ``ok`` with reward 0 (ClawGym semantics), the
    checker's traceback in ``error`` and the failure metric counted as ``checker_failed``;
  - ``engine_error`` (``engine_unreachable``, ``engine_unavailable``, ``engine_failed``): a
    model call failed for infrastructure reasons (engine refused or unreachable, 5xx, an
    unexpected reply; see ``harnessrl.proxy.stack.failure_reason``) and no call generated after the last
    such failure, whatever the harness did then. A transient failure followed by calls that
    generate is not one; neither is a 400 the harness caused nor a call it abandoned. This is
    judged first, before the harness's exit or timeout: a harness that gave up (or hung) on a
    dead engine is never scored. When no engine at all has been in rotation for
    ``engine_grace_s`` while the harness runs, the harness is stopped then and there (reason
    ``engine_unreachable``): a dead engine is reported in seconds, not at the harness's own
    timeout, however long the harness keeps retrying.

Shared state: one `RolloutDeps` per process (the proxy stack of ``harnessrl.proxy.stack`` — engine
router, renderer, ModelCaller, Recorder — the sandbox backend and the judge); one `ProxyServer`
per rollout, listening on its own unix socket, which the sandbox's forwarder exposes at
``127.0.0.1:<proxy_port>`` inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.actors.config import RolloutSettings
from harnessrl.actors.harnesses import (
    HarnessContext,
    HarnessNotInstalled,
    LaunchSpec,
    get_adapter,
    harness_version,
    preload,
)
from harnessrl.actors.harnesses.base import HarnessAdapter, default_cache_dir, write_launch_files
from harnessrl.actors.sandbox import Limits, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from harnessrl.actors.sandbox.base import ExecResult, MiB
from harnessrl.common import metrics
from harnessrl.common.bus import Bus
from harnessrl.common.procs import pid_alive
from harnessrl.common.records import RolloutResult, TaskRequest, rollout_id
from harnessrl.common.tasks import Task, TaskError, load_task

log = logging.getLogger("harnessrl.actor.rollout")

__all__ = ["RolloutDeps", "RolloutReport", "run_rollout", "sweep_socket_dirs"]

SOLUTION_MOUNT = "/opt/hrl/solution"
"""Where ``expose_solution`` binds a task's reference solution (``command`` harness only)."""
SOCKET_ROOT = Path(tempfile.gettempdir()) / "harnessrl-proxy-sockets"
"""Parent of each actor process's proxy socket folder (``<root>/<pid>-<random>``)."""
VERIFY_SLACK_S = 30.0
"""Added to a sandbox's default wall clock beyond the harness timeout (verifier, file copies)."""
PROXY_STOP_TIMEOUT_S = 30.0
"""Bound on stopping a rollout's proxy (in-flight calls are aborted first, so it is quick)."""
NOT_RUNNABLE_EXITS = (126, 127)
"""Shell exit statuses for "found but not executable" and "command not found"."""

_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

M_PHASE = metrics.histogram(
    "hrl_actor_phase_seconds",
    "Rollout phase durations (sandbox create, harness, verify, total)",
    ("phase",),
    buckets=_DURATION_BUCKETS,
)
M_SANDBOX_CREATE = metrics.histogram(
    "hrl_actor_sandbox_create_seconds", "Sandbox creation latency", ("backend",)
)
M_SANDBOX_DESTROY = metrics.histogram(
    "hrl_actor_sandbox_destroy_seconds", "Sandbox destruction latency", ("backend",)
)
M_REWARD = metrics.histogram(
    "hrl_actor_reward",
    "Rewards of scored rollouts, by harness and kind (train|eval)",
    ("harness", "kind"),
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.999, 1.0),
)
M_ROLLOUTS = metrics.counter(
    "hrl_actor_rollouts_total", "Rollouts finished, by status", ("status",)
)
M_FAILURES = metrics.counter(
    "hrl_actor_failures_total", "Failed rollouts by reason (finer than the status)", ("reason",)
)
M_CALLS = metrics.histogram(
    "hrl_actor_calls_per_rollout",
    "Model calls per rollout",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)


# ---------------------------------------------------------------------------------------------
# shared per-process state
# ---------------------------------------------------------------------------------------------


@dataclass
class RolloutDeps:
    """What every rollout of one process shares. Build it with `RolloutDeps.open`."""

    bus: Bus
    proxy: Any
    """``harnessrl.proxy.stack.ProxyStack``: engine router, renderer, ModelCaller, Recorder."""
    backend: SandboxBackend
    settings: RolloutSettings
    socket_dir: Path
    """This process's folder of per-rollout proxy sockets."""
    judge: Any = None
    """``harnessrl.actors.verifier.RubricJudge`` or None."""
    actor: str = ""
    """Name put in results and sandbox owners."""
    preloads: Any = None
    """``harnessrl.actors.harnesses.preload.PreloadPool`` (None: every harness starts cold)."""

    @property
    def caller(self) -> Any:
        """``harnessrl.proxy.calls.ModelCaller`` over the engine router, renderer, parser and recorder."""
        return self.proxy.caller

    @property
    def recorder(self) -> Any:
        return self.proxy.recorder

    @property
    def router(self) -> Any:
        """``harnessrl.proxy.stack.TrackingRouter``: the engines, and each rollout's engine outcome."""
        return self.proxy.router

    @property
    def max_context(self) -> int:
        """The engines' context window (0: unknown)."""
        return self.proxy.max_context

    @property
    def cache_dir(self) -> Path:
        return self.settings.harness_cache_dir or default_cache_dir()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        settings: RolloutSettings,
        bus: Bus,
        *,
        actor: str = "",
        backend: SandboxBackend | None = None,
    ) -> AsyncIterator[RolloutDeps]:
        """Start the shared parts (engines checked, sandboxes swept); close them on exit."""
        from harnessrl.proxy.stack import open_proxy_stack

        async with contextlib.AsyncExitStack() as stack:
            proxy = await stack.enter_async_context(
                open_proxy_stack(
                    settings,
                    bus,
                    record_buffer=settings.record_buffer,
                    health_interval_s=settings.engine_health_interval_s,
                )
            )
            if backend is None:
                backend = make_sandbox_backend(settings)
            await backend.start()  # type: ignore[attr-defined]  # both backends sweep here
            stack.push_async_callback(backend.close)
            judge = None
            if settings.judge_config is not None:
                from harnessrl.actors.verifier import RubricJudge

                judge = RubricJudge(settings.judge_config)
                stack.push_async_callback(judge.close)
            socket_dir = await asyncio.to_thread(_new_socket_dir)
            stack.callback(shutil.rmtree, socket_dir, True)
            preloads = None
            if settings.harness_preload and preload.supported(backend):
                preloads = preload.PreloadPool(socket_dir, min_uid=backend.uid_base)  # type: ignore[attr-defined]
                stack.push_async_callback(preloads.close)
            yield cls(
                bus=bus,
                proxy=proxy,
                backend=backend,
                settings=settings,
                socket_dir=socket_dir,
                judge=judge,
                actor=actor or default_actor_name(),
                preloads=preloads,
            )


def default_actor_name() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"{host[:60] or 'actor'}-{os.getpid()}"


def make_sandbox_backend(settings: RolloutSettings) -> SandboxBackend:
    """The configured sandbox backend (not started)."""
    from harnessrl.actors.sandbox import make_backend

    kw: dict[str, Any] = {}
    if settings.sandbox_root is not None:
        kw["root"] = settings.sandbox_root
    if settings.sandbox == "docker" and settings.docker_image:
        kw["image"] = settings.docker_image
    if settings.env_cache_dir is not None:
        kw["env_cache_dir"] = settings.env_cache_dir
    kw["pool_size"] = settings.sandbox_pool
    return make_backend(settings.sandbox, **kw)


def _new_socket_dir() -> Path:
    SOCKET_ROOT.mkdir(parents=True, exist_ok=True, mode=0o700)
    sweep_socket_dirs()
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=SOCKET_ROOT))


def sweep_socket_dirs(root: Path = SOCKET_ROOT) -> int:
    """Remove socket folders of dead actor processes (named ``<pid>-…``); returns how many."""
    removed = 0
    if not root.is_dir():
        return 0
    for d in root.iterdir():
        pid = d.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    return removed


# ---------------------------------------------------------------------------------------------
# one rollout
# ---------------------------------------------------------------------------------------------


@dataclass
class RolloutReport:
    """What a rollout did beyond its result: for logs and the ``rollout`` command."""

    task: Task | None = None
    harness_exit: int | None = None
    """The harness's exit status (None: it never ran)."""
    timed_out: bool = False
    harness_stdout: str = ""
    """Tail of the harness's stdout."""
    harness_stderr: str = ""
    """Tail of the harness's stderr."""
    verifier_output: str = ""
    """Tail of the checker's stderr."""
    bad_request: str = ""
    """Non-empty when the TaskRequest can never run anywhere (dead-letter it)."""
    workspace: Path | None = None
    """Where the final workspace was copied (``keep_workspace``)."""
    launch: dict[str, Any] = field(default_factory=dict)
    """The harness's LaunchSpec with the token redacted."""


class _Fail(Exception):
    """Ends a rollout with a failed status; ``reason`` labels the failure metric."""

    def __init__(self, status: str, reason: str, error: str) -> None:
        super().__init__(error)
        self.status, self.reason, self.error = status, reason, error


def _said(done: ExecResult, n: int = 1500) -> str:
    """The tails of what a command wrote, stderr then stdout (harnesses differ in where their
    reason goes: Codex prints its fatal errors on stdout)."""
    parts = [
        (name, _tail(data, n)) for name, data in (("stderr", done.stderr), ("stdout", done.stdout))
    ]
    said = [f"{name}: {text}" for name, text in parts if text]
    return " | ".join(said) or "no output"


def _tail(data: bytes | str, n: int = 2000) -> str:
    s = data.decode(errors="replace") if isinstance(data, bytes) else data
    s = s.strip()
    return s if len(s) <= n else "…" + s[-n:]


async def run_rollout(
    req: TaskRequest,
    attempt: int,
    deps: RolloutDeps,
    *,
    keep_workspace: Path | None = None,
    report: RolloutReport | None = None,
) -> RolloutResult:
    """Run attempt ``attempt`` of ``req`` and return its result (see the module docstring).

    Raises only for what a retry may fix: the bus could not store the rollout's records
    (``TimeoutError``), or the caller cancelled (everything is cleaned up either way).
    """
    return await _Rollout(req, attempt, deps, keep_workspace, report or RolloutReport()).run()


class _Rollout:
    """The steps of one rollout; ``run`` is the whole story, each step a method."""

    def __init__(
        self,
        req: TaskRequest,
        attempt: int,
        deps: RolloutDeps,
        keep_workspace: Path | None,
        report: RolloutReport,
    ) -> None:
        self.req, self.deps, self.report = req, deps, report
        self.settings = deps.settings
        self.keep_workspace = keep_workspace
        self.rid = rollout_id(req.group_id, req.k, attempt)
        self.token = "hrl-" + secrets.token_urlsafe(24)
        self.server: Any = None
        self.sock: Path | None = None
        self.preloader: Any = None
        """The ``Preloader`` this rollout's harness starts from (None: a cold start)."""
        self.preload_run = ""
        self.result = RolloutResult(
            rollout_id=self.rid,
            task_id=req.task_id,
            suite=req.suite,
            harness=req.harness,
            group_id=req.group_id,
            k=req.k,
            attempt=attempt,
            group_size=req.group_size,
            issued_version=req.issued_version,
            is_eval=req.is_eval,
            actor=deps.actor,
            meta=dict(req.meta),
            claim=req.claim,
        )
        self.durations: dict[str, float] = {}
        self.engines_gone = ""
        """Why the harness was stopped for want of an engine ("": it was not)."""

    async def run(self) -> RolloutResult:
        res = self.result
        res.started_at = time.time()
        t0 = time.monotonic()
        try:
            try:
                await self._body()
            except _Fail as f:
                res.status = f.status  # type: ignore[assignment]
                res.reason, res.error = f.reason, f.error
                M_FAILURES.labels(reason=f.reason).inc()
            finally:
                await self._close_proxy()
            res.n_calls = await self._flush()
        finally:
            self.deps.caller.drop(self.rid)
            self.deps.recorder.forget(self.rid)
            self.deps.router.forget(self.rid)
        self.durations["total"] = time.monotonic() - t0
        res.durations = {k: round(v, 4) for k, v in self.durations.items()}
        res.ended_at = time.time()
        self._observe()
        return res

    async def _body(self) -> None:
        task = self._load_task()
        adapter = self._adapter()
        timeout = self._timeout(task)
        spec = await self._prepare(adapter, task, timeout)
        await self._start_proxy()
        await self._preload(spec)
        sandbox = await self._create_sandbox(task, spec, timeout)
        try:
            done = await self._launch(sandbox, spec)
            if self.keep_workspace is not None:
                await self._keep(sandbox)
            await self._close_proxy()
            n_calls = await self._flush()
            self._judge_engine(n_calls)  # raises when the harness was stopped (done is None)
            if done is not None and self._judge_exit(done, n_calls, timeout):
                await self._verify(task, sandbox)
        finally:
            await self._destroy(sandbox)

    # -- before the sandbox ---------------------------------------------------------------

    def _load_task(self) -> Task:
        req = self.req
        try:
            task = load_task(req.suite, req.task_id) if req.suite else _load_path(req.task_id)
        except TaskError as e:
            self.report.bad_request = f"task not found: {e}"
            raise _Fail("harness_error", "task_not_found", self.report.bad_request) from None
        if req.task_hash and task.task_hash and req.task_hash != task.task_hash:
            self.report.bad_request = (
                f"task {task.name} changed: request has hash {req.task_hash}, this actor "
                f"{task.task_hash} (re-sync the task files)"
            )
            raise _Fail("harness_error", "task_changed", self.report.bad_request)
        self.report.task = task
        return task

    def _adapter(self) -> HarnessAdapter:
        try:
            adapter = get_adapter(self.req.harness)
        except KeyError as e:
            self.report.bad_request = str(e.args[0])
            raise _Fail("harness_error", "unknown_harness", self.report.bad_request) from None
        if adapter.name == "command" and not self.req.harness_cmd.strip():
            self.report.bad_request = "the command harness needs harness_cmd"
            raise _Fail("harness_error", "no_command", self.report.bad_request)
        return adapter

    def _timeout(self, task: Task) -> float:
        return self.req.timeout_s or self.settings.harness_timeout_s or task.agent_timeout_s

    async def _prepare(self, adapter: HarnessAdapter, task: Task, timeout: float) -> LaunchSpec:
        cache = self.deps.cache_dir
        if not adapter.is_installed(cache):
            if not self.settings.install_harnesses:
                why = f"harness {adapter.name} is not installed (harnessrl harness install)"
                raise _Fail("harness_error", "not_installed", why)
            try:
                log.info("installing harness %s into %s", adapter.name, cache)
                await adapter.install(cache)
            except Exception as e:
                why = f"installing {adapter.name} failed: {_tail(str(e), 1000)}"
                raise _Fail("harness_error", "install_failed", why) from None
        try:
            spec = adapter.prepare(self._context(adapter, task, timeout))
        except (HarnessNotInstalled, ValueError, OSError) as e:
            raise _Fail("harness_error", "prepare_failed", f"{adapter.name}: {e}") from None
        self.report.launch = spec.redacted(self.token)
        version = harness_version(adapter, cache)
        self.result.harness_version = version
        self.deps.recorder.register(self.rid, harness=adapter.name, harness_version=version)
        return spec

    def _context(self, adapter: HarnessAdapter, task: Task, timeout: float) -> HarnessContext:
        s = self.settings
        options = dict(s.harness_options.get(adapter.name, {}))
        env = dict(s.harness_env)
        if adapter.name == "command":
            options["command"] = self.req.harness_cmd
            if s.expose_solution and task.solution is not None:
                binds, env["HRL_SOLUTION"] = _solution_binds(task.solution)
                options["ro_binds"] = [*options.get("ro_binds", []), *binds]
        window = s.context_window or self.deps.max_context
        return HarnessContext(
            instruction=task.instruction,
            token=self.token,
            model=s.model_name,
            proxy_url=f"http://127.0.0.1:{s.proxy_port}",
            workspace=task.mount,
            home=_home_for(task.mount),
            max_turns=s.max_turns or None,
            timeout_s=timeout,
            context_window=window or None,
            max_output_tokens=s.output_limit(),
            cache_dir=self.deps.cache_dir,
            env=env,
            options=options,
        )

    async def _start_proxy(self) -> None:
        from harnessrl.proxy.server import ProxyServer

        self.sock = self.deps.socket_dir / f"{secrets.token_hex(6)}.sock"
        self.deps.caller.seed_rollout(self.rid, self.req.seed)
        self.server = ProxyServer(
            self.deps.caller,
            {self.token: self.rid},
            model_name=self.settings.model_name,
            unix_path=str(self.sock),
            max_body_bytes=self.settings.request_limit(self.deps.max_context),
        )
        await self.server.start()

    async def _preload(self, spec: LaunchSpec) -> None:
        """Make ``spec`` a preloaded start when its harness declares one and a preloader for
        it runs (started on first use); else it stays cold."""
        pool = self.deps.preloads
        if pool is None or spec.preload is None:
            return
        self.preloader = await pool.get(spec.preload)
        if self.preloader is not None:
            self.preload_run = pool.wrap(spec, self.preloader)
            self.report.launch["preloaded"] = True

    # -- the sandbox ----------------------------------------------------------------------

    async def _create_sandbox(self, task: Task, spec: LaunchSpec, timeout: float) -> Sandbox:
        s = self.settings
        sb_spec = SandboxSpec(
            workspace_src=task.workspace_dir,
            workdir=task.mount,
            home=_home_for(task.mount),
            proxy_socket=self.sock,
            proxy_port=s.proxy_port,
            ro_binds=list(spec.ro_binds),
            limits=Limits(
                memory_bytes=s.sandbox_memory_mb * MiB,
                max_processes=s.sandbox_max_processes,
                disk_bytes=s.sandbox_disk_mb * MiB or None,
                wall_clock_s=timeout + task.verifier_timeout_s + VERIFY_SLACK_S,
            ),
            owner=self.deps.actor,
            environment=task.environment if s.task_environments else None,
        )
        t0 = time.monotonic()
        try:
            sandbox = await self.deps.backend.create(sb_spec)
        except (SandboxError, OSError) as e:
            raise _Fail(
                "sandbox_error", "sandbox_create", f"sandbox creation failed: {e}"
            ) from None
        took = time.monotonic() - t0
        self.durations["sandbox"] = took
        M_SANDBOX_CREATE.labels(backend=self.deps.backend.name).observe(took)
        return sandbox

    async def _launch(self, sandbox: Sandbox, spec: LaunchSpec) -> ExecResult | None:
        t0 = time.monotonic()
        try:
            try:
                await write_launch_files(sandbox, spec)
            except RuntimeError as e:
                if isinstance(e, SandboxError):
                    raise
                raise _Fail("harness_error", "launch_files", str(e)) from None
            done = await self._run_harness(sandbox, spec)
        except SandboxError as e:
            raise _Fail("sandbox_error", "sandbox_run", f"sandbox failed: {e}") from None
        finally:
            self.durations["harness"] = time.monotonic() - t0
        rep = self.report
        if done is None:  # stopped: no engine
            rep.harness_exit = -9
            return None
        if done.cpu_s is not None:
            extra = self.preloader.take_cpu(self.preload_run) if self.preloader else None
            self.durations["harness_cpu"] = done.cpu_s + (extra or 0.0)
        rep.harness_exit, rep.timed_out = done.returncode, done.timed_out
        rep.harness_stdout, rep.harness_stderr = _tail(done.stdout), _tail(done.stderr)
        return done

    async def _run_harness(self, sandbox: Sandbox, spec: LaunchSpec) -> ExecResult | None:
        """The harness's run, or None when it was stopped because no engine was in rotation
        for ``engine_grace_s`` (`engines_gone` says why). Cancelling ``sandbox.run`` kills
        the harness and every process it started."""
        run = asyncio.ensure_future(
            sandbox.run(
                spec.argv, env=spec.env, cwd=spec.cwd, timeout=spec.timeout_s, stdin=spec.stdin
            )
        )
        watch = asyncio.ensure_future(self._engines_down_for(self.settings.engine_grace_s))
        try:
            await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (run, watch):
                t.cancel()  # a no-op for the one that finished
            await asyncio.gather(run, watch, return_exceptions=True)
        if not run.cancelled():
            return run.result()
        router = self.deps.router
        self.engines_gone = (
            f"no engine in rotation for {self.settings.engine_grace_s:g} s: the harness was "
            f"stopped ({_tail(router.down(), 500)})"
        )
        log.warning("rollout %s: %s", self.rid, self.engines_gone)
        return None

    async def _engines_down_for(self, grace: float) -> None:
        """Return once no engine has been in rotation for ``grace`` seconds on end."""
        router = self.deps.router
        while True:
            since = router.down_since
            left = grace if since is None else since + grace - time.monotonic()
            if since is not None and left <= 0:
                return
            await asyncio.sleep(min(max(left, 0.05), 1.0))

    async def _keep(self, sandbox: Sandbox) -> None:
        dest = Path(self.keep_workspace)  # type: ignore[arg-type]
        try:
            await sandbox.copy_out(dest)
            self.report.workspace = dest
        except (SandboxError, OSError) as e:
            log.warning("rollout %s: keeping the workspace in %s failed: %s", self.rid, dest, e)

    def _judge_engine(self, n_calls: int) -> None:
        """Raise `_Fail` (``engine_error``) when the engines failed the rollout: the harness
        was stopped for want of an engine, or a model call failed for an infrastructure reason
        and none generated after it."""
        if self.engines_gone:
            raise _Fail("engine_error", "engine_unreachable", self.engines_gone)
        router = self.deps.router
        o = router.outcome(self.rid)
        if not o.failed:
            return
        where = f"engine {o.engine}" if o.engine else "engines " + ", ".join(router.urls)
        what = {"engine_unreachable": "unreachable", "engine_unavailable": "unavailable"}
        after = "" if o.since_ok == o.failures else f" ({o.since_ok} after the last one served)"
        raise _Fail(
            "engine_error",
            o.reason,
            f"{o.failures} of {max(n_calls, o.failures)} model calls failed{after}: {where} "
            f"{what.get(o.reason, 'failed')}: {_tail(o.error, 500)}",
        )

    def _judge_exit(self, done: ExecResult, n_calls: int, timeout: float) -> bool:
        """Whether the workspace is to be verified (raises `_Fail` for a failed run)."""
        if done.disk_exceeded:  # the harness's own doing: scored 0, as a failed attempt
            M_FAILURES.labels(reason="disk_quota").inc()
            limit = self.settings.sandbox_disk_mb
            self.result.reward, self.result.metrics = 0.0, {}
            self.result.error = (
                f"disk quota: the sandbox held {done.disk_exceeded / MiB:.0f} MiB across its "
                f"writable mounts, over its {limit} MiB (sandbox_disk_mb); stopped, scored 0"
            )
            return False
        if done.killed:  # an infrastructure death is never the model's failure
            raise _Fail(
                "sandbox_error",
                "sandbox_killed",
                f"sandbox killed from outside while the harness ran ({done.killed}; exit "
                f"{done.returncode}, {n_calls} model calls): {_said(done, 1000)}",
            )
        if done.timed_out:
            msg = f"harness killed at its {timeout:g} s timeout"
            if self.settings.timeout_scoring == "discard":
                raise _Fail("timeout", "timeout", msg)
            M_FAILURES.labels(reason="timeout_scored").inc()
            self.result.error = msg + " (workspace scored anyway)"
            return True
        rc = done.returncode
        if rc in NOT_RUNNABLE_EXITS or (rc != 0 and n_calls == 0):
            why = "could not start" if rc in NOT_RUNNABLE_EXITS else "failed before any model call"
            raise _Fail(
                "harness_error", "harness_exit", f"harness {why} (exit {rc}): {_said(done)}"
            )
        return True

    async def _verify(self, task: Task, sandbox: Sandbox) -> None:
        from harnessrl.actors.verifier import verify

        if self.settings.reward_weights:
            weights = {**task.metric_weights, **self.settings.reward_weights}
            task = task.model_copy(update={"metric_weights": weights})
        t0 = time.monotonic()
        try:
            vr = await verify(task, sandbox, self.deps.judge)
        except SandboxError as e:
            raise _Fail("sandbox_error", "sandbox_verify", f"sandbox failed: {e}") from None
        except Exception as e:  # a verifier bug must not end the actor's loop
            log.exception("rollout %s: verifier failed", self.rid)
            raise _Fail("verifier_error", "verifier_bug", f"verifier failed: {e!r}") from None
        finally:
            self.durations["verify"] = time.monotonic() - t0
        self.report.verifier_output = vr.output
        if vr.status != "ok":
            reason = f"verifier_{vr.reason}" if vr.reason else "verifier"
            raise _Fail("verifier_error", reason, vr.error)
        self.result.reward, self.result.metrics = vr.reward, dict(vr.metrics)
        notes = []
        if vr.checker_error:
            M_FAILURES.labels(reason="checker_failed").inc()
            notes.append(f"checker failed (scored {vr.reward:g}): {vr.checker_error}")
        if vr.judge_error:
            notes.append(f"rubric judge failed, code score only: {vr.judge_error}")
        if notes:
            self.result.error = "; ".join(
                [self.result.error, *notes] if self.result.error else notes
            )

    async def _destroy(self, sandbox: Sandbox) -> None:
        t0 = time.monotonic()
        try:
            await sandbox.destroy()
        except Exception as e:  # the backend's sweep gets whatever is left
            log.error("rollout %s: destroying its sandbox failed: %r", self.rid, e)
        took = time.monotonic() - t0
        self.durations["destroy"] = took
        M_SANDBOX_DESTROY.labels(backend=self.deps.backend.name).observe(took)

    # -- the proxy ------------------------------------------------------------------------

    async def _close_proxy(self) -> None:
        """Abort this rollout's in-flight engine calls, stop its server, remove its socket."""
        server, self.server = self.server, None
        if server is None:
            return
        router = self.deps.router
        prefix = f"{self.rid}-"
        for rid in [r for r in getattr(router, "_inflight", {}) if r.startswith(prefix)]:
            with contextlib.suppress(Exception):
                await router.abort(rid)
        try:
            await asyncio.wait_for(server.stop(), PROXY_STOP_TIMEOUT_S)
        except Exception as e:
            log.warning("rollout %s: stopping its proxy: %r", self.rid, e)
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.unlink()

    async def _flush(self) -> int:
        """Wait until the bus stored every record of the rollout; their number."""
        from harnessrl.proxy.recorder import RecordLost

        t0 = time.monotonic()
        try:
            n = await self.deps.recorder.flush(self.rid, timeout=self.settings.flush_timeout_s)
        except RecordLost as e:
            ro = self.deps.recorder.rollouts.get(self.rid)
            n = ro.recorded if ro is not None else 0
            log.error("rollout %s: %s", self.rid, e)
        except TimeoutError:
            raise TimeoutError(
                f"rollout {self.rid}: the bus did not store its call records within "
                f"{self.settings.flush_timeout_s:g} s"
            ) from None
        self.durations["flush"] = self.durations.get("flush", 0.0) + time.monotonic() - t0
        return n

    # -- accounting -------------------------------------------------------------------------

    def _observe(self) -> None:
        res = self.result
        M_ROLLOUTS.labels(status=res.status).inc()
        M_CALLS.observe(res.n_calls)
        for phase in ("sandbox", "harness", "verify", "total"):
            if phase in self.durations:
                M_PHASE.labels(phase=phase).observe(self.durations[phase])
        if res.status == "ok":
            kind = "eval" if res.is_eval else "train"
            M_REWARD.labels(harness=res.harness, kind=kind).observe(res.reward)


def _load_path(task_id: str) -> Task:
    from harnessrl.common.tasks import load_task_path

    return load_task_path(task_id)


def _home_for(mount: str) -> str:
    """``$HOME`` inside: ``/root`` for workspaces under it (ClawGym's ``~/.openclaw/…``)."""
    return "/root" if mount.startswith("/root/") else "/home/hrl"


def _solution_binds(solution: Path) -> tuple[list[list[str]], str]:
    """Read-only binds exposing a reference solution, and the script's path inside."""
    solution = solution.resolve()
    if solution.parent.name == "solution":  # a solution folder (Harbor: solve.sh + files)
        return [[str(solution.parent), SOLUTION_MOUNT]], f"{SOLUTION_MOUNT}/{solution.name}"
    inside = f"{SOLUTION_MOUNT}/{solution.name}"
    return [[str(solution), inside]], inside
