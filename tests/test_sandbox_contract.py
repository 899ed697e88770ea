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

from actors.sandbox import SandboxSpec
from actors.sandbox.base import Limits, Sandbox, SandboxBackend
from tests.conftest import bwrap_or_skip, procs_with

KINDS = ("bwrap", "bwrap_pool", "docker")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """The backend's name, and the docker engine's URL for docker (the session's dockerd is
    started here, outside the test's event loop)."""
    if request.param == "docker":
        return request.param, request.getfixturevalue("docker_engine")
    return request.param, None


@pytest.fixture
async def backend(kind: tuple[str, str | None], tmp_path: Path):
    """Each backend, entered (sweep at start, everything removed at exit)."""
    name, engine = kind
    if name == "docker":
        from actors.sandbox.docker import DockerBackend

        be = DockerBackend(tmp_path / "sandboxes", docker_url=engine)
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


LEAVE_TRACES = """
echo ws > ws.txt; echo home > ~/home.txt; echo tmp > /tmp/tmp.txt; echo shm > /dev/shm/shm.txt
(setsid sh -c 'sleep 977' </dev/null >/dev/null 2>&1 &)
echo started
"""

LOOK_FOR_TRACES = """
ls -A . ~ /tmp /dev/shm; echo "env=$HRL_FIRST_ROLLOUT"; ps -eo args 2>/dev/null || ls /proc
"""


async def test_next_rollout_sees_nothing_of_the_previous(backend: SandboxBackend, tmp_path: Path):
    """Sandboxes one after another (from the warm pool where the backend has one): nothing the
    first rollout left — workspace, home, /tmp and /dev/shm files, a detached process, its
    environment — is visible to the second, and the first's state is gone from the host."""
    marker = f"hrl-first-{uuid.uuid4().hex}"
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "task.md").write_text("second task")
    pool = getattr(backend, "pool", None)
    pooled = pool is not None and pool.size > 0

    def from_pool(sb, ready: set[str]) -> bool:
        return sb.state_dir.name.rsplit("-", 1)[1] in ready

    if pooled:
        await pool.wait_full()
        ready = {b.sid for b in pool._ready}
    first = await backend.create(SandboxSpec(owner="first", env={"HRL_FIRST_ROLLOUT": marker}))
    if pooled:
        assert from_pool(first, ready)
    r = await first.run(["sh", "-c", LEAVE_TRACES], timeout=10)
    assert r.ok and r.stdout == b"started\n", r
    first_state = first.state_dir
    await first.destroy()
    if pooled:
        await pool.drain()
        await pool.wait_full()
        assert len(pool) == pool.size and pool.made == pool.size + 1  # refilled after the take
        ready = {b.sid for b in pool._ready}
    async with await backend.create(SandboxSpec(owner="second", workspace_src=seed)) as second:
        if pooled:
            assert from_pool(second, ready)
        assert second.state_dir != first_state
        r = await second.run(["sh", "-c", LOOK_FOR_TRACES], timeout=10)
        assert r.ok, r
        seen = r.stdout.decode()
        assert "task.md" in seen and "env=\n" in seen
        for trace in ("ws.txt", "home.txt", "tmp.txt", "shm.txt", "977", marker):
            assert trace not in seen, (trace, seen)
        with pytest.raises(FileNotFoundError):
            await second.read_file("ws.txt")
    assert not first_state.exists()
    deadline = asyncio.get_running_loop().time() + 3
    while procs_with(marker) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert procs_with(marker) == []
