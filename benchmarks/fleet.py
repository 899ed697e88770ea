"""Fleet simulation: over 1,000 rollouts in flight across 4 actor processes on one machine.

    python -m benchmarks.fleet [--quick]

Everything between the task queue and the samples is the real thing, each in its own process
where it would be in production: a nats-server (JetStream, ephemeral port), 4 actor processes
(``harnessrl.actors.service.serve``: the actor service, one proxy per rollout on its own unix socket,
the shared recorder publishing CallRecords, heartbeats, the verifier), the assembler process
(``harnessrl assembler``) and a scripted engine process (``harnessrl.proxy.scripted.ScriptedEngine``
speaking SGLang's native API). This process is the feeder (TaskRequests, keeping the queue
ahead of the free slots) and the learner's side of SAMPLES (it consumes and counts every
sample and tombstone). Only two things are scripted:

* **the engine** answers every call of a rollout with a Hermes tool call: ``run`` with
  ``sleep S`` (S drawn per rollout and call in ``[sleep_lo, sleep_hi]``) until the rollout's
  last call, which is ``finish``; each answer takes ``engine_s``;
* **the harness**. ``noop`` phase (the 1,000 figure): a **no-op sandbox** (`NoopBackend`: no
  isolation, the sandbox's paths are folders of one host directory) whose harness is a
  coroutine of the actor (`scripted_harness`): an agent loop over HTTP on the rollout's proxy
  socket that sleeps for each ``run`` and stops at ``finish`` (a thousand harness processes do
  not fit this 2-core machine next to the rest); every other command (the launch files, the
  verifier with its real checker) runs as a plain host process. ``bwrap`` phase: real
  bubblewrap sandboxes with the proxy forwarder and the real ``reference`` agent
  (``actors/harnesses/reference_agent.py``), whose ``run`` tool runs ``sleep`` in the sandbox:
  what one rollout costs in memory when it is isolated, at 50 in flight.

Reported per phase, over a steady window that starts once the actors' in-flight gauges
(``hrl_actor_rollouts_inflight``) add up to the target: in flight (min / median), records/s
(CallRecords the actors' recorders stored), assembler calls/s and rollouts/s, bus lag (the
assembler's rollout-end -> sample-stored histogram, the record -> bus-ack latency, and the
results waiting for the assembler: its consumer's pending + ack-pending), memory (RSS and USS of
the actor processes with their sandboxes, total and per in-flight rollout, beside the same
actors idle), file descriptors per actor, CPU of each component, and **lost**: issued members
(``group_id``, ``k``) without a sample or tombstone once the feeder stopped and the fleet
drained. Baseline (same run): the actors' memory before any task, and the call rate the fleet
would produce if nothing throttled it (``in flight x calls per rollout / rollout duration``).
Targets: ``in_flight`` (the window's minimum) >= 1,000 and ``lost`` == 0 (full runs; quick
runs: the quick fleet's size).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import parse_args, print_table, target, write_result
from harnessrl.actors.sandbox import _fs
from harnessrl.actors.sandbox.base import (
    ExecResult,
    SandboxBase,
    SandboxError,
    SandboxSpec,
    workspace_relpath,
)

FLEET_HARNESS = "hrl-fleet-harness"
"""The ``command`` harness line that `NoopSandbox` runs as `scripted_harness`."""
TASK_SUITE, TASK_ID = "toy", "copy_01"
MAX_TURNS = 64
"""The scripted harness gives up after this many model calls."""


@dataclass
class Phase:
    """One fleet configuration."""

    name: str
    sandbox: str
    """``noop`` or ``bwrap``."""
    harness: str
    """``command`` (`FLEET_HARNESS`) or ``reference``."""
    actors: int
    slots: int
    """Concurrency of each actor."""
    target: int
    """In-flight rollouts the steady window needs."""
    calls: int
    """Model calls per rollout."""
    sleep_lo: float
    """Shortest ``sleep`` the engine asks for (a tool call's duration, seconds)."""
    sleep_hi: float
    """Longest ``sleep``."""
    engine_s: float
    """Seconds the engine takes per call."""
    window_s: float
    """Length of the steady window."""
    drain_s: float
    """Longest wait for the last samples after the feeder stopped."""

    @property
    def rollout_s(self) -> float:
        """A rollout's length if nothing but the harness's sleeps and the engine took time."""
        return (self.calls - 1) * (self.sleep_lo + self.sleep_hi) / 2 + self.calls * self.engine_s


FULL = [
    # 1,160 slots for the 1,000 target: a finished rollout's slot stays empty until its
    # actor has acked the task and fetched the next (the first full run, with 1,040 slots,
    # dipped to 957 in flight while a wave of rollouts ended together)
    Phase("noop", "noop", "command", 4, 290, 1000, 4, 60.0, 120.0, 0.2, 300.0, 900.0),
    Phase("bwrap", "bwrap", "reference", 2, 25, 50, 3, 10.0, 20.0, 0.2, 40.0, 600.0),
]
QUICK = [
    Phase("noop", "noop", "command", 4, 16, 60, 3, 1.0, 3.0, 0.05, 8.0, 600.0),
    Phase("bwrap", "bwrap", "reference", 1, 4, 4, 2, 1.0, 2.0, 0.05, 3.0, 600.0),
]


# ---------------------------------------------------------------------------------------------
# the scripted engine (its own process)
# ---------------------------------------------------------------------------------------------


def tool_call(name: str, **arguments: str) -> str:
    """Model text of one Hermes tool call."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def sleep_for(rollout: str, seq: int, lo: float, hi: float) -> float:
    """The ``sleep`` of call ``seq`` of ``rollout``: deterministic, spread over ``[lo, hi]``."""
    u = zlib.crc32(f"{rollout}:{seq}".encode()) % 1000 / 999
    return round(lo + u * (hi - lo), 2)


def engine_script(phases: dict[str, dict[str, Any]]):
    """The engine's answer to a call: ``run sleep S`` until the rollout's last call, then
    ``finish``, as its phase says. The proxy names each engine request ``<rollout id>-<seq>-
    <random>``, and the feeder names each group ``<phase>_<n>``."""
    from harnessrl.proxy.scripted import Reply

    def reply(input_ids: list[int], body: dict[str, Any]) -> Reply:
        rollout, seq, _ = str(body.get("rid", "x-0-0")).rsplit("-", 2)
        ph = phases.get(rollout.split("_", 1)[0]) or next(iter(phases.values()))
        n = int(seq) if seq.isdigit() else 0
        if n >= ph["calls"] - 1:
            return Reply(text=tool_call("finish", summary="done"), delay=ph["engine_s"])
        cmd = f"sleep {sleep_for(rollout, n, ph['sleep_lo'], ph['sleep_hi'])}"
        return Reply(text=tool_call("run", cmd=cmd), delay=ph["engine_s"])

    return reply


async def serve_engine(phases: dict[str, dict[str, Any]]) -> None:
    from harnessrl.proxy.scripted import ScriptedEngine

    fn = engine_script(phases)
    eng = await ScriptedEngine("tiny-1m", fn).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"fleet engine ready: {eng.url}", flush=True)
    while not stop.is_set():  # the engine keeps every request body for tests: not here
        eng.requests.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 5.0)
    await eng.stop()


# ---------------------------------------------------------------------------------------------
# the no-op sandbox and the scripted harness (inside each actor process)
# ---------------------------------------------------------------------------------------------


class NoopBackend:
    """Sandboxes without isolation, for load tests only: see `NoopSandbox`."""

    name = "noop"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._live: set[NoopSandbox] = set()

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    async def create(self, spec: SandboxSpec) -> NoopSandbox:
        state = Path(tempfile.mkdtemp(prefix="noop-", dir=self.root))
        sb = NoopSandbox(self, spec, state)
        try:
            await asyncio.to_thread(sb.populate)
        except OSError as e:
            await sb.destroy()
            raise SandboxError(f"no-op sandbox: {e}") from e
        self._live.add(sb)
        return sb

    async def sweep(self) -> int:
        return 0

    async def close(self) -> None:
        for sb in list(self._live):
            await sb.destroy()


class NoopSandbox(SandboxBase):
    """A sandbox that isolates nothing. Its workdir, home and ``/tmp`` are folders of one host
    directory: a command's argv, cwd and environment values naming them are rewritten to those
    folders, and it runs as a plain host process. The harness line `FLEET_HARNESS` runs as
    `scripted_harness` in the actor's own event loop, talking to the rollout's proxy socket."""

    def __init__(self, backend: NoopBackend, spec: SandboxSpec, state: Path) -> None:
        self.backend, self.spec, self.state = backend, spec, state
        self.workdir = spec.workdir
        self.workspace_host = state / "workspace"
        self._map = [(spec.workdir, self.workspace_host), (spec.home, state / "home")]
        self._map.append(("/tmp", state / "tmp"))
        self._procs: set[asyncio.subprocess.Process] = set()
        self._destroyed = False

    def populate(self) -> None:
        for _, host in self._map:
            host.mkdir(parents=True, exist_ok=True)
        if self.spec.workspace_src is not None:
            _fs.copy_in(self.spec.workspace_src, self.workspace_host, ".", None)

    def host_path(self, s: str) -> str:
        for inside, host in self._map:
            if s == inside or s.startswith(inside.rstrip("/") + "/"):
                return str(host) + s[len(inside.rstrip("/")) :]
        return s

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
        limit = self.spec.limits.wall_clock_s if timeout is None else timeout
        env = {**self.spec.env, **(env or {})}
        if not proxy:  # the verifier and file operations: no model API
            env.pop("HRL_PROXY_URL", None)
        elif argv[-1:] == [FLEET_HARNESS]:
            return await scripted_harness(self.spec.proxy_socket, env, limit)
        return await self._exec(argv, env, cwd, limit, stdin)

    async def _exec(self, argv, env, cwd, limit, stdin) -> ExecResult:
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        full_env = base | {"HOME": self.spec.home, "TMPDIR": "/tmp"} | env
        full_env = {k: self.host_path(v) for k, v in full_env.items()}
        where = self.host_path(cwd or self.workdir)
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *[self.host_path(a) for a in argv],
            cwd=where if Path(where).is_relative_to(self.state) else str(self.state),
            env=full_env,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._procs.add(proc)
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), limit)
            timed_out = False
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
            timed_out = True
        finally:
            self._procs.discard(proc)
        assert proc.returncode is not None
        return ExecResult(proc.returncode, out, err, timed_out, time.monotonic() - t0)

    async def read_file(self, path: str, *, max_bytes: int = 64 << 20) -> bytes:
        rel = workspace_relpath(self.workdir, path)
        return await asyncio.to_thread(_fs.read_file, self.workspace_host, rel, max_bytes)

    async def write_file(self, path: str, data: bytes) -> None:
        rel = workspace_relpath(self.workdir, path)
        await asyncio.to_thread(_fs.write_file, self.workspace_host, rel, data, None)

    async def copy_in(self, host_src: Path, dest: str) -> None:
        rel = workspace_relpath(self.workdir, dest)
        await asyncio.to_thread(_fs.copy_in, Path(host_src), self.workspace_host, rel, None)

    async def copy_out(self, dest_host: Path) -> None:
        await asyncio.to_thread(_fs.copy_out, self.workspace_host, Path(dest_host))

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        for proc in list(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(shutil.rmtree, self.state, True)
        self.backend._live.discard(self)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string"}},
                "required": [arg],
            },
        },
    }
    for name, arg in (("run", "cmd"), ("finish", "summary"))
]


async def scripted_harness(sock: Path | None, env: dict[str, str], limit: float) -> ExecResult:
    """An agent loop over the proxy's unix socket: chat completions with the whole history,
    ``run`` sleeps for its ``sleep S``, ``finish`` ends it; 5xx/429 are retried like a real
    harness does. Exit 0 when finished, 1 on an error, 2 out of turns."""
    t0 = time.monotonic()
    try:
        rc, err = await asyncio.wait_for(_agent(sock, env), limit)
        timed_out = False
    except TimeoutError:
        rc, err, timed_out = -9, b"timeout", True
    return ExecResult(rc, b"", err, timed_out, time.monotonic() - t0)


async def _agent(sock: Path | None, env: dict[str, str]) -> tuple[int, bytes]:
    import aiohttp

    if sock is None:
        return 1, b"no proxy socket"
    headers = {"Authorization": f"Bearer {env.get('OPENAI_API_KEY', '')}"}
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a fleet test agent. Use the tools."},
        {"role": "user", "content": env.get("HRL_INSTRUCTION", "Do the task.")},
    ]
    connector = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
        for _ in range(MAX_TURNS):
            body = {"model": env.get("OPENAI_MODEL", "m"), "messages": msgs, "tools": TOOLS}
            reply = await _complete(http, body)
            if reply is None:
                return 1, b"the proxy kept failing"
            msgs.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                msgs.append({"role": "user", "content": "Use the tools."})
            for call in calls:
                fn = call["function"]
                if fn["name"] == "finish":
                    return 0, b""
                args = json.loads(fn.get("arguments") or "{}")
                m = re.fullmatch(r"sleep ([0-9.]+)", str(args.get("cmd", "")))
                await asyncio.sleep(float(m.group(1)) if m else 0.0)
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
    return 2, b"out of turns"


async def _complete(http: Any, body: dict[str, Any]) -> dict[str, Any] | None:
    delay = 0.5
    for _ in range(8):
        async with http.post("http://proxy/v1/chat/completions", json=body) as r:
            if r.status == 200:
                return (await r.json())["choices"][0]["message"]
            if r.status not in (429, 500, 502, 503, 529):
                return None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 8.0)
    return None


async def serve_actor(spec: dict[str, Any]) -> int:
    from harnessrl.actors.config import ActorConfig
    from harnessrl.actors.service import serve

    noop_root = spec.pop("noop_root", None)
    cfg = ActorConfig(**spec)
    backend = NoopBackend(Path(noop_root)) if noop_root else None
    return await serve(cfg, backend=backend)


# ---------------------------------------------------------------------------------------------
# measuring processes
# ---------------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(stat.parent.name))
    return kids


def tree(pids: list[int]) -> list[int]:
    """``pids`` and all their descendants."""
    kids, out, todo = _children(), [], list(pids)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def memory_kib(pids: list[int]) -> tuple[int, int]:
    """(RSS, USS) of ``pids`` in KiB (processes gone meanwhile count 0). USS, the private pages,
    does not depend on who else maps the same libraries (PSS does: other Python processes on
    the machine would shrink it)."""
    rss = uss = 0
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                    uss += int(line.split()[1])
    return rss, uss


def cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def scrape(http: Any, port: int) -> dict[tuple[str, tuple], float]:
    """One ``/metrics`` page as ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(pages: list[dict[tuple[str, tuple], float]], name: str, **labels: str) -> float:
    """Sum of a sample over pages (and over label sets that include ``labels``)."""
    want = set(labels.items())
    return sum(v for pg in pages for (n, lb), v in pg.items() if n == name and want <= set(lb))


def hist_quantile(
    start: dict[tuple[str, tuple], float], end: dict[tuple[str, tuple], float], name: str, q: float
) -> float:
    """The ``q`` quantile of a histogram's observations between two scrapes (bucket bound)."""
    buckets = []
    for (n, lb), v in end.items():
        if n == f"{name}_bucket":
            le = float(dict(lb)["le"])
            buckets.append((le, v - start.get((n, lb), 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    for le, n in buckets:
        if n >= q * buckets[-1][1]:
            return le
    return float("inf")


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


async def consumer_lag(bus: Any, kind: str, durable: str) -> tuple[int, int]:
    """(not yet delivered, delivered but not acked) of a durable consumer; 0s before it exists."""
    try:
        info = await bus.js.consumer_info(bus.subjects.stream(kind), durable)
    except Exception:
        return 0, 0
    return int(info.num_pending or 0), int(info.num_ack_pending or 0)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    port: int = 0
    """Metrics port (actors, assembler) or engine port."""


async def start(
    name: str, argv: list[str], ready: str, log: Path, *, on_stderr: bool = False
) -> Proc:
    """Start a child (it dies with us) and wait for its line containing ``ready`` (on stdout,
    or stderr); both streams end up in ``log``."""
    from harnessrl.common.procs import popen_child

    logf = log.open("ab")
    pipe = subprocess.PIPE
    if on_stderr:
        p = popen_child(argv, stdout=logf, stderr=pipe, new_session=True)
        stream = p.stderr
    else:
        p = popen_child(argv, stdout=pipe, stderr=logf, new_session=True)
        stream = p.stdout
    assert stream is not None
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await asyncio.wait_for(loop.run_in_executor(None, stream.readline), 300)
            if not line:
                raise RuntimeError(f"{name} exited ({p.wait()}): {log.read_text()[-2000:]}")
            logf.write(line)
            text = line.decode(errors="replace")
            if ready in text:
                m = re.search(r":(\d+)", text)
                # its own thread: the loop's executor must stay free (the bus encodes there)
                threading.Thread(target=_copy, args=(stream, logf), daemon=True).start()
                return Proc(name, p, int(m.group(1)) if m else 0)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        logf.close()
        raise


def _copy(stream: Any, logf: Any) -> None:
    with logf:
        for line in stream:
            logf.write(line)


def stop(procs: list[Proc], timeout: float = 60.0) -> None:
    """SIGTERM each child (its own group), then SIGKILL what is left after ``timeout``."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait()


@dataclass
class Ledger:
    """Issued members and what came of them on SAMPLES."""

    issued: set[tuple[str, int]] = field(default_factory=set)
    outcomes: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    """Member -> the outcome of each sample received (``sample`` or the tombstone's reason)."""
    calls: int = 0
    """Calls of the samples received (their counters)."""

    unfinished: int = 0
    """Members without an outcome whose task was still on the TASKS work queue (queued or
    running, not acked) when the drain gave up: late, not lost."""

    def missing(self) -> int:
        """Members without a sample or tombstone yet."""
        return len(self.issued - self.outcomes.keys())

    def lost(self) -> int:
        """Members without an outcome whose task is gone from the queue: an actor acked it (it
        does so only once its result is stored), yet no sample or tombstone came of it."""
        return self.missing() - self.unfinished


class Fleet:
    """One phase: its run's streams, assembler and actors on the shared server and engine."""

    def __init__(self, ph: Phase, url: str, engine: str, tmp: Path) -> None:
        self.ph, self.url, self.engine, self.tmp = ph, url, engine, tmp
        self.run = f"fleet{ph.name}{uuid.uuid4().hex[:6]}"
        self.ledger = Ledger()
        self.feeding = True
        self.procs: list[Proc] = []
        self.samples: list[dict[str, Any]] = []
        """Monitor samples over the phase."""

    @property
    def slots(self) -> int:
        return self.ph.actors * self.ph.slots

    def actor_spec(self, i: int) -> dict[str, Any]:
        ph = self.ph
        spec: dict[str, Any] = dict(
            nats=self.url,
            run=self.run,
            engines=[self.engine],
            model="tiny-1m",
            name=f"{ph.name}-{i}",
            concurrency=ph.slots,
            metrics_port=0,
            log_level="warning",
            install_harnesses=False,
            sandbox_root=str(self.tmp / f"sandboxes-{ph.name}-{i}"),
        )
        if ph.sandbox == "noop":
            spec["noop_root"] = spec["sandbox_root"]
        return spec

    async def start(self) -> None:
        py, logs = sys.executable, self.tmp
        asm = [py, "-m", "harnessrl.learner.assembler_cmd", "--nats", self.url, "--run", self.run]
        asm += ["--metrics-port", "0", "--log-level", "warning"]
        log = logs / f"{self.run}-assembler.log"
        starting = [start("assembler", asm, "metrics on", log, on_stderr=True)]
        for i in range(self.ph.actors):
            argv = [py, "-m", "benchmarks.fleet", "--serve-actor", json.dumps(self.actor_spec(i))]
            starting.append(start(f"actor{i}", argv, "actor ready", logs / f"{self.run}-a{i}.log"))
        got = await asyncio.gather(*starting, return_exceptions=True)
        self.procs = [p for p in got if isinstance(p, Proc)]  # stopped by the caller
        for e in got:
            if isinstance(e, BaseException):
                raise e

    @property
    def actors(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("actor")]

    @property
    def assembler(self) -> Proc:
        return next(p for p in self.procs if p.name == "assembler")

    # -- feeding and consuming ----------------------------------------------------------------

    async def feed(self, bus: Any) -> None:
        """Keep ``slots + margin`` members outstanding (issued, no sample yet) while feeding."""
        from harnessrl.common.records import TaskRequest, member_claim
        from harnessrl.learner.config import FeederConfig
        from harnessrl.learner.task_queue import TaskQueue

        await TaskQueue(bus, FeederConfig()).ensure()  # the feeder owns the actors' consumer
        key = await bus.claim_key(create=True)  # and the claims the assembler checks
        ph, n, group = self.ph, 0, 8
        margin = max(16, self.slots // 8)
        timeout = max(300.0, 3 * ph.rollout_s)  # a starved machine must not time rollouts out
        while self.feeding:
            outstanding = len(self.ledger.issued) - len(self.ledger.outcomes)
            want = self.slots + margin - outstanding
            items = []
            for _ in range(max(0, want)):
                gid, k = f"{ph.name}_{n // group}", n % group
                req = TaskRequest(
                    group_id=gid,
                    k=k,
                    group_size=group,
                    issued_version=0,
                    task_id=TASK_ID,
                    suite=TASK_SUITE,
                    harness=ph.harness,
                    harness_cmd=FLEET_HARNESS if ph.harness == "command" else "",
                    timeout_s=timeout,
                    created_at=time.time(),
                    claim=member_claim(key, gid, k),
                )
                items.append((bus.subjects.tasks, req, req.msg_id()))
                self.ledger.issued.add((gid, k))
                n += 1
            for i in range(0, len(items), 256):
                await bus.publish_many(items[i : i + 256])
            await asyncio.sleep(0.5)

    async def consume(self, bus: Any) -> None:
        """The learner's side of SAMPLES: count each member's outcomes, ack everything."""
        from harnessrl.common.records import TreeSample

        consumer = await bus.consumer("SAMPLES", "learner", TreeSample, ack_wait=30.0)
        while True:
            for d in await consumer.fetch(256, timeout=1.0):
                s = d.record
                member = (s.group_id, s.k)
                outcome = s.dropped_reason or "sample"
                self.ledger.outcomes.setdefault(member, []).append(outcome)
                self.ledger.calls += s.counters.n_calls
                await d.ack()

    # -- monitoring ------------------------------------------------------------------------

    async def observe(self, http: Any, bus: Any, nats_pid: int, engine_pid: int) -> dict:
        pages = await asyncio.gather(*(scrape(http, p.port) for p in self.procs))
        actor_pages = pages[1:] if self.procs[0].name == "assembler" else pages
        backlog = await consumer_lag(bus, "ROLLOUTS", "assembler")
        queued = await consumer_lag(bus, "TASKS", "actors")
        actor_pids = [p.popen.pid for p in self.actors]
        rss, uss = memory_kib(tree(actor_pids))
        return {
            "t": time.monotonic(),
            "pages": pages,
            "in_flight": int(total(actor_pages, "hrl_actor_rollouts_inflight")),
            "rss_kib": rss,
            "uss_kib": uss,
            "fds": [open_fds(p) for p in actor_pids],
            "assembler_backlog": backlog[0] + backlog[1],
            "tasks_queued": queued[0],
            "cpu": {
                "actors": sum(cpu_s(p) for p in actor_pids),
                "assembler": cpu_s(self.assembler.popen.pid),
                "engine": cpu_s(engine_pid),
                "nats": cpu_s(nats_pid),
                "driver": cpu_s(os.getpid()),
            },
        }

    async def measure(self, bus: Any, nats_pid: int, engine_pid: int) -> dict[str, Any]:
        import aiohttp

        ph = self.ph
        interval = 1.0 if ph.window_s < 30 else 2.0
        async with aiohttp.ClientSession() as http:
            idle = await self.observe(http, bus, nats_pid, engine_pid)
            workers = [asyncio.create_task(self.feed(bus)), asyncio.create_task(self.consume(bus))]
            try:
                t_feed = time.monotonic()
                first: dict | None = None
                window: list[dict] = []
                while True:  # ramp up, then the steady window
                    await asyncio.sleep(interval)
                    for w in workers:
                        if w.done():
                            w.result()  # the feeder or the consumer failed: say why
                    s = await self.observe(http, bus, nats_pid, engine_pid)
                    self._log(s, "ramp" if first is None else "steady")
                    if first is None and s["in_flight"] >= ph.target:
                        first = s
                    if first is not None:
                        window.append(s)
                        if s["t"] - first["t"] >= ph.window_s:
                            break
                    if first is None and time.monotonic() - t_feed > max(900, ph.window_s):
                        raise RuntimeError(f"{ph.name}: in flight stuck at {s['in_flight']}")
                self.feeding = False
                ramp_s = first["t"] - t_feed
                drained = await self._drain(http, bus, nats_pid, engine_pid)
                await self._audit(bus)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        return self.summary(idle, window, ramp_s, drained)

    async def _drain(self, http: Any, bus: Any, nats_pid: int, engine_pid: int) -> float:
        t0 = time.monotonic()
        while self.ledger.missing() and time.monotonic() - t0 < self.ph.drain_s:
            await asyncio.sleep(1.0)
            if int(time.monotonic() - t0) % 15 == 0:
                s = await self.observe(http, bus, nats_pid, engine_pid)
                self._log(s, f"drain ({self.ledger.missing()} outstanding)")
        return time.monotonic() - t0

    async def _audit(self, bus: Any) -> None:
        """Count the members still missing whose task is still on the queue (`Ledger.unfinished`)."""
        from harnessrl.common.records import TaskRequest, decode

        missing = self.ledger.issued - self.ledger.outcomes.keys()
        if not missing:
            return
        queued = {
            (t.group_id, t.k)
            for _, data in await bus.stored(bus.subjects.tasks)
            for t in [decode(data, TaskRequest)]
        }
        self.ledger.unfinished = len(missing & queued)

    def _log(self, s: dict, what: str) -> None:
        print(
            f"  [{self.ph.name}] {what}: in flight {s['in_flight']}, "
            f"samples {len(self.ledger.outcomes)}/{len(self.ledger.issued)}, "
            f"assembler backlog {s['assembler_backlog']}, rss {s['rss_kib'] / 1024:.0f} MiB",
            flush=True,
        )

    def summary(self, idle: dict, window: list[dict], ramp_s: float, drain_s: float) -> dict:
        ph, a, b = self.ph, window[0], window[-1]
        secs = b["t"] - a["t"]
        actors_a, actors_b = a["pages"][1:], b["pages"][1:]
        asm_a, asm_b = a["pages"][0], b["pages"][0]

        def rate(pages_a, pages_b, name, **lb) -> float:
            return (total(pages_b, name, **lb) - total(pages_a, name, **lb)) / secs

        def mean_of(pages_a, pages_b, name) -> float:
            n = total(pages_b, f"{name}_count") - total(pages_a, f"{name}_count")
            s = total(pages_b, f"{name}_sum") - total(pages_a, f"{name}_sum")
            return s / n if n else float("nan")

        in_flight = [s["in_flight"] for s in window]
        per = [s["rss_kib"] / s["in_flight"] for s in window if s["in_flight"]]
        per_uss = [s["uss_kib"] / s["in_flight"] for s in window if s["in_flight"]]
        marginal = [(s["rss_kib"] - idle["rss_kib"]) / s["in_flight"] for s in window]
        marginal_uss = [(s["uss_kib"] - idle["uss_kib"]) / s["in_flight"] for s in window]
        mid = window[len(window) // 2]
        fds = [f for s in window for f in s["fds"]]
        outcomes = Counter(o for v in self.ledger.outcomes.values() for o in v)
        expected = statistics.median(in_flight) * ph.calls / ph.rollout_s
        calls_s = rate([asm_a], [asm_b], "hrl_assembler_calls_total")
        return {
            "sandbox": ph.sandbox,
            "harness": ph.harness,
            "actors": ph.actors,
            "slots": self.slots,
            "in_flight": min(in_flight),
            "in_flight_median": statistics.median(in_flight),
            "window_s": round(secs, 1),
            "ramp_s": round(ramp_s, 1),
            "drain_s": round(drain_s, 1),
            "records_per_s": round(
                rate(actors_a, actors_b, "hrl_proxy_records_total", outcome="published"), 2
            ),
            "assembler_calls_per_s": round(calls_s, 2),
            "assembler_rollouts_per_s": round(
                rate([asm_a], [asm_b], "hrl_assembler_rollouts_total"), 3
            ),
            "expected_calls_per_s": round(expected, 2),
            "bus_lag": {
                "rollout_end_to_sample_mean_s": round(
                    mean_of([asm_a], [asm_b], "hrl_assembler_lag_seconds"), 3
                ),
                "rollout_end_to_sample_p99_s_le": hist_quantile(
                    asm_a, asm_b, "hrl_assembler_lag_seconds", 0.99
                ),
                "record_to_bus_ack_mean_ms": round(
                    1e3 * mean_of(actors_a, actors_b, "hrl_proxy_record_publish_seconds"), 2
                ),
                "assembler_backlog_max": max(s["assembler_backlog"] for s in window),
                "assembler_backlog_median": statistics.median(
                    s["assembler_backlog"] for s in window
                ),
                "tasks_queued_median": statistics.median(s["tasks_queued"] for s in window),
            },
            "memory": {
                "actors_rss_mib": round(mid["rss_kib"] / 1024, 1),
                "actors_uss_mib": round(mid["uss_kib"] / 1024, 1),
                "idle_actors_rss_mib": round(idle["rss_kib"] / 1024, 1),
                "rss_per_rollout_kib": round(statistics.median(per)),
                "uss_per_rollout_kib": round(statistics.median(per_uss)),
                "marginal_rss_per_rollout_kib": round(statistics.median(marginal)),
                "marginal_uss_per_rollout_kib": round(statistics.median(marginal_uss)),
            },
            "fds_per_actor_max": max(fds),
            "fds_per_rollout": round(
                (statistics.median(sum(s["fds"]) for s in window) - sum(idle["fds"]))
                / statistics.median(in_flight),
                2,
            ),
            "cpu_cores": {k: round((b["cpu"][k] - a["cpu"][k]) / secs, 3) for k in a["cpu"]},
            "issued": len(self.ledger.issued),
            "samples": outcomes.get("sample", 0),
            "tombstones": {k: v for k, v in outcomes.items() if k != "sample"},
            "duplicates": sum(len(v) - 1 for v in self.ledger.outcomes.values()),
            "calls_in_samples": self.ledger.calls,
            "unfinished": self.ledger.unfinished,
            "lost": self.ledger.lost(),
        }


async def bwrap_usable(tmp: Path) -> str | None:
    """None when bubblewrap runs here, else why not."""
    from harnessrl.actors.sandbox.bwrap import BwrapBackend

    return await BwrapBackend(tmp / "probe").probe()


async def main(quick: bool) -> dict[str, Any]:
    from harnessrl.common.bus import connect
    from harnessrl.common.natsd import NatsServer

    phases = QUICK if quick else FULL
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hrl-fleet-") as d, NatsServer(Path(d) / "nats") as ns:
        tmp = Path(d)
        spec = json.dumps({ph.name: asdict(ph) for ph in phases})
        argv = [sys.executable, "-m", "benchmarks.fleet", "--serve-engine", spec]
        engine = await start("engine", argv, "ready", tmp / "engine.log")
        try:
            for ph in phases:
                if ph.sandbox == "bwrap" and (why := await bwrap_usable(tmp)) is not None:
                    out[ph.name] = {"skipped": f"bubblewrap not usable: {why}"}
                    continue
                fleet = Fleet(ph, ns.url, f"http://127.0.0.1:{engine.port}", tmp)
                bus = await connect(ns.url, fleet.run)
                try:
                    await fleet.start()
                    print(f"{ph.name}: {ph.actors} actors x {ph.slots} slots started", flush=True)
                    out[ph.name] = await fleet.measure(bus, ns.proc.pid, engine.popen.pid)
                    out[ph.name]["results_stored"] = await bus.stream_count("ROLLOUTS")
                finally:
                    await asyncio.to_thread(stop, fleet.procs)
                    await bus.close()
        finally:
            await asyncio.to_thread(stop, [engine])
    return out


def report(res: dict[str, Any], quick: bool, out: Path) -> Path:
    rows = []
    for name, r in res.items():
        if "skipped" in r:
            rows.append((name, r["skipped"], "", "", "", "", "", ""))
            continue
        m, lag = r["memory"], r["bus_lag"]
        rows.append(
            (
                name,
                f"{r['in_flight']} ({r['in_flight_median']:g})",
                f"{r['records_per_s']:.1f}",
                f"{r['assembler_calls_per_s']:.1f} / {r['expected_calls_per_s']:.1f}",
                f"{lag['rollout_end_to_sample_mean_s']:.2f} s, backlog {lag['assembler_backlog_max']}",
                f"{m['actors_rss_mib']:.0f} / {m['actors_uss_mib']:.0f}",
                f"{m['rss_per_rollout_kib']} / {m['marginal_uss_per_rollout_kib']}",
                f"{r['lost']} of {r['issued']}",
            )
        )
    header = ("phase", "in flight min (med)", "records/s", "asm calls/s / expected")
    header += ("bus lag", "actors RSS/USS MiB", "KiB/rollout RSS/marginal USS", "lost")
    print_table("fleet simulation", rows, header)
    noop = res.get("noop", {})
    bw = res.get("bwrap", {})
    in_flight = noop.get("in_flight", 0)
    lost = sum(r.get("lost", 0) for r in res.values())
    phases = QUICK if quick else FULL
    metrics = {"in_flight": in_flight, "lost": lost, **res}
    baseline = {
        name: {
            "idle_actors_rss_mib": r["memory"]["idle_actors_rss_mib"],
            "expected_calls_per_s": r["expected_calls_per_s"],
        }
        for name, r in res.items()
        if "memory" in r
    }
    ratios = {}
    if "assembler_calls_per_s" in noop:
        ratios["calls_vs_expected"] = round(
            noop["assembler_calls_per_s"] / noop["expected_calls_per_s"], 3
        )
    if "memory" in noop and "memory" in bw:
        ratios["bwrap_vs_noop_uss_per_rollout"] = round(
            bw["memory"]["marginal_uss_per_rollout_kib"]
            / max(1, noop["memory"]["marginal_uss_per_rollout_kib"]),
            2,
        )
    targets = {
        "in_flight": target(in_flight, phases[0].target),
        "lost": target(lost, 0, at_least=False),
    }
    return write_result("fleet", metrics, baseline, targets, ratios=ratios, quick=quick, out=out)


def run(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] in ("--serve-engine", "--serve-actor"):
        from harnessrl.common.aio import run as aio_run
        from harnessrl.common.aio import setup_logging

        spec = json.loads(sys.argv[2])
        if sys.argv[1] == "--serve-engine":
            aio_run(serve_engine(spec))
            return
        setup_logging(spec.get("log_level", "warning"), "actor")
        sys.exit(aio_run(serve_actor(spec)))
    args = parse_args(__doc__.splitlines()[0], argv)
    res = asyncio.run(main(args.quick))
    print(f"wrote {report(res, args.quick, args.out)}")


if __name__ == "__main__":
    run()
