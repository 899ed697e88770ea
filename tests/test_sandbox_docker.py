"""What only docker sandboxes have: the locked-down container config, a proxy socket bound in
from another filesystem, the pool of started containers of the shape asked for, the container
killed from outside. What every backend holds (commands, files, the proxy forwarder, escapes,
limits, lifecycle, sweeps) is in ``test_sandbox_contract.py``.

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
import time
from pathlib import Path

import pytest

from harnessrl.actors.sandbox import SandboxError, SandboxSpec
from harnessrl.actors.sandbox.base import Limits
from harnessrl.actors.sandbox.docker import LABEL, DockerBackend
from tests.helpers.sandboxes import procs_with, py, sleep_marker
from tests.helpers.wait import until

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(docker_engine: str) -> str:
    """URL of a docker engine with the sandbox image (the session's: tests/conftest.py)."""
    return docker_engine


@pytest.fixture
async def backend(engine: str, tmp_path: Path):
    async with DockerBackend(tmp_path / "sandboxes", docker_url=engine) as be:
        yield be


async def containers(backend: DockerBackend) -> list[str]:
    flt = json.dumps({"label": [f"{LABEL}=docker"]})
    return [
        c["Names"][0].lstrip("/")
        for c in await backend.docker.containers.list(all=True, filters=flt)
    ]


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


# ---------------------------------------------------------------------- proxy forwarder


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


async def test_container_killed_from_outside_is_flagged(backend: DockerBackend):
    """The container killed from outside while a command runs: the command's end says so
    (``killed``) or the run fails as a sandbox error; never a plain exit status."""
    async with await backend.create(SandboxSpec(owner="test")) as s:
        left = sleep_marker()
        run = asyncio.create_task(s.run(["sleep", left], timeout=60))
        await until(lambda: procs_with(f"sleep\0{left}"), 20, "the command to run")
        os.kill(s._init_pid, signal.SIGKILL)  # the container's init: the container stops
        try:
            r = await asyncio.wait_for(run, 30)
        except SandboxError:
            return
        assert r.killed and not r.timed_out, r
