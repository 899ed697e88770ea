"""The sandbox contract (``actors/sandbox/base.py``), held by every backend: bubblewrap, bubblewrap
with its warm pool, docker. Backend-specific behaviour (locked-down container config, uid
drops, sweeps, limits that differ) stays in ``test_sandbox_bwrap.py`` / ``test_sandbox_docker.py``.

The docker cases use the session's private dockerd (tests/conftest.py) and skip where it cannot
start; the bwrap cases skip where bubblewrap cannot run.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.base import Limits, Sandbox, SandboxBackend
from tests.conftest import bwrap_or_skip, procs_with

KINDS = ("bwrap", "bwrap_pool", "docker", "docker_pool")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """The backend's name, and the docker engine's URL for docker (the session's dockerd is
    started here, outside the test's event loop)."""
    if request.param.startswith("docker"):
        return request.param, request.getfixturevalue("docker_engine")
    return request.param, None


@pytest.fixture
async def backend(kind: tuple[str, str | None], tmp_path: Path):
    """Each backend, entered (sweep at start, everything removed at exit)."""
    name, engine = kind
    if name.startswith("docker"):
        from harnessrl.actors.sandbox.docker import DockerBackend

        pool = 2 if name == "docker_pool" else 0
        be = DockerBackend(tmp_path / "sandboxes", docker_url=engine, pool_size=pool)
    else:
        pool = 2 if name == "bwrap_pool" else 0
        be = await bwrap_or_skip(tmp_path / "sandboxes", pool_size=pool)
    async with be:
        yield be


@pytest.fixture
async def sb(backend: SandboxBackend):
    async with await backend.create(SandboxSpec(owner="test")) as s:
        yield s


async def test_interface(backend: SandboxBackend, sb: Sandbox):
    """Each backend and its sandboxes satisfy the backend-neutral protocols."""
    assert isinstance(backend, SandboxBackend) and isinstance(sb, Sandbox)


async def test_env_cwd_and_no_host_env(sb: Sandbox, monkeypatch: pytest.MonkeyPatch):
    """env and cwd are honoured; the host's environment never leaks in."""
    monkeypatch.setenv("HRL_HOST_SECRET", "leak")
    await sb.write_file("sub/dir/.keep", b"")
    r = await sb.run(
        ["sh", "-c", "echo $FOO; pwd; echo $HOME; whoami; env"],
        env={"FOO": "bar"},
        cwd="/workspace/sub/dir",
        timeout=10,
    )
    lines = r.stdout.decode().splitlines()
    assert lines[:4] == ["bar", "/workspace/sub/dir", "/home/hrl", "hrl"]
    assert "HRL_HOST_SECRET" not in r.stdout.decode()


async def test_output_is_capped(backend: SandboxBackend):
    """Output beyond the cap is drained and dropped, and says so."""
    async with await backend.create(SandboxSpec(limits=Limits(output_cap_bytes=1000))) as s:
        r = await s.run(["head", "-c", "300000", "/dev/zero"], timeout=10)
    assert r.ok and len(r.stdout) == 1000 and r.stdout_truncated and not r.stderr_truncated


async def test_workdir_below_home(backend: SandboxBackend):
    """A task's mount dir such as /root/.openclaw/workspace works, with a private /root."""
    spec = SandboxSpec(home="/root", workdir="/root/.openclaw/workspace")
    async with await backend.create(spec) as s:
        await s.write_file("task.md", b"do it")
        r = await s.run(
            ["sh", "-c", "pwd; cat task.md; echo; touch ../openclaw.json; ls -A ~"], timeout=10
        )
        assert r.ok, r.stderr
        assert r.stdout.decode().split() == ["/root/.openclaw/workspace", "do", "it", ".openclaw"]


async def test_ro_binds(backend: SandboxBackend, tmp_path: Path):
    """Extra binds (a harness install) are readable and not writable."""
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "bin.sh").write_text("echo harness")
    spec = SandboxSpec(ro_binds=[(harness, "/opt/harness")])
    async with await backend.create(spec) as s:
        r = await s.run(["sh", "/opt/harness/bin.sh"], timeout=10)
        assert r.stdout == b"harness\n"
        r = await s.run(["sh", "-c", "echo x > /opt/harness/new"], timeout=10)
        assert r.returncode != 0 and not (harness / "new").exists()


async def test_host_home_is_invisible(sb: Sandbox):
    """A marker in the host's real $HOME cannot be read (nor listed) from inside."""
    marker = Path.home() / f".hrl-marker-{uuid.uuid4().hex}"
    try:
        marker.write_text("HOST-HOME-SECRET")
        cmd = f"cat {marker}; cat ~/{marker.name}; ls -a {Path.home()} /root /home; true"
        r = await sb.run(["sh", "-c", cmd], timeout=10)
    finally:
        marker.unlink()
    assert b"HOST-HOME-SECRET" not in r.stdout and marker.name.encode() not in r.stdout


async def test_file_size_limit(backend: SandboxBackend):
    """A file cannot grow beyond the file size limit (SIGXFSZ)."""
    spec = SandboxSpec(limits=Limits(max_file_size=2**20))
    async with await backend.create(spec) as s:
        r = await s.run(["sh", "-c", "head -c 3000000 /dev/zero > big"], timeout=10)
        assert r.returncode != 0
        assert s.workspace_host.joinpath("big").stat().st_size <= 2**20


QUOTA = 64 * 2**20


async def test_disk_quota_stops_a_sandbox_within_a_second(backend: SandboxBackend):
    """The total across the writable mounts is limited (``Limits.disk_bytes``): 40 MiB in the
    workspace and 40 MiB in /tmp each fit, together they do not; the sandbox is stopped within
    a second (not at the command's 60 s), the result says how much it held and is no death
    from outside. /dev/shm and home count too; under the quota nothing happens."""
    spec = SandboxSpec(limits=Limits(disk_bytes=QUOTA))
    fill = "head -c 40000000 /dev/zero > {}; sync"
    async with await backend.create(spec) as s:
        r = await s.run(["sh", "-c", f"{fill.format('w1')}; sleep 0.2"], timeout=30)
        assert r.ok and not r.disk_exceeded, r
        t0 = asyncio.get_running_loop().time()
        r = await s.run(["sh", "-c", f"{fill.format('/tmp/t1')}; sleep 60"], timeout=90)
        took = asyncio.get_running_loop().time() - t0
        assert r.disk_exceeded > QUOTA and not r.killed and not r.timed_out, r
        assert r.returncode != 0 and took < 10, (took, r)
    for where in ("/dev/shm/x", "~/x"):  # a fresh sandbox: these count as well
        async with await backend.create(spec) as s:
            r = await s.run(["sh", "-c", f"{fill.format('w1')}; {fill.format(where)}"], timeout=30)
            assert r.disk_exceeded > QUOTA, (where, r)


PROXY_PROBE = """
import os, socket, sys
out = [os.environ.get("HRL_PROXY_URL", "-")]
for family, addr in ((socket.AF_INET, ("127.0.0.1", 18080)), (socket.AF_UNIX, "/run/hrl/proxy.sock")):
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(addr)
        s.sendall(sys.argv[1].encode())
        s.shutdown(socket.SHUT_WR)
        out.append("reached:" + (s.recv(64).decode() or "nothing"))
    except OSError as e:
        out.append(type(e).__name__)
print(" ".join(out))
"""


@pytest.fixture
async def proxies(tmp_path: Path):
    """``proxies(name)``: a unix-socket server standing in for one rollout's proxy; it answers
    its name and records what each connection sent (``.got``)."""
    servers = []

    async def make(name: str) -> Path:
        sock = tmp_path / f"{name}.sock"
        got: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.append(await reader.read())
            writer.write(name.encode())
            await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(answer, path=str(sock))
        server.got = got  # type: ignore[attr-defined]
        servers.append(server)
        return sock

    make.servers = servers  # type: ignore[attr-defined]
    yield make
    for server in servers:
        server.close()


async def test_only_proxy_runs_reach_the_proxy(backend: SandboxBackend, proxies):
    """The harness's run (``proxy`` left on) reaches the rollout's proxy through the forwarder;
    a run with ``proxy=False`` (the verifier, file operations) has no ``$HRL_PROXY_URL``,
    nothing listening on the proxy port and no usable proxy socket; the proxy run after it
    reaches the proxy again."""
    sock = await proxies("proxy")
    (server,) = proxies.servers
    outs = []
    async with await backend.create(SandboxSpec(proxy_socket=sock)) as s:
        for i, proxy in enumerate((True, False, True)):
            r = await s.run(["python3", "-c", PROXY_PROBE, f"run{i}"], timeout=60, proxy=proxy)
            assert r.ok, r
            outs.append(r.stdout.decode().split())
    url = "http://127.0.0.1:18080"
    assert outs[0][:2] == outs[2][:2] == [url, "reached:proxy"], outs
    assert outs[1][:2] == ["-", "ConnectionRefusedError"], outs
    assert not outs[1][2].startswith("reached"), outs  # bwrap: no socket; docker: not its own
    assert b"run1" not in server.got and {b"run0", b"run2"} <= set(server.got)


LEAVE_TRACES = """
echo ws > ws.txt; echo home > ~/home.txt; echo tmp > /tmp/tmp.txt; echo shm > /dev/shm/shm.txt
(setsid sh -c 'sleep 977' </dev/null >/dev/null 2>&1 &)
echo started
"""

LOOK_FOR_TRACES = """
ls -A . ~ /tmp /dev/shm; echo "env=$HRL_FIRST_ROLLOUT"; ps -eo args 2>/dev/null || ls /proc
"""


async def test_next_rollout_sees_nothing_of_the_previous(
    backend: SandboxBackend, tmp_path: Path, proxies
):
    """Sandboxes one after another (from the warm pool where the backend has one): nothing the
    first rollout left — workspace, home, /tmp and /dev/shm files, a detached process, its
    environment, its proxy — is visible to the second (whose forwarder reaches the second's
    proxy only), and the first's state is gone from the host."""
    marker = f"hrl-first-{uuid.uuid4().hex}"
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "task.md").write_text("second task")
    pool = getattr(backend, "pool", None)
    pooled = pool is not None and pool.size > 0

    def from_pool(sb, ready: set[str]) -> bool:
        return sb.state_dir.name.rsplit("-", 1)[1] in ready

    spec = SandboxSpec(
        owner="first", env={"HRL_FIRST_ROLLOUT": marker}, proxy_socket=await proxies("first")
    )
    if pooled:
        if hasattr(backend, "warm"):  # docker: containers of the shape asked for
            await backend.warm(spec)
        await pool.wait_full()
        ready = {b.sid for b in pool._ready}
    first = await backend.create(spec)
    if pooled:
        assert from_pool(first, ready)
    r = await first.run(["sh", "-c", LEAVE_TRACES], timeout=10)
    assert r.ok and r.stdout == b"started\n", r
    r = await first.run(["python3", "-c", PROXY_PROBE, marker], timeout=30)
    assert r.stdout.split()[1] == b"reached:first", r
    first_state = first.state_dir
    await first.destroy()
    if pooled:
        await pool.drain()
        await pool.wait_full()
        assert len(pool) == pool.size and pool.made == pool.size + 1  # refilled after the take
        ready = {b.sid for b in pool._ready}
    spec = SandboxSpec(owner="second", workspace_src=seed, proxy_socket=await proxies("second"))
    async with await backend.create(spec) as second:
        if pooled:
            assert from_pool(second, ready)
        assert second.state_dir != first_state
        r = await second.run(["python3", "-c", PROXY_PROBE, "second"], timeout=30)
        assert r.stdout.split()[1] == b"reached:second", r  # its own proxy, not the first's
        r = await second.run(["sh", "-c", LOOK_FOR_TRACES], timeout=10)
        assert r.ok, r
        seen = r.stdout.decode()
        assert "task.md" in seen and "env=\n" in seen
        for trace in ("ws.txt", "home.txt", "tmp.txt", "shm.txt", "sleep 977", marker):
            assert trace not in seen, (trace, seen)
        with pytest.raises(FileNotFoundError):
            await second.read_file("ws.txt")
    first_server, second_server = proxies.servers
    # (each probe may reach its proxy twice: through the forwarder and by the socket itself)
    assert set(first_server.got) == {marker.encode()}, first_server.got
    assert set(second_server.got) == {b"second"}, second_server.got
    assert not first_state.exists()
    deadline = asyncio.get_running_loop().time() + 3
    while procs_with(marker) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert procs_with(marker) == []
