"""Preloaded harness starts (``harnessrl.actors.harnesses.preload``): a harness forked from the
preloader into a bubblewrap sandbox sees what a cold start sees (uid, namespaces, cwd,
environment, stdio, rlimits, no capabilities), ends the same way (exit status, timeout),
reports its CPU, and falls back to a cold start whenever the preloader cannot serve it.

The "harness" is a probe module in the sandbox's workspace, run with the system Python, and
the preloader imports ``decimal`` ahead (a cold ``python3 -m`` does not): the probe says which
start it got. Needs bubblewrap as root (skips otherwise)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from pathlib import Path

import pytest

from harnessrl.actors.harnesses.base import LaunchSpec
from harnessrl.actors.harnesses.preload import Preload, Preloader, PreloadPool, supported
from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.base import Limits
from tests.helpers.sandboxes import bwrap_or_skip, procs_with
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
PY = "/usr/bin/python3"
PROBE = r"""
import atexit, json, os, resource, socket, sys, time
atexit.register(lambda: sys.stderr.write("atexit ran\n"))
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
              if ":\t" in line)
if os.environ.get("BURN"):
    t = time.process_time()
    while time.process_time() - t < float(os.environ["BURN"]):
        pass
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
if os.environ.get("RAISE"):
    raise RuntimeError("boom")
print(json.dumps({
    "preloaded": "decimal" in sys.modules,
    "name": __name__, "argv": sys.argv[1:], "path0": sys.path[0],
    "uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(), "groups": os.getgroups(),
    "cwd": os.getcwd(), "host": socket.gethostname(),
    "ifs": [n for _, n in socket.if_nameindex()],
    "probe_env": os.environ.get("PROBE"), "run_env": "HRL_PRELOAD_RUN" in os.environ,
    "stdin": sys.stdin.read(),
    "nproc": resource.getrlimit(resource.RLIMIT_NPROC),
    "fsize": resource.getrlimit(resource.RLIMIT_FSIZE),
    "capeff": status["CapEff"], "capbnd": status["CapBnd"],
    "pid1": open("/proc/1/cmdline", "rb").read().split(b"\0")[0].decode(),
    "repo_visible": os.path.exists(sys.argv[1]),
    "fds": sorted(int(x) for x in os.listdir("/proc/self/fd")),
}))
sys.exit(int(os.environ.get("EXIT", "0")))
"""
COLD = [PY, "-m", "hrlprobe", str(REPO), "two words"]


@pytest.fixture
async def backend(tmp_path: Path):
    be = await bwrap_or_skip(tmp_path / "sb")
    if not supported(be):
        pytest.skip("preloaded starts need bubblewrap running as root")
    async with be:
        yield be


@pytest.fixture
async def pool(tmp_path: Path, backend):
    folder = tmp_path / "pre"
    folder.mkdir()
    p = PreloadPool(folder, min_uid=backend.uid_base)
    yield p
    await p.close()


PRELOAD = Preload(python=Path(PY), entry="hrlprobe", modules=("decimal",))


async def probe_sandbox(backend, spec: LaunchSpec, **limits):
    lim = Limits(max_processes=64, **limits)
    sb = await backend.create(
        SandboxSpec(
            ro_binds=list(spec.ro_binds),
            proxy_socket=Path("/nonexistent/proxy.sock"),
            limits=lim,
            hostname="probe-host",
        )
    )
    await sb.write_file("/workspace/hrlprobe.py", PROBE.encode())
    return sb


async def run(sb, spec: LaunchSpec, timeout: float = 60):
    return await sb.run(spec.argv, env=spec.env, cwd="/workspace", timeout=timeout, stdin=b"in")


def spec(env: dict[str, str] | None = None, argv: list[str] | None = None) -> LaunchSpec:
    return LaunchSpec(argv=list(argv or COLD), env={"PROBE": "p", **(env or {})}, api="chat")


async def cold_and_hot(backend, pool, env: dict[str, str]):
    """The probe run with ``env`` cold, then preloaded, in one sandbox: its uid and both
    results."""
    pre = await pool.get(PRELOAD)
    assert pre is not None and pre.alive
    hot = spec(env)
    run_name = pool.wrap(hot, pre)
    assert hot.argv[-len(COLD) :] == COLD and hot.env["HRL_PRELOAD_RUN"] == run_name
    sb = await probe_sandbox(backend, hot)
    try:
        return sb.uid, await run(sb, spec(env)), await run(sb, hot)
    finally:
        await sb.destroy()


async def test_a_preloaded_start_sees_what_a_cold_start_sees(backend, pool):
    """Same argv, env, stdin, uid, groups, cwd, hostname, loopback-only network, pid
    namespace, rlimits, fds, no capabilities, host files hidden; exit status passed back."""
    uid, cold_res, hot_res = await cold_and_hot(backend, pool, {"EXIT": "7"})
    assert cold_res.returncode == 7 and hot_res.returncode == 7, hot_res.stderr
    cold, warm = json.loads(cold_res.stdout), json.loads(hot_res.stdout)
    assert (cold.pop("preloaded"), warm.pop("preloaded")) == (False, True)
    assert warm == cold
    assert warm["uid"] == uid and warm["euid"] == uid and warm["groups"] == []
    assert warm["capeff"] == warm["capbnd"] == "0000000000000000"
    assert warm["argv"] == [str(REPO), "two words"] and warm["name"] == "__main__"
    assert warm["stdin"] == "in" and warm["probe_env"] == "p" and not warm["run_env"]
    assert warm["host"] == "probe-host" and warm["ifs"] == ["lo"] and warm["pid1"].endswith("bwrap")
    assert warm["cwd"] == warm["path0"] == "/workspace" and not warm["repo_visible"]
    assert warm["nproc"] == [64, 64] and warm["fds"] == [0, 1, 2, 3]
    assert b"starting cold" not in hot_res.stderr
    assert hot_res.stderr.count(b"atexit ran") == cold_res.stderr.count(b"atexit ran") == 1


async def test_an_uncaught_exception_ends_as_it_would_cold(backend, pool):
    _, cold_res, hot_res = await cold_and_hot(backend, pool, {"RAISE": "1"})
    for res in (cold_res, hot_res):
        assert res.returncode == 1 and res.stdout == b""
        assert b"RuntimeError: boom" in res.stderr and b"atexit ran" in res.stderr


async def test_cpu_is_reported_and_a_timeout_kills_the_harness(backend, pool):
    pre = await pool.get(PRELOAD)
    burn = spec({"BURN": "0.3"})
    name = pool.wrap(burn, pre)
    sleepy = spec({"SLEEP": "120", "MARK": "preload-sleeper"})
    pool.wrap(sleepy, pre)
    sb = await probe_sandbox(backend, burn)
    try:
        res = await run(sb, burn)
        assert res.ok and json.loads(res.stdout)["preloaded"]
        cpu = pre.take_cpu(name)
        assert cpu is not None and cpu >= 0.25 and pre.take_cpu(name) is None
        res = await run(sb, sleepy, timeout=3)
        assert res.timed_out
        await until(lambda: not procs_with("preload-sleeper"), timeout=10)
        # the preloader still serves
        again = spec()
        pool.wrap(again, pre)
        res = await run(sb, again)
        assert res.ok and json.loads(res.stdout)["preloaded"]
    finally:
        await sb.destroy()


async def test_the_client_starts_cold_when_not_served(backend, pool):
    """Another command, or no preloader: the client runs the command itself."""
    pre = await pool.get(PRELOAD)
    other = spec(argv=[PY, "/workspace/hrlprobe.py", str(REPO), "x"])
    pool.wrap(other, pre)
    sb = await probe_sandbox(backend, other)
    try:
        res = await run(sb, other)
        assert res.ok and not json.loads(res.stdout)["preloaded"]
        assert b"serves only python -m hrlprobe" in res.stderr
        hot = spec()
        pool.wrap(hot, pre)
        await pre.close()  # the socket is gone; its folder stays bound
        res = await run(sb, hot)
        assert res.ok and not json.loads(res.stdout)["preloaded"]
        assert b"starting cold" in res.stderr
    finally:
        await sb.destroy()


def ask(path: Path, payload: bytes, fds: list[int] | None = None, close: bool = True) -> dict:
    """Send ``payload`` (with ``fds``) to the preloader at ``path``; its one-line answer."""
    import array

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        if fds:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            s.sendmsg([payload], anc)
        elif payload:
            s.sendall(payload)
        if close:
            s.shutdown(socket.SHUT_WR)
        return json.loads(s.makefile().readline())


def framed(obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


async def test_bad_requests_do_not_stop_the_preloader(backend, pool, tmp_path):
    """Garbage, a huge length, missing fds, a root peer: each gets a ``fallback`` answer and
    the preloader goes on serving."""
    pre = await pool.get(PRELOAD)
    good = {"argv": [PY, "-m", "hrlprobe"], "env": {}, "cwd": "/"}
    # this test runs as root: refused before its request is read
    assert "uid 0" in (await asyncio.to_thread(ask, pre.socket_path, framed(good)))["fallback"]
    # malformed requests, to a preloader that would serve root (none is well-formed)
    lax = Preloader(PRELOAD, tmp_path / "lax", min_uid=0)
    await lax.start()
    try:
        path = lax.socket_path
        assert "fallback" in await asyncio.to_thread(ask, path, b"\xff\xff")
        huge = await asyncio.to_thread(ask, path, struct.pack("!I", 1 << 30))
        assert "request of" in huge["fallback"]
        assert "3" in (await asyncio.to_thread(ask, path, framed(good)))["fallback"]  # no fds
        bad = {"argv": [PY, "-m", "hrlprobe"], "env": {"A": 1}, "cwd": "/"}
        assert "fallback" in await asyncio.to_thread(ask, path, framed(bad), [0, 1, 2])
        other = {"argv": [PY, "-m", "os"], "env": {}, "cwd": "/"}
        assert "only" in (await asyncio.to_thread(ask, path, framed(other), [0, 1, 2]))["fallback"]
        assert lax.alive
    finally:
        await lax.close()
    assert pre.alive
    hot = spec()
    pool.wrap(hot, pre)
    sb = await probe_sandbox(backend, hot)
    try:
        res = await run(sb, hot)
        assert res.ok and json.loads(res.stdout)["preloaded"]
    finally:
        await sb.destroy()


async def test_one_sandbox_cannot_pile_up_supervisors(tmp_path):
    """Clients that connect and say nothing: two at once per uid are held (each at most the
    request timeout), a third is told ``busy`` at once; once they are gone a new one is
    served again."""
    lax = Preloader(PRELOAD, tmp_path / "lax", min_uid=0, per_uid=2, request_timeout_s=2.0)
    await lax.start()
    held = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(lax.socket_path))
            held.append(s)
        await asyncio.sleep(0.5)
        busy = await asyncio.to_thread(ask, lax.socket_path, b"", None, False)
        assert busy == {"fallback": "busy"}
        # the silent ones are answered at the request timeout
        for s in held:
            s.settimeout(10)
            assert "fallback" in json.loads(s.makefile().readline())
        await asyncio.sleep(1.5)  # reaped within a second
        again = await asyncio.to_thread(ask, lax.socket_path, b"\xff\xff")
        assert again["fallback"] != "busy"
    finally:
        for s in held:
            s.close()
        await lax.close()


async def test_one_client_after_another_is_never_told_busy(tmp_path):
    """A sandbox that asks again as soon as its last answer came (one harness after another)
    is served, even at a bound of one: the answered supervisor may not have exited yet."""
    lax = Preloader(PRELOAD, tmp_path / "lax", min_uid=0, per_uid=1, request_timeout_s=2.0)
    await lax.start()
    try:
        for _ in range(20):
            reply = await asyncio.to_thread(ask, lax.socket_path, b"\xff\xff")
            assert reply["fallback"] != "busy"
    finally:
        await lax.close()


async def test_a_preloader_that_cannot_start_leaves_cold_starts(tmp_path, caplog):
    """A missing interpreter: `PreloadPool.get` says why and returns None, and does not try
    again at once (every rollout would pay for the failed start)."""
    folder = tmp_path / "pre"
    folder.mkdir()
    p = PreloadPool(folder, min_uid=1000)
    missing = Preload(Path("/nonexistent/python"), "m", ())
    try:
        fds = len(os.listdir("/proc/self/fd"))
        assert await p.get(missing) is None
        assert len(os.listdir("/proc/self/fd")) == fds  # its report pipe is closed
        assert "harnesses start cold" in caplog.text
        caplog.clear()
        assert await p.get(missing) is None and not caplog.text
    finally:
        await p.close()


def test_preloader_refuses_to_fork_with_threads(tmp_path):
    """A module whose import starts a thread makes the preloader exit (fork would copy one
    thread of several): checked in the preloader itself."""
    import subprocess

    from harnessrl.actors.harnesses.preload import PRELOADER_SRC

    (tmp_path / "threads.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True)"
        ".start()\n"
    )
    r, w = os.pipe()
    try:
        p = subprocess.run(
            [
                PY,
                "-s",
                "-B",
                str(PRELOADER_SRC),
                "--socket",
                str(tmp_path / "s"),
                "--report-fd",
                str(w),
                "--entry",
                "m",
                "--min-uid",
                "1",
                "--parent",
                str(os.getpid()),
                "--import",
                "threads",
            ],
            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
            pass_fds=(w,),
        )
    finally:
        os.close(r)
        os.close(w)
    assert p.returncode == 3 and "started threads" in p.stderr
    assert not (tmp_path / "s").exists()


def test_take_cpu_reads_the_report_pipe(tmp_path):
    pre = Preloader(PRELOAD, tmp_path / "p", 1000)
    r, w = os.pipe()
    os.set_blocking(r, False)
    pre._report = r
    try:
        os.write(w, b"aa 1.5\nbb 0.25\ncc ")
        assert pre.take_cpu("bb") == 0.25 and pre.take_cpu("bb") is None
        os.write(w, b"2\nbroken line\n")
        assert pre.take_cpu("cc") == 2.0 and pre.take_cpu("aa") == 1.5
    finally:
        os.close(w)
        os.close(r)
        pre._report = None


async def test_the_preloader_ends_with_its_actor(tmp_path):
    """An actor killed with SIGKILL takes its preloader with it (parent-death signal)."""
    import signal
    import sys

    script = f"""
import asyncio, sys
from pathlib import Path
from harnessrl.actors.harnesses.preload import Preload, PreloadPool
async def main():
    pool = PreloadPool(Path({str(tmp_path)!r}), min_uid=1000)
    pre = await pool.get(Preload(Path({PY!r}), "m", ("decimal",)))
    print(pre.proc.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""
    actor = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(actor.stdout.readline(), 60)
        pid = int(line)
        assert Path(f"/proc/{pid}").exists()
    finally:
        actor.send_signal(signal.SIGKILL)
        await actor.wait()
    await until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=10)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True
