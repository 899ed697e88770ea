"""Bubblewrap sandboxes, for real: commands, files, the proxy forwarder, and escape attempts.

Every escape test asserts the attempt *fails from inside*; survivors are looked for on the
host by a marker in their environment. Skips only when bubblewrap cannot run here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from aiohttp import web

from harnessrl.actors.sandbox import SandboxError, SandboxSpec, make_backend
from harnessrl.actors.sandbox.base import Limits, Sandbox, SandboxBackend
from harnessrl.actors.sandbox.bwrap import BwrapBackend, BwrapSandbox
from tests.conftest import bwrap_or_skip, procs_with

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
async def sb(backend: BwrapBackend):
    async with await backend.create(SandboxSpec(owner="test")) as s:
        yield s


def py(code: str) -> list[str]:
    """argv running ``code`` with the sandbox's python3."""
    return ["python3", "-c", textwrap.dedent(code)]


async def no_survivors(marker: str, within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while procs_with(marker):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# ---------------------------------------------------------------------- basics


async def test_interface(backend: BwrapBackend, sb: BwrapSandbox):
    """The bwrap classes satisfy the backend-neutral protocols; make_backend finds bwrap."""
    assert isinstance(backend, SandboxBackend) and isinstance(sb, Sandbox)
    assert isinstance(make_backend("bwrap", root=backend.root), BwrapBackend)


async def test_run_stdout_stderr_exit_code(sb: BwrapSandbox):
    """stdout, stderr and the exit code come back; stdin is /dev/null unless given."""
    r = await sb.run(["sh", "-c", "echo out; echo err >&2; cat; exit 3"], timeout=10)
    assert (r.returncode, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    r = await sb.run(["cat"], stdin=b"piped", timeout=10)
    assert r.ok and r.stdout == b"piped"
    r = await sb.run(["no-such-command"], timeout=10)
    assert r.returncode == 127
    r = await sb.run(["sh", "-c", "kill -9 $$"], timeout=10)
    assert r.returncode == 128 + signal.SIGKILL


async def test_setup_failure_is_a_sandbox_error(backend: BwrapBackend, tmp_path: Path):
    """A sandbox that cannot be set up raises SandboxError, not a command failure."""
    spec = SandboxSpec(ro_binds=[(tmp_path / "missing", "/opt/x")])
    async with await backend.create(spec) as s:
        with pytest.raises(SandboxError):
            await s.run(["true"], timeout=10)


# ---------------------------------------------------------------------- files


async def test_write_read_copy_in_copy_out(backend: BwrapBackend, tmp_path: Path):
    """Files move both ways; trees keep modes and symlinks; workspace_src seeds the workspace."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    (src / "pkg" / "link").symlink_to("run.sh")
    (src / "seed.txt").write_text("seed")
    async with await backend.create(SandboxSpec(workspace_src=src)) as s:
        await s.write_file("a/b.txt", b"hello")
        r = await s.run(["sh", "-c", "cat a/b.txt seed.txt; echo made > out.txt"], timeout=10)
        assert r.stdout == b"helloseed"
        assert await s.read_file("out.txt") == b"made\n"
        assert await s.read_file("/workspace/a/b.txt") == b"hello"
        await s.copy_in(src / "pkg", "tools")
        await s.copy_in(src / "seed.txt", "/workspace/tools/seed2.txt")
        r = await s.run(["sh", "-c", "tools/link && cat tools/seed2.txt"], timeout=10)
        assert r.stdout == b"ran\nseed"
        await s.run(["sh", "-c", "mkfifo fifo; mkdir -p deep/er; echo x > deep/er/f"], timeout=10)
        out = tmp_path / "out"
        await s.copy_out(out)
    assert (out / "a" / "b.txt").read_bytes() == b"hello"
    assert (out / "tools" / "link").is_symlink() and os.access(out / "tools" / "run.sh", os.X_OK)
    assert (out / "deep" / "er" / "f").read_text() == "x\n"
    assert not (out / "fifo").exists()  # special files are skipped


async def test_file_verbs_never_follow_sandbox_symlinks(sb: BwrapSandbox, tmp_path: Path):
    """Symlinks planted inside cannot make the host read or write outside the workspace."""
    secret = tmp_path / "host-secret.txt"
    secret.write_text("top secret")
    hostdir = tmp_path / "hostdir"
    hostdir.mkdir()
    cmd = f"ln -s {secret} s; ln -s {hostdir} d; mkfifo p"
    assert (await sb.run(["sh", "-c", cmd], timeout=10)).ok
    for bad in ("s", "d/x", "p", "../x", "/etc/passwd", "/workspace/../etc/passwd"):
        with pytest.raises(SandboxError):
            await sb.read_file(bad)
    for bad in ("s", "d/x", "../x", "/tmp/x"):
        with pytest.raises(SandboxError):
            await sb.write_file(bad, b"pwned")
    with pytest.raises(SandboxError):
        await sb.copy_in(secret, "d/copied")
    assert secret.read_text() == "top secret" and not any(hostdir.iterdir())
    out = tmp_path / "out"
    await sb.copy_out(out)
    assert (out / "s").is_symlink() and os.readlink(out / "s") == str(secret)


# ---------------------------------------------------------------------- proxy forwarder


@pytest.fixture
async def unix_http(tmp_path: Path):
    """A stand-in proxy: an aiohttp app on a host unix socket that echoes what it got."""

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"path": request.path, "len": len(body), "via": "unix"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = tmp_path / "proxy.sock"
    await web.UnixSite(runner, str(sock)).start()
    yield sock
    await runner.cleanup()


@pytest.fixture(params=["c", "python"])
async def fwd_backend(request: pytest.FixtureRequest, tmp_path: Path):
    """The backend with each forwarder: the compiled one and the Python fallback."""
    from tests.conftest import bwrap_or_skip

    be = await bwrap_or_skip(tmp_path / "sandboxes", forwarder=request.param)
    async with be:
        assert be.forwarder_kind == request.param
        yield be


def test_forwarder_choice_and_build_errors(tmp_path: Path):
    """A bad ``forwarder`` is refused; a compiler that fails is a `SandboxError` (``auto``
    then falls back to the Python forwarder, ``c`` raises); a good build is cached."""
    from harnessrl.actors.sandbox.bwrap import build_forwarder

    with pytest.raises(ValueError, match="forwarder"):
        BwrapBackend(tmp_path, forwarder="rust")
    with pytest.raises(SandboxError, match="cannot build"):
        build_forwarder(tmp_path / "fwd", cc="/bin/false")
    if shutil.which("cc"):
        first = build_forwarder(tmp_path / "fwd")
        assert os.access(first, os.X_OK) and build_forwarder(tmp_path / "fwd") == first


async def test_forwarder_auto_falls_back_to_python(tmp_path: Path, monkeypatch):
    """Where no C compiler works, ``auto`` runs the Python forwarder; ``c`` refuses to start."""
    from tests.conftest import bwrap_or_skip

    monkeypatch.setenv("CC", "/bin/false")
    auto = await bwrap_or_skip(tmp_path / "a", forwarder_cache_dir=tmp_path / "fa")
    async with auto:
        assert auto.forwarder_kind == "python"
    strict = BwrapBackend(tmp_path / "c", forwarder="c", forwarder_cache_dir=tmp_path / "fc")
    with pytest.raises(SandboxError, match="cannot build"):
        await strict.start()


async def test_forwarder_reaches_host_unix_socket(fwd_backend: BwrapBackend, unix_http: Path):
    """HTTP to 127.0.0.1:<port> inside reaches the host's unix-socket server, concurrently."""
    spec = SandboxSpec(proxy_socket=unix_http, proxy_port=18080)
    code = """
        import json, os, urllib.request
        from concurrent.futures import ThreadPoolExecutor
        base = os.environ["HRL_PROXY_URL"]
        def call(i):
            req = urllib.request.Request(f"{base}/v1/messages/{i}", data=b"x" * (i * 10000))
            return json.load(urllib.request.urlopen(req, timeout=10))
        with ThreadPoolExecutor(16) as ex:
            res = list(ex.map(call, range(32)))
        assert all(r == {"path": f"/v1/messages/{i}", "len": i * 10000, "via": "unix"}
                   for i, r in enumerate(res)), res
        print(base, "ok", len(res))
    """
    async with await fwd_backend.create(spec) as s:
        r = await s.run(py(code), timeout=30)
        assert r.ok, r.stderr
        assert r.stdout.decode().split() == ["http://127.0.0.1:18080", "ok", "32"]
        # exit statuses pass through the launcher unchanged
        assert (await s.run(["sh", "-c", "exit 7"], timeout=10)).returncode == 7
        assert (await s.run(["no-such-command"], timeout=10)).returncode == 127
        killed = await s.run(["sh", "-c", "kill -9 $$"], timeout=10)
        assert killed.returncode == 137 and "SIGKILL" in killed.killed, killed
        own = await s.run(["sh", "-c", "exit 137"], timeout=10)
        assert own.returncode == 137 and own.killed == "", own
        # the limits hold under either forwarder (the compiled one sets them itself)
        code = """
            import resource as r
            for x in ("NPROC", "FSIZE", "CORE"):
                print(r.getrlimit(getattr(r, "RLIMIT_" + x))[0])
        """
        lim = await s.run(py(code), timeout=10)
        assert lim.stdout.split() == [b"1024", str(4 * 2**30).encode(), b"0"], lim


async def test_forwarder_without_proxy_fails_fast(fwd_backend: BwrapBackend, tmp_path: Path):
    """With the proxy socket gone, connections are closed at once (the harness retries)."""
    code = """
        import os, urllib.request
        try:
            urllib.request.urlopen(os.environ["HRL_PROXY_URL"] + "/v1/models", timeout=5)
        except Exception as e:
            print("failed", type(e).__name__)
    """
    spec = SandboxSpec(proxy_socket=tmp_path / "gone.sock")
    async with await fwd_backend.create(spec) as s:
        r = await s.run(py(code), timeout=20)
    assert r.stdout.startswith(b"failed") and r.duration_s < 5, r


async def test_forwarder_measures_the_commands_cpu(fwd_backend: BwrapBackend, unix_http: Path):
    """The launcher inside reports the CPU seconds of the command and of the processes it
    waited for (a child that burns CPU counts): bwrap's pid namespace hides them from the
    host's ``RUSAGE_CHILDREN``. A run without the forwarder measures nothing."""
    import resource

    code = """
        import subprocess, sys, time
        subprocess.run([sys.executable, "-c", "t = __import__('time').process_time()\\n"
                        "while __import__('time').process_time() - t < 0.4: pass"])
        t = time.process_time()
        while time.process_time() - t < 0.3:
            pass
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    async with await fwd_backend.create(SandboxSpec(proxy_socket=unix_http)) as s:
        r = await s.run(py(code), timeout=60)
        assert r.returncode == 0, r
        assert r.cpu_s is not None and 0.65 <= r.cpu_s < 5.0, r.cpu_s
        quiet = await s.run(["true"], proxy=False)
        assert quiet.cpu_s is None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert after.ru_utime - before.ru_utime < 0.5  # what the forwarder's report is for


async def test_forwarder_half_close_and_bulk(fwd_backend: BwrapBackend, tmp_path: Path):
    """A client that shuts down its write side still gets the whole reply (8 MiB each way)."""

    async def echo_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        data = await reader.read()  # until the client's half-close
        writer.write(data[::-1])
        await writer.drain()
        writer.close()

    sock = tmp_path / "echo.sock"
    server = await asyncio.start_unix_server(echo_after_eof, path=str(sock))
    code = """
        import hashlib, socket
        data = bytes(range(256)) * (8 * 4096)
        s = socket.create_connection(("127.0.0.1", 18080))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := s.recv(1 << 16):
            got += chunk
        assert bytes(got) == data[::-1], len(got)
        print("echoed", len(got))
    """
    try:
        async with await fwd_backend.create(SandboxSpec(proxy_socket=sock)) as s:
            r = await s.run(py(code), timeout=30)
    finally:
        server.close()
    assert r.ok, r.stderr
    assert r.stdout == b"echoed 8388608\n"


# ---------------------------------------------------------------------- escapes


async def test_no_host_loopback_or_external_network(sb: BwrapSandbox):
    """A real listener on the host's 127.0.0.1 and outside addresses are unreachable."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    code = f"""
        import socket
        for addr in [("127.0.0.1", {port}), ("1.1.1.1", 443), ("8.8.8.8", 53), ("10.0.0.1", 80)]:
            try:
                socket.create_connection(addr, timeout=2).close()
                print("CONNECTED", addr)
            except OSError as e:
                print("blocked", addr, type(e).__name__)
        print(sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]))
    """
    try:
        r = await sb.run(py(code), timeout=30)
    finally:
        server.close()
    out = r.stdout.decode()
    assert r.ok, r.stderr
    assert "CONNECTED" not in out and out.count("blocked") == 4
    assert out.strip().endswith("['lo']")


async def test_no_privileges_inside(sb: BwrapSandbox):
    """Inside: not root, no capabilities at all, no_new_privs, no /etc/shadow."""
    r = await sb.run(["sh", "-c", "id -u; cat /proc/self/status; ls /etc/shadow"], timeout=10)
    uid, *status = r.stdout.decode().splitlines()
    fields = dict(line.split(":\t", 1) for line in status if ":\t" in line)
    assert int(uid) != 0 and int(fields["CapEff"], 16) == 0 and fields["NoNewPrivs"] == "1"
    if sb.backend.mode == "root":  # no user namespace: the bounding set is emptied too
        assert int(fields["CapBnd"], 16) == 0 and int(fields["Uid"].split()[0]) == sb.uid
    assert b"No such file" in r.stderr


async def test_hidden_files_next_to_workspace_are_invisible(sb: BwrapSandbox):
    """Reward files beside the workspace on the host cannot be read from inside."""
    reward = sb.state_dir / "reward"
    reward.mkdir()
    (reward / "secret.txt").write_text("REWARD-ANSWER")
    paths = [str(reward / "secret.txt"), "/workspace/../reward/secret.txt", "/reward/secret.txt"]
    r = await sb.run(["sh", "-c", "for p; do cat $p && echo READ; done; ls -a /", "-", *paths])
    assert b"READ" not in r.stdout and b"REWARD-ANSWER" not in r.stdout
    assert b"reward" not in r.stdout


async def test_cannot_write_outside_workspace(sb: BwrapSandbox):
    """/, /usr, /etc, /run, the state dir and the host's /tmp are out of reach for writing."""
    name = f"hrl-escape-{uuid.uuid4().hex}"
    targets = ["/", "/usr", "/usr/bin", "/etc", "/run/hrl", "/home", "/proc", str(sb.state_dir)]
    cmd = "for d; do echo x > $d/" + name + " 2>/dev/null && echo WROTE $d; done; true"
    r = await sb.run(["sh", "-c", cmd, "-", *targets], timeout=10)
    assert r.ok and b"WROTE" not in r.stdout, r.stdout
    # /tmp inside is the sandbox's own: writable, but not the host's /tmp
    r = await sb.run(["sh", "-c", f"echo x > /tmp/{name} && cat /tmp/{name}"], timeout=10)
    assert r.stdout == b"x\n"
    assert not (Path("/tmp") / name).exists()
    assert not any(p.name == name for p in sb.state_dir.rglob(name) if "tmp" not in p.parts)


async def test_process_limit(backend: BwrapBackend):
    """Forking stops at the process limit, and a fork bomb is contained and fully killed."""
    marker = f"hrl-bomb-{uuid.uuid4().hex}"
    spec = SandboxSpec(limits=Limits(max_processes=32), env={"HRL_TEST_MARKER": marker})
    code = """
        import os, subprocess
        procs = []
        try:
            for _ in range(200):
                procs.append(subprocess.Popen(["sleep", "30"]))
        except OSError as e:
            print("stopped", len(procs), e.errno)
    """
    async with await backend.create(spec) as s:
        r = await s.run(py(code), timeout=20)
        words = r.stdout.split()
        assert words[0] == b"stopped" and int(words[1]) < 32 and words[2] == b"11", r
        bomb = asyncio.ensure_future(s.run(["bash", "-c", ":(){ :|:& };:; sleep 60"], timeout=3))
        await asyncio.sleep(2)
        if backend.mode == "root":  # the sandbox's own uid: count its processes on the host
            n = sum(1 for p in Path("/proc").glob("[0-9]*/status") if _uid_of(p) == s.uid)
            assert 0 < n <= 32
        r = await bomb
        assert r.timed_out
    assert await no_survivors(marker)


def _uid_of(status: Path) -> int | None:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


async def test_memory_limit(backend: BwrapBackend):
    """Allocating beyond the memory limit fails; below it works."""
    spec = SandboxSpec(limits=Limits(memory_bytes=256 * 2**20))
    async with await backend.create(spec) as s:
        small = await s.run(py("x = bytearray(64 << 20); x[-1] = 1"), timeout=20)
        big = await s.run(py("x = bytearray(1 << 30); x[-1] = 1"), timeout=20)
    assert small.ok, small.stderr
    assert big.returncode != 0 and b"MemoryError" in big.stderr


async def test_timeout_kills_whole_tree(backend: BwrapBackend):
    """On timeout the command, its children, and a setsid'd daemon all die."""
    marker = f"hrl-timeout-{uuid.uuid4().hex}"
    spec = SandboxSpec(env={"HRL_TEST_MARKER": marker})
    cmd = "sleep 987 & echo $! > bg.pid; setsid sh -c 'sleep 988 & sleep 989' & sleep 999"
    async with await backend.create(spec) as s:
        t0 = time.monotonic()
        r = await s.run(["sh", "-c", cmd], timeout=1.0)
        assert r.timed_out and r.returncode == -signal.SIGKILL
        assert time.monotonic() - t0 < 3.0
        assert (await s.read_file("bg.pid")).strip()
        assert await no_survivors(marker)
        # and when the command simply exits, what it left in the background dies too
        r = await s.run(["sh", "-c", "sleep 990 & echo started"], timeout=10)
        assert r.ok and await no_survivors(marker)


# ---------------------------------------------------------------------- lifecycle


async def test_destroy_is_idempotent_and_removes_state(backend: BwrapBackend):
    """destroy twice is fine, the state dir is gone, and the sandbox refuses further use."""
    s = await backend.create(SandboxSpec())
    await s.run(["sh", "-c", "mkdir -p d && chmod 000 d"], timeout=10)
    state = s.state_dir
    assert state.is_dir()
    await s.destroy()
    await s.destroy()
    assert not state.exists()
    with pytest.raises(SandboxError):
        await s.run(["true"], timeout=10)


async def test_destroy_kills_running_commands(backend: BwrapBackend):
    """destroy during a run kills it; the run returns instead of hanging."""
    marker = f"hrl-destroy-{uuid.uuid4().hex}"
    s = await backend.create(SandboxSpec(env={"HRL_TEST_MARKER": marker}))
    task = asyncio.ensure_future(s.run(["sleep", "60"], timeout=60))
    await asyncio.sleep(0.5)
    await s.destroy()
    r = await asyncio.wait_for(task, 5)
    assert r.returncode == -signal.SIGKILL and await no_survivors(marker)


SWEEP_OWNER = """
import asyncio, sys
from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.bwrap import BwrapBackend

async def main():
    be = BwrapBackend(sys.argv[1])
    sb = await be.create(SandboxSpec(owner="doomed", env={"HRL_TEST_MARKER": sys.argv[2]}))
    asyncio.ensure_future(sb.run(["sleep", "300"], timeout=300))
    await asyncio.sleep(0.5)
    print(sb.state_dir, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def test_sweep_removes_dead_owners_leftovers(backend: BwrapBackend):
    """A killed owner's sandbox (state dir, processes) is swept; live ones are left alone."""
    marker = f"hrl-sweep-{uuid.uuid4().hex}"
    live = await backend.create(SandboxSpec(owner="alive"))
    owner = subprocess.Popen(
        [sys.executable, "-c", SWEEP_OWNER, str(backend.root), marker],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 30)
        state = Path(line.decode().strip())
        assert state.is_dir() and procs_with(marker)
    finally:
        owner.kill()
        owner.wait()
    assert await backend.sweep() == 1
    assert not state.exists() and live.state_dir.is_dir()
    assert await no_survivors(marker)
    await live.destroy()


POOL_OWNER = """
import asyncio, sys
from harnessrl.actors.sandbox.bwrap import BwrapBackend

async def main():
    be = BwrapBackend(sys.argv[1], pool_size=2, sweep_on_start=False)
    await be.start()
    await be.pool.wait_full()
    print(*(b.path for b in be.pool._ready), flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def test_sweep_removes_a_dead_pools_blanks_and_spares_a_live_pools(
    backend: BwrapBackend,
):
    """Blanks made ahead by a pool are kept while their pool lives (even when old), removed by
    sweep once it died; a closed pool leaves nothing behind."""
    owner = subprocess.Popen(
        [sys.executable, "-c", POOL_OWNER, str(backend.root)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 30)
        dead = [Path(x) for x in line.decode().split()]
    finally:
        owner.kill()
        owner.wait()
    live = BwrapBackend(backend.root, pool_size=2, sweep_on_start=False)
    await live.start()
    await live.pool.wait_full()
    blanks = [b.path for b in live.pool._ready]
    for d in dead + blanks:  # older than any create in progress
        os.utime(d, (time.time() - 600, time.time() - 600))
    assert len(dead) == 2 and all(d.is_dir() for d in dead + blanks)
    assert await backend.sweep() == 2
    assert not any(d.exists() for d in dead) and all(b.is_dir() for b in blanks)
    sb = await live.create(SandboxSpec(owner="pooled"))
    assert sb.state_dir.name.startswith("pooled-")
    await sb.destroy()
    await live.close()
    assert sorted(p.name for p in backend.root.iterdir()) == []


async def test_sweep_kills_processes_left_under_a_dead_sandbox_uid(backend: BwrapBackend):
    """Root mode: anything still running as a dead sandbox's own uid is killed by sweep."""
    if backend.mode != "root":
        pytest.skip("per-sandbox uids exist in root mode only")
    marker = f"hrl-sweep-uid-{uuid.uuid4().hex}"
    s = await backend.create(SandboxSpec(owner="doomed"))
    uid, state = s.uid, s.state_dir
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "300"],
        env={"HRL_TEST_MARKER": marker},
        start_new_session=True,
    )
    try:
        for _ in range(100):  # until setpriv has switched uid
            if _uid_of(Path(f"/proc/{stray.pid}/status")) == uid:
                break
            await asyncio.sleep(0.02)
        # the owner "dies": its flocks go away, nothing is cleaned up
        os.close(s._lock_fd)
        os.close(s._uid_fd)
        backend._live.discard(s)
        assert await backend.sweep() == 1
        assert not state.exists()
        assert await asyncio.wait_for(asyncio.to_thread(stray.wait), 5) == -signal.SIGKILL
    finally:
        stray.kill()
        stray.wait()


async def test_sweep_spares_a_live_sandbox_given_a_dead_ones_uid(tmp_path: Path):
    """A dead owner's uid lock is free at once: another actor's new sandbox may get that uid
    before the dead state is swept. Sweep then removes the state but kills nothing: the
    processes under that uid are the live sandbox's."""
    # two actors sharing a uid range and its lock dir (private to this test)
    shared = {"uid_lock_dir": tmp_path / "uids", "uid_base": 2_100_000_000 + os.getpid() % 1000}
    dying = await bwrap_or_skip(tmp_path / "dying", **shared)
    if dying.mode != "root":
        pytest.skip("per-sandbox uids exist in root mode only")
    other = await bwrap_or_skip(tmp_path / "other", **shared)
    async with dying, other:
        s = await dying.create(SandboxSpec(owner="doomed"))
        uid, state = s.uid, s.state_dir
        os.close(s._lock_fd)  # the owner dies: both its flocks go away
        os.close(s._uid_fd)
        dying._live.discard(s)
        live = await other.create(SandboxSpec(owner="alive"))
        assert live.uid == uid  # the lowest free uid: the one the dead sandbox had
        running = asyncio.create_task(live.run(["sleep", "30"], timeout=60))
        try:
            for _ in range(250):  # until the command runs as the uid
                if any(_uid_of(p / "status") == uid for p in Path("/proc").glob("[0-9]*")):
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the live sandbox's command never ran")
            assert await dying.sweep() == 1
            assert not state.exists()
            await asyncio.sleep(0.3)
            assert not running.done()  # not killed from outside
        finally:
            await live.destroy()
            with contextlib.suppress(BaseException):
                await running


async def test_sweep_survives_entries_that_vanish_while_it_looks(
    backend: BwrapBackend, monkeypatch: pytest.MonkeyPatch
):
    """Another process's create renames or removes its ``.new-`` folder between the sweep's
    listing and its look at the entry (two actors, or an eval beside a run, share the root):
    the sweep skips the entry instead of failing the process that is starting."""
    import harnessrl.actors.sandbox.bwrap as bwrap_mod

    gone = [backend.root / f".new-{os.getpid()}-vanish", backend.root / "vanished-sandbox"]
    real = os.scandir

    def racing_scandir(path=".", *args):
        if Path(path) != backend.root:  # os.scandir is the os module's: others pass through
            return real(path, *args)
        for d in gone:
            d.mkdir(parents=True, exist_ok=True)
        entries = list(real(path))
        for d in gone:  # the owner finished its create (rename) or destroy meanwhile
            os.rmdir(d)
        return iter(entries)

    monkeypatch.setattr(bwrap_mod.os, "scandir", racing_scandir)
    assert await backend.sweep() == 0
