"""Stopping with NATS down, and a nats-server that dies under ``harnessrl run``.

* Real processes (``python -m harnessrl.common.cli learner|assembler|actor|weights-sync``) on a real
  nats-server that is then SIGKILLed: SIGTERM stops each of them within the supervisor's stop
  timeout, with exit status 0 and no traceback; the learner first commits its unsaved steps
  to its local checkpoint (what it cannot ack is redelivered and acked as committed later).
* ``harnessrl run``'s supervision (a real ``harnessrl nats`` child) restarts a killed
  nats-server while its monitor is stuck reading that server: supervising never waits for a
  refresh of the view.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from harnessrl.common import natsauth
from harnessrl.common.bus import connect
from harnessrl.common.layout import StepLine, read_metrics
from harnessrl.common.natsd import NatsServer
from harnessrl.common.procs import popen_child
from harnessrl.common.run.config import RunConfig
from harnessrl.learner.checkpoint import Checkpointer
from harnessrl.proxy.scripted import ScriptedEngine
from tests.helpers.actor import actor_argv, actor_process, task_consumer
from tests.helpers.learner import grpo_group, publish, start_learner
from tests.helpers.rollout import TOK, request, toy_solver
from tests.helpers.wait import until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "harnessrl.common.cli", *args]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "ab") as out:
        return popen_child(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


async def test_sigterm_with_nats_down_stops_every_process_cleanly(
    tmp_path: Path, sandbox_root: Path
) -> None:
    """Three trained steps not yet checkpointed, NATS SIGKILLed, then SIGTERM to everyone:
    every process exits 0 in time without a traceback (or a warning of a coroutine left
    behind), the learner with its steps committed."""
    server = NatsServer(tmp_path / "nats").start()
    run, url = "t" + uuid.uuid4().hex[:8], server.url
    run_dir = tmp_path / "learner"
    run_dir.mkdir()
    procs: dict[str, subprocess.Popen] = {}
    try:
        async with ScriptedEngine(TOK, toy_solver()) as eng:
            bus = await connect(url, run)
            groups = [grpo_group(f"g{i}", [0, 1, 0.5, 0.25], 0) for i in range(3)]
            await publish(bus, [s for g in groups for s in g])
            await bus.close()
            learner_flags = ("--checkpoint-every", "1000", "--broadcast.transport", "none")
            procs["learner"] = start_learner(url, run, run_dir, *learner_flags)
            common = ("--nats", url, "--run", run, "--metrics-port", "-1")
            procs["assembler"] = start(cli("assembler", *common), tmp_path / "assembler.log")
            procs["weights-sync"] = start(
                cli("weights-sync", *common, "--engine", eng.url, "--work-dir", str(tmp_path)),
                tmp_path / "weights-sync.log",
            )
            actor = actor_argv(url, run, eng.url, sandbox_root)
            procs["actor"] = start(actor, tmp_path / "actor.log")
            metrics = run_dir / "metrics.jsonl"
            steps = lambda: [m for m in read_metrics(metrics) if isinstance(m, StepLine)]  # noqa: E731
            await until(lambda: len(steps()) == 3, 240, "three steps", proc=procs["learner"])
            server.kill()
            await asyncio.sleep(1.0)  # every client saw the connection go
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            limit = RunConfig().stop_timeout_s  # then the supervisor would SIGKILL
            codes = {}
            for name, p in procs.items():
                try:
                    codes[name] = await asyncio.to_thread(p.wait, limit)
                except subprocess.TimeoutExpired:
                    codes[name] = "still running"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()
    logs = {n: log.read_text() for n, log in _logs(tmp_path, run_dir).items()}
    assert codes == dict.fromkeys(procs, 0), {n: logs[n][-3000:] for n in codes}
    assert not [n for n, text in logs.items() if "Traceback" in text or "never awaited" in text]
    assert Checkpointer(run_dir / "checkpoints").read().version == 3


def tls_server(tmp_path: Path, run: str) -> NatsServer:
    """A nats-server as ``harnessrl run`` starts one: role credentials and TLS."""
    auth = natsauth.prepare_server_auth(tmp_path / "auth", [run], tls=True)
    return NatsServer(tmp_path / "nats", auth=auth).start()


async def test_closing_a_tls_connection_whose_server_is_away_never_raises(tmp_path: Path) -> None:
    """What nats-py buffered while the server was away (here a heartbeat) is never written to
    the dead TLS transport on close (it raised ``AttributeError: 'NoneType' object has no
    attribute '_write_appdata'``, so actors crashed on shutdown while NATS was down)."""
    run = "t" + uuid.uuid4().hex[:8]
    server = tls_server(tmp_path, run)
    try:
        bus = await connect(server.url, run, creds=server.creds("admin"), ca=server.ca)
        server.kill()
        nc = bus.nc  # type: ignore[attr-defined]
        await until(lambda: not nc.is_connected, 10, "the client to see the server go")
        await bus.nc.publish(bus.subjects.tasks, b"+WPI")  # type: ignore[attr-defined]
        bus.interrupt()
        await bus.close()
    finally:
        server.stop()


async def test_actor_on_tls_stops_at_once_when_nats_is_down(
    tmp_path: Path, sandbox_root: Path
) -> None:
    """A rollout in flight, a 120 s grace, NATS SIGKILLed, then SIGTERM: the rollout can no
    longer publish its result, so the grace ends at once; the actor exits 0 within seconds,
    without a traceback (it waited the whole grace and crashed closing its TLS connection)."""
    run = "t" + uuid.uuid4().hex[:8]
    server = tls_server(tmp_path, run)
    log = tmp_path / "actor.log"
    try:
        admin = await connect(server.url, run, creds=server.creds("admin"), ca=server.ca)
        await task_consumer(admin, ack_wait=3)
        await admin.publish(admin.subjects.tasks, request("reference", group_id="gn"))
        await admin.close()
        async with ScriptedEngine(TOK, toy_solver(hang_attempt=1)) as eng:
            creds = ("--nats-creds", server.creds("actor-0"), "--nats-ca", server.ca)
            grace = ("--shutdown-grace-s", "120")
            argv = actor_argv(server.url, run, eng.url, sandbox_root, *grace, *creds)
            async with actor_process(argv, log) as proc:
                await until(lambda: eng.requests, 60, "the rollout's first call", proc=proc)
                server.kill()
                await asyncio.sleep(3.0)  # the actor saw it go; heartbeats were buffered
                t0 = asyncio.get_running_loop().time()
                proc.send_signal(signal.SIGTERM)
                rc = await asyncio.wait_for(proc.wait(), 150)
                took = asyncio.get_running_loop().time() - t0
    finally:
        server.stop()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert took < 20, (took, text[-3000:])


def _logs(tmp_path: Path, run_dir: Path) -> dict[str, Path]:
    out = {n: tmp_path / f"{n}.log" for n in ("assembler", "weights-sync", "actor")}
    (learner,) = run_dir.parent.glob("learner-*.log")
    return {**out, "learner": learner}


async def test_supervisor_restarts_nats_while_its_monitor_waits_for_it(tmp_path: Path) -> None:
    """The embedded nats-server is SIGKILLed while the monitor's refresh hangs on it (as reads
    of a dead server do, for their timeouts): the supervisor restarts it anyway."""
    from harnessrl.common.run.plan import SECTIONS, Plan, prepare_run_dir
    from harnessrl.common.run.run import Run

    cfg = RunConfig(
        name="t" + uuid.uuid4().hex[:8],
        out=tmp_path / "run",
        nats_insecure=True,
        dashboard=False,
        scrape_interval_s=0.1,
        restart_backoff_s=0.1,
        on_exit={"nats": "restart"},
    )
    sections: dict = {s: {} for s in SECTIONS}
    run = Run(cfg, Plan(cfg, sections, prepare_run_dir(cfg, sections)), out=io.StringIO())
    run.phases = {"nats": run.phases["nats"], "core": [], "actors": []}
    stuck: list[asyncio.Task] = []

    async def refresh_stuck_on_the_server() -> None:
        stuck.append(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.Event().wait()

    watch = None
    try:
        assert await run.start_all()
        run.monitor.tick = refresh_stuck_on_the_server
        watch = asyncio.create_task(run.watch())
        nats = run.sup.children["nats"]
        await until(lambda: stuck, 30, "the monitor to refresh")
        os.kill(nats.pid, signal.SIGKILL)
        # a restart, and a python process starting
        await until(lambda: nats.starts == 2 and nats.ready, 120, "nats-server restarted")
        run._on_signal(signal.SIGTERM)
        assert (await asyncio.wait_for(watch, 30)).kind == "signal"
    finally:
        for t in [*stuck, watch]:
            if t is not None:
                t.cancel()
        await asyncio.to_thread(run.stop_all)
        await run.monitor.close()
    assert run.sup.leftovers() == []
