"""Docker sandboxes, for real: a private dockerd, the offline image, commands, files, the proxy
forwarder, and the same escape attempts as the bwrap tests.

The tests use the session's own ``dockerd`` (``docker_engine`` in tests/conftest.py: data root
in a temp dir, no iptables/bridge) with the sandbox image imported from the rootfs tarball
cached per machine (built on first use: ~1 min with debootstrap). ``HRL_TEST_DOCKER_HOST``
points the tests at an existing engine instead. Skips only when dockerd is not installed or
cannot start here.
"""

from __future__ import annotations

import asyncio
import json
import os
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
from harnessrl.actors.sandbox._docker_host import _oom_kills
from harnessrl.actors.sandbox.base import Limits, Sandbox, SandboxBackend
from harnessrl.actors.sandbox.docker import LABEL, DockerBackend, DockerSandbox, _proc_status
from tests.conftest import procs_with

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def engine(docker_engine: str) -> str:
    """URL of a docker engine with the sandbox image (the session's: tests/conftest.py)."""
    return docker_engine


@pytest.fixture
async def backend(engine: str, tmp_path: Path):
    async with DockerBackend(tmp_path / "sandboxes", docker_url=engine) as be:
        yield be


@pytest.fixture
async def sb(backend: DockerBackend):
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


def user_procs(s: DockerSandbox) -> list[str]:
    """Host pids of live processes of the sandbox's user in its container."""
    return [
        pid
        for pid in s._procs_file.read_text().split()
        if (st := _proc_status(pid)) is not None and st[0] == s.uid and st[1] != "Z"
    ]


async def containers(backend: DockerBackend) -> list[str]:
    flt = json.dumps({"label": [f"{LABEL}=docker"]})
    return [
        c["Names"][0].lstrip("/")
        for c in await backend.docker.containers.list(all=True, filters=flt)
    ]


# ---------------------------------------------------------------------- basics


async def test_interface(backend: DockerBackend, sb: DockerSandbox):
    """The docker classes satisfy the backend-neutral protocols; make_backend finds docker."""
    assert isinstance(backend, SandboxBackend) and isinstance(sb, Sandbox)
    assert isinstance(make_backend("docker", root=backend.root), DockerBackend)


async def test_container_is_locked_down(backend: DockerBackend):
    """The container has no network, a read-only root, no caps, and pids/memory/cpu limits."""
    spec = SandboxSpec(limits=Limits(memory_bytes=512 * 2**20, max_processes=64))
    async with await backend.create(spec) as s:
        info = await s._container.show()
    hc = info["HostConfig"]
    assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] and hc["CapDrop"] == ["ALL"]
    assert hc["SecurityOpt"] == ["no-new-privileges"] and hc["Init"]
    assert (hc["PidsLimit"], hc["Memory"], hc["MemorySwap"]) == (64, 2**29, 2**29)
    assert hc["NanoCpus"] == 10**9 and info["Config"]["User"] != "0"
    assert info["Config"]["Labels"]["harnessrl.pid"] == str(os.getpid())


async def test_run_stdout_stderr_exit_code(sb: DockerSandbox):
    """stdout, stderr and the exit code come back; stdin is /dev/null unless given."""
    r = await sb.run(["sh", "-c", "echo out; echo err >&2; cat; exit 3"], timeout=10)
    assert (r.returncode, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    r = await sb.run(["cat"], stdin=b"piped", timeout=10)
    assert r.ok and r.stdout == b"piped"
    r = await sb.run(["no-such-command"], timeout=10)
    assert r.returncode == 127 and b"not found" in r.stderr
    r = await sb.run(["sh", "-c", "kill -9 $$"], timeout=10)
    assert r.returncode == 128 + signal.SIGKILL


async def test_setup_failure_is_a_sandbox_error(backend: DockerBackend, tmp_path: Path):
    """A sandbox that cannot be set up raises SandboxError, not a command failure."""
    with pytest.raises(SandboxError):
        await backend.create(SandboxSpec(ro_binds=[(tmp_path / "missing", "/opt/x")]))
    assert not any(backend.root.iterdir()) and not await containers(backend)
    async with await backend.create(SandboxSpec()) as s:
        with pytest.raises(SandboxError):
            await s.run(["true"], cwd="/no/such/dir", timeout=10)


# ---------------------------------------------------------------------- files


async def test_write_read_copy_in_copy_out(backend: DockerBackend, tmp_path: Path):
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
        await s.copy_in(src / "pkg", "tools")
        r = await s.run(["sh", "-c", "tools/link && echo more >> a/b.txt"], timeout=10)
        assert r.ok and r.stdout == b"ran\n"
        out = tmp_path / "out"
        await s.copy_out(out)
    assert (out / "a" / "b.txt").read_bytes() == b"hellomore\n"
    assert (out / "tools" / "link").is_symlink() and os.access(out / "tools" / "run.sh", os.X_OK)


async def test_file_verbs_never_follow_sandbox_symlinks(sb: DockerSandbox, tmp_path: Path):
    """Symlinks planted inside cannot make the host read or write outside the workspace."""
    secret = tmp_path / "host-secret.txt"
    secret.write_text("top secret")
    assert (await sb.run(["sh", "-c", f"ln -s {secret} s; mkfifo p"], timeout=10)).ok
    for bad in ("s", "p", "../x", "/etc/passwd"):
        with pytest.raises(SandboxError):
            await sb.read_file(bad)
    with pytest.raises(SandboxError):
        await sb.write_file("s", b"pwned")
    assert secret.read_text() == "top secret"


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


async def test_forwarder_reaches_host_unix_socket(backend: DockerBackend, unix_http: Path):
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
    async with await backend.create(spec) as s:
        r = await s.run(py(code), timeout=30)
        assert r.ok, r.stderr
        assert r.stdout.decode().split() == ["http://127.0.0.1:18080", "ok", "32"]
        # the forwarder is not the command's to kill: it runs as another user
        r = await s.run(["sh", "-c", "kill -9 -1; sleep 0.5"], timeout=10)  # spares the caller
        assert r.ok
        r = await s.run(py(code), timeout=30)
        assert r.ok, r.stderr


async def test_forwarder_without_proxy_fails_fast(backend: DockerBackend, tmp_path: Path):
    """With the proxy socket missing, connections are closed at once (the harness retries)."""
    code = """
        import os, urllib.request
        try:
            urllib.request.urlopen(os.environ["HRL_PROXY_URL"] + "/v1/models", timeout=5)
        except Exception as e:
            print("failed", type(e).__name__)
    """
    spec = SandboxSpec(proxy_socket=tmp_path / "gone.sock")
    async with await backend.create(spec) as s:
        r = await s.run(py(code), timeout=20)
    assert r.stdout.startswith(b"failed") and r.duration_s < 5, r


async def test_socket_on_another_filesystem_is_bound_and_never_pooled(
    engine: str,
    tmp_path: Path,
    unix_http: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
):
    """Where the proxy socket cannot be hard-linked into the sandbox's ``run`` folder (another
    filesystem), a fresh container binds the socket itself and reaches the proxy; a pooled
    container is not handed out for it, and the pool turns itself off with a warning (it
    would make containers only to remove them)."""

    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr("harnessrl.actors.sandbox.docker.os.link", no_link)
    spec = SandboxSpec(proxy_socket=unix_http)
    code = "import os, urllib.request; print(urllib.request.urlopen("
    code += "os.environ['HRL_PROXY_URL'] + '/v1/x', timeout=10).read().decode())"
    async with DockerBackend(tmp_path / "sbx", docker_url=engine, pool_size=1) as be:
        await be.warm(spec)
        await be.pool.wait_full()
        (blank,) = be.pool._ready
        async with await be.create(spec) as s:
            assert s is not blank and s.bind_socket
            r = await s.run(py(code), timeout=30)
        assert r.ok and json.loads(r.stdout)["via"] == "unix", r
        await be.pool.drain()
        assert blank.name not in await containers(be)  # the unusable blank was removed
        assert be.pool.size == 0 and not be.pool._ready
        assert "different filesystems" in caplog.text
        async with await be.create(spec) as s:  # still served, by fresh containers
            assert s.bind_socket
        await be.pool.drain()
        assert not be.pool._ready


# ---------------------------------------------------------------------- pool


async def test_pool_hands_out_started_containers_of_the_shape_asked_for(
    engine: str, tmp_path: Path, unix_http: Path
):
    """With a pool, `create` hands out a container started ahead for the last spec's shape
    (its workspace and proxy socket given on the way out) and `destroy` removes it in the
    background; a spec of another shape gets a fresh container, the blanks of the old shape
    are removed and the pool refills with the new one."""
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "task.md").write_text("task\n")
    spec = SandboxSpec(workspace_src=seed, proxy_socket=unix_http)
    async with DockerBackend(tmp_path / "sbx", docker_url=engine, pool_size=2) as be:
        first = await be.create(spec)  # the first of its shape: started on the spot
        await be.pool.wait_full()
        ready = {b.name for b in be.pool._ready}
        assert first.name not in ready and len(ready) == 2
        second = await be.create(spec)
        assert second.name in ready
        r = await second.run(["sh", "-c", "cat task.md; ls /run/hrl"], timeout=10)
        assert r.ok and r.stdout.split() == [b"task", b"forwarder.py", b"proxy.sock"] + [
            b"proxy.sock.mnt"
        ], r
        code = "import os, urllib.request; print(urllib.request.urlopen("
        code += "os.environ['HRL_PROXY_URL'] + '/v1/y', timeout=10).read().decode())"
        r = await second.run(py(code), timeout=30)
        assert r.ok and json.loads(r.stdout)["path"] == "/v1/y", r
        t0 = time.monotonic()
        await second.destroy()
        assert time.monotonic() - t0 < 0.05  # removal is the pool's, in the background
        with pytest.raises(SandboxError):
            await second.run(["true"], timeout=10)
        await be.pool.drain()
        assert second.name not in await containers(be) and not second.state_dir.exists()
        await be.pool.wait_full()
        old = {b.name for b in be.pool._ready}
        other = SandboxSpec(limits=Limits(max_processes=77))
        async with await be.create(other) as third:
            assert third.name not in old
            assert (await third._container.show())["HostConfig"]["PidsLimit"] == 77
        await be.pool.drain()
        await be.pool.wait_full()
        names = set(await containers(be))
        assert not old & names  # the old shape's blanks are gone
        for b in be.pool._ready:  # the new shape's are ready
            assert (await b._container.show())["HostConfig"]["PidsLimit"] == 77
        await first.destroy()
        await be.close()  # removes the ready blanks and waits for the removals
        await be.start()
        assert not await containers(be)


# ---------------------------------------------------------------------- escapes


async def test_no_host_loopback_or_external_network(sb: DockerSandbox, nats_server):
    """The host's nats-server, a host listener on all addresses, and outside are unreachable."""
    server = await asyncio.start_server(lambda r, w: w.close(), "0.0.0.0", 0)
    port = server.sockets[0].getsockname()[1]
    targets = [("127.0.0.1", nats_server.port), ("127.0.0.1", port), ("172.17.0.1", port)]
    targets += [("1.1.1.1", 443), ("8.8.8.8", 53), ("10.0.0.1", 80)]
    code = f"""
        import socket
        for addr in {targets!r}:
            try:
                socket.create_connection(addr, timeout=2).close()
                print("CONNECTED", addr)
            except OSError as e:
                print("blocked", addr, type(e).__name__)
        print(sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]))
    """
    try:
        r = await sb.run(py(code), timeout=40)
    finally:
        server.close()
    out = r.stdout.decode()
    assert r.ok, r.stderr
    assert "CONNECTED" not in out and out.count("blocked") == len(targets)
    assert out.strip().endswith("['lo']")


async def test_no_privileges_inside(sb: DockerSandbox):
    """Inside: not root, no capabilities at all, no_new_privs, /etc/shadow unreadable."""
    r = await sb.run(["sh", "-c", "id -u; cat /proc/self/status; cat /etc/shadow"], timeout=10)
    uid, *status = r.stdout.decode().splitlines()
    fields = dict(line.split(":\t", 1) for line in status if ":\t" in line)
    assert int(uid) == sb.uid != 0 and fields["NoNewPrivs"] == "1"
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert b"Permission denied" in r.stderr or b"No such file" in r.stderr  # host-built image
    assert "root:" not in r.stdout.decode()


async def test_hidden_files_next_to_workspace_are_invisible(sb: DockerSandbox):
    """Reward files beside the workspace on the host cannot be read from inside."""
    reward = sb.state_dir / "reward"
    reward.mkdir()
    (reward / "secret.txt").write_text("REWARD-ANSWER")
    paths = [str(reward / "secret.txt"), "/workspace/../reward/secret.txt", "/reward/secret.txt"]
    cmd = "for p; do cat $p && echo READ; done; ls -a / /workspace/.."
    r = await sb.run(["sh", "-c", cmd, "-", *paths], timeout=10)
    assert b"READ" not in r.stdout and b"REWARD-ANSWER" not in r.stdout
    assert b"reward" not in r.stdout


async def test_cannot_write_outside_workspace(sb: DockerSandbox):
    """/, /usr, /etc, /run/hrl, /home, the state dir and the host's /tmp are out of reach."""
    name = f"hrl-escape-{uuid.uuid4().hex}"
    targets = ["/", "/usr", "/usr/bin", "/etc", "/run", "/home", "/proc", "/dev"]
    targets.append(str(sb.state_dir))
    cmd = "for d; do echo x > $d/" + name + " 2>/dev/null && echo WROTE $d; done; true"
    r = await sb.run(["sh", "-c", cmd, "-", *targets], timeout=10)
    assert r.ok and b"WROTE" not in r.stdout, r.stdout
    # /tmp inside is the sandbox's own tmpfs: writable, but not the host's /tmp
    r = await sb.run(["sh", "-c", f"echo x > /tmp/{name} && cat /tmp/{name}"], timeout=10)
    assert r.stdout == b"x\n" and not (Path("/tmp") / name).exists()
    assert not list(sb.state_dir.rglob(name))


async def test_process_limit(backend: DockerBackend):
    """Forking stops at the pids limit, and a fork bomb is contained and fully killed."""
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
        assert 0 < len(procs_with(marker)) <= 32
        r = await bomb
        assert r.timed_out
        assert await no_survivors(marker)
        assert (await s.run(["true"], timeout=10)).ok  # the sandbox is usable again


async def test_memory_limit(backend: DockerBackend):
    """Allocating beyond the memory cgroup limit gets the command OOM-killed; below it works."""
    spec = SandboxSpec(limits=Limits(memory_bytes=256 * 2**20))
    async with await backend.create(spec) as s:
        small = await s.run(py("x = bytearray(64 << 20); x[-1] = 1"), timeout=20)
        assert small.ok, small.stderr
        before = _oom_kills(s._init_pid)
        big = await s.run(py("x = bytearray(1 << 30); x[-1] = 1"), timeout=20)
        assert big.returncode == 128 + signal.SIGKILL and not big.timed_out
        assert _oom_kills(s._init_pid) > before
        assert "OOM killer" in big.killed and small.killed == ""  # killed from outside
        assert (await s.run(["true"], timeout=10)).ok  # only the hog died


async def test_timeout_kills_whole_tree(backend: DockerBackend):
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
        assert await no_survivors(marker, within=0.2)
        # when the command exits, what it left in the background dies too, env cleared or not
        cmd = "env -i setsid sleep 990 </dev/null >/dev/null 2>&1 & sleep 991 & echo started"
        r = await s.run(["sh", "-c", cmd], timeout=10)
        assert r.ok and r.stdout == b"started\n"
        assert user_procs(s) == []


# ---------------------------------------------------------------------- lifecycle


async def test_destroy_is_idempotent_and_removes_everything(backend: DockerBackend):
    """destroy twice is fine, the container and state dir are gone, and further use fails."""
    s = await backend.create(SandboxSpec())
    await s.run(["sh", "-c", "mkdir -p d && chmod 000 d"], timeout=10)
    assert s.name in await containers(backend) and s.state_dir.is_dir()
    await s.destroy()
    await s.destroy()
    assert not s.state_dir.exists() and s.name not in await containers(backend)
    with pytest.raises(SandboxError):
        await s.run(["true"], timeout=10)


async def test_destroy_kills_running_commands(backend: DockerBackend):
    """destroy during a run kills it; the run returns instead of hanging."""
    marker = f"hrl-destroy-{uuid.uuid4().hex}"
    s = await backend.create(SandboxSpec(env={"HRL_TEST_MARKER": marker}))
    task = asyncio.ensure_future(s.run(["sleep", "60"], timeout=60))
    await asyncio.sleep(0.5)
    await s.destroy()
    r = await asyncio.wait_for(task, 10)
    assert r.returncode == -signal.SIGKILL and await no_survivors(marker)


SWEEP_OWNER = """
import asyncio, sys
from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.docker import DockerBackend

async def main():
    be = DockerBackend(sys.argv[1], docker_url=sys.argv[2])
    sb = await be.create(SandboxSpec(owner="doomed", env={"HRL_TEST_MARKER": sys.argv[3]}))
    asyncio.ensure_future(sb.run(["sleep", "300"], timeout=300))
    await asyncio.sleep(0.5)
    print(sb.state_dir, sb.name, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def test_sweep_removes_dead_owners_leftovers(backend: DockerBackend, engine: str):
    """A killed owner's sandbox (container, processes, state dir) is swept; live ones stay."""
    marker = f"hrl-sweep-{uuid.uuid4().hex}"
    live = await backend.create(SandboxSpec(owner="alive"))
    owner = subprocess.Popen(
        [sys.executable, "-c", SWEEP_OWNER, str(backend.root), engine, marker],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 60)
        state, name = line.decode().split()
        assert Path(state).is_dir() and procs_with(marker) and name in await containers(backend)
    finally:
        owner.kill()
        owner.wait()
    assert await backend.sweep() == 1
    assert not Path(state).exists() and name not in await containers(backend)
    assert await no_survivors(marker)
    assert live.state_dir.is_dir() and live.name in await containers(backend)
    assert (await live.run(["true"], timeout=10)).ok
    await live.destroy()


async def test_container_killed_from_outside_is_flagged(backend: DockerBackend):
    """The container killed from outside while a command runs: the command's end says so
    (``killed``) or the run fails as a sandbox error; never a plain exit status."""
    async with await backend.create(SandboxSpec(owner="test")) as s:
        run = asyncio.create_task(s.run(["sleep", "4321"], timeout=60))
        deadline = time.monotonic() + 20
        while not procs_with("sleep\x004321") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        os.kill(s._init_pid, signal.SIGKILL)  # the container's init: the container stops
        try:
            r = await asyncio.wait_for(run, 30)
        except SandboxError:
            return
        assert r.killed and not r.timed_out, r
